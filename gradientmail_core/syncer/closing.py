"""Closing a round this node claimed: recover the fragment's outer state, judge snapshots as
they arrive, decide when the round may close, write the commit (payloads, then the record)."""

from __future__ import annotations

import numpy as np

from .. import events as ev
from ..errors import RecordInvalid
from ..mailbox import CreateOutcome
from ..protocol import keys
from ..protocol.records import RoundRecord
from ..protocol.schedule import fragment_of, gap
from .closer import IGNORED, Collector, compute_commit
from .following import Following
from .fragment import FragmentState
from .replay import recover
from .timing import Estimates


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
            r, self.run, state, self.clock.now(), Estimates.from_record(self.newest_of_head()), closer=self.closer
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
        """Judge the round's new snapshots and close it when due. True if this node committed it."""
        for learner in sorted(self.snapshot_keys.get(c.round, set()) - set(c.judged)):
            j = c.judge_snapshot(
                self.store, learner, own=self.own_snapshots.get(c.round) if learner == self.me else None
            )
            if j.reason is not None and j.reason != IGNORED:
                self.stats.rejected[j.reason] = self.stats.rejected.get(j.reason, 0) + 1
                self.emit(ev.ContributionRejected(self.me, c.round, learner, j.reason))
        live = self.liveness.live()
        cfg = self.run.cfg
        had_quorum = c.quorum_at is not None
        assert cfg.in_flight is not None
        close = c.update(
            live,
            self.clock.now(),
            quorum_size=cfg.quorum_size,
            gap=gap(c.round, cfg.sync_every, self.run.P),
            in_flight=cfg.in_flight,
            overlap_steps=cfg.overlap_steps,
        )
        if not had_quorum and c.quorum_at is not None:
            self.emit(ev.QuorumReached(self.me, c.round, len(c.accepted()), c.quorum_at - c.opened_at))
        return close and self._close(c, len(live))

    def _close(self, c: Collector, live: int) -> bool:
        """Write the commit of ``c``'s round. True if ours is the record; False if another
        closer's record was there first (then we follow theirs)."""
        t0 = self.clock.now()
        # The payloads are written as they are hashed (the next one hashes during this write).
        commit = compute_commit(
            c,
            closer=self.me,
            live=live,
            compression=self.opts.compression,
            sync_seconds=self._last_sync,
            now=t0,
            write=self.store.put_blob,
        )
        written = sum(len(data) for data in commit.payloads.values())
        rec = commit.record
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
