"""A deterministic single-threaded cluster that reads the mailbox the way a Session does:
through ``GuardedMailbox`` with the run's policy (a secret or none).

N learners (numpy models) over one ``MemoryMailbox`` and one ``FakeClock``; the test drives
them in lock step: every learner trains one round's steps, then nodes tick until every learner
has aligned with that round. Used by the security and poisoning tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradientmail_core import events as ev
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.clock import FakeClock
from gradientmail_core.config import DiLoCo
from gradientmail_core.mailbox import Mailbox
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol.auth import policy
from gradientmail_core.protocol.guard import GuardedMailbox
from gradientmail_core.protocol.run import max_payload_bytes, open_run
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.bridge import Bridge
from gradientmail_core.syncer.learner import Learner
from gradientmail_core.syncer.node import Node
from gradientmail_core.syncer.options import NodeOptions


class PoisonAdapter(NumpyAdapter):
    """Trains honestly but reports ``anchor + scale * (params - anchor)`` when its fragment is read
    for a contribution: its delta is ``scale`` times the honest one."""

    def __init__(self, params: dict[str, np.ndarray], scale: float) -> None:
        super().__init__(params)
        self.scale = np.float32(scale)
        self.anchor = {n: a.copy() for n, a in params.items()}

    def read(self, names):
        return {n: self.anchor[n] + self.scale * (self.params[n] - self.anchor[n]) for n in names}

    def subtract_from(self, out) -> None:  # the in-place delta reports the same scaled one
        for n, o in out.items():
            np.subtract(o, self.read([n])[n], out=o)

    def write(self, values, mixing: float = 0.0) -> None:
        super().write(values, mixing)
        for n in values:
            self.anchor[n] = self.params[n].copy()


@dataclass
class Member:
    name: str
    params: dict[str, np.ndarray]
    node: Node
    learner: Learner
    events: list[ev.Event]
    store: RunStore

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


@dataclass
class SimRun:
    cfg: DiLoCo
    secret: str | bytes | None = None
    mailbox: Mailbox = field(default_factory=MemoryMailbox)
    clock: FakeClock = field(default_factory=FakeClock)
    options: NodeOptions = field(
        default_factory=lambda: NodeOptions(poll_interval=0.05, lease_timeout=2.0, round_timeout=1.0)
    )
    members: dict[str, Member] = field(default_factory=dict)

    def join(
        self, name: str, params: dict[str, np.ndarray], adapter: Any = None, *, secret: Any = "run", auth: Any = None
    ) -> Member:
        """``auth``: a ready policy (a ``members.MemberAuth``) instead of one made from the secret."""
        auth = auth if auth is not None else policy(self.secret if secret == "run" else secret)
        events: list[ev.Event] = []

        def ignored(key: str, why: str) -> None:
            events.append(ev.IgnoredObject(name, key, why))

        guard = GuardedMailbox(self.mailbox, auth=auth, on_ignored=ignored)
        store = RunStore(guard, auth=auth, on_ignored=ignored)
        seed = len(self.members)
        adapter = adapter or NumpyAdapter(params)
        run, created = open_run(
            store, adapter.schema(), adapter.read, self.cfg, learner=name, compression="", rng=random.Random(seed)
        )
        guard.limit_payloads(max_payload_bytes(run))
        bridge = Bridge()
        node = Node(store, self.clock, run, learner=name, nonce=f"{seed + 1:08x}", emit=events.append,
                    options=self.options, bridge=bridge)  # fmt: skip
        thetas = node.join(created=created)
        learner = Learner(adapter, run, bridge, self.clock, learner=name, emit=events.append)
        learner.start(node.state.head, thetas, {f: v for f, (v, _) in node.state.thetas.items()})
        m = Member(name, params, node, learner, events, store)
        self.members[name] = m
        return m

    def see_each_other(self) -> None:
        """What ``session.wait_for`` ensures: every node has listed every lease."""
        for m in self.members.values():
            m.node.state.list_leases(m.node.store)

    def tick_all(self) -> None:
        for m in self.members.values():
            m.node.tick()
            m.learner.drain()
        self.clock.advance(self.options.poll_interval)

    def train(self, step: Callable[[Member], int], steps: int) -> None:
        """``steps`` optimizer steps on every learner; ``step`` trains one and returns its samples."""
        for m in self.members.values():
            for _ in range(steps):
                m.learner.step(step(m))

    def sync(
        self,
        round_: int,
        *,
        max_ticks: int = 400,
        between: Callable[[], None] | None = None,
        waiting: Callable[[Member], bool] | None = None,
    ) -> None:
        """Tick until every learner (every one ``waiting`` selects) has aligned with ``round_``."""
        for _ in range(max_ticks):
            if all(m.learner.aligned >= round_ for m in self.members.values() if waiting is None or waiting(m)):
                return
            if between is not None:
                between()
            self.tick_all()
        heads = {m.name: (m.learner.aligned, m.node.follower.stuck) for m in self.members.values()}
        raise AssertionError(f"round {round_} did not reach every learner: {heads}")

    def close(self) -> None:
        for m in self.members.values():
            m.learner.drain()
            m.learner.write_newest()
            m.node.leave()
