"""``DiLoCo(checkpoint_every=k)``: the closer writes the parameters and outer state only at
checkpoints; a node that becomes closer between them replays the rounds since the checkpoint bit
for bit, a learner joining between them rebuilds the parameters from the checkpoint and the
changes, and GC keeps exactly what those need (docs/protocol.md, "Checkpoints")."""

from __future__ import annotations

import copy
import dataclasses
import random

import numpy as np
import pytest
from harness import Cluster, Member, make_params
from test_engine_rounds import assert_identical, assert_tape_contiguous, finish, records

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.errors import MailboxUnavailable, ProtocolError
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.rebuild import theta_digest
from gradientmail_core.protocol.records import Manifest, RoundRecord, decode, encode
from gradientmail_core.protocol.run import RunInfo, open_run
from gradientmail_core.protocol.schedule import is_checkpoint, round_of
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.protocol.tape import fetch_theta, load_newest
from gradientmail_core.syncer import replay
from gradientmail_core.syncer.bridge import Bridge
from gradientmail_core.syncer.learner import Learner
from gradientmail_core.syncer.merger import FragmentMerger
from gradientmail_core.syncer.node import Node

K = 3


def cfg(**kw) -> gm.DiLoCo:
    base = dict(sync_every=4, fragments=2, quorum_size=3, commit_dtype="F8_E4M3", checkpoint_every=K)
    return gm.DiLoCo(**{**base, **kw})


# ---- configuration and records --------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(checkpoint_every=2), "commit_dtype"),
        (dict(checkpoint_every=0, commit_dtype="F4"), "integer >= 1"),
        (dict(checkpoint_every=True, commit_dtype="F4"), "integer >= 1"),
        (dict(checkpoint_every=2.0, commit_dtype="F4"), "integer >= 1"),
    ],
)
def test_a_bad_checkpoint_every_raises(kw, why):
    with pytest.raises(ValueError, match=why):
        gm.DiLoCo(sync_every=4, fragments=2, **kw)


def test_a_manifest_with_a_bad_checkpoint_every_is_refused():
    store = RunStore(MemoryMailbox())
    adapter = NumpyAdapter(make_params())
    run, _ = open_run(store, adapter.schema(), adapter.read, cfg(), learner="a", compression="", rng=random.Random(0))
    config = {**run.manifest.config, "commit_dtype": None}
    with pytest.raises(ProtocolError, match="checkpoint_every=3 with commit_dtype=None"):
        RunInfo.from_manifest(dataclasses.replace(run.manifest, config=config))


def test_the_default_keeps_manifests_and_records_as_they_were():
    d = gm.DiLoCo(sync_every=4, fragments=2, commit_dtype="F4")
    assert "checkpoint_every" not in d.to_dict() and d.checkpoint_every == 1
    assert gm.DiLoCo.from_dict(d.to_dict()) == d
    d.check_matches({k: v for k, v in d.to_dict().items()})  # a manifest from before the option
    assert cfg().to_dict()["checkpoint_every"] == K
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2, commit_dtype="F4"))
    c.join_all("ab")
    c.run(16)
    for k in c.mailbox.list(keys.ROUNDS):
        raw = c.mailbox.get(k)
        assert b"checkpoint" not in raw and b"outer_digest" not in raw and b"contributions" not in raw
        rec = decode(raw, RoundRecord, key=k)
        assert rec.is_checkpoint and rec.theta is not None and rec.outer is not None
        assert encode(rec) == raw


def test_is_checkpoint_every_kth_version_and_final_rounds():
    assert [v for v in range(10) if is_checkpoint(v, final=False, every=3)] == [0, 3, 6, 9]
    assert is_checkpoint(4, final=True, every=3)
    assert all(is_checkpoint(v, final=False, every=1) for v in range(5))
    assert [round_of(1, v, 3) for v in (1, 2, 3)] == [1, 4, 7]


