"""The merger: the one place a round's contributions are judged, merged and stepped, and the
commit's payloads written, chunk by chunk (``docs/protocol.md`` section 10, "The closer";
``docs/sharding.md`` section 5, for the ranks, the chunks' owners and the F8 scales).

A ``FragmentMerger`` works on the flat range of each tensor this process holds: every tensor
whole (``one_process``), or on each rank of a sharded node its shards, the ranks meeting only in
``ranges.Ranks``. Its ops: ``load`` (a fragment's state at a checkpoint), ``judge`` (a contribution
read into the spool, checked finite, its squared norms summed), ``commit`` (the new state pending
until ``landed``: a commit whose record was not written is made again from the state before it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ..aggregators.acceptance import PayloadStatus
from ..aggregators.leaves import Pooled
from ..ahead import call, ordered
from ..codec import quant
from ..codec.payload import PayloadStream, encode_payload
from ..codec.plan import ChunkSpec, Piece, chunk_specs, is_whole, numel
from ..codec.quant import ELEMENTWISE
from ..config import RDA
from ..errors import MailboxUnavailable, MissingExtra, PayloadCorrupt, PayloadLayoutMismatch
from ..protocol import keys
from ..protocol.layout import Layout
from ..protocol.records import PayloadRef, chunk_refs, digest_of, join_refs
from ..protocol.run import RunInfo, payload_cap
from ..protocol.store import CHUNK_HEADER_ALLOWANCE, RunStore
from .commit import Commit, CommitOp, FragmentState, Lost, Put, discard
from .passes import Source, Span, merge_and_step
from .ranges import OneProcess, Owned, Ranks, Visit, alloc, flat, tensor_of, visits, whole_layout
from .spool import Spool

# A process holding at least this much of a fragment (float32) reads ahead and encodes its payloads
# on worker threads; one holding less (a simulation's, a test's, a rank's small shards) inline,
# without starting threads (each worker's malloc arena costs a training rank a few MiB).
THREADED_BYTES = 8 << 20
AHEAD = 2  # payload chunks encoded and hashed ahead of the one being written (large fragments)
Arrays = dict[str, np.ndarray]


@dataclass
class Verdict:
    """A contribution read: the status ``acceptance.judge`` takes, whether every value is finite,
    and each tensor's squared norm (``sq_norms``, bit for bit) when the status is ok."""

    status: PayloadStatus
    finite: bool = True
    norms: dict[str, float] | None = None


class _Failed(Exception):
    """Chunk ``k`` could not be read (``status``: ``missing``, ``corrupt``, ``schema``)."""

    def __init__(self, k: int, status: str, cause: Exception | None = None) -> None:
        self.k, self.status, self.cause = k, status, cause


