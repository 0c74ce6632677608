"""The closer, chunk by chunk: judging and committing a fragment of more than one chunk without
holding any contribution whole (``docs/protocol.md``, section 10; ``docs/sharding.md``, section 5).

A chunked run's fragment larger than one chunk (``chunk_by_chunk``) is closed here; every other
fragment by the whole-fragment code of ``closer.py``. Both commit the same bytes for the same
contributions (theta, outer state, change, the record and its digests): every quantity below is
the one ``merge.py``/``fused.py``/``outer.py`` compute, with the same float operations in the same
order, only visited a chunk at a time.

- **Judging** (``judge_payload``): each chunk of a snapshot is fetched (or found in the node's
  ``Spool``), size- and sha256-checked, checked against its place in the plan and decoded, in chunk
  order; its values are checked finite and fed to each tensor's ``leaves.StreamedDot`` (the squared
  norm ``sq_norms`` gives, bit for bit). The encoded bytes are kept in the spool as they arrive.
  The first chunk missing, damaged or of another layout decides the status, as
  ``RunStore.get_payload`` does.
- **Merging** (``commit_by_chunks``), chunk ``k`` of the plan after chunk ``k - 1``: chunk ``k``
  of every accepted contribution, in learner order, is read from the spool (hash checked again;
  downloaded again when damaged) and decoded, and each of its pieces is added into the merged
  chunk (``fused.merge_into``: ``_merge_range``'s operations) and into the cosine's unit-vector sum
  (``fused.cosine_into``); then the outer step (``outer.outer_step_tensor``, element-wise) is taken
  on each piece, into the new master and momentum. Clipping scales come from the judged norms.
  RDA needs the merged tensor's norm before any of it is scaled: a first pass merges the chunks
  of the tensors that span several chunks only to sum that norm (``StreamedDot``), the second
  merges them again and steps (recomputed from the spool, nothing merged is kept); with clipping,
  a pass before that sums the norms of the clipped contributions RDA divides by.
- **Payloads**: the new parameters (with ``commit_dtype``, rebuilt from the quantized change piece
  by piece), then the theta, outer-state and change chunks, encoded and written one at a time
  (a few ahead on worker threads for a large fragment), in the whole-fragment closer's order.

Memory: the fragment's outer state as before (the master and momentum before and after the step,
and the parameters: what a closer keeps between rounds), plus a few chunks: the merged chunk
(float32), the cosine's sum (float64), the decoded contribution chunk being merged (and, for a
large fragment, the one read ahead), the payload chunks being encoded; never a contribution, a
merged delta or a change whole. Disk: the spool, each accepted contribution's encoded chunks.
``replay.py`` replays a round of such a fragment with this code too.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..aggregators import merge as merge_mod
from ..aggregators import outer as outer_mod
from ..aggregators.acceptance import PayloadStatus
from ..aggregators.fused import cosine_from, cosine_into, cosine_units, merge_into, norm_of
from ..aggregators.leaves import StreamedCosine, StreamedDot
from ..codec import quant
from ..codec.chunked import ChunkSpec, chunk_specs, decode_chunk, f8_scales, split, stream_chunk
from ..codec.stream import ELEMENTWISE, PayloadStream
from ..config import RDA
from ..errors import MailboxUnavailable, MissingExtra, PayloadCorrupt, PayloadLayoutMismatch
from ..protocol import keys
from ..protocol.chunks import Piece, is_whole, numel
from ..protocol.records import PayloadRef, chunk_refs, digest_of, join_refs
from ..protocol.run import RunInfo, payload_cap
from ..protocol.store import CHUNK_HEADER_ALLOWANCE, RunStore
from .spool import Spool

if TYPE_CHECKING:
    from .closer import Collector, Commit, Judged

# Off: every fragment is closed whole (``closer.py``), as before this module (tests compare the two).
ENABLED = True
# Payload chunks encoded ahead of the one being written, and contribution chunks read and decoded
# ahead of the one being merged, on worker threads (large fragments only).
AHEAD = 2
READ_AHEAD = 1
_T = TypeVar("_T")


def chunk_by_chunk(run: RunInfo, f: int) -> bool:
    """Is fragment ``f`` closed chunk by chunk? A chunked run's fragment of more than one chunk."""
    return ENABLED and run.chunk_elements is not None and len(run.plan(f)) > 1


# ---- reading a chunk --------------------------------------------------------------------------


