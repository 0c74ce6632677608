"""Driving learners single-threaded for the benchmarks: Node + Learner without a thread.

What ``gm.Session`` does on its background thread, the benchmarks do in a loop they control:
train a step, ``learner.step()``, ``node.tick()``, advance a fake clock. The same seed gives the
same run, byte for byte, whatever else the machine is doing.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import gradientmail_core as gm
from gradientmail_core.adapters import adapter_for
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.host import join_run
from gradientmail_core.syncer.learner import Learner
from gradientmail_core.syncer.node import Node
from gradientmail_core.syncer.options import NodeOptions


@dataclass
class Member:
    name: str
    model: Any
    counting: gm.CountingMailbox
    node: Node
    learner: Learner
    events: list = field(default_factory=list)

    def step(self, samples: int) -> None:
        self.learner.step(samples)

    def tick(self) -> None:
        self.node.tick()
        self.learner.drain()


def join(
    name: str,
    model: Any,
    *,
    cfg: gm.DiLoCo,
    mailbox: Any,
    clock: gm.FakeClock,
    options: NodeOptions | None = None,
    compression: str = "",
    seed: int = 0,
    keep_events: bool = False,
) -> Member:
    """Join ``model`` (anything ``adapter_for`` accepts) to the run in ``mailbox`` as ``name``."""
    opts = options or NodeOptions(poll_interval=1.0, lease_timeout=120.0, round_timeout=60.0)
    opts = dataclasses.replace(opts, compression=compression)
    counting = gm.CountingMailbox(mailbox)
    store = RunStore(counting)
    events: list = []
    emit = events.append if keep_events else (lambda e: None)
    node, learner = join_run(
        store,
        adapter_for(model),
        cfg,
        clock,
        learner=name,
        nonce=f"{seed + 1:08x}",
        emit=emit,
        options=opts,
        rng=random.Random(seed),
        node_rng=random.Random(seed),
    )
    return Member(name, model, counting, node, learner, events)


def see_each_other(members: list[Member]) -> None:
    """Let every node list every lease (what ``session.wait_for`` waits for)."""
    for m in members:
        m.node.state.list_leases(m.node.store)
