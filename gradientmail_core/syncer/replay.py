"""Recovering a fragment's merger state (``FragmentState``) from the store, checkpoints included
(``docs/protocol.md`` section 9, "A node that becomes closer"): from the checkpoint, or a state of
its own commit after it, each later round committed again (``recompute``) and compared with its
record (``differences``), bit for bit, or ``ProtocolError``. ``recompute`` and ``differences`` are
also what verifying a round runs (``verify.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import MailboxUnavailable, PayloadCorrupt, ProtocolError
from ..protocol import keys
from ..protocol.rebuild import chain_records, checkpoint_record
from ..protocol.records import PayloadRef, RoundRecord, chunk_refs, ref_digest
from ..protocol.run import RunInfo
from ..protocol.store import RunStore
from .commit import Accepted, Commit, FragmentState, discard, merge_commit
from .merger import FragmentMerger

# The fields of a record that its inputs determine (the rest are the closer's timings and views);
# a replay needs those that make the state it continues from (the change, the digests, the chain).
COMPARED = ("theta", "outer", "change", "theta_digest", "outer_digest", "cosine", "final", "checkpoint")
REPLAYED = ("change", "theta_digest", "outer_digest", "final", "checkpoint")


def recover(
    merger: FragmentMerger,
    store: RunStore,
    run: RunInfo,
    f: int,
    rec: RoundRecord | None,
    theta: tuple[int, dict[str, np.ndarray] | None] | None = None,
) -> FragmentState:
    """Fragment ``f``'s state at ``rec`` (its newest record; None: the initial parameters), held by
    ``merger`` afterwards: a state ``merger`` holds when it is ``rec``'s version or replaying from
    it is shorter; else the checkpoint and the rounds after it. ``theta``: ``(version, parameters)``
    this node holds already (``NodeState.thetas``), not downloaded again (``None``: lent, so
    downloaded). Missing payloads raise ``MailboxUnavailable``: the view is stale, caught up next poll."""
    version = rec.version if rec else 0
    held = merger.held(f)
    if held is not None and held.version == version:
        return held
    known = theta[1] if theta is not None and theta[0] == version else None
    if rec is None or rec.is_checkpoint:
        return _load(merger, run, f, rec, known)
    assert rec.checkpoint is not None
    if held is not None and rec.checkpoint <= held.version < version and held.checkpoint == rec.checkpoint:
        state = held
    else:
        state = _load(merger, run, f, checkpoint_record(store, run, f, rec.checkpoint))
    for link in chain_records(store, run, rec, state.version):
        state = replay_round(merger, store, run, state, link)
    return state


def _load(
    merger: FragmentMerger, run: RunInfo, f: int, rec: RoundRecord | None, known: dict[str, np.ndarray] | None = None
) -> FragmentState:
    if rec is None:
        return merger.load(f, 0, run.manifest.init[f], None, known)
    assert rec.theta is not None and rec.outer is not None
    return merger.load(f, rec.version, rec.theta, rec.outer, known)


def replay_round(
    merger: FragmentMerger, store: RunStore, run: RunInfo, state: FragmentState, rec: RoundRecord
) -> FragmentState:
    """Commit ``rec``'s round again from ``state`` (the version before, held by ``merger``) and its
    recorded contributions; ``ProtocolError`` unless the result is the record's, bit for bit."""
    f, r = rec.fragment, rec.round
    assert rec.change is not None and rec.contributions is not None
    commit = recompute(merger, store, run, state, rec, rec.contributions)
    if differences(commit, rec, REPLAYED):
        merger.forget(f, unless=state.version)
        raise ProtocolError(
            f"{keys.round_key(r)}: replaying fragment {f} version {rec.version} from its contributions does not give "
            "the committed change, parameters and outer state; refusing to close with a different state"
        )
    merger.landed(f, rec.version)
    return commit.state


def recompute(
    merger: FragmentMerger,
    store: RunStore,
    run: RunInfo,
    state: FragmentState,
    rec: RoundRecord,
    refs: Sequence[PayloadRef],
) -> Commit:
    """``rec``'s round committed again through ``merger`` from ``state`` (the version before) and
    ``refs`` (each participant's payload, in record order): the recorded weights, no outlier
    judgement, payloads hashed and not kept, the new state pending in ``merger``. A payload gone is
    ``MailboxUnavailable``, damaged ``PayloadCorrupt``, not the participant's ``ProtocolError``."""
    r = rec.round
    assert state.version == rec.version - 1 and len(refs) == len(rec.participants)
    try:
        contributions = _contributions(merger, run, rec, refs)
        # (every payload of a commit is written with one compression: the change's, or the theta's)
        written = rec.change if rec.change is not None else rec.theta
        assert written is not None
        compression = keys.compression_of(written.key)
        # only the record is compared: keep no payload
        return merge_commit(merger, state, contributions, round=r, compression=compression, write=discard)
    finally:
        merger.spool.drop_through(r)  # (the round this node collects comes after every replayed one)


def _contributions(
    merger: FragmentMerger, run: RunInfo, rec: RoundRecord, refs: Sequence[PayloadRef]
) -> list[Accepted]:
    """Each participant of ``rec`` as the merge takes it: its payload (``refs``, in order) read and
    verified (its own blob folder, the sha256 the record names) into the merger's spool, its
    recorded weight, each tensor's squared norm; a payload gone is ``MailboxUnavailable``."""
    f, r = rec.fragment, rec.round
    out = []
    for p, ref in zip(rec.participants, refs, strict=True):
        if ref_digest(ref) != p.payload_sha256 or not all(
            keys.in_snapshot_folder(x.key, x.sha256, r, p.learner) for x in chunk_refs(ref)
        ):
            raise ProtocolError(
                f"{keys.round_key(r)}: contribution {ref.key} is not {p.learner}'s payload of round {r}"
            )
        verdict = merger.judge(f, r, ref)
        if verdict.status in ("corrupt", "schema"):
            raise PayloadCorrupt(f"{ref.key}: a chunk of {p.learner}'s contribution to round {r} reads back bad")
        if verdict.norms is None:
            raise MailboxUnavailable(
                f"fragment {f}: {p.learner}'s contribution {ref.key} to round {r}, needed to commit version "
                f"{rec.version} again, is gone; newer commits exist (or the store lost it: then restore it, the "
                "fragment cannot be rebuilt without it)"
            )
        out.append(Accepted(tuple(chunk_refs(ref)), p.weight, verdict.norms, p.final))
    return out


def differences(mine: Commit, rec: RoundRecord, compared: Sequence[str] = COMPARED) -> list[str]:
    """The fields of ``compared`` in which a recomputed commit ``mine`` is not ``rec``'s (payloads:
    every chunk's key, sha256 and size)."""

    def chunks(ref: PayloadRef | None) -> list[tuple[str, str, int]] | None:
        return None if ref is None else [(c.key, c.sha256, c.size) for c in chunk_refs(ref)]

    out = []
    for name in compared:
        if name in ("theta", "outer", "change"):
            a, b = chunks(mine.refs.get(name)), chunks(getattr(rec, name))
        else:
            a, b = getattr(mine, name), getattr(rec, name)
        if a != b:
            out.append(name)
    return out
