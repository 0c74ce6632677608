"""Where the training thread and the background node meet: two queues and a small view.

The training thread never does I/O; it reads the view (under a lock), pushes
contributions to the outbox and drains commits from the inbox between steps.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..adapters.base import Captured, DevicePipeline


@dataclass(frozen=True)
class Publish:
    """A contribution the training thread handed over: the fragment's parameters now, and
    the anchor they are relative to. The node computes ``anchor - local`` off-thread.

    With a device pipeline both stay on the device: ``captured`` holds them, and encodes the
    delta there; ``anchor`` and ``local`` are empty."""

    round: int
    fragment: int
    base_version: int
    anchor: Mapping[str, np.ndarray]
    local: Mapping[str, np.ndarray]
    steps: int
    tokens: int
    local_step: int
    step_seconds: float
    final: bool = False
    captured: Captured | None = None


@dataclass(frozen=True)
class CommitNotice:
    """A committed round's new parameters, for the training thread to align with; with a
    device pipeline, ``staged`` is the theta already on its way to the device."""

    round: int
    fragment: int
    version: int
    theta: Mapping[str, np.ndarray]
    nbytes: int = 0
    participants: tuple[str, ...] = ()
    cosine: float | None = None
    staged: Any = None


@dataclass(frozen=True)
class View:
    head: int = -1
    # rounds whose snapshots from other learners already meet the quorum: the round will
    # close without us, so a slower learner contributes what it has rather than be late
    others_published: frozenset[int] = frozenset()
    live: int = 1
    rounds_seen: int = 0
    closer_of: int | None = None


class Bridge:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outbox: deque[Publish] = deque()
        self.inbox: queue.Queue[CommitNotice] = queue.Queue()
        self.view = View()
        self.failure: BaseException | None = None
        self.wake = threading.Event()
        self.local_step = 0
        self.tokens = 0
        # The adapter's device pipeline, if any (set by the learner): the node stages commits
        # on the device with it, off the training thread.
        self.pipeline: DevicePipeline | None = None

    def publish(self, p: Publish) -> None:
        with self.lock:
            self.outbox.append(p)
        self.wake.set()

    def pending_publishes(self) -> int:
        with self.lock:
            return len(self.outbox)
