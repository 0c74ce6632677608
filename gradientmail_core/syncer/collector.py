"""A round this node closes, as its closer sees it (``Collector``): the snapshots judged (SPEC 3.6),
quorum, then the grace window; outliers; the commit of the accepted contributions and the round
record built from it. Contributions are merged in learner-id order, so a closer that recomputes a
round after a crash writes the same bytes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..aggregators.acceptance import PayloadStatus, judge, outlier_mask_of_norms
from ..aggregators.fused import norm_of
from ..aggregators.merge import contribution_weight
from ..errors import MailboxUnavailable, RecordInvalid
from ..protocol import keys
from ..protocol.members import SignatureInvalid
from ..protocol.records import Participant, PayloadRef, Rejection, RoundRecord, Snapshot, chunk_refs, ref_digest
from ..protocol.run import RunInfo
from ..protocol.schedule import fragment_of, gap, nominal_step, version_before
from ..protocol.store import RunStore
from .commit import Accepted, Commit, FragmentState, Lost, Put, merge_commit
from .merger import FragmentMerger
from .timing import Estimates, ema, grace_seconds

IGNORED = "ignored"  # a snapshot no member signed: judged once, in no record


@dataclass
class Judged:
    learner: str
    reason: str | None
    snapshot: Snapshot | None = None
    weight: float = 0.0
    # Squared norm of each tensor of an accepted delta (``fused.sq_norms``, bit for bit), summed as
    # the snapshot was read: the clip, outlier and cosine norms need no second read.
    norms: dict[str, float] | None = None


@dataclass
class Collector:
    """The closer's view of one open round, judged and committed on ``merger`` (the node's, which
    holds ``state``: the fragment at the version before)."""

    round: int
    run: RunInfo
    state: FragmentState
    opened_at: float
    estimates: Estimates
    merger: FragmentMerger
    judged: dict[str, Judged] = field(default_factory=dict)
    quorum_at: float | None = None
    grace: float = 0.0
    # With ``max_contributions``: the learners the draw was last taken over (``Closing._judge_drawn``).
    roster: list[str] | None = None

    @property
    def fragment(self) -> int:
        return fragment_of(self.round, self.run.P)

    def accepted(self) -> list[Judged]:
        return [j for j in self.judged.values() if j.reason is None]

    def merged(self) -> list[tuple[Judged, Snapshot]]:
        """The accepted in learner order (the merge's), each with its snapshot."""
        return [(j, j.snapshot) for j in sorted(self.accepted(), key=lambda j: j.learner) if j.snapshot is not None]

    def judge_snapshot(self, store: RunStore, learner: str, *, own: Snapshot | None = None) -> Judged:
        """Fetch and judge ``learner``'s snapshot for this round (SPEC 3.6). ``own``: the closer's
        own snapshot record (not read back; its chunks are in the closer's spool already)."""
        key = keys.snapshot_key(self.round, learner)
        try:
            snap = own if own is not None else store.read_record(key, Snapshot)
        except SignatureInvalid as e:
            # Members-only runs: not signed by a member (a copied public key, a revoked key, a
            # replay). Not a contribution at all: reported once, kept out of the record.
            store.on_ignored(key, str(e))
            return self._record(Judged(learner, IGNORED))
        except RecordInvalid:
            return self._record(Judged(learner, "corrupt"))
        if snap is None:
            return self._record(Judged(learner, "missing"))
        if snap.learner != learner or snap.round != self.round:
            return self._record(Judged(learner, "corrupt", snap))
        base = version_before(self.round, self.run.P)
        schema_ok = snap.schema_digest == self.run.digest
        status: PayloadStatus = "ok"
        finite, norms = True, None
        if snap.steps > 0 and schema_ok and snap.base_version == base:
            if not all(keys.in_snapshot_folder(x.key, x.sha256, self.round, learner) for x in chunk_refs(snap.payload)):
                status = "corrupt"  # checked before any read: the ref may name any object
            else:
                verdict = self.merger.judge(self.fragment, self.round, snap.payload)
                status, finite, norms = verdict.status, verdict.finite, verdict.norms
        ok = status == "ok" and norms is not None
        reason = judge(snap.steps, schema_ok, snap.base_version, base, {} if ok else None, status)
        if reason is None and not finite:
            reason = "nonfinite"
        weight = contribution_weight(snap.tokens, snap.steps) if reason is None and snap.steps else 0.0
        if reason is None and not weight > 0:
            reason = "zero_steps"
        if reason is not None or not ok:
            self.forget(snap)
            return self._record(Judged(learner, reason, snap, weight))
        self.merger.reserve(self.fragment)
        return self._record(Judged(learner, reason, snap, weight, norms))

    def forget(self, snap: Snapshot) -> None:
        """Drop a rejected snapshot's chunks from the spool (those no accepted one shares)."""
        spool = self.merger.spool
        keep = {r.sha256 for j in self.accepted() if j.snapshot is not None for r in chunk_refs(j.snapshot.payload)}
        for r in chunk_refs(snap.payload):
            if r.sha256 not in keep:
                spool.discard(r.sha256)

    def reject_outliers(self, factor: float) -> None:
        """Reject (reason ``outlier``) accepted deltas whose norm is over ``factor`` times the median
        norm of the others (``acceptance.outlier_mask``). The smallest one is never an outlier."""
        accepted = sorted(self.accepted(), key=lambda j: j.learner)
        if len(accepted) < 2:
            return
        mask = outlier_mask_of_norms([norm_of(j.norms or {}) for j in accepted], factor=factor)
        for j, outlier in zip(accepted, mask, strict=True):
            if outlier:
                j.reason, j.weight, j.norms = "outlier", 0.0, None
                if j.snapshot is not None:
                    self.forget(j.snapshot)

    def retry_unreadable(self) -> None:
        """Judge the snapshots rejected as corrupt or missing again on the next poll: with none
        accepted nothing else can close the round, and they may only have been read back damaged
        in transit."""
        for learner in [lr for lr, j in self.judged.items() if j.reason in ("corrupt", "missing")]:
            del self.judged[learner]

    def _record(self, j: Judged) -> Judged:
        self.judged[j.learner] = j
        return j

    def update(self, live: set[str], now: float, *, reported: set[str] | None = None) -> bool:
        """Advance the quorum and grace state; True when the round should close now. ``reported``:
        with ``max_contributions``, the learners whose snapshot records are listed, which the
        quorum counts before any is read (judged only once the round may close)."""
        quorum_size = self.run.cfg.quorum_size
        if reported is not None:
            cap = self.run.cfg.max_contributions or quorum_size
            return self._advance(now, len(reported), live <= reported, min(quorum_size, cap))
        n_ok = len(self.accepted())
        all_reported = live <= set(self.judged)
        if all_reported and n_ok == 0:
            self.retry_unreadable()  # every live learner reported, none accepted: nothing else can close it
        return self._advance(now, n_ok, all_reported, quorum_size)

    def _advance(self, now: float, n_ok: int, all_reported: bool, quorum_size: int) -> bool:
        cfg = self.run.cfg
        if self.quorum_at is None and (n_ok >= quorum_size or (all_reported and n_ok >= 1)):
            self.quorum_at = now
            assert cfg.in_flight is not None
            g = gap(self.round, cfg.sync_every, self.run.P)
            self.grace = grace_seconds(
                **asdict(self.estimates), gap=g, in_flight=cfg.in_flight, overlap_steps=cfg.overlap_steps
            )
        if self.quorum_at is None:
            return False
        return all_reported or now - self.quorum_at >= self.grace

    def commit(self, *, compression: str, write: Put | None = None) -> Commit:
        """The commit of the accepted contributions, outliers rejected first (``merge_commit``;
        payloads written with ``write``, else kept). A contribution that can no longer be read is
        rejected and the commit given up (``MailboxUnavailable``): the next poll decides again."""
        if self.run.cfg.outlier_factor is not None:
            self.reject_outliers(self.run.cfg.outlier_factor)
        merged = self.merged()
        contributions = [
            Accepted(tuple(chunk_refs(s.payload)), j.weight, dict(j.norms or {}), s.final) for j, s in merged
        ]
        try:
            return merge_commit(
                self.merger, self.state, contributions, round=self.round, compression=compression, write=write
            )
        except Lost as lost:
            j = merged[lost.i][0]
            j.reason, j.weight, j.norms = lost.reason, 0.0, None
            if j.snapshot is not None:
                self.forget(j.snapshot)
            raise MailboxUnavailable(
                f"round {self.round}: {j.learner}'s contribution can no longer be read ({lost}); rejected as "
                f"{lost.reason}, the round closes on the next poll if it still may"
            ) from lost

    def record(
        self,
        commit: Commit,
        *,
        closer: str,
        live: int,
        now: float,
        sync_seconds: float | None,
        roster: PayloadRef | None = None,
    ) -> RoundRecord:
        """The round record of ``commit`` (of this round's accepted contributions) written by
        ``closer`` at ``now``: the participants, the rejections, the payloads' refs and digests,
        the timings, and ``roster`` (a capped round's, written)."""
        st, run, cfg = self.state, self.run, self.run.cfg
        merged = self.merged()
        e = self.estimates
        steps_seconds = [s.step_seconds for _, s in merged if s.step_seconds > 0]
        x_step = ema(e.x_step, float(np.mean(steps_seconds))) if steps_seconds else e.x_step
        assert self.quorum_at is not None
        x_quorum = ema(e.x_quorum, max(self.quorum_at - self.opened_at, 0.0))
        x_sync = ema(e.x_sync, sync_seconds) if sync_seconds is not None else e.x_sync
        return RoundRecord(
            round=self.round,
            step=nominal_step(self.round, cfg.sync_every, run.P),
            fragment=self.fragment,
            version=st.version + 1,
            closer=closer,
            participants=[
                Participant(
                    learner=j.learner,
                    weight=j.weight,
                    steps=s.steps,
                    tokens=s.tokens,
                    payload_sha256=ref_digest(s.payload),
                    final=s.final,
                )
                for j, s in merged
            ],
            rejected=[
                Rejection(learner=j.learner, reason=j.reason)
                for j in sorted(self.judged.values(), key=lambda j: j.learner)
                if j.reason is not None and j.reason != IGNORED
            ],
            theta=commit.refs.get("theta"),
            theta_digest=commit.theta_digest,
            outer=commit.refs.get("outer"),
            change=commit.refs.get("change"),
            cosine=commit.cosine,
            final=commit.final,
            live=live,
            quorum_seconds=round(max(self.quorum_at - self.opened_at, 0.0), 6),
            # The grace realized (quorum to close, as the prior art records it), and the one planned.
            grace_seconds=round(max(now - self.quorum_at, 0.0), 6),
            grace_planned=round(self.grace, 6),
            x_step=x_step,
            x_quorum=x_quorum,
            x_sync=x_sync,
            checkpoint=commit.checkpoint,
            outer_digest=commit.outer_digest,
            contributions=None if commit.checkpoint is None else [s.payload for _, s in merged],
            roster=roster,
        )