def read_chunk(
    store: RunStore,
    spool: Spool | None,
    ref: PayloadRef,
    s: ChunkSpec,
    *,
    dtypes: Mapping[str, str],
    max_bytes: int | None,
    round: int,
) -> dict[str, np.ndarray] | None:
    """Chunk ``s`` of a payload (``ref``: that chunk's ref), verified and decoded as
    ``{piece name: flat float32 values}``: from the spool when it holds the bytes and they hash
    to ``ref.sha256``, else downloaded (and kept in the spool, tagged with ``round``, when it has
    room). None if the store has no such object; ``PayloadCorrupt``/``PayloadLayoutMismatch``/
    ``MissingExtra`` as ``RunStore.get_chunk``. A spooled file that does not verify is dropped and
    the chunk is read from the store again: damaged bytes are never decoded into a merge."""
    cap = s.cap() if max_bytes is None else min(max_bytes, s.cap())
    if ref.more:
        raise PayloadCorrupt(f"{ref.key}: a chunk's ref lists chunks of its own")
    if spool is not None and spool.has(ref.sha256):
        try:
            compression = keys.compression_of(ref.key)
        except ValueError as e:
            raise PayloadCorrupt(str(e)) from None
        if ref.size <= cap:
            try:
                got = decode_chunk(
                    spool.chunks(ref.sha256),
                    s,
                    size=ref.size,
                    sha256=ref.sha256,
                    compression=compression,
                    max_bytes=cap,
                    dtypes=dtypes,
                    key=ref.key,
                )
                return {name: v.reshape(-1) for name, v in got.items()}
            except PayloadLayoutMismatch:
                raise
            except (PayloadCorrupt, OSError):
                spool.discard(ref.sha256)  # damaged on disk (or gone): read it from the store again

    def get(tee: Callable[[Any], object] | None) -> dict[str, np.ndarray] | None:
        return store.get_chunk(ref, s.pieces, shapes=s.shapes, k=s.k, n=s.n, dtypes=dtypes, max_bytes=cap, tee=tee)

    if spool is None:
        return get(None)
    with spool.writer(ref.sha256, ref.size, round) as w:
        fetched = get(None if w is None else w.write)
        if fetched is not None and w is not None:
            w.commit()
    return fetched


# ---- judging ----------------------------------------------------------------------------------


@dataclass
class Verdict:
    """What reading a snapshot's payload chunk by chunk found: the status ``judge`` takes, whether
    every value is finite, and each tensor's squared norm (``sq_norms``) when the status is ok."""

    status: PayloadStatus
    finite: bool = True
    norms: dict[str, float] | None = None


def judge_payload(store: RunStore, spool: Spool | None, run: RunInfo, f: int, ref: PayloadRef, round: int) -> Verdict:
    """Read, verify and measure a contribution to fragment ``f`` chunk by chunk (module docstring);
    its chunks stay in ``spool``. The statuses are ``RunStore.get_payload``'s, decided by the same
    checks in the same order (the chunk count, the declared total against the cap, then each chunk
    in order: the first one gone, damaged or of another layout)."""
    shapes = run.shapes[f]
    sq = {n: StreamedDot(numel(s)) for n, s in shapes.items()}
    finite = True

    def feed(name: str, v: np.ndarray) -> None:
        nonlocal finite
        finite = finite and bool(np.isfinite(v).all())
        sq[name].feed(v)

    specs = chunk_specs(shapes, run.chunk_elements)
    failed = read_chunks(
        store, spool, run, f, ref, round, [(s.k, [(p, 0, p.size) for p in s.pieces]) for s in specs], feed
    )
    if failed is not None:
        return Verdict(failed[1])
    return Verdict("ok", finite, {n: d.total() for n, d in sq.items()})


Visit = tuple[int, list[tuple[Piece, int, int]]]  # chunk k; each piece read, and its slice of the chunk's piece


