"""Chunked payloads on a sharded node: which rank builds which chunk (``docs/sharding.md``,
sections 1 and 2; ``docs/protocol.md``, "Chunked payloads").

The plan itself (the line, the cut every ``C`` elements, ``Piece``, ``fragment_plan``,
``assemble``) is pure payload layout and lives with the codec, in ``codec/plan.py``; its names
are re-exported here so existing imports keep working. This module holds what a sharded node adds
on top: how its ranks hold each tensor (``Layout``, ``shard_range``) and, from that, which rank
owns each chunk (``chunk_owner``, ``owned_chunks``) and which elements move to it
(``Transfer``, ``transfers``).

API for sharded nodes
---------------------

The plan (``codec/plan.py``, pure; re-exported here) and the ownership functions (this module;
the same names and signatures as ``adapters/torch_sharded.py``'s):

- ``BLOCK``, ``Piece(name, start, stop)`` (``.size``), ``numel(shape)``, ``check_chunk(C)``,
  ``offsets(shapes)``, ``chunk_plan(shapes, C) -> list[list[Piece]]``, ``shard_range``,
  ``Layout`` (``.holder``), ``chunk_owner``, ``owned_chunks``, ``Transfer``, ``transfers`` (``shapes``: a
  sequence of ``(name, shape)`` in fragment order, or for the ownership functions a mapping).
- ``fragment_plan(shapes, chunk_elements) -> list[list[Piece]]``: ``chunk_plan``, or for
  ``None`` one chunk of whole tensors. ``shapes``: an ordered mapping (``RunInfo.shapes[f]``) or
  a sequence of pairs. ``RunInfo.chunk_elements`` is the run's ``C``; ``RunInfo.plan(f)`` and
  ``RunInfo.outer_plan(f)`` are the plans of a fragment's parameters/deltas/changes and of its
  outer state.
- ``is_whole(piece, shapes)``, ``piece_view(flat, piece)``, ``piece_shape(piece, shapes)`` (the
  shape a piece is stored with: the tensor's shape when whole, else ``(size,)``),
  ``assemble(plan, chunks, shapes) -> {name: array}`` (full tensors from each chunk's
  ``{name: values}``; every element covered exactly once, else ``PayloadCorrupt``).

Refs and digests (``protocol/records.py``):

- ``PayloadRef.more: list[PayloadRef]``: chunks 1..n-1 (the ref itself is chunk 0); left out of
  the JSON when empty; entries may not have ``more`` themselves.
- ``chunk_refs(ref) -> list[PayloadRef]`` (each without ``more``), ``join_refs(refs) ->
  PayloadRef`` (the inverse), ``ref_digest(ref)`` (``ref.sha256`` for one chunk, else the sha256
  of the chunks' sha256 hex strings concatenated in order: what ``Participant.payload_sha256``,
  ``theta_digest`` and ``outer_digest`` hold), ``digest_of(shas)``, ``ref_size(ref)`` (bytes of
  all chunks).

Encoding one chunk (``codec/plan.py``, ``codec/payload.py``, ``codec/quant.py``):

- ``ChunkSpec(k, n, pieces, shapes)``: ``.expected`` (stored name -> logical shape) and ``.meta``
  (the ``"pieces"``/``"chunk"`` metadata; empty for one chunk of whole tensors);
  ``chunk_specs(shapes, chunk_elements) -> list[ChunkSpec]``.
- F8_E4M3 has one scale per tensor: a chunk holding part of an F8 tensor must be given the
  tensor-wide scale byte, ``f8_scales={name: quant.e4m3_scale_byte(amax)}``, where ``amax`` is the
  tensor's finite absolute maximum: ``all_reduce(MAX)`` over the ranks of ``quant.e4m3_amax(local
  part)`` (exact). Whole tensors, and F4/I2/BF16/F16/F32 pieces, need nothing.
- ``encode_payload(values, dtypes, *, kind, compression, chunk=spec, f8_scales=None,
  stream=True) -> PayloadStream``: ``values[name]`` is the piece's float32 values (flat,
  ``piece.size`` elements; a whole tensor may have its shape), its whole tensor's (cut there), or
  a ``quant.QTensor`` of either (quantized already: an F4/I2 piece is the byte slice of the whole
  tensor's codes and scales). Every chunk of a whole fragment: one such call per
  ``chunk_specs(shapes, chunk_elements)``.
- ``decode_payload(parts, spec, *, size, sha256, ...)``: one chunk's stream checked against its
  spec and decoded.

The store (``protocol/store.py``, ``RunStore``):

- ``get_payload(ref, expected, *, max_bytes=None, dtypes=None, chunk_elements=None)``: the whole
  fragment, assembled from every chunk (each fetched, size- and sha256-checked, decoded against
  the plan); ``None`` if any chunk is gone; ``PayloadCorrupt`` for a wrong chunk count, order, or
  any bad chunk; nothing half-assembled is ever returned. ``expected``: ordered shapes (the plan
  follows the order). ``max_bytes`` bounds the chunks' total; each chunk is also capped by its
  own largest size (``header.default_payload_cap`` of its pieces).
- ``get_chunk(ref, pieces, *, shapes, k, n, dtypes=None, max_bytes=None, kind=None) ->
  dict[str, np.ndarray] | None``: one chunk (``ref``: that chunk's ref, e.g. ``chunk_refs(r)[k]``),
  verified, as ``{piece name: flat float32 values of the piece}``; ``None`` if gone.
- ``put_chunk(key_for_sha, values, pieces, *, shapes, k, n, dtypes, kind, compression,
  f8_scales=None) -> PayloadRef``: encodes one chunk (``encode_payload``) and uploads it under
  ``key_for_sha(sha256)`` (e.g. ``functools.partial(keys.snapshot_blob_key, round, learner,
  compression=compression)``, ``keys.round_blob_key(r, kind, sha, compression)``,
  ``keys.init_blob_key(f, sha, compression)``). Equivalent: ``put_payload(key_for_sha,
  encode_payload(..., chunk=spec, stream=True))``. Join the chunk refs in chunk order with ``join_refs``.
- ``put_fragment(key_for_sha, tensors, *, shapes, dtypes, chunk_elements, kind, compression,
  on_chunk=None) -> PayloadRef``: every chunk of a whole fragment (float32 or ``QTensor``s),
  uploaded in order, refs joined.

The engine (``syncer/publishing.py``): a contribution object with a method ``upload(store, run,
fragment, round, learner, compression) -> PayloadRef`` is uploaded by that method (a sharded
node's ranks upload their chunks; it returns the joined ref) instead of by the node; the node
then writes the snapshot record naming that ref.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..codec.plan import (
    BLOCK,
    Piece,
    Shapes,
    assemble,
    check_chunk,
    chunk_plan,
    fragment_plan,
    is_one_whole_chunk,
    is_whole,
    numel,
    offsets,
    piece_shape,
    piece_view,
)

__all__ = [
    # the plan, from codec/plan.py
    "BLOCK",
    "Piece",
    "Shapes",
    "assemble",
    "check_chunk",
    "chunk_plan",
    "fragment_plan",
    "is_one_whole_chunk",
    "is_whole",
    "numel",
    "offsets",
    "piece_shape",
    "piece_view",
    # rank ownership
    "Layout",
    "Transfer",
    "chunk_owner",
    "owned_chunks",
    "shard_range",
    "transfers",
]


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

    def renamed(self, names: Mapping[str, str]) -> Layout:
        """The same ranges under other names (``{new: old}``): e.g. ``momentum/x`` held as ``x``."""
        return Layout(self.world, {new: self.bounds[old] for new, old in names.items()})


def chunk_owner(pieces: Sequence[Piece], layout: Layout) -> int:
    """The rank that builds (and uploads, and downloads) a chunk: the one holding most of its
    elements (the lowest such rank on a tie; rank 0 for a chunk of empty pieces), so the fewest
    elements move and a chunk straddling two shards goes to the rank with more of it."""
    held = [0] * layout.world
    for p in pieces:
        at = p.start
        while at < p.stop:
            h = layout.holder(p.name, at)
            stop = min(p.stop, layout.range(p.name, h)[1])
            held[h] += stop - at
            at = stop
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
            if not p.size:
                continue
            at = p.start
            while at < p.stop:
                h = layout.holder(p.name, at)
                stop = min(p.stop, layout.range(p.name, h)[1])
                if h != owner:
                    out.append(Transfer(h, owner, k, i, Piece(p.name, at, stop)))
                at = stop
    return out
