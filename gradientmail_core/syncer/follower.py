"""Following the tape: read each new round record in order, screen it (``CommitScreen``), fetch its
parameters (by the node's placement) and hand them to the training thread (``on_record``, the one
place where a round is taken as committed)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np

from .. import events as ev
from ..clock import Clock, SystemClock
from ..errors import PayloadCorrupt, RecordDamaged
from ..protocol import keys
from ..protocol.records import RoundRecord, ref_size
from ..protocol.run import RunInfo
from ..protocol.store import RunStore
from ..protocol.tape import newest_claim, schedule_problem
from .bridge import Bridge, CommitNotice
from .placement import Placement
from .state import NodeState
from .verify import UNVERIFIABLE, VERIFIED, RoundVerifier

Theta = dict[str, np.ndarray]


class CommitScreen:
    """Checks a share of the commits a node follows before its learner sees them
    (``Session(verify=fraction)``, ``verify.RoundVerifier``; ``docs/security.md``, "Verifying
    commits", says what is refused and applied, and what it does to liveness). A verified commit's
    parameters are the recomputed ones (nothing more is downloaded for them); a refused one stays
    on the tape, and the learner keeps the fragment's parameters of the last commit it applied."""

    def __init__(
        self,
        store: RunStore,
        run: RunInfo,
        emit: Callable[[ev.Event], None],
        *,
        me: str,
        fraction: float,
        rng: random.Random,
    ) -> None:
        self.emit, self.me, self.fraction = emit, me, fraction
        # The commits recomputed before they are applied, on a merger of the verifier's own.
        self.verifier = RoundVerifier(store, run, keep=fraction >= 1.0) if fraction > 0 else None
        # (drawn only when verifying: the node's draws are otherwise what they were)
        self.rng = random.Random(rng.getrandbits(64) if self.verifier is not None else 0)
        self.distrusted: dict[str, int] = {}  # closer -> the round of its commit found forged

    @property
    def verifies(self) -> bool:
        return self.verifier is not None

    def screen(self, rec: RoundRecord, theta: tuple[int, Theta | None] | None) -> tuple[str | None, Theta | None]:
        """Whether to apply ``rec`` (``theta``: the fragment's newest parameters this node holds):
        ``(why not, None)``, or ``(None, its parameters when this node verified them, else None)``."""
        if rec.closer == self.me:
            return None, None
        forged = self.distrusted.get(rec.closer)
        if forged is not None:
            return f"{rec.closer} committed round {forged}, which is not the merge of its inputs", None
        if self.verifier is None or self.rng.random() >= self.fraction:
            return None, None
        check = self.verifier.check(rec, theta=theta)
        if check.status == VERIFIED:
            self.emit(ev.RoundVerified(self.me, rec.round, rec.fragment, rec.closer))
            return None, check.theta
        if check.status == UNVERIFIABLE:
            self.emit(ev.RoundUnverifiable(self.me, rec.round, rec.fragment, rec.closer, check.reason))
            return None, None
        self.distrusted[rec.closer] = rec.round
        self.emit(ev.ForgedCommit(self.me, rec.round, rec.fragment, rec.closer, check.reason, check.evidence))
        return f"not the merge of its recorded inputs: {check.reason}", None

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()


class Follower:
    def __init__(
        self,
        store: RunStore,
        state: NodeState,
        placement: Placement,
        bridge: Bridge,
        screen: CommitScreen,
        emit: Callable[[ev.Event], None],
        clock: Clock | None = None,
        damaged_after: float = math.inf,
    ) -> None:
        """``damaged_after``: how long the next round's record may stay on the tape without reading
        back as a commit before this node stops (``RecordDamaged``): its writer had the time to write
        it again (``Closing.recheck``)."""
        self.store, self.state, self.placement, self.bridge = store, state, placement, bridge
        self.screen, self.emit = screen, emit
        self.clock, self.damaged_after = clock or SystemClock(), damaged_after
        self.merger = placement.merger
        self.stuck: str | None = None  # why the next record cannot be followed (reported once)
        self.stuck_since: tuple[int, float] | None = None  # (round, since when) its record is damaged

    def advance(self, round_keys: list[str]) -> bool:
        """Follow the listed records in order; False if one could not be read yet (retried next poll)."""
        s = self.state
        rounds = sorted({r for k in round_keys if (r := keys.parse_round_key(k)) is not None and r > s.head})
        # Commits are contiguous (round r commits after r-1, and records are never deleted), so an
        # object past a gap is no commit: stray or hostile, it must not push the real ones out.
        rounds = [r for i, r in enumerate(rounds) if r == s.head + 1 + i]
        if len(rounds) >= 2 * s.run.P:
            # Far behind (or just joined): only the newest record of each fragment matters. (Fewer
            # than 2P behind, every record is followed: skipping fewer would leave the first kept
            # one within P of the head, which _check_record refuses as out of order, for good.)
            skipped, rounds = rounds[: -s.run.P], rounds[-s.run.P :]
            # Whether this node's newest contribution of each fragment was merged, where its round is
            # skipped (at most one read per fragment): the learner carries only what came after it.
            for r in s.uploaded.values():
                if r in skipped and (rec := self.store.try_record(keys.round_key(r), RoundRecord)) is not None:
                    self._note_landed(rec)
            c = s.collector
            if c is not None and c.round in skipped:
                # We were closing a round that someone else committed while we stalled.
                rec = self.store.try_record(keys.round_key(c.round), RoundRecord)
                self._closed_by(c.round, rec.closer if rec else None)
        for r in rounds:
            rec = self.store.try_record(keys.round_key(r), RoundRecord)
            problem = self._check_record(rec, r)
            if problem:
                if self.stuck != problem:
                    self.stuck = problem
                    self.emit(ev.IgnoredObject(s.me, keys.round_key(r), problem))
                if r == s.head + 1:
                    self._damaged(r, problem)
                return False
            self.stuck_since = None
            assert rec is not None
            if not self.take(rec, lend=True):
                return False
        return True

    def _damaged(self, r: int, problem: str) -> None:
        """Round ``r``'s record, the next on the tape, is there but is no commit: past the bound,
        ``RecordDamaged``, naming the key, who claimed the round, and the remedy."""
        now = self.clock.now()
        if self.stuck_since is None or self.stuck_since[0] != r:
            self.stuck_since = (r, now)
            return
        waited = now - self.stuck_since[1]
        if waited < self.damaged_after:
            return
        key = keys.round_key(r)
        claim, after = newest_claim(self.store, r), newest_claim(self.store, r + 1)
        writer = (  # (a round's claims are collected once it commits; its closer claimed the next first)
            f"its closer {claim.learner}"
            if claim is not None
            else f"its closer ({after.learner}, probably: it claimed round {r + 1})"
            if after is not None
            else "the node that closed it"
        )
        raise RecordDamaged(
            f"{key} does not read back as the commit of round {r} ({problem}) and {writer} has not written "
            f"it again in {waited:.0f} s: no node can follow the tape past it. If {writer} still runs, it "
            "rewrites the record when it reads it back; otherwise restore the object from a copy of the "
            f"bucket, or, where no node ever applied round {r}, delete {key} so the round is closed again "
            f"from its contributions (`gradientmail status URL` says which); then restart this node"
        )

    def take(self, rec: RoundRecord, *, lend: bool = False) -> bool:
        """Follow another node's commit ``rec``: screened first (``CommitScreen``), its parameters
        fetched (unless verifying made them), handed to the learner (``lend``: without keeping
        them, when ``lends``). False when a payload read back damaged (a transport fault: the
        caller retries on the next poll)."""
        s = self.state
        refused, theta = self.screen.screen(rec, s.thetas.get(rec.fragment))
        if refused is not None:
            self._refuse(rec, refused)
            return True
        if theta is None:
            try:
                theta = self.placement.fetch_commit(rec, s.thetas.get(rec.fragment))
            except PayloadCorrupt as e:
                self.emit(ev.StoreFailure(s.me, f"round {rec.round}: {e}"))
                return False
        self.on_record(rec, theta, lent=lend and theta is not None and self.lends())
        return True

    def _refuse(self, rec: RoundRecord, reason: str) -> None:
        """Follow ``rec`` on the tape without applying it: the learner hears that the round is over
        (it waits for it no longer) and keeps the fragment's parameters of the last commit it
        applied; this node keeps those too (``thetas``)."""
        s = self.state
        self.on_record(rec, None)
        self.emit(ev.CommitRefused(s.me, rec.round, rec.fragment, rec.closer, reason))
        if s.role != "syncer":
            self.bridge.inbox.put(CommitNotice(rec.round, rec.fragment, rec.version, {}, refused=True))

    def _check_record(self, rec: RoundRecord | None, r: int) -> str | None:
        s = self.state
        problem = schedule_problem(rec, r, s.run.P)
        if problem is None and s.head >= 0 and r > s.head + 1 and r - s.head <= s.run.P:
            return f"round {r} record arrived before round {s.head + 1}"
        return problem

    def _closed_by(self, r: int, closer: str | None) -> None:
        """Round ``r``, the one this node was closing, is committed (by ``closer``; None: unknown):
        it is abandoned, and reported superseded unless it was this node's own commit."""
        s = self.state
        if closer != s.me:
            s.stats.superseded += 1
            self.emit(ev.Superseded(s.me, r, closer or "?"))
        s.collector = None

    def on_record(self, rec: RoundRecord, theta: Theta | None, *, lent: bool = False) -> None:
        """Round ``rec.round`` is committed (by this node or another): follow it. ``theta``: its
        parameters (None: not applied, or pruned already); ``lent``: they go to the training
        thread, not kept (``lends``)."""
        s, f = self.state, rec.fragment
        c = s.collector
        if c is not None and c.round == rec.round:
            self._closed_by(rec.round, rec.closer)
        s.newest[f] = rec
        s.head = rec.round
        self._note_landed(rec)
        # Another node committed this fragment: the outer state held for it is stale (twice the
        # fragment in fp32). Elected again, the node reloads it from the newest record.
        self.merger.forget(f, unless=rec.version)
        s.rounds_seen += 1
        for r in [r for r in s.own_snapshots if r <= rec.round]:
            del s.own_snapshots[r]
        if theta is not None:
            self._hand_over(rec, theta, lent)
        # A round this node was closing is abandoned then: the contribution chunks spooled for it
        # are no longer needed.
        self.merger.spool.drop_through(rec.round)

    def _note_landed(self, rec: RoundRecord) -> None:
        s = self.state
        if rec.round > s.landed.get(rec.fragment, -1) and any(p.learner == s.me for p in rec.participants):
            s.landed[rec.fragment] = rec.round

    def _hand_over(self, rec: RoundRecord, theta: Theta, lent: bool) -> None:
        s, f = self.state, rec.fragment
        s.thetas[f] = (rec.version, None if lent else theta)
        if s.role == "syncer":
            return  # no training thread: nothing would ever drain the inbox
        self.bridge.inbox.put(
            CommitNotice(
                rec.round,
                f,
                rec.version,
                theta,
                ref_size(rec.theta) if rec.theta else 0,
                tuple(p.learner for p in rec.participants),
                rec.cosine,
                incoming=self.placement.incoming(f, rec, theta),
                landed=s.landed.get(f),
                lent=lent,
            )
        )

    def lends(self) -> bool:
        """Whether a commit's parameters go to the training thread without this node keeping them
        (``CommitNotice.lent``): its learner turns anchors into deltas in place (``Bridge.lend``),
        no commit is rebuilt from the previous parameters (``commit_dtype=None``: no change
        payloads), and this node closes nothing now (no outer state to share them with). A follower
        then holds one copy of the model, the learner's anchors; elected, it reads them back."""
        return (
            self.bridge.lend
            and not self.screen.verifies  # (a verified commit's parameters are the verifier's state)
            and self.state.run.cfg.commit_dtype is None
            and self.state.collector is None
            and not self.merger.holds_any()
        )
