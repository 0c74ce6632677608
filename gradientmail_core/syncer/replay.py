"""Recovering a fragment's closer state (``FragmentState``) from the store, checkpoints included.

A checkpoint record names the parameters and the fp32 outer state; with ``checkpoint_every > 1``
the records between checkpoints name only the quantized change. Their outer step is a
deterministic function of the state before and the contributions the record lists (payload,
weight, steps, tokens, final), so a node that becomes closer starts from the checkpoint (or the
initial parameters, or a state it still holds from a commit of its own after the checkpoint) and
commits every later round again with ``compute_commit`` itself: the same merge, in the same
order, with the recorded weights and no outlier judgement (the record lists the participants
after it); a fragment of several chunks chunk by chunk, as its closers commit it (``streamed.py``). Each replayed round must give the record's change payload, ``theta_digest`` and
``outer_digest`` bit for bit, or ``ProtocolError``: never a silently different state.
"""

from __future__ import annotations

import numpy as np

from ..aggregators.fused import sq_norms
from ..errors import MailboxUnavailable, PayloadCorrupt, ProtocolError
from ..protocol import keys
from ..protocol.rebuild import chain_records, checkpoint_record
from ..protocol.records import Participant, PayloadRef, RoundRecord, Snapshot, chunk_refs, ref_digest
from ..protocol.run import RunInfo, payload_cap
from ..protocol.schedule import version_before
from ..protocol.store import RunStore
from ..protocol.tape import fetch_theta
from .closer import Collector, Estimates, FragmentState, Judged, compute_commit
from .spool import Spool
from .streamed import chunk_by_chunk, judge_payload


def recover(
    store: RunStore,
    run: RunInfo,
    f: int,
    rec: RoundRecord | None,
    held: FragmentState | None,
    theta: tuple[int, dict[str, np.ndarray] | None] | None = None,
) -> FragmentState:
    """Fragment ``f``'s state at ``rec`` (its newest record; None: the initial parameters).

    ``held``: a state this node computed itself (a commit of its own), used when it is ``rec``'s
    version, or, between checkpoints, when replaying from it is shorter than from the checkpoint.
    ``theta``: ``(version, parameters)`` this node holds already (``NodeState.thetas``: read and
    verified, or committed by itself), used instead of downloading them again when the state is
    recovered at that version (a fragment less to hold while the closer's first round merges);
    ``(version, None)``: lent to the training thread (``NodeState.lends``), downloaded again.
    Missing payloads raise ``MailboxUnavailable`` (newer commits exist: GC collected what this
    node's stale view needs; it catches up on the next poll)."""
    version = rec.version if rec else 0
    if held is not None and held.version == version:
        return held
    known = theta[1] if theta is not None and theta[0] == version else None
    if rec is None or rec.is_checkpoint:
        return _checkpoint_state(store, run, f, rec, known)
    assert rec.checkpoint is not None
    if held is not None and rec.checkpoint <= held.version < version and held.checkpoint == rec.checkpoint:
        state = held
    else:
        state = _checkpoint_state(store, run, f, checkpoint_record(store, run, f, rec.checkpoint))
    for link in chain_records(store, run, rec, state.version):
        state = replay_round(store, run, state, link)
    return state


def _checkpoint_state(
    store: RunStore, run: RunInfo, f: int, rec: RoundRecord | None, known: dict[str, np.ndarray] | None = None
) -> FragmentState:
    version = rec.version if rec else 0
    theta = known if known is not None else fetch_theta(store, run, f, rec)
    if theta is None:
        raise MailboxUnavailable(f"fragment {f}: the parameters of version {version} are gone; newer commits exist")
    if rec is None:
        return FragmentState.initial(theta)
    assert rec.outer is not None
    outer = store.get_payload(
        rec.outer, run.outer_shapes(f), max_bytes=3 * payload_cap(run, f), chunk_elements=run.chunk_elements
    )
    if outer is None:
        raise MailboxUnavailable(f"fragment {f}: the outer state of round {rec.round} is gone; newer commits exist")
    return FragmentState(version, theta, *run.split_outer(f, outer, theta), checkpoint=version)


def replay_round(store: RunStore, run: RunInfo, state: FragmentState, rec: RoundRecord) -> FragmentState:
    """Commit ``rec``'s round again from ``state`` (the version before) and its recorded
    contributions; ``ProtocolError`` unless the result is the record's, bit for bit."""
    assert rec.change is not None and state.version == rec.version - 1
    # A fragment of several chunks is replayed chunk by chunk, as its closer committed it
    # (``streamed.py``), its contributions in a spool of the replay's own, removed after it.
    spool = Spool() if chunk_by_chunk(run, rec.fragment) else None
    try:
        return _replay(store, run, state, rec, spool)
    finally:
        if spool is not None:
            spool.close()


