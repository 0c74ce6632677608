"""``quant.py``'s quantizers in torch, on whatever device the tensor lives on, and the
dequantization of their results there (``dequantize``, for error feedback).

Same rules, same bytes: every step is either integer arithmetic on the float32 bits or a single
IEEE float32 operation (one add, one subtract, one multiply by a power of two), which every
device rounds alike, and the E4M3/E2M1 codes come from ``quant``'s own tables. Values the numpy
quantizers leave to the FPU's NaN rules are set explicitly (see ``_f4_block_codes``), so a CUDA
node writes what a host node would. ``tests/test_torch_quant.py`` checks the bytes against numpy.
Dequantized values are the same bit for bit: a code's value comes from ``quant``'s own tables
(exact), times its power-of-two scale (one IEEE multiply), and a product past float32's max
saturates, as numpy's ``clip`` does; BF16 and F16 widen exactly.

Results stay on the device; ``to_qtensor`` views host copies of them as ``quant.QTensor``.
Large tensors are converted in chunks so the temporaries stay small beside a training job.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from ..codec import quant, quant_i2
from ..codec.e8m0 import E8M0_VALUES

CHUNK = 1 << 24  # elements per chunk; a multiple of F4_BLOCK so blocks never straddle chunks
_MAG = 0x7FFFFFFF
_EXP = 0x7F800000
_NP_STORAGE = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "F8_E4M3": np.uint8,
    "F4": np.uint8,
    "I2": np.uint8,
}


@dataclass(frozen=True, eq=False)
class DeviceQ:
    """A quantized tensor on the device: ``data`` in a torch dtype of the storage's element size
    (float32; int16 bits for F16/BF16; uint8 codes for F8_E4M3, packed F4 and I2), ``scale``
    uint8."""

    dtype: str
    shape: tuple[int, ...]
    data: torch.Tensor
    scale: torch.Tensor | None = None


def quantize(x: torch.Tensor, dtype: str) -> DeviceQ:
    """float32 tensor -> its storage form in ``dtype``, on x's device (``quant.quantize``'s bytes)."""
    assert x.dtype == torch.float32, x.dtype
    shape = tuple(int(d) for d in x.shape)
    x = x.contiguous()
    flat = x.reshape(-1)
    if dtype == "F32":
        return DeviceQ(dtype, shape, x)
    if dtype == "F16":
        return DeviceQ(dtype, shape, _chunked(flat, _f16_bits, torch.int16).reshape(shape))
    if dtype == "BF16":
        return DeviceQ(dtype, shape, _chunked(flat, _bf16_bits, torch.int16).reshape(shape))
    if dtype == "F8_E4M3":
        codes, scale = _e4m3(flat)
        return DeviceQ(dtype, shape, codes.reshape(shape), scale)
    if dtype == "F4":
        packed, scales = _f4(flat)
        return DeviceQ(dtype, shape, packed, scales)
    if dtype == "I2":
        packed, scales = _i2(flat)
        return DeviceQ(dtype, shape, packed, scales)
    raise ValueError(f"unknown payload dtype {dtype!r}, expected one of {quant.DTYPES}")


def to_qtensor(q: DeviceQ, data: torch.Tensor, scale: torch.Tensor | None) -> quant.QTensor:
    """A ``QTensor`` over host (CPU) copies of ``q.data`` and ``q.scale``; no copy."""
    arr = data.numpy().view(_NP_STORAGE[q.dtype])
    return quant.QTensor(q.dtype, q.shape, arr, None if scale is None else scale.numpy())


def _chunked(flat: torch.Tensor, fn, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(flat.numel(), dtype=dtype, device=flat.device)
    for i in range(0, flat.numel(), CHUNK):
        out[i : i + CHUNK] = fn(flat[i : i + CHUNK])
    return out


# ---------------------------------------------------------------------------------------------
# BF16 and F16


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """RNE on the bits: ``(u + 0x7FFF + lsb) >> 16``; NaN -> 0x7FC0 (not the device's cast,
    whose NaN differs between CPU and CUDA)."""
    u = x.view(torch.int32)
    nan = torch.isnan(x)
    u = u.masked_fill(nan, 0)  # keeps the add below clear of int32 overflow (only NaN bits reach it)
    t = (u + (0x7FFF + ((u >> 16) & 1))) >> 16  # arithmetic shift: the low 16 bits are right
    t = (t & 0xFFFF).masked_fill_(nan, 0x7FC0)
    return _as_int16(t)


def _f16_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float16 is one IEEE conversion (RNE, +-inf past 65504) on every device; NaN is
    canonicalised to 0x7E00 as numpy's path does."""
    return x.to(torch.float16).view(torch.int16).masked_fill(torch.isnan(x), 0x7E00)


