"""The closer's arithmetic and bookkeeping for one round: judge snapshots, decide when the
round may close, and compute the commit (merge, outer step, payloads). No I/O here except
through the ``RunStore`` handed in; the node orchestrates when each step happens."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ..aggregators.acceptance import PayloadStatus, judge, outlier_mask_of_norms
from ..aggregators.fused import memo_norms, norm_of, sq_norms
from ..aggregators.merge import contribution_weight, mean_pairwise_cosine, merge_with_cosine
from ..aggregators.outer import final_step_tensor, outer_step_tensor
from ..codec.chunked import fragment_streams
from ..codec.stream import PayloadStream
from ..errors import MissingExtra, PayloadCorrupt, PayloadLayoutMismatch, RecordInvalid
from ..protocol import keys
from ..protocol.members import SignatureInvalid
from ..protocol.rebuild import cast
from ..protocol.rebuild import rebuild_theta as rebuild_theta  # (these two lived here; still imported from here)
from ..protocol.rebuild import theta_digest as theta_digest
from ..protocol.records import (
    Participant,
    PayloadRef,
    Rejection,
    RoundRecord,
    Snapshot,
    chunk_refs,
    digest_of,
    join_refs,
    ref_digest,
)
from ..protocol.run import RunInfo, payload_cap
from ..protocol.schedule import fragment_of, nominal_step, version_before
from ..protocol.store import RunStore
from .spool import Spool
from .timing import ema, grace_seconds

T = TypeVar("T")
IGNORED = "ignored"  # a snapshot no member signed: judged once, in no record


@dataclass
class FragmentState:
    """What a closer needs of one fragment: the version, the published parameters, the fp32
    outer state (master parameters and Nesterov momentum), and the version of the fragment's
    newest checkpoint (``checkpoint_every``; 0: the initial parameters)."""

    version: int
    theta: dict[str, np.ndarray]
    master: dict[str, np.ndarray]
    momentum: dict[str, np.ndarray]
    checkpoint: int = 0

    @classmethod
    def initial(cls, theta: dict[str, np.ndarray]) -> FragmentState:
        return cls(
            0,
            theta,
            {n: v.astype(np.float32, copy=False) for n, v in theta.items()},  # shared: never written in place
            {n: np.zeros_like(v, dtype=np.float32) for n, v in theta.items()},
        )


@dataclass
class Judged:
    learner: str
    reason: str | None
    snapshot: Snapshot | None = None
    delta: dict[str, np.ndarray] | None = None
    weight: float = 0.0
    # Squared norm of each tensor of an accepted delta (``merge.sq_norms``): computed as the
    # snapshot arrives, so the merge after quorum reads the delta once instead of twice. (A
    # collector that merges chunk by chunk keeps only these: ``delta`` is None, the chunks are in
    # its spool.)
    norms: dict[str, float] | None = None


@dataclass
class Estimates:
    x_step: float | None = None
    x_quorum: float | None = None
    x_sync: float | None = None

    @classmethod
    def from_record(cls, rec: RoundRecord | None) -> Estimates:
        return cls() if rec is None else cls(rec.x_step, rec.x_quorum, rec.x_sync)


@dataclass
class Collector:
    """The closer's view of one open round."""

    round: int
    run: RunInfo
    state: FragmentState
    opened_at: float
    estimates: Estimates
    judged: dict[str, Judged] = field(default_factory=dict)
    quorum_at: float | None = None
    grace: float = 0.0
    # The arrays the commit writes the new master and momentum into (``reserve``).
    reserved: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
    # Judge and merge chunk by chunk (``streamed.py``; None: when the fragment is more than one
    # chunk of a chunked run, ``streamed.chunk_by_chunk``), keeping the contributions' chunks in
    # ``spool`` (the node's; None: one of this collector's own) and reading them through ``store``
    # (the one the snapshots were judged from).
    streamed: bool | None = None
    spool: Spool | None = None
    store: RunStore | None = None
    # A sharded node's closer (``sharded/closing.ShardCloser``): its ranks judge and commit.
    sharded: Any = None

    @property
    def by_chunks(self) -> bool:
        """Does this collector judge and merge chunk by chunk (``streamed``, decided on first use)?"""
        if self.streamed is None:
            from .streamed import chunk_by_chunk

            self.streamed = chunk_by_chunk(self.run, self.fragment)
        if self.streamed and self.spool is None:
            self.spool = Spool()
        return self.streamed

    @property
    def fragment(self) -> int:
        return fragment_of(self.round, self.run.P)

    def accepted(self) -> list[Judged]:
        return [j for j in self.judged.values() if j.reason is None]

    def judge_snapshot(
        self, store: RunStore, learner: str, *, own: tuple[Snapshot, dict[str, np.ndarray] | None] | None = None
    ) -> Judged:
        """Fetch and judge ``learner``'s snapshot for this round (SPEC 3.6).

        ``own``: the closer's own snapshot and its payload decoded as it wrote it: judged the same
        way without reading them back (two GETs and a download of the payload fewer per round).
        Its payload None: its chunks are in the spool (a chunk-by-chunk collector reads them there).
        """
        key = keys.snapshot_key(self.round, learner)
        try:
            snap = own[0] if own is not None else store.read_record(key, Snapshot)
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
        expected = self.run.shapes[self.fragment]
        base = version_before(self.round, self.run.P)
        payload: dict[str, np.ndarray] | None = None
        status: PayloadStatus = "ok"
        if self.by_chunks:
            return self._judge_by_chunks(store, learner, snap, base)
        if snap.steps > 0 and snap.schema_digest == self.run.digest and snap.base_version == base:
            if not _in_snapshot_blobs(snap, self.round, learner):
                status = "corrupt"  # checked before any read: the ref may name any object
            else:
                # A delta holds the fragment's tensors in the run's delta dtypes: intact bytes of
                # other names, shapes or dtypes are ``schema``; broken bytes are ``corrupt``.
                dtypes = self.run.delta_dtypes(self.fragment)
                try:
                    cap = payload_cap(self.run, self.fragment)
                    if own is not None and own[1] is not None:
                        payload = own[1]  # decoded with these shapes, dtypes and cap (``publishing``)
                    else:
                        payload = store.get_payload(
                            snap.payload, expected, max_bytes=cap, dtypes=dtypes, chunk_elements=self.run.chunk_elements
                        )
                    status = "ok" if payload is not None else "missing"
                except PayloadLayoutMismatch:
                    status = "schema"
                except (PayloadCorrupt, MissingExtra):  # MissingExtra: a zstd payload, zstandard absent
                    status = "corrupt"
        reason = judge(snap.steps, snap.schema_digest == self.run.digest, snap.base_version, base, payload, status)
        weight = contribution_weight(snap.tokens, snap.steps) if reason is None and snap.steps else 0.0
        if reason is None and not weight > 0:
            reason = "zero_steps"
        if reason is not None or payload is None:
            return self._record(Judged(learner, reason, snap, None, weight))
        self.reserve()
        return self._record(Judged(learner, reason, snap, payload, weight, sq_norms(payload)))

    def _judge_by_chunks(self, store: RunStore, learner: str, snap: Snapshot, base: int) -> Judged:
        """``judge_snapshot``'s payload checks, chunk by chunk (``streamed.judge_payload``): the
        same reasons in the same order, each tensor's squared norm the same bits; the chunks of
        an accepted snapshot stay in the spool for the merge."""
        from .streamed import judge_payload

        self.store = store
        status: PayloadStatus = "ok"
        finite, norms = True, None
        if snap.steps > 0 and snap.schema_digest == self.run.digest and snap.base_version == base:
            if not _in_snapshot_blobs(snap, self.round, learner):
                status = "corrupt"
            else:
                judging = judge_payload if self.sharded is None else self.sharded.judge
                verdict = judging(store, self.spool, self.run, self.fragment, snap.payload, self.round)
                status, finite, norms = verdict.status, verdict.finite, verdict.norms
        ok = status == "ok" and norms is not None
        reason = judge(
            snap.steps, snap.schema_digest == self.run.digest, snap.base_version, base, {} if ok else None, status
        )
        if reason is None and not finite:
            reason = "nonfinite"
        weight = contribution_weight(snap.tokens, snap.steps) if reason is None and snap.steps else 0.0
        if reason is None and not weight > 0:
            reason = "zero_steps"
        if reason is not None or not ok:
            self._forget(snap)
            return self._record(Judged(learner, reason, snap, None, weight))
        self.reserve()
        return self._record(Judged(learner, reason, snap, None, weight, norms))

    def _forget(self, snap: Snapshot) -> None:
        """Drop a rejected snapshot's chunks from the spool (those no accepted one shares)."""
        if self.spool is None:
            return
        keep = {r.sha256 for j in self.accepted() if j.snapshot is not None for r in chunk_refs(j.snapshot.payload)}
        for r in chunk_refs(snap.payload):
            if r.sha256 not in keep:
                self.spool.discard(r.sha256)

    def reserve(self) -> None:
        """Allocate the arrays the commit will write the new master and momentum into, and touch
        every page of them now: with the first accepted snapshot, so that the page faults of
        8 bytes per parameter of fresh memory are paid while snapshots arrive, not after quorum."""
        if self.reserved is None:
            master, momentum = {}, {}
            for n, v in self.state.master.items():
                master[n], momentum[n] = np.empty(v.shape, np.float32), np.empty(v.shape, np.float32)
                master[n].fill(0)
                momentum[n].fill(0)
            self.reserved = master, momentum

    def reject_outliers(self, factor: float) -> None:
        """Reject (reason ``outlier``) accepted deltas whose norm is over ``factor`` times the median
        norm of the others (``merge.outlier_mask``). The smallest one is never an outlier."""
        accepted = sorted(self.accepted(), key=lambda j: j.learner)
        if len(accepted) < 2:
            return
        # The whole-fragment norms, from each tensor's squared norm computed when judged: what
        # ``outlier_mask`` computes from the deltas (a chunk-by-chunk collector holds none).
        mask = outlier_mask_of_norms([norm_of(j.norms or {}) for j in accepted], factor=factor)
        for j, outlier in zip(accepted, mask, strict=True):
            if outlier:
                j.reason, j.delta, j.weight, j.norms = "outlier", None, 0.0, None
                if j.snapshot is not None and self.by_chunks:
                    self._forget(j.snapshot)

    def _record(self, j: Judged) -> Judged:
        self.judged[j.learner] = j
        return j

    def update(
        self, live: set[str], now: float, *, quorum_size: int, gap: int, in_flight: int, overlap_steps: int | None
    ) -> bool:
        """Advance the quorum and grace state; True when the round should close now."""
        n_ok = len(self.accepted())
        all_reported = live <= set(self.judged)
        if all_reported and n_ok == 0:
            # Every live learner reported and none was accepted: nothing else can close the
            # round. A payload rejected as corrupt or missing may only have been read back
            # damaged in transit, so judge those again on the next poll.
            for learner in [lr for lr, j in self.judged.items() if j.reason in ("corrupt", "missing")]:
                del self.judged[learner]
        if self.quorum_at is None and (n_ok >= quorum_size or (all_reported and n_ok >= 1)):
            self.quorum_at = now
            e = self.estimates
            self.grace = grace_seconds(
                x_step=e.x_step,
                x_quorum=e.x_quorum,
                x_sync=e.x_sync,
                gap=gap,
                in_flight=in_flight,
                overlap_steps=overlap_steps,
            )
        if self.quorum_at is None:
            return False
        return all_reported or now - self.quorum_at >= self.grace


