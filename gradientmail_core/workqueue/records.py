"""The work queue's records (``docs/protocol.md`` section 7), in ``protocol/records.py``'s conventions.

Frozen dataclasses, every field type- and range-checked on read, unknown fields refused,
canonical JSON through ``records.encode`` / ``records.decode`` (the same codec, the same
``format``). Queue names and holder ids follow the learner-id rule; nonces tell two
incarnations of one holder id apart. Each record names its own key and the id it speaks for
(``records.KeyedRecord``), which is all the run's policy needs to sign and check it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol.keys import MAX_SEQ
from ..protocol.records import _LEARNER, _MAC, _NONCE, Signed, learner_field, nonneg
from . import keys
from .keys import MAX_ATTEMPT, MAX_UNIT

__all__ = ["QueueInfo", "UnitClaim", "UnitDone", "UnitHold", "UnitRelease"]


def _check(**kw: Any) -> dict[str, Any]:
    return {"check": kw}


@dataclass(frozen=True, kw_only=True)
class _QueueRecord(Signed):
    """What every record of a queue carries: the queue's name and, from ``Signed``, the policy's
    fields. Unlike the run's records, an unset ``mac`` is left out of the JSON, so the records of
    an open run keep the bytes they had before authenticated queues existed."""

    queue: str = field(metadata=_check(pattern=_LEARNER))
    mac: str | None = field(default=None, metadata={**_check(pattern=_MAC), "omit_default": True})


@dataclass(frozen=True, kw_only=True)
class QueueInfo(_QueueRecord):
    """``work/{queue}/queue.json``: written once by whoever opens the queue first."""

    units: int = field(metadata=_check(min=1, max=MAX_UNIT + 1))
    lease_timeout: float = field(metadata=_check(min=0.001))
    created_by: str = learner_field()

    def logical_key(self) -> str:
        return keys.queue_info_key(self.queue)

    def speaker(self) -> str:
        return self.created_by


@dataclass(frozen=True, kw_only=True)
class _UnitRecord(_QueueRecord):
    """What every record of one attempt at a unit carries: which unit, which attempt, whose."""

    unit: int = field(metadata=_check(min=0, max=MAX_UNIT))
    attempt: int = field(metadata=_check(min=1, max=MAX_ATTEMPT))
    holder: str = learner_field()
    nonce: str = field(metadata=_check(pattern=_NONCE))

    def speaker(self) -> str:
        return self.holder


@dataclass(frozen=True, kw_only=True)
class UnitClaim(_UnitRecord):
    """``claims/{unit}/{attempt}.json``: attempt ``attempt`` of ``unit`` belongs to this holder."""

    def logical_key(self) -> str:
        return keys.unit_claim_key(self.queue, self.unit, self.attempt)


@dataclass(frozen=True, kw_only=True)
class UnitHold(_UnitRecord):
    """``holds/{unit}/{attempt}/{seq}.json``: the holder's heartbeat for its attempt.

    ``consumed`` is how many of the unit's items the holder had handed out (informational).
    """

    seq: int = field(metadata=_check(min=1, max=MAX_SEQ))
    consumed: int = nonneg(default=0)

    def logical_key(self) -> str:
        return keys.unit_hold_key(self.queue, self.unit, self.attempt, self.seq)


@dataclass(frozen=True, kw_only=True)
class UnitRelease(_UnitRecord):
    """``released/{unit}/{attempt}.json``: the holder gave its attempt back unfinished."""

    consumed: int = nonneg(default=0)

    def logical_key(self) -> str:
        return keys.unit_release_key(self.queue, self.unit, self.attempt)


@dataclass(frozen=True, kw_only=True)
class UnitDone(_UnitRecord):
    """``done/{unit}.json``: the unit is consumed, by this attempt. Created once, never deleted."""

    def logical_key(self) -> str:
        return keys.unit_done_key(self.queue, self.unit)
