"""Contribution weights and merges of fragment deltas (SPEC 4.2).

Pure numpy on host arrays. Deltas are float32; the result is float32.

Determinism: a recomputed round must commit the same bytes (SPEC 4.3), so every sum runs in a
fixed order. Contributions are summed in the order given; the caller passes them sorted (by
learner id). Element-wise float32 arithmetic has no reduction order to vary. Scalar reductions
(norms, dot products) run in float64 over fixed-size chunks with ``np.add.reduce`` rather than BLAS
(``np.dot``/``np.linalg.norm``), whose summation order may depend on threads; fragment-level
reductions visit tensors in sorted-name order so a mapping's insertion order does not matter.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..config import RDA, WeightedMean

Delta = Mapping[str, np.ndarray]

# Bounds the float64 temporaries of a reduction (8 MiB) on multi-GB fragments.
_CHUNK = 1 << 20
# Per thread: a reused float64 scratch chunk, and (inside ``memo_norms``) the squared norms of
# the contributions already computed, so a commit reads each contribution once per quantity.
_local = threading.local()
_LEAF = 1 << 15  # float64 elements (256 KiB) a reduction handles at once, in cache
# The merge of a large fragment runs on a few threads, over ranges of each tensor (numpy releases
# the GIL); few, as it runs beside training. Below _PARALLEL_BYTES of contributions, inline.
WORKERS = min(2, os.cpu_count() or 1)
_PARALLEL_BYTES = 32 << 20
# Elements of every contribution the merge handles at once (a multiple of _LEAF): its float32 and
# float64 scratch (1.25 MiB) plus one contribution's chunk stay in L2.
_STEP = 2 * _LEAF


def contribution_weight(tokens: int, steps: int) -> float:
    """``tokens * (tokens / steps)``: more data counts more, and so does a larger batch per step."""
    assert steps > 0, "a zero-step snapshot is rejected before it is weighed"
    return float(tokens) * (float(tokens) / float(steps))


def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``sum(w_i * d_i) / sum(w_i)`` in float32, summed in the given order."""
    return _scaled(*_merge_tensor([_f32(d) for d in deltas], _normalized(weights, len(deltas)), radial=False))


