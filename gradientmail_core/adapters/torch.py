"""The torch adapter: ``named_parameters()`` in, in-place ``copy_`` out.

Parameters on a CUDA device are read without stalling the training thread: each is copied,
``non_blocking``, into a pinned host buffer, and a CUDA event recorded after the copies; the
mapping handed back waits on that event only when the background thread first reads a value.
A plain ``.to("cpu")`` would instead wait for all the GPU work queued so far.

That host path is what ``read``/``write`` do. With the parameters on one CUDA device the adapter
also offers ``pipeline`` (``TorchPipeline``, the ``DevicePipeline`` capability), which the learner
and node use instead: the delta, its quantization and the alignment run on the device, and only
encoded bytes cross to the host. ``TorchAdapter(model, device_pipeline=True)`` turns it on for
CPU parameters too (the same code, with CPU tensors; how the tests run it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..codec.quant import QTensor
from ..errors import MissingExtra
from ..protocol.records import TensorSpec

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise MissingExtra("torch") from e

from . import torch_quant as tq  # noqa: E402 (needs torch, checked above)
from .naming import Names, canonical_parameters, renaming  # noqa: E402

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class TorchAdapter:
    """``model``'s trainable parameters under their canonical names (``naming.py``: wrappers
    removed, a tied parameter once), renamed by ``names`` (``naming.renaming``)."""

    convention = "torch"  # layouts.py: the reference order

    @property
    def kinds(self) -> dict[str, tuple[str, str]]:
        """The layer kind and role of each parameter a layout table knows (``layouts.py``)."""
        from .layouts import torch_kinds

        return torch_kinds(self.model, self.params)

    def __init__(self, model: Any, *, names: Names | None = None, device_pipeline: bool | None = None) -> None:
        self.model = model
        found = canonical_parameters(model)
        to_run = renaming(names, list(found))
        self.params: dict[str, torch.nn.Parameter] = {to_run[n]: p for n, p in found.items()}
        if not self.params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters")
        for name, p in self.params.items():
            if p.dtype not in _DTYPES:
                raise TypeError(
                    f"parameter {name!r} has dtype {p.dtype}; gradientmail trains float32, bfloat16 and "
                    "float16 parameters (cast the model, or freeze this parameter)"
                )
        devices = {p.device for p in self.params.values()}
        if device_pipeline is None:
            device_pipeline = len(devices) == 1 and next(iter(devices)).type == "cuda"
        if device_pipeline and len(devices) != 1:
            raise ValueError(f"device_pipeline=True needs every trainable parameter on one device, found {devices}")
        self.pipeline = TorchPipeline(self.params, _Device(next(iter(devices)))) if device_pipeline else None
        # In-place deltas on the training thread only for host parameters: on a GPU, the host path
        # reads asynchronously instead (``read``), so as not to stall the training thread.
        self.subtract_from = self._subtract_from if {d.type for d in devices} == {"cpu"} else None

    def schema(self) -> list[TensorSpec]:
        return [TensorSpec(name=n, dtype=_DTYPES[p.dtype], shape=list(p.shape)) for n, p in self.params.items()]

    @torch.no_grad()
    def read(self, names: Sequence[str]) -> Mapping[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        pinned: dict[str, torch.Tensor] = {}
        for n in names:
            p = self.params[n].detach()
            if p.is_cuda:
                host = torch.empty(p.shape, dtype=torch.float32, pin_memory=True)
                host.copy_(p, non_blocking=True)  # casts on the device, then one async copy
                pinned[n] = host
            else:
                out[n] = p.to("cpu", torch.float32, copy=True).numpy()
        if not pinned:
            return out
        return _HostCopies(out, pinned, torch.cuda.Event())

    @torch.no_grad()
    def _subtract_from(self, out: Mapping[str, np.ndarray]) -> None:
        """``out[n] -= params[n]`` in float32, in place (CPU parameters: no copy of a float32 one)."""
        for n, o in out.items():
            torch.from_numpy(o).sub_(self.params[n].detach().to(torch.float32))

    @torch.no_grad()
    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        for n, v in values.items():
            p = self.params[n]
            if mixing:
                # Blend on the host in numpy float32, like every other adapter, so a torch
                # and an MLX node mixing the same values hold the same bits.
                current = p.detach().to("cpu", torch.float32).numpy()
                v = np.float32(mixing) * current + np.float32(1.0 - mixing) * v
            # np.require keeps 0-d arrays 0-d (ascontiguousarray would make them 1-d). One copy
            # straight into the parameter (casting on the way), not via a temporary on its device.
            p.copy_(torch.from_numpy(np.require(v, np.float32, "C")))


class _HostCopies(Mapping[str, np.ndarray]):
    """Host float32 copies of CUDA parameters still in flight: reading a value waits (once) for
    the copies, so that wait happens on whichever thread first looks, never at ``read``."""

    def __init__(self, ready: dict[str, np.ndarray], pinned: dict[str, torch.Tensor], event: Any) -> None:
        event.record()  # on the current stream, after the copies just queued
        self._ready, self._pinned, self._event = ready, pinned, event
        self._names = [*ready, *pinned]

    def _wait(self) -> None:
        if self._pinned:
            self._event.synchronize()
            # numpy views keep their pinned tensors alive (and the caching host allocator
            # reuses the blocks once they are freed).
            self._ready.update({n: t.numpy() for n, t in self._pinned.items()})
            self._pinned = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._ready:
            self._wait()
        return self._ready[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# ---------------------------------------------------------------------------------------------
# The device pipeline


class _Device:
    """Where the pipeline's work runs. On CUDA: the background's work goes to a side stream, and
    each thread orders its work after the other's with events (never a host wait, except for the
    background's final device-to-host copies). On the CPU everything runs inline: no-ops."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def side(self) -> contextlib.AbstractContextManager[Any]:
        """Run the enclosed work on the side stream."""
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def mark(self) -> Any:
        """An event after the work queued so far on the current stream."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def after(self, event: Any) -> None:
        """Order the current stream's next work after ``event`` (no host wait)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def used_here(self, tensors: Any) -> None:
        """Tensors allocated on another stream, now used on the current one: the caching allocator
        must not hand their memory out again before this stream is done with them."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            for t in tensors:
                t.record_stream(stream)

    def upload(self, value: np.ndarray) -> torch.Tensor:
        """A float32 host array -> a tensor on the device (on CUDA, queued from pinned memory)."""
        value = np.require(value, np.float32, "C")  # keeps 0-d arrays 0-d
        src = torch.from_numpy(value if value.flags.writeable else value.copy())
        if not self.cuda:
            return src.clone()  # the pipeline's own copy: nothing aliases the host theta
        host = torch.empty(src.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(src)
        return host.to(self.device, non_blocking=True)

    def download(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device tensors -> CPU tensors, waiting (on this thread) for them to arrive."""
        if not self.cuda:
            return tensors
        out = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        return out