def _as_int16(t: torch.Tensor) -> torch.Tensor:
    # 0..0xFFFF -> the int16 with those bits, without relying on an out-of-range cast
    return torch.where(t >= 0x8000, t - 0x10000, t).to(torch.int16)


# ---------------------------------------------------------------------------------------------
# Minifloat codes and E8M0 scales


@cache
def _table(name: str, device: torch.device) -> torch.Tensor:
    """``quant``'s tables on the device: a grid's codes (uint8), or the values of codes and scales."""
    codes = {"E4M3": quant.E4M3_CODES, "E2M1": quant.E2M1_CODES}
    if name in codes:
        return torch.from_numpy(codes[name]).to(device)
    values = {
        "E4M3 values": quant.E4M3_FLOATS,
        "E2M1 values": quant.E2M1_FLOATS,
        "E8M0 values": E8M0_VALUES,
        "I2 values": quant_i2.I2_LEVELS,
        "I2 scale values": quant_i2.I2_SCALE_VALUES,
    }[name]
    return torch.from_numpy(np.asarray(values, np.float32)).to(device)


def _grid_codes(y: torch.Tensor, grid: quant.Grid, name: str) -> torch.Tensor:
    """Finite float32 -> RNE codes on ``grid`` (uint8), by the numpy path's magic-number rounding
    (see ``quant.Grid``): ``(a + M) - M`` with M a power of two picked from a's exponent, then
    the code from ``grid``'s table. Entries that are not finite get some code; callers overwrite
    them."""
    shift = 23 - grid.mbits
    u = y.view(torch.int32)
    mag = u & _MAG
    e = (mag & _EXP).clamp_(int((127 + grid.emin) << 23), int((127 + grid.top) << 23)) + (shift << 23)
    a, m = mag.view(torch.float32), e.view(torch.float32)
    r = (a + m) - m  # two kernels, so no device may fuse or reassociate them
    idx = ((r.view(torch.int32) & _MAG) >> shift) | ((u < 0).to(torch.int32) << (31 - shift))
    return _table(name, y.device)[idx.long()]


def _pow2_exponent(amax_bits: torch.Tensor, top: float) -> torch.Tensor:
    """The numpy path's E8M0 exponent, on int32 bits: smallest k with amax <= top * 2**k, in
    [-127, 127] (integer arithmetic on the bits, exact at powers of two)."""
    tb = int(np.array([top], np.float32).view(np.uint32)[0])
    k = (amax_bits >> 23) - (tb >> 23) + ((amax_bits & 0x7FFFFF) > (tb & 0x7FFFFF)).to(torch.int32)
    return k.clamp_(-127, 127)


def _inv_pow2(k: torch.Tensor) -> torch.Tensor:
    """float32 2**-k for k in [-127, 126], from its bits."""
    return ((127 - k) << 23).view(torch.float32)


# ---------------------------------------------------------------------------------------------
# F8 E4M3 (fn), one scale per tensor


def _e4m3(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=flat.device), _byte(127, flat.device)
    mag = flat.view(torch.int32) & _MAG
    # Scale from the finite entries; integer order of the magnitude bits is float order.
    amax = torch.where(mag < _EXP, mag, 0).max()
    k = torch.where(amax > 0, _pow2_exponent(amax, quant.E4M3_MAX), 0)
    inv = _inv_pow2(k)

    def codes(x: torch.Tensor) -> torch.Tensor:
        c = _grid_codes(x * inv, quant.E4M3_GRID, "E4M3")  # a power-of-two scale is exact
        return c.masked_fill_(~torch.isfinite(x), 0x7F)  # E4M3fn has no inf: NaN code

    return _chunked(flat, codes, torch.uint8), (k + 127).to(torch.uint8).reshape(1)


