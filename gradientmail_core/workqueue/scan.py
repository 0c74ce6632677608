"""Reading a work queue's state from its keys (``docs/protocol.md`` section 7).

One listing of ``work/{queue}/`` returns the whole queue in byte order: claims, done markers,
heartbeats, the queue record and the releases. ``scan_queue`` parses it; ``read_queues`` sums
up every queue of a mailbox for ``gradientmail status``. Pure reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import RecordInvalid
from ..mailbox import Mailbox
from ..protocol.keys import WORK
from ..protocol.records import decode
from . import keys
from .records import QueueInfo


@dataclass
class QueueScan:
    """What one listing of a queue's folder shows."""

    name: str
    has_info: bool = False
    attempts: dict[int, int] = field(default_factory=dict)  # unit -> newest attempt claimed
    done: set[int] = field(default_factory=set)
    beats: dict[tuple[int, int], str] = field(default_factory=dict)  # (unit, attempt) -> newest hold key
    released: set[tuple[int, int]] = field(default_factory=set)

    def pulse(self, unit: int) -> str | None:
        """The newest sign of life of ``unit``'s newest attempt: its newest heartbeat key, or
        the claim key before the first heartbeat. None if the unit was never claimed."""
        n = self.attempts.get(unit)
        if n is None:
            return None
        return self.beats.get((unit, n)) or keys.unit_claim_key(self.name, unit, n)

    def is_released(self, unit: int) -> bool:
        n = self.attempts.get(unit)
        return n is not None and (unit, n) in self.released


def parse_listing(name: str, listed: Iterable[str]) -> QueueScan:
    scan = QueueScan(name)
    for k in listed:
        if (c := keys.parse_unit_claim_key(k)) is not None:
            if c[0] == name and c[2] > scan.attempts.get(c[1], 0):
                scan.attempts[c[1]] = c[2]
        elif (d := keys.parse_unit_done_key(k)) is not None:
            if d[0] == name:
                scan.done.add(d[1])
        elif (h := keys.parse_unit_hold_key(k)) is not None:
            if h[0] == name:
                scan.beats[(h[1], h[2])] = k  # listed in byte order: the last one is the newest
        elif (r := keys.parse_unit_release_key(k)) is not None:
            if r[0] == name:
                scan.released.add((r[1], r[2]))
        elif keys.parse_queue_info_key(k) == name:
            scan.has_info = True
    return scan


def scan_queue(mailbox: Mailbox, name: str, *, keep: Callable[[str], bool] | None = None) -> QueueScan:
    """The queue as one listing shows it (``keep``: which listed keys count; default all)."""
    listed = mailbox.list(keys.queue_prefix(name))
    return parse_listing(name, listed if keep is None else [k for k in listed if keep(k)])


@dataclass(frozen=True)
class QueueProgress:
    """A queue at a glance. ``in_progress``: claimed, not done, not given back (one look cannot
    tell a live holder from a dead one whose lease has not lapsed yet)."""

    name: str
    units: int
    done: int
    in_progress: int
    left: int
    reissued: int  # units claimed more than once (a holder died or gave the unit back)


def progress_of(scan: QueueScan, units: int) -> QueueProgress:
    done = {u for u in scan.done if 0 <= u < units}
    held = {u for u in scan.attempts if 0 <= u < units and u not in done and not scan.is_released(u)}
    return QueueProgress(
        name=scan.name,
        units=units,
        done=len(done),
        in_progress=len(held),
        left=units - len(done) - len(held),
        reissued=sum(1 for n in scan.attempts.values() if n > 1),
    )


def read_queue_info(mailbox: Mailbox, name: str) -> QueueInfo | None:
    key = keys.queue_info_key(name)
    data = mailbox.get(key)
    return None if data is None else decode(data, QueueInfo, key=key)


def read_queues(mailbox: Mailbox) -> list[QueueProgress]:
    """Every work queue of the mailbox, from one listing of ``work/``. A queue whose record
    is unreadable is left out."""
    by_queue: dict[str, list[str]] = {}
    for k in mailbox.list(WORK):
        parts = k.split("/", 2)
        if len(parts) == 3:
            by_queue.setdefault(parts[1], []).append(k)
    out = []
    for name, listed in sorted(by_queue.items()):
        scan = parse_listing(name, listed)
        if not scan.has_info:
            continue
        try:
            info = read_queue_info(mailbox, name)
        except (RecordInvalid, ValueError):
            continue
        if info is not None:
            out.append(progress_of(scan, info.units))
    return out
