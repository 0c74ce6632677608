"""Hugging Face Accelerate: ``accelerator.register_gradientmail(model, optimizer, ...)``.

Importing this module (or ``gradientmail_lightning``) adds the method to
``accelerate.Accelerator``. The session steps from a post-step hook on the *inner*
optimizer: ``AcceleratedOptimizer.step`` calls the inner ``step`` only when gradients were
synchronized (not on the micro-batches of gradient accumulation) and only when the
GradScaler found no inf/NaN, so exactly the real optimizer steps count.

The session joins the run lazily (``start()``, entering the handle, or at the latest just
before the first real optimizer step), so that ``accelerator.load_state(...)`` called after
registering can restore the handle's state (its learner id) before the node rejoins.

With the FSDP plugin at ``fsdp_version=2`` the prepared model's parameters are DTensors
(``fully_shard``): every process then runs a session of the same learner, and the post-step
hook, which runs on every process after the same real optimizer step, steps each of them (the
session's per-step decision is a collective of the node's processes). A step the GradScaler
skips is skipped on every process alike (DTensor all-reduces the inf/NaN flag over the mesh).
FSDP1 (``fsdp_version=1``) with ``use_orig_params=True`` works the same way (each rank holds a
range of each of the model's tensors; the session opens on the wrapped root module); FSDP1's
flat parameters (``use_orig_params=False``, Accelerate's FSDP1 default) are refused.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

import gradientmail_core as gm
from gradientmail_core.errors import MissingExtra

try:
    import torch
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
except ImportError as e:  # pragma: no cover - exercised only without accelerate
    raise MissingExtra("accelerate") from e

from .driver import SessionDriver, overflowed
from .options import SessionOptions

_UNSUPPORTED = {
    DistributedType.FSDP: (
        "FSDP1 without use_orig_params=True shards flat parameters that no longer name the model's tensors "
        "(FullyShardedDataParallelPlugin(use_orig_params=True), or fsdp_version=2)"
    ),
    DistributedType.DEEPSPEED: "DeepSpeed owns the optimizer step and may shard the parameters",
    DistributedType.MEGATRON_LM: "Megatron-LM shards the parameters",
    DistributedType.XLA: "XLA runs outside torch.distributed",
}


def check_distributed_type(
    distributed_type: DistributedType, fsdp_version: int | None = None, use_orig_params: bool | None = None
) -> None:
    """Refuse Accelerate setups whose parameters gradientmail cannot read: FSDP1 with flat
    parameters (``use_orig_params`` not set), DeepSpeed, Megatron-LM, XLA. FSDP with
    ``fsdp_version=2`` (DTensor parameters), or ``fsdp_version=1`` with ``use_orig_params=True``
    (each rank a range of each of the model's tensors), is accepted."""
    if distributed_type == DistributedType.FSDP and (fsdp_version == 2 or use_orig_params):
        return
    why = _UNSUPPORTED.get(distributed_type)
    if why is not None:
        raise ValueError(
            f"register_gradientmail cannot train with distributed_type={distributed_type.value}: {why}, and "
            "gradientmail reads and writes whole parameters on rank 0, or FSDP2 DTensor shards on every rank. "
            "Use the FSDP plugin with fsdp_version=2 (or 1 with use_orig_params=True), or launch the node as plain data parallel "
            "(accelerate launch --multi_gpu, or torchrun) so every rank holds the full model, or use one process "
            "per node."
        )


def _fsdp1_root(model: Any) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FullyShardedDataParallel)


