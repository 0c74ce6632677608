"""One node of tests/test_names.py's run, as a real process: the same small network trained as a
plain model, under ``torch.compile`` (the whole model, and its first layer compiled again on its
own: ``_orig_mod`` at two depths), inside a one-process ``DistributedDataParallel`` (gloo), or as
the ``self.net`` of a LightningModule (``module="net"``). Every node's parameters have other
names in its own model; the run sees one schema. Writes ``OUT.json`` (the model's own names, the
session's schema names, the participants of every commit it aligned with) and ``OUT.npz`` (its
final parameters by run name)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import gradientmail_core as gm
from gradientmail_core.adapters import adapter_for

BATCH = 8


def network() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batches(seed: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.linspace(-1.0, 1.0, 8).unsqueeze(1)
    out = []
    for _ in range(steps):
        x = torch.randn(BATCH, 8, generator=g)
        out.append((x, torch.tanh(x @ w)))
    return out


def algorithm(quorum: int) -> gm.DiLoCo:
    return gm.DiLoCo(
        sync_every=4, fragments=2, in_flight=1, overlap_steps=0, quorum_size=quorum, merge=gm.WeightedMean()
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("plain", "compiled", "ddp", "lightning"))
    ap.add_argument("--mailbox", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quorum", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    aligned: list[Any] = []

    def watch(e: gm.events.Event) -> None:
        if isinstance(e, gm.events.Aligned):
            aligned.append([e.round, sorted(e.participants)])

    options: dict[str, Any] = {"learner_id": args.kind, "poll_interval": 0.05, "lease_timeout": 30.0,
                               "callbacks": [watch]}  # fmt: skip
    net = network()
    data = batches(args.seed, args.steps)
    if args.kind == "lightning":
        model, schema = run_lightning(args, net, data, options)
    else:
        if args.kind == "compiled":
            net[0] = torch.compile(net[0], backend="eager")  # a block compiled on its own...
            model: Any = torch.compile(net, backend="eager")  # ...inside the compiled model
        elif args.kind == "ddp":
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"file://{args.out}.pg", rank=0, world_size=1)
            model = torch.nn.parallel.DistributedDataParallel(net)
        else:
            model = net
        schema = [s.name for s in adapter_for(model).schema()]
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with gm.Session(model, algorithm=algorithm(args.quorum), mailbox=gm.FileMailbox(args.mailbox), **options) as s:
            s.wait_for(args.quorum, timeout=300)
            for x, y in data:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                s.step(samples=len(x))
    report = {"own_names": [n for n, _ in model.named_parameters()], "schema": schema, "aligned": aligned}
    Path(args.out + ".json").write_text(json.dumps(report))
    np.savez(args.out + ".npz", **{n: p.detach().numpy() for n, p in zip(schema, net.parameters(), strict=True)})


def run_lightning(args: argparse.Namespace, net: torch.nn.Module, data: list, options: dict) -> tuple[Any, list[str]]:
    from lightning.pytorch import LightningModule, Trainer

    from gradientmail_lightning import GradientMailCallback

    class Regressor(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net  # the run's parameters: module="net"

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    callback = GradientMailCallback(
        algorithm=algorithm(args.quorum), mailbox=gm.FileMailbox(args.mailbox), module="net",
        wait_for_learners=args.quorum, wait_timeout=300, log_metrics=False, **options,
    )  # fmt: skip
    trainer = Trainer(max_steps=args.steps, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=os.path.dirname(args.out))  # fmt: skip
    module = Regressor()
    xs, ys = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=BATCH))
    return module, [s.name for s in adapter_for(module, module="net").schema()]


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
