"""Every key of a work queue (``gm.WorkQueue``, ``docs/protocol.md`` section 7), formatted and
parsed here and nowhere else. One folder per queue, under the run's ``work/``:

    work/{queue}/queue.json
    work/{queue}/claims/{unit:010d}/{attempt:03d}.json
    work/{queue}/done/{unit:010d}.json
    work/{queue}/holds/{unit:010d}/{attempt:03d}/{seq:010d}.json
    work/{queue}/released/{unit:010d}/{attempt:03d}.json

Numbers are zero-padded as the run's keys are (``protocol/keys.py``), so byte order is numeric
order. In an authenticated run these keys are secret-tagged like the run's record keys (``work/``
is one of ``protocol.keys.TAGGED_PREFIXES``).
"""

from __future__ import annotations

import re

from ..protocol.keys import LEARNER_ID, MAX_SEQ, WORK, is_known_key, padded

MAX_UNIT = 10**10 - 1
MAX_ATTEMPT = 999

_NAME = LEARNER_ID.pattern
_QUEUE_INFO_RE = re.compile(rf"work/({_NAME})/queue\.json")
_UNIT_CLAIM_RE = re.compile(rf"work/({_NAME})/claims/(\d{{10}})/(\d{{3}})\.json")
_UNIT_DONE_RE = re.compile(rf"work/({_NAME})/done/(\d{{10}})\.json")
_UNIT_HOLD_RE = re.compile(rf"work/({_NAME})/holds/(\d{{10}})/(\d{{3}})/(\d{{10}})\.json")
_UNIT_RELEASE_RE = re.compile(rf"work/({_NAME})/released/(\d{{10}})/(\d{{3}})\.json")


# ---- formatting -------------------------------------------------------------------------

# Queue names follow the learner-id rule. Inside a queue's folder ``claims/`` < ``done/`` <
# ``holds/`` < ``queue.json`` < ``released/`` in byte order, so one listing of ``work/{queue}/``
# returns all of it.


def _queue(name: str) -> str:
    if not isinstance(name, str) or not LEARNER_ID.fullmatch(name):
        raise ValueError(f"queue name {name!r} is invalid: it must match [a-z0-9][a-z0-9-]{{0,63}}")
    return name


def _unit(u: int) -> str:
    return padded(u, "unit", 0, MAX_UNIT)


def _attempt(n: int) -> str:
    return padded(n, "attempt", 1, MAX_ATTEMPT)


def queue_prefix(name: str) -> str:
    return f"{WORK}{_queue(name)}/"


def queue_info_key(name: str) -> str:
    return f"{queue_prefix(name)}queue.json"


def unit_claims_prefix(name: str, unit: int) -> str:
    return f"{queue_prefix(name)}claims/{_unit(unit)}/"


def unit_claim_key(name: str, unit: int, attempt: int) -> str:
    return f"{unit_claims_prefix(name, unit)}{_attempt(attempt)}.json"


def unit_done_prefix(name: str) -> str:
    return f"{queue_prefix(name)}done/"


def unit_done_key(name: str, unit: int) -> str:
    return f"{unit_done_prefix(name)}{_unit(unit)}.json"


def unit_holds_prefix(name: str, unit: int, attempt: int) -> str:
    return f"{queue_prefix(name)}holds/{_unit(unit)}/{_attempt(attempt)}/"


def unit_hold_key(name: str, unit: int, attempt: int, seq: int) -> str:
    return f"{unit_holds_prefix(name, unit, attempt)}{padded(seq, 'hold sequence', 0, MAX_SEQ)}.json"


def unit_release_key(name: str, unit: int, attempt: int) -> str:
    return f"{queue_prefix(name)}released/{_unit(unit)}/{_attempt(attempt)}.json"


# ---- parsing (None for anything that is not a key of that kind) -------------------------


def parse_queue_info_key(key: str) -> str | None:
    """The queue's name."""
    m = _QUEUE_INFO_RE.fullmatch(key)
    return m[1] if m else None


def parse_unit_claim_key(key: str) -> tuple[str, int, int] | None:
    """``(queue, unit, attempt)``."""
    m = _UNIT_CLAIM_RE.fullmatch(key)
    if not m or int(m[3]) < 1:
        return None
    return m[1], int(m[2]), int(m[3])


def parse_unit_done_key(key: str) -> tuple[str, int] | None:
    """``(queue, unit)``."""
    m = _UNIT_DONE_RE.fullmatch(key)
    return (m[1], int(m[2])) if m else None


def parse_unit_hold_key(key: str) -> tuple[str, int, int, int] | None:
    """``(queue, unit, attempt, seq)``."""
    m = _UNIT_HOLD_RE.fullmatch(key)
    if not m or int(m[3]) < 1:
        return None
    return m[1], int(m[2]), int(m[3]), int(m[4])


def parse_unit_release_key(key: str) -> tuple[str, int, int] | None:
    """``(queue, unit, attempt)``."""
    m = _UNIT_RELEASE_RE.fullmatch(key)
    if not m or int(m[3]) < 1:
        return None
    return m[1], int(m[2]), int(m[3])


def is_queue_key(key: str) -> bool:
    """True if ``key`` is a key of some work queue (after untagging)."""
    return (
        parse_queue_info_key(key) is not None
        or parse_unit_claim_key(key) is not None
        or parse_unit_done_key(key) is not None
        or parse_unit_hold_key(key) is not None
        or parse_unit_release_key(key) is not None
    )


def is_known(key: str) -> bool:
    """True for a key of the run's protocol or of a work queue: what a ``GuardedMailbox`` that
    lists a queue's folder takes for its own (``known=``)."""
    return is_known_key(key) or is_queue_key(key)
