"""A round's commit: the accepted contributions handed to the closer (``kernel.FragmentCloser``,
or a sharded node's ranks), then the round record built from what it made.

Deterministic: contributions are merged in learner-id order, so a closer that recomputes the
round after a crash writes the same parameter bytes. A version that is no checkpoint
(``checkpoint_every``) writes the change only; its record carries the digests of the parameters
and outer state it did not write and the contributions' payloads, so a recovering closer
replays it (``replay.py``, which calls this with ``outliers=False``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import MailboxUnavailable
from ..protocol.rebuild import cast, rebuild_theta, theta_digest
from ..protocol.records import Participant, Rejection, RoundRecord, chunk_refs, ref_digest
from ..protocol.schedule import nominal_step
from .collector import IGNORED, Collector, Estimates, Judged
from .fragment import Accepted, CommitOp, FragmentState, Lost, Made, Written
from .timing import ema
from .writing import Put

# (names that lived here before the closer was one; still imported from here)
__all__ = ["IGNORED", "Collector", "Commit", "Estimates", "FragmentState", "Judged", "Written", "cast"]
__all__ += ["commit_record", "compute_commit", "rebuild_theta", "theta_digest"]


@dataclass
class Commit:
    record: RoundRecord
    state: FragmentState
    # key -> its bytes (no ``write`` given) or ``Written``, in the order written, before the record
    payloads: dict[str, Any]
    # the new parameters for this node's learner (whole tensors; empty on a sharded node)
    theta: dict[str, np.ndarray] = field(default_factory=dict)


def compute_commit(
    c: Collector,
    *,
    closer: str,
    live: int,
    compression: str,
    sync_seconds: float | None,
    now: float,
    write: Put | None = None,
    outliers: bool = True,
) -> Commit:
    """Merge the accepted deltas, take the outer step, write the payloads (``write(key, stream)``,
    for each in a fixed order as soon as its sha256 is known; without it ``payloads`` holds their
    bytes), and build the record. A contribution that can no longer be read is rejected
    (``corrupt``/``missing``) and the commit given up with ``MailboxUnavailable``: the next poll
    decides again whether the round may close."""
    run, cfg = c.run, c.run.cfg
    if outliers and cfg.outlier_factor is not None:
        c.reject_outliers(cfg.outlier_factor)
    accepted = sorted(c.accepted(), key=lambda j: j.learner)
    assert accepted and c.closer is not None, "a round closes with at least one judged, accepted snapshot"
    final = all(j.snapshot is not None and j.snapshot.final for j in accepted)
    op = CommitOp(
        f=c.fragment,
        round=c.round,
        version=c.state.version,
        final=final,
        checkpoint=run.checkpoint_due(c.fragment, c.state.version + 1, final=final, participants=len(accepted)),
        compression=compression,
        accepted=tuple(
            Accepted(tuple(chunk_refs(j.snapshot.payload)), j.weight, dict(j.norms or {}))
            for j in accepted
            if j.snapshot is not None
        ),
    )
    try:
        made = c.closer.commit(op, write)
    except Lost as lost:
        j = accepted[lost.i]
        j.reason, j.weight, j.norms = lost.reason, 0.0, None
        for ref in chunk_refs(j.snapshot.payload) if j.snapshot is not None else []:
            c.closer.spool.discard(ref.sha256)
        raise MailboxUnavailable(
            f"round {c.round}: {j.learner}'s contribution can no longer be read ({lost}); rejected as "
            f"{lost.reason}, the round closes on the next poll if it still may"
        ) from lost
    record = commit_record(c, accepted, made, op, closer=closer, live=live, now=now, sync_seconds=sync_seconds)
    return Commit(record, made.state, made.payloads, made.theta)


def commit_record(
    c: Collector, accepted: list[Judged], made: Made, op: CommitOp, *, closer: str, live: int, now: float,
    sync_seconds: float | None,
) -> RoundRecord:  # fmt: skip
    """The round record of a commit: the participants, the rejections, the payloads' refs and
    digests, the timings."""
    st, run, cfg, f = c.state, c.run, c.run.cfg, c.fragment
    e = c.estimates
    steps_seconds = [
        j.snapshot.step_seconds for j in accepted if j.snapshot is not None and j.snapshot.step_seconds > 0
    ]
    x_step = ema(e.x_step, float(np.mean(steps_seconds))) if steps_seconds else e.x_step
    assert c.quorum_at is not None
    x_quorum = ema(e.x_quorum, max(c.quorum_at - c.opened_at, 0.0))
    x_sync = ema(e.x_sync, sync_seconds) if sync_seconds is not None else e.x_sync
    return RoundRecord(
        round=c.round,
        step=nominal_step(c.round, cfg.sync_every, run.P),
        fragment=f,
        version=st.version + 1,
        closer=closer,
        participants=[
            Participant(
                learner=j.learner,
                weight=j.weight,
                steps=j.snapshot.steps,
                tokens=j.snapshot.tokens,
                payload_sha256=ref_digest(j.snapshot.payload),
                final=j.snapshot.final,
            )
            for j in accepted
            if j.snapshot is not None
        ],
        rejected=[
            Rejection(learner=j.learner, reason=j.reason)
            for j in sorted(c.judged.values(), key=lambda j: j.learner)
            if j.reason is not None and j.reason != IGNORED
        ],
        theta=made.refs.get("theta"),
        theta_digest=made.theta_digest,
        outer=made.refs.get("outer"),
        change=made.refs.get("change"),
        cosine=made.cosine,
        final=op.final,
        live=live,
        quorum_seconds=round(max(c.quorum_at - c.opened_at, 0.0), 6),
        # The grace realized (quorum to close, as the prior art records it), and the one planned.
        grace_seconds=round(max(now - c.quorum_at, 0.0), 6),
        grace_planned=round(c.grace, 6),
        x_step=x_step,
        x_quorum=x_quorum,
        x_sync=x_sync,
        checkpoint=None if op.checkpoint else st.checkpoint,
        outer_digest=made.outer_digest,
        contributions=None if op.checkpoint else [j.snapshot.payload for j in accepted if j.snapshot is not None],
    )
