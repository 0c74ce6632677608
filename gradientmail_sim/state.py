"""What the simulation holds: one ``SimNode`` per simulated process, and ``SimState``, the state
every part of the simulation reads and writes (simulated time, the event queue, the trace, the
shared store and its auditor, the phase), with the few primitives they all use.

The simulation is built in layers, each a class adding to the one below it, so that each
reads on its own:

- ``SimState`` (here): state, queue, trace, time;
- ``Checks`` (``checks.py``): the invariants checked as the run goes and at its end;
- ``NodeActions`` (``actors.py``): what one node does (start, tick, step, crash, leave);
- ``Chaos`` (``chaos.py``): the faults a seed injects (kills, stalls, pauses, brownouts, ghosts);
- ``Simulation`` (``world.py``): the nodes, the event loop and the three phases.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import random
from collections import Counter
from dataclasses import dataclass

import numpy as np

from gradientmail_core.clock import FakeClock
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.syncer.learner import Learner
from gradientmail_core.syncer.node import Node

from .audit import Auditor
from .faults import FaultLog, FaultyMailbox
from .scenario import SimConfig, _views, draw_scenario

# The trace of a verbose run (``python -m gradientmail_sim --seed N -v`` shows it on stdout).
_trace_log = logging.getLogger("gradientmail.sim.trace")


@dataclass
class SimNode:
    name: str
    index: int
    drift: float
    step_period: float
    samples: int
    faulty: FaultyMailbox
    state: str = "down"  # "up", "down" (crashed or not started), "left", "dead" (engine failure)
    incarnation: int = 0
    gen: int = 0  # bumped on every (re)start and crash: queued events of older lives are dropped
    tick_gen: int = 0
    tick_at: float = float("inf")
    stalled_until: float = 0.0
    failures: int = 0
    clock: FakeClock | None = None
    node: Node | None = None
    learner: Learner | None = None
    params: dict[str, np.ndarray] | None = None
    flat: np.ndarray | None = None
    nprng: np.random.Generator | None = None
    start_pending: bool = False


class _Abort(BaseException):
    """Stops the simulation at an invariant violation (a BaseException: engine code must not catch it)."""


class SimState:
    """The simulation's shared state. ``Simulation.__init__`` adds the nodes and their first events."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.draw = draw_scenario(self.rng, config.nodes, config.fleet)
        self.store = MemoryMailbox()
        self.auditor = Auditor(self.store)
        # learner -> when its newest lease key changed: (auditor seq, the key or None, {observer: its clock})
        self.lease_writes: dict[str, list[tuple[int, str | None, dict[tuple[str, int], float]]]] = {}
        self.clock_started: dict[str, float] = {}  # node -> its current clock's reading at (re)start
        self.lease_listed: dict[str, tuple[float, int]] = {}  # node -> (liveness.listed_at, auditor seq)
        self.flog = FaultLog(keep_events=config.verbose)
        self.T = 0.0
        self.queue: list[tuple[float, int, str, str, int]] = []
        self.qseq = 0
        self.hash = hashlib.sha256()
        self.stats: Counter[str] = Counter()
        self.violations: list[str] = []
        self.phase = "faults"
        self.steady_from = float("inf")
        self.deadline = float("inf")
        self.last_commit_at = 0.0
        self.final_from = float("inf")
        self.preempting = False
        self.pending_recovery: set[int] = set()
        size = self.draw.size
        self.target_flat = np.asarray(np.random.default_rng([config.seed, 99]).standard_normal(size), np.float32)
        self.target = _views(self.target_flat, self.draw.shapes)
        self.nodes: dict[str, SimNode] = {}

    def _init_params(self, index: int, incarnation: int) -> np.ndarray:
        g = np.random.default_rng([self.config.seed, index, incarnation, 1])
        return np.asarray(g.standard_normal(self.draw.size), np.float32)

    def _push(self, at: float, name: str, kind: str, gen: int) -> None:
        self.qseq += 1
        heapq.heappush(self.queue, (at, self.qseq, name, kind, gen))

    def _trace(self, line: str) -> None:
        self.hash.update(line.encode())
        self.hash.update(b"\n")
        if self.config.verbose:
            _trace_log.info(line)

    def _advance_to(self, at: float) -> None:
        if at > self.T:
            for sn in self.nodes.values():
                if sn.clock is not None:
                    sn.clock.advance(at - self.T)
            self.T = at
