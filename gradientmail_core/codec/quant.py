"""Quantizers from float32 to the payload storage dtypes, in vectorised numpy.

All host-side math is numpy float32 so torch and MLX nodes produce identical bytes by
construction. Every rounding is round-to-nearest-even (RNE):

- ``BF16``: the upper 16 bits of float32 after adding the RNE bias. NaN becomes 0x7FC0.
- ``F16``: numpy's cast (RNE; beyond +-65504 becomes +-inf, as in torch).
- ``F8_E4M3`` (the "fn" variant: bias 7, max 448, no inf, NaN 0x7F): one power-of-two scale per
  tensor, ``2**ceil(log2(amax / 448))``, stored as one E8M0 byte (biased exponent, 127 = 2**0).
  Non-finite inputs become the NaN code, so the receiver sees a non-finite tensor.
- ``F4`` (E2M1, OCP MX): blocks of 32 along the flattened tensor (the last one zero-padded),
  one E8M0 scale per block, ``2**ceil(log2(amax_block / 6))`` (127 for an all-zero block), codes
  ``sign<<3 | magnitude`` on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}, two per byte, low nibble first.
  A block holding a non-finite value gets the E8M0 NaN scale (0xFF) and dequantizes to NaN.
- ``I2``: two-bit codes for the levels {+-1, +-3} times a power-of-two scale per block of 32,
  four per byte (``quant_i2.py``: the grid, the scale search, the zero and NaN blocks).

E8M0 cannot go below 2**-127, so tensors (F8) or blocks (F4) whose largest magnitude is a
float32 subnormal lose their low bits. Dequantized values that a scale carries past float32's
largest value saturate there (the input was finite).

The work runs in chunks that fit in L2 cache with reused scratch buffers: a conversion is a
dozen elementwise passes, which over a whole tensor would each stream it through memory and
page-fault a fresh temporary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .e8m0 import E8M0_VALUES
from .e8m0 import inv_pow2 as _inv_pow2
from .e8m0 import pow2_exponent as _pow2_exponent
from .quant_i2 import dequantize_i2, quantize_i2

DTYPES = ("F32", "F16", "BF16", "F8_E4M3", "F4", "I2")
# Safetensors dtype each logical dtype is stored as.
STORAGE = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F8_E4M3": "F8_E4M3", "F4": "U8", "I2": "U8"}
# Quantized elementwise: a slice of the input quantizes to the same slice of the output.
ELEMENTWISE = ("F32", "F16", "BF16")
F4_BLOCK = 32
F32_MAX = np.float32(np.finfo(np.float32).max)

_F32 = np.dtype(np.float32)
_CHUNK = 1 << 15  # elements per chunk; a multiple of F4_BLOCK so blocks never straddle chunks


@dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized tensor: the storage array (``data``), plus E8M0 scale bytes for F8/F4.

    ``data`` is a C-contiguous numpy array in the storage dtype (float32, float16, or uint16 /
    uint8 bit patterns for BF16 / F8 / packed F4); arrays rather than bytes so serialization
    joins them without an extra copy. ``data.tobytes()`` is the stored byte string.
    """

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    scale: np.ndarray | None = None

    @property
    def storage_dtype(self) -> str:
        return STORAGE[self.dtype]


def _flat(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=_F32, order="C").reshape(-1)


def _quiet_nan() -> np.errstate:
    # Arithmetic on signalling NaNs (or inf * 0 in a NaN block) raises "invalid value"
    # warnings; such inputs are detected and patched explicitly, so the warning is noise.
    return np.errstate(invalid="ignore")


def _all_finite(x: np.ndarray) -> bool:
    # Two reductions at memory speed; NaN propagates through max/min.
    return x.size == 0 or bool(np.isfinite(x.max()) and np.isfinite(x.min()))


