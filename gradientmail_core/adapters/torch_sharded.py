"""FSDP2 (DTensor) parameters cut into fixed, world-size-independent chunks (``docs/sharding.md``).

Groundwork for issue 13: the adapter-level pieces a sharded node needs, with no protocol change.

A fragment's tensors are laid end to end, each starting at a multiple of ``BLOCK`` elements
(32: the F4 and I2 quantizer blocks), and that padded line is cut every ``chunk`` elements
(a multiple of ``BLOCK``). A chunk is a list of ``Piece``s, flat element ranges of tensors, and
every piece starts at a multiple of ``BLOCK`` inside its tensor, so a quantizer block never
straddles two chunks and a chunk's bytes are the same whichever node (and world size) made it.

An FSDP2 rank holds, of each tensor, the rows ``torch.chunk`` gives it along dim 0 (``ceil(rows /
world)`` rows per rank; the last ranks may hold fewer or none): one contiguous flat range. A chunk
is owned by the rank holding most of its elements; the owner receives the elements it lacks from the
ranks holding them (``gather_chunks``) and, for a commit, sends each rank its part back
(``scatter_chunks``). A rank never holds more than its own shard plus the chunks it owns.

The plan (``codec/plan.py``) and the ranks' layout (``protocol/layout.py``: ``shard_range``,
``Layout``, ``chunk_owner``, ``transfers``) are pure and take no tensors; this module finds a
model's sharded parameters, and ``torch_transfer.py`` moves their pieces through ``torch.distributed``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import GradientMailError, MissingExtra
from ..protocol.layout import Layout
from .naming import Names, canonical_parameters, renaming

try:
    import torch
    import torch.distributed  # noqa: F401  (a torch without it cannot shard)
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise MissingExtra("torch") from e

__all__ = ["Meter", "ShardedParams", "ShardedTorchAdapter", "ShardingUnsupported", "find_sharded"]


class ShardingUnsupported(GradientMailError, ValueError):
    """The model is sharded in a way gradientmail cannot cut into chunks, or the run or session
    asks what a sharded node does not do (yet). The message says what to do instead."""


# ---------------------------------------------------------------------------------------------
# FSDP2 parameters


class Meter:
    """What the functions below (and a sharded node, ``gradientmail_core/sharded``) allocated, in
    bytes: the largest single tensor or array (``peak``) and the sum of everything allocated
    (``total``). A sharded node meters each publish and each commit with a fresh ``Meter`` and
    folds it into the rank's with ``fold``: ``op_peak`` is then the most one fragment operation
    allocated in all. The check that no rank ever materialises a full fragment."""

    def __init__(self) -> None:
        self.peak = 0
        self.total = 0
        self.op_peak = 0

    def note(self, nbytes: int, *, transient: bool = False) -> None:
        """Count an allocation made elsewhere (a host copy, a decoded array). ``transient``: freed
        before the operation allocates anything else (a temporary of one tensor): not in ``total``."""
        self.peak = max(self.peak, int(nbytes))
        if not transient:
            self.total += int(nbytes)

    def empty(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.note(n * dtype.itemsize)
        return torch.empty(n, dtype=dtype, device=device)

    def fold(self, op: Meter) -> None:
        """Take in one operation's meter: its largest allocation, and its total as one operation."""
        self.peak = max(self.peak, op.peak)
        self.op_peak = max(self.op_peak, op.total, op.op_peak)


@dataclass
class ShardedParams:
    """A model's trainable sharded parameters: FSDP2 DTensors on one 1-D mesh, every one
    ``Shard(0)``, or FSDP1 flat parameters (``use_orig_params=True``, ``FULL_SHARD``); either way
    each rank holds one contiguous range of each tensor's flat elements (``layout``)."""

    params: dict[str, Any]  # name -> the parameter (a DTensor, or FSDP1's view of the local shard)
    shapes: dict[str, tuple[int, ...]]  # full (global) shapes
    world: int
    coord: int  # this rank's coordinate on the mesh
    group: Any  # the mesh's process group
    layout: Layout  # each rank's range of each tensor (``Layout.shard0`` for FSDP2)
    kind: str = "fsdp2"  # or "fsdp1"

    def local(self, name: str) -> torch.Tensor:
        """The flat view of this rank's shard of ``name``, detached (writes go into the parameter)."""
        p = self.params[name]
        return (p.to_local() if self.kind == "fsdp2" else p).detach().view(-1)

    @property
    def device(self) -> torch.device:
        """Where the parameters live."""
        return self.local(next(iter(self.params))).device

    def local_range(self, name: str) -> tuple[int, int]:
        return self.layout.range(name, self.coord)


