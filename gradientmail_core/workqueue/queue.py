"""Data assignment through the mailbox: ``gm.WorkQueue`` hands each node units of the dataset.

A dataset is cut into ``units`` shards, numbered ``0..units-1``. Nodes take units by create-once
claims; a node renews a heartbeat while it works on one; a finished unit gets a create-once done
marker; a unit whose holder stopped renewing is handed out again, as a new numbered attempt, once
its heartbeat has not changed for ``lease_timeout`` on the observer's own clock. No coordinator:
the store's create-once write decides every race. The protocol is ``docs/protocol.md`` section 7.

    queue = gm.WorkQueue(gm.FileMailbox("/shared/run-1"), units=1000, holder="node-a")
    while (hold := queue.next_unit()) is not None:
        for i in shard(hold.unit):
            train_on(i)
            queue.renew(hold)          # cheap: writes only every renew_every seconds
        queue.complete(hold)

``gradientmail_core.data`` turns a queue into a torch ``Sampler`` or an index-batch iterator.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..clock import Clock, SystemClock
from ..errors import GradientMailError, MailboxUnavailable
from ..mailbox import CreateOutcome, Mailbox
from ..protocol.guard import GuardedMailbox
from ..protocol.keys import validate_learner_id
from ..protocol.lease import Seen, note
from ..protocol.store import RunStore
from . import keys
from .auth import QueueRecords
from .records import QueueInfo, UnitClaim, UnitDone, UnitHold, UnitRelease
from .scan import QueueProgress, QueueScan, progress_of, scan_queue

__all__ = ["Hold", "HoldLost", "QueueMismatch", "WorkQueue"]

log = logging.getLogger("gradientmail.workqueue")
U = TypeVar("U", UnitClaim, UnitHold, UnitRelease, UnitDone)


class HoldLost(GradientMailError):
    """This node no longer holds the unit: it was handed to another holder (this one stopped
    renewing for a whole ``lease_timeout``), or another holder recorded it done. Stop working on
    it and take the next unit."""


class QueueMismatch(GradientMailError, ValueError):
    """The queue in the mailbox was created with another number of units. Use the same
    ``units`` on every node, or another queue ``name``."""


@dataclass
class Hold:
    """A unit this node holds: attempt ``attempt`` of ``unit``."""

    unit: int
    attempt: int
    renewed_at: float  # this node's clock, taken before its newest heartbeat was written
    consumed: int = 0
    seq: int = 0  # newest heartbeat written (0: only the claim)
    _beats: list[str] = field(default_factory=list)  # our heartbeat keys not deleted yet


class WorkQueue:
    """One node's handle on a work queue of ``units`` units in ``mailbox``.

    ``holder``: this node's id (the learner-id rule); two live processes must not share one.
    ``lease_timeout``: a holder whose heartbeat has not changed for this long, on an observer's
    own clock, has lost its unit; the queue's creator fixes it for everyone (``queue.json``).
    ``renew_every``: seconds between heartbeats (default ``lease_timeout / 4``).
    ``poll_interval``: how long ``next_unit`` sleeps while every unit left is held by others.
    ``secret``, ``secret_file``, ``identity``: the run's, as its ``Session`` was given them: in an
    authenticated run the queue's records are signed and checked like the run's own
    (``workqueue/auth.py``), and ``holder`` carries the identity's fingerprint.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        units: int,
        holder: str,
        name: str = "data",
        lease_timeout: float = 60.0,
        renew_every: float | None = None,
        poll_interval: float = 1.0,
        clock: Clock | None = None,
        nonce: str | None = None,
        max_tries: int = 8,
        secret: bytes | str | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        identity: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(units, int) or isinstance(units, bool) or not 1 <= units <= keys.MAX_UNIT + 1:
            raise ValueError(f"units={units!r}: expected an integer in 1..{keys.MAX_UNIT + 1}")
        if not lease_timeout > 0 or not poll_interval > 0:
            raise ValueError("lease_timeout and poll_interval must be positive")
        validate_learner_id(holder)
        keys.queue_prefix(name)  # validates the name
        store = RunStore(mailbox)
        if secret is not None or secret_file is not None or identity is not None:
            from ..protocol.members import node_policy

            auth, me = node_policy(secret, secret_file, identity)
            holder = me.learner_id(holder) if me is not None else holder
            store = RunStore(GuardedMailbox(mailbox, auth=auth, known=keys.is_known), auth=auth)
        self._records = QueueRecords(store)
        self.units, self.holder, self.name = units, holder, name
        self.lease_timeout = float(lease_timeout)
        self._renew_every = renew_every
        self.poll_interval = poll_interval
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.nonce = nonce if nonce is not None else secrets.token_hex(8)
        self.max_tries = max_tries
        self.info: QueueInfo | None = None
        self._held: dict[int, Hold] = {}
        self._unrecorded: dict[int, Hold] = {}  # finished, done marker not written yet (store down)
        self._watch: dict[int, Seen] = {}  # unit -> its newest sign of life, on this node's clock
        self._cursor = int.from_bytes(hashlib.sha256(holder.encode()).digest()[:8], "big") % units
        self._retry_at = float("-inf")
        self._done_seen = 0  # done markers in the newest listing
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"WorkQueue({self.name!r}, units={self.units}, holder={self.holder!r})"

    @property
    def store(self) -> RunStore:
        """The queue's records (an authenticated run's are bound to the run on first use)."""
        if not self._records.bound:
            self._records.bind()
        return self._records.store

    @property
    def mailbox(self) -> Mailbox:
        return self.store.mailbox

    @property
    def renew_every(self) -> float:
        return self._renew_every if self._renew_every is not None else self.lease_timeout / 4

    @property
    def held(self) -> list[Hold]:
        """The units this node holds now."""
        with self._lock:
            return list(self._held.values())

    # ---- opening ----------------------------------------------------------------------

    def open(self) -> QueueInfo:
        """Create the queue, or join it (checking ``units``; adopting its ``lease_timeout``)."""
        with self._lock:
            if self.info is not None:
                return self.info
            key = keys.queue_info_key(self.name)
            mine = QueueInfo(
                queue=self.name, units=self.units, lease_timeout=self.lease_timeout, created_by=self.holder
            )
            outcome, existing = self.store.put_record(key, mine)
            info = mine if outcome is not CreateOutcome.TAKEN else self.store.decode_record(existing, QueueInfo, key)
            if info.queue != self.name or info.units != self.units:
                raise QueueMismatch(
                    f"work queue {self.name!r} has {info.units} units, this node asked for {self.units}; "
                    "use the same units on every node, or another queue name"
                )
            self.lease_timeout = info.lease_timeout
            self.info = info
            return info

    # ---- looking -----------------------------------------------------------------------

    def refresh(self) -> QueueScan:
        """List the queue once and update, on this node's clock, when each claimed unit last
        showed a sign of life."""
        scan = self._scan()
        now = self.clock.now()
        with self._lock:
            self._done_seen = len(scan.done)
            for u in list(self._watch):
                if u in scan.done or u not in scan.attempts:
                    del self._watch[u]
            for u in scan.attempts:
                if u in scan.done:
                    continue
                pulse = scan.pulse(u)
                assert pulse is not None
                note(self._watch, u, pulse, now)
        return scan

    def lapsed(self, scan: QueueScan, unit: int) -> bool:
        """True if ``unit``'s newest attempt was given back, or showed no sign of life for
        ``lease_timeout`` on this node's clock (since this node first saw it)."""
        if unit in scan.done or unit not in scan.attempts:
            return False
        if scan.is_released(unit):
            return True
        w = self._watch.get(unit)
        return w is not None and self.clock.now() - w.changed_at >= self.lease_timeout

    def progress(self) -> QueueProgress:
        """Units done / in progress / left, from one listing."""
        return progress_of(self._scan(), self.units)

    def finished(self) -> bool:
        """True once every unit is recorded done."""
        return len(self._scan().done) >= self.units

    def _scan(self) -> QueueScan:
        return scan_queue(self.mailbox, self.name, keep=self._records.trusted)

    # ---- taking a unit -----------------------------------------------------------------

    def _candidates(self, scan: QueueScan) -> Iterator[int]:
        mine = set(self._held) | set(self._unrecorded)
        # Units given back or whose holder died first: they are the oldest work.
        for u in sorted(scan.attempts):
            if u not in mine and 0 <= u < self.units and self.lapsed(scan, u):
                yield u
        # Then never-claimed units, in order from this node's cursor, so that nodes start
        # apart and each one reads mostly consecutive units.
        for i in range(self.units):
            u = (self._cursor + i) % self.units
            if u not in scan.attempts and u not in scan.done:
                yield u

    def claim(self) -> Hold | None:
        """Take one unit if one can be taken now (never waits). None if every unit left is
        done or held by a live holder, or if other nodes won the units tried."""
        self.open()
        self._flush()
        scan = self.refresh()
        with self._lock:
            tries = 0
            for u in self._candidates(scan):
                if tries >= self.max_tries:
                    break
                n = scan.attempts.get(u, 0) + 1
                if n > keys.MAX_ATTEMPT:
                    log.warning(
                        "work queue %s: unit %d was claimed %d times; not handing it out again", self.name, u, n - 1
                    )
                    continue
                tries += 1
                hold = self._try_claim(u, n)
                if hold is not None:
                    self._cursor = (u + 1) % self.units
                    return hold
        return None

    def _try_claim(self, unit: int, attempt: int) -> Hold | None:
        started = self.clock.now()
        rec = self._record(UnitClaim, unit, attempt)
        outcome, _ = self.store.put_record(rec.logical_key(), rec)
        if outcome is CreateOutcome.TAKEN:
            return None  # another node took this attempt first
        if self._records.exists(keys.unit_done_key(self.name, unit), UnitDone):
            return None  # finished after our listing: our claim is moot, nothing to undo
        hold = Hold(unit=unit, attempt=attempt, renewed_at=started)
        self._held[unit] = hold
        return hold

    def next_unit(self, *, wait: bool = True, timeout: float | None = None) -> Hold | None:
        """The next unit for this node. Waits while every unit left is held by others (one of
        them may die, and its unit come back); None once every unit is done. ``wait=False``:
        None at once when nothing can be taken now. ``TimeoutError`` after ``timeout``."""
        deadline = None if timeout is None else self.clock.now() + timeout
        while True:
            try:
                hold = self.claim()
                if hold is not None or not wait:
                    return hold
                if self._done_seen >= self.units and not self._held:
                    return None  # the listing claim() just took shows every unit done
            except MailboxUnavailable as e:
                log.warning("work queue %s: store unavailable while looking for a unit (%s); retrying", self.name, e)
            self.heartbeat()
            if deadline is not None and self.clock.now() >= deadline:
                raise TimeoutError(f"work queue {self.name!r}: no unit could be taken within {timeout} s")
            self.clock.sleep(self.poll_interval)

    # ---- holding -----------------------------------------------------------------------

    def renew(self, hold: Hold, *, consumed: int | None = None, force: bool = False) -> None:
        """Keep ``hold``: writes a heartbeat when one is due (every ``renew_every``), else does
        nothing. Raises ``HoldLost`` if the unit went to another holder or was recorded done by
        one, or if this node could not renew for a whole ``lease_timeout`` (others may have
        taken it meanwhile: the unit is given back). A store that is down is retried later."""
        with self._lock:
            if self._held.get(hold.unit) is not hold:
                raise HoldLost(f"work queue {self.name!r}: unit {hold.unit} (attempt {hold.attempt}) is not held")
            if consumed is not None:
                hold.consumed = consumed
            now = self.clock.now()
            if now - hold.renewed_at >= self.lease_timeout:
                self._give_back(hold)
                raise HoldLost(
                    f"work queue {self.name!r}: unit {hold.unit} was not renewed for {now - hold.renewed_at:.1f} s "
                    f"(lease_timeout {self.lease_timeout} s); it was given back"
                )
            if not force and (now - hold.renewed_at < self.renew_every or now < self._retry_at):
                return
            try:
                self._beat(hold, now)
            except MailboxUnavailable as e:
                self._retry_at = now + self.poll_interval
                log.warning("work queue %s: could not renew unit %d (%s); retrying", self.name, hold.unit, e)

    def _beat(self, hold: Hold, now: float) -> None:
        u, n = hold.unit, hold.attempt
        newest = max(
            (
                p[2]
                for k in self.mailbox.list(keys.unit_claims_prefix(self.name, u))
                if (p := keys.parse_unit_claim_key(k)) and self._records.trusted(k)
            ),
            default=n,
        )
        if newest > n:
            self._forget(hold)
            self._delete_beats(hold)
            raise HoldLost(f"work queue {self.name!r}: unit {u} was handed out again (attempt {newest} > ours, {n})")
        if self._records.exists(keys.unit_done_key(self.name, u), UnitDone):
            self._forget(hold)
            self._delete_beats(hold)
            raise HoldLost(f"work queue {self.name!r}: unit {u} was recorded done by another holder")
        seq = hold.seq + 1
        rec = self._record(UnitHold, u, n, seq=seq, consumed=hold.consumed)
        key = rec.logical_key()
        if not self.store.put_own(key, rec, self.nonce):
            self._forget(hold)
            raise HoldLost(f"work queue {self.name!r}: another process wrote our heartbeat {key}")
        hold.seq, hold.renewed_at = seq, now
        hold._beats.append(key)
        self._delete_beats(hold, keep=key)

    def _record(self, cls: type[U], unit: int, attempt: int, **fields: Any) -> U:
        """This holder's record ``cls`` of its attempt ``attempt`` at ``unit``."""
        return cls(queue=self.name, unit=unit, attempt=attempt, holder=self.holder, nonce=self.nonce, **fields)

    def _forget(self, hold: Hold) -> None:
        self._held.pop(hold.unit, None)
        self._unrecorded.pop(hold.unit, None)

    def _delete_beats(self, hold: Hold, keep: str | None = None) -> None:
        doomed = [k for k in hold._beats if k != keep]
        if doomed:
            try:
                self.mailbox.delete(doomed)
            except MailboxUnavailable:
                return  # tried again with the next heartbeat
            hold._beats = [k for k in hold._beats if k == keep]

    def heartbeat(self) -> list[Hold]:
        """Renew every unit held (when due). Returns the holds lost."""
        lost = []
        for hold in self.held:
            try:
                self.renew(hold)
            except HoldLost:
                lost.append(hold)
        self._flush()
        return lost

    # ---- finishing ---------------------------------------------------------------------

    def complete(self, hold: Hold) -> bool:
        """Record ``hold``'s unit as done (create-once). True if this attempt's marker is the
        one recorded; False if another holder recorded the unit first. If the store is down,
        the unit stays held (and renewed by ``heartbeat``) and is recorded later."""
        with self._lock:
            if self._held.get(hold.unit) is not hold:
                raise HoldLost(f"work queue {self.name!r}: unit {hold.unit} (attempt {hold.attempt}) is not held")
            try:
                return self._record_done(hold)
            except MailboxUnavailable as e:
                log.warning("work queue %s: could not record unit %d done (%s); retrying", self.name, hold.unit, e)
                self._unrecorded[hold.unit] = hold
                return True

    def _record_done(self, hold: Hold) -> bool:
        rec = self._record(UnitDone, hold.unit, hold.attempt)
        outcome, _ = self.store.put_record(rec.logical_key(), rec)
        self._forget(hold)
        self._delete_beats(hold)
        return outcome is not CreateOutcome.TAKEN

    def _flush(self) -> None:
        with self._lock:
            for hold in list(self._unrecorded.values()):
                try:
                    self._record_done(hold)
                except MailboxUnavailable:
                    return

    def release(self, hold: Hold) -> None:
        """Give ``hold``'s unit back unfinished: other nodes may take it at once."""
        with self._lock:
            if self._held.get(hold.unit) is not hold:
                return
            self._give_back(hold)

    def _give_back(self, hold: Hold) -> None:
        self._forget(hold)
        rec = self._record(UnitRelease, hold.unit, hold.attempt, consumed=hold.consumed)
        try:
            self.store.put_record(rec.logical_key(), rec)
        except MailboxUnavailable:
            pass  # the unit comes back once its heartbeat lapses instead
        self._delete_beats(hold)

    def close(self) -> None:
        """Give back every unit still held (call on a clean shutdown)."""
        self._flush()
        for hold in self.held:
            self.release(hold)
