"""The chunk plan: a payload's tensors cut into fixed, world-size-independent chunks
(``docs/protocol.md``, "Chunked payloads"; ``docs/sharding.md``, sections 1 and 2).

A payload's tensors, in its order (the manifest's ``fragments[f]``; for the outer state,
``RunInfo.outer_shapes(f)``'s order), are flattened (C order) and laid end to end on a *line*,
each starting at the previous one's end rounded up to a multiple of ``BLOCK`` (32: the F4 and I2
quantizer blocks). The line is cut every ``C = chunk_elements`` elements (a positive multiple of
``BLOCK``); chunk ``k`` is the list of ``Piece``s (flat element ranges of tensors) in
``[k*C, (k+1)*C)``, and a payload has ``max(1, ceil(line_end / C))`` chunks. A run whose
manifest has no ``chunk_elements`` (``None``: every run created before chunks existed) stores one
chunk of whole tensors per fragment. A payload whose line is at most ``C`` is one chunk of whole
tensors too, and that chunk has exactly the bytes of a whole payload.

A chunk is stored as an ordinary payload holding its pieces (``ChunkSpec``: what chunk ``k`` of
``n`` stores and declares; ``payload.encode_payload``/``decode_payload`` with ``chunk=`` and a
``ChunkSpec`` write and read it): a whole tensor under its name and shape, part of a tensor under
the tensor's name with the 1-D shape ``[stop - start]``, plus the metadata ``"pieces"``
(canonical JSON ``{name: [start, stop]}`` of the partial pieces) and ``"chunk"`` (``"k/n"``, when
``n > 1``). One chunk of whole tensors has neither: it is the whole-fragment payload, byte for byte.

Pure (numpy at most): every node computes the same plan from (shapes, ``C``). Which rank of a
sharded node builds which chunk is not the plan's business (``protocol/layout.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import PayloadCorrupt
from .header import canonical, default_payload_cap

BLOCK = 32  # the F4 and I2 quantizer blocks (quant.F4_BLOCK, quant_i2.I2_BLOCK)

Shapes = Sequence[tuple[str, Sequence[int]]]
"""A payload's tensors in payload order: (name, full shape)."""


@dataclass(frozen=True, order=True)
class Piece:
    """Elements ``[start, stop)`` of tensor ``name``, flattened in C order."""

    name: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def check_chunk(chunk: int) -> int:
    if chunk <= 0 or chunk % BLOCK:
        raise ValueError(f"chunk size must be a positive multiple of {BLOCK} elements, found {chunk}")
    return chunk


