"""The merge's fused float operations: how ``merge.py``'s formulas are computed, fast and bit for bit.

``merge.py`` states what a merge is; this module computes it. A commit needs, per fragment, the
merge of the contributions and their mean pairwise cosine, each of which is a few reductions
over every contribution. Done separately they would stream the contributions through memory
several times; here each chunk of every contribution is read once and, while it is in cache,
feeds the merge's float32 accumulator, the cosine's float64 one and the squared norms
(``merge_tensor``; the closer's passes over chunks and ranks, ``syncer/passes.py``, make the same
operations with ``merge_into``/``cosine_into``, on ``WORKERS`` threads for a large fragment).

Determinism: a recomputed round must commit the same bytes (SPEC 4.3), so every sum runs in a
fixed order. Contributions are summed in the order given; the caller passes them sorted (by
learner id). Element-wise float32 arithmetic has no reduction order to vary. Scalar reductions
(norms, dot products) run in float64 over fixed-size chunks with ``np.add.reduce`` rather than BLAS
(``np.dot``/``np.linalg.norm``), whose summation order may depend on threads; fragment-level
reductions visit tensors in sorted-name order so a mapping's insertion order does not matter.
Threads get ranges of whole chunks and their results are combined in order, so the bytes do
not depend on how many there are.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

Delta = Mapping[str, np.ndarray]

# Bounds the float64 temporaries of a reduction (8 MiB) on multi-GB fragments.
_CHUNK = 1 << 20
# Per thread: a reused float64 scratch chunk, and (inside ``memo_norms``) the squared norms of
# the contributions already computed, so a commit reads each contribution once per quantity.
_local = threading.local()
_LEAF = 1 << 15  # float64 elements (256 KiB) a reduction handles at once, in cache
# The closer's merge of a large fragment runs on a few threads (numpy releases the GIL); few, as
# it runs beside training. Read at each call (tests patch it here).
WORKERS = min(2, os.cpu_count() or 1)
# Elements of every contribution the merge handles at once (a multiple of _LEAF): its float32 and
# float64 scratch (1.25 MiB) plus one contribution's chunk stay in L2.
_STEP = 2 * _LEAF


def mean_cosine(deltas: Sequence[Delta]) -> float | None:
    """``merge.mean_pairwise_cosine``: one pass over the contributions, not one per pair."""
    units = _cosine_units(deltas)
    squares: dict[str, list[float]] = {}
    if units is not None:
        for k in deltas[0]:
            cos = [None if u is None else (deltas[i][k], u) for i, u in enumerate(units)]
            merge_tensor([], [], radial=False, cosine=cos, squares=squares.setdefault(k, []))
    return _cosine_from(units, squares, len(deltas))


def merge_tensor(
    xs: Sequence[np.ndarray],
    p: Sequence[float],
    *,
    radial: bool,
    cosine: Sequence[tuple[np.ndarray, float] | None] | None = None,
    squares: list[float] | None = None,
    out: np.ndarray | None = None,
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
    separate passes.
    """
    shape = np.shape(xs[0]) if xs else next(np.shape(c[0]) for c in cosine or () if c is not None)
    size = int(np.prod(shape, dtype=np.int64))
    scales: list[np.float32 | None] = []
    norms: list[float] = []
    for x, p_i in zip(xs, p, strict=True):
        assert x.shape == shape, (x.shape, shape)
        if not radial:
            scales.append(np.float32(p_i))
            continue
        n = math.sqrt(_sq(x))
        norms.append(n)
        # One float32 multiply per element: scale folded into a single float64-computed scalar.
        scales.append(np.float32(p_i / n) if n > 0.0 else None)  # unit(0) = 0: no direction
    radius = rda_radius(p, norms) if radial else 0.0
    if out is None:
        out = np.empty(shape if xs else 0, np.float32)
    assert out.dtype == np.float32 and out.flags.c_contiguous and out.size == (size if xs else 0)
    flats = [x.reshape(-1) for x in xs]
    cos = [None if c is None else (np.asarray(c[0]).reshape(-1), c[1]) for c in cosine or ()]
    assert all(c is None or c[0].size == size for c in cos), size
    leaves = _dot_leaves(size) if radial and xs else ()

    sq_part, leaf_part = _merge_range(out.reshape(-1), flats, scales, cos, leaves, 0, size)
    if squares is not None:
        squares += sq_part
    if not radial:
        return out, None
    n_dir = math.sqrt(_dot_total(size, leaf_part))
    if n_dir == 0.0:
        out.fill(0)  # +0.0 everywhere (the direction may hold -0.0)
        return out, None
    return out, np.float32(radius / n_dir)


