"""A GPT-2-style language model trained in one gradientmail run by a Hugging Face ``Trainer`` node,
a Lightning node and a plain-loop node (and, with ``--kinds``, a TRL ``SFTTrainer`` node).

The model is ``transformers.GPT2LMHeadModel`` built from a config (nothing is downloaded), over the
characters of ``examples/hf_trainer.txt``, the text that ships with this example. Every node trains
the same model under the same parameter names, each framework its own way:

- ``trainer``: ``transformers.Trainer`` with ``GradientMailTrainerCallback(module="model")``. The
  Trainer trains ``SmoothedLM``, a module that holds the language model as ``self.model`` and adds a
  label-smoothed loss, so ``module="model"`` names the part that forms the run. It accumulates
  gradients over ``--accumulate`` micro-batches: one session step per optimizer step.
- ``lightning``: a ``LightningModule`` holding the model as ``self.model``, trained with
  ``MailboxDiLoCoStrategy(module="model")``.
- ``plain``: a hand-written loop with ``gm.Session(model, ...)``.
- ``sft``: ``trl.SFTTrainer`` on the model itself, with a character tokenizer built here.

The run is standard DiLoCo (every round waits for every node: ``quorum_size`` = the nodes), so the
nodes move in lockstep. GPT-2 ties its LM head to the token embedding: the weight travels once,
as ``transformer.wte.weight``, and stays one tensor after every commit (each node checks).

It needs the ``transformers`` extra besides ``lightning`` (the demo's ``scripts/demo.sh`` does not
install it; ``sft`` needs ``trl`` too):

    .venv/bin/python -m pip install -e '.[transformers,lightning]'    # in a clone, after scripts/demo.sh
    pip install 'gradientmail[transformers,lightning]'                 # anywhere else

    # start the nodes on this machine (one process each), then evaluate the newest commit; the
    # mailbox, logs and reports go to a new temporary directory unless --out/--mailbox say where
    python examples/hf_trainer.py
    python examples/hf_trainer.py --kinds trainer,sft,lightning,plain --out /tmp/gm-hf-2

    # or one node per command, on machines sharing the directory or a bucket
    python examples/hf_trainer.py --as-node trainer --quorum 3 --mailbox s3://bucket/runs/hf-1 &
    python examples/hf_trainer.py --as-node lightning --quorum 3 --mailbox s3://bucket/runs/hf-1 &
    torchrun --nproc_per_node 2 examples/hf_trainer.py --as-node trainer-2 ...   # a 2-process DDP node
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import gradientmail_core as gm

HERE = Path(__file__).resolve().parent
TEXT = HERE / "hf_trainer.txt"
SIZES = {  # embedding width, layers, heads, context length
    "tiny": (16, 1, 2, 16),
    "small": (64, 2, 4, 64),
}
KINDS = ("trainer", "lightning", "plain", "sft")
# The modules each kind of node imports beyond torch, and the extra of gradientmail that brings them.
NEEDS = {
    "trainer": (("transformers", "transformers"),),
    "lightning": (("transformers", "transformers"), ("lightning", "lightning")),
    "plain": (("transformers", "transformers"),),
    "sft": (("transformers", "transformers"), ("trl", None)),
}
PROGRESS_EVERY = 10.0  # seconds between the launcher's progress lines


def missing_packages(kinds: list[str]) -> str | None:
    """What to install for ``kinds``, as the exact command, or None when everything is there."""
    extras: list[str] = []
    plain: list[str] = []
    for kind in kinds:
        for module, extra in NEEDS[kind]:
            if importlib.util.find_spec(module) is None:
                if extra is not None and extra not in extras:
                    extras.append(extra)
                elif extra is None and module not in plain:
                    plain.append(module)
    if not extras and not plain:
        return None
    names = ", ".join([*extras, *plain])
    spec = f"[{','.join(extras)}]" if extras else ""
    clone = f"{sys.executable} -m pip install -e '.{spec}'" + (f" {' '.join(plain)}" if plain else "")
    anywhere = f"pip install 'gradientmail{spec}'" + (f" {' '.join(plain)}" if plain else "") if extras else ""
    return (
        f"examples/hf_trainer.py needs {names}, which this Python does not have. Install it with\n"
        f"    {clone}\n"
        f"from the root of the clone (the demo's .venv does not include it)"
        + (f", or elsewhere with\n    {anywhere}" if anywhere else "")
    )


# ---- the text, the model ----------------------------------------------------------------------


def vocabulary(text: str) -> dict[str, int]:
    chars = sorted(set(text))
    return {**{c: i for i, c in enumerate(chars)}, "<unk>": len(chars), "<pad>": len(chars) + 1}


def encode(text: str, vocab: dict[str, int]) -> torch.Tensor:
    return torch.tensor([vocab.get(c, vocab["<unk>"]) for c in text], dtype=torch.long)


def make_lm(size: str, vocab: dict[str, int]) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    width, layers, heads, block = SIZES[size]
    config = GPT2Config(
        vocab_size=len(vocab), n_positions=block, n_embd=width, n_layer=layers, n_head=heads,
        bos_token_id=None, eos_token_id=vocab["<pad>"], pad_token_id=vocab["<pad>"],
    )  # fmt: skip
    torch.manual_seed(0)  # every node starts from the same model (the run's creator uploads it anyway)
    return GPT2LMHeadModel(config)


def windows(ids: torch.Tensor, block: int, count: int, seed: int) -> torch.Tensor:
    """``count`` windows of ``block`` characters from the training part (the first 90%), by ``seed``."""
    train = ids[: len(ids) * 9 // 10]
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train) - block, (count,), generator=g)
    return torch.stack([train[s : s + block] for s in starts.tolist()])


@torch.no_grad()
def heldout_loss(lm: Any, ids: torch.Tensor, block: int) -> float:
    """Mean loss over the last 10% of the text, in consecutive windows."""
    rest = ids[len(ids) * 9 // 10 :]
    rows = torch.stack([rest[i : i + block] for i in range(0, len(rest) - block + 1, block)])
    lm.eval()
    return float(lm(input_ids=rows, labels=rows).loss)


class SmoothedLM(torch.nn.Module):
    """What a Trainer user often writes: the language model inside a module of their own (here to
    train with label smoothing). Its parameters are named ``model.transformer...``; the run's names
    are the language model's, so the callback is given ``module="model"``."""

    def __init__(self, lm: Any, smoothing: float = 0.1) -> None:
        super().__init__()
        self.model, self.smoothing = lm, smoothing

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.model(input_ids=input_ids).logits[:, :-1]
        target = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), label_smoothing=self.smoothing
        )
        return {"loss": loss}


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