@dataclass(frozen=True, eq=False)
class _Staged:
    """A commit's theta on the device, in each parameter's dtype, ready once ``event`` is."""

    anchors: dict[str, torch.Tensor]
    event: Any


class TorchPipeline:
    """The ``DevicePipeline`` of a torch model whose parameters are on one device.

    Anchors are kept in each parameter's dtype: a theta is the decoding of a payload stored in
    the parameter's dtype (``closer.cast``), so that dtype holds it exactly.
    """

    def __init__(self, params: Mapping[str, torch.nn.Parameter], device: _Device) -> None:
        self.params, self.device = params, device
        self.anchors: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def capture(self, names: Sequence[str]) -> _Captured:
        # A device-to-device copy queued on the training stream, after the step that made it.
        local = {n: self.params[n].detach().clone() for n in names}
        return _Captured(self.device, {n: self.anchors[n] for n in names}, local, self.device.mark())

    @torch.no_grad()
    def stage(self, theta: Mapping[str, np.ndarray]) -> _Staged:
        with self.device.side():
            anchors = {n: self.device.upload(v).to(self.params[n].dtype) for n, v in theta.items()}
            return _Staged(anchors, self.device.mark())

    @torch.no_grad()
    def align(self, staged: _Staged, mixing: float = 0.0) -> None:
        self.device.after(staged.event)
        self.device.used_here(staged.anchors.values())
        # NumpyAdapter.write's formula, op for op: mixing*current + (1-mixing)*value in float32,
        # each product and the sum rounded once (no lerp, no fused multiply-add), then cast.
        keep, take = float(np.float32(mixing)), float(np.float32(1.0 - mixing))
        for n, anchor in staged.anchors.items():
            p = self.params[n]
            if mixing:
                mixed = p.float() * keep
                mixed += anchor.float() * take
                p.copy_(mixed)
            else:
                p.copy_(anchor)
            self.anchors[n] = anchor

    @torch.no_grad()
    def carry(self, staged: _Staged, since: _Captured | None) -> None:
        self.device.after(staged.event)
        self.device.used_here(staged.anchors.values())
        for n, anchor in staged.anchors.items():
            p = self.params[n]
            snapshot = since.local[n] if since is not None else self.anchors[n]
            # The host formula, op for op: theta + (local - snapshot), each rounded once in float32.
            moved = p.float() - snapshot.float()
            moved += anchor.float()
            p.copy_(moved)
            self.anchors[n] = anchor

    @torch.no_grad()
    def give_back(self, owed: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        # feedback.give_back and feedback.carried, op for op. The residuals were made on the side
        # stream, whose work the background waited for (its device-to-host copies came after).
        self.device.used_here(owed.values())
        left = {}
        for n, r in owed.items():
            p = self.params[n]
            wanted = p.float() - r
            p.copy_(wanted)
            if p.dtype != torch.float32:
                left[n] = p.float() - wanted
        return left or None


class _Captured:
    def __init__(self, device: _Device, anchors: dict[str, torch.Tensor], local: dict[str, torch.Tensor], event: Any):
        self.device, self.anchors, self.local, self.event = device, anchors, local, event

    @torch.no_grad()
    def encode(self, dtypes: Mapping[str, str]) -> dict[str, QTensor]:
        return self.encode_with_residual(dtypes, None, feedback=False)[0]

    @torch.no_grad()
    def encode_with_residual(
        self, dtypes: Mapping[str, str], residual: Mapping[str, torch.Tensor] | None, *, feedback: bool = True
    ) -> tuple[dict[str, QTensor], dict[str, torch.Tensor]]:
        new: dict[str, torch.Tensor] = {}
        with self.device.side():
            self.device.after(self.event)
            self.device.used_here(self.local.values())
            quantized = {}
            for n, local in self.local.items():
                # The node's host formula: np.subtract(anchor, local, dtype=float32).
                x = self.anchors[n].float() - local.float()
                if not feedback or dtypes[n] == "F32":
                    quantized[n] = tq.quantize(x, dtypes[n])
                    continue
                # feedback.quantize_with_residual, op for op (residuals never leave the device).
                if residual is not None and n in residual:
                    self.device.used_here([residual[n]])  # (``carried``: made on the training stream)
                    x += residual[n]
                quantized[n] = q = tq.quantize(x, dtypes[n])
                e = torch.sub(x, tq.dequantize(q), out=x)  # q holds its own codes, not x (x is not F32)
                new[n] = e.masked_fill_(~torch.isfinite(e), 0)
            flat = [t for q in quantized.values() for t in (q.data, q.scale) if t is not None]
            host = iter(self.device.download(flat))
        out = {n: tq.to_qtensor(q, next(host), None if q.scale is None else next(host)) for n, q in quantized.items()}
        return out, new
