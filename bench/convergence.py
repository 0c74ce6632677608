"""Convergence at equal compute: DiLoCo variants against synchronous data parallel, and quantized
deltas and commits against F32 deltas, each arm over several seeds.

A small character-level transformer (``examples/charlm.py``) on the standard library's own
source files (every ``heldout_every``-th file held out). Every arm trains 4 learners x ``steps``
optimizer steps of ``batch`` sequences with the same AdamW and the same learning-rate schedule
(linear warmup over 5% of the steps, then cosine decay to 10% of the peak at ``steps``, each
optimizer following it by its own step count), so all see the same number of tokens; the loss
reported is the held-out loss of the newest *committed* parameters. A seed picks the initial
weights and every learner's data order; every arm runs every seed (``--seeds``), and a ratio
against another arm is taken seed by seed, then averaged (mean, and the spread over seeds).

Arms:

- ``data-parallel``: gradients averaged over the 4 workers every step (one model, batch 4 x b),
- ``diloco-H20`` / ``diloco-H50``: standard DiLoCo (``fragments=1, in_flight=1,
  overlap_steps=0, WeightedMean, quorum 4``), every learner waits at each sync; ``diloco-H20``
  has learner 3 three times slower (its curve against steps is standard DiLoCo's, its clock the
  straggler's),
- two sets of quantized arms, each against its own F32 arm, same lrs (``--arms 'textbook-*'``):
  ``textbook-*``: textbook DiLoCo as a new user would try it (``fragments=1, in_flight=1,
  overlap_steps=0``, no mixing, ``gm.Overwrite()``, ``WeightedMean``, quorum 4, ``sync_every=20``,
  4 learners in lockstep); ``streaming-*``: Streaming DiLoCo (5 fragments, H=50, overlap 5 steps, mixing 0.5).
  Each set has ``-F32``, ``-F4``, ``-F4-EF``, ``-I2``, ``-I2-EF`` (deltas in that dtype, ``-EF``
  with error feedback), ``-frontier``: ``gm.DiLoCo.frontier`` (I2 deltas and commits, error
  feedback, ``checkpoint_every=10``, ``gap_projection``: the bytes of ``traffic.py --goal``),
  ``-frontier-noproj``: the same without ``gap_projection``, ``-frugal``: F4 commits
  (``gm.DiLoCo.frugal``), and ``-cap2`` / ``-cap2-carry``: F32 deltas with ``max_contributions=2``
  (each round merges the 2 of the 4 learners its draw picks; the others' steps are dropped, or kept
  with ``gm.Carry()``),
- ``decoupled-hetero``: Decoupled DiLoCo (4 fragments, H=20, quorum 3, RDA, no waiting) with
  learner 3 taking three times as long per step as the others; its fast learners go on to
  1.5 x ``steps`` (at the schedule's floor after ``steps``) to find when it reaches the target,
- ``{set}-rule-{overwrite,blend,carry,adaptive}``, set ``textbook``, ``streaming`` or ``default``
  (``gm.DiLoCo(sync_every=50, fragments=5)``, every other field at its default: what a user gets):
  each alignment rule with F32 deltas, with the share of the computed steps that reached a commit,
- ``align-blend`` / ``align-carry`` / ``align-adaptive``: ``decoupled-hetero`` (whose commits
  overwrite the local steps: ``gm.Overwrite()``) with the other alignment rules, the same 3x
  straggler: each rule's loss at ``steps`` and its time to Overwrite's loss at ``steps``.

Learners are driven single-threaded (``Node.tick``/``Learner.step`` on a ``MemoryMailbox`` and
one ``FakeClock``) in simulated time: a fast step takes one time unit, every node polls once
per unit. A run is reproducible bit for bit and needs one core; ``--jobs N`` runs N (arm, seed)
pairs side by side in worker processes (the same figures).

    python bench/convergence.py --seeds 1      # every arm, 2,500 steps, one seed: ~25 minutes
    python bench/convergence.py --steps 1000 --no-data-parallel --arms 'textbook-*' 'streaming-*' --jobs 2
    python bench/convergence.py --no-data-parallel --arms streaming-F32 streaming-F4-EF --log runs.jsonl
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path

from _training import LEARNERS, SIZE, Curve, Job, charlm, run_job

import gradientmail_core as gm
from gradientmail_core.config import FRONTIER, FRUGAL

HERE = Path(__file__).resolve().parent
SETS = ("textbook", "streaming")
# The quantized arms of each set: what each compares against F32 deltas, and the target.
QUANTIZED = {
    "F4": "",
    "F4-EF": "<= 1.003, and <= F4",
    "I2": "",
    "I2-EF": "<= 1.01, and <= I2",
    "frontier": "<= 1.015",
    "frontier-noproj": "",
    "frugal": "<= 1.015",
    "cap2": "",
    "cap2-carry": "",
}
# ``-frontier``: what ``gm.DiLoCo.frontier`` sets (the bytes of ``traffic.py --goal``: I2 deltas
# and commits, with ``gap_projection``); ``-frontier-noproj``: the same without the projection (the
# frontier before it); ``-frugal``: what ``gm.DiLoCo.frugal`` sets (F4 commits).
HETERO = ("decoupled-hetero", "align-blend", "align-carry", "align-adaptive")
RULES = {"overwrite": gm.Overwrite(), "blend": gm.Blend(mixing=0.5), "carry": gm.Carry(), "adaptive": gm.Adaptive()}


def arm_configs(args: argparse.Namespace) -> list[tuple[str, gm.DiLoCo, list[int]]]:
    """Every arm but data parallel: (name, config, time units per step of each learner)."""
    outer = dict(outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
    # Overwrite: what these arms' figures were measured with (in lockstep behind a barrier, Carry's
    # bits too); ``-cap2`` is the arm whose undrawn learners drop their steps.
    standard = dict(
        fragments=1,
        in_flight=1,
        overlap_steps=0,
        merge=gm.WeightedMean(),
        quorum_size=LEARNERS,
        alignment=gm.Overwrite(),
        **outer,
    )
    sets = {
        "textbook": gm.DiLoCo(sync_every=20, **standard),
        "streaming": gm.DiLoCo(
            **outer,
            sync_every=50,
            fragments=5,
            in_flight=2,
            overlap_steps=5,
            mixing=0.5,
            merge=gm.WeightedMean(),
            quorum_size=LEARNERS,
        ),
    }
    lockstep, straggler = [1] * LEARNERS, [1, 1, 1, 3]
    arms = [
        ("diloco-H20", gm.DiLoCo(sync_every=20, **standard), straggler),
        ("diloco-H50", gm.DiLoCo(sync_every=50, **standard), lockstep),
    ]
    for s, base in sets.items():
        arms += [
            (f"{s}-F32", base, lockstep),
            (f"{s}-F4", replace(base, delta_dtype="F4"), lockstep),
            (f"{s}-F4-EF", replace(base, delta_dtype="F4", error_feedback=True), lockstep),
            (f"{s}-I2", replace(base, delta_dtype="I2"), lockstep),
            (f"{s}-I2-EF", replace(base, delta_dtype="I2", error_feedback=True), lockstep),
            (f"{s}-frontier", replace(base, **FRONTIER), lockstep),
            (f"{s}-frontier-noproj", replace(base, **{**FRONTIER, "gap_projection": False}), lockstep),
            (f"{s}-frugal", replace(base, **FRUGAL), lockstep),
            # a fleet's cap (``max_contributions``): each round merges the 2 drawn of the 4
            (f"{s}-cap2", replace(base, max_contributions=2), lockstep),
            (f"{s}-cap2-carry", replace(base, max_contributions=2, mixing=0.0, alignment=gm.Carry()), lockstep),
        ]
    # The alignment rules, F32 deltas, in each set and in the config a user gets by default
    # (``gm.DiLoCo(sync_every=50, fragments=5)``: overlap unbounded, quorum 1, RDA; each rule named).
    groups = {**sets, "default": gm.DiLoCo(sync_every=50, fragments=5, **outer)}
    for s, base in groups.items():
        for rule, alignment in RULES.items():
            arms.append((f"{s}-rule-{rule}", replace(base, mixing=0.0, alignment=alignment), lockstep))
    hetero = gm.DiLoCo(sync_every=20, fragments=4, quorum_size=3, alignment=gm.Overwrite(), **outer)
    arms += [
        ("decoupled-hetero", hetero, straggler),
        ("align-blend", replace(hetero, alignment=gm.Blend(mixing=0.5)), straggler),
        ("align-carry", replace(hetero, alignment=gm.Carry()), straggler),
        ("align-adaptive", replace(hetero, alignment=gm.Adaptive()), straggler),
    ]
    return arms


def selected(name: str, patterns: list[str] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def jobs_for(args: argparse.Namespace) -> list[Job]:
    jobs: list[Job] = []
    for seed in args.seeds:
        if not args.no_data_parallel:
            jobs.append(Job("data-parallel", seed, None))
        for name, cfg, units in arm_configs(args):
            if selected(name, args.arms):
                hetero = name in HETERO
                until = int(args.steps * 1.5) if hetero else args.steps
                jobs.append(Job(name, seed, cfg, tuple(units), until, hetero))
    return jobs


# ---- tables --------------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    """``mean +- sample sd`` (``mean`` alone for one value)."""
    m = statistics.fmean(values)
    return f"{m:.4f}" if len(values) < 2 else f"{m:.4f} +- {statistics.stdev(values):.4f}"


def ratios(curves: dict[str, dict[int, Curve]], name: str, base: str, at: int | None = None) -> list[float]:
    """``name``'s loss over ``base``'s, seed by seed (the seeds both ran)."""
    got, ref = curves.get(name, {}), curves.get(base, {})

    def loss(c: Curve) -> float:
        return c.at(at) if at is not None else c.final()

    return [loss(got[s]) / loss(ref[s]) for s in sorted(got) if s in ref]


def ratio_cell(rs: list[float]) -> str:
    if not rs:
        return "-"
    m = statistics.fmean(rs)
    return f"{m:.4f}" if len(rs) < 2 else f"{m:.4f} [{min(rs):.4f}, {max(rs):.4f}]"


def final_loss(name: str, c: Curve, steps: int) -> float:
    # The hetero arms train past ``steps`` (50% more time) to find when they reach the target;
    # their loss at ``steps`` fast-learner steps is the figure at equal time.
    return c.at(steps) if name in HETERO else c.final()


def main_table(curves: dict[str, dict[int, Curve]], steps: int) -> None:
    if "data-parallel" not in curves:
        return
    print(f"\nheld-out loss (nats/char) at the end of training, mean +- sd over seeds; load {os.getloadavg()[0]:.1f}")
    print(f"{'arm':>20} | {'final loss':>17} | {'/ data-parallel [min, max]':>26} | rounds | rejected")
    for name, by_seed in curves.items():
        losses = [final_loss(name, c, steps) for c in by_seed.values()]
        rs = ratios(curves, name, "data-parallel", at=steps if name in HETERO else None)
        one = next(iter(by_seed.values()))
        print(
            f"{name:>20} | {spread(losses):>17} | {ratio_cell(rs):>26} | {one.info.get('rounds', '-')!s:>6} | "
            f"{one.info.get('rejected', '-')}"
        )
    if "diloco-H20" in curves:
        rs = ratios(curves, "diloco-H20", "data-parallel")
        print(f"DiLoCo H=20 against data parallel: loss ratio {ratio_cell(rs)} (target <= 1.02)")


def quantized_table(curves: dict[str, dict[int, Curve]]) -> None:
    """Each set's quantized arms against the set's F32 deltas, seed by seed, same lr."""
    for s in SETS:
        base = f"{s}-F32"
        if base not in curves:
            continue
        seeds = sorted(curves[base])
        print(f"\n{s}: held-out loss against {base}, seed by seed (seeds {seeds}); mean [min, max]")
        print(f"{'arm':>20} | {'final loss':>17} | {'/ F32 deltas':>26} | target")
        print(f"{base:>20} | {spread([c.final() for c in curves[base].values()]):>17} | {'1':>26} |")
        for arm, target in QUANTIZED.items():
            name = f"{s}-{arm}"
            if name in curves:
                rs = ratios(curves, name, base)
                losses = [c.final() for c in curves[name].values()]
                print(f"{name:>20} | {spread(losses):>17} | {ratio_cell(rs):>26} | {target}")
        for fed, plain in ((f"{s}-F4-EF", f"{s}-F4"), (f"{s}-I2-EF", f"{s}-I2")):
            if fed in curves and plain in curves:
                diffs = ratios(curves, fed, plain)
                print(f"{fed:>20} against {plain}: {ratio_cell(diffs)} (error feedback never worse: <= 1)")


def alignment_table(curves: dict[str, dict[int, Curve]], steps: int) -> None:
    """Each alignment rule against Overwrite (``decoupled-hetero``), with the 3x straggler: the loss
    when the fast learners have trained ``steps`` steps, and the time to Overwrite's loss there."""
    rules = [n for n in HETERO[1:] if n in curves]
    if "decoupled-hetero" not in curves or not rules:
        return
    print("\nalignment rules with a 3x straggler (decoupled, H=20, 4 fragments, quorum 3), against Overwrite")
    print(f"{'rule':>17} | {'loss @ steps':>17} | {'/ overwrite':>26} | time to Overwrite's loss / Overwrite's")
    over = curves["decoupled-hetero"]
    for name in rules:
        c = curves[name]
        times = []
        for seed, o in over.items():
            if seed in c:
                t, t_over = c[seed].time_to(o.at(steps)), o.time_to(o.at(steps))
                times.append(float("nan") if t is None or not t_over else t / t_over)
        losses = [x.at(steps) for x in c.values()]
        print(
            f"{name[6:]:>17} | {spread(losses):>17} | {ratio_cell(ratios(curves, name, 'decoupled-hetero', steps)):>26}"
            f" | {ratio_cell(times)}"
        )


