"""The learner processes of tests/test_four_frameworks.py: one small transformer LM, written
natively in torch, MLX, Flax NNX and Keras 3, training one run over a file mailbox.

    python tests/test_four_frameworks_nodes.py --framework flax --mailbox file:///tmp/run --learner-id f --out /tmp/f

Every model names its layers as the torch one does (``block.qkv``, ``norm``, ...); the Flax and
Keras nodes join through ``layouts="torch"`` (kernels transposed, ``scale``/``gamma`` read as
``weight``, ``embedding``/``embeddings`` as ``weight``). One block with a square projection
(``block.proj``, D x D): a node that forgot the transpose would fit the shapes. Each node writes
its final parameters in the run's names and layout (``OUT.npz``) and a JSON line with its
held-out loss. Frameworks are imported inside each node's function, so pytest collects this
file without importing any of them (it holds no tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import zlib
from pathlib import Path

import numpy as np

import gradientmail_core as gm

VOCAB, CONTEXT, WIDTH, HEADS = 96, 16, 32, 2
BATCH, LR = 16, 3e-3
# Standard DiLoCo's lockstep: every round waits for all four contributions (quorum 4, no overlap).
ALGORITHM = dict(sync_every=8, fragments=2, in_flight=1, overlap_steps=0, merge=gm.WeightedMean())
FRAMEWORKS = ("torch", "mlx", "flax", "keras")


def corpus(limit: int = 200_000) -> np.ndarray:
    """Characters of a few standard-library modules, mapped to 0..95."""
    root = Path(os.__file__).parent
    text = "".join((root / n).read_text(encoding="utf-8", errors="replace") for n in ("os.py", "argparse.py"))[:limit]
    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8).astype(np.int64) - 32
    return np.where((codes >= 0) & (codes < VOCAB - 1), codes, VOCAB - 1)


def windows(data: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random windows of CONTEXT characters and the windows shifted by one (int32)."""
    starts = np.random.default_rng(seed).integers(0, len(data) - CONTEXT - 1, size=n)
    idx = starts[:, None] + np.arange(CONTEXT)
    return data[idx].astype(np.int32), data[idx + 1].astype(np.int32)


def causal_mask() -> np.ndarray:
    return np.triu(np.full((CONTEXT, CONTEXT), -1e9, np.float32), k=1)


# ---- torch --------------------------------------------------------------------------------


