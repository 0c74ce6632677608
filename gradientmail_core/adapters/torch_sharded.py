"""FSDP2 (DTensor) parameters cut into fixed, world-size-independent chunks (``docs/sharding.md``).

Groundwork for issue 13: the adapter-level pieces a sharded node needs, with no protocol change.

A fragment's tensors are laid end to end, each starting at a multiple of ``BLOCK`` elements
(32: the F4 and I2 quantizer blocks), and that padded line is cut every ``chunk`` elements
(a multiple of ``BLOCK``). A chunk is a list of ``Piece``s, flat element ranges of tensors, and
every piece starts at a multiple of ``BLOCK`` inside its tensor, so a quantizer block never
straddles two chunks and a chunk's bytes are the same whichever node (and world size) made it.

An FSDP2 rank holds, of each tensor, the rows ``torch.chunk`` gives it along dim 0 (``ceil(rows /
world)`` rows per rank; the last ranks may hold fewer or none): one contiguous flat range. A chunk
is owned by the rank holding its first element; the owner receives the elements it lacks from the
ranks holding them (``gather_chunks``) and, for a commit, sends each rank its part back
(``scatter_chunks``). A rank never holds more than its own shard plus the chunks it owns.

The plan functions (``chunk_plan``, ``shard_range``, ``holder``, ``chunk_owner``, ``transfers``)
are pure and take no tensors; the rest moves torch tensors through ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MissingExtra

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise MissingExtra("torch") from e

BLOCK = 32  # the F4 and I2 quantizer blocks (quant.F4_BLOCK, quant_i2.I2_BLOCK)

Shapes = Sequence[tuple[str, Sequence[int]]]
"""A fragment's tensors in payload order: (name, full shape)."""


class ShardingUnsupported(ValueError):
    """The model is sharded in a way gradientmail cannot cut into chunks (yet)."""


