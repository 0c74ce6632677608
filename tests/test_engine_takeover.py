"""Election, takeover and recovery on a deterministic cluster (fake clock, one thread)."""

from __future__ import annotations

import numpy as np
from harness import Cluster, CrashingMailbox, Member, make_params
from test_engine_rounds import assert_identical, assert_tape_contiguous, finish, records

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.protocol.tape import load_newest


def took_over(c: Cluster) -> list[ev.TookOver]:
    return [e for m in c.members.values() for e in m.of(ev.TookOver)]


def test_closer_that_dies_is_taken_over_when_its_lease_is_lost():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2), audit=True)  # the new closer's commits are recomputed
    a, b, cc = c.join_all("abc")
    c.run(12)
    assert {r.closer for r in records(c)} == {"a"}
    c.crash(a)  # SIGKILL: no more ticks, the lease stays behind unchanged
    c.run(60)
    finish(c)
    recs = assert_tape_contiguous(c)
    new = {r.closer for r in recs} - {"a"}
    assert len(new) == 1
    events = took_over(c)
    assert events and events[0].previous == "a" and events[0].reason in ("lease_lost", "timeout")
    assert_identical([b, cc])


def test_stalled_closer_is_taken_over_by_timeout_and_superseded_when_it_resumes():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1), audit=True)
    from gradientmail_core.syncer.options import NodeOptions

    c.options = NodeOptions(poll_interval=0.1, lease_timeout=5.0, round_timeout=0.5)
    a, b = c.join_all("ab")
    c.run(4)
    c.settle(4)
    head = c.head()
    # a holds the claim of the open round; it stops (SIGSTOP) right after b publishes
    for _ in range(4):
        b.train()
    for _ in range(30):  # 1.5 s: past round_timeout, well within lease_timeout
        b.node.tick()
        b.learner.drain()
        c.clock.advance(0.05)
    assert c.head() == head + 1
    tk = b.of(ev.TookOver)
    assert tk and tk[0].reason == "timeout" and tk[0].previous == "a"
    # a resumes (SIGCONT): it sees the record and steps down
    a.node.tick()
    assert a.of(ev.Superseded) and a.of(ev.Superseded)[0].by == "b"
    assert a.node.state.collector is None or a.node.state.collector.round > head + 1
    c.run(8)
    finish(c)
    assert_tape_contiguous(c)
    assert_identical([a, b])


def test_closer_crash_between_payload_and_record_is_recomputed_with_the_same_bytes():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, quorum_size=3), audit=True)
    crashing = CrashingMailbox(c.path("a"), lambda op, key: op == "put" and key == keys.round_key(1))
    a = c.join("a", mailbox=crashing)
    b, cc = c.join("b"), c.join("c")
    for m in c.live():
        m.node.state.list_leases(m.node.store)
    c.run(8)
    c.settle(5)
    assert not a.alive  # died writing rounds/1
    written = [k for op, k in crashing.log if op == "put" and k.startswith(keys.round_blobs_prefix(1))]
    assert any("/theta-" in k for k in written)
    c.run(60)
    finish(c)
    recs = assert_tape_contiguous(c)
    assert recs[1].closer != "a"
    assert recs[1].theta.key in written and recs[1].outer.key in written
    assert_identical([b, cc])


def test_closer_crash_after_commit_holds_the_next_claim_and_it_is_taken_over():
    # The closer claims the next round before its commit lands (so no follower sees it unclaimed
    # while the closer lives); dying right after the commit leaves that claim to a dead holder.
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1), audit=True)
    crashing = CrashingMailbox(c.path("a"), lambda op, key: op == "put" and key == keys.round_key(0), after=True)
    a = c.join("a", mailbox=crashing)
    b = c.join("b")
    for m in c.live():
        m.node.state.list_leases(m.node.store)
    c.run(60)
    assert not a.alive
    finish(c)
    recs = assert_tape_contiguous(c)
    assert recs[0].closer == "a" and recs[1].closer == "b"
    took = b.of(ev.TookOver)
    assert took and took[0].round == 1 and took[0].previous == "a" and took[0].reason in ("lease_lost", "timeout")