# ---------------------------------------------------------------------------------------------
# BF16 and F16


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round-to-nearest-even; NaN -> 0x7FC0."""
    x = np.asarray(x, dtype=_F32, order="C")
    u = x.reshape(-1).view(np.uint32)
    out = np.empty(u.size, np.uint16)
    t = np.empty(min(u.size, _CHUNK), np.uint32)
    for i in range(0, u.size, _CHUNK):
        ui, ti = u[i : i + _CHUNK], t[: u.size - i]
        # RNE: add 0x7FFF plus the lowest kept bit, then truncate. Carries into the exponent
        # are right (up to the next binade, or to inf past the largest bf16); no finite
        # float32 overflows uint32.
        np.right_shift(ui, 16, out=ti)
        ti &= 1
        ti += ui
        ti += 0x7FFF
        ti >>= 16
        np.copyto(out[i : i + _CHUNK], ti, casting="unsafe")
    if not _all_finite(x):
        # NaN would round into inf or wrap the sign; canonicalise it as torch does.
        out[np.isnan(x.reshape(-1))] = 0x7FC0
    return out.reshape(x.shape)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    bits = np.asarray(bits, dtype=np.uint16)
    out = np.empty(bits.shape, np.uint32)
    np.left_shift(bits, 16, out=out, dtype=np.uint32)
    return out.view(_F32)


def to_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> float16, round-to-nearest-even (numpy's cast); overflow becomes +-inf, NaN
    becomes 0x7E00 (canonical, so NaN payload bits cannot make equal inputs differ)."""
    x = np.asarray(x, dtype=_F32)
    with np.errstate(over="ignore"):
        out = x.astype(np.float16)
    if not _all_finite(x):
        out[np.isnan(x)] = np.float16(np.nan)
    return out


# ---------------------------------------------------------------------------------------------
# Minifloat grids (E4M3, E2M1)


@dataclass(frozen=True, eq=False)
class Grid:
    """A small float format: ``mbits`` mantissa bits, normal exponents ``emin..top``,
    subnormals below 2**emin, the non-negative values by code, and the NaN code (if any).

    A float32 rounds onto the grid by adding and subtracting a power of two picked from its
    exponent (clipped to ``[emin, top]``), which the FPU rounds to the grid's spacing (RNE); the
    rounded value's sign, exponent and top ``mbits`` mantissa bits then index ``table()`` for its
    code. ``E4M3_GRID`` and ``E2M1_GRID`` are the two in use; the device quantizers
    (``adapters.torch_quant``) round the same way and look codes up in the same tables.
    """

    mbits: int
    emin: int
    top: int
    values: np.ndarray
    nan_code: int | None

    @property
    def sign_bit(self) -> int:
        return 1 << (self.values.size - 1).bit_length()

    def table(self) -> np.ndarray:
        """Code of every rounded float32, indexed by its sign, exponent and top ``mbits``
        mantissa bits (``bits >> (23 - mbits)``). Above the largest value saturates."""
        shift = 23 - self.mbits
        idx = np.arange(1 << (32 - shift), dtype=np.uint64)
        v = (idx << shift).astype(np.uint32).view(_F32)
        mag = np.abs(v)
        code = np.minimum(np.searchsorted(self.values, mag), self.values.size - 1)
        code |= np.where(np.signbit(v), self.sign_bit, 0)
        if self.nan_code is not None:
            code[~np.isfinite(v)] = self.nan_code
        return code.astype(np.uint8)


E4M3_VALUES = np.array(  # the 127 finite non-negative values by code; 0x7F is NaN
    [(c & 7) / 8 * 2.0**-6 if c < 8 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7) for c in range(127)],
    dtype=np.float32,
)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# F8 E4M3fn: normals 2**-6 .. 448 (exponents -6..8), 3 mantissa bits, NaN code 0x7F, no inf.
E4M3_GRID = Grid(mbits=3, emin=-6, top=8, values=E4M3_VALUES, nan_code=0x7F)
# F4 E2M1: {0, .5, 1, 1.5, 2, 3, 4, 6}, 1 mantissa bit, no NaN or inf (saturates at 6).
E2M1_GRID = Grid(mbits=1, emin=0, top=2, values=E2M1_VALUES, nan_code=None)
# ``Grid.table()`` of each: the code (uint8, sign bit included) of a float32 already rounded onto
# the grid, indexed by ``bits >> 20`` (E4M3, 4096 entries) or ``bits >> 22`` (E2M1, 1024).
E4M3_CODES = E4M3_GRID.table()
E2M1_CODES = E2M1_GRID.table()


