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

from ..codec import quant
from ..codec.payload import PayloadStream, encode_payload
from .base import Adapter, Captured, DevicePipeline, pipeline_of
from .feedback import Fed, Residuals, carried, give_back, quantize_with_residual


class Contribution(Protocol):
    """One fragment's delta (anchor minus local parameters) as captured after a step."""

    def encode(self, dtypes: Mapping[str, str], *, compression: str) -> bytes:
        """Background thread: the delta payload, each tensor quantized to its dtype."""
        ...

    def stream(self, dtypes: Mapping[str, str], *, compression: str) -> PayloadStream:
        """Background thread: the same payload, produced piece by piece as it is uploaded (the
        node uploads this: no joined copy of the payload is held)."""
        ...

    def quantized(self, dtypes: Mapping[str, str]) -> dict[str, quant.QTensor]:
        """Background thread: the delta's tensors quantized (what ``stream`` encodes), which the
        node cuts into the chunks of a chunked run's payload (``syncer/placement.OneProcess``)."""
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
    def __init__(
        self,
        anchor: Mapping[str, np.ndarray],
        local: Mapping[str, np.ndarray],
        *,
        keep: bool,
        delta: dict[str, np.ndarray] | None = None,
    ) -> None:
        self.anchor, self.local, self.keep = anchor, local, keep
        self.delta = delta  # given: computed already (``FragmentIO.consume``)
        self.fed: Fed | None = None  # error feedback (``feedback.py``), set by ``FragmentIO``

    def encode(self, dtypes: Mapping[str, str], *, compression: str) -> bytes:
        return self.stream(dtypes, compression=compression).read()

    def stream(self, dtypes: Mapping[str, str], *, compression: str) -> PayloadStream:
        # quantized once (F32: the delta itself), read by the stream's hash pass and its upload
        return encode_payload(self.quantized(dtypes), kind="delta", compression=compression, stream=True)

    def quantized(self, dtypes: Mapping[str, str]) -> dict[str, quant.QTensor]:
        delta = self._delta()
        if self.fed is not None:
            return self.fed.quantize(lambda residual: quantize_with_residual(delta, residual, dtypes))
        return {n: quant.quantize(v, dtypes[n]) for n, v in delta.items()}

    def _delta(self) -> dict[str, np.ndarray]:
        if self.delta is not None:  # encoded before (a failed upload is retried): the delta is kept
            return self.delta
        if self.keep:  # Carry reads the local copy again: the delta goes elsewhere
            return {n: np.subtract(self.anchor[n], self.local[n], dtype=np.float32) for n in self.local}
        # Nothing reads the local copy again: the delta is written over it (a fragment of host
        # memory less at every publish; the same float32 values).
        self.delta = {n: np.subtract(self.anchor[n], v, out=_own(v), dtype=np.float32) for n, v in self.local.items()}
        self.local = {}
        return self.delta


def _own(v: np.ndarray) -> np.ndarray | None:
    """``v`` if a result may be written into it (a float32, C-contiguous, writable array), else None."""
    ok = isinstance(v, np.ndarray) and v.dtype == np.float32 and v.flags.c_contiguous and v.flags.writeable
    return v if ok else None


