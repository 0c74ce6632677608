"""Bytes on the wire per optimizer step, against synchronous data parallel: per node, the worst
node, and the whole run (every node's bytes together).

Drives N learners single-threaded over one in-memory mailbox with a fake clock, each behind its
own ``gm.CountingMailbox``, so every figure is an exact byte count (no timing). Everything a
node moves is counted: payloads, records, leases, claims. The model is a dict of float32 arrays
whose "training" adds seeded noise, so deltas look like real ones to the quantizers and zstd.

Reference: a ring all-reduce of fp32 gradients sends and receives about twice the model's fp32
bytes per worker per step (``2 (n-1)/n * 4 B * params`` each way). Ratios are like for like:
uploads against what data parallel sends, downloads against what it receives; a node's total
against ``2 x`` that; the whole run's total against ``n x 2 x`` that (every worker's bytes).

The node that commits a round claims the next, so one learner (the *closer*) merges every round:
it also downloads every snapshot and uploads the change and, at checkpoints, the new parameters
and the outer state. It is the worst node. ``--breakdown`` prints where its bytes go (per kind:
the other deltas down, its own delta up, the change up and down, checkpoints, records and leases).

    python bench/traffic.py                                  # the dtype table, sync_every=100, 4 learners
    python bench/traffic.py --goal                           # I2 deltas and commits, error feedback, checkpoint_every=10
    python bench/traffic.py --delta I2 F4 --commit same --error-feedback --checkpoint-every 10 --breakdown
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _cluster  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.mailbox.forwarding import ForwardingMailbox  # noqa: E402

KINDS = ("delta", "change", "checkpoint", "init", "records")


def kind_of(key: str) -> str:
    """What a stored object is, for the breakdown (keys as ``protocol/keys.py`` lays them out)."""
    if key.startswith("blobs/snapshots/"):
        return "delta"
    if key.startswith("blobs/rounds/"):
        return "change" if key.rsplit("/", 1)[-1].startswith("change-") else "checkpoint"
    if key.startswith("blobs/init/"):
        return "init"
    return "records"  # round and snapshot records, claims, leases, the manifest


class KindCounter(ForwardingMailbox):
    """Bytes up and down per kind of object (``kind_of``), beside the ``CountingMailbox`` totals."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.up: dict[str, int] = defaultdict(int)
        self.down: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.up.clear()
        self.down.clear()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.up[kind_of(key)] += len(data)
        return super().put_if_absent(key, data)

    def get(self, key: str) -> bytes | None:
        data = super().get(key)
        self.down[kind_of(key)] += len(data or b"")
        return data

    def get_prefix(self, key: str, n: int) -> bytes | None:
        data = super().get_prefix(key, n)
        self.down[kind_of(key)] += len(data or b"")
        return data

    def put_stream(self, key: str, chunks: Iterable, *, create_once: bool = False) -> bool:
        return super().put_stream(key, self._passing(chunks, self.up, key), create_once=create_once)

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator | None:
        stream = super().get_stream(key, part_size=part_size)
        return None if stream is None else self._passing(stream, self.down, key)

    def _passing(self, chunks: Iterable, into: dict[str, int], key: str) -> Iterator:
        for chunk in chunks:
            into[kind_of(key)] += memoryview(chunk).nbytes
            yield chunk


