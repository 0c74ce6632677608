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
    lr32 = np.float32(lr)
    beta32 = np.float32(beta)
    new_theta: dict[str, np.ndarray] = {}
    new_momentum: dict[str, np.ndarray] = {}
    for name in theta:
        t, m, d = _f32(theta[name]), _f32(momentum[name]), _f32(delta[name])
        assert t.shape == m.shape == d.shape, (name, t.shape, m.shape, d.shape)
        m_new, t_new = np.empty(m.shape, np.float32), np.empty(t.shape, np.float32)
        tf, mf, df = t.reshape(-1), m.reshape(-1), d.reshape(-1)
        mo, to = m_new.reshape(-1), t_new.reshape(-1)
        scratch = np.empty(min(tf.size, _CHUNK), np.float32)
        # Chunks that stay in cache, with the same float32 operations as the two lines of the
        # docstring (x*y and x+y commute exactly): the outputs are the only full-size writes.
        for s in range(0, tf.size, _CHUNK):
            e = s + _CHUNK
            mc, sc = mo[s:e], scratch[: mo[s:e].size]
            np.multiply(mf[s:e], beta32, out=mc)
            mc += df[s:e]
            np.multiply(mc, beta32, out=sc)
            sc += df[s:e]
            sc *= lr32
            np.subtract(tf[s:e], sc, out=to[s:e])
        new_momentum[name] = m_new
        new_theta[name] = t_new
    return new_theta, new_momentum


def final_step(theta: Tensors, delta: Tensors) -> dict[str, np.ndarray]:
    """``theta - delta``: a round made only of final contributions (learners leaving) commits their
    progress as is, without outer momentum, so the momentum stays unchanged.
    """
    assert set(theta) == set(delta), "theta and delta must name the same tensors"
    out: dict[str, np.ndarray] = {}
    for name in theta:
        t, d = _f32(theta[name]), _f32(delta[name])
        assert t.shape == d.shape, (name, t.shape, d.shape)
        out[name] = t - d
    return out


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)
