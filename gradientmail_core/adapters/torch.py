"""The torch adapter: ``named_parameters()`` in, in-place ``copy_`` out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import MissingExtra
from ..records import TensorSpec

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise MissingExtra("torch") from e

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class TorchAdapter:
    def __init__(self, model: Any) -> None:
        self.model = model
        # named_parameters() already yields a tied parameter once, under its first name.
        self.params: dict[str, torch.nn.Parameter] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters")
        for name, p in self.params.items():
            if p.dtype not in _DTYPES:
                raise TypeError(
                    f"parameter {name!r} has dtype {p.dtype}; gradientmail trains float32, bfloat16 and "
                    "float16 parameters (cast the model, or freeze this parameter)"
                )

    def schema(self) -> list[TensorSpec]:
        return [TensorSpec(name=n, dtype=_DTYPES[p.dtype], shape=list(p.shape)) for n, p in self.params.items()]

    @torch.no_grad()
    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        out = {}
        for n in names:
            t = self.params[n].detach().to("cpu", torch.float32, copy=True)
            out[n] = t.numpy()
        return out

    @torch.no_grad()
    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        for n, v in values.items():
            p = self.params[n]
            if mixing:
                # Blend on the host in numpy float32, like every other adapter, so a torch
                # and an MLX node mixing the same values hold the same bits.
                current = p.detach().to("cpu", torch.float32).numpy()
                v = np.float32(mixing) * current + np.float32(1.0 - mixing) * v
            # np.require keeps 0-d arrays 0-d (ascontiguousarray would make them 1-d)
            p.copy_(torch.from_numpy(np.require(v, np.float32, "C")).to(p.device))
