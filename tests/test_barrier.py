"""``gm.Barrier``: parties in separate processes, over a directory and over S3 (moto's HTTP
server), released by one outcome key; reused by name; a timeout names who had not arrived."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gradientmail_core as gm
from gradientmail_core.barrier import Outcome
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import decode

ROOT = Path(__file__).resolve().parents[1]
PARTY = str(Path(__file__).with_name("barrier_party.py"))


def _party(url: str, learner: str, parties: str, *, times: int = 1, endpoint_url: str | None = None):
    cmd = [sys.executable, PARTY, "--url", url, "--id", learner, "--parties", parties, "--times", str(times)]
    if endpoint_url:
        cmd += ["--endpoint-url", endpoint_url]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _released_together(url: str, mailbox: gm.Mailbox, endpoint_url: str | None = None) -> None:
    """a and b arrive and stay blocked while c is not there; c arrives and all three are released
    with the same set, twice (the name reused: a second generation)."""
    early = [_party(url, p, "a,b,c", times=2, endpoint_url=endpoint_url) for p in ("a", "b")]
    try:
        arrivals = {keys.barrier_arrival_key("eval", 0, p) for p in ("a", "b")}
        deadline = time.monotonic() + 120
        while not arrivals <= set(mailbox.list(keys.barrier_prefix("eval"))):
            assert all(p.poll() is None for p in early), [p.communicate() for p in early]
            assert time.monotonic() < deadline, "the early parties never arrived"
            time.sleep(0.05)
        time.sleep(0.5)  # a few of their polls: they see two of three and must keep waiting
        assert all(p.poll() is None for p in early), "released before the last party arrived"
        assert mailbox.get(keys.barrier_outcome_key("eval", 0)) is None
        late = _party(url, "c", "a,b,c", times=2, endpoint_url=endpoint_url)
        procs = [*early, late]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in early:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        lines = [json.loads(line) for line in out.splitlines()]
        assert lines == [{"use": 0, "arrived": ["a", "b", "c"]}, {"use": 1, "arrived": ["a", "b", "c"]}]
    # Each use was opened by one outcome, written once, which every party read.
    for g in (0, 1):
        key = keys.barrier_outcome_key("eval", g)
        outcome = decode(mailbox.get(key), Outcome, key=key)
        assert outcome.released and outcome.arrived == ["a", "b", "c"] and outcome.generation == g


def test_parties_in_separate_processes_over_a_file_mailbox_are_released_together(tmp_path: Path) -> None:
    path = tmp_path / "run"
    _released_together(f"file://{path}", gm.FileMailbox(path))


def test_parties_in_separate_processes_over_s3_are_released_together(s3_server: str, s3_bucket: str) -> None:
    pytest.importorskip("boto3")
    url = f"s3://{s3_bucket}/run"
    _released_together(url, gm.open_mailbox(url, endpoint_url=s3_server), endpoint_url=s3_server)


def test_a_missing_party_is_named_in_the_timeout_error() -> None:
    mailbox, clock = gm.MemoryMailbox(), gm.FakeClock()
    barrier = gm.Barrier(mailbox=mailbox, learner_id="learner-0", poll_interval=1.0, clock=clock)
    with pytest.raises(gm.BarrierTimeout, match=r"not arrived: learner-2 \(arrived: learner-0\)"):
        barrier.wait("epoch-end", parties=["learner-0", "learner-2"], timeout=30)
    assert clock.now() >= 30  # it waited on its own (injected) clock
    # The outcome is there for every party: learner-2, arriving at that use, gets the same error.
    key = keys.barrier_outcome_key("epoch-end", 0)
    assert decode(mailbox.get(key), Outcome, key=key).missing == ["learner-2"]


def test_a_count_of_parties_names_the_learners_holding_a_lease_that_did_not_arrive() -> None:
    mailbox = gm.MemoryMailbox()
    mailbox.put_if_absent(keys.lease_key("learner-1", 3), b"{}")
    barrier = gm.Barrier(mailbox=mailbox, learner_id="learner-0", clock=gm.FakeClock())
    with pytest.raises(gm.BarrierTimeout, match="not arrived: learner-1"):
        barrier.wait("eval", parties=2, timeout=3)


def test_the_next_wait_on_a_name_opens_a_new_use_and_old_arrivals_are_collected() -> None:
    mailbox = gm.MemoryMailbox()
    barrier = gm.Barrier(mailbox=mailbox, learner_id="solo", clock=gm.FakeClock())
    for _ in range(4):
        assert barrier.wait("eval", parties=1, timeout=1) == frozenset({"solo"})
    listed = mailbox.list(keys.barrier_prefix("eval"))
    assert [keys.barrier_outcome_key("eval", g) for g in range(4)] == [k for k in listed if k.count("/") == 2]
    # Generations 0 and 1 are two behind a released one: their arrivals are gone.
    assert {keys.parse_barrier_key(k)[1] for k in listed if k.count("/") == 3} == {2, 3}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"parties": ["a", "b"]}, "this party, 'solo', is not among them"),
        ({"parties": 0}, "expected a count >= 1"),
        ({"parties": "solo"}, "collection of learner ids"),
        ({"parties": 1, "timeout": 0}, "expected seconds > 0"),
    ],
)
def test_bad_arguments_say_what_to_pass(kwargs: dict, message: str) -> None:
    barrier = gm.Barrier(mailbox=gm.MemoryMailbox(), learner_id="solo", clock=gm.FakeClock())
    with pytest.raises(ValueError, match=message):
        barrier.wait("eval", **{"timeout": 1, **kwargs})
    with pytest.raises(ValueError, match="barrier name 'Eval/1' is invalid"):
        barrier.wait("Eval/1", parties=1, timeout=1)
