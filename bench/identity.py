"""What signatures cost in a members-only run: records verified per second, and the share of a
round's CPU that verification takes on the closer.

1. Per record (one thread): Ed25519 signing and verifying alone, then what a node does per record
   it reads: decode the JSON and ``MemberAuth.verify`` it (the signature, the learner's
   fingerprint, the membership), for a snapshot, a lease and a round record.
2. Per round, on the closer: the closing work of a round of ``contributions`` F32 snapshots of one
   fragment of ``params`` (judging each snapshot: fetch, sha256, decode, norms; then
   ``Collector.commit``: ``merge_commit``'s merge, outer step, payloads; then the record), on a ``MemoryMailbox``, in CPU
   seconds (``time.process_time``: both threads of the merge count). Against it, what a
   members-only run adds on the closer per round: verifying each contribution's snapshot record,
   one lease per other learner (an upper bound: leases renew every ``lease_timeout / 4``, rounds
   are usually faster), the claim and the previous round's record, and signing the claim and the
   round record. The share is that added CPU over the round's CPU with it.

    python bench/identity.py                              # 1M and 10M params x 4, 16, 64 contributions
    python bench/identity.py --params 1e6 --contributions 8
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.adapters.base import NumpyAdapter  # noqa: E402
from gradientmail_core.codec.payload import encode_payload  # noqa: E402
from gradientmail_core.mailbox.memory import MemoryMailbox  # noqa: E402
from gradientmail_core.protocol import identity as ids  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.protocol.guard import GuardedMailbox  # noqa: E402
from gradientmail_core.protocol.members import MemberAuth, change  # noqa: E402
from gradientmail_core.protocol.records import (  # noqa: E402
    Lease,
    Manifest,
    Participant,
    PayloadRef,
    RoundRecord,
    Snapshot,
    decode,
    encode,
)
from gradientmail_core.protocol.run import open_run  # noqa: E402
from gradientmail_core.protocol.store import RunStore  # noqa: E402
from gradientmail_core.syncer.collector import Collector  # noqa: E402
from gradientmail_core.syncer.merger import FragmentMerger  # noqa: E402
from gradientmail_core.syncer.timing import Estimates  # noqa: E402

TENSOR = 1 << 20
SHA = "ab" * 32


def per_second(fn, *, seconds: float = 0.5) -> float:
    """Calls of ``fn`` per CPU second (best of three runs of about ``seconds``)."""
    best = 0.0
    for _ in range(3):
        n, t0 = 0, time.process_time()
        while (dt := time.process_time() - t0) < seconds:
            for _ in range(50):
                fn()
            n += 50
        best = max(best, n / dt)
    return best


def members_policy(n_members: int) -> tuple[MemberAuth, list[ids.Identity], Manifest]:
    """A members-only run's policy (the closer's), bound to a run with ``n_members`` members."""
    members = [ids.Identity.from_seed(i.to_bytes(32, "big")) for i in range(1, n_members + 1)]
    mb = MemoryMailbox()
    pol = MemberAuth(identity=members[0])
    GuardedMailbox(mb, auth=pol)
    manifest = pol.sign(
        Manifest(
            run_id="0123456789abcdef",
            created_by=members[0].learner_id("n0"),
            schema=[],
            schema_digest=SHA,
            fragments=[[]],
        )  # fmt: skip
    )
    change(mb, manifest, members[0], add=[m.public_hex for m in members[1:]])
    pol.refresh()
    return pol, members, manifest


def per_record(n_members: int) -> dict[str, float]:
    pol, members, _ = members_policy(n_members)
    them = members[-1]
    signer = MemberAuth(identity=them)
    signer.run_id, signer.membership = pol.run_id, pol.membership
    name = them.learner_id("x")
    ref = PayloadRef(key=keys.snapshot_blob_key(7, name, SHA), sha256=SHA, size=1 << 20)
    snap = signer.sign(Snapshot(learner=name, round=7, local_step=70, steps=10, tokens=640, base_version=3,
                                step_seconds=0.1, schema_digest=SHA, payload=ref, nonce="0123abcd"))  # fmt: skip
    lease = signer.sign(Lease(learner=name, nonce="0123abcd", seq=9, local_step=70, tokens=640))
    parts = [Participant(learner=m.learner_id(f"n{i}"), weight=1.0, steps=10, tokens=640, payload_sha256=SHA)
             for i, m in enumerate(members[:16])]  # fmt: skip
    rec = signer.sign(RoundRecord(round=7, step=80, fragment=1, version=4, closer=name, participants=parts,
                                  theta=ref, theta_digest=SHA, outer=ref, change=ref))  # fmt: skip
    msg = b"x" * 600
    sig = them.sign(msg)
    out = {
        "sign": per_second(lambda: them.sign(msg)),
        "verify": per_second(lambda: ids.verify(them.public_hex, sig, msg)),
    }
    for what, r, cls in (("snapshot", snap, Snapshot), ("lease", lease, Lease), ("round", rec, RoundRecord)):
        data, key = encode(r), (keys.snapshot_key(7, name) if cls is Snapshot else None)
        key = key or (keys.lease_key(name, 9) if cls is Lease else keys.round_key(7))

        def read(data=data, key=key, cls=cls) -> None:
            pol._tape.clear()
            pol.verify(decode(data, cls, key=key), key)

        out[f"{what}_verified"] = per_second(read)
        out[f"{what}_decoded"] = per_second(lambda data=data, key=key, cls=cls: decode(data, cls, key=key))
    return out


def model(n_params: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    sizes = [TENSOR] * (n_params // TENSOR) + ([n_params % TENSOR] if n_params % TENSOR else [])
    return {f"layers.{i}.w": (0.02 * rng.standard_normal(s, dtype=np.float32)) for i, s in enumerate(sizes)}


def round_cpu(n_params: int, n_contrib: int) -> float:
    """CPU seconds of one round's closing work (judge every snapshot, compute and write the commit)
    in an open run: the work a members-only run adds verification to."""
    params = model(n_params)
    cfg = gm.DiLoCo(sync_every=n_contrib, fragments=1, quorum_size=n_contrib)
    store = RunStore(MemoryMailbox())
    adapter = NumpyAdapter(params)
    run, _ = open_run(
        store, adapter.schema(), adapter.read, cfg, learner="closer", compression="", rng=random.Random(0)
    )
    for i in range(n_contrib):
        rng = np.random.default_rng(1 + i)
        delta = {n: (1e-3 * rng.standard_normal(p.shape, dtype=np.float32)) for n, p in params.items()}
        learner = f"l{i:03d}"
        ref = store.put_payload(lambda sha, lr=learner: keys.snapshot_blob_key(0, lr, sha, ""),
                                encode_payload(delta, "F32", kind="delta"))  # fmt: skip
        store.put_record(keys.snapshot_key(0, learner), Snapshot(
            learner=learner, round=0, local_step=n_contrib, steps=n_contrib, tokens=64 * n_contrib, base_version=0,
            step_seconds=0.1, schema_digest=run.digest, payload=ref, nonce="0123abcd"))  # fmt: skip
    t0 = time.process_time()
    merger = FragmentMerger.one_process(run, store)
    c = Collector(0, run, merger.load(0, 0, run.manifest.init[0], None, params), 0.0, Estimates(), merger)
    for i in range(n_contrib):
        assert c.judge_snapshot(store, f"l{i:03d}").reason is None
    c.update(set(c.judged), 1.0)  # (every live learner reported: closes now)
    commit = c.commit(compression="", write=store.put_blob)
    store.put_record(keys.round_key(0), c.record(commit, closer="closer", live=n_contrib, now=1.0, sync_seconds=None))
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, nargs="*", default=[1e6, 10e6])
    ap.add_argument("--contributions", type=int, nargs="*", default=[4, 16, 64])
    a = ap.parse_args()
    print(f"cpu: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; cryptography {_version()}")
    rates = per_record(max(a.contributions) + 1)
    print("\nper record, one thread (per CPU second):")
    print(f"  Ed25519 sign {rates['sign']:>9,.0f}/s   verify {rates['verify']:>9,.0f}/s")
    for what in ("snapshot", "lease", "round"):
        v, d = rates[f"{what}_verified"], rates[f"{what}_decoded"]
        print(f"  {what:<8} decoded {d:>9,.0f}/s   decoded + verified {v:>9,.0f}/s")
    cost = {w: 1 / rates[f"{w}_verified"] - 1 / rates[f"{w}_decoded"] for w in ("snapshot", "lease", "round")}
    print("\nper round on the closer (CPU seconds):")
    print(f"  {'params':>8} {'contrib':>7} {'closing':>9} {'verify':>9} {'share':>7}")
    for p in a.params:
        for c in a.contributions:
            close = statistics.median(round_cpu(int(p), c) for _ in range(3))
            # c snapshots and up to c leases verified, the claim and the previous record read,
            # the claim and the round record signed
            extra = c * cost["snapshot"] + c * cost["lease"] + cost["lease"] + cost["round"] + 2 / rates["sign"]
            print(f"  {p / 1e6:>7.0f}M {c:>7} {close:>9.4f} {extra:>9.5f} {extra / (close + extra):>7.2%}")


def _version() -> str:
    import cryptography

    return cryptography.__version__


if __name__ == "__main__":
    main()