# ---- the nodes --------------------------------------------------------------------------------


def algorithm(args: argparse.Namespace) -> gm.DiLoCo:
    # Standard DiLoCo: every round waits for the contributions of all the run's nodes.
    return gm.DiLoCo(
        sync_every=args.sync_every, fragments=2, in_flight=1, overlap_steps=0,
        quorum_size=args.quorum, merge=gm.WeightedMean(),
    )  # fmt: skip


class Watch:
    """The node's own record: who merged into each round it aligned with, and whether the LM head
    is still the token embedding (one tensor) after every commit."""

    def __init__(self, lm: Any) -> None:
        self.lm, self.aligned, self.tie_checks, self.untied = lm, [], 0, 0

    def __call__(self, event: gm.events.Event) -> None:
        if isinstance(event, gm.events.Aligned):
            self.aligned.append([event.round, sorted(event.participants)])
            head, embedding = self.lm.lm_head.weight, self.lm.transformer.wte.weight
            self.tie_checks += 1
            self.untied += int(head is not embedding or head.data_ptr() != embedding.data_ptr())


def node_options(args: argparse.Namespace, watch: Watch) -> dict[str, Any]:
    return {
        "learner_id": args.node, "wait_for_learners": args.quorum, "wait_timeout": 300,
        "poll_interval": 0.1, "lease_timeout": 30.0, "callbacks": (gm.log_events, watch),
    }  # fmt: skip