def read_chunks(
    store: RunStore,
    spool: Spool | None,
    run: RunInfo,
    f: int,
    ref: PayloadRef,
    round: int,
    visits: Sequence[Visit],
    feed: Callable[[str, np.ndarray], None],
) -> tuple[int, PayloadStatus] | None:
    """Judging's reads of a contribution to fragment ``f``: the chunk count and the declared total
    against the cap, then each chunk ``visits`` names, in order, verified and decoded (spooled),
    each of its listed pieces' values (``[a:b]`` of the chunk's piece) given to ``feed``. The first
    failure as ``(chunk, status)`` (chunk -1: the ref itself), or None."""
    specs = chunk_specs(run.shapes[f], run.chunk_elements)
    refs = chunk_refs(ref)
    if len(refs) != len(specs):
        return -1, "corrupt"
    cap = payload_cap(run, f) + CHUNK_HEADER_ALLOWANCE * (len(refs) - 1)
    if sum(r.size for r in refs) > cap:
        return -1, "corrupt"
    dtypes = run.delta_dtypes(f)
    for k, pieces in visits:
        try:
            got = read_chunk(store, spool, refs[k], specs[k], dtypes=dtypes, max_bytes=cap, round=round)
        except PayloadLayoutMismatch:
            return k, "schema"
        except (PayloadCorrupt, MissingExtra):  # MissingExtra: a zstd payload, zstandard absent
            return k, "corrupt"
        if got is None:
            return k, "missing"
        for p, a, b in pieces:
            feed(p.name, got[p.name][a:b])
    return None


# ---- committing -------------------------------------------------------------------------------


class _Lost(Exception):
    """A contribution's chunk could be read neither from the spool nor from the store."""

    def __init__(self, j: Judged, reason: str, why: str) -> None:
        super().__init__(why)
        self.judged, self.reason = j, reason


class _Contributions:
    """The accepted contributions of a round, read chunk by chunk (spool first)."""

    def __init__(self, c: Collector, store: RunStore | None, accepted: list[Judged], *, threaded: bool) -> None:
        self.c, self.store, self.accepted, self.threaded = c, store, accepted, threaded
        run, f = c.run, c.fragment
        self.specs = chunk_specs(run.shapes[f], run.chunk_elements)
        self.refs = [chunk_refs(j.snapshot.payload) for j in accepted if j.snapshot is not None]
        assert len(self.refs) == len(accepted)
        self.dtypes = run.delta_dtypes(f)
        self.cap = payload_cap(run, f) + CHUNK_HEADER_ALLOWANCE * (len(self.specs) - 1)

    def chunk(self, i: int, k: int) -> dict[str, np.ndarray]:
        j, ref = self.accepted[i], self.refs[i][k]
        if self.store is None:
            raise AssertionError("a chunk-by-chunk commit reads its contributions through the store and spool")
        try:
            got = read_chunk(
                self.store, self.c.spool, ref, self.specs[k], dtypes=self.dtypes, max_bytes=self.cap, round=self.c.round
            )
        except (PayloadCorrupt, MissingExtra) as e:
            raise _Lost(j, "corrupt", f"{ref.key}: {e}") from e
        if got is None:
            raise _Lost(j, "missing", f"{ref.key} is gone")
        return got

    def stream(self, pairs: Sequence[tuple[int, int]]) -> Generator[dict[str, np.ndarray], None, None]:
        """``chunk(i, k)`` of each ``(i, k)`` in order; for a large fragment the next ``READ_AHEAD``
        are read and decoded on worker threads while the caller merges this one (as many decoded
        chunks more)."""
        makes = [functools.partial(self.chunk, i, k) for i, k in pairs]
        yield from _ahead(makes, threaded=self.threaded and len(pairs) > 1, ahead=READ_AHEAD, name="read")


def _writable(x: np.ndarray) -> np.ndarray:
    return x if x.flags.writeable else x.copy()


def commit_by_chunks(
    c: Collector,
    *,
    closer: str,
    live: int,
    compression: str,
    sync_seconds: float | None,
    now: float,
    write: Callable[[str, bytes | PayloadStream], object] | None,
    outliers: bool,
) -> Commit:
    """``closer.compute_commit`` for a fragment of several chunks (the same arguments, the same
    result, byte for byte). A contribution whose chunk can no longer be read (the spool's copy
    damaged and the store's gone or damaged) is rejected (``corrupt``/``missing``) and the commit
    given up with ``MailboxUnavailable``: the next poll decides again whether the round may close."""
    from .closer import Commit, commit_record

    assert c.store is not None, "a chunk-by-chunk collector keeps the store it judged from"
    run, cfg, f = c.run, c.run.cfg, c.fragment
    if outliers and cfg.outlier_factor is not None:
        c.reject_outliers(cfg.outlier_factor)
    accepted = sorted(c.accepted(), key=lambda j: j.learner)
    assert accepted, "a round closes with at least one accepted snapshot"
    st = c.state
    final = all(j.snapshot is not None and j.snapshot.final for j in accepted)
    checkpoint = run.checkpoint_due(f, st.version + 1, final=final, participants=len(accepted))
    if c.sharded is not None:  # a sharded node: its ranks merge, step and write their chunks
        assert write is not None, "a sharded closer writes as it commits"
        with _rejecting_lost(c):
            made = c.sharded.commit(c, accepted, final=final, checkpoint=checkpoint, compression=compression)
    else:
        made = _commit_here(c, accepted, final, checkpoint, compression, write)
    record = commit_record(
        c,
        accepted,
        made.refs,
        theta_digest=made.theta_digest,
        outer_digest=made.outer_digest,
        cosine=made.cosine,
        final=final,
        checkpoint=checkpoint,
        closer=closer,
        live=live,
        now=now,
        sync_seconds=sync_seconds,
    )
    return Commit(record, made.state, made.payloads)


