"""A deterministic, single-threaded simulation of many learners (each also a potential closer)
over one in-memory mailbox, with faults, driven by one seed.

Every node is a real ``Node`` + ``Learner`` pair with a tiny numpy model, its own ``FakeClock``
(own offset, own drift against simulated time) and its own ``FaultyMailbox`` on the path to
the shared store; an ``AuditMailbox`` below the faults reports to the ``Auditor``. An event
queue decides who acts next (a train step, a tick of the node, a (re)start) and a chaos timer
kills nodes (at once, or armed to die at their k-th next store call in one of three phases),
stalls them, makes them leave and rejoin, and browns out parts of the store.

A run has three phases:

1. *faults*, until 60% of the rounds have committed;
2. *quiet*: faults off, stalled nodes resumed, crashed nodes restarted; after a settling window
   the run must be *steady* (no takeover, no superseded closer) and commit every round within a
   bound, until all rounds have committed;
3. *final*: no more training; nodes keep polling until each holds the newest commit; then every
   surviving node must hold bit-identical parameters equal to the newest committed ones.

The trace (who did what when, every engine event, every fault) is hashed: a seed replays
exactly, and ``python -m gradientmail_sim --seed N -v`` prints it.

The simulation's parts, each building on the one before: ``scenario.py`` (the config, the result,
what the seed draws), ``state.py`` (the shared state, the event queue, the trace), ``checks.py``
(the invariants), ``actors.py`` (what one node does), ``chaos.py`` (the injected faults) and,
here, the nodes, the event loop and the phases.
"""

from __future__ import annotations

import heapq
import os
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor

from .audit import AuditMailbox
from .chaos import Chaos
from .faults import FaultyMailbox
from .scenario import SimConfig, SimResult
from .state import SimNode, _Abort