def hf_args(args: argparse.Namespace, out: Path, sft: bool = False) -> Any:
    common = dict(
        output_dir=str(out / f"hf-{args.node}"), use_cpu=not torch.cuda.is_available(), max_steps=args.steps,
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulate, learning_rate=args.lr,
        lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_steps=max(args.steps // 4, 1),
        disable_tqdm=True, seed=args.seed,
    )  # fmt: skip
    if sft:
        from trl import SFTConfig

        return SFTConfig(**common, max_length=SIZES[args.size][3], packing=False)
    from transformers import TrainingArguments

    return TrainingArguments(**common)


def run_trainer(args: argparse.Namespace, lm: Any, rows: torch.Tensor, watch: Watch, out: Path) -> int:
    from transformers import Trainer

    from gradientmail_lightning import GradientMailTrainerCallback

    callback = GradientMailTrainerCallback(
        algorithm=algorithm(args), mailbox=args.mailbox, module="model", **node_options(args, watch)
    )
    trainer = Trainer(model=SmoothedLM(lm), args=hf_args(args, out), train_dataset=Rows(rows), callbacks=[callback])
    trainer.train()
    return callback.driver.steps


def run_sft(args: argparse.Namespace, lm: Any, rows: torch.Tensor, watch: Watch, out: Path, vocab: dict) -> int:
    import datasets
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTTrainer

    from gradientmail_lightning import GradientMailTrainerCallback

    datasets.disable_progress_bars()
    # A BPE without merges splits text into characters: the same ids as ``encode``.
    chars = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=chars, unk_token="<unk>", pad_token="<pad>", eos_token="<pad>")
    data = datasets.Dataset.from_dict({"input_ids": rows.tolist()})  # already tokenized: SFT trains on them as they are
    callback = GradientMailTrainerCallback(algorithm=algorithm(args), mailbox=args.mailbox, **node_options(args, watch))
    trainer = SFTTrainer(
        model=lm,
        args=hf_args(args, out, sft=True),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    trainer.train()
    return callback.driver.steps


def run_lightning(args: argparse.Namespace, lm: Any, rows: torch.Tensor, watch: Watch, out: Path) -> int:
    from lightning.pytorch import LightningModule, Trainer

    from gradientmail_lightning import MailboxDiLoCoStrategy

    class LitLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = lm  # the run's parameters: module="model"

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=args.lr, weight_decay=0.0)

    strategy = MailboxDiLoCoStrategy(
        algorithm=algorithm(args), mailbox=args.mailbox, module="model", **node_options(args, watch)
    )
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(out / f"pl-{args.node}"),
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(Rows(rows), batch_size=args.batch, shuffle=False)
    trainer.fit(LitLM(), loader)
    return strategy.callback.driver.steps


