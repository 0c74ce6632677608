"""Memory a node holds between polls, counted in the distinct buffers (numpy arrays, payload
bytes) reachable from its node and learner, the model's own parameters and the store excluded.

A follower of ``gm.Overwrite()`` holds one copy of the model: the learner's anchors, the node
keeping none of the parameters it hands over, and the fragment in flight computed in place of its
anchor (which the next commit of the fragment replaces); with ``gm.Carry()`` or ``gm.Adaptive()``
(the default), which read the anchor again when the commit comes, the fragment in flight is held
beside it; a node that stops closing rounds releases the outer state
it held. ``bench/memory.py`` measures the same in processes (peak RSS)."""

from __future__ import annotations

import functools
import gc
import queue
import sys
import threading
import types
from typing import Any

import numpy as np
from harness import Cluster, Member
from test_engine_rounds import assert_identical, finish

import gradientmail_core as gm
from gradientmail_core.syncer.options import NodeOptions

SHAPES = {f"w{i}": (128, 128) for i in range(8)}  # 8 x 64 KiB: 4 fragments of 128 KiB
MODEL = sum(4 * a * b for a, b in SHAPES.values())
FRAGMENT = MODEL // 4
SLACK = 16 << 10  # payload headers, records, events: small next to a fragment

# Not followed: what every object reaches (types, modules, code) and never holds a model.
_SKIP = (type, types.ModuleType, types.CodeType, str, int, float, bool, type(None), type(threading.Lock()))


def _shared() -> set[int]:
    """Module namespaces (a function's globals, a frame's builtins): they reach everything."""
    return {id(vars(mod)) for mod in list(sys.modules.values()) if mod is not None and hasattr(mod, "__dict__")}


def held_bytes(m: Member) -> int:
    """Bytes of the distinct buffers reachable from ``m``'s node and learner (each array counted
    once by the buffer that owns its memory), not counting the model, the store, the clock or the
    test's ``Member`` (its training target).

    Everything an object refers to is followed (``gc.get_referents``): attributes, containers,
    and what no attribute names: a function's closure cells and defaults, a partial's arguments,
    a bound method's object, a generator's or a thread's frame and its locals, a queue's items."""
    skip = {id(m), id(m.node.store), id(m.node.clock), id(m.learner.adapter), id(m.params)} | _shared()
    seen: set[int] = set(skip)
    owners: dict[int, int] = {}
    todo: list[Any] = [m.node, m.learner]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            owner: Any = obj
            while isinstance(owner.base, np.ndarray):
                owner = owner.base
            if owner.base is not None:  # a view of bytes (a decoded payload, a frombuffer)
                todo.append(owner.base)
            elif id(owner) not in skip and not any(owner is p for p in m.params.values()):
                owners[id(owner)] = owner.nbytes
            continue
        if isinstance(obj, bytes | bytearray | memoryview):
            owners[id(obj)] = memoryview(obj).nbytes
            continue
        if isinstance(obj, types.FrameType):  # f_back leads to the caller (the test itself)
            todo.extend(obj.f_locals.values())
            continue
        if isinstance(obj, types.GeneratorType | types.CoroutineType):
            if obj.gi_frame is not None if isinstance(obj, types.GeneratorType) else obj.cr_frame is not None:
                todo.append(obj.gi_frame if isinstance(obj, types.GeneratorType) else obj.cr_frame)
            continue
        todo.extend(gc.get_referents(obj))
    return sum(owners.values())


def test_the_count_sees_arrays_held_where_no_attribute_names_them():
    # The count must see a model copy however it is held: in a closure, a partial, a bound
    # method's object, a generator's frame, a default argument, a queue (the four 64 KiB tensors
    # of a fragment, held once each way).
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=4, quorum_size=2, alignment=gm.Overwrite()), shapes=dict(SHAPES))
    (b,) = c.join_all("b")
    base = held_bytes(b)

    def copy() -> dict[str, np.ndarray]:
        return {n: v.copy() for n, v in list(b.params.items())[:2]}

    def held_in_a_closure(kept: Any) -> Any:
        return lambda: kept

    def held_in_a_generator(kept: Any) -> Any:
        yield kept

    class Holder:
        def __init__(self) -> None:
            self.kept = copy()

        def hook(self) -> None:
            pass

    def default(kept: dict[str, np.ndarray] = copy()) -> None:  # noqa: B006
        pass

    gen = held_in_a_generator(copy())
    next(gen)
    q: queue.Queue[Any] = queue.Queue()
    q.put(copy())
    for name, hook in {
        "closure": held_in_a_closure(copy()),
        "partial": functools.partial(print, copy()),
        "bound method": Holder().hook,
        "generator": gen,
        "default": default,
        "queue": q,
    }.items():
        b.node.hook_under_test = hook  # type: ignore[attr-defined]
        assert held_bytes(b) - base == 2 * 64 << 10, name
    del b.node.hook_under_test  # type: ignore[attr-defined]
    assert held_bytes(b) == base


def run_measured(c: Cluster, steps: int) -> dict[tuple[str, str], int]:
    """Run ``steps`` steps; the most each member held after training ("step": a contribution may
    wait in the outbox) and after each poll ("poll")."""
    most: dict[tuple[str, str], int] = {}

    def look(when: str) -> None:
        for name, m in c.members.items():
            most[name, when] = max(most.get((name, when), 0), held_bytes(m))

    for _ in range(steps):
        for m in c.live():
            m.train(4)
        look("step")
        c.tick_all()
        look("poll")
        c.clock.advance(0.05)
    return most


