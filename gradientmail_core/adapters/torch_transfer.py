"""Moving a sharded model's chunks between its ranks (``docs/sharding.md`` section 3): the owner
of a chunk (``chunk_owner``) receives the elements it lacks from the ranks holding them
(``gather_chunks``) and sends each rank its part back (``scatter_chunks``); ranks pool the refs of
the chunks they uploaded (``gather_refs``). Point-to-point bytes over the mesh's gloo group."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..codec.plan import Piece, chunk_plan
from ..protocol.layout import Transfer, owned_chunks, transfers
from .torch_sharded import Meter, ShardedParams

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
    plan = chunk_plan([(n, sharded.shapes[n]) for n in names], chunk)
    return plan, transfers(plan, sharded.layout)


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
    for k in owned_chunks(plan, sharded.layout, me):
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
