"""One gradientmail learner node with PyTorch, pointed at any mailbox URL.

It trains a small character-level language model on text that ships with Python (the
standard library's own source files), so several of these, on one machine or many, train
one model together. Start as many as you like, whenever you like:

    # a local directory (one machine)
    python examples/torch_learner.py --mailbox file:///tmp/gm-run --learner-id a &
    python examples/torch_learner.py --mailbox file:///tmp/gm-run --learner-id b &

    # an S3-compatible store. With moto's server on this machine:
    #   pip install "moto[server]" && moto_server -H 127.0.0.1 -p 5000 &
    #   AWS_ACCESS_KEY_ID=x AWS_SECRET_ACCESS_KEY=x AWS_DEFAULT_REGION=us-east-1 \
    #     python -c "import boto3; boto3.client('s3', endpoint_url='http://127.0.0.1:5000').create_bucket(Bucket='gm')"
    python examples/torch_learner.py --mailbox s3://gm/runs/run-1 --endpoint-url http://127.0.0.1:5000

    # MinIO (current releases honour If-None-Match):
    #   minio server /tmp/minio &   (user/password minioadmin; create bucket "gm" with `mc mb`)
    #   AWS_ACCESS_KEY_ID=minioadmin AWS_SECRET_ACCESS_KEY=minioadmin python examples/torch_learner.py \
    #     --mailbox s3://gm/runs/run-1 --endpoint-url http://127.0.0.1:9000

An MLX node on a Mac joins the same run with ``examples/mlx_learner.py`` and the same URL.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import learner_flags
import numpy as np
import torch
from torch import nn

import gradientmail_core as gm

VOCAB = 96  # printable ASCII (32..126) plus one "other" symbol
CONTEXT = 8


def corpus(limit: int = 400_000) -> np.ndarray:
    """Characters of a few standard-library modules, mapped to 0..95."""
    root = Path(os.__file__).parent
    text = "".join(
        (root / name).read_text(encoding="utf-8", errors="replace")
        for name in ("os.py", "argparse.py", "dataclasses.py", "functools.py", "pathlib.py", "typing.py")
    )[:limit]
    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8).astype(np.int64) - 32
    return np.where((codes >= 0) & (codes < VOCAB - 1), codes, VOCAB - 1)


class CharMLP(nn.Module):
    """Embed the last CONTEXT characters, two dense layers, predict the next one."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16 * CONTEXT, width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.embed(x).flatten(1))))


def batches(data: np.ndarray, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    idx = np.arange(CONTEXT)
    while True:
        starts = rng.integers(0, len(data) - CONTEXT - 1, size=batch)
        window = data[starts[:, None] + idx]
        yield torch.from_numpy(window), torch.from_numpy(data[starts + CONTEXT])


def evaluate(model: nn.Module, data: np.ndarray) -> float:
    x, y = next(batches(data, 2048, seed=12345))
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y))


def main(argv: list[str] | None = None) -> int:
    args = learner_flags.parse(__doc__, argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = CharMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = corpus()
    split = int(len(data) * 0.9)
    train, held_out = data[:split], data[split:]
    kwargs = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    mailbox = gm.open_mailbox(args.mailbox, **kwargs)
    algorithm = gm.DiLoCo(
        sync_every=args.sync_every,
        fragments=args.fragments,
        quorum_size=args.quorum,
        overlap_steps=args.overlap_steps,
        delta_dtype=args.delta_dtype,
        commit_dtype=args.commit_dtype,
        max_contributions=args.max_contributions,
    )
    callbacks: list = [gm.log_events]
    if args.events:
        sink = open(args.events, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

        def to_file(e: gm.events.Event) -> None:
            sink.write(
                json.dumps({"event": type(e).__name__, **{k: v for k, v in vars(e).items()}}, default=str) + "\n"
            )

        callbacks.append(to_file)
    seed = args.data_seed if args.data_seed is not None else abs(hash(args.learner_id or os.getpid())) % 2**31
    losses = []
    with gm.Session(
        model,
        algorithm=algorithm,
        mailbox=mailbox,
        learner_id=args.learner_id,
        poll_interval=args.poll_interval,
        lease_timeout=args.lease_timeout,
        round_timeout=args.round_timeout,
        close_timeout=args.close_timeout,
        compression=args.compression,
        callbacks=callbacks,
    ) as session:
        first = evaluate(model, held_out)
        if args.wait_for > 1:
            session.wait_for(learners=args.wait_for, timeout=120)
        t0 = time.perf_counter()
        for step, (x, y) in zip(range(args.steps), batches(train, args.batch, seed)):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            session.step(samples=len(x))
            losses.append(float(loss))
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.verbose and step % 50 == 0:
                p = session.progress
                print(f"step {step:5d} loss {loss.item():.3f} round {p.round} live {p.live_learners}", flush=True)
        elapsed = time.perf_counter() - t0
    final = evaluate(model, held_out)
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
        np.savez(args.out + ".npz", **{n: p.detach().numpy() for n, p in model.named_parameters()})
        Path(args.out + ".json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
