"""Step overhead: the same training loop with and without a gm.Session, in one run.

Runs alternating blocks of steps (plain, session, plain, session, ...) so drift in the
machine's speed hits both arms equally, and prints the ratio of median step times. The
session trains against a FileMailbox in a temp dir as a lone learner, so the same process
also closes every round (merge + outer step + payload writes on the background thread):
the worst case for the training thread.

    python bench/overhead.py                 # ~20 ms and ~200 ms steps
    python bench/overhead.py --target-ms 20 --blocks 6
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import gradientmail_core as gm


def make(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 256),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt, x) -> None:
    loss = model(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def calibrate(target_ms: float, batch: int) -> int:
    x = torch.randn(batch, 256)
    width = 256
    while True:
        model, opt = make(width)
        for _ in range(3):
            step(model, opt, x)
        t0 = time.perf_counter()
        for _ in range(5):
            step(model, opt, x)
        ms = (time.perf_counter() - t0) / 5 * 1000
        if ms >= target_ms or width >= 8192:
            return width
        width = int(width * max(1.2, min(2.0, (target_ms / ms) ** 0.5)))


def measure(target_ms: float, blocks: int, steps: int, sync_every: int) -> dict:
    torch.set_num_threads(1)  # leave the other core to the background thread, as on a real node
    batch = 64
    width = calibrate(target_ms, batch)
    x = torch.randn(batch, 256)
    plain_model, plain_opt = make(width)
    model, opt = make(width)
    n_params = sum(p.numel() for p in model.parameters())
    times: dict[str, list[float]] = {"plain": [], "session": []}
    with tempfile.TemporaryDirectory() as d:
        cfg = gm.DiLoCo(sync_every=sync_every, fragments=4)
        with gm.Session(
            model, algorithm=cfg, mailbox=gm.FileMailbox(d), learner_id="bench", poll_interval=0.2, callbacks=()
        ) as session:
            for _ in range(blocks):
                for arm in ("plain", "session"):
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        if arm == "plain":
                            step(plain_model, plain_opt, x)
                        else:
                            step(model, opt, x)
                            session.step(samples=batch)
                        times[arm].append(time.perf_counter() - t0)
            rounds = session.rounds_seen
    plain, with_session = statistics.median(times["plain"]), statistics.median(times["session"])
    mean_ratio = statistics.fmean(times["session"]) / statistics.fmean(times["plain"])
    return {
        "width": width,
        "params": n_params,
        "plain_ms": plain * 1000,
        "session_ms": with_session * 1000,
        "median_ratio": with_session / plain,
        "mean_ratio": mean_ratio,
        "rounds": rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-ms", type=float, nargs="*", default=[20.0, 200.0])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=0, help="steps per block (default: about 2 s of work)")
    ap.add_argument("--sync-every", type=int, default=40)
    args = ap.parse_args()
    print("step time with vs without gm.Session (lone learner that also closes every round)")
    print(
        f"{'target':>7} | {'params':>9} | {'plain ms':>9} | {'session ms':>10} | {'median':>7} | {'mean':>7} | rounds"
    )
    for target in args.target_ms:
        steps = args.steps or max(10, int(2000 / target))
        r = measure(target, args.blocks, steps, args.sync_every)
        print(
            f"{target:>5.0f}ms | {r['params']:>9,} | {r['plain_ms']:>9.2f} | {r['session_ms']:>10.2f} | "
            f"{r['median_ratio']:>7.3f} | {r['mean_ratio']:>7.3f} | {r['rounds']}"
        )


if __name__ == "__main__":
    main()
