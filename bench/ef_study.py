"""Why error feedback and quantized commits cost training quality, measured (issue 29).

Runs ``convergence.py``'s arms (``--arms``, the same names) for several seeds with the engine as
it is, or with one of the variants below patched in, and records per round what the deltas, the
residuals and the commits were:

- ``resent``: ``|R_t| / |D_t|``, the merged residual a round owes (the mean over learners of what
  quantization took out of each delta: ``x_i - sent_i``) against the merged plain delta;
- ``reaction``: ``<D_{t+1}, R_t> / |R_t|^2``: how much of the owed residual the *next* round's
  plain deltas hold already. The commit of round t missed ``outer_lr (1 + momentum) R_t``; where
  the inner steps pull the parameters back regardless of where they start (stiff directions) the
  next deltas hold that much (1.33 at the defaults), where they do not (flat ones), nothing. Error
  feedback adds ``R_t`` again on top of what the learners recover by themselves;
- ``gap``: with ``commit_dtype``, the closer's ``|master - theta| / |master_t - master_{t-1}|``
  after a commit (the rounding of the change the learners train from), and ``gap_reaction``
  ``<D_{t+1}, master_t - theta_t> / |master_t - theta_t|^2``: -1 where the learners' deltas undo
  the gap themselves (which the closer's master then applies a second time), 0 where they do not.

Variants (``--variant``, comma-separated ``key=value``):

- ``ef=add`` (the engine before issue 29): a merged delta's residual is added to the next delta
  instead of being given back to the parameters when its commit arrives (the engine since issue
  29, ``adapters/feedback.py``: the next delta then carries it only where the inner steps leave
  it in place);
- ``commit=keep`` (before issue 29): the closer's master keeps the whole rounding of the change;
  ``commit=decay:g``: ``g`` of it (``commit=decay:0``: the master is the published parameters);
  ``proj=tensor`` / ``proj=B`` (with commit_dtype): the merged delta's projection on the newest
  commit's gap, where negative (the learners pulling back toward the master), taken out before the
  outer step, per tensor or per block of B elements (``proj=32`` is the engine's
  ``gap_projection`` since issue 29: run it on ``-frontier-noproj``, the ``-frontier`` arms have it);
  ``commit=grad``: the closer quantizes the merged outer gradient (I2, with a residual of its own;
  ``grad-noef``: without) and every node takes the outer step from it (the learners' parameters
  are the master); ``cd=F4``: commits in another dtype.

    python bench/ef_study.py --arms textbook-I2 textbook-I2-EF --seeds 0 1 2 --jobs 2 --steps 1000
    python bench/ef_study.py --arms textbook-I2-EF --variant '' ef=add commit=decay:0 --steps 1000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from typing import Any

import numpy as np
from _training import Data, cluster
from convergence import FRONTIER, arm_configs

_DATA: dict[int, Data] = {}


def flat(values: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(values[n], np.float64).reshape(-1) for n in sorted(values)])


class Recorder:
    """What the patched engine reports: per (round, fragment) each learner's plain delta, what it
    meant to send (the delta and the residual added) and what it sent; the closer's master and
    theta after each commit. Only the two newest rounds of a fragment are held: a pair of rounds
    is measured when a third one starts."""

    def __init__(self, fragments: int) -> None:
        self.P = fragments
        self.deltas: dict[int, dict[int, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]]] = defaultdict(dict)
        self.commits: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # round -> (master, theta)
        self.out: dict[str, list[float]] = defaultdict(list)

    def delta(self, learner: int, r: int, f: int, d: np.ndarray, x: np.ndarray, sent: np.ndarray) -> None:
        rounds = self.deltas[f]
        if r not in rounds and len(rounds) == 2:
            a, b = sorted(rounds)
            self._pair(a, b, rounds.pop(a), rounds[b])
        rounds.setdefault(r, {})[learner] = (d, x, sent)

    def commit(self, r: int, master: np.ndarray, theta: np.ndarray) -> None:
        self.commits[r] = (master, theta)
        for old in [k for k in self.commits if k < r - 2 * self.P]:
            del self.commits[old]

    def _pair(self, a: int, b: int, cur: dict, nxt: dict) -> None:
        if len(cur) < 2 or len(nxt) < 2:
            return
        d_now = np.mean([v[0] for v in cur.values()], axis=0)
        owed = np.mean([v[1] - v[2] for v in cur.values()], axis=0)  # x_i - sent_i
        d_next = np.mean([v[0] for v in nxt.values()], axis=0)
        n_owed = float(owed @ owed)
        if n_owed > 0:
            self.out["resent"].append(float(np.sqrt(n_owed / (d_now @ d_now))))
            self.out["reaction"].append(float(d_next @ owed) / n_owed)
            err = [float((v[1] - v[2]) @ (v[1] - v[2]) / (v[1] @ v[1])) for v in cur.values()]
            self.out["own_error"].append(float(np.sqrt(statistics.fmean(err))))
        if a in self.commits:
            master, theta = self.commits[a]
            gap = master - theta
            n_gap = float(gap @ gap)
            if n_gap > 0:
                self.out["gap_reaction"].append(float(d_next @ gap) / n_gap)
                prev = self.commits.get(a - self.P)
                if prev is not None:
                    step = master - prev[0]
                    self.out["gap"].append(float(np.sqrt(n_gap / (step @ step))))

    def summary(self) -> dict[str, Any]:
        for rounds in self.deltas.values():
            if len(rounds) == 2:
                a, b = sorted(rounds)
                self._pair(a, b, rounds[a], rounds[b])
        return {k: (statistics.fmean(v), statistics.median(v), len(v)) for k, v in self.out.items()}


def patch(variant: dict[str, str], rec: Recorder) -> None:
    """Patch the engine in this (worker) process: the variant, and the recorder's hooks."""
    from gradientmail_core.adapters import handles
    from gradientmail_core.codec import quant
    from gradientmail_core.syncer.merger import FragmentMerger

    ef = variant.get("ef", "engine")
    commit = variant.get("commit", "keep")
    if ef == "add":
        # the rule before issue 29: what the merged delta owes goes into the next delta, the
        # parameters are left as the commit made them
        def settle(self, fragment, round, *, merged):
            if self.residuals is not None:
                owed = self.residuals.settle(fragment, round, merged=merged)
                if owed:
                    self.residuals.carry(fragment, owed)

        handles.FragmentIO.settle = settle
    elif ef != "engine":
        raise SystemExit(f"unknown ef={ef}")
    who: dict[int, int] = {}
    orig_quantized = handles._HostContribution.quantized

    def quantized(self, dtypes):
        first = not hasattr(self, "_seen")
        before = None
        if first and self.fed is not None:
            before = self.fed.residuals.of(self.fed.fragment)
        out = orig_quantized(self, dtypes)
        if first:
            self._seen = True
            d = flat(self.delta if self.delta is not None else self._delta())
            x = d if before is None else d + flat(before)
            sent = flat({n: quant.dequantize(q) for n, q in out.items()})
            slot = getattr(self, "_slot", None)
            if slot is not None:
                rec.delta(*slot, d.astype(np.float32), x.astype(np.float32), sent.astype(np.float32))
        return out

    handles._HostContribution.quantized = quantized
    for name in ("capture", "consume"):
        orig = getattr(handles.FragmentIO, name)

        def wrapped(self, names, anchor, *a, _orig=orig, **kw):
            c = _orig(self, names, anchor, *a, **kw)
            slot = kw.get("slot")
            if slot is not None:
                c._slot = (who.setdefault(id(self), len(who)), slot[1], slot[0])
            return c

        setattr(handles.FragmentIO, name, wrapped)
    g_commit = float(commit.split(":")[1]) if commit.startswith("decay:") else 1.0
    proj = variant.get("proj")  # None, "tensor" or a block size
    gaps: dict[str, np.ndarray] = {}  # each tensor's master - theta after the newest commit
    orig_commit = FragmentMerger.commit

    def commit_fn(self, op, put):
        made = orig_commit(self, op, put)
        st = self.pending[op.f]
        if self.run.cfg.commit_dtype is not None and g_commit != 1.0:
            for n in st.master:
                gap = np.subtract(st.master[n], st.theta[n], dtype=np.float32)
                st.master[n][...] = st.theta[n] + np.float32(g_commit) * gap
        if proj is not None and self.run.cfg.commit_dtype is not None:
            for n in st.master:
                gaps[n] = np.subtract(st.master[n], st.theta[n], dtype=np.float32).reshape(-1)
        rec.commit(op.round, flat(st.master).astype(np.float32), flat(st.theta).astype(np.float32))
        return made

    FragmentMerger.commit = commit_fn
    if proj is not None:
        # The part of the merged delta that pulls the learners back toward the master (its
        # projection on the newest commit's gap, where negative: the learners recovering the
        # rounding) is taken out before the outer step, which would apply it a second time. Per
        # tensor, or per block of ``proj`` elements; the rest of the gap stays in the master.
        from gradientmail_core.syncer import passes

        block = 0 if proj == "tensor" else int(proj)
        orig_outer = passes.outer_mod.outer_step_tensor

        def projected(theta, momentum, delta, *, lr, beta, scale=None, out=None, name=""):
            g = gaps.get(name)
            if g is None:
                return orig_outer(theta, momentum, delta, lr=lr, beta=beta, scale=scale, out=out, name=name)
            assert g.size == np.size(theta), (name, g.size, np.size(theta))  # whole tensors, one piece
            d = np.array(delta, np.float32).reshape(-1)  # a copy: ``delta`` may be ``out``'s memory
            if scale is not None:
                d *= scale
            starts = np.arange(0, d.size, block or d.size)
            dots = np.add.reduceat((d * g).astype(np.float64), starts)
            sq = np.add.reduceat((g * g).astype(np.float64), starts)
            c = np.clip(np.divide(dots, sq, out=np.zeros_like(dots), where=sq > 0), -1.0, 0.0)
            d -= np.repeat(c, np.diff(np.append(starts, d.size))).astype(np.float32) * g
            rec.out["proj_c"].append(float(np.mean(c)))
            return orig_outer(theta, momentum, d.reshape(np.shape(delta)), lr=lr, beta=beta, out=out, name=name)

        passes.outer_mod.outer_step_tensor = projected
    if commit.startswith("grad"):
        # The closer quantizes the merged outer gradient (I2, with its own residual unless
        # ``grad-noef``) and every node takes the same fp32 outer step from it: what the learners
        # train from is the master itself. Run on an arm without commit_dtype (``job``).
        from gradientmail_core.syncer import passes

        orig_step = passes.outer_mod.outer_step_tensor
        held: dict[str, np.ndarray] = {}

        def step(theta, momentum, delta, *, lr, beta, scale=None, out=None, name=""):
            d = np.asarray(delta, np.float32)
            if scale is not None:
                d = np.multiply(d, scale, dtype=np.float32)
            x = d if commit == "grad-noef" or name not in held else np.add(d, held[name], dtype=np.float32)
            q = quant.dequantize(quant.quantize(x, "I2"))
            held[name] = np.subtract(x, q, dtype=np.float32)
            return orig_step(theta, momentum, q, lr=lr, beta=beta, out=out, name=name)

        passes.outer_mod.outer_step_tensor = step


