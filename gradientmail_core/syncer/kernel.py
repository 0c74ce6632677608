"""The closer: the one place a round's contributions are judged, merged and stepped, and the
commit's payloads written (``docs/protocol.md`` section 10; ``docs/sharding.md`` section 5).

A ``FragmentCloser`` works on the flat range of each tensor this process holds: every tensor
whole in one process (``one_process``), or on each rank of a sharded node the ranges of its
shards, the ranks meeting only in ``Ranks`` (``ranks.py``). Its ops: ``load`` (a fragment's
state at a checkpoint), ``judge`` (a contribution read into the spool, checked finite, its
squared norms summed), ``commit`` (``merging.py``, then ``writing.py``; the new state pending
until ``landed``: a commit whose record was not written is made again from the state before it).
It keeps each fragment's state (``states``, let go by ``forget`` when another node commits the
fragment) and the contributions of the rounds it closes (``spool``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..aggregators.leaves import Pooled
from ..codec.chunked import ChunkSpec, chunk_specs
from ..codec.plan import Piece, numel
from ..config import RDA
from ..errors import MailboxUnavailable, MissingExtra, PayloadCorrupt, PayloadLayoutMismatch
from ..protocol.layout import Layout
from ..protocol.records import PayloadRef, chunk_refs
from ..protocol.run import RunInfo
from ..protocol.store import RunStore
from .fragment import CommitOp, FragmentState, Lost, Made, Verdict, discard
from .merging import Source, Span, merge_and_step
from .ranks import OneProcess, Ranks, alloc, flat, whole_layout
from .reading import Visit, contribution_cap, read_chunk, tensor_of, visits
from .spool import Spool
from .writing import Put, write_commit

# A process holding at least this much of a fragment (float32) reads ahead and encodes its payloads
# on worker threads; one holding less (a simulation's, a test's, a rank's small shards) inline,
# without starting threads (each worker's malloc arena costs a training rank a few MiB).
THREADED_BYTES = 8 << 20
Arrays = dict[str, np.ndarray]


class _Failed(Exception):
    """Chunk ``k`` could not be read (``status``: ``missing``, ``corrupt``, ``schema``)."""

    def __init__(self, k: int, status: str, cause: Exception | None = None) -> None:
        self.k, self.status, self.cause = k, status, cause


class FragmentCloser:
    """One process's part of closing rounds (module docstring). ``keep_theta``: keep each
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
    def one_process(cls, run: RunInfo, store: RunStore, spool: Spool | None = None) -> FragmentCloser:
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

    def commit(self, op: CommitOp, put: Put | None) -> Made:
        """Merge ``op``'s contributions, take the outer step and write the payloads (``put``; None:
        keep their bytes). ``Lost`` when a contribution can no longer be read."""
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
        theta, refs, theta_digest, outer_digest, payloads = write_commit(
            run, self.ranks, self.layout, op, st, master, momentum, keep=self.keep_theta, put=put, threaded=threaded
        )
        cosine = cosine_of()  # (summed on a worker meanwhile, for a large fragment held in memory)
        version = op.version + 1
        kept = theta if self.keep_theta or run.cfg.commit_dtype is not None else master
        self.pending[f] = FragmentState(version, kept, master, momentum, version if op.checkpoint else st.checkpoint)
        return Made(
            refs, theta_digest, outer_digest, cosine, payloads, self.pending[f], theta if self.keep_theta else {}
        )

    def landed(self, f: int, version: int) -> None:
        """The record of this process's commit of fragment ``f`` at ``version`` is written."""
        self.ranks.begin("landed", f=f, version=version)
        if f in self.pending and self.pending[f].version == version:
            self.states[f] = self.pending.pop(f)

    def close(self) -> None:
        self.spool.close()


def _pair(span: Span) -> tuple[Arrays, Arrays]:
    return alloc(span.ranges, span.shapes), alloc(span.ranges, span.shapes)
