"""The node's parts, each built alone over a plain ``NodeState`` (no ``Node``): the election
claims and takes over by its rules, and the follower follows the tape through whatever placement
it is given."""

from __future__ import annotations

import random

import numpy as np
from harness import Cluster, make_params
from test_engine_rounds import finish, records

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.clock import FakeClock
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.lease import LeaseWriter, Liveness
from gradientmail_core.protocol.records import Claim, Manifest, decode
from gradientmail_core.protocol.run import RunInfo, open_run
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.protocol.tape import fetch_theta
from gradientmail_core.syncer.bridge import Bridge
from gradientmail_core.syncer.election import Election
from gradientmail_core.syncer.follower import CommitScreen, Follower
from gradientmail_core.syncer.merger import FragmentMerger
from gradientmail_core.syncer.options import NodeOptions
from gradientmail_core.syncer.placement import OneProcess
from gradientmail_core.syncer.state import NodeState

OPTS = NodeOptions(poll_interval=0.1, lease_timeout=2.0, round_timeout=1.0)


def _run(store: RunStore) -> RunInfo:
    adapter = NumpyAdapter(make_params(1, {"w": (8,), "b": (4,)}))
    cfg = gm.DiLoCo(sync_every=2, fragments=1)
    run, _ = open_run(store, adapter.schema(), adapter.read, cfg, learner="a", compression="", rng=random.Random(0))
    return run


def _election(store: RunStore, clock: FakeClock, me: str = "a", role: str = "both"):
    run = _run(store)
    events: list[ev.Event] = []
    state = NodeState(run, me, role, Liveness(clock, OPTS.lease_timeout, me, role=role))
    lease = LeaseWriter(store, clock, me, "0" * 8, OPTS.lease_interval, role=role)
    election = Election(store, clock, state, lease, Bridge(), events.append, options=OPTS, nonce="0" * 8)
    return election, state, events


def _claim(store: RunStore, r: int, n: int) -> Claim:
    return store.decode_record(store.mailbox.get(keys.claim_key(r, n)), Claim, keys.claim_key(r, n))


# ---- the election -------------------------------------------------------------------------------


def test_an_unclaimed_round_is_claimed_at_once_and_counted_as_a_takeover() -> None:
    store, clock = RunStore(MemoryMailbox()), FakeClock()
    election, state, events = _election(store, clock)
    assert election.watch(0)  # nobody claimed round 0: this node holds number 1 now
    assert _claim(store, 0, 1).learner == "a"
    assert [(e.round, e.reason) for e in events if isinstance(e, ev.TookOver)] == [(0, "unclaimed")]
    assert state.stats.takeovers == 1


def test_a_claim_whose_holder_holds_no_lease_is_taken_over_on_a_listing_newer_than_the_claim() -> None:
    store, clock = RunStore(MemoryMailbox()), FakeClock()
    election, state, events = _election(store, clock)
    store.put_record(keys.claim_key(0, 1), Claim(round=0, n=1, learner="b", nonce="1" * 8))
    state.snapshot_keys = {0: {"a"}}  # a contribution is listed: the round has something to close
    state.list_leases(store)  # listed before the claim was seen: b may have joined since
    clock.advance(0.1)
    assert not election.watch(0)  # lists the leases again instead of judging on the old listing
    assert store.mailbox.get(keys.claim_key(0, 2)) is None
    assert election.watch(0)  # b holds no lease on the newer listing either: claim number 2
    assert _claim(store, 0, 2).learner == "a"
    assert [(e.previous, e.reason) for e in events if isinstance(e, ev.TookOver)] == [
        ("b", "left")
    ]  # b holds no lease: it left


def test_a_claim_whose_holder_left_waits_for_a_contribution_before_it_is_taken_over() -> None:
    store, clock = RunStore(MemoryMailbox()), FakeClock()
    election, state, events = _election(store, clock)
    store.put_record(keys.claim_key(0, 1), Claim(round=0, n=1, learner="b", nonce="1" * 8))
    clock.advance(0.1)
    state.list_leases(store)  # b holds no lease
    assert not election.watch(0)  # nothing listed to close: no takeover
    assert store.mailbox.get(keys.claim_key(0, 2)) is None
    state.snapshot_keys = {0: {"c"}}  # someone contributes
    assert election.watch(0)
    assert [(e.previous, e.reason) for e in events if isinstance(e, ev.TookOver)] == [
        ("b", "left")
    ]  # b holds no lease: it left


def test_a_live_holder_keeps_its_claim_until_the_round_overruns_the_timeout() -> None:
    store, clock = RunStore(MemoryMailbox()), FakeClock()
    election, state, events = _election(store, clock)
    LeaseWriter(store, clock, "b", "1" * 8, OPTS.lease_interval).acquire(poll=OPTS.poll_interval)
    store.put_record(keys.claim_key(0, 1), Claim(round=0, n=1, learner="b", nonce="1" * 8))
    clock.advance(0.1)
    state.list_leases(store)
    state.snapshot_keys = {0: {"a"}}  # the quorum (one of the live learners) has contributed
    assert not election.watch(0)
    clock.advance(election.round_timeout() - 0.05)
    assert not election.watch(0) and store.mailbox.get(keys.claim_key(0, 2)) is None
    clock.advance(0.1)
    assert election.watch(0)
    assert [(e.previous, e.reason) for e in events if isinstance(e, ev.TookOver)] == [("b", "timeout")]


