"""Framework adapters: read a model's trainable parameters as named host arrays and write
fragments back in place. The framework is detected from the model; adapters load lazily."""

from __future__ import annotations

import sys
from typing import Any

from .base import Adapter, NumpyAdapter, Renamed
from .naming import Names, Select, select


def adapter_for(model: Any, *, module: Select | None = None, names: Names | None = None) -> Adapter:
    """Pick the adapter for ``model``: torch (FSDP-sharded or not), MLX, or an object that is
    already an adapter. ``module``: the submodule whose parameters form the run (``naming.select``);
    ``names``: this node's canonical names -> the run's (``naming.renaming``)."""
    plain = isinstance(model, dict) and not _is_mlx_module(model)  # an mlx.nn.Module is a dict too
    if plain or all(hasattr(model, a) for a in ("schema", "read", "write")):
        if module is not None:
            raise ValueError(
                "module= picks a submodule of a torch or MLX model; this model is a dict of arrays or an adapter: "
                "pass the part that forms the run itself"
            )
        return _renamed(NumpyAdapter(model) if plain else model, names)
    sub = select(model, module)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(sub, torch.nn.Module):
        # FSDP2 parameters are DTensors, FSDP1's views of flat parameters: without
        # torch.distributed.tensor or torch.distributed.fsdp loaded there are none.
        if any(sys.modules.get(m) is not None for m in ("torch.distributed.tensor", "torch.distributed.fsdp")):
            from .torch_sharded import ShardedTorchAdapter, find_sharded

            sharded = find_sharded(sub, root=model, names=names)  # ShardingUnsupported for a layout it cannot cut
            if sharded is not None:
                return ShardedTorchAdapter(sub, sharded)
        from .torch import TorchAdapter

        return TorchAdapter(sub, names=names)
    if (type(sub).__module__ or "").startswith("mlx") or _is_mlx_module(sub):
        from .mlx import MLXAdapter

        return MLXAdapter(sub, names=names)
    raise TypeError(
        f"cannot train a {type(sub).__module__}.{type(sub).__qualname__}: expected a torch.nn.Module, "
        "an mlx.nn.Module, a dict of numpy arrays, or an object with schema()/read()/write() (see docs/adapters.md)"
    )


def _renamed(adapter: Any, names: Names | None) -> Adapter:
    return adapter if names is None else Renamed(adapter, names)


def _is_mlx_module(model: Any) -> bool:
    nn = sys.modules.get("mlx.nn")
    return nn is not None and isinstance(model, nn.Module)


__all__ = ["Adapter", "NumpyAdapter", "Renamed", "adapter_for"]