def test_records_between_checkpoints_carry_only_the_change():
    c = Cluster(cfg())
    c.join_all("abc")
    c.run(40)
    recs = assert_tape_contiguous(c)
    assert len(recs) >= 12
    for rec in recs:
        kinds = sorted(
            b.kind for k in c.mailbox.list(keys.round_blobs_prefix(rec.round)) if (b := keys.parse_blob_key(k))
        )
        if rec.version % K == 0:
            assert rec.is_checkpoint and rec.theta and rec.outer and rec.change
            assert rec.contributions is None and rec.outer_digest is None
            if rec.round > recs[-1].round - 2 * c.cfg.fragments:
                assert kinds == ["change", "outer", "theta"]
        else:
            assert rec.checkpoint == rec.version // K * K and rec.theta is None and rec.outer is None
            assert rec.change is not None and rec.outer_digest is not None
            assert [x.sha256 for x in rec.contributions] == [p.payload_sha256 for p in rec.participants]
            assert kinds in (["change"], [])  # (collected: older than 2P and before the newest checkpoint)


# ---- a closer killed between checkpoints ----------------------------------------------------


class Lockstep:
    """Three learner-only nodes and two syncers on one store. Each learner takes one step, then
    every node polls until the run is quiet, so what the learners train and contribute does not
    depend on how long a round takes to close: a run with a takeover contributes exactly what a
    run without one does."""

    def __init__(self, config: gm.DiLoCo) -> None:
        self.c = Cluster(config)
        self.learners = [self._join(n, role="learner") for n in "abc"]
        self.syncers = {n: self._syncer(n) for n in ("s1", "s2")}
        self.down: set[str] = set()

    def _join(self, name: str, role: str) -> Member:
        c, seed = self.c, len(self.c.members)
        params = make_params(100 + seed, c.shapes)
        adapter = NumpyAdapter(params)
        store = RunStore(c.mailbox)
        run, created = open_run(
            store, adapter.schema(), adapter.read, c.cfg, learner=name, compression="", rng=random.Random(seed)
        )
        events: list[ev.Event] = []
        node = Node(store, c.clock, run, learner=name, nonce=f"{seed + 1:08x}", emit=events.append,
                    options=c.options, bridge=Bridge(), role=role)  # fmt: skip
        thetas = node.join(created=created)
        learner = Learner(adapter, run, node.bridge, c.clock, learner=name, emit=events.append)
        learner.start(node.state.head, thetas, {f: v for f, (v, _) in node.state.thetas.items()})
        m = Member(name, params, node, learner, events, np.random.default_rng(seed), make_params(7, c.shapes))
        c.members[name] = m
        return m

    def _syncer(self, name: str) -> Node:
        c = self.c
        run = RunInfo.from_manifest(decode(c.mailbox.get(keys.MANIFEST), Manifest, key=keys.MANIFEST))
        node = Node(RunStore(c.mailbox), c.clock, run, learner=name, nonce="5" * 8, emit=lambda e: None,
                    options=c.options, role="syncer")  # fmt: skip
        node.join(created=False)
        return node

    def quiet(self, ticks: int = 30) -> None:
        for _ in range(ticks):
            for name, s in self.syncers.items():
                if name not in self.down:
                    s.tick()
            for m in self.learners:
                m.node.tick()
                m.learner.drain()
            self.c.clock.advance(0.05)

    def step(self) -> None:
        for m in self.learners:
            m.train()
        self.quiet()


def between_checkpoints(c: Cluster, f: int) -> bool:
    newest = [r for r in records(c) if r.fragment == f][-1]
    return not newest.is_checkpoint


