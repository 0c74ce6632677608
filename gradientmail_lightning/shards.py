"""The ranks of a node whose parameters are FSDP2 DTensors (Lightning ``ModelParallelStrategy``
with ``fully_shard`` in ``configure_model``, Accelerate's FSDP plugin with ``fsdp_version=2``).

Unlike a data-parallel node (``replicas.py``), no rank holds the whole model, so there are no
replicas to mirror: **every rank** opens a ``gm.Session`` under the same learner id, and the
session itself keeps the ranks in step (rank 0 runs the protocol; each ``session.step`` is a
collective over the mesh, see ``docs/sharding.md``, section 6). What the integrations add is
small: the learner id chosen on rank 0 and given to every rank, the node's sample count summed
over its ranks, and a flag that every rank agrees on before and after work that only rank 0
does (waiting for the other learners), so that a failure there never leaves a rank waiting in
a collective.

Collectives carry tensors only (no pickled objects), on the device of the parameters' shards,
over the mesh's process group, so gloo (CPU) and NCCL (GPU) both work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradientmail_core.adapters.torch_sharded import ShardedParams, ShardingUnsupported
from gradientmail_core.errors import SessionFailed

from .replicas import world

# keys.LEARNER_ID: at most 64 characters of [a-z0-9-].
_ID_BYTES = 64


class Shards:
    """One node made of the ranks of one FSDP2 mesh; every rank runs a session."""

    def __init__(self, sharded: ShardedParams) -> None:
        rank, world_size = world()
        if sharded.world != world_size:
            raise ShardingUnsupported(
                f"the parameters are sharded over {sharded.world} of the {world_size} processes: the other "
                "processes would hold replicas that gradientmail does not keep equal. Shard over every process "
                "of the node (fully_shard on a mesh of the whole world, e.g. ModelParallelStrategy("
                "data_parallel_size=N, tensor_parallel_size=1) with mesh=device_mesh['data_parallel'])"
            )
        self.sharded = sharded
        self.group = sharded.group
        self.rank, self.world_size = rank, world_size
        self.device = sharded.device

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def total(self, n: int) -> int:
        """The sum of ``n`` over the node's ranks."""
        if self.world_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return int(t.item())

    def same_id(self, learner_id: str | None) -> str:
        """Rank 0's ``learner_id`` (which rank 0 must have), on every rank."""
        if self.world_size == 1:
            assert learner_id is not None
            return learner_id
        buf = torch.zeros(_ID_BYTES, dtype=torch.uint8, device=self.device)
        if self.leader:
            assert learner_id is not None
            raw = learner_id.encode("ascii")
            if len(raw) > _ID_BYTES:
                raise ValueError(f"learner id {learner_id!r} is longer than {_ID_BYTES} characters")
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(buf, group=self.group, group_src=0)
        return bytes(buf.cpu().tolist()).rstrip(b"\0").decode("ascii")

    def agree(self, failed: bool) -> bool:
        """Collective: whether any rank failed (every rank calls it at the same point)."""
        if self.world_size == 1:
            return failed
        t = torch.tensor([int(failed)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def failed_elsewhere(self, what: str) -> SessionFailed:
        return SessionFailed(f"{what} failed on another rank of this node (this is rank {self.rank}); see its error")
