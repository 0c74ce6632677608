"""The background half of a learner: one ``tick()`` polls the mailbox once and does what
is due (upload contributions, renew the lease, follow the tape, align, close or take
over rounds, collect garbage).

A tick is single-threaded and reads time only from the injected clock, so a simulation
drives many nodes deterministically by calling ``tick()`` in a seeded order. The session
runs ticks on a background thread.

Each concern is a module of its own, over the state in ``state.py``: ``publishing`` (uploading
contributions), ``following`` (the tape), ``closing`` (the round this node closes), ``election``
(claims and takeover), ``gc``. This module joins them and runs one poll.
"""

from __future__ import annotations

import numpy as np

from .. import events as ev
from ..errors import MailboxUnavailable, PayloadCorrupt
from ..protocol import keys
from ..protocol.records import chunk_refs
from ..protocol.tape import newest_records, read_newest, round_keys
from .bridge import View
from .election import Election
from .publishing import Publishing
from .state import NodeOptions, NodeStats

__all__ = ["Node", "NodeOptions", "NodeStats"]


class Node(Publishing, Election):
    # ---- joining ----------------------------------------------------------------------

    def join(self, *, created: bool, predecessor: str | None = None) -> dict[int, dict[str, np.ndarray]]:
        """Take a lease, read the tape and the newest parameters of every fragment.

        ``predecessor``: the nonce of this learner id's previous process, known dead (its lease
        is then taken over at once, ``LeaseWriter.acquire``)."""
        try:
            return self._join(created, predecessor)
        except PayloadCorrupt as e:  # a payload damaged in transit: transient, like any failed read
            raise MailboxUnavailable(f"{e}; retry joining") from e

    def _join(self, created: bool, predecessor: str | None) -> dict[int, dict[str, np.ndarray]]:
        self.lease.acquire(poll=self.opts.poll_interval, predecessor=predecessor)
        self._list_leases()
        if self.bridge.follow is not None:  # a sharded node: its ranks read their own chunks (join_run)
            recs = newest_records(self.store, self.run, round_keys(self.store))
            thetas: dict[int, dict[str, np.ndarray]] = {f: {} for f in range(self.run.P)}
        else:
            recs, thetas = read_newest(self.store, self.run)
        for f, theta in thetas.items():
            version = recs[f].version if f in recs else 0
            self.thetas[f] = (version, theta)
        self.newest = recs
        self.head = max((r.round for r in recs.values()), default=-1)
        if created:
            self._try_claim(0, 1, previous=None, reason=None)
        # A node that closes round 0 (it created the run, and no node claimed the round first)
        # recovers the outer state from what it read; any other lends it to its learner.
        self.lent = self.lends()
        if self.lent:
            self.thetas = {f: (v, None) for f, (v, _) in self.thetas.items()}
        self._publish_view()
        self.emit(ev.Joined(self.me, self.head, created, len(self.liveness.live())))
        return thetas

    def leave(self) -> None:
        self.lease.release()
        self.spool.close()  # the contribution chunks of the rounds it closed: on local disk, removed
        if self.verifier is not None:
            self.verifier.close()
        self.emit(ev.Left(self.me, self.head))

    # ---- one poll ---------------------------------------------------------------------

    def tick(self) -> None:
        try:
            self._tick()
        except PayloadCorrupt as e:
            # A payload read back damaged (a flipped bit in transit): transient, retried next poll.
            raise MailboxUnavailable(f"{e}; retrying on the next poll") from e

    def _tick(self) -> None:
        self._publish_pending()
        self.lease.renew(local_step=self.bridge.local_step, tokens=self.bridge.tokens)
        if self.polls_fleet():
            # A follower of a fleet (``max_contributions``): one LIST of the round records after the
            # head, of a size that does not grow with the fleet; the claimant's lease is watched
            # by ``election`` and the live count comes from the newest record.
            self.snapshot_keys = {}
            round_keys = self.store.keys(keys.ROUNDS, after=keys.round_key(self.head))
            self.listing += 1
        else:
            round_keys = self._list_open_rounds()
        if self._advance(round_keys):
            self._drive_round()  # never for a round the listing shows committed but we could not read yet
        self._release_own_snapshots()
        self._publish_view()

    def _list_open_rounds(self) -> list[str]:
        """The poll's listing of the new round records and the open rounds' snapshots (which
        ``snapshot_keys`` takes), with the leases when due; returns the round records' keys."""
        if self.clock.now() - self.liveness.listed_at >= self.opts.lease_list_interval:
            self._list_leases()
        # One listing per poll: ``snapshots/`` sorts after ``rounds/``, so listing everything after
        # the head's record returns the new records and the open rounds' snapshots together.
        after = keys.round_key(self.head) if self.head >= 0 else keys.ROUNDS
        listing = self.store.keys("", after=after)
        before, self.snapshot_keys = self.snapshot_keys, {}
        for k in listing:
            parsed = keys.parse_snapshot_key(k)
            if parsed is not None:
                self.snapshot_keys.setdefault(parsed[0], set()).add(parsed[1])
        self.listing += 1
        for learner in self.liveness.live():
            self.sightings[learner] = self.listing
        newcomers = False
        for r, learners in self.snapshot_keys.items():
            for learner in learners - before.get(r, set()):
                self.sightings[learner] = self.listing  # a new contribution
                newcomers = newcomers or learner not in self.liveness.seen
        if newcomers:
            # A learner contributes before this node listed its lease (it joined since): list the
            # leases now, so a round this node closes waits for it as the quorum says (at most one
            # extra LIST a poll, and only when an unknown learner's snapshot appears).
            self._list_leases()
        return [k for k in listing if k.startswith(keys.ROUNDS)]

    def _release_own_snapshots(self) -> None:
        """Keep this node's snapshots (and their chunks in the spool) only for the rounds it may
        still judge as their closer: the one it collects (until judged) and those after it. A node
        closing nothing keeps none (a fragment per round in flight): were it to take a round over,
        it reads its snapshot back from the store like anyone else's."""
        c = self.collector
        for r in [r for r in self.own_snapshots if c is None or r < c.round or (r == c.round and self.me in c.judged)]:
            snap = self.own_snapshots.pop(r)
            if c is None or r < c.round:  # (judged: its chunks stay in the spool for the merge)
                for ref in chunk_refs(snap.payload):
                    self.spool.discard(ref.sha256)

    def _publish_view(self) -> None:
        # A round is about to close once the others' snapshots, with ours, would meet the quorum
        # the closer uses: ``max(min(quorum, live) - 1, 1)`` others, as the prior art counts them;
        # a learner then contributes what it has rather than be left out. Not when the quorum is
        # every live learner (textbook DiLoCo): that round waits for us anyway, and publishing
        # before we are due would only cut our contribution short (by the steps we lag: the
        # prior art's count breaks the equality with the textbook loop, tests/test_equivalence.py).
        # Only live learners' snapshots count: objects under names nobody holds a lease for (stray
        # or hostile) must not hurry every learner into contributing early.
        learners = self.liveness.live()
        live = len(learners)
        if self.polls_fleet() and (rec := self.newest_of_head()) is not None:
            live = rec.live  # (the closer's count; this node lists no leases but the claimant's)
        quorum = self.run.cfg.quorum_size
        need = quorum if quorum >= live else max(min(quorum, live) - 1, 1)
        others = frozenset(
            r for r, ls in self.snapshot_keys.items() if r > self.head and len((ls & learners) - {self.me}) >= need
        )
        closer_of = self.collector.round if self.collector else None
        view = View(
            self.head, others, live, self.rounds_seen, closer_of, sightings=dict(self.sightings), listing=self.listing
        )
        with self.bridge.lock:
            self.bridge.view = view

    def view(self) -> View:
        with self.bridge.lock:
            return self.bridge.view
