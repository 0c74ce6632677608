"""An independent reference for a commit: what a closer must commit for a round, computed over
whole tensors in memory with the definitions (``merge_with_cosine`` here: ``aggregators/merge.py``'s
merge, tensor by tensor through ``fused.merge_tensor``, a code path of its own, ``outer.outer_step_tensor``, ``rebuild.cast``/``rebuild_theta``,
``codec.payload.encode_payload`` with ``chunk=``). The engine's merger (``syncer/merger.py``) merges chunk by
chunk and range by range; tests hold its payloads, digests, cosine and state to this, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gradientmail_core.aggregators import fused
from gradientmail_core.aggregators.merge import Delta, clip, normalized
from gradientmail_core.aggregators.outer import drop_pullback, final_step_tensor, outer_step_tensor
from gradientmail_core.codec.header import sha256_hex
from gradientmail_core.codec.payload import encode_payload
from gradientmail_core.codec.plan import chunk_specs
from gradientmail_core.config import RDA, WeightedMean
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.rebuild import cast, rebuild_theta
from gradientmail_core.protocol.records import RoundRecord, Snapshot, digest_of
from gradientmail_core.protocol.run import RunInfo
from gradientmail_core.protocol.store import RunStore


def merge_with_cosine(
    deltas: Sequence[Delta],
    weights: Sequence[float],
    cfg: WeightedMean | RDA,
    *,
    clip_norm: float | None = None,
    each: Callable[[str, np.ndarray, np.float32 | None], object] | None = None,
) -> tuple[dict[str, np.ndarray], float | None]:
    """``(merge.merge(deltas, ...), merge.mean_pairwise_cosine(deltas))`` in one pass per tensor
    (``fused.merge_tensor`` feeds the merge's float32 accumulator and the cosine's float64 one;
    the cosine is of the contributions as given, before any clipping). ``each(name, values,
    scale)``, if given, receives every merged tensor instead of the returned dict (then empty):
    the merge is ``values * scale`` (a float32 multiply) when ``scale`` is not None."""
    p = normalized(weights, len(deltas))
    merged_in = [clip(d, clip_norm) for d in deltas] if clip_norm is not None else list(deltas)
    units = fused._cosine_units(deltas)
    squares: dict[str, list[float]] = {}
    out: dict[str, np.ndarray] = {}
    for name in deltas[0]:
        cos = None if units is None else [None if u is None else (d[name], u) for d, u in zip(deltas, units)]
        values, scale = fused.merge_tensor(
            [np.asarray(d[name], np.float32) for d in merged_in],
            p,
            radial=isinstance(cfg, RDA) and not cfg.is_direct(name),
            cosine=cos,
            squares=squares.setdefault(name, []),
        )
        if each is None:
            out[name] = fused.scaled(values, scale)
        else:
            each(name, values, scale)
    return out, fused._cosine_from(units, squares, len(deltas))


@dataclass
class Reference:
    payloads: dict[str, bytes]  # the payloads a commit writes, in the order it writes them
    theta_digest: str
    outer_digest: str | None
    cosine: float | None
    theta: dict[str, np.ndarray]
    master: dict[str, np.ndarray]
    momentum: dict[str, np.ndarray]


def reference_commit(
    store: RunStore,
    run: RunInfo,
    rec: RoundRecord,
    theta: dict[str, np.ndarray],
    master: dict[str, np.ndarray],
    momentum: dict[str, np.ndarray],
    compression: str,
) -> Reference:
    """The commit of ``rec``'s round (its participants, weights, final and checkpoint flags) from the
    state before it, over whole tensors."""
    cfg, f = run.cfg, rec.fragment
    deltas = []
    for p in rec.participants:
        snap = store.read_record(keys.snapshot_key(rec.round, p.learner), Snapshot)
        assert snap is not None
        d = store.get_payload(
            snap.payload, run.shapes[f], dtypes=run.delta_dtypes(f), chunk_elements=run.chunk_elements
        )
        assert d is not None
        deltas.append(d)
    new_master: dict[str, np.ndarray] = {}
    new_momentum: dict[str, np.ndarray] = {}

    def step(name: str, d: np.ndarray, scale: np.float32 | None) -> None:
        if cfg.gap_projection:  # over the whole tensor, its blocks of 32 from element 0
            d = np.array(d, np.float32) if scale is None else np.multiply(d, scale, dtype=np.float32)
            scale = None
            drop_pullback(d.reshape(-1), master[name].reshape(-1), np.asarray(theta[name], np.float32).reshape(-1))
        if rec.final:
            new_master[name] = final_step_tensor(master[name], d, scale=scale, name=name)
        else:
            new_master[name], new_momentum[name] = outer_step_tensor(
                master[name], momentum[name], d, lr=cfg.outer_lr, beta=cfg.outer_momentum, scale=scale, name=name
            )

    _, cosine = merge_with_cosine(
        deltas, [p.weight for p in rec.participants], cfg.merge, clip_norm=cfg.clip_norm, each=step
    )
    m = {n: new_master[n] for n in master}
    mo = momentum if rec.final else {n: new_momentum[n] for n in master}
    shapes, dtypes, c = run.shapes[f], run.fragment_dtypes(f), run.chunk_elements
    checkpoint = rec.checkpoint is None
    change = None
    if cfg.commit_dtype is not None:
        change = {n: np.subtract(m[n], theta[n], dtype=np.float32) for n in m}
        new_theta = rebuild_theta(run, f, theta, cast(change, dict.fromkeys(change, cfg.commit_dtype)))
    else:
        new_theta = cast(m, dtypes)
    outer = {f"momentum/{n}": v for n, v in mo.items()}
    if not run.master_is_theta(f):
        outer.update({f"master/{n}": v for n, v in m.items()})

    def shas(values, shp, dt, kind: str, z: str) -> list[tuple[str, bytes]]:
        out = []
        for s in chunk_specs(shp, c):
            data = encode_payload(values, dt, kind=kind, compression=z, chunk=s)
            out.append((sha256_hex(data), data))
        return out

    payloads: dict[str, bytes] = {}
    plain = shas(new_theta, shapes, dtypes, "theta", "")
    outer_plain = shas(outer, run.outer_shapes(f), "F32", "outer", "")
    written = []
    if checkpoint:
        written += [("theta", shas(new_theta, shapes, dtypes, "theta", compression) if compression else plain)]
        written += [("outer", shas(outer, run.outer_shapes(f), "F32", "outer", compression))]
    if change is not None:
        written += [("change", shas(change, shapes, cfg.commit_dtype, "change", compression))]
    for kind, chunks in written:
        for sha, data in chunks:
            payloads[keys.round_blob_key(rec.round, kind, sha, compression)] = data
    return Reference(
        payloads,
        digest_of([sha for sha, _ in plain]),
        None if checkpoint else digest_of([sha for sha, _ in outer_plain]),
        cosine,
        new_theta,
        m,
        mo,
    )