def _replay(
    store: RunStore, run: RunInfo, state: FragmentState, rec: RoundRecord, spool: Spool | None
) -> FragmentState:
    f, r = rec.fragment, rec.round
    assert rec.change is not None
    c = Collector(
        r, run, state, opened_at=0.0, estimates=Estimates(), quorum_at=0.0, streamed=spool is not None, spool=spool
    )
    c.store = store
    for p, ref, delta, norms in _contributions(store, run, rec, spool):
        snap = Snapshot(
            learner=p.learner,
            round=r,
            local_step=0,
            steps=p.steps,
            tokens=p.tokens,
            base_version=version_before(r, run.P),
            step_seconds=0.0,
            schema_digest=run.digest,
            payload=ref,
            final=p.final,
        )
        c.judged[p.learner] = Judged(p.learner, None, snap, delta, p.weight, norms)
    compression = keys.compression_of(rec.change.key)  # (every chunk's: the closer writes them alike)
    commit = compute_commit(
        c,
        closer=rec.closer,
        live=rec.live,
        compression=compression,
        sync_seconds=None,
        now=0.0,
        outliers=False,
        write=None if spool is None else _discard,  # only the record is compared: keep no payload
    )
    if not _same(commit.record, rec):
        raise ProtocolError(
            f"{keys.round_key(r)}: replaying fragment {f} version {rec.version} from its contributions does not give "
            "the committed change, parameters and outer state; refusing to close with a different state"
        )
    return commit.state


def _discard(key: str, data: object) -> None:
    pass


def _contributions(
    store: RunStore, run: RunInfo, rec: RoundRecord, spool: Spool | None = None
) -> list[tuple[Participant, PayloadRef, dict[str, np.ndarray] | None, dict[str, float]]]:
    """Each participant of ``rec`` with its payload, read and verified (its own blob folder, the
    sha256 the record names), and each tensor's squared norm; a payload gone is
    ``MailboxUnavailable``. With a ``spool``: the payload read chunk by chunk into it
    (``streamed.judge_payload``) and given as None."""
    f, r = rec.fragment, rec.round
    assert rec.contributions is not None
    expected, dtypes, cap = run.shapes[f], run.delta_dtypes(f), payload_cap(run, f)
    out: list[tuple[Participant, PayloadRef, dict[str, np.ndarray] | None, dict[str, float]]] = []
    for p, ref in zip(rec.participants, rec.contributions, strict=True):
        parsed = [keys.parse_blob_key(c.key) for c in chunk_refs(ref)]
        if ref_digest(ref) != p.payload_sha256 or not all(
            b is not None and (b.kind, b.round, b.learner, b.sha) == ("snapshot", r, p.learner, c.sha256)
            for b, c in zip(parsed, chunk_refs(ref), strict=True)
        ):
            raise ProtocolError(
                f"{keys.round_key(r)}: contribution {ref.key} is not {p.learner}'s payload of round {r}"
            )
        if spool is not None:
            verdict = judge_payload(store, spool, run, f, ref, r)
            if verdict.status in ("corrupt", "schema"):
                raise PayloadCorrupt(f"{ref.key}: a chunk of {p.learner}'s contribution to round {r} reads back bad")
            if verdict.norms is not None:
                out.append((p, ref, None, verdict.norms))
                continue
        delta = (
            None
            if spool is not None
            else store.get_payload(ref, expected, max_bytes=cap, dtypes=dtypes, chunk_elements=run.chunk_elements)
        )
        if delta is None:
            raise MailboxUnavailable(
                f"fragment {f}: contribution {ref.key} to round {r}, needed to rebuild version {rec.version} from "
                f"checkpoint version {rec.checkpoint}, is gone; newer commits exist (or the store lost it: then "
                "restore it, the fragment cannot be rebuilt without it)"
            )
        out.append((p, ref, delta, sq_norms(delta)))
    return out


def _same(mine: RoundRecord, rec: RoundRecord) -> bool:
    """The replayed commit is the recorded one: the same change payload, parameters (their digest)
    and outer state (its digest), building on the same checkpoint."""
    return (
        mine.change is not None
        and rec.change is not None
        and [c.sha256 for c in chunk_refs(mine.change)] == [c.sha256 for c in chunk_refs(rec.change)]
        and mine.theta_digest == rec.theta_digest
        and mine.outer_digest == rec.outer_digest
        and (mine.checkpoint, mine.final) == (rec.checkpoint, rec.final)
    )