def torch_node(args, train, held):
    import torch
    from torch import nn

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(WIDTH, eps=1e-5), nn.LayerNorm(WIDTH, eps=1e-5)
            self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
            self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, h):
            b, t, d = h.shape
            q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-1, -2)) / (d // HEADS) ** 0.5 + torch.from_numpy(causal_mask())
            a = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
            h = h + self.proj(a)
            return h + self.fc2(torch.relu(self.fc1(self.norm2(h))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.pos = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
            self.block = Block()
            self.norm = nn.LayerNorm(WIDTH, eps=1e-5)
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, x):
            return self.head(self.norm(self.block(self.embed(x) + self.pos)))

    model = LM()
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=1e-8)

    def loss_of(x, y):
        return nn.functional.cross_entropy(
            model(torch.from_numpy(x).long()).flatten(0, 1), torch.from_numpy(y).long().flatten()
        )

    with _session(args, model) as session:
        session.wait_for(learners=args.learners, timeout=120)
        for i in range(args.steps):
            x, y = train[0][i * BATCH : (i + 1) * BATCH], train[1][i * BATCH : (i + 1) * BATCH]
            opt.zero_grad()
            loss_of(x, y).backward()
            opt.step()
            session.step(samples=BATCH)
    with torch.no_grad():
        held_loss = float(loss_of(*held))
    return model, held_loss, None


# ---- MLX ----------------------------------------------------------------------------------


def mlx_node(args, train, held):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    mx.random.seed(args.seed)
    mask = mx.array(causal_mask())

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(WIDTH, eps=1e-5), nn.LayerNorm(WIDTH, eps=1e-5)
            self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
            self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

        def __call__(self, h):
            b, t, d = h.shape
            qkv = self.qkv(self.norm1(h)).reshape(b, t, 3, HEADS, d // HEADS).transpose(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            att = (q @ k.transpose(0, 1, 3, 2)) / (d // HEADS) ** 0.5 + mask
            a = (mx.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
            h = h + self.proj(a)
            return h + self.fc2(nn.relu(self.fc1(self.norm2(h))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.pos = mx.random.normal((CONTEXT, WIDTH)) * 0.02
            self.block = Block()
            self.norm = nn.LayerNorm(WIDTH, eps=1e-5)
            self.head = nn.Linear(WIDTH, VOCAB)

        def __call__(self, x):
            return self.head(self.norm(self.block(self.embed(x) + self.pos)))

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    model = LM()
    opt = optim.Adam(learning_rate=LR, eps=1e-8, bias_correction=True)  # as torch, optax and Keras
    step = nn.value_and_grad(model, loss_fn)
    with _session(args, model) as session:
        session.wait_for(learners=args.learners, timeout=120)
        for i in range(args.steps):
            x, y = train[0][i * BATCH : (i + 1) * BATCH], train[1][i * BATCH : (i + 1) * BATCH]
            _, grads = step(model, mx.array(x), mx.array(y))
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)
            session.step(samples=BATCH)
    held_loss = loss_fn(model, mx.array(held[0]), mx.array(held[1])).item()
    assert "torch" not in sys.modules, "the MLX node imported torch"
    return model, held_loss, None  # MLX lays out Linear and Embedding as torch does


# ---- Flax NNX -----------------------------------------------------------------------------


def flax_node(args, train, held):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    rngs = nnx.Rngs(args.seed)
    mask = jnp.asarray(causal_mask())

    class Block(nnx.Module):
        def __init__(self):
            self.norm1, self.norm2 = (
                nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs),
                nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs),
            )
            self.qkv, self.proj = nnx.Linear(WIDTH, 3 * WIDTH, rngs=rngs), nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.fc1, self.fc2 = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs), nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

        def __call__(self, h):
            b, t, d = h.shape
            qkv = self.qkv(self.norm1(h)).reshape(b, t, 3, HEADS, d // HEADS).transpose(2, 0, 3, 1, 4)
            att = (qkv[0] @ qkv[1].transpose(0, 1, 3, 2)) / (d // HEADS) ** 0.5 + mask
            a = (jax.nn.softmax(att, axis=-1) @ qkv[2]).transpose(0, 2, 1, 3).reshape(b, t, d)
            h = h + self.proj(a)
            return h + self.fc2(jax.nn.relu(self.fc1(self.norm2(h))))

    class LM(nnx.Module):
        def __init__(self):
            self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
            self.pos = nnx.Param(jax.random.normal(rngs.params(), (CONTEXT, WIDTH)) * 0.02)
            self.block = Block()
            self.norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs)
            self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

        def __call__(self, x):
            return self.head(self.norm(self.block(self.embed(x) + self.pos[...])))

    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    @nnx.jit
    def train_step(model, opt, x, y):
        grads = nnx.grad(loss_fn)(model, x, y)
        opt.update(model, grads)

    model = LM()
    opt = nnx.Optimizer(model, optax.adam(LR, eps=1e-8), wrt=nnx.Param)
    with _session(args, model, layouts="torch") as session:
        session.wait_for(learners=args.learners, timeout=120)
        for i in range(args.steps):
            x, y = train[0][i * BATCH : (i + 1) * BATCH], train[1][i * BATCH : (i + 1) * BATCH]
            train_step(model, opt, jnp.asarray(x), jnp.asarray(y))
            session.step(samples=BATCH)
    return model, float(loss_fn(model, jnp.asarray(held[0]), jnp.asarray(held[1]))), "torch"


# ---- Keras 3 (jax backend) ----------------------------------------------------------------


def keras_node(args, train, held):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    from keras import ops

    from gradientmail_lightning import GradientMailKerasCallback

    keras.utils.set_random_seed(args.seed)

    def norm(name):
        return keras.layers.LayerNormalization(epsilon=1e-5, name=name)

    class Block(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.norm1, self.norm2 = norm("norm1"), norm("norm2")
            self.qkv, self.proj = keras.layers.Dense(3 * WIDTH, name="qkv"), keras.layers.Dense(WIDTH, name="proj")
            self.fc1, self.fc2 = keras.layers.Dense(4 * WIDTH, name="fc1"), keras.layers.Dense(WIDTH, name="fc2")

        def call(self, h):
            b, t, d = ops.shape(h)
            qkv = ops.transpose(ops.reshape(self.qkv(self.norm1(h)), (b, t, 3, HEADS, d // HEADS)), (2, 0, 3, 1, 4))
            att = ops.matmul(qkv[0], ops.transpose(qkv[1], (0, 1, 3, 2))) / (d // HEADS) ** 0.5 + causal_mask()
            a = ops.reshape(ops.transpose(ops.matmul(ops.softmax(att, axis=-1), qkv[2]), (0, 2, 1, 3)), (b, t, d))
            h = h + self.proj(a)
            return h + self.fc2(ops.relu(self.fc1(self.norm2(h))))

    class LM(keras.Model):
        def __init__(self):
            super().__init__(name="lm")
            self.embed = keras.layers.Embedding(VOCAB, WIDTH, name="embed")
            self.pos = self.add_weight(shape=(CONTEXT, WIDTH), initializer="random_normal", name="pos")
            self.block = Block(name="block")
            self.norm = norm("norm")
            self.head = keras.layers.Dense(VOCAB, name="head")

        def call(self, x):
            return self.head(self.norm(self.block(self.embed(x) + self.pos)))

    model = LM()
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=LR, epsilon=1e-8),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = train[0][: args.steps * BATCH], train[1][: args.steps * BATCH]
    callback = GradientMailKerasCallback(
        **_session_kwargs(args),
        samples_per_batch=BATCH,
        layouts="torch",
        learner_id=args.learner_id,
        wait_for_learners=args.learners,
        wait_timeout=120,
    )
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[callback], verbose=0)
    held_loss = float(model.evaluate(held[0], held[1], batch_size=len(held[0]), verbose=0))
    # (torch is loaded here all the same: importing gradientmail_lightning loads Accelerate when installed)
    return model, held_loss, "torch"


# ---- shared -------------------------------------------------------------------------------


def _session_kwargs(args) -> dict:
    algorithm = gm.DiLoCo(quorum_size=args.learners, delta_dtype=args.delta_dtype, **ALGORITHM)
    return dict(
        algorithm=algorithm,
        mailbox=gm.open_mailbox(args.mailbox),
        poll_interval=0.05,
        lease_timeout=5.0,
        callbacks=(gm.log_events,),
    )


def _session(args, model, **kw) -> gm.Session:
    return gm.Session(model, learner_id=args.learner_id, **_session_kwargs(args), **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=FRAMEWORKS, required=True)
    ap.add_argument("--mailbox", required=True)
    ap.add_argument("--learner-id", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delta-dtype", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    data = corpus()
    split = int(len(data) * 0.9)
    train = windows(data[:split], args.steps * BATCH, seed=zlib.crc32(args.learner_id.encode()))
    held = windows(data[split:], 512, seed=12345)
    node = {"torch": torch_node, "mlx": mlx_node, "flax": flax_node, "keras": keras_node}[args.framework]
    model, held_loss, layouts = node(args, train, held)
    from gradientmail_core.adapters import adapter_for

    adapter = adapter_for(model, layouts=layouts)  # the parameters in the run's names and layout
    params = adapter.read([s.name for s in adapter.schema()])
    np.savez(args.out + ".npz", **params)
    print(json.dumps({"learner": args.learner_id, "framework": args.framework, "held_out_loss": held_loss}))


if __name__ == "__main__":
    main()
