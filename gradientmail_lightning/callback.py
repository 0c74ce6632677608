"""``GradientMailCallback``: a Lightning callback that makes the Trainer's node a learner of a
gradientmail run.

It joins the run in ``on_train_start`` (after a checkpoint is restored, so a resumed node
rejoins under its old learner id and starts from the newest committed parameters), steps the
session in ``on_train_batch_end`` once per real optimizer step, and closes the session in
``on_train_end``, leaving the model at the newest committed parameters. Under DDP only global
rank 0 holds the session; alignments are mirrored to the other ranks at the same step. Under
``ModelParallelStrategy`` with FSDP2 (``fully_shard`` in ``configure_model``) every rank holds
a session of the same learner and steps it after each real optimizer step.
"""

from __future__ import annotations

from typing import Any

import gradientmail_core as gm
from gradientmail_core.errors import MissingExtra

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
    from typing_extensions import override
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise MissingExtra("lightning") from e

from gradientmail_core.adapters.naming import Select, select
from gradientmail_core.adapters.torch_sharded import find_sharded

from .driver import SamplesFn, SessionDriver, first_batch_len
from .options import SessionOptions

_PROGRESS_BAR = ("gm/round", "gm/live_learners")
# The callback's own options, besides those of SessionOptions.
_OWN_OPTIONS = ("samples_fn", "log_metrics")


def check_strategy(strategy: Any) -> None:
    """Refuse strategies whose parameters gradientmail cannot read: those that shard them other
    than as FSDP2 DTensors or FSDP1 flat parameters with the model's own parameters
    (``use_orig_params=True``), or run outside torch.distributed. ``ModelParallelStrategy`` and
    ``FSDPStrategy`` pass here; whether the module really is sharded is checked when training
    starts (``check_sharded_module``), after ``configure_model`` ran."""
    name = type(strategy).__name__
    if isinstance(strategy, FSDPStrategy):
        kwargs = getattr(strategy, "kwargs", {}) or {}
        if kwargs.get("use_orig_params") is False:
            raise ValueError(
                "Trainer(strategy=FSDPStrategy(use_orig_params=False)): the parameters become FSDP1 flat "
                "parameters, which no longer name the model's tensors; pass use_orig_params=True (Lightning's "
                "default)"
            )
        return
    if isinstance(strategy, DeepSpeedStrategy) or "XLA" in name:
        raise ValueError(
            f"gradientmail cannot train with Trainer(strategy={name}(...)): this strategy shards the parameters "
            "in its own format (DeepSpeed's partitions) or runs outside torch.distributed. Use "
            "Trainer(strategy=ModelParallelStrategy()) with fully_shard(...) in "
            "LightningModule.configure_model (FSDP2), Trainer(strategy=FSDPStrategy()) (FSDP1), and "
            "GradientMailCallback(...), or "
            "Trainer(strategy=MailboxDiLoCoStrategy(...)) (DDP: every rank holds the full model), or "
            "strategy='ddp' / a single device with GradientMailCallback(...)."
        )


