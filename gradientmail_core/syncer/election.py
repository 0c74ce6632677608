"""Election and takeover: who closes the open round (``docs/protocol.md`` section 4, steps 12 to 15).

A follower watches the open round's newest claim (``Watch``) and claims the next number when the
holder's lease lapses (``lease_lost``; ``left`` when the holder released its lease, leaving cleanly),
the round overruns what past rounds predict (``timeout``), or nobody claims it (``unclaimed``). A
learner-only node never claims: it reports when no node that may close is live (``NoCloser``) and
when one is back (``CloserBack``). ``Election`` writes claims and never closes a round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import events as ev
from ..clock import Clock
from ..errors import ProtocolError, RecordInvalid
from ..mailbox import CreateOutcome
from ..protocol import keys
from ..protocol.lease import LeaseWriter
from ..protocol.records import Claim
from ..protocol.store import RunStore
from ..protocol.tape import newest_claim
from .bridge import Bridge
from .options import NodeOptions
from .state import NodeState


@dataclass
class Watch:
    """A follower's watch over the open round: who claimed it, and since when it waits."""

    round: int
    opened_at: float
    claim: Claim | None = None
    claim_seen_at: float = 0.0
    timer_from: float | None = None


class Election:
    def __init__(
        self,
        store: RunStore,
        clock: Clock,
        state: NodeState,
        lease: LeaseWriter,
        bridge: Bridge,
        emit: Callable[[ev.Event], None],
        *,
        options: NodeOptions,
        nonce: str,
    ) -> None:
        self.store, self.clock, self.state = store, clock, state
        self.lease, self.bridge, self.emit = lease, bridge, emit
        self.opts, self.nonce = options, nonce
        self.watching: Watch | None = None
        # A learner-only node that sees no live node that may close rounds: the round it waits in.
        self.closer_gone: int | None = None

    def stop_watching(self) -> None:
        """This node closes the round it watched."""
        self.watching = None

    # ---- a node that may close ------------------------------------------------------------

    def watch(self, r: int) -> bool:
        """One look at open round ``r``'s claim, taking it over when due. True if this node holds
        the claim now (it claimed it, or found its own: then it closes the round)."""
        if self.bridge.leaving:
            return False  # its rounds are committed and it is about to leave: it would close nothing
        s, now = self.state, self.clock.now()
        if self.bridge.settling and s.contributed < r:
            # Leaving, and no contribution of its own in this round: the nodes that stay close it.
            # Taken over, it would load the fragment's outer state (theta and momentum, twice the
            # fragment; a 300M-parameter follower peaked at 1.57x the model for it) only to leave.
            # A clean leaver's round (it claims r + 1 before it writes r) is the usual case.
            return False
        fo = self.watching
        if fo is None or fo.round != r:
            fo = self.watching = Watch(r, now)
        fleet = s.polls_fleet()
        if fleet:
            # No snapshot is listed: the wait counts from this node's own contribution to the round
            # (a node that trains nothing now, or a syncer, takes over on lease loss only).
            if fo.timer_from is None and s.contributed >= r:
                fo.timer_from = now
        else:
            n_snaps = len(s.snapshot_keys.get(r, ()))
            need = min(s.run.cfg.quorum_size, max(len(s.liveness.live()), 1))
            if fo.timer_from is None and n_snaps >= need:
                fo.timer_from = now
        if fo.claim is None:
            fo.claim = newest_claim(self.store, r)
            fo.claim_seen_at = now
            if fo.claim is None:
                return self.try_claim(r, 1, previous=None, reason="unclaimed")
        claim = fo.claim
        if claim.learner == s.me:
            return True
        reason = None
        if fleet:
            looked = s.liveness.looked.get(claim.learner, float("-inf"))
            if now - looked >= self.opts.lease_list_interval:
                # Only the claimant's leases: a LIST of one or two keys, whatever the fleet's size.
                s.liveness.observe_one(claim.learner, self.store.keys(keys.lease_prefix(claim.learner)))
                looked = now
            if looked >= fo.claim_seen_at and self._will_not_close(claim.learner):
                reason = self._gone(claim.learner)
        elif s.liveness.listed_at > float("-inf") and self._will_not_close(claim.learner):
            if s.liveness.listed_at < fo.claim_seen_at:
                # The leases were listed before this claim was seen: its holder may have joined
                # since (two nodes starting together: the one that created the run would take
                # round 0 over from the one that claimed it first). Judge on a newer listing.
                s.list_leases(self.store)
                return False
            if not s.snapshot_keys.get(r) and s.contributed < r:
                # Nothing to close yet (no contribution listed, none of ours): most often a clean
                # leaver's claim of the round after its last. Taken over, it would load the outer
                # state (as above) for a round nobody may contribute to again (protocol step 15).
                return False
            reason = self._gone(claim.learner)
        if (
            reason is None
            and fo.timer_from is not None
            and now - max(fo.timer_from, fo.claim_seen_at) >= self.round_timeout()
        ):
            reason = "timeout"
        if reason is None:
            return False
        latest = newest_claim(self.store, r)
        if latest is not None and latest.n != claim.n:
            fo.claim, fo.claim_seen_at = latest, now
            return False
        return self.try_claim(r, claim.n + 1, previous=claim.learner, reason=reason)

    def _will_not_close(self, holder: str) -> bool:
        """The claim's holder will not close the round: its lease lapsed, or it came back as a
        learner-only node."""
        liveness = self.state.liveness
        return not liveness.is_live(holder) or liveness.role_of(holder) == "learner"

    def _gone(self, holder: str) -> str:
        """Why a holder that will not close is taken over: ``left`` when it holds no lease at all (it
        released it, leaving cleanly), ``lease_lost`` when its lease lapsed or it only trains now."""
        return "lease_lost" if holder in self.state.liveness.seen else "left"

    def round_timeout(self) -> float:
        rec = self.state.newest_of_head()
        # The longer of the grace realized and the one planned: a round that closed early (every
        # live learner reported) must not shorten the patience with one that waits its window.
        grace = 0.0 if rec is None else max(rec.grace_seconds, rec.grace_planned or 0.0)
        predicted = 0.0 if rec is None else (rec.x_sync or 0.0) + grace + (rec.x_quorum or 0.0)
        return max(self.opts.round_timeout_floor, 4 * predicted)

    def try_claim(self, r: int, n: int, *, previous: str | None, reason: str | None) -> bool:
        """Create claim ``n`` of round ``r``; True if this node holds it."""
        s = self.state
        if not s.may_close:
            return False  # a learner-only node never claims
        if n > keys.MAX_CLAIM:
            raise ProtocolError(f"round {r} has been taken over {keys.MAX_CLAIM} times; the run cannot elect a closer")
        claim = Claim(round=r, n=n, learner=s.me, nonce=self.nonce)
        outcome, existing = self.store.put_record(keys.claim_key(r, n), claim)
        if outcome is CreateOutcome.TAKEN:
            try:
                theirs = self.store.decode_record(existing, Claim, keys.claim_key(r, n))
            except RecordInvalid:
                # Not a claim anyone can hold: the next number is the one to create.
                return self.try_claim(r, n + 1, previous=previous, reason=reason)
            fo = self.watching
            if fo is not None and fo.round == r:
                fo.claim = theirs
                fo.claim_seen_at = self.clock.now()
            return False
        self.emit(ev.RoundClaimed(s.me, r, n))
        if previous is not None or reason == "unclaimed":
            s.stats.takeovers += 1
            self.emit(ev.TookOver(s.me, r, previous or "", reason or "unclaimed"))
        fo = self.watching
        if fo is not None and fo.round == r:
            # Ours now: if opening the round fails (a transient read of the fragment's state), the
            # next poll finds this claim and retries, instead of watching the one it replaced.
            fo.claim, fo.claim_seen_at = claim, self.clock.now()
        return True

    # ---- a learner-only node ----------------------------------------------------------------

    def watch_closers(self, r: int) -> None:
        """Report when the run has no live node that may close its rounds."""
        liveness = self.state.liveness
        if liveness.listed_at == float("-inf"):
            return
        closers = liveness.closers()
        if not closers and self.closer_gone is None:
            self.closer_gone = r
            self.emit(ev.NoCloser(self.state.me, r))
            self._waiting_for_closer(True)
        elif closers and self.closer_gone is not None:
            self.closer_gone = None
            self.emit(ev.CloserBack(self.state.me, r, sorted(closers)[0]))
            self._waiting_for_closer(False)

    def _waiting_for_closer(self, waiting: bool) -> None:
        self.lease.waiting_for_closer = waiting
        self.lease.renew(local_step=self.bridge.local_step, tokens=self.bridge.tokens, force=True)
