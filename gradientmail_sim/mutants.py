"""Deliberately broken variants of the engine, to prove the simulation catches real bugs.

Each mutant is a context manager that monkeypatches engine functions or methods and restores
them on exit; the engine's source is never edited. ``tests/test_sim_mutants.py`` runs each
one over a few hundred seeds and asserts that some seed fails, so the simulation's power to
find these bugs cannot silently decay.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gradientmail_core import mailbox
from gradientmail_core.aggregators import fused, merge, outer
from gradientmail_core.errors import MailboxUnavailable, ProtocolError
from gradientmail_core.mailbox import CreateOutcome
from gradientmail_core.protocol import keys, store
from gradientmail_core.protocol.lease import LeaseWriter
from gradientmail_core.protocol.records import Lease
from gradientmail_core.syncer import collector, merger, passes, replay  # noqa: F401
from gradientmail_core.syncer.closing import Closing
from gradientmail_core.syncer.election import Election
from gradientmail_core.syncer.gc import GarbageCollector
from gradientmail_core.syncer.state import NodeState


@contextlib.contextmanager
def _patched(*patches: tuple[Any, str, Any]) -> Iterator[None]:
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def skip_readback() -> contextlib.AbstractContextManager[None]:
    """A create-once write that finds the key taken assumes it was its own earlier write (no
    read-back): a closer that lost the race believes it committed, a superseded closer never
    learns it was superseded."""

    def create_once(mb: Any, key: str, data: bytes) -> tuple[CreateOutcome, bytes | None]:
        if mb.put_if_absent(key, bytes(data)):
            return CreateOutcome.CREATED, None
        return CreateOutcome.ALREADY_OURS, bytes(data)

    return _patched((mailbox, "create_once", create_once), (store, "create_once", create_once))


class _AnyVersion(int):
    """Equal to every version: the closer's staleness check always passes."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = int.__hash__


