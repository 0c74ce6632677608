"""``GradientMailTrainerCallback``: the Hugging Face ``transformers.Trainer`` (and the TRL trainers
built on it, such as ``trl.SFTTrainer``) as a node of a gradientmail run.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[GradientMailTrainerCallback(algorithm=gm.DiLoCo(sync_every=100, fragments=4),
                                                             mailbox="s3://bucket/runs/run-1")])

The Trainer runs on Accelerate, and so does this callback's idea of a step, as in the Accelerate hook
(``accelerate.py``): a post-step hook on the *inner* optimizer counts the optimizer steps that really
happened (never a micro-batch of gradient accumulation, never a step the GradScaler skipped on an
fp16 overflow), and the session steps once per such step, in ``on_step_end``. Everything else is
the ``SessionDriver`` the Lightning callback and the Accelerate hook share: a DDP run under
``torchrun`` is one node whose rank 0 talks to the store (every rank mirrors its alignments), the
Trainer's FSDP (FSDP2, or FSDP1 with ``use_orig_params=True``, through its Accelerate plugin) is a
sharded node, every rank of it a session of the same learner.

The session opens in ``on_train_begin``, on the model the Trainer trains (``trainer.model``, the
user's model; under FSDP the wrapped one, whose canonical names are the model's), after a checkpoint
was loaded: ``trainer.train(resume_from_checkpoint=...)`` rejoins under the learner id and counters
saved with the checkpoint (in ``trainer_state.json``, as an ``ExportableState``) and starts from the
run's newest committed parameters. With PEFT only the trainable parameters, the adapters, are in
the run. The round metrics (``gm/...``) are added to every log the Trainer writes.
"""

from __future__ import annotations

import os
from typing import Any

import gradientmail_core as gm
from gradientmail_core.errors import MissingExtra

try:
    import torch
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import ExportableState
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise MissingExtra("transformers") from e

from .driver import SessionDriver, overflowed
from .options import SessionOptions

_OWN_OPTIONS = ("samples_per_step", "log_metrics")

DEEPSPEED_REFUSED = (
    "gradientmail cannot train under the Trainer's DeepSpeed integration: DeepSpeed owns the optimizer step and "
    "partitions the parameters in its own format. What works: plain data parallel (torchrun, every rank holds the "
    "full model: one node, rank 0 talks to the store), the Trainer's FSDP (fsdp='full_shard' with "
    "fsdp_config={'fsdp_version': 2}, or FSDP1 with use_orig_params=True: a sharded node), or one process per node"
)


def check_args(args: TrainingArguments) -> None:
    """Refuse what the callback cannot run: DeepSpeed, and the Trainer rebuilding callbacks from a
    checkpoint (it would construct this one without its algorithm and mailbox)."""
    if getattr(args, "deepspeed", None) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        raise ValueError(DEEPSPEED_REFUSED)
    if getattr(args, "restore_callback_states_from_checkpoint", False):
        raise ValueError(
            "TrainingArguments(restore_callback_states_from_checkpoint=True) makes the Trainer rebuild callbacks "
            "from their saved arguments, and this callback's mailbox and algorithm are not saved: leave it False. "
            "GradientMailTrainerCallback restores its own state (learner id, counters) from the checkpoint anyway"
        )


