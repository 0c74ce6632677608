"""I2: two-bit codes with a power-of-two scale per block of 32, in vectorised numpy.

Layout: blocks of 32 along the flattened tensor (the last one zero-padded). Each value becomes
a code ``sign << 1 | outer`` for the levels ``{+1, +3, -1, -3} * 2**k`` (code 0..3), four codes
per byte, the first in the lowest two bits; each block has one scale byte:

- ``b`` in 1..254: ``2**k`` with ``k = b - 127`` (E8M0's meaning);
- 0: an all-zero block, which decodes to exact zeros (E8M0's ``2**-127`` is not used);
- 255: a block holding inf or NaN; it decodes to NaN, like an F4 block (the receiver sees a
  non-finite delta and rejects it).

Codes and bytes of the zero and NaN blocks are 0. A value's sign is its sign bit (so -0 gets
-1); it takes the outer level when ``|x| > 2 * 2**k``, the inner one otherwise (a tie at
exactly ``2 * 2**k`` goes to the inner level, toward zero).

Why this grid: the four levels of the mean-square optimal (Lloyd-Max) quantizer of a Gaussian
are ``+-0.45`` and ``+-1.51`` sigma, no zero among them, almost exactly the uniform ``{1, 3} * s``
at ``s = 0.5 sigma``. A grid with a zero spends one of four codes on it: ternary
``{-1, 0, 1}`` measured 0.44 relative error on Gaussian blocks against 0.34 here.

Why this scale: a block's absmax alone is a poor guide to its spread at two bits (a scale from
it suits either Gaussian or constant-magnitude blocks, never both; and a power of two wastes up
to half the range). So each block tries four exponents, ``k0 + 1 .. k0 - 2`` with ``k0`` the
smallest k whose outer level ``3 * 2**k`` reaches its absmax, and keeps the one with the least
squared error (the first of equals, so the largest scale). Measured on 2**20 values, relative
L2 error (F4 in brackets): Gaussian 0.344 (0.115), Student-t(4) 0.468 (0.139), Laplace 0.441
(0.132), uniform 0.311 (0.123), one magnitude a block with random signs 0.100 (0.100); a fixed
absmax ratio (the best for Gaussians, ``absmax <= 7 * 2**k``) gave 0.349, 0.513, 0.460, 0.311,
0.403. At 2.25 bits a value against F4's 4.25, with error feedback carrying the rest into the
next delta. The price of no zero level: exact zeros scattered in a block that is not all zero
become +-2**k (80% random zeros: 0.69, F4 0.11); an all-zero block is exact (scale byte 0).

Same bytes everywhere: the codes are integer comparisons of float32 bits, and the errors that
pick the exponent are integer arithmetic too. Each magnitude becomes a fixed-point integer,
``floor(|x| * 2**(FIX - kn))`` (``kn`` = k0 but at most 126), taken from its bits by a shift;
a candidate's squared error less the common sum of squares is then
``s*s*(n + 8*n_out) - 2*s*(sum_all + 2*sum_out)`` with ``s = 2**(FIX + k - kn)``, ``n`` the
block's values and ``n_out``, ``sum_out`` the count and sum of those above ``2*s``: exact in
int64, so any summation order gives the same choice (``adapters/torch_quant.py`` uses
``torch.sum``), and no float flush-to-zero or denormals-are-zero mode can change it. The fixed
point truncates below ``2**-FIX`` of ``2**kn``, far below anything that separates candidates.
"""

from __future__ import annotations

import numpy as np

from .e8m0 import pow2_exponent

I2_BLOCK = 32
# Level of each code, ``sign << 1 | outer``, in units of the block's scale.
I2_LEVELS = np.array([1.0, 3.0, -1.0, -3.0], dtype=np.float32)
# The tried exponents, relative to k0, in preference order for equal errors.
I2_TRIES = (1, 0, -1, -2)
I2_TOP = 3.0  # k0: the smallest k with absmax <= I2_TOP * 2**k
FIX = 20  # fraction bits of the fixed point the scale search runs in
ZERO_SCALE, NAN_SCALE = 0, 0xFF
# Scale byte -> its float32 multiplier: 0 for a zero block, 2**(b - 127), NaN for 255.
I2_SCALE_VALUES = np.array([0.0] + [2.0 ** (b - 127) for b in range(1, 255)] + [np.nan], dtype=np.float32)
_F32 = np.dtype(np.float32)
_F32_MAX = np.float32(np.finfo(np.float32).max)
_CHUNK = 1 << 15  # elements per chunk; a multiple of I2_BLOCK so blocks never straddle chunks
# Every packed byte -> its four levels (lowest bits first): one gather decodes four values.
_QUADS = np.stack([I2_LEVELS[(np.arange(256) >> s) & 3] for s in (0, 2, 4, 6)], axis=1)


