"""What followers read and when they act, and when a closer closes: readers never list
``blobs/``; the follower's takeover timeout is 4x the predicted round; the grace window ends
early once every live learner contributed; a change that rebuilds to the wrong digest makes
the follower fetch the full parameters."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from harness import Cluster
from test_engine_rounds import assert_identical, finish, records

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.mailbox import Mailbox
from gradientmail_core.protocol import keys
from gradientmail_core.syncer import placement
from gradientmail_core.syncer.collector import Collector, Judged
from gradientmail_core.syncer.options import NodeOptions
from gradientmail_core.syncer.timing import Estimates


class Recorder:
    """Forwards the four operations; records each LIST (prefix, after, keys returned) with
    whether it was made by garbage collection (``syncer/gc.py`` on the call stack)."""

    def __init__(self, inner: Mailbox) -> None:
        self.inner = inner
        self.lists: list[tuple[str, str, list[str], bool]] = []
        self.gets: list[str] = []

    def put_if_absent(self, key, data):
        return self.inner.put_if_absent(key, data)

    def get(self, key):
        self.gets.append(key)
        return self.inner.get(key)

    def list(self, prefix, after=""):
        out = self.inner.list(prefix, after)
        in_gc = False
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.replace("\\", "/").endswith("gradientmail_core/syncer/gc.py"):
                in_gc = True
                break
            frame = frame.f_back
        self.lists.append((prefix, after, list(out), in_gc))
        return out

    def delete(self, keys):
        return self.inner.delete(keys)


def _may_return_blobs(prefix: str, after: str) -> bool:
    """Whether LIST(prefix, after) can return a key under blobs/ (keys there sort below 'blobs0')."""
    if not (prefix.startswith(keys.BLOBS) or keys.BLOBS.startswith(prefix)):
        return False
    return after < "blobs0"


def test_readers_never_list_blobs_only_the_closers_gc_does() -> None:
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2))
    recorders = {name: Recorder(c.mailbox) for name in "abc"}
    ms = [c.join(name, mailbox=recorders[name]) for name in "abc"]
    for m in ms:
        m.node.state.list_leases(m.node.store)
    c.run(60)
    finish(c)
    assert len(records(c)) >= 20
    polls = 0
    for name, rec in recorders.items():
        for prefix, after, out, in_gc in rec.lists:
            if in_gc:
                continue
            polls += 1
            assert not _may_return_blobs(prefix, after), (name, prefix, after)
            assert not [k for k in out if k.startswith(keys.BLOBS)], (name, prefix, after)
    assert polls >= 3 * 60  # every node listed on every poll
    # The check sees blob listings when they happen: the closers' GC made some.
    gc_blob_lists = [p for rec in recorders.values() for p, a, _, gc in rec.lists if gc and _may_return_blobs(p, a)]
    assert gc_blob_lists
    closers = {r.closer for r in records(c)}
    assert all(any(gc for *_, gc in recorders[n].lists) for n in closers)
    assert not any(gc for n in set("abc") - closers for *_, gc in recorders[n].lists)


# ---- the follower's timeout ------------------------------------------------------------------


@pytest.mark.parametrize(("predicted", "expected"), [(None, 1.0), ((2.0, 0.5, 0.5), 12.0)])
def test_a_follower_takes_over_a_stalled_closer_after_4x_the_predicted_round(predicted, expected) -> None:
    """The closer stops (a stall: its lease stays live), the round has enough snapshots: the
    follower waits max(round_timeout, 4 x (x_sync + grace + x_quorum)) on its clock, then takes
    over with reason "timeout"."""
    opts = NodeOptions(poll_interval=0.1, lease_timeout=10_000.0, round_timeout=1.0)
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1), options=opts)
    a, b = c.join_all("ab")
    c.run(12)
    recs = records(c)
    assert len(recs) >= 2
    closer = c.members[recs[-1].closer]
    follower = b if closer is a else a
    closer.alive = False  # stalled: no more ticks, its lease is never judged stale here
    if predicted is not None:
        x_sync, grace, x_quorum = predicted
        f = follower.node.state.newest_of_head().fragment
        follower.node.state.newest[f] = dataclasses.replace(
            follower.node.state.newest[f], x_sync=x_sync, grace_seconds=grace, grace_planned=None, x_quorum=x_quorum
        )
    assert follower.node.election.round_timeout() == expected
    start = None
    for _ in range(2000):
        follower.train()
        follower.node.tick()
        follower.learner.drain()
        if follower.of(ev.TookOver):
            break
        fo = follower.node.election.watching
        if fo is not None and fo.timer_from is not None:
            start = max(fo.timer_from, fo.claim_seen_at)
        c.clock.advance(0.05)
    took = follower.of(ev.TookOver)
    assert took and took[0].reason == "timeout" and took[0].previous == closer.name
    assert start is not None
    waited = c.clock.now() - start
    assert expected <= waited <= expected + 0.2  # on the fake clock: never before, within a few polls


# ---- the grace window -------------------------------------------------------------------------


def _collector() -> Collector:
    # update() reads only the judged snapshots, the estimates and the run's config (round 0 of
    # H=8 over 2 fragments: a gap of 4 steps; quorum 1, in_flight 2, no overlap bound).
    est = Estimates(x_step=1.0, x_quorum=0.1, x_sync=0.1)
    run = SimpleNamespace(cfg=gm.DiLoCo(sync_every=8, fragments=2, quorum_size=1, in_flight=2), P=2)
    return Collector(round=0, run=run, state=None, opened_at=0.0, estimates=est, merger=None)  # type: ignore[arg-type]


def _accept(c: Collector, learner: str) -> None:
    c.judged[learner] = Judged(learner, None, weight=1.0, norms={"w": 2.0})


def test_grace_window_ends_early_once_every_live_learner_contributed() -> None:
    live = {"a", "b", "c"}
    c = _collector()
    _accept(c, "a")
    assert not c.update(live, 0.0)  # quorum at 0.0; b and c still training
    assert c.quorum_at == 0.0 and c.grace == pytest.approx(3.9)  # min(0.5*(8*1 - 0.2), 4*1)
    _accept(c, "b")
    assert not c.update(live, 1.0)
    _accept(c, "c")
    assert c.update(live, 1.1)  # everyone is in: close now, 2.8 s before the deadline


def test_grace_window_runs_to_its_end_while_a_live_learner_is_missing() -> None:
    live = {"a", "b", "c"}
    c = _collector()
    _accept(c, "a")
    _accept(c, "b")
    assert not c.update(live, 0.0)
    assert not c.update(live, 3.89)
    assert c.update(live, 3.9)


# ---- commit_dtype: the digest check ---------------------------------------------------------


@pytest.mark.parametrize("broken", [False, True], ids=["rebuild-ok", "rebuild-wrong"])
def test_a_change_that_rebuilds_to_the_wrong_digest_falls_back_to_the_full_theta(monkeypatch, broken) -> None:
    shapes = {"w": (32, 16), "b": (16,)}
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, commit_dtype="F8_E4M3"), shapes=shapes)
    got: list[str] = []
    inner_get = c.mailbox.get

    def spy(key):
        data = inner_get(key)
        b = keys.parse_blob_key(key)
        if b is not None and data is not None and b.kind in ("theta", "change"):
            got.append(b.kind)
        return data

    c.mailbox.get = spy  # type: ignore[method-assign]
    rebuilt = []
    real_rebuild = placement.rebuild_theta

    def rebuild(run, f, prev, change):
        theta = real_rebuild(run, f, prev, change)
        rebuilt.append(f)
        if broken:  # a rebuild that is off by one ulp somewhere: the digest no longer matches
            theta = {n: v.copy() for n, v in theta.items()}
            theta["b"][0] = np.nextafter(theta["b"][0], np.float32(np.inf))
        return theta

    monkeypatch.setattr(placement, "rebuild_theta", rebuild)
    ms = c.join_all("ab")
    c.run(40)
    finish(c)
    assert len(rebuilt) >= 8 and got.count("change") >= 8
    if broken:
        # every rebuilt change was refused: the full parameters were fetched each time
        assert got.count("theta") >= got.count("change")
    else:
        assert got.count("theta") <= 2
    assert_identical(ms)  # with the broken rebuild too: the follower never kept its wrong result
    recs = records(c)
    for n in ms[0].params:
        assert np.array_equal(ms[0].params[n], ms[1].params[n])
    assert all(r.change is not None for r in recs)
