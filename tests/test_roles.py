"""Node roles (issue 15, part 1) on a deterministic cluster (fake clock, one thread): learner-only
nodes never close rounds, a syncer (``gm.Syncer``) closes them and is not counted as a learner,
and the run says when it waits for a node that may close."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from harness import Cluster, Member, make_params
from test_engine_rounds import assert_audited, assert_identical, assert_tape_contiguous, records

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.cli import views
from gradientmail_core.cli.overview import read_overview
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.auth import policy
from gradientmail_core.protocol.guard import GuardedMailbox
from gradientmail_core.protocol.records import Claim, Lease, decode, encode
from gradientmail_core.protocol.run import open_run
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.bridge import Bridge
from gradientmail_core.syncer.learner import Learner
from gradientmail_core.syncer.node import Node
from gradientmail_core.syncer.options import NodeOptions


@dataclass
class Roles(Cluster):
    """The harness cluster, with a role per learner and syncers ticked alongside."""

    syncers: dict[str, gm.Syncer] = field(default_factory=dict)
    syncer_events: dict[str, list[ev.Event]] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)  # syncers not ticked (killed)
    secret: bytes | None = None  # an authenticated run: every node reads through the guarded view

    def join(self, name: str, seed: int | None = None, role: str = "both", **_: object) -> Member:  # type: ignore[override]
        seed = len(self.members) if seed is None else seed
        params = make_params(100 + seed, self.shapes)
        adapter = NumpyAdapter(params)
        auth = policy(self.secret)
        store = RunStore(GuardedMailbox(self.path(name), auth=auth), auth=auth)
        events: list[ev.Event] = []
        run, created = open_run(
            store, adapter.schema(), adapter.read, self.cfg, learner=name, compression="", rng=random.Random(seed)
        )
        bridge = Bridge()
        node = Node(
            store,
            self.clock,
            run,
            learner=name,
            nonce=f"{seed + 1:08x}",
            emit=events.append,
            options=self.options,
            bridge=bridge,
            role=role,
        )
        thetas = node.join(created=created)
        learner = Learner(adapter, run, bridge, self.clock, learner=name, emit=events.append)
        learner.start(node.state.head, thetas, {f: v for f, (v, _) in node.state.thetas.items()})
        m = Member(name, params, node, learner, events, np.random.default_rng(seed), make_params(7, self.shapes))
        self.members[name] = m
        return m

    def learners(self, names: str, role: str = "learner") -> list[Member]:
        ms = [self.join(n, role=role) for n in names]
        for m in self.live():
            m.node.state.list_leases(m.node.store)
        return ms

    def start_syncer(self, name: str = "s", seed: int = 99) -> gm.Syncer:
        events = self.syncer_events.setdefault(name, [])
        o = self.options
        s = gm.Syncer(
            self.path(name),
            syncer_id=name,
            poll_interval=o.poll_interval,
            lease_timeout=o.lease_timeout,
            round_timeout=o.round_timeout,
            clock=self.clock,
            seed=seed,
            callbacks=[events.append],
            secret=self.secret,
        )
        assert s.open()
        self.syncers[name] = s
        self.down.discard(name)
        for m in self.live():
            m.node.state.list_leases(m.node.store)
        return s

    def tick_all(self) -> None:
        super().tick_all()
        for name, s in self.syncers.items():
            if name not in self.down:
                s.tick()


def options(lease_timeout: float = 2.0) -> NodeOptions:
    return NodeOptions(poll_interval=0.1, lease_timeout=lease_timeout, round_timeout=1.0)


def claims_by(c: Cluster, learners: set[str]) -> list[str]:
    """Every claim in the store whose holder is one of ``learners``."""
    out = []
    for k in c.mailbox.list(keys.CLAIMS):
        data = c.mailbox.get(k)
        if data is not None and decode(data, Claim, key=k).learner in learners:
            out.append(k)
    return out


def of(c: Roles, name: str, kind: type) -> list:
    events = c.members[name].events if name in c.members else c.syncer_events[name]
    return [e for e in events if isinstance(e, kind)]


# ---- keys and records ---------------------------------------------------------------------


def test_the_role_is_in_the_lease_key_and_both_keeps_the_old_key():
    assert keys.lease_key("a", 7) == "leases/a/0000000007.json" == keys.lease_key("a", 7, "both")
    assert keys.lease_key("a", 7, "learner") == "leases/a/0000000007.l.json"
    assert keys.lease_key("a", 7, "syncer") == "leases/a/0000000007.s.json"
    for role in keys.ROLES:
        k = keys.lease_key("a", 7, role)
        assert keys.parse_lease_key(k) == ("a", 7) and keys.lease_role(k) == role
    assert keys.lease_role("leases/a/0000000007.x.json") is None
    with pytest.raises(ValueError, match="role"):
        keys.lease_key("a", 7, "closer")


def test_a_lease_of_role_both_keeps_its_bytes_and_old_leases_decode():
    old = b'{"format":1,"learner":"a","local_step":3,"mac":null,"nonce":"0000abcd","seq":2,"tokens":9}'
    lease = decode(old, Lease)
    assert lease.role == "both" and lease.waiting_for_closer is False
    assert encode(lease) == old  # the defaults are left out: a node without roles reads it
    waiting = Lease(
        learner="a", nonce="0000abcd", seq=2, local_step=3, tokens=9, role="learner", waiting_for_closer=True
    )
    assert decode(encode(waiting), Lease) == waiting
    with pytest.raises(gm.ProtocolError):
        decode(old.replace(b'"format"', b'"role":"closer","format"'), Lease)


def test_session_and_options_take_the_role():
    with pytest.raises(ValueError, match="gm.Syncer"):
        gm.Session(
            {"w": np.zeros(2, np.float32)},
            algorithm=gm.DiLoCo(sync_every=4, fragments=1),
            mailbox=gm.MemoryMailbox(),
            role="syncer",
        )
    s = gm.Session(
        {"w": np.zeros(2, np.float32)},
        algorithm=gm.DiLoCo(sync_every=4, fragments=1),
        mailbox=gm.MemoryMailbox(),
        role="learner",
    )
    assert s.role == "learner"


# ---- learner-only nodes ---------------------------------------------------------------------


def test_learner_only_nodes_never_claim_and_say_once_that_the_run_waits():
    c = Roles(gm.DiLoCo(sync_every=4, fragments=2), options=options())
    a, b = c.learners("ab")
    # Round 0 is unclaimed from the start and snapshots pile up (the "unclaimed" and "timeout"
    # takeovers would fire many times over): a learner-only node claims nothing, ever.
    c.run(60)
    assert c.mailbox.list(keys.CLAIMS) == [] and c.mailbox.list(keys.ROUNDS) == []
    for m in (a, b):
        assert not m.of(ev.RoundClaimed) and not m.of(ev.TookOver)
        assert [e.round for e in m.of(ev.NoCloser)] == [0]  # once, not once per poll
    # the waiting shows in the leases, so `gradientmail status` can say it from one look
    ov = read_overview(c.mailbox)
    assert ov.waiting_for_closer == ["a", "b"]
    assert {le.role for le in ov.leases} == {"learner"}
    line = views.waiting_line(ov, "file:///run")
    assert line is not None and "no node that may close rounds is live (seen by a, b)" in line
    assert "gradientmail syncer file:///run --id NAME" in line


def test_a_both_node_closes_when_present_and_learner_only_nodes_never_take_over():
    c = Roles(gm.DiLoCo(sync_every=4, fragments=2), options=options())
    a, b = c.learners("ab")
    c.settle(2)  # they see no node that may close rounds
    (d,) = c.learners("d", role="both")
    c.run(24)
    assert records(c) and {r.closer for r in records(c)} == {"d"}
    assert [e.who for e in a.of(ev.CloserBack)] == ["d"]  # it saw no closer before d joined
    head = c.head()
    c.crash(d)  # its lease stays behind unchanged and lapses; its claim of the open round stays
    c.run(60)
    assert c.head() <= head + 1  # at most the round d was closing when it stopped ticking
    assert claims_by(c, {"a", "b"}) == []
    for m in (a, b):
        assert not m.of(ev.RoundClaimed) and not m.of(ev.TookOver)
        assert len(m.of(ev.NoCloser)) == 2  # before d joined, and once d's lease lapsed


def test_a_learner_and_a_both_node_the_both_node_closes_every_round():
    c = Roles(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2), options=options(), audit=True)
    a = c.learners("a")[0]
    b = c.learners("b", role="both")[0]
    c.run(40)
    c.settle()
    for m in (a, b):
        c.close(m)
    recs = assert_tape_contiguous(c)
    assert len(recs) == 40 // 4 * 2 and {r.closer for r in recs} == {"b"}
    assert all({p.learner for p in r.participants} == {"a", "b"} for r in recs)
    assert_audited(c)  # each commit is its participants' merge and outer step
    assert_identical([a, b])


# ---- the syncer -----------------------------------------------------------------------------


def test_a_syncer_never_creates_a_run_it_waits_and_says_so():
    mb = gm.MemoryMailbox()
    events: list[ev.Event] = []
    s = gm.Syncer(
        mb, syncer_id="s", poll_interval=0.1, lease_timeout=2.0, clock=gm.FakeClock(), callbacks=[events.append]
    )
    looks = {"n": 0}
    real = mb.get

    def get(key: str) -> bytes | None:  # stop it after 20 looks for the manifest
        looks["n"] += 1
        if looks["n"] >= 20:
            s.stop()
        return real(key)

    mb.get = get  # type: ignore[method-assign]
    assert s.open() is False  # stopped while waiting
    assert looks["n"] == 20
    assert [type(e) for e in events] == [ev.WaitingForRun]  # said once, not once per poll
    assert mb.list("") == []  # nothing written: no manifest, no lease
    s.close()


def test_a_syncer_closes_every_round_and_is_not_counted_as_a_learner():
    c = Roles(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2), options=options(), audit=True)
    a, b = c.learners("ab")
    c.settle(2)  # they see no node that may close rounds
    s = c.start_syncer("s")
    c.settle(1)
    assert (
        a.node.state.liveness.live() == {"a", "b"} and s.node is not None and s.node.state.liveness.live() == {"a", "b"}
    )
    assert a.node.state.liveness.closers() == {"s"} and s.node.state.liveness.closers() == {"s"}
    assert a.node.bridge.view.live == 2
    c.run(80)
    c.settle()
    for m in (a, b):
        c.close(m)
    recs = assert_tape_contiguous(c)
    assert len(recs) == 80 // 4 * 2 and {r.closer for r in recs} == {"s"}
    # quorum 2 of 2 learners + a syncer: every round closes as soon as both contributed (if the
    # syncer counted as a live learner, not everyone live would have reported, and each round
    # would wait out its grace window)
    assert all(r.live == 2 and {p.learner for p in r.participants} == {"a", "b"} for r in recs)
    assert all(r.grace_seconds == 0 for r in recs)
    assert any((r.grace_planned or 0) > 0 for r in recs)  # a window was planned, and not waited
    assert_audited(c)  # the syncer, which trains nothing, commits its learners' merge
    assert_identical([a, b])
    # it trains nothing and keeps no commits for a training thread
    assert s.node.state.stats.published == 0 and s.node.bridge.inbox.qsize() == 0
    assert not any("/s/" in k or k.endswith("/s.json") for k in c.mailbox.list(keys.SNAPSHOTS))
    for m in (a, b):
        assert [e.who for e in m.of(ev.CloserBack)] == ["s"]  # it joined after them
    s.close()
    assert c.mailbox.list(keys.LEASES) == []


def test_no_closer_fires_once_when_the_syncer_lapses_and_closer_back_when_it_returns():
    c = Roles(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2), options=options(), audit=True)
    a, b = c.learners("ab")
    c.settle(2)
    c.start_syncer("s")
    c.run(24)
    for m in (a, b):
        assert len(m.of(ev.NoCloser)) == 1 and len(m.of(ev.CloserBack)) == 1  # the start, before s
    head = c.head()
    assert head >= 4
    c.down.add("s")  # SIGKILL: its lease stays behind, unchanged
    c.run(60)  # 3 s of fake time: past the 2 s lease timeout
    assert c.head() <= head + 1
    for m in (a, b):
        assert len(m.of(ev.NoCloser)) == 2 and len(m.of(ev.CloserBack)) == 1
        assert m.of(ev.NoCloser)[-1].round >= head
    assert claims_by(c, {"a", "b"}) == []
    ov = read_overview(c.mailbox)
    assert ov.waiting_for_closer == ["a", "b"]
    assert {le.learner: le.role for le in ov.leases} == {"a": "learner", "b": "learner", "s": "syncer"}
    # a new syncer process with the same id: it takes the dead one's lease and its claim over
    c.start_syncer("s", seed=100)
    c.run(40)
    c.settle()
    assert c.head() > head + 2
    for m in (a, b):
        assert len(m.of(ev.NoCloser)) == 2 and len(m.of(ev.CloserBack)) == 2
        assert m.of(ev.CloserBack)[-1].who == "s"
    assert read_overview(c.mailbox).waiting_for_closer == []
    for m in (a, b):
        c.close(m)
    recs = assert_tape_contiguous(c)
    assert {r.closer for r in recs} == {"s"}
    assert_audited(c)  # the restarted syncer went on from the outer state in the store
    assert_identical([a, b])


def test_roles_in_an_authenticated_run_live_under_tagged_lease_keys():
    c = Roles(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2), options=options(), secret=b"k" * 32)
    a, b = c.learners("ab")
    c.start_syncer("s")
    raw = c.mailbox.list(keys.LEASES)
    untagged = [keys.untag_key(k) for k in raw]
    assert all(u is not None for u in untagged)  # every lease key carries the run's tag...
    roles = {keys.parse_lease_key(u[0])[0]: keys.lease_role(u[0]) for u in untagged if u is not None}
    assert roles == {"a": "learner", "b": "learner", "s": "syncer"}  # ...and its role
    c.run(40)
    c.settle()
    for m in (a, b):
        c.close(m)
    recs = assert_tape_contiguous(c)
    assert len(recs) == 40 // 4 * 2 and {r.closer for r in recs} == {"s"}
    assert all(r.live == 2 for r in recs)
    assert_identical([a, b])
