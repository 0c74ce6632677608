"""Bytes on the wire per learner per optimizer step, against synchronous data parallel.

Drives N learners single-threaded over one in-memory mailbox with a fake clock, each behind its
own ``gm.CountingMailbox``, so every figure is an exact byte count (no timing). Everything a
node moves is counted: payloads, records, leases, claims. The model is a dict of float32 arrays
whose "training" adds seeded noise, so deltas look like real ones to the quantizers and zstd.

Reference: a ring all-reduce of fp32 gradients sends and receives about twice the model's fp32
bytes per worker per step (``2 (n-1)/n * 4 B * params`` each way). Ratios are like for like:
uploads against what data parallel sends, downloads against what it receives.

The node that commits a round claims the next, so one learner (the *closer*) merges every round:
it also downloads every snapshot and uploads the new parameters, the outer state and the change.
The table shows it, a *follower*, and the mean over the learners.

    python bench/traffic.py                       # sync_every=100, 4 learners, 2M params
    python bench/traffic.py --params 8e6 --nodes 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _cluster  # noqa: E402

import gradientmail_core as gm  # noqa: E402


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
) -> dict:
    cfg = gm.DiLoCo(sync_every=H, fragments=fragments, quorum_size=n_nodes, delta_dtype=delta, commit_dtype=commit)
    shared, clock = gm.MemoryMailbox(), gm.FakeClock()
    members = []
    for i in range(n_nodes):
        model = make_model(n_params, seed=0)  # the run's init is the first node's; the rest load it
        members.append(
            _cluster.join(f"n{i}", model, cfg=cfg, mailbox=shared, clock=clock, compression=compression, seed=i)
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

    run(H)  # warm-up cycle: every fragment committed once, estimates seeded
    for m in members:
        m.counting.reset()
    head0 = members[0].node.head
    steps = cycles * H
    run(steps)
    for _ in range(10):  # let the last rounds commit (no training: counted bytes only grow)
        for m in members:
            m.tick()
        clock.advance(1.0)
    rounds = members[0].node.head - head0
    closer = max(members, key=lambda m: m.node.stats.committed)
    followers = [m for m in members if m is not closer]
    model_bytes = 4 * sum(p.size for p in members[0].model.values())
    dp = 2 * (n_nodes - 1) / n_nodes * model_bytes  # per worker per step, each direction

    def per_step(ms: list, attr: str) -> float:
        return sum(getattr(m.counting, attr) for m in ms) / len(ms) / steps

    return {
        "model_bytes": model_bytes,
        "rounds": rounds,
        "dp": dp,
        "closer_up": per_step([closer], "bytes_up"),
        "closer_down": per_step([closer], "bytes_down"),
        "follower_up": per_step(followers, "bytes_up"),
        "follower_down": per_step(followers, "bytes_down"),
        "mean_up": per_step(members, "bytes_up"),
        "mean_down": per_step(members, "bytes_down"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=2e6)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=100)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=2, help="sync_every-step cycles measured")
    ap.add_argument("--delta", nargs="*", default=["F32", "BF16", "F8_E4M3", "F4"])
    args = ap.parse_args()
    n_params = int(args.params)
    print(
        f"bytes per learner per optimizer step, {args.nodes} learners, ~{n_params / 1e6:.1f}M params, "
        f"sync_every={args.sync_every}, fragments={args.fragments}; ratio = data parallel / this "
        "(ring all-reduce, fp32, each direction)"
    )
    head = (
        f"{'delta':>8} {'commit':>8} {'zstd':>4} | {'up B/step':>10} {'down B/step':>11} | "
        f"{'DP/up':>7} {'DP/down':>7} {'DP/total':>8} | {'follower DP/tot':>15} | {'closer DP/tot':>13}"
    )
    print(head)
    print("-" * len(head))
    for delta in args.delta:
        for commit in (None, delta):
            for compression in ("", "zstd"):
                r = measure(
                    n_params=n_params,
                    n_nodes=args.nodes,
                    H=args.sync_every,
                    fragments=args.fragments,
                    delta=delta,
                    commit=commit,
                    compression=compression,
                    cycles=args.cycles,
                )
                dp = r["dp"]
                tot = r["mean_up"] + r["mean_down"]
                ftot = r["follower_up"] + r["follower_down"]
                ctot = r["closer_up"] + r["closer_down"]
                print(
                    f"{delta:>8} {commit or '-':>8} {'yes' if compression else 'no':>4} | "
                    f"{r['mean_up']:>10,.0f} {r['mean_down']:>11,.0f} | "
                    f"{dp / r['mean_up']:>6.0f}x {dp / r['mean_down']:>6.0f}x {2 * dp / tot:>7.0f}x | "
                    f"{2 * dp / ftot:>14.0f}x | {2 * dp / ctot:>12.0f}x",
                    flush=True,
                )
    print(f"data parallel: {r['dp']:,.0f} B per worker per step each way (model {r['model_bytes']:,} B fp32)")


if __name__ == "__main__":
    main()
