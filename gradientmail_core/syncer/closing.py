"""Closing a round this node claimed: recover the fragment's outer state (``open``), judge the
snapshots as they arrive and decide when the round may close (``due``: the quorum, the grace, and
with ``max_contributions`` the draw), merge (``merge``: the commit's payloads written), then write
the commit's record (``write``). The node calls them in that order and claims the next round
between the merge and the record, so no follower ever sees it unclaimed while this closer lives."""

from __future__ import annotations

from collections.abc import Callable

from .. import events as ev
from ..clock import Clock
from ..errors import ProtocolError, RecordInvalid
from ..mailbox import CreateOutcome
from ..mailbox.contract import write_stream
from ..protocol import keys
from ..protocol.records import Roster, RoundRecord, encode
from ..protocol.schedule import draw_order, fragment_of
from ..protocol.store import RunStore
from .collector import IGNORED, Collector
from .commit import Commit, FragmentState
from .merger import FragmentMerger
from .placement import Placement
from .replay import recover
from .state import NodeState
from .timing import Estimates


class Closing:
    def __init__(
        self,
        store: RunStore,
        clock: Clock,
        state: NodeState,
        placement: Placement,
        emit: Callable[[ev.Event], None],
        *,
        compression: str,
        recheck_after: tuple[float, ...] = (),
    ) -> None:
        """``recheck_after``: when this node reads each of its own round records back, in seconds
        after it wrote it (``recheck``)."""
        self.store, self.clock, self.state, self.placement, self.emit = store, clock, state, placement, emit
        self.recheck_after = recheck_after
        self.merger: FragmentMerger = placement.merger
        self.compression = compression
        self.last_sync: float | None = None  # how long the newest commit's merge and write took
        self._started = 0.0
        # This node's round records as written, each read back at the times ``recheck`` says (a record
        # damaged in the store is written again: nobody else holds its bytes): round -> (bytes, due).
        self.written: dict[int, tuple[bytes, list[float]]] = {}

    def open(self, r: int) -> None:
        """Start collecting round ``r`` (this node holds its claim)."""
        s = self.state
        state = self.fragment_state(fragment_of(r, s.run.P))
        s.collector = Collector(
            r, s.run, state, self.clock.now(), Estimates.from_record(s.newest_of_head()), merger=self.merger
        )

    def fragment_state(self, f: int) -> FragmentState:
        """The merger's state of fragment ``f`` at its newest record (``replay.recover``);
        ``MailboxUnavailable`` when this node's view is stale: caught up next poll."""
        s = self.state
        return recover(self.merger, self.store, s.run, f, s.newest.get(f), s.thetas.get(f))

    # ---- judging --------------------------------------------------------------------------

    def due(self, c: Collector) -> int | None:
        """Judge the round's new snapshots; the number of live learners once it may close (None: not
        yet). With ``max_contributions`` the quorum counts the records listed, and only the drawn ones
        are read once the round may close (``_judge_drawn``)."""
        s = self.state
        cap = s.run.cfg.max_contributions
        reported = s.snapshot_keys.get(c.round, set())
        if cap is None:
            for learner in sorted(reported - set(c.judged)):
                self._judge(c, learner)
        live = s.liveness.live()
        # (with a cap only live learners' names count: objects under names nobody holds a lease
        # for must not hurry the round closed; a drawn one of them is judged like any other)
        counted = None if cap is None else reported & live
        had_quorum = c.quorum_at is not None
        close = c.update(live, self.clock.now(), reported=counted)
        if not had_quorum and c.quorum_at is not None:
            n = len(c.accepted()) if counted is None else len(counted)
            self.emit(ev.QuorumReached(s.me, c.round, n, c.quorum_at - c.opened_at))
        if close and cap is not None:
            close = self._judge_drawn(c, cap, reported)
        return len(live) if close else None

    def _judge(self, c: Collector, learner: str) -> None:
        s = self.state
        j = c.judge_snapshot(self.store, learner, own=s.own_snapshots.get(c.round) if learner == s.me else None)
        if j.reason is not None and j.reason != IGNORED:
            s.stats.reject(j.reason)
            self.emit(ev.ContributionRejected(s.me, c.round, learner, j.reason))

    def _judge_drawn(self, c: Collector, cap: int, reported: set[str]) -> bool:
        """Judge the reported snapshots in the order of the round's draw (``schedule.draw``) until ``cap``
        are accepted, each batch's records, then payloads, fetched together; a rejected one is replaced
        by the next in the draw. The draw is taken again at every attempt (lower draws may have been
        listed since): judgements past the ``cap``-th accepted are dropped. True if one is accepted."""
        order = draw_order(self.state.run.manifest.run_id, c.round, reported | set(c.judged))

        def unjudged_in_reach() -> list[str]:
            accepted, todo = 0, list[str]()
            for lr in order:
                if accepted + len(todo) >= cap:
                    break
                j = c.judged.get(lr)
                if j is None:
                    todo.append(lr)
                elif j.reason is None:
                    accepted += 1
            return todo

        try:
            while todo := unjudged_in_reach():
                self._prefetch_snapshots(c.round, todo)
                for learner in todo:
                    self._judge(c, learner)
        finally:
            self.store.drop_prefetched()
        accepted, past = 0, []
        for lr in order:
            if accepted >= cap:
                past.append(lr)
            elif (j := c.judged.get(lr)) is not None and j.reason is None:
                accepted += 1
        for lr in past:
            if (j := c.judged.pop(lr, None)) is not None and j.snapshot is not None:
                c.forget(j.snapshot)
        if c.accepted():
            # What the record names (``Roster``): every learner the draw was taken over, less those
            # ignored (signed by no member), so a reader can take the draw again.
            c.roster = sorted(lr for lr in order if (j := c.judged.get(lr)) is None or j.reason != IGNORED)
            return True
        c.retry_unreadable()
        return False

    def _prefetch_snapshots(self, r: int, learners: list[str]) -> None:
        """Fetch these learners' snapshot records of round ``r`` together, then the payloads this
        process reads (``Placement.prefetch_contributions``)."""
        s = self.state
        own = r in s.own_snapshots
        wanted = {lr: keys.snapshot_key(r, lr) for lr in learners if not (own and lr == s.me)}
        self.store.prefetch(list(wanted.values()))
        self.placement.prefetch_contributions(r, wanted)

    # ---- committing -----------------------------------------------------------------------

    def merge(self, c: Collector, live: int) -> tuple[Commit, RoundRecord]:
        """The commit of ``c``'s round and its record: the payloads written as they are hashed (the
        next one hashes during this write), and a capped round's roster; the record not yet."""
        self._started = self.clock.now()
        commit = c.commit(compression=self.compression, write=self.store.put_blob)
        roster = None
        if c.roster is not None:  # (a capped round: its roster is written before the record names it)
            data = encode(Roster(round=c.round, learners=c.roster))
            roster = self.store.put_payload(lambda sha: keys.roster_key(c.round, sha), data)
        rec = c.record(
            commit, closer=self.state.me, live=live, now=self._started, sync_seconds=self.last_sync, roster=roster
        )
        return commit, rec

    def write(self, commit: Commit, rec: RoundRecord) -> RoundRecord | None:
        """Write the commit's record ``rec``; returns the round's record as it landed: ours
        (``rec``), another closer's written first (the node follows theirs), or None where theirs
        does not decode (the listing will find it and report it)."""
        s = self.state
        data = self.store.encode_record(rec)
        outcome, existing = self.store.put_encoded(keys.round_key(rec.round), data)
        self.last_sync = self.clock.now() - self._started
        if outcome is CreateOutcome.TAKEN:
            try:
                return self.store.decode_record(existing, RoundRecord, keys.round_key(rec.round))
            except RecordInvalid:
                return None
        s.stats.committed += 1
        self.merger.landed(rec.fragment, rec.version)
        for x in rec.rejected:
            if x.reason == "outlier":  # the others were reported as they were judged
                s.stats.reject("outlier")
                self.emit(ev.ContributionRejected(s.me, rec.round, x.learner, x.reason))
        self.emit(
            ev.RoundClosed(
                s.me,
                rec.round,
                rec.fragment,
                tuple(p.learner for p in rec.participants),
                tuple((x.learner, x.reason) for x in rec.rejected),
                rec.cosine,
                rec.grace_seconds,
            )
        )
        written = sum(commit.sizes.values())
        self.emit(ev.Committed(s.me, rec.round, rec.fragment, rec.version, written))
        s.collector = None
        if self.recheck_after:
            self.written[rec.round] = (data, [self.clock.now() + d for d in self.recheck_after])
        return rec

    # ---- the records written --------------------------------------------------------------

    def recheck(self) -> None:
        """Read back each of this node's records that is due (one GET per time in ``recheck_after``):
        one that no longer holds the bytes written (truncated or altered in the store: no follower
        can get past it, and nobody else holds its bytes) is replaced by the same bytes, in one write
        where the store replaces objects (else deleted and created again)."""
        now = self.clock.now()
        for r, (data, due) in list(self.written.items()):
            if due[0] > now:
                continue
            key = keys.round_key(r)
            found = self.store.mailbox.get(key)
            if found != data:
                why = "missing" if found is None else f"{len(found)} bytes that are not the {len(data)} written"
                if not write_stream(self.store.mailbox, key, [data]):
                    self.store.delete([key])
                    if self.store.put_encoded(key, data)[0] is CreateOutcome.TAKEN:
                        raise ProtocolError(
                            f"{key}: another node wrote round {r}'s record while this node replaced its damaged "
                            "copy; restart this node (it joins from the tape as it is)"
                        )
                self.emit(ev.RecordRepaired(self.state.me, r, key, f"it read back {why}"))
            if len(due) > 1:
                self.written[r] = (data, due[1:])
            else:
                del self.written[r]
