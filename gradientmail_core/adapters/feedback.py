"""Error feedback for quantized deltas (``DiLoCo(error_feedback=True)``).

Each learner keeps, per fragment, what quantization took out of its last delta, and adds it to
its next delta of that fragment before quantizing::

    x = (anchor - local) + residual          # float32, each operation rounded once
    q = quantize(x, dtype)
    residual = x - dequantize(q)             # float32; non-finite entries become 0

So the deltas a learner sends sum to its true deltas up to one residual: a low-bit delta loses
nothing on average (MuLoCo, SparseLoCo). ``F32`` tensors have nothing to feed back and are left
alone, and the first delta of a fragment has no residual to add (``x`` is then the plain delta,
not ``delta + 0``, which would turn ``-0`` into ``+0``). A non-finite residual entry (a delta
with inf or NaN, which the closer rejects anyway) is reset to 0, so it cannot poison every later
delta. Host (numpy) and device (``Captured.encode_with_residual``) follow the same operations,
so they send the same bytes.

When the residual moves:

- at ``encode`` (the background thread), once per contribution: a retried upload encodes the
  same quantized tensors again, and the residual moves once;
- a publish the node drops before encoding (its round committed already) leaves it unchanged;
- a contribution the round's commit does not name (rejected, late, or over the quorum): the
  residual goes back to what it was before that delta (``settle``). Its training is either still
  in the parameters (``Carry``, so the next delta holds it in full) or replaced by the commit
  (``Overwrite``); keeping the whole delta as residual would send it twice, or send training the
  run dropped. If a later delta of the fragment went out before the commit arrived, the newer
  residual is kept (the older one is no longer separable from it);
- a learner that restarts or rejoins starts without residuals (they are not checkpointed: one
  round's rounding error per fragment, while the integrations checkpoint no anchors either).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..codec import quant

_F32 = np.float32
# residual -> (the quantized tensors, the new residual)
Encode = Callable[[Mapping[str, Any] | None], tuple[dict[str, quant.QTensor], Mapping[str, Any]]]


def quantize_with_residual(
    delta: Mapping[str, np.ndarray], residual: Mapping[str, np.ndarray] | None, dtypes: Mapping[str, str]
) -> tuple[dict[str, quant.QTensor], dict[str, np.ndarray]]:
    """``delta + residual`` quantized to ``dtypes``, and the new residual (the formula above)."""
    quantized, new = {}, {}
    for n, d in delta.items():
        if dtypes[n] == "F32":
            quantized[n] = quant.quantize(d, "F32")
            continue
        x = d if residual is None or n not in residual else np.add(d, residual[n], dtype=_F32)
        x = np.asarray(x, dtype=_F32)
        quantized[n] = q = quant.quantize(x, dtypes[n])
        e = np.subtract(x, quant.dequantize(q), dtype=_F32)
        with np.errstate(invalid="ignore"):
            new[n] = np.where(np.isfinite(e), e, _F32(0))
    return quantized, new


class Residuals:
    """One learner's residuals, per fragment, where its parameters live (numpy arrays on the host
    path, device tensors on a device pipeline). Encoding runs on the background thread, settling
    on the training thread: the maps are swapped under a lock, never computed under it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, Mapping[str, Any]] = {}
        # fragment -> (round of its newest delta, the residual before it) until a commit says
        # whether that delta was merged
        self._before: dict[int, tuple[int, Mapping[str, Any] | None]] = {}

    def of(self, fragment: int) -> Mapping[str, Any] | None:
        with self._lock:
            return self._held.get(fragment)

    def settle(self, fragment: int, round: int, *, merged: bool) -> None:
        """A commit of ``round`` arrived: if it left out this learner's delta of that round, the
        residual goes back to the one before that delta."""
        with self._lock:
            pending = self._before.get(fragment)
            if pending is None or pending[0] != round:
                return
            del self._before[fragment]
            if merged:
                return
            if pending[1] is None:
                self._held.pop(fragment, None)
            else:
                self._held[fragment] = pending[1]

    def _move(self, fragment: int, round: int, encode: Encode) -> dict[str, quant.QTensor]:
        # Only the background thread encodes, one contribution at a time, so nothing moves the
        # residual between the read and the write; the lock orders them against ``settle``.
        old = self.of(fragment)
        out, new = encode(old)
        with self._lock:
            self._held[fragment] = new
            self._before[fragment] = (round, old)
        return out


class Fed:
    """One contribution's part in its fragment's residual: quantizes once, however many times
    the contribution is encoded."""

    def __init__(self, residuals: Residuals, fragment: int, round: int) -> None:
        self.residuals, self.fragment, self.round = residuals, fragment, round
        self._quantized: dict[str, quant.QTensor] | None = None

    def quantize(self, encode: Encode) -> dict[str, quant.QTensor]:
        """``encode(residual) -> (quantized, new residual)``, the first time; its result after."""
        if self._quantized is None:
            self._quantized = self.residuals._move(self.fragment, self.round, encode)
        return self._quantized
