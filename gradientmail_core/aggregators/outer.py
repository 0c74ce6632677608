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


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)