def rules_table(curves: dict[str, dict[int, Curve]]) -> None:
    """Each alignment rule in each set (``{set}-rule-{rule}``): its loss against the set's Overwrite,
    seed by seed, and the share of the computed steps that reached a commit (and that alignments
    dropped)."""
    for s in (*SETS, "default"):
        base = f"{s}-rule-overwrite"
        names = [f"{s}-rule-{r}" for r in RULES if f"{s}-rule-{r}" in curves]
        if base not in curves or len(names) < 2:
            continue
        print(f"\nalignment rules, {s} set (F32 deltas, lockstep): loss against Overwrite; steps merged and dropped")
        print(
            f"{'rule':>10} | {'final loss':>17} | {'/ overwrite [min, max]':>26} | merged | published | dropped by alignment"
        )
        for name in names:
            c = curves[name]
            merged = statistics.fmean(x.info["goodput"] for x in c.values())
            dropped = statistics.fmean(x.info["dropped_by_alignment"] for x in c.values())
            published = statistics.fmean(x.info["published"] for x in c.values())
            print(
                f"{name.rsplit('-', 1)[1]:>10} | {spread([x.final() for x in c.values()]):>17} | "
                f"{ratio_cell(ratios(curves, name, base)):>26} | {merged:6.1%} | {published:9.1%} | {dropped:.1%}"
            )


