"""One learner of the demo: a Lightning node training the character-level transformer.

``examples/demo.py`` starts several of these; each is an ordinary Lightning training script
whose Trainer uses ``MailboxDiLoCoStrategy``. It is also a template for your own node:

    python examples/demo_learner.py --workdir DIR --id learner-0 --steps 300

It reads the demo's settings from ``DIR/settings.json`` (among them the run's config:
``gm.DiLoCo.frugal`` with zstd-compressed payloads, or plain F32 deltas with ``--f32``), trains
on the mailbox ``DIR/mailbox``, and appends what the demo's display shows (loss, bytes, events) to
``DIR/metrics/ID.jsonl``, one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

# One thread per learner, set before torch loads: several learners share the machine's cores,
# and Lightning would otherwise give each process all of them (cpu_count // devices), which
# makes every small op of every process fight for them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import charlm  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core import events as ev  # noqa: E402
from gradientmail_lightning import MailboxDiLoCoStrategy  # noqa: E402


class CharLM(LightningModule):
    def __init__(self, size: charlm.Size, lr: float) -> None:
        super().__init__()
        self.model = charlm.CharTransformer(size, seed=0)  # the run's creator's init is everyone's start
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model.loss(*batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class Windows(IterableDataset):
    """Endless random batches of text windows; each learner draws its own with its own seed."""

    def __init__(self, data: torch.Tensor, batch: int, block: int, seed: int) -> None:
        self.data, self.batch, self.block, self.seed = data, batch, block, seed

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield charlm.sample_batch(self.data, batch=self.batch, block=self.block, generator=g)


class JsonLines:
    """Appends one JSON object per line; written from the training and the session's threads."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
        self.lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "kind": kind, **fields})
        with self.lock:
            self.file.write(line + "\n")


# The session's events worth a line in the demo's event log.
def describe(event: ev.Event) -> str | None:
    if isinstance(event, ev.TookOver):
        why = {
            "lease_lost": f"{event.previous} is no longer live",
            "left": f"{event.previous} left the run",
            "timeout": f"{event.previous} did not commit it in time",
            "unclaimed": "nobody had claimed it",
        }.get(event.reason, event.reason)
        return f"took over round {event.round}" + (f" from {event.previous}" if event.previous else "") + f" ({why})"
    if isinstance(event, ev.Joined):
        return f"joined at round {event.round}" + (" and created the run" if event.created_run else "")
    if isinstance(event, ev.ContributionRejected):
        return f"rejected {event.contributor}'s contribution to round {event.round} ({event.reason})"
    if isinstance(event, ev.Superseded):
        return f"was superseded on round {event.round} by {event.by}"
    if isinstance(event, ev.GaveUp | ev.BackgroundFailed | ev.StoreFailure):
        return event.describe()
    return None


class Reporter(Callback):
    """After every optimizer step: this learner's step, loss and traffic, for the display."""

    def __init__(
        self, out: JsonLines, mailbox: gm.CountingMailbox, strategy: MailboxDiLoCoStrategy, start_step: int
    ) -> None:
        self.out, self.mailbox, self.strategy, self.start_step = out, mailbox, strategy, start_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        session = self.strategy.session
        progress = session.progress if session is not None else None
        self.out.write(
            "step",
            step=self.start_step + trainer.global_step,
            loss=outputs["loss"].item(),
            sent=self.mailbox.bytes_up,
            received=self.mailbox.bytes_down,
            round=progress.round if progress else -1,
            live=progress.live_learners if progress else 0,
        )


def algorithm(s: dict[str, Any]) -> gm.DiLoCo:
    """The run's config from the demo's settings: ``gm.DiLoCo.frugal`` (I2 deltas with error
    feedback, F4 commits, a checkpoint every 10th version) or, with ``--f32``, plain F32 deltas."""
    if s["preset"] == "frugal":
        return gm.DiLoCo.frugal(**s["diloco"])
    assert s["preset"] is None, s["preset"]
    return gm.DiLoCo(**s["diloco"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--id", help="learner id; a restarted learner reuses its id")
    ap.add_argument("--steps", type=int, help="optimizer steps to train")
    ap.add_argument("--start-step", type=int, default=0, help="steps this learner trained before a restart")
    ap.add_argument("--wait-for", type=int, help="start training once this many learners are live")
    ap.add_argument("--join", action="store_true", help="wait for another learner to create the run, then join it")
    ap.add_argument("--standby", metavar="FILE", help="load everything, then wait for FILE to say which learner to be")
    args = ap.parse_args(argv)
    with open(os.path.join(args.workdir, "settings.json")) as f:
        s = json.load(f)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    size = charlm.Size(**s["size"])
    data = charlm.encode(charlm.stdlib_text()["train"])
    if args.standby:
        # Python, torch and Lightning take seconds to load; a standby process has loaded them
        # already, so a restart takes no longer than the protocol needs.
        while not os.path.exists(args.standby):
            time.sleep(0.05)
        with open(args.standby) as f:
            go = json.load(f)
        args.id, args.steps, args.start_step = go["id"], go["steps"], go["start_step"]
    if args.id is None or args.steps is None:
        ap.error("--id and --steps are required (or --standby)")
    out = JsonLines(os.path.join(args.workdir, "metrics", f"{args.id}.jsonl"))
    out.write("start", pid=os.getpid(), start_step=args.start_step)

    def on_event(event: ev.Event) -> None:
        text = describe(event)
        if text is not None:
            out.write("event", text=text)

    mailbox_dir = os.path.join(args.workdir, "mailbox")
    if args.join:
        # One learner creates the run (its manifest and initial parameters); the others start
        # from those, whatever their own initialization was.
        while not os.path.exists(os.path.join(mailbox_dir, "manifest.json")):
            time.sleep(0.1)
    mailbox = gm.CountingMailbox(gm.FileMailbox(mailbox_dir))
    strategy = MailboxDiLoCoStrategy(
        algorithm=algorithm(s),
        mailbox=mailbox,
        learner_id=args.id,
        samples_fn=lambda batch: batch[0].numel(),  # weigh contributions by characters trained
        log_metrics=False,
        wait_for_learners=args.wait_for,
        wait_timeout=600,
        poll_interval=s["poll_interval"],
        lease_timeout=s["lease_timeout"],
        compression=s["compression"],  # "zstd": the I2 and F4 payloads shrink by another ~15%
        callbacks=(on_event,),
    )
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        callbacks=[Reporter(out, mailbox, strategy, args.start_step)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # A restarted learner draws other batches than its first life did.
    seed = 1000 * s["seed"] + 10 * int(args.id.rsplit("-", 1)[-1]) + (args.start_step > 0)
    loader = DataLoader(Windows(data, s["batch"], size.block, seed), batch_size=None)
    trainer.fit(CharLM(size, s["lr"]), train_dataloaders=loader)
    out.write("done", step=args.start_step + trainer.global_step, sent=mailbox.bytes_up, received=mailbox.bytes_down)


if __name__ == "__main__":
    main()
