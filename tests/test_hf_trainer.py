"""The Hugging Face ``Trainer`` as a gradientmail node (``GradientMailTrainerCallback``).

``examples/hf_trainer.py`` runs as a user starts it, tiny: a ``transformers.Trainer`` node (the
language model inside the Trainer's module, ``module="model"``, gradient accumulation 2, two DDP
processes under ``torchrun``: one node whose rank 0 talks to the store), a TRL
``SFTTrainer`` node, a Lightning node (``module="model"``) and a plain-loop node train one GPT-2-style
model in lockstep. What each node contributed is read from the run's records. In this process: the
steps that count (a skipped fp16 step does not), the metrics in the Trainer's logs, a resumed
checkpoint's place in the run, what is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from node_procs import round_records  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.protocol.run import read_manifest  # noqa: E402
from gradientmail_core.protocol.store import RunStore  # noqa: E402
from gradientmail_lightning import GradientMailTrainerCallback  # noqa: E402
from gradientmail_lightning.hf_trainer import check_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

FAST = {"poll_interval": 0.05, "lease_timeout": 5.0, "callbacks": ()}
STEPS, SYNC, BATCH = 8, 4, 4  # fragments=2: a round every 2 steps, 4 rounds


@pytest.mark.timeout(600)
def test_trainer_sft_lightning_and_plain_nodes_train_one_run_in_lockstep(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("lightning")
    out, mailbox = tmp_path / "out", tmp_path / "mb"
    cmd = [sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--kinds", "trainer,sft,lightning,plain"]
    cmd += ["--size", "tiny", "--steps", str(STEPS), "--sync-every", str(SYNC), "--batch", str(BATCH)]
    cmd += ["--accumulate", "2", "--processes", "2", "--mailbox", f"file://{mailbox}", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    logs = "".join((out / f"{k}.log").read_text(errors="replace")[-3000:] for k in ("trainer", "sft") if out.exists())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + logs
    nodes = ["lightning", "plain", "sft", "trainer"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["newest_round"] == 3 and summary["heldout_after"] < summary["heldout_before"]

    # Every round merged every node; each contribution covers the optimizer steps since the last
    # one, and the Trainer and SFT nodes report the samples of 2 micro-batches per step (the
    # Trainer node's summed over its 2 processes: one node, one learner).
    records = round_records(mailbox)
    assert sorted(records) == [0, 1, 2, 3]
    for r, rec in records.items():
        got = {p["learner"]: p for p in rec["participants"]}
        assert sorted(got) == nodes, r
        gap = {0: 2, 1: 4, 2: 4, 3: 4}[r]  # fragment 0 at steps 2 and 6, fragment 1 at 4 and 8
        assert {n: p["steps"] for n, p in got.items()} == dict.fromkeys(nodes, gap), r
        assert got["trainer"]["tokens"] == 2 * got["sft"]["tokens"] == gap * BATCH * 2 * 2
        assert got["plain"]["tokens"] == got["lightning"]["tokens"] == gap * BATCH

    # One schema for all: the language model's own names (module="model" dropped the wrappers'
    # prefix), the tied LM head under the token embedding's name only.
    manifest = read_manifest(RunStore(gm.FileMailbox(mailbox)))
    assert manifest is not None
    names = [s.name for s in manifest.schema]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert not any(n.startswith("model.") for n in names)
    # The Trainer node's second process mirrored every alignment of rank 0: the same bytes at the end.
    second = dict(np.load(out / "trainer.rank1.npz"))

    reports = {n: json.loads((out / f"{n}.json").read_text()) for n in nodes}
    finals = {n: dict(np.load(out / f"{n}.npz")) for n in nodes}
    for n, report in reports.items():
        assert report["steps"] == STEPS, n  # the Trainer's 16 micro-batches are 8 session steps
        assert [a[0] for a in report["aligned"]] == [0, 1, 2, 3] and all(a[1] == nodes for a in report["aligned"])
        assert report["tie_checks"] == 4 and report["untied"] == 0 and report["head_is_embedding"], n
        for name, value in finals[n].items():
            assert value.tobytes() == finals["plain"][name].tobytes(), (n, name)
    assert all(second[name].tobytes() == finals["trainer"][name].tobytes() for name in second)


# ---- in this process ------------------------------------------------------------------------


class _Loss(torch.nn.Module):
    """A linear model whose loss is inf on the forward passes listed in ``inf_at`` (1-based)."""

    def __init__(self, inf_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.inf_at, self.calls = inf_at, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        return {"loss": loss * float("inf") if self.calls in self.inf_at else loss}


class _Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.full((4,), (i % 17) / 17)
        return {"x": x, "y": x.sum(0, keepdim=True)}


def _args(tmp_path: Path, **kw: object) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "hf"), use_cpu=True, per_device_train_batch_size=4, report_to=[],
                save_strategy="no", disable_tqdm=True, logging_steps=2, max_grad_norm=0.0)  # fmt: skip
    return TrainingArguments(**{**base, **kw})  # type: ignore[arg-type]


LOCKSTEP = gm.DiLoCo(sync_every=4, fragments=2, in_flight=1, overlap_steps=0)  # each round committed in its step


def _callback(mailbox: gm.Mailbox, **kw: object) -> GradientMailTrainerCallback:
    return GradientMailTrainerCallback(algorithm=LOCKSTEP, mailbox=mailbox, **{**FAST, **kw})


class _SessionSteps(TrainerCallback):
    def __init__(self, gm_callback: GradientMailTrainerCallback) -> None:
        self.gm_callback, self.seen = gm_callback, []

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        session = self.gm_callback.session
        assert session is not None
        self.seen.append(session.progress.local_step)


def test_an_fp16_step_the_grad_scaler_skips_is_not_a_session_step(tmp_path: Path) -> None:
    model = _Loss(inf_at=(3, 6))
    cb = _callback(gm.MemoryMailbox(), samples_per_step=4)
    watch = _SessionSteps(cb)
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=8, fp16=True), train_dataset=_Data(),
                      callbacks=[cb, watch])  # fmt: skip
    # What the Trainer's Accelerator builds for fp16 on a GPU; its default optimizer (fused AdamW)
    # is called on an overflow too, told by the scaler to skip its update.
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    trainer.train()
    assert trainer.state.global_step == 8
    assert watch.seen == [1, 2, 2, 3, 4, 4, 5, 6]
    assert cb.skipped == 2 and cb.driver.steps == 6 and cb.driver.samples == 6 * 4


def test_gradient_accumulation_steps_the_session_once_per_optimizer_step_and_logs_its_metrics(tmp_path: Path) -> None:
    cb = _callback(gm.MemoryMailbox())
    watch = _SessionSteps(cb)
    trainer = Trainer(model=_Loss(), args=_args(tmp_path, max_steps=6, gradient_accumulation_steps=3),
                      train_dataset=_Data(), callbacks=[cb, watch])  # fmt: skip
    trainer.train()
    assert watch.seen == [1, 2, 3, 4, 5, 6]
    assert cb.driver.samples == 6 * 3 * 4  # per step: 3 micro-batches of 4
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [2, 4, 6]
    assert [h["gm/local_step"] for h in logged] == [2.0, 4.0, 6.0]
    assert [h["gm/round"] for h in logged] == [0.0, 1.0, 2.0]  # rounds at steps 2, 4 and 6
    assert 0 < logged[0]["gm/bytes_sent"] < logged[1]["gm/bytes_sent"] < logged[2]["gm/bytes_sent"]


def test_resume_from_checkpoint_rejoins_as_the_same_learner_with_its_counters(tmp_path: Path) -> None:
    mailbox = gm.FileMailbox(tmp_path / "mb")
    first = _callback(mailbox)
    args = _args(tmp_path, max_steps=4, save_strategy="steps", save_steps=4)
    Trainer(model=_Loss(), args=args, train_dataset=_Data(), callbacks=[first]).train()
    assert first.driver.learner_id is not None and first.driver.steps == 4
    # A new process, in effect: a fresh callback (no learner id given), resumed from the checkpoint.
    second = _callback(mailbox)
    model = _Loss()
    resumed = Trainer(model=model, args=_args(tmp_path, max_steps=6), train_dataset=_Data(), callbacks=[second])
    resumed.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-4"))
    assert second.driver.learner_id == first.driver.learner_id
    assert second.driver.steps == 6 and second.driver.samples == 6 * 4
    newest = _Loss()
    gm.align(newest, mailbox=mailbox)
    for a, b in zip(model.parameters(), newest.parameters(), strict=True):
        assert torch.equal(a, b)  # the node left the run's newest commit in its model


def test_deepspeed_and_rebuilt_callbacks_are_refused_saying_what_works() -> None:
    with pytest.raises(ValueError, match="DeepSpeed") as e:
        check_args(SimpleNamespace(deepspeed="ds_config.json"))  # type: ignore[arg-type]
    assert "fsdp_version" in str(e.value) and "torchrun" in str(e.value)
    with pytest.raises(ValueError, match="restore_callback_states_from_checkpoint"):
        check_args(SimpleNamespace(deepspeed=None, restore_callback_states_from_checkpoint=True))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="poll_interval"):
        GradientMailTrainerCallback(algorithm=gm.DiLoCo(sync_every=4, fragments=2), mailbox=gm.MemoryMailbox(), pol=1)


class _Uploads(gm.mailbox.ForwardingMailbox):
    """Records the size of every object written, by key."""

    def __init__(self, inner: gm.Mailbox) -> None:
        super().__init__(inner)
        self.sizes: dict[str, int] = {}

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.sizes[key] = len(data)
        return super().put_if_absent(key, data)

    def put_stream(self, key: str, chunks, *, create_once: bool = False) -> bool:  # type: ignore[no-untyped-def]
        parts = [bytes(c) for c in chunks]
        self.sizes[key] = sum(len(p) for p in parts)
        return super().put_stream(key, parts, create_once=create_once)


def _lora_lm(r: int, targets: tuple[str, ...] = ("c_attn",)):  # type: ignore[no-untyped-def]
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=64, n_layer=2, n_head=2, bos_token_id=None,
                        eos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=r, lora_alpha=8, target_modules=list(targets), fan_in_fan_out=True, lora_dropout=0.0)
    return peft.get_peft_model(GPT2LMHeadModel(config), lora)


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(16) * (i % 7 + 1)) % 50
        return {"input_ids": ids, "labels": ids}


def test_a_peft_lora_run_uploads_the_adapters_bytes_and_never_a_base_weight(tmp_path: Path) -> None:
    from gradientmail_core.protocol import keys

    model = _lora_lm(r=4)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapter_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    base_bytes = sum(t.numel() * 4 for t in base.values())
    assert base_bytes > 40 * adapter_bytes  # a model worth not sending
    mailbox = _Uploads(gm.MemoryMailbox())
    cb = GradientMailTrainerCallback(algorithm=gm.DiLoCo(sync_every=2, fragments=1), mailbox=mailbox, **FAST)
    args = _args(tmp_path, max_steps=6, learning_rate=1e-2)
    Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb]).train()
    manifest = read_manifest(RunStore(mailbox))
    assert manifest is not None and manifest.schema and all(".lora_" in s.name for s in manifest.schema)
    assert sum(s.shape[0] * s.shape[1] for s in manifest.schema) * 4 == adapter_bytes
    # Each contribution is one payload of the adapters' float32 bytes and a small header; so is
    # every commit and the initial parameters. Everything uploaded is a fraction of the base model.
    contributions = [n for k, n in mailbox.sizes.items() if k.startswith(keys.SNAPSHOT_BLOBS)]
    assert len(contributions) == 3
    for size in contributions:
        assert adapter_bytes < size < adapter_bytes + 4096, (size, adapter_bytes)
    assert sum(mailbox.sizes.values()) < base_bytes / 4
    for n, p in model.named_parameters():  # the base weights were trained on by nobody
        if n in base:
            assert torch.equal(p, base[n]), n
    # A node with another adapter config is told so before it trains.
    with pytest.raises(gm.SchemaMismatch, match="adapter config"):
        gm.Session(_lora_lm(r=8), algorithm=gm.DiLoCo(sync_every=2, fragments=1), mailbox=mailbox,
                   learner_id="other-rank", **FAST).open()  # fmt: skip
    with pytest.raises(gm.SchemaMismatch, match="adapter"):
        gm.Session(_lora_lm(r=4, targets=("c_attn", "c_proj")), algorithm=gm.DiLoCo(sync_every=2, fragments=1),
                   mailbox=mailbox, learner_id="other-targets", **FAST).open()  # fmt: skip
