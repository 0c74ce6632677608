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
    assert [r.round for r in recs] == list(range(STEPS))
    assert all(sorted(p.learner for p in r.participants) == list(LEARNERS) for r in recs)
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
