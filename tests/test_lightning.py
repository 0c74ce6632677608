"""The Lightning callback in this process: which batches step the session, what it reports,
what it saves, and what it refuses. Multi-process runs are in test_lightning_nodes.py."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402
from lightning_node import TinyRegressor, make_loader  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_lightning import GradientMailCallback, MailboxDiLoCoStrategy  # noqa: E402
from gradientmail_lightning.callback import check_strategy  # noqa: E402
from gradientmail_lightning.driver import spread  # noqa: E402

ALGO = gm.DiLoCo(sync_every=4, fragments=2)
FAST = {"poll_interval": 0.05, "lease_timeout": 3.0, "callbacks": ()}


class SessionSteps(Callback):
    """Records the session's own step counter after every batch (runs after the gm callback)."""

    def __init__(self, gm_callback: GradientMailCallback) -> None:
        self.gm_callback = gm_callback
        self.seen: list[int] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        session = self.gm_callback.session
        assert session is not None
        self.seen.append(session.progress.local_step)


def fit(model: LightningModule, callback: GradientMailCallback, batches: int, **trainer_kw: Any) -> SessionSteps:
    steps = SessionSteps(callback)
    trainer = Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        callbacks=[callback, steps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kw,
    )
    trainer.fit(model, make_loader(seed=1, n=16 * batches, batch=16))
    return steps


def test_gradient_accumulation_of_2_over_10_batches_gives_5_session_steps() -> None:
    cb = GradientMailCallback(algorithm=ALGO, mailbox=gm.MemoryMailbox(), learner_id="acc", **FAST)
    seen = fit(TinyRegressor(), cb, batches=10, accumulate_grad_batches=2)
    assert seen.seen == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5]
    assert cb.driver.steps == 5
    assert cb.driver.samples == 10 * 16  # both micro-batches of each step are reported
    assert cb.session is None  # closed in on_train_end


@pytest.mark.parametrize(
    ("steps_per_batch", "step_every", "expected"),
    [(2, 1, 10), (1, 2, 2)],
    ids=["two-steps-per-batch", "every-other-batch"],
)
def test_manual_optimization_counts_its_own_optimizer_steps(
    steps_per_batch: int, step_every: int, expected: int
) -> None:
    cb = GradientMailCallback(algorithm=ALGO, mailbox=gm.MemoryMailbox(), learner_id="manual", **FAST)
    model = TinyRegressor(manual=True, steps_per_batch=steps_per_batch, step_every=step_every)
    seen = fit(model, cb, batches=5)
    assert seen.seen[-1] == expected
    assert cb.driver.steps == expected
    assert len(model.losses) == expected


def test_several_optimizer_steps_on_one_batch_share_its_samples_so_no_round_weighs_nothing() -> None:
    # Three optimizer steps per batch, a round every two steps: the third round holds the last two
    # steps of the second batch. Each step reports its share of the batch (6, 5, 5), so that round
    # weighs what it trained on; reporting the batch on its first step only left it 0 tokens,
    # rejected, and a lone node waited for a commit that could not come.
    events: list[Any] = []
    cb = GradientMailCallback(
        algorithm=ALGO, mailbox=gm.MemoryMailbox(), learner_id="three", **{**FAST, "callbacks": (events.append,)}
    )
    model = TinyRegressor(manual=True, steps_per_batch=3)
    fit(model, cb, batches=4)
    published = [e for e in events if isinstance(e, gm.events.Published)]
    assert published and all(e.tokens > 0 for e in published), [(e.round, e.steps, e.tokens) for e in published]
    assert not [e for e in events if isinstance(e, gm.events.ContributionRejected)]
    assert cb.driver.steps == 12 and cb.driver.samples == 4 * 16


def test_a_batchs_samples_are_spread_over_its_steps_every_sample_counted_once() -> None:
    assert spread(16, 3) == [6, 5, 5] and spread(16, 1) == [16] and spread(2, 3) == [1, 1, 0] and spread(0, 2) == [0, 0]


def test_samples_fn_overrides_what_a_batch_reports() -> None:
    cb = GradientMailCallback(
        algorithm=ALGO, mailbox=gm.MemoryMailbox(), samples_fn=lambda batch: 3 * len(batch[0]), **FAST
    )
    fit(TinyRegressor(), cb, batches=4)
    assert cb.driver.samples == 4 * 3 * 16