def i2_sizes(n: int) -> tuple[int, int]:
    """(packed bytes, scale bytes) of an I2 tensor with ``n`` elements."""
    nblocks = -(-n // I2_BLOCK)
    return nblocks * I2_BLOCK // 4, nblocks


def fixed_point(mag: np.ndarray, kn: np.ndarray) -> np.ndarray:
    """[nblocks, 32] magnitude bits (finite) -> ``floor(|x| * 2**(FIX - kn))`` per value (int32,
    below 2**23), by shifting the significand: exact for normals and subnormals alike."""
    mi = mag.view(np.int32)
    e = mi >> 23  # the biased exponent, 0 for subnormals; they scale as if it were 1
    np.maximum(e, 1, out=e)
    m = e - 1
    m <<= 23
    np.subtract(mi, m, out=m)  # the significand m, with its implicit bit for normals
    # |x| = m * 2**(e - 150); times 2**(FIX - kn) is m >> (kn - FIX + 150 - e), a right shift
    # of at least 1 since |x| <= 6 * 2**kn. Inf/NaN blocks shift by anything; they are discarded.
    shift = (kn + (150 - FIX)).astype(np.int32)[:, None] - e
    np.clip(shift, 0, 31, out=shift)
    np.right_shift(m, shift, out=m)
    return m


def _choose(mag: np.ndarray, amax: np.ndarray, n_last: int) -> np.ndarray:
    """[nblocks, 32] magnitude bits and their block maxima -> the exponent k of each block
    (``I2_TRIES`` around k0, least squared error, clipped to [-126, 127]); the last block holds
    ``n_last`` values and zero padding, which does not count. Blocks of zeros, inf or NaN get
    some k; the caller overwrites them."""
    k0 = pow2_exponent(amax, I2_TOP)
    kn = np.minimum(k0, 126)
    y = fixed_point(mag, kn)
    # Row sums by einsum: ten times ndarray.sum's speed on rows of 32; int32 cannot overflow
    # (32 values below 2**23). Integer sums are exact in any order.
    y_all = np.einsum("ij->i", y).astype(np.int64)
    n = np.full(k0.shape, I2_BLOCK, np.int64)
    n[-1] = n_last  # padding is 0: it adds to no sum, only to the count of values
    best_k = np.zeros(k0.shape, np.int64)
    best_err = np.full(k0.shape, np.iinfo(np.int64).max, np.int64)
    for j in I2_TRIES:
        k = np.clip(k0 + j, -126, 127)
        s = np.left_shift(1, FIX + k - kn)  # k - kn in [-2, 1]: 2**18 .. 2**21
        outer = y > (2 * s).astype(np.int32)[:, None]
        y_out = np.einsum("ij->i", y * outer).astype(np.int64)
        n_out = np.einsum("ij->i", outer.view(np.uint8)).astype(np.int64)
        err = s * s * (n + 8 * n_out) - 2 * s * (y_all + 2 * y_out)  # below 2**53: no overflow
        better = err < best_err  # strict: the first of equal errors (the largest scale) stays
        best_k[better] = k[better]
        best_err[better] = err[better]
    return best_k


def quantize_i2(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (packed codes, uint8 [8 * nblocks]; scale bytes, uint8 [nblocks])."""
    flat = np.asarray(x, dtype=_F32, order="C").reshape(-1)
    n = flat.size
    nbytes, nblocks = i2_sizes(flat.size)
    if flat.size != nblocks * I2_BLOCK:
        flat = np.concatenate([flat, np.zeros(nblocks * I2_BLOCK - flat.size, _F32)])
    packed = np.empty(nbytes, np.uint8)
    scale = np.empty(nblocks, np.uint8)
    for i in range(0, flat.size, _CHUNK):
        u = flat[i : i + _CHUNK].view(np.uint32).reshape(-1, I2_BLOCK)
        mag = u & np.uint32(0x7FFFFFFF)
        # Integer order of the magnitude bits is float order; inf/NaN sort last.
        amax = mag.max(axis=1)
        regular = (amax > 0) & (amax < 0x7F800000)
        last = i + (u.shape[0] - 1) * I2_BLOCK  # where the chunk's last block starts
        k = _choose(mag, amax, min(n - last, I2_BLOCK))
        # outer: |x| > 2 * 2**k, compared on the bits (2**(k + 1) has exponent field k + 128;
        # 2**128 is inf's bits, above every finite value).
        outer = mag > ((k + 128).astype(np.uint32) << 23)[:, None]
        codes = ((u >> 31) << 1).astype(np.uint8) | outer
        codes[~regular] = 0
        quads = codes.reshape(-1, 4)
        out = packed[i // 4 : i // 4 + quads.shape[0]]
        np.left_shift(quads[:, 3], 6, out=out)
        out |= quads[:, 2] << 4
        out |= quads[:, 1] << 2
        out |= quads[:, 0]
        sc = (k + 127).astype(np.uint8)
        sc[amax == 0] = ZERO_SCALE
        sc[amax >= 0x7F800000] = NAN_SCALE
        scale[i // I2_BLOCK : i // I2_BLOCK + sc.size] = sc
    return packed, scale


def dequantize_i2(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    scale = np.asarray(scale, dtype=np.uint8)
    vals = np.take(_QUADS, np.asarray(packed, dtype=np.uint8), axis=0).reshape(-1, I2_BLOCK)
    # 3 * 2**127 (scale byte 254) passes float32's max: saturate there, as F4 does.
    big = bool(scale.size) and bool((scale == 254).any())
    with np.errstate(over="ignore" if big else "warn"):
        vals *= np.take(I2_SCALE_VALUES, scale)[:, None]
    if big:
        np.clip(vals, -_F32_MAX, _F32_MAX, out=vals)
    return vals.reshape(-1)[:n].reshape(shape)
