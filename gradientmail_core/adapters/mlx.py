"""The MLX adapter: ``trainable_parameters()`` in, leaf replacement out.

MLX arrays are values, not buffers: "in place" means replacing the leaf in the module tree,
which is what ``Module.update`` (and the optimizer) do too. Optimizer state is keyed by the
same tree path, so it survives a write. Names are ``mlx.utils.tree_flatten``'s dotted paths
(``layers.0.weight``), the same scheme as torch's ``named_parameters()``, listed in torch's
order; a structurally equal torch and MLX model therefore share one schema (see
docs/adapters.md for naming modules so they match).

All arithmetic stays in the core's numpy float32; this module only converts. BF16 and F16
parameters are converted through numpy's bit patterns (``quant.to_bf16_bits``, numpy's RNE
cast), so an MLX node rounds exactly as the core and torch do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..codec import quant
from ..errors import MissingExtra
from ..protocol.records import TensorSpec
from .naming import Names, renaming

try:
    import mlx.core as mx
    import mlx.nn as nn
except ImportError as e:  # exercised without mlx, or with plain `mlx` on Linux (no CPU backend)
    raise MissingExtra("mlx") from e

_DTYPES = {mx.float32: "F32", mx.bfloat16: "BF16", mx.float16: "F16"}
_SUPPORTED = "float32, bfloat16 and float16"

Path = tuple[str | int, ...]


class MLXAdapter:
    """``model``'s trainable parameters by dotted path, renamed by ``names`` (``naming.renaming``)."""

    def __init__(self, model: Any, *, names: Names | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"MLXAdapter needs an mlx.nn.Module, found {type(model).__module__}.{type(model).__name__}")
        self.model = model
        self.paths: dict[str, Path] = {}
        first_name: dict[int, str] = {}
        for path, value in _leaves(model.trainable_parameters(), ()):
            name = _name(path)
            if not isinstance(value, mx.array):
                raise TypeError(f"parameter {name!r} is a {type(value).__name__}, expected an mlx.core.array")
            if value.dtype not in _DTYPES:
                raise TypeError(
                    f"parameter {name!r} has dtype {value.dtype}; gradientmail trains {_SUPPORTED} "
                    "parameters (cast the model, e.g. model.set_dtype(mx.float32), or freeze this parameter)"
                )
            if id(value) in first_name:
                # Sharing one array under two names is not a tie in MLX: the gradient and the
                # optimizer treat each name as its own leaf, so the two drift apart after a step.
                raise ValueError(
                    f"parameters {first_name[id(value)]!r} and {name!r} are the same array; MLX updates each "
                    "name separately, so the tie would not survive training. Tie them in the forward pass "
                    "instead (e.g. nn.Embedding.as_linear) so the array appears once in trainable_parameters()"
                )
            first_name[id(value)] = name
            self.paths[name] = path
        if not self.paths:
            raise ValueError(f"{type(model).__name__} has no trainable parameters (all frozen, or none defined)")
        to_run = renaming(names, list(self.paths))
        self.paths = {to_run[n]: path for n, path in self.paths.items()}

    def _get(self, name: str) -> Any:
        node: Any = self.model
        for key in self.paths[name]:
            node = node[key]
        return node

    def schema(self) -> list[TensorSpec]:
        out = []
        for name in self.paths:
            p = self._get(name)
            out.append(TensorSpec(name=name, dtype=_DTYPES[p.dtype], shape=[int(d) for d in p.shape]))
        return out

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        out = {}
        for n in names:
            p = self._get(n)
            if p.dtype == mx.bfloat16:
                # numpy has no bfloat16: take the bit patterns; widening to float32 is exact.
                out[n] = quant.from_bf16_bits(np.array(p.view(mx.uint16)))
            else:
                out[n] = np.array(p, dtype=np.float32)  # a copy, also for float32
        return out

    def subtract_from(self, out: Mapping[str, np.ndarray]) -> None:
        """``out[n] -= params[n]`` in float32, in place: one parameter's host copy at a time."""
        for n, o in out.items():
            np.subtract(o, self.read([n])[n], out=o, dtype=np.float32)

    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        written = []
        for n, v in values.items():
            path = self.paths[n]
            old = self._get(n)
            v = np.asarray(v, dtype=np.float32)
            # MLX would silently accept any shape for a leaf; the core always passes the schema's.
            assert tuple(v.shape) == tuple(old.shape), (n, v.shape, old.shape)
            if mixing:
                v = np.asarray(np.float32(mixing) * self.read([n])[n] + np.float32(1.0 - mixing) * v)
            new = _from_host(v, old.dtype)
            parent: Any = self.model
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = new
            written.append(new)
        mx.eval(written)  # materialise now, so nothing lazy hangs off the training graph


def _from_host(v: np.ndarray, dtype: Any) -> Any:
    if dtype == mx.bfloat16:
        return mx.array(quant.to_bf16_bits(v)).view(mx.bfloat16)
    if dtype == mx.float16:
        return mx.array(quant.to_f16(v))
    return mx.array(v)  # not np.ascontiguousarray: it turns a 0-d array into shape (1,)


def _leaves(tree: Any, path: Path) -> list[tuple[Path, Any]]:
    """(path, leaf) pairs of a ``trainable_parameters()`` tree (dicts, lists and arrays).

    Paths join into ``mlx.utils.tree_flatten``'s names; list indices stay ints so a write can
    walk back to the leaf's container. The order is torch's ``named_parameters()`` order: at
    every level the arrays held directly come first, then the nested containers, each in
    insertion order (a torch module lists its own parameters before its children's), so a
    structurally equal torch model lists the same names in the same order.
    """
    if isinstance(tree, list):
        items: list[tuple[str | int, Any]] = list(enumerate(tree))
    else:
        items = list(tree.items())
        for key, _ in items:
            if not isinstance(key, str) or not key or "." in key or "#" in key:
                raise ValueError(
                    f"parameter path {_name((*path, str(key)))!r} has the key {key!r}: names are dotted "
                    "paths, so keys must be non-empty strings without '.' or '#' (rename the attribute "
                    "or dict key)"
                )
    out = [((*path, k), v) for k, v in items if not isinstance(v, dict | list)]
    for k, v in items:
        if isinstance(v, dict | list):
            out.extend(_leaves(v, (*path, k)))
    return out


def _name(path: Path) -> str:
    return ".".join(str(k) for k in path)
