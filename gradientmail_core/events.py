"""A closed set of typed events, delivered to ``Session(callbacks=...)``.

Events are facts about the run as one node saw them. ``log_events`` writes one line
each to the ``gradientmail.events`` logger, with the event's fields on the record as
structured data; tests and integrations subscribe with their own callables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

_log = logging.getLogger("gradientmail.events")


@dataclass(frozen=True)
class Event:
    learner: str

    def describe(self) -> str:
        parts = " ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "learner")
        return f"[{self.learner}] {type(self).__name__} {parts}".rstrip()


@dataclass(frozen=True)
class Joined(Event):
    round: int
    created_run: bool
    live: int


@dataclass(frozen=True)
class FragmentsClamped(Event):
    """``fragments`` asked for more fragments than the model has tensors: the run uses ``used``
    (``min(fragments, tensors)``, as recorded in the manifest's config)."""

    asked: int
    used: int


@dataclass(frozen=True)
class Left(Event):
    round: int


@dataclass(frozen=True)
class RoundClaimed(Event):
    round: int
    claim: int


@dataclass(frozen=True)
class TookOver(Event):
    round: int
    previous: str
    reason: str  # "lease_lost", "left" (the holder released its lease), "timeout" or "unclaimed"


@dataclass(frozen=True)
class QuorumReached(Event):
    round: int
    accepted: int
    seconds: float


@dataclass(frozen=True)
class RoundClosed(Event):
    round: int
    fragment: int
    participants: tuple[str, ...]
    rejected: tuple[tuple[str, str], ...]
    cosine: float | None
    grace_seconds: float


@dataclass(frozen=True)
class Committed(Event):
    round: int
    fragment: int
    version: int
    bytes_written: int


@dataclass(frozen=True)
class Superseded(Event):
    round: int
    by: str


@dataclass(frozen=True)
class Published(Event):
    round: int
    fragment: int
    steps: int
    tokens: int
    bytes: int
    final: bool


@dataclass(frozen=True)
class Skipped(Event):
    """A contribution was not sent because its round had already committed."""

    round: int
    reason: str


@dataclass(frozen=True)
class Aligned(Event):
    round: int
    fragment: int
    version: int
    bytes: int
    participants: tuple[str, ...] = ()  # of the round aligned with, for loggers on every node
    cosine: float | None = None
    dropped: int = 0  # local steps on this fragment the alignment discarded (none with Carry)
    # Steps this learner handed over in contributions of the fragment that did not reach a commit
    # (late, skipped, or cut off) and that Carry keeps in the local delta: its next contribution
    # carries them, though its ``steps`` (since the last contribution, SPEC 3.3) does not count them.
    carried: int = 0


@dataclass(frozen=True)
class ContributionRejected(Event):
    round: int
    contributor: str
    reason: str


@dataclass(frozen=True)
class IgnoredObject(Event):
    """An object in the mailbox failed validation or authentication and was ignored."""

    key: str
    reason: str


@dataclass(frozen=True)
class RecordRepaired(Event):
    """This node's own round record read back damaged (``reason``) and was written again."""

    round: int
    key: str
    reason: str


@dataclass(frozen=True)
class GaveUp(Event):
    round: int
    reason: str


@dataclass(frozen=True)
class WaitingForRun(Event):
    """A syncer (``gm.Syncer``) found no run in its mailbox (no manifest): it never creates one,
    so it waits for a learner to. Emitted once."""

    where: str


@dataclass(frozen=True)
class NoCloser(Event):
    """A learner-only node (``role="learner"``) sees no live node that may close rounds (a syncer
    or a ``role="both"`` node): the run waits at ``round``. Start one, e.g.
    ``gradientmail syncer URL --id NAME``. Emitted once, until ``CloserBack``."""

    round: int


@dataclass(frozen=True)
class CloserBack(Event):
    """A node that may close rounds (``who``) is live again after ``NoCloser``."""

    round: int
    who: str


@dataclass(frozen=True)
class RoundVerified(Event):
    """This node recomputed ``round``'s commit from its recorded inputs and found the record's
    parameters, outer state and change bit for bit (``Session(verify=)``)."""

    round: int
    fragment: int
    closer: str


@dataclass(frozen=True)
class RoundUnverifiable(Event):
    """This node chose ``round`` to verify but could not: an input is gone or reads back damaged
    (``reason``). The commit is applied, as without verification."""

    round: int
    fragment: int
    closer: str
    reason: str


@dataclass(frozen=True)
class ForgedCommit(Event):
    """``round``'s commit is not the merge of its recorded inputs (``reason``): ``closer`` committed
    it. This node does not apply it, nor any later commit of ``closer`` (``CommitRefused``).
    ``evidence``: in an authenticated run, the signed record that proves it. Follow the run's
    procedure: revoke ``closer``'s key in a members-only run (``gradientmail members remove``)."""

    round: int
    fragment: int
    closer: str
    reason: str
    evidence: str | None = None


@dataclass(frozen=True)
class CommitRefused(Event):
    """This node did not apply ``round``'s commit (``reason``); its learner keeps the fragment's
    parameters of the last commit it applied."""

    round: int
    fragment: int
    closer: str
    reason: str


@dataclass(frozen=True)
class StoreFailure(Event):
    """A transient store error; the node retries on its next poll."""

    error: str


@dataclass(frozen=True)
class BackgroundFailed(Event):
    error: str


class Callback(Protocol):
    def __call__(self, event: Event) -> None: ...


_QUIET = (StoreFailure, IgnoredObject)


def log_events(event: Event) -> None:
    """Log one line per event through ``logging`` (INFO; transient failures at WARNING).

    The message is ``event.describe()``. The event also reaches handlers and formatters as
    structured data, as two attributes of the ``LogRecord`` (passed with ``extra=``):

    - ``record.gm_event``: the event's type name, e.g. ``"RoundClosed"``;
    - ``record.gm``: a dict of the event's fields, ``learner`` included, with their values
      as the event holds them (e.g. ``{"learner": "a", "round": 3, "fragment": 0, ...}``).

    Both names start with ``gm`` so they never collide with ``LogRecord``'s own attributes
    (``logging`` refuses ``extra`` keys such as ``message`` or ``args``).
    """
    loud = (
        GaveUp,
        BackgroundFailed,
        Superseded,
        NoCloser,
        ForgedCommit,
        CommitRefused,
        RoundUnverifiable,
        RecordRepaired,
    )
    level = logging.WARNING if isinstance(event, _QUIET + loud) else logging.INFO
    if not _log.isEnabledFor(level):
        return
    data = {f.name: getattr(event, f.name) for f in fields(event)}
    _log.log(level, event.describe(), extra={"gm_event": type(event).__name__, "gm": data})


def deliver(callbacks: Sequence[Callable[[Event], None]], event: Event) -> None:
    """Hand ``event`` to every callback; one that raises is logged and the others still run (a
    broken logger must not stop training or the rounds)."""
    for cb in callbacks:
        try:
            cb(event)
        except Exception:
            _log.exception("event callback %r failed on %s", cb, type(event).__name__)
