"""``MailboxDiLoCoStrategy``: ``Trainer(strategy=MailboxDiLoCoStrategy(...))``.

A node is one Lightning process (``devices=1``) or a DDP group (``devices>1``, or several
machines with ``num_nodes``): it is Lightning's ``DDPStrategy`` plus a
:class:`GradientMailCallback` that the strategy adds to the Trainer when it connects (a
strategy never sees ``on_train_batch_end``). Within the node DDP averages gradients every
step; across nodes gradientmail syncs parameters every few hundred steps through the mailbox.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import gradientmail_core as gm
from gradientmail_core.errors import MissingExtra

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy
    from typing_extensions import override
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise MissingExtra("lightning") from e

from .callback import GradientMailCallback


class MailboxDiLoCoStrategy(DDPStrategy):
    """Decoupled DiLoCo across nodes that share only a mailbox; DDP within a node.

    Args:
        algorithm, mailbox, **options: as for :class:`GradientMailCallback` (``module``, ``names``, ``samples_fn``,
            ``log_metrics``, ``wait_for_learners``, ``learner_id``, ``poll_interval``, ...: the
            callback's own options and those of
            :class:`~gradientmail_lightning.options.SessionOptions`).
        process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``.
        ddp_kwargs: passed to ``torch.nn.parallel.DistributedDataParallel``
            (e.g. ``{"find_unused_parameters": True}``).

    Runs on the CPU and CUDA accelerators. On Apple's MPS, which Lightning runs with no DDP
    strategy, use ``GradientMailCallback`` with the default strategy instead.
    """

    strategy_name = "mailbox_diloco"

    def __init__(
        self,
        *,
        algorithm: gm.DiLoCo,
        mailbox: gm.Mailbox | str,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        ddp_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        self.callback = GradientMailCallback(algorithm=algorithm, mailbox=mailbox, **options)
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **(ddp_kwargs or {}),
        )

    @property
    def session(self) -> gm.Session | None:
        """The live session, on rank 0 while training (None elsewhere)."""
        return self.callback.session

    @property
    def single_process(self) -> bool:
        """One process in the node: no process group, no DDP wrapper, no port to open."""
        return self.num_nodes * self.num_processes == 1

    @override
    def setup_distributed(self) -> None:
        if not self.single_process:
            super().setup_distributed()
            return
        # What DDPStrategy does besides opening the process group. Several one-process nodes
        # on one machine then never compete for MASTER_PORT.
        reset_seed()
        self.set_world_ranks()

    @override
    def configure_ddp(self) -> None:
        if not self.single_process:
            super().configure_ddp()

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        trainer = getattr(model, "_trainer", None)
        if trainer is None:
            return
        others = [c for c in trainer.callbacks if isinstance(c, GradientMailCallback) and c is not self.callback]
        if others:
            raise ValueError(
                "Trainer(strategy=MailboxDiLoCoStrategy(...), callbacks=[GradientMailCallback(...)]) would run "
                "two sessions: MailboxDiLoCoStrategy adds its own callback. Drop the GradientMailCallback, or use "
                "it alone with strategy='ddp'."
            )
        if self.callback not in trainer.callbacks:
            # First, so the other callbacks of a batch see the parameters after its alignment.
            trainer.callbacks.insert(0, self.callback)
