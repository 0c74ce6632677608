"""Election and takeover: who closes the open round.

The node that committed round r claims r + 1 at once (``claims/{r+1}/0001``). A follower watches
the open round's newest claim; it claims the next number itself when the holder's lease lapses
(``lease_lost``), when the round overruns what the past rounds predict (``timeout``), or at once
when nobody claims it (``unclaimed``: number 1, which only one node can create, so followers
racing for it and the previous closer's own late claim are safe). A node that finds a claim of its
own id (it restarted under that id) resumes closing the round.

Only nodes whose role may close (``role="both"``, the default, and syncers) take part. A
learner-only node never claims: it only watches whether any node that may close is live, and says
so once when none is (``NoCloser``, and ``waiting_for_closer`` in its lease for ``gradientmail
status``) and once when one is back (``CloserBack``).
"""

from __future__ import annotations

from .. import events as ev
from ..errors import ProtocolError, RecordInvalid
from ..mailbox import CreateOutcome
from ..protocol import keys
from ..protocol.records import Claim
from ..protocol.tape import newest_claim
from .closing import Closing
from .gc import GarbageCollection
from .state import Follow


class Election(Closing, GarbageCollection):
    def _drive_round(self) -> None:
        r = self.head + 1
        if not self.may_close:
            self._watch_closers(r)
            return
        if self.collector is not None and self.collector.round != r:
            self.collector = None
        if self.collector is None:
            self._follow(r)
        elif self._collect(self.collector):
            if self.next_claimed == r + 1:
                self._become_closer(r + 1)  # claimed before the commit landed (``_claim_next``)
            else:
                self._try_claim(r + 1, 1, previous=None, reason=None)
            self._collect_garbage(r)

    def _claim_next(self, r: int) -> bool:
        # The round after the one being committed is claimed before its record is written, so
        # no follower ever sees it unclaimed (and claims it at once) while this closer lives.
        return self._try_claim(r, 1, previous=None, reason=None)

    def _watch_closers(self, r: int) -> None:
        """A learner-only node: report when the run has no live node that may close its rounds."""
        if self.liveness.listed_at == float("-inf"):
            return
        closers = self.liveness.closers()
        if not closers and self.closer_gone is None:
            self.closer_gone = r
            self.emit(ev.NoCloser(self.me, r))
            self._waiting_for_closer(True)
        elif closers and self.closer_gone is not None:
            self.closer_gone = None
            self.emit(ev.CloserBack(self.me, r, sorted(closers)[0]))
            self._waiting_for_closer(False)

    def _waiting_for_closer(self, waiting: bool) -> None:
        self.lease.waiting_for_closer = waiting
        self.lease.renew(local_step=self.bridge.local_step, tokens=self.bridge.tokens, force=True)

    def _list_claims(self, r: int) -> Claim | None:
        return newest_claim(self.store, r)

    def _follow(self, r: int) -> None:
        if self.bridge.leaving:
            return  # its rounds are committed and it is about to leave: it would close nothing
        now = self.clock.now()
        fo = self.follow
        if fo is None or fo.round != r:
            fo = self.follow = Follow(r, now)
        fleet = self.polls_fleet()
        if fleet:
            # No snapshot is listed: the wait counts from this node's own contribution to the round
            # (a node that trains nothing now, or a syncer, takes over on lease loss only).
            if fo.timer_from is None and self.contributed >= r:
                fo.timer_from = now
        else:
            n_snaps = len(self.snapshot_keys.get(r, ()))
            need = min(self.run.cfg.quorum_size, max(len(self.liveness.live()), 1))
            if fo.timer_from is None and n_snaps >= need:
                fo.timer_from = now
        if fo.claim is None:
            fo.claims_listed_at = now
            fo.claim = self._list_claims(r)
            fo.claim_seen_at = now
            if fo.claim is None:
                self._try_claim(r, 1, previous=None, reason="unclaimed")
                return
        claim = fo.claim
        if claim.learner == self.me:
            self._become_closer(r)
            return
        reason = None
        if fleet:
            looked = self.liveness.looked.get(claim.learner, float("-inf"))
            if now - looked >= self.opts.lease_list_interval:
                # Only the claimant's leases: a LIST of one or two keys, whatever the fleet's size.
                self.liveness.observe_one(claim.learner, self.store.keys(keys.lease_prefix(claim.learner)))
                looked = now
            if looked >= fo.claim_seen_at and self._will_not_close(claim.learner):
                reason = "lease_lost"
        elif self.liveness.listed_at > float("-inf") and self._will_not_close(claim.learner):
            if self.liveness.listed_at < fo.claim_seen_at:
                # The leases were listed before this claim was seen: its holder may have joined
                # since (two nodes starting together: the one that created the run would take
                # round 0 over from the one that claimed it first). Judge on a newer listing.
                self._list_leases()
                return
            reason = "lease_lost"
        if (
            reason is None
            and fo.timer_from is not None
            and now - max(fo.timer_from, fo.claim_seen_at) >= self._round_timeout()
        ):
            reason = "timeout"
        if reason is None:
            return
        latest = self._list_claims(r)
        if latest is not None and latest.n != claim.n:
            fo.claim, fo.claim_seen_at = latest, now
            return
        self._try_claim(r, claim.n + 1, previous=claim.learner, reason=reason)

    def _will_not_close(self, holder: str) -> bool:
        """The claim's holder will not close the round: its lease lapsed, or it came back as a
        learner-only node."""
        return not self.liveness.is_live(holder) or self.liveness.role_of(holder) == "learner"

    def _round_timeout(self) -> float:
        rec = self.newest_of_head()
        # The longer of the grace realized and the one planned: a round that closed early (every
        # live learner reported) must not shorten the patience with one that waits its window.
        grace = 0.0 if rec is None else max(rec.grace_seconds, rec.grace_planned or 0.0)
        predicted = 0.0 if rec is None else (rec.x_sync or 0.0) + grace + (rec.x_quorum or 0.0)
        return max(self.opts.round_timeout, 4 * predicted)

    def _try_claim(self, r: int, n: int, *, previous: str | None, reason: str | None) -> bool:
        """Create claim ``n`` of round ``r``; True if this node holds it."""
        if not self.may_close:
            return False  # a learner-only node never claims
        if n > keys.MAX_CLAIM:
            raise ProtocolError(f"round {r} has been taken over {keys.MAX_CLAIM} times; the run cannot elect a closer")
        claim = Claim(round=r, n=n, learner=self.me, nonce=self.nonce)
        outcome, existing = self.store.put_record(keys.claim_key(r, n), claim)
        if outcome is CreateOutcome.TAKEN:
            try:
                theirs = self.store.decode_record(existing, Claim, keys.claim_key(r, n))
            except RecordInvalid:
                # Not a claim anyone can hold: the next number is the one to create.
                return self._try_claim(r, n + 1, previous=previous, reason=reason)
            fo = self.follow
            if fo is not None and fo.round == r:
                fo.claim = theirs
                fo.claim_seen_at = self.clock.now()
            return False
        self.emit(ev.RoundClaimed(self.me, r, n))
        if previous is not None or reason == "unclaimed":
            self.stats.takeovers += 1
            self.emit(ev.TookOver(self.me, r, previous or "", reason or "unclaimed"))
        fo = self.follow
        if fo is not None and fo.round == r:
            # Ours now: if becoming the closer fails (a transient read of the fragment's state),
            # the next poll finds this claim and retries, instead of watching the one it replaced.
            fo.claim, fo.claim_seen_at = claim, self.clock.now()
        self._become_closer(r)
        return True
