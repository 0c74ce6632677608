"""Goodput at the paper's scale: the engine's learners under the failure model of Decoupled
DiLoCo's Table 1 (arXiv 2604.21428), beside synchronous and elastic data parallel.

The failure model (``FailureModel``). Every chip is interrupted about once a year (``mtbf_chip``),
independently: ``chips`` chips fail at the cluster rate ``lam = chips / mtbf_chip`` (1.2M chips:
one failure every 26 s). Split into ``M`` learners of ``C = chips / M`` chips each, a learner is
interrupted at ``mu = C / mtbf_chip = lam / M`` and is down for ``recovery`` (``R``) seconds, after
which it rejoins under the same id; synchronous data parallel stalls the whole job for
``dp_restart`` per interruption, elastic data parallel for ``elastic_restart``. An interruption
that arrives while its victim is already down (a learner recovering, a DP job restarting) is
absorbed by that recovery. With interruptions Poisson in wall time, the share of the time a unit
that pays ``R`` per interruption is up is then exactly

    up = 1 / (1 + rate * R)

(each down period lasts ``R``; the up period after it is exponential with mean ``1 / rate``). The
paper's figures at 1.2M chips fix the recovery times: DP's 27% gives ``lam * R_dp = 1/0.27 - 1``,
``R_dp = 71.0 s``; elastic's 58%, ``R_el = 19.0 s``; learners' 88% at M=8 needs ``R`` in
[27.5, 30.0] s and 93% at M=16 ``R`` in [29.2, 34.1] s: ``R = 29.5 s`` gives both (87.7%, 93.4%).

Those closed forms are the paper's side only (``FailureModel.ideal``, printed as a check). Our
figure is measured: ``GoodputRun`` drives ``M`` real ``Node`` + ``Learner`` pairs over one
``MemoryMailbox`` on injected clocks, as ``world.py`` does, under the interruption times drawn from
one seed (``fault_log``): a learner interrupted while up dies (at once, or at one of its next
store calls, so closers die in the middle of commits too), loses everything in memory, and
restarts ``R`` later with the same id from the store; takeovers happen by the engine's rules.
Goodput is what the run's records say reached a commit, over what the chips could have computed:

    goodput = merged steps / (M * (horizon / step_seconds) - steps still unsent at the horizon)

counted per fragment (``P`` equal fragments; a step trains each, so one step is ``P``
fragment-steps and a round record's participant carries the fragment-steps it merged). What did
not reach a commit is split: down (the learner was recovering), lost to a kill (trained, not yet
sent), dropped by alignment (trained while the fragment was in flight, overwritten by the
commit, ``Aligned.dropped``) and the rest (sent but not merged: rejected, late, skipped). Data
parallel's two figures come from the same interruption times (``dp_goodput``), in the same units.

``python -m gradientmail_sim --goodput`` prints the table; ``bench/goodput_table.py`` is the same
with every parameter as a flag. See ``docs/reliability.md`` and ``bench/README.md``.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import random
import statistics
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from gradientmail_core import events as ev
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.config import Carry, DiLoCo, Overwrite
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import RoundRecord
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.host import join_run
from gradientmail_core.syncer.learner import Learner
from gradientmail_core.syncer.node import Node
from gradientmail_core.syncer.options import NodeOptions

from .faults import FaultyMailbox, InjectedCrash

YEAR = 365 * 24 * 3600.0
# the engine's default until gm.Adaptive() (what the recorded tables use), and one that drops nothing
ALIGNMENTS = {"overwrite": Overwrite(), "carry": Carry()}
# Table 1 of the paper at 1.2M chips, per-chip MTBF one year: learners -> goodput, and data parallel.
PAPER_LEARNERS = {8: 0.88, 16: 0.93}
PAPER_DP, PAPER_ELASTIC = 0.27, 0.58


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """The paper's failure model (see the module): chips, their MTBF, and what a failure costs."""

    chips: int = 1_200_000
    mtbf_chip: float = YEAR  # seconds between interruptions of one chip
    recovery: float = 29.5  # R: a learner's down time per interruption (restart, reload, rejoin)
    dp_restart: float = 71.0  # R_dp: synchronous data parallel's stall per interruption
    elastic_restart: float = 19.0  # R_el: elastic data parallel's reconfiguration per interruption

    def __post_init__(self) -> None:
        if self.chips < 1 or not self.mtbf_chip > 0:
            raise ValueError(f"FailureModel(chips={self.chips}, mtbf_chip={self.mtbf_chip}): expected both > 0")
        for name in ("recovery", "dp_restart", "elastic_restart"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"FailureModel({name}={getattr(self, name)!r}): expected seconds >= 0")

    @property
    def cluster_rate(self) -> float:
        """Interruptions per second of the whole cluster."""
        return self.chips / self.mtbf_chip

    def learner_rate(self, m: int) -> float:
        """Interruptions per second of one of ``m`` learners (``chips / m`` chips)."""
        return self.cluster_rate / m

    def ideal(self, m: int) -> float:
        """The up share of one of ``m`` learners, ``1 / (1 + mu R)``: goodput if a failure cost
        nothing but its recovery (the paper's side of the comparison, not our measurement)."""
        return 1.0 / (1.0 + self.learner_rate(m) * self.recovery)


