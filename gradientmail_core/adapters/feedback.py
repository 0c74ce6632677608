"""Error feedback for quantized deltas (``DiLoCo(error_feedback=True)``).

Each learner keeps, per fragment, what quantization took out of its last delta::

    x = (anchor - local) + carried           # float32, each operation rounded once
    q = quantize(x, dtype)
    owed = x - dequantize(q)                 # float32; non-finite entries become 0

and when the commit that merged that delta arrives, it gives ``owed`` back **to its parameters**:
the fragment, just aligned with the commit, becomes ``local - owed`` (``FragmentIO.settle``). The
next delta, ``anchor - local`` after the next inner steps, then holds ``owed`` wherever the inner
steps leave a parameter where it starts, and not where they pull it back regardless of where it
starts. ``carried`` is what the parameters could not hold: ``written - (local - owed)`` where the
parameter dtype rounds (bf16, f16), nothing for float32 parameters.

Why not add ``owed`` to the next delta (the textbook rule, and this module's before issue 29):
the commit that merged the delta missed ``outer_lr * (1 + momentum) * owed`` (the outer Nesterov
step applies a delta that much at once), so the next commit's parameters are displaced by it.
Where the inner steps pull every start to the same point (the loss is stiff there), the next
delta already brings that displacement back by itself; adding ``owed`` on top sends it a second
time, amplified by the same outer step. On textbook DiLoCo (1,000 steps, 3 seeds, held-out loss
against F32 deltas) that rule bought nothing: I2 1.0089 against 1.0096 without feedback, F4
1.0012 against 0.9986; given back, 1.0021 and 1.0009 (``bench/README.md``, section 6, issue 29).
Given back to the parameters, ``owed`` is sent exactly where the inner steps leave it: all of it
where the loss is flat (the deltas a learner sends sum to its true deltas up to one residual
there, as in MuLoCo and SparseLoCo), none of it where the loss is stiff (as without feedback).

``F32`` tensors have nothing to feed back and are left alone, and the first delta of a fragment
has nothing to add (``x`` is then the plain delta, not ``delta + 0``, which would turn ``-0`` into
``+0``). A non-finite residual entry (a delta with inf or NaN, which the closer rejects anyway) is
reset to 0, so it cannot poison every later delta. Host (numpy, MLX), the torch host path and the
torch device pipeline follow the same float32 operations, so they send the same bytes.

When the residual moves:

- at ``encode`` (the background thread), once per contribution: a retried upload encodes the
  same quantized tensors again, and the residual moves once;
- a publish the node drops before encoding (its round committed already) leaves it unchanged;
- the commit that merged the delta: ``owed`` goes into the parameters (``settle``), ``carried``
  is kept for the next delta;
- a commit that does not name the delta (rejected, late, or over the quorum): ``carried`` goes
  back to what it was before that delta, and ``owed`` is dropped. The delta's training is either
  still in the parameters (``Carry``, so the next delta holds it in full) or replaced by the
  commit (``Overwrite``); giving back the whole delta would send it twice, or send training the
  run dropped. If a later delta of the fragment went out before the commit arrived, the older
  ``owed`` was added to that delta (it is no longer separable from it);
- a learner that restarts or rejoins starts without residuals (they are not checkpointed: one
  round's rounding error per fragment, while the integrations checkpoint no anchors either).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from ..codec import quant

_F32 = np.float32
# what is added to the delta -> (the quantized tensors, the new residual)
Encode = Callable[[Mapping[str, Any] | None], tuple[dict[str, quant.QTensor], Mapping[str, Any]]]


def quantize_with_residual(
    delta: Mapping[str, np.ndarray], residual: Mapping[str, np.ndarray] | None, dtypes: Mapping[str, str]
) -> tuple[dict[str, quant.QTensor], dict[str, np.ndarray]]:
    """``delta + residual`` quantized to ``dtypes``, and the new residual (``owed``, above)."""
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


def give_back(local: Mapping[str, np.ndarray], owed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The host formula of ``settle``: the fragment's float32 values less what its delta owed
    (one float32 subtraction each); the parameters store it rounded to their dtype."""
    return {n: np.subtract(local[n], r, dtype=_F32) for n, r in owed.items()}


def carried(wanted: Mapping[str, np.ndarray], written: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """What parameters that round (bf16, f16: the names of ``wanted``) could not take of
    ``give_back``'s values: ``written - wanted`` (float32), added to the next delta; None for no
    such parameter. One entry per parameter, zeros included, whatever the values: the host and
    the device decide the same way without looking at them (adding a zero turns a -0 into +0)."""
    return {n: np.subtract(written[n], w, dtype=_F32) for n, w in wanted.items()} or None


class _Pending(NamedTuple):
    round: int
    added: Mapping[str, Any] | None  # what was added to the delta (``carried`` before it)
    owed: Mapping[str, Any]  # the delta's residual, until a commit says whether it was merged


class Residuals:
    """One learner's residuals, per fragment, where its parameters live (numpy arrays on the host
    path, device tensors on a device pipeline): ``carried`` (added to the next delta) and, until a
    commit answers, the newest delta's ``owed``. Encoding runs on the background thread, settling
    on the training thread: the maps are swapped under a lock, never computed under it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._carried: dict[int, Mapping[str, Any]] = {}
        self._pending: dict[int, _Pending] = {}

    def of(self, fragment: int) -> Mapping[str, Any] | None:
        """What the next delta of ``fragment`` adds (``carried``, and an unanswered delta's ``owed``)."""
        with self._lock:
            return _added(self._carried.get(fragment), self._pending.get(fragment))

    def owed(self, fragment: int) -> Mapping[str, Any] | None:
        """The newest delta's residual, until a commit answers it."""
        with self._lock:
            pending = self._pending.get(fragment)
            return None if pending is None else pending.owed

    def settle(self, fragment: int, round: int, *, merged: bool) -> Mapping[str, Any] | None:
        """A commit of ``round`` arrived: what this learner's delta of that round owes, to give
        back to the parameters if the commit merged it (None otherwise, or if it was not this
        fragment's newest delta); if it left the delta out, ``carried`` goes back to what it was
        before that delta."""
        with self._lock:
            pending = self._pending.get(fragment)
            if pending is None or pending.round != round:
                return None
            del self._pending[fragment]
            if merged:
                return pending.owed
            if pending.added is None:
                self._carried.pop(fragment, None)
            else:
                self._carried[fragment] = pending.added
            return None

    def carry(self, fragment: int, left: Mapping[str, Any] | None) -> None:
        """What the parameters could not hold of a residual given back: added to the next delta."""
        with self._lock:
            if left:
                self._carried[fragment] = left
            else:
                self._carried.pop(fragment, None)

    def _move(self, fragment: int, round: int, encode: Encode) -> dict[str, quant.QTensor]:
        # Only the background thread encodes, one contribution at a time, so nothing moves the
        # residual between the read and the write; the lock orders them against ``settle``.
        added = self.of(fragment)
        out, owed = encode(added)
        with self._lock:
            self._carried.pop(fragment, None)
            self._pending[fragment] = _Pending(round, added, owed)
        return out


def _added(carried: Mapping[str, Any] | None, pending: _Pending | None) -> Mapping[str, Any] | None:
    """``carried``, or an unanswered delta's ``owed``: a newer delta going out before the commit
    of the older one arrived (records skipped to catch up) takes the older residual in, as it
    can no longer be given back on its own. Never both: ``carried`` is emptied by each encode and
    set again only once a commit answered it."""
    assert carried is None or pending is None
    return pending.owed if pending is not None else carried


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
