"""Verifying a round: its commit recomputed from its recorded inputs and compared, bit for bit,
with what its record names. The rules (the inputs, the weights, what ``verified``, ``mismatch``
and ``unverifiable`` mean) are in ``docs/protocol.md`` section 11 and ``docs/security.md``,
"Verifying commits"; the merge is ``replay.recompute``. Nothing is written.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ..aggregators.merge import contribution_weight
from ..errors import MailboxUnavailable, PayloadCorrupt, ProtocolError, RecordInvalid
from ..protocol import identity as ids
from ..protocol import keys
from ..protocol.members import signature_ok
from ..protocol.records import PayloadRef, Roster, RoundRecord, Snapshot, decode, ref_digest
from ..protocol.run import RunInfo
from ..protocol.schedule import draw_order, draw_problem, round_of, slot, version_before
from ..protocol.store import RunStore
from ..protocol.tape import schedule_problem
from .commit import FragmentState
from .merger import FragmentMerger
from .replay import differences, recompute, recover

VERIFIED, MISMATCH, UNVERIFIABLE = "verified", "mismatch", "unverifiable"


@dataclass(frozen=True)
class RoundCheck:
    """What verifying one round found. ``evidence``: for a mismatch in an authenticated run, the
    signed record that proves it (the closer's round record and what signs it). ``theta``: a
    verified round's parameters (whole tensors, read-only), as its record publishes them."""

    round: int
    fragment: int
    version: int
    closer: str
    status: str
    reason: str = ""
    evidence: str | None = None
    bytes_read: int = 0
    theta: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "theta"}