def rda(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Radial-directional averaging of one tensor:
    ``(sum w_i |d_i| / sum w_i) * unit(sum w_i unit(d_i) / sum w_i)``, with ``unit(0) = 0``.

    Unlike the mean, disagreeing directions do not shrink the step's length, only its direction;
    directions that cancel exactly give zero.
    """
    return _scaled(*_merge_tensor([_f32(d) for d in deltas], _normalized(weights, len(deltas)), radial=True))


def merge(
    deltas: Sequence[Delta],
    weights: Sequence[float],
    cfg: WeightedMean | RDA,
    *,
    clip_norm: float | None = None,
) -> dict[str, np.ndarray]:
    """Merge whole-fragment deltas, tensor by tensor, in the order given (callers sort by learner).

    With ``RDA``, tensors whose name contains ``cfg.direct_pattern`` (embeddings, whose rows are
    updated sparsely so per-row norms mean little) use the weighted mean. ``clip_norm`` first
    scales each contribution down to at most that whole-fragment L2 norm (bounds what one bad
    contribution can do). Output names follow the first contribution's order.
    """
    return merge_with_cosine(deltas, weights, cfg, clip_norm=clip_norm, cosine=False)[0]


def merge_with_cosine(
    deltas: Sequence[Delta],
    weights: Sequence[float],
    cfg: WeightedMean | RDA,
    *,
    clip_norm: float | None = None,
    cosine: bool = True,
    each: Callable[[str, np.ndarray, np.float32 | None], object] | None = None,
) -> tuple[dict[str, np.ndarray], float | None]:
    """``(merge(deltas, ...), mean_pairwise_cosine(deltas))``, bit for bit, in one pass.

    Each chunk of every contribution is read from memory once and feeds both the merge's float32
    accumulator and the cosine's float64 one while it is in cache (the closer's time from quorum
    to commit is mostly these passes). The cosine is of the contributions as given, before any
    clipping. ``cosine=False`` skips it (``None``).

    ``each(name, values, scale)``, if given, receives every merged tensor as it is done instead
    of the returned dict (which is then empty): the merged tensor is ``values * scale`` (a float32
    multiply) when ``scale`` is not None, else ``values``. ``values`` lives in one buffer reused
    for the next tensor, so a consumer (the outer step) takes the fragment's merged delta one
    tensor at a time, without a fragment-sized temporary or a pass of its own for the scaling.
    """
    assert deltas, "merge needs at least one accepted contribution"
    names = list(deltas[0])
    for d in deltas[1:]:
        assert set(d) == set(names), f"contributions disagree on tensor names: {sorted(set(d) ^ set(names))[:5]}"
    p = _normalized(weights, len(deltas))
    merged_in = [clip(d, clip_norm) for d in deltas] if clip_norm is not None else list(deltas)
    units = _cosine_units(deltas) if cosine else None
    squares: dict[str, list[float]] = {}
    shared = None if each is None else np.empty(max((np.size(deltas[0][n]) for n in names), default=0), np.float32)
    out: dict[str, np.ndarray] = {}
    workers = WORKERS if sum(np.size(deltas[0][n]) for n in names) * 4 * len(deltas) >= _PARALLEL_BYTES else 1
    with contextlib.ExitStack() as stack:
        pool = (
            stack.enter_context(ThreadPoolExecutor(workers, thread_name_prefix="gradientmail-merge"))
            if workers > 1
            else None
        )
        for name in names:
            radial = isinstance(cfg, RDA) and cfg.direct_pattern not in name
            cos_in = (
                None if units is None else [None if u is None else (deltas[i][name], u) for i, u in enumerate(units)]
            )
            values, scale = _merge_tensor(
                [_f32(d[name]) for d in merged_in],
                p,
                radial=radial,
                cosine=cos_in,
                squares=squares.setdefault(name, []),
                out=None if shared is None else shared[: np.size(deltas[0][name])].reshape(np.shape(deltas[0][name])),
                pool=pool,
                workers=workers,
            )
            if each is None:
                out[name] = _scaled(values, scale)
            else:
                each(name, values, scale)
    return out, _cosine_from(units, squares, len(deltas))


def fragment_norm(delta: Delta) -> float:
    """L2 norm of the flattened whole-fragment delta (float64, deterministic)."""
    return math.sqrt(sum(_sq(delta[k]) for k in sorted(delta)))


def clip(delta: Delta, max_norm: float) -> dict[str, np.ndarray]:
    """``delta`` scaled down to whole-fragment norm ``max_norm``; unchanged (same arrays) if within it."""
    if not max_norm > 0:
        raise ValueError(f"clip_norm={max_norm!r}: expected a number > 0")
    n = fragment_norm(delta)
    if n <= max_norm:
        return dict(delta)
    scale = np.float32(max_norm / n)
    return {k: _f32(v) * scale for k, v in delta.items()}


def mean_pairwise_cosine(deltas: Sequence[Delta]) -> float | None:
    """Mean cosine similarity of the flattened whole-fragment deltas over all pairs.

    A health signal for the round record: near 1 the learners agree, near 0 they pull in unrelated
    directions. ``None`` with fewer than two contributions; a pair with a zero vector counts 0.
    """
    units = _cosine_units(deltas)
    squares: dict[str, list[float]] = {}
    if units is not None:
        for k in deltas[0]:
            cos = [None if u is None else (deltas[i][k], u) for i, u in enumerate(units)]
            _merge_tensor([], [], radial=False, cosine=cos, squares=squares.setdefault(k, []))
    return _cosine_from(units, squares, len(deltas))


def _cosine_units(deltas: Sequence[Delta]) -> list[float | None] | None:
    """``1 / |d_i|`` of each contribution (None for a zero one): the scales of the unit vectors
    whose sum the cosine needs. None when it needs no pass (fewer than two non-zero contributions)."""
    if len(deltas) < 2:
        return None
    units = [1.0 / n if n > 0.0 else None for n in (fragment_norm(d) for d in deltas)]
    return units if sum(u is not None for u in units) >= 2 else None


def _cosine_from(units: Sequence[float | None] | None, squares: Mapping[str, list[float]], n: int) -> float | None:
    """The sum over pairs of u_i . u_j (u_i = d_i / |d_i|) is (|sum_i u_i|^2 - k) / 2 for k unit
    vectors: one pass over the contributions instead of one per pair. ``squares`` holds
    |sum_i u_i|^2 of each tensor's leaves (float64), summed here in sorted-name order."""
    if n < 2:
        return None
    if units is None:
        return 0.0
    square = 0.0
    for k in sorted(squares):
        for v in squares[k]:
            square += v
    k_units = sum(u is not None for u in units)
    # Clamp: rounding can push the mean of (anti)parallel vectors a hair past 1.
    return max(-1.0, min(1.0, (square - k_units) / 2 / (n * (n - 1) // 2)))


def outlier_mask(deltas: Sequence[Delta], *, factor: float) -> list[bool]:
    """``True`` for each contribution whose whole-fragment norm exceeds ``factor`` times the median
    norm of the *other* contributions (a rejection with reason ``outlier``).

    Leave-one-out: an oversized contribution cannot raise the bar it is measured against, and with
    two contributions only the much larger one can be flagged (never both, as ``factor > 1``). A
    single contribution has no peers and is never flagged. A non-finite norm is always an outlier.
    A zero median (all peers did not move) flags any non-zero contribution: that is the rule, and a
    round of zero deltas is suspicious anyway.
    """
    if not factor > 1.0:
        raise ValueError(f"outlier factor={factor!r}: expected a number > 1 (at most 1 could reject everyone)")
    norms = [fragment_norm(d) for d in deltas]
    mask: list[bool] = []
    for i, n in enumerate(norms):
        others = norms[:i] + norms[i + 1 :]
        if not math.isfinite(n):
            mask.append(True)
        elif not others:
            mask.append(False)
        else:
            mask.append(n > factor * float(np.median(others)))
    return mask


def _normalized(weights: Sequence[float], n: int) -> list[float]:
    """Weights divided by their (exactly rounded) sum, in float64.

    Normalising first keeps huge weights (tokens squared) from overflowing float32 products.
    """
    assert n >= 1 and len(weights) == n, (n, len(weights))
    ws = [float(w) for w in weights]
    if any(not (math.isfinite(w) and w >= 0.0) for w in ws):
        raise ValueError(f"weights {ws!r}: expected finite numbers >= 0")
    total = math.fsum(ws)
    if total <= 0.0:
        raise ValueError(f"weights {ws!r} sum to zero: no contribution carries any tokens")
    return [w / total for w in ws]


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """Float64 dot product of two same-shape tensors, summed chunk by chunk in a fixed order."""
    x = np.asarray(a).reshape(-1)
    y = np.asarray(b).reshape(-1)
    assert x.shape == y.shape, (np.shape(a), np.shape(b))
    buf = _scratch(min(x.size, _LEAF))
    leaves = []
    for lo, hi in _dot_leaves(x.size):
        out = buf[: hi - lo]
        # The product of the float64 casts (exact for float32 inputs); square is the faster loop.
        if a is b:
            np.square(x[lo:hi], out=out, dtype=np.float64)
        else:
            np.multiply(x[lo:hi], y[lo:hi], out=out, dtype=np.float64)
        leaves.append(float(np.add.reduce(out)))
    return _dot_total(x.size, leaves)


@functools.lru_cache(maxsize=256)
def _dot_leaves(size: int) -> tuple[tuple[int, int], ...]:
    """The ranges ``_dot`` reduces at once, in ascending order.

    Chunks of ``_CHUNK``, each split the way ``np.add.reduce`` sums pairwise (halves rounded down
    to a multiple of 8, down to blocks of 128) until the pieces fit ``_LEAF``: summing the leaves
    along the same tree (``_dot_total``) gives the same additions, bit for bit, as one reduce over
    the whole chunk, without materialising its float64 products."""
    out: list[tuple[int, int]] = []

    def split(lo: int, hi: int) -> None:
        if hi - lo <= _LEAF:
            out.append((lo, hi))
            return
        half = (hi - lo) // 2
        half -= half % 8
        split(lo, lo + half)
        split(lo + half, hi)

    for s in range(0, size, _CHUNK):
        split(s, min(s + _CHUNK, size))
    return tuple(out)


def _dot_total(size: int, leaves: Sequence[float]) -> float:
    """The leaf sums of ``_dot_leaves(size)`` added along the same tree: chunks in order, each
    chunk's pairwise tree left before right."""
    it = iter(leaves)

    def tree(lo: int, hi: int) -> float:
        if hi - lo <= _LEAF:
            return next(it)
        half = (hi - lo) // 2
        half -= half % 8
        return tree(lo, lo + half) + tree(lo + half, hi)

    total = 0.0
    for s in range(0, size, _CHUNK):
        total += tree(s, min(s + _CHUNK, size))
    return total


def _merge_tensor(
    xs: Sequence[np.ndarray],
    p: Sequence[float],
    *,
    radial: bool,
    cosine: Sequence[tuple[np.ndarray, float] | None] | None = None,
    squares: list[float] | None = None,
    out: np.ndarray | None = None,
    pool: ThreadPoolExecutor | None = None,
    workers: int = 1,
) -> tuple[np.ndarray, np.float32 | None]:
    """One tensor merged from float32 contributions ``xs`` with normalised weights ``p`` (RDA when
    ``radial``, else the weighted mean), as ``(values, scale)``: the merge is ``values * scale``
    when ``scale`` is not None (RDA's length applied to its direction), else ``values``. ``out``:
    the buffer ``values`` is written into (default: a new array). With ``cosine``
    (``(d_i, 1 / |d_i|)`` per contribution, None for those left out), also appends to
    ``squares`` the float64 ``|sum_i d_i / |d_i||^2`` of each ``_LEAF``-sized leaf.

    One pass, ``_STEP`` elements at a time: every contribution's chunk is read from memory once,
    while in cache it is added into both accumulators, and the merged chunk's own float64
    squares (RDA's direction norm) are summed as its leaves complete. Each accumulator sees the
    same operations in the same order as a pass of its own would (``out += float32(s_i) * d_i``
    onto zeros for the merge, contributions in the order given), so the bytes are those of
    separate passes. With a ``pool``, ranges of whole ``_CHUNK``s go to its ``workers`` threads
    (numpy releases the GIL in each operation); their results are combined in order, so the
    bytes do not depend on the threads.
    """
    shape = np.shape(xs[0]) if xs else next(np.shape(c[0]) for c in cosine or () if c is not None)
    size = int(np.prod(shape, dtype=np.int64))
    scales: list[np.float32 | None] = []
    radius = 0.0
    for x, p_i in zip(xs, p, strict=True):
        assert x.shape == shape, (x.shape, shape)
        if not radial:
            scales.append(np.float32(p_i))
            continue
        n = math.sqrt(_sq(x))
        if n > 0.0:
            radius += p_i * n
            # One float32 multiply per element: scale folded into a single float64-computed scalar.
            scales.append(np.float32(p_i / n))
        else:
            scales.append(None)  # unit(0) = 0: no direction
    if out is None:
        out = np.empty(shape if xs else 0, np.float32)
    assert out.dtype == np.float32 and out.flags.c_contiguous and out.size == (size if xs else 0)
    flats = [x.reshape(-1) for x in xs]
    cos = [None if c is None else (np.asarray(c[0]).reshape(-1), c[1]) for c in cosine or ()]
    assert all(c is None or c[0].size == size for c in cos), size
    leaves = _dot_leaves(size) if radial and xs else ()

    def part(lo: int, hi: int) -> tuple[list[float], list[float]]:
        return _merge_range(out.reshape(-1), flats, scales, cos, leaves, lo, hi)

    # Ranges of whole _CHUNKs (so whole reduction leaves) on the workers, results in order.
    bounds = list(range(0, size, max(_CHUNK, -(-size // _CHUNK // max(workers, 1)) * _CHUNK))) + [size]
    if len(bounds) > 2 and pool is not None:
        parts = list(pool.map(part, bounds[:-1], bounds[1:]))
    else:
        parts = [part(0, size)]
    if squares is not None:
        for sq_part, _ in parts:
            squares += sq_part
    if not radial:
        return out, None
    n_dir = math.sqrt(_dot_total(size, [v for _, leaf_part in parts for v in leaf_part]))
    if n_dir == 0.0:
        out.fill(0)  # +0.0 everywhere (the direction may hold -0.0)
        return out, None
    return out, np.float32(radius / n_dir)


def _merge_range(
    o: np.ndarray,
    flats: Sequence[np.ndarray],
    scales: Sequence[np.float32 | None],
    cos: Sequence[tuple[np.ndarray, float] | None],
    leaves: Sequence[tuple[int, int]],
    lo: int,
    hi: int,
) -> tuple[list[float], list[float]]:
    """The pass of ``_merge_tensor`` over elements ``[lo, hi)`` (``lo`` a multiple of ``_CHUNK``):
    writes ``o[lo:hi]``, returns the cosine's leaf squares and the direction's leaf sums there."""
    t32, acc, t64 = _buffers(min(max(hi - lo, 1), _STEP))
    squares: list[float] = []
    leaf_sums: list[float] = []
    li = bisect.bisect_left(leaves, (lo, lo))
    zero = np.float32(0.0)
    for s in range(lo, hi, _STEP):
        e = min(s + _STEP, hi)
        oc, t, a, t6 = o[s:e], t32[: e - s], acc[: e - s], t64[: e - s]
        first_merge = first_cos = True
        for i in range(max(len(flats), len(cos))):
            sc = scales[i] if i < len(flats) else None
            if sc is not None:
                if first_merge:
                    # 0 + t, as accumulating onto zeros would (-0.0 becomes +0.0), without a pass
                    # to zero the chunk first.
                    np.multiply(flats[i][s:e], sc, out=oc)
                    oc += zero
                    first_merge = False
                else:
                    np.multiply(flats[i][s:e], sc, out=t)
                    oc += t
            c = cos[i] if i < len(cos) else None
            if c is not None:
                # float64(d) * inv: an exact cast, then one rounding (as multiply(..., dtype=float64)).
                np.copyto(a if first_cos else t6, c[0][s:e])
                if first_cos:
                    np.multiply(a, c[1], out=a)
                    first_cos = False
                else:
                    np.multiply(t6, c[1], out=t6)
                    a += t6
        if first_merge:
            oc.fill(0)  # no contribution has a direction here
        if not first_cos:
            np.multiply(a, a, out=t6)
            for ls in range(0, e - s, _LEAF):
                squares.append(float(np.add.reduce(t6[ls : ls + _LEAF])))
        # The merged chunk's leaves are complete: their self-dot while they are in cache.
        while li < len(leaves) and leaves[li][1] <= e:
            b = t64[: leaves[li][1] - leaves[li][0]]
            np.square(o[leaves[li][0] : leaves[li][1]], out=b, dtype=np.float64)
            leaf_sums.append(float(np.add.reduce(b)))
            li += 1
    return squares, leaf_sums


def _scaled(values: np.ndarray, scale: np.float32 | None) -> np.ndarray:
    if scale is not None:
        values *= scale
    return values


def _buffers(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-thread scratch of ``n`` elements: float32 product, float64 accumulator, float64 product."""
    bufs = getattr(_local, "merge", None)
    if bufs is None or bufs[0].size < n:
        bufs = _local.merge = (np.empty(n, np.float32), np.empty(n, np.float64), np.empty(n, np.float64))
    return bufs


def _scratch(n: int) -> np.ndarray:
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.size < n:
        buf = _local.scratch = np.empty(n, np.float64)
    return buf[:n]


def sq_norms(delta: Delta) -> dict[str, float]:
    """The squared L2 norm of each tensor (float64, the same bits as the merge computes): worked
    out when a contribution is judged, before quorum, and handed to ``memo_norms``."""
    return {k: _dot(v, v) for k, v in delta.items()}


@contextlib.contextmanager
def memo_norms(known: Iterable[tuple[np.ndarray, float]] = ()) -> Iterator[None]:
    """Within this block (on this thread), remember the squared norm of each tensor computed, by
    identity: the merge, the cosine and the outlier check then read each contribution once.
    ``known``: ``(tensor, squared norm)`` pairs already computed (``sq_norms``)."""
    outer = getattr(_local, "norms", None)
    _local.norms = {id(a): (a, v) for a, v in known}
    try:
        yield
    finally:
        _local.norms = outer


def _sq(a: np.ndarray) -> float:
    """``_dot(a, a)``, remembered inside ``memo_norms`` (the entry holds ``a``, so its id stays its own)."""
    memo = getattr(_local, "norms", None)
    if memo is None:
        return _dot(a, a)
    hit = memo.get(id(a))
    if hit is not None and hit[0] is a:
        return hit[1]
    value = _dot(a, a)
    memo[id(a)] = (a, value)
    return value
