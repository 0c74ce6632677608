"""Nodes of the sharded tests (run as scripts by tests/test_sharded_lightning.py).

``lightning``: a Lightning node of two CPU ranks, ``Trainer(strategy=ModelParallelStrategy(),
accelerator="cpu", devices=2)`` with ``fully_shard`` in ``configure_model`` and
``GradientMailCallback`` (Lightning re-runs this script for rank 1). ``--fake-session`` replaces
``gm.Session`` with ``LockstepSession``, which checks at every call that both ranks make the same
call with the same arguments (the Lightning plumbing, without the sharded runtime).

``plain``: one process, ``gm.Session`` over the same network, unsharded, in a plain loop.

Each node writes into ``--out``: ``result-rank{r}.json`` per rank and, from rank 0, ``params.npz``
(the final full parameters; ``full_tensor()`` on the sharded node).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import gradientmail_core as gm
from gradientmail_core.adapters.torch_sharded import find_sharded
from gradientmail_core.session import Progress

FEATURES = 8
HIDDEN = 24  # net.0.weight is 24 x 8 = 192 elements: 96 per rank, so 64-element chunks straddle the ranks


def make_net() -> torch.nn.Sequential:
    torch.manual_seed(0)  # the same initial parameters on every node and rank
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 3))


class PlainNet(torch.nn.Module):
    """The same parameter names as the Lightning module (``net.0.weight``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()


def make_data(seed: int, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.linspace(-1.0, 1.0, FEATURES * 3, dtype=torch.float32).reshape(FEATURES, 3)
    return TensorDataset(x, x @ w)


def algorithm(args: argparse.Namespace) -> gm.DiLoCo:
    extra: dict[str, Any] = {} if args.chunk is None else {"chunk_elements": args.chunk}
    return gm.DiLoCo(sync_every=4, fragments=2, overlap_steps=0, quorum_size=args.quorum, **extra)


def session_options(args: argparse.Namespace) -> dict[str, Any]:
    # A clean leave releases the lease at once: a long lease_timeout costs nothing, and a node
    # starved of CPU on a busy test machine is not mistaken for a dead one.
    return {"learner_id": args.learner_id, "poll_interval": 0.05, "lease_timeout": 20.0, "role": args.role}


# ---------------------------------------------------------------------------------------------
# A stand-in session that checks the ranks make the same calls


class LockstepSession:
    """Takes ``gm.Session``'s place on every rank of a sharded node. Each call (open, step,
    close) all-gathers (call kind, argument, learner id hash) and fails unless every rank made
    the same call: the contract a sharded session's collectives rely on."""

    calls: list[list[Any]] = []  # this process's calls, in order (read by main)

    def __init__(self, model: Any, *, algorithm: gm.DiLoCo, mailbox: Any, learner_id: str, **_: Any) -> None:
        if find_sharded(model) is None:
            raise AssertionError("LockstepSession was given a module without DTensor parameters")
        self.learner_id = learner_id
        self.steps = 0

    def _same(self, kind: int, arg: int = 0) -> None:
        ident = int.from_bytes(self.learner_id.encode()[:7].ljust(7, b"\0"), "big")
        mine = torch.tensor([kind, arg, ident, self.steps], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        if any(not torch.equal(everyone[0], t) for t in everyone):
            raise AssertionError(f"ranks made different calls: {[t.tolist() for t in everyone]}")
        LockstepSession.calls.append([kind, arg, self.learner_id])

    def open(self) -> None:
        self._same(1)

    def step(self, samples: int = 1) -> None:
        self._same(2, samples)
        self.steps += 1

    def close(self) -> None:
        self._same(3)

    def wait_for(self, learners: int, timeout: float | None = None) -> None:
        LockstepSession.calls.append([4, learners, self.learner_id])  # rank 0 only

    @property
    def progress(self) -> Progress:
        return Progress(round=self.steps // 2 - 1, versions=(), live_learners=1, local_step=self.steps, tokens=0,
                        rounds_seen=0, closing_round=None)  # fmt: skip

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        LockstepSession.calls.append([9, 0, self.learner_id])


# ---------------------------------------------------------------------------------------------
# The nodes


def lightning_node(args: argparse.Namespace) -> None:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy

    from gradientmail_lightning import GradientMailCallback

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer)
            fully_shard(self.net)

        def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    mailbox = gm.open_mailbox(args.mailbox)
    options = {k: v for k, v in session_options(args).items() if v is not None}
    callback = GradientMailCallback(
        algorithm=algorithm(args),
        mailbox=mailbox,
        wait_for_learners=args.wait,
        wait_timeout=60,
        log_metrics=False,
        **options,
    )
    if args.fake_session:
        callback.driver.session_factory = LockstepSession  # type: ignore[assignment]
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(),
        callbacks=[callback],
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    module = Module()
    batches = args.steps * args.accumulate * 2
    loader = DataLoader(make_data(args.seed, 8 * batches), batch_size=8, shuffle=False)
    trainer.fit(module, loader, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    rank = trainer.global_rank
    driver = callback.driver
    full = {n: p.full_tensor().detach().numpy() for n, p in module.named_parameters()}  # collective
    placements = {n: [str(x) for x in p.placements] for n, p in module.named_parameters()}
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "learner_id": driver.learner_id,
        "steps": driver.steps,
        "samples": driver.samples,
        "global_step": trainer.global_step,
        "calls": LockstepSession.calls,
        "placements": placements,
        "mesh_ndim": {n: p.device_mesh.ndim for n, p in module.named_parameters()},
    }
    write(args.out, rank, result, full)


def plain_node(args: argparse.Namespace) -> None:
    model = PlainNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = make_data(args.seed, 8 * args.steps)
    mailbox = gm.open_mailbox(args.mailbox)
    with gm.Session(model, algorithm=algorithm(args), mailbox=mailbox, **session_options(args)) as session:
        if args.wait:
            session.wait_for(args.wait, timeout=60)
        for x, y in DataLoader(data, batch_size=8, shuffle=False):
            loss = torch.nn.functional.mse_loss(model.net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            session.step(samples=len(x))
    result = {"rank": 0, "learner_id": session.learner_id, "steps": args.steps, "rounds_seen": session.rounds_seen}
    write(args.out, 0, result, {n: p.detach().numpy() for n, p in model.named_parameters()})


def write(out: str, rank: int, result: dict[str, Any], params: dict[str, np.ndarray]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"result-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if rank == 0:
        np.savez(os.path.join(out, "params.npz"), **params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["lightning", "plain"])
    ap.add_argument("--mailbox", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--learner-id")
    ap.add_argument("--role", default="both")
    ap.add_argument("--wait", type=int)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quorum", type=int, default=1)
    ap.add_argument("--chunk", type=int, help="chunk_elements of the run")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--fake-session", action="store_true")
    ap.add_argument("--save", help="save a Lightning checkpoint here at the end")
    ap.add_argument("--resume", help="resume from this Lightning checkpoint")
    args = ap.parse_args()
    torch.set_num_threads(1)  # several test nodes share a few cores
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)7d %(name)s %(message)s")
    logging.getLogger("gradientmail").setLevel(logging.INFO)
    if args.kind == "lightning":
        lightning_node(args)
    else:
        plain_node(args)


if __name__ == "__main__":
    main()
