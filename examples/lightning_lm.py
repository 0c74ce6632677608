"""A character-level transformer trained with PyTorch Lightning by several gradientmail nodes.

Each node is an ordinary Lightning ``Trainer`` with ``strategy=MailboxDiLoCoStrategy(...)``;
the nodes share nothing but a mailbox (here a local directory). The model and the text (the
standard library's own ``.py`` files) come from ``examples/charlm.py``.

    # one command: start 2 node processes on this machine, then evaluate the run
    python examples/lightning_lm.py --nodes 2 --mailbox file:///tmp/gm-lightning

    # or one command per node (on one machine or several sharing the directory or a bucket)
    python examples/lightning_lm.py --node-id 0 --mailbox file:///tmp/gm-lightning &
    python examples/lightning_lm.py --node-id 1 --mailbox file:///tmp/gm-lightning --devices 2   # a 2-rank DDP node

A node may join or leave whenever it likes; ``--wait N`` makes it wait for N learners before
training. Metrics (``gm/round``, ``gm/participants``, ``gm/cosine``...) go to a CSV log per
node under ``--log-dir``. Start a new run with a new mailbox directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from typing import Any

import torch
from charlm import SIZES, CharTransformer, encode, evaluate, heldout_batches, stdlib_text
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import gradientmail_core as gm
from gradientmail_lightning import MailboxDiLoCoStrategy


class Windows(Dataset):
    """``length`` random windows of the text (fixed by ``seed``) and their next characters."""

    def __init__(self, data: torch.Tensor, *, block: int, length: int, seed: int) -> None:
        self.data, self.block = data, block
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - block - 1, (length,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        return self.data[s : s + self.block], self.data[s + 1 : s + self.block + 1]


class CharLM(LightningModule):
    def __init__(self, size: str, lr: float) -> None:
        super().__init__()
        self.model = CharTransformer(SIZES[size])  # same seed on every node: same initial model
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model.loss(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def algorithm(args: argparse.Namespace) -> gm.DiLoCo:
    return gm.DiLoCo(sync_every=args.sync_every, fragments=args.fragments)


def run_node(args: argparse.Namespace) -> None:
    if args.accelerator == "cpu":
        # Several nodes share this machine's cores; oversubscribed torch threads crawl.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (args.nodes * args.devices)))
    size = SIZES[args.size]
    text = stdlib_text()
    data = encode(text["train"])
    # A tokens-per-sample count: the session weighs contributions by tokens.
    strategy = MailboxDiLoCoStrategy(
        algorithm=algorithm(args),
        mailbox=args.mailbox,
        samples_fn=lambda batch: batch[0].numel(),
        wait_for_learners=args.wait,
        learner_id=f"lightning-{args.node_id}",
        poll_interval=0.2,
        lease_timeout=10.0,
    )
    trainer = Trainer(
        max_steps=args.steps,
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        logger=CSVLogger(args.log_dir, name=f"node-{args.node_id}"),
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    world = args.devices  # ranks of this node; Lightning gives each its own shard of the windows
    windows = Windows(data, block=size.block, length=args.steps * args.batch * world, seed=1000 + args.node_id)
    module = CharLM(args.size, args.lr)
    trainer.fit(module, DataLoader(windows, batch_size=args.batch, shuffle=False))
    if trainer.global_rank == 0:
        # The session closed at the end of fit: the model holds the newest committed parameters.
        loss = evaluate(
            module.model.cpu(), heldout_batches(encode(text["heldout"]), batches=8, batch=32, block=size.block)
        )
        print(f"node {args.node_id}: held-out loss {loss:.3f} nats/char after {trainer.global_step} steps", flush=True)


def launch(args: argparse.Namespace) -> None:
    """Start ``--nodes`` node processes, wait for them, evaluate the newest committed model."""
    argv = sys.argv[1:]
    procs = []
    for i in range(args.nodes):
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--node-id", str(i), "--wait", str(args.nodes)]
        procs.append(subprocess.Popen(cmd))
    start = time.monotonic()
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"node processes exited with {codes}")
    text = stdlib_text()
    batches = heldout_batches(encode(text["heldout"]), batches=8, batch=32, block=SIZES[args.size].block)
    lm = CharLM(args.size, args.lr)  # parameter names as the nodes trained them ("model.…")
    untrained = evaluate(lm.model, batches)
    newest = gm.align(lm, mailbox=gm.open_mailbox(args.mailbox))
    print(
        f"\n{args.nodes} nodes, {time.monotonic() - start:.0f} s: newest committed round {newest}; held-out loss "
        f"{untrained:.3f} -> {evaluate(lm.model, batches):.3f} nats/char (CSV logs in {args.log_dir})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mailbox", default="file:///tmp/gm-lightning", help="mailbox URL (file:///..., s3://...)")
    ap.add_argument("--nodes", type=int, default=2, help="nodes to start (without --node-id); sizes thread counts")
    ap.add_argument("--node-id", type=int, help="run this one node (its index) instead of launching")
    ap.add_argument("--wait", type=int, help="wait for this many learners before training")
    ap.add_argument("--devices", type=int, default=1, help="processes in this node (DDP within the node)")
    ap.add_argument("--accelerator", default="cpu", help="cpu or gpu")
    ap.add_argument("--size", default="quick", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--log-dir", default="lightning_logs_gm")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.node_id is None:
        launch(args)
    else:
        logging.getLogger("gradientmail").setLevel(logging.INFO)
        run_node(args)


if __name__ == "__main__":
    main()