class Simulation(Chaos):
    def __init__(self, config: SimConfig) -> None:
        super().__init__(config)
        self.auditor.on_commit.append(self._committed)
        self.auditor.on_lease.append(self._lease_changed)
        d = self.draw
        for i in range(d.nodes):
            name = f"n{i}"
            faulty = FaultyMailbox(
                AuditMailbox(self.store, self.auditor, name),
                rng=random.Random(config.seed * 7919 + i),
                node=name,
                log=self.flog,
                page_size=self.rng.choice([None, None, 1, 2, 3, 7]),
            )
            if config.faults:
                faulty.rules = self._background_faults(name)
                faulty.tap = self._tapper(name)
            self.nodes[name] = SimNode(
                name,
                i,
                drift=self.rng.uniform(0.85, 1.2),
                step_period=self.rng.uniform(0.15, 0.4),
                samples=self.rng.choice([2, 4, 8]),
                faulty=faulty,
            )
        for i, sn in enumerate(self.nodes.values()):
            # most start together; some join the running run later
            at = self.rng.uniform(0.0, 1.0) if i == 0 or self.rng.random() < 0.7 else self.rng.uniform(3.0, 15.0)
            self._push(at, sn.name, "start", sn.gen)
            sn.start_pending = True
        if config.faults:
            self._push(self.rng.expovariate(1 / d.chaos_every), "", "chaos", 0)

    # ---- the event loop -----------------------------------------------------------------

    def run(self) -> SimResult:
        d = self.draw
        self._trace(f"seed {self.config.seed}: {d.nodes} nodes, {d.cfg}, {d.options}")
        try:
            self._loop()
        except _Abort as e:
            self.violations.append(str(e))
        self.auditor.check_tape()
        if not self.violations and not self.auditor.violations:
            self._check_end()
        violations = [str(v) for v in self.auditor.violations] + self.violations
        stats = self.stats + self.auditor.stats
        losses = (0.0, 0.0)
        # Only a run that held every invariant: a round the auditor refused (a mutant caught) has
        # no recomputed state, so between checkpoints its parameters are nowhere to be read.
        if self.auditor.run is not None and not violations:
            losses = (self._loss(self._newest_params(initial=True)), self._loss(self._newest_params()))
        return SimResult(
            self.config,
            violations,
            self.hash.hexdigest(),
            stats,
            Counter(self.flog.counts),
            Counter(self.flog.resolved),
            self.T,
            self.auditor.head + 1,
            losses,
            self.auditor.run.cfg if self.auditor.run is not None else None,
            d.nodes,
        )

    def _loop(self) -> None:
        rounds = self.config.rounds
        while self.queue:
            at, _, name, kind, gen = heapq.heappop(self.queue)
            self._advance_to(at)
            if self.auditor.violations:
                raise _Abort("stopped at the first invariant violation")
            if self.phase == "faults" and (
                self.auditor.head + 1 >= self.draw.fault_share * rounds or self.T > 3.0 * rounds
            ):
                self._enter_quiet()
            if self.phase == "quiet" and self.auditor.head + 1 >= rounds:
                self._enter_final()
            if self.phase == "final" and self._settled():
                return
            if self.T > self.deadline:
                raise _Abort(
                    f"no progress: {self.auditor.head + 1} of {rounds} rounds committed by simulated "
                    f"second {self.T:.1f} (the {self.phase} phase's bound)"
                )
            if kind == "chaos":
                if self.phase == "faults":
                    self._chaos()
                    self._push(self.T + self.rng.expovariate(1 / self.draw.chaos_every), "", "chaos", 0)
                continue
            self._dispatch(name, kind, gen)

    def _committed(self, r: int, rec: object) -> None:
        self.last_commit_at = self.T
        if r in self.pending_recovery:
            self.pending_recovery.discard(r)
            self.stats["recovered_between_payload_and_record"] += 1
        if self.phase == "quiet" and self.T >= self.steady_from:
            self.deadline = self.T + self._round_bound()

    # ---- phases -------------------------------------------------------------------------

    def _round_bound(self) -> float:
        """Simulated seconds within which a healthy run commits its next round."""
        o, cfg = self.draw.options, self.draw.cfg
        slowest = max(sn.step_period for sn in self.nodes.values()) / min(sn.drift for sn in self.nodes.values())
        gap = -(-cfg.sync_every // cfg.fragments)
        return 4 * (gap + 1) * slowest + 2 * o.round_timeout_floor + o.lease_timeout + 8 * o.poll_interval

    def _enter_quiet(self) -> None:
        self.phase = "quiet"
        self._trace(f"{self.T:.6f} quiet")
        self.stats["quiet_at_round"] = self.auditor.head + 1
        for sn in self.nodes.values():
            sn.faulty.enabled = False
            sn.faulty.clear()
            sn.stalled_until = min(sn.stalled_until, self.T)
            if sn.faulty.pending_crash is not None and sn.state == "up":
                self._crash(sn, sn.faulty.pending_crash.describe())
            elif sn.state == "down":
                self._schedule_start(sn, 0.05)
        if not any(sn.state in ("up", "down") for sn in self.nodes.values()):
            self._schedule_start(next(iter(self.nodes.values())), 0.05)
        o = self.draw.options
        settle = 3 * o.lease_timeout + 3 * o.round_timeout_floor + 2.0
        self.steady_from = self.T + settle
        self.deadline = self.steady_from + self._round_bound()

    def _enter_final(self) -> None:
        self.phase = "final"
        self._trace(f"{self.T:.6f} final")
        self.final_from = self.T
        o = self.draw.options
        self.deadline = self.T + 4 * o.lease_timeout + 4 * o.round_timeout_floor + 10.0

    def _settled(self) -> bool:
        # A few polls after the last commit (rounds still in flight may land), every node must
        # be at the newest commit with nothing left to send.
        quiet = 4 * self.draw.options.poll_interval
        if self.T - self.final_from < quiet or self.T - self.last_commit_at < quiet:
            return False
        head = self.auditor.head
        return all(
            sn.node is not None and sn.node.state.head == head and not sn.node.bridge.outbox
            for sn in self.nodes.values()
            if sn.state == "up"
        )


def run_seed(
    seed: int,
    rounds: int = 50,
    *,
    faults: bool = True,
    nodes: int | None = None,
    verbose: bool = False,
    mutant: str | None = None,
    fleet: bool = False,
) -> SimResult:
    """Run one seed (inside ``mutants.active(mutant)`` when a mutant is named); ``fleet``: of
    64..96 learners."""
    config = SimConfig(
        seed=seed, rounds=rounds, faults=faults, nodes=nodes, verbose=verbose, mutant=mutant, fleet=fleet
    )
    if mutant is None:
        return Simulation(config).run()
    from .mutants import active

    with active(mutant):
        return Simulation(config).run()


def _run_one(args: tuple[int, int, bool, int | None, str | None, bool]) -> SimResult:
    seed, rounds, faults, nodes, mutant, fleet = args
    return run_seed(seed, rounds, faults=faults, nodes=nodes, mutant=mutant, fleet=fleet)


def run_many(
    seeds: Iterable[int],
    rounds: int = 50,
    *,
    faults: bool = True,
    nodes: int | None = None,
    mutant: str | None = None,
    workers: int | None = None,
    fleet: bool = False,
) -> Iterator[SimResult]:
    """Run seeds in ``workers`` processes (default: the CPUs this process may use), yielding
    results in seed order as they complete."""
    jobs = [(s, rounds, faults, nodes, mutant, fleet) for s in seeds]
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if workers <= 1 or len(jobs) <= 1:
        yield from map(_run_one, jobs)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(_run_one, jobs, chunksize=max(1, min(16, len(jobs) // (4 * workers))))


__all__ = ["SimConfig", "SimResult", "Simulation", "run_many", "run_seed"]
