"""The background half of a learner: one ``tick()`` polls the mailbox once and does what is due.

A tick is single-threaded and reads time only from the injected clock, so a simulation drives many
nodes deterministically. The node owns its parts, each given the shared ``NodeState`` and nothing
of the others (``Publisher``, ``Follower``, ``Election``, ``Closing``, ``GarbageCollector``), and
its ``Placement``. ``tick`` reads as one round's story, in order.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from .. import events as ev
from ..clock import Clock
from ..errors import MailboxUnavailable, PayloadCorrupt
from ..protocol import keys
from ..protocol.lease import LeaseWriter, Liveness
from ..protocol.records import chunk_refs
from ..protocol.run import RunInfo
from ..protocol.store import RunStore
from .bridge import Bridge, View
from .closing import Closing
from .election import Election
from .follower import CommitScreen, Follower
from .gc import GarbageCollector
from .options import NodeOptions
from .placement import OneProcess, Placement
from .publisher import Publisher
from .state import NodeState


class Node:
    def __init__(
        self,
        store: RunStore,
        clock: Clock,
        run: RunInfo,
        *,
        learner: str,
        nonce: str,
        emit: Callable[[ev.Event], None],
        options: NodeOptions,
        bridge: Bridge | None = None,
        rng: random.Random | None = None,
        role: str = "both",
        placement: Placement | None = None,
    ) -> None:
        """``placement``: how parameters move and who merges (default ``OneProcess``: this
        process holds the model; a sharded node's rank 0 passes its own)."""
        self.store, self.clock, self.run, self.me = store, clock, run, learner
        self.emit, self.opts = emit, options
        self.bridge = bridge or Bridge()
        role = keys.validate_role(role)
        self.lease = LeaseWriter(store, clock, learner, nonce, options.lease_interval, role=role)
        self.placement = placement or OneProcess(store, run, self.bridge)
        liveness = Liveness(clock, options.lease_timeout, learner, role=role)
        self.state = NodeState(run, learner, role, liveness, fleet_polls=self.placement.fleet_polls)
        self.merger = self.placement.merger
        self.spool = self.merger.spool  # the contributions of the rounds it closes, on local disk
        screen = CommitScreen(store, run, emit, me=learner, fraction=options.verify, rng=rng or random.Random(0))
        s, c = self.state, options.payload_compression
        self.publisher = Publisher(store, s, self.placement, self.bridge, emit, nonce=nonce, compression=c)
        # A follower stuck on a damaged record stops once its writer had time to write it again
        # (``Closing.recheck``: two polls after it lands).
        damaged_after = options.round_timeout_floor + options.lease_timeout
        self.follower = Follower(store, s, self.placement, self.bridge, screen, emit, clock, damaged_after)
        self.election = Election(store, clock, s, self.lease, self.bridge, emit, options=options, nonce=nonce)
        recheck = (2 * options.poll_interval,)  # one GET per commit: a record damaged as it lands
        self.closing = Closing(store, clock, s, self.placement, emit, compression=c, recheck_after=recheck)
        self.gc = GarbageCollector(store, s)

    # ---- joining ----------------------------------------------------------------------

    def join(self, *, created: bool, predecessor: str | None = None) -> dict[int, dict[str, np.ndarray]]:
        """Take a lease, read the tape and the newest parameters of every fragment. ``predecessor``: the
        nonce of this learner id's previous process, known dead (``LeaseWriter.acquire``)."""
        try:
            s = self.state
            self.lease.acquire(poll=self.opts.poll_interval, predecessor=predecessor)
            s.list_leases(self.store)
            recs, thetas = self.placement.read_newest()
            for f, theta in thetas.items():
                s.thetas[f] = (recs[f].version if f in recs else 0, theta)
            s.newest = recs
            s.head = max((r.round for r in recs.values()), default=-1)
            if created and self.election.try_claim(0, 1, previous=None, reason=None):
                self._open(0)
            # A node that closes round 0 (it created the run, and no node claimed the round first)
            # recovers the outer state from what it read; any other lends it to its learner.
            s.lent = self.follower.lends()
            if s.lent:
                s.thetas = {f: (v, None) for f, (v, _) in s.thetas.items()}
            self._publish_view()
            self.emit(ev.Joined(self.me, s.head, created, len(s.liveness.live())))
            return thetas
        except PayloadCorrupt as e:  # a payload damaged in transit: transient, like any failed read
            raise MailboxUnavailable(f"{e}; retry joining") from e

    def leave(self) -> None:
        self.lease.release()
        self.spool.close()  # the contribution chunks of the rounds it closed: on local disk, removed
        self.follower.screen.close()
        self.emit(ev.Left(self.me, self.state.head))

    # ---- one poll ---------------------------------------------------------------------

    def tick(self) -> None:
        try:
            self.publisher.publish_pending()  # the learner's contributions, uploaded
            self.lease.renew(local_step=self.bridge.local_step, tokens=self.bridge.tokens)
            if self.follower.advance(self._list_rounds()):  # the commits since the last poll, followed
                # (never for a round the listing shows committed but we could not read yet)
                self._drive_round(self.state.head + 1)
            self.closing.recheck()  # this node's own records, read back when due
            self._release_own_snapshots()
            self._publish_view()  # what the learner sees until the next poll
        except PayloadCorrupt as e:  # read back damaged (a flipped bit in transit): retried next poll
            raise MailboxUnavailable(f"{e}; retrying on the next poll") from e

    def _drive_round(self, r: int) -> None:
        """The open round ``r``: watched, claimed, or judged and committed by this node."""
        s = self.state
        if not s.may_close:
            self.election.watch_closers(r)
            return
        if s.collector is not None and s.collector.round != r:
            s.collector = None
        if s.collector is None:
            if self.election.watch(r):
                self._open(r)
            return
        c = s.collector
        live = self.closing.due(c)  # its snapshots judged; the number of live learners once due
        if live is None:
            return
        commit, rec = self.closing.merge(c, live)  # the commit's payloads written
        # The round after is claimed before this record is written, so no follower ever sees it
        # unclaimed (and claims it at once) while this closer lives.
        next_claimed = self.election.try_claim(r + 1, 1, previous=None, reason=None)
        landed = self.closing.write(commit, rec)
        if landed is not rec:  # another closer's record was there first: follow theirs
            if landed is not None:
                self.follower.take(landed)  # (a payload that reads back damaged: advance retries it)
            return
        self.follower.on_record(landed, commit.theta)
        if next_claimed or self.election.try_claim(r + 1, 1, previous=None, reason=None):
            self._open(r + 1)
        self.gc.collect(r)

    def _open(self, r: int) -> None:
        """This node holds round ``r``'s claim: it closes the round (once it is the open one)."""
        if r != self.state.head + 1:
            return
        self.closing.open(r)
        self.election.stop_watching()

    # ---- the poll's listing -----------------------------------------------------------

    def _list_rounds(self) -> list[str]:
        s = self.state
        if s.polls_fleet():
            # A fleet's follower (docs/protocol.md section 12, rule 4): the round records after the
            # head; the claimant's lease is watched by ``election``, the live count is the record's.
            s.snapshot_keys = {}
            round_keys = self.store.keys(keys.ROUNDS, after=keys.round_key(s.head))
            s.listing += 1
            return round_keys
        # Else the new round records and the open rounds' snapshots (which ``snapshot_keys`` takes),
        # with the leases when due.
        if self.clock.now() - s.liveness.listed_at >= self.opts.lease_list_interval:
            s.list_leases(self.store)
        # One listing per poll: ``snapshots/`` sorts after ``rounds/``, so listing everything after
        # the head's record returns the new records and the open rounds' snapshots together.
        after = keys.round_key(s.head) if s.head >= 0 else keys.ROUNDS
        listing = self.store.keys("", after=after)
        before, s.snapshot_keys = s.snapshot_keys, {}
        for k in listing:
            parsed = keys.parse_snapshot_key(k)
            if parsed is not None:
                s.snapshot_keys.setdefault(parsed[0], set()).add(parsed[1])
        s.listed()
        newcomers = False
        for r, learners in s.snapshot_keys.items():
            for learner in learners - before.get(r, set()):
                s.sightings[learner] = s.listing  # a new contribution
                newcomers = newcomers or learner not in s.liveness.seen
        if newcomers:
            # A learner contributes before this node listed its lease (it joined since): list the
            # leases now, so a round this node closes waits for it as the quorum says (at most one
            # extra LIST a poll, and only when an unknown learner's snapshot appears).
            s.list_leases(self.store)
        return [k for k in listing if k.startswith(keys.ROUNDS)]

    # ---- after the poll ---------------------------------------------------------------

    def _release_own_snapshots(self) -> None:
        """Keep this node's snapshots (and their chunks in the spool) only for the rounds it may
        still judge as their closer: the one it collects (until judged) and those after it. A node
        closing nothing keeps none (a fragment per round in flight): were it to take a round over,
        it reads its snapshot back from the store like anyone else's."""
        s = self.state
        c = s.collector
        for r in [r for r in s.own_snapshots if c is None or r < c.round or (r == c.round and self.me in c.judged)]:
            snap = s.own_snapshots.pop(r)
            if c is None or r < c.round:  # (judged: its chunks stay in the spool for the merge)
                for ref in chunk_refs(snap.payload):
                    self.spool.discard(ref.sha256)

    def _publish_view(self) -> None:
        # The rounds about to close, which a learner contributes to early (docs/protocol.md step 1;
        # the prior art's count would break the equality with the textbook loop when the quorum is
        # every live learner: tests/test_equivalence.py). Only live learners' snapshots count:
        # objects under names nobody holds a lease for must not hurry every learner.
        s = self.state
        learners = s.liveness.live()
        live = len(learners)
        if s.polls_fleet() and (rec := s.newest_of_head()) is not None:
            live = rec.live  # (the closer's count; this node lists no leases but the claimant's)
        quorum = self.run.cfg.quorum_size
        need = quorum if quorum >= live else max(min(quorum, live) - 1, 1)
        others = frozenset(
            r for r, ls in s.snapshot_keys.items() if r > s.head and len((ls & learners) - {self.me}) >= need
        )
        closer_of = s.collector.round if s.collector else None
        view = View(s.head, others, live, s.rounds_seen, closer_of, sightings=dict(s.sightings), listing=s.listing)
        with self.bridge.lock:
            self.bridge.view = view