@dataclass
class Made:
    """What a commit made before its record: the refs of the payloads written (by kind), the
    digests of the parameters and outer state, the cosine, each payload handed to ``write``
    (``closer.Commit.payloads``) and the fragment's new state."""

    refs: dict[str, PayloadRef]
    theta_digest: str
    outer_digest: str | None
    cosine: float | None
    payloads: dict[str, Any]
    state: Any  # closer.FragmentState


@contextlib.contextmanager
def _rejecting_lost(c: Collector, out: Any = None) -> Generator[None, None, None]:
    """A contribution whose chunk can no longer be read is rejected and the commit given up with
    ``MailboxUnavailable`` (``commit_by_chunks``); ``out``: the arrays the commit would have
    written, given back to the collector for the next attempt."""
    try:
        yield
    except _Lost as lost:
        c.reserved = out  # nothing was committed: the next attempt writes every element again
        j = lost.judged
        j.reason, j.weight, j.norms = lost.reason, 0.0, None
        for ref in chunk_refs(j.snapshot.payload) if j.snapshot is not None else []:
            if c.spool is not None:
                c.spool.discard(ref.sha256)
        raise MailboxUnavailable(
            f"round {c.round}: {j.learner}'s contribution can no longer be read ({lost}); rejected as "
            f"{lost.reason}, the round closes on the next poll if it still may"
        ) from lost


def _commit_here(
    c: Collector,
    accepted: list[Judged],
    final: bool,
    checkpoint: bool,
    compression: str,
    write: Callable[[str, bytes | PayloadStream], object] | None,
) -> Made:
    """The merge, the outer step and the payloads of a commit in this process."""
    from .closer import FragmentState, Written

    assert c.store is not None
    run, cfg, f, st = c.run, c.run.cfg, c.fragment, c.state
    out, c.reserved = c.reserved, None  # taken: a second attempt writes into fresh arrays
    threaded = run.fragment_bytes(f) >= _threaded_bytes()
    source = _Contributions(c, c.store, accepted, threaded=threaded)
    with _rejecting_lost(c, out):
        master, momentum, cosine = _merge_and_step(c, source, accepted, final, out)
    theta = _new_theta(run, f, st.theta, master)
    shapes, outer_shapes, dtypes = run.shapes[f], run.outer_shapes(f), run.fragment_dtypes(f)
    outer = {f"momentum/{n}": v for n, v in momentum.items()}
    if not run.master_is_theta(f):
        outer.update({f"master/{n}": v for n, v in master.items()})

    def streams(
        values: Mapping[str, np.ndarray],
        shp: Mapping[str, tuple[int, ...]],
        dt: str | Mapping[str, str],
        kind: str,
        zip: str,
    ) -> list[Callable[[], PayloadStream]]:
        def one(s: ChunkSpec) -> Callable[[], PayloadStream]:
            return lambda: _stream_of(values, s, dt, kind, zip)

        return [one(s) for s in chunk_specs(shp, run.chunk_elements)]

    # (kind, what is done with it, the chunks' streams) in the whole-fragment closer's write order
    plan: list[tuple[str, bool, list[Callable[[], PayloadStream]]]] = []
    for kind, written in write_plan(checkpoint, cfg.commit_dtype is not None, compression):
        zip_ = compression if written else ""
        if kind == "theta":
            plan.append((kind, written, streams(theta, shapes, dtypes, "theta", zip_)))
        elif kind == "outer":
            plan.append((kind, written, streams(outer, outer_shapes, "F32", "outer", zip_)))
        else:
            assert cfg.commit_dtype is not None
            plan.append((kind, written, _change_streams(run, f, st.theta, master, cfg.commit_dtype, compression)))
    payloads: dict[str, bytes | PayloadStream | Written] = {}
    parts: dict[tuple[str, bool], list[PayloadRef]] = {}
    jobs = [(kind, written, make) for kind, written, makes in plan for make in makes]
    made = _ahead([make for _, _, make in jobs], threaded=threaded, drop=_close)
    try:
        for (kind, written, _), data in zip(jobs, made, strict=True):
            with data:
                k = keys.round_blob_key(c.round, kind, data.sha256, compression if written else "")
                parts.setdefault((kind, written), []).append(PayloadRef(key=k, sha256=data.sha256, size=len(data)))
                if written:
                    if write is not None:
                        write(k, data)
                        payloads[k] = Written(len(data), data.sha256)
                    else:
                        payloads[k] = data.read()
    finally:
        made.close()
    refs = {kind: join_refs(ps) for (kind, written), ps in parts.items() if written}
    theta_digest = digest_of([p.sha256 for p in parts[("theta", checkpoint and compression == "")]])
    outer_digest = None if checkpoint else digest_of([p.sha256 for p in parts[("outer", False)]])
    version = st.version + 1
    state = FragmentState(version, theta, master, momentum, version if checkpoint else st.checkpoint)
    return Made(refs, theta_digest, outer_digest, cosine, payloads, state)


