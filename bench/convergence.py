"""Convergence at equal compute: DiLoCo variants against synchronous data parallel.

A small character-level transformer (``examples/charlm.py``) on the standard library's own
source files (every ``heldout_every``-th file held out). Every arm trains 4 learners x ``steps``
optimizer steps of ``batch`` sequences with the same AdamW and the same learning-rate schedule
(linear warmup over 5% of the steps, then cosine decay to 10% of the peak at ``steps``, each
optimizer following it by its own step count), so all see the same number of tokens; the loss
reported is the held-out loss of the newest *committed* parameters.

Arms:

- ``data-parallel``: gradients averaged over the 4 workers every step (one model, batch 4 x b),
- ``diloco-H20`` / ``diloco-H50``: standard DiLoCo (``fragments=1, in_flight=1,
  overlap_steps=0, WeightedMean, quorum 4``), every learner waits at each sync,
- ``streaming-F32`` / ``streaming-F4``: Streaming DiLoCo (5 fragments, H=50, overlap 5 steps,
  mixing 0.5), deltas in F32 or F4; ``streaming-F4-EF``, ``streaming-I2``, ``streaming-I2-EF``:
  F4 and I2 deltas with and without error feedback; ``streaming-I2-goal``: I2 deltas and commits,
  error feedback and ``checkpoint_every=10`` (``traffic.py --goal``); each against F32, same lrs;
- ``decoupled-hetero``: Decoupled DiLoCo (4 fragments, H=20, quorum 3, RDA, no waiting) with
  learner 3 taking three times as long per step as the others; its fast learners go on to
  1.5 x ``steps`` (at the schedule's floor after ``steps``) to find when it reaches the target,
- ``diloco-H20`` is run with that same straggler: it waits for it at every sync, so its
  curve against steps is standard DiLoCo's and its clock is the straggler's.
- ``align-blend`` / ``align-carry`` / ``align-adaptive``: ``decoupled-hetero`` (whose commits
  overwrite the local steps: ``gm.Overwrite()``) with the other alignment rules, the same 3x
  straggler: each rule's loss at ``steps`` and its time to Overwrite's loss at ``steps``.
  ``--arms decoupled-hetero align-blend align-carry align-adaptive --no-data-parallel`` runs just these.

Learners are driven single-threaded (``Node.tick``/``Learner.step`` on a ``MemoryMailbox`` and
one ``FakeClock``) in simulated time: a fast step takes one time unit, every node polls once
per unit. The run is reproducible bit for bit and needs one core.

    python bench/convergence.py                 # 2,500 steps: 11 minutes on an idle core, 20 loaded
    python bench/convergence.py --steps 600     # quicker, further from converged (larger gaps)
    python bench/convergence.py --no-data-parallel --arms streaming-F32 streaming-F4-EF   # quantized deltas
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import _cluster  # noqa: E402
import charlm  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.adapters import adapter_for  # noqa: E402

LEARNERS = 4
SIZE = charlm.Size(layers=2, width=64, heads=4, block=64)


@dataclass
class Curve:
    name: str
    steps: list[float] = field(default_factory=list)  # optimizer steps of a (fast) learner
    times: list[float] = field(default_factory=list)  # simulated time units
    losses: list[float] = field(default_factory=list)

    def add(self, step: float, t: float, loss: float) -> None:
        self.steps.append(step)
        self.times.append(t)
        self.losses.append(loss)

    def final(self) -> float:
        """The loss of the last evaluation: at the end of training, after the last commit."""
        return self.losses[-1]

    def at(self, step: float) -> float:
        """The loss of the last evaluation at or before ``step``."""
        return [loss for s, loss in zip(self.steps, self.losses) if s <= step][-1]

    def time_to(self, target: float) -> float | None:
        for t, loss in zip(self.times, self.losses):
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

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

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


# ---- arms ----------------------------------------------------------------------------------------


def data_parallel(data: Data, args: argparse.Namespace) -> Curve:
    """4 workers averaging gradients every step = one model on their 4 batches at once."""
    model = charlm.CharTransformer(SIZE, seed=0)
    opt = Inner(model, args)
    gens = [data.generator(100 + i) for i in range(LEARNERS)]
    curve = Curve("data-parallel")
    curve.add(0, 0, charlm.evaluate(model, data.heldout))
    for s in range(1, args.steps + 1):
        xs, ys = zip(*(data.batch(g, args.batch) for g in gens))
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
) -> tuple[Curve, dict]:
    """Learners taking ``step_units`` time units per step. Each trains ``until`` steps and the run
    ends when their rounds have committed; with ``hetero``, it ends when the fast learners have
    trained ``until`` steps, however far the slow ones got."""
    mailbox, clock = gm.MemoryMailbox(), gm.FakeClock()
    members, opts, gens = [], [], []
    for i in range(LEARNERS):
        model = charlm.CharTransformer(SIZE, seed=0)
        members.append(_cluster.join(f"l{i}", model, cfg=cfg, mailbox=mailbox, clock=clock, seed=i))
        opts.append(Inner(model, args))
        gens.append(data.generator(100 + i))
    _cluster.see_each_other(members)
    evaluator = charlm.CharTransformer(SIZE, seed=0)
    eval_adapter = adapter_for(evaluator)
    stats = {"rejected": {}, "steps": [0] * LEARNERS}

    def committed_loss() -> float:
        for _, theta in members[0].node.thetas.values():
            eval_adapter.write(theta)
        return charlm.evaluate(evaluator, data.heldout)

    def blocked(m) -> bool:
        lr = m.learner
        overlap = cfg.overlap_steps
        return overlap is not None and bool(lr.published) and lr.local_step - lr.published[0].local_step >= overlap

    curve = Curve(name)
    curve.add(0, 0, committed_loss())
    fast = min(step_units)
    # A step ends ``step_units`` after it starts; a learner starts its next step when it is
    # free and not held back by ``overlap_steps`` (the engine's wait, here in simulated time).
    busy_until: list[int | None] = list(step_units)
    goal = [until if step_units[i] == fast or not hetero else 0 for i in range(LEARNERS)]
    t = 0
    next_eval = args.eval_every

    def finished() -> bool:
        trained = all(stats["steps"][i] >= goal[i] for i in range(LEARNERS))
        # Equal-speed and synchronous arms end once their last rounds committed, like data parallel.
        return trained and (hetero or all(not m.learner.published for m in members))

    while not finished():
        t += 1
        clock.advance(1.0)
        for i, m in enumerate(members):
            if busy_until[i] == t:
                x, y = data.batch(gens[i], args.batch)
                train_step(m.model, opts[i], x, y)
                m.step(args.batch * SIZE.block)
                stats["steps"][i] += 1
                busy_until[i] = None
        for m in members:
            m.tick()
        for i, m in enumerate(members):
            if busy_until[i] is None and stats["steps"][i] < max(goal) and not blocked(m):
                busy_until[i] = t + step_units[i]
        lead = max(stats["steps"][i] for i in range(LEARNERS) if step_units[i] == fast)
        if lead >= next_eval:
            curve.add(lead, t, committed_loss())
            next_eval += args.eval_every
    if curve.times[-1] != t:
        curve.add(lead, t, committed_loss())
    for m in members:
        for k, v in m.node.stats.rejected.items():
            stats["rejected"][k] = stats["rejected"].get(k, 0) + v
    stats["rounds"] = members[0].node.head + 1
    stats["time"] = t
    return curve, stats


# ---- main ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2500, help="optimizer steps per learner")
    ap.add_argument("--batch", type=int, default=8, help="sequences per learner per step")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak inner learning rate (AdamW)")
    ap.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps)")
    ap.add_argument("--min-lr", type=float, default=0.1, help="final learning rate, as a fraction of --lr")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--heldout-batches", type=int, default=8, help="fixed held-out batches of 32 x 64 chars")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="outer learning rate of every DiLoCo arm")
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--arms", nargs="*", default=None, help="run only these arms (data-parallel always runs)")
    ap.add_argument("--no-data-parallel", action="store_true", help="skip the data-parallel baseline")
    ap.add_argument("--plot", default=str(HERE / "convergence.png"))
    args = ap.parse_args()
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    data = Data(args.heldout_batches)
    outer = dict(outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
    standard = dict(fragments=1, in_flight=1, overlap_steps=0, merge=gm.WeightedMean(), quorum_size=LEARNERS, **outer)
    streaming = dict(
        **outer,
        sync_every=50,
        fragments=5,
        in_flight=2,
        overlap_steps=5,
        mixing=0.5,
        merge=gm.WeightedMean(),
        quorum_size=LEARNERS,
    )
    straggler = [1, 1, 1, 3]
    curves: dict[str, Curve] = {}
    info: dict[str, dict] = {}

    def done(name: str) -> None:
        c = curves[name]
        print(
            f"  {name:>17}: final held-out loss {c.final():.4f}  ({time.perf_counter() - t_start:.0f} s elapsed)",
            flush=True,
        )

    print(
        f"convergence at equal compute: {LEARNERS} learners x {args.steps} steps x {args.batch} x {SIZE.block} "
        f"chars, model {sum(p.numel() for p in charlm.CharTransformer(SIZE).parameters()):,} params; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    if not args.no_data_parallel:
        curves["data-parallel"] = data_parallel(data, args)
        done("data-parallel")
    arms = [
        ("diloco-H20", gm.DiLoCo(sync_every=20, **standard), straggler),
        ("diloco-H50", gm.DiLoCo(sync_every=50, **standard), [1] * LEARNERS),
        ("streaming-F32", gm.DiLoCo(**streaming), [1] * LEARNERS),
        ("streaming-F4", gm.DiLoCo(**streaming, delta_dtype="F4"), [1] * LEARNERS),
        ("streaming-F4-EF", gm.DiLoCo(**streaming, delta_dtype="F4", error_feedback=True), [1] * LEARNERS),
        ("streaming-I2", gm.DiLoCo(**streaming, delta_dtype="I2"), [1] * LEARNERS),
        ("streaming-I2-EF", gm.DiLoCo(**streaming, delta_dtype="I2", error_feedback=True), [1] * LEARNERS),
        ("decoupled-hetero", gm.DiLoCo(sync_every=20, fragments=4, quorum_size=3, **outer), straggler),
    ]
    goal = dict(delta_dtype="I2", commit_dtype="I2", error_feedback=True, checkpoint_every=10)  # traffic.py --goal
    arms.append(("streaming-I2-goal", gm.DiLoCo(**streaming, **goal), [1] * LEARNERS))
    hetero_cfg = dict(sync_every=20, fragments=4, quorum_size=3, **outer)
    arms += [
        ("align-blend", gm.DiLoCo(**hetero_cfg, alignment=gm.Blend(mixing=0.5)), straggler),
        ("align-carry", gm.DiLoCo(**hetero_cfg, alignment=gm.Carry()), straggler),
        ("align-adaptive", gm.DiLoCo(**hetero_cfg, alignment=gm.Adaptive()), straggler),
    ]
    for name, cfg, units in arms:
        if args.arms is not None and name not in args.arms:
            continue
        hetero = name == "decoupled-hetero" or name.startswith("align-")
        until = int(args.steps * 1.5) if hetero else args.steps
        curves[name], info[name] = cluster(name, cfg, data, args, step_units=units, until=until, hetero=hetero)
        done(name)

    alignment_table(curves, args.steps)
    if "data-parallel" not in curves:
        quantized_table(curves)
        return
    base = curves["data-parallel"].final()
    print(f"\nheld-out loss (nats/char) at the end of training, load average {os.getloadavg()[0]:.1f}")
    print(f"{'arm':>17} | {'final loss':>10} | {'/ data-parallel':>15} | {'rounds':>6} | rejected")
    for name, c in curves.items():
        if name == "decoupled-hetero" or name.startswith("align-"):
            # It trains past args.steps (50% more time) to find when it reaches the target; its
            # loss at args.steps fast-learner steps is the figure at equal time.
            final = c.at(args.steps)
        else:
            final = c.final()
        i = info.get(name, {})
        print(
            f"{name:>17} | {final:>10.4f} | {final / base:>15.4f} | {i.get('rounds', '-'):>6} | "
            f"{i.get('rejected', '-')}"
        )
    quantized_table(curves)
    if "diloco-H20" in curves:
        ratio = curves["diloco-H20"].final() / base
        print(f"DiLoCo H=20 against data parallel: loss ratio {ratio:.4f} (target <= 1.02)")
    if "diloco-H20" not in curves or "decoupled-hetero" not in curves:
        return

    sync, het = curves["diloco-H20"], curves["decoupled-hetero"]
    target = base
    if sync.time_to(target) is None or het.time_to(target) is None:
        target = max(sync.final(), base)
        print(
            f"(data parallel's final loss {base:.4f} is not reached by both; target = synchronous DiLoCo's final "
            f"loss {target:.4f})"
        )
    ts, th = sync.time_to(target), het.time_to(target)
    if ts is not None and th is not None:
        print(
            f"time to loss {target:.4f} with a 3x straggler: synchronous DiLoCo {ts} units, decoupled {th} units: "
            f"ratio {th / ts:.3f} (target <= 0.6)"
        )
    else:
        print(f"time to loss {target:.4f}: synchronous {ts}, decoupled {th} (not reached)")
    plot(curves, args.plot, args.steps)
    print(f"plot: {args.plot}; total {time.perf_counter() - t_start:.0f} s")


QUANTIZED = {
    "streaming-F4": "< 1.01",
    "streaming-F4-EF": "<= 1.003",
    "streaming-I2": "(what error feedback buys)",
    "streaming-I2-EF": "<= 1.01",
    "streaming-I2-goal": "(I2 commits, checkpoint_every=10)",
}


def quantized_table(curves: dict[str, Curve]) -> None:
    """Quantized deltas (with and without error feedback) against F32 deltas, same lr."""
    if "streaming-F32" not in curves:
        return
    base = curves["streaming-F32"].final()
    for name, target in QUANTIZED.items():
        if name in curves:
            ratio = curves[name].final() / base
            print(f"{name[10:]:>8} against F32 deltas (streaming): loss ratio {ratio:.4f} (target {target})")


def alignment_table(curves: dict[str, Curve], steps: int) -> None:
    """Each alignment rule against Overwrite (``decoupled-hetero``), with the 3x straggler: the loss
    when the fast learners have trained ``steps`` steps, and the time to Overwrite's loss there."""
    rules = [n for n in ("align-blend", "align-carry", "align-adaptive") if n in curves]
    if "decoupled-hetero" not in curves or not rules:
        return
    over = curves["decoupled-hetero"]
    target = over.at(steps)
    t_over = over.time_to(target)
    print(
        f"\nalignment rules with a 3x straggler (decoupled, H=20, 4 fragments, quorum 3), target = Overwrite's loss {target:.4f}"
    )
    print(f"{'rule':>17} | {'loss @ steps':>12} | {'/ overwrite':>11} | {'time to target':>14} | {'/ overwrite':>11}")
    print(f"{'overwrite':>17} | {target:>12.4f} | {1.0:>11.4f} | {t_over!s:>14} | {1.0:>11.3f}")
    for name in rules:
        c = curves[name]
        loss, t = c.at(steps), c.time_to(target)
        ratio = "-" if t is None or not t_over else f"{t / t_over:.3f}"
        print(f"{name[6:]:>17} | {loss:>12.4f} | {loss / target:>11.4f} | {t!s:>14} | {ratio:>11}")


def plot(curves: dict[str, Curve], path: str, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for name, c in curves.items():
        a.plot(c.steps, c.losses, label=name)
    a.set_xlabel("optimizer steps per learner (fast learners for decoupled-hetero)")
    a.set_ylabel("held-out loss (nats/char)")
    a.set_title("equal compute: loss against step")
    a.set_xlim(0, steps * 1.5)
    lows = [min(c.losses) for c in curves.values()]
    a.set_ylim(min(lows) - 0.05, min(lows) + 1.0)
    a.legend()
    for name in ("diloco-H20", "decoupled-hetero"):
        c = curves[name]
        label = (
            "synchronous DiLoCo H=20 (waits for the straggler)"
            if name == "diloco-H20"
            else "decoupled DiLoCo (quorum 3)"
        )
        b.plot(c.times, c.losses, label=label)
    b.axhline(curves["data-parallel"].final(), color="grey", linestyle=":", label="data parallel, final loss")
    b.set_xlabel("simulated time (units of one fast step)")
    b.set_ylabel("held-out loss (nats/char)")
    b.set_title("one learner 3x slower")
    b.set_ylim(min(lows) - 0.05, min(lows) + 1.0)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
