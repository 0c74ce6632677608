"""A torch learner process for tests/test_mlx_runs.py, structurally equal to mlx_node.py's."""

from __future__ import annotations

import numpy as np
import torch
from mixed_common import DIMS, LR, algorithm, batches, dataset, finish, parse_args

import gradientmail_core as gm


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.ReLU(), torch.nn.Linear(DIMS[1], DIMS[2])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = dataset(args.data_seed)
    xe, ye = torch.from_numpy(x), torch.from_numpy(y)
    data = batches(x, y, args.learner_id)
    losses = []
    with gm.Session(
        model,
        algorithm=algorithm(args),
        mailbox=gm.open_mailbox(args.mailbox),
        learner_id=args.learner_id,
        poll_interval=0.05,
        lease_timeout=3.0,
    ) as session:
        session.wait_for(learners=args.learners, timeout=60)
        with torch.no_grad():
            losses.append(torch.nn.functional.mse_loss(model(xe), ye).item())
        for _ in range(args.steps):
            xb, yb = next(data)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
            opt.step()
            session.step(samples=len(xb))
    with torch.no_grad():
        losses.append(torch.nn.functional.mse_loss(model(xe), ye).item())
    params = {n: p.detach().numpy().astype(np.float32) for n, p in model.named_parameters()}
    finish(args, params, session, losses)


if __name__ == "__main__":
    main()