def test_a_learner_only_node_never_claims_and_says_once_that_no_closer_is_live() -> None:
    store, clock = RunStore(MemoryMailbox()), FakeClock()
    election, state, events = _election(store, clock, role="learner")
    assert not election.try_claim(0, 1, previous=None, reason=None)
    assert store.mailbox.list(keys.CLAIMS) == []
    state.list_leases(store)
    election.watch_closers(0)
    election.watch_closers(0)
    assert [e.round for e in events if isinstance(e, ev.NoCloser)] == [0]


# ---- the follower -------------------------------------------------------------------------------


def _committed_run() -> Cluster:
    c = Cluster(gm.DiLoCo(sync_every=2, fragments=2, quorum_size=2))
    c.join_all("ab")
    c.run(16)
    finish(c)
    return c


def _follower(c: Cluster, placement_of=OneProcess):
    store = RunStore(c.mailbox)
    run = RunInfo.from_manifest(decode(c.mailbox.get(keys.MANIFEST), Manifest, key=keys.MANIFEST))
    events: list[ev.Event] = []
    state = NodeState(run, "f", "learner", Liveness(c.clock, OPTS.lease_timeout, "f", role="learner"))
    bridge = Bridge()
    placement = placement_of(store, run, bridge)
    screen = CommitScreen(store, run, events.append, me="f", fraction=0.0, rng=random.Random(0))
    return Follower(store, state, placement, bridge, screen, events.append), state, bridge, events


def test_a_follower_alone_follows_the_tape_in_order_and_hands_every_commit_to_its_learner() -> None:
    c = _committed_run()
    tape = records(c)
    follower, state, bridge, _ = _follower(c)
    assert follower.advance(c.mailbox.list(keys.ROUNDS))
    assert state.head == tape[-1].round
    notices = [bridge.inbox.get_nowait() for _ in range(bridge.inbox.qsize())]
    # far behind (2P records or more): only each fragment's newest record is followed
    assert [(n.round, n.fragment) for n in notices] == [(r.round, r.fragment) for r in tape[-2:]]
    store = RunStore(c.mailbox)
    for n in notices:
        newest = fetch_theta(store, state.run, n.fragment, state.newest[n.fragment])
        assert newest is not None and all(np.array_equal(newest[k], n.theta[k]) for k in newest)


def test_a_follower_skips_a_stray_record_past_a_gap_in_the_tape() -> None:
    c = _committed_run()
    head = records(c)[-1].round
    c.mailbox.put_if_absent(keys.round_key(head + 5), c.mailbox.get(keys.round_key(head)))
    follower, state, _, _ = _follower(c)
    assert follower.advance(c.mailbox.list(keys.ROUNDS))
    assert state.head == head


class _Counting(OneProcess):
    """A placement that counts the commits it is asked to fetch, and stages each one itself."""

    def __init__(self, store, run, bridge) -> None:
        super().__init__(store, run, bridge, FragmentMerger.one_process(run, store))
        self.fetched: list[int] = []
        self.staged: list[int] = []

    def fetch_commit(self, rec, prev):
        self.fetched.append(rec.round)
        return super().fetch_commit(rec, prev)

    def incoming(self, f, rec, theta):
        self.staged.append(rec.round)
        return None


def test_a_follower_fetches_and_stages_commits_through_the_placement_it_is_given() -> None:
    c = _committed_run()
    tape = records(c)
    follower, _, bridge, _ = _follower(c, placement_of=_Counting)
    # one record at a time, as a follower that keeps up sees them
    for rec in tape:
        assert follower.advance([keys.round_key(rec.round)])
    placement = follower.placement
    assert isinstance(placement, _Counting)
    rounds = [r.round for r in tape]
    assert placement.fetched == rounds
    # (the oldest commits' parameters are collected already: nothing to stage, the tape moves on)
    staged = placement.staged
    assert staged[-2:] == rounds[-2:] and staged == rounds[len(rounds) - len(staged) :]
    assert bridge.inbox.qsize() == len(staged)


def test_a_round_this_node_was_closing_that_another_commits_is_abandoned_and_reported_once() -> None:
    c = _committed_run()
    rec = records(c)[0]
    follower, state, _, events = _follower(c)

    class Closing:
        round = rec.round

    state.collector = Closing()  # type: ignore[assignment]
    follower.on_record(rec, None)
    assert state.collector is None and state.stats.superseded == 1
    assert [(e.round, e.by) for e in events if isinstance(e, ev.Superseded)] == [(rec.round, rec.closer)]


# ---- composed, not stacked ----------------------------------------------------------------------


def test_no_engine_class_inherits_from_another_engine_class() -> None:
    """The node and the sharded hosts own their parts: a class of ``syncer/`` or ``sharded/``
    derives from nothing but a ``Protocol`` or an exception (STYLE.md, "Compose, don't stack")."""
    import ast
    from pathlib import Path

    import gradientmail_core
    from gradientmail_core import errors

    root = Path(gradientmail_core.__file__).parent
    # The errors are not engine classes: an error says what to do, and its class says which.
    exceptions = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)}
    stacked = []
    for path in sorted([*root.glob("syncer/*.py"), *root.glob("sharded/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                if bases - {"Protocol", "Exception"} - exceptions:
                    stacked.append(f"{path.relative_to(root)}: {node.name}({', '.join(sorted(bases))})")
    assert stacked == []