@dataclass(frozen=True, kw_only=True)
class TimeScale:
    """The simulated run's clock: a step of ``step_seconds``, DiLoCo with ``sync_every`` steps
    and ``fragments`` equal fragments (a round every ``sync_every / fragments`` steps), and the
    node's timeouts, all in simulated seconds of the same scale as the recovery times."""

    step_seconds: float = 1.0
    sync_every: int = 20
    fragments: int = 4
    poll_interval: float = 1.0
    lease_timeout: float = 5.0
    round_timeout: float = 10.0
    horizon: float = 10_000.0  # simulated seconds of training
    # share of interruptions delivered at one of the victim's next store calls (mid-tick: a closer
    # dies between a commit's payloads and its record, or between its claim and its record)
    mid_call: float = 0.5
    alignment: str = "overwrite"  # how a commit meets the local steps: a key of ALIGNMENTS

    def __post_init__(self) -> None:
        if not (self.step_seconds > 0 and self.horizon > 0 and 0.0 <= self.mid_call <= 1.0):
            raise ValueError(f"{self}: expected step_seconds > 0, horizon > 0, 0 <= mid_call <= 1")
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"TimeScale(alignment={self.alignment!r}): expected one of {sorted(ALIGNMENTS)}")

    def cfg(self) -> DiLoCo:
        """The engine's defaults but for the cadence (quorum 1, in_flight 2, RDA, no overlap)."""
        return DiLoCo(sync_every=self.sync_every, fragments=self.fragments, alignment=ALIGNMENTS[self.alignment])

    def options(self) -> NodeOptions:
        return NodeOptions(
            poll_interval=self.poll_interval,
            lease_timeout=self.lease_timeout,
            round_timeout=self.round_timeout,
            compression="",
            callbacks=(),
        )


def fault_log(m: int, model: FailureModel, horizon: float, seed: int) -> list[list[float]]:
    """Each of ``m`` learners' interruption times in ``[0, horizon)``: a Poisson process at
    ``model.learner_rate(m)`` in wall time, whatever the learner is doing (one rng per learner,
    so a learner's times do not depend on how many others there are)."""
    rate = model.learner_rate(m)
    out = []
    for i in range(m):
        rng = random.Random(f"goodput/{seed}/{m}/{i}")
        t, times = 0.0, []
        while (t := t + rng.expovariate(rate)) < horizon:
            times.append(t)
        out.append(times)
    return out


