"""The ranks of a closing sharded node as the merger's ``Ranks`` (``syncer/ranges.py``): rank 0
announces each op (``begin``, to ``leading.run_op`` on the other ranks); a phase pools every
rank's result on every rank, so a failure fails the op everywhere at the same point, raising what
a one-process closer would; pieces move with ``gather_chunks``/``scatter_chunks``. Everything
crosses as JSON bytes over a gloo group of the closer's own (floats read back exactly)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ..adapters.torch_sharded import ShardedParams
from ..adapters.torch_transfer import gather_chunks, scatter_chunks
from ..errors import MailboxUnavailable, SessionFailed
from ..protocol.layout import Layout
from ..syncer.commit import Lost
from ..syncer.ranges import Local, Owned, Shapes, flat
from .wire import pack, unpack, wire

_log = logging.getLogger(__name__)
T = TypeVar("T")


class OpFailed(SessionFailed):
    """A closer op failed on some rank with an error no one-process closer raises (every rank
    raises it at the same phase)."""


class GlooRanks:
    """``Ranks`` over a gloo group of the closer's own. ``relay`` (rank 0 of a node that closes):
    sends an op's message to the other ranks; ``stopping``: set when the node leaves."""

    def __init__(
        self,
        group: Any,
        rank: int,
        world: int,
        relay: Callable[[dict[str, Any]], None] | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        self.group, self.rank, self.world, self.relay, self.stopping = group, rank, world, relay, stopping

    def begin(self, name: str, /, **args: Any) -> None:
        if self.relay is None:
            return  # a rank > 0: running what rank 0 announced
        if self.stopping is not None and self.stopping.is_set():
            raise SessionFailed("the node is stopping")
        self.relay({"op": name, "args": {k: wire(v) for k, v in args.items()}})

    def all(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        data = pack(value)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=self.group)
        most = max(int(s.item()) for s in sizes)
        buf = torch.zeros(most, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(most, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(bufs, buf, group=self.group)
        return [unpack(b[: int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes, strict=True)]

    def phase(self, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` here, then pool every rank's result; if any failed, every rank raises what a
        one-process closer would (``Lost``, ``MailboxUnavailable``), or ``OpFailed``."""
        try:
            mine: dict[str, Any] = {"v": fn()}
        except Lost as e:
            mine = {"e": str(e), "t": "lost", "i": e.i, "reason": e.reason}
        except MailboxUnavailable as e:
            mine = {"e": str(e), "t": "unavailable"}
        except Exception as e:
            _log.debug("closer op failed here", exc_info=True)
            mine = {"e": f"{type(e).__name__}: {e}", "t": "error"}
        got = self.all(mine)
        errors = [(r, g) for r, g in enumerate(got) if "e" in g]
        lost = [g for _, g in errors if g["t"] == "lost"]
        if lost:  # rejected there as any closer rejects a contribution it cannot read
            raise Lost(int(lost[0]["i"]), str(lost[0]["reason"]), str(lost[0]["e"]))
        why = "; ".join(f"rank {r}: {g['e']}" for r, g in errors)
        if errors and all(g["t"] == "unavailable" for _, g in errors):
            raise MailboxUnavailable(f"a rank of this node could not read the store: {why}")
        if errors:
            raise OpFailed(why)
        return [g["v"] for g in got]

    def _params(self, shapes: Shapes, layout: Layout) -> ShardedParams:
        return ShardedParams({}, {n: tuple(s) for n, s in shapes.items()}, self.world, self.rank, self.group, layout)

    def gather(self, shapes: Shapes, layout: Layout, chunk: int | None, local: Local) -> Owned:
        assert chunk is not None, "a sharded node joins chunked runs only"
        tensors = {n: torch.from_numpy(np.ascontiguousarray(flat(v))) for n, v in local.items()}
        got = gather_chunks(self._params(shapes, layout), list(shapes), chunk, tensors)
        return {k: [(p, t.numpy()) for p, t in pieces] for k, pieces in got.items()}

    def scatter(self, shapes: Shapes, layout: Layout, chunk: int | None, owned: Owned, local: Local) -> None:
        assert chunk is not None, "a sharded node joins chunked runs only"
        pieces = {k: [(p, torch.from_numpy(np.ascontiguousarray(v))) for p, v in ps] for k, ps in owned.items()}
        tensors = {n: torch.from_numpy(flat(v)) for n, v in local.items()}  # (views: written in place)
        scatter_chunks(self._params(shapes, layout), list(shapes), chunk, pieces, tensors)
