"""Framework adapters: read a model's trainable parameters as named host arrays and write
fragments back in place. The framework is detected from the model; adapters load lazily."""

from __future__ import annotations

import sys
from typing import Any

from .base import Adapter, NumpyAdapter


def adapter_for(model: Any) -> Adapter:
    """Pick the adapter for ``model``: torch (FSDP2-sharded or not), MLX, or an object that is
    already an adapter."""
    if isinstance(model, dict) and not _is_mlx_module(model):  # an mlx.nn.Module is a dict too
        return NumpyAdapter(model)
    if all(hasattr(model, a) for a in ("schema", "read", "write")):
        return model  # type: ignore[no-any-return]
    module = type(model).__module__ or ""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        # FSDP2 parameters are DTensors, FSDP1's views of flat parameters: without
        # torch.distributed.tensor or torch.distributed.fsdp loaded there are none.
        if any(sys.modules.get(m) is not None for m in ("torch.distributed.tensor", "torch.distributed.fsdp")):
            from .torch_sharded import ShardedTorchAdapter, find_sharded

            sharded = find_sharded(model)  # ShardingUnsupported for a layout it cannot cut
            if sharded is not None:
                return ShardedTorchAdapter(model, sharded)
        from .torch import TorchAdapter

        return TorchAdapter(model)
    if module.startswith("mlx") or _is_mlx_module(model):
        from .mlx import MLXAdapter

        return MLXAdapter(model)
    raise TypeError(
        f"cannot train a {type(model).__module__}.{type(model).__qualname__}: expected a torch.nn.Module, "
        "an mlx.nn.Module, a dict of numpy arrays, or an object with schema()/read()/write() (see docs/adapters.md)"
    )


def _is_mlx_module(model: Any) -> bool:
    nn = sys.modules.get("mlx.nn")
    return nn is not None and isinstance(model, nn.Module)


__all__ = ["Adapter", "NumpyAdapter", "adapter_for"]