def test_restarted_learner_continues_from_the_store():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2), audit=True)
    a, b = c.join_all("ab")
    c.run(20)
    c.crash(b)
    c.run(8)
    # restart b with the same id: it waits out its own stale lease, then loads the newest commit
    b2 = c.join("b", seed=1)
    # Nothing ticked while b2 joined: the store's newest commit is what it must hold, read
    # here independently of the joiner (a fresh reader on the same mailbox).
    _, head, thetas = load_newest(RunStore(c.mailbox), NumpyAdapter(make_params(0)).schema())
    assert head == c.head() >= 0 and b2.node.state.head == head
    expected = {n: v for theta in thetas.values() for n, v in theta.items()}
    assert set(expected) == set(b2.params)
    for n in expected:
        assert np.array_equal(b2.params[n], expected[n]), n
    c.run(20)
    finish(c)
    recs = assert_tape_contiguous(c)
    late = [r for r in recs if r.round > recs[-1].round - 4]
    assert any("b" in {p.learner for p in r.participants} for r in late)
    assert_identical([a, b2])


def test_learner_that_leaves_is_not_waited_for_and_a_joiner_starts_from_committed_parameters():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, quorum_size=2), audit=True)
    a, b = c.join_all("ab")
    c.run(8)
    c.close(b)  # deletes its lease: not waited for any more
    c.settle(12)
    c.run(8)
    assert c.head() >= 3
    d = c.join("d", seed=9)
    # the joiner holds exactly the newest committed parameters before its first step
    assert all(np.array_equal(d.params[n], a.learner.anchors[0][n]) for n in d.params)
    c.run(8)
    finish(c)
    assert_tape_contiguous(c)


def test_killed_learner_stops_being_waited_for_after_lease_timeout():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, quorum_size=2))
    a, b = c.join_all("ab")
    c.run(8)
    c.crash(b)
    head = c.head()
    c.run(4)
    c.settle(100)  # 5 s > lease_timeout: b's lease is stale, a closes alone
    assert c.head() > head
    assert a.node.state.liveness.live() == {"a"}


def _closer_leaves_cleanly(names: str) -> tuple[Cluster, Member, list[Member]]:
    """Learners in lockstep; the closer leaves cleanly (its lease released) after its last round,
    holding the claim of the next one (claimed before it wrote the last record)."""
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=len(names)))
    ms = c.join_all(names)
    c.run(16)
    c.settle(10)
    (closer,) = [m for m in ms if m.node.state.stats.committed]
    head = c.head()
    assert keys.claim_key(head + 1, 1) in c.mailbox.list(keys.claims_prefix(head + 1))
    c.close(closer)
    return c, closer, [m for m in ms if m is not closer]


def _train(c: Cluster, m: Member, steps: int) -> None:
    for _ in range(steps):
        m.train()
        c.tick_all()
        c.clock.advance(0.05)


def test_a_clean_leavers_round_is_taken_over_only_once_it_has_a_contribution():
    # Until a contribution is listed there is nothing to close: taken over, the round would cost
    # the follower the fragment's outer state (theta and momentum: a 300M-parameter follower
    # peaked at 1.57x the model's bytes for it, bench/memory.py --overlap-steps 0) for a round
    # nobody may contribute to again. Trained on, the follower contributes, then takes it over.
    c, _, (follower,) = _closer_leaves_cleanly("ab")
    head = c.head()
    c.settle(120)  # 6 s: three lease timeouts
    assert not follower.of(ev.TookOver) and not follower.node.merger.holds_any()
    _train(c, follower, 8)
    c.settle(120)
    took = follower.of(ev.TookOver)
    assert took and took[0].reason == "left" and took[0].round == head + 1  # its lease was released, not lapsed
    assert c.head() > head


def test_a_settling_follower_leaves_the_round_to_a_node_that_stays():
    # b closes its session (settling: it waits for its own rounds) and has no part in the open
    # round; c trains on and contributes: c takes the round over, b loads no outer state.
    c, _, (b, cc) = _closer_leaves_cleanly("abc")
    head = c.head()
    b.node.bridge.settling = True
    _train(c, cc, 8)
    c.settle(120)
    assert not b.of(ev.TookOver) and not b.node.merger.holds_any()
    took = cc.of(ev.TookOver)
    assert took and took[0].reason == "left" and took[0].round == head + 1  # its lease was released, not lapsed