def accept_stale() -> contextlib.AbstractContextManager[None]:
    """The closer accepts snapshots whose delta is relative to an older version of the fragment."""
    return _patched((collector, "version_before", lambda r, P: _AnyVersion(r // P)))


def sweep_newest() -> contextlib.AbstractContextManager[None]:
    """Garbage collection keeps one round too few: it deletes the payloads of round r-P+1, the
    newest commit of the next fragment (with P=1, of the round it just committed)."""
    orig = GarbageCollector.collect

    def collect(self: GarbageCollector, r: int) -> None:
        orig(self, r)
        cutoff = r - self.state.run.P + 1
        if cutoff >= 0:
            doomed = self.store.keys(keys.round_blobs_prefix(cutoff))
            if doomed:
                self.store.delete(doomed)

    return _patched((GarbageCollector, "collect", collect))


def no_claim_next() -> contextlib.AbstractContextManager[None]:
    """The closer does not claim the next round after committing: every round then waits until
    someone takes it over as unclaimed."""
    orig = Election.try_claim

    def try_claim(self: Election, r: int, n: int, *, previous: str | None, reason: str | None) -> bool:
        if r > 0 and previous is None and reason is None:
            return False
        return orig(self, r, n, previous=previous, reason=reason)

    return _patched((Election, "try_claim", try_claim))


def remote_clock_lease() -> contextlib.AbstractContextManager[None]:
    """Liveness judged on the lease writer's clock: each lease carries its writer's clock reading
    and observers compare it with their own clock (SPEC 3.6 forbids this)."""
    orig_renew = LeaseWriter.renew
    orig_list = NodeState.list_leases

    def renew(self: LeaseWriter, *, local_step: int, tokens: int, force: bool = False) -> None:
        orig_renew(self, local_step=max(int(self.clock.now() * 1000), 0), tokens=tokens, force=force)

    def list_leases(self: NodeState, store: Any) -> None:
        orig_list(self, store)
        for seen in self.liveness.seen.values():
            lease = store.try_record(seen.key, Lease)
            if lease is not None:
                seen.changed_at = lease.local_step / 1000

    return _patched((LeaseWriter, "renew", renew), (NodeState, "list_leases", list_leases))


def skip_sha_check() -> contextlib.AbstractContextManager[None]:
    """Payloads are decoded without checking their sha256: bytes damaged in transit are trusted."""
    from gradientmail_core.codec.payload import decode_payload
    from gradientmail_core.codec.plan import assemble, chunk_spec, chunk_specs
    from gradientmail_core.protocol.records import chunk_refs

    def get_payload(
        self: store.RunStore,
        ref: Any,
        expected: Any,
        *,
        max_bytes: int | None = None,
        dtypes: Any = None,
        chunk_elements: int | None = None,
    ) -> Any:
        specs, parts = chunk_specs(expected, chunk_elements), []
        for r, s in zip(chunk_refs(ref), specs, strict=False):
            data = self.mailbox.get(r.key)
            if data is None:
                return None
            ds = None if dtypes is None else {n: dtypes[n] for n in s.expected}
            parts.append(
                decode_payload(data, s, compression=keys.compression_of(r.key), max_bytes=max_bytes, dtypes=ds)
            )
        return parts[0] if len(specs) == 1 else assemble([list(s.pieces) for s in specs], parts, expected)

    def get_chunk(
        self: store.RunStore, ref: Any, pieces: Any, *, shapes: Any, k: int, n: int, dtypes: Any = None,
        max_bytes: int | None = None, kind: str | None = None, tee: Any = None,
    ) -> Any:  # fmt: skip
        s = chunk_spec(pieces, shapes, k, n)
        data = self.mailbox.get(ref.key)
        if data is None:
            return None
        if tee is not None:
            tee(data)
        ds = None if dtypes is None else {p.name: dtypes[p.name] for p in s.pieces}
        got = decode_payload(data, s, compression=keys.compression_of(ref.key), max_bytes=max_bytes, dtypes=ds)
        return {name: v.reshape(-1) for name, v in got.items()}

    return _patched((store.RunStore, "get_payload", get_payload), (store.RunStore, "get_chunk", get_chunk))


def count_twice() -> contextlib.AbstractContextManager[None]:
    """The merge weighs the first accepted contribution twice."""
    orig = merger.merge_and_step

    def merge(cfg: Any, ranks: Any, span: Any, source: Any, op: Any, *rest: Any) -> Any:
        if len(op.accepted) > 1:
            read = source.chunk
            source = passes.Source(lambda i, k: read(max(i - 1, 0), k), in_memory=source.in_memory, threaded=False)
            op = dataclasses.replace(op, accepted=(op.accepted[0], *op.accepted))
        return orig(cfg, ranks, span, source, op, *rest)

    return _patched((merger, "merge_and_step", merge))


def stale_view_is_fatal() -> contextlib.AbstractContextManager[None]:
    """The bug fixed in 0461177: a node that becomes closer on a stale view (paused after its
    listing while the run committed and collected 2P rounds) dies on the missing parameters."""
    orig = Closing.fragment_state

    def fragment_state(self: Closing, f: int) -> Any:
        try:
            return orig(self, f)
        except MailboxUnavailable as e:
            if "newer commits exist" in str(e):
                raise ProtocolError(str(e)) from e
            raise

    return _patched((Closing, "fragment_state", fragment_state))


def gc_forgets_checkpoints() -> contextlib.AbstractContextManager[None]:
    """Garbage collection treats every record as a checkpoint: between checkpoints it deletes the
    contributions (and, 2P rounds on, the changes and the checkpoint) a recovery replays."""

    def checkpoint_rounds(self: GarbageCollector) -> list[int]:
        return [rec.round if (rec := self.state.newest.get(f)) else -1 for f in range(self.state.run.P)]

    return _patched((GarbageCollector, "_checkpoint_rounds", checkpoint_rounds))


def gc_ignores_window() -> contextlib.AbstractContextManager[None]:
    """Garbage collection keeps no verify window: after each commit it deletes the contributions,
    snapshot records and states the newest rounds' verification needs, as with ``verify_window=0``."""
    return _patched((GarbageCollector, "_window", lambda self, r: (r + 1, r + 1, r + 1)))


def replay_skips_contribution() -> contextlib.AbstractContextManager[None]:
    """A node that becomes closer between checkpoints replays each round without its last
    contribution, and trusts the result (no comparison with the record's digests)."""
    orig = replay._contributions

    def contributions(store: Any, run: Any, rec: Any, *args: Any) -> Any:
        got = orig(store, run, rec, *args)
        return got[:-1] if len(got) > 1 else got

    return _patched((replay, "_contributions", contributions), (replay, "differences", lambda *args: []))


# ---- the arithmetic itself -------------------------------------------------------------------
# These patch the merge and outer-step functions everywhere the engine reaches them (the closer
# and the auditor's exact recomputation both call them), so only the simulation's independent
# float64 reference (``sim/reference.py``) can tell the committed numbers are wrong.


def weights_not_normalised() -> contextlib.AbstractContextManager[None]:
    """The merge weights are used as they are (``tokens**2 / steps``), not divided by their sum."""

    def normalized(weights: Any, n: int) -> list[float]:
        assert len(weights) == n
        return [float(w) for w in weights]

    return _patched((merge, "normalized", normalized), (merge, "_normalized", normalized))


def rda_length_unweighted() -> contextlib.AbstractContextManager[None]:
    """RDA's length is the plain sum of the contributions' norms, not their weighted mean."""
    return _patched((fused, "rda_radius", lambda p, norms: float(sum(n for n in norms if n > 0.0))))


def _outer_patches(step: Callable[..., Any]) -> contextlib.AbstractContextManager[None]:
    return _patched((outer, "outer_step_tensor", step))


def nesterov_without_momentum() -> contextlib.AbstractContextManager[None]:
    """The outer step updates the momentum but leaves it out of the parameter update:
    ``theta - lr * d`` instead of ``theta - lr * (d + beta * m)``."""
    orig = outer.outer_step_tensor

    def step(theta: Any, momentum: Any, delta: Any, *, lr: float, beta: float, scale: Any = None, **kw: Any) -> Any:
        d = np.array(delta, np.float32)  # (a copy: the closer steps in place, over the merged delta)
        t_new, m_new = orig(theta, momentum, delta, lr=lr, beta=beta, scale=scale, **kw)
        if scale is not None:
            d = d * scale
        np.subtract(np.asarray(theta, np.float32), np.float32(lr) * d, out=t_new)
        return t_new, m_new

    return _outer_patches(step)


def outer_lr_twice() -> contextlib.AbstractContextManager[None]:
    """The outer learning rate is applied twice: ``theta - lr * lr * (d + beta * m)``."""
    orig = outer.outer_step_tensor

    def step(theta: Any, momentum: Any, delta: Any, *, lr: float, beta: float, **kw: Any) -> Any:
        return orig(theta, momentum, delta, lr=lr * lr, beta=beta, **kw)

    return _outer_patches(step)


def pullback_also_pushes() -> contextlib.AbstractContextManager[None]:
    """``gap_projection`` takes out of the merged delta its push along the master's rounding too
    (``c`` clipped to [-1, 1], not [-1, 0]): the learners' progress away from the master is lost."""

    orig = outer.drop_pullback

    def drop(delta: np.ndarray, master: np.ndarray, theta: np.ndarray) -> None:
        np.negative(delta, out=delta)  # the pushes, as pulls of the negated delta, taken out first
        orig(delta, master, theta)
        np.negative(delta, out=delta)
        orig(delta, master, theta)

    return _patched((outer, "drop_pullback", drop))


MUTANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "skip_readback": skip_readback,
    "accept_stale": accept_stale,
    "sweep_newest": sweep_newest,
    "gc_ignores_window": gc_ignores_window,
    "no_claim_next": no_claim_next,
    "remote_clock_lease": remote_clock_lease,
    "skip_sha_check": skip_sha_check,
    "count_twice": count_twice,
    "stale_view_is_fatal": stale_view_is_fatal,
    "gc_forgets_checkpoints": gc_forgets_checkpoints,
    "replay_skips_contribution": replay_skips_contribution,
    "weights_not_normalised": weights_not_normalised,
    "rda_length_unweighted": rda_length_unweighted,
    "nesterov_without_momentum": nesterov_without_momentum,
    "outer_lr_twice": outer_lr_twice,
    "pullback_also_pushes": pullback_also_pushes,
}


def active(name: str) -> contextlib.AbstractContextManager[None]:
    try:
        return MUTANTS[name]()
    except KeyError:
        raise ValueError(f"unknown mutant {name!r}; expected one of {sorted(MUTANTS)}") from None
