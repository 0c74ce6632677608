"""The passes of a commit over the ranges this process holds: each quantity ``aggregators/merge.py``
defines, with ``fused.py``'s float operations in the same order, a chunk (or a block) and a range
at a time, so one process and the ranks of a sharded node write the same bytes.

Pass 0 (RDA with clipping): each clipped contribution's radial norms. Pass 1 (RDA): the merged
norm of each radial tensor. Pass 2: every chunk merged (with the cosine's sums), scaled and
stepped. Whole-tensor sums cross the ranks as leaves (``Pooled``). Spooled chunks on disk are
merged a chunk at a time, contribution by contribution (the next read ahead); chunks in memory a
block of one tensor at a time, all contributions together."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..aggregators import fused
from ..aggregators import merge as merge_mod
from ..aggregators import outer as outer_mod
from ..aggregators.fused import cosine_from, cosine_into, cosine_units, merge_into, norm_of
from ..aggregators.leaves import Pooled, combine_leaves, dot_range, dot_total
from ..ahead import ordered
from ..codec.plan import ChunkSpec, numel
from ..config import DiLoCo
from .commit import CommitOp, FragmentState
from .ranges import Ranks, Visit, flat

T = TypeVar("T")
BLOCK = 1 << 20  # elements of one tensor merged at once from contributions held in memory
READ_AHEAD = 1  # contribution chunks read and decoded ahead of the one merged (large fragments)


@dataclass(frozen=True)
class Source:
    """The accepted contributions' chunks: ``chunk(i, k)`` (decoded, ``{piece name: flat values}``;
    ``Lost`` when gone), ``in_memory`` when every one is held decoded (the spool's policy for a
    fragment of one chunk), ``threaded`` to read ahead on a worker."""

    chunk: Callable[[int, int], dict[str, np.ndarray]]
    in_memory: bool
    threaded: bool

    def stream(self, pairs: Sequence[tuple[int, int]]) -> Generator[dict[str, np.ndarray], None, None]:
        threads = READ_AHEAD if self.threaded and len(pairs) > 1 else 0
        yield from ordered(lambda ik: self.chunk(*ik), pairs, threads=threads, queued=READ_AHEAD + 1, name="read")


def merge_terms(
    cfg: DiLoCo, weights: Sequence[float], sq: Sequence[Mapping[str, float]]
) -> tuple[list[float], list[np.float32 | None], list[float | None] | None]:
    """What the merge needs before reading any contribution: the normalized weights, each one's
    clipping factor (``float32(c / |d_i|)`` from its judged whole-fragment norm, None when not
    clipped) and the cosine's unit factors."""
    n = len(weights)
    p = merge_mod.normalized(list(weights), n)
    clips: list[np.float32 | None] = [None] * n
    if cfg.clip_norm is not None:
        if not cfg.clip_norm > 0:
            raise ValueError(f"clip_norm={cfg.clip_norm!r}: expected a number > 0")
        for i in range(n):
            norm = norm_of(sq[i])
            if not norm <= cfg.clip_norm:
                clips[i] = np.float32(cfg.clip_norm / norm)
    return p, clips, cosine_units([norm_of(s) for s in sq])


def merge_scales(
    names: Sequence[str], radial: set[str], p: Sequence[float], x_sq: Sequence[Mapping[str, float]]
) -> tuple[dict[str, list[Any]], dict[str, float]]:
    """Each tensor's merge scales: ``float32(p_i)`` (weighted mean), or RDA's ``float32(p_i / |x_i|)``
    (None for a zero contribution) and its length ``sum_i p_i |x_i|`` (``fused.merge_tensor``)."""
    scales: dict[str, list[Any]] = {}
    radius: dict[str, float] = {}
    for name in names:
        if name not in radial:
            scales[name] = [np.float32(p_i) for p_i in p]
            continue
        norms = [math.sqrt(x_sq[i][name]) for i in range(len(p))]
        scales[name] = [np.float32(p_i / n) if n > 0.0 else None for p_i, n in zip(p, norms, strict=True)]
        radius[name] = fused.rda_radius(p, norms)
    return scales, radius