def dp_goodput(times: list[float], horizon: float, restart: float) -> tuple[float, int]:
    """Data parallel over the same interruption ``times`` (every learner's, merged): the job
    stalls ``restart`` seconds at each interruption that finds it running (one that arrives during
    a stall is absorbed). Returns (the share of ``horizon`` it ran, the stalls)."""
    stalled, until, stalls = 0.0, 0.0, 0
    for t in sorted(times):
        if t < until:
            continue
        until = t + restart
        stalled += min(until, horizon) - t
        stalls += 1
    return 1.0 - stalled / horizon, stalls


class SimClock:
    """One simulated process's monotonic clock: simulated time plus its own offset (where it
    started, and whatever it slept inside a call, which runs its clock ahead of the world's)."""

    def __init__(self, world: GoodputRun, start: float) -> None:
        self.world, self.offset = world, start - world.T

    def now(self) -> float:
        return self.world.T + self.offset

    def sleep(self, seconds: float) -> None:
        self.offset += max(seconds, 0.0)


class _Marker:
    """What a ``Session``'s ``RestartMarker`` tells a restarted process on its own host: the nonce
    of the id's previous process, known dead, so that its lease is taken over at once."""

    def __init__(self, predecessor: str | None) -> None:
        self.predecessor = predecessor

    def open(self, run_id: str) -> str | None:
        return self.predecessor

    def hold(self, nonce: str) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Slot:
    """One learner id and its current process (``node`` is None while it is down)."""

    name: str
    index: int
    faulty: FaultyMailbox
    gen: int = 0  # bumped on every (re)start and crash: queued events of an older life are dropped
    incarnation: int = 0
    nonce: str = ""
    node: Node | None = None
    learner: Learner | None = None
    flat: np.ndarray | None = None
    nprng: np.random.Generator | None = None
    armed: bool = False  # an interruption delivered at one of its next store calls
    down_since: float = 0.0
    up_seconds: float = 0.0
    up_since: float | None = None
    restarted_at: list[float] = field(default_factory=list)


@dataclass
class Row:
    """One learner count's figures (fragment-steps unless named otherwise)."""

    learners: int
    chips_per_learner: float
    interruptions: int  # in the fault log
    crashes: int  # interruptions that found their learner up (the rest were absorbed)
    closer_crashes: int  # of which the victim was closing a round
    recovered: int  # crashes after which the learner's contributions reached a commit again
    restarted_late: int  # crashes restarted too near the horizon (``recovery_margin``), or after it
    unrecovered: int  # crashes restarted in time whose learner never reached a commit again
    capacity: int
    computed: int
    merged: int
    lost_to_kill: int
    dropped_by_alignment: int
    unsent_at_end: int
    rounds: int
    fault_free_rounds: int
    takeovers: dict[str, int]  # TookOver events by reason
    kill_to_commit: list[float]
    up_share: float  # the learners' up time over M * horizon, from the run
    goodput: float
    step_efficiency: float
    dp: float
    elastic: float
    ideal: float  # FailureModel.ideal(M): the paper's closed form, as a check
    tape_ok: bool
    sim_seconds: float

    @property
    def other_lost(self) -> int:
        """Sent but never merged (rejected, late, skipped), and anything in flight at the end."""
        return self.computed - self.merged - self.lost_to_kill - self.dropped_by_alignment - self.unsent_at_end

    def share(self, n: int) -> float:
        return n / (self.capacity - self.unsent_at_end)


