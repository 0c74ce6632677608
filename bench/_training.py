"""What ``convergence.py`` runs: the model, the data, the inner optimizer, and one arm of learners
driven single-threaded in simulated time (or data parallel), for one seed.

A seed picks the model's initial weights and every learner's data order (``seed`` 0 is what the
bench ran before seeds existed). ``run_job`` is the entry point of a worker process
(``convergence.py --jobs N``): it loads the data once per process and returns plain values.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import _cluster  # noqa: E402
import charlm  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.adapters import adapter_for  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.protocol.records import RoundRecord, decode  # noqa: E402

LEARNERS = 4
SIZE = charlm.Size(layers=2, width=64, heads=4, block=64)


@dataclass
class Curve:
    name: str
    seed: int = 0
    steps: list[float] = field(default_factory=list)  # optimizer steps of a (fast) learner
    times: list[float] = field(default_factory=list)  # simulated time units
    losses: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # rounds, rejected, simulated time, wall seconds

    def add(self, step: float, t: float, loss: float) -> None:
        self.steps.append(step)
        self.times.append(t)
        self.losses.append(loss)

    def final(self) -> float:
        """The loss of the last evaluation: at the end of training, after the last commit."""
        return self.losses[-1]

    def at(self, step: float) -> float:
        """The loss of the last evaluation at or before ``step``."""
        return [loss for s, loss in zip(self.steps, self.losses, strict=True) if s <= step][-1]

    def time_to(self, target: float) -> float | None:
        for t, loss in zip(self.times, self.losses, strict=True):
            if loss <= target:
                return t
        return None


class Data:
    def __init__(self, heldout_batches: int) -> None:
        text = charlm.stdlib_text()
        self.train = charlm.encode(text["train"])
        self.heldout = charlm.heldout_batches(
            charlm.encode(text["heldout"]), batches=heldout_batches, batch=32, block=SIZE.block
        )

    def generators(self, seed: int) -> list[torch.Generator]:
        """Each learner's (or data-parallel worker's) data order for ``seed``."""
        return [torch.Generator().manual_seed(100 + i + 1000 * seed) for i in range(LEARNERS)]

    def batch(self, g: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return charlm.sample_batch(self.train, batch=batch, block=SIZE.block, generator=g)


def optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def lr_factor(k: int, args: argparse.Namespace) -> float:
    """The inner learning rate of an optimizer's step ``k + 1`` (after ``k`` steps), as a
    fraction of ``--lr``: linear warmup over ``--warmup`` steps, then cosine decay to
    ``--min-lr`` at ``--steps`` steps, and ``--min-lr`` after that. Every optimizer of every arm
    follows it by its own step count. ``--schedule constant`` keeps it at 1."""
    if args.schedule == "constant":
        return 1.0
    if k < args.warmup:
        return (k + 1) / args.warmup
    p = min(1.0, (k - args.warmup) / max(1, args.steps - args.warmup))
    return args.min_lr + (1.0 - args.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


class Inner:
    """A learner's (or data parallel's) AdamW and its learning-rate schedule."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace) -> None:
        self.args = args
        self.opt = optimizer(model, args.lr)
        self.k = 0
        self._set()

    def _set(self) -> None:
        for group in self.opt.param_groups:
            group["lr"] = self.args.lr * lr_factor(self.k, self.args)

    def step(self) -> None:
        self.opt.step()
        self.k += 1
        self._set()


def train_step(model, inner: Inner, x, y) -> None:
    loss = model.loss(x, y)
    inner.opt.zero_grad(set_to_none=True)
    loss.backward()
    inner.step()


def data_parallel(data: Data, args: argparse.Namespace, seed: int = 0) -> Curve:
    """4 workers averaging gradients every step = one model on their 4 batches at once."""
    model = charlm.CharTransformer(SIZE, seed=seed)
    opt = Inner(model, args)
    gens = data.generators(seed)
    curve = Curve("data-parallel", seed)
    curve.add(0, 0, charlm.evaluate(model, data.heldout))
    for s in range(1, args.steps + 1):
        xs, ys = zip(*(data.batch(g, args.batch) for g in gens), strict=True)
        train_step(model, opt, torch.cat(xs), torch.cat(ys))
        if s % args.eval_every == 0:
            curve.add(s, s, charlm.evaluate(model, data.heldout))
    return curve