def write_plan(checkpoint: bool, change: bool, compression: str) -> list[tuple[str, bool]]:
    """A commit's payloads in the order they are written: ``(kind, written)``. A checkpoint writes
    the parameters and the outer state; ``change`` (``commit_dtype``) writes the quantized change;
    the parameters and outer state not written are still hashed uncompressed, for the record's
    ``theta_digest``/``outer_digest``."""
    plan: list[tuple[str, bool]] = []
    if checkpoint:
        plan += [("theta", True), ("outer", True)]
    if change:
        plan.append(("change", True))
    if not (checkpoint and compression == ""):
        plan.append(("theta", False))
    if not checkpoint:
        plan.append(("outer", False))
    return plan


def _threaded_bytes() -> int:
    from . import closer

    return closer._THREADED_BYTES


def _stream_of(
    values: Mapping[str, np.ndarray], s: ChunkSpec, dt: str | Mapping[str, str], kind: str, zip: str
) -> PayloadStream:
    """Chunk ``s`` of the payload of ``values`` (whole tensors in memory), as
    ``codec.chunked.fragment_streams`` makes it (an F8 piece of a split tensor with the whole
    tensor's scale)."""
    dtypes = dict.fromkeys(s.shapes, dt) if isinstance(dt, str) else dt
    return stream_chunk(split(values, s), s, dtypes, kind=kind, compression=zip, f8_scales=f8_scales(values, dtypes, s))


def _ahead(
    makes: Sequence[Callable[[], _T]],
    *,
    threaded: bool,
    ahead: int = AHEAD,
    name: str = "commit",
    drop: Callable[[_T], None] | None = None,
) -> Generator[_T, None, None]:
    """Each ``make()`` in order, up to ``ahead`` of them computed ahead on worker threads (the
    next chunks read, or hashed, while this one is used). ``drop``: for each result computed but
    not handed out (the caller stopped early)."""
    if not threaded:
        for make in makes:
            yield make()
        return
    pending: deque[Future[_T]] = deque()
    with ThreadPoolExecutor(max_workers=ahead, thread_name_prefix=f"gradientmail-{name}") as pool:
        try:
            for make in makes:
                pending.append(pool.submit(make))
                if len(pending) > ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                if not fut.cancel() and drop is not None:
                    try:
                        drop(fut.result())
                    except BaseException:  # noqa: S110 - its error is moot: the caller failed already
                        pass


def _close(stream: PayloadStream) -> None:
    stream.close()


# ---- the merge passes -------------------------------------------------------------------------


