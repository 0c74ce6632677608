"""What one process holds of a fragment and how the processes of a node meet over it. A merger
holds one contiguous flat range of each tensor (``Layout``): all of it in one process
(``OneProcess``), its FSDP shard's on a rank of a sharded node (``sharded/pooling.GlooRanks``);
``visits`` says which chunks of a payload, and which part of each piece, lie in its ranges.

The collectives its work needs (``Ranks``):

- ``begin``: an op starts on every rank (the leading rank announces it);
- ``phase(fn)``: ``fn`` run on every rank, the results pooled (a rank that fails fails the phase on
  every rank); whole-tensor sums cross as their leaves (``aggregators.leaves.Pooled``), so the
  totals are the one-process bits;
- ``gather``: each chunk of a payload at its owner (``chunk_owner``), from the ranks holding it;
- ``scatter``: the reverse, each owner's chunks back to the holders' ranges."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from ..codec.plan import ChunkSpec, Piece, fragment_plan, numel
from ..protocol.layout import Layout

T = TypeVar("T")
Owned = dict[int, list[tuple[Piece, np.ndarray]]]  # chunk -> its pieces' values, at the chunk's owner
Shapes = Mapping[str, Sequence[int]]
Local = Mapping[str, np.ndarray]  # tensor -> this process's flat range of it
Visit = tuple[int, list[tuple[Piece, int, int]]]  # chunk k; each piece's part in range, and its slice of the piece


class Ranks(Protocol):
    rank: int
    world: int

    def begin(self, name: str, /, **args: Any) -> None: ...
    def phase(self, fn: Callable[[], T]) -> list[T]: ...

    def gather(self, shapes: Shapes, layout: Layout, chunk: int | None, local: Local) -> Owned:
        """Collective: the chunks of a payload of ``shapes`` this rank owns, from each holder's flat
        range ``local[name]``. Pieces this rank holds whole may be views of ``local``."""
        ...

    def scatter(self, shapes: Shapes, layout: Layout, chunk: int | None, owned: Owned, local: Local) -> None:
        """Collective, the reverse of ``gather``: every holder's ``local`` ranges get their elements
        of every chunk from its owner."""
        ...


def flat(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).reshape(-1)


class OneProcess:
    """Every range in this process: a phase is a call, a gather a set of views, a scatter a copy
    of what is not in place already."""

    rank, world = 0, 1

    def begin(self, name: str, /, **args: Any) -> None:
        pass

    def phase(self, fn: Callable[[], T]) -> list[T]:
        return [fn()]

    def gather(self, shapes: Shapes, layout: Layout, chunk: int | None, local: Local) -> Owned:
        plan = fragment_plan(shapes, chunk)
        return {k: [(p, flat(local[p.name])[p.start : p.stop]) for p in pieces] for k, pieces in enumerate(plan)}

    def scatter(self, shapes: Shapes, layout: Layout, chunk: int | None, owned: Owned, local: Local) -> None:
        for pieces in owned.values():
            for p, values in pieces:
                dest = flat(local[p.name])[p.start : p.stop]
                if not np.shares_memory(dest, values):
                    dest[...] = values


def alloc(ranges: Mapping[str, tuple[int, int]], shapes: Shapes) -> dict[str, np.ndarray]:
    """Float32 arrays for the ranges a process holds: a tensor held whole in its shape, a range flat."""
    whole = {n: (lo, hi) == (0, numel(shapes[n])) for n, (lo, hi) in ranges.items()}
    return {n: np.empty(tuple(shapes[n]) if whole[n] else hi - lo, np.float32) for n, (lo, hi) in ranges.items()}


def whole_layout(shapes: Mapping[str, Sequence[int]]) -> Layout:
    """One process holding every tensor whole."""
    return Layout(1, {n: (0, numel(s)) for n, s in shapes.items()})


def tensor_of(name: str) -> str:
    """The fragment tensor a payload's tensor name stands for (``momentum/x`` -> ``x``)."""
    head, _, rest = name.partition("/")
    return rest if head in ("momentum", "master") and rest else name


def visits(specs: Sequence[ChunkSpec], ranges: Mapping[str, tuple[int, int]], rank: int) -> list[Visit]:
    """The chunks whose pieces overlap ``ranges``, each piece clipped to its range (a chunk of empty
    pieces only is read by rank 0, so that every chunk is verified)."""
    out: list[Visit] = []
    for s in specs:
        clipped = []
        for pc in s.pieces:
            lo, hi = ranges[pc.name]
            a, b = max(pc.start, lo), min(pc.stop, hi)
            if a < b:
                clipped.append((Piece(pc.name, a, b), a - pc.start, b - pc.start))
        if clipped or (rank == 0 and all(pc.size == 0 for pc in s.pieces)):
            out.append((s.k, clipped))
    return out