@dataclass(frozen=True)
class Span:
    """What one process holds of a fragment: each tensor's range, the chunks, the part of each chunk
    in its ranges, the tensors RDA merges radially, and those whose merged norm needs a pass of its
    own (``split``: spanning chunks, or not held whole by one rank)."""

    shapes: Mapping[str, tuple[int, ...]]
    ranges: dict[str, tuple[int, int]]
    specs: list[ChunkSpec]
    visits: list[Visit]
    radial: set[str]
    split: set[str]


def merge_and_step(
    cfg: DiLoCo,
    ranks: Ranks,
    span: Span,
    source: Source,
    op: CommitOp,
    st: FragmentState,
    out: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], Callable[[], float | None]]:
    """``(new master, new momentum, cosine)`` of this process's ranges, written into ``out``;
    ``cosine()`` gives the cosine (a phase: call it on every rank, after the payloads)."""
    shapes, ranges, visits, radial, split = span.shapes, span.ranges, span.visits, span.radial, span.split
    names, sizes, final = list(shapes), {n: numel(s) for n, s in shapes.items()}, op.final
    n, sq = len(op.accepted), [a.norms for a in op.accepted]
    p, clips, units = merge_terms(cfg, [a.weight for a in op.accepted], sq)

    def part(i: int, k: int, clipped: Sequence[tuple[Any, int, int]], got: Mapping[str, np.ndarray] | None = None):
        got = source.chunk(i, k) if got is None else got
        return [got[pc.name][a:b] for pc, a, b in clipped]

    def pooled_norms(select: set[str], count: int, who: Sequence[int], values: Callable[..., Iterable[list[Any]]]):
        """``count`` squared norms of each tensor in ``select``, pooled over the ranks:
        ``values(k, mine, fetch)`` gives each one's arrays of chunk ``k``'s pieces ``mine``, reading
        the chunks of contributions ``who`` in order with ``fetch(i, k)`` (the next read ahead)."""
        dots = [Pooled("dot", {nm: sizes[nm] for nm in select}, ranges) for _ in range(count)]

        def local() -> list[dict[str, Any]]:
            for d in dots:
                d.start()
            ks = [k for k, clipped in visits if any(c[0].name in select for c in clipped)]
            reads = None if source.in_memory else source.stream([(i, k) for k in ks for i in who])

            def fetch(i: int, k: int) -> dict[str, np.ndarray]:
                return source.chunk(i, k) if reads is None else next(reads)

            with contextlib.closing(reads) if reads is not None else contextlib.nullcontext():
                for k, clipped in visits:
                    mine = [c for c in clipped if c[0].name in select]
                    for d, arrays in zip(dots, values(k, mine, fetch) if mine else (), strict=False):
                        for (pc, _, _), x in zip(mine, arrays, strict=True):
                            d.feed(pc.name, x)
            return [d.wire() for d in dots]

        pooled = ranks.phase(local)
        return [d.totals([p[j] for p in pooled]) for j, d in enumerate(dots)]

    # Pass 0: RDA divides each contribution by its norm, of the clipped values when clipped.
    x_sq: list[dict[str, float]] = [{name: sq[i][name] for name in radial} for i in range(n)]
    clipped_i = [i for i in range(n) if clips[i] is not None]
    if radial and clipped_i:
        got = pooled_norms(
            radial, len(clipped_i), clipped_i,
            lambda k, m, fetch: ([x * clips[i] for x in part(i, k, m, fetch(i, k))] for i in clipped_i),
        )  # fmt: skip
        x_sq = [dict(got[clipped_i.index(i)]) if i in clipped_i else x_sq[i] for i in range(n)]
    scales, radius = merge_scales(names, radial, p, x_sq)
    # Pass 1: the merged norm of each radial tensor that spans chunks or ranks.
    direction: dict[str, float] = {}
    if split:
        merged = pooled_norms(
            split, 1, range(n),
            lambda k, m, fetch: [_merged(m, (part(i, k, m, fetch(i, k)) for i in range(n)), scales, clips, None)[0]],
        )  # fmt: skip
        direction = {nm: math.sqrt(v) for nm, v in merged[0].items()}
    # Pass 2: every chunk merged (and the cosine's sums), scaled, stepped.
    new_master, new_momentum = out
    cos = Pooled("cosine", sizes, ranges) if units is not None else None
    # Contributions held in memory stay there: a large fragment's cosine is summed after the pass,
    # on a worker while the payloads are written (``later``), not in it (2-3x the merge's work).
    defer = cos is not None and source.in_memory and source.threaded
    inline = None if defer else units
    lr, beta = cfg.outer_lr, cfg.outer_momentum

    def step(pc: Any, v: np.ndarray, sq: float | None = None) -> None:
        name, scale = pc.name, None
        if name in radial:
            if name in direction:
                norm = direction[name]
            else:  # this process holds the whole tensor, in this chunk: its norm now (or summed as merged)
                norm = math.sqrt(fused.sq_norms({name: v})[name] if sq is None else sq)
            if norm == 0.0:
                v.fill(0)  # +0.0 everywhere (the direction may hold -0.0)
            else:
                scale = np.float32(radius[name] / norm)
        lo = ranges[name][0]
        a, b = pc.start - lo, pc.stop - lo
        m_old, nm = flat(st.master[name])[a:b], flat(new_master[name])[a:b]
        if cfg.gap_projection:
            if scale is not None:  # (the float32 multiply the step would make)
                np.multiply(v, scale, out=v)
                scale = None
            outer_mod.drop_pullback(v.reshape(-1), m_old, flat(st.theta[name])[a:b])
        if final:
            outer_mod.final_step_tensor(m_old, v, scale=scale, out=nm, name=name)
        else:
            mo = flat(st.momentum[name])[a:b]
            nmo = flat(new_momentum[name])[a:b]
            outer_mod.outer_step_tensor(m_old, mo, v, lr=lr, beta=beta, scale=scale, out=(nm, nmo), name=name)

    def dest(pc: Any) -> np.ndarray:
        # A piece is merged into the new master's elements and stepped there in place (the step
        # reads each element of the merged delta before it writes the new master's): the merge
        # needs no buffer of its own.
        start = pc.start - ranges[pc.name][0]
        return flat(new_master[pc.name])[start : start + pc.size]

    def held(at: tuple[int, Any, int]) -> None:
        """A piece held in memory merged block by block (on worker threads for a large tensor), its
        cosine sums fed in order (each tensor its own), then stepped; its squared norm summed as
        merged when this process takes it (RDA, a tensor held whole)."""
        k, pc, a = at
        v = dest(pc)
        norm_here = pc.name in radial and pc.name not in direction

        def block(lo: int) -> tuple[list[np.ndarray] | None, Any]:
            hi = min(lo + BLOCK, pc.size)
            piece = [(pc, a + lo, a + hi)]
            sums = _merged(piece, (part(i, k, piece) for i in range(n)), scales, clips, inline, into=[v[lo:hi]])[1]
            if not norm_here:
                return sums, None
            d = dot_range(pc.size, lo, hi)  # (the tensor held whole: blocks in its own coordinates)
            d.feed(v[lo:hi])
            return sums, d.finish()

        threads = fused.WORKERS if source.threaded and pc.size > BLOCK else 0
        dots = []
        for sums, dot in ordered(block, range(0, pc.size, BLOCK), threads=threads, queued=2 * threads):
            if cos is not None and sums is not None:
                cos.feed(pc.name, sums[0])
            dots.append(dot)
        step(pc, v, dot_total(pc.size, combine_leaves(pc.size, "dot", dots)) if norm_here else None)

    def merge_read(k: int, clipped: list[Any], reads: Iterator[dict[str, np.ndarray]]) -> None:
        """Chunk ``k`` of each contribution read once and merged as it comes (the next read
        meanwhile), then stepped; its cosine sums let go on return, before the next chunk's."""
        chunks = (part(i, k, clipped, next(reads)) for i in range(n))
        merged, sums = _merged(clipped, chunks, scales, clips, units, into=[dest(pc) for pc, _, _ in clipped])
        for t, ((pc, _, _), v) in enumerate(zip(clipped, merged, strict=True)):
            if cos is not None and sums is not None:
                cos.feed(pc.name, sums[t])
            step(pc, v)

    def pass2() -> dict[str, Any]:
        if cos is not None and not defer:
            cos.start()
        reads = None if source.in_memory else source.stream([(i, k) for k, _ in visits for i in range(n)])
        with contextlib.closing(reads) if reads is not None else contextlib.nullcontext():
            for k, clipped in visits:
                if reads is not None:
                    merge_read(k, clipped, reads)
                    continue
                # Held in memory: a large tensor by blocks side by side, then the smaller ones side
                # by side, each whole on one thread (the order of tensors changes no byte).
                big = [(k, pc, a) for pc, a, _ in clipped if pc.size > BLOCK]
                small = [(k, pc, a) for pc, a, _ in clipped if pc.size <= BLOCK]
                threads = fused.WORKERS if source.threaded and len(small) > 1 else 0
                for c in big:
                    held(c)
                for _ in ordered(held, small, threads=threads, queued=2 * threads):
                    pass
        return cos.wire() if cos is not None and not defer else {}

    pooled = ranks.phase(pass2)
    master, momentum = new_master, (st.momentum if final else new_momentum)
    if cos is None or not defer:
        cosine = cosine_from(units, cos.leaves(pooled) if cos is not None else {}, n)
        return master, momentum, lambda: cosine

    def sums() -> dict[str, Any]:  # the cosine's sums of the contributions held, block by block
        assert cos is not None
        cos.start()
        for k, clipped in visits:
            for pc, a, _ in clipped:
                for lo in range(0, pc.size, BLOCK):
                    piece = [(pc, a + lo, a + min(lo + BLOCK, pc.size))]
                    got = _merged(piece, (part(i, k, piece) for i in range(n)), None, clips, units)[1]
                    if got is not None:
                        cos.feed(pc.name, got[0])
        return cos.wire()

    pool = ThreadPoolExecutor(1, thread_name_prefix="gradientmail-cosine")
    summing = pool.submit(sums)
    pool.shutdown(wait=False)  # (not ``with``: its exit would wait for the sums here)

    def later() -> float | None:  # (a phase: every rank calls it after the payloads are written)
        return cosine_from(units, cos.leaves(ranks.phase(summing.result)), n)

    return master, momentum, later


