"""Leases: each live learner keeps renewing a create-once heartbeat key, and observers
judge liveness by whether that key *changed* on their own monotonic clock.

Wall clocks are never compared across machines: a lease holds no timestamp anyone trusts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from ..clock import Clock
from ..errors import DuplicateLearner
from . import keys
from .records import Lease
from .store import RunStore

K = TypeVar("K")


class LeaseWriter:
    """This node's own lease: ``leases/{learner}/{seq}.json``, rewritten every ``interval``.

    ``role`` is in the key (``keys.lease_key``) and the record; ``waiting_for_closer`` goes into the
    next lease written (a learner-only node that sees no live node that may close rounds)."""

    def __init__(
        self, store: RunStore, clock: Clock, learner: str, nonce: str, interval: float, role: str = "both"
    ) -> None:
        self.store, self.clock, self.learner, self.nonce, self.interval = store, clock, learner, nonce, interval
        self.role = keys.validate_role(role)
        self.waiting_for_closer = False
        self.seq = 0
        self.key: str | None = None
        self.renewed_at = float("-inf")
        self._behind: list[str] = []  # our older lease keys not deleted yet

    def acquire(self, *, poll: float, predecessor: str | None = None) -> None:
        """Write the first lease; refuses when another live process holds this learner id. A crashed
        process's lease is taken over at once when it carries ``predecessor`` (the nonce of a process
        known dead, ``syncer.marker``), else once it has not changed for 1.5 renewal intervals."""
        existing = self.store.keys(keys.lease_prefix(self.learner))
        if existing:
            first = existing[-1]
            lease = self.store.try_record(first, Lease) if predecessor is not None else None
            known_dead = lease is not None and lease.nonce == predecessor
            deadline = self.clock.now() + (0.0 if known_dead else 1.5 * self.interval)
            while self.clock.now() < deadline:
                self.clock.sleep(poll)
                now = self.store.keys(keys.lease_prefix(self.learner))
                if now and now[-1] != first:
                    raise DuplicateLearner(
                        f"learner id {self.learner!r} is already used by a live process (its lease {now[-1]} "
                        "keeps changing); give this process a different learner_id"
                    )
            parsed = keys.parse_lease_key(first)
            self.seq = parsed[1] + 1 if parsed else 0
            self.store.delete(existing)
        self.renew(local_step=0, tokens=0, force=True)

    def due(self) -> bool:
        return self.clock.now() - self.renewed_at >= self.interval

    def renew(self, *, local_step: int, tokens: int, force: bool = False) -> None:
        if not force and not self.due():
            return
        key = keys.lease_key(self.learner, self.seq, self.role)
        lease = Lease(
            learner=self.learner,
            nonce=self.nonce,
            seq=self.seq,
            local_step=local_step,
            tokens=tokens,
            role=self.role,
            waiting_for_closer=self.waiting_for_closer,
        )
        if not self.store.put_own(key, lease, self.nonce):
            # Our next lease key exists with someone else's bytes: another process with our id.
            raise DuplicateLearner(
                f"learner id {self.learner!r} is used by another live process (it wrote {key}); "
                "give each process its own learner_id"
            )
        old, self.key = self.key, key
        self.seq += 1
        self.renewed_at = self.clock.now()
        if old is not None:
            self._behind.append(old)
            self.store.delete(list(self._behind))
            self._behind.clear()

    def release(self) -> None:
        if self.key is not None:
            # With any key a failed delete left behind: it would look like our lease, unchanged,
            # until it timed out.
            self.store.delete([*self._behind, self.key])
            self.key = None


@dataclass
class Seen:
    """The newest key of something watched (a node's lease, a work unit's heartbeat), and when it
    last changed on the observer's own clock: a timeout is judged by this, never by a timestamp
    written by another machine."""

    key: str
    changed_at: float


def note(seen: dict[K, Seen], name: K, key: str, now: float, *, afresh: bool = False) -> None:
    """``name``'s newest key as listed ``now``: watched afresh when it changed (or when ``afresh``:
    the observer was blind too long to know it stayed unchanged)."""
    prev = seen.get(name)
    if prev is None or prev.key != key or afresh:
        seen[name] = Seen(key, now)


class Liveness:
    """Who is live, from listings of ``leases/``, judged on this node's own clock; each node's role
    from its newest lease key. ``live()``: the nodes that contribute ("both", "learner"; a syncer
    counted would hold every round until its grace ran out). ``closers()``: "both" and "syncer"."""

    def __init__(self, clock: Clock, timeout: float, me: str | None, role: str = "both") -> None:
        self.clock, self.timeout, self.me = clock, timeout, me
        self.role = keys.validate_role(role)
        self.seen: dict[str, Seen] = {}
        self.roles: dict[str, str] = {}  # learner -> role, from its newest lease key
        self.listed_at = float("-inf")
        self.looked: dict[str, float] = {}  # learner -> when its leases alone were last listed

    def observe(self, lease_keys: list[str]) -> None:
        now = self.clock.now()
        # Keys are listed in order: the last one of each learner is its newest.
        newest = {p[0]: k for k in lease_keys if (p := keys.parse_lease_key(k))}
        # After a gap of a whole timeout between our listings we do not know that any lease
        # stayed unchanged: a learner that restarted meanwhile (its lease deleted, its sequence
        # starting over) may be back at the very key we saw last. Start watching afresh.
        blind = now - self.listed_at >= self.timeout
        for learner, k in newest.items():
            self._note(learner, k, now, blind)
        for gone in set(self.seen) - set(newest):
            del self.seen[gone]
            self.roles.pop(gone, None)
        self.listed_at = now

    def observe_one(self, learner: str, lease_keys: list[str]) -> None:
        """A listing of one node's leases (``leases/{learner}/``): what a follower of a fleet
        (``DiLoCo.max_contributions``) watches instead of every lease, the open round's claimant.
        The same rules as ``observe`` for that node; the others are left as they were."""
        now = self.clock.now()
        newest = [k for k in lease_keys if (p := keys.parse_lease_key(k)) is not None and p[0] == learner]
        blind = now - self.looked.get(learner, float("-inf")) >= self.timeout
        self.looked[learner] = now
        if newest:
            self._note(learner, newest[-1], now, blind)
        else:
            self.seen.pop(learner, None)
            self.roles.pop(learner, None)

    def _note(self, learner: str, key: str, now: float, blind: bool) -> None:
        """``learner``'s newest lease key as listed now: watched afresh when it changed (or when
        this node was blind for a whole timeout), its role from the key."""
        note(self.seen, learner, key, now, afresh=blind)
        self.roles[learner] = keys.lease_role(key) or "both"

    def is_live(self, learner: str) -> bool:
        if learner == self.me:
            return True
        s = self.seen.get(learner)
        return s is not None and self.clock.now() - s.changed_at < self.timeout

    def role_of(self, learner: str) -> str:
        return self.role if learner == self.me else self.roles.get(learner, "both")

    def live_nodes(self) -> set[str]:
        """Every live node, whatever its role (this one included)."""
        return {n for n in [*self.seen, self.me] if n is not None and self.is_live(n)}

    def live(self) -> set[str]:
        """The live learners: nodes that train (roles "both" and "learner"), this one included
        unless it is a syncer."""
        return {n for n in self.live_nodes() if self.role_of(n) != "syncer"}

    def closers(self) -> set[str]:
        """The live nodes that may close rounds (roles "both" and "syncer"), this one included
        when its role allows."""
        return {n for n in self.live_nodes() if self.role_of(n) in keys.CLOSER_ROLES}

    def abandoned(self, factor: float = 10.0) -> list[str]:
        """Lease keys unchanged for ``factor`` timeouts: their owners are long gone."""
        now = self.clock.now()
        return [s.key for n, s in self.seen.items() if n != self.me and now - s.changed_at > factor * self.timeout]
