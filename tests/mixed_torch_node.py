"""A torch learner process for tests/test_mlx_runs.py, structurally equal to mlx_node.py's.

Under ``torchrun`` with several processes it is a sharded node (FSDP2, gloo): every rank opens
the session, trains on its own batches, and rank 0 writes the gathered parameters
(``tests/test_fleet.py``)."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from mixed_common import DIMS, LR, algorithm, batches, dataset, finish, opened, parse_args, session_options

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
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun: one rank of an FSDP2 node
    rank, world = 0, 1
    if sharded:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        for layer in model.layers:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = dataset(args.data_seed)
    xe, ye = torch.from_numpy(x), torch.from_numpy(y)
    data = batches(x, y, f"{args.learner_id}-{rank}" if sharded else args.learner_id)
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
        with torch.no_grad():
            losses.append(torch.nn.functional.mse_loss(model(xe), ye).item())
        for _ in range(args.steps):
            xb, yb = next(data)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
            opt.step()
            session.step(samples=len(xb) * world)
    with torch.no_grad():
        losses.append(torch.nn.functional.mse_loss(model(xe), ye).item())
    params = {
        n: (p.full_tensor() if sharded else p).detach().numpy().astype(np.float32) for n, p in model.named_parameters()
    }
    if rank == 0:
        finish(args, params, session, losses)
    if sharded:
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # (the gloo teardown abort at exit: see tests/sharded_node.py)


if __name__ == "__main__":
    main()