def test_a_takeover_between_checkpoints_gives_the_same_parameters_as_a_run_without_one(monkeypatch):
    replayed: list[int] = []
    orig = replay.replay_round
    monkeypatch.setattr(replay, "replay_round", lambda *a: replayed.append(a[-1].round) or orig(*a))

    def run(kill_at: int | None) -> Lockstep:
        ls = Lockstep(cfg(in_flight=1))
        for step in range(36):
            if step == kill_at:
                # s1 dies (SIGKILL) with both fragments between checkpoints
                assert between_checkpoints(ls.c, 0) and between_checkpoints(ls.c, 1)
                ls.down.add("s1")
                ls.quiet(120)  # past the lease timeout: s2 takes the open round over
            ls.step()
        ls.quiet(60)
        return ls

    plain, taken = run(None), run(kill_at=20)
    closers = [r.closer for r in records(taken.c)]
    assert "s2" in closers and closers[-1] == "s2" and set(records(plain.c)[i].closer for i in range(5)) == {"s1"}
    assert replayed, "s2 must have rebuilt the state by replaying rounds after a checkpoint"
    a, b = records(plain.c), records(taken.c)
    assert [r.theta_digest for r in a] == [r.theta_digest for r in b]
    assert [(r.change.sha256, r.outer_digest, r.outer and r.outer.sha256) for r in a] == [
        (r.change.sha256, r.outer_digest, r.outer and r.outer.sha256) for r in b
    ]
    for x, y in zip(plain.learners, taken.learners, strict=True):
        for n in x.params:
            assert np.array_equal(x.params[n], y.params[n]), (x.name, n)
    # the outer state the new closer holds is the one the old closer would hold
    for f in range(2):
        s_plain, s_taken = plain.syncers["s1"].merger.held(f), taken.syncers["s2"].merger.held(f)
        assert s_plain.version == s_taken.version
        for n in s_plain.master:
            assert np.array_equal(s_plain.master[n], s_taken.master[n])
            assert np.array_equal(s_plain.momentum[n], s_taken.momentum[n])
            assert np.array_equal(s_plain.theta[n], s_taken.theta[n])


def test_a_closer_killed_between_checkpoints_is_taken_over_and_the_new_closer_rebuilds_exactly():
    c = Cluster(cfg(), audit=True)  # the new closer's commits recomputed
    a, b, cc = c.join_all("abc")
    c.run(22)
    c.settle(4)
    f = (c.head() + 1) % 2
    assert between_checkpoints(c, f)
    held = a.node.merger.held(f)
    c.crash(a)
    newest = [r for r in records(c) if r.fragment == f][-1]
    rebuilt = replay.recover(_closer(b.node), b.node.store, b.node.run, f, newest)
    assert rebuilt.version == held.version == newest.version and rebuilt.checkpoint == newest.checkpoint
    for n in held.master:
        for what in ("theta", "master", "momentum"):
            assert np.array_equal(getattr(held, what)[n], getattr(rebuilt, what)[n]), (what, n)
    c.run(40)
    finish(c)
    recs = assert_tape_contiguous(c)
    assert {r.closer for r in recs[-4:]} <= {"b", "c"}
    assert_identical([b, cc])


def test_a_missing_contribution_makes_the_new_closer_wait_and_a_wrong_one_is_refused():
    c = Cluster(cfg())
    a, b, _ = c.join_all("abc")
    c.run(22)
    c.settle(4)
    f = (c.head() + 1) % 2
    newest = [r for r in records(c) if r.fragment == f][-1]
    assert not newest.is_checkpoint and newest.contributions
    store, run = b.node.store, b.node.run
    # a wrong weight (a record that does not replay): refused, never a different state
    p0 = newest.participants[0]
    forged = dataclasses.replace(
        newest, participants=[dataclasses.replace(p0, weight=p0.weight * 2), *newest.participants[1:]]
    )
    k = _closer(b.node)
    state = replay.recover(k, store, run, f, [r for r in records(c) if r.fragment == f][-2])
    before = copy.deepcopy(state)  # what the refused replay must leave as it was
    with pytest.raises(ProtocolError, match="does not give the committed"):
        replay.replay_round(k, store, run, state, forged)
    assert (state.version, state.checkpoint) == (before.version, before.checkpoint)
    for what in ("theta", "master", "momentum"):
        mine, kept = getattr(state, what), getattr(before, what)
        assert mine.keys() == kept.keys() and all(mine[n].tobytes() == kept[n].tobytes() for n in kept), what
    # the true record still replays from that same state, to the committed one
    assert replay.replay_round(k, store, run, state, newest).version == newest.version
    # a contribution gone (no newer checkpoint yet): the node waits, with the key in the message
    c.mailbox.delete([newest.contributions[-1].key])
    with pytest.raises(MailboxUnavailable, match=newest.contributions[-1].key):
        replay.recover(_closer(b.node), store, run, f, newest)


