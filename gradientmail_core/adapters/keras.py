"""The Keras 3 adapter: ``trainable_variables`` in, ``Variable.assign`` out, on any backend.

Names come from ``Variable.path`` without the model's own name, ``/`` read as ``.``
(``sequential/l0/kernel`` is ``l0.kernel``), so a Keras model and a Flax NNX model built with
the same layer names share a schema. Keras names a layer left unnamed from its class and the
layers created before it in the process (``dense_1``), so two processes can name one model
differently: ``auto_named`` lists those names, for the error that says to name the layers.

On the jax backend ``model.fit`` keeps the weights outside the variables while it trains;
reading or writing first calls ``model.jax_state_sync()``, which puts them back and marks the
state synced, so the trainer takes the variables up again at its next batch (with what was
written). The call does nothing outside ``fit`` and on the other backends has no counterpart.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..codec import quant
from ..errors import MissingExtra
from ..protocol.records import TensorSpec
from .layouts import Kind, layout_of

try:
    import keras
except ImportError as e:  # exercised without keras
    raise MissingExtra("keras") from e

_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_KINDS: list[tuple[str, str, dict[str, str]]] = [
    ("Dense", "dense", {"kernel": "weight", "bias": "bias"}),
    ("Conv1D", "conv", {"kernel": "weight", "bias": "bias"}),
    ("Conv2D", "conv", {"kernel": "weight", "bias": "bias"}),
    ("Conv3D", "conv", {"kernel": "weight", "bias": "bias"}),
    ("Embedding", "embed", {"embeddings": "weight"}),
    ("LayerNormalization", "norm", {"gamma": "weight", "beta": "bias"}),
    ("BatchNormalization", "norm", {"gamma": "weight", "beta": "bias"}),
    ("GroupNormalization", "norm", {"gamma": "weight", "beta": "bias"}),
]


class KerasAdapter:
    """A Keras model's (or layer's) trainable variables by dotted path."""

    convention = "keras"

    def __init__(self, model: Any) -> None:
        if not model.built:
            raise ValueError(
                f"the Keras model {model.name!r} is not built, so it has no variables yet: call it on a batch or "
                "model.build(input_shape) before opening the session (model.fit builds it before its callbacks start)"
            )
        self.model = model
        owners: dict[int, Any] = {}
        auto_layers: set[str] = set()
        for layer in model._flatten_layers(include_self=True):  # parents first: the deepest layer wins
            for v in layer.trainable_weights:
                owners[id(v)] = layer
            if layer is not model and _auto_name(layer):
                auto_layers.add(layer.name)
        self.variables: dict[str, Any] = {}
        self.kinds: dict[str, Kind] = {}
        self.auto_named: dict[str, str] = {}  # name in the run -> the automatic layer name in it
        for v in model.trainable_variables:
            parts = v.path.split("/")
            if len(parts) > 1 and parts[0] == model.name:
                parts = parts[1:]
            name = ".".join(parts)
            if name in self.variables:
                raise ValueError(f"two trainable variables have the path {v.path!r}: give their layers distinct names")
            if v.dtype not in _DTYPES:
                raise TypeError(
                    f"parameter {name!r} has dtype {v.dtype}; gradientmail trains float32, bfloat16 and float16 "
                    "variables (set the layer's dtype, or make the variable non-trainable)"
                )
            self.variables[name] = v
            layer = owners.get(id(v))
            if layer is not None:
                kind = _kind(layer, parts[-1])
                if kind is not None:
                    self.kinds[name] = kind
            auto = [p for p in parts[:-1] if p in auto_layers]
            if auto:
                self.auto_named[name] = auto[0]
        if not self.variables:
            raise ValueError(f"the Keras model {model.name!r} has no trainable variables")

    def _sync(self) -> None:
        sync = getattr(self.model, "jax_state_sync", None)  # the jax backend's trainer only
        if sync is not None:
            sync()

    def schema(self) -> list[TensorSpec]:
        out = []
        for name, v in self.variables.items():
            shape = [int(d) for d in v.shape]
            layout = layout_of(self.convention, self.kinds.get(name), len(shape))
            out.append(TensorSpec(name=name, dtype=_DTYPES[v.dtype], shape=shape, layout=layout))
        return out

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        self._sync()
        return {n: np.array(keras.ops.convert_to_numpy(self.variables[n].value), dtype=np.float32) for n in names}

    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        self._sync()
        for n, v in values.items():
            var = self.variables[n]
            v = np.asarray(v, dtype=np.float32)
            assert tuple(v.shape) == tuple(var.shape), (n, v.shape, var.shape)
            if mixing:
                current = np.asarray(keras.ops.convert_to_numpy(var.value), dtype=np.float32)
                v = np.float32(mixing) * current + np.float32(1.0 - mixing) * v
            if var.dtype == "bfloat16":
                import ml_dtypes  # a dependency of keras

                host: np.ndarray = quant.to_bf16_bits(v).view(ml_dtypes.bfloat16)
            elif var.dtype == "float16":
                host = quant.to_f16(v)
            else:
                host = np.require(v, np.float32, "C")
            var.assign(host)  # the same variable: the optimizer's slots for it survive


def _kind(layer: Any, leaf: str) -> Kind | None:
    names = {c.__name__ for c in type(layer).__mro__}
    for cls, kind, roles in _KINDS:
        if cls in names and leaf in roles:
            return (kind, roles[leaf])
    return None


def _auto_name(layer: Any) -> bool:
    """Whether ``layer`` has the name Keras gives an unnamed layer: its class in snake case,
    with ``_<n>`` when the process made one before (``dense``, ``dense_3``, ``layer_normalization_1``)."""
    cls = re.sub(r"\W+", "", type(layer).__name__)
    snake = re.sub("([a-z])([A-Z])", r"\1_\2", re.sub("(.)([A-Z][a-z]+)", r"\1_\2", cls)).lower()
    return re.fullmatch(rf"{re.escape(snake)}(?:_\d+)?", layer.name) is not None


def explain(adapter: KerasAdapter, error: Any) -> str | None:
    """The fix for a ``SchemaMismatch`` that automatic layer names explain: None if none do."""
    differing = {d.split(":")[0] for d in error.differences}
    auto = sorted({adapter.auto_named[n] for n in differing if n in adapter.auto_named})
    if not auto:
        return None
    return (
        f"this Keras model has layers named automatically ({', '.join(auto[:5])}), and Keras numbers such names "
        "by the layers created before them in the process, so they differ between nodes: name every layer, "
        "e.g. keras.layers.Dense(64, name='l0'), the same on every node"
    )