class FragmentMerger:
    """One process's part of merging rounds (module docstring). ``keep_theta``: keep each
    fragment's parameters (a node hands them to its learner); without, only a change needs them."""

    def __init__(
        self, run: RunInfo, store: RunStore, ranks: Ranks, layout: Layout, *, spool: Spool, keep_theta: bool
    ) -> None:
        self.run, self.store, self.ranks, self.layout = run, store, ranks, layout
        self.spool, self.keep_theta = spool, keep_theta
        self.states: dict[int, FragmentState] = {}  # landed
        self.pending: dict[int, FragmentState] = {}  # committed, record not yet written
        self.reserved: dict[int, tuple[Arrays, Arrays]] = {}
        self.spans: dict[int, Span] = {}  # what this process holds of each fragment (fixed for the run)

    @classmethod
    def one_process(cls, run: RunInfo, store: RunStore, spool: Spool | None = None) -> FragmentMerger:
        shapes = {n: s for f in range(run.P) for n, s in run.shapes[f].items()}
        return cls(run, store, OneProcess(), whole_layout(shapes), spool=spool or Spool(), keep_theta=True)

    def held(self, f: int) -> FragmentState | None:
        return self.states.get(f)

    def holds_any(self) -> bool:
        return bool(self.states or self.pending)

    def forget(self, f: int, *, unless: int | None = None) -> None:
        """Let fragment ``f``'s state go unless it is version ``unless`` (another node committed the
        fragment: the outer state held is stale, twice the fragment in fp32)."""
        if f in self.states and self.states[f].version != unless:
            del self.states[f]
        self.pending.pop(f, None)
        self.reserved.pop(f, None)

    def span(self, f: int) -> Span:
        if f in self.spans:
            return self.spans[f]
        shapes, merge, layout = self.run.shapes[f], self.run.cfg.merge, self.layout
        ranges = {n: layout.range(n, self.ranks.rank) for n in shapes}
        specs = chunk_specs(shapes, self.run.chunk_elements)
        # RDA's merged norm of a tensor spanning chunks, or not held whole by one rank: a pass of its own
        spans = {n for n in shapes if sum(any(p.name == n for p in s.pieces) for s in specs) > 1}
        whole = {n for n, s in shapes.items() if any(layout.range(n, r) == (0, numel(s)) for r in range(layout.world))}
        radial = {n for n in shapes if isinstance(merge, RDA) and not merge.is_direct(n)}
        split = {n for n in radial if n in spans or n not in whole}
        self.spans[f] = Span(shapes, ranges, specs, visits(specs, ranges, self.ranks.rank), radial, split)
        return self.spans[f]

    def _chunk(
        self, refs: Sequence[PayloadRef], specs: Sequence[ChunkSpec], k: int, dtypes: Mapping[str, str],
        cap: int | None = None, round: int = 0, spool: Spool | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """Chunk ``k`` read (spool first), verified and decoded; ``_Failed`` when it cannot be."""
        s = specs[k]
        dt = {p.name: dtypes[p.name] for p in s.pieces}
        try:
            got = read_chunk(
                self.store, spool, refs[k], s, dtypes=dt, max_bytes=cap, round=round, decoded=len(specs) == 1
            )
        except PayloadLayoutMismatch as e:
            raise _Failed(k, "schema", e) from e
        except (PayloadCorrupt, MissingExtra) as e:  # MissingExtra: a zstd payload, zstandard absent
            raise _Failed(k, "corrupt", e) from e
        if got is None:
            raise _Failed(k, "missing")
        return got

    def _read(
        self, refs: Sequence[PayloadRef], specs: Sequence[ChunkSpec], dtypes: Mapping[str, str],
        planned: Sequence[Visit], feed: Callable[[Piece, np.ndarray], None], **how: Any,
    ) -> None:  # fmt: skip
        """Each chunk ``planned`` names (``_chunk``): each piece's part in this process's ranges to ``feed``."""
        for k, pieces in planned:
            got = self._chunk(refs, specs, k, dtypes, **how)
            for p, a, b in pieces:
                feed(p, got[p.name][a:b])

    # ---- ops: each runs on every rank at once --------------------------------------------------

    def load(
        self, f: int, version: int, theta: PayloadRef, outer: PayloadRef | None, known: Arrays | None = None
    ) -> FragmentState:
        """Fragment ``f`` at ``version`` from its parameters ``theta`` and outer state ``outer``
        (None: the initial parameters, zero momentum); ``known``: the parameters, read already."""
        self.ranks.begin("load", f=f, version=version, theta=theta, outer=outer)
        self.forget(f)  # (a stale state is let go before the new one is read)
        run, span = self.run, self.span(f)

        def read(ref: PayloadRef, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str]) -> Arrays:
            specs, refs = chunk_specs(shapes, run.chunk_elements), chunk_refs(ref)
            if len(refs) != len(specs):
                raise PayloadCorrupt(f"{ref.key} names {len(refs)} chunks, the plan has {len(specs)}")
            ranges = {n: span.ranges[tensor_of(n)] for n in shapes}
            out = alloc(ranges, shapes)

            def into(p: Piece, v: np.ndarray) -> None:
                lo = ranges[p.name][0]
                flat(out[p.name])[p.start - lo : p.stop - lo] = v

            try:
                self._read(refs, specs, dtypes, visits(specs, ranges, self.ranks.rank), into)
            except _Failed as e:
                if e.cause is not None:
                    raise e.cause from None
                raise MailboxUnavailable(f"{refs[e.k].key} is gone; newer commits exist") from None
            return out

        loaded: list[FragmentState] = []

        def load_here() -> bool:
            # (``known``: a node's whole parameters; a rank of a sharded node reads its ranges)
            mine = known if known is not None and self.keep_theta else None
            params = mine if mine is not None else read(theta, run.shapes[f], run.fragment_dtypes(f))
            if outer is None:
                loaded.append(FragmentState.initial(params))
                return True
            outer_shapes = run.outer_shapes(f)
            master, momentum = run.split_outer(f, read(outer, outer_shapes, dict.fromkeys(outer_shapes, "F32")), params)
            if not self.keep_theta and run.cfg.commit_dtype is None:
                params = master  # only a change is computed from the parameters: none is, so keep no copy
            loaded.append(FragmentState(version, params, master, momentum, checkpoint=version))
            return True

        self.ranks.phase(load_here)
        self.states[f] = loaded[0]
        return loaded[0]

    def judge(self, f: int, round: int, ref: PayloadRef) -> Verdict:
        """A contribution to fragment ``f`` read into the spool, checked finite, its squared norms
        summed, pooled over the ranks. The first chunk missing, damaged or of another layout decides."""
        self.ranks.begin("judge", f=f, round=round, ref=ref)
        span, refs = self.span(f), chunk_refs(ref)
        cap = contribution_cap(self.run, f, len(span.specs))
        dots = Pooled("dot", {n: numel(s) for n, s in span.shapes.items()}, span.ranges)

        def read() -> dict[str, Any]:
            if len(refs) != len(span.specs) or sum(r.size for r in refs) > cap:
                return {"fail": [-1, "corrupt"]}
            dots.start()
            finite = [True]

            def feed(p: Piece, v: np.ndarray) -> None:
                finite[0] = finite[0] and bool(np.isfinite(v).all())
                dots.feed(p.name, v)

            dtypes = self.run.delta_dtypes(f)
            try:
                self._read(refs, span.specs, dtypes, span.visits, feed, cap=cap, round=round, spool=self.spool)
            except _Failed as e:
                return {"fail": [e.k, e.status]}
            return {"finite": finite[0], "dots": dots.wire()}

        pooled = self.ranks.phase(read)
        fails = [p["fail"] for p in pooled if "fail" in p]
        if fails:
            return Verdict(min(fails, key=lambda x: x[0])[1])
        return Verdict("ok", all(p["finite"] for p in pooled), dots.totals([p["dots"] for p in pooled]))

    def reserve(self, f: int) -> None:
        """The arrays a commit of ``f`` writes the new outer state into, every page touched now (with
        the first accepted contribution): the page faults are paid while contributions arrive."""
        if f not in self.reserved:
            self.reserved[f] = _pair(self.span(f))
            for arrays in self.reserved[f]:
                for a in arrays.values():
                    a.fill(0)

    def commit(self, op: CommitOp, put: Put | None) -> Commit:
        """Merge ``op``'s contributions, take the outer step and write the payloads (``put``; None:
        keep their bytes). ``Lost`` when a contribution can no longer be read. (Called through
        ``commit.merge_commit``; the other ranks of a sharded node run the op rank 0 announces.)"""
        self.ranks.begin("commit", op=op, write=put is not None and put is not discard)
        run, f, st = self.run, op.f, self.states.get(op.f)

        def check() -> bool:
            if st is None or st.version != op.version:
                have = None if st is None else st.version
                raise MailboxUnavailable(
                    f"fragment {f}: this process holds version {have} of the state, not {op.version}"
                )
            return True

        self.ranks.phase(check)
        assert st is not None
        self.pending.pop(f, None)  # a commit whose record did not land: made again from ``st``
        span = self.span(f)
        cap, dtypes = contribution_cap(run, f, len(span.specs)), run.delta_dtypes(f)

        def chunk(i: int, k: int) -> dict[str, np.ndarray]:
            refs = op.accepted[i].refs
            try:
                return self._chunk(refs, span.specs, k, dtypes, cap, op.round, self.spool)
            except _Failed as e:
                why = f"{refs[k].key}: {e.cause}" if e.cause else f"{refs[k].key} is gone"
                raise Lost(i, "corrupt" if e.cause else "missing", why) from e.cause

        threaded = 4 * sum(hi - lo for lo, hi in span.ranges.values()) >= THREADED_BYTES
        source = Source(chunk, in_memory=len(span.specs) == 1, threaded=threaded)
        out = self.reserved.pop(f, None) or _pair(span)
        try:
            master, momentum, cosine_of = merge_and_step(run.cfg, self.ranks, span, source, op, st, out)
        except BaseException:
            self.reserved[f] = out  # nothing was committed: the next attempt writes every element again
            raise
        commit = write_commit(
            run, self.ranks, self.layout, op, st, master, momentum, cosine_of,
            keep_theta=self.keep_theta, put=put, threaded=threaded,
        )  # fmt: skip
        self.pending[f] = commit.state
        return commit

    def landed(self, f: int, version: int) -> None:
        """The record of this process's commit of fragment ``f`` at ``version`` is written."""
        self.ranks.begin("landed", f=f, version=version)
        if f in self.pending and self.pending[f].version == version:
            self.states[f] = self.pending.pop(f)

    def close(self) -> None:
        self.spool.close()


