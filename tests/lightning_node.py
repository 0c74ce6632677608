"""One Lightning node of a test run (run as a script by tests/test_lightning_nodes.py).

Trains a tiny regressor with ``Trainer(strategy=MailboxDiLoCoStrategy(...))`` and writes,
per rank, ``result-rank{r}.json`` (learner id, counters, losses, sync checks, mailbox calls)
and ``params-rank{r}.npz`` (final parameters) into ``--out``. With ``--devices 2`` Lightning
re-runs this script for rank 1 (the node is a gloo DDP group).
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
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import gradientmail_core as gm
from gradientmail_lightning import MailboxDiLoCoStrategy

FEATURES = 8


class TinyRegressor(LightningModule):
    """y = x . w_true; every node draws its own x."""

    def __init__(self, lr: float = 0.05, manual: bool = False, steps_per_batch: int = 1, step_every: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)  # same init on every node and rank
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.lr = lr
        self.automatic_optimization = not manual
        self.steps_per_batch = steps_per_batch
        self.step_every = step_every
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.automatic_optimization:
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss
        opt = self.optimizers()
        if (batch_idx + 1) % self.step_every:
            return None  # manual: this batch steps no optimizer
        for _ in range(self.steps_per_batch):  # manual: possibly several optimizer steps on one batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.losses.append(float(loss.detach()))
        return None

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def make_loader(seed: int, n: int, batch: int) -> DataLoader:
    w_true = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    return DataLoader(TensorDataset(x, x @ w_true), batch_size=batch, shuffle=False)


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class SyncCheck(Callback):
    """After every optimizer step and at the end: all-gather the parameters, compare exactly."""

    def __init__(self) -> None:
        self.checks = 0
        self.mismatches = 0

    def _check(self, pl_module: LightningModule) -> None:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        mine = flat_params(pl_module)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        self.checks += 1
        self.mismatches += sum(not torch.equal(everyone[0], t) for t in everyone[1:])

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._check(pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check(pl_module)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mailbox", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--learner-id")
    ap.add_argument("--wait", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quorum", type=int, default=1)
    ap.add_argument("--ckpt-dir")
    ap.add_argument("--resume")
    ap.add_argument("--csv")
    args = ap.parse_args()
    torch.set_num_threads(1)  # several test nodes share a few cores
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)7d %(name)s %(message)s")
    logging.getLogger("gradientmail").setLevel(logging.INFO)

    mailbox = gm.CountingMailbox(gm.open_mailbox(args.mailbox))
    # A clean leave releases the lease at once, so a long lease_timeout costs these runs nothing,
    # and a node starved of CPU on a busy test machine is not mistaken for a dead one.
    options: dict[str, Any] = {"poll_interval": 0.05, "lease_timeout": 10.0}
    if args.learner_id:
        options["learner_id"] = args.learner_id
    strategy = MailboxDiLoCoStrategy(
        algorithm=gm.DiLoCo(sync_every=4, fragments=2, overlap_steps=1, quorum_size=args.quorum),
        mailbox=mailbox,
        wait_for_learners=args.wait,
        wait_timeout=60,
        **options,
    )
    check = SyncCheck()
    callbacks: list[Callback] = [check]
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=4, save_last=True, save_top_k=0))
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        callbacks=callbacks,
        logger=CSVLogger(args.csv, name="node") if args.csv else False,
        log_every_n_steps=1,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyRegressor()
    # Rank r of the node trains on its own shard (Lightning adds a DistributedSampler).
    trainer.fit(model, make_loader(args.seed, n=16 * args.steps * args.devices, batch=16), ckpt_path=args.resume)

    rank = trainer.global_rank
    driver = strategy.callback.driver
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "learner_id": driver.learner_id if rank == 0 else None,
        "steps": driver.steps,
        "samples": driver.samples,
        "global_step": trainer.global_step,
        "aligned": driver.metrics.aligned,
        "losses": model.losses,
        "sync_checks": check.checks,
        "sync_mismatches": check.mismatches,
        "mailbox_calls": sum(mailbox.counts.values()),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"result-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    np.savez(
        os.path.join(args.out, f"params-rank{rank}.npz"),
        **{n: p.detach().numpy() for n, p in model.named_parameters()},
    )


if __name__ == "__main__":
    main()
    # Everything is written. A rank on gloo has (rarely: once in several CI runs, also after
    # barrier + destroy_process_group, and without gradientmail) aborted in the interpreter's
    # teardown ("terminate called without an active exception"): leave without running it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
