"""An independent float64 implementation of the merges and the outer step (SPEC 4.2, 4.3).

Written from the spec, not from ``merge.py``/``outer.py``: the auditor recomputes every
commit with it and compares within a tolerance, so a bug in the engine's float32 arithmetic
(or a mutant that weights, merges or steps wrongly) shows up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

F64 = dict[str, np.ndarray]


def weights_of(tokens: int, steps: int) -> float:
    return tokens * tokens / steps


def merge64(
    deltas: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], *, rda: bool, direct_pattern: str = "embed"
) -> F64:
    total = sum(weights)
    p = [w / total for w in weights]
    out: F64 = {}
    for name in deltas[0]:
        ds = [np.asarray(d[name], dtype=np.float64) for d in deltas]
        acc = np.zeros_like(ds[0])
        if rda and direct_pattern.lower() not in name.lower():
            radius = 0.0
            for pi, d in zip(p, ds):
                n = float(np.sqrt((d * d).sum()))
                if n > 0:
                    radius += pi * n
                    acc += (pi / n) * d
            dn = float(np.sqrt((acc * acc).sum()))
            out[name] = acc * (radius / dn) if dn > 0 else acc
        else:
            for pi, d in zip(p, ds):
                acc += pi * d
            out[name] = acc
    return out


def nesterov64(
    master: Mapping[str, np.ndarray],
    momentum: Mapping[str, np.ndarray],
    delta: Mapping[str, np.ndarray],
    *,
    lr: float,
    beta: float,
) -> tuple[F64, F64]:
    new_master: F64 = {}
    new_momentum: F64 = {}
    for n in master:
        m = beta * np.asarray(momentum[n], np.float64) + delta[n]
        new_momentum[n] = m
        new_master[n] = np.asarray(master[n], np.float64) - lr * (delta[n] + beta * m)
    return new_master, new_momentum


def final64(master: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> F64:
    return {n: np.asarray(master[n], np.float64) - delta[n] for n in master}


def drop_pullback64(delta: np.ndarray, master: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """``gap_projection`` in float64, written apart from ``outer.drop_pullback``: per block of 32
    elements of the flat tensor, the component of ``delta`` along ``master - theta`` taken out
    where it is negative, by at most the whole gap."""
    d = np.asarray(delta, np.float64).reshape(-1).copy()
    g = np.asarray(master, np.float64).reshape(-1) - np.asarray(theta, np.float64).reshape(-1)
    for lo in range(0, d.size, 32):
        gb, db = g[lo : lo + 32], d[lo : lo + 32]
        sq = float(gb @ gb)
        if sq > 0:
            db -= min(max(float(db @ gb) / sq, -1.0), 0.0) * gb
    return d.reshape(np.shape(delta))


def close(a: np.ndarray, b: np.ndarray, *, scale: float) -> bool:
    """Equal up to float32 rounding of a few operations, relative to the fragment's scale."""
    return bool(
        np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-4, atol=1e-5 * max(scale, 1.0))
    )