def _pair(span: Span) -> tuple[Arrays, Arrays]:
    return alloc(span.ranges, span.shapes), alloc(span.ranges, span.shapes)


def read_chunk(
    store: RunStore,
    spool: Spool | None,
    ref: PayloadRef,
    s: ChunkSpec,
    *,
    dtypes: Mapping[str, str],
    max_bytes: int | None,
    round: int,
    decoded: bool = False,
) -> dict[str, np.ndarray] | None:
    """Chunk ``s`` of a payload, verified and decoded: from the spool (a file there that no longer
    verifies is read again), else downloaded into it, tagged ``round`` (``decoded``: held in memory,
    else bytes on disk). None if the store has no such object; errors as ``RunStore.get_chunk``."""
    cap = s.cap() if max_bytes is None else min(max_bytes, s.cap())
    if ref.more:
        raise PayloadCorrupt(f"{ref.key}: a chunk's ref lists chunks of its own")
    got = spool.read(ref, s, dtypes=dtypes, cap=cap) if spool is not None else None
    if got is not None:
        return got

    def get(tee: Callable[[Any], object] | None) -> dict[str, np.ndarray] | None:
        return store.get_chunk(ref, s.pieces, shapes=s.shapes, k=s.k, n=s.n, dtypes=dtypes, max_bytes=cap, tee=tee)

    if spool is None or decoded:
        fetched = get(None)
        if fetched is None or spool is None:
            return fetched
        spool.hold(ref.sha256, fetched, round)
        return spool.decoded(ref.sha256)
    with spool.writer(ref.sha256, ref.size, round) as w:
        fetched = get(None if w is None else w.write)
        if fetched is not None and w is not None:
            w.commit()
    return None if fetched is None else {name: v.reshape(-1) for name, v in fetched.items()}


