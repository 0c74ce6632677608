"""The background half of a learner: one ``tick()`` polls the mailbox once and does what
is due (upload contributions, renew the lease, follow the tape, align, close or take
over rounds, collect garbage).

A tick is single-threaded and reads time only from the injected clock, so a simulation
drives many nodes deterministically by calling ``tick()`` in a seeded order. The session
runs ticks on a background thread.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import events as ev
from ..clock import Clock
from ..codec.payload import encode_payload, encode_quantized
from ..errors import MailboxUnavailable, PayloadCorrupt, ProtocolError, RecordInvalid
from ..mailbox import CreateOutcome, create_once
from ..protocol import keys
from ..protocol.lease import LeaseWriter, Liveness
from ..protocol.records import Claim, RoundRecord, Snapshot
from ..protocol.run import RunInfo, fetch_theta, newest_records, payload_cap
from ..protocol.schedule import gap
from ..protocol.store import RunStore
from .bridge import Bridge, CommitNotice, Publish, View
from .closer import Collector, Estimates, FragmentState, compute_commit, rebuild_theta, theta_digest


@dataclass(frozen=True)
class NodeOptions:
    poll_interval: float = 1.0
    lease_timeout: float = 120.0
    round_timeout: float = 60.0  # floor of the follower's no-record timeout
    compression: str = ""

    @property
    def lease_interval(self) -> float:
        return self.lease_timeout / 4

    @property
    def lease_list_interval(self) -> float:
        return min(self.lease_timeout / 4, 5 * self.poll_interval)

    @property
    def claim_wait(self) -> float:
        # How long an open round may stay unclaimed before anyone claims it: the node that
        # committed the previous round normally claims it within one of its own polls.
        return max(3 * self.poll_interval, self.lease_timeout / 8)


@dataclass
class _Follow:
    round: int
    opened_at: float
    claim: Claim | None = None
    claim_seen_at: float = 0.0
    claims_listed_at: float = float("-inf")
    timer_from: float | None = None


@dataclass
class NodeStats:
    committed: int = 0
    takeovers: int = 0
    superseded: int = 0
    published: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


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
    ) -> None:
        self.store, self.clock, self.run, self.me, self.nonce = store, clock, run, learner, nonce
        self.emit, self.opts = emit, options
        self.bridge = bridge or Bridge()
        self.rng = rng or random.Random(0)
        self.lease = LeaseWriter(store, clock, learner, nonce, options.lease_interval)
        self.liveness = Liveness(clock, options.lease_timeout, learner)
        self.head = -1
        self.newest: dict[int, RoundRecord] = {}
        self.thetas: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        self.closer_states: dict[int, FragmentState] = {}
        self.collector: Collector | None = None
        self.follow: _Follow | None = None
        self.snapshot_keys: dict[int, set[str]] = {}
        # This node's snapshots of rounds not yet committed, as written: its own contribution is
        # judged from them when it closes the round, instead of being read back from the store.
        self.own_snapshots: dict[int, tuple[Snapshot, bytes]] = {}
        self.rounds_seen = 0
        self.stats = NodeStats()
        self._last_sync: float | None = None
        self.stuck: str | None = None

    # ---- joining ----------------------------------------------------------------------

    def join(self, *, created: bool) -> dict[int, dict[str, np.ndarray]]:
        """Take a lease, read the tape and the newest parameters of every fragment."""
        try:
            return self._join(created)
        except PayloadCorrupt as e:  # a payload damaged in transit: transient, like any failed read
            raise MailboxUnavailable(f"{e}; retry joining") from e

    def _join(self, created: bool) -> dict[int, dict[str, np.ndarray]]:
        self.lease.acquire(poll=self.opts.poll_interval)
        self._list_leases()
        for _ in range(5):
            round_keys = [k for k in self.store.mailbox.list(keys.ROUNDS) if keys.parse_round_key(k) is not None]
            recs = newest_records(self.store, self.run, round_keys)
            thetas = {f: fetch_theta(self.store, self.run, f, recs.get(f)) for f in range(self.run.P)}
            # A payload gone while we read means the run committed 2P more rounds meanwhile (GC
            # keeps 2P): newer records exist, read the tape again.
            if all(t is not None for t in thetas.values()):
                break
        for f, theta in thetas.items():
            if theta is None:
                raise ProtocolError(f"the newest parameters of fragment {f} are missing from the mailbox")
            version = recs[f].version if f in recs else 0
            self.thetas[f] = (version, theta)
        self.newest = recs
        self.head = max((r.round for r in recs.values()), default=-1)
        if created:
            self._try_claim(0, 1, previous=None, reason=None)
        self._publish_view()
        self.emit(ev.Joined(self.me, self.head, created, len(self.liveness.live())))
        return {f: t for f, (_, t) in self.thetas.items()}

    def leave(self) -> None:
        self.lease.release()
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
        if self.clock.now() - self.liveness.listed_at >= self.opts.lease_list_interval:
            self._list_leases()
        after = keys.round_key(self.head) if self.head >= 0 else keys.ROUNDS
        listing = self.store.mailbox.list("", after=after)
        round_keys = [k for k in listing if k.startswith(keys.ROUNDS)]
        self.snapshot_keys = {}
        for k in listing:
            parsed = keys.parse_snapshot_key(k)
            if parsed is not None:
                self.snapshot_keys.setdefault(parsed[0], set()).add(parsed[1])
        if self._advance(round_keys):
            self._drive_round()  # never for a round the listing shows committed but we could not read yet
        self._publish_view()

    def _list_leases(self) -> None:
        self.liveness.observe(self.store.mailbox.list(keys.LEASES))

    def _publish_view(self) -> None:
        quorum = self.run.cfg.quorum_size
        others = frozenset(r for r, ls in self.snapshot_keys.items() if r > self.head and len(ls - {self.me}) >= quorum)
        closer_of = self.collector.round if self.collector else None
        view = View(self.head, others, len(self.liveness.live()), self.rounds_seen, closer_of)
        with self.bridge.lock:
            self.bridge.view = view

    # ---- contributing -----------------------------------------------------------------

    def _publish_pending(self) -> None:
        while True:
            with self.bridge.lock:
                if not self.bridge.outbox:
                    return
                pub = self.bridge.outbox[0]
            self._publish(pub)
            with self.bridge.lock:
                self.bridge.outbox.popleft()

    def _publish(self, pub: Publish) -> None:
        if pub.round <= self.head:
            self.emit(ev.Skipped(self.me, pub.round, "round already committed"))
            return
        cfg, compression = self.run.cfg, self.opts.compression
        f = pub.fragment
        dtypes = (
            dict.fromkeys(self.run.fragments[f], cfg.delta_dtype) if cfg.delta_dtype else self.run.fragment_dtypes(f)
        )
        if pub.captured is not None:  # the delta is computed and quantized on the device
            data = encode_quantized(pub.captured.encode(dtypes), kind="delta", compression=compression)
        else:
            delta = {n: np.subtract(pub.anchor[n], pub.local[n], dtype=np.float32) for n in pub.local}
            data = encode_payload(delta, dtypes, kind="delta", compression=compression)
        ref = self.store.put_payload(lambda sha: keys.snapshot_blob_key(pub.round, self.me, sha, compression), data)
        snap = Snapshot(
            learner=self.me,
            round=pub.round,
            local_step=pub.local_step,
            steps=pub.steps,
            tokens=pub.tokens,
            base_version=pub.base_version,
            step_seconds=max(pub.step_seconds, 0.0),
            schema_digest=self.run.digest,
            payload=ref,
            final=pub.final,
            nonce=self.nonce,
        )
        outcome, _ = self.store.put_record(keys.snapshot_key(pub.round, self.me), snap)
        if outcome is CreateOutcome.TAKEN:
            self.emit(ev.Skipped(self.me, pub.round, "this learner id already contributed to the round"))
            return
        self.stats.published += 1
        if outcome is CreateOutcome.CREATED:  # known to be what the store holds (not a retry's read-back)
            self.own_snapshots[pub.round] = (snap, data)
        self.snapshot_keys.setdefault(pub.round, set()).add(self.me)
        self.emit(ev.Published(self.me, pub.round, pub.fragment, pub.steps, pub.tokens, len(data), pub.final))

    # ---- following the tape -----------------------------------------------------------

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
            try:
                theta = self._fetch_commit(rec)
            except PayloadCorrupt as e:
                # A committed payload that reads back wrong is a transport fault: retry next poll.
                self.emit(ev.StoreFailure(self.me, f"round {r}: {e}"))
                return False
            self._on_record(rec, theta)
        return True

    def _check_record(self, rec: RoundRecord | None, r: int) -> str | None:
        if rec is None:
            return f"round {r} record is unreadable"
        P = self.run.P
        if rec.round != r or rec.fragment != r % P or rec.version != r // P + 1 or rec.theta is None:
            return f"round {r} record is inconsistent with the schedule"
        if rec.round > self.head + 1 and self.head >= 0 and rec.round - self.head <= P:
            return f"round {r} record arrived before round {self.head + 1}"
        return None

    def _fetch_commit(self, rec: RoundRecord) -> dict[str, np.ndarray] | None:
        f = rec.fragment
        prev = self.thetas.get(f)
        cap = payload_cap(self.run, f)
        if rec.change is not None and prev is not None and prev[0] == rec.version - 1:
            change = self.store.get_payload(rec.change, self.run.shapes[f], max_bytes=cap)
            if change is not None:
                theta = rebuild_theta(self.run, f, prev[1], change)
                if theta_digest(self.run, f, theta) == rec.theta_digest:
                    return theta
        assert rec.theta is not None
        return self.store.get_payload(rec.theta, self.run.shapes[f], max_bytes=cap)

    def _on_record(self, rec: RoundRecord, theta: dict[str, np.ndarray] | None) -> None:
        f = rec.fragment
        c = self.collector
        if c is not None and c.round == rec.round:
            if rec.closer != self.me:
                self.stats.superseded += 1
                self.emit(ev.Superseded(self.me, rec.round, rec.closer))
            self.collector = None
        self.newest[f] = rec
        self.head = rec.round
        self.rounds_seen += 1
        self.follow = None
        for r in [r for r in self.own_snapshots if r <= rec.round]:
            del self.own_snapshots[r]
        if theta is None:
            return  # pruned already: a newer record of this fragment is on the tape
        self.thetas[f] = (rec.version, theta)
        pipeline = self.bridge.pipeline  # moves the theta to the device here, off the training thread
        self.bridge.inbox.put(
            CommitNotice(
                rec.round,
                f,
                rec.version,
                theta,
                rec.theta.size if rec.theta else 0,
                tuple(p.learner for p in rec.participants),
                rec.cosine,
                staged=pipeline.stage(theta) if pipeline is not None else None,
            )
        )

    # ---- electing and closing ---------------------------------------------------------

    def _drive_round(self) -> None:
        r = self.head + 1
        if self.collector is not None and self.collector.round != r:
            self.collector = None
        if self.collector is not None:
            self._collect(self.collector)
        else:
            self._follow(r)

    def _list_claims(self, r: int) -> Claim | None:
        claim_keys = [k for k in self.store.mailbox.list(keys.claims_prefix(r)) if keys.parse_claim_key(k)]
        for k in reversed(claim_keys):
            claim = self.store.try_record(k, Claim)
            parsed = keys.parse_claim_key(k)
            if claim is not None and parsed is not None and (claim.round, claim.n) == parsed:
                return claim
        return None

    def _follow(self, r: int) -> None:
        now = self.clock.now()
        fo = self.follow
        if fo is None or fo.round != r:
            fo = self.follow = _Follow(r, now)
        n_snaps = len(self.snapshot_keys.get(r, ()))
        need = min(self.run.cfg.quorum_size, max(len(self.liveness.live()), 1))
        if fo.timer_from is None and n_snaps >= need:
            fo.timer_from = now
        if fo.claim is None:
            if now - fo.claims_listed_at >= self.opts.claim_wait / 3:
                fo.claims_listed_at = now
                fo.claim = self._list_claims(r)
                fo.claim_seen_at = now
            if fo.claim is None:
                if now - fo.opened_at >= self.opts.claim_wait:
                    self._try_claim(r, 1, previous=None, reason="unclaimed")
                return
        claim = fo.claim
        if claim.learner == self.me:
            self._become_closer(r)
            return
        reason = None
        if self.liveness.listed_at > float("-inf") and not self.liveness.is_live(claim.learner):
            reason = "lease_lost"
        elif fo.timer_from is not None and now - max(fo.timer_from, fo.claim_seen_at) >= self._round_timeout():
            reason = "timeout"
        if reason is None:
            return
        latest = self._list_claims(r)
        if latest is not None and latest.n != claim.n:
            fo.claim, fo.claim_seen_at = latest, now
            return
        self._try_claim(r, claim.n + 1, previous=claim.learner, reason=reason)

    def _round_timeout(self) -> float:
        rec = self.newest.get(self.head % self.run.P) if self.head >= 0 else None
        predicted = 0.0 if rec is None else (rec.x_sync or 0.0) + rec.grace_seconds + (rec.x_quorum or 0.0)
        return max(self.opts.round_timeout, 4 * predicted)

    def _try_claim(self, r: int, n: int, *, previous: str | None, reason: str | None) -> None:
        if n > keys.MAX_CLAIM:
            raise ProtocolError(f"round {r} has been taken over {keys.MAX_CLAIM} times; the run cannot elect a closer")
        claim = Claim(round=r, n=n, learner=self.me, nonce=self.nonce)
        outcome, existing = self.store.put_record(keys.claim_key(r, n), claim)
        if outcome is CreateOutcome.TAKEN:
            fo = self.follow
            if fo is not None and fo.round == r:
                try:
                    fo.claim = self.store.decode_record(existing, Claim, keys.claim_key(r, n))
                except RecordInvalid:
                    fo.claim = None
                fo.claim_seen_at = self.clock.now()
            return
        self.emit(ev.RoundClaimed(self.me, r, n))
        if previous is not None or reason == "unclaimed":
            self.stats.takeovers += 1
            self.emit(ev.TookOver(self.me, r, previous or "", reason or "unclaimed"))
        self._become_closer(r)

    def _become_closer(self, r: int) -> None:
        if r != self.head + 1:
            return
        f = r % self.run.P
        state = self._fragment_state(f)
        self.collector = Collector(
            r,
            self.run,
            state,
            self.clock.now(),
            Estimates.from_record(self.newest.get(self.head % self.run.P) if self.head >= 0 else None),
        )
        self.follow = None

    def _fragment_state(self, f: int) -> FragmentState:
        """Recover the closer's state of fragment ``f`` from its newest record (or the init)."""
        rec = self.newest.get(f)
        version = rec.version if rec else 0
        cached = self.closer_states.get(f)
        if cached is not None and cached.version == version:
            return cached
        theta = fetch_theta(self.store, self.run, f, rec)
        # Missing payloads mean this node's view is stale (paused after its listing, the run
        # committed 2P rounds meanwhile and collected them): transient, catch up next poll.
        if theta is None:
            raise MailboxUnavailable(f"fragment {f}: the parameters of version {version} are gone; newer commits exist")
        if rec is None:
            state = FragmentState.initial(theta)
        else:
            assert rec.outer is not None
            shapes = self.run.outer_shapes(f)
            outer = self.store.get_payload(rec.outer, shapes, max_bytes=3 * payload_cap(self.run, f))
            if outer is None:
                raise MailboxUnavailable(
                    f"fragment {f}: the outer state of round {rec.round} is gone; newer commits exist"
                )
            state = FragmentState(version, theta, *self.run.split_outer(f, outer, theta))
        self.closer_states[f] = state
        return state

    def _collect(self, c: Collector) -> None:
        for learner in sorted(self.snapshot_keys.get(c.round, set()) - set(c.judged)):
            j = c.judge_snapshot(
                self.store, learner, own=self.own_snapshots.get(c.round) if learner == self.me else None
            )
            if j.reason is not None:
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
        if close:
            self._close(c, len(live))

    def _close(self, c: Collector, live: int) -> None:
        t0 = self.clock.now()

        def write(key: str, data: bytes) -> None:
            outcome, _ = create_once(self.store.mailbox, key, data)
            if outcome is CreateOutcome.TAKEN:
                raise PayloadCorrupt(f"{key}: holds different bytes than its sha256 name says")

        # The payloads are written as they are hashed (the next one hashes during this write).
        commit = compute_commit(
            c,
            closer=self.me,
            live=live,
            compression=self.opts.compression,
            sync_seconds=self._last_sync,
            now=t0,
            write=write,
        )
        written = sum(len(data) for data in commit.payloads.values())
        rec = commit.record
        outcome, existing = self.store.put_record(keys.round_key(c.round), rec)
        self._last_sync = self.clock.now() - t0
        if outcome is CreateOutcome.TAKEN:
            try:
                theirs = self.store.decode_record(existing, RoundRecord, keys.round_key(c.round))
            except RecordInvalid:
                return  # the listing will find the record and report it
            try:
                theta = self._fetch_commit(theirs)
            except PayloadCorrupt:
                return  # as above: _advance reports it and retries
            self._on_record(theirs, theta)
            return
        self.stats.committed += 1
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
        self.closer_states[rec.fragment] = commit.state
        self.collector = None
        self._on_record(rec, commit.state.theta)
        self._try_claim(c.round + 1, 1, previous=None, reason=None)
        self._collect_garbage(c.round)

    def _collect_garbage(self, r: int) -> None:
        """After committing r: snapshots and their payloads of rounds <= r, claims of rounds
        <= r, round payloads of rounds <= r - 2P, and leases abandoned long ago."""
        mb = self.store.mailbox
        doomed = [keys.snapshot_key(rr, lr) for rr, ls in self.snapshot_keys.items() if rr <= r for lr in ls]
        for k in mb.list(keys.SNAPSHOT_BLOBS):
            b = keys.parse_blob_key(k)
            if b is None or (b.round is not None and b.round <= r):
                doomed.append(k)
        for k in mb.list(keys.CLAIMS):
            parsed = keys.parse_claim_key(k)
            if parsed is None or parsed[0] <= r:
                doomed.append(k)
        cutoff = r - 2 * self.run.P
        if cutoff >= 0:
            for k in mb.list(keys.ROUND_BLOBS):
                b = keys.parse_blob_key(k)
                if b is not None and b.round is not None and b.round <= cutoff:
                    doomed.append(k)
        doomed += self.liveness.abandoned()
        if doomed:
            mb.delete(doomed)
        for rr in [rr for rr in self.snapshot_keys if rr <= r]:
            del self.snapshot_keys[rr]

    def view(self) -> View:
        with self.bridge.lock:
            return self.bridge.view
