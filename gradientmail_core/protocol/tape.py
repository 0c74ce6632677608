"""Reading the tape (``rounds/``: one create-once record per committed round, contiguous, never
deleted): the committed records, the newest parameters, the open claim. Every reader uses these,
so what counts as a valid record is said once.
"""

from __future__ import annotations

import numpy as np

from ..errors import ProtocolError
from . import keys
from .rebuild import chain_theta
from .records import Claim, RoundRecord, TensorSpec
from .run import RunInfo, payload_cap, read_manifest
from .schedule import slot
from .schema import check_schema
from .store import RunStore


def schedule_problem(rec: RoundRecord | None, r: int, P: int) -> str | None:
    """Why ``rec`` (read from round ``r``'s key) is not a commit of round ``r``; None if it is."""
    if rec is None:
        return f"round {r} record is unreadable"
    if rec.round != r or (rec.fragment, rec.version) != slot(r, P):
        return f"round {r} record is inconsistent with the schedule"
    if rec.is_checkpoint:
        if rec.theta is None or rec.outer is None:
            return f"round {r} record names no parameters and no checkpoint"
    elif (
        rec.checkpoint is None
        or not rec.checkpoint < rec.version
        or rec.theta is not None
        or rec.outer is not None
        or rec.change is None
        or rec.outer_digest is None
        or rec.contributions is None
        or len(rec.contributions) != len(rec.participants)
    ):
        return f"round {r} record between checkpoints is incomplete"
    return None


def round_keys(store: RunStore) -> list[str]:
    """Every key on the tape that parses as a round record key, in round order."""
    return [k for k in store.keys(keys.ROUNDS) if keys.parse_round_key(k) is not None]


def newest_records(store: RunStore, run: RunInfo, listed: list[str]) -> dict[int, RoundRecord]:
    """The newest record of every fragment among the listed round keys, read newest first (at most
    ``4P + 64``); an object that is not a valid record of its round is reported and skipped."""
    out: dict[int, RoundRecord] = {}
    for k in reversed(listed[-(4 * run.P + 64) :]):
        r = keys.parse_round_key(k)
        if r is None:
            continue
        rec = store.try_record(k, RoundRecord)
        if rec is None or schedule_problem(rec, r, run.P) is not None:
            continue
        out.setdefault(rec.fragment, rec)
        if len(out) == run.P:
            break
    return out


def fetch_theta(store: RunStore, run: RunInfo, f: int, record: RoundRecord | None) -> dict[str, np.ndarray] | None:
    """Published parameters of fragment ``f`` at ``record`` (or the initial ones); None if gone.

    A record between checkpoints names no parameters: they are rebuilt from its checkpoint and
    the changes after it (``rebuild.chain_theta``, checked against its ``theta_digest``)."""
    if record is not None and not record.is_checkpoint:
        return chain_theta(store, run, record)
    ref = run.manifest.init[f] if record is None else record.theta
    assert ref is not None
    return store.get_payload(ref, run.shapes[f], max_bytes=payload_cap(run, f), chunk_elements=run.chunk_elements)


def read_newest(
    store: RunStore, run: RunInfo, *, attempts: int = 5
) -> tuple[dict[int, RoundRecord], dict[int, dict[str, np.ndarray]]]:
    """The newest record and parameters of every fragment: ``(records, thetas)``. A payload gone
    while we read means GC collected it under newer records: the tape is listed again, up to
    ``attempts`` times; then ``ProtocolError``."""
    for _ in range(attempts):
        recs = newest_records(store, run, round_keys(store))
        thetas: dict[int, dict[str, np.ndarray]] = {}
        for f in range(run.P):
            theta = fetch_theta(store, run, f, recs.get(f))
            if theta is None:
                break
            thetas[f] = theta
        else:
            return recs, thetas
    raise ProtocolError(
        f"the newest parameters kept disappearing while being read ({attempts} tries): the run commits "
        "faster than this node reads; retry"
    )


def newest_claim(store: RunStore, r: int) -> Claim | None:
    """The claim with the highest number on round ``r`` that is what its key says; None if none."""
    for k in reversed(store.keys(keys.claims_prefix(r))):
        parsed = keys.parse_claim_key(k)
        if parsed is None:
            continue
        claim = store.try_record(k, Claim)
        if claim is not None and (claim.round, claim.n) == parsed:
            return claim
    return None


def load_newest(store: RunStore, schema: list[TensorSpec]) -> tuple[RunInfo, int, dict[int, dict[str, np.ndarray]]]:
    """The run, its newest committed round and the parameters of every fragment, for a model
    of ``schema`` (``SchemaMismatch`` otherwise): what ``gm.align`` loads."""
    manifest = read_manifest(store)
    if manifest is None:
        raise ProtocolError(f"no run in this mailbox ({keys.MANIFEST} is missing); start a Session first")
    run = RunInfo.from_manifest(manifest)
    check_schema(run.schema, schema)
    recs, thetas = read_newest(store, run)
    return run, max((r.round for r in recs.values()), default=-1), thetas
