"""E8M0 scales: one byte holding a power of two, ``2**(b - 127)``; 255 is NaN (OCP MX).

The F8, F4 and I2 quantizers (``quant.py``, ``quant_i2.py``) pick their scales here, from the
float32 bits of a magnitude, so the choice is integer arithmetic and exact on every host.
"""

from __future__ import annotations

import numpy as np

_F32 = np.dtype(np.float32)

# 2**(b - 127) for every E8M0 byte; 255 is NaN. 2**-127 is a float32 subnormal, still exact.
E8M0_VALUES = np.array([2.0 ** (b - 127) for b in range(255)] + [np.nan], dtype=np.float32)


def pow2_exponent(amax_bits: np.ndarray, top: float) -> np.ndarray:
    """Smallest k with amax <= top * 2**k, for finite amax >= 0 given as float32 bits, clipped to
    E8M0's [-127, 127].

    Integer arithmetic on the bits, so exact (a float log2 can be off by one at powers of two):
    with amax = (1 + f) * 2**E and top = (1 + g) * 2**G, k = E - G when f <= g, else one more.
    Subnormal amax (E = -127 here) lands below -127 and is clipped.
    """
    tb = int(np.array([top], _F32).view(np.uint32)[0])
    b = amax_bits.astype(np.int64)
    k = (b >> 23) - (tb >> 23) + ((b & 0x7FFFFF) > (tb & 0x7FFFFF))
    return np.clip(k, -127, 127)


def inv_pow2(k: np.ndarray) -> np.ndarray:
    """float32 2**-k for k in [-127, 126], built from its bits: exact, and a normal float."""
    return ((127 - k).astype(np.uint32) << 23).view(_F32)