def find_sharded(model: Any, *, root: Any = None, names: Names | None = None) -> ShardedParams | None:
    """The model's FSDP2 or FSDP1 sharding, or None when its trainable parameters are plain tensors.
    ``ShardingUnsupported`` for any other layout, saying which parameter and why. Parameters go by
    their canonical names (``naming.py``) renamed by ``names``; ``root``: the whole model when
    ``model`` is a submodule of it (FSDP1's units may wrap the submodule from above)."""
    from torch.distributed.tensor import DTensor, Shard

    found = canonical_parameters(model)
    to_run = renaming(names, list(found))
    params = {to_run[n]: p for n, p in found.items()}
    fsdp1 = _find_fsdp1(params, model if root is None else root)
    if fsdp1 is not None:
        return fsdp1
    dtensors = {n for n, p in params.items() if isinstance(p, DTensor)}
    if not dtensors:
        return None
    if len(dtensors) != len(params):
        plain = sorted(set(params) - dtensors)[:3]
        raise ShardingUnsupported(
            f"parameters {plain} are plain tensors while others are FSDP2 DTensors; gradientmail "
            "needs every trainable parameter sharded (fully_shard the root module too, or freeze them)"
        )
    mesh = None
    for n, p in params.items():
        if p.device_mesh.ndim != 1:
            raise ShardingUnsupported(
                f"parameter {n!r} lives on a {p.device_mesh.ndim}-D device mesh {tuple(p.device_mesh.shape)}; "
                "gradientmail supports FSDP2 on a 1-D mesh (HSDP and TP+FSDP are not supported yet)"
            )
        placement = p.placements[0]
        if type(placement) is not Shard or placement.dim != 0:
            raise ShardingUnsupported(
                f"parameter {n!r} has placement {placement}; gradientmail supports Shard(dim=0) only "
                "(FSDP2's default: drop a custom shard_placement_fn)"
            )
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise ShardingUnsupported(f"parameter {n!r} is on mesh {p.device_mesh}, others on {mesh}: one mesh only")
    assert mesh is not None
    world, coord = mesh.size(), mesh.get_local_rank()
    shapes = {n: tuple(int(d) for d in p.shape) for n, p in params.items()}
    out = ShardedParams(params, shapes, world, coord, mesh.get_group(), Layout.shard0(shapes, world))
    for n, p in params.items():
        lo, hi = out.local_range(n)
        if p.to_local().numel() != hi - lo:
            raise ShardingUnsupported(
                f"rank {coord} holds {p.to_local().numel()} elements of {n!r} {shapes[n]}, expected {hi - lo} "
                f"(torch.chunk rows over {world} ranks): a sharding gradientmail does not know"
            )
    return out