def merge_terms(
    cfg: Any, names: Sequence[str], weights: Sequence[float], sq: Sequence[Mapping[str, float]]
) -> tuple[list[float], list[np.float32 | None], list[float | None] | None, set[str]]:
    """What the merge needs of the accepted contributions before reading any: their normalized
    weights, clipping factors (``merge.clip``: ``float32(c / |d_i|)`` from each one's judged
    whole-fragment norm, None when not clipped), the cosine's unit factors, and the tensors RDA
    merges radially."""
    n = len(weights)
    p = merge_mod._normalized(list(weights), n)
    clips: list[np.float32 | None] = [None] * n
    if cfg.clip_norm is not None:
        if not cfg.clip_norm > 0:
            raise ValueError(f"clip_norm={cfg.clip_norm!r}: expected a number > 0")
        for i in range(n):
            norm = norm_of(sq[i])
            if not norm <= cfg.clip_norm:
                clips[i] = np.float32(cfg.clip_norm / norm)
    units = cosine_units([norm_of(s) for s in sq])
    radial = {name for name in names if isinstance(cfg.merge, RDA) and not cfg.merge.is_direct(name)}
    return p, clips, units, radial


def merge_scales(
    names: Sequence[str], radial: set[str], p: Sequence[float], x_sq: Sequence[Mapping[str, float]]
) -> tuple[dict[str, list[Any]], dict[str, float]]:
    """Each tensor's merge scales: ``float32(p_i)`` (weighted mean), or RDA's
    ``float32(p_i / |x_i|)`` (None for a zero contribution) and its length ``sum_i p_i |x_i|``
    (``fused.merge_tensor``); ``x_sq``: each contribution's squared norm of each radial tensor."""
    scales: dict[str, list[Any]] = {}  # np.float32, or None
    radius: dict[str, float] = {}
    for name in names:
        if name not in radial:
            scales[name] = [np.float32(p_i) for p_i in p]
            continue
        r = 0.0
        sc: list[Any] = []
        for i, p_i in enumerate(p):
            norm = math.sqrt(x_sq[i][name])
            if norm > 0.0:
                r += p_i * norm
                sc.append(np.float32(p_i / norm))
            else:
                sc.append(None)
        scales[name], radius[name] = sc, r
    return scales, radius


def _merge_and_step(
    c: Collector,
    source: _Contributions,
    accepted: list[Judged],
    final: bool,
    out: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], float | None]:
    """Merge the accepted contributions chunk by chunk and take the outer step on each piece:
    ``(new master, new momentum, cosine)``, as ``merge_with_cosine`` and ``outer_step_tensor``
    over whole tensors give them."""
    run, cfg, f, st = c.run, c.run.cfg, c.fragment, c.state
    shapes = run.shapes[f]
    names = list(shapes)
    n = len(accepted)
    sq = [j.norms or {} for j in accepted]
    p, clips, units, radial = merge_terms(cfg, names, [j.weight for j in accepted], sq)
    specs = source.specs
    chunks_of = {name: [k for k, s in enumerate(specs) if any(pc.name == name for pc in s.pieces)] for name in names}
    # RDA divides each contribution by its norm, of the clipped values when clipped: those norms
    # need a pass of their own (pass 0).
    x_sq: list[dict[str, float]] = [{name: sq[i][name] for name in radial} for i in range(n)]
    clipped = [i for i in range(n) if clips[i] is not None]
    if radial and clipped:
        dots = {i: {name: StreamedDot(numel(shapes[name])) for name in radial} for i in clipped}
        ks = [k for k, s in enumerate(specs) if any(pc.name in radial for pc in s.pieces)]
        with contextlib.closing(source.stream([(i, k) for k in ks for i in clipped])) as reads:
            for k in ks:
                for i in clipped:
                    got = next(reads)
                    for pc in specs[k].pieces:
                        if pc.name in radial:
                            dots[i][pc.name].feed(got[pc.name] * clips[i])
        for i in clipped:
            x_sq[i] = {name: d.total() for name, d in dots[i].items()}
    scales, radius = merge_scales(names, radial, p, x_sq)
    # Pass 1 (RDA): the norm of each radial tensor that spans chunks, merged but not yet scaled.
    direction: dict[str, float] = {}
    split = {name for name in radial if len(chunks_of[name]) > 1}
    if split:
        dots_v = {name: StreamedDot(numel(shapes[name])) for name in split}
        ks = [k for k, s in enumerate(specs) if any(pc.name in split for pc in s.pieces)]
        with contextlib.closing(source.stream([(i, k) for k in ks for i in range(n)])) as reads:
            for k in ks:
                wanted = [pc for pc in specs[k].pieces if pc.name in split]
                merged = _merge_chunk((next(reads) for _ in range(n)), wanted, scales, clips, None, None)
                for pc, v in zip(wanted, merged, strict=True):
                    dots_v[pc.name].feed(v)
        direction = {name: math.sqrt(d.total()) for name, d in dots_v.items()}
    # Pass 2: merge every chunk again (with the cosine's sums), scale, step.
    new_master: dict[str, np.ndarray] = {}
    new_momentum: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        new_master[name] = out[0][name] if out is not None else np.empty(shape, np.float32)
        if not final:
            new_momentum[name] = out[1][name] if out is not None else np.empty(shape, np.float32)
    cos = {name: StreamedCosine(numel(shapes[name])) for name in names} if units is not None else None
    lr, beta = cfg.outer_lr, cfg.outer_momentum
    with contextlib.closing(source.stream([(i, k) for k in range(len(specs)) for i in range(n)])) as reads:
        for s in specs:
            pieces = list(s.pieces)
            merged = _merge_chunk((next(reads) for _ in range(n)), pieces, scales, clips, units, cos)
            for pc, v in zip(pieces, merged, strict=True):
                name = pc.name
                scale: np.float32 | None = None
                if name in radial:
                    if name in direction:
                        norm = direction[name]
                    else:  # the whole tensor is in this chunk: its norm now
                        d = StreamedDot(pc.size)
                        d.feed(v)
                        norm = math.sqrt(d.total())
                    if norm == 0.0:
                        v.fill(0)  # +0.0 everywhere (the direction may hold -0.0)
                    else:
                        scale = np.float32(radius[name] / norm)
                lo, hi = pc.start, pc.stop
                m_old = np.asarray(st.master[name], np.float32).reshape(-1)[lo:hi]
                nm = new_master[name].reshape(-1)[lo:hi]
                if final:
                    outer_mod.final_step_tensor(m_old, v, scale=scale, out=nm, name=name)
                else:
                    mo_old = np.asarray(st.momentum[name], np.float32).reshape(-1)[lo:hi]
                    nmo = new_momentum[name].reshape(-1)[lo:hi]
                    outer_mod.outer_step_tensor(
                        m_old, mo_old, v, lr=lr, beta=beta, scale=scale, out=(nm, nmo), name=name
                    )
    cosine = cosine_from(units, {name: cos[name].squares() for name in names} if cos is not None else {}, n)
    master = {name: new_master[name] for name in st.master}
    momentum = st.momentum if final else {name: new_momentum[name] for name in st.master}
    return master, momentum, cosine


