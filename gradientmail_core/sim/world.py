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
exactly, and ``python -m gradientmail_core.sim --seed N -v`` prints it.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import random
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from .. import events as ev
from ..adapters.base import NumpyAdapter
from ..clock import FakeClock
from ..codec.payload import encode_payload, sha256_hex
from ..config import RDA, DiLoCo, WeightedMean
from ..errors import MailboxUnavailable
from ..mailbox.faults import Fault, FaultLog, FaultyMailbox, InjectedCrash, Op, Phase
from ..mailbox.memory import MemoryMailbox
from ..protocol import keys
from ..protocol.records import PayloadRef, Snapshot, encode
from ..protocol.run import open_run
from ..protocol.store import RunStore
from ..syncer.learner import Learner
from ..syncer.node import Node, NodeOptions
from .audit import AuditMailbox, Auditor

GHOST = "ghost"
SHAPES = {"embed.weight": (4, 3), "layers.0.w": (3, 3), "layers.1.w": (3, 3), "head.b": (3,)}
CRASH_TARGETS: list[tuple[tuple[Op, ...] | None, str]] = [
    (None, ""),
    (None, ""),
    (("put",), keys.ROUNDS),
    (("put",), keys.ROUND_BLOBS),
    (("put",), keys.CLAIMS),
    (("put",), keys.SNAPSHOTS),
    (("put",), keys.SNAPSHOT_BLOBS),
    (("list",), ""),
    (("get",), keys.ROUNDS),
    (("delete",), ""),
    (("put",), keys.LEASES),
]
SIZE = sum(int(np.prod(s)) for s in SHAPES.values())


def _views(flat: np.ndarray) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for n, s in SHAPES.items():
        size = int(np.prod(s))
        out[n] = flat[at : at + size].reshape(s)
        at += size
    return out


BROWNOUT_PREFIXES = [keys.ROUNDS, keys.SNAPSHOTS, keys.BLOBS, keys.CLAIMS, keys.LEASES, ""]


@dataclass(frozen=True)
class SimConfig:
    seed: int
    rounds: int = 50
    faults: bool = True
    nodes: int | None = None  # None: 3..6, drawn from the seed
    verbose: bool = False
    mutant: str | None = None  # only recorded here; the caller enters the mutant's context

    def command(self) -> str:
        extra = "" if self.faults else " --no-faults"
        extra += f" --nodes {self.nodes}" if self.nodes else ""
        extra += f" --mutant {self.mutant}" if self.mutant else ""
        return f"python -m gradientmail_core.sim --seed {self.seed} --rounds {self.rounds}{extra} -v"


@dataclass
class SimResult:
    config: SimConfig
    violations: list[str]
    trace_hash: str
    stats: Counter[str]
    faults: Counter[str]
    resolved: Counter[str]
    sim_seconds: float
    rounds: int
    losses: tuple[float, float] = (0.0, 0.0)  # loss of the initial and of the final parameters

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        head = (
            f"seed {self.config.seed}: {'ok' if self.ok else 'FAILED'}, {self.rounds} rounds in "
            f"{self.sim_seconds:.0f} simulated s, trace {self.trace_hash[:16]}"
        )
        if self.ok:
            return head
        return "\n".join([head, *(f"  - {v}" for v in self.violations[:10]), f"  replay: {self.config.command()}"])


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


@dataclass
class _Draw:
    """Everything the seed decides about the run's shape."""

    nodes: int
    cfg: DiLoCo
    options: NodeOptions
    fault_share: float
    p_error: float
    p_lost_ack: float
    p_retry: float
    p_latency: float
    p_flip: float
    chaos_every: float
    p_preempt: float
    p_preempt_contested: float
    p_pause: float
    p_pause_contested: float