def _merged(
    pieces: Sequence[tuple[Any, int, int]],
    contributions: Iterable[Sequence[np.ndarray]],
    scales: Mapping[str, Sequence[np.float32 | None]] | None,
    clips: Sequence[np.float32 | None],
    units: Sequence[float | None] | None,
    *,
    into: Sequence[np.ndarray] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """``pieces`` merged, not scaled, from each contribution's values (in learner order, each used
    and dropped in turn) as ``fused._merge_range`` merges them, into ``into`` (or a new buffer);
    with ``units``, each piece's cosine sum (float64, before clipping). ``scales`` None: sums only."""
    sizes = [b - a for _, a, b in pieces]
    starts = np.cumsum([0, *sizes]).tolist()
    if scales is None:
        into = []
    elif into is None:
        buf = np.empty(starts[-1], np.float32)
        into = [buf[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    acc = np.empty(starts[-1], np.float64) if units is not None else None
    first_merge = [True] * len(pieces)
    first_cos = True
    for i, xs in enumerate(contributions):
        u = None if units is None else units[i]
        for t, ((pc, _, _), x) in enumerate(zip(pieces, xs, strict=True)):
            if u is not None and acc is not None:
                cosine_into(acc[starts[t] : starts[t + 1]], x, u, first=first_cos)
            if scales is None:
                continue
            if clips[i] is not None:
                x = x if x.flags.writeable else x.copy()
                x *= clips[i]  # ``merge.clip``: one float32 multiply, before the merge's
            sc = scales[pc.name][i]
            if sc is not None:
                merge_into(into[t], x, sc, first=first_merge[t])
                first_merge[t] = False
        if u is not None:
            first_cos = False
    for t, v in enumerate(into):
        if first_merge[t]:
            v.fill(0)  # no contribution has a direction here
    sums = None if acc is None else [acc[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return list(into), sums
