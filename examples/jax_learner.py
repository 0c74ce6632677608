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
import learner_flags
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


def main(argv: list[str] | None = None) -> int:
    args = learner_flags.parse(__doc__, argv)
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