class GoodputRun:
    """``m`` learners under ``log`` (``fault_log``): the event loop, the crashes and restarts,
    and the accounting of every fragment-step. ``faults=False``: the fault-free twin."""

    def __init__(self, m: int, model: FailureModel, scale: TimeScale, seed: int, *, faults: bool = True) -> None:
        self.m, self.model, self.scale, self.seed = m, model, scale, seed
        self.cfg, self.opts = scale.cfg(), scale.options()
        self.rng = random.Random(f"goodput-run/{seed}/{m}")
        self.T = 0.0
        self.store = MemoryMailbox()
        self.queue: list[tuple[float, int, int, str, int]] = []
        self.qseq = 0
        self.log = fault_log(m, model, scale.horizon, seed) if faults else [[] for _ in range(m)]
        n = 4 * scale.fragments  # P equal fragments of four 4x4 tensors' worth each
        self.shapes = {f"layers.{i}.w": (4, 4) for i in range(n)}
        self.size = 16 * n
        self.target = np.random.default_rng([seed, 99]).standard_normal(self.size).astype(np.float32)
        self.counts: Counter[str] = Counter()
        self.takeovers: Counter[str] = Counter()
        self.crash_times: list[float] = []
        self.commit_times: dict[int, float] = {}
        self.slots = [
            _Slot(f"l{i:02d}", i, FaultyMailbox(self.store, rng=random.Random(f"{seed}/{m}/{i}"), node=f"l{i:02d}"))
            for i in range(m)
        ]
        self.training = True
        for s in self.slots:
            self._push(s.index * scale.step_seconds / m / 10, s, "start", 0)  # not all at one instant
            for t in self.log[s.index]:
                self._push(t, s, "fault", -1)

    # ---- the event loop -----------------------------------------------------------------

    def _push(self, at: float, s: _Slot, kind: str, gen: int) -> None:
        self.qseq += 1
        heapq.heappush(self.queue, (at, self.qseq, s.index, kind, gen))

    def run(self) -> Row:
        horizon = self.scale.horizon
        drain = horizon + 2 * (self.opts.lease_timeout + self.opts.round_timeout_floor)
        while self.queue:
            at, _, i, kind, gen = heapq.heappop(self.queue)
            if at >= horizon and self.training:
                self._stop_training()
            if at >= drain:
                break
            self.T = max(self.T, at)
            s = self.slots[i]
            if kind == "fault":
                self._interrupt(s)
            elif kind == "start":
                if gen == s.gen and s.node is None and self.training:
                    self._start(s)
            elif gen == s.gen and s.node is not None:
                if kind in ("tick", "wake"):
                    self._tick(s, again=kind == "tick")
                elif kind == "step" and self.training:
                    self._step(s)
        if self.training:
            self._stop_training()
        return self._row()

    def _stop_training(self) -> None:
        """The horizon: no more steps; what no learner has sent yet is excluded from the count.
        Polls go on for a while so that what was sent can still commit."""
        self.training = False
        self.T = self.scale.horizon
        for s in self.slots:
            if s.learner is not None:
                self.counts["unsent_at_end"] += sum(s.learner.steps_since)
                self._close_up(s)

    def _close_up(self, s: _Slot) -> None:
        if s.up_since is not None:
            s.up_seconds += min(self.T, self.scale.horizon) - s.up_since
            s.up_since = None

    # ---- one learner ------------------------------------------------------------------

    def _emit(self, s: _Slot):  # noqa: ANN202 (a closure over the slot)
        def emit(e: ev.Event) -> None:
            if isinstance(e, ev.Aligned):
                self.counts["dropped_by_alignment"] += e.dropped
            elif isinstance(e, ev.TookOver):
                self.takeovers[e.reason] += 1
            elif isinstance(e, ev.Committed):
                self.commit_times.setdefault(e.round, self.T)
            elif isinstance(e, ev.BackgroundFailed | ev.GaveUp):
                raise RuntimeError(f"engine failure in the goodput run: {e.describe()}")

        return emit

    def _start(self, s: _Slot) -> None:
        s.incarnation += 1
        s.gen += 1
        s.armed = False
        s.faulty.clear()
        predecessor = s.nonce or None  # a restart on the same host: the marker knows it died
        s.nonce = f"{self.rng.getrandbits(64):016x}"
        clock = SimClock(self, start=self.rng.uniform(0.0, 1000.0))
        s.faulty.clock = clock
        s.flat = np.random.default_rng([self.seed, s.index, s.incarnation]).standard_normal(self.size)
        s.flat = s.flat.astype(np.float32)
        s.nprng = np.random.default_rng([self.seed, s.index, s.incarnation, 2])
        params, at = {}, 0
        for n, shape in self.shapes.items():
            params[n] = s.flat[at : at + 16].reshape(shape)
            at += 16
        store = RunStore(s.faulty)
        node, learner = join_run(
            store,
            NumpyAdapter(params),
            self.cfg,
            clock,
            learner=s.name,
            nonce=s.nonce,
            emit=self._emit(s),
            options=self.opts,
            rng=random.Random(self.rng.getrandbits(32)),
            node_rng=random.Random(self.rng.getrandbits(32)),
            marker=_Marker(predecessor),
        )
        s.node, s.learner, s.up_since = node, learner, self.T
        if s.incarnation > 1:
            s.restarted_at.append(self.T)
        self._push(self.T + self.rng.uniform(0.0, self.opts.poll_interval), s, "tick", s.gen)
        self._push(self.T + self.scale.step_seconds, s, "step", s.gen)

    def _tick(self, s: _Slot, *, again: bool) -> None:
        """One poll; ``again``: the periodic one, which queues the next (a wake, an extra poll
        for a ready contribution, leaves the periodic one queued)."""
        assert s.node is not None
        try:
            s.node.tick()
        except InjectedCrash:
            self._crash(s)
            return
        if s.faulty.pending_crash is not None:
            self._crash(s)
            return
        if again:
            self._push(self.T + self.opts.poll_interval, s, "tick", s.gen)

    def _step(self, s: _Slot) -> None:
        assert s.learner is not None and s.flat is not None and s.node is not None
        flat = s.flat
        flat -= np.float32(0.1) * (flat - self.target)
        assert s.nprng is not None
        flat += np.float32(0.02) * s.nprng.standard_normal(self.size, np.float32)
        s.learner.step(8)
        self.counts["computed"] += self.cfg.fragments
        if s.node.bridge.outbox:  # a contribution is ready: the session wakes its background thread
            self._push(self.T + 0.01, s, "wake", s.gen)
        self._push(self.T + self.scale.step_seconds, s, "step", s.gen)

    def _interrupt(self, s: _Slot) -> None:
        """One of the learner's chips fails: the learner dies, at once or at one of its next store
        calls; absorbed when it is down (or already dying)."""
        self.counts["interruptions"] += 1
        if s.node is None or s.armed:
            self.counts["absorbed"] += 1
            return
        if self.rng.random() < self.scale.mid_call:
            s.armed = True
            phase = self.rng.choice(["before", "landed", "replied"])
            s.faulty.arm_crash(after_calls=self.rng.randint(0, 12), phase=phase)
            return
        self._crash(s)

    def _crash(self, s: _Slot) -> None:
        assert s.node is not None and s.learner is not None
        self.counts["crashes"] += 1
        self.counts["closer_crashes"] += s.node.state.collector is not None
        # trained and not sent: the steps since each fragment's last contribution, and the
        # contributions handed over whose snapshot record had not landed (a crash after it landed,
        # before the reply was read, leaves it in the outbox and in the store)
        unsent = [p.steps for p in s.node.bridge.outbox if self.store.get(keys.snapshot_key(p.round, s.name)) is None]
        self.counts["lost_to_kill"] += sum(s.learner.steps_since) + sum(unsent)
        self.crash_times.append(self.T)
        self._close_up(s)
        s.node = s.learner = s.flat = None
        s.armed = False
        s.faulty.clear()
        s.faulty.pending_crash = None
        s.gen += 1
        self._push(self.T + self.model.recovery, s, "start", s.gen)

    # ---- the figures --------------------------------------------------------------------

    def _tape(self) -> list[RoundRecord]:
        store = RunStore(self.store)
        out = []
        for k in store.keys(keys.ROUNDS):
            if keys.parse_round_key(k) is not None:
                rec = store.read_record(k, RoundRecord)
                assert rec is not None, k
                out.append(rec)
        return out

    def recovery_margin(self) -> float:
        """Simulated seconds a restarted learner may take to reach a commit again: two syncs of
        every fragment, a takeover (a lease timeout) and a round timeout."""
        sc = self.scale
        return 2 * sc.sync_every * sc.step_seconds + self.opts.lease_timeout + self.opts.round_timeout_floor

    def _row(self) -> Row:
        sc, c = self.scale, self.counts
        tape = self._tape()
        horizon_rounds = [r for r in tape if self.commit_times.get(r.round, 0.0) <= sc.horizon]
        merged = sum(p.steps for r in tape for p in r.participants)
        capacity = self.m * int(sc.horizon / sc.step_seconds) * sc.fragments
        # recovered: the learner took part in a commit after its restart
        recovered = late = unrecovered = 0
        margin = self.recovery_margin()
        for s in self.slots:
            merged_at = sorted(
                self.commit_times[r.round]
                for r in tape
                if r.round in self.commit_times and any(p.learner == s.name for p in r.participants)
            )
            for t in s.restarted_at:
                if bisect.bisect_left(merged_at, t) < len(merged_at):
                    recovered += 1
                elif t > sc.horizon - margin:
                    late += 1
                else:
                    unrecovered += 1
        late += c["crashes"] - sum(len(s.restarted_at) for s in self.slots)  # restart due after the horizon
        commits = sorted(self.commit_times.values())
        to_commit = [commits[j] - t for t in self.crash_times if (j := bisect.bisect_right(commits, t)) < len(commits)]
        every = [t for times in self.log for t in times]
        dp, _ = dp_goodput(every, sc.horizon, self.model.dp_restart)
        elastic, _ = dp_goodput(every, sc.horizon, self.model.elastic_restart)
        up = sum(s.up_seconds for s in self.slots) / (self.m * sc.horizon)
        rounds_ok = [r.round for r in tape] == list(range(len(tape)))
        row = Row(
            learners=self.m,
            chips_per_learner=self.model.chips / self.m,
            interruptions=c["interruptions"],
            crashes=c["crashes"],
            closer_crashes=c["closer_crashes"],
            recovered=recovered,
            restarted_late=late,
            unrecovered=unrecovered,
            capacity=capacity,
            computed=c["computed"],
            merged=merged,
            lost_to_kill=c["lost_to_kill"],
            dropped_by_alignment=c["dropped_by_alignment"],
            unsent_at_end=c["unsent_at_end"],
            rounds=len(horizon_rounds),
            fault_free_rounds=0,
            takeovers=dict(sorted(self.takeovers.items())),
            kill_to_commit=to_commit,
            up_share=up,
            goodput=merged / (capacity - c["unsent_at_end"]),
            step_efficiency=float("nan"),
            dp=dp,
            elastic=elastic,
            ideal=self.model.ideal(self.m),
            tape_ok=rounds_ok,
            sim_seconds=self.T,
        )
        return row


