"""How the ranks of a sharded node talk: one exchange per step on the training threads, and two
background channels (``docs/sharding.md``, section 6).

Everything crosses as tensors of bytes holding canonical JSON (never pickled Python objects:
no ``*_object`` collective), over gloo groups of their own made when the session opens, so the
training's own process group (NCCL on GPUs) is never used from a second thread and the exchange
never waits on device work.

- ``Exchange`` (training threads, collective): each rank gives ``[bytes, done, failed]``
  (``all_gather`` of three int64); when rank 0 has something to say, its bytes follow in one
  ``broadcast``. One tiny collective per step, two when rank 0's learner acted.
- ``Channel`` (background threads, point to point): a message is its size (one int64) then its
  bytes. ``up`` carries each rank's chunk refs to rank 0; ``down`` carries each commit's refs from
  rank 0 to the other ranks. Each group is used by one thread per rank at a time.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..protocol.records import PayloadRef, chunk_refs, join_refs
from ..syncer.commit import Accepted, CommitOp

# The exchange waits as long as rank 0's learner waits (lockstep: for the other nodes' rounds, a
# lease timeout, a slow closer): far longer than a collective of the training ever takes.
WAIT = timedelta(hours=24)


def pack(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def unpack(data: bytes) -> Any:
    return json.loads(data.decode())


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def new_group() -> Any:
    """A gloo group of every process (collective: every rank calls it, in the same order)."""
    return dist.new_group(backend="gloo", timeout=WAIT)


class Exchange:
    """The per-step collective of the training threads (see the module docstring)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.calls = 0  # collectives issued (for the cost figures)

    def __call__(self, message: Any | None, *, done: bool, failed: bool) -> tuple[Any | None, bool, list[int]]:
        """Every rank calls it; rank 0 passes its message (None: nothing), the others None.
        Returns (rank 0's message or None, rank 0's ``done``, the ranks that reported failure)."""
        data = pack(message) if message is not None and self.rank == 0 else b""
        head = torch.tensor([len(data), int(done), int(failed)], dtype=torch.int64)
        heads = [torch.empty_like(head) for _ in range(self.world)]
        dist.all_gather(heads, head, group=self.group)
        self.calls += 1
        size = int(heads[0][0])
        got = None
        if size:
            buf = _tensor(data) if self.rank == 0 else torch.empty(size, dtype=torch.uint8)
            dist.broadcast(buf, group_src=0, group=self.group)
            self.calls += 1
            got = unpack(buf.numpy().tobytes())
        return got, bool(heads[0][1]), [r for r, h in enumerate(heads) if int(h[2])]

    def agree(self, ok: bool, *, timeout: float | None = None) -> bool:
        """Collective: True when every rank says ok (before a step every rank must take together).
        ``timeout``: at most that many seconds, else raises (a rank that never comes)."""
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        assert work is not None
        work.wait(timedelta(seconds=timeout)) if timeout is not None else work.wait()
        self.calls += 1
        return bool(flag.item())


class Channel:
    """Point-to-point JSON messages on one gloo group (see the module docstring)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, dst: int, message: Any, *, timeout: float | None = None) -> None:
        """Returns once ``dst`` received it (``timeout``: at most that many seconds, else raises)."""
        data = pack(message)
        wait = timedelta(seconds=timeout) if timeout is not None else None
        for t in (torch.tensor([len(data)], dtype=torch.int64), _tensor(data)):
            if t.numel():
                work = dist.isend(t, group_dst=dst, group=self.group)
                if work is not None:
                    work.wait(wait) if wait is not None else work.wait()

    def recv(self, src: int | None = None) -> tuple[int, Any]:
        """The next message (from ``src``, or from any rank): (sender, message)."""
        size = torch.empty(1, dtype=torch.int64)
        # Our groups hold every process in order: a group rank is the global rank.
        sender = (
            dist.recv(size, group_src=src, group=self.group) if src is not None else dist.recv(size, group=self.group)
        )
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            dist.recv(buf, group_src=sender, group=self.group)
        return int(sender), unpack(buf.numpy().tobytes())


# ---- a closer op's arguments (``pooling.GlooRanks.begin``, ``leading.run_op``) ------------------


def wire(v: Any) -> Any:
    """An op's argument as JSON."""
    if isinstance(v, PayloadRef):
        return {"ref": [[c.key, c.sha256, c.size] for c in chunk_refs(v)]}
    if isinstance(v, CommitOp):
        head = [v.f, v.round, v.version, v.final, v.checkpoint, v.compression]
        return {"commit": [*head, [[wire(join_refs(list(a.refs))), a.weight, a.norms] for a in v.accepted]]}
    return v


def unwire(v: Any) -> Any:
    if isinstance(v, dict) and "ref" in v:
        return join_refs([PayloadRef(key=str(k), sha256=str(s), size=int(n)) for k, s, n in v["ref"]])
    if isinstance(v, dict) and "commit" in v:
        f, r, version, final, checkpoint, compression, accepted = v["commit"]
        made = tuple(Accepted(tuple(chunk_refs(unwire(x))), w, n) for x, w, n in accepted)
        return CommitOp(f, r, version, final, checkpoint, compression, made)
    return v
