"""Several learners on one machine, no framework beyond torch.

Each learner is its own process (as it would be on separate machines) training a small
regression model on its own shard of a synthetic task; they meet only in a directory
mailbox. At the end every learner holds the same parameters, and the script compares the
loss with the initial one.

    python examples/synthetic.py --learners 3 --steps 200
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time

import numpy as np
import torch

import gradientmail_core as gm

DIM = 32


def task(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y = sin(x @ w) for a fixed teacher w; each learner sees its own inputs."""
    teacher = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(x @ teacher)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def learner(i: int, path: str, args: argparse.Namespace, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = task(seed=i, n=4096)
    x_eval, y_eval = task(seed=999, n=1024)
    cfg = gm.DiLoCo(
        sync_every=args.sync_every, fragments=2, overlap_steps=args.sync_every // 2, quorum_size=args.learners
    )
    with gm.Session(
        model,
        algorithm=cfg,
        mailbox=gm.FileMailbox(path),
        learner_id=f"learner-{i}",
        poll_interval=0.05,
        lease_timeout=10.0,
        callbacks=(),
    ) as session:
        session.wait_for(learners=args.learners, timeout=60)
        with torch.no_grad():
            first = torch.nn.functional.mse_loss(model(x_eval), y_eval).item()
        g = torch.Generator().manual_seed(100 + i)
        for _ in range(args.steps):
            idx = torch.randint(0, len(x), (64,), generator=g)
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            session.step(samples=64)
            time.sleep(args.step_sleep)
    with torch.no_grad():
        last = torch.nn.functional.mse_loss(model(x_eval), y_eval).item()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    results.put((i, first, last, session.rounds_seen, flat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--learners", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sync-every", type=int, default=20)
    ap.add_argument("--step-sleep", type=float, default=0.005, help="seconds per step, as if the model were bigger")
    ap.add_argument("--mailbox", default=None, help="directory to use (default: a temporary one)")
    args = ap.parse_args()
    path = args.mailbox or tempfile.mkdtemp(prefix="gm-synthetic-")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=learner, args=(i, path, args, results)) for i in range(args.learners)]
    for p in procs:
        p.start()
    rows = sorted(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    print(f"mailbox: {path}")
    for i, first, last, rounds, _ in rows:
        print(f"learner-{i}: held-out loss {first:.4f} -> {last:.4f} over {rounds} committed rounds")
    same = all(np.array_equal(rows[0][4], r[4]) for r in rows[1:])
    print("all learners hold identical parameters:", same)


if __name__ == "__main__":
    main()
