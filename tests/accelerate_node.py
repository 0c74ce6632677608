"""One Accelerate node of a test run (run by tests/test_accelerate_nodes.py, directly or
under ``torchrun --nproc_per_node=2``: then the node is a 2-process gloo group).

Writes ``result-rank{r}.json`` and ``params-rank{r}.npz`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import gradientmail_core as gm
import gradientmail_lightning  # noqa: F401  (adds Accelerator.register_gradientmail)

FEATURES = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_loader(seed: int, n: int, batch: int) -> DataLoader:
    w_true = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    return DataLoader(TensorDataset(x, x @ w_true), batch_size=batch, shuffle=False)


def params_equal_across_ranks(model: torch.nn.Module) -> bool:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return True
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], t) for t in everyone[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mailbox", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, required=True, help="batches per process")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--learner-id")
    ap.add_argument("--wait", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quorum", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)  # several test nodes share a few cores
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)7d %(name)s %(message)s")
    logging.getLogger("gradientmail").setLevel(logging.INFO)

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, cpu=True)
    batch = 16
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = make_loader(args.seed, n=batch * args.batches * accelerator.num_processes, batch=batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    mailbox = gm.CountingMailbox(gm.open_mailbox(args.mailbox))
    # A clean leave releases the lease at once, so a long lease_timeout costs these runs nothing,
    # and a node starved of CPU on a busy test machine is not mistaken for a dead one.
    options: dict[str, Any] = {"poll_interval": 0.05, "lease_timeout": 10.0}
    if args.learner_id:
        options["learner_id"] = args.learner_id
    handle = accelerator.register_gradientmail(
        model,
        optimizer,
        algorithm=gm.DiLoCo(sync_every=4, fragments=2, overlap_steps=1, quorum_size=args.quorum),
        mailbox=mailbox,
        samples_per_step=batch * args.accumulate,
        wait_for_learners=args.wait,
        wait_timeout=60,
        **options,
    )
    losses: list[float] = []
    checks = mismatches = 0
    session_steps = None
    with handle:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(float(loss.detach()))
            if accelerator.sync_gradients:
                checks += 1
                mismatches += not params_equal_across_ranks(model)
        if handle.session is not None:
            session_steps = handle.session.progress.local_step
    checks += 1
    mismatches += not params_equal_across_ranks(model)

    rank = accelerator.process_index
    result = {
        "rank": rank,
        "world_size": accelerator.num_processes,
        "learner_id": handle.driver.learner_id if rank == 0 else None,
        "steps": handle.steps,
        "session_steps": session_steps,
        "samples": handle.driver.samples,
        "aligned": handle.driver.metrics.aligned,
        "losses": losses,
        "sync_checks": checks,
        "sync_mismatches": mismatches,
        "mailbox_calls": sum(mailbox.counts.values()),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"result-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    unwrapped = accelerator.unwrap_model(model)
    np.savez(
        os.path.join(args.out, f"params-rank{rank}.npz"),
        **{n: p.detach().numpy() for n, p in unwrapped.named_parameters()},
    )
    accelerator.end_training()
    if torch.distributed.is_initialized():
        # Tear gloo down while both ranks are still here: a rank that exits with the process
        # group alive can abort in C++ ("terminate called without an active exception").
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # Even after barrier + destroy_process_group, a DDP rank on gloo has (rarely, once in four CI
    # runs) aborted in the interpreter's teardown ("terminate called without an active
    # exception"): everything is written, so leave without running the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