def _byte(b: int, device: torch.device) -> torch.Tensor:
    return torch.full((1,), b, dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------------------
# F4 and I2: codes packed into bytes, one scale per block of 32


def _blockwise(flat: torch.Tensor, block: int, sizes, bits: int, block_codes) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scale per block) of ``flat`` zero-padded to whole blocks (``sizes(n)``: their
    bytes and number), a ``CHUNK`` at a time: ``block_codes(blocks, start)`` gives the chunk's
    codes of ``bits`` bits and its blocks' scales; codes are packed ``8 // bits`` a byte, lowest
    bits first."""
    n = flat.numel()
    nbytes, nblocks = sizes(n)
    if n != nblocks * block:
        flat = torch.cat([flat, flat.new_zeros(nblocks * block - n)])
    packed = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    scales = torch.empty(nblocks, dtype=torch.uint8, device=flat.device)
    per = 8 // bits
    for i in range(0, flat.numel(), CHUNK):
        codes, sc = block_codes(flat[i : i + CHUNK].reshape(-1, block), i)
        q = codes.reshape(-1, per)
        byte = q[:, 0]
        for j in range(1, per):
            byte = byte | (q[:, j] << (bits * j))
        packed[i // per : i // per + q.shape[0]] = byte
        scales[i // block : i // block + sc.numel()] = sc
    return packed, scales


def _f4(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _blockwise(flat, quant.F4_BLOCK, quant.f4_sizes, 4, lambda blocks, _: _f4_block_codes(blocks))


def _f4_block_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nblocks, 32] float32 -> (E2M1 codes [nblocks * 32], E8M0 scale per block)."""
    u = blocks.view(torch.int32)
    amax = (u & _MAG).amax(dim=1)
    finite = amax < _EXP
    k = torch.where(amax > 0, _pow2_exponent(amax, quant.E2M1_MAX), 0)
    inv = torch.where(finite, _inv_pow2(k), 1.0)
    codes = _grid_codes(blocks * inv[:, None], quant.E2M1_GRID, "E2M1").reshape(blocks.shape)
    # A block holding a non-finite value decodes to NaN whatever its codes. numpy scales such a
    # block by 0 and codes what the FPU gives; on x86 hosts: a finite x -> +-0 (its sign), a
    # NaN -> that NaN (its sign, magnitude code 7), an inf -> the default NaN, negative (code 15).
    # Written out here, because CUDA's NaNs differ (they carry no sign).
    neg = (u < 0).to(torch.uint8) << 3
    nonfinite = torch.where(torch.isnan(blocks), neg | 7, torch.where(torch.isinf(blocks), 15, neg))
    codes = torch.where(finite[:, None], codes, nonfinite.to(torch.uint8))
    scale = torch.where(finite, k + 127, 0xFF).to(torch.uint8)
    return codes.reshape(-1), scale


# I2 (``codec/quant_i2.py``: the grid and why)