def _with_twin(row: Row, free: Row) -> Row:
    """``row`` with step efficiency: its committed rounds over the fault-free twin's."""
    eff = row.rounds / free.rounds if free.rounds else float("nan")
    return dataclasses.replace(row, fault_free_rounds=free.rounds, step_efficiency=eff)


def measure(m: int, model: FailureModel, scale: TimeScale, seed: int = 0) -> Row:
    """One row: ``m`` learners under the failure model, and the same run without faults (its
    twin, whose committed rounds are step efficiency's denominator)."""
    row = GoodputRun(m, model, scale, seed).run()
    return _with_twin(row, GoodputRun(m, model, scale, seed, faults=False).run())


def _run(job: tuple[int, FailureModel, TimeScale, int, bool]) -> Row:
    m, model, scale, seed, faults = job
    return GoodputRun(m, model, scale, seed, faults=faults).run()


def run_table(
    learners: Iterable[int], model: FailureModel, scale: TimeScale, seed: int = 0, *, workers: int = 1
) -> list[Row]:
    """``measure`` for each learner count, its runs and their twins over ``workers`` processes
    (the largest first: a run's cost grows with its learners)."""
    ms = sorted(set(learners))
    jobs = [(m, model, scale, seed, faults) for m in sorted(ms, reverse=True) for faults in (True, False)]
    if workers <= 1:
        done = list(map(_run, jobs))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            done = list(pool.map(_run, jobs))
    by = {(j[0], j[4]): r for j, r in zip(jobs, done, strict=True)}
    return [_with_twin(by[m, True], by[m, False]) for m in ms]