def rda_radius(p: Sequence[float], norms: Sequence[float]) -> float:
    """RDA's length ``sum_i p_i |d_i|`` of one tensor (float64, in the order given; a zero
    contribution adds nothing): the one place it is summed."""
    radius = 0.0
    for p_i, n in zip(p, norms, strict=True):
        if n > 0.0:
            radius += p_i * n
    return radius


def scaled(values: np.ndarray, scale: np.float32 | None) -> np.ndarray:
    """``values * scale`` in place (a float32 multiply), or ``values`` when ``scale`` is None."""
    if scale is not None:
        values *= scale
    return values


def fragment_norm(delta: Delta) -> float:
    """L2 norm of the flattened whole-fragment delta (float64, deterministic)."""
    return math.sqrt(sum(_sq(delta[k]) for k in sorted(delta)))


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


def _merge_range(
    o: np.ndarray,
    flats: Sequence[np.ndarray],
    scales: Sequence[np.float32 | None],
    cos: Sequence[tuple[np.ndarray, float] | None],
    leaves: Sequence[tuple[int, int]],
    lo: int,
    hi: int,
) -> tuple[list[float], list[float]]:
    """The pass of ``merge_tensor`` over elements ``[lo, hi)`` (``lo`` a multiple of ``_CHUNK``):
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


def merge_into(out: np.ndarray, x: np.ndarray, scale: np.float32, *, first: bool) -> None:
    """One contribution's term of the merge, added into ``out`` (float32, flat): ``x * scale``
    onto zeros when ``first``, else ``out += x * scale``, with ``_merge_range``'s operations (so a
    piece merged one contribution at a time holds the bytes of the whole tensor's merge there)."""
    t32 = _buffers(min(max(x.size, 1), _STEP))[0]
    zero = np.float32(0.0)
    for s in range(0, x.size, _STEP):
        e = min(s + _STEP, x.size)
        oc = out[s:e]
        if first:
            np.multiply(x[s:e], scale, out=oc)
            oc += zero
        else:
            t = t32[: e - s]
            np.multiply(x[s:e], scale, out=t)
            oc += t


def cosine_into(a: np.ndarray, d: np.ndarray, inv: float, *, first: bool) -> None:
    """One contribution's term of the cosine's unit-vector sum, added into ``a`` (float64, flat):
    ``float64(d) * inv`` (``inv = 1 / |d|``), as ``_merge_range`` computes it."""
    t64 = _buffers(min(max(d.size, 1), _STEP))[2]
    for s in range(0, d.size, _STEP):
        e = min(s + _STEP, d.size)
        ac = a[s:e]
        if first:
            np.copyto(ac, d[s:e])
            np.multiply(ac, inv, out=ac)
        else:
            t6 = t64[: e - s]
            np.copyto(t6, d[s:e])
            np.multiply(t6, inv, out=t6)
            ac += t6


def norm_of(sq: Mapping[str, float]) -> float:
    """``fragment_norm`` from each tensor's squared norm (``sq_norms``): the same sum, in sorted-name order."""
    return math.sqrt(sum(sq[k] for k in sorted(sq)))


def cosine_units(norms: Sequence[float]) -> list[float | None] | None:
    """``_cosine_units`` from the contributions' whole-fragment norms."""
    if len(norms) < 2:
        return None
    units = [1.0 / n if n > 0.0 else None for n in norms]
    return units if sum(u is not None for u in units) >= 2 else None


def cosine_from(units: Sequence[float | None] | None, squares: Mapping[str, list[float]], n: int) -> float | None:
    """``_cosine_from``: the mean pairwise cosine from the leaf squares of each tensor."""
    return _cosine_from(units, squares, n)


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


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)