def _find_fsdp1(trainable: dict[str, Any], root: Any) -> ShardedParams | None:
    """The sharding of ``trainable`` (run name -> parameter) by the FSDP1 units of ``root``
    (``FullyShardedDataParallel``, ``use_orig_params=True``, ``FULL_SHARD``), or None when no FSDP1
    unit holds a parameter. Each unit's flat parameter is the concatenation of its original
    parameters (and alignment padding), cut into ``world`` equal shards in rank order: every rank
    computes every rank's range of every tensor."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return None
    units = [m for m in root.modules() if isinstance(m, fsdp.FullyShardedDataParallel)]
    if not units:
        return None
    info: dict[int, tuple[tuple[int, ...], list[int]]] = {}  # id(param) -> (full shape, bounds)
    world = coord = None
    group = None
    for unit in units:
        handle = getattr(unit, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        strategy = getattr(unit, "sharding_strategy", None)
        if strategy is not None and strategy.name != "FULL_SHARD":
            raise ShardingUnsupported(
                f"an FSDP1 unit uses sharding_strategy={strategy.name}; gradientmail supports FULL_SHARD "
                "(the parameters stay sharded between steps), or FSDP2 (fully_shard)"
            )
        if not getattr(unit, "_use_orig_params", False) or flat._params is None:
            raise ShardingUnsupported(
                "an FSDP1 model wrapped with use_orig_params=False: its parameters are flat parameters, not the "
                "model's; wrap it with use_orig_params=True (Lightning: FSDPStrategy(use_orig_params=True))"
            )
        pg = unit.process_group
        ws, rank = pg.size(), pg.rank()
        if world is None:
            world, coord, group = ws, rank, pg
        elif (ws, rank) != (world, coord):
            raise ShardingUnsupported("the FSDP1 units of this model shard over different process groups: one only")
        size = int(flat._sharded_size.numel()) if hasattr(flat, "_sharded_size") else int(flat.numel())
        offsets, at = [], 0
        for count, pad in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
            if not pad:
                offsets.append(at)
            at += int(count)
        for p, shape, off in zip(flat._params, flat._shapes, offsets, strict=True):
            count = math.prod(int(d) for d in shape)
            cuts = [min(max(r * size - off, 0), count) for r in range(ws + 1)]
            info[id(p)] = (tuple(int(d) for d in shape), cuts)
    if world is None:
        return None
    params: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    bounds: dict[str, tuple[int, ...]] = {}
    for name, p in trainable.items():
        got = info.get(id(p))
        if got is None:
            raise ShardingUnsupported(
                f"parameter {name!r} is in no FSDP1 unit of this module: open the session on the FSDP-wrapped root "
                "module (every trainable parameter must be sharded)"
            )
        params[name], shapes[name], bounds[name] = p, got[0], tuple(got[1])
    assert coord is not None
    out = ShardedParams(params, shapes, world, coord, group, Layout(world, bounds), kind="fsdp1")
    for n in params:
        lo, hi = out.local_range(n)
        if out.local(n).numel() != hi - lo:
            raise ShardingUnsupported(
                f"rank {coord} holds {out.local(n).numel()} elements of {n!r} {shapes[n]}, expected {hi - lo} from its "
                "FSDP1 flat parameter (are the parameters sharded now? call it between steps, not inside forward)"
            )
    return out


class ShardedTorchAdapter:
    """The adapter of a model whose trainable parameters are FSDP2 DTensors (``find_sharded``).

    It states the schema (full shapes, the parameters' dtypes), which the run checks as for any
    node. A sharded node never moves a whole fragment: its session (``gradientmail_core/sharded``)
    publishes and aligns chunk by chunk on every rank, so ``read`` refuses and ``write`` accepts
    only nothing (``Learner.write_newest`` of a sharded node, whose ranks write their own parts)."""

    def __init__(self, model: Any, sharded: ShardedParams) -> None:
        from .torch import _DTYPES

        self.model, self.sharded = model, sharded
        for name, p in sharded.params.items():
            if p.dtype not in _DTYPES:
                raise TypeError(
                    f"parameter {name!r} has dtype {p.dtype}; gradientmail trains float32, bfloat16 and "
                    "float16 parameters (cast the model, or freeze this parameter)"
                )
        self._dtypes = {n: _DTYPES[p.dtype] for n, p in sharded.params.items()}

    def schema(self) -> list[Any]:
        from ..protocol.records import TensorSpec

        return [
            TensorSpec(name=n, dtype=self._dtypes[n], shape=list(self.sharded.shapes[n])) for n in self.sharded.params
        ]

    def read(self, names: Sequence[str]) -> Mapping[str, Any]:
        raise ShardingUnsupported(
            "the parameters are FSDP2 DTensors: no rank reads a whole fragment (a gm.Session over the "
            "sharded model publishes chunk by chunk; for a whole copy, gather the model with full_tensor())"
        )

    def write(self, values: Mapping[str, Any], mixing: float = 0.0) -> None:
        if values:
            raise ShardingUnsupported(
                "the parameters are FSDP2 DTensors: no rank writes a whole fragment (gm.align does not "
                "load into a sharded model; open a gm.Session on every rank, or load into an unsharded copy)"
            )


# ---------------------------------------------------------------------------------------------
# Moving chunks between ranks
