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

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np

from .config import RDA, WeightedMean

Delta = Mapping[str, np.ndarray]

# Bounds the float64 temporaries of a reduction (8 MiB) on multi-GB fragments.
_CHUNK = 1 << 20
# Per thread: a reused float64 scratch chunk, and (inside ``memo_norms``) the squared norms of
# the contributions already computed, so a commit reads each contribution once per quantity.
_local = threading.local()
_AXPY_CHUNK = 1 << 16  # float32 elements (256 KiB)
_LEAF = 1 << 15  # float64 elements (256 KiB) a reduction handles at once, in cache


def contribution_weight(tokens: int, steps: int) -> float:
    """``tokens * (tokens / steps)``: more data counts more, and so does a larger batch per step."""
    assert steps > 0, "a zero-step snapshot is rejected before it is weighed"
    return float(tokens) * (float(tokens) / float(steps))


def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``sum(w_i * d_i) / sum(w_i)`` in float32, summed in the given order."""
    p = _normalized(weights, len(deltas))
    out = np.zeros(np.shape(deltas[0]), dtype=np.float32)
    for d, p_i in zip(deltas, p, strict=True):
        d = _f32(d)
        assert d.shape == out.shape, (d.shape, out.shape)
        _axpy(out, np.float32(p_i), d)
    return out


def rda(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Radial-directional averaging of one tensor:
    ``(sum w_i |d_i| / sum w_i) * unit(sum w_i unit(d_i) / sum w_i)``, with ``unit(0) = 0``.

    Unlike the mean, disagreeing directions do not shrink the step's length, only its direction;
    directions that cancel exactly give zero.
    """
    p = _normalized(weights, len(deltas))
    radius = 0.0
    direction = np.zeros(np.shape(deltas[0]), dtype=np.float32)
    for d, p_i in zip(deltas, p, strict=True):
        d = _f32(d)
        assert d.shape == direction.shape, (d.shape, direction.shape)
        n = math.sqrt(_sq(d))
        if n > 0.0:
            radius += p_i * n
            # One float32 multiply per element: scale folded into a single float64-computed scalar.
            _axpy(direction, np.float32(p_i / n), d)
    n_dir = _norm(direction)
    if n_dir == 0.0:
        return np.zeros_like(direction)
    return direction * np.float32(radius / n_dir)


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
    assert deltas, "merge needs at least one accepted contribution"
    names = list(deltas[0])
    for d in deltas[1:]:
        assert set(d) == set(names), f"contributions disagree on tensor names: {sorted(set(d) ^ set(names))[:5]}"
    if clip_norm is not None:
        deltas = [clip(d, clip_norm) for d in deltas]
    out: dict[str, np.ndarray] = {}
    for name in names:
        tensors = [d[name] for d in deltas]
        if isinstance(cfg, RDA) and cfg.direct_pattern not in name:
            out[name] = rda(tensors, weights)
        else:
            out[name] = weighted_mean(tensors, weights)
    return out


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
    if len(deltas) < 2:
        return None
    pairs = len(deltas) * (len(deltas) - 1) // 2
    units = [(d, 1.0 / n) for d, n in ((d, fragment_norm(d)) for d in deltas) if n > 0.0]
    if len(units) < 2:
        return 0.0
    # The sum over pairs of u_i . u_j (u_i = d_i / |d_i|) is (|sum_i u_i|^2 - k) / 2 for k unit
    # vectors: one pass over the contributions instead of one per pair (n - 1 passes), in float64
    # chunk by chunk, tensors in sorted-name order.
    square = 0.0
    size = max(np.size(units[0][0][k]) for k in units[0][0])
    acc, tmp = np.empty(min(size, _LEAF), np.float64), np.empty(min(size, _LEAF), np.float64)
    for k in sorted(units[0][0]):
        flats = [(np.asarray(d[k]).reshape(-1), inv) for d, inv in units]
        for s in range(0, flats[0][0].size, _LEAF):
            a = acc[: min(_LEAF, flats[0][0].size - s)]
            t = tmp[: a.size]
            np.multiply(flats[0][0][s : s + _LEAF], flats[0][1], out=a, dtype=np.float64)
            for x, inv in flats[1:]:
                np.multiply(x[s : s + _LEAF], inv, out=t, dtype=np.float64)
                a += t
            np.multiply(a, a, out=t)
            square += float(np.add.reduce(t))
    # Clamp: rounding can push the mean of (anti)parallel vectors a hair past 1.
    return max(-1.0, min(1.0, (square - len(units)) / 2 / pairs))


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
    if a is b:
        y = x
    total = 0.0
    buf = _scratch(min(x.size, _LEAF))
    for s in range(0, x.size, _CHUNK):
        total += _pairwise_dot(x, y, s, min(s + _CHUNK, x.size), buf)
    return total


def _pairwise_dot(x: np.ndarray, y: np.ndarray, lo: int, hi: int, buf: np.ndarray) -> float:
    """``np.add.reduce`` of the float64 products ``x[lo:hi] * y[lo:hi]``, bit for bit, without
    materialising them: numpy sums pairwise (halves rounded down to a multiple of 8, down to
    blocks of 128), so splitting the same way and reducing cache-sized leaves gives the same
    tree of additions as one reduce over the whole chunk."""
    n = hi - lo
    if n <= _LEAF:
        out = buf[:n]
        # The product of the float64 casts (exact for float32 inputs).
        np.multiply(x[lo:hi], y[lo:hi], out=out, dtype=np.float64)
        return float(np.add.reduce(out))
    half = n // 2
    half -= half % 8
    return _pairwise_dot(x, y, lo, lo + half, buf) + _pairwise_dot(x, y, lo + half, hi, buf)


def _axpy(out: np.ndarray, scale: np.float32, d: np.ndarray) -> None:
    """``out += scale * d`` (float32, the same two roundings), chunk by chunk through a scratch
    buffer that stays in cache instead of a fresh full-size temporary per contribution."""
    o, x = out.reshape(-1), d.reshape(-1)
    buf = getattr(_local, "axpy", None)
    if buf is None or buf.size < min(o.size, _AXPY_CHUNK):
        buf = _local.axpy = np.empty(min(o.size, _AXPY_CHUNK), np.float32)
    for s in range(0, o.size, _AXPY_CHUNK):
        t = buf[: o[s : s + _AXPY_CHUNK].size]
        np.multiply(x[s : s + _AXPY_CHUNK], scale, out=t)
        o[s : s + _AXPY_CHUNK] += t


def _scratch(n: int) -> np.ndarray:
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.size < n:
        buf = _local.scratch = np.empty(n, np.float64)
    return buf[:n]


@contextmanager
def memo_norms() -> Iterator[None]:
    """Within this block (on this thread), remember the squared norm of each tensor computed, by
    identity: the merge, the cosine and the outlier check then read each contribution once."""
    outer = getattr(_local, "norms", None)
    _local.norms = {}
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


def _norm(a: np.ndarray) -> float:
    return math.sqrt(_dot(a, a))
