"""The training-thread half of a learner: counts steps, decides when a fragment is due,
hands contributions to the node, and aligns with commits in place between steps.

Nothing here does I/O; only ``overlap_steps`` (and ``close``) wait on the commit queue the node
fills. With a device pipeline, publishing and aligning only queue device work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from .. import events as ev
from ..adapters.base import Adapter
from ..adapters.handles import Contribution, FragmentIO, Incoming, Mover
from ..clock import Clock
from ..config import Adaptive, Carry
from ..errors import MailboxUnavailable, PayloadCorrupt
from ..protocol.run import RunInfo
from ..protocol.schedule import fragment_of, nominal_step
from .bridge import Bridge, CommitNotice, Publish


@dataclass
class _Pending:
    round: int
    local_step: int


class Learner:
    def __init__(
        self,
        adapter: Adapter,
        run: RunInfo,
        bridge: Bridge,
        clock: Clock,
        *,
        learner: str,
        emit: Callable[[ev.Event], None],
        io: Mover | None = None,
    ) -> None:
        self.adapter, self.run, self.bridge, self.clock, self.me, self.emit = adapter, run, bridge, clock, learner, emit
        # Error feedback only where deltas are quantized (``adapters/feedback.py``). ``io``: another
        # way to move fragments (a sharded node's, ``sharded/runtime.py``: every rank its part).
        self.io: Mover = io or FragmentIO(adapter, feedback=run.cfg.error_feedback and run.cfg.delta_dtype is not None)
        bridge.stage = self.io.stage
        self.cfg = run.cfg
        self.local_step = 0
        self.tokens = 0
        self.next_round = 0
        self.aligned = -1
        self.anchors: dict[int, Mapping[str, np.ndarray]] = {}
        self.versions: dict[int, int] = {}
        self.steps_since_any = 0
        self.steps_since = [0] * run.P
        self.tokens_since = [0] * run.P
        self.seconds_since = [0.0] * run.P
        self.published: deque[_Pending] = deque()
        # The last contribution of each fragment (its round and delta handle) until a commit of
        # the fragment arrives: the snapshot Carry keeps the local steps since.
        self._sent: dict[int, tuple[int, Contribution]] = {}
        self._carrying: dict[int, bool] = {}  # Adaptive: each fragment's current rule
        # Per fragment, (round, steps) of each contribution handed over that no commit has merged yet.
        self._unlanded: list[list[tuple[int, int]]] = [[] for _ in range(run.P)]
        self._keeps_snapshots = isinstance(self.cfg.alignment, Carry | Adaptive)
        self._last_step_at: float | None = None
        self._nominal0 = 0
        # Anchors turned into deltas in place: the host path without Carry/Adaptive (which read the
        # anchor again). Only anchors the node lent (``CommitNotice.lent``: nothing else holds them)
        # are consumed; a consumed fragment has no anchor until a commit of the round it went to
        # replaces it, which ``in_flight`` (at most ``fragments``) makes come before the fragment's
        # next round is due (``maybe_publish`` also waits for it; ``write_newest`` reads it back).
        self.consumes = isinstance(self.io, FragmentIO) and self.io.consumes and not self._keeps_snapshots
        bridge.lend = self.consumes
        self._lent: set[int] = set()
        # ``write_newest`` for a fragment whose anchor is consumed: its newest committed
        # parameters, read from the store (set by ``join_run``).
        self.reload: Callable[[int], Mapping[str, np.ndarray] | None] | None = None

    # ---- start and align ----------------------------------------------------------------

    def start(
        self,
        head: int,
        thetas: Mapping[int, Mapping[str, np.ndarray]],
        versions: Mapping[int, int],
        incoming: Mapping[int, Incoming] | None = None,
        *,
        lent: bool = False,
        cosines: Mapping[int, float | None] | None = None,
    ) -> None:
        """Load the newest committed parameters into the model before the first step.
        ``incoming``: each fragment's parameters already on their way (``Placement.joining``);
        ``lent``: ``thetas`` are this learner's alone (``CommitNotice.lent``); ``cosines``: each
        fragment's newest commit's cosine, where Adaptive starts a joining learner (``_carries``)."""
        for f, theta in thetas.items():
            (incoming[f] if incoming is not None else self.io.stage(theta)).write()
            self.anchors[f] = theta
            self.versions[f] = versions[f]
            if lent:
                self._lent.add(f)
        rule = self.cfg.alignment
        if isinstance(rule, Adaptive):
            # A learner joining a run under way starts each fragment on the rule its newest commit
            # implies: Carry unless the learners disagreed (at most ``overwrite_below``), as the
            # ones that ran through the run's agreeing rounds have. Started on Overwrite, a learner
            # restarted late in a run (when the cosines have fallen between the two thresholds)
            # would drop its in-flight steps until the end of the run.
            for f, cosine in (cosines or {}).items():
                self._carrying[f] = cosine is not None and cosine > rule.overwrite_below
        self.aligned = head
        self.next_round = head + 1
        # The schedule is anchored where this learner joined: round r is due once it has
        # trained nominal_step(r) - nominal_step(head) steps. Early contributions (into a
        # round others already published to) do not shift it, so learners that train the
        # same number of steps contribute to the same rounds.
        self._nominal0 = nominal_step(head, self.cfg.sync_every, self.run.P)

    def apply(self, c: CommitNotice) -> None:
        """Align fragment ``c.fragment`` with a commit, in place, by the run's alignment rule."""
        if c.refused:
            # Not applied (follower.CommitScreen): this learner waits for the round no longer, and keeps the
            # fragment as it is (its next contribution of it is stale until a commit it applies).
            while self.published and self.published[0].round <= c.round:
                self.published.popleft()
            return
        if c.version <= self.versions.get(c.fragment, -1):
            return
        f = c.fragment
        incoming = c.incoming or self.io.stage(c.theta)
        # The newest round of the fragment, up to this one, that merged this learner's contribution:
        # this one, or one the node read while it skipped records to catch up (``c.landed``).
        landed = c.round if self.me in c.participants else c.landed
        # Handed over, of rounds up to this one, and in no commit: Carry keeps it in the local delta.
        self._unlanded[f] = [(r, n) for r, n in self._unlanded[f] if landed is None or r > landed]
        carried = 0
        if self._carries(c):
            sent = self._sent.get(f)
            # The snapshot is what this learner sent to the committed round, or to an earlier round
            # of the fragment that merged it (the commit descends from it); without a part in either,
            # everything since the anchor is still local only, and is kept.
            since = sent[1] if sent is not None and sent[0] == landed else None
            incoming.carry(since, self.anchors[f])
            keep = 1.0
            carried = sum(n for r, n in self._unlanded[f] if r <= c.round)
        else:
            incoming.write(self.cfg.mixing)
            keep = self.cfg.mixing
            self._unlanded[f] = [(r, n) for r, n in self._unlanded[f] if r > c.round]
        if f in self._sent and self._sent[f][0] <= c.round:
            del self._sent[f]
        if landed is not None and landed < c.round:  # (its round skipped: the delta it owes is due)
            self.io.settle(f, landed, merged=True)
        self.io.settle(f, c.round, merged=self.me in c.participants)
        self.anchors[f] = c.theta
        if c.lent:  # (only ever set where this learner consumes: ``Bridge.lend``)
            self._lent.add(f)
        else:
            self._lent.discard(f)
        self.versions[f] = c.version
        # Replacing the fragment drops the training it held since the contribution (all of it,
        # or 1 - mixing of it; none with Carry), so the next contribution reports only the
        # steps its delta still carries.
        kept = round(self.steps_since[f] * keep)
        dropped, self.steps_since[f] = self.steps_since[f] - kept, kept
        self.tokens_since[f] = round(self.tokens_since[f] * keep)
        self.seconds_since[f] *= keep
        self.aligned = max(self.aligned, c.round)
        while self.published and self.published[0].round <= self.aligned:
            self.published.popleft()
        self.emit(
            ev.Aligned(self.me, c.round, c.fragment, c.version, c.nbytes, c.participants, c.cosine, dropped, carried)
        )

    def _carries(self, c: CommitNotice) -> bool:
        """Whether the alignment rule keeps the local steps for this commit (Carry, or Adaptive
        on a fragment whose rounds have agreed enough: hysteresis between its two thresholds)."""
        rule = self.cfg.alignment
        if isinstance(rule, Carry):
            return True
        if not isinstance(rule, Adaptive):
            return False
        carrying = self._carrying.get(c.fragment, False)
        if c.cosine is not None:
            if c.cosine >= rule.carry_above:
                carrying = True
            elif c.cosine <= rule.overwrite_below:
                carrying = False
        self._carrying[c.fragment] = carrying
        return carrying

    def drain(self) -> None:
        """Align with every commit the node has queued (this thread is the queue's only reader)."""
        while not self.bridge.inbox.empty():
            self.apply(self.bridge.inbox.get_nowait())

    # ---- stepping -----------------------------------------------------------------------

    def step(self, samples: int, *, wait: Callable[[], CommitNotice | None] | None = None) -> None:
        now = self.clock.now()
        elapsed = 0.0 if self._last_step_at is None else now - self._last_step_at
        self._last_step_at = now
        self.local_step += 1
        self.tokens += samples
        self.steps_since_any += 1
        for f in range(self.run.P):
            self.steps_since[f] += 1
            self.tokens_since[f] += samples
            self.seconds_since[f] += elapsed
        self.bridge.local_step, self.bridge.tokens = self.local_step, self.tokens
        versions = dict(self.versions)
        self.drain()
        f = fragment_of(max(self.next_round, self.bridge.view.head + 1), self.run.P)
        if self.versions.get(f) == versions.get(f):
            # Not in the step a commit replaced the fragment: its training since the last
            # contribution is gone, the delta would be empty. It goes out after the next step.
            self.maybe_publish()
        if self.cfg.overlap_steps is not None and wait is not None:
            blocked_from = self.clock.now()
            waited = False
            while self.published and self.local_step - self.published[0].local_step >= self.cfg.overlap_steps:
                waited = True
                c = wait()
                if c is not None:
                    self.apply(c)
                    self.drain()
            if waited:
                # Time blocked on the overlap bound is not training: the next step's duration
                # starts when this wait ended, so ``step_seconds`` (and the grace window the
                # closer derives from it) counts training time only.
                assert self._last_step_at is not None
                self._last_step_at += self.clock.now() - blocked_from

    def maybe_publish(self, *, final: bool = False) -> bool:
        view = self.bridge.view
        self.next_round = max(self.next_round, view.head + 1)
        r = self.next_round
        assert self.cfg.in_flight is not None
        if r - self.aligned > self.cfg.in_flight:
            return False
        if fragment_of(r, self.run.P) not in self.anchors:
            # Its anchor went into the last contribution of the fragment and no commit of that
            # round has arrived yet (it follows from in_flight, except when the node skipped
            # records to catch up and the fragment's newest is still on its way).
            return False
        if not final:
            due = self.local_step >= nominal_step(r, self.cfg.sync_every, self.run.P) - self._nominal0
            early = self.steps_since_any > 0 and r in view.others_published
            if not (due or early):
                return False
        self.publish(r, final=final)
        return True

    def publish(self, r: int, *, final: bool = False) -> None:
        f = fragment_of(r, self.run.P)
        steps = self.steps_since[f]
        if steps > 0:
            names = self.run.fragments[f]
            if f in self._lent:
                assert isinstance(self.io, FragmentIO)
                self._lent.discard(f)
                delta = self.io.consume(names, self.anchors.pop(f), slot=(f, r))
            else:
                delta = self.io.capture(names, self.anchors[f], keep=self._keeps_snapshots, slot=(f, r))
            if self._keeps_snapshots:
                self._sent[f] = (r, delta)
            self._unlanded[f].append((r, steps))
            self.bridge.publish(
                Publish(
                    round=r,
                    fragment=f,
                    base_version=self.versions[f],
                    delta=delta,
                    steps=steps,
                    tokens=self.tokens_since[f],
                    local_step=self.local_step,
                    step_seconds=self.seconds_since[f] / steps,
                    final=final,
                )
            )
            self.published.append(_Pending(r, self.local_step))
        self.steps_since[f] = self.tokens_since[f] = 0
        self.seconds_since[f] = 0.0
        self.steps_since_any = 0
        self.next_round = r + 1

    def write_newest(self) -> None:
        """Set the whole model to the newest committed parameters this learner holds (a fragment
        whose anchor went into a contribution no commit has answered yet: read back through
        ``reload``, or left as trained if that fails)."""
        for f in range(self.run.P):
            theta = self.anchors.get(f)
            if theta is None and f in self.versions and self.reload is not None:
                try:
                    theta = self.reload(f)
                except (MailboxUnavailable, PayloadCorrupt) as e:
                    self.emit(ev.StoreFailure(self.me, f"could not read fragment {f}'s parameters back: {e}"))
            if theta is not None:
                self.adapter.write(theta)