class Simulation:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.draw = self._draw()
        self.store = MemoryMailbox()
        self.auditor = Auditor(self.store)
        self.auditor.on_commit.append(self._committed)
        self.auditor.on_lease.append(self._lease_changed)
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
        self.target_flat = np.asarray(np.random.default_rng([config.seed, 99]).standard_normal(SIZE), np.float32)
        self.target = _views(self.target_flat)
        self.nodes: dict[str, SimNode] = {}
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

    # ---- the seed's choices -------------------------------------------------------------

    def _draw(self) -> _Draw:
        r = self.rng
        n = self.config.nodes or r.choice([3, 3, 3, 4, 4, 5, 6])
        P = r.choice([1, 2, 2, 3])
        H = P * r.choice([2, 3, 4])
        cfg = DiLoCo(
            sync_every=H,
            fragments=P,
            in_flight=r.randint(1, P),
            quorum_size=r.choice([1, 1, 2]),
            merge=RDA() if r.random() < 0.5 else WeightedMean(),
            # DiLoCo's Nesterov (0.7, 0.9), a gentler one, and local SGD (1, 0)
            outer_lr=(lr_beta := r.choice([(0.7, 0.9), (0.4, 0.8), (1.0, 0.0)]))[0],
            outer_momentum=lr_beta[1],
        )
        opts = NodeOptions(poll_interval=0.5, lease_timeout=3.0, round_timeout=2.0)
        return _Draw(
            nodes=n,
            cfg=cfg,
            options=opts,
            fault_share=0.6,
            p_error=r.uniform(0.0, 0.04),
            p_lost_ack=r.uniform(0.0, 0.03),
            p_retry=r.uniform(0.0, 0.05),
            p_latency=r.uniform(0.0, 0.1),
            p_flip=r.uniform(0.0, 0.08),
            chaos_every=r.uniform(2.5, 6.0),
            p_preempt=r.uniform(0.0, 0.03),
            p_preempt_contested=r.uniform(0.05, 0.5),
            p_pause=r.uniform(0.0, 0.0015),
            p_pause_contested=r.uniform(0.0, 0.06),
        )

    def _tapper(self, name: str) -> Callable[[Op, str], None]:
        """Preemption: while this node's request is "slow", another node ticks (often right
        before a commit or a claim), as concurrent processes interleave. This is what makes two
        closers race for one round record, GC run while a commit is in flight, and so on."""

        def tap(op: Op, key: str) -> None:
            if self.phase != "faults" or self.preempting:
                return
            contested = op == "put" and (key.startswith(keys.ROUNDS) or key.startswith(keys.CLAIMS))
            if self.rng.random() < (self.draw.p_pause_contested if contested else self.draw.p_pause):
                seconds = self.rng.uniform(0.3, 2.5 * self.draw.options.lease_timeout)
                self._trace(f"{self.T:.6f} {name} paused for {seconds:.3f} s inside {op} {key}")
                self.stats["chaos/pause_mid_call"] += 1
                self.preempting = True
                try:
                    self._pause_inside(self.nodes[name], seconds)
                finally:
                    self.preempting = False
                return
            if self.rng.random() >= (self.draw.p_preempt_contested if contested else self.draw.p_preempt):
                return
            others = [
                o for o in self.nodes.values() if o.name != name and o.state == "up" and self.T >= o.stalled_until
            ]
            if not others:
                return
            r = keys.parse_round_key(key) if contested else None
            rivals = [o for o in others if o.node is not None and o.node.collector and o.node.collector.round == r]
            other = self.rng.choice(rivals or others)  # a rival closer of the same round, if any
            self._trace(f"{self.T:.6f} {name} {op} {key} is slow: {other.name} acts meanwhile")
            self.stats["preemptions"] += 1
            self.preempting = True
            try:
                self.stats["ticks"] += 1
                self._tick(other)
            finally:
                self.preempting = False

        return tap

    def _background_faults(self, name: str) -> list[Fault]:
        d = self.draw
        return [
            Fault(kind="latency", probability=d.p_latency, seconds=self.rng.uniform(0.01, 0.3)),
            Fault(kind="error", probability=d.p_error, message="HTTP 503 SlowDown (injected)"),
            Fault(
                kind="error",
                ops=("put",),
                phase="landed",
                probability=d.p_lost_ack,
                message="connection reset after the request was sent (injected)",
            ),
            Fault(
                kind="error",
                ops=("put",),
                probability=d.p_error / 2,
                message="HTTP 409 ConditionalRequestConflict (injected)",
            ),
            Fault(kind="retry_412", ops=("put",), probability=d.p_retry),
            Fault(kind="flip", ops=("get",), prefix=keys.BLOBS, probability=d.p_flip),
        ]

    def _init_params(self, index: int, incarnation: int) -> np.ndarray:
        g = np.random.default_rng([self.config.seed, index, incarnation, 1])
        return np.asarray(g.standard_normal(SIZE), np.float32)

    # ---- the event loop -----------------------------------------------------------------

    def _push(self, at: float, name: str, kind: str, gen: int) -> None:
        self.qseq += 1
        heapq.heappush(self.queue, (at, self.qseq, name, kind, gen))

    def _trace(self, line: str) -> None:
        self.hash.update(line.encode())
        self.hash.update(b"\n")
        if self.config.verbose:
            print(line)

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
        if self.auditor.run is not None:
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
        )

    def _advance_to(self, at: float) -> None:
        if at > self.T:
            for sn in self.nodes.values():
                if sn.clock is not None:
                    sn.clock.advance(at - self.T)
            self.T = at

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

    def _pause_inside(self, paused: SimNode, seconds: float) -> None:
        """The node is paused (SIGSTOP) in the middle of a store call: the others run on for
        ``seconds`` (its events and the chaos timer wait), then its call proceeds, on its now
        stale view of the run."""
        until = self.T + seconds
        held = []
        while self.queue and self.queue[0][0] <= until:
            item = heapq.heappop(self.queue)
            at, _, name, kind, gen = item
            if name == paused.name or kind == "chaos":
                held.append(item)
                continue
            self._advance_to(at)
            self._dispatch(name, kind, gen)
        self._advance_to(until)
        for item in held:
            heapq.heappush(self.queue, item)

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
        sn.params = _views(sn.flat)  # the model's tensors are views of one buffer: one op trains all
        sn.nprng = np.random.default_rng([self.config.seed, sn.index, sn.incarnation, 2])
        adapter = NumpyAdapter(sn.params)
        emit = self._emit(sn)
        store = RunStore(sn.faulty, on_ignored=lambda k, why: emit(ev.IgnoredObject(sn.name, k, why)))
        self._trace(f"{self.T:.6f} {sn.name} start #{sn.incarnation}")
        try:
            run, created = open_run(
                store,
                adapter,
                self.draw.cfg,
                learner=sn.name,
                compression="",
                rng=random.Random(self.rng.getrandbits(32)),
            )
            node = Node(
                store,
                sn.clock,
                run,
                learner=sn.name,
                nonce=f"{self.rng.getrandbits(64):016x}",
                emit=emit,
                options=self.draw.options,
                rng=random.Random(self.rng.getrandbits(32)),
            )
            thetas = node.join(created=created)
            learner = Learner(adapter, run, node.bridge, sn.clock, learner=sn.name, emit=emit)
            learner.start(node.head, thetas, {f: v for f, (v, _) in node.thetas.items()})
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
        flat += np.float32(0.02) * sn.nprng.standard_normal(SIZE, np.float32)
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

    def _check_aligned(self, sn: SimNode, e: ev.Aligned) -> None:
        """A learner aligns only with committed parameters: bit-identical to the theta of the
        round record it names."""
        rec = self.auditor.tape.get(e.round)
        run = self.auditor.run
        if rec is None or run is None or rec.theta is None or sn.learner is None:
            self.violations.append(f"at {self.T:.2f} s {sn.name} aligned with round {e.round}, which never committed")
            raise _Abort("aligned with an uncommitted round")
        theta = self.auditor._payload(rec.theta, run.shapes[e.fragment])
        mine = sn.learner.anchors.get(e.fragment, {})
        if (
            theta is None
            or rec.fragment != e.fragment
            or rec.version != e.version
            or any(n not in mine or not np.array_equal(mine[n], v) for n, v in theta.items())
        ):
            self.violations.append(
                f"at {self.T:.2f} s {sn.name} aligned fragment {e.fragment} with parameters that differ from "
                f"round {e.round}'s committed ones"
            )
            raise _Abort("aligned with parameters nobody committed")

    def _lease_changed(self, learner: str) -> None:
        """Record when the learner's newest lease key (what observers judge by) changes."""
        listed = self.store.list(keys.lease_prefix(learner))
        newest = listed[-1] if listed else None
        history = self.lease_writes.setdefault(learner, [])
        if history and history[-1][1] == newest:
            return
        clocks = {(o.name, o.incarnation): o.clock.now() for o in self.nodes.values() if o.clock is not None}
        history.append((self.auditor.seq, newest, clocks))
        del history[:-32]

    def _check_lease_judgement(self, observer: SimNode, learner: str) -> None:
        """A live learner's lease may be judged lost only if, at the observer's last complete
        listing, it was gone, or its newest key had been the newest for lease_timeout on the
        observer's own clock (ground truth from the store's history, not from the engine's
        bookkeeping)."""
        target = self.nodes.get(learner)
        if observer.clock is None or observer.node is None or target is None or target.state != "up":
            return  # only a live learner can be wrongly judged lost
        # The observer's newest complete listing of leases/ (a paginated one that failed midway
        # does not count): made during this tick if its listed_at moved since the last tick.
        stored = self.lease_listed.get(observer.name)
        la = observer.node.liveness.listed_at
        listed = self.auditor.lease_listing.get(observer.name, 0) if stored is None or stored[0] != la else stored[1]
        history = [h for h in self.lease_writes.get(learner, []) if h[0] < listed]
        if not history or history[-1][1] is None:
            return  # gone when it listed
        newest = history[-1][1]
        i = len(history) - 1
        while i > 0 and history[i - 1][1] == newest:
            i -= 1
        me = (observer.name, observer.incarnation)
        since = max(history[i][2].get(me, float("-inf")), self.clock_started[observer.name])
        elapsed = observer.clock.now() - since
        if elapsed < self.draw.options.lease_timeout:
            self.violations.append(
                f"at {self.T:.2f} s {observer.name} judged {learner}'s lease lost, but {newest} became its newest "
                f"lease only {elapsed:.3f} s before, on {observer.name}'s clock (lease_timeout "
                f"{self.draw.options.lease_timeout})"
            )
            raise _Abort("a live lease was judged lost")

    def _note_lease_listing(self, sn: SimNode) -> None:
        """Remember when (in store operations) the node's liveness view last listed leases/
        completely: its listed_at moved during this tick, so its last listing completed."""
        if sn.node is not None:
            la = sn.node.liveness.listed_at
            if self.lease_listed.get(sn.name, (None, 0))[0] != la:
                self.lease_listed[sn.name] = (la, self.auditor.lease_listing.get(sn.name, 0))

    def _committed(self, r: int, rec: object) -> None:
        self.last_commit_at = self.T
        if r in self.pending_recovery:
            self.pending_recovery.discard(r)
            self.stats["recovered_between_payload_and_record"] += 1
        if self.phase == "quiet" and self.T >= self.steady_from:
            self.deadline = self.T + self._round_bound()

    # ---- chaos --------------------------------------------------------------------------

    def _chaos(self) -> None:
        up = [sn for sn in self.nodes.values() if sn.state == "up" and self.T >= sn.stalled_until]
        if not up:
            return
        sn = self.rng.choice(up)
        what = self.rng.choices(["kill", "arm", "stall", "leave", "brownout", "ghost"], weights=[2, 4, 3, 1, 2, 2])[0]
        lease = self.draw.options.lease_timeout
        if what == "kill":
            self._crash(sn, "killed (SIGKILL)")
            self.stats["chaos/kill"] += 1
        elif what == "arm":
            ops, prefix = self.rng.choice(CRASH_TARGETS)
            phase: Phase = self.rng.choice(["before", "landed", "replied"])
            sn.faulty.arm_crash(after_calls=self.rng.randint(0, 20), phase=phase, ops=ops, prefix=prefix)
            self.stats["chaos/arm"] += 1
        elif what == "stall":
            sn.stalled_until = self.T + self.rng.uniform(0.2, 3 * lease)
            self._trace(f"{self.T:.6f} {sn.name} stalls until {sn.stalled_until:.6f}")
            self.stats["chaos/stall"] += 1
        elif what == "leave":
            if sum(1 for s in self.nodes.values() if s.state == "up") >= 2:
                self._leave(sn)
                self.stats["chaos/leave"] += 1
        elif what == "ghost":
            self._ghost()
        else:
            prefix = self.rng.choice(BROWNOUT_PREFIXES)
            rule = sn.faulty.add(
                Fault(
                    kind="error",
                    prefix=prefix,
                    probability=self.rng.uniform(0.5, 1.0),
                    times=self.rng.randint(5, 30),
                    message="HTTP 503 brownout (injected)",
                )
            )
            self._trace(f"{self.T:.6f} {sn.name} brownout on {prefix!r} ({rule.times} errors)")
            self.stats["chaos/brownout"] += 1

    def _ghost(self) -> None:
        """A broken contributor ("ghost", holding no lease) writes a bad snapshot into the open
        round: stale (relative to an older version), with a payload that does not hash to its
        reference, with non-finite values, with zero steps, or of another schema. The closer
        must reject it with that reason; a mutant that accepts it is caught by the auditor."""
        run = self.auditor.run
        if run is None:
            return
        r = self.auditor.head + 1
        key = keys.snapshot_key(r, GHOST)
        if self.store.get(key) is not None:
            return
        f, base = r % run.P, r // run.P
        kinds = ["corrupt", "nonfinite", "zero_steps", "schema"] + (["stale", "stale"] if base > 0 else [])
        kind = self.rng.choice(kinds)
        g = np.random.default_rng([self.config.seed, r, 3])
        delta = {n: np.asarray(0.01 * g.standard_normal(s), np.float32) for n, s in run.shapes[f].items()}
        if kind == "nonfinite":
            next(iter(delta.values())).flat[0] = np.nan
        data = encode_payload(delta, run.fragment_dtypes(f), kind="delta")
        sha = sha256_hex(data)
        if kind == "corrupt":
            sha = sha256_hex(data + b"x")  # the reference does not match the bytes stored under it
        mb = AuditMailbox(self.store, self.auditor, GHOST)
        pkey = keys.snapshot_blob_key(r, GHOST, sha)
        mb.put_if_absent(pkey, data)
        snap = Snapshot(
            learner=GHOST,
            round=r,
            local_step=100,
            steps=0 if kind == "zero_steps" else 4,
            tokens=16,
            base_version=base - 1 if kind == "stale" else base,
            step_seconds=0.1,
            schema_digest=("0" * 64) if kind == "schema" else run.digest,
            payload=PayloadRef(key=pkey, sha256=sha, size=len(data)),
        )
        mb.put_if_absent(key, encode(snap))
        self._trace(f"{self.T:.6f} ghost writes a {kind} snapshot into round {r}")
        self.stats[f"chaos/ghost/{kind}"] += 1

    # ---- phases -------------------------------------------------------------------------

    def _round_bound(self) -> float:
        """Simulated seconds within which a healthy run commits its next round."""
        o, cfg = self.draw.options, self.draw.cfg
        slowest = max(sn.step_period for sn in self.nodes.values()) / min(sn.drift for sn in self.nodes.values())
        gap = -(-cfg.sync_every // cfg.fragments)
        return 4 * (gap + 1) * slowest + 2 * o.round_timeout + o.lease_timeout + 8 * o.poll_interval

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
        settle = 3 * o.lease_timeout + 3 * o.round_timeout + 2.0
        self.steady_from = self.T + settle
        self.deadline = self.steady_from + self._round_bound()

    def _enter_final(self) -> None:
        self.phase = "final"
        self._trace(f"{self.T:.6f} final")
        self.final_from = self.T
        o = self.draw.options
        self.deadline = self.T + 4 * o.lease_timeout + 4 * o.round_timeout + 10.0

    def _settled(self) -> bool:
        # A few polls after the last commit (rounds still in flight may land), every node must
        # be at the newest commit with nothing left to send.
        quiet = 4 * self.draw.options.poll_interval
        if self.T - self.final_from < quiet or self.T - self.last_commit_at < quiet:
            return False
        head = self.auditor.head
        return all(
            sn.node is not None and sn.node.head == head and not sn.node.bridge.outbox
            for sn in self.nodes.values()
            if sn.state == "up"
        )

    # ---- the end ------------------------------------------------------------------------

    def _newest_params(self, initial: bool = False) -> dict[str, np.ndarray]:
        run = self.auditor.run
        assert run is not None
        newest = {} if initial else self.auditor.newest()
        out: dict[str, np.ndarray] = {}
        for f in range(run.P):
            rec = newest.get(f)
            pref = run.manifest.init[f] if rec is None else rec.theta
            assert pref is not None
            theta = self.auditor._payload(pref, run.shapes[f])
            assert theta is not None, f"the newest parameters of fragment {f} were never captured"
            out.update(theta)
        return out

    def _loss(self, params: dict[str, np.ndarray]) -> float:
        return float(sum(((params[n].astype(np.float64) - self.target[n]) ** 2).sum() for n in SHAPES))

    def _check_end(self) -> None:
        survivors = [sn for sn in self.nodes.values() if sn.state == "up"]
        if not survivors:
            self.violations.append("no node survived")
            return
        if self.auditor.head + 1 < self.config.rounds:
            self.violations.append(f"only {self.auditor.head + 1} of {self.config.rounds} rounds committed")
        newest = self._newest_params()
        versions = {rec.fragment: rec.version for rec in self.auditor.newest().values()}
        for sn in survivors:
            assert sn.learner is not None and sn.params is not None
            sn.learner.drain()
            sn.learner.write_newest()
            for n in SHAPES:
                if not np.array_equal(sn.params[n], newest[n]):
                    self.violations.append(f"{sn.name} ends with {n} different from the newest commit")
                    break
            for f, v in versions.items():
                if sn.learner.versions.get(f) != v:
                    self.violations.append(
                        f"{sn.name} holds version {sn.learner.versions.get(f)} of fragment {f}, the newest is {v}"
                    )
        self.stats["survivors"] = len(survivors)


class _Abort(BaseException):
    """Stops the simulation at an invariant violation (a BaseException: engine code must not catch it)."""


def run_seed(
    seed: int,
    rounds: int = 50,
    *,
    faults: bool = True,
    nodes: int | None = None,
    verbose: bool = False,
    mutant: str | None = None,
) -> SimResult:
    """Run one seed (inside ``mutants.active(mutant)`` when a mutant is named)."""
    config = SimConfig(seed=seed, rounds=rounds, faults=faults, nodes=nodes, verbose=verbose, mutant=mutant)
    if mutant is None:
        return Simulation(config).run()
    from .mutants import active

    with active(mutant):
        return Simulation(config).run()


def _run_one(args: tuple[int, int, bool, int | None, str | None]) -> SimResult:
    seed, rounds, faults, nodes, mutant = args
    return run_seed(seed, rounds, faults=faults, nodes=nodes, mutant=mutant)


def run_many(
    seeds: Iterable[int],
    rounds: int = 50,
    *,
    faults: bool = True,
    nodes: int | None = None,
    mutant: str | None = None,
    workers: int | None = None,
) -> Iterator[SimResult]:
    """Run seeds in ``workers`` processes (default: the CPUs this process may use), yielding
    results in seed order as they complete."""
    jobs = [(s, rounds, faults, nodes, mutant) for s in seeds]
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if workers <= 1 or len(jobs) <= 1:
        yield from map(_run_one, jobs)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(_run_one, jobs, chunksize=max(1, min(16, len(jobs) // (4 * workers))))


__all__ = ["SimConfig", "SimResult", "Simulation", "run_many", "run_seed"]