class GradientMailTrainerCallback(TrainerCallback, ExportableState):  # type: ignore[misc]
    """Train this Trainer's node as a learner of a gradientmail run.

    Args:
        algorithm: the run's ``gm.DiLoCo(...)`` config.
        mailbox: a ``gm.Mailbox`` or a mailbox URL (``file:///...``, ``s3://bucket/prefix``).
        module: the submodule whose parameters form the run: an attribute path of the model the
            Trainer trains (``"model"`` when it holds the network as ``self.model``), or a callable
            given that model; None: all of it.
        samples_per_step: samples (or tokens) one optimizer step trains on *this process*; default:
            ``per_device_train_batch_size`` times the micro-batches of that step. The session is told
            the sum over the node's processes.
        log_metrics: add the session's metrics (``gm/round``, ``gm/bytes_sent``, ...) to the Trainer's logs.
        **options: the other options of :class:`~gradientmail_lightning.options.SessionOptions`
            (``names``, ``wait_for_learners``, ``learner_id``, ``poll_interval``, ``lease_timeout``, ...).
    """

    def __init__(
        self,
        *,
        algorithm: gm.DiLoCo,
        mailbox: gm.Mailbox | str,
        module: Any = None,
        samples_per_step: int | None = None,
        log_metrics: bool = True,
        **options: Any,
    ) -> None:
        owner = type(self).__name__
        kwargs = {"algorithm": algorithm, "mailbox": mailbox, "module": module, **options}
        self.driver = SessionDriver(SessionOptions.from_kwargs(owner, kwargs, also=_OWN_OPTIONS), owner=owner)
        if samples_per_step is not None and (not isinstance(samples_per_step, int) or samples_per_step < 0):
            raise ValueError(f"{owner}(samples_per_step={samples_per_step!r}): expected an int >= 0")
        self.samples_per_step = samples_per_step
        self.log_metrics = log_metrics
        self._hooks: list[Any] = []
        self._real_steps = 0  # optimizer steps that happened since on_step_end last looked
        self._micro = 0  # micro-batches since the last optimizer step
        self.skipped = 0  # optimizer steps the Trainer counted and the optimizer did not take

    @property
    def session(self) -> gm.Session | None:
        """The live session while training: on rank 0 (on every rank of a sharded node)."""
        return self.driver.session

    # ---- the Trainer's events -----------------------------------------------------------

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        check_args(args)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        **kw: Any,
    ) -> None:
        check_args(args)
        if model is None or optimizer is None:
            raise RuntimeError(f"{type(self).__name__}: the Trainer passed no model or optimizer to on_train_begin")
        name = type(self).__name__
        saved = state.stateful_callbacks.get(name) if isinstance(state.stateful_callbacks, dict) else None
        if isinstance(saved, dict) and "gradientmail" in saved.get("attributes", {}):
            self.driver.load_state_dict(saved["attributes"]["gradientmail"])  # a resumed run: this node's place
        # The Trainer saves ExportableState callbacks by name, and fails on one its state does not
        # list yet (this callback added to a run resumed from a checkpoint made without it).
        state.stateful_callbacks.setdefault(name, self.state())
        inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
        self._hooks = [inner.register_step_post_hook(self._stepped)]
        self._real_steps = self._micro = 0
        self.driver.start(model)

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not overflowed(optimizer):
            self._real_steps += 1

    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._micro += 1  # a micro-batch of gradient accumulation

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        micro, self._micro = self._micro + 1, 0
        steps, self._real_steps = self._real_steps, 0
        if not self.driver.started:
            return
        if steps == 0:  # the Trainer counted a step the optimizer did not take (an fp16 overflow)
            self.skipped += 1
            return
        per_step = self.samples_per_step
        samples = per_step * steps if per_step is not None else micro * args.per_device_train_batch_size
        self.driver.step(samples, steps=steps)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        if not self.log_metrics or logs is None:
            return
        values = self.driver.values()  # {} except on rank 0 of a started session
        logs.update(values)
        history = state.log_history
        if values and history and history[-1].get("step") == state.global_step:
            history[-1].update(values)  # the entry the Trainer just made of these logs

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._unhook()
        if self.driver.started:
            self.driver.close()

    def abort(self, error: BaseException | None = None) -> None:
        """Leave the run at once (the Trainer has no event for a failed ``train()``): call it when
        ``trainer.train()`` raised, or let the lease run out."""
        self._unhook()
        self.driver.abort(error)

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---- checkpoints: trainer_state.json ------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"args": {}, "attributes": {"gradientmail": self.driver.state_dict()}}
