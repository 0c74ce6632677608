"""The adapter contract, and the plain numpy adapter used by tests and simulations."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..codec.quant import QTensor
from ..protocol.records import TensorSpec


class Adapter(Protocol):
    def schema(self) -> list[TensorSpec]:
        """Trainable parameters in a stable order: name, dtype (F32/F16/BF16), shape."""
        ...

    def read(self, names: Sequence[str]) -> Mapping[str, np.ndarray]:
        """Host float32 copies of the named parameters (the caller may keep them). The copies
        may still be in flight from a device: the mapping waits for them when first read."""
        ...

    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        """Set the named parameters in place to ``mixing*current + (1-mixing)*value``."""
        ...


class Captured(Protocol):
    """A fragment's parameters and anchor as they were at ``DevicePipeline.capture``."""

    def encode(self, dtypes: Mapping[str, str]) -> dict[str, QTensor]:
        """Background thread: ``anchor - local`` in float32, quantized to ``dtypes`` on the device,
        as host ``QTensor``s holding the bytes ``quant.quantize`` gives for the same delta."""
        ...

    def encode_with_residual(
        self, dtypes: Mapping[str, str], residual: Mapping[str, Any] | None
    ) -> tuple[dict[str, QTensor], Mapping[str, Any]]:
        """Error feedback (``feedback.py``): ``anchor - local + residual`` quantized as ``encode``
        does, and the new residual, kept on the device (the bytes and values of
        ``feedback.quantize_with_residual``)."""
        ...


class DevicePipeline(Protocol):
    """Optional adapter capability, offered as ``adapter.pipeline`` (None or absent: the host path).

    For parameters on an accelerator: deltas, their quantization and the alignment run where the
    parameters are, and only encoded bytes cross to the host. The pipeline keeps each fragment's
    anchor (the theta last aligned with) on the device; the learner and node still keep the host
    thetas, for ``write_newest`` and the closer. The training thread only queues device work.
    """

    def capture(self, names: Sequence[str]) -> Captured:
        """Training thread: snapshot the named parameters and their anchors (device work only)."""
        ...

    def stage(self, theta: Mapping[str, np.ndarray]) -> Any:
        """Background thread: start moving a commit's theta to the device; an opaque handle."""
        ...

    def align(self, staged: Any, mixing: float = 0.0) -> None:
        """Training thread: ``write(theta, mixing)`` from a staged theta, which becomes the anchor."""
        ...

    def carry(self, staged: Any, since: Captured | None) -> None:
        """Training thread: ``theta + (current - snapshot)`` from a staged theta (the snapshot:
        the parameters ``since`` captured, or the device anchor without one); theta becomes the
        anchor. The same float32 operations as the host path, so the same bits."""
        ...

    def give_back(self, owed: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Training thread, error feedback (``feedback.py``): each named parameter becomes its
        float32 value less ``owed`` (device tensors ``encode_with_residual`` made), stored in its
        dtype; returns what a non-float32 parameter could not hold (``feedback.carried``, one
        entry per such parameter), None if every one is float32."""
        ...


def pipeline_of(adapter: Adapter) -> DevicePipeline | None:
    pipeline: DevicePipeline | None = getattr(adapter, "pipeline", None)
    return pipeline


class NumpyAdapter:
    """A model that is a ``dict`` of float32 numpy arrays (updated in place)."""

    def __init__(self, params: dict[str, np.ndarray]) -> None:
        for name, a in params.items():
            if not isinstance(a, np.ndarray) or a.dtype != np.float32:
                raise TypeError(f"parameter {name!r} must be a float32 numpy array, found {type(a).__name__}")
        self.params = params

    def schema(self) -> list[TensorSpec]:
        return [TensorSpec(name=n, dtype="F32", shape=list(a.shape)) for n, a in self.params.items()]

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return {n: self.params[n].copy() for n in names}

    def subtract_from(self, out: Mapping[str, np.ndarray]) -> None:
        """``out[n] -= params[n]`` in float32, in place, for each name of ``out`` (no copy of a
        parameter is made)."""
        for n, o in out.items():
            np.subtract(o, self.params[n], out=o, dtype=np.float32)

    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        for n, v in values.items():
            p = self.params[n]
            if mixing:
                p[...] = np.float32(mixing) * p + np.float32(1.0 - mixing) * v
            else:
                p[...] = v


class Renamed:
    """Another adapter under other names: ``names`` maps each of its names to the run's
    (``naming.renaming``). For adapters that hold no names of their own (a dict of arrays, one
    written by the user); the torch and MLX adapters rename as they are built. Offers no device
    pipeline (the host path)."""

    def __init__(self, inner: Adapter, names: Any) -> None:
        from .naming import renaming

        self.inner = inner
        self.to_run = renaming(names, [s.name for s in inner.schema()])
        self.to_inner = {m: n for n, m in self.to_run.items()}
        inner_subtract = getattr(inner, "subtract_from", None)
        self.subtract_from = None if inner_subtract is None else self._subtract_from

    def schema(self) -> list[TensorSpec]:
        return [dataclasses.replace(s, name=self.to_run[s.name], shape=list(s.shape)) for s in self.inner.schema()]

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        got = self.inner.read([self.to_inner[n] for n in names])
        return {n: got[self.to_inner[n]] for n in names}

    def _subtract_from(self, out: Mapping[str, np.ndarray]) -> None:
        self.inner.subtract_from({self.to_inner[n]: o for n, o in out.items()})  # type: ignore[attr-defined]

    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        self.inner.write({self.to_inner[n]: v for n, v in values.items()}, mixing)
