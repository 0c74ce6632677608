"""How the ranks of a sharded node hold a fragment (``docs/sharding.md``, sections 1 and 2).

The chunk plan itself lives with the codec (``codec/plan.py``). This module adds how the ranks
hold each tensor (``Layout``, ``shard_range``), which rank owns each chunk (``chunk_owner``,
``owned_chunks``) and which elements move to it (``transfers``). Pure: every rank computes the
same answers from (plan, layout).

Where the rest of a chunked payload lives: refs and digests in ``protocol/records.py``; encoding a
chunk in ``codec/plan.py`` and ``codec/payload.py``; fetching and uploading chunks on ``RunStore``
(``protocol/store.py``); moving pieces between ranks in ``adapters/torch_transfer.py``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..codec.plan import Piece, numel


def shard_range(shape: Sequence[int], world: int, coord: int) -> tuple[int, int]:
    """The flat elements ``[start, stop)`` of a tensor that mesh coordinate ``coord`` holds under
    ``Shard(0)``: ``torch.chunk``'s ``ceil(rows / world)`` rows per rank, clipped to the tensor."""
    if not shape:  # 0-d: one element, on coordinate 0 (FSDP2 never shards these)
        return (0, 1) if coord == 0 else (1, 1)
    rows, inner = int(shape[0]), numel(shape[1:])
    per = -(-rows // world)
    lo, hi = min(coord * per, rows), min((coord + 1) * per, rows)
    return lo * inner, hi * inner


@dataclass(frozen=True)
class Layout:
    """How the ranks of a sharded node hold each tensor: rank ``r`` holds the flat elements
    ``[bounds[name][r], bounds[name][r + 1])`` (one contiguous range per rank, in rank order; empty
    ranges allowed). FSDP2's ``Shard(0)`` (``shard0``) and FSDP1's flat parameters both give one."""

    world: int
    bounds: Mapping[str, tuple[int, ...]]

    @classmethod
    def shard0(cls, shapes: Mapping[str, Sequence[int]], world: int) -> Layout:
        """``Shard(0)`` on a 1-D mesh of ``world`` ranks (``shard_range``)."""
        return cls(
            world,
            {
                n: (*(shard_range(s, world, c)[0] for c in range(world)), shard_range(s, world, world - 1)[1])
                for n, s in shapes.items()
            },
        )

    def range(self, name: str, coord: int) -> tuple[int, int]:
        b = self.bounds[name]
        return b[coord], b[coord + 1]

    def holder(self, name: str, element: int) -> int:
        """The rank holding flat ``element`` of ``name``."""
        return bisect.bisect_right(self.bounds[name], element) - 1

    def split(self, piece: Piece) -> Iterator[tuple[int, int, int]]:
        """``(rank, start, stop)``: the parts of ``piece`` each rank holds, in element order."""
        at = piece.start
        while at < piece.stop:
            h = self.holder(piece.name, at)
            stop = min(piece.stop, self.range(piece.name, h)[1])
            yield h, at, stop
            at = stop

    def renamed(self, names: Mapping[str, str]) -> Layout:
        """The same ranges under other names (``{new: old}``): e.g. ``momentum/x`` held as ``x``."""
        return Layout(self.world, {new: self.bounds[old] for new, old in names.items()})


def chunk_owner(pieces: Sequence[Piece], layout: Layout) -> int:
    """The rank that builds (and uploads, and downloads) a chunk: the one holding most of its
    elements (the lowest such rank on a tie; rank 0 for a chunk of empty pieces), so the fewest
    elements move and a chunk straddling two shards goes to the rank with more of it."""
    held = [0] * layout.world
    for p in pieces:
        for h, start, stop in layout.split(p):
            held[h] += stop - start
    return max(range(layout.world), key=lambda r: (held[r], -r))


def owned_chunks(plan: Sequence[Sequence[Piece]], layout: Layout, coord: int) -> list[int]:
    return [k for k, pieces in enumerate(plan) if chunk_owner(pieces, layout) == coord]


@dataclass(frozen=True, order=True)
class Transfer:
    """Elements of ``piece`` (a sub-range of a piece of ``chunk``) that ``src`` holds and
    ``dst``, the chunk's owner, lacks. ``scatter_chunks`` runs the same list backwards."""

    src: int
    dst: int
    chunk: int
    index: int  # of the plan piece (in ``plan[chunk]``) that ``piece`` lies in
    piece: Piece


def transfers(plan: Sequence[Sequence[Piece]], layout: Layout) -> list[Transfer]:
    """Every element a chunk's owner must receive, in (chunk, piece, element) order: the same
    list on every rank, so sender and receiver agree on sizes and order without talking."""
    out = []
    for k, pieces in enumerate(plan):
        owner = chunk_owner(pieces, layout)
        for i, p in enumerate(pieces):
            out += [Transfer(h, owner, k, i, Piece(p.name, lo, hi)) for h, lo, hi in layout.split(p) if h != owner]
    return out
