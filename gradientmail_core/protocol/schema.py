"""Does this node's model fit the run? The schema check every path makes before it trains, and
the fix it suggests when one explains the difference (``module=`` for a model holding the run's
network one attribute deeper, ``names=`` for the opposite, a different adapter config for
adapter shapes alone). Names are compared canonical on both sides (``adapters/naming.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..errors import SchemaMismatch
from .records import TensorSpec

__all__ = ["check_schema", "schema_differences", "suggest_fix"]


def schema_differences(run: list[TensorSpec], mine: list[TensorSpec]) -> list[str]:
    """Every difference between the run's schema and this model's, one line each, sorted by name."""
    theirs = {s.name: s for s in run}
    ours = {s.name: s for s in mine}
    out = [f"{n}: in the run, missing from this model" for n in theirs if n not in ours]
    out += [f"{n}: in this model, not in the run" for n in ours if n not in theirs]
    for n in theirs.keys() & ours.keys():
        a, b = theirs[n], ours[n]
        if (a.dtype, list(a.shape)) != (b.dtype, list(b.shape)):
            out.append(f"{n}: run has {a.dtype}{list(a.shape)}, this model has {b.dtype}{list(b.shape)}")
        elif a.layout != b.layout:  # equal shapes, other axis order: a square kernel not transposed
            out.append(f"{n}: run lays it out as {_axes(a.layout)}, this model as {_axes(b.layout)}")
    return sorted(out)


def _axes(layout: str) -> str:
    return f"({layout})" if layout else "the reference (torch) order"


def _prefixes(names: Iterable[str]) -> list[str]:
    """The dotted prefixes every name shares, shortest first (``a.b.c``, ``a.b.d`` -> ``a``, ``a.b``)."""
    common = os.path.commonprefix([n.split(".")[:-1] for n in names])  # element-wise on lists
    return [".".join(common[: i + 1]) for i in range(len(common))]


def _one_level_deeper(names: list[str], other: set[str]) -> str | None:
    """The module ``p`` such that ``names`` less their ``p.`` are ``other``; None if there is none."""
    for p in _prefixes(names):
        if {n[len(p) + 1 :] for n in names} == other:
            return p
    return None


def suggest_fix(run: list[TensorSpec], mine: list[TensorSpec]) -> str | None:
    """What makes this node's schema the run's, when a rule explains the difference; else None."""
    theirs = [s.name for s in run]
    ours = [s.name for s in mine]
    want, have = set(theirs), set(ours)
    if (p := _one_level_deeper(ours, want)) is not None:
        return (
            f"every name of this node starts with '{p}.' and the run's do not: pass module='{p}' "
            f"(gm.Session: open it on that submodule, model.{p})"
        )
    if (p := _one_level_deeper(theirs, have)) is not None:
        return (
            f"every name of the run starts with '{p}.' and this node's do not: the run's nodes hold this "
            f"model as '{p}'; give this node that structure, or pass names=lambda n: '{p}.' + n"
        )
    if want == have:
        differing = {d.split(":")[0] for d in schema_differences(run, mine)}
        if differing and all(theirs_s.layout != ours_s.layout for theirs_s, ours_s in _pairs(run, mine, differing)):
            return (
                "the run lays these tensors out in another axis order: pass layouts= with the run's convention "
                "(layouts='torch' for a Flax or Keras node joining a torch or MLX run, layouts='flax' for a torch "
                "node joining a Flax or Keras run; docs/adapters.md, 'Layouts')"
            )
        if differing and all(_adapter_tensor(n) for n in differing):
            return (
                "only the shapes of adapter tensors differ: this node's adapter config (e.g. the LoRA rank r) is "
                "not the run's; use the run's adapter config"
            )
        return None
    if len(want) == len(have) and not (want & have):
        return (
            "no name matches the run's, though the counts do: if the models are the same under another naming "
            "convention, map this node's names to the run's with names={...} or names=callable"
        )
    if any(_adapter_tensor(n) for n in want ^ have):
        return "the adapter tensors differ: this node's adapter config (target modules, rank) is not the run's"
    return None


def _pairs(run: list[TensorSpec], mine: list[TensorSpec], names: set[str]) -> list[tuple[TensorSpec, TensorSpec]]:
    ours = {s.name: s for s in mine}
    return [(s, ours[s.name]) for s in run if s.name in names]


def _adapter_tensor(name: str) -> bool:
    """A PEFT adapter's tensor (LoRA, DoRA, IA3, ...), by the module names PEFT gives them."""
    return any(part.startswith(("lora_", "ia3_", "oft_", "boft_", "vera_")) for part in name.split("."))


def check_schema(run: list[TensorSpec], mine: list[TensorSpec]) -> None:
    """``SchemaMismatch`` (the differences, and the fix when one explains them) unless this model's
    schema has the run's names, dtypes and shapes."""
    diffs = schema_differences(run, mine)
    if diffs:
        raise SchemaMismatch(diffs, fix=suggest_fix(run, mine))