def test_training_ends_with_the_newest_committed_parameters() -> None:
    mailbox = gm.MemoryMailbox()
    cb = GradientMailCallback(algorithm=ALGO, mailbox=mailbox, learner_id="solo", **FAST)
    model = TinyRegressor()
    fit(model, cb, batches=8)
    fresh = TinyRegressor()
    torch.nn.init.zeros_(fresh.net[0].weight)
    assert gm.align(fresh, mailbox=mailbox) >= 0
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name


def test_checkpoint_state_restores_learner_id_and_counters() -> None:
    cb = GradientMailCallback(algorithm=ALGO, mailbox=gm.MemoryMailbox(), **FAST)
    fit(TinyRegressor(), cb, batches=4)
    state = cb.state_dict()
    assert state["learner_id"] and state["steps"] == 4 and state["samples"] == 64
    again = GradientMailCallback(algorithm=ALGO, mailbox=gm.MemoryMailbox(), **FAST)
    again.load_state_dict(state)
    assert again.state_dict() == state
    with pytest.raises(ValueError, match="format"):
        again.load_state_dict({**state, "format": 99})


def test_fsdp1_is_accepted_with_the_models_own_parameters_and_refused_without() -> None:
    check_strategy(FSDPStrategy())  # FSDP1, use_orig_params=True (Lightning's default): the model's names
    with pytest.raises(ValueError, match="use_orig_params=True"):
        check_strategy(FSDPStrategy(use_orig_params=False))  # flat parameters named by FSDP
    check_strategy(ModelParallelStrategy())  # FSDP2: checked for DTensors at on_train_start


def test_strategy_refuses_a_second_gradientmail_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning exports MASTER_PORT, LOCAL_RANK... while setting up a DDP strategy: keep them here.
    monkeypatch.setattr(os, "environ", os.environ.copy())
    strategy = MailboxDiLoCoStrategy(algorithm=ALGO, mailbox=gm.MemoryMailbox(), **FAST)
    extra = GradientMailCallback(algorithm=ALGO, mailbox=gm.MemoryMailbox(), **FAST)
    trainer = Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        callbacks=[extra],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # connect() runs before any process group exists, so this stays in-process.
    with pytest.raises(ValueError, match="two sessions"):
        trainer.fit(TinyRegressor(), make_loader(seed=1, n=16, batch=16))


def test_configuration_errors_are_raised_before_training() -> None:
    with pytest.raises(TypeError, match="poll_intervall"):
        GradientMailCallback(algorithm=ALGO, mailbox=gm.MemoryMailbox(), poll_intervall=1.0)
    with pytest.raises(TypeError, match="gm.DiLoCo"):
        GradientMailCallback(algorithm={"sync_every": 4}, mailbox=gm.MemoryMailbox())
    with pytest.raises(ValueError, match="learner id"):
        MailboxDiLoCoStrategy(algorithm=ALGO, mailbox=gm.MemoryMailbox(), learner_id="Not Valid")
    with pytest.raises(ValueError, match="wait_for_learners"):
        GradientMailCallback(algorithm=ALGO, mailbox=gm.MemoryMailbox(), wait_for_learners=0)


def test_without_lightning_or_accelerate_the_package_imports_and_names_the_extra() -> None:
    code = """
import sys
sys.modules["lightning"] = None  # makes `import lightning...` raise ImportError
sys.modules["accelerate"] = None
import gradientmail_core as gm
import gradientmail_lightning
for name, extra in [("MailboxDiLoCoStrategy", "lightning"), ("GradientMailCallback", "lightning"),
                    ("register_gradientmail", "accelerate")]:
    try:
        getattr(gradientmail_lightning, name)
    except gm.MissingExtra as e:
        assert f"gradientmail[{extra}]" in str(e), e
    else:
        raise SystemExit(f"{name} imported without its framework")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_multi_process_launch_without_a_process_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun set WORLD_SIZE, but nobody initialized torch.distributed: every process would
    # otherwise join the run as its own "rank 0" under the same learner id.
    monkeypatch.setenv("WORLD_SIZE", "2")
    cb = GradientMailCallback(algorithm=ALGO, mailbox=gm.MemoryMailbox(), **FAST)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2"):
        cb.driver.start(TinyRegressor())
    assert cb.session is None
