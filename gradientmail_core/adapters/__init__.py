"""Framework adapters: read a model's trainable parameters as named host arrays and write
fragments back in place. The framework is detected from the model; adapters load lazily (a
framework counts only once the user's code imported it: nothing here imports one)."""

from __future__ import annotations

import sys
from typing import Any

from .base import Adapter, NumpyAdapter, Renamed
from .layouts import Laid, Layouts
from .naming import Names, Select, select


def adapter_for(
    model: Any, *, module: Select | None = None, names: Names | None = None, layouts: Layouts | None = None
) -> Adapter:
    """Pick the adapter for ``model``: torch (FSDP-sharded or not), MLX, a Flax NNX module, a pytree
    of JAX arrays, a Keras 3 model, or an object that is already an adapter. ``module``: the
    submodule whose parameters form the run (``naming.select``); ``layouts``: a convention
    (``"torch"``, ``"flax"``, ``"keras"``) or ``{name: axes}`` this node shows its tensors in
    (``layouts.Laid``); ``names``: this node's names (after ``layouts``) -> the run's."""
    if _is_jax_tree(model) or _is_keras(model):
        if module is not None:
            raise ValueError("module= picks a submodule of a torch or MLX model; pass the JAX or Keras part itself")
        if _is_keras(model):
            from .keras import KerasAdapter

            native: Any = KerasAdapter(model)
        else:
            from .jax import adapter_for_jax

            native = adapter_for_jax(model)
        return _renamed(native if layouts is None else Laid(native, layouts), names)
    plain = isinstance(model, dict) and not _is_mlx_module(model)  # an mlx.nn.Module is a dict too
    if plain or all(hasattr(model, a) for a in ("schema", "read", "write")):
        if module is not None:
            raise ValueError(
                "module= picks a submodule of a torch or MLX model; this model is a dict of arrays or an adapter: "
                "pass the part that forms the run itself"
            )
        inner = NumpyAdapter(model) if plain else model
        return _renamed(inner if layouts is None else Laid(inner, layouts), names)
    sub = select(model, module)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(sub, torch.nn.Module):
        # FSDP2 parameters are DTensors, FSDP1's views of flat parameters: without
        # torch.distributed.tensor or torch.distributed.fsdp loaded there are none.
        if any(sys.modules.get(m) is not None for m in ("torch.distributed.tensor", "torch.distributed.fsdp")):
            from .torch_sharded import ShardedTorchAdapter, find_sharded

            sharded = find_sharded(sub, root=model, names=names)  # ShardingUnsupported for a layout it cannot cut
            if sharded is not None:
                if layouts is not None:
                    raise ValueError(
                        "layouts= is not supported on a sharded (FSDP) node: join a run in the torch layout, "
                        "or convert the model's layers"
                    )
                return ShardedTorchAdapter(sub, sharded)
        from .torch import TorchAdapter

        if layouts is None:
            return TorchAdapter(sub, names=names)
        return _renamed(Laid(TorchAdapter(sub), layouts), names)
    if (type(sub).__module__ or "").startswith("mlx") or _is_mlx_module(sub):
        from .mlx import MLXAdapter

        if layouts is None:
            return MLXAdapter(sub, names=names)
        return _renamed(Laid(MLXAdapter(sub), layouts), names)
    raise TypeError(
        f"cannot train a {type(sub).__module__}.{type(sub).__qualname__}: expected a torch.nn.Module, "
        "an mlx.nn.Module, a Flax NNX module, a pytree of JAX arrays, a Keras model, a dict of numpy arrays, "
        "or an object with schema()/read()/write() (see docs/adapters.md)"
    )


def _renamed(adapter: Any, names: Names | None) -> Adapter:
    return adapter if names is None else Renamed(adapter, names)


def _is_jax_tree(model: Any) -> bool:
    """A Flax NNX module, or a pytree (dict, list, tuple) whose leaves are JAX arrays."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(model, nnx.Module):
        return True
    jax = sys.modules.get("jax")
    if jax is None or not isinstance(model, dict | list | tuple) or _is_mlx_module(model):
        return False
    leaves = jax.tree_util.tree_leaves(model)
    return bool(leaves) and all(isinstance(x, jax.Array) for x in leaves)


def _is_keras(model: Any) -> bool:
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(model, keras.layers.Layer)


def _is_mlx_module(model: Any) -> bool:
    nn = sys.modules.get("mlx.nn")
    return nn is not None and isinstance(model, nn.Module)


__all__ = ["Adapter", "Laid", "Layouts", "NumpyAdapter", "Renamed", "adapter_for"]