def offsets(shapes: Shapes) -> list[int]:
    """Where each tensor starts on the payload's padded line: the previous one's end, rounded up
    to a multiple of ``BLOCK`` (so every tensor starts on a quantizer block)."""
    out, at = [], 0
    for _, shape in shapes:
        out.append(at)
        at += -(-numel(shape) // BLOCK) * BLOCK
    return out


def chunk_plan(shapes: Shapes, chunk: int) -> list[list[Piece]]:
    """Chunk index -> its pieces, in line order. At least one chunk; a tensor with no elements is
    a zero-length piece of chunk 0 (so a payload that fits one chunk is a chunk of every tensor)."""
    check_chunk(chunk)
    starts = offsets(shapes)
    end = max((s + numel(shape) for s, (_, shape) in zip(starts, shapes)), default=0)
    plan: list[list[Piece]] = [[] for _ in range(max(1, -(-end // chunk)))]
    for at, (name, shape) in zip(starts, shapes):
        n = numel(shape)
        if n == 0:
            plan[0].append(Piece(name, 0, 0))
            continue
        for k in range(at // chunk, (at + n - 1) // chunk + 1):
            lo, hi = max(k * chunk, at), min((k + 1) * chunk, at + n)
            plan[k].append(Piece(name, lo - at, hi - at))
    return plan


def _pairs(shapes: Mapping[str, Sequence[int]] | Shapes) -> list[tuple[str, tuple[int, ...]]]:
    items = shapes.items() if isinstance(shapes, Mapping) else shapes
    return [(str(n), tuple(int(d) for d in s)) for n, s in items]


def fragment_plan(shapes: Mapping[str, Sequence[int]] | Shapes, chunk_elements: int | None) -> list[list[Piece]]:
    """The chunks of a payload of these tensors (in this order): ``chunk_plan``, or for a run
    without chunks (``None``) one chunk of whole tensors."""
    pairs = _pairs(shapes)
    if chunk_elements is None:
        return [[Piece(n, 0, numel(s)) for n, s in pairs]]
    return chunk_plan(pairs, chunk_elements)


@dataclass(frozen=True)
class ChunkSpec:
    """Chunk ``k`` of ``n`` of a payload: its pieces, and the full shapes of the payload's tensors."""

    k: int
    n: int
    pieces: tuple[Piece, ...]
    shapes: Mapping[str, tuple[int, ...]]

    @property
    def expected(self) -> dict[str, tuple[int, ...]]:
        """Stored tensor name -> the logical shape it is stored with."""
        return {p.name: piece_shape(p, self.shapes) for p in self.pieces}

    @property
    def meta(self) -> dict[str, str]:
        """The chunk's layout metadata: empty for one chunk of whole tensors."""
        out = {}
        partial = {p.name: [p.start, p.stop] for p in self.pieces if not is_whole(p, self.shapes)}
        if partial:
            out["pieces"] = canonical(partial)
        if self.n > 1:
            out["chunk"] = f"{self.k}/{self.n}"
        return out

    def cap(self) -> int:
        """The largest acceptable payload of this chunk (F32 data, scales, zstd framing, header)."""
        return default_payload_cap(self.expected)


def chunk_spec(pieces: Sequence[Piece], shapes: Mapping[str, Sequence[int]], k: int, n: int) -> ChunkSpec:
    return ChunkSpec(k, n, tuple(pieces), {name: tuple(int(d) for d in s) for name, s in shapes.items()})


def chunk_specs(shapes: Mapping[str, Sequence[int]], chunk_elements: int | None) -> list[ChunkSpec]:
    """Every chunk of a payload of these tensors (in this order)."""
    plan = fragment_plan(shapes, chunk_elements)
    return [chunk_spec(pieces, shapes, k, len(plan)) for k, pieces in enumerate(plan)]


def is_whole(piece: Piece, shapes: Mapping[str, Sequence[int]]) -> bool:
    """Is ``piece`` all of its tensor (stored with the tensor's shape, as a whole payload does)?"""
    return piece.start == 0 and piece.stop == numel(shapes[piece.name])


def is_one_whole_chunk(plan: Sequence[Sequence[Piece]], shapes: Mapping[str, Sequence[int]]) -> bool:
    """One chunk of whole tensors: its payload is the whole-fragment payload, byte for byte."""
    return len(plan) == 1 and all(is_whole(p, shapes) for p in plan[0])


def piece_shape(piece: Piece, shapes: Mapping[str, Sequence[int]]) -> tuple[int, ...]:
    """The logical shape a piece is stored with: its tensor's when whole, else ``(size,)``."""
    return tuple(int(d) for d in shapes[piece.name]) if is_whole(piece, shapes) else (piece.size,)


def piece_view(flat: Any, piece: Piece) -> Any:
    """The piece's elements of its tensor's flat (1-D, C order) values: a view, not a copy."""
    return flat[piece.start : piece.stop]


def assemble(
    plan: Sequence[Sequence[Piece]],
    chunks: Sequence[Mapping[str, np.ndarray]],
    shapes: Mapping[str, Sequence[int]],
) -> dict[str, np.ndarray]:
    """Full float32 tensors (in ``shapes``' order) from each chunk's decoded ``{name: values}``
    (``values``: the piece's elements, any shape of ``piece.size`` elements). Every element of
    every tensor must be covered exactly once by the plan and every piece present with its size:
    anything else is ``PayloadCorrupt``, and nothing is returned."""
    if len(chunks) != len(plan):
        raise PayloadCorrupt(f"{len(chunks)} chunks for a plan of {len(plan)}")
    flats = {n: np.empty(numel(s), np.float32) for n, s in shapes.items()}
    covered = dict.fromkeys(shapes, 0)
    ends = dict.fromkeys(shapes, 0)
    for k, (pieces, got) in enumerate(zip(plan, chunks)):
        if set(got) != {p.name for p in pieces}:
            raise PayloadCorrupt(f"chunk {k} holds {sorted(got)[:10]}, the plan {[p.name for p in pieces][:10]}")
        for p in pieces:
            if p.name not in flats:
                raise PayloadCorrupt(f"chunk {k}: tensor {p.name!r} is not one of the fragment's")
            values = np.asarray(got[p.name])
            if values.size != p.size or p.start != ends[p.name] or p.stop > flats[p.name].size:
                raise PayloadCorrupt(
                    f"chunk {k}: piece {p.name}[{p.start}:{p.stop}] does not continue the tensor at {ends[p.name]} "
                    f"with {values.size} values"
                )
            flats[p.name][p.start : p.stop] = values.reshape(-1)
            ends[p.name] = p.stop
            covered[p.name] += p.size
    for n, flat in flats.items():
        if covered[n] != flat.size or ends[n] != flat.size:
            raise PayloadCorrupt(f"tensor {n!r}: the chunks cover {covered[n]} of its {flat.size} elements")
    return {n: flats[n].reshape(tuple(int(d) for d in s)) for n, s in shapes.items()}
