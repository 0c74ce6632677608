"""A small deterministic cluster for engine tests: N learners with numpy models over one
MemoryMailbox and one FakeClock, driven single-threaded (train step, tick, advance).

``Cluster(..., audit=True)`` puts the simulation's auditor (``gradientmail_sim/audit.py``)
between every member and the store: each commit is recomputed as it is written, from the
contributions its record lists, bit for bit with the engine's functions and within float32
rounding with an independent float64 reference, and deletions of what the run still needs are
caught. ``test_engine_rounds.finish`` then asserts that every round was verified, without a
violation: "every node ends identical" holds by construction (closing loads the newest commit
everywhere); that each commit is the right one does not."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import numpy as np

from gradientmail_core import events as ev
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.clock import FakeClock
from gradientmail_core.config import DiLoCo
from gradientmail_core.mailbox import Mailbox
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol.run import open_run
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.protocol.tape import fetch_theta
from gradientmail_core.syncer.bridge import Bridge
from gradientmail_core.syncer.learner import Learner
from gradientmail_core.syncer.node import Node
from gradientmail_core.syncer.options import NodeOptions
from gradientmail_sim.audit import AuditMailbox, Auditor

SHAPES = {"embed.weight": (6, 4), "layers.0.w": (4, 4), "layers.1.w": (4, 4), "head.b": (4,)}


def make_params(seed: int = 0, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


class Crash(Exception):
    """The process died inside a store call."""


class CrashingMailbox:
    """Wraps a mailbox; raises ``Crash`` when ``when(op, key)`` is true, before or after the
    call lands (``after=True``: the write happened, the reply was lost with the process)."""

    def __init__(self, inner: Mailbox, when, *, after: bool = False) -> None:
        self.inner, self.when, self.after = inner, when, after
        self.armed = True
        self.log: list[tuple[str, str]] = []

    def _maybe(self, op: str, key: str, call):
        hit = self.armed and self.when(op, key)
        if hit and not self.after:
            self.armed = False
            raise Crash(f"{op} {key}")
        out = call()
        self.log.append((op, key))
        if hit:
            self.armed = False
            raise Crash(f"after {op} {key}")
        return out

    def put_if_absent(self, key, data):
        return self._maybe("put", key, lambda: self.inner.put_if_absent(key, data))

    def get(self, key):
        return self._maybe("get", key, lambda: self.inner.get(key))

    def list(self, prefix, after=""):
        return self._maybe("list", prefix, lambda: self.inner.list(prefix, after))

    def delete(self, keys):
        keys = list(keys)
        return self._maybe("delete", ",".join(keys), lambda: self.inner.delete(keys))


@dataclass
class Member:
    name: str
    params: dict[str, np.ndarray]
    node: Node
    learner: Learner
    events: list[ev.Event]
    rng: np.random.Generator
    target: dict[str, np.ndarray]
    alive: bool = True

    def train(self, samples: int = 4) -> None:
        """A deterministic 'optimizer step': move toward a target, plus seeded noise."""
        for n, p in self.params.items():
            p -= np.float32(0.1) * (p - self.target[n]) + np.float32(0.01) * self.rng.standard_normal(p.shape).astype(
                np.float32
            )
        self.learner.step(samples)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


@dataclass
class Cluster:
    cfg: DiLoCo
    mailbox: Mailbox = field(default_factory=MemoryMailbox)
    clock: FakeClock = field(default_factory=FakeClock)
    options: NodeOptions = field(
        default_factory=lambda: NodeOptions(poll_interval=0.1, lease_timeout=2.0, round_timeout=1.0)
    )
    compression: str = ""
    members: dict[str, Member] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=lambda: dict(SHAPES))
    audit: bool = False  # every commit checked by the simulation's auditor (the module docstring)
    auditor: Auditor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.audit:
            self.auditor = Auditor(self.mailbox)

    def path(self, name: str) -> Mailbox:
        """``name``'s way to the store: through the auditor when the cluster is audited (a fault
        wrapper goes above it: ``CrashingMailbox(c.path(name), ...)``)."""
        return self.mailbox if self.auditor is None else AuditMailbox(self.mailbox, self.auditor, name)

    def join(
        self,
        name: str,
        seed: int | None = None,
        compression: str | None = None,
        mailbox: Mailbox | None = None,
        verify: float = 0.0,
    ) -> Member:
        seed = len(self.members) if seed is None else seed
        params = make_params(100 + seed, self.shapes)
        adapter = NumpyAdapter(params)
        store = RunStore(mailbox or self.path(name))
        events: list[ev.Event] = []
        comp = self.compression if compression is None else compression
        run, created = open_run(
            store, adapter.schema(), adapter.read, self.cfg, learner=name, compression=comp, rng=random.Random(seed)
        )
        opts = dataclasses.replace(self.options, compression=comp, verify=verify)
        bridge = Bridge()
        node = Node(
            store,
            self.clock,
            run,
            learner=name,
            nonce=f"{seed + 1:08x}",
            emit=events.append,
            options=opts,
            bridge=bridge,
            rng=random.Random(seed),
        )
        # As join_run: the learner first (it tells the node whether to lend what it reads).
        learner = Learner(adapter, run, bridge, self.clock, learner=name, emit=events.append)
        learner.reload = lambda f: fetch_theta(store, run, f, node.state.newest.get(f))
        thetas = node.join(created=created)
        s = node.state
        cosines = {f: rec.cosine for f, rec in s.newest.items()}
        learner.start(s.head, thetas, {f: v for f, (v, _) in s.thetas.items()}, lent=s.lent, cosines=cosines)
        target = make_params(7, self.shapes)
        m = Member(name, params, node, learner, events, np.random.default_rng(seed), target)
        self.members[name] = m
        return m

    def join_all(self, names: str | list[str]) -> list[Member]:
        """Join several learners, then let every node see every lease (like ``wait_for``)."""
        ms = [self.join(n) for n in names]
        for m in self.live():
            m.node.state.list_leases(m.node.store)
        return ms

    def live(self) -> list[Member]:
        return [m for m in self.members.values() if m.alive]

    def tick_all(self) -> None:
        for m in self.live():
            try:
                m.node.tick()
            except Crash:
                m.alive = False
                continue
            m.learner.drain()

    def run(self, steps: int, *, ticks_per_step: int = 1, dt: float = 0.05, samples: int = 4) -> None:
        for _ in range(steps):
            for m in self.live():
                m.train(samples)
            for _ in range(ticks_per_step):
                self.tick_all()
                self.clock.advance(dt)

    def settle(self, ticks: int = 40, dt: float = 0.05) -> None:
        for _ in range(ticks):
            self.tick_all()
            self.clock.advance(dt)

    def close(self, m: Member) -> None:
        m.learner.drain()
        m.learner.write_newest()
        m.node.leave()
        m.alive = False

    def crash(self, m: Member) -> None:
        m.alive = False

    def head(self) -> int:
        rounds = self.mailbox.list("rounds/")
        return len(rounds) - 1


class RecordingClock(FakeClock):
    """A fake clock that remembers every sleep, so tests assert the backoff, not wall time."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        super().sleep(seconds)