class _DeviceContribution:
    def __init__(self, captured: Captured) -> None:
        self.captured = captured
        self.fed: Fed | None = None

    def encode(self, dtypes: Mapping[str, str], *, compression: str) -> bytes:
        return self.stream(dtypes, compression=compression).read()

    def stream(self, dtypes: Mapping[str, str], *, compression: str) -> PayloadStream:
        return encode_payload(self.quantized(dtypes), kind="delta", compression=compression, stream=True)

    def quantized(self, dtypes: Mapping[str, str]) -> dict[str, quant.QTensor]:
        if self.fed is not None:
            return self.fed.quantize(lambda residual: self.captured.encode_with_residual(dtypes, residual))
        return self.captured.encode(dtypes)


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

    def __init__(self, adapter: Adapter, *, feedback: bool = False) -> None:
        self.adapter = adapter
        self.pipeline = pipeline_of(adapter)
        # Error feedback: each fragment's quantization residual, where the parameters live.
        self.residuals = Residuals() if feedback else None
        self._dtypes: dict[str, str] | None = None  # the parameters' own dtypes (``settle``)

    def capture(
        self,
        names: Sequence[str],
        anchor: Mapping[str, np.ndarray],
        *,
        keep: bool = True,
        slot: tuple[int, int] | None = None,
    ) -> Contribution:
        """Training thread: the fragment's delta since ``anchor`` (the device pipeline keeps its own).
        ``keep``: the fragment as captured is read again (``Incoming.carry``), so the host delta
        may not be computed over it. ``slot``: (fragment, round), for error feedback."""
        c: _DeviceContribution | _HostContribution
        if self.pipeline is not None:
            c = _DeviceContribution(self.pipeline.capture(names))
        else:
            c = _HostContribution(anchor, self.adapter.read(names), keep=keep)
        if self.residuals is not None and slot is not None:
            c.fed = Fed(self.residuals, *slot)
        return c

    @property
    def consumes(self) -> bool:
        """Whether ``consume`` can turn an anchor into the delta in place (the host path, with an
        adapter that subtracts its parameters from an array without copying them)."""
        return self.pipeline is None and getattr(self.adapter, "subtract_from", None) is not None

    def consume(
        self, names: Sequence[str], anchor: Mapping[str, np.ndarray], *, slot: tuple[int, int] | None = None
    ) -> Contribution:
        """Training thread: the fragment's delta, computed now over ``anchor``'s own arrays (which
        the caller gives up: nothing else may hold them). The delta of ``capture`` with no copy of
        the fragment: ``anchor - local``, the same float32 values, where the anchor was."""
        subtract = getattr(self.adapter, "subtract_from", None)
        assert self.pipeline is None and subtract is not None
        delta: dict[str, np.ndarray] = {}
        for n in names:
            own = _own(anchor[n])
            if own is not None:
                subtract({n: own})
                delta[n] = own
            else:  # not writable in place: a new array (one parameter's copy at a time)
                delta[n] = np.subtract(anchor[n], self.adapter.read([n])[n], dtype=np.float32)
        c = _HostContribution({}, {}, keep=False, delta=delta)
        if self.residuals is not None and slot is not None:
            c.fed = Fed(self.residuals, *slot)
        return c

    def settle(self, fragment: int, round: int, *, merged: bool) -> None:
        """Training thread, after the fragment was aligned with a commit of ``round``; ``merged``:
        it holds this learner's delta. Error feedback: what that delta owes goes into the
        parameters (``feedback.py``)."""
        if self.residuals is None:
            return
        owed = self.residuals.settle(fragment, round, merged=merged)
        if not owed:
            return
        if self.pipeline is not None:
            left = self.pipeline.give_back(owed)
        else:
            wanted = give_back(self.adapter.read(list(owed)), owed)
            self.adapter.write(wanted)
            rounded = [n for n in wanted if self._param_dtypes()[n] != "F32"]
            left = carried({n: wanted[n] for n in rounded}, self.adapter.read(rounded)) if rounded else None
        self.residuals.carry(fragment, left)

    def _param_dtypes(self) -> dict[str, str]:
        if self._dtypes is None:
            self._dtypes = {s.name: s.dtype for s in self.adapter.schema()}
        return self._dtypes

    def stage(self, theta: Mapping[str, np.ndarray]) -> Incoming:
        """Background thread (or the training thread, if the node did not): a commit's theta,
        ready to be written (on the device pipeline, already moving to the device)."""
        if self.pipeline is not None:
            return _DeviceIncoming(self.pipeline, self.pipeline.stage(theta))
        return _HostIncoming(self.adapter, theta)


Stage = Callable[[Mapping[str, np.ndarray]], Incoming]


class Mover(Protocol):
    """What the learner moves fragments through: ``FragmentIO``, or a sharded node's recording IO
    (``sharded/runtime.py``), whose ranks each move their own part."""

    def capture(
        self,
        names: Sequence[str],
        anchor: Mapping[str, np.ndarray],
        *,
        keep: bool = True,
        slot: tuple[int, int] | None = None,
    ) -> Contribution: ...

    def settle(self, fragment: int, round: int, *, merged: bool) -> None: ...

    def stage(self, theta: Mapping[str, np.ndarray]) -> Incoming: ...