class _Scratch:
    """Reusable per-call buffers of one chunk."""

    def __init__(self, n: int) -> None:
        m = min(n, _CHUNK)
        self.a, self.b, self.c = np.empty(m, np.uint32), np.empty(m, np.uint32), np.empty(m, np.uint32)
        self.y = np.empty(m, _F32)

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.a[:n], self.b[:n], self.c[:n]


def _grid_codes(y: np.ndarray, grid: Grid, table: np.ndarray, out: np.ndarray, scratch: _Scratch) -> None:
    """float32 chunk -> RNE codes on ``grid``, written to ``out`` (uint8)."""
    u = y.view(np.uint32)
    mag, e, t = scratch.take(y.size)
    shift = 23 - grid.mbits
    np.bitwise_and(u, 0x7FFFFFFF, out=mag)
    # The magic-number trick: with M = 2**(exp + shift), (a + M) - M rounds a to a multiple of
    # 2**(exp - mbits), the grid's spacing in a's binade, by the FPU's own RNE. Clipping exp to
    # [emin, top] gives the uniform subnormal spacing below 2**emin and leaves larger values
    # (which saturate) alone. No step yields a float32 subnormal, so flush-to-zero modes set
    # by other libraries cannot change the result.
    np.bitwise_and(mag, 0x7F800000, out=e)
    np.clip(e, (127 + grid.emin) << 23, (127 + grid.top) << 23, out=e)
    e += shift << 23
    a, m, r = mag.view(_F32), e.view(_F32), t.view(_F32)
    np.add(a, m, out=r)
    r -= m
    # The rounded value is on the grid: its sign, exponent and top mantissa bits index the code.
    np.bitwise_and(u, 0x80000000, out=e)
    t |= e
    t >>= shift
    np.take(table, t, out=out)


# ---------------------------------------------------------------------------------------------
# F8 E4M3 (fn)

E4M3_MAX = 448.0
E4M3_FLOATS = np.concatenate([E4M3_VALUES, [np.nan], -E4M3_VALUES, [np.nan]]).astype(np.float32)


def _e4m3_encode(flat: np.ndarray, inv_scale: np.float32 | None) -> np.ndarray:
    out = np.empty(flat.size, np.uint8)
    scratch = _Scratch(flat.size)
    with _quiet_nan():
        for i in range(0, flat.size, _CHUNK):
            xi = flat[i : i + _CHUNK]
            if inv_scale is not None:
                # A power-of-two scale is exact; done per chunk so it costs no memory pass.
                xi = np.multiply(xi, inv_scale, out=scratch.y[: xi.size])
            _grid_codes(xi, E4M3_GRID, E4M3_CODES, out[i : i + _CHUNK], scratch)
    return out