def describe(model: FailureModel, scale: TimeScale, seed: int) -> str:
    """The parameters, as the table's heading prints them."""
    lam = model.cluster_rate
    return "\n".join(
        [
            f"failure model: {model.chips:,} chips, per-chip MTBF {model.mtbf_chip / YEAR:g} year(s): "
            f"a cluster interruption every {1 / lam:.1f} s; a learner down R = {model.recovery:g} s per "
            f"interruption; DP stalls R_dp = {model.dp_restart:g} s, elastic DP R_el = {model.elastic_restart:g} s",
            f"time scale: a step every {scale.step_seconds:g} s, DiLoCo(sync_every={scale.sync_every}, "
            f"fragments={scale.fragments}) (a round every {scale.sync_every / scale.fragments:g} steps), "
            f"poll {scale.poll_interval:g} s, lease timeout {scale.lease_timeout:g} s, round timeout "
            f"{scale.round_timeout:g} s, alignment {scale.alignment}; {scale.horizon:,.0f} simulated s; "
            f"{scale.mid_call:.0%} of the kills at one of the victim's next store calls; seed {seed}",
        ]
    )


def _pct(x: float | None) -> str:
    return "" if x is None or x != x else f"{100 * x:.1f}%"


def table(rows: list[Row]) -> str:
    """The rows as a markdown table, the paper's Table 1 beside them. Goodput and the four lost
    shares sum to 100% of the compute the chips could have done; "up" is the learners' time up
    (a time-based goodput, what the failure model alone takes away)."""
    head = (
        "| M | chips / learner | interruptions (crashes, of closers) | recovered | **goodput** | up "
        "| lost: down / kill / alignment / other | step efficiency | kill to next commit (median) "
        "| takeovers | DP | elastic DP | paper: learners / DP / elastic | check: 1/(1+muR) |"
    )
    lines = [head, "| " + " | ".join(["---:"] * 14) + " |"]
    for r in rows:
        shares = (r.capacity - r.computed, r.lost_to_kill, r.dropped_by_alignment, r.other_lost)
        lost = " / ".join(_pct(r.share(n)) for n in shares)
        k2c = f"{statistics.median(r.kill_to_commit):.1f} s" if r.kill_to_commit else ""
        took = ", ".join(f"{k} {v}" for k, v in sorted(r.takeovers.items())) or "0"
        paper = f"{_pct(PAPER_LEARNERS.get(r.learners)) or '-'} / {_pct(PAPER_DP)} / {_pct(PAPER_ELASTIC)}"
        lines.append(
            f"| {r.learners} | {r.chips_per_learner:,.0f} | {r.interruptions} ({r.crashes}, {r.closer_crashes}) "
            f"| {r.recovered} of {r.crashes - r.restarted_late} | **{_pct(r.goodput)}** | {_pct(r.up_share)} | {lost} "
            f"| {_pct(r.step_efficiency)} | {k2c} | {took} | {_pct(r.dp)} | {_pct(r.elastic)} | {paper} "
            f"| {_pct(r.ideal)} |"
        )
    return "\n".join(lines)


__all__ = [
    "ALIGNMENTS",
    "PAPER_DP",
    "PAPER_ELASTIC",
    "PAPER_LEARNERS",
    "FailureModel",
    "GoodputRun",
    "Row",
    "TimeScale",
    "describe",
    "dp_goodput",
    "fault_log",
    "measure",
    "run_table",
    "table",
]
