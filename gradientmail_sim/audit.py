"""The auditor: sees every operation that reaches the shared store (below the fault wrappers)
and checks the protocol's invariants as they happen.

It captures what was written (GC deletes snapshots and old payloads later), so it can
recompute each commit independently:

- at most one record per round, never deleted; the tape is contiguous; versions rise by one;
- the closer of a round holds a claim for it; the payloads a record names were written first;
- every participant is a snapshot written for that round, against the current version, weighted
  ``tokens * tokens / steps``, counted once; no learner is both weighted and rejected; every snapshot
  listed before the commit is weighted or rejected (others are *late*; with a cap, or past the draw);
- the committed parameters and outer state equal the merge and Nesterov step of the listed
  contributions: bit-exactly with the engine's pure functions, and within float32 rounding
  with an independent float64 implementation (``reference.py``);
- between checkpoints (``checkpoint_every``) the record names no theta and no outer state: its
  outer state must hash to ``outer_digest`` and the parameters rebuilt from the change to
  ``theta_digest``; the auditor carries its own recomputed state from round to round;
- no payload of the newest record of a fragment, no initial payload, no record of the tape, no
  contribution to a round that has not committed, and nothing a recovery between checkpoints
  needs (the newest checkpoint, every change and contribution after it) is ever deleted.
"""

from __future__ import annotations

import builtins
import hashlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from gradientmail_core.aggregators.merge import contribution_weight, merge
from gradientmail_core.aggregators.outer import drop_pullback, final_step, outer_step
from gradientmail_core.config import RDA
from gradientmail_core.errors import GradientMailError
from gradientmail_core.mailbox import ForwardingMailbox, Mailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.rebuild import cast, payload_digest, rebuild_theta, theta_digest
from gradientmail_core.protocol.records import (
    Claim,
    Manifest,
    Roster,
    RoundRecord,
    Snapshot,
    chunk_refs,
    decode,
    ref_digest,
)
from gradientmail_core.protocol.run import RunInfo
from gradientmail_core.protocol.schedule import draw, fragment_of, slot, version_before

from . import reference as ref
from .captured import Captured


@dataclass(frozen=True)
class Violation:
    seq: int
    node: str
    what: str

    def __str__(self) -> str:
        return f"op #{self.seq} by {self.node or '?'}: {self.what}"


