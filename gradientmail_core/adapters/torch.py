"""The torch adapter: ``named_parameters()`` in, in-place ``copy_`` out.

Parameters on a CUDA device are read without stalling the training thread: each is copied,
``non_blocking``, into a pinned host buffer, and a CUDA event recorded after the copies; the
mapping handed back waits on that event only when the background thread first reads a value.
A plain ``.to("cpu")`` would instead wait for all the GPU work queued so far.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
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
    def read(self, names: Sequence[str]) -> Mapping[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        pinned: dict[str, torch.Tensor] = {}
        for n in names:
            p = self.params[n].detach()
            if p.is_cuda:
                host = torch.empty(p.shape, dtype=torch.float32, pin_memory=True)
                host.copy_(p, non_blocking=True)  # casts on the device, then one async copy
                pinned[n] = host
            else:
                out[n] = p.to("cpu", torch.float32, copy=True).numpy()
        if not pinned:
            return out
        return _HostCopies(out, pinned, torch.cuda.Event())

    @torch.no_grad()
    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        for n, v in values.items():
            p = self.params[n]
            if mixing:
                # Blend on the host in numpy float32, like every other adapter, so a torch
                # and an MLX node mixing the same values hold the same bits.
                current = p.detach().to("cpu", torch.float32).numpy()
                v = np.float32(mixing) * current + np.float32(1.0 - mixing) * v
            # np.require keeps 0-d arrays 0-d (ascontiguousarray would make them 1-d). One copy
            # straight into the parameter (casting on the way), not via a temporary on its device.
            p.copy_(torch.from_numpy(np.require(v, np.float32, "C")))


class _HostCopies(Mapping[str, np.ndarray]):
    """Host float32 copies of CUDA parameters still in flight: reading a value waits (once) for
    the copies, so that wait happens on whichever thread first looks, never at ``read``."""

    def __init__(self, ready: dict[str, np.ndarray], pinned: dict[str, torch.Tensor], event: Any) -> None:
        event.record()  # on the current stream, after the copies just queued
        self._ready, self._pinned, self._event = ready, pinned, event
        self._names = [*ready, *pinned]

    def _wait(self) -> None:
        if self._pinned:
            self._event.synchronize()
            # numpy views keep their pinned tensors alive (and the caching host allocator
            # reuses the blocks once they are freed).
            self._ready.update({n: t.numpy() for n, t in self._pinned.items()})
            self._pinned = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._ready:
            self._wait()
        return self._ready[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
