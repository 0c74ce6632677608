"""What the engine holds of a sharded node (``lead_rank.py``): rank 0's learner and node talk to
these as to any node's, and they record what every rank must do, or hand the node thread the
ranks' chunk refs; and what a sharded node refuses before any I/O (``check_config``)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch.distributed as dist

from ..adapters.handles import Contribution, Incoming
from ..adapters.torch_sharded import ShardedParams, ShardingUnsupported
from ..codec.payload import PayloadStream
from ..codec.quant import QTensor
from ..config import Adaptive, Carry, DiLoCo
from ..errors import SessionFailed
from ..protocol.records import PayloadRef, join_refs
from .rank_io import Captured, RankIO


class Recorder(Protocol):
    """What the handles need of rank 0's host (``lead_rank.LeadRank``): its rank's IO,
    and the actions it sends every rank at the next exchange."""

    @property
    def io(self) -> RankIO | None: ...

    def record(self, action: dict[str, Any], handle: ShardContribution | None = None) -> None: ...

    def record_publish(self, f: int, r: int) -> ShardContribution: ...


class Together(SessionFailed):
    """A failure every rank learned at the same exchange: nothing more to tell the others."""


def check_config(cfg: DiLoCo) -> None:
    """What a sharded node does not do in this version, refused before any I/O (on every rank)."""
    if getattr(cfg, "chunk_elements", None) is None:
        raise ShardingUnsupported(
            "chunk_elements=None stores whole fragments, which no rank of a sharded node holds: keep the "
            "default chunk size (gm.DiLoCo(chunk_elements=...))"
        )
    if cfg.checkpoint_every > 1:
        raise ShardingUnsupported(
            f"checkpoint_every={cfg.checkpoint_every}: a sharded node reads each commit's parameters chunk by "
            "chunk, and rounds between checkpoints name none (only changes from a checkpoint); run with "
            "checkpoint_every=1 (the default)"
        )
    if isinstance(cfg.alignment, Carry | Adaptive):
        raise ShardingUnsupported(
            f"alignment={cfg.alignment!r} is not supported by sharded nodes yet (each rank would keep the "
            "snapshot of the chunks it owns): a sharded node creates its run with gm.Overwrite() when the rule "
            "is left at its default, and joins runs of gm.Overwrite() or gm.Blend(mixing); pass one of those "
            "(to the node that creates the run, too)"
        )
    if cfg.gap_projection:
        raise ShardingUnsupported(
            "gap_projection=True is not supported by sharded nodes yet (its blocks of 32 elements may straddle "
            "two ranks' shards): run without it"
        )
    if cfg.error_feedback:
        raise ShardingUnsupported(
            "error_feedback=True is not supported by sharded nodes yet (each rank would keep the residuals of "
            "the chunks it owns): run without it"
        )


def mesh_matches(sharded: ShardedParams) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ShardingUnsupported(
            "the parameters are FSDP2 DTensors but no default process group is initialised: open the "
            "gm.Session on every rank after torch.distributed.init_process_group (torchrun does it)"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if sharded.world != world or sharded.coord != rank:
        raise ShardingUnsupported(
            f"the parameters are sharded over a mesh of {sharded.world} ranks (this rank at {sharded.coord}), "
            f"the job has {world} processes (this one rank {rank}): gradientmail needs one FSDP2 mesh of every "
            "process, in rank order (fully_shard's default mesh)"
        )
    return rank, world


class ShardIncoming:
    """A commit of fragment ``f`` on its way in: writing it records the action for every rank."""

    def __init__(self, rt: Recorder, f: int, v: int) -> None:
        self.rt, self.f, self.v = rt, f, v

    def write(self, mixing: float = 0.0) -> None:
        self.rt.record({"a": "write", "f": self.f, "v": self.v, "m": float(mixing)})

    def carry(self, since: Contribution | None, anchor: Mapping[str, np.ndarray]) -> None:
        raise ShardingUnsupported("a sharded node does not carry local steps across commits yet")


class ShardContribution:
    """Rank 0's handle on one publish: ``upload`` (``lead_rank.OverRanks.upload``, on the node's
    thread) uploads rank 0's chunks once every rank captured them, adds the other ranks' refs and
    returns the joined ref."""

    def __init__(self, rt: Recorder, f: int, r: int, seq: int) -> None:
        self.rt, self.fragment, self.round, self.seq = rt, f, r, seq
        self.captured: Captured | None = None
        self.ready = threading.Event()
        self.ref: PayloadRef | None = None

    def upload(self, store: Any, run: Any, fragment: int, round: int, learner: str, compression: str) -> PayloadRef:
        if self.ref is not None:  # a retry after the snapshot record's write failed
            return self.ref
        io = self.rt.io
        assert io is not None and fragment == self.fragment and round == self.round
        while not self.ready.wait(0.2):
            if io.stopping.is_set() or io.failure is not None:
                raise SessionFailed(f"round {round}: the node stopped before its ranks captured fragment {fragment}")
        assert self.captured is not None
        mine = io.upload_owned(self.captured)
        refs = {**mine, **io.others_refs(self.seq)}
        n = len(io.plans[fragment])
        if sorted(refs) != list(range(n)):
            raise SessionFailed(f"round {round}: the ranks uploaded chunks {sorted(refs)} of fragment {fragment}'s {n}")
        self.ref = join_refs([refs[k] for k in range(n)])
        self.captured = None
        return self.ref

    def encode(self, dtypes: Mapping[str, str], *, compression: str) -> bytes:
        raise AssertionError("a sharded contribution is uploaded by its ranks (upload), never encoded whole")

    def quantized(self, dtypes: Mapping[str, str]) -> dict[str, QTensor]:
        raise AssertionError("a sharded contribution is uploaded by its ranks (upload), never quantized whole")

    def stream(self, dtypes: Mapping[str, str], *, compression: str) -> PayloadStream:
        raise AssertionError("a sharded contribution is uploaded by its ranks (upload), never streamed whole")


class RecordingIO:
    """Rank 0's ``FragmentIO``: the learner's captures are recorded for every rank to perform."""

    def __init__(self, rt: Recorder) -> None:
        self.rt = rt

    def capture(
        self,
        names: Sequence[str],
        anchor: Mapping[str, np.ndarray],
        *,
        keep: bool = True,
        slot: tuple[int, int] | None = None,
    ) -> Contribution:
        assert slot is not None
        return self.rt.record_publish(*slot)

    def settle(self, fragment: int, round: int, *, merged: bool) -> None:
        pass

    def stage(self, theta: Mapping[str, np.ndarray]) -> Incoming:
        raise AssertionError("a sharded node's follower hands records to LeadRank.announce, never whole parameters")
