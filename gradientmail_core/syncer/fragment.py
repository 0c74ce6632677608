"""What the closer holds of a fragment and what it hands over: the state over the ranges this
process holds (``FragmentState``), a commit to make (``CommitOp``), what a commit made (``Made``),
what reading a contribution found (``Verdict``), and the one failure a commit reports about a
contribution (``Lost``). Plain data: the closer's work is ``kernel.FragmentCloser``'s."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..aggregators.acceptance import PayloadStatus
from ..protocol.records import PayloadRef


@dataclass
class FragmentState:
    """A fragment at ``version``: the published parameters, the fp32 outer state (master parameters
    and Nesterov momentum), and the version of the fragment's newest checkpoint
    (``checkpoint_every``; 0: the initial parameters). One process holds whole tensors; a rank
    of a sharded node the flat range of each tensor it holds (``theta`` empty unless kept)."""

    version: int
    theta: dict[str, np.ndarray]
    master: dict[str, np.ndarray]
    momentum: dict[str, np.ndarray]
    checkpoint: int = 0

    @classmethod
    def initial(cls, theta: dict[str, np.ndarray]) -> FragmentState:
        return cls(
            0,
            theta,
            {n: v.astype(np.float32, copy=False) for n, v in theta.items()},  # shared: never written in place
            {n: np.zeros_like(v, dtype=np.float32) for n, v in theta.items()},
        )


@dataclass(frozen=True)
class Accepted:
    """An accepted contribution as the merge needs it: its chunks, its weight and each tensor's
    squared norm (computed when it was judged)."""

    refs: tuple[PayloadRef, ...]
    weight: float
    norms: Mapping[str, float]


@dataclass(frozen=True)
class CommitOp:
    """One commit of fragment ``f`` from ``version`` (round ``round``): the accepted contributions
    in learner order, whether every one was final, whether it is a checkpoint, the compression of
    the payloads written."""

    f: int
    round: int
    version: int
    final: bool
    checkpoint: bool
    compression: str
    accepted: tuple[Accepted, ...]


@dataclass(frozen=True)
class Written:
    """A payload handed to ``put`` and let go (a commit keeps no stream, whose inputs would stay
    alive with it): its size and sha256."""

    size: int
    sha256: str

    def __len__(self) -> int:
        return self.size


@dataclass
class Made:
    """What a commit made before its record: the refs of the payloads written (by kind), the
    digests of the parameters and outer state, the cosine, each payload (its bytes when no
    ``put`` was given, else ``Written``), the fragment's new state, and the new parameters for
    this node's learner (whole tensors; empty where this process holds ranges only)."""

    refs: dict[str, PayloadRef]
    theta_digest: str
    outer_digest: str | None
    cosine: float | None
    payloads: dict[str, Any]
    state: FragmentState
    theta: dict[str, np.ndarray]


@dataclass
class Verdict:
    """What reading a snapshot's payload found: the status ``judge`` takes, whether every value is
    finite, and each tensor's squared norm (``sq_norms``, bit for bit) when the status is ok."""

    status: PayloadStatus
    finite: bool = True
    norms: dict[str, float] | None = None


class Lost(Exception):
    """Accepted contribution ``i`` of a commit can no longer be read (``reason``: ``corrupt`` or
    ``missing``): it is rejected and the commit given up, to be decided again on the next poll."""

    def __init__(self, i: int, reason: str, why: str) -> None:
        super().__init__(why)
        self.i, self.reason = i, reason


def discard(key: str, data: object) -> None:
    """A commit's ``put`` that writes nothing (a replay compares digests only)."""
