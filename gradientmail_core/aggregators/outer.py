"""The outer optimizer (SPEC 4.3): Nesterov momentum without dampening, in float32.

``delta`` is the merged outer gradient (``anchor - local``), so the update subtracts it:

    m     = beta * m + d
    theta = theta - lr * (d + beta * m)

Each line is evaluated element-wise in exactly this operation order in float32 (numpy neither
fuses nor reorders element-wise ops), so the same inputs give byte-identical outputs and a round
recomputed after a crash commits the same bytes. Inputs are never mutated.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

Tensors = Mapping[str, np.ndarray]
_CHUNK = 1 << 16  # float32 elements: 256 KiB of scratch, in L2


def outer_step(
    theta: Tensors, momentum: Tensors, delta: Tensors, *, lr: float, beta: float
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One Nesterov step; returns ``(new_theta, new_momentum)`` as new float32 arrays.

    ``momentum`` of a fragment that never committed is zeros (the caller keeps it per fragment).
    """
    assert set(theta) == set(momentum) == set(delta), "theta, momentum and delta must name the same tensors"
    new_theta: dict[str, np.ndarray] = {}
    new_momentum: dict[str, np.ndarray] = {}
    for name in theta:
        new_theta[name], new_momentum[name] = outer_step_tensor(
            theta[name], momentum[name], delta[name], lr=lr, beta=beta, name=name
        )
    return new_theta, new_momentum


def outer_step_tensor(
    theta: np.ndarray,
    momentum: np.ndarray,
    delta: np.ndarray,
    *,
    lr: float,
    beta: float,
    scale: np.float32 | None = None,
    out: tuple[np.ndarray, np.ndarray] | None = None,
    name: str = "",
) -> tuple[np.ndarray, np.ndarray]:
    """``outer_step`` of one tensor. With ``scale``, the delta is ``delta * scale`` (a float32
    multiply, done chunk by chunk here: the merge hands RDA's direction and length this way).
    ``out``: the ``(new_theta, new_momentum)`` arrays to write into (default: new ones)."""
    lr32 = np.float32(lr)
    beta32 = np.float32(beta)
    t, m, d = _f32(theta), _f32(momentum), _f32(delta)
    assert t.shape == m.shape == d.shape, (name, t.shape, m.shape, d.shape)
    t_new, m_new = out if out is not None else (np.empty(t.shape, np.float32), np.empty(m.shape, np.float32))
    assert t_new.shape == m_new.shape == t.shape and t_new.dtype == m_new.dtype == np.float32, name
    assert t_new.flags.c_contiguous and m_new.flags.c_contiguous, name
    tf, mf, df = t.reshape(-1), m.reshape(-1), d.reshape(-1)
    mo, to = m_new.reshape(-1), t_new.reshape(-1)
    scratch = np.empty(min(tf.size, _CHUNK), np.float32)
    dscr = np.empty(min(tf.size, _CHUNK) if scale is not None else 0, np.float32)
    # Chunks that stay in cache, with the same float32 operations as the two lines of the
    # docstring (x*y and x+y commute exactly): the outputs are the only full-size writes.
    for s in range(0, tf.size, _CHUNK):
        e = s + _CHUNK
        mc, sc = mo[s:e], scratch[: mo[s:e].size]
        dc = df[s:e]
        if scale is not None:
            dc = np.multiply(dc, scale, out=dscr[: dc.size])
        np.multiply(mf[s:e], beta32, out=mc)
        mc += dc
        np.multiply(mc, beta32, out=sc)
        sc += dc
        sc *= lr32
        np.subtract(tf[s:e], sc, out=to[s:e])
    return t_new, m_new


def final_step(theta: Tensors, delta: Tensors) -> dict[str, np.ndarray]:
    """``theta - delta``: a round made only of final contributions (learners leaving) commits their
    progress as is, without outer momentum, so the momentum stays unchanged.
    """
    assert set(theta) == set(delta), "theta and delta must name the same tensors"
    return {name: final_step_tensor(theta[name], delta[name], name=name) for name in theta}


def final_step_tensor(
    theta: np.ndarray,
    delta: np.ndarray,
    *,
    scale: np.float32 | None = None,
    out: np.ndarray | None = None,
    name: str = "",
) -> np.ndarray:
    """``final_step`` of one tensor; with ``scale``, the delta is ``delta * scale`` (float32).
    ``out``: the array to write into (default: a new one)."""
    t, d = _f32(theta), _f32(delta)
    assert t.shape == d.shape, (name, t.shape, d.shape)
    if out is None:
        out = np.empty(t.shape, np.float32)
    assert out.shape == t.shape and out.dtype == np.float32, name
    if scale is None:
        return np.subtract(t, d, out=out)
    np.multiply(d, scale, out=out)
    return np.subtract(t, out, out=out)


GAP_BLOCK = 32  # elements: the blocks of F4 and I2, each with a scale of its own


def drop_pullback(delta: np.ndarray, master: np.ndarray, theta: np.ndarray) -> None:
    """Take out of a merged delta (flat float32, in place) the part that pulls the parameters back
    toward the master's rounding. With ``commit_dtype`` the learners train from ``theta``, the
    published parameters, while the master keeps ``gap = master - theta``; where the loss is stiff
    the inner steps pull ``theta`` toward the master, so the merged delta holds a share of ``-gap``
    that the outer step would apply a second time (bench/README.md section 6). Per block of
    ``GAP_BLOCK`` elements from the delta's start (a piece of a tensor starts on such a block), the
    delta's component along the gap is ``c = <delta, gap> / |gap|^2`` (float64 sums); where it pulls
    back, ``delta -= float32(max(c, -1)) * gap``, the master keeping the rest of its rounding."""
    assert delta.ndim == master.ndim == theta.ndim == 1 and delta.size == master.size == theta.size
    for s in range(0, delta.size, _CHUNK):  # (_CHUNK is a multiple of GAP_BLOCK)
        e = min(s + _CHUNK, delta.size)
        gap = np.subtract(master[s:e], theta[s:e], dtype=np.float32)
        d = delta[s:e]
        full = (e - s) // GAP_BLOCK * GAP_BLOCK
        for lo, hi, rows in ((0, full, full // GAP_BLOCK), (full, e - s, 1)):
            if hi == lo:
                continue
            g, x = gap[lo:hi].reshape(rows, -1), d[lo:hi].reshape(rows, -1)
            g64 = g.astype(np.float64)
            dots, sq = (x.astype(np.float64) * g64).sum(axis=1), (g64 * g64).sum(axis=1)
            c = np.clip(np.divide(dots, sq, out=np.zeros_like(dots), where=sq > 0), -1.0, 0.0).astype(np.float32)
            x -= c[:, None] * g


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)
