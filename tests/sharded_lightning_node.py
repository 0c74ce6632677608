"""A Lightning node of the sharded tests (run as a script by tests/test_sharded_lightning.py).

Two CPU ranks, ``Trainer(strategy=ModelParallelStrategy(), accelerator="cpu", devices=2)`` with
``fully_shard`` in ``configure_model`` and ``GradientMailCallback`` (Lightning re-runs this
script for rank 1). The network and the run's ``gm.DiLoCo`` are those of ``tests/sharded_node.py``
(the plain and the torchrun Session nodes of the same run), with the same parameter names.
``--fake-session`` replaces ``gm.Session`` with ``LockstepSession``, which checks at every call
that both ranks make the same call with the same arguments (the Lightning plumbing, without the
sharded runtime).

Writes into ``--out``: ``result-rank{r}.json`` per rank and, from rank 0, ``params.npz`` (the
final full parameters, gathered with ``full_tensor()``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import gradientmail_core as gm
from gradientmail_core.adapters.torch_sharded import ShardedTorchAdapter, find_sharded
from gradientmail_core.session import Progress

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharded_node  # noqa: E402  (the other nodes of the run: its network and its gm.DiLoCo)


def make_data(learner: str, n: int) -> TensorDataset:
    draws = sharded_node.batches(learner, 0)
    xs, ys = zip(*(next(draws) for _ in range(-(-n // sharded_node.BATCH))))
    return TensorDataset(torch.cat(xs)[:n], torch.cat(ys)[:n])


# ---------------------------------------------------------------------------------------------
# A stand-in session that checks the ranks make the same calls


class LockstepSession:
    """Takes ``gm.Session``'s place on every rank of a sharded node. Each call (open, step,
    close) all-gathers (call kind, argument, learner id hash) and fails unless every rank made
    the same call: the contract a sharded session's collectives rely on."""

    calls: list[list[Any]] = []  # this process's calls, in order (read by main)

    def __init__(self, model: Any, *, algorithm: gm.DiLoCo, mailbox: Any, learner_id: str, **_: Any) -> None:
        # The driver hands the session the adapter it built on every rank (module= and names= applied).
        if not isinstance(model, ShardedTorchAdapter) or find_sharded(model.model) is None:
            raise AssertionError("LockstepSession was given no sharded adapter of a module with DTensor parameters")
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
        if learners > 1:  # nobody else is coming: as gm.Session's wait_for ends
            raise TimeoutError(f"only 1 of {learners} learners seen after {timeout} s")

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
        """``sharded_node.model()``'s layers as this module's own children ``0`` .. ``4``: the
        parameter names of the run's other nodes (``0.weight``, ...)."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = len(sharded_node.model())
            for i, layer in enumerate(sharded_node.model()):
                self.add_module(str(i), layer)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i in range(self.layers):
                x = self.get_submodule(str(i))(x)
            return x

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            for layer in self.children():
                if any(True for _ in layer.parameters()):
                    fully_shard(layer)
            fully_shard(self)  # the root: every parameter is a DTensor

        def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=sharded_node.LR)

    options: dict[str, Any] = {"poll_interval": 0.05, "lease_timeout": args.lease_timeout, "close_timeout": 60.0}
    if args.id:
        options["learner_id"] = args.id
    callback = GradientMailCallback(
        algorithm=sharded_node.algorithm(args),
        mailbox=gm.FileMailbox(args.mailbox),
        wait_for_learners=args.learners,
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
    samples = args.steps * args.accumulate * 2 * sharded_node.BATCH  # Lightning splits them over the ranks
    loader = DataLoader(make_data(args.id or "lightning", samples), batch_size=sharded_node.BATCH, shuffle=False)
    try:
        trainer.fit(module, loader, ckpt_path=args.resume)
    except Exception as e:
        if not args.expect_failure:
            raise
        error = {"rank": trainer.global_rank, "error": type(e).__name__, "message": str(e)}
        write(args.out, trainer.global_rank, {**error, "calls": LockstepSession.calls}, {})
        return
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


def write(out: str, rank: int, result: dict[str, Any], params: dict[str, np.ndarray]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"result-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if rank == 0 and params:
        np.savez(os.path.join(out, "params.npz"), **params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mailbox", required=True, help="a FileMailbox directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--id", help="the learner id (default: a fresh one, or the checkpoint's)")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--learners", type=int, help="wait for this many learners")
    # The run's gm.DiLoCo, as tests/sharded_node.py makes it:
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--quorum", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--delta-dtype", default=None)
    ap.add_argument("--lease-timeout", type=float, default=20.0)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--fake-session", action="store_true")
    ap.add_argument("--expect-failure", action="store_true", help="write the error of fit() instead of raising it")
    ap.add_argument("--save", help="save a Lightning checkpoint here at the end")
    ap.add_argument("--resume", help="resume from this Lightning checkpoint")
    args = ap.parse_args()
    torch.set_num_threads(1)  # several test nodes share a few cores
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)7d %(name)s %(message)s")
    logging.getLogger("gradientmail").setLevel(logging.INFO)
    lightning_node(args)


if __name__ == "__main__":
    main()
    # Everything is written. A rank on gloo has (rarely: once in several CI runs, also after
    # barrier + destroy_process_group, and without gradientmail) aborted in the interpreter's
    # teardown ("terminate called without an active exception"): leave without running it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