@dataclass(frozen=True)
class Written:
    """A payload handed to ``write`` and let go (a chunk-by-chunk commit keeps no stream, whose
    inputs would stay alive with it): its size and sha256."""

    size: int
    sha256: str

    def __len__(self) -> int:
        return self.size


@dataclass
class Commit:
    record: RoundRecord
    state: FragmentState
    # key -> bytes, written before the record (with ``write``: the stream it wrote, or ``Written``)
    payloads: dict[str, bytes | PayloadStream | Written]


def compute_commit(
    c: Collector,
    *,
    closer: str,
    live: int,
    compression: str,
    sync_seconds: float | None,
    now: float,
    write: Callable[[str, bytes | PayloadStream], object] | None = None,
    outliers: bool = True,
) -> Commit:
    """Merge the accepted deltas, take the outer step, and build the payloads and record.

    Deterministic: contributions are merged in learner-id order, so a closer that
    recomputes the round after a crash writes the same parameter bytes.

    ``write(key, stream)``, if given, is called for each payload (theta, outer, then the change: a
    fixed order, on the calling thread) as soon as its sha256 is known, while the payloads after
    it are still being hashed on worker threads; the record is built once all are written. The
    payloads are ``PayloadStream``s, produced again piece by piece as they are written: no
    joined copy of one is held (without ``write``, ``payloads`` holds their bytes).

    A version that is no checkpoint (``checkpoint_every``, ``schedule.is_checkpoint``) writes the
    change only; its record carries the sha256 of the theta and outer payloads it did not write
    and the contributions' payloads, so a recovering closer replays it (``replay.py``, which calls
    this with the recorded participants and ``outliers=False``: the record lists them after that).

    A collector that judged chunk by chunk (``c.by_chunks``) commits chunk by chunk
    (``streamed.commit_by_chunks``), the same bytes.
    """
    if c.by_chunks:
        from .streamed import commit_by_chunks

        return commit_by_chunks(
            c,
            closer=closer,
            live=live,
            compression=compression,
            sync_seconds=sync_seconds,
            now=now,
            write=write,
            outliers=outliers,
        )
    run, cfg, f = c.run, c.run.cfg, c.fragment
    # The contributions' norms were computed as they were judged; the merge, the cosine and the
    # outlier check share them.
    known = [(j.delta[n], v) for j in c.accepted() if j.delta is not None and j.norms for n, v in j.norms.items()]
    with memo_norms(known):
        if outliers and cfg.outlier_factor is not None:
            c.reject_outliers(cfg.outlier_factor)
        accepted = sorted(c.accepted(), key=lambda j: j.learner)
        assert accepted, "a round closes with at least one accepted snapshot"
        deltas = [j.delta for j in accepted if j.delta is not None]
        weights = [j.weight for j in accepted]
        st = c.state
        final = all(j.snapshot is not None and j.snapshot.final for j in accepted)
        new_master: dict[str, np.ndarray] = {}
        new_momentum: dict[str, np.ndarray] = {}
        # Taken, not borrowed: they become the new state, so a second attempt at this commit (after
        # a failed write) must not write into them again.
        out, c.reserved = c.reserved, None

        def step(name: str, d: np.ndarray, scale: np.float32 | None) -> None:
            # The outer step takes each merged tensor as the merge finishes it (one buffer, reused).
            if final:
                o = None if out is None else out[0][name]
                new_master[name] = final_step_tensor(st.master[name], d, scale=scale, out=o, name=name)
            else:
                new_master[name], new_momentum[name] = outer_step_tensor(
                    st.master[name],
                    st.momentum[name],
                    d,
                    lr=cfg.outer_lr,
                    beta=cfg.outer_momentum,
                    scale=scale,
                    out=None if out is None else (out[0][name], out[1][name]),
                    name=name,
                )

        # A large fragment's cosine (only the record needs it) is summed on a worker while the
        # payloads are encoded, hashed and written; a small one's in the merge's pass.
        threaded = run.fragment_bytes(f) >= _THREADED_BYTES
        _, cosine = merge_with_cosine(
            deltas, weights, cfg.merge, clip_norm=cfg.clip_norm, cosine=not threaded, each=step
        )
    assert set(new_master) == set(st.master), "the merge and the outer state must name the same tensors"
    master = {n: new_master[n] for n in st.master}
    momentum = st.momentum if final else {n: new_momentum[n] for n in st.master}
    dtypes = run.fragment_dtypes(f)
    checkpoint = run.checkpoint_due(f, st.version + 1, final=final, participants=len(accepted))
    shapes, chunk_elements = run.shapes[f], run.chunk_elements
    # Each payload's hash pass is a job on a worker thread (sha256 and zstd overlap each other and
    # the writes, which release the GIL); written in a fixed order. A payload is the chunks of its
    # plan (one, for a fragment of at most ``chunk_elements``: the whole payload), each a stream.
    with _Jobs(threaded=threaded) as jobs:

        def chunks(values: dict[str, np.ndarray], shp: Mapping[str, tuple[int, ...]], dt: Any, kind: str, zip: str):
            return jobs.payload(
                lambda: [s for _, s in fragment_streams(values, shp, dt, chunk_elements, kind=kind, compression=zip)]
            )

        change_job = None
        if cfg.commit_dtype is not None:
            diff = {n: np.subtract(master[n], st.theta[n], dtype=np.float32) for n in master}
            change_job = chunks(diff, shapes, cfg.commit_dtype, "change", compression)
            # Publish exactly what a learner rebuilds from the change; the fp32 master keeps the
            # rounding error, so it is fed back into the next round's change.
            theta = rebuild_theta(run, f, st.theta, cast(diff, dict.fromkeys(diff, cfg.commit_dtype)))
        else:
            theta = cast(master, dtypes)
        plain_job = chunks(theta, shapes, dtypes, "theta", "")
        theta_job = (
            None
            if not checkpoint
            else plain_job
            if compression == ""
            else chunks(theta, shapes, dtypes, "theta", compression)
        )
        outer = {f"momentum/{n}": v for n, v in momentum.items()}
        if not run.master_is_theta(f):  # else theta is the master, byte for byte: not written twice
            outer.update({f"master/{n}": v for n, v in master.items()})
        # Between checkpoints the outer payload is only hashed (uncompressed), for ``outer_digest``.
        outer_zip = compression if checkpoint else ""
        outer_job = chunks(outer, run.outer_shapes(f), "F32", "outer", outer_zip)
        cosine_job = jobs.submit(lambda: _cosine(known, deltas)) if threaded else None
        payloads: dict[str, bytes | PayloadStream | Written] = {}
        refs = {}
        for kind, job in (("theta", theta_job), ("outer", outer_job if checkpoint else None), ("change", change_job)):
            if job is None:
                continue
            parts = []
            for data in job():
                k = keys.round_blob_key(c.round, kind, data.sha256, compression)
                parts.append(PayloadRef(key=k, sha256=data.sha256, size=len(data)))
                if write is not None:
                    write(k, data)
                payloads[k] = data if write is not None else data.read()
            refs[kind] = join_refs(parts)
        theta_digest = digest_of([s.sha256 for s in plain_job()])
        outer_digest = None if checkpoint else digest_of([s.sha256 for s in outer_job()])
        if cosine_job is not None:
            cosine = cosine_job()
    record = commit_record(
        c,
        accepted,
        refs,
        theta_digest=theta_digest,
        outer_digest=outer_digest,
        cosine=cosine,
        final=final,
        checkpoint=checkpoint,
        closer=closer,
        live=live,
        now=now,
        sync_seconds=sync_seconds,
    )
    version = st.version + 1
    state = FragmentState(version, theta, master, momentum, version if checkpoint else st.checkpoint)
    return Commit(record, state, payloads)


