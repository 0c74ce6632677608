"""What one simulated node does, each a real ``Node`` + ``Learner`` pair over its own
``FaultyMailbox``: (re)start and join the run, tick its node (the background thread's poll),
step its learner (one local training step of the tiny model), crash, and leave.

Every queued node event (``start``, ``tick``, ``step``) goes through ``_dispatch``; events of a
node's older lives (its ``gen`` moved on since they were queued) are dropped.
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Callable

import numpy as np

from gradientmail_core import events as ev
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.clock import FakeClock
from gradientmail_core.errors import MailboxUnavailable
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.host import join_run

from .checks import Checks
from .faults import InjectedCrash
from .scenario import _views
from .state import SimNode, _Abort


class NodeActions(Checks):
    def _dispatch(self, name: str, kind: str, gen: int) -> None:
        sn = self.nodes[name]
        if kind == "start":
            if gen == sn.gen and sn.state in ("down", "left"):
                self._start(sn)
            return
        if gen != (sn.tick_gen if kind == "tick" else sn.gen) or sn.state != "up":
            return
        if self.T < sn.stalled_until:
            self._push(sn.stalled_until, name, kind, gen)
            return
        if kind == "tick":
            self.stats["ticks"] += 1
            self._tick(sn)
        elif kind == "step" and self.phase != "final":
            self.stats["steps"] += 1
            self._step(sn)

    # ---- node actions -------------------------------------------------------------------

    def _emit(self, sn: SimNode) -> Callable[[ev.Event], None]:
        def emit(e: ev.Event) -> None:
            self._trace(f"{self.T:.6f} {e.describe()}")
            kind = type(e).__name__
            if isinstance(e, ev.TookOver):
                self.stats[f"took_over/{e.reason}"] += 1
                if e.reason == "lease_lost":
                    self._check_lease_judgement(sn, e.previous)
            elif isinstance(e, ev.ContributionRejected):
                self.stats[f"engine_rejected/{e.reason}"] += 1
            else:
                self.stats[kind] += 1
            if self.T >= self.steady_from and isinstance(e, ev.TookOver | ev.Superseded):
                self.violations.append(f"at {self.T:.2f} s, in the steady phase: {e.describe()}")
                raise _Abort("a steady run must keep its closer")
            if isinstance(e, ev.Aligned):
                self._check_aligned(sn, e)
            if isinstance(e, ev.BackgroundFailed | ev.GaveUp):
                self.violations.append(f"{e.describe()}")

        return emit

    def _start(self, sn: SimNode) -> None:
        sn.start_pending = False
        sn.incarnation += 1
        sn.gen += 1
        sn.tick_gen += 1
        sn.clock = FakeClock(start=self.rng.uniform(0.0, 10_000.0), drift=sn.drift)
        sn.faulty.clock = sn.clock
        self.clock_started[sn.name] = sn.clock.now()  # a fresh process has seen no lease before now
        sn.faulty.pending_crash = None
        sn.flat = self._init_params(sn.index, sn.incarnation)
        sn.params = _views(sn.flat, self.draw.shapes)  # the model's tensors are views of one buffer: one op trains all
        sn.nprng = np.random.default_rng([self.config.seed, sn.index, sn.incarnation, 2])
        adapter = NumpyAdapter(sn.params)
        emit = self._emit(sn)
        store = RunStore(sn.faulty, on_ignored=lambda k, why: emit(ev.IgnoredObject(sn.name, k, why)))
        self._trace(f"{self.T:.6f} {sn.name} start #{sn.incarnation}")
        # three draws, in this order: the run id's rng (used if this node creates the run), the
        # node's nonce, the node's own rng
        open_rng = random.Random(self.rng.getrandbits(32))
        nonce = f"{self.rng.getrandbits(64):016x}"
        node_rng = random.Random(self.rng.getrandbits(32))
        try:
            node, learner = join_run(
                store,
                adapter,
                self.draw.cfg,
                sn.clock,
                learner=sn.name,
                nonce=nonce,
                emit=emit,
                options=self.draw.options,
                rng=open_rng,
                node_rng=node_rng,
            )
        except (MailboxUnavailable, InjectedCrash) as e:
            self.stats["failed_starts"] += 1
            self._trace(f"{self.T:.6f} {sn.name} start failed: {type(e).__name__}")
            if isinstance(e, InjectedCrash):
                self._note_crash(sn)
            sn.faulty.pending_crash = None
            self._schedule_start(sn, self.rng.uniform(0.5, 4.0))  # a supervisor restarts it
            return
        except Exception as e:
            raise _Abort(f"{sn.name} failed to join: {type(e).__name__}: {e}\n{traceback.format_exc()}") from e
        if sn.faulty.pending_crash is not None:
            self._crash(sn, "crashed right after joining")
            return
        sn.node, sn.learner, sn.state, sn.failures = node, learner, "up", 0
        self.lease_listed.pop(sn.name, None)
        self._note_lease_listing(sn)
        self.stats["starts"] += 1
        self._schedule_tick(sn, self.T + self.rng.uniform(0.0, 0.1))
        self._push(self.T + sn.step_period * self.rng.uniform(0.5, 1.5), sn.name, "step", sn.gen)

    def _schedule_start(self, sn: SimNode, delay: float) -> None:
        sn.gen += 1
        sn.start_pending = True
        self._push(self.T + delay, sn.name, "start", sn.gen)

    def _schedule_tick(self, sn: SimNode, at: float) -> None:
        sn.tick_gen += 1
        sn.tick_at = at
        self._push(at, sn.name, "tick", sn.tick_gen)

    def _tick(self, sn: SimNode) -> None:
        assert sn.node is not None
        self._trace(f"{self.T:.6f} {sn.name} tick")
        try:
            sn.node.tick()
            sn.failures = 0
        except MailboxUnavailable as e:
            sn.failures += 1
            self.stats["tick_failures"] += 1
            self._trace(f"{self.T:.6f} {sn.name} store failure: {e}")
        except InjectedCrash as e:
            self._crash(sn, str(e))
            return
        except _Abort:
            raise
        except Exception as e:
            raise _Abort(
                f"{sn.name}'s tick raised {type(e).__name__}: {e} (a Session would die here)\n{traceback.format_exc()}"
            ) from e
        self._note_lease_listing(sn)
        if sn.faulty.pending_crash is not None:
            self._crash(sn, sn.faulty.pending_crash.describe())
            return
        poll = self.draw.options.poll_interval * min(2**sn.failures, 16)
        self._schedule_tick(sn, self.T + poll / sn.drift * self.rng.uniform(0.9, 1.1))

    def _step(self, sn: SimNode) -> None:
        assert sn.learner is not None and sn.flat is not None and sn.nprng is not None and sn.node is not None
        flat = sn.flat
        flat -= np.float32(0.1) * (flat - self.target_flat)
        flat += np.float32(0.02) * sn.nprng.standard_normal(self.draw.size, np.float32)
        sn.learner.step(sn.samples)
        if sn.node.bridge.outbox:  # a contribution is ready: the session wakes its background thread
            at = self.T + 0.01 / sn.drift
            if at < sn.tick_at:
                self._schedule_tick(sn, at)
        self._push(self.T + sn.step_period * self.rng.uniform(0.8, 1.2), sn.name, "step", sn.gen)

    def _note_crash(self, sn: SimNode) -> None:
        for r in self.auditor.round_blob_writes.get(sn.name, {}):
            if r not in self.auditor.tape:
                self.pending_recovery.add(r)

    def _crash(self, sn: SimNode, why: str) -> None:
        self._trace(f"{self.T:.6f} {sn.name} crash: {why}")
        self.stats["crashes"] += 1
        self._note_crash(sn)
        sn.state = "down"
        sn.node = sn.learner = sn.params = sn.flat = sn.clock = None
        sn.faulty.pending_crash = None
        sn.stalled_until = 0.0
        delay = self.rng.uniform(0.2, 3 * self.draw.options.lease_timeout) if self.phase == "faults" else 0.1
        self._schedule_start(sn, delay)

    def _leave(self, sn: SimNode) -> None:
        assert sn.learner is not None and sn.node is not None
        self._trace(f"{self.T:.6f} {sn.name} leaves")
        sn.learner.drain()
        sn.learner.write_newest()
        try:
            sn.node.leave()
        except (MailboxUnavailable, InjectedCrash):
            pass  # the lease then goes stale on its own
        self.stats["leaves"] += 1
        sn.state = "left"
        sn.node = sn.learner = sn.params = sn.flat = sn.clock = None
        sn.faulty.pending_crash = None
        sn.gen += 1
        if self.rng.random() < 0.7:
            self._schedule_start(sn, self.rng.uniform(0.5, 10.0))