def session_module(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    """The module the session opens on: ``FSDPStrategy`` wraps the LightningModule in its root FSDP1
    unit (whose flat parameter holds what no inner unit holds), so the session opens on that wrapper
    (its parameter names are the LightningModule's); any other strategy, the LightningModule."""
    wrapped = getattr(trainer.strategy, "model", None)
    if isinstance(trainer.strategy, FSDPStrategy) and wrapped is not None and wrapped is not pl_module:
        return wrapped
    return pl_module


def check_sharded_module(trainer: pl.Trainer, pl_module: pl.LightningModule, module: Select | None = None) -> None:
    """Under ``ModelParallelStrategy`` or ``FSDPStrategy`` with several processes, the module's
    trainable parameters (those of ``module=``, when given) must be sharded (FSDP2 on one 1-D mesh,
    ``Shard(0)``, or FSDP1 ``FULL_SHARD``: ``find_sharded`` says why not)."""
    if not isinstance(trainer.strategy, (ModelParallelStrategy, FSDPStrategy)) or trainer.world_size == 1:
        return
    root = session_module(trainer, pl_module)
    if find_sharded(select(root, module), root=root) is None:
        raise ValueError(
            f"Trainer(strategy=ModelParallelStrategy(...)) with {trainer.world_size} processes, but the "
            "LightningModule's parameters are plain tensors: each process would train its own copy. Call "
            "torch.distributed.fsdp.fully_shard on the module's layers and on the module in configure_model "
            "(gradientmail supports FSDP2 on a 1-D mesh; tensor parallelism is not supported)"
        )


class GradientMailCallback(Callback):
    """Train this Trainer's node as a learner of a gradientmail run.

    Args:
        algorithm: the run's ``gm.DiLoCo(...)`` config.
        mailbox: a ``gm.Mailbox`` or a mailbox URL (``file:///...``, ``s3://bucket/prefix``).
        module: the submodule whose parameters form the run, when the LightningModule holds the
            network (``self.net``: ``module="net"``; ``"model.backbone"``; or a callable given the
            LightningModule); its parameter names then start below it, as a plain node's do.
        names: this node's parameter names -> the run's (a dict or a callable), for a model named
            by another convention.
        samples_fn: ``batch -> int``, the samples (or tokens) a batch holds on this rank;
            default: the length of the batch's first tensor. The session is told the sum
            over the node's ranks and over the batches of one optimizer step.
        log_metrics: log the session's metrics (``gm/...``) through ``pl_module.log``.
        **options: the other options of :class:`~gradientmail_lightning.options.SessionOptions`
            (``wait_for_learners``, ``wait_timeout``, ``learner_id``, ``poll_interval``,
            ``lease_timeout``, ``compression``, ``callbacks``, ...).
    """

    def __init__(
        self,
        *,
        algorithm: gm.DiLoCo,
        mailbox: gm.Mailbox | str,
        samples_fn: SamplesFn | None = None,
        log_metrics: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        session_options = SessionOptions.from_kwargs(
            owner, {"algorithm": algorithm, "mailbox": mailbox, **options}, also=_OWN_OPTIONS
        )
        self.driver = SessionDriver(session_options, owner=owner)
        self.samples_fn: SamplesFn = samples_fn or first_batch_len
        self.log_metrics = log_metrics
        self._last_global_step = 0
        self._pending_samples = 0
        self._logged_round: int | None = None

    @property
    def session(self) -> gm.Session | None:
        """The live session while training: on rank 0 (on every rank of an FSDP2 node)."""
        return self.driver.session

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            check_strategy(trainer.strategy)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_sharded_module(trainer, pl_module, self.driver.options.module)
        self.driver.start(session_module(trainer, pl_module))
        self._last_global_step = trainer.global_step
        self._pending_samples = 0
        self._logged_round = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._pending_samples += int(self.samples_fn(batch))
        # global_step counts optimizer steps that really happened: none on the batches that
        # only accumulate gradients; one per optimizer.step() under manual optimization.
        steps = trainer.global_step - self._last_global_step
        if steps <= 0:
            return
        self._last_global_step = trainer.global_step
        samples, self._pending_samples = self._pending_samples, 0
        self.driver.step(samples, steps=steps)
        if self.log_metrics:
            self._log(trainer, pl_module)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bar = trainer.progress_bar_callback is not None
        if not (trainer.loggers or bar) or not self.driver.leader:
            return
        # self.log costs about a millisecond per value: log at the Trainer's logging cadence,
        # and whenever the round moves (for the progress bar).
        moved = self.driver.round != self._logged_round
        if not moved and trainer.global_step % max(getattr(trainer, "log_every_n_steps", 1), 1):
            return
        self._logged_round = self.driver.round
        for name, value in self.driver.values().items():
            pl_module.log(
                name,
                value,
                on_step=True,
                on_epoch=False,
                prog_bar=bar and name in _PROGRESS_BAR,
                logger=bool(trainer.loggers),
                batch_size=1,
                rank_zero_only=True,
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.driver.started:
            self.driver.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.driver.abort(exception)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.driver.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.driver.load_state_dict(state_dict)