def test_a_learner_joining_between_checkpoints_rebuilds_the_parameters_from_the_checkpoint():
    c = Cluster(cfg(), audit=True)
    ms = c.join_all("abc")
    c.run(22)
    c.settle(4)
    assert between_checkpoints(c, 0) or between_checkpoints(c, 1)
    d = c.join("d")
    newest = {}
    for r in records(c):
        newest[r.fragment] = r
    for f, rec in newest.items():
        assert d.learner.versions[f] == rec.version
        assert theta_digest(d.node.run, f, d.learner.anchors[f]) == rec.theta_digest
        for n, v in d.learner.anchors[f].items():
            assert np.array_equal(v, ms[0].learner.anchors[f][n])
    # gm.align's reader too
    _, head, thetas = load_newest(RunStore(c.mailbox), NumpyAdapter(make_params()).schema())
    assert head == c.head() and all(
        np.array_equal(thetas[f][n], d.learner.anchors[f][n]) for f in thetas for n in thetas[f]
    )
    c.run(12)
    finish(c)
    assert_identical([*ms, d])


def test_gc_keeps_the_newest_checkpoint_and_what_follows_it_and_deletes_the_rest():
    c = Cluster(cfg(verify_window=0))  # (only what a recovery needs; the verify window: tests/test_verify.py)
    c.join_all("abc")
    for steps in (26, 6, 6):
        c.run(steps)
        c.settle(4)
        recs = records(c)
        head, P = recs[-1].round, c.cfg.fragments
        blobs = set(c.mailbox.list(keys.BLOBS))
        for f in range(P):
            newest = [r for r in recs if r.fragment == f][-1]
            ck = (
                newest.round
                if newest.is_checkpoint
                else (round_of(f, newest.checkpoint, P) if newest.checkpoint else -1)
            )
            for r in recs:
                if r.fragment != f:
                    continue
                snaps = {k for k in blobs if k.startswith(keys.snapshot_blobs_prefix(r.round))}
                mine = {ref.key for ref in r.contributions or []}
                if r.round > ck:  # replayed by a recovery: its change and contributions stay
                    assert r.change.key in blobs and mine <= snaps, r.round
                else:
                    assert not snaps, r.round  # contributions up to the checkpoint are gone
                if r.round == ck:
                    assert r.theta.key in blobs and r.outer.key in blobs
                elif r.round < ck and r.round <= head - 2 * P:
                    assert not any(k.startswith(keys.round_blobs_prefix(r.round)) for k in blobs), r.round


def test_a_recovery_racing_gc_on_an_old_chain_waits_for_the_newer_records():
    c = Cluster(cfg())
    _, b, _ = c.join_all("abc")
    c.run(60)
    c.settle(4)
    recs = records(c)
    newest_ck = max(r.round for r in recs if r.fragment == 0 and r.is_checkpoint)
    # a stale view: fragment 0's record of two checkpoints ago, between checkpoints
    old = next(r for r in recs if r.fragment == 0 and not r.is_checkpoint and r.round < newest_ck - 2 * K * 2)
    store, run = b.node.store, b.node.run
    assert fetch_theta(store, run, 0, old) is None  # gone: the reader lists the tape again
    with pytest.raises(MailboxUnavailable, match="newer commits exist"):
        replay.recover(_closer(b.node), store, run, 0, old)


def _closer(node):
    """A one-process merger of ``node``'s run, holding nothing yet."""
    return FragmentMerger.one_process(node.run, node.store)