def test_follower_holds_one_copy_of_the_model_with_the_fragment_in_flight():
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=4, quorum_size=2, alignment=gm.Overwrite()), shapes=dict(SHAPES))
    a, b = c.join_all("ab")
    c.run(16)  # every fragment committed at least once
    most = run_measured(c, 32)
    assert a.node.state.stats.committed > 0 and b.node.state.stats.committed == 0
    assert b.learner.consumes and not a.learner._lent  # the closer's anchors are its outer state's
    # After a poll and after a step: b's anchors (the model, once), one of them possibly turned
    # into the delta captured for the next round (until a commit of that fragment replaces it); no
    # payload bytes of its own snapshots (it closes nothing) and no second copy of the model.
    for when in ("poll", "step"):
        assert most["b", when] <= MODEL + SLACK, (when, most["b", when] / MODEL, "model copies")
    assert all(theta is None for _, theta in b.node.state.thetas.values()), "the node keeps what it lent"
    finish(c)
    assert_identical([a, b])


def test_a_learner_that_keeps_its_anchors_holds_the_fragment_in_flight_beside_them():
    # Carry reads the anchor again when the commit arrives, so no anchor is consumed: the captured
    # fragment is a copy, kept (Carry's snapshot) until the commit of its round.
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=4, quorum_size=2, alignment=gm.Carry()), shapes=dict(SHAPES))
    a, b = c.join_all("ab")
    c.run(16)
    most = run_measured(c, 32)
    assert not b.learner.consumes
    for when in ("poll", "step"):
        assert most["b", when] <= MODEL + FRAGMENT + SLACK, (when, most["b", when] / MODEL, "model copies")
    for f, (_, theta) in b.node.state.thetas.items():
        assert theta is not None and all(theta[n] is b.learner.anchors[f][n] for n in theta)
    finish(c)
    assert_identical([a, b])


def test_a_consumed_anchor_is_read_back_when_the_learner_leaves_before_its_commit():
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=4, quorum_size=2, alignment=gm.Overwrite()), shapes=dict(SHAPES))
    a, b = c.join_all("ab")
    c.run(16)
    for _ in range(8):  # b trains alone until it has captured a fragment no commit has answered
        b.train(4)
        if b.learner.published:
            break
    f = b.learner.published[-1].round % 4
    assert f not in b.learner.anchors, "the contribution took the anchor's place"
    newest = {n: v.copy() for n, v in a.learner.anchors[f].items()}
    b.learner.write_newest()  # what close does: the fragment is read back from the store
    assert all(np.array_equal(b.params[n], v) for n, v in newest.items())


def test_closer_holds_its_outer_state_and_one_fragment_merge():
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=4, quorum_size=2, alignment=gm.Overwrite()), shapes=dict(SHAPES))
    a, b = c.join_all("ab")
    c.run(16)
    most = max(run_measured(c, 32)["a", when] for when in ("step", "poll"))
    assert a.node.state.stats.committed > 0
    # The anchors (also the fp32 master: the parameters are F32), the momentum, and one round's
    # merge between polls: a delta judged (the round closes in the poll that judges the last one;
    # the closer's own is kept decoded, never as payload bytes too) and the new master and
    # momentum it writes into.
    assert most <= 2 * MODEL + 3 * FRAGMENT + SLACK, (most / MODEL, "model copies")
    finish(c)
    assert_identical([a, b])


def test_node_that_stops_closing_releases_the_outer_state():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2), shapes=dict(SHAPES))
    c.options = NodeOptions(poll_interval=0.1, lease_timeout=5.0, round_timeout=0.5)
    a, b = c.join_all("ab")
    c.run(8)
    c.settle(4)
    assert a.node.merger.holds_any(), "a closes the first rounds"
    for _ in range(40):  # a stalls; b takes the rounds over (timeout) and commits both fragments
        b.train()
        b.node.tick()
        b.learner.drain()
        c.clock.advance(0.05)
    c.run(8)  # a resumes as a follower
    assert {a.node.state.newest[f].closer for f in (0, 1)} == {"b"}
    assert not a.node.merger.holds_any()
    finish(c)
    assert_identical([a, b])


def test_a_new_closer_recovers_from_the_parameters_it_already_holds():
    from gradientmail_core.syncer import replay
    from gradientmail_core.syncer.merger import FragmentMerger

    def recover(*args):  # with a closer of its own, holding nothing yet
        return replay.recover(FragmentMerger.one_process(b.node.run, b.node.store), b.node.store, b.node.run, *args)

    # Carry: the learner keeps its anchors, which the node's parameters share (a learner that
    # consumes them gets them lent: the node then holds none and downloads them when elected).
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=4, quorum_size=2, alignment=gm.Carry()), shapes=dict(SHAPES))
    a, b = c.join_all("ab")
    c.run(16)
    assert b.node.state.stats.committed == 0
    for f, (version, theta) in b.node.state.thetas.items():
        assert theta is not None
        rec = b.node.state.newest[f]
        assert rec.version == version and rec.is_checkpoint
        held = recover(f, rec, (version, theta))
        # The arrays it holds, not a download of them (a fragment more while the first round merges) ...
        assert all(held.theta[n] is theta[n] for n in theta)
        # ... and the state the download gives, bit for bit.
        fetched = recover(f, rec)
        for mine, theirs in (
            (held.theta, fetched.theta),
            (held.master, fetched.master),
            (held.momentum, fetched.momentum),
        ):
            assert all(mine[n].tobytes() == theirs[n].tobytes() for n in theirs)
        # A version it does not hold is downloaded.
        stale = recover(f, rec, (version - 1, theta))
        assert not any(stale.theta[n] is theta[n] for n in theta)
    finish(c)
    assert_identical([a, b])