def commit_record(
    c: Collector,
    accepted: list[Judged],
    refs: Mapping[str, PayloadRef],
    *,
    theta_digest: str,
    outer_digest: str | None,
    cosine: float | None,
    final: bool,
    checkpoint: bool,
    closer: str,
    live: int,
    now: float,
    sync_seconds: float | None,
) -> RoundRecord:
    """The round record of a commit (both closers': whole fragments here, chunk by chunk in
    ``streamed.py``): the participants, the rejections, the payloads' refs and digests, the timings."""
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
        theta=refs.get("theta"),
        theta_digest=theta_digest,
        outer=refs.get("outer"),
        change=refs.get("change"),
        cosine=cosine,
        final=final,
        live=live,
        quorum_seconds=round(max(c.quorum_at - c.opened_at, 0.0), 6),
        # The grace realized (quorum to close, as the prior art records it), and the one planned.
        grace_seconds=round(max(now - c.quorum_at, 0.0), 6),
        grace_planned=round(c.grace, 6),
        x_step=x_step,
        x_quorum=x_quorum,
        x_sync=x_sync,
        checkpoint=None if checkpoint else st.checkpoint,
        outer_digest=outer_digest,
        contributions=None if checkpoint else [j.snapshot.payload for j in accepted if j.snapshot is not None],
    )