def job(arm: str, seed: int, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    cfgs = {name: (cfg, units) for name, cfg, units in arm_configs(args)}
    cfg, units = cfgs[arm]
    rec = Recorder(cfg.fragments)
    spec = dict(kv.split("=", 1) for kv in variant.split(",") if kv)
    if spec.get("commit", "").startswith("grad"):
        cfg = replace(cfg, commit_dtype=None, checkpoint_every=1)
    if "cd" in spec:  # another commit dtype
        cfg = replace(cfg, commit_dtype=spec["cd"])
    patch(spec, rec)
    data = _DATA.get(0) or _DATA.setdefault(0, Data(args.heldout_batches))
    start = time.perf_counter()
    curve = cluster(arm, cfg, data, args, step_units=units, until=args.steps, seed=seed)
    return dict(
        arm=arm,
        seed=seed,
        variant=variant,
        steps=args.steps,
        final=curve.final(),
        wall_s=round(time.perf_counter() - start, 1),
        diag=rec.summary(),
        curve=[curve.steps, curve.losses],
    )


def linear_model(lr: float = 0.7, beta: float = 0.9, rounds: int = 200_000) -> None:
    """The outer loop on one direction of a quadratic loss, where the inner steps take the offset
    from the optimum ``y`` to ``rho * y`` (``rho`` 0: stiff, the inner steps reach the optimum
    from any start; 1: flat, they do not move it), and quantization takes a white residual ``r``
    (variance 1) out of each merged delta. The steady offset variance, per unit of residual:
    no feedback (``d - r_t``), the residual added to the next delta (``d + r_{t-1} - r_t``), and
    given back to the parameters (the next delta holds ``rho * r_{t-1}``)."""
    rng = np.random.default_rng(0)
    rhos = np.array([0.0, 0.3, 0.6, 0.8, 0.9, 0.95, 0.99])
    print("inner contraction rho         " + " ".join(f"{v:7.2f}" for v in rhos))
    for name, gamma in (("no feedback", 0 * rhos), ("added to the next delta", 1 + 0 * rhos), ("given back", rhos)):
        y, m, before, acc = (np.zeros_like(rhos) for _ in range(4))
        for t in range(rounds):
            r = rng.standard_normal(rhos.size)
            d = (1 - rhos) * y + gamma * before - r
            m = beta * m + d
            y = y - lr * (d + beta * m)
            before = r
            if t >= 1000:
                acc += y * y
        print(f"{name:>29} " + " ".join(f"{v:7.2f}" for v in acc / (rounds - 1000)))


def summarize(path: str) -> None:
    """Each (arm, variant) of a log: its held-out loss over its set's F32 arm, seed by seed (mean
    [min, max]), and the mean of each diagnostic over seeds."""
    rows = [json.loads(line) for line in open(path)]
    f32 = {(r["arm"].split("-")[0], r["seed"], r["steps"]): r["final"] for r in rows if r["arm"].endswith("-F32")}
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["arm"], r["variant"], r["steps"])].append(r)
    print(f"{'arm':>20} {'variant':>28} | seeds | / F32 mean [min, max] | diagnostics (mean over seeds)")
    for (arm, variant, steps), rs in sorted(groups.items()):
        ratios = [r["final"] / f32[k] for r in rs if (k := (arm.split("-")[0], r["seed"], steps)) in f32]
        diag: dict[str, list[float]] = defaultdict(list)
        for r in rs:
            for k, (mean, _, _) in r["diag"].items():
                diag[k].append(mean)
        cell = "-" if not ratios else f"{statistics.fmean(ratios):.4f} [{min(ratios):.4f}, {max(ratios):.4f}]"
        d = " ".join(f"{k}={statistics.fmean(v):.3f}" for k, v in sorted(diag.items()))
        print(f"{arm:>20} {variant or '(engine)':>28} | {len(rs):>5} | {cell:>22} | {d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="*", default=[], help="convergence.py's arm names, or 'arm@variant'")
    ap.add_argument("--linear", action="store_true", help="print the linear model's table (no training)")
    ap.add_argument("--summarize", metavar="LOG", help="print the table of a log (no training)")
    ap.add_argument("--variant", nargs="+", default=[""], help="variants, each 'key=value,...' ('' = the engine)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--log", default="ef_study.jsonl")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    args = ap.parse_args()
    if args.linear:
        linear_model()
        return
    if args.summarize:
        summarize(args.summarize)
        return
    args.batch, args.schedule, args.warmup, args.min_lr = 8, "cosine", max(1, args.steps // 20), 0.1
    args.heldout_batches, args.outer_lr, args.outer_momentum = 8, 0.7, 0.9
    assert FRONTIER
    # ``arm@variant`` runs that variant only; a plain arm runs every ``--variant``
    pairs = [
        tuple(a.split("@", 1)) if "@" in a else (a, v) for a in args.arms for v in ([""] if "@" in a else args.variant)
    ]
    todo = [(a, s, v) for a, v in pairs for s in args.seeds]
    ctx = multiprocessing.get_context("spawn")
    # a fresh process per job: the patches of one variant never meet another's
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = [pool.submit(job, a, s, v, args) for a, s, v in todo]
        for fut in as_completed(futures):
            row = fut.result()
            with open(args.log, "a") as f:
                f.write(json.dumps(row) + "\n")
            diag = " ".join(f"{k}={m:.3f}/{med:.3f}" for k, (m, med, _) in sorted(row["diag"].items()))
            print(
                f"{row['arm']:>20} seed {row['seed']} [{row['variant']}]: {row['final']:.4f} ({row['wall_s']:.0f} s) {diag}",
                flush=True,
            )


if __name__ == "__main__":
    main()
