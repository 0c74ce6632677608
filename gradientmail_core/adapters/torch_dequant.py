"""``quant.dequantize`` in torch, on the device of ``torch_quant``'s results (for error feedback).

The same values bit for bit: a code's value comes from ``quant``'s own tables (exact), times its
power-of-two scale (one IEEE multiply), and a product past float32's max saturates, as numpy's
``clip`` does. BF16 and F16 widen exactly.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from ..codec import quant, quant_i2
from ..codec.e8m0 import E8M0_VALUES
from .torch_quant import DeviceQ

_F32_MAX = float(quant.F32_MAX)


@cache
def _table(name: str, device: torch.device) -> torch.Tensor:
    values = {
        "E4M3": quant._E4M3_FLOATS,
        "E2M1": quant._E2M1_FLOATS,
        "E8M0": E8M0_VALUES,
        "I2": quant_i2.I2_LEVELS,
        "I2_SCALE": quant_i2.I2_SCALE_VALUES,
    }[name]
    return torch.from_numpy(np.asarray(values, np.float32)).to(device)


def dequantize(q: DeviceQ) -> torch.Tensor:
    """A device-quantized tensor -> float32 of ``q.shape`` (a fresh tensor)."""
    device = q.data.device
    if q.dtype == "F32":
        return q.data.clone().reshape(q.shape)
    if q.dtype == "F16":
        return q.data.view(torch.float16).float().reshape(q.shape)
    if q.dtype == "BF16":
        return ((q.data.to(torch.int32) & 0xFFFF) << 16).view(torch.float32).reshape(q.shape)
    assert q.scale is not None, f"{q.dtype} without a scale"
    n = int(np.prod(q.shape, dtype=np.int64))
    if q.dtype == "F8_E4M3":
        vals = _table("E4M3", device)[q.data.reshape(-1).long()] * _table("E8M0", device)[q.scale.long()]
    elif q.dtype == "F4":
        codes = torch.stack([q.data & 15, q.data >> 4], dim=1).reshape(-1, quant.F4_BLOCK)
        vals = _table("E2M1", device)[codes.long()] * _table("E8M0", device)[q.scale.long()][:, None]
    elif q.dtype == "I2":
        codes = torch.stack([(q.data >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1, quant_i2.I2_BLOCK)
        vals = _table("I2", device)[codes.long()] * _table("I2_SCALE", device)[q.scale.long()][:, None]
    else:
        raise ValueError(f"unknown payload dtype {q.dtype!r}, expected one of {quant.DTYPES}")
    return vals.clamp_(-_F32_MAX, _F32_MAX).reshape(-1)[:n].reshape(q.shape)