# A fragment at least this large encodes and hashes its commit payloads on worker threads; a
# smaller one (a simulation's, a test's) inline, without starting threads.
_THREADED_BYTES = 8 << 20


class _Jobs:
    """A commit's jobs (payloads to encode and hash, the cosine), on worker threads or inline."""

    def __init__(self, *, threaded: bool) -> None:
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gradientmail-commit") if threaded else None

    def __enter__(self) -> _Jobs:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, fn: Callable[[], T]) -> Callable[[], T]:
        """Start ``fn``; returns a function that waits for its result."""
        if self._pool is None:
            done = fn()
            return lambda: done
        return self._pool.submit(fn).result

    def payload(self, encode: Callable[[], list[PayloadStream]]) -> Callable[[], list[PayloadStream]]:
        """Start ``encode`` (the hash pass of each of a payload's chunks); returns a function
        waiting for the chunks' streams (their ``sha256`` known)."""
        return self.submit(encode)


def _cosine(known: list[tuple[np.ndarray, float]], deltas: list[dict[str, np.ndarray]]) -> float | None:
    with memo_norms(known):  # the memo is per thread: a worker is handed the known norms
        return mean_pairwise_cosine(deltas)


def _in_snapshot_blobs(snap: Snapshot, r: int, learner: str) -> bool:
    """A snapshot may only point into its own blob folder (so GC can find it, and nobody can
    make a closer read another learner's or a round's payload)."""
    for ref in chunk_refs(snap.payload):
        parsed = keys.parse_blob_key(ref.key)
        ok = parsed is not None and parsed.kind == "snapshot" and parsed.round == r and parsed.learner == learner
        if not ok or parsed is None or parsed.sha != ref.sha256:
            return False
    return True