def make_model(n_params: int, seed: int) -> dict[str, np.ndarray]:
    """A transformer-ish set of tensors: a few matrices and some vectors, about n_params."""
    rng = np.random.default_rng(seed)
    width = 512
    rows = max(1, n_params // (8 * width))
    shapes = [(rows, width)] * 8 + [(width,)] * 8
    return {f"blocks.{i}.w": (0.02 * rng.standard_normal(s)).astype(np.float32) for i, s in enumerate(shapes)}


def measure(
    *,
    n_params: int,
    n_nodes: int,
    H: int,
    fragments: int,
    delta: str,
    commit: str | None,
    compression: str,
    cycles: int,
    error_feedback: bool = False,
    checkpoint_every: int = 1,
    gap_projection: bool = False,
) -> dict:
    extra: dict = {"checkpoint_every": checkpoint_every} if checkpoint_every != 1 else {}
    if gap_projection and commit is not None:
        extra["gap_projection"] = True
    cfg = gm.DiLoCo(
        sync_every=H,
        fragments=fragments,
        quorum_size=n_nodes,
        delta_dtype=delta,
        commit_dtype=commit,
        error_feedback=error_feedback,
        **extra,
    )
    shared, clock = gm.MemoryMailbox(), gm.FakeClock()
    members, kinds = [], []
    for i in range(n_nodes):
        model = make_model(n_params, seed=0)  # the run's init is the first node's; the rest load it
        kinds.append(KindCounter(shared))
        members.append(
            _cluster.join(f"n{i}", model, cfg=cfg, mailbox=kinds[-1], clock=clock, compression=compression, seed=i)
        )
    _cluster.see_each_other(members)
    # Per-learner noise directions, reused cyclically: cheap, and deltas of a realistic shape.
    noise = []
    for i, m in enumerate(members):
        rng = np.random.default_rng(100 + i)
        noise.append(
            [
                {n: (1e-4 * rng.standard_normal(p.shape)).astype(np.float32) for n, p in m.model.items()}
                for _ in range(4)
            ]
        )

    def run(steps: int) -> None:
        for s in range(steps):
            for i, m in enumerate(members):
                for n, p in m.model.items():
                    p -= noise[i][s % 4][n]
                m.step(64)
            for m in members:
                m.tick()
            clock.advance(1.0)

    def settle() -> None:  # let the rounds due so far commit (no training: counted bytes only grow)
        for _ in range(10):
            for m in members:
                m.tick()
            clock.advance(1.0)

    run(H)  # warm-up cycle: every fragment committed once, estimates seeded
    settle()  # so the window holds exactly the rounds of its own steps (cycles x fragments)
    for m, k in zip(members, kinds, strict=True):
        m.counting.reset()
        k.reset()
    head0 = members[0].node.state.head
    steps = cycles * H
    run(steps)
    settle()
    rounds = members[0].node.state.head - head0
    model_bytes = 4 * sum(p.size for p in members[0].model.values())
    dp = 2 * (n_nodes - 1) / n_nodes * model_bytes  # per worker per step, each direction
    nodes = [
        {
            "name": m.name,
            "committed": m.node.state.stats.committed,
            "up": m.counting.bytes_up / steps,
            "down": m.counting.bytes_down / steps,
            "up_kinds": {kd: v / steps for kd, v in k.up.items()},
            "down_kinds": {kd: v / steps for kd, v in k.down.items()},
        }
        for m, k in zip(members, kinds, strict=True)
    ]
    closer = max(nodes, key=lambda n: n["committed"])
    followers = [n for n in nodes if n is not closer]
    worst = max(nodes, key=lambda n: n["up"] + n["down"])

    def mean(ns: list, attr: str) -> float:
        return sum(n[attr] for n in ns) / len(ns)

    return {
        "model_bytes": model_bytes,
        "params": model_bytes // 4,
        "rounds": rounds,
        "steps": steps,
        "dp": dp,
        "nodes": nodes,
        "worst": worst,
        "closer_up": closer["up"],
        "closer_down": closer["down"],
        "follower_up": mean(followers, "up"),
        "follower_down": mean(followers, "down"),
        "mean_up": mean(nodes, "up"),
        "mean_down": mean(nodes, "down"),
        "run_total": sum(n["up"] + n["down"] for n in nodes),
    }


def ratios(r: dict) -> dict[str, float]:
    dp, n = r["dp"], len(r["nodes"])
    w = r["worst"]
    return {
        "up": dp / r["mean_up"],
        "down": dp / r["mean_down"],
        "follower": 2 * dp / (r["follower_up"] + r["follower_down"]),
        "closer": 2 * dp / (r["closer_up"] + r["closer_down"]),
        "worst": 2 * dp / (w["up"] + w["down"]),
        "run": n * 2 * dp / r["run_total"],
    }


def print_breakdown(r: dict) -> None:
    """Where the worst node's bytes go, per kind, in B/step and B/param per round of a fragment."""
    w, P = r["worst"], r["params"]
    per_round = r["steps"] / max(r["rounds"], 1)  # steps between two rounds (each round: one fragment)
    total = w["up"] + w["down"]
    print(f"  worst node {w['name']} (committed {w['committed']} rounds): {total:,.0f} B/step")
    for direction in ("up", "down"):
        for kd in KINDS:
            v = w[f"{direction}_kinds"].get(kd, 0.0)
            if v:
                print(
                    f"    {kd:>10} {direction:<4} {v:>10,.0f} B/step  {100 * v / total:5.1f}%  "
                    f"{v * per_round / P:.4f} B/param (of the model) per round"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=2e6)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=100)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument(
        "--cycles",
        type=int,
        default=None,
        help="sync_every-step cycles measured (default 2, or checkpoint_every: checkpoints amortized exactly)",
    )
    ap.add_argument("--delta", "--delta-dtype", nargs="*", default=["F32", "BF16", "F8_E4M3", "F4"])
    ap.add_argument(
        "--commit",
        "--commit-dtype",
        nargs="*",
        default=["none", "same"],
        help="commit dtypes to measure: none, same (the delta's) or a dtype",
    )
    ap.add_argument("--zstd", choices=("no", "yes", "both"), default="both")
    ap.add_argument("--error-feedback", action="store_true", help="DiLoCo(error_feedback=True)")
    ap.add_argument("--checkpoint-every", type=int, default=1, help="DiLoCo(checkpoint_every=k); needs a commit dtype")
    ap.add_argument("--breakdown", action="store_true", help="per-kind bytes of the worst node")
    ap.add_argument(
        "--goal",
        action="store_true",
        help="gm.DiLoCo.frontier: I2 deltas and commits, error feedback, checkpoint_every=10, gap_projection",
    )
    ap.add_argument("--gap-projection", action="store_true", help="DiLoCo(gap_projection=True); needs a commit dtype")
    args = ap.parse_args()
    if args.goal:
        args.delta, args.commit, args.error_feedback, args.checkpoint_every = ["I2"], ["same"], True, 10
        args.gap_projection = True
    n_params = int(args.params)
    if args.cycles is None:
        args.cycles = max(2, args.checkpoint_every)
    print(
        f"bytes per optimizer step, {args.nodes} learners, ~{n_params / 1e6:.1f}M params, "
        f"sync_every={args.sync_every}, fragments={args.fragments}, error_feedback={args.error_feedback}, "
        f"checkpoint_every={args.checkpoint_every}; ratio = data parallel / this (ring all-reduce, fp32)"
    )
    head = (
        f"{'delta':>8} {'commit':>8} {'zstd':>4} | {'up B/step':>10} {'down B/step':>11} | "
        f"{'DP/up':>7} {'DP/down':>7} | {'follower':>8} {'closer':>7} {'worst':>7} | {'whole run':>9}"
    )
    print(head)
    print("-" * len(head))
    zstd = {"no": [""], "yes": ["zstd"], "both": ["", "zstd"]}[args.zstd]
    r = None
    for delta in args.delta:
        for c in args.commit:
            commit = None if c == "none" else delta if c == "same" else c
            if commit is None and args.checkpoint_every != 1:
                continue  # checkpoint_every needs a commit dtype
            for compression in zstd:
                r = measure(
                    n_params=n_params,
                    n_nodes=args.nodes,
                    H=args.sync_every,
                    fragments=args.fragments,
                    delta=delta,
                    commit=commit,
                    compression=compression,
                    cycles=args.cycles,
                    error_feedback=args.error_feedback,
                    checkpoint_every=args.checkpoint_every,
                    gap_projection=args.gap_projection,
                )
                x = ratios(r)
                print(
                    f"{delta:>8} {commit or '-':>8} {'yes' if compression else 'no':>4} | "
                    f"{r['mean_up']:>10,.0f} {r['mean_down']:>11,.0f} | "
                    f"{x['up']:>6.0f}x {x['down']:>6.0f}x | "
                    f"{x['follower']:>7.0f}x {x['closer']:>6.0f}x {x['worst']:>6.0f}x | {x['run']:>8.0f}x",
                    flush=True,
                )
                if args.breakdown:
                    print_breakdown(r)
    if r is not None:
        print(f"data parallel: {r['dp']:,.0f} B per worker per step each way (model {r['model_bytes']:,} B fp32)")


if __name__ == "__main__":
    main()
