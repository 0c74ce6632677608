"""One gradientmail learner node with Keras 3 ``model.fit``, pointed at any mailbox URL.

``examples/torch_learner.py`` in Keras: the same character-level model, data and flags, trained
by ``model.fit`` with ``GradientMailKerasCallback``. Every layer is named as the torch model's
(``embed``, ``hidden``, ``out``), and ``layouts="torch"`` shows them in torch's names and axis
order, so this node joins a run of torch, MLX and JAX nodes. Any backend (``KERAS_BACKEND``:
jax, torch or tensorflow; jax here by default):

    pip install 'gradientmail[keras,jax]'
    python examples/torch_learner.py --mailbox file:///tmp/gm-run --learner-id linux-1 &
    python examples/keras_learner.py --mailbox file:///tmp/gm-run --learner-id keras-1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import zlib
from pathlib import Path

import learner_flags

os.environ.setdefault("KERAS_BACKEND", "jax")  # before the first import of keras

import keras  # noqa: E402
import numpy as np  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_lightning import GradientMailKerasCallback  # noqa: E402

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


def char_mlp(width: int = 64) -> keras.Model:
    """Embed the last CONTEXT characters, two dense layers, predict the next one."""
    return keras.Sequential(
        [
            keras.Input((CONTEXT,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 16, name="embed"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(width, activation="relu", name="hidden"),
            keras.layers.Dense(VOCAB, name="out"),
        ],
        name="char_mlp",
    )


def main(argv: list[str] | None = None) -> int:
    args = learner_flags.parse(__doc__, argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    keras.utils.set_random_seed(args.seed)
    model = char_mlp()
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=args.lr, weight_decay=0.01),  # torch's AdamW
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    data = corpus()
    split = int(len(data) * 0.9)
    train, held_out = data[:split], data[split:]
    held = windows(held_out, 2048, seed=12345)
    name = args.learner_id or str(os.getpid())
    seed = args.data_seed if args.data_seed is not None else zlib.crc32(name.encode())
    xs, ys = windows(train, args.steps * args.batch, seed)
    kwargs = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    callback = GradientMailKerasCallback(
        algorithm=algorithm(args),
        mailbox=gm.open_mailbox(args.mailbox, **kwargs),
        samples_per_batch=args.batch,
        layouts="torch",  # the torch nodes' names and axis order
        learner_id=args.learner_id,
        poll_interval=args.poll_interval,
        lease_timeout=args.lease_timeout,
        round_timeout=args.round_timeout,
        close_timeout=args.close_timeout,
        compression=args.compression,
        wait_for_learners=args.wait_for if args.wait_for > 1 else None,
        wait_timeout=120,
    )
    first = float(model.evaluate(*held, batch_size=len(held[0]), verbose=0))
    t0 = time.perf_counter()
    history = model.fit(xs, ys, batch_size=args.batch, epochs=1, shuffle=False, callbacks=[callback],
                        verbose=2 if args.verbose else 0)  # fmt: skip
    elapsed = time.perf_counter() - t0
    final = float(model.evaluate(*held, batch_size=len(held[0]), verbose=0))  # the newest commit, after fit
    summary = {
        "learner": args.learner_id,
        "initial_loss": first,
        "final_loss": final,
        "train_loss_last": float(history.history["loss"][-1]),
        "steps": args.steps,
        "seconds": elapsed,
        "rounds_seen": int(history.history.get("gm/rounds_seen", [0])[-1]),
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        adapter = gm.adapters.adapter_for(model, layouts="torch")  # the run's names and layout
        np.savez(args.out + ".npz", **adapter.read([s.name for s in adapter.schema()]))
        Path(args.out + ".json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
