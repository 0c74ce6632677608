"""The engine's handles on a model's fragments: what goes out (a contribution) and what comes in
(a commit on its way into the model), whichever way the adapter moves them.

The learner and node see only these two handles. A contribution is asked for its payload bytes
on the background thread; a commit is staged on the background thread and written into the model
on the training thread. With the host path (every adapter) that is ``anchor - read()`` encoded
with numpy, and ``adapter.write``; with an adapter's ``DevicePipeline`` (``base.py``) the delta,
its quantization and the alignment happen where the parameters live, and device tensors and
events stay inside the pipeline's own handles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..codec.payload import encode_payload, encode_quantized
from .base import Adapter, Captured, DevicePipeline, pipeline_of


class Contribution(Protocol):
    """One fragment's delta (anchor minus local parameters) as captured after a step."""

    def encode(self, dtypes: Mapping[str, str], *, compression: str) -> bytes:
        """Background thread: the delta payload, each tensor quantized to its dtype."""
        ...


class Incoming(Protocol):
    """A commit's parameters of one fragment, on their way into the model."""

    def write(self, mixing: float = 0.0) -> None:
        """Training thread: set the fragment to ``mixing*current + (1-mixing)*theta``."""
        ...

    def carry(self, since: Contribution | None, anchor: Mapping[str, np.ndarray]) -> None:
        """Training thread: set the fragment to ``theta + (current - snapshot)`` in float32 (the
        subtraction first), where the snapshot is the fragment as ``since`` captured it, or
        ``anchor`` (the theta last aligned with) without one: the local steps since are kept."""
        ...


class _HostContribution:
    def __init__(self, anchor: Mapping[str, np.ndarray], local: Mapping[str, np.ndarray]) -> None:
        self.anchor, self.local = anchor, local

    def encode(self, dtypes: Mapping[str, str], *, compression: str) -> bytes:
        delta = {n: np.subtract(self.anchor[n], self.local[n], dtype=np.float32) for n in self.local}
        return encode_payload(delta, dtypes, kind="delta", compression=compression)


class _DeviceContribution:
    def __init__(self, captured: Captured) -> None:
        self.captured = captured

    def encode(self, dtypes: Mapping[str, str], *, compression: str) -> bytes:
        return encode_quantized(self.captured.encode(dtypes), kind="delta", compression=compression)


class _HostIncoming:
    def __init__(self, adapter: Adapter, theta: Mapping[str, np.ndarray]) -> None:
        self.adapter, self.theta = adapter, theta

    def write(self, mixing: float = 0.0) -> None:
        self.adapter.write(self.theta, mixing)

    def carry(self, since: Contribution | None, anchor: Mapping[str, np.ndarray]) -> None:
        snapshot = since.local if isinstance(since, _HostContribution) else anchor
        local = self.adapter.read(list(self.theta))
        self.adapter.write(
            {
                n: np.add(t, np.subtract(local[n], snapshot[n], dtype=np.float32), dtype=np.float32)
                for n, t in self.theta.items()
            }
        )


class _DeviceIncoming:
    def __init__(self, pipeline: DevicePipeline, staged: Any) -> None:
        self.pipeline, self.staged = pipeline, staged

    def write(self, mixing: float = 0.0) -> None:
        self.pipeline.align(self.staged, mixing)

    def carry(self, since: Contribution | None, anchor: Mapping[str, np.ndarray]) -> None:
        self.pipeline.carry(self.staged, since.captured if isinstance(since, _DeviceContribution) else None)


class FragmentIO:
    """Makes the two handles for one model, through its device pipeline when it has one."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.pipeline = pipeline_of(adapter)

    def capture(self, names: Sequence[str], anchor: Mapping[str, np.ndarray]) -> Contribution:
        """Training thread: the fragment's delta since ``anchor`` (the device pipeline keeps its own)."""
        if self.pipeline is not None:
            return _DeviceContribution(self.pipeline.capture(names))
        return _HostContribution(anchor, self.adapter.read(names))

    def stage(self, theta: Mapping[str, np.ndarray]) -> Incoming:
        """Background thread (or the training thread, if the node did not): a commit's theta,
        ready to be written (on the device pipeline, already moving to the device)."""
        if self.pipeline is not None:
            return _DeviceIncoming(self.pipeline, self.pipeline.stage(theta))
        return _HostIncoming(self.adapter, theta)


Stage = Callable[[Mapping[str, np.ndarray]], Incoming]
