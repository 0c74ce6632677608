"""One gradientmail learner node with JAX (Flax NNX + optax), pointed at any mailbox URL.

``examples/torch_learner.py`` in Flax NNX: the same character-level model, data and flags. The
layers carry the torch model's names (``embed``, ``hidden``, ``out``) and ``layouts="torch"``
shows them in torch's names and axis order (kernels transposed, ``embedding`` as ``weight``),
so this node joins a run of torch and MLX nodes:

    pip install 'gradientmail[jax]'
    python examples/torch_learner.py --mailbox file:///tmp/gm-run --learner-id linux-1 &
    python examples/jax_learner.py   --mailbox file:///tmp/gm-run --learner-id jax-1
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

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

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


def windows(data: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - CONTEXT - 1, size=n)
    return data[starts[:, None] + np.arange(CONTEXT)].astype(np.int32), data[starts + CONTEXT].astype(np.int32)


def algorithm(args: argparse.Namespace) -> gm.DiLoCo:
    # Built exactly as torch_learner.py builds it: the run's config must match on every node.
    return gm.DiLoCo(
        sync_every=args.sync_every,
        fragments=args.fragments,
        quorum_size=args.quorum,
        overlap_steps=args.overlap_steps,
        delta_dtype=args.delta_dtype,
        commit_dtype=args.commit_dtype,
        max_contributions=args.max_contributions,
    )


class CharMLP(nnx.Module):
    """Embed the last CONTEXT characters, two dense layers, predict the next one."""

    def __init__(self, rngs: nnx.Rngs, width: int = 64) -> None:
        self.embed = nnx.Embed(VOCAB, 16, rngs=rngs)
        self.hidden = nnx.Linear(16 * CONTEXT, width, rngs=rngs)
        self.out = nnx.Linear(width, VOCAB, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(self.embed(x).reshape(x.shape[0], -1))))


def loss_fn(model: CharMLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def train_step(model: CharMLP, opt: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    opt.update(model, grads)
    return loss


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
    p.add_argument(
        "--max-contributions", type=int, default=None, help="each round merges at most this many, drawn by hash"
    )
    p.add_argument("--delta-dtype", default=None)
    p.add_argument("--commit-dtype", default=None)
    p.add_argument("--compression", default="off")
    p.add_argument("--poll-interval", type=float, default=0.5)
    p.add_argument("--lease-timeout", type=float, default=30.0)
    p.add_argument("--round-timeout", type=float, default=None)
    p.add_argument(
        "--close-timeout", type=float, default=None, help="how long leaving waits for a round to commit (seconds)"
    )
    p.add_argument("--wait-for", type=int, default=1, help="learners to wait for before training")
    p.add_argument("--seed", type=int, default=0, help="model init seed (the run's creator decides)")
    p.add_argument("--data-seed", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (a slower machine)")
    p.add_argument("--out", default=None, help="write final parameters (.npz) and a .json summary here")
    p.add_argument("--events", default=None, help="append one JSON line per event to this file")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    model = CharMLP(nnx.Rngs(args.seed))
    opt = nnx.Optimizer(model, optax.adamw(args.lr, weight_decay=0.01), wrt=nnx.Param)  # torch's AdamW
    data = corpus()
    split = int(len(data) * 0.9)
    train, held_out = data[:split], data[split:]
    held = tuple(jnp.asarray(a) for a in windows(held_out, 2048, seed=12345))
    kwargs = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    name = args.learner_id or str(os.getpid())
    seed = args.data_seed if args.data_seed is not None else zlib.crc32(name.encode())
    xs, ys = windows(train, args.steps * args.batch, seed)
    losses: list[float] = []
    with gm.Session(
        model,
        algorithm=algorithm(args),
        mailbox=gm.open_mailbox(args.mailbox, **kwargs),
        learner_id=args.learner_id,
        poll_interval=args.poll_interval,
        lease_timeout=args.lease_timeout,
        round_timeout=args.round_timeout,
        close_timeout=args.close_timeout,
        compression=args.compression,
        layouts="torch",  # the torch nodes' names and axis order
    ) as session:
        first = float(loss_fn(model, *held))
        if args.wait_for > 1:
            session.wait_for(learners=args.wait_for, timeout=120)
        t0 = time.perf_counter()
        for step in range(args.steps):
            b = slice(step * args.batch, (step + 1) * args.batch)
            loss = train_step(model, opt, jnp.asarray(xs[b]), jnp.asarray(ys[b]))
            session.step(samples=args.batch)
            losses.append(float(loss))
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.verbose and step % 50 == 0:
                p = session.progress
                print(f"step {step:5d} loss {losses[-1]:.3f} round {p.round} live {p.live_learners}", flush=True)
        elapsed = time.perf_counter() - t0
    final = float(loss_fn(model, *held))
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
        adapter = gm.adapters.adapter_for(model, layouts="torch")  # the run's names and layout
        np.savez(args.out + ".npz", **adapter.read([s.name for s in adapter.schema()]))
        Path(args.out + ".json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
