"""An MLX learner process for tests/test_mlx_runs.py. It must never import torch."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mixed_common import DIMS, LR, algorithm, batches, dataset, finish, opened, parse_args, session_options
from mlx.utils import tree_flatten

import gradientmail_core as gm


class MLP(nn.Module):
    # `layers` as a list names the parameters layers.0.weight, ... like torch's
    # `self.layers = nn.Sequential(...)`.
    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(DIMS[0], DIMS[1]), nn.ReLU(), nn.Linear(DIMS[1], DIMS[2])]

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x)
        return x


def loss_fn(model: MLP, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.mse_loss(model(x), y)


def main() -> None:
    args = parse_args()
    model = MLP()
    opt = optim.SGD(learning_rate=LR)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    x, y = dataset(args.data_seed)
    xe, ye = mx.array(x), mx.array(y)
    data = batches(x, y, args.learner_id)
    losses = []
    with gm.Session(
        model,
        algorithm=algorithm(args),
        mailbox=gm.open_mailbox(args.mailbox),
        learner_id=args.learner_id,
        poll_interval=0.05,
        lease_timeout=3.0,
        **session_options(args),
    ) as session:
        opened(args, session)
        session.wait_for(learners=args.learners, timeout=60)
        losses.append(loss_fn(model, xe, ye).item())
        for _ in range(args.steps):
            xb, yb = next(data)
            _, grads = loss_and_grad(model, mx.array(xb), mx.array(yb))
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)
            session.step(samples=len(xb))
    losses.append(loss_fn(model, xe, ye).item())
    finish(args, {n: np.array(a) for n, a in tree_flatten(model.parameters())}, session, losses)
    assert "torch" not in sys.modules, "the MLX node imported torch"


if __name__ == "__main__":
    main()
