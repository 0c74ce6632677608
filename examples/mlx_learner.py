"""One gradientmail learner node with MLX, pointed at any mailbox URL. No PyTorch needed.

It is ``examples/torch_learner.py`` in MLX: the same character-level model (same parameter
names and shapes: ``embed.weight``, ``hidden.weight``, ``hidden.bias``, ``out.weight``,
``out.bias``), the same data and the same command-line flags, so a Mac on MLX and a Linux GPU box
on PyTorch train one model together. Give every node the same URL and the same run flags
(``--sync-every``, ``--fragments``, ``--quorum``, ...; a node whose config differs from the run's
is refused with ``gm.RunConfigMismatch``):

    pip install 'gradientmail[mlx]'                  # plain `mlx` on macOS, `mlx[cpu]` on Linux

    # one machine, a local directory: a torch node and an MLX node
    python examples/torch_learner.py --mailbox file:///tmp/gm-run --learner-id linux-1 &
    python examples/mlx_learner.py   --mailbox file:///tmp/gm-run --learner-id mac-1

    # two machines, one S3-compatible bucket both can reach (R2, MinIO, AWS S3, ...):
    #   on the Linux GPU box
    python examples/torch_learner.py --mailbox s3://my-bucket/runs/run-1 --endpoint-url https://... --learner-id linux-1
    #   on the Mac
    python examples/mlx_learner.py   --mailbox s3://my-bucket/runs/run-1 --endpoint-url https://... --learner-id mac-1

Credentials for S3 come from boto3's usual chain (environment, ~/.aws). Nodes may start and
stop whenever they like; the first one creates the run, later ones load its newest parameters.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import zlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import gradientmail_core as gm

VOCAB = 96  # printable ASCII (32..126) plus one "other" symbol
CONTEXT = 8


def corpus(limit: int = 400_000) -> np.ndarray:
    """Characters of a few standard-library modules, mapped to 0..95 (as torch_learner.py)."""
    root = Path(os.__file__).parent
    text = "".join(
        (root / name).read_text(encoding="utf-8", errors="replace")
        for name in ("os.py", "argparse.py", "dataclasses.py", "functools.py", "pathlib.py", "typing.py")
    )[:limit]
    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8).astype(np.int64) - 32
    return np.where((codes >= 0) & (codes < VOCAB - 1), codes, VOCAB - 1)


class CharMLP(nn.Module):
    """Embed the last CONTEXT characters, two dense layers, predict the next one.

    Attribute names are the torch model's, so the parameter names match; MLX's Linear and
    Embedding weights have torch's shapes ((out, in) and (vocab, dim)).
    """

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16 * CONTEXT, width)
        self.out = nn.Linear(width, VOCAB)

    def __call__(self, x: mx.array) -> mx.array:
        return self.out(nn.relu(self.hidden(self.embed(x).reshape(x.shape[0], -1))))


def loss_fn(model: CharMLP, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def batches(data: np.ndarray, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    idx = np.arange(CONTEXT)
    while True:
        starts = rng.integers(0, len(data) - CONTEXT - 1, size=batch)
        yield mx.array(data[starts[:, None] + idx]), mx.array(data[starts + CONTEXT])


def evaluate(model: CharMLP, data: np.ndarray) -> float:
    x, y = next(batches(data, 2048, seed=12345))
    return loss_fn(model, x, y).item()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mailbox", required=True, help="file:///path, s3://bucket/prefix or memory://name")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (R2, MinIO, moto)")
    p.add_argument("--learner-id", default=None)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--quorum", type=int, default=1)
    p.add_argument(
        "--overlap-steps",
        type=int,
        default=None,
        help="block once a round published this many steps ago has not committed",
    )
    p.add_argument("--delta-dtype", default=None)
    p.add_argument("--commit-dtype", default=None)
    p.add_argument("--compression", default="off")
    p.add_argument("--poll-interval", type=float, default=0.5)
    p.add_argument("--lease-timeout", type=float, default=30.0)
    p.add_argument("--round-timeout", type=float, default=None)
    p.add_argument("--wait-for", type=int, default=1, help="learners to wait for before training")
    p.add_argument("--seed", type=int, default=0, help="model init seed (the run's creator decides)")
    p.add_argument("--data-seed", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (a slower machine)")
    p.add_argument("--out", default=None, help="write final parameters (.npz) and a .json summary here")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    mx.random.seed(args.seed)
    model = CharMLP()
    opt = optim.AdamW(learning_rate=args.lr)  # weight_decay=0.01, as torch's AdamW
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    data = corpus()
    split = int(len(data) * 0.9)
    train, held_out = data[:split], data[split:]
    kwargs = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    mailbox = gm.open_mailbox(args.mailbox, **kwargs)
    # Built exactly as torch_learner.py builds it: the run's config must match on every node.
    algorithm = gm.DiLoCo(
        sync_every=args.sync_every,
        fragments=args.fragments,
        quorum_size=args.quorum,
        overlap_steps=args.overlap_steps,
        delta_dtype=args.delta_dtype,
        commit_dtype=args.commit_dtype,
    )
    name = args.learner_id or str(os.getpid())
    seed = args.data_seed if args.data_seed is not None else zlib.crc32(name.encode())
    losses: list[float] = []
    with gm.Session(
        model,
        algorithm=algorithm,
        mailbox=mailbox,
        learner_id=args.learner_id,
        poll_interval=args.poll_interval,
        lease_timeout=args.lease_timeout,
        round_timeout=args.round_timeout,
        compression=args.compression,
    ) as session:
        first = evaluate(model, held_out)
        if args.wait_for > 1:
            session.wait_for(learners=args.wait_for, timeout=120)
        t0 = time.perf_counter()
        for step, (x, y) in zip(range(args.steps), batches(train, args.batch, seed)):
            loss, grads = loss_and_grad(model, x, y)
            opt.update(model, grads)
            mx.eval(loss, model.parameters(), opt.state)  # MLX is lazy: train this step now
            session.step(samples=x.shape[0])
            losses.append(loss.item())
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.verbose and step % 50 == 0:
                p = session.progress
                print(f"step {step:5d} loss {losses[-1]:.3f} round {p.round} live {p.live_learners}", flush=True)
        elapsed = time.perf_counter() - t0
    final = evaluate(model, held_out)  # the session left the newest committed parameters in the model
    summary = {
        "learner": session.learner_id,
        "initial_loss": first,
        "final_loss": final,
        "train_loss_first": float(np.mean(losses[:10])) if losses else math.nan,
        "train_loss_last": float(np.mean(losses[-10:])) if losses else math.nan,
        "steps": len(losses),
        "seconds": elapsed,
        "rounds_seen": session.rounds_seen,
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        np.savez(args.out + ".npz", **{n: np.array(a) for n, a in tree_flatten(model.parameters())})
        Path(args.out + ".json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