def e4m3_values(codes: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """E4M3fn codes (uint8) -> float32 (exact), times a power-of-two ``scale``."""
    codes = np.asarray(codes, dtype=np.uint8)
    table = E4M3_FLOATS
    if scale != 1.0:
        # Folding the scale into the table is exact, except that top codes times the largest
        # scales pass float32's max: saturate there.
        with np.errstate(over="ignore"):
            table = np.clip(E4M3_FLOATS * np.float32(scale), -F32_MAX, F32_MAX)
    return np.take(table, codes.reshape(-1)).reshape(codes.shape)  # flat: take() on 0-d gives a scalar


def e4m3_amax(x: np.ndarray) -> np.float32:
    """The largest magnitude of the finite entries of ``x`` (0 for none): what an F8 tensor's
    scale is computed from. The maximum of the parts' values is the whole's (exact), so a
    tensor held in parts (a sharded node's ranks, a chunk's pieces) gets its scale from
    ``e4m3_scale_byte(max(e4m3_amax(part) for part in parts))``."""
    flat = np.asarray(x, dtype=_F32).reshape(-1)
    if flat.size == 0:
        return np.float32(0)
    amax = np.float32(max(flat.max(), -flat.min()))
    if not np.isfinite(amax):  # scale from the finite entries
        amax = np.float32(np.max(np.abs(flat), where=np.isfinite(flat), initial=0))
    return amax


def e4m3_scale_byte(amax: float | np.floating) -> int:
    """The E8M0 scale byte of an F8 tensor whose finite absolute maximum is ``amax``."""
    a = np.float32(amax)
    k = int(_pow2_exponent(np.array([a], _F32).view(np.uint32), E4M3_MAX)[0]) if a > 0 else 0
    return k + 127


def quantize_e4m3(x: np.ndarray, scale_byte: int | None = None) -> tuple[np.ndarray, int]:
    """float32 -> (E4M3 codes shaped like x, E8M0 scale byte). ``scale_byte``: the scale to use
    (a part of a larger tensor is encoded with the whole tensor's), else ``x``'s own."""
    x = np.asarray(x, dtype=_F32, order="C")
    flat = x.reshape(-1)
    if scale_byte is None:
        if flat.size == 0:
            return np.zeros(x.shape, np.uint8), 127
        scale_byte = e4m3_scale_byte(e4m3_amax(flat))
    k = int(scale_byte) - 127
    # Non-finite inputs stay non-finite through the scaling and map to the NaN code.
    codes = _e4m3_encode(flat, _inv_pow2(np.array([k]))[0] if k else None)
    return codes.reshape(x.shape), k + 127


def dequantize_e4m3(codes: np.ndarray, scale_byte: int) -> np.ndarray:
    return e4m3_values(codes, float(E8M0_VALUES[scale_byte]))


# ---------------------------------------------------------------------------------------------
# F4 E2M1 (OCP MX)

E2M1_MAX = 6.0
# Every packed byte -> its two values (low nibble first) as one uint64: one gather decodes two.
E2M1_FLOATS = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)
_E2M1_PAIRS = np.stack([E2M1_FLOATS[np.arange(256) & 15], E2M1_FLOATS[np.arange(256) >> 4]], axis=1)
_E2M1_PAIRS64 = _E2M1_PAIRS.reshape(-1).view(np.uint64)


