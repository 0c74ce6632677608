"""What the closer (``kernel.FragmentCloser``) holds of a fragment and hands over: plain data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..aggregators.acceptance import PayloadStatus
from ..protocol.records import PayloadRef


@dataclass
class FragmentState:
    """A fragment at ``version``: the published parameters, the fp32 outer state (master and
    Nesterov momentum) and the version of its newest checkpoint (0: the initial parameters). One
    process holds whole tensors; a rank of a sharded node the flat range of each tensor it holds."""

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
    """An accepted contribution: its chunks, its weight, each tensor's squared norm (judged)."""

    refs: tuple[PayloadRef, ...]
    weight: float
    norms: Mapping[str, float]


@dataclass(frozen=True)
class CommitOp:
    """A commit of fragment ``f`` from ``version`` in round ``round``: the contributions in learner
    order, whether all were final, whether it is a checkpoint, the compression written."""

    f: int
    round: int
    version: int
    final: bool
    checkpoint: bool
    compression: str
    accepted: tuple[Accepted, ...]


@dataclass(frozen=True)
class Written:
    """A payload handed to ``put`` and let go: its size and sha256."""

    size: int
    sha256: str

    def __len__(self) -> int:
        return self.size


@dataclass
class Made:
    """A commit before its record: the refs written (by kind), the digests, the cosine, each
    payload (its bytes when no ``put`` was given, else ``Written``), the new state, and the new
    parameters for this node's learner (whole tensors; empty where only ranges are held)."""

    refs: dict[str, PayloadRef]
    theta_digest: str
    outer_digest: str | None
    cosine: float | None
    payloads: dict[str, Any]
    state: FragmentState
    theta: dict[str, np.ndarray]


@dataclass
class Verdict:
    """A contribution read: the status ``acceptance.judge`` takes, whether every value is finite,
    and each tensor's squared norm (``sq_norms``, bit for bit) when the status is ok."""

    status: PayloadStatus
    finite: bool = True
    norms: dict[str, float] | None = None


class Lost(Exception):
    """Accepted contribution ``i`` of a commit can no longer be read (``reason``: ``corrupt`` or
    ``missing``): it is rejected and the commit given up, decided again on the next poll."""

    def __init__(self, i: int, reason: str, why: str) -> None:
        super().__init__(why)
        self.i, self.reason = i, reason


def discard(key: str, data: object) -> None:
    """A commit's ``put`` that writes nothing (a replay compares digests only)."""
