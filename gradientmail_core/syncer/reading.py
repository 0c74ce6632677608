"""Reading payload chunks for a closer: which chunks, and which part of each piece, lie in this
process's ranges (``visits``), and one chunk read, verified and decoded (``read_chunk``), a
contribution's kept in the ``Spool``: decoded in memory for a one-chunk fragment, else on disk."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..codec.chunked import ChunkSpec
from ..codec.plan import Piece
from ..errors import PayloadCorrupt
from ..protocol.records import PayloadRef
from ..protocol.run import RunInfo, payload_cap
from ..protocol.store import CHUNK_HEADER_ALLOWANCE, RunStore
from .spool import Spool

Visit = tuple[int, list[tuple[Piece, int, int]]]  # chunk k; each piece's part in range, and its slice of the piece


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


def read_chunk(
    store: RunStore,
    spool: Spool | None,
    ref: PayloadRef,
    s: ChunkSpec,
    *,
    dtypes: Mapping[str, str],
    max_bytes: int | None,
    round: int,
    decoded: bool = False,
) -> dict[str, np.ndarray] | None:
    """Chunk ``s`` of a payload (``ref``: that chunk's ref), verified and decoded (``{piece name:
    flat float32 values}``): from the spool (a file there that no longer verifies is read again),
    else downloaded into it, tagged ``round`` (``decoded``: held in memory, else bytes on disk).
    None if the store has no such object; errors as ``RunStore.get_chunk``."""
    cap = s.cap() if max_bytes is None else min(max_bytes, s.cap())
    if ref.more:
        raise PayloadCorrupt(f"{ref.key}: a chunk's ref lists chunks of its own")
    got = spool.read(ref, s, dtypes=dtypes, cap=cap) if spool is not None else None
    if got is not None:
        return got

    def get(tee: Callable[[Any], object] | None) -> dict[str, np.ndarray] | None:
        return store.get_chunk(ref, s.pieces, shapes=s.shapes, k=s.k, n=s.n, dtypes=dtypes, max_bytes=cap, tee=tee)

    if spool is None or decoded:
        fetched = get(None)
        if fetched is None or spool is None:
            return fetched
        spool.hold(ref.sha256, fetched, round)
        return spool.decoded(ref.sha256)
    with spool.writer(ref.sha256, ref.size, round) as w:
        fetched = get(None if w is None else w.write)
        if fetched is not None and w is not None:
            w.commit()
    return None if fetched is None else {name: v.reshape(-1) for name, v in fetched.items()}


def contribution_cap(run: RunInfo, f: int, chunks: int) -> int:
    """The most bytes a contribution to fragment ``f`` of ``chunks`` chunks may declare."""
    return payload_cap(run, f) + CHUNK_HEADER_ALLOWANCE * (chunks - 1)
