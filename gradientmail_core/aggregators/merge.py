"""Merging a round's contributions into one fragment delta (SPEC 4.2): the formulas.

The contributions ``d_1 .. d_n`` are float32 deltas of one fragment (``anchor - local``), in the
order given (the caller sorts them by learner). Each weighs ``w_i = tokens_i**2 / steps_i``
(``contribution_weight``), normalised in float64 before any product (tokens squared would
overflow float32): ``p_i = w_i / sum_j w_j``. With ``|x|`` the L2 norm and ``unit(x) = x / |x|``,
``unit(0) = 0``:

    weighted mean   m = sum_i p_i * d_i
    RDA             m = (sum_i p_i * |d_i|) * unit(sum_i p_i * unit(d_i))
    clip            d_i -> d_i * min(1, c / |d_i|)
    cosine          mean over pairs i < j of unit(d_i) . unit(d_j)

RDA (radial-directional averaging) works tensor by tensor (``|d_i|`` of one tensor), except on
tensors named like ``RDA.direct_pattern``, which take the weighted mean; clip and the cosine use
whole-fragment norms (all tensors flattened into one vector).

In float32, element by element, in the order given, onto zeros:

    weighted mean   m = sum_i float32(p_i) * d_i
    RDA             v = sum_i float32(p_i / |d_i|) * d_i   (zero contributions left out)
                    m = v * float32(sum_i p_i * |d_i| / |v|)   (0 where |v| = 0)
    clip            d_i * float32(c / |d_i|)   where |d_i| > c

Norms and the weights' products are float64; every norm sums its squares in one fixed order, so
the same contributions give the same bytes on any machine and any number of threads. These are
the definitions; ``fused.py`` computes each in one pass over the contributions (with the cosine
the round record reports), with exactly these operations, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..config import RDA, WeightedMean
from . import fused
from .acceptance import outlier_mask
from .fused import Delta, fragment_norm, memo_norms, sq_norms

__all__ = [
    "Delta",
    "clip",
    "contribution_weight",
    "fragment_norm",
    "mean_pairwise_cosine",
    "memo_norms",
    "merge",
    "normalized",
    "outlier_mask",
    "rda",
    "sq_norms",
    "weighted_mean",
]


def contribution_weight(tokens: int, steps: int) -> float:
    """``tokens * (tokens / steps)``: more data counts more, and so does a larger batch per step."""
    assert steps > 0, "a zero-step snapshot is rejected before it is weighed"
    return float(tokens) * (float(tokens) / float(steps))


def weighted_mean(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``sum(w_i * d_i) / sum(w_i)`` in float32, summed in the given order."""
    values, scale = fused.merge_tensor([_f32(d) for d in deltas], normalized(weights, len(deltas)), radial=False)
    return fused.scaled(values, scale)


def rda(deltas: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Radial-directional averaging of one tensor:
    ``(sum w_i |d_i| / sum w_i) * unit(sum w_i unit(d_i) / sum w_i)``, with ``unit(0) = 0``.

    Unlike the mean, disagreeing directions do not shrink the step's length, only its direction;
    directions that cancel exactly give zero.
    """
    values, scale = fused.merge_tensor([_f32(d) for d in deltas], normalized(weights, len(deltas)), radial=True)
    return fused.scaled(values, scale)


def merge(
    deltas: Sequence[Delta],
    weights: Sequence[float],
    cfg: WeightedMean | RDA,
    *,
    clip_norm: float | None = None,
) -> dict[str, np.ndarray]:
    """Merge whole-fragment deltas, tensor by tensor, in the order given (callers sort by learner).

    With ``RDA``, tensors whose name contains ``cfg.direct_pattern`` (compared lowercased; embeddings,
    whose rows are updated sparsely so per-row norms mean little) use the weighted mean. ``clip_norm`` first
    scales each contribution down to at most that whole-fragment L2 norm (bounds what one bad
    contribution can do). Output names follow the first contribution's order.
    """
    assert deltas, "merge needs at least one accepted contribution"
    names = list(deltas[0])
    for d in deltas[1:]:
        assert set(d) == set(names), f"contributions disagree on tensor names: {sorted(set(d) ^ set(names))[:5]}"
    p = normalized(weights, len(deltas))
    merged_in = [clip(d, clip_norm) for d in deltas] if clip_norm is not None else list(deltas)
    out = {}
    for name in names:
        radial = isinstance(cfg, RDA) and not cfg.is_direct(name)
        out[name] = fused.scaled(*fused.merge_tensor([_f32(d[name]) for d in merged_in], p, radial=radial))
    return out


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
    return fused.mean_cosine(deltas)


def normalized(weights: Sequence[float], n: int) -> list[float]:
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


_normalized = normalized  # (its old name)