def f4_sizes(n: int) -> tuple[int, int]:
    """(packed bytes, scale bytes) of an F4 tensor with ``n`` elements."""
    nblocks = -(-n // F4_BLOCK)
    return nblocks * F4_BLOCK // 2, nblocks


def quantize_f4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (packed codes, uint8 [16 * nblocks]; E8M0 scales, uint8 [nblocks])."""
    flat = _flat(x)
    nbytes, nblocks = f4_sizes(flat.size)
    if flat.size != nblocks * F4_BLOCK:
        flat = np.concatenate([flat, np.zeros(nblocks * F4_BLOCK - flat.size, _F32)])
    packed = np.empty(nbytes, np.uint8)
    scale = np.empty(nblocks, np.uint8)
    scratch = _Scratch(flat.size)
    codes = np.empty(min(flat.size, _CHUNK), np.uint8)
    with _quiet_nan():
        for i in range(0, flat.size, _CHUNK):
            xi = flat[i : i + _CHUNK]
            n = xi.size
            # Block amax on the magnitude bits: integer order is float order, NaN/inf sort last.
            mag, _, _ = scratch.take(n)
            np.bitwise_and(xi.view(np.uint32), 0x7FFFFFFF, out=mag)
            amax = mag.reshape(-1, F4_BLOCK).max(axis=1)
            k = _pow2_exponent(amax, E2M1_MAX)
            k[amax == 0] = 0
            finite = amax < 0x7F800000
            inv = _inv_pow2(k)
            inv[~finite] = 0  # the block decodes to NaN whatever its codes; zero them for stable bytes
            y = scratch.y[:n]
            np.multiply(xi.reshape(-1, F4_BLOCK), inv[:, None], out=y.reshape(-1, F4_BLOCK))
            _grid_codes(y, E2M1_GRID, E2M1_CODES, codes[:n], scratch)
            pairs = codes[:n].reshape(-1, 2)
            out = packed[i // 2 : (i + n) // 2]
            np.left_shift(pairs[:, 1], 4, out=out)
            out |= pairs[:, 0]
            sc = (k + 127).astype(np.uint8)
            sc[~finite] = 0xFF
            scale[i // F4_BLOCK : (i + n) // F4_BLOCK] = sc
    return packed, scale


def dequantize_f4(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    scale = np.asarray(scale, dtype=np.uint8)
    vals = np.take(_E2M1_PAIRS64, np.asarray(packed, dtype=np.uint8)).view(_F32).reshape(-1, F4_BLOCK)
    # Scales of 2**126 (byte 253) and up can carry a rounded-up block past float32's max: let
    # the multiply overflow there and saturate afterwards.
    big = bool(scale.size) and int(scale[scale != 255].max(initial=0)) >= 253
    with np.errstate(over="ignore" if big else "warn"):
        vals *= np.take(E8M0_VALUES, scale)[:, None]
    if big:
        np.clip(vals, -F32_MAX, F32_MAX, out=vals)
    return vals.reshape(-1)[:n].reshape(shape)


# ---------------------------------------------------------------------------------------------
# Dispatch


def quantize(x: np.ndarray, dtype: str, *, f8_scale: int | None = None) -> QTensor:
    """float32 array -> its storage form in ``dtype`` (one of ``DTYPES``). ``f8_scale``: for
    F8_E4M3, the E8M0 scale byte to encode with (a part of a tensor takes the whole tensor's,
    ``e4m3_scale_byte``); ignored by the other dtypes."""
    x = np.asarray(x, dtype=_F32, order="C")
    shape = tuple(int(d) for d in x.shape)
    if dtype == "F32":
        return QTensor(dtype, shape, x)
    if dtype == "F16":
        return QTensor(dtype, shape, to_f16(x))
    if dtype == "BF16":
        return QTensor(dtype, shape, to_bf16_bits(x))
    if dtype == "F8_E4M3":
        codes, scale_byte = quantize_e4m3(x, f8_scale)
        return QTensor(dtype, shape, codes, np.array([scale_byte], np.uint8))
    if dtype == "F4":
        packed, scale = quantize_f4(x)
        return QTensor(dtype, shape, packed, scale)
    if dtype == "I2":
        packed, scale = quantize_i2(x)
        return QTensor(dtype, shape, packed, scale)
    raise ValueError(f"unknown payload dtype {dtype!r}, expected one of {DTYPES}")


def dequantize(q: QTensor) -> np.ndarray:
    """QTensor -> float32 array of ``q.shape`` (a fresh, writable array)."""
    if q.dtype == "F32":
        return np.array(q.data, dtype=_F32).reshape(q.shape)
    if q.dtype == "F16":
        return np.asarray(q.data).view(np.float16).astype(_F32).reshape(q.shape)
    if q.dtype == "BF16":
        return from_bf16_bits(q.data).reshape(q.shape)
    assert q.scale is not None, f"{q.dtype} QTensor without a scale"
    if q.dtype == "F8_E4M3":
        return dequantize_e4m3(q.data, int(q.scale[0])).reshape(q.shape)
    if q.dtype == "F4":
        return dequantize_f4(q.data, q.scale, q.shape)
    if q.dtype == "I2":
        return dequantize_i2(q.data, q.scale, q.shape)
    raise ValueError(f"unknown payload dtype {q.dtype!r}, expected one of {DTYPES}")