def cluster(
    name: str,
    cfg: gm.DiLoCo,
    data: Data,
    args: argparse.Namespace,
    *,
    step_units: list[int],
    until: int,
    hetero: bool = False,
    seed: int = 0,
    probe: Callable[[list[_cluster.Member]], None] | None = None,
) -> Curve:
    """Learners taking ``step_units`` time units per step. Each trains ``until`` steps and the run
    ends when their rounds have committed; with ``hetero``, it ends when the fast learners have
    trained ``until`` steps, however far the slow ones got. ``probe(members)``: called after every
    time unit's polls (``bench/ef_study.py`` reads the nodes' state through it)."""
    mailbox, clock = gm.MemoryMailbox(), gm.FakeClock()
    members, opts = [], []
    for i in range(LEARNERS):
        model = charlm.CharTransformer(SIZE, seed=seed)
        members.append(_cluster.join(f"l{i}", model, cfg=cfg, mailbox=mailbox, clock=clock, seed=i, keep_events=True))
        opts.append(Inner(model, args))
    gens = data.generators(seed)
    _cluster.see_each_other(members)
    evaluator = charlm.CharTransformer(SIZE, seed=seed)
    eval_adapter = adapter_for(evaluator)
    steps = [0] * LEARNERS

    def committed_loss() -> float:
        for _, theta in members[0].node.state.thetas.values():
            eval_adapter.write(theta)
        return charlm.evaluate(evaluator, data.heldout)

    def blocked(m) -> bool:
        lr = m.learner
        overlap = cfg.overlap_steps
        return overlap is not None and bool(lr.published) and lr.local_step - lr.published[0].local_step >= overlap

    curve = Curve(name, seed)
    curve.add(0, 0, committed_loss())
    fast = min(step_units)
    # A step ends ``step_units`` after it starts; a learner starts its next step when it is
    # free and not held back by ``overlap_steps`` (the engine's wait, here in simulated time).
    busy_until: list[int | None] = list(step_units)
    goal = [until if step_units[i] == fast or not hetero else 0 for i in range(LEARNERS)]
    t = 0
    next_eval = args.eval_every

    def finished() -> bool:
        trained = all(steps[i] >= goal[i] for i in range(LEARNERS))
        # Equal-speed and synchronous arms end once their last rounds committed, like data parallel.
        return trained and (hetero or all(not m.learner.published for m in members))

    lead = 0
    while not finished():
        t += 1
        clock.advance(1.0)
        for i, m in enumerate(members):
            if busy_until[i] == t:
                x, y = data.batch(gens[i], args.batch)
                train_step(m.model, opts[i], x, y)
                m.step(args.batch * SIZE.block)
                steps[i] += 1
                busy_until[i] = None
        for m in members:
            m.tick()
        if probe is not None:
            probe(members)
        for i, m in enumerate(members):
            if busy_until[i] is None and steps[i] < max(goal) and not blocked(m):
                busy_until[i] = t + step_units[i]
        lead = max(steps[i] for i in range(LEARNERS) if step_units[i] == fast)
        if lead >= next_eval:
            curve.add(lead, t, committed_loss())
            next_eval += args.eval_every
    if curve.times[-1] != t:
        curve.add(lead, t, committed_loss())
    rejected: dict[str, int] = {}
    for m in members:
        for k, v in m.node.state.stats.rejected.items():
            rejected[k] = rejected.get(k, 0) + v
    curve.info.update(
        rounds=members[0].node.state.head + 1, rejected=rejected, time=t, **goodput(mailbox, members, steps)
    )
    return curve


def goodput(mailbox: gm.Mailbox, members: list[_cluster.Member], steps: list[int]) -> dict[str, float]:
    """The share of the steps the learners computed that reached a commit, in fragment-steps (a step
    trains every fragment; a fragment's part of it reaches a commit through that fragment's
    contribution), and the share the alignments dropped (``Aligned.dropped``)."""
    P = members[0].node.run.P
    merged = 0
    for k in mailbox.list(keys.ROUNDS):
        merged += sum(p.steps for p in decode(mailbox.get(k), RoundRecord, key=k).participants)
    dropped = sum(e.dropped for m in members for e in m.events if isinstance(e, gm.events.Aligned))
    published = sum(e.steps for m in members for e in m.events if isinstance(e, gm.events.Published))
    computed = P * sum(steps)
    return {"goodput": merged / computed, "dropped_by_alignment": dropped / computed, "published": published / computed}


# ---- worker processes (``--jobs``) --------------------------------------------------------------

_DATA: dict[int, Data] = {}


@dataclass(frozen=True)
class Job:
    """One arm for one seed: ``cfg`` None is data parallel."""

    name: str
    seed: int
    cfg: gm.DiLoCo | None
    step_units: tuple[int, ...] = (1,) * LEARNERS
    until: int = 0
    hetero: bool = False


def run_job(job: Job, args: argparse.Namespace) -> Curve:
    torch.set_num_threads(1)
    data = _DATA.get(args.heldout_batches)
    if data is None:
        data = _DATA[args.heldout_batches] = Data(args.heldout_batches)
    start = time.perf_counter()
    if job.cfg is None:
        curve = data_parallel(data, args, job.seed)
    else:
        curve = cluster(
            job.name,
            job.cfg,
            data,
            args,
            step_units=list(job.step_units),
            until=job.until,
            hetero=job.hetero,
            seed=job.seed,
        )
    curve.info["wall_s"] = round(time.perf_counter() - start, 1)
    return curve
