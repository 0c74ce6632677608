"""A sharded node that closes rounds: every rank judges, merges and steps the part of each fragment
it holds, and the node commits what a one-process closer commits, byte for byte
(``docs/sharding.md``, section 5).

Rank 0's node runs the election, the quorum and the records as any closer (``syncer/closing.py``).
Where a one-process closer reads, merges or writes tensors, rank 0 hands the work to every rank
(``leading.ShardCloser``: the op goes down the ``down`` channel; each rank > 0 runs it on its
closer thread, rank 0 on its node thread) and the ranks run it together (``RankCloser``, here),
talking on a gloo group of their own (``pooling.Comm``):

- **What a rank holds**: of each tensor of the fragment, the flat range its FSDP2 shard holds
  (``ShardedParams.layout``): the outer state (master and momentum, float32) and the parameters of that
  range only. A node of ``ws`` ranks holds one closer's state in all, ``1/ws`` of it per rank.
- **Reading**: a rank reads (spool first, as ``streamed.read_chunk``) every chunk of a payload its
  ranges overlap, and uses the part inside them; a chunk that straddles two ranks is read by both.
- **Whole-tensor quantities** (norms for clipping, outliers, RDA; the cosine): each rank sums the
  reduction leaves inside its ranges and keeps the values of the leaves its ranges cut
  (``leaves.LeafRange``); the ranks pool them (``pooling.Comm.phase``) and sum each cut leaf over its
  elements joined (``leaves.combine_leaves``): the one-process sums, bit for bit. F8 scales take
  the maximum of the ranks' maxima (exact).
- **Payloads**: the theta, change and outer chunks are built by their owners (``chunk_owner``, as
  for a contribution), from the pieces the ranks hold (``gather_chunks`` on the closer's group),
  with ``streamed.py``'s arithmetic piece by piece; each owner writes its chunks and the ranks pool
  the refs; rank 0 writes the record once every chunk landed. The new parameters go back to their
  holders (``scatter_chunks``) as the ranks' next state.

Every op ends with the ranks agreeing on the outcome: a rank that fails (a store error, a chunk
gone) fails the op on every rank at the same phase, and rank 0 raises what the one-process closer
would (``MailboxUnavailable``: the node tries again on its next poll).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..adapters.torch_sharded import ShardedParams, gather_chunks, scatter_chunks
from ..aggregators import outer as outer_mod
from ..aggregators.fused import cosine_from
from ..aggregators.leaves import cosine_range, dot_range, dot_total
from ..codec import quant
from ..codec.chunked import ChunkSpec, chunk_specs, stream_chunk
from ..codec.stream import ELEMENTWISE
from ..errors import MailboxUnavailable, MissingExtra, PayloadCorrupt
from ..protocol import keys
from ..protocol.chunks import Piece, is_whole, numel
from ..protocol.records import PayloadRef, join_refs
from ..protocol.run import RunInfo, payload_cap
from ..protocol.store import CHUNK_HEADER_ALLOWANCE, RunStore
from ..syncer.closer import FragmentState
from ..syncer.spool import Spool
from ..syncer.streamed import Visit, _merge_chunk, merge_scales, merge_terms, read_chunk, read_chunks, write_plan
from .pooling import Comm, Lost, Pooled, hexf, ref_unwire, unhexf

_log = logging.getLogger(__name__)

Ranges = dict[str, tuple[int, int]]


class RankCloser:
    """What one rank of a closing sharded node holds and does (module docstring). Every method
    named after an op runs on every rank at once."""

    def __init__(
        self,
        run: RunInfo,
        store: RunStore,
        comm: Comm,
        sharded: ShardedParams,
    ) -> None:
        self.run, self.store, self.comm = run, store, comm
        self.rank, self.world = comm.rank, comm.world
        c = run.chunk_elements
        assert c is not None, "a sharded node joins chunked runs only"
        self.C = int(c)
        self.shapes = dict(sharded.shapes)
        self.layout = sharded.layout
        self.states: dict[int, FragmentState] = {}  # this rank's ranges of each fragment it closed
        # The state a commit started from, until rank 0 says its record landed (``landed``): a
        # commit whose record could not be written is computed again from it.
        self.previous: dict[int, FragmentState] = {}
        self.spool = Spool()
        # gather/scatter of payload pieces between holders and owners, on the closer's group
        self.frag = ShardedParams({}, self.shapes, self.world, self.rank, comm.group, self.layout)
        outer = {f"{p}/{n}": n for n in self.shapes for p in ("momentum", "master")}
        self.outer = ShardedParams(
            {},
            {o: self.shapes[n] for o, n in outer.items()},
            self.world,
            self.rank,
            comm.group,
            self.layout.renamed(outer),
        )

    # ---- layout ------------------------------------------------------------------------

    def ranges(self, f: int) -> Ranges:
        return {n: self.layout.range(n, self.rank) for n in self.run.shapes[f]}

    def visits(self, specs: Sequence[ChunkSpec], ranges: Mapping[str, tuple[int, int]]) -> list[Visit]:
        """The chunks whose pieces overlap ``ranges`` (names of other payloads map to their
        tensor's range: ``momentum/x`` is ``x``'s), each piece clipped; a chunk of empty pieces
        only is read by rank 0."""
        out: list[Visit] = []
        for s in specs:
            clipped = []
            for pc in s.pieces:
                lo, hi = ranges[_tensor(pc.name)]
                a, b = max(pc.start, lo), min(pc.stop, hi)
                if a < b:
                    clipped.append((Piece(pc.name, a, b), a - pc.start, b - pc.start))
            if clipped or (self.rank == 0 and all(pc.size == 0 for pc in s.pieces)):
                out.append((s.k, clipped))
        return out

    def _read(self, ref: PayloadRef, s: ChunkSpec, dtypes: Mapping[str, str], cap: int | None, round: int, spool: bool):
        return read_chunk(self.store, self.spool if spool else None, ref, s, dtypes=dtypes, max_bytes=cap, round=round)

    # ---- ops -----------------------------------------------------------------------------

    def run_op(self, op: Mapping[str, Any]) -> Any:
        kind = op["op"]
        if "round" in op:
            self.spool.drop_through(int(op["round"]) - 1)
        if kind == "state":
            return self.state(op)
        if kind == "judge":
            return self.judge(op)
        if kind == "commit":
            return self.commit(op)
        if kind == "landed":  # (no collective: every rank just lets the state before go)
            f = int(op["f"])
            if f in self.states and self.states[f].version == int(op["version"]):
                self.previous.pop(f, None)
            return None
        raise AssertionError(f"unknown closer op {kind!r}")

    def state(self, op: Mapping[str, Any]) -> int:
        """This rank's ranges of fragment ``f`` at ``version``: kept from its own commit, or read
        from the theta (and outer-state) chunks the record names."""
        f, version = int(op["f"]), int(op["version"])

        def load() -> bool:
            self.states.pop(f, None)  # (a stale state is let go before the new one is read)
            self.previous.pop(f, None)
            self.states[f] = self._load(f, version, op["theta"], op.get("outer"))
            return True

        self.comm.phase(load)
        return version

    def _load(self, f: int, version: int, theta_refs: Sequence[Any], outer_refs: Sequence[Any] | None) -> FragmentState:
        run, ranges = self.run, self.ranges(f)
        theta = self._read_ranges(
            [ref_unwire(r) for r in theta_refs], run.shapes[f], run.fragment_dtypes(f), ranges, what="parameters"
        )
        if outer_refs is None:
            return FragmentState.initial(theta)
        outer = self._read_ranges(
            [ref_unwire(r) for r in outer_refs], run.outer_shapes(f), "F32", ranges, what="outer state"
        )
        master, momentum = run.split_outer(f, outer, theta)
        if run.cfg.commit_dtype is None:
            theta = master  # only a change is computed from the parameters: none is, so keep no copy
        return FragmentState(version, theta, master, momentum, checkpoint=version)

    def _read_ranges(
        self,
        refs: Sequence[PayloadRef],
        shapes: Mapping[str, tuple[int, ...]],
        dtypes: Mapping[str, str] | str,
        ranges: Ranges,
        *,
        what: str,
    ) -> dict[str, np.ndarray]:
        specs = chunk_specs(shapes, self.C)
        if len(refs) != len(specs):
            raise PayloadCorrupt(f"the {what} name {len(refs)} chunks, the plan has {len(specs)}")
        dt = dict.fromkeys(shapes, dtypes) if isinstance(dtypes, str) else dict(dtypes)
        out = {n: np.empty(ranges[_tensor(n)][1] - ranges[_tensor(n)][0], np.float32) for n in shapes}
        for k, clipped in self.visits(specs, ranges):
            got = self._read(refs[k], specs[k], {p.name: dt[p.name] for p in specs[k].pieces}, None, 0, False)
            if got is None:
                raise MailboxUnavailable(f"the {what} chunk {refs[k].key} is gone; newer commits exist")
            for pc, a, b in clipped:
                lo = ranges[_tensor(pc.name)][0]
                out[pc.name][pc.start - lo : pc.stop - lo] = got[pc.name][a:b]
        return out

    def judge(self, op: Mapping[str, Any]) -> dict[str, Any]:
        """``streamed.judge_payload`` over this rank's ranges; the verdict pooled over the ranks."""
        f, r = int(op["f"]), int(op["round"])
        shapes = self.run.shapes[f]
        ref = join_refs([ref_unwire(x) for x in op["refs"]])
        ranges = self.ranges(f)
        dots = Pooled("dot", {n: numel(s) for n, s in shapes.items()}, {})

        def local() -> dict[str, Any]:
            dots.ranges = {n: dot_range(numel(s), *ranges[n]) for n, s in shapes.items()}
            finite = True

            def feed(name: str, v: np.ndarray) -> None:
                nonlocal finite
                finite = finite and bool(np.isfinite(v).all())
                dots.ranges[name].feed(v)

            visits = self.visits(chunk_specs(shapes, self.C), ranges)
            failed = read_chunks(self.store, self.spool, self.run, f, ref, r, visits, feed)
            if failed is not None:
                return {"fail": list(failed)}
            return {"finite": finite, "dots": dots.wire()}

        pooled = self.comm.phase(local)
        fails = [p["fail"] for p in pooled if "fail" in p]
        if fails:
            return {"status": min(fails, key=lambda x: x[0])[1]}
        leaves = dots.leaves([p["dots"] for p in pooled])
        norms = {n: hexf(dot_total(dots.sizes[n], leaves[n])) for n in shapes}
        return {"status": "ok", "finite": all(p["finite"] for p in pooled), "norms": norms}

    # ---- the commit ----------------------------------------------------------------------

    def commit(self, op: Mapping[str, Any]) -> dict[str, Any]:
        """``streamed.commit_by_chunks``'s merge, outer step and payloads over this rank's ranges."""
        f, r = int(op["f"]), int(op["round"])
        st = self.states.get(f)
        version = int(op["version"])
        before = self.previous.get(f)
        if st is not None and st.version != version and before is not None and before.version == version:
            st = before  # the record of the last commit did not land: compute it again, from the same state
        self.comm.phase(lambda: _check_state(st, f, version))
        assert st is not None
        accepted = [
            ([ref_unwire(x) for x in a[0]], unhexf(a[1]), {n: unhexf(v) for n, v in a[2].items()})
            for a in op["accepted"]
        ]
        final, checkpoint, compression = bool(op["final"]), bool(op["checkpoint"]), str(op["compression"])
        master, momentum, cosine = self._merge_and_step(f, r, st, accepted, final)
        theta, parts = self._payloads(f, r, st, master, momentum, checkpoint=checkpoint, compression=compression)
        self.previous[f] = st
        self.states[f] = FragmentState(
            version + 1, theta, master, momentum, version + 1 if checkpoint else st.checkpoint
        )
        return {"parts": parts, "cosine": None if cosine is None else hexf(cosine)}

    def _merge_and_step(
        self,
        f: int,
        r: int,
        st: FragmentState,
        accepted: list[tuple[list[PayloadRef], float, dict[str, float]]],
        final: bool,
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], float | None]:
        """``streamed._merge_and_step`` over this rank's ranges: the same scales, norms and steps;
        every whole-tensor quantity pooled over the ranks."""
        run, cfg = self.run, self.run.cfg
        shapes = run.shapes[f]
        names = list(shapes)
        sizes = {n: numel(s) for n, s in shapes.items()}
        ranges = self.ranges(f)
        specs = chunk_specs(shapes, self.C)
        dtypes = run.delta_dtypes(f)
        cap = payload_cap(run, f) + CHUNK_HEADER_ALLOWANCE * (len(specs) - 1)
        visits = self.visits(specs, ranges)
        n = len(accepted)
        sq = [norms for _, _, norms in accepted]
        p, clips, units, radial = merge_terms(cfg, names, [w for _, w, _ in accepted], sq)

        def chunk(i: int, k: int, clipped: list[tuple[Piece, int, int]]) -> dict[str, np.ndarray]:
            ref = accepted[i][0][k]
            try:
                got = self._read(ref, specs[k], dtypes, cap, r, True)
            except (PayloadCorrupt, MissingExtra) as e:
                raise Lost(i, "corrupt", f"{ref.key}: {e}") from e
            if got is None:
                raise Lost(i, "missing", f"{ref.key} is gone")
            return {pc.name: got[pc.name][a:b] for pc, a, b in clipped}

        # Pass 0 (RDA with clipping): the norms of the clipped contributions' radial tensors.
        x_sq: list[dict[str, float]] = [{name: sq[i][name] for name in radial} for i in range(n)]
        clipped_i = [i for i in range(n) if clips[i] is not None]
        if radial and clipped_i:
            pooled = {i: Pooled("dot", {nm: sizes[nm] for nm in radial}, {}) for i in clipped_i}

            def pass0() -> dict[str, Any]:
                for i in clipped_i:
                    pooled[i].ranges = {nm: dot_range(sizes[nm], *ranges[nm]) for nm in radial}
                for k, clipped in visits:
                    mine = [c for c in clipped if c[0].name in radial]
                    if not mine:
                        continue
                    for i in clipped_i:
                        got = chunk(i, k, mine)
                        for pc, _, _ in mine:
                            pooled[i].ranges[pc.name].feed(got[pc.name] * clips[i])
                return {str(i): pooled[i].wire() for i in clipped_i}

            everyone = self.comm.phase(pass0)
            for i in clipped_i:
                leaves = pooled[i].leaves([e[str(i)] for e in everyone])
                x_sq[i] = {nm: dot_total(sizes[nm], leaves[nm]) for nm in radial}
        scales, radius = merge_scales(names, radial, p, x_sq)
        # Pass 1 (RDA): each radial tensor's merged norm (a tensor split over ranks needs the others'
        # leaves, so every radial tensor takes this pass here, not only those spanning chunks).
        direction: dict[str, float] = {}
        if radial:
            dirs = Pooled("dot", {nm: sizes[nm] for nm in radial}, {})

            def pass1() -> dict[str, Any]:
                dirs.ranges = {nm: dot_range(sizes[nm], *ranges[nm]) for nm in radial}
                for k, clipped in visits:
                    mine = [c for c in clipped if c[0].name in radial]
                    if not mine:
                        continue
                    wanted = [pc for pc, _, _ in mine]
                    merged = _merge_chunk((chunk(i, k, mine) for i in range(n)), wanted, scales, clips, None, None)
                    for pc, v in zip(wanted, merged, strict=True):
                        dirs.ranges[pc.name].feed(v)
                return dirs.wire()

            leaves = dirs.leaves(self.comm.phase(pass1))
            direction = {nm: math.sqrt(dot_total(sizes[nm], leaves[nm])) for nm in radial}
        # Pass 2: merge every chunk (with the cosine's sums), scale, step.
        lr, beta = cfg.outer_lr, cfg.outer_momentum
        new_master = {nm: np.empty(hi - lo, np.float32) for nm, (lo, hi) in ranges.items()}
        new_momentum = {nm: np.empty(hi - lo, np.float32) for nm, (lo, hi) in ranges.items()} if not final else {}
        cos = Pooled("cosine", dict(sizes), {})

        def pass2() -> dict[str, Any]:
            cos.ranges = {nm: cosine_range(sizes[nm], *ranges[nm]) for nm in names} if units is not None else {}
            for k, clipped in visits:
                pieces = [pc for pc, _, _ in clipped]
                merged = _merge_chunk(
                    (chunk(i, k, clipped) for i in range(n)), pieces, scales, clips, units, cos.ranges or None
                )
                for pc, v in zip(pieces, merged, strict=True):
                    name = pc.name
                    scale: np.float32 | None = None
                    if name in radial:
                        if direction[name] == 0.0:
                            v.fill(0)
                        else:
                            scale = np.float32(radius[name] / direction[name])
                    lo = ranges[name][0]
                    a, b = pc.start - lo, pc.stop - lo
                    m_old = np.asarray(st.master[name], np.float32).reshape(-1)[a:b]
                    nm = new_master[name][a:b]
                    if final:
                        outer_mod.final_step_tensor(m_old, v, scale=scale, out=nm, name=name)
                    else:
                        mo_old = np.asarray(st.momentum[name], np.float32).reshape(-1)[a:b]
                        outer_mod.outer_step_tensor(
                            m_old,
                            mo_old,
                            v,
                            lr=lr,
                            beta=beta,
                            scale=scale,
                            out=(nm, new_momentum[name][a:b]),
                            name=name,
                        )
            return cos.wire() if units is not None else {}

        pooled2 = self.comm.phase(pass2)
        cosine = cosine_from(units, cos.leaves(pooled2) if units is not None else {}, n)
        momentum = st.momentum if final else new_momentum
        return new_master, momentum, cosine

    def _payloads(
        self,
        f: int,
        r: int,
        st: FragmentState,
        master: dict[str, np.ndarray],
        momentum: dict[str, np.ndarray],
        *,
        checkpoint: bool,
        compression: str,
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The theta, change and outer chunks this rank owns, built from the pieces the ranks
        hold and written (the ones the record names); this rank's new parameters; each chunk's
        ``(sha256, size)`` by ``kind/written``, pooled."""
        run, cfg = self.run, self.run.cfg
        shapes, dtypes, cd = run.shapes[f], run.fragment_dtypes(f), cfg.commit_dtype
        names = list(shapes)
        specs = chunk_specs(shapes, self.C)
        outer_shapes = run.outer_shapes(f)
        outer_specs = chunk_specs(outer_shapes, self.C)
        for name in names:
            if dtypes[name] not in ELEMENTWISE:
                raise AssertionError(f"parameters of dtype {dtypes[name]} are not cast piece by piece")

        def tensors(values: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
            return {nm: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for nm, v in values.items()}

        # Collectives (on every rank, in this order): the master's chunks (and the previous
        # parameters' with commit_dtype) at their owners, then the change's F8 scales.
        owned_master = gather_chunks(self.frag, names, self.C, tensors(master))
        owned_prev = gather_chunks(self.frag, names, self.C, tensors(st.theta)) if cd is not None else {}
        change_scales: dict[str, int] = {}
        if cd == "F8_E4M3":

            def amax() -> dict[str, str]:
                out: dict[str, np.float32] = {}
                for k, pieces in owned_master.items():
                    for (pc, m), (_, pv) in zip(pieces, owned_prev[k], strict=True):
                        diff = np.subtract(m.numpy(), pv.numpy(), dtype=np.float32)
                        out[pc.name] = max(out.get(pc.name, np.float32(0)), quant.e4m3_amax(diff))
                return {nm: hexf(a) for nm, a in out.items()}

            most: dict[str, float] = {}
            for got in self.comm.phase(amax):
                for nm, a in got.items():
                    most[nm] = max(most.get(nm, 0.0), unhexf(a))
            change_scales = {nm: quant.e4m3_scale_byte(np.float32(a)) for nm, a in most.items()}
        # Each owned chunk: the new parameters (with commit_dtype, rebuilt from the quantized
        # change, as a learner does) and the change, piece by piece (``streamed._new_theta``).
        # (A phase: a rank failing here fails the op on every rank before the collectives below.)
        theta_owned: dict[int, list[tuple[Piece, torch.Tensor]]] = {}
        change_owned: dict[int, dict[str, np.ndarray]] = {}

        def build() -> bool:
            for k, pieces in owned_master.items():
                s = specs[k]
                chunk_theta: list[tuple[Piece, torch.Tensor]] = []
                change: dict[str, np.ndarray] = {}
                for i, (pc, m) in enumerate(pieces):
                    mf = m.numpy()
                    if cd is None:
                        values = mf
                    else:
                        pf = owned_prev[k][i][1].numpy()
                        diff = np.subtract(mf, pf, dtype=np.float32)
                        change[pc.name] = diff.reshape(s.expected[pc.name])
                        values = pf + quant.dequantize(quant.quantize(diff, cd, f8_scale=change_scales.get(pc.name)))
                    if dtypes[pc.name] != "F32":
                        values = quant.dequantize(quant.quantize(values, dtypes[pc.name]))
                    chunk_theta.append((pc, torch.from_numpy(np.ascontiguousarray(values, np.float32).reshape(-1))))
                theta_owned[k] = chunk_theta
                change_owned[k] = change
            return True

        self.comm.phase(build)
        # The new parameters of this rank's ranges, kept for the next change (with commit_dtype:
        # collective, every owner sends each holder its part); without a change they are not read
        # again, and the master stands for them.
        theta = master
        if cd is not None:
            theta = {nm: np.empty(hi - lo, np.float32) for nm, (lo, hi) in self.ranges(f).items()}
            scatter_chunks(self.frag, names, self.C, theta_owned, tensors(theta))  # (views of ``theta``)
        # The outer state's chunks at their owners.
        outer_local = {f"momentum/{nm}": v for nm, v in momentum.items()}
        if not run.master_is_theta(f):
            outer_local.update({f"master/{nm}": v for nm, v in master.items()})
        owned_outer = gather_chunks(self.outer, list(outer_shapes), self.C, tensors(outer_local))

        def write_all() -> dict[str, dict[str, list[Any]]]:
            out: dict[str, dict[str, list[Any]]] = {}

            def put(kind: str, written: bool, s: ChunkSpec, stream: Any) -> None:
                with stream as data:
                    zip_ = compression if written else ""
                    key = keys.round_blob_key(r, kind, data.sha256, zip_)
                    if written:
                        self.store.put_blob(key, data)
                    out.setdefault(f"{kind}/{int(written)}", {})[str(s.k)] = [data.sha256, len(data)]

            plan = write_plan(checkpoint, cd is not None, compression)
            for kind, written in plan:
                zip_ = compression if written else ""
                if kind == "theta":
                    for k, pieces in theta_owned.items():
                        s = specs[k]
                        values = {pc.name: t.numpy().reshape(s.expected[pc.name]) for pc, t in pieces}
                        put(kind, written, s, stream_chunk(values, s, dtypes, kind="theta", compression=zip_))
                elif kind == "outer":
                    for k, pieces in owned_outer.items():
                        s = outer_specs[k]
                        values = {pc.name: t.numpy().reshape(s.expected[pc.name]) for pc, t in pieces}
                        put(kind, written, s, stream_chunk(values, s, "F32", kind="outer", compression=zip_))
                else:
                    assert cd is not None
                    for k, change in change_owned.items():
                        s = specs[k]
                        parted = {
                            nm: change_scales[nm]
                            for nm in change
                            if nm in change_scales and not is_whole(_piece(s, nm), shapes)
                        }
                        put(
                            kind,
                            written,
                            s,
                            stream_chunk(change, s, cd, kind="change", compression=zip_, f8_scales=parted),
                        )
            return out

        pooled = self.comm.phase(write_all)
        parts: dict[str, dict[str, list[Any]]] = {}
        for got in pooled:
            for kind, chunks in got.items():
                parts.setdefault(kind, {}).update(chunks)
        return theta, parts


def _piece(s: ChunkSpec, name: str) -> Piece:
    return next(pc for pc in s.pieces if pc.name == name)


def _tensor(name: str) -> str:
    """The fragment tensor a payload's tensor name stands for (``momentum/x`` -> ``x``)."""
    head, _, rest = name.partition("/")
    return rest if head in ("momentum", "master") and rest else name


def _check_state(st: FragmentState | None, f: int, version: int) -> bool:
    if st is None or st.version != version:
        have = None if st is None else st.version
        raise MailboxUnavailable(f"fragment {f}: this rank holds version {have} of the outer state, not {version}")
    return True
