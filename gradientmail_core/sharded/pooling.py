"""How the ranks of a closing sharded node work together on one op (``closing.py``): every phase
of an op ends with every rank's result pooled on every rank (``Comm.phase``), so a rank that fails
fails the op on every rank at the same point, and the leaves of whole-tensor sums cross as their
exact bits (``Pooled``: float sums as hex, cut leaves' values as base64 of their bytes).

Everything crosses as JSON bytes over a gloo group of the closer's own (never Python objects)."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..aggregators.leaves import LeafRange, combine_leaves
from ..errors import MailboxUnavailable
from ..protocol.records import PayloadRef
from .wire import pack, unpack

_log = logging.getLogger(__name__)


class OpFailed(Exception):
    """A closer op failed on some rank (every rank raises it at the same phase)."""

    def __init__(self, errors: list[tuple[int, dict[str, Any]]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"rank {r}: {e['e']}" for r, e in errors))

    @property
    def unavailable(self) -> bool:
        return all(e.get("t") == "unavailable" for _, e in self.errors)

    @property
    def lost(self) -> tuple[int, str, str] | None:
        """A contribution's chunk no rank could read: (its index in the op, reason, why)."""
        for _, e in self.errors:
            if e.get("t") == "lost":
                return int(e["i"]), str(e["reason"]), str(e["e"])
        return None


class Lost(Exception):
    def __init__(self, i: int, reason: str, why: str) -> None:
        super().__init__(why)
        self.i, self.reason = i, reason


class Comm:
    """Collectives of the closer's ranks: JSON bytes over a gloo group of their own (never Python objects)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

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

    def phase(self, fn: Callable[[], Any]) -> list[Any]:
        """Run ``fn`` here, then pool every rank's result; ``OpFailed`` on every rank if any failed."""
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
        if errors:
            raise OpFailed(errors)
        return [g["v"] for g in got]


def hexf(x: Any) -> str:
    return float(x).hex()


def unhexf(s: str) -> float:
    return float.fromhex(s)


def wire_parts(parts: Mapping[int, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, p in parts.items():
        if isinstance(p, tuple):
            out[str(i)] = [p[0], base64.b64encode(np.ascontiguousarray(p[1]).tobytes()).decode()]
        else:
            out[str(i)] = hexf(p)
    return out


def unwire_parts(got: Mapping[str, Any], kind: str) -> dict[int, Any]:
    dtype = np.float32 if kind == "dot" else np.float64
    out: dict[int, Any] = {}
    for i, p in got.items():
        out[int(i)] = (
            (int(p[0]), np.frombuffer(base64.b64decode(p[1]), dtype=dtype)) if isinstance(p, list) else unhexf(p)
        )
    return out


def ref_wire(r: PayloadRef) -> list[Any]:
    return [r.key, r.sha256, r.size]


def ref_unwire(v: Sequence[Any]) -> PayloadRef:
    return PayloadRef(key=str(v[0]), sha256=str(v[1]), size=int(v[2]))


# ---- one rank's part -----------------------------------------------------------------------------


@dataclass
class Pooled:
    """The leaves of several tensors, one ``LeafRange`` each, pooled over the ranks in one phase."""

    kind: str
    sizes: dict[Any, int]
    ranges: dict[Any, LeafRange]

    def wire(self) -> dict[str, Any]:
        return {pack(k).decode(): wire_parts(r.finish()) for k, r in self.ranges.items()}

    def leaves(self, pooled: Sequence[Mapping[str, Any]]) -> dict[Any, list[float]]:
        out = {}
        for k, size in self.sizes.items():
            key = pack(k).decode()
            out[k] = combine_leaves(size, self.kind, [unwire_parts(p.get(key, {}), self.kind) for p in pooled])
        return out
