"""Following the tape: read each new round record in order, fetch its parameters (rebuilt from
the quantized change when possible) and hand them to the training thread."""

from __future__ import annotations

import numpy as np

from .. import events as ev
from ..errors import PayloadCorrupt
from ..protocol import keys
from ..protocol.rebuild import rebuild_theta, theta_digest
from ..protocol.records import RoundRecord, ref_size
from ..protocol.run import payload_cap
from ..protocol.tape import fetch_theta, schedule_problem
from .bridge import CommitNotice
from .verifying import Verifying


class Following(Verifying):
    def _advance(self, round_keys: list[str]) -> bool:
        """Follow the listed records in order; False if one could not be read yet (retried next poll)."""
        rounds = sorted({r for k in round_keys if (r := keys.parse_round_key(k)) is not None and r > self.head})
        # Commits are contiguous (round r commits after r-1, and records are never deleted), so an
        # object past a gap is no commit: stray or hostile, it must not push the real ones out.
        rounds = [r for i, r in enumerate(rounds) if r == self.head + 1 + i]
        if len(rounds) >= 2 * self.run.P:
            # Far behind (or just joined): only the newest record of each fragment matters. (Fewer
            # than 2P behind, every record is followed: skipping fewer would leave the first kept
            # one within P of the head, which _check_record refuses as out of order, for good.)
            skipped, rounds = rounds[: -self.run.P], rounds[-self.run.P :]
            c = self.collector
            if c is not None and c.round in skipped:
                # We were closing a round that someone else committed while we stalled.
                rec = self.store.try_record(keys.round_key(c.round), RoundRecord)
                if rec is None or rec.closer != self.me:
                    self.stats.superseded += 1
                    self.emit(ev.Superseded(self.me, c.round, rec.closer if rec else "?"))
                self.collector = None
        for r in rounds:
            rec = self.store.try_record(keys.round_key(r), RoundRecord)
            problem = self._check_record(rec, r)
            if problem:
                if self.stuck != problem:
                    self.stuck = problem
                    self.emit(ev.IgnoredObject(self.me, keys.round_key(r), problem))
                return False
            assert rec is not None
            if self.bridge.follow is not None:  # a sharded node: its ranks fetch their own chunks
                self._on_record(rec, {})
                continue
            if not self._take(rec, lend=True):
                return False
        return True

    def _take(self, rec: RoundRecord, *, lend: bool = False) -> bool:
        """Follow another node's commit ``rec``: checked first when this node verifies
        (``verifying.py``), its parameters fetched (unless verifying made them), handed to the
        learner (``lend``: without keeping them, when ``lends``). False when a payload read back
        damaged (a transport fault: the caller retries on the next poll)."""
        refused, theta = self._screen(rec)
        if refused is not None:
            self._refuse(rec, refused)
            return True
        if theta is None:
            try:
                theta = self._fetch_commit(rec)
            except PayloadCorrupt as e:
                self.emit(ev.StoreFailure(self.me, f"round {rec.round}: {e}"))
                return False
        self._on_record(rec, theta, lent=lend and theta is not None and self.lends())
        return True

    def _refuse(self, rec: RoundRecord, reason: str) -> None:
        """Follow ``rec`` on the tape without applying it: the learner hears that the round is over
        (it waits for it no longer) and keeps the fragment's parameters of the last commit it
        applied; this node keeps those too (``thetas``)."""
        self._on_record(rec, None)
        self.emit(ev.CommitRefused(self.me, rec.round, rec.fragment, rec.closer, reason))
        if self.role != "syncer":
            self.bridge.inbox.put(CommitNotice(rec.round, rec.fragment, rec.version, {}, refused=True))

    def _check_record(self, rec: RoundRecord | None, r: int) -> str | None:
        problem = schedule_problem(rec, r, self.run.P)
        if problem is None and self.head >= 0 and r > self.head + 1 and r - self.head <= self.run.P:
            return f"round {r} record arrived before round {self.head + 1}"
        return problem

    def _fetch_commit(self, rec: RoundRecord) -> dict[str, np.ndarray] | None:
        f = rec.fragment
        prev = self.thetas.get(f)
        cap = payload_cap(self.run, f)
        if rec.change is not None and prev is not None and prev[1] is not None and prev[0] == rec.version - 1:
            change = self.store.get_payload(
                rec.change, self.run.shapes[f], max_bytes=cap, chunk_elements=self.run.chunk_elements
            )
            if change is not None:
                theta = rebuild_theta(self.run, f, prev[1], change)
                if theta_digest(self.run, f, theta) == rec.theta_digest:
                    return theta
        return fetch_theta(self.store, self.run, f, rec)  # (between checkpoints: rebuilt from the checkpoint)

    def _on_record(self, rec: RoundRecord, theta: dict[str, np.ndarray] | None, *, lent: bool = False) -> None:
        """Follow ``rec``; ``lent``: ``theta`` goes to the training thread, not kept (``lends``)."""
        f = rec.fragment
        c = self.collector
        if c is not None and c.round == rec.round:
            if rec.closer != self.me:
                self.stats.superseded += 1
                self.emit(ev.Superseded(self.me, rec.round, rec.closer))
            self.collector = None
        self.newest[f] = rec
        self.head = rec.round
        # Another node committed this fragment: the outer state held for it is stale (twice the
        # fragment in fp32). Elected again, the node reloads it from the newest record.
        self.closer.forget(f, unless=rec.version)
        self.rounds_seen += 1
        self.follow = None
        for r in [r for r in self.own_snapshots if r <= rec.round]:
            del self.own_snapshots[r]
        if theta is None:
            return  # pruned already: a newer record of this fragment is on the tape
        self.thetas[f] = (rec.version, None if lent else theta)
        if self.role == "syncer":
            return  # no training thread: nothing would ever drain the inbox
        stage = self.bridge.stage  # e.g. moves the theta to the device here, off the training thread
        follow = self.bridge.follow
        self.bridge.inbox.put(
            CommitNotice(
                rec.round,
                f,
                rec.version,
                theta,
                ref_size(rec.theta) if rec.theta else 0,
                tuple(p.learner for p in rec.participants),
                rec.cosine,
                incoming=follow(f, rec) if follow is not None else stage(theta) if stage is not None else None,
                lent=lent,
            )
        )
