"""What the auditor captured, and the fragments' states it derives from it: every payload ever
written (GC deletes them later), the tape, and the state after each round as the auditor
recomputed it, which the rounds between checkpoints (``checkpoint_every``) build on: their records
name no payload holding it. ``Auditor`` (``audit.py``) is built on this."""

from __future__ import annotations

import numpy as np

from gradientmail_core.codec.header import sha256_hex
from gradientmail_core.codec.payload import decode_payload
from gradientmail_core.codec.plan import assemble, chunk_specs
from gradientmail_core.errors import GradientMailError
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import PayloadRef, RoundRecord, chunk_refs, ref_digest
from gradientmail_core.protocol.run import RunInfo
from gradientmail_core.protocol.schedule import fragment_of, round_of

State = tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]  # master, momentum, theta


class Captured:
    def __init__(self) -> None:
        self.run: RunInfo | None = None
        self.blobs: dict[str, bytes] = {}  # every payload ever created, by key
        self._decoded: dict[tuple[str, str], dict[str, np.ndarray]] = {}
        self.tape: dict[int, RoundRecord] = {}
        # round -> (master, momentum, theta) after it, as recomputed and checked by the auditor
        self.states: dict[int, State] = {}

    def newest(self) -> dict[int, RoundRecord]:
        out: dict[int, RoundRecord] = {}
        for r in sorted(self.tape)[-self.P :] if self.run else []:
            out[self.tape[r].fragment] = self.tape[r]
        return out

    @property
    def P(self) -> int:
        assert self.run is not None
        return self.run.P

    def _payload(self, pref: PayloadRef, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
        """The payload ``pref`` names, decoded from what was written: every chunk intact (size,
        sha256, its place in the run's chunk plan of ``shapes``, in that order) and assembled; None
        if any is not."""
        hit = self._decoded.get((pref.key, ref_digest(pref)))
        if hit is not None:
            return hit
        specs = chunk_specs(shapes, self.run.chunk_elements if self.run is not None else None)
        refs = chunk_refs(pref)
        if len(refs) != len(specs):
            return None
        parts = []
        for ref, s in zip(refs, specs, strict=True):
            data = self.blobs.get(ref.key)
            if data is None or sha256_hex(data) != ref.sha256 or len(data) != ref.size:
                return None
            try:
                parts.append(decode_payload(data, s, compression=keys.compression_of(ref.key)))
            except GradientMailError:
                return None
        if len(parts) == 1 and not specs[0].meta:
            out = parts[0]  # one chunk of whole tensors: the whole payload, as decoded
        else:
            try:
                out = assemble([list(s.pieces) for s in specs], parts, shapes)
            except GradientMailError:
                return None
        self._decoded[(pref.key, ref_digest(pref))] = out
        return out

    def theta_of(self, rec: RoundRecord) -> dict[str, np.ndarray] | None:
        """The parameters a record commits: its theta payload, or (between checkpoints) the ones
        the auditor rebuilt from the change and checked against its ``theta_digest``."""
        assert self.run is not None
        if rec.theta is not None:
            return self._payload(rec.theta, self.run.shapes[rec.fragment])
        state = self.states.get(rec.round)
        return None if state is None else state[2]

    def _chains(self) -> dict[str, int]:
        """Payload key -> fragment, for what a recovery needs between checkpoints: the newest
        checkpoint's theta and outer state, and every change and contribution after it."""
        out: dict[str, int] = {}
        for f, rec in self.newest().items():
            if rec.checkpoint is None:
                continue
            for v in range(max(rec.checkpoint, 1), rec.version + 1):
                link = self.tape.get(round_of(f, v, self.P))
                if link is None:
                    continue
                refs = [link.theta, link.outer] if v == rec.checkpoint else [link.change, *(link.contributions or [])]
                out.update({c.key: f for ref in refs if ref is not None for c in chunk_refs(ref)})
        return out

    def _state_before(
        self, r: int
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]] | None:
        """``(master, momentum, theta)`` of round ``r``'s fragment before it: the initial
        parameters, a checkpoint's payloads, or (between checkpoints) the state recomputed here."""
        run = self.run
        assert run is not None
        f = fragment_of(r, run.P)
        shapes = run.shapes[f]
        if r < run.P:
            theta = self._payload(run.manifest.init[f], shapes)
            if theta is None:
                return None
            zeros = {n: np.zeros_like(v) for n, v in theta.items()}
            return {n: v.astype(np.float32) for n, v in theta.items()}, zeros, theta
        prev = self.tape.get(r - run.P)
        if prev is None:
            return None
        if prev.outer is None or prev.theta is None:
            return self.states.get(r - run.P)
        outer = self._payload(prev.outer, run.outer_shapes(f))
        theta = self._payload(prev.theta, shapes)
        if outer is None or theta is None:
            return None
        return (*run.split_outer(f, outer, theta), theta)

    def _check_checkpoint(self, r: int, rec: RoundRecord) -> list[str]:
        """A record is a checkpoint exactly when ``RunInfo.checkpoint_due`` says so; one between
        checkpoints names its change, its fragment's newest checkpoint and what replays it."""
        assert self.run is not None
        P = self.P
        f = fragment_of(r, P)
        due = self.run.checkpoint_due(f, rec.version, final=rec.final, participants=len(rec.participants))
        if due:
            ok = rec.checkpoint is None and rec.theta is not None and rec.outer is not None
            return [] if ok else ["a checkpoint's record names no theta or outer state"]
        prev = self.tape.get(r - P) if r >= P else None
        expected = 0 if prev is None else prev.version if prev.checkpoint is None else prev.checkpoint
        if rec.checkpoint != expected or rec.theta is not None or rec.outer is not None:
            return [f"between checkpoints: record names checkpoint {rec.checkpoint}, the newest is version {expected}"]
        if rec.change is None or rec.outer_digest is None or len(rec.contributions or []) != len(rec.participants):
            return ["between checkpoints: the record lacks its change, outer_digest or contributions"]
        return []