class _Found(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


class RoundVerifier:
    """Recomputes rounds of ``run`` read from ``store`` (module docstring), on a one-process merger
    of its own. ``keep``: hold each verified fragment's state for the next round of it (a closer's
    memory: parameters, master and momentum of every fragment verified); without, each round loads
    the state it starts from."""

    def __init__(self, store: RunStore, run: RunInfo, *, keep: bool = True) -> None:
        self.store, self.run, self.keep = store, run, keep
        self.merger = FragmentMerger.one_process(run, store)

    def close(self) -> None:
        self.merger.close()

    def check_round(self, r: int, *, head: int | None = None) -> RoundCheck:
        """Read round ``r``'s record (authenticated as the run is) and ``check`` it. ``head``: the
        newest round, to say when a round is older than the window."""
        key = keys.round_key(r)
        f, v = slot(r, self.run.P)
        try:
            rec = self.store.read_record(key, RoundRecord)
        except RecordInvalid as e:
            return RoundCheck(r, f, v, "?", MISMATCH, f"the record is not a commit: {e}")
        problem = schedule_problem(rec, r, self.run.P)
        if rec is None or problem is not None:
            return RoundCheck(r, f, v, rec.closer if rec else "?", MISMATCH, problem or "no record")
        return self.check(rec, outside=None if head is None else r <= head - self.run.cfg.verify_window)

    def check(
        self,
        rec: RoundRecord,
        *,
        theta: tuple[int, dict[str, np.ndarray] | None] | None = None,
        outside: bool | None = None,
    ) -> RoundCheck:
        """Verify ``rec`` (a commit of its round, authenticated). ``theta``: ``(version, parameters)``
        of its fragment this node holds (used for the state before when it is that version).
        ``outside``: the round is older than the run's window (said when an input is gone)."""
        f, r, v = rec.fragment, rec.round, rec.version
        down = self.store.bytes_down
        theta_out = None
        try:
            self._draw(rec)  # (before the merge: a round merged from the wrong learners is named as such)
            refs = self._inputs(rec)
            state = self._state_before(rec, theta)
            commit = recompute(self.merger, self.store, self.run, state, rec, refs)
            diff = differences(commit, rec)
            if diff:
                raise _Found(MISMATCH, f"recomputing the merge gives another {', '.join(diff)}")
            self.merger.landed(f, v)
            theta_out = commit.theta
            if not self.keep:
                self.merger.forget(f)
            status, reason = VERIFIED, ""
        except _Found as e:
            status, reason = e.status, e.reason
        except (MailboxUnavailable, PayloadCorrupt) as e:
            status, reason = UNVERIFIABLE, " ".join(str(e).split())
        except ProtocolError as e:  # a contribution that is not its participant's (replay._contributions)
            status, reason = MISMATCH, " ".join(str(e).split())
        if status != VERIFIED:
            self.merger.forget(f)
        if status == UNVERIFIABLE and outside is not None:
            w = self.run.cfg.verify_window
            reason += (
                f"; the round is older than the run's verify window (the newest {w} rounds keep their inputs)"
                if outside
                else f"; inside the run's verify window of {w} rounds (deleted early, or the store lost it)"
            )
        evidence = self._evidence(rec) if status == MISMATCH else None
        return RoundCheck(r, f, v, rec.closer, status, reason, evidence, self.store.bytes_down - down, theta_out)

    # ---- the inputs ---------------------------------------------------------------------------

    def _inputs(self, rec: RoundRecord) -> list[PayloadRef]:
        """Each participant's payload ref, checked against what the record says of it."""
        out = []
        for i, p in enumerate(rec.participants):
            if p.steps <= 0 or contribution_weight(p.tokens, p.steps) != p.weight:
                raise _Found(MISMATCH, f"{p.learner}'s weight {p.weight!r} is not tokens*tokens/steps")
            listed = rec.contributions[i] if rec.contributions is not None else None
            snap = self._snapshot(rec.round, p.learner)
            if snap is None and listed is None:
                raise _Found(UNVERIFIABLE, f"{p.learner}'s snapshot record of round {rec.round} is gone")
            if snap is not None and (
                ref_digest(snap.payload) != p.payload_sha256
                or (snap.steps, snap.tokens, snap.final) != (p.steps, p.tokens, p.final)
                or snap.base_version != version_before(rec.round, self.run.P)
                or snap.schema_digest != self.run.digest
            ):
                raise _Found(
                    MISMATCH,
                    f"{p.learner}'s snapshot record of round {rec.round} does not name the contribution the record "
                    "merges (payload, steps, tokens, final or base version)",
                )
            out.append(listed if listed is not None else snap.payload)  # type: ignore[union-attr]
        return out

    def _draw(self, rec: RoundRecord) -> None:
        """Under ``max_contributions``: the participants and the rejected are the learners the round's
        draw over its roster takes (``schedule.draw_problem``). The roster is read by the key its
        record names and must hash to the sha256 it names; a record without one, or a roster that
        hashes right but is not one for this round, is the closer's (its record binds those bytes)."""
        cap = self.run.cfg.max_contributions
        if cap is None:
            return
        ref, r = rec.roster, rec.round
        if ref is None:
            raise _Found(MISMATCH, f"round {r} merges at most max_contributions={cap} but its record names no roster")
        b = keys.parse_blob_key(ref.key)
        if b is None or (b.kind, b.round, b.sha) != ("roster", r, ref.sha256):
            raise _Found(MISMATCH, f"its record names {ref.key} as its roster, which is not round {r}'s roster key")
        data = self.store.mailbox.get(ref.key)
        if data is None:
            raise _Found(UNVERIFIABLE, f"its roster {ref.key} is gone")
        self.store.bytes_down += len(data)
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise _Found(
                UNVERIFIABLE,
                f"its roster {ref.key} holds {len(data)} bytes that do not hash to the sha256 its record names "
                "(damaged or replaced in the store)",
            )
        if len(data) != ref.size:
            raise _Found(MISMATCH, f"its record says its roster {ref.key} is {ref.size} bytes; it is {len(data)}")
        try:
            roster = decode(data, Roster, key=ref.key)
        except RecordInvalid as e:
            raise _Found(MISMATCH, f"its roster does not decode: {e}") from None
        if roster.round != r or roster.learners != sorted(set(roster.learners)):
            raise _Found(
                MISMATCH, f"its roster {ref.key} is not round {r}'s, or its ids are not ascending and distinct"
            )
        counted = {p.learner for p in rec.participants} | {x.learner for x in rec.rejected if x.reason == "outlier"}
        refused = {x.learner for x in rec.rejected if x.reason != "outlier"}
        order = draw_order(self.run.manifest.run_id, r, roster.learners)
        problem = draw_problem(order, cap, counted, refused)
        if problem is not None:
            raise _Found(MISMATCH, f"not the round's draw: {problem}")

    def _snapshot(self, r: int, learner: str) -> Snapshot | None:
        """``learner``'s snapshot record of round ``r``, authenticated as its learner wrote it (a
        members-only run: signed by the key its id names, whatever the membership is now); None
        when it is gone. One that fails is a mismatch: the closer merged what no learner sent."""
        key = keys.snapshot_key(r, learner)
        data = self.store.mailbox.get(key)
        if data is None:
            return None
        auth = self.store.auth
        try:
            snap = decode(data, Snapshot, key=key)
            if getattr(auth, "members_only", False):
                auth.inner.verify(snap, key)  # (the secret's MAC, in a run that has one too)
                if not (snap.signer and ids.names_key(learner, snap.signer) and signature_ok(snap, auth.run_id, key)):
                    raise RecordInvalid(f"{key}: not signed by the key {learner} names")
            elif auth is not None:
                auth.verify(snap, key)
        except RecordInvalid as e:
            raise _Found(MISMATCH, f"{learner}'s snapshot record fails its check: {e}") from None
        if snap.learner != learner or snap.round != r:
            raise _Found(MISMATCH, f"{key} holds another learner's or round's snapshot")
        return snap

    def _state_before(self, rec: RoundRecord, theta: tuple[int, dict[str, np.ndarray] | None] | None) -> FragmentState:
        """The fragment's state at the version before ``rec``, held by the merger."""
        f, v = rec.fragment, rec.version
        held = self.merger.held(f)
        if held is not None and held.version == v - 1:
            return held
        prev = None
        if v > 1:
            r = round_of(f, v - 1, self.run.P)
            try:
                prev = self.store.read_record(keys.round_key(r), RoundRecord)
            except RecordInvalid as e:
                raise _Found(UNVERIFIABLE, f"the record it builds on fails its check: {e}") from None
            problem = schedule_problem(prev, r, self.run.P)
            if prev is None or problem is not None:
                raise _Found(UNVERIFIABLE, f"the record it builds on is not a commit: {problem or 'missing'}")
        try:
            return recover(self.merger, self.store, self.run, f, prev, theta)
        except ProtocolError as e:  # a round between checkpoints before it does not replay
            raise _Found(UNVERIFIABLE, f"the state it starts from cannot be rebuilt: {e}") from None

    def _evidence(self, rec: RoundRecord) -> str | None:
        """The signed record that proves a mismatch: the round record, whose signature or MAC binds
        its closer to the inputs and the outputs compared."""
        auth, key = self.store.auth, keys.round_key(rec.round)
        if getattr(auth, "members_only", False) and rec.signer is not None:
            return f"{key}, signed by {rec.closer}'s Ed25519 key {rec.signer}"
        if getattr(auth, "authenticated", False) and rec.mac is not None:
            return (
                f"{key}, whose MAC verifies under the run secret (written by a holder of the secret, as {rec.closer})"
            )
        return None