def contribution_cap(run: RunInfo, f: int, chunks: int) -> int:
    """The most bytes a contribution to fragment ``f`` of ``chunks`` chunks may declare."""
    return payload_cap(run, f) + CHUNK_HEADER_ALLOWANCE * (chunks - 1)


def write_plan(checkpoint: bool, change: bool, compression: str) -> list[tuple[str, bool]]:
    """A commit's payloads in the order they are written, ``(kind, written)``: a checkpoint's
    parameters and outer state, the change (``commit_dtype``); the parameters and outer state not
    written are hashed uncompressed for the record's ``theta_digest``/``outer_digest``."""
    plan = [("theta", True), ("outer", True)] if checkpoint else []
    plan += [("change", True)] if change else []
    plan += [] if checkpoint and compression == "" else [("theta", False)]
    return plan + ([] if checkpoint else [("outer", False)])


def write_commit(
    run: RunInfo,
    ranks: Ranks,
    layout: Layout,
    op: CommitOp,
    st: FragmentState,
    master: Arrays,
    momentum: Arrays,
    cosine: Callable[[], float | None],
    *,
    keep_theta: bool,
    put: Put | None,
    threaded: bool,
) -> Commit:
    """The commit of the new ``master`` and ``momentum`` (of this process's ranges) from ``st``:
    its payloads, this rank's chunks written (or hashed; ``put`` None: their bytes kept, one
    process only), refs and digests from every rank's chunks, the ``cosine`` (a phase, after the
    payloads) and the new state (its parameters kept when ``keep_theta`` or with a change)."""
    f, r, compression = op.f, op.round, op.compression
    shapes, dtypes, cd, C = run.shapes[f], run.fragment_dtypes(f), run.cfg.commit_dtype, run.chunk_elements
    assert all(dtypes[n] in ELEMENTWISE for n in shapes), "parameters are cast piece by piece"
    specs, ranges = chunk_specs(shapes, C), {n: layout.range(n, ranks.rank) for n in shapes}
    # Collectives, on every rank in this order: the master's chunks (and the previous parameters'
    # with a change) at their owners, the change's F8 scales, the new parameters back to their
    # holders, the outer state at its owners, the written chunks pooled.
    owned_master = ranks.gather(shapes, layout, C, master)
    owned_prev = ranks.gather(shapes, layout, C, st.theta) if cd is not None else {}
    scales: dict[str, int] = {}
    if cd == "F8_E4M3":

        def amax() -> dict[str, str]:
            out: dict[str, np.float32] = {}
            for k, pieces in owned_master.items():
                for (pc, m), (_, pv) in zip(pieces, owned_prev[k], strict=True):
                    a = quant.e4m3_amax(np.subtract(m, pv, dtype=np.float32))
                    out[pc.name] = max(out.get(pc.name, np.float32(0)), a)
            return {nm: float(a).hex() for nm, a in out.items()}

        for got in ranks.phase(amax):
            for nm, a in got.items():
                scales[nm] = max(scales.get(nm, 0), quant.e4m3_scale_byte(np.float32(float.fromhex(a))))
    keep = keep_theta or cd is not None
    local = {n: master[n] for n in ranges if cd is None and dtypes[n] == "F32"}  # the master's own arrays
    local |= alloc({n: r for n, r in ranges.items() if keep and n not in local}, shapes)
    theta: Owned = {}

    def build() -> bool:  # (a phase: a rank failing here fails the commit on every rank)
        for k, pieces in owned_master.items():
            theta[k] = []
            for i, (pc, m) in enumerate(pieces):
                values = m
                if cd is not None:
                    pf = owned_prev[k][i][1]
                    diff = np.subtract(m, pf, dtype=np.float32)
                    values = pf + quant.dequantize(quant.quantize(diff, cd, f8_scale=scales.get(pc.name)))
                elif dtypes[pc.name] == "F32":
                    theta[k].append((pc, m))
                    continue
                if dtypes[pc.name] != "F32":
                    values = quant.dequantize(quant.quantize(values, dtypes[pc.name]))
                lo, hi = ranges[pc.name]
                here = keep and lo <= pc.start and pc.stop <= hi
                dest = flat(local[pc.name])[pc.start - lo : pc.stop - lo] if here else np.empty(pc.size, np.float32)
                dest[...] = np.asarray(values, np.float32).reshape(-1)
                theta[k].append((pc, dest))
        return True

    ranks.phase(build)
    if keep:
        ranks.scatter(shapes, layout, C, theta, local)
    outer_shapes = run.outer_shapes(f)
    outer_specs = chunk_specs(outer_shapes, C)
    outer_local = {f"momentum/{n}": v for n, v in momentum.items()}
    if not run.master_is_theta(f):
        outer_local.update({f"master/{n}": v for n, v in master.items()})
    owned_outer = ranks.gather(outer_shapes, layout.renamed({o: tensor_of(o) for o in outer_shapes}), C, outer_local)

    def change(k: int) -> PayloadStream:
        values, parted = {}, {}
        for (pc, m), (_, pv) in zip(owned_master[k], owned_prev[k], strict=True):
            values[pc.name] = np.subtract(m, pv, dtype=np.float32)
            if pc.name in scales and not is_whole(pc, shapes):
                parted[pc.name] = scales[pc.name]
        assert cd is not None
        return encode_payload(
            values, cd, kind="change", compression=compression, chunk=specs[k], f8_scales=parted, stream=True
        )

    owners: dict[str, Owned] = {"theta": theta, "outer": owned_outer, "change": owned_master}
    makers: dict[str, Callable[[int, str], PayloadStream]] = {
        "theta": lambda k, z: _stream(theta[k], specs[k], dtypes, "theta", z),
        "outer": lambda k, z: _stream(owned_outer[k], outer_specs[k], "F32", "outer", z),
        "change": lambda k, z: change(k),
    }
    plan = write_plan(op.checkpoint, cd is not None, compression)
    jobs = [(kind, written, k) for kind, written in plan for k in owners[kind]]
    kept: dict[str, Any] = {}

    def write_all() -> list[list[Any]]:
        rows = []
        makes = [partial(makers[kind], k, compression if written else "") for kind, written, k in jobs]
        made = ordered(call, makes, threads=AHEAD if threaded else 0, queued=AHEAD + 1, drop=PayloadStream.close)
        try:
            for (kind, written, k), data in zip(jobs, made, strict=True):
                with data:
                    key = keys.round_blob_key(r, kind, data.sha256, compression if written else "")
                    if written and put is not None:
                        put(key, data)
                    elif written:
                        kept[key] = data.read()
                    rows.append([kind, written, k, data.sha256, len(data)])
        finally:
            made.close()
        return rows

    rows = sorted(tuple(row) for pooled in ranks.phase(write_all) for row in pooled)  # (kind, written, k, sha, size)
    counts = {"theta": len(specs), "change": len(specs), "outer": len(outer_specs)}
    refs: dict[str, PayloadRef] = {}
    shas: dict[tuple[str, bool], list[str]] = {}
    sizes: dict[str, int] = {}
    for kind, written in plan:
        done = [row for row in rows if row[:2] == (kind, written)]
        assert [row[2] for row in done] == list(range(counts[kind])), f"round {r}: {kind} chunks {done}"
        shas[kind, written] = [row[3] for row in done]
        if written:
            made_refs = [
                PayloadRef(key=keys.round_blob_key(r, kind, sha, compression), sha256=sha, size=n)
                for *_, sha, n in done
            ]
            refs[kind] = join_refs(made_refs)
            sizes.update({x.key: x.size for x in made_refs})
    theta_digest = digest_of(shas["theta", op.checkpoint and compression == ""])
    outer_digest = None if op.checkpoint else digest_of(shas["outer", False])
    cos = cosine()  # (summed on a worker meanwhile, for a large fragment held in memory)
    version = op.version + 1
    state = FragmentState(
        version, local if keep else master, master, momentum, version if op.checkpoint else st.checkpoint
    )
    checkpoint = None if op.checkpoint else st.checkpoint
    payloads = {key: kept[key] for key in sizes if key in kept}
    return Commit(
        refs, theta_digest, outer_digest, cos, op.final, checkpoint, state, local if keep_theta else {}, sizes, payloads
    )


def _stream(pieces: list[tuple[Any, np.ndarray]], s: Any, dtypes: Any, kind: str, z: str) -> PayloadStream:
    return encode_payload({pc.name: v for pc, v in pieces}, dtypes, kind=kind, compression=z, chunk=s, stream=True)
