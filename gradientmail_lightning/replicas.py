"""The ranks of a node that is itself a data-parallel group (Lightning DDP, multi-process
Accelerate).

Rank 0 holds the session and is the only rank that talks to the mailbox. After every real
optimizer step each rank calls :meth:`Replicas.mirror`: rank 0 broadcasts a small header
saying which parameters an alignment just changed (or that its session failed), then those
parameters, so every replica ends the step with rank 0's bytes. Data-parallel training keeps
the replicas equal between alignments; this keeps them equal across alignments.

Collectives carry tensors only (no pickled objects), on the parameters' device, so the same
code runs on gloo (CPU) and NCCL (GPU). Only the default (world) process group is used: the
whole DDP world is one gradientmail node.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence

import torch
import torch.distributed as dist

from gradientmail_core.errors import SessionFailed

# One broadcast moves at most this many elements, so mirroring a large model does not need a
# second copy of all of it at once.
_BUCKET_ELEMENTS = 1 << 26


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    launched = int(os.environ.get("WORLD_SIZE") or 1)
    if launched > 1:
        # Every process would believe it is rank 0 and join the run on its own, under one id.
        raise RuntimeError(
            f"this process is one of WORLD_SIZE={launched} launched processes, but torch.distributed is not "
            "initialized, so each would join the run as a separate learner. Initialize the process group before "
            "training starts: with Accelerate on a machine without GPUs, create Accelerator(cpu=True); with "
            "Lightning, use a DDP strategy (MailboxDiLoCoStrategy) with devices/num_nodes matching the launch."
        )
    return 0, 1


class Replicas:
    """The trainable parameters of one replica, and the collectives that keep replicas equal."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        if not named_params:
            raise ValueError("the model has no trainable parameters")
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.device = self.params[0].device
        self.rank, self.world_size = world()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def total(self, n: int) -> int:
        """The sum of ``n`` over all ranks (the group's global batch)."""
        if self.world_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t)
        return int(t.item())

    def mirror(self, changed: Collection[str] | None, *, failed: bool = False) -> None:
        """Make every rank hold rank 0's values of the parameters in ``changed`` (all when
        None). Every rank calls it at the same point; ``changed`` and ``failed`` are read on
        rank 0 only. Raises ``SessionFailed`` on the other ranks when rank 0 says it failed."""
        if self.world_size == 1:
            return
        header = torch.zeros(len(self.names) + 1, dtype=torch.uint8, device=self.device)
        if self.leader:
            header[0] = int(failed)
            if changed is None:
                header[1:] = 1
            else:
                for n in changed:
                    header[1 + self.index[n]] = 1
        dist.broadcast(header, src=0)
        flags = header.tolist()
        if flags[0]:
            if self.leader:
                return  # the caller re-raises rank 0's own error
            raise SessionFailed(
                f"the gradientmail session on rank 0 failed (this is rank {self.rank}); see rank 0's error"
            )
        chosen = [p for p, f in zip(self.params, flags[1:]) if f]
        if chosen:
            self._broadcast(chosen)

    @torch.no_grad()
    def _broadcast(self, params: list[torch.nn.Parameter]) -> None:
        for bucket in _buckets(params):
            flat = torch.cat([p.detach().reshape(-1) for p in bucket])
            dist.broadcast(flat, src=0)
            if not self.leader:
                offset = 0
                for p in bucket:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()


def _buckets(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of one dtype, at most ``_BUCKET_ELEMENTS`` each (a larger tensor
    travels alone)."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        if not out or out[-1][0].dtype != p.dtype or size + p.numel() > _BUCKET_ELEMENTS:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out
