"""The published parameters of a commit, rebuilt from quantized changes.

With ``commit_dtype`` a commit publishes exactly ``cast(previous + dequantized change)``, checked
against the record's ``theta_digest``; with ``checkpoint_every > 1`` a record between checkpoints
names no theta: it is the checkpoint's theta plus every change after it (``chain_theta``). Shared
by the closer, the followers and the tape readers, so the rounding is said once.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..codec.payload import encode_payload
from ..codec.plan import chunk_specs
from ..codec.quant import dequantize, quantize
from ..errors import ProtocolError
from . import keys
from .records import RoundRecord, digest_of
from .run import RunInfo, payload_cap
from .schedule import round_of
from .store import RunStore


def cast(values: Mapping[str, np.ndarray], dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Round float32 values to what the storage dtype holds (RNE), back in float32. F32 arrays come
    back uncopied (nothing modifies parameter arrays in place: a commit's theta may be its master)."""
    return {
        n: v if dtypes[n] == "F32" and _is_f32_array(v) else dequantize(quantize(v, dtypes[n]))
        for n, v in values.items()
    }


def _is_f32_array(v: object) -> bool:
    return isinstance(v, np.ndarray) and v.dtype == np.float32 and v.flags.c_contiguous


def rebuild_theta(
    run: RunInfo, f: int, prev: Mapping[str, np.ndarray], change: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """A learner holding the previous version rebuilds the new parameters from the change."""
    return cast({n: prev[n] + change[n] for n in prev}, run.fragment_dtypes(f))


def theta_digest(run: RunInfo, f: int, theta: Mapping[str, np.ndarray]) -> str:
    """The digest of the plain theta payload of ``theta`` (``records.digest_of`` its chunks), hashed
    piece by piece as the stream is produced: a fragment's payload is never joined to be hashed."""
    return payload_digest(theta, run.shapes[f], run.fragment_dtypes(f), run.chunk_elements, kind="theta")


def payload_digest(
    values: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, str] | str,
    chunk_elements: int | None,
    *,
    kind: str,
) -> str:
    """``ref_digest`` of the plain (uncompressed) payload of ``values``, chunked by the plan of
    ``shapes`` (in that order), computed without writing it."""
    shas = []
    for c in chunk_specs(shapes, chunk_elements):
        with encode_payload(values, dtypes, kind=kind, chunk=c, stream=True) as s:
            shas.append(s.sha256)
    return digest_of(shas)


def checkpoint_record(store: RunStore, run: RunInfo, f: int, v: int) -> RoundRecord | None:
    """The record of fragment ``f``'s version ``v`` (a checkpoint: it names its theta and outer
    state); None for version 0 (the initial parameters). ``ProtocolError`` if it is not one."""
    if v == 0:
        return None
    r = round_of(f, v, run.P)
    rec = store.read_record(keys.round_key(r), RoundRecord)
    if rec is None or (rec.round, rec.fragment, rec.version) != (r, f, v) or rec.theta is None or rec.outer is None:
        raise ProtocolError(f"{keys.round_key(r)}: not the checkpoint of fragment {f} version {v} a later record names")
    return rec


def chain_records(store: RunStore, run: RunInfo, rec: RoundRecord, start: int) -> list[RoundRecord]:
    """The records of ``rec``'s fragment after version ``start`` up to ``rec`` itself, in order:
    every one between checkpoints, building on the same checkpoint (``ProtocolError`` otherwise;
    the tape is never deleted, so a record that is missing is a broken store, not a race)."""
    f, out = rec.fragment, []
    for v in range(start + 1, rec.version):
        k = keys.round_key(round_of(f, v, run.P))
        got = store.read_record(k, RoundRecord)
        if got is None or (got.fragment, got.version) != (f, v) or got.checkpoint != rec.checkpoint:
            raise ProtocolError(f"{k}: not the commit of fragment {f} version {v} after checkpoint {rec.checkpoint}")
        out.append(got)
    return [*out, rec]


def chain_theta(store: RunStore, run: RunInfo, rec: RoundRecord) -> dict[str, np.ndarray] | None:
    """The parameters of a record between checkpoints: its checkpoint's theta (or the initial
    parameters) plus every change after it. None if a payload is gone (GC keeps the chain until a
    newer checkpoint commits, so newer records exist: the caller lists the tape again)."""
    assert rec.checkpoint is not None
    f = rec.fragment
    cap = payload_cap(run, f)
    base = checkpoint_record(store, run, f, rec.checkpoint)
    ref = run.manifest.init[f] if base is None else base.theta
    assert ref is not None
    theta = store.get_payload(ref, run.shapes[f], max_bytes=cap, chunk_elements=run.chunk_elements)
    for link in chain_records(store, run, rec, rec.checkpoint):
        if theta is None:
            return None
        assert link.change is not None
        change = store.get_payload(link.change, run.shapes[f], max_bytes=cap, chunk_elements=run.chunk_elements)
        if change is None:
            return None
        theta = rebuild_theta(run, f, theta, change)
    if theta is not None and theta_digest(run, f, theta) != rec.theta_digest:
        raise ProtocolError(
            f"{keys.round_key(rec.round)}: the parameters rebuilt from checkpoint version {rec.checkpoint} and the "
            f"changes after it do not hash to the record's theta_digest; the store holds a broken chain"
        )
    return theta
