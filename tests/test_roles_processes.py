"""Node roles end to end, as processes over a FileMailbox: a syncer started with the command
(``gradientmail syncer``) closes every round of two learner-only processes; killed, the run
stalls and says so (the learners' ``NoCloser``, ``gradientmail status``); restarted, it resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from nodes import wait_until

import gradientmail_core as gm
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import RoundRecord, decode

pytestmark = pytest.mark.timeout(600)

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
LEASE_TIMEOUT = "3"
STEPS, SYNC_EVERY, FRAGMENTS = 120, 10, 2
ROUNDS = STEPS // SYNC_EVERY * FRAGMENTS


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


class Proc:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log_path = log
        self.log = open(log, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=_env())

    def wait(self, timeout: float = 400) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self, sig: int) -> None:
        self.proc.send_signal(sig)


def syncer(tmp_path: Path, url: str, n: int) -> Proc:
    argv = [sys.executable, "-m", "gradientmail_core.cli", "syncer", url, "--id", "sync"]
    argv += ["--poll-interval", "0.05", "--lease-timeout", LEASE_TIMEOUT, "--round-timeout", "2"]
    return Proc(argv, tmp_path / f"syncer-{n}.log")


def learner(tmp_path: Path, url: str, name: str) -> Proc:
    argv = [sys.executable, str(TESTS / "role_learner.py"), "--mailbox", url, "--id", name, "--role", "learner"]
    argv += ["--steps", str(STEPS), "--sync-every", str(SYNC_EVERY), "--fragments", str(FRAGMENTS)]
    argv += ["--quorum", "2", "--overlap-steps", "5", "--wait-for", "2", "--step-sleep", "0.01"]
    argv += ["--lease-timeout", LEASE_TIMEOUT, "--out", str(tmp_path / f"out-{name}")]
    argv += ["--events", str(tmp_path / f"events-{name}.jsonl")]
    return Proc(argv, tmp_path / f"log-{name}.txt")


def events(tmp_path: Path, name: str, kinds: tuple[str, ...]) -> list[dict]:
    path = tmp_path / f"events-{name}.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["event"] in kinds]


def waiting_now(tmp_path: Path, name: str) -> bool:
    """The learner's newest closer event says the run waits (NoCloser after any CloserBack)."""
    seen = events(tmp_path, name, ("NoCloser", "CloserBack"))
    return bool(seen) and seen[-1]["event"] == "NoCloser"


def tape(mailbox: gm.Mailbox) -> list[RoundRecord]:
    recs = [decode(mailbox.get(k), RoundRecord, key=k) for k in mailbox.list(keys.ROUNDS)]
    assert [r.round for r in recs] == list(range(len(recs))), "the tape has a gap"
    return recs


def status(url: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "gradientmail_core.cli", "status", url],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return " ".join(out.stdout.split())  # rich wraps long lines


def test_a_syncer_command_closes_every_round_of_learner_only_processes_stalls_when_killed_and_resumes(tmp_path):
    url = f"file://{tmp_path / 'mailbox'}"
    s1 = syncer(tmp_path, url, 1)
    # It never creates the run: it waits for one, and says so.
    wait_until(lambda: "waiting for a learner to create it" in s1.output(), timeout=120, what="the syncer to wait")
    mb = gm.open_mailbox(url)
    assert mb.get(keys.MANIFEST) is None
    a, b = learner(tmp_path, url, "a"), learner(tmp_path, url, "b")
    wait_until(lambda: len(mb.list(keys.ROUNDS)) >= 4, timeout=300, what="four commits")
    assert {r.closer for r in tape(mb)} == {"sync"}
    assert "round 0  fragment 0" in s1.output()  # the live line per round

    s1.kill(signal.SIGKILL)
    s1.wait()
    head = len(mb.list(keys.ROUNDS))
    # The run stalls and says so: each learner-only node reports that no node may close rounds...
    for name in "ab":
        wait_until(lambda name=name: waiting_now(tmp_path, name), timeout=120, what=f"NoCloser from {name}")
        assert "NoCloser" in (tmp_path / f"log-{name}.txt").read_text()  # in its log, too
    # ...and `gradientmail status` shows it, from the learners' leases.
    line = "the run is waiting: no node that may close rounds is live (seen by a, b)"
    wait_until(lambda: line in status(url), timeout=120, what="the waiting line in gradientmail status")
    assert f"start one with `gradientmail syncer {url} --id NAME`" in status(url)
    # (a round the syncer was writing when it was killed may still land; nothing after it)
    assert len(mb.list(keys.ROUNDS)) <= head + 1
    assert a.proc.poll() is None and b.proc.poll() is None  # waiting, not gone
    for name in "ab":  # the learners never claimed anything
        assert not events(tmp_path, name, ("RoundClaimed", "TookOver"))

    s2 = syncer(tmp_path, url, 2)  # the same id: it takes its dead predecessor's lease and claim over
    assert a.wait() == 0, a.output()[-3000:]
    assert b.wait() == 0, b.output()[-3000:]
    recs = tape(mb)
    assert len(recs) == ROUNDS > head + 1
    assert {r.closer for r in recs} == {"sync"}
    for name in "ab":
        back = events(tmp_path, name, ("CloserBack",))
        assert back and back[-1]["who"] == "sync"
    with np.load(tmp_path / "out-a.npz") as pa, np.load(tmp_path / "out-b.npz") as pb:
        assert sorted(pa.files) == sorted(pb.files)
        for n in pa.files:
            assert pa[n].tobytes() == pb[n].tobytes(), f"{n} differs"
    assert line not in status(url)

    s2.kill(signal.SIGTERM)
    assert s2.wait(timeout=120) == 0, s2.output()[-3000:]
    assert "left the run" in s2.output()
    assert mb.list(keys.LEASES) == []  # every node released its lease