class Auditor(Captured):
    def __init__(self, store: Mailbox) -> None:
        super().__init__()
        self.store = store  # the shared store itself, to check what exists
        self.seq = 0
        self.violations: list[Violation] = []
        self.stats: Counter[str] = Counter()
        # round -> learner -> (seq of its creation, its bytes); decoded only when a round is checked
        self.snapshots: dict[int, dict[str, tuple[int, bytes]]] = {}
        self.claims: dict[int, list[tuple[str, bytes]]] = {}  # round -> (writer, bytes) of every claim
        self._snapshot_refs: dict[tuple[int, str], tuple[str, list[str]]] = {}  # (round, learner) -> digest, keys
        self.last_listing: dict[str, int] = {}  # node -> seq of its last full listing
        self.lease_listing: dict[str, int] = {}  # node -> seq of its last listing of leases/
        self.round_blob_writes: dict[str, dict[int, int]] = {}  # node -> round -> seq of its last round payload
        self.on_commit: list[Callable[[int, RoundRecord], None]] = []  # for the simulator
        self.on_lease: list[Callable[[str], None]] = []  # a learner's lease keys changed (put or delete)

    # ---- reporting ----------------------------------------------------------------------

    def fail(self, node: str, what: str) -> None:
        self.violations.append(Violation(self.seq, node, what))

    @property
    def head(self) -> int:
        return max(self.tape, default=-1)

    # ---- what reaches the store ---------------------------------------------------------

    def put(self, node: str, key: str, data: bytes, created: bool) -> None:
        self.seq += 1
        if not created:
            if keys.parse_round_key(key) is not None:
                if key not in self.store.list(key):
                    self.fail(node, f"put_if_absent({key}) returned False but no record exists")
                elif self.store.get(key) != data:
                    self.stats["commit_race_lost"] += 1  # two closers wrote this round: one lost
            return
        if key.startswith(keys.BLOBS):
            self.blobs[key] = data
            b = keys.parse_blob_key(key)
            if b is not None and b.kind in keys.ROUND_BLOB_KINDS and b.round is not None:
                self.round_blob_writes.setdefault(node, {})[b.round] = self.seq
            return
        if key == keys.MANIFEST:
            try:
                self.run = RunInfo.from_manifest(decode(data, Manifest, key=key))
            except GradientMailError as e:
                self.fail(node, f"the manifest does not decode: {e}")
            return
        if (parsed := keys.parse_snapshot_key(key)) is not None:
            self.snapshots.setdefault(parsed[0], {})[parsed[1]] = (self.seq, data)
            if parsed[0] in self.tape:
                self.stats["late"] += 1  # the round had committed already
            return
        if (claim := keys.parse_claim_key(key)) is not None:
            self.claims.setdefault(claim[0], []).append((node, data))
            return
        if (lease := keys.parse_lease_key(key)) is not None:
            for cb in self.on_lease:
                cb(lease[0])
            return
        if (r := keys.parse_round_key(key)) is not None:
            self._round(node, r, key, data)

    def listed(self, node: str, prefix: str) -> None:
        self.seq += 1
        if prefix == "":
            self.last_listing[node] = self.seq
        elif prefix == keys.LEASES:
            self.lease_listing[node] = self.seq

    def get(self) -> None:
        self.seq += 1

    def delete(self, node: str, doomed: Iterable[str]) -> None:
        self.seq += 1
        if self.run is None:
            return
        live: dict[str, int] = {}
        for rec in self.newest().values():
            for pref in (rec.theta, rec.outer, rec.change):
                if pref is not None:
                    live.update(dict.fromkeys((c.key for c in chunk_refs(pref)), rec.round))
        init = {c.key for r in self.run.manifest.init for c in chunk_refs(r)}
        head = self.head
        chains = self._chains()
        window = self._window()
        for k in doomed:
            if k == keys.MANIFEST or keys.parse_round_key(k) is not None:
                self.fail(node, f"deleted {k}, which is never deleted")
            elif k in live:
                self.fail(node, f"deleted {k}, a payload of round {live[k]}, the newest of its fragment")
            elif k in chains:
                self.fail(node, f"deleted {k}, which a recovery of fragment {chains[k]} between checkpoints needs")
            elif k in window:
                self.fail(node, f"deleted {k}, which verifying round {window[k]}, inside the verify window, needs")
            elif k in init:
                self.fail(node, f"deleted {k}, an initial payload named by the manifest")
            else:
                snap = keys.parse_snapshot_key(k)
                b = keys.parse_blob_key(k)
                r = snap[0] if snap else (b.round if b is not None and b.kind == "snapshot" else None)
                if r is not None and r > head:
                    self.fail(node, f"deleted {k}, a contribution to round {r}, which has not committed (head {head})")

    def _window(self) -> dict[str, int]:
        """Key -> round, for what verifying each of the newest ``verify_window`` rounds needs
        (``syncer/gc.py``): its participants' snapshot records and payloads, and the theta and outer
        state of the version before (when that is a checkpoint; a chain's are ``_chains``')."""
        run = self.run
        assert run is not None
        out: dict[str, int] = {}
        for q in range(max(self.head - run.cfg.verify_window + 1, 0), self.head + 1):
            rec = self.tape.get(q)
            if rec is None:
                continue
            if rec.roster is not None:
                out[rec.roster.key] = q
            for p in rec.participants:
                out[keys.snapshot_key(q, p.learner)] = q
                out.update(dict.fromkeys(self._payload_keys(q, p.learner, p.payload_sha256), q))
            prev = self.tape.get(q - run.P) if q >= run.P else None
            for pref in (prev.theta, prev.outer) if prev is not None else ():
                out.update(dict.fromkeys((c.key for c in chunk_refs(pref)) if pref is not None else (), q))
        return out

    def _roster(self, rec: RoundRecord, out: list[str]) -> set[str] | None:
        """The learners of ``rec``'s roster (a capped round's), each of which wrote a snapshot of its
        round; None without one (or when it does not decode: said in ``out``)."""
        if rec.roster is None:
            return None
        data = self.blobs.get(rec.roster.key)
        if data is None or hashlib.sha256(data).hexdigest() != rec.roster.sha256:
            out.append(f"its roster {rec.roster.key} was not written with the bytes the record names")
            return None
        try:
            roster = decode(data, Roster, key=rec.roster.key)
        except GradientMailError as e:
            out.append(f"its roster does not decode: {e}")
            return None
        if roster.round != rec.round:
            out.append(f"its roster is round {roster.round}'s")
        for learner in set(roster.learners) - set(self.snapshots.get(rec.round, {})):
            out.append(f"its roster names {learner}, which wrote no snapshot for the round")
        return set(roster.learners)

    def _payload_keys(self, r: int, learner: str, digest: str) -> list[str]:
        """The chunk keys of ``learner``'s snapshot of round ``r``, when its payload is ``digest``
        (decoded once: a snapshot record is created once)."""
        got = self._snapshot_refs.get((r, learner))
        if got is None:
            data = self.snapshots.get(r, {}).get(learner)
            try:
                snap = decode(data[1], Snapshot) if data is not None else None
            except GradientMailError:
                snap = None
            got = ("", []) if snap is None else (ref_digest(snap.payload), [c.key for c in chunk_refs(snap.payload)])
            if data is not None:
                self._snapshot_refs[(r, learner)] = got
        return got[1] if got[0] == digest else []

    def deleted(self, doomed: list[str]) -> None:
        """After a delete reached the store: report the leases it changed."""
        for learner in sorted({p[0] for k in doomed if (p := keys.parse_lease_key(k)) is not None}):
            for cb in self.on_lease:
                cb(learner)

    # ---- a new round record -------------------------------------------------------------

    def _round(self, node: str, r: int, key: str, data: bytes) -> None:
        self.stats["rounds"] += 1
        if r in self.tape:
            self.fail(node, f"{key} was created twice")
            return
        try:
            rec = decode(data, RoundRecord, key=key)
        except GradientMailError as e:
            self.fail(node, f"{key} does not decode: {e}")
            return
        self.tape[r] = rec
        if self.run is None:
            self.fail(node, f"{key} committed before any manifest")
            return
        problems = self._check_round(node, r, rec)
        for p in problems:
            self.fail(node, f"round {r}: {p}")
        for cb in self.on_commit:
            cb(r, rec)

    def _check_round(self, node: str, r: int, rec: RoundRecord) -> list[str]:
        run = self.run
        assert run is not None
        P, cfg = run.P, run.cfg
        out: list[str] = []
        if r > 0 and r - 1 not in self.tape:
            out.append(f"committed before round {r - 1}: the tape has a gap")
        if rec.round != r or (rec.fragment, rec.version) != slot(r, P):
            out.append(f"record says round {rec.round}, fragment {rec.fragment}, version {rec.version}")
        prev = self.tape.get(r - P) if r >= P else None
        if prev is not None and prev.version + 1 != rec.version:
            out.append(f"version {rec.version} does not follow version {prev.version} of round {r - P}")
        if rec.closer != node:
            out.append(f"record names closer {rec.closer}, written by {node}")
        if prev is not None and prev.checkpoint is not None and prev.closer != rec.closer:
            self.stats["closed_between_checkpoints_by_another"] += 1  # its state replayed from a checkpoint
        claimants = set()
        for writer, data in self.claims.get(r, []):
            try:
                c = decode(data, Claim, key=keys.claims_prefix(r))
            except GradientMailError as e:
                out.append(f"a claim by {writer} does not decode: {e}")
                continue
            if c.learner != writer or c.round != r:
                out.append(f"claim {c.n} names {c.learner} for round {c.round}, written by {writer}")
            claimants.add(c.learner)
        if node not in claimants:
            out.append(f"closed by {node}, which never claimed it (claimants {sorted(claimants)})")
        out += self._check_checkpoint(r, rec)
        if out:
            return out
        if (rec.roster is None) != (cfg.max_contributions is None):
            out.append(
                f"names {'no roster' if rec.roster is None else 'a roster'} in a run with max_contributions={cfg.max_contributions}"
            )
        for pref in (rec.theta, rec.outer, rec.change, rec.roster, *(rec.contributions or [])):
            for part in chunk_refs(pref) if pref is not None else []:
                if part.key not in self.blobs or not self.store.list(part.key):
                    out.append(f"names payload {part.key}, which was not written before the record")
        if out:
            return out

        # -- participants and rejections --
        names = [p.learner for p in rec.participants]
        rejected = {x.learner: x.reason for x in rec.rejected}
        if len(set(names)) != len(names):
            out.append(f"a participant is weighted twice: {names}")
        if set(names) & set(rejected):
            out.append(f"weighted and rejected at once: {sorted(set(names) & set(rejected))}")
        base = version_before(r, P)
        deltas: list[dict[str, np.ndarray]] = []
        weights: list[float] = []
        finals: list[bool] = []
        snaps = self.snapshots.get(r, {})
        contributed = dict(zip((p.learner for p in rec.participants), rec.contributions or [], strict=False))
        for p in sorted(rec.participants, key=lambda p: p.learner):
            snap = self._snapshot(r, p.learner, out)
            if snap is None:
                out.append(f"participant {p.learner} never wrote a snapshot for this round")
                continue
            if snap.base_version != base:
                out.append(f"participant {p.learner} is stale: base_version {snap.base_version}, current {base}")
            if snap.schema_digest != run.digest:
                out.append(f"participant {p.learner} has another schema")
            if snap.steps <= 0 or (snap.steps, snap.tokens, snap.final) != (p.steps, p.tokens, p.final):
                out.append(
                    f"participant {p.learner}: record says steps/tokens/final {p.steps}/{p.tokens}/{p.final},"
                    f" snapshot says {snap.steps}/{snap.tokens}/{snap.final}"
                )
                continue
            w = contribution_weight(snap.tokens, snap.steps)
            if p.weight != w or abs(ref.weights_of(snap.tokens, snap.steps) - p.weight) > 1e-9 * max(w, 1.0):
                out.append(f"participant {p.learner} weighted {p.weight}, expected {w}")
            if ref_digest(snap.payload) != p.payload_sha256:
                out.append(
                    f"participant {p.learner}: record names payload {p.payload_sha256[:12]}, "
                    f"snapshot names {ref_digest(snap.payload)[:12]}"
                )
            if p.learner in contributed and contributed[p.learner] != snap.payload:
                out.append(f"participant {p.learner}: the record names contribution {contributed[p.learner].key}")
            delta = self._payload(snap.payload, run.shapes[fragment_of(r, P)])
            if delta is None:
                out.append(f"participant {p.learner}: its payload {snap.payload.key} was never written intact")
                continue
            deltas.append(delta)
            weights.append(w)
            finals.append(snap.final)
        for learner, reason in rejected.items():
            snap = self._snapshot(r, learner, out)
            if snap is None:
                out.append(f"rejected {learner} ({reason}), which never wrote a snapshot for this round")
            elif reason == "stale" and snap.base_version == base:
                out.append(f"rejected {learner} as stale, but its base_version {base} is current")
            elif reason == "zero_steps" and snap.steps > 0:
                out.append(f"rejected {learner} for zero steps, but it trained {snap.steps}")
            self.stats[f"rejected/{reason}"] += 1
        listed_at = self.last_listing.get(node, 0)
        # ``max_contributions``: judged in draw order until K accepted; only those past them unjudged
        cap, order = run.cfg.max_contributions, lambda lr: (draw(run.manifest.run_id, r, lr), lr)
        top = max(map(order, [*names, *rejected]), default=None)
        full = cap is not None and len(names) + sum(x == "outlier" for x in rejected.values()) >= cap
        roster = self._roster(rec, out)
        for learner, (seq, _) in snaps.items():
            if roster is not None and seq < listed_at and learner not in roster:
                out.append(f"the snapshot of {learner} was listed before the close but is not in the roster")
            if learner in rejected or learner in names:
                continue
            if seq < listed_at and not (full and top is not None and order(learner) > top):
                out.append(f"the snapshot of {learner} was listed before the close, neither weighted nor rejected")
            else:
                self.stats["late"] += 1
        if out:
            return out

        # -- the merge and the outer step, recomputed --
        f = fragment_of(r, P)
        dtypes = run.fragment_dtypes(f)
        state = self._state_before(r)
        if state is None:
            return [f"the state before round {r} (round {r - P} or the initial parameters) was not captured"]
        master, momentum, theta = state
        final = all(finals)
        if final != rec.final:
            out.append(f"record final={rec.final}, participants final={finals}")
        # (1) bit-exact with the engine's pure functions, in learner order
        merged = merge(deltas, weights, cfg.merge)
        if cfg.gap_projection:  # (the closer's step in ``syncer/passes.py``: on the merged delta, RDA scaled)
            merged = {n: np.array(v, np.float32) for n, v in merged.items()}
            for n, v in merged.items():
                drop_pullback(v.reshape(-1), *(np.asarray(x[n], np.float32).reshape(-1) for x in (master, theta)))
        if final:
            e_master, e_momentum = final_step(master, merged), dict(momentum)
        else:
            e_master, e_momentum = outer_step(master, momentum, merged, lr=cfg.outer_lr, beta=cfg.outer_momentum)
        if rec.theta is not None and rec.outer is not None:
            new_theta = self._payload(rec.theta, run.shapes[f])
            outer = self._payload(rec.outer, run.outer_shapes(f))
            if new_theta is None or outer is None:
                return out + ["its theta or outer payload does not decode"]
            new_master, new_momentum = run.split_outer(f, outer, new_theta)
        else:  # between checkpoints: the state is the recomputed one if it hashes to outer_digest
            e_outer = {f"momentum/{n}": v for n, v in e_momentum.items()}
            e_outer.update({f"master/{n}": v for n, v in e_master.items()})
            if (
                payload_digest(e_outer, run.outer_shapes(f), "F32", run.chunk_elements, kind="outer")
                != rec.outer_digest
            ):
                out.append("its outer state differs from the recomputed one (engine functions, exact; outer_digest)")
            change = self._payload(rec.change, run.shapes[f]) if rec.change is not None else None
            if change is None:
                return out + ["its change payload does not decode"]
            new_theta, new_master, new_momentum = rebuild_theta(run, f, theta, change), e_master, e_momentum
        if theta_digest(run, f, new_theta) != rec.theta_digest:
            out.append("its parameters do not hash to its theta_digest")
        if cfg.commit_dtype is None:
            e_theta = cast(e_master, dtypes)
            if not all(np.array_equal(e_theta[n], new_theta[n]) for n in e_theta):
                out.append("its parameters differ from the merge of its participants (engine functions, exact)")
        for what, mine, theirs in (("master", e_master, new_master), ("momentum", e_momentum, new_momentum)):
            if not all(np.array_equal(mine[n], theirs[n]) for n in mine):
                out.append(f"its outer {what} differs from the recomputed one (engine functions, exact)")
        self.states[r] = (new_master, new_momentum, new_theta)  # (all kept: a stalled learner may align an old round)
        # (2) independent float64 cross-check
        d64 = ref.merge64(
            deltas,
            weights,
            rda=isinstance(cfg.merge, RDA),
            direct_pattern=cfg.merge.direct_pattern if isinstance(cfg.merge, RDA) else "",
        )
        if cfg.gap_projection:
            d64 = {n: ref.drop_pullback64(v, master[n], theta[n]) for n, v in d64.items()}
        if final:
            m64, mom64 = ref.final64(master, d64), {n: np.asarray(v, np.float64) for n, v in momentum.items()}
        else:
            m64, mom64 = ref.nesterov64(master, momentum, d64, lr=cfg.outer_lr, beta=cfg.outer_momentum)
        scale = max(float(np.abs(v).max(initial=0.0)) for v in master.values())
        for n in m64:
            if not ref.close(m64[n], new_master[n], scale=scale) or not ref.close(
                mom64[n], new_momentum[n], scale=scale
            ):
                out.append(f"tensor {n}: the committed master/momentum differ from the float64 recomputation")
                break
        self.stats["rounds_verified"] += 1
        return out

    def _snapshot(self, r: int, learner: str, out: list[str]) -> Snapshot | None:
        got = self.snapshots.get(r, {}).get(learner)
        if got is None:
            return None
        try:
            return decode(got[1], Snapshot, key=keys.snapshot_key(r, learner))
        except GradientMailError as e:
            out.append(f"the snapshot of {learner} does not decode: {e}")
            return None

    # ---- at the end ---------------------------------------------------------------------

    def check_tape(self) -> None:
        stored = [keys.parse_round_key(k) for k in self.store.list(keys.ROUNDS)]
        if stored != list(range(len(stored))):
            self.fail("", f"the tape in the store is not contiguous: {stored[:5]}...")
        if sorted(self.tape) != stored:
            self.fail("", "the tape in the store differs from the records the auditor saw created")


class AuditMailbox(ForwardingMailbox):
    """Reports every operation of one node that reaches the shared store to the auditor."""

    def __init__(self, inner: Mailbox, auditor: Auditor, node: str) -> None:
        super().__init__(inner)
        self.auditor, self.node = auditor, node

    def put_if_absent(self, key: str, data: bytes) -> bool:
        created = self.inner.put_if_absent(key, data)
        self.auditor.put(self.node, key, bytes(data), created)
        return created

    def get(self, key: str) -> bytes | None:
        self.auditor.get()
        return self.inner.get(key)

    def get_prefix(self, key: str, n: int) -> bytes | None:
        self.auditor.get()
        return super().get_prefix(key, n)

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        self.auditor.listed(self.node, prefix)
        return self.inner.list(prefix, after)

    def delete(self, keys: Iterable[str]) -> None:
        todo = builtins.list(keys)
        self.auditor.delete(self.node, todo)
        self.inner.delete(todo)
        self.auditor.deleted(todo)
