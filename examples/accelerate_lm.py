"""A character-level transformer trained with Hugging Face Accelerate by several gradientmail
nodes.

The training loop is a plain Accelerate loop; one call joins it to the run:

    handle = accelerator.register_gradientmail(model, optimizer, algorithm=..., mailbox=...)
    with handle:
        for x, y in loader:
            with accelerator.accumulate(model):
                ...; optimizer.step(); optimizer.zero_grad()

The model and the text (the standard library's own ``.py`` files) come from ``examples/charlm.py``.

    # one command: start 2 node processes on this machine, then evaluate the run
    python examples/accelerate_lm.py --nodes 2 --mailbox file:///tmp/gm-accelerate

    # or one command per node; --processes 2 makes a node of 2 data-parallel processes (torchrun)
    python examples/accelerate_lm.py --node-id 0 --mailbox file:///tmp/gm-accelerate &
    python examples/accelerate_lm.py --node-id 1 --mailbox file:///tmp/gm-accelerate --processes 2
    # (the same as: torchrun --standalone --nproc_per_node=2 examples/accelerate_lm.py --node-id 1 ...)

Start a new run with a new mailbox directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

import torch
from accelerate import Accelerator
from charlm import SIZES, VOCAB, CharTransformer, encode, evaluate, heldout_batches, stdlib_text
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import gradientmail_core as gm
import gradientmail_lightning  # noqa: F401  (adds Accelerator.register_gradientmail)


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


def run_node(args: argparse.Namespace) -> None:
    # Without GPUs, Accelerate makes the processes of a torchrun launch one group only with cpu=True.
    multi = int(os.environ.get("WORLD_SIZE") or 1) > 1
    cpu = args.cpu or (multi and not torch.cuda.is_available())
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, cpu=cpu)
    if accelerator.device.type == "cpu":
        # Several nodes share this machine's cores; oversubscribed torch threads crawl.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (args.nodes * accelerator.num_processes)))
    size = SIZES[args.size]
    text = stdlib_text()
    model = CharTransformer(size)  # same seed on every node: same initial model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # Micro-batches for every process of this node; accelerate shards them across processes.
    length = args.steps * args.accumulate * args.batch * accelerator.num_processes
    windows = Windows(encode(text["train"]), block=size.block, length=length, seed=1000 + args.node_id)
    loader = DataLoader(windows, batch_size=args.batch, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    handle = accelerator.register_gradientmail(
        model,
        optimizer,
        algorithm=gm.DiLoCo(sync_every=args.sync_every, fragments=args.fragments),
        mailbox=args.mailbox,
        samples_per_step=args.batch * size.block * args.accumulate,  # tokens per optimizer step, per process
        wait_for_learners=args.wait,
        learner_id=f"accelerate-{args.node_id}",
        poll_interval=0.2,
        lease_timeout=10.0,
    )
    with handle:  # joins the run; leaving waits for this node's rounds and loads the newest commit
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients and handle.steps % 50 == 0:
                m = handle.metrics  # on the main process only
                accelerator.print(
                    f"node {args.node_id} step {handle.steps}: loss {loss.item():.3f}, round {m.get('gm/round', -1):.0f}, "
                    f"{m.get('gm/live_learners', 0):.0f} live"
                )
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model).cpu()
        loss = evaluate(unwrapped, heldout_batches(encode(text["heldout"]), batches=8, batch=32, block=size.block))
        print(f"node {args.node_id}: held-out loss {loss:.3f} nats/char after {handle.steps} steps", flush=True)
    accelerator.end_training()
    if torch.distributed.is_initialized():
        # Tear gloo down while both ranks are still here: a rank that exits with the process
        # group alive can abort in C++ ("terminate called without an active exception").
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def launch(args: argparse.Namespace) -> None:
    """Start ``--nodes`` node processes, wait for them, evaluate the newest committed model."""
    procs = []
    for i in range(args.nodes):
        node_argv = [os.path.abspath(__file__), *sys.argv[1:], "--node-id", str(i), "--wait", str(args.nodes)]
        if args.processes > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={args.processes}", *node_argv]  # fmt: skip
        else:
            cmd = [sys.executable, *node_argv]
        procs.append(subprocess.Popen(cmd))
    start = time.monotonic()
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"node processes exited with {codes}")
    size = SIZES[args.size]
    batches = heldout_batches(encode(stdlib_text()["heldout"]), batches=8, batch=32, block=size.block)
    model = CharTransformer(size)
    untrained = evaluate(model, batches)
    newest = gm.align(model, mailbox=gm.open_mailbox(args.mailbox))
    print(
        f"\n{args.nodes} nodes, {time.monotonic() - start:.0f} s: newest committed round {newest}; held-out loss "
        f"{untrained:.3f} -> {evaluate(model, batches):.3f} nats/char"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mailbox", default="file:///tmp/gm-accelerate", help="mailbox URL (file:///..., s3://...)")
    ap.add_argument("--nodes", type=int, default=2, help="nodes to start (without --node-id); sizes thread counts")
    ap.add_argument("--node-id", type=int, help="run this one node (its index) instead of launching")
    ap.add_argument("--processes", type=int, default=1, help="processes per node, when launching")
    ap.add_argument("--wait", type=int, help="wait for this many learners before training")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU present")
    ap.add_argument("--size", default="quick", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per node")
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--fragments", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.node_id is None:
        launch(args)
    else:
        logging.getLogger("gradientmail").setLevel(logging.INFO)
        run_node(args)


if __name__ == "__main__":
    main()
