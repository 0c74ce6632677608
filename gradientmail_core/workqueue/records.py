"""The work queue's records (``docs/protocol.md`` section 7), in ``records.py``'s conventions.

Frozen dataclasses, every field type- and range-checked on read, unknown fields refused,
canonical JSON through ``records.encode`` / ``records.decode`` (the same codec, the same
``format``). Queue names and holder ids follow the learner-id rule; nonces tell two
incarnations of one holder id apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol.keys import MAX_ATTEMPT, MAX_SEQ, MAX_UNIT
from ..protocol.records import _LEARNER, _MAC, _NONCE, _PUBKEY, _SIG, FORMAT, learner_field, nonneg

__all__ = ["QueueInfo", "UnitClaim", "UnitDone", "UnitHold", "UnitRelease"]


def _meta(**kw: Any) -> dict[str, Any]:
    return {"check": kw}


def _queue() -> Any:
    return field(metadata=_meta(pattern=_LEARNER))


def _unit() -> Any:
    return field(metadata=_meta(min=0, max=MAX_UNIT))


def _attempt() -> Any:
    return field(metadata=_meta(min=1, max=MAX_ATTEMPT))


def _nonce() -> Any:
    return field(metadata=_meta(pattern=_NONCE))


# In an authenticated run (``docs/security.md``) a queue's records carry the run secret's MAC and,
# in a members-only run, the holder's signature, as the run's own records do; left out of the JSON
# when unset, so the records of an open run keep their bytes.
def _mac() -> Any:
    return field(default=None, metadata={**_meta(pattern=_MAC), "omit_default": True})


def _signer() -> Any:
    return field(default=None, metadata=_meta(pattern=_PUBKEY))


def _sig() -> Any:
    return field(default=None, metadata=_meta(pattern=_SIG))


@dataclass(frozen=True, kw_only=True)
class QueueInfo:
    """``work/{queue}/queue.json``: written once by whoever opens the queue first."""

    queue: str = _queue()
    units: int = field(metadata=_meta(min=1, max=MAX_UNIT + 1))
    lease_timeout: float = field(metadata=_meta(min=0.001))
    created_by: str = learner_field()
    format: int = FORMAT
    mac: str | None = _mac()
    signer: str | None = _signer()
    sig: str | None = _sig()


@dataclass(frozen=True, kw_only=True)
class UnitClaim:
    """``claims/{unit}/{attempt}.json``: attempt ``attempt`` of ``unit`` belongs to this holder."""

    queue: str = _queue()
    unit: int = _unit()
    attempt: int = _attempt()
    holder: str = learner_field()
    nonce: str = _nonce()
    format: int = FORMAT
    mac: str | None = _mac()
    signer: str | None = _signer()
    sig: str | None = _sig()


@dataclass(frozen=True, kw_only=True)
class UnitHold:
    """``holds/{unit}/{attempt}/{seq}.json``: the holder's heartbeat for its attempt.

    ``consumed`` is how many of the unit's items the holder had handed out (informational).
    """

    queue: str = _queue()
    unit: int = _unit()
    attempt: int = _attempt()
    holder: str = learner_field()
    nonce: str = _nonce()
    seq: int = field(metadata=_meta(min=1, max=MAX_SEQ))
    consumed: int = nonneg(default=0)
    format: int = FORMAT
    mac: str | None = _mac()
    signer: str | None = _signer()
    sig: str | None = _sig()


@dataclass(frozen=True, kw_only=True)
class UnitRelease:
    """``released/{unit}/{attempt}.json``: the holder gave its attempt back unfinished."""

    queue: str = _queue()
    unit: int = _unit()
    attempt: int = _attempt()
    holder: str = learner_field()
    nonce: str = _nonce()
    consumed: int = nonneg(default=0)
    format: int = FORMAT
    mac: str | None = _mac()
    signer: str | None = _signer()
    sig: str | None = _sig()


@dataclass(frozen=True, kw_only=True)
class UnitDone:
    """``done/{unit}.json``: the unit is consumed, by this attempt. Created once, never deleted."""

    queue: str = _queue()
    unit: int = _unit()
    attempt: int = _attempt()
    holder: str = learner_field()
    nonce: str = _nonce()
    format: int = FORMAT
    mac: str | None = _mac()
    signer: str | None = _signer()
    sig: str | None = _sig()
