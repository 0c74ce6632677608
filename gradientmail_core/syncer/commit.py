"""A commit of a fragment: what goes in, what comes out, and the one function from one to the other.

``merge_commit``: the fragment's state at the version before, the accepted contributions in
learner order, the run (the merger's) -> a ``Commit``. The live closer, a takeover's replay,
``gradientmail verify`` and the benches call it alike; the round record is built from a commit by
the one who writes it (``Collector.record``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..codec.payload import PayloadStream
from ..errors import MailboxUnavailable
from ..protocol.records import PayloadRef
from ..protocol.run import RunInfo
from ..protocol.schedule import fragment_of

Put = Callable[[str, PayloadStream], object]  # a payload written under its key


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
    """An accepted contribution: its chunks, its weight, each tensor's squared norm (judged), and
    whether its learner sent it as its last (``Snapshot.final``)."""

    refs: tuple[PayloadRef, ...]
    weight: float
    norms: Mapping[str, float]
    final: bool = False


@dataclass(frozen=True)
class CommitOp:
    """A commit of fragment ``f`` from ``version`` in round ``round`` as every rank runs it: the
    contributions in learner order, whether all were final, whether it is a checkpoint, the
    compression written."""

    f: int
    round: int
    version: int
    final: bool
    checkpoint: bool
    compression: str
    accepted: tuple[Accepted, ...]


@dataclass(frozen=True)
class Commit:
    """A commit as its record names it (payloads by kind, digests, cosine, ``final``, ``checkpoint``:
    None when this is one, else the version it builds on), and what this process keeps: the new
    state (pending until ``landed``), the new parameters for its learner (empty where only ranges
    are held), each payload's size in the order written, and their bytes when no ``write`` was given."""

    refs: dict[str, PayloadRef]
    theta_digest: str
    outer_digest: str | None
    cosine: float | None
    final: bool
    checkpoint: int | None
    state: FragmentState
    theta: dict[str, np.ndarray]
    sizes: dict[str, int]
    payloads: dict[str, bytes]


class Lost(MailboxUnavailable):
    """Accepted contribution ``i`` of a commit can no longer be read (``reason``: ``corrupt`` or
    ``missing``): the closer rejects it and gives the commit up, decided again on the next poll
    (a replay, which cannot leave it out, waits as for any store that is unavailable)."""

    def __init__(self, i: int, reason: str, why: str) -> None:
        super().__init__(why)
        self.i, self.reason = i, reason


def discard(key: str, data: object) -> None:
    """A commit's ``write`` that writes nothing (a replay compares digests only)."""


class Merging(Protocol):
    """What a commit runs on: this process's ``merger.FragmentMerger`` (declared here, as the
    merger is built on this module's types)."""

    run: RunInfo

    def commit(self, op: CommitOp, put: Put | None) -> Commit: ...


def merge_commit(
    merger: Merging,
    state: FragmentState,
    contributions: Sequence[Accepted],
    *,
    round: int,
    compression: str,
    write: Put | None = None,
) -> Commit:
    """Round ``round``'s commit of ``contributions`` (learner order) onto ``state`` (the version
    before, held by ``merger``): merged, stepped, its payloads written with ``write(key, stream)``
    (None: their bytes kept in ``Commit.payloads``). A checkpoint when the run's
    ``checkpoint_every`` says so. ``Lost`` when a contribution can no longer be read."""
    run = merger.run
    assert contributions, "a round closes with at least one accepted contribution"
    f = fragment_of(round, run.P)
    final = all(a.final for a in contributions)
    version = state.version
    checkpoint = run.checkpoint_due(f, version + 1, final=final, participants=len(contributions))
    return merger.commit(CommitOp(f, round, version, final, checkpoint, compression, tuple(contributions)), write)
