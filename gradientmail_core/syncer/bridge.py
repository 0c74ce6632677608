"""Where the training thread and the background node meet: two queues and a small view.

The training thread never does I/O; it reads the view (under a lock), pushes
contributions to the outbox and drains commits from the inbox between steps.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..adapters.handles import Contribution, Incoming, Stage


@dataclass(frozen=True)
class Publish:
    """A contribution the training thread handed over: the fragment's delta as a handle the
    node asks for payload bytes off-thread (``adapters.handles``), and what it reports."""

    round: int
    fragment: int
    base_version: int
    delta: Contribution
    steps: int
    tokens: int
    local_step: int
    step_seconds: float
    final: bool = False


@dataclass(frozen=True)
class CommitNotice:
    """A committed round's new parameters, for the training thread to align with; ``incoming``
    is the theta already staged for writing (on a device pipeline, on its way to the device)."""

    round: int
    fragment: int
    version: int
    theta: Mapping[str, np.ndarray]
    nbytes: int = 0
    participants: tuple[str, ...] = ()
    cosine: float | None = None
    incoming: Incoming | None = None
    # ``theta``'s arrays are the training thread's alone: the node kept no reference to them
    # (``Bridge.lend``), so the learner may turn them into its next delta in place.
    lent: bool = False
    # The newest round of this fragment, up to this one, whose commit merged this learner's
    # contribution (read too where the node skipped records to catch up): a commit descends from it,
    # so Carry keeps only the steps since that contribution (``Learner.apply``).
    landed: int | None = None
    # The node does not apply this commit (``Session(verify=)`` found its closer's commits forged):
    # no ``theta``; the round is over, the fragment keeps its parameters.
    refused: bool = False


@dataclass(frozen=True)
class View:
    head: int = -1
    # rounds whose snapshots from other learners already number max(min(quorum, live) - 1, 1):
    # the round is about to close, so a slower learner contributes what it has rather than be late
    others_published: frozenset[int] = frozenset()
    live: int = 1
    rounds_seen: int = 0
    closer_of: int | None = None
    # learner -> the number of the node's newest listing that saw it (live in a listing of the
    # leases, or a new snapshot of it): ``Session.wait_for`` counts those seen since it began,
    # so a learner that came and went between two of its looks still counts
    sightings: Mapping[str, int] = field(default_factory=dict)
    listing: int = 0  # the number of the node's newest listing


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
        # How a commit is staged for writing (set by the learner from its adapter): the node
        # stages each commit with it, off the training thread.
        self.stage: Stage | None = None
        # The learner turns its anchors into deltas in place (``Learner.consumes``): a following
        # node then hands each commit's parameters over without keeping them (``CommitNotice.lent``).
        self.lend = False
        # The training thread is leaving (``Session.close``): ``settling`` while it waits for the
        # rounds it contributed to, then ``leaving`` with nothing in flight. A settling node takes
        # over only rounds it contributed to; a leaving one claims no round at all.
        self.settling = False
        self.leaving = False

    def publish(self, p: Publish) -> None:
        with self.lock:
            self.outbox.append(p)
        self.wake.set()
