"""The payloads of a commit (new parameters, quantized change, outer state), chunk by chunk, each
built and written by the rank that owns it (``chunk_owner``; one process owns all) from the pieces
the ranks hold (``Ranks.gather``), in ``write_plan``'s order; those not written are hashed for the
record's digests. A chunk's new parameters are ``cast(master)``, or with ``commit_dtype`` what a
learner rebuilds (``prev + dequantize(quantize(master - prev))``, cast), built in place where
this process holds the piece and sent back to the holders (``Ranks.scatter``). Pieces start on
32-element blocks, so F4/I2 quantize as over the whole tensor; an F8 change takes the whole
tensor's scale (the maximum of the ranks' maxima)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np

from ..ahead import call, ordered
from ..codec import quant
from ..codec.chunked import chunk_specs, stream_chunk
from ..codec.plan import is_whole
from ..codec.stream import ELEMENTWISE, PayloadStream
from ..protocol import keys
from ..protocol.layout import Layout
from ..protocol.records import PayloadRef, digest_of, join_refs
from ..protocol.run import RunInfo
from .fragment import CommitOp, FragmentState, Written
from .ranks import Owned, Ranks, alloc, flat
from .reading import tensor_of

AHEAD = 2  # payload chunks encoded and hashed ahead of the one being written (large fragments)

Put = Callable[[str, PayloadStream], object]
Arrays = Mapping[str, np.ndarray]


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
    *,
    keep: bool,
    put: Put | None,
    threaded: bool,
) -> tuple[dict[str, np.ndarray], dict[str, PayloadRef], str, str | None, dict[str, Any]]:
    """The commit's payloads, this rank's chunks written (or hashed; ``put`` None: their bytes kept,
    one process only): ``(new parameters of this process's ranges, kept when ``keep`` or with a
    change; refs by kind; theta_digest; outer_digest; payloads)``, from every rank's chunks."""
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
    keep = keep or cd is not None
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
        return stream_chunk(values, specs[k], cd, kind="change", compression=compression, f8_scales=parted)

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
    payloads: dict[str, Any] = {}
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
            payloads.update({x.key: kept.get(x.key, Written(x.size, x.sha256)) for x in made_refs})
    theta_digest = digest_of(shas["theta", op.checkpoint and compression == ""])
    outer_digest = None if op.checkpoint else digest_of(shas["outer", False])
    return local, refs, theta_digest, outer_digest, payloads


def _stream(pieces: list[tuple[Any, np.ndarray]], s: Any, dtypes: Any, kind: str, z: str) -> PayloadStream:
    return stream_chunk({pc.name: v for pc, v in pieces}, s, dtypes, kind=kind, compression=z)
