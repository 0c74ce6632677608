"""The fault-injecting mailbox: each fault does exactly what it says, and nothing else."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gradientmail_core.clock import FakeClock
from gradientmail_core.codec.payload import encode_payload
from gradientmail_core.errors import MailboxUnavailable, PayloadCorrupt
from gradientmail_core.mailbox import CreateOutcome, create_once
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.store import RunStore
from gradientmail_sim.faults import Fault, FaultLog, FaultyMailbox, InjectedCrash, round_of

SNAP = keys.snapshot_key(3, "a")
ROUND = keys.round_key(3)


def faulty(*rules: Fault, seed: int = 0, **kw) -> tuple[FaultyMailbox, MemoryMailbox]:
    inner = MemoryMailbox()
    return FaultyMailbox(inner, rules, rng=random.Random(seed), node="a", **kw), inner


def test_without_rules_it_is_the_inner_mailbox():
    mb, inner = faulty()
    assert mb.put_if_absent(ROUND, b"x") and not mb.put_if_absent(ROUND, b"y")
    assert mb.get(ROUND) == b"x" and mb.get(SNAP) is None
    mb.put_if_absent(SNAP, b"s")
    assert mb.list("") == inner.list("") == [ROUND, SNAP]
    assert mb.list("", after=ROUND) == [SNAP]
    mb.delete([ROUND, "rounds/0000000009.json"])
    assert inner.list("") == [SNAP]
    assert not mb.log.events


def test_error_before_the_request_is_sent_applies_nothing():
    mb, inner = faulty(Fault(kind="error", ops=("put",), times=1))
    with pytest.raises(MailboxUnavailable, match="503"):
        mb.put_if_absent(ROUND, b"x")
    assert inner.get(ROUND) is None
    assert mb.put_if_absent(ROUND, b"x")  # fired once only
    assert mb.log.counts["error/before"] == 1


def test_lost_acknowledgement_applies_the_write_then_fails_and_the_read_back_says_ours():
    mb, inner = faulty(Fault(kind="error", ops=("put",), phase="landed", times=1))
    with pytest.raises(MailboxUnavailable, match="after the request was applied"):
        mb.put_if_absent(ROUND, b"mine")
    assert inner.get(ROUND) == b"mine"
    assert create_once(mb, ROUND, b"mine") == (CreateOutcome.ALREADY_OURS, b"mine")
    assert mb.log.resolved["ours/rounds"] == 1


def test_unknown_outcome_resolved_as_theirs_when_another_writer_won():
    mb, inner = faulty(Fault(kind="error", ops=("put",), times=1))
    with pytest.raises(MailboxUnavailable):
        mb.put_if_absent(ROUND, b"mine")
    inner.put_if_absent(ROUND, b"theirs")
    assert create_once(mb, ROUND, b"mine") == (CreateOutcome.TAKEN, b"theirs")
    assert mb.log.resolved["theirs/rounds"] == 1


def test_retry_412_returns_false_for_our_own_write():
    mb, inner = faulty(Fault(kind="retry_412"))
    assert mb.put_if_absent(ROUND, b"mine") is False
    assert inner.get(ROUND) == b"mine"
    assert create_once(mb, ROUND, b"mine")[0] is CreateOutcome.ALREADY_OURS


@pytest.mark.parametrize("phase, applied", [("before", False), ("landed", True)])
def test_crash_before_or_after_the_write_lands(phase, applied):
    mb, inner = faulty(Fault(kind="crash", ops=("put",), phase=phase))
    with pytest.raises(InjectedCrash):
        mb.put_if_absent(ROUND, b"x")
    assert (inner.get(ROUND) is not None) == applied


def test_crash_after_the_reply_returns_it_and_dies_at_the_next_call():
    mb, inner = faulty(Fault(kind="crash", ops=("put",), phase="replied", times=1))
    assert mb.put_if_absent(ROUND, b"x") is True
    assert mb.pending_crash is not None
    with pytest.raises(InjectedCrash):
        mb.get(ROUND)
    assert isinstance(InjectedCrash(), BaseException) and not isinstance(InjectedCrash(), Exception)


def test_armed_crash_fires_at_the_kth_matching_call_only():
    mb, _ = faulty()
    mb.arm_crash(after_calls=2, ops=("get",), prefix=keys.ROUNDS)
    mb.get(ROUND)
    mb.get(SNAP)  # not matching
    mb.get(ROUND)
    with pytest.raises(InjectedCrash):
        mb.get(ROUND)
    mb.pending_crash = None
    mb.get(ROUND)  # fired once


def test_flipped_payload_read_is_caught_by_its_sha256():
    mb, inner = faulty(Fault(kind="flip"))
    store = RunStore(mb)
    data = encode_payload({"w": np.arange(8, dtype=np.float32)}, "F32", kind="delta")
    ref = RunStore(inner).put_payload(lambda sha: keys.snapshot_blob_key(3, "a", sha), data)
    got = mb.get(ref.key)
    assert got is not None and got != data and len(got) == len(data)
    assert sum(bin(x ^ y).count("1") for x, y in zip(got, data)) == 1
    with pytest.raises(PayloadCorrupt):
        store.get_payload(ref, {"w": (8,)})
    inner.put_if_absent(SNAP, b"{}")
    assert mb.get(SNAP) == b"{}"  # records are never flipped


def test_listings_are_paginated_but_complete_and_each_page_can_fail():
    mb, inner = faulty(page_size=2)
    ks = [keys.round_key(r) for r in range(7)]
    for k in ks:
        inner.put_if_absent(k, b"x")
    assert mb.list(keys.ROUNDS) == ks
    assert mb.list(keys.ROUNDS, after=ks[2]) == ks[3:]
    mb.add(Fault(kind="error", ops=("list",), skip=2, times=1))  # the third page fails
    with pytest.raises(MailboxUnavailable):
        mb.list(keys.ROUNDS)
    assert mb.list(keys.ROUNDS) == ks
    assert mb.log.counts["paginated_lists"] >= 2


def test_latency_sleeps_on_the_injected_clock():
    clock = FakeClock()
    mb, _ = faulty(Fault(kind="latency", seconds=0.25), clock=clock)
    mb.get(ROUND)
    mb.list("")
    assert clock.now() == pytest.approx(0.5)


def test_rules_select_by_node_prefix_round_and_operation():
    rule = Fault(kind="error", ops=("get",), prefix=keys.SNAPSHOTS, node="a", rounds=(3, 4))
    mb, _ = faulty(rule)
    mb.get(keys.snapshot_key(5, "a"))
    mb.get(ROUND)
    mb.put_if_absent(SNAP, b"x")
    with pytest.raises(MailboxUnavailable):
        mb.get(SNAP)
    other = FaultyMailbox(MemoryMailbox(), [rule], rng=random.Random(0), node="b")
    other.get(SNAP)
    assert round_of(keys.snapshot_blob_key(4, "a", "0" * 64)) == 4 and round_of(keys.MANIFEST) is None


def test_the_same_seed_injects_the_same_faults():
    def run(seed: int) -> list[str]:
        log = FaultLog()
        mb = FaultyMailbox(MemoryMailbox(), [Fault(kind="error", probability=0.3)], rng=random.Random(seed), log=log)
        for i in range(200):
            try:
                mb.put_if_absent(keys.round_key(i), b"x")
            except MailboxUnavailable:
                pass
        return [e.describe() for e in log.events]

    assert run(1) == run(1) and run(1) != run(2) and 30 < len(run(1)) < 90


def test_invalid_rules_are_refused():
    with pytest.raises(ValueError):
        Fault(kind="meltdown")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Fault(kind="flip", ops=("put",))
    with pytest.raises(ValueError):
        Fault(kind="error", probability=1.5)
    with pytest.raises(ValueError):
        FaultyMailbox(MemoryMailbox(), rng=random.Random(0), page_size=0)