# ---------------------------------------------------------------------------------------------
# The chunk plan (pure)


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
    """Where each tensor starts on the fragment's padded line: the previous one's end, rounded up
    to a multiple of ``BLOCK`` (so every tensor starts on a quantizer block)."""
    out, at = [], 0
    for _, shape in shapes:
        out.append(at)
        at += -(-numel(shape) // BLOCK) * BLOCK
    return out


def chunk_plan(shapes: Shapes, chunk: int) -> list[list[Piece]]:
    """Chunk index -> its pieces, in line order. At least one chunk; a tensor with no elements is
    a zero-length piece of chunk 0 (so a fragment that fits one chunk is a chunk of every tensor)."""
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


def shard_range(shape: Sequence[int], world: int, coord: int) -> tuple[int, int]:
    """The flat elements ``[start, stop)`` of a tensor that mesh coordinate ``coord`` holds under
    ``Shard(0)``: ``torch.chunk``'s ``ceil(rows / world)`` rows per rank, clipped to the tensor."""
    if not shape:  # 0-d: one element, on coordinate 0 (FSDP2 never shards these)
        return (0, 1) if coord == 0 else (1, 1)
    rows, inner = int(shape[0]), numel(shape[1:])
    per = -(-rows // world)
    lo, hi = min(coord * per, rows), min((coord + 1) * per, rows)
    return lo * inner, hi * inner


def holder(shape: Sequence[int], world: int, element: int) -> int:
    """The mesh coordinate holding flat ``element`` of a ``Shard(0)`` tensor."""
    if not shape:
        return 0
    rows, inner = int(shape[0]), numel(shape[1:])
    return (element // inner) // -(-rows // world)


def chunk_owner(pieces: Sequence[Piece], shapes: Mapping[str, Sequence[int]], world: int) -> int:
    """The rank that builds (and uploads, and downloads) a chunk: the holder of its first element."""
    for p in pieces:
        if p.size:
            return holder(shapes[p.name], world, p.start)
    return 0


def owned_chunks(
    plan: Sequence[Sequence[Piece]], shapes: Mapping[str, Sequence[int]], world: int, coord: int
) -> list[int]:
    return [k for k, pieces in enumerate(plan) if chunk_owner(pieces, shapes, world) == coord]


@dataclass(frozen=True, order=True)
class Transfer:
    """Elements of ``piece`` (a sub-range of a piece of ``chunk``) that ``src`` holds and
    ``dst``, the chunk's owner, lacks. ``scatter_chunks`` runs the same list backwards."""

    src: int
    dst: int
    chunk: int
    index: int  # of the plan piece (in ``plan[chunk]``) that ``piece`` lies in
    piece: Piece


def transfers(plan: Sequence[Sequence[Piece]], shapes: Mapping[str, Sequence[int]], world: int) -> list[Transfer]:
    """Every element a chunk's owner must receive, in (chunk, piece, element) order: the same
    list on every rank, so sender and receiver agree on sizes and order without talking."""
    out = []
    for k, pieces in enumerate(plan):
        owner = chunk_owner(pieces, shapes, world)
        for i, p in enumerate(pieces):
            if not p.size:
                continue
            shape = shapes[p.name]
            at = p.start
            while at < p.stop:
                h = holder(shape, world, at)
                stop = min(p.stop, shard_range(shape, world, h)[1])
                if h != owner:
                    out.append(Transfer(h, owner, k, i, Piece(p.name, at, stop)))
                at = stop
    return out


# ---------------------------------------------------------------------------------------------
# FSDP2 parameters


class Meter:
    """The largest tensor the functions below allocated, in bytes (``peak``): the check that no
    rank ever materialises a full fragment."""

    def __init__(self) -> None:
        self.peak = 0

    def empty(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.peak = max(self.peak, n * dtype.itemsize)
        return torch.empty(n, dtype=dtype, device=device)


@dataclass
class ShardedParams:
    """A model's trainable FSDP2 parameters: one 1-D device mesh, every one ``Shard(0)``."""

    params: dict[str, Any]  # name -> DTensor parameter
    shapes: dict[str, tuple[int, ...]]  # full (global) shapes
    world: int
    coord: int  # this rank's coordinate on the mesh
    group: Any  # the mesh's process group

    def local(self, name: str) -> torch.Tensor:
        """The flat view of this rank's shard of ``name``, detached (writes go into the parameter)."""
        return self.params[name].to_local().detach().view(-1)

    def local_range(self, name: str) -> tuple[int, int]:
        return shard_range(self.shapes[name], self.world, self.coord)


def find_sharded(model: Any) -> ShardedParams | None:
    """The model's FSDP2 sharding, or None when no trainable parameter is a DTensor (a plain model).
    ``ShardingUnsupported`` for any other layout, saying which parameter and why."""
    from torch.distributed.tensor import DTensor, Shard

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    dtensors = {n for n, p in params.items() if isinstance(p, DTensor)}
    if not dtensors:
        return None
    if len(dtensors) != len(params):
        plain = sorted(set(params) - dtensors)[:3]
        raise ShardingUnsupported(
            f"parameters {plain} are plain tensors while others are FSDP2 DTensors; gradientmail "
            "needs every trainable parameter sharded (fully_shard the root module too, or freeze them)"
        )
    mesh = None
    for n, p in params.items():
        if p.device_mesh.ndim != 1:
            raise ShardingUnsupported(
                f"parameter {n!r} lives on a {p.device_mesh.ndim}-D device mesh {tuple(p.device_mesh.shape)}; "
                "gradientmail supports FSDP2 on a 1-D mesh (HSDP and TP+FSDP are not supported yet)"
            )
        placement = p.placements[0]
        if type(placement) is not Shard or placement.dim != 0:
            raise ShardingUnsupported(
                f"parameter {n!r} has placement {placement}; gradientmail supports Shard(dim=0) only "
                "(FSDP2's default: drop a custom shard_placement_fn)"
            )
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise ShardingUnsupported(f"parameter {n!r} is on mesh {p.device_mesh}, others on {mesh}: one mesh only")
    assert mesh is not None
    world, coord = mesh.size(), mesh.get_local_rank()
    shapes = {n: tuple(int(d) for d in p.shape) for n, p in params.items()}
    out = ShardedParams(params=params, shapes=shapes, world=world, coord=coord, group=mesh.get_group())
    for n, p in params.items():
        lo, hi = out.local_range(n)
        if p.to_local().numel() != hi - lo:
            raise ShardingUnsupported(
                f"rank {coord} holds {p.to_local().numel()} elements of {n!r} {shapes[n]}, expected {hi - lo} "
                f"(torch.chunk rows over {world} ranks): a sharding gradientmail does not know"
            )
    return out


# ---------------------------------------------------------------------------------------------
# Moving chunks between ranks


Chunk = list[tuple[Piece, torch.Tensor]]
"""A chunk's pieces and their values (1-D tensors of ``piece.size`` elements)."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Sent as bytes: gloo's point-to-point then needs no support for bfloat16/float16.
    return t.contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _exchange(
    sharded: ShardedParams,
    outgoing: Mapping[int, list[torch.Tensor]],
    incoming: Mapping[int, int],
    meter: Meter,
    device: torch.device,
) -> dict[int, torch.Tensor]:
    """Sends each peer its tensors (packed into one byte buffer) and receives ``incoming[peer]``
    bytes from each: one message per pair of ranks that has anything to move."""
    ops, received = [], {}
    for peer, parts in sorted(outgoing.items()):
        size = sum(p.numel() * p.element_size() for p in parts)
        buf = meter.empty(size, torch.uint8, device)
        at = 0
        for p in parts:
            b = _bytes(p)
            buf[at : at + b.numel()].copy_(b)
            at += b.numel()
        ops.append(dist.isend(buf, group=sharded.group, group_dst=peer))
    for peer, size in sorted(incoming.items()):
        received[peer] = meter.empty(size, torch.uint8, device)
        ops.append(dist.irecv(received[peer], group=sharded.group, group_src=peer))
    for op in ops:
        if op is not None:
            op.wait()
    return received


def _as(raw: torch.Tensor, dtype: torch.dtype, meter: Meter) -> torch.Tensor:
    """Bytes received as values of ``dtype`` (copied when their offset is not aligned for it)."""
    if raw.storage_offset() % dtype.itemsize:
        raw = meter.empty(raw.numel(), torch.uint8, raw.device).copy_(raw)
    return raw.view(dtype)


def _plan_for(sharded: ShardedParams, names: Sequence[str], chunk: int) -> tuple[list[list[Piece]], list[Transfer]]:
    shapes = {n: sharded.shapes[n] for n in names}
    plan = chunk_plan([(n, shapes[n]) for n in names], chunk)
    return plan, transfers(plan, shapes, sharded.world)


def _slice(sharded: ShardedParams, local: Mapping[str, torch.Tensor], piece: Piece) -> torch.Tensor:
    """``piece`` (held wholly here) as a view of this rank's flat shard."""
    lo = sharded.local_range(piece.name)[0]
    return local[piece.name][piece.start - lo : piece.stop - lo]


def gather_chunks(
    sharded: ShardedParams,
    names: Sequence[str],
    chunk: int,
    local: Mapping[str, torch.Tensor],
    *,
    meter: Meter | None = None,
) -> dict[int, Chunk]:
    """Collective (every rank of the mesh calls it): the chunks this rank owns, built from the
    flat local shards ``local[name]`` (the parameters, or their deltas, any dtype) and the elements
    the other ranks send. Pieces held wholly here are views of ``local``; the others new tensors."""
    meter = meter or Meter()
    plan, moves = _plan_for(sharded, names, chunk)
    me, device = sharded.coord, next(iter(local.values())).device
    outgoing: dict[int, list[torch.Tensor]] = defaultdict(list)
    incoming: dict[int, int] = defaultdict(int)
    for t in moves:
        if t.src == me:
            outgoing[t.dst].append(_slice(sharded, local, t.piece))
        elif t.dst == me:
            incoming[t.src] += t.piece.size * local[t.piece.name].element_size()
    received = _exchange(sharded, outgoing, incoming, meter, device)
    out: dict[int, Chunk] = {}
    shapes = {n: sharded.shapes[n] for n in names}
    for k in owned_chunks(plan, shapes, sharded.world, me):
        pieces: Chunk = []
        for p in plan[k]:
            lo, hi = sharded.local_range(p.name)
            if lo <= p.start and p.stop <= hi:
                pieces.append((p, _slice(sharded, local, p)))
            else:  # straddles ranks: what is here now, the rest as it is unpacked below
                buf = meter.empty(p.size, local[p.name].dtype, device)
                a, b = max(p.start, lo), min(p.stop, hi)
                if a < b:
                    buf[a - p.start : b - p.start].copy_(local[p.name][a - lo : b - lo])
                pieces.append((p, buf))
        out[k] = pieces
    cursor = dict.fromkeys(received, 0)
    for t in moves:  # unpacked in the order the senders packed
        if t.dst == me:
            nbytes = t.piece.size * local[t.piece.name].element_size()
            raw = received[t.src][cursor[t.src] : cursor[t.src] + nbytes]
            cursor[t.src] += nbytes
            p, buf = out[t.chunk][t.index]
            buf[t.piece.start - p.start : t.piece.stop - p.start].copy_(_as(raw, buf.dtype, meter))
    return out


def apply_local(sharded: ShardedParams, pieces: Chunk, local: Mapping[str, torch.Tensor]) -> int:
    """Writes the part of a chunk's values that this rank holds into the flat shards ``local``
    (casting to their dtype); returns the elements written. Local work, no communication."""
    written = 0
    for p, values in pieces:
        lo, hi = sharded.local_range(p.name)
        a, b = max(p.start, lo), min(p.stop, hi)
        if a < b:
            local[p.name][a - lo : b - lo].copy_(values[a - p.start : b - p.start])
            written += b - a
    return written


def scatter_chunks(
    sharded: ShardedParams,
    names: Sequence[str],
    chunk: int,
    owned: Mapping[int, Chunk],
    local: Mapping[str, torch.Tensor],
    *,
    meter: Meter | None = None,
) -> None:
    """Collective, the reverse of ``gather_chunks``: every rank passes the chunks it owns (say a
    commit it downloaded and decoded, in the shards' dtypes); every rank's shards ``local`` get
    their elements of every chunk, from whichever rank owns it."""
    meter = meter or Meter()
    _, moves = _plan_for(sharded, names, chunk)
    me, device = sharded.coord, next(iter(local.values())).device
    outgoing: dict[int, list[torch.Tensor]] = defaultdict(list)
    incoming: dict[int, int] = defaultdict(int)
    for t in moves:
        if t.dst == me:  # the owner sends each holder its part
            p, values = owned[t.chunk][t.index]
            part = values[t.piece.start - p.start : t.piece.stop - p.start]
            outgoing[t.src].append(part.to(local[t.piece.name].dtype))  # the holder reads its own dtype
        elif t.src == me:
            incoming[t.dst] += t.piece.size * local[t.piece.name].element_size()
    received = _exchange(sharded, outgoing, incoming, meter, device)
    for pieces in owned.values():
        apply_local(sharded, pieces, local)
    cursor = dict.fromkeys(received, 0)
    for t in moves:
        if t.src == me:
            nbytes = t.piece.size * local[t.piece.name].element_size()
            raw = received[t.dst][cursor[t.dst] : cursor[t.dst] + nbytes]
            cursor[t.dst] += nbytes
            apply_local(sharded, [(t.piece, _as(raw, local[t.piece.name].dtype, meter))], local)


def gather_refs(
    sharded: ShardedParams, refs: Mapping[int, tuple[str, int]], device: Any = "cpu"
) -> dict[int, tuple[str, int]]:
    """Collective: every rank's ``{chunk: (sha256 hex, size)}`` of the chunk payloads it uploaded,
    merged and known to every rank. Tensors only (``all_gather_object`` would unserialise Python objects): per chunk
    six int64 words, [chunk, size, sha256 as four words], padded to the largest rank's count.
    ``device``: where the collective's tensors live (``cuda`` for NCCL)."""
    count = torch.tensor([len(refs)], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in range(sharded.world)]
    dist.all_gather(counts, count, group=sharded.group)
    most = max(int(c.item()) for c in counts)
    rows = torch.zeros((max(most, 1), 6), dtype=torch.int64)
    for i, (k, (sha, size)) in enumerate(sorted(refs.items())):
        rows[i, 0], rows[i, 1] = k, size
        rows[i, 2:] = torch.frombuffer(bytearray(bytes.fromhex(sha)), dtype=torch.int64)
    mine = rows.to(device)
    everyone = [torch.empty_like(mine) for _ in range(sharded.world)]
    dist.all_gather(everyone, mine, group=sharded.group)
    out: dict[int, tuple[str, int]] = {}
    for c, got in zip(counts, everyone):
        for row in got[: int(c.item())].cpu():
            k = int(row[0])
            if k in out:
                raise ValueError(f"chunk {k} uploaded by two ranks: ownership differs between ranks")
            out[k] = (row[2:].numpy().tobytes().hex(), int(row[1]))
    return out
