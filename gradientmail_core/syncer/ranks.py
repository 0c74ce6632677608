"""The ranks a closer runs on, behind the three collectives its work needs (``Ranks``).

A closer holds, of each tensor, one contiguous flat range (``protocol.chunks.Layout``): one
process holds every tensor whole (``OneProcess``, ``whole_layout``); each rank of a sharded node
the range its FSDP shard holds (``sharded/pooling.GlooRanks``). The closer's work
(``kernel.FragmentCloser``) is written once over ranges and talks to the other ranks only here:

- ``phase(fn)``: run ``fn`` on every rank and pool the results (a rank that fails fails the phase
  on every rank at the same point);
- ``gather``: each chunk of a payload at the rank that owns it (``chunk_owner``), its pieces
  sent by the ranks that hold them;
- ``scatter``: the reverse, the pieces of the chunks a rank owns back to their holders.

Whole-tensor sums (norms, the cosine) cross a phase as their leaves (``Pooled``): each rank sums
the reduction leaves inside its range and sends the values of the leaves its range cuts; every
leaf is then summed once over its elements joined, so the totals are the one-process bits.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from ..aggregators.leaves import LeafRange, combine_leaves, cosine_range, dot_range, dot_total
from ..protocol.chunks import Layout, Piece, fragment_plan, numel

T = TypeVar("T")
Owned = dict[int, list[tuple[Piece, np.ndarray]]]  # chunk -> its pieces' values, at the chunk's owner


class Ranks(Protocol):
    rank: int
    world: int

    def phase(self, fn: Callable[[], T]) -> list[T]:
        """``fn()`` here, then every rank's result in rank order (on every rank)."""
        ...

    def gather(
        self, shapes: Mapping[str, Sequence[int]], layout: Layout, chunk: int | None, local: Mapping[str, np.ndarray]
    ) -> Owned:
        """Collective: the chunks of a payload of ``shapes`` this rank owns, from each holder's flat
        range ``local[name]``. Pieces this rank holds whole may be views of ``local``."""
        ...

    def scatter(
        self,
        shapes: Mapping[str, Sequence[int]],
        layout: Layout,
        chunk: int | None,
        owned: Owned,
        local: Mapping[str, np.ndarray],
    ) -> None:
        """Collective, the reverse of ``gather``: every holder's ``local`` ranges get their elements
        of every chunk from its owner."""
        ...


def flat(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).reshape(-1)


class OneProcess:
    """Every range in this process: a phase is a call, a gather a set of views, a scatter a copy
    of what is not in place already."""

    rank, world = 0, 1

    def phase(self, fn: Callable[[], T]) -> list[T]:
        return [fn()]

    def gather(
        self, shapes: Mapping[str, Sequence[int]], layout: Layout, chunk: int | None, local: Mapping[str, np.ndarray]
    ) -> Owned:
        plan = fragment_plan(shapes, chunk)
        return {k: [(p, flat(local[p.name])[p.start : p.stop]) for p in pieces] for k, pieces in enumerate(plan)}

    def scatter(
        self,
        shapes: Mapping[str, Sequence[int]],
        layout: Layout,
        chunk: int | None,
        owned: Owned,
        local: Mapping[str, np.ndarray],
    ) -> None:
        for pieces in owned.values():
            for p, values in pieces:
                dest = flat(local[p.name])[p.start : p.stop]
                if not np.shares_memory(dest, values):
                    dest[...] = values


def whole_layout(shapes: Mapping[str, Sequence[int]]) -> Layout:
    """One process holding every tensor whole."""
    return Layout(1, {n: (0, numel(s)) for n, s in shapes.items()})


class Pooled:
    """One float64 sum per tensor (``kind``: ``"dot"``, a squared norm's leaves; ``"cosine"``, the
    cosine's leaf squares) over this rank's ``ranges``, pooled in a phase (module docstring).
    ``start()`` inside the phase (an attempt begins afresh), ``feed`` the range's values in order,
    return ``wire()`` from the phase; ``leaves``/``totals`` on what the phase pooled."""

    def __init__(self, kind: str, sizes: Mapping[str, int], ranges: Mapping[str, tuple[int, int]]) -> None:
        self.kind, self.sizes, self.bounds = kind, dict(sizes), dict(ranges)
        self.ranges: dict[str, LeafRange] = {}

    def start(self) -> None:
        make = dot_range if self.kind == "dot" else cosine_range
        self.ranges = {n: make(size, *self.bounds[n]) for n, size in self.sizes.items()}

    def feed(self, name: str, values: np.ndarray) -> None:
        self.ranges[name].feed(values)

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, r in self.ranges.items():
            parts: dict[str, Any] = {}
            for i, p in r.finish().items():
                if isinstance(p, tuple):
                    parts[str(i)] = [p[0], base64.b64encode(np.ascontiguousarray(p[1]).tobytes()).decode()]
                else:
                    parts[str(i)] = float(p).hex()
            out[name] = parts
        return out

    def leaves(self, pooled: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
        dtype = np.float32 if self.kind == "dot" else np.float64
        out = {}
        for name, size in self.sizes.items():
            ranks = []
            for got in pooled:
                parts: dict[int, Any] = {}
                for i, p in got.get(name, {}).items():
                    parts[int(i)] = (
                        (int(p[0]), np.frombuffer(base64.b64decode(p[1]), dtype=dtype))
                        if isinstance(p, list)
                        else float.fromhex(p)
                    )
                ranks.append(parts)
            out[name] = combine_leaves(size, self.kind, ranks)
        return out

    def totals(self, pooled: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Each tensor's squared norm (``kind == "dot"``), the one-process bits."""
        return {n: dot_total(self.sizes[n], leaves) for n, leaves in self.leaves(pooled).items()}
