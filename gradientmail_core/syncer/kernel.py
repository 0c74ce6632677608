"""The closer: the one place a round's contributions are judged, merged and stepped, and the
commit's payloads written (``docs/protocol.md`` section 10; ``docs/sharding.md`` section 5).

A ``FragmentCloser`` works on the flat range of each tensor this process holds (``Layout``): one
process holds every tensor whole (``one_process``); each rank of a sharded node runs one over
the ranges its FSDP shards hold, the ranks meeting only in ``Ranks``' collectives, and the node
commits what one process commits, byte for byte. Every op runs on every rank at once.

- ``load``: a fragment's state at a checkpoint (or the initial parameters), its ranges read
  chunk by chunk from the payloads the record names.
- ``judge``: a contribution's chunks read (``reading.py``), verified, checked finite, and each
  tensor's squared norm summed (pooled over the ranks as leaves).
- ``commit``: the merge and outer step (``merging.py``) and the payloads (``writing.py``). The
  new state is pending until ``landed`` (its record was written): a commit whose record could not
  be written is made again from the state before it.

It reads contributions through its ``Spool``; what it keeps between rounds is each fragment's
state (``held``), dropped when another node commits the fragment (``forget``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..codec.chunked import chunk_specs
from ..config import RDA
from ..errors import MailboxUnavailable, MissingExtra, PayloadCorrupt
from ..protocol.chunks import Layout, numel
from ..protocol.records import PayloadRef, chunk_refs
from ..protocol.run import RunInfo
from ..protocol.store import RunStore
from .fragment import CommitOp, FragmentState, Lost, Made, Verdict
from .merging import Source, merge_and_step
from .ranks import OneProcess, Pooled, Ranks, whole_layout
from .reading import Ranges, contribution_cap, read_chunk, read_chunks, tensor_of, visits
from .spool import Spool
from .writing import Put, new_theta, write_payloads

# A fragment at least this large reads ahead and encodes its payloads on worker threads; a smaller
# one (a simulation's, a test's) inline, without starting threads.
THREADED_BYTES = 8 << 20


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
        self.reserved: dict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = {}

    @classmethod
    def one_process(cls, run: RunInfo, store: RunStore, spool: Spool | None = None) -> FragmentCloser:
        shapes = {n: s for f in range(run.P) for n, s in run.shapes[f].items()}
        return cls(run, store, OneProcess(), whole_layout(shapes), spool=spool or Spool(), keep_theta=True)

    # ---- what is held ------------------------------------------------------------------------

    def held(self, f: int) -> FragmentState | None:
        return self.states.get(f)

    def holds_any(self) -> bool:
        return bool(self.states or self.pending)

    def adopt(self, f: int, state: FragmentState) -> None:
        """Hold ``state`` as fragment ``f``'s (a state recovered or given by the caller)."""
        self.states[f] = state

    def forget(self, f: int, *, unless: int | None = None) -> None:
        """Let fragment ``f``'s state go, unless it is version ``unless`` (another node committed the
        fragment: the outer state held is stale, twice the fragment in fp32)."""
        st = self.states.get(f)
        if st is not None and st.version != unless:
            del self.states[f]
        self.pending.pop(f, None)
        self.reserved.pop(f, None)

    def ranges(self, f: int) -> dict[str, tuple[int, int]]:
        return {n: self.layout.range(n, self.ranks.rank) for n in self.run.shapes[f]}

    def _alloc(self, ranges: Ranges, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
        """Arrays for this process's ranges: a tensor held whole in its shape, a range flat."""
        out = {}
        for n, (lo, hi) in ranges.items():
            whole = (lo, hi) == (0, numel(shapes[n]))
            out[n] = np.empty(tuple(shapes[n]) if whole else hi - lo, np.float32)
        return out

    # ---- ops -------------------------------------------------------------------------------------

    def load(
        self,
        f: int,
        version: int,
        theta: PayloadRef,
        outer: PayloadRef | None,
        known: dict[str, np.ndarray] | None = None,
    ) -> FragmentState:
        """Fragment ``f`` at ``version`` from its parameters ``theta`` and outer state ``outer``
        (None: the initial parameters, zero momentum); ``known``: the parameters, read already."""
        ranges = self.ranges(f)
        self.forget(f)  # (a stale state is let go before the new one is read)

        loaded: list[FragmentState] = []

        def read() -> bool:
            loaded.append(self._load(f, version, theta, outer, known, ranges))
            return True

        self.ranks.phase(read)
        self.states[f] = loaded[0]
        return loaded[0]

    def _load(
        self,
        f: int,
        version: int,
        theta: PayloadRef,
        outer: PayloadRef | None,
        known: dict[str, np.ndarray] | None,
        ranges: Ranges,
    ) -> FragmentState:
        run = self.run
        params = known if known is not None else self._read(theta, run.shapes[f], run.fragment_dtypes(f), ranges)
        if outer is None:
            return FragmentState.initial(params)
        state = self._read(outer, run.outer_shapes(f), "F32", ranges)
        master, momentum = run.split_outer(f, state, params)
        if not self.keep_theta and run.cfg.commit_dtype is None:
            params = master  # only a change is computed from the parameters: none is, so keep no copy
        return FragmentState(version, params, master, momentum, checkpoint=version)

    def _read(
        self, ref: PayloadRef, shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, str] | str, ranges: Ranges
    ) -> dict[str, np.ndarray]:
        specs = chunk_specs(shapes, self.run.chunk_elements)
        refs = chunk_refs(ref)
        if len(refs) != len(specs):
            raise PayloadCorrupt(f"{ref.key} names {len(refs)} chunks, the plan has {len(specs)}")
        dt = dict.fromkeys(shapes, dtypes) if isinstance(dtypes, str) else dict(dtypes)
        out = self._alloc({n: ranges[tensor_of(n)] for n in shapes}, shapes)
        for k, clipped in visits(specs, ranges, self.ranks.rank):
            s = specs[k]
            got = read_chunk(
                self.store, None, refs[k], s, dtypes={p.name: dt[p.name] for p in s.pieces}, max_bytes=None, round=0
            )
            if got is None:
                raise MailboxUnavailable(f"{refs[k].key} is gone; newer commits exist")
            for pc, a, b in clipped:
                lo = ranges[tensor_of(pc.name)][0]
                out[pc.name].reshape(-1)[pc.start - lo : pc.stop - lo] = got[pc.name][a:b]
        return out

    def judge(self, f: int, round: int, ref: PayloadRef) -> Verdict:
        """A contribution to fragment ``f`` read chunk by chunk (into the spool), checked finite and
        each tensor's squared norm summed: its status and norms, pooled over the ranks."""
        run, ranges = self.run, self.ranges(f)
        shapes = run.shapes[f]
        dots = Pooled("dot", {n: numel(s) for n, s in shapes.items()}, ranges)
        planned = visits(chunk_specs(shapes, run.chunk_elements), ranges, self.ranks.rank)

        def read() -> dict[str, Any]:
            dots.start()
            finite = True

            def feed(name: str, v: np.ndarray) -> None:
                nonlocal finite
                finite = finite and bool(np.isfinite(v).all())
                dots.feed(name, v)

            failed = read_chunks(self.store, self.spool, run, f, ref, round, planned, feed)
            if failed is not None:
                return {"fail": list(failed)}
            return {"finite": finite, "dots": dots.wire()}

        pooled = self.ranks.phase(read)
        fails = [p["fail"] for p in pooled if "fail" in p]
        if fails:
            return Verdict(min(fails, key=lambda x: x[0])[1])  # the first chunk that failed decides
        return Verdict("ok", all(p["finite"] for p in pooled), dots.totals([p["dots"] for p in pooled]))

    def reserve(self, f: int) -> None:
        """Allocate the arrays a commit of fragment ``f`` writes the new master and momentum into,
        and touch every page of them now (with the first accepted contribution): the page faults of
        8 bytes per parameter of fresh memory are paid while contributions arrive, not after quorum."""
        if f not in self.reserved:
            shapes, ranges = self.run.shapes[f], self.ranges(f)
            pair = self._alloc(ranges, shapes), self._alloc(ranges, shapes)
            for arrays in pair:
                for a in arrays.values():
                    a.fill(0)
            self.reserved[f] = pair

    def commit(self, op: CommitOp, put: Put | None) -> Made:
        """Merge ``op``'s contributions, take the outer step and write the payloads (``put``; None:
        keep their bytes). ``Lost`` when a contribution can no longer be read."""
        run, f = self.run, op.f
        st = self.states.get(f)

        def check() -> bool:
            if st is None or st.version != op.version:
                have = None if st is None else st.version
                raise MailboxUnavailable(
                    f"fragment {f}: this process holds version {have} of the outer state, not {op.version}"
                )
            return True

        self.ranks.phase(check)
        assert st is not None
        self.pending.pop(f, None)  # a commit whose record did not land: made again from ``st``
        shapes, ranges = run.shapes[f], self.ranges(f)
        specs = chunk_specs(shapes, run.chunk_elements)
        cap = contribution_cap(run, f, len(specs))
        dtypes, in_memory = run.delta_dtypes(f), len(specs) == 1
        refs = [list(a.refs) for a in op.accepted]

        def chunk(i: int, k: int) -> dict[str, np.ndarray]:
            ref = refs[i][k]
            try:
                got = read_chunk(
                    self.store,
                    self.spool,
                    ref,
                    specs[k],
                    dtypes=dtypes,
                    max_bytes=cap,
                    round=op.round,
                    decoded=in_memory,
                )
            except (PayloadCorrupt, MissingExtra) as e:
                raise Lost(i, "corrupt", f"{ref.key}: {e}") from e
            if got is None:
                raise Lost(i, "missing", f"{ref.key} is gone")
            return got

        threaded = run.fragment_bytes(f) >= THREADED_BYTES
        source = Source(chunk, in_memory=in_memory, threaded=threaded)
        out = self.reserved.pop(f, None) or (self._alloc(ranges, shapes), self._alloc(ranges, shapes))
        try:
            master, momentum, cosine = merge_and_step(
                run.cfg,
                self.ranks,
                shapes,
                ranges,
                visits(specs, ranges, self.ranks.rank),
                self._split(f, len(specs)),
                source,
                op.accepted,
                st,
                op.final,
                out,
            )
        except BaseException:
            self.reserved[f] = out  # nothing was committed: the next attempt writes every element again
            raise
        theta, built = new_theta(run, self.ranks, self.layout, f, st, master, keep=self.keep_theta)
        refs_, theta_digest, outer_digest, payloads = write_payloads(
            run,
            self.ranks,
            self.layout,
            f,
            op.round,
            momentum,
            master,
            built,
            checkpoint=op.checkpoint,
            compression=op.compression,
            put=put,
            threaded=threaded,
        )
        kept = theta if self.keep_theta or run.cfg.commit_dtype is not None else master
        version = op.version + 1
        state = FragmentState(version, kept, master, momentum, version if op.checkpoint else st.checkpoint)
        self.pending[f] = state
        return Made(refs_, theta_digest, outer_digest, cosine, payloads, state, theta if self.keep_theta else {})

    def _split(self, f: int, chunks: int) -> set[str]:
        """The radial tensors whose merged norm a pass of its own sums: those spanning chunks, or
        not held whole by any one rank."""
        merge, shapes = self.run.cfg.merge, self.run.shapes[f]
        if not isinstance(merge, RDA):
            return set()
        plan = self.run.plan(f)
        spans = {n for n in shapes if sum(any(p.name == n for p in pieces) for pieces in plan) > 1}
        whole = {
            n
            for n, s in shapes.items()
            if any(self.layout.range(n, r) == (0, numel(s)) for r in range(self.layout.world))
        }
        return {n for n in shapes if not merge.is_direct(n) and (n in spans or n not in whole)}

    def landed(self, f: int, version: int) -> None:
        """The record of this process's commit of fragment ``f`` at ``version`` is written."""
        st = self.pending.get(f)
        if st is not None and st.version == version:
            self.states[f] = self.pending.pop(f)

    def close(self) -> None:
        self.spool.close()
