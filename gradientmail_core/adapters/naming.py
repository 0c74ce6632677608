"""Canonical parameter names: what a run calls a model's parameters, whatever wraps the model.

A parameter's name in a run is its name in the user's model with the wrapper modules removed.
Wrappers are found by walking the module tree, not by editing name strings: a module is a wrapper
when it is torch's ``DistributedDataParallel`` or ``DataParallel`` (the wrapped model is its
``module``), or when it holds its model under one of the attributes torch reserves for wrappers:
``_orig_mod`` (``torch.compile``'s ``OptimizedModule``, also on a single block), ``_fsdp_wrapped_module``
(FSDP1) and ``_checkpoint_wrapped_module`` (activation checkpointing). The walk goes through a
wrapper to what it wraps without adding a name, at any depth, so ``DDP(compile(model))`` and a model
whose blocks were compiled one by one both name their parameters as ``model`` does. A wrapper's own
parameters (FSDP1's flat parameter) are never the model's.

Tied weights, one ``Parameter`` under two names (GPT-2's token embedding and LM head), travel once,
under the name the walk meets first (``named_parameters()``'s order and choice): writes go into
that one tensor, so the tie holds after every commit.

Then two choices of the user: ``module=``, the submodule whose parameters form the run (an
attribute path such as ``"net"`` or ``"model.backbone"``, followed through wrappers, or a callable
that returns the submodule), and ``names=``, a map from this node's canonical names to the run's
(a dict, whose missing names stay as they are, or a callable) for models named by another
convention. Imports no framework: the walk reads ``torch.nn.Module``'s own ``_parameters`` and
``_modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

# torch's attributes for the model inside a wrapper (reserved: no model has them for itself)
WRAPPED_AT = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")

Names = Mapping[str, str] | Callable[[str], str]
Select = str | Callable[[Any], Any]


def wrapped(module: Any) -> Any | None:
    """The module ``module`` wraps, or None when it is not a wrapper."""
    children = getattr(module, "_modules", None) or {}
    for attr in WRAPPED_AT:
        if children.get(attr) is not None:
            return children[attr]
    parallel = getattr(sys.modules.get("torch.nn.parallel"), "DistributedDataParallel", None)
    data_parallel = getattr(sys.modules.get("torch.nn"), "DataParallel", None)
    kinds = tuple(k for k in (parallel, data_parallel) if k is not None)
    if kinds and isinstance(module, kinds):
        return module.module
    return None


def unwrap(module: Any) -> Any:
    """``module`` without the wrappers around it."""
    inner = wrapped(module)
    while inner is not None:
        module, inner = inner, wrapped(inner)
    return module


def canonical_parameters(model: Any) -> dict[str, Any]:
    """The trainable parameters of a torch module by canonical name, in ``named_parameters()``'s
    order, each tied parameter once (under its first name)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, p in _walk(model, "", set()):
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out[name] = p
    return out


def _walk(module: Any, prefix: str, visited: set[int]) -> Iterator[tuple[str, Any]]:
    module = unwrap(module)
    if id(module) in visited:  # a submodule reached twice: its parameters were met the first time
        return
    visited.add(id(module))
    for n, p in module._parameters.items():
        if p is not None:
            yield prefix + n, p
    for n, child in module._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{n}.", visited)


def select(model: Any, module: Select | None) -> Any:
    """The submodule of ``model`` whose parameters form the run: ``model`` itself for None, an
    attribute path followed through wrappers (``"net"``, ``"model.backbone"``), or what a callable
    returns when given ``model``. ``ValueError`` naming what exists where a step is missing."""
    if module is None:
        return model
    if callable(module):
        got = module(model)
        if got is None or isinstance(got, str | bytes | int | float):
            raise TypeError(f"module={module!r} returned {got!r}: expected the submodule whose parameters form the run")
        return got
    if not isinstance(module, str) or not module or any(not part for part in module.split(".")):
        raise TypeError(
            f"module={module!r}: expected an attribute path such as 'net' or 'model.backbone', or a callable"
        )
    node, path = model, list[str]()
    for part in module.split("."):
        node = unwrap(node)
        children = getattr(node, "_modules", None)
        child = children.get(part) if isinstance(children, dict) else None
        if child is None and isinstance(node, list | tuple) and part.isdigit() and int(part) < len(node):
            child = node[int(part)]  # an MLX list of layers
        elif child is None:  # not a registered submodule: an attribute (MLX modules are dicts of children)
            child = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if child is None:
            here = ".".join(path) or "the model"
            known = (
                sorted(children)
                if isinstance(children, dict)
                else sorted(k for k in dir(node) if not k.startswith("_"))
            )
            raise ValueError(f"module={module!r}: {here} has no submodule {part!r} (it has {known[:12]})")
        node = child
        path.append(part)
    return node


def renaming(names: Names | None, canonical: list[str]) -> dict[str, str]:
    """This node's canonical name -> the run's name, for every canonical name. ``names``: None (the
    same), a dict (names it lacks stay as they are) or a callable. Refuses a dict key that is no
    name of this node, a name that is not a non-empty string without ``#``, and two names made one."""
    if names is None:
        return {n: n for n in canonical}
    if isinstance(names, Mapping):
        unknown = sorted(set(names) - set(canonical))
        if unknown:
            raise ValueError(
                f"names={{...}} maps {unknown[:5]}, which are not parameters of this node (its names are "
                f"{canonical[:5]}{' ...' if len(canonical) > 5 else ''}): keys are this node's canonical names"
            )
        out = {n: names.get(n, n) for n in canonical}
    elif callable(names):
        out = {n: names(n) for n in canonical}
    else:
        raise TypeError(
            f"names= must be a dict or a callable from this node's names to the run's, found {type(names).__name__}"
        )
    for n, m in out.items():
        if not isinstance(m, str) or not m or "#" in m:
            raise ValueError(f"names= maps {n!r} to {m!r}: a run's names are non-empty strings without '#'")
    by_target: dict[str, str] = {}
    for n, m in out.items():
        if m in by_target:
            raise ValueError(f"names= maps both {by_target[m]!r} and {n!r} to {m!r}: each parameter needs its own name")
        by_target[m] = n
    return out
