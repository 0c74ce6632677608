"""The JAX adapters: a Flax NNX module (``nnx.state`` in, ``nnx.update`` out), or a pytree of
parameters in a functional loop.

JAX arrays are immutable: "in place" means the module's ``Param`` variables take new arrays
(``nnx.update`` keeps each variable, so an ``nnx.Optimizer``'s state, keyed by the same paths,
survives), or, for a pytree, the session hands back a new tree with the written leaves
replaced: ``params = session.step(samples=n, params=params)`` (``TreeParams``). Arrays stay
where they live: they come to the host only to be read for a contribution, and a written value
goes back with the old leaf's sharding (its device).

Names are the pytree paths dotted, without NNX's ``.value`` leaf (``blocks.0.attn.kernel``).
An NNX module declares each parameter's layer (``kinds``: ``nnx.Linear`` kernels are dense,
(in, out)); a plain pytree is read by the Flax naming of leaves (``kernel``, ``embedding``,
``scale``), so ``layouts="torch"`` (``layouts.py``) shows either in torch's names and axis order.
All arithmetic stays in the core's numpy float32; BF16 and F16 go through the core's rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..codec import quant
from ..errors import MissingExtra
from ..protocol.records import TensorSpec
from .layouts import Kind, layout_of

try:
    import jax
    import jax.numpy as jnp
except ImportError as e:  # exercised without jax
    raise MissingExtra("jax") from e

_DTYPES = {jnp.dtype(jnp.float32): "F32", jnp.dtype(jnp.bfloat16): "BF16", jnp.dtype(jnp.float16): "F16"}
Path = tuple[str | int, ...]


def adapter_for_jax(model: Any) -> JaxAdapter:
    nnx = _nnx()
    if nnx is not None and isinstance(model, nnx.Module):
        return JaxAdapter(NNXParams(model, nnx))
    return JaxAdapter(TreeParams(model))


class JaxAdapter:
    """The parameters of ``source`` (``NNXParams`` or ``TreeParams``: where the arrays live and
    how new ones are put back) by dotted path."""

    convention = "flax"

    def __init__(self, source: NNXParams | TreeParams) -> None:
        self.source = source
        self.paths: dict[str, Path] = {}
        self.kinds: dict[str, Kind] = {}
        for path, value in source.leaves().items():
            name = ".".join(str(k) for k in path)
            if not isinstance(value, jax.Array):
                raise TypeError(f"parameter {name!r} is a {type(value).__name__}, expected a jax.Array")
            if value.dtype not in _DTYPES:
                raise TypeError(
                    f"parameter {name!r} has dtype {value.dtype}; gradientmail trains float32, bfloat16 and float16 "
                    "parameters (cast it, or keep it out of the trained parameters)"
                )
            for key in path:
                if isinstance(key, str) and (not key or "." in key or "#" in key):
                    raise ValueError(
                        f"parameter path {name!r} has the key {key!r}: names are dotted paths, so keys must be "
                        "non-empty strings without '.' or '#' (rename the attribute or dict key)"
                    )
            self.paths[name] = path
            if path in source.kinds:
                self.kinds[name] = source.kinds[path]
        if not self.paths:
            raise ValueError("the model has no parameters to train")

    def schema(self) -> list[TensorSpec]:
        leaves = self.source.leaves()
        out = []
        for name, path in self.paths.items():
            v = leaves[path]
            layout = layout_of(self.convention, self.kinds.get(name), v.ndim)
            out.append(TensorSpec(name=name, dtype=_DTYPES[v.dtype], shape=[int(d) for d in v.shape], layout=layout))
        return out

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        leaves = self.source.leaves()
        # A copy: a CPU array's buffer may be shared with the host, and donated by the next step.
        return {n: np.array(leaves[self.paths[n]], dtype=np.float32) for n in names}

    def subtract_from(self, out: Mapping[str, np.ndarray]) -> None:
        """``out[n] -= params[n]`` in float32, in place (a CPU float32 array is read without a copy)."""
        leaves = self.source.leaves()
        for n, o in out.items():
            np.subtract(o, np.asarray(leaves[self.paths[n]]), out=o, dtype=np.float32)

    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        leaves = self.source.leaves()
        new = {}
        for n, v in values.items():
            old = leaves[self.paths[n]]
            v = np.asarray(v, dtype=np.float32)
            assert tuple(v.shape) == tuple(old.shape), (n, v.shape, old.shape)
            if mixing:
                v = np.float32(mixing) * np.asarray(old, dtype=np.float32) + np.float32(1.0 - mixing) * v
            if old.dtype == jnp.bfloat16:
                host: np.ndarray = quant.to_bf16_bits(v).view(jnp.bfloat16)
            elif old.dtype == jnp.float16:
                host = quant.to_f16(v)
            else:
                host = np.require(v, np.float32, "C")
            new[self.paths[n]] = jax.device_put(host, old.sharding)  # back where the old leaf lives
        self.source.replace(new)


class NNXParams:
    """A Flax NNX module's ``nnx.Param`` variables: read through ``nnx.state``, written back
    through ``nnx.update`` (which keeps each variable, and so an optimizer's state)."""

    def __init__(self, model: Any, nnx: Any) -> None:
        self.model, self.nnx = model, nnx
        owners = {tuple(p): type(node) for p, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}
        self.kinds: dict[Path, Kind] = {}
        for path in self.leaves():
            kind = _nnx_kind(nnx, owners.get(path[:-1]), str(path[-1]))
            if kind is not None:
                self.kinds[path] = kind

    def leaves(self) -> dict[Path, Any]:
        flat = self.nnx.to_flat_state(self.nnx.state(self.model, self.nnx.Param))
        return {tuple(path): var.get_value() for path, var in flat}

    def replace(self, new: Mapping[Path, Any]) -> None:
        tree: dict[Any, Any] = {}
        for path, v in new.items():
            node = tree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = v
        self.nnx.update(self.model, tree)  # a nested dict of the written leaves only


class TreeParams:
    """A pytree of JAX arrays in a functional loop: ``params`` is the newest tree (the session
    sets it at ``step(params=...)`` and hands back what an alignment made of it)."""

    def __init__(self, params: Any) -> None:
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.params = params
        self.order = [tuple(_key(k) for k in path) for path, _ in flat]
        if len(set(self.order)) != len(self.order):
            raise ValueError("two leaves of the parameter pytree have the same dotted path: rename one")
        self.kinds = _tree_kinds({p: v for p, (_, v) in zip(self.order, flat, strict=True)})

    def leaves(self) -> dict[Path, Any]:
        leaves, treedef = jax.tree_util.tree_flatten(self.params)
        if treedef != self.treedef:  # type: ignore[operator]
            raise ValueError(
                "the parameters passed to session.step(params=...) are not the tree the session was opened with "
                f"(expected {self.treedef}, found {treedef}): pass the tree your train step returns, unchanged"
            )
        return dict(zip(self.order, leaves, strict=True))

    def replace(self, new: Mapping[Path, Any]) -> None:
        leaves = {**self.leaves(), **new}
        self.params = jax.tree_util.tree_unflatten(self.treedef, [leaves[p] for p in self.order])


def _key(k: Any) -> str | int:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey / FlattenedIndexKey, GetAttrKey
        if hasattr(k, attr):
            v = getattr(k, attr)
            return v if isinstance(v, int) else str(v)
    return str(k)


def _nnx() -> Any:
    try:
        from flax import nnx
    except ImportError:
        return None
    return nnx


def _nnx_kind(nnx: Any, owner: type | None, leaf: str) -> Kind | None:
    if owner is None:
        return None
    norms = tuple(getattr(nnx, n) for n in ("LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm") if hasattr(nnx, n))
    table = [(nnx.Linear, "dense", {"kernel": "weight", "bias": "bias"}),
             (nnx.Conv, "conv", {"kernel": "weight", "bias": "bias"}),
             (nnx.Embed, "embed", {"embedding": "weight"}),
             (norms, "norm", {"scale": "weight", "bias": "bias"})]  # fmt: skip
    for cls, kind, roles in table:
        if issubclass(owner, cls) and leaf in roles:
            return (kind, roles[leaf])
    return None


def _tree_kinds(leaves: Mapping[Path, Any]) -> dict[Path, Kind]:
    """Kinds in a plain pytree, by the Flax names of leaves: ``kernel`` (2-D dense, 3- to 5-D conv)
    and its ``bias``, ``embedding``, ``scale`` and its ``bias``."""
    out: dict[Path, Kind] = {}
    for path, v in leaves.items():
        leaf = path[-1]
        if leaf == "kernel" and 2 <= v.ndim <= 5:
            out[path] = ("dense" if v.ndim == 2 else "conv", "weight")
        elif leaf == "embedding" and v.ndim == 2:
            out[path] = ("embed", "weight")
        elif leaf == "scale" and v.ndim == 1:
            out[path] = ("norm", "weight")
    for path in leaves:
        sibling = out.get((*path[:-1], "kernel")) or out.get((*path[:-1], "scale"))
        if path[-1] == "bias" and sibling is not None:
            out[path] = (sibling[0], "bias")
    return out