def run_plain(args: argparse.Namespace, lm: Any, rows: torch.Tensor, watch: Watch, out: Path) -> int:
    options = node_options(args, watch)
    wait, timeout = options.pop("wait_for_learners"), options.pop("wait_timeout")
    optimizer = torch.optim.AdamW(lm.parameters(), lr=args.lr, weight_decay=0.0)
    mailbox = gm.open_mailbox(args.mailbox)
    with gm.Session(lm, algorithm=algorithm(args), mailbox=mailbox, **options) as session:
        session.wait_for(wait, timeout=timeout)
        for step in range(args.steps):
            batch = rows[step * args.batch : (step + 1) * args.batch]
            loss = lm(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            session.step(samples=len(batch))
        return session.progress.local_step


def run_node(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the nodes share this machine's cores
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("gradientmail").setLevel(logging.INFO)
    kind = args.node.split("-")[0]
    out = Path(args.out or tempfile.mkdtemp(prefix=f"gm-hf-{args.node}-"))  # never the current directory
    text = TEXT.read_text()
    vocab = vocabulary(text)
    lm = make_lm(args.size, vocab)
    count = args.steps * args.batch * (args.accumulate if kind in ("trainer", "sft") else 1)
    rows = windows(encode(text, vocab), SIZES[args.size][3], count, seed=args.seed)
    watch = Watch(lm)
    runs = {"trainer": run_trainer, "lightning": run_lightning, "plain": run_plain}
    if kind == "sft":
        steps = run_sft(args, lm, rows, watch, out, vocab)
    else:
        steps = runs[kind](args, lm, rows, watch, out)
    rank = int(os.environ.get("RANK", "0"))  # a Trainer node of several processes: rank 0 holds the session
    if args.out and rank == 0:
        report = {"node": args.node, "steps": steps, "aligned": watch.aligned, "tie_checks": watch.tie_checks,
                  "untied": watch.untied, "head_is_embedding": lm.lm_head.weight is lm.transformer.wte.weight}  # fmt: skip
        (out / f"{args.node}.json").write_text(json.dumps(report))
    if args.out:
        suffix = f".rank{rank}" if rank else ""
        np.savez(out / f"{args.node}{suffix}.npz", **{n: p.detach().numpy() for n, p in lm.named_parameters()})


def launch(args: argparse.Namespace) -> None:
    """Start every node of ``--kinds`` as a process, wait for all, then evaluate the newest commit."""
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown}; choose from {list(KINDS)}")
    need = missing_packages(kinds)
    if need is not None:
        raise SystemExit(need)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gm-hf-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.mailbox is None:
        args.mailbox = f"file://{out / 'mailbox'}"  # a fresh run each time, beside its logs
    print(f"{len(kinds)} nodes ({', '.join(kinds)}) on {args.mailbox}; logs, reports and parameters in {out}")
    common = ["--mailbox", args.mailbox, "--quorum", str(len(kinds)), "--out", str(out), "--size", args.size]
    common += ["--steps", str(args.steps), "--batch", str(args.batch), "--sync-every", str(args.sync_every)]
    common += ["--lr", str(args.lr), "--accumulate", str(args.accumulate)]
    procs = []
    for i, kind in enumerate(kinds):
        cmd = [sys.executable, __file__]
        if kind == "trainer" and args.processes > 1:
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            cmd = [torchrun, "--standalone", f"--nproc_per_node={args.processes}", __file__]
        node = [*cmd, "--as-node", kind, "--seed", str(i + 1), *common]
        with open(out / f"{kind}.log", "wb") as log:  # a session each: a node is killed with its processes
            procs.append(subprocess.Popen(node, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    start, shown = time.monotonic(), time.monotonic()
    while any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs):
        time.sleep(0.5)
        if time.monotonic() - shown >= PROGRESS_EVERY:
            shown = time.monotonic()
            print(f"{shown - start:6.0f} s  {progress(args.mailbox, args, kinds, procs)}", flush=True)
    for p in procs:  # one node failed: the others would wait for it until their timeout
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    failed = [kinds[i] for i, p in enumerate(procs) if p.wait() != 0]
    if failed:
        tails = "".join(f"\n--- the end of {out / f'{k}.log'}:\n{log_tail(out / f'{k}.log')}" for k in failed)
        raise SystemExit(f"nodes {failed} failed; see their logs in {out}{tails}")
    text = TEXT.read_text()
    vocab = vocabulary(text)
    lm = make_lm(args.size, vocab)
    ids = encode(text, vocab)
    before = heldout_loss(lm, ids, SIZES[args.size][3])
    newest = gm.align(lm, mailbox=gm.open_mailbox(args.mailbox))
    after = heldout_loss(lm, ids, SIZES[args.size][3])
    summary = {"kinds": kinds, "newest_round": newest, "heldout_before": before, "heldout_after": after}
    (out / "summary.json").write_text(json.dumps(summary))
    print(f"{len(kinds)} nodes ({', '.join(kinds)}): newest round {newest}, held-out loss {before:.3f} -> {after:.3f}")


def progress(url: str, args: argparse.Namespace, kinds: list[str], procs: list[Any]) -> str:
    """One line: rounds committed so far (about ``steps * fragments / sync_every`` in all), nodes running."""
    from gradientmail_core.cli.overview import round_numbers

    running = [k for k, p in zip(kinds, procs, strict=True) if p.poll() is None]
    try:
        rounds = len(round_numbers(gm.open_mailbox(url)))
    except gm.GradientMailError:
        rounds = 0
    total = args.steps * 2 // args.sync_every  # two fragments (algorithm)
    what = f"{rounds} of {total} rounds committed" if rounds else "loading and joining (no round committed yet)"
    return f"{what}; running: {', '.join(running) or 'none'}"


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mailbox", help="mailbox URL (file:///..., s3://...; default: a new directory under --out)")
    ap.add_argument("--kinds", default="trainer,lightning,plain", help="the nodes to start: " + ",".join(KINDS))
    ap.add_argument(
        "--as-node", dest="node", help="run this one node: trainer, lightning, plain or sft (-x suffixes name it)"
    )
    ap.add_argument("--quorum", type=int, default=3, help="with --node: the number of nodes in the run")
    ap.add_argument("--processes", type=int, default=1, help="processes of the Trainer node (DDP under torchrun)")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps of each node")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step (Trainer, SFT)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sync-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1, help="with --node: this node's data order")
    ap.add_argument("--out", help="reports, logs and each node's final parameters (default: a new temporary directory)")
    args = ap.parse_args()
    if args.node:
        run_node(args)
    else:
        start = time.monotonic()
        launch(args)
        print(f"took {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
