"""Closing a round this node claimed: recover the fragment's outer state, judge snapshots as
they arrive, decide when the round may close, write the commit (payloads, then the record)."""

from __future__ import annotations

import numpy as np

from .. import events as ev
from ..errors import RecordInvalid
from ..mailbox import CreateOutcome
from ..protocol import keys
from ..protocol.records import RoundRecord, Snapshot, chunk_refs
from ..protocol.schedule import draw, fragment_of, gap
from .collector import IGNORED, Collector
from .commit import FragmentState
from .following import Following
from .replay import recover
from .timing import Estimates

# The most payload bytes a closer fetches ahead at once for one batch of drawn contributions (the
# rest are streamed as they are judged, as without a cap).
PREFETCH_BYTES = 256 << 20


class Closing(Following):
    next_claimed: int | None = None  # the round after the one committing, if this node claimed it

    def _claim_next(self, r: int) -> bool:
        """Claim round ``r`` (the next) before committing ``r - 1``: ``election`` does it."""
        return False

    def _become_closer(self, r: int) -> None:
        if r != self.head + 1:
            return
        state = self._fragment_state(fragment_of(r, self.run.P))
        self.collector = Collector(
            r, self.run, state, self.clock.now(), Estimates.from_record(self.newest_of_head()), merger=self.closer
        )
        self.follow = None

    def _fragment_state(self, f: int) -> FragmentState:
        """The closer's state of fragment ``f`` at its newest record (or the init): held from this
        node's own commit, or recovered from its checkpoint and the rounds after it
        (``replay.py``). Missing payloads mean this node's view is stale (paused after its
        listing, the run committed meanwhile and collected them): ``MailboxUnavailable``, catch up
        next poll."""
        return recover(self.closer, self.store, self.run, f, self.newest.get(f), self.thetas.get(f))

    def _collect(self, c: Collector) -> bool:
        """Judge the round's new snapshots and close it when due. True if this node committed it.

        With ``max_contributions`` (a fleet of any size) nothing is read as it arrives: the
        quorum counts the snapshot records listed, and once the round may close the closer reads
        only the drawn ones (``_judge_drawn``)."""
        cfg = self.run.cfg
        cap = cfg.max_contributions
        reported = self.snapshot_keys.get(c.round, set())
        if cap is None:
            for learner in sorted(reported - set(c.judged)):
                self._judge(c, learner)
        live = self.liveness.live()
        # (with a cap only live learners' names count: objects under names nobody holds a lease
        # for must not hurry the round closed; a drawn one of them is judged like any other)
        counted = None if cap is None else reported & live
        had_quorum = c.quorum_at is not None
        assert cfg.in_flight is not None
        close = c.update(
            live,
            self.clock.now(),
            quorum_size=cfg.quorum_size,
            gap=gap(c.round, cfg.sync_every, self.run.P),
            in_flight=cfg.in_flight,
            overlap_steps=cfg.overlap_steps,
            reported=counted,
        )
        if not had_quorum and c.quorum_at is not None:
            n = len(c.accepted()) if counted is None else len(counted)
            self.emit(ev.QuorumReached(self.me, c.round, n, c.quorum_at - c.opened_at))
        if close and cap is not None:
            close = self._judge_drawn(c, cap, reported)
        return close and self._close(c, len(live))

    def _judge(self, c: Collector, learner: str) -> None:
        j = c.judge_snapshot(self.store, learner, own=self.own_snapshots.get(c.round) if learner == self.me else None)
        if j.reason is not None and j.reason != IGNORED:
            self.stats.rejected[j.reason] = self.stats.rejected.get(j.reason, 0) + 1
            self.emit(ev.ContributionRejected(self.me, c.round, learner, j.reason))

    def _judge_drawn(self, c: Collector, cap: int, reported: set[str]) -> bool:
        """Judge the reported snapshots in the order of the round's draw (``schedule.draw``: a hash
        of the run, the round and the learner, which no learner's speed or data sways) until
        ``cap`` are accepted; each batch's records, then payloads, are fetched together. A rejected
        one is replaced by the next in the draw, so only rejections make this node read more than
        ``cap`` contributions. The draw is taken again at every attempt (a commit that failed is
        retried on a later poll, when lower draws may have been listed): judgements past the
        ``cap``-th accepted are dropped. True if the round may close (at least one accepted)."""
        run_id = self.run.manifest.run_id
        order = sorted(reported | set(c.judged), key=lambda lr: (draw(run_id, c.round, lr), lr))

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
            return True
        c.retry_unreadable()
        return False

    def _prefetch_snapshots(self, r: int, learners: list[str]) -> None:
        """Fetch these learners' snapshot records of round ``r`` together, then their payloads
        (those the records place in the learner's own folder, up to ``PREFETCH_BYTES``), so that a
        batch costs the store's round trip about twice, not twice per contribution. A sharded
        node's ranks read their own chunks: only the records are fetched ahead there."""
        own = r in self.own_snapshots
        wanted = {lr: keys.snapshot_key(r, lr) for lr in learners if not (own and lr == self.me)}
        self.store.prefetch(list(wanted.values()))
        if self.bridge.closer is not None:
            return
        payloads, budget = [], PREFETCH_BYTES
        for learner, key in wanted.items():
            try:
                snap = self.store.decode_record(self.store.peek(key), Snapshot, key)
            except (RecordInvalid, ValueError):
                continue  # (judged as it is read: corrupt, unsigned or missing)
            for x in chunk_refs(snap.payload):
                if keys.in_snapshot_folder(x.key, x.sha256, r, learner) and x.size <= budget:
                    payloads.append(x.key)
                    budget -= x.size
        self.store.prefetch(payloads)

    def _close(self, c: Collector, live: int) -> bool:
        """Write the commit of ``c``'s round. True if ours is the record; False if another
        closer's record was there first (then we follow theirs)."""
        t0 = self.clock.now()
        # The payloads are written as they are hashed (the next one hashes during this write).
        commit = c.commit(compression=self.opts.compression, write=self.store.put_blob)
        written = sum(commit.sizes.values())
        rec = c.record(commit, closer=self.me, live=live, now=t0, sync_seconds=self._last_sync)
        self.next_claimed = c.round + 1 if self._claim_next(c.round + 1) else None
        outcome, existing = self.store.put_record(keys.round_key(c.round), rec)
        self._last_sync = self.clock.now() - t0
        if outcome is CreateOutcome.TAKEN:
            try:
                theirs = self.store.decode_record(existing, RoundRecord, keys.round_key(c.round))
            except RecordInvalid:
                return False  # the listing will find the record and report it
            self._take(theirs)  # (a payload that reads back damaged: _advance retries it)
            return False
        self.stats.committed += 1
        self.closer.landed(rec.fragment, rec.version)
        for x in rec.rejected:
            if x.reason == "outlier":  # the others were reported as they were judged
                self.stats.rejected["outlier"] = self.stats.rejected.get("outlier", 0) + 1
                self.emit(ev.ContributionRejected(self.me, rec.round, x.learner, x.reason))
        self.emit(
            ev.RoundClosed(
                self.me,
                rec.round,
                rec.fragment,
                tuple(p.learner for p in rec.participants),
                tuple((x.learner, x.reason) for x in rec.rejected),
                rec.cosine,
                rec.grace_seconds,
            )
        )
        self.emit(ev.Committed(self.me, rec.round, rec.fragment, rec.version, written))
        self.collector = None
        self._on_record(rec, commit.theta)
        return True

    def _on_record(self, rec: RoundRecord, theta: dict[str, np.ndarray] | None, *, lent: bool = False) -> None:
        super()._on_record(rec, theta, lent=lent)
        # Round ``rec.round`` is committed (by this node or another: a round this node was
        # closing is abandoned then): the contribution chunks spooled for it are no longer needed.
        self.spool.drop_through(rec.round)
