"""A real multi-process run under attack: three learner processes on a FileMailbox and a separate
adversary process with write access to the directory but without the run secret.

The learners are deterministic (tests/adversary_learner.py: one round per step, quorum = all,
``overlap_steps=0``), so the parameters of an honest run are a fixed point to compare against:

- with a secret, everything the adversary writes is ignored (forged commits and claims included)
  and the run ends with parameters bit-identical to the run without an adversary;
- without a secret, the bad inputs are rejected with reasons in the round records, junk names are
  reported, and the run completes (the adversary stays off the keys only a secret protects).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from gradientmail_core.mailbox.file import FileMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.auth import RunAuth, Unauthenticated
from gradientmail_core.protocol.guard import GuardedMailbox
from gradientmail_core.protocol.records import Manifest, RoundRecord
from gradientmail_core.protocol.store import RunStore

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
LEARNERS = ("a", "b", "c")
STEPS = 12
SECRET = "adversary-test-secret-0123456789abcdef"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def run(tmp_path: Path, name: str, *, secret: bool, attack: str | None) -> dict:
    base = tmp_path / name
    root = base / "mailbox"
    root.mkdir(parents=True)
    extra: list[str] = []
    if secret:
        (base / "run.key").write_text(SECRET + "\n")
        extra = ["--secret-file", str(base / "run.key")]
    stop = base / "stop"
    attacker = None
    if attack:
        attacker = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "adversary_attacker.py"),
                "--mailbox",
                str(root),
                "--mode",
                attack,
                "--stop",
                str(stop),
                "--log",
                str(base / "attacker.log"),
            ],
            env=_env(),
            stderr=open(base / "attacker.err", "wb"),
        )  # noqa: SIM115
    procs = {}
    for lr in LEARNERS:
        log = open(base / f"log-{lr}.txt", "wb")  # noqa: SIM115 - the child holds it
        procs[lr] = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "adversary_learner.py"),
                "--mailbox",
                str(root),
                "--learner-id",
                lr,
                "--steps",
                str(STEPS),
                "--out",
                str(base / lr),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
    try:
        for lr, p in procs.items():
            assert p.wait(timeout=240) == 0, (base / f"log-{lr}.txt").read_text()[-4000:]
    finally:
        stop.touch()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        if attacker is not None:
            attacker.wait(timeout=60)
    out: dict = {"root": root, "params": {}, "events": {}}
    for lr in LEARNERS:
        with np.load(base / f"{lr}.npz", allow_pickle=False) as z:
            out["params"][lr] = {k: z[k] for k in z.files}
        rows = (base / f"{lr}.events.jsonl").read_text().splitlines()
        out["events"][lr] = [json.loads(x) for x in rows if x.strip()]
    if attacker is not None:
        out["attacker"] = json.loads((base / "attacker.log").read_text().splitlines()[-1])
    out["tape"] = tape(root, SECRET if secret else None)
    return out


def tape(root: Path, secret: str | None) -> list[RoundRecord]:
    """The committed records, read the way a node reads them (authenticated when secret)."""
    auth = Unauthenticated() if secret is None else RunAuth(secret.encode())
    store = RunStore(GuardedMailbox(FileMailbox(root), auth=auth), auth=auth)
    store.read_record(keys.MANIFEST, Manifest)
    recs = []
    for k in store.mailbox.list(keys.ROUNDS):
        r = keys.parse_round_key(k)
        if r is not None and r == len(recs):  # the contiguous tape; junk past a gap is no commit
            rec = store.read_record(k, RoundRecord)
            assert rec is not None and rec.round == r
            recs.append(rec)
    return recs


def same(p: dict[str, np.ndarray], q: dict[str, np.ndarray]) -> bool:
    return p.keys() == q.keys() and all(np.array_equal(p[k], q[k]) for k in p)


def events(out: dict, kind: str) -> list[dict]:
    return [e for lr in LEARNERS for e in out["events"][lr] if e["event"] == kind]


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> dict:
    return run(tmp_path_factory.mktemp("honest"), "honest", secret=False, attack=None)


def test_honest_run_is_deterministic_and_complete(honest):
    assert [r.round for r in honest["tape"]] == list(range(STEPS))
    assert all(sorted(p.learner for p in r.participants) == list(LEARNERS) for r in honest["tape"])
    first = honest["params"]["a"]
    assert all(same(first, honest["params"][lr]) for lr in LEARNERS)
    assert not events(honest, "ContributionRejected") and not events(honest, "IgnoredObject")


def test_with_a_secret_the_adversary_changes_nothing(tmp_path, honest):
    out = run(tmp_path, "auth", secret=True, attack="auth")
    assert out["attacker"]["written"] > 100
    for lr in LEARNERS:  # bit-identical to the run without an adversary
        assert same(out["params"][lr], honest["params"]["a"]), lr
    recs = out["tape"]
    assert [r.round for r in recs] == list(range(STEPS))
    assert all(sorted(p.learner for p in r.participants) == list(LEARNERS) and not r.rejected for r in recs)
    assert all(r.closer in LEARNERS for r in recs)
    ignored = events(out, "IgnoredObject")
    reasons = Counter(e["reason"].split(":")[0] for e in ignored)
    # forged commit points, claims, leases and snapshots were all seen and ignored by name
    seen = {e["key"].split("/")[0] for e in ignored}
    assert {"rounds", "claims", "snapshots", "leases"} <= seen, reasons
    assert not events(out, "BackgroundFailed")
    assert not events(out, "ContributionRejected")


def test_without_a_secret_bad_input_is_rejected_with_reasons_and_the_run_completes(tmp_path, honest):
    out = run(tmp_path, "noauth", secret=False, attack="noauth")
    assert out["attacker"]["written"] > 50
    recs = out["tape"]
    assert [r.round for r in recs] == list(range(STEPS)), [
        (
            r.round,
            r.closer,
            sorted(p.learner for p in r.participants),
            sorted((x.learner, x.reason) for x in r.rejected),
        )
        for r in recs
    ]
    assert all(sorted(p.learner for p in r.participants) == list(LEARNERS) for r in recs), [
        (
            r.round,
            r.closer,
            sorted(p.learner for p in r.participants),
            sorted((x.learner, x.reason) for x in r.rejected),
        )
        for r in recs
    ]
    reasons = {(x.learner, x.reason) for r in recs for x in r.rejected}
    by_learner = dict(reasons)
    expected = {
        "evil-nan": "nonfinite",
        "evil-inf": "nonfinite",
        "evil-trunc": "corrupt",
        "evil-huge": "corrupt",
        "evil-bigpay": "corrupt",
        "evil-big": "corrupt",
        "evil-json": "corrupt",
        "evil-deep": "corrupt",
        "evil-stale": "stale",
        "evil-schema": "schema",
        "evil-zero": "zero_steps",
        "evil-missing": "missing",
        "evil-other": "corrupt",
        "evil-dotdot": "corrupt",
        "manifest": "corrupt",
    }
    assert {k: by_learner.get(k) for k in expected} == expected
    assert not events(out, "BackgroundFailed")
    rejected = events(out, "ContributionRejected")
    assert {e["contributor"] for e in rejected} >= set(expected)
    junk = {e["key"].rsplit("/", 1)[-1] for e in events(out, "IgnoredObject")}
    assert {"..evil.json", "a.json.tmp", "-x.json", "A.json", "evil.json"} <= junk, junk
    # the honest contributions were never touched, so the result is the honest one too
    for lr in LEARNERS:
        assert same(out["params"][lr], honest["params"]["a"]), lr


# ---- members-only runs: a member revoked mid-run keeps writing ----------------------------------

REVOKE_AFTER = 2
MEMBER_STEPS = 24


def _cli(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "gradientmail_core.cli", *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=HERE.parent,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _wait_for(path: Path, procs: dict, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        for lr, p in procs.items():
            assert p.poll() is None, f"learner {lr} exited early"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_a_revoked_member_that_keeps_writing_is_ignored_and_the_others_agree(tmp_path):
    from gradientmail_core.protocol.identity import Identity
    from gradientmail_core.protocol.members import MemberAuth, change
    from gradientmail_core.protocol.records import decode

    root = tmp_path / "mailbox"
    root.mkdir()
    url = f"file://{root}"
    names = ("a", "b", "c", "k")
    key_files = {n: tmp_path / f"{n}.key" for n in names}
    pubs = {n: _cli("members", "key", "--identity", str(key_files[n])).strip() for n in names}
    ident = {n: Identity.load(key_files[n]) for n in names}
    assert all(ident[n].public_hex == pubs[n] for n in names)
    procs: dict[str, subprocess.Popen] = {}

    def start(n: str, *extra: str) -> None:
        log = open(tmp_path / f"log-{n}.txt", "wb")  # noqa: SIM115 - the child holds it
        procs[n] = subprocess.Popen(
            [sys.executable, str(HERE / "adversary_learner.py"), "--mailbox", str(root), "--learner-id", n,
             "--steps", str(MEMBER_STEPS), "--learners", "4", "--out", str(tmp_path / n),
             "--identity", str(key_files[n]), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=_env(),
        )  # fmt: skip

    try:
        start("a")  # creates the run, and owns it (its identity signs the membership log)
        _wait_for(root / keys.MANIFEST, procs)
        _cli("members", "add", url, "--owner-key", str(key_files["a"]), pubs["b"], pubs["c"], pubs["k"])
        start("b")
        start("c")
        start("k", "--ignore-revocation")  # keeps writing after its revocation, believing it is a member
        _wait_for(root / keys.round_key(REVOKE_AFTER), procs)
        # in this process (what `gradientmail members remove` does, without its start-up time)
        mb = FileMailbox(root)
        change(mb, decode(mb.get(keys.MANIFEST), Manifest), ident["a"], remove=[pubs["k"]])
        for n in "abc":
            assert procs[n].wait(timeout=240) == 0, (tmp_path / f"log-{n}.txt").read_text()[-4000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    listing = _cli("members", "list", url)
    assert f"revoked (1): {ident['k'].fingerprint}" in listing, listing

    params = {}
    for n in "abc":
        with np.load(tmp_path / f"{n}.npz", allow_pickle=False) as z:
            params[n] = {k: z[k] for k in z.files}
    assert same(params["a"], params["b"]) and same(params["a"], params["c"])  # the honest ones agree

    auth = MemberAuth()
    store = RunStore(GuardedMailbox(FileMailbox(root), auth=auth), auth=auth)
    store.read_record(keys.MANIFEST, Manifest)
    recs = []
    for key in store.keys(keys.ROUNDS):
        rec = store.read_record(key, RoundRecord)
        assert rec is not None and rec.round == len(recs)
        recs.append(rec)
    assert len(recs) == MEMBER_STEPS
    k = ident["k"].learner_id("k")
    adopted = next(i for i, r in enumerate(recs) if r.members is not None and int(r.members[:10]) >= 2)
    assert any(k in {p.learner for p in r.participants} for r in recs[:adopted])  # a member until revoked
    assert all(k not in {p.learner for p in r.participants} for r in recs[adopted:])
    assert all(r.closer != k for r in recs[adopted:])
    rows = [json.loads(x) for n in "abc" for x in (tmp_path / f"{n}.events.jsonl").read_text().splitlines() if x]
    assert not [e for e in rows if e["event"] == "BackgroundFailed"]
    revoked = [e for e in rows if e["event"] == "IgnoredObject" and "revoked" in e["reason"]]
    assert {e["key"].split("/")[0] for e in revoked} >= {"leases"}, revoked[:5]
    # it kept writing: snapshots for rounds past the one that adopted its revocation
    k_rows = [json.loads(x) for x in (tmp_path / "k.events.jsonl").read_text().splitlines() if x]
    assert any(e["event"] == "Published" and e["round"] >= adopted for e in k_rows)
