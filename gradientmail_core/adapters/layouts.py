"""Layouts: how a node lays its tensors out against the run's, and the rules that convert.

Frameworks store the same layer in different axis orders and under different leaf names:

| layer | torch (and MLX) | Flax NNX | Keras 3 |
| --- | --- | --- | --- |
| dense | ``weight`` (out, in) | ``kernel`` (in, out) | ``kernel`` (in, out) |
| conv  | ``weight`` (out, in, *spatial) | ``kernel`` (*spatial, in, out) | ``kernel`` (*spatial, in, out) |
| embedding | ``weight`` (vocab, dim) | ``embedding`` | ``embeddings`` |
| norm  | ``weight``, ``bias`` | ``scale``, ``bias`` | ``gamma``, ``beta`` |

A tensor's *layout* is the labels of its axes (``"in,out"``), recorded in the run's schema
(``TensorSpec.layout``) so a node holding a square kernel the other way round is refused at
join: its shape alone cannot tell. The reference order is torch's and is recorded as ``""``, so
the schemas of torch and MLX runs are what they were before layouts existed.

An adapter that knows its layers declares ``convention`` (``"torch"``, ``"flax"`` or
``"keras"``) and ``kinds``: for each parameter it can place, ``(kind, role)``, the kind one of
``dense``, ``conv``, ``embed``, ``norm`` and the role ``weight`` or ``bias``. ``Laid`` shows such
an adapter in another convention: each known parameter's leaf renamed and its axes permuted, at
read and at write, one tensor at a time (no copy of the model is kept). ``layouts=`` on
``gm.Session`` picks it: a convention name, or ``{name: axes}`` for tensors no table knows
(``np.transpose``'s ``axes``: the run sees ``param.transpose(axes)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..protocol.records import TensorSpec

Kind = tuple[str, str]  # (kind, role): ("dense", "weight"), ("norm", "bias"), ...
Layouts = str | Mapping[str, Sequence[int]]

CONVENTIONS = ("torch", "flax", "keras")
_LEAVES: dict[str, dict[str, dict[str, str]]] = {
    "torch": {
        "dense": {"weight": "weight", "bias": "bias"},
        "conv": {"weight": "weight", "bias": "bias"},
        "embed": {"weight": "weight"},
        "norm": {"weight": "weight", "bias": "bias"},
    },
    "flax": {
        "dense": {"weight": "kernel", "bias": "bias"},
        "conv": {"weight": "kernel", "bias": "bias"},
        "embed": {"weight": "embedding"},
        "norm": {"weight": "scale", "bias": "bias"},
    },
    "keras": {
        "dense": {"weight": "kernel", "bias": "bias"},
        "conv": {"weight": "kernel", "bias": "bias"},
        "embed": {"weight": "embeddings"},
        "norm": {"weight": "gamma", "bias": "beta"},
    },
}
_SPATIAL = {1: ("w",), 2: ("h", "w"), 3: ("d", "h", "w")}


def axes_of(convention: str, kind: Kind, ndim: int) -> tuple[str, ...] | None:
    """The axis labels of a ``kind`` tensor of ``ndim`` axes in ``convention``; None where the
    layout is the same in every convention (biases, embeddings, norms) or ``ndim`` fits no layer."""
    what, role = kind
    if role != "weight" or what not in ("dense", "conv"):
        return None
    if what == "dense":
        if ndim != 2:
            return None
        return ("out", "in") if convention == "torch" else ("in", "out")
    spatial = _SPATIAL.get(ndim - 2)
    if spatial is None:
        return None
    return ("out", "in", *spatial) if convention == "torch" else (*spatial, "in", "out")


def layout_of(convention: str, kind: Kind | None, ndim: int) -> str:
    """What ``TensorSpec.layout`` records: the labels, or ``""`` for the reference (torch) order."""
    labels = None if kind is None else axes_of(convention, kind, ndim)
    if labels is None or labels == axes_of("torch", kind, ndim):  # type: ignore[arg-type]
        return ""
    return ",".join(labels)


def check_convention(convention: str) -> str:
    if convention not in CONVENTIONS:
        raise ValueError(
            f"layouts={convention!r}: expected one of {list(CONVENTIONS)} (the convention of the run's nodes), "
            "or a dict {name: axes} of this node's tensors to permute"
        )
    return convention


class Laid:
    """``inner`` (an adapter with ``convention`` and ``kinds``) in the layouts of another
    convention, or with ``{name: axes}`` permutations. The names it shows are the run's
    (``names=`` then maps them further, ``base.Renamed``). Offers no device pipeline."""

    def __init__(self, inner: Any, layouts: Layouts) -> None:
        own = getattr(inner, "convention", None)
        kinds: Mapping[str, Kind] = getattr(inner, "kinds", {})
        specs = inner.schema()
        self.inner = inner
        self.to_inner: dict[str, str] = {}
        self.axes: dict[str, tuple[int, ...]] = {}  # run name -> permutation of inner's axes
        out: list[TensorSpec] = []
        if isinstance(layouts, str):
            target = check_convention(layouts)
            if own is None:
                raise TypeError(
                    f"layouts={layouts!r}: this model's adapter ({type(inner).__name__}) declares no layer kinds, "
                    "so no ready rule applies; pass layouts={name: axes} for the tensors to permute"
                )
            for s in specs:
                kind = kinds.get(s.name)
                name, layout, axes = s.name, s.layout, tuple(range(len(s.shape)))
                if kind is not None:
                    name = _releaf(s.name, _LEAVES[own][kind[0]][kind[1]], _LEAVES[target][kind[0]][kind[1]])
                    mine, theirs = axes_of(own, kind, len(s.shape)), axes_of(target, kind, len(s.shape))
                    if mine is not None and theirs is not None:
                        axes = tuple(mine.index(a) for a in theirs)
                    layout = layout_of(target, kind, len(s.shape))
                out.append(self._add(s, name, axes, layout))
        elif isinstance(layouts, Mapping):
            by_name = {s.name: s for s in specs}
            unknown = sorted(set(layouts) - set(by_name))
            if unknown:
                raise ValueError(f"layouts={{...}} names {unknown[:5]}, which are not parameters of this node")
            for s in specs:
                axes = tuple(int(a) for a in layouts.get(s.name, range(len(s.shape))))
                if sorted(axes) != list(range(len(s.shape))):
                    raise ValueError(
                        f"layouts={{{s.name!r}: {axes}}}: a {len(s.shape)}-axis tensor needs a permutation of "
                        f"{list(range(len(s.shape)))}"
                    )
                layout = s.layout
                if s.name in layouts and (own is not None and s.name in kinds):
                    labels = axes_of(own, kinds[s.name], len(s.shape))
                    if labels is not None:
                        moved = tuple(labels[a] for a in axes)
                        layout = "" if moved == axes_of("torch", kinds[s.name], len(s.shape)) else ",".join(moved)
                out.append(self._add(s, s.name, axes, layout))
        else:
            raise TypeError(
                f"layouts= must be a convention name or a dict {{name: axes}}, found {type(layouts).__name__}"
            )
        self.specs = out
        inner_subtract = getattr(inner, "subtract_from", None)
        self.subtract_from = None if inner_subtract is None else self._subtract_from

    def _add(self, s: TensorSpec, name: str, axes: tuple[int, ...], layout: str) -> TensorSpec:
        if name in self.to_inner:
            raise ValueError(f"layouts= gives {self.to_inner[name]!r} and {s.name!r} one name, {name!r}")
        self.to_inner[name] = s.name
        if axes != tuple(range(len(axes))):
            self.axes[name] = axes
        return TensorSpec(name=name, dtype=s.dtype, shape=[int(s.shape[a]) for a in axes], layout=layout)

    def schema(self) -> list[TensorSpec]:
        return list(self.specs)

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        got = self.inner.read([self.to_inner[n] for n in names])
        out = {}
        for n in names:
            v = got[self.to_inner[n]]
            out[n] = np.ascontiguousarray(v.transpose(self.axes[n])) if n in self.axes else v
        return out

    def _subtract_from(self, out: Mapping[str, np.ndarray]) -> None:
        # The inner adapter subtracts into a view of ``out`` in its own axis order: no copy.
        self.inner.subtract_from(
            {self.to_inner[n]: (o.transpose(np.argsort(self.axes[n])) if n in self.axes else o) for n, o in out.items()}
        )

    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        back = {}
        for n, v in values.items():
            back[self.to_inner[n]] = v.transpose(np.argsort(self.axes[n])) if n in self.axes else v
        self.inner.write(back, mixing)


def _releaf(name: str, leaf: str, new: str) -> str:
    head, _, last = name.rpartition(".")
    assert last == leaf, (name, leaf)  # an adapter declares kinds only for its layers' own leaves
    return f"{head}.{new}" if head else new


def torch_kinds(model: Any, params: Mapping[str, Any]) -> dict[str, Kind]:
    """``(kind, role)`` of the torch parameters ``params`` (canonical name -> Parameter) that
    belong to a layer the tables know, found by the module that holds each one."""
    import torch.nn as tnn

    kinds = {
        tnn.Linear: "dense",
        tnn.Conv1d: "conv",
        tnn.Conv2d: "conv",
        tnn.Conv3d: "conv",
        tnn.Embedding: "embed",
        tnn.LayerNorm: "norm",
        tnn.GroupNorm: "norm",
        tnn.BatchNorm1d: "norm",
        tnn.BatchNorm2d: "norm",
        tnn.BatchNorm3d: "norm",
    }
    rms = getattr(tnn, "RMSNorm", None)
    if rms is not None:
        kinds[rms] = "norm"
    by_id: dict[int, Kind] = {}
    for m in model.modules():
        kind = kinds.get(type(m))
        if kind is None:
            continue
        for role in ("weight", "bias"):
            p = m._parameters.get(role)
            if p is not None:
                by_id[id(p)] = (kind, role)
    return {n: by_id[id(p)] for n, p in params.items() if id(p) in by_id}