class GradientMailHandle:
    """What ``register_gradientmail`` returns: the node's membership in the run.

    Use it as a context manager, or call ``start()`` before training and ``close()`` after.
    ``close()`` waits for this node's rounds in flight and leaves the model at the newest
    committed parameters, on every rank. Registered for checkpointing with the accelerator.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        driver: SessionDriver,
        samples_per_step: int | None,
    ) -> None:
        self.accelerator = accelerator
        self.module = model
        self.driver = driver
        self.samples_per_step = samples_per_step
        self._pending_samples = 0
        self._hooks = [
            inner_optimizer.register_step_pre_hook(self._before_step),
            inner_optimizer.register_step_post_hook(self._after_step),
        ]
        self._closed = False

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> GradientMailHandle:
        """Join the run now (rank 0) and load the newest committed parameters on every rank.
        Call it on every process, after ``accelerator.load_state`` when resuming."""
        if self._closed:
            raise RuntimeError("this gradientmail handle is closed; register a new one")
        if not self.driver.started:
            self.driver.start(self.module)
        return self

    def close(self) -> None:
        """Wait for this node's rounds in flight, then set the model (every rank) to the
        newest committed parameters. Call it on every process."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        if self.driver.started:
            self.driver.close()

    def __enter__(self) -> GradientMailHandle:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.close()
        else:
            self._closed = True
            for h in self._hooks:
                h.remove()
            self.driver.abort(e)

    # ---- stepping -----------------------------------------------------------------------

    def add_samples(self, n: int) -> None:
        """Report samples (or tokens) this process trained on since the last optimizer step;
        overrides ``samples_per_step`` for that step (for variable batch sizes)."""
        self._pending_samples += int(n)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.driver.started and not self._closed:
            self.start()  # nobody called start(): join before the first real step lands

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._closed or overflowed(optimizer):  # (a fused optimizer's step the scaler told to skip)
            return
        if self._pending_samples:
            samples, self._pending_samples = self._pending_samples, 0
        else:
            samples = self.samples_per_step if self.samples_per_step is not None else 1
        self.driver.step(samples)

    # ---- observing ----------------------------------------------------------------------

    @property
    def session(self) -> gm.Session | None:
        """The live session while started: on the main process (on every process under FSDP2)."""
        return self.driver.session

    @property
    def steps(self) -> int:
        """Real optimizer steps counted (including those restored from a checkpoint)."""
        return self.driver.steps

    @property
    def metrics(self) -> dict[str, float]:
        """The session's metrics for ``accelerator.log(handle.metrics, step=...)``;
        empty except on the main process."""
        return self.driver.values()

    # ---- checkpoints (accelerator.save_state / load_state) -------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.driver.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.driver.load_state_dict(state_dict)


def register_gradientmail(
    self: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    algorithm: gm.DiLoCo,
    mailbox: gm.Mailbox | str,
    samples_per_step: int | None = None,
    **options: Any,
) -> GradientMailHandle:
    """Make this process's node a learner of a gradientmail run.

    Args:
        model, optimizer: as returned by ``accelerator.prepare``.
        algorithm: the run's ``gm.DiLoCo(...)``.
        mailbox: a ``gm.Mailbox`` or a mailbox URL.
        samples_per_step: samples (or tokens) one optimizer step trains on *this process*
            (its batch times the accumulation steps); the session is told the sum over the
            node's processes. Default 1 per step, unless ``handle.add_samples`` reports them.
        **options: the other options of :class:`~gradientmail_lightning.options.SessionOptions`
            (``module``: the submodule whose parameters form the run, an attribute path of the
            unwrapped model or a callable; ``names``, ``wait_for_learners``, ``learner_id``, ...).

    Call it on every process; only the main process talks to the mailbox (under FSDP2, every
    process moves its part of the payloads).
    """
    plugin = getattr(self.state, "fsdp_plugin", None)
    check_distributed_type(
        self.distributed_type, getattr(plugin, "fsdp_version", None), getattr(plugin, "use_orig_params", None)
    )
    if samples_per_step is not None and (not isinstance(samples_per_step, int) or samples_per_step < 0):
        raise ValueError(f"register_gradientmail(samples_per_step={samples_per_step!r}): expected an int >= 0")
    if isinstance(optimizer, AcceleratedOptimizer):
        inner = optimizer.optimizer
    elif isinstance(optimizer, torch.optim.Optimizer):
        inner = optimizer  # not prepared: every step counts, accumulation included
    else:
        raise TypeError(
            f"register_gradientmail(optimizer=...) expects the optimizer returned by accelerator.prepare, "
            f"found {type(optimizer).__name__}"
        )
    owner = "register_gradientmail"
    session_options = SessionOptions.from_kwargs(
        owner, {"algorithm": algorithm, "mailbox": mailbox, **options}, also=("samples_per_step",)
    )
    driver = SessionDriver(session_options, owner=owner)
    # FSDP1: the session opens on the wrapped root (its flat parameter holds what no inner unit
    # holds; its names are the model's); anything else, on the unwrapped model.
    module = model if _fsdp1_root(model) else self.unwrap_model(model)
    handle = GradientMailHandle(self, module, inner, driver, samples_per_step)
    self.register_for_checkpointing(handle)
    return handle


def install() -> None:
    """Add ``register_gradientmail`` to ``accelerate.Accelerator`` (idempotent)."""
    method: Callable[..., GradientMailHandle] = register_gradientmail
    Accelerator.register_gradientmail = method  # type: ignore[attr-defined]


install()