def hetero_table(curves: dict[str, dict[int, Curve]]) -> None:
    if not {"data-parallel", "diloco-H20", "decoupled-hetero"} <= set(curves):
        return
    for seed in sorted(curves["decoupled-hetero"]):
        if seed not in curves["diloco-H20"] or seed not in curves["data-parallel"]:
            continue
        sync, het, base = curves["diloco-H20"][seed], curves["decoupled-hetero"][seed], curves["data-parallel"][seed]
        target, what = base.final(), "data parallel's final loss"
        if sync.time_to(target) is None or het.time_to(target) is None:
            target, what = max(sync.final(), base.final()), "synchronous DiLoCo's final loss"
        ts, th = sync.time_to(target), het.time_to(target)
        ratio = "-" if ts is None or th is None else f"{th / ts:.3f}"
        print(
            f"seed {seed}: time to {what} {target:.4f} with a 3x straggler: synchronous {ts}, decoupled {th}: "
            f"ratio {ratio} (target <= 0.6)"
        )


def plot(curves: dict[str, dict[int, Curve]], path: str, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    lows = []
    for name, by_seed in curves.items():
        c = by_seed[min(by_seed)]
        a.plot(c.steps, c.losses, label=name)
        lows.append(min(c.losses))
    a.set_xlabel("optimizer steps per learner (fast learners for the hetero arms); the first seed")
    a.set_ylabel("held-out loss (nats/char)")
    a.set_xlim(0, steps * 1.5)
    a.set_ylim(min(lows) - 0.05, min(lows) + 1.0)
    a.legend(fontsize=7)
    for name in ("diloco-H20", "decoupled-hetero"):
        if name in curves:
            c = curves[name][min(curves[name])]
            b.plot(c.times, c.losses, label=name)
    if "data-parallel" in curves:
        b.axhline(curves["data-parallel"][min(curves["data-parallel"])].final(), color="grey", linestyle=":")
    b.set_xlabel("simulated time (units of one fast step)")
    b.set_ylim(min(lows) - 0.05, min(lows) + 1.0)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    ap.add_argument("--arms", nargs="*", default=None, help="run only these arms (shell-style patterns)")
    ap.add_argument("--no-data-parallel", action="store_true", help="skip the data-parallel baseline")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (init and data order) of every arm")
    ap.add_argument("--jobs", type=int, default=1, help="(arm, seed) pairs run side by side, one process each")
    ap.add_argument("--log", default=None, help="append each (arm, seed)'s curve to this JSON-lines file")
    ap.add_argument("--plot", default=str(HERE / "convergence.png"))
    args = ap.parse_args()
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    t_start = time.perf_counter()
    jobs = jobs_for(args)
    n_params = sum(p.numel() for p in charlm.CharTransformer(SIZE).parameters())
    print(
        f"convergence at equal compute: {LEARNERS} learners x {args.steps} steps x {args.batch} x {SIZE.block} "
        f"chars, model {n_params:,} params; {len(jobs)} runs (seeds {args.seeds}), {args.jobs} at a time; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    curves: dict[str, dict[int, Curve]] = {}

    def done(c: Curve) -> None:
        curves.setdefault(c.name, {})[c.seed] = c
        print(
            f"  {c.name:>20} seed {c.seed}: final held-out loss {c.final():.4f} ({c.info['wall_s']:.0f} s; "
            f"{time.perf_counter() - t_start:.0f} s elapsed)",
            flush=True,
        )
        if args.log:
            with open(args.log, "a") as f:
                row = dict(arm=c.name, seed=c.seed, steps=args.steps, lr=args.lr, final=c.final(), info=c.info)
                f.write(json.dumps({**row, "curve": [c.steps, c.times, c.losses]}) + "\n")

    if args.jobs <= 1:
        for job in jobs:
            done(run_job(job, args))
    else:
        # spawn: a forked child of a process that ran torch may hang in its thread pools
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for future in as_completed([pool.submit(run_job, job, args) for job in jobs]):
                done(future.result())
    curves = {name: dict(sorted(curves[name].items())) for name in dict.fromkeys(j.name for j in jobs)}
    main_table(curves, args.steps)
    quantized_table(curves)
    alignment_table(curves, args.steps)
    rules_table(curves)
    hetero_table(curves)
    if "data-parallel" in curves:
        plot(curves, args.plot, args.steps)
        print(f"plot: {args.plot}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