def _i2(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = flat.numel()

    def codes(blocks: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        last = at + (blocks.shape[0] - 1) * quant_i2.I2_BLOCK  # where the chunk's last block starts
        return _i2_block_codes(blocks, min(n - last, quant_i2.I2_BLOCK))

    return _blockwise(flat, quant_i2.I2_BLOCK, quant_i2.i2_sizes, 2, codes)


def _i2_block_codes(blocks: torch.Tensor, n_last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[nblocks, 32] float32 -> (I2 codes [nblocks * 32], scale byte per block); the last block
    holds ``n_last`` values, then padding. ``quant_i2._choose`` and ``quantize_i2``, op for op;
    the search is exact integer arithmetic, so ``torch.sum``'s order cannot change it."""
    u = blocks.view(torch.int32)
    mag = u & _MAG
    amax = mag.amax(dim=1)
    k0 = _pow2_exponent(amax, quant_i2.I2_TOP).long()
    kn = k0.clamp(max=126)
    y = _fixed_point(mag, kn)
    y_all = y.sum(dim=1, dtype=torch.int64)
    n = torch.full_like(k0, quant_i2.I2_BLOCK)
    n[-1] = n_last
    best_k = torch.zeros_like(k0)
    best_err = torch.full_like(k0, torch.iinfo(torch.int64).max)
    for j in quant_i2.I2_TRIES:
        k = (k0 + j).clamp_(-126, 127)
        s = torch.ones_like(k) << (quant_i2.FIX + k - kn)
        outer = y > (2 * s)[:, None]
        y_out = torch.where(outer, y, 0).sum(dim=1, dtype=torch.int64)
        n_out = outer.sum(dim=1)
        err = s * s * (n + 8 * n_out) - 2 * s * (y_all + 2 * y_out)
        better = err < best_err
        best_k = torch.where(better, k, best_k)
        best_err = torch.where(better, err, best_err)
    outer_bits = ((best_k + 128) << 23).to(torch.int32)  # 2**(k + 1); at k = 127, inf's bits
    codes = (((u < 0).to(torch.int32) << 1) | (mag > outer_bits[:, None]).to(torch.int32)).to(torch.uint8)
    regular = (amax > 0) & (amax < _EXP)
    codes = torch.where(regular[:, None], codes, 0).to(torch.uint8)
    zero, nan = quant_i2.ZERO_SCALE, quant_i2.NAN_SCALE
    scale = torch.where(amax == 0, zero, torch.where(amax >= _EXP, nan, best_k + 127)).to(torch.uint8)
    return codes.reshape(-1), scale


def _fixed_point(mag: torch.Tensor, kn: torch.Tensor) -> torch.Tensor:
    """``quant_i2.fixed_point``: ``floor(|x| * 2**(FIX - kn))`` from the bits, by a shift."""
    e = (mag >> 23).clamp_(min=1)
    m = mag - ((e - 1) << 23)
    shift = (kn + (150 - quant_i2.FIX)).to(torch.int32)[:, None] - e
    return m >> shift.clamp_(0, 31)


# ---------------------------------------------------------------------------------------------
# Dequantizing

_F32_MAX = float(quant.F32_MAX)


def dequantize(q: DeviceQ) -> torch.Tensor:
    """A device-quantized tensor -> float32 of ``q.shape`` (a fresh tensor), ``quant.dequantize``'s values."""
    device = q.data.device
    if q.dtype == "F32":
        return q.data.clone().reshape(q.shape)
    if q.dtype == "F16":
        return q.data.view(torch.float16).float().reshape(q.shape)
    if q.dtype == "BF16":
        return ((q.data.to(torch.int32) & 0xFFFF) << 16).view(torch.float32).reshape(q.shape)
    assert q.scale is not None, f"{q.dtype} without a scale"
    n = int(np.prod(q.shape, dtype=np.int64))
    if q.dtype == "F8_E4M3":  # one scale for the tensor
        codes, values, scales = q.data.reshape(-1, 1), "E4M3 values", "E8M0 values"
    elif q.dtype == "F4":  # two codes a byte, low nibble first, a scale per block
        codes = torch.stack([q.data & 15, q.data >> 4], dim=1).reshape(-1, quant.F4_BLOCK)
        values, scales = "E2M1 values", "E8M0 values"
    elif q.dtype == "I2":  # four codes a byte, lowest bits first, a scale per block
        codes = torch.stack([(q.data >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1, quant_i2.I2_BLOCK)
        values, scales = "I2 values", "I2 scale values"
    else:
        raise ValueError(f"unknown payload dtype {q.dtype!r}, expected one of {quant.DTYPES}")
    vals = _table(values, device)[codes.long()] * _table(scales, device)[q.scale.long()][:, None]
    return vals.clamp_(-_F32_MAX, _F32_MAX).reshape(-1)[:n].reshape(q.shape)
