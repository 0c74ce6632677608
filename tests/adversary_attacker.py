"""A hostile party with write access to a FileMailbox directory but without the run secret.

Started beside the learners by tests/test_adversary_processes.py. It watches the tape and, for
each of the next few rounds, writes straight into the directory (bypassing the mailbox API,
which refuses some of these names):

- bad contributions under its own learner ids, one per rejection reason: NaN, Inf, truncated
  payload, declared size far above the cap, oversized record, malformed JSON, stale base
  version, wrong schema digest, zero steps, missing payload, a ref into another learner's
  folder, a ref with '..', a manifest-shaped object;
- junk names: '..'-prefixed, spaces, non-ASCII, a symlink to /dev/zero, ``.tmp`` suffixes;
- with ``--mode auth`` also what only a secret protects against: forged round records and
  claims at the next commit points (plain and with made-up tags), forged leases, well-formed
  contributions that would be accepted in an unauthenticated run, snapshots at the honest
  learners' plain keys, honest snapshots replayed into later rounds, a directory squatting a
  future commit key.

    python tests/adversary_attacker.py --mailbox DIR --mode auth|noauth --stop STOPFILE --log LOG
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradientmail_core.codec.header import sha256_hex  # noqa: E402
from gradientmail_core.codec.payload import encode_payload  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.protocol.records import (  # noqa: E402
    Claim,
    Lease,
    Manifest,
    Participant,
    PayloadRef,
    RoundRecord,
    Snapshot,
    canonical_json,
    decode,
    to_dict,
)
from gradientmail_core.protocol.schedule import version_before  # noqa: E402

HONEST = ("a", "b", "c")
_ROUND_NAME = re.compile(r"(\d{10})(?:\.[0-9a-f]{32})?\.json")


class Attacker:
    def __init__(self, root: Path, mode: str, log) -> None:
        self.root, self.mode, self.log = root, mode, log
        self.written = 0
        self.mine: set[str] = set()  # what we wrote, so that head() follows the real tape only
        self.manifest: Manifest | None = None

    # ---- raw filesystem writes (create-once, like a bucket) ----------------------------

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "xb") as f:
                f.write(data)
            self.written += 1
            self.mine.add(key)
        except OSError as e:  # taken already, or a name the filesystem refuses
            self.log.write(f"skip {key!r}: {e}\n")

    def record(self, key: str, rec) -> None:
        self.put(key, canonical_json(to_dict(rec)))

    # ---- what the attacker can learn by reading --------------------------------------

    def load_manifest(self) -> bool:
        try:
            data = (self.root / keys.MANIFEST).read_bytes()
            self.manifest = decode(data, Manifest, key=keys.MANIFEST)
        except (OSError, ValueError):
            return False
        return True

    def lease_holders(self) -> set[str]:
        """The learners holding a lease now (leases/<learner>/<seq>.json)."""
        try:
            return {d.name for d in (self.root / keys.LEASES).iterdir() if any(d.iterdir())}
        except OSError:
            return set()

    def head(self) -> int:
        try:
            names = os.listdir(self.root / "rounds")
        except OSError:
            return -1
        rounds = {int(m[1]) for n in names if (m := _ROUND_NAME.fullmatch(n)) and f"{keys.ROUNDS}{n}" not in self.mine}
        head = -1
        while head + 1 in rounds:  # the contiguous tape, not the junk we wrote past it
            head += 1
        return head

    def fragment(self, r: int) -> dict[str, tuple[int, ...]]:
        m = self.manifest
        assert m is not None
        shapes = {s.name: tuple(s.shape) for s in m.schema}
        return {n: shapes[n] for n in m.fragments[r % len(m.fragments)]}

    # ---- contributions ------------------------------------------------------------------

    def payload(self, r: int, learner: str, fill: float | None = None, scale: float = 1.0) -> tuple[PayloadRef, bytes]:
        rng = np.random.default_rng(r)
        values = {n: (scale * rng.standard_normal(s)).astype(np.float32) for n, s in self.fragment(r).items()}
        if fill is not None:
            for v in values.values():
                v.reshape(-1)[0] = fill
        data = encode_payload(values, "F32", kind="delta")
        key = keys.snapshot_blob_key(r, learner, sha256_hex(data))
        return PayloadRef(key=key, sha256=sha256_hex(data), size=len(data)), data

    def snapshot(self, r: int, learner: str, ref: PayloadRef, **kw) -> Snapshot:
        assert self.manifest is not None
        fields = dict(
            learner=learner,
            round=r,
            local_step=r + 1,
            steps=2,
            tokens=32,
            base_version=version_before(r, len(self.manifest.fragments)),
            step_seconds=0.01,
            schema_digest=self.manifest.schema_digest,
            payload=ref,
        )
        fields.update(kw)
        return Snapshot(**fields)

    def contribute(
        self,
        r: int,
        learner: str,
        *,
        key: str | None = None,
        data: bytes | None = None,
        ref: PayloadRef | None = None,
        **kw,
    ) -> None:
        if ref is None:
            ref, blob = self.payload(r, learner)
            self.put(ref.key, blob if data is None else data)
        self.record(key or keys.snapshot_key(r, learner), self.snapshot(r, learner, ref, **kw))

    def bad_contributions(self, r: int) -> None:
        ref, data = self.payload(r, "evil-nan", fill=float("nan"))
        self.put(ref.key, data)
        self.record(keys.snapshot_key(r, "evil-nan"), self.snapshot(r, "evil-nan", ref))
        ref, data = self.payload(r, "evil-inf", fill=float("inf"))
        self.put(ref.key, data)
        self.record(keys.snapshot_key(r, "evil-inf"), self.snapshot(r, "evil-inf", ref))
        ref, data = self.payload(r, "evil-trunc")
        self.contribute(r, "evil-trunc", ref=ref)
        self.put(ref.key, data[: len(data) // 2])
        ref, _ = self.payload(r, "evil-huge")
        self.contribute(r, "evil-huge", ref=dataclasses.replace(ref, size=10**15))
        if r % 3 == 0:  # objects far above their caps: a 3 MiB record and a 3 MiB payload
            self.put(keys.snapshot_key(r, "evil-big"), b'{"format":1,"pad":"' + b"x" * (3 << 20) + b'"}')
            big = np.random.default_rng(r).bytes(3 << 20)
            big_ref = PayloadRef(
                key=keys.snapshot_blob_key(r, "evil-bigpay", sha256_hex(big)), sha256=sha256_hex(big), size=len(big)
            )
            self.contribute(r, "evil-bigpay", ref=big_ref)
            self.put(big_ref.key, big)
        self.put(keys.snapshot_key(r, "evil-json"), b'{"format":1,"learner":"evil-json",')
        self.put(keys.snapshot_key(r, "evil-deep"), b"[" * 100_000 + b"]" * 100_000)
        self.contribute(r, "evil-stale", base_version=version_before(r, 2) + 7)
        self.contribute(r, "evil-schema", schema_digest="0" * 64)
        self.contribute(r, "evil-zero", steps=0)
        ref, _ = self.payload(r, "evil-missing")
        self.contribute(r, "evil-missing", ref=ref)  # payload never written
        ref, data = self.payload(r, "a")  # a ref into learner a's payload folder
        self.put(ref.key, data)
        self.contribute(r, "evil-other", ref=ref)
        dotdot = {"key": f"blobs/snapshots/{r:010d}/../../../manifest.json", "sha256": "0" * 64, "size": 10}
        raw = to_dict(self.snapshot(r, "evil-dotdot", ref))
        raw["payload"] = dotdot
        self.put(keys.snapshot_key(r, "evil-dotdot"), canonical_json(raw))
        self.put(keys.snapshot_key(r, "manifest"), (self.root / keys.MANIFEST).read_bytes())
        # junk names, and round keys no commit can reach (past a gap in the tape)
        self.put(keys.round_key(r + 1000), b"junk")
        self.put(f"{keys.ROUNDS}evil.json", b"junk")
        for name in ("..evil.json", "a b.json", "\u00fc.json", "a.json.tmp", "-x.json", "A.json"):
            self.put(f"{keys.snapshots_prefix(r)}{name}", b"junk")
        link = self.root / keys.snapshots_prefix(r) / "evil-link.json"
        try:
            link.symlink_to("/dev/zero")
        except OSError:
            pass

    def forgeries(self, r: int) -> None:
        """What an unauthenticated run cannot tell from honest objects; only with --mode auth."""
        assert self.manifest is not None
        P = len(self.manifest.fragments)
        ref, data = self.payload(r, "mallory", scale=1e3)
        self.put(ref.key, data)
        theta_ref, theta = self.payload(r, "mallory", fill=float("nan"))
        self.put(theta_ref.key, theta)
        rec = RoundRecord(
            round=r,
            step=r + 1,
            fragment=r % P,
            version=r // P + 1,
            closer="mallory",
            participants=[Participant(learner="mallory", weight=1.0, steps=2, tokens=32, payload_sha256=ref.sha256)],
            theta=theta_ref,
            outer=theta_ref,
            mac="f" * 64,
        )
        tag = secrets.token_hex(16)
        for key in (keys.round_key(r), keys.tag_key(keys.round_key(r), tag)):
            self.record(key, rec)
        claim = Claim(round=r, n=1, learner="mallory", nonce="deadbeef")
        for key in (keys.claim_key(r, 1), keys.tag_key(keys.claim_key(r, 1), tag), keys.claim_key(r, 2)):
            self.record(key, claim)
        self.record(
            keys.lease_key("mallory", r), Lease(learner="mallory", nonce="deadbeef", seq=r, local_step=r, tokens=0)
        )
        # accepted as-is by an unauthenticated run (finite, well-formed, right base version)
        self.contribute(r, "mallory", ref=ref)
        self.contribute(r, "mallory", ref=ref, key=keys.tag_key(keys.snapshot_key(r, "mallory"), tag))
        for h in HONEST:  # take the honest learners' plain keys first
            self.contribute(r, h, ref=ref)
        (self.root / keys.round_key(r + 100)).mkdir(parents=True, exist_ok=True)  # a directory at a commit key
        self.put(keys.round_key(r + 100) + "/x", b"junk")

    def replays(self, r: int) -> None:
        """Honest snapshot files of earlier rounds copied into round ``r`` (name and all)."""
        for prev in (r - 1, r - 2):
            folder = self.root / keys.snapshots_prefix(prev) if prev >= 0 else None
            for src in folder.glob("[abc].*.json") if folder and folder.is_dir() else ():
                dst = self.root / keys.snapshots_prefix(r) / src.name
                try:
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)
                    self.written += 1
                except OSError:
                    pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mailbox", required=True)
    p.add_argument("--mode", choices=("auth", "noauth"), required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--rounds", type=int, default=16, help="rounds attacked up front, before they open")
    p.add_argument("--learners", type=int, default=3, help="attack once this many learners hold leases")
    a = p.parse_args(argv)
    root, stop = Path(a.mailbox), Path(a.stop)
    with open(a.log, "w") as log:
        attacker = Attacker(root, a.mode, log)
        while not stop.exists() and not attacker.load_manifest():
            time.sleep(0.02)
        # Once the learners hold their leases: the names it contributes under would otherwise count
        # in their ``wait_for`` as learners seen contributing (a learner that came and went between
        # two lease listings counts so), and the honest learners would not start together.
        while not stop.exists() and len(attacker.lease_holders()) < a.learners:
            time.sleep(0.02)
        for r in range(a.rounds):
            attacker.bad_contributions(r)
            if a.mode == "auth":
                attacker.forgeries(r)
        replayed: set[int] = set()
        while not stop.exists():
            head = attacker.head()
            for r in (head + 1, head + 2):
                if a.mode == "auth" and head >= 0 and r not in replayed:
                    replayed.add(r)
                    attacker.replays(r)
            time.sleep(0.01)
        log.write(json.dumps({"rounds": a.rounds, "replayed": sorted(replayed), "written": attacker.written}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