def _merge_chunk(
    chunks: Iterable[dict[str, np.ndarray]],
    pieces: Sequence[Any],
    scales: Mapping[str, Sequence[np.float32 | None]],
    clips: Sequence[np.float32 | None],
    units: Sequence[float | None] | None,
    cos: Mapping[str, Any] | None,  # StreamedCosine, or a rank's leaves.LeafRange
) -> list[np.ndarray]:
    """The ``pieces`` of one chunk merged (not scaled) from ``chunks`` (that chunk of each
    contribution, decoded, in learner order; each taken, used and dropped in turn): each piece's
    float32 values. With ``units``, also feeds each piece's cosine sum to ``cos``."""
    sizes = [pc.size for pc in pieces]
    starts = np.cumsum([0, *sizes]).tolist()
    buf = np.empty(starts[-1], np.float32)
    acc = np.empty(starts[-1], np.float64) if units is not None else None
    merged = [buf[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    first_merge = dict.fromkeys((pc.name for pc in pieces), True)
    first_cos = True
    for i, got in enumerate(chunks):
        u = None if units is None else units[i]
        for pc, v, a, b in zip(pieces, merged, starts[:-1], starts[1:], strict=True):
            x = got[pc.name]
            if u is not None and acc is not None:
                cosine_into(acc[a:b], x, u, first=first_cos)  # of the contribution as given
            if clips[i] is not None:
                x = _writable(x)
                x *= clips[i]  # ``merge.clip``: one float32 multiply, before the merge's
            sc = scales[pc.name][i]
            if sc is not None:
                merge_into(v, x, sc, first=first_merge[pc.name])
                first_merge[pc.name] = False
        if u is not None:
            first_cos = False
        del got
    for pc, v in zip(pieces, merged, strict=True):
        if first_merge[pc.name]:
            v.fill(0)  # no contribution has a direction here
    if cos is not None and acc is not None:
        for pc, a, b in zip(pieces, starts[:-1], starts[1:], strict=True):
            cos[pc.name].feed(acc[a:b])
    return merged


# ---- the new parameters and the change --------------------------------------------------------


def _new_theta(
    run: RunInfo, f: int, prev: Mapping[str, np.ndarray], master: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The published parameters: ``cast(master)``, or with ``commit_dtype`` what a learner rebuilds
    from the quantized change (``rebuild_theta(prev, cast(master - prev))``), computed a chunk's
    pieces at a time (no whole change held). Each piece starts on a 32-element block of its
    tensor, so F4/I2 quantize it as they quantize the whole tensor; F8 is given the whole
    tensor's scale."""
    from ..protocol.rebuild import cast

    dtypes, cd = run.fragment_dtypes(f), run.cfg.commit_dtype
    if cd is None and all(dtypes[n] == "F32" for n in master):
        return cast(master, dtypes)  # the master's own arrays
    scales = _change_scales(run, f, prev, master) if cd == "F8_E4M3" else {}
    theta: dict[str, np.ndarray] = {}
    for name, m in master.items():
        if cd is None and dtypes[name] == "F32":
            theta[name] = cast({name: m}, dtypes)[name]
            continue
        theta[name] = np.empty(np.shape(m), np.float32)
    for s in chunk_specs(run.shapes[f], run.chunk_elements):
        for pc in s.pieces:
            name = pc.name
            if cd is None and dtypes[name] == "F32":
                continue
            lo, hi = pc.start, pc.stop
            mf = np.asarray(master[name], np.float32).reshape(-1)[lo:hi]
            if cd is None:
                values = mf
            else:
                pf = np.asarray(prev[name], np.float32).reshape(-1)[lo:hi]
                diff = np.subtract(mf, pf, dtype=np.float32)
                values = pf + quant.dequantize(quant.quantize(diff, cd, f8_scale=scales.get(name)))
            if dtypes[name] not in ELEMENTWISE:
                raise AssertionError(f"parameters of dtype {dtypes[name]} are not cast piece by piece")
            theta[name].reshape(-1)[lo:hi] = (
                values if dtypes[name] == "F32" else quant.dequantize(quant.quantize(values, dtypes[name]))
            )
    return theta


def _change_scales(
    run: RunInfo, f: int, prev: Mapping[str, np.ndarray], master: Mapping[str, np.ndarray]
) -> dict[str, int]:
    """The F8_E4M3 scale byte of each tensor of the change ``master - prev``, from the maximum of
    its pieces' finite magnitudes (exact: the whole tensor's)."""
    amax: dict[str, np.float32] = {}
    for s in chunk_specs(run.shapes[f], run.chunk_elements):
        for pc in s.pieces:
            lo, hi = pc.start, pc.stop
            diff = np.subtract(
                np.asarray(master[pc.name], np.float32).reshape(-1)[lo:hi],
                np.asarray(prev[pc.name], np.float32).reshape(-1)[lo:hi],
                dtype=np.float32,
            )
            a = quant.e4m3_amax(diff)
            amax[pc.name] = max(amax.get(pc.name, np.float32(0)), a)
    return {name: quant.e4m3_scale_byte(a) for name, a in amax.items()}


def _change_streams(
    run: RunInfo,
    f: int,
    prev: Mapping[str, np.ndarray],
    master: Mapping[str, np.ndarray],
    dtype: str,
    compression: str,
) -> list[Callable[[], PayloadStream]]:
    """The change payload's chunks, each computed (``master - prev`` of its pieces) when its
    stream is made: the change is never whole."""
    shapes = run.shapes[f]
    scales = _change_scales(run, f, prev, master) if dtype == "F8_E4M3" else {}

    def one(s: ChunkSpec) -> Callable[[], PayloadStream]:
        def make() -> PayloadStream:
            values = {
                pc.name: np.subtract(
                    np.asarray(master[pc.name], np.float32).reshape(-1)[pc.start : pc.stop],
                    np.asarray(prev[pc.name], np.float32).reshape(-1)[pc.start : pc.stop],
                    dtype=np.float32,
                ).reshape(s.expected[pc.name])
                for pc in s.pieces
            }
            parted = {pc.name: scales[pc.name] for pc in s.pieces if pc.name in scales and not is_whole(pc, shapes)}
            return stream_chunk(values, s, dtype, kind="change", compression=compression, f8_scales=parted)

        return make

    return [one(s) for s in chunk_specs(shapes, run.chunk_elements)]


__all__ = ["ENABLED", "Verdict", "chunk_by_chunk", "commit_by_chunks", "judge_payload", "read_chunk"]
