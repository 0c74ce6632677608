"""``GradientMailKerasCallback``: a Keras 3 ``model.fit`` as a node of a gradientmail run, on the
jax, torch and tensorflow backends.

    model.fit(x, y, batch_size=32, callbacks=[GradientMailKerasCallback(
        algorithm=gm.DiLoCo(sync_every=100, fragments=4), mailbox="s3://bucket/runs/run-1",
        samples_per_batch=32)])

The session opens in ``on_train_begin`` (the model is built by then) on the model's trainable
variables (``gradientmail_core/adapters/keras.py``: names from ``Variable.path`` without the
model's name), steps once per train batch in ``on_train_batch_end`` (``steps_per_execution=k``:
k steps, one call), and closes in ``on_train_end``, leaving the model at the newest committed
parameters. The ``gm/...`` metrics are added to the batch and epoch logs, so ``History`` and the
progress bar show them. A model whose automatic layer names (``dense_1``) differ from the run's
is refused with the advice to name its layers.
"""

from __future__ import annotations

from typing import Any

import gradientmail_core as gm
from gradientmail_core.adapters import adapter_for
from gradientmail_core.adapters.layouts import Layouts
from gradientmail_core.errors import MissingExtra, SchemaMismatch
from gradientmail_core.session import default_learner_id

try:
    import keras
except ImportError as e:  # pragma: no cover - exercised only without keras
    raise MissingExtra("keras") from e

from gradientmail_core.adapters.keras import KerasAdapter, explain

from .metrics import Metrics, metric_values
from .options import SessionOptions

_OWN_OPTIONS = ("samples_per_batch", "layouts", "log_metrics")


class GradientMailKerasCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Train this ``model.fit`` as a learner of a gradientmail run.

    Args:
        algorithm: the run's ``gm.DiLoCo(...)`` config.
        mailbox: a ``gm.Mailbox`` or a mailbox URL (``file:///...``, ``s3://bucket/prefix``).
        samples_per_batch: the samples (or tokens) one train batch holds, reported to the run as
            each step's weight (Keras does not tell callbacks its batch size); default 1.
        layouts: the convention the run's tensors are in, when it is not Keras' own:
            ``"torch"`` for a run of torch or MLX nodes (``gradientmail_core/adapters/layouts.py``).
        names: this node's parameter names (after ``layouts``) -> the run's, a dict or a callable.
        log_metrics: add the session's metrics (``gm/round``, ...) to the Keras logs.
        **options: the other options of :class:`~gradientmail_lightning.options.SessionOptions`
            (``wait_for_learners``, ``learner_id``, ``poll_interval``, ``lease_timeout``, ...).
    """

    def __init__(
        self,
        *,
        algorithm: gm.DiLoCo,
        mailbox: gm.Mailbox | str,
        samples_per_batch: int = 1,
        layouts: Layouts | None = None,
        log_metrics: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.options = SessionOptions.from_kwargs(
            owner, {"algorithm": algorithm, "mailbox": mailbox, **options}, also=_OWN_OPTIONS
        )
        self.options.check(owner)
        if self.options.module is not None:
            raise ValueError(f"{owner}(module=...): the run is the fitted model's trainable variables; leave it unset")
        if not isinstance(samples_per_batch, int) or samples_per_batch < 0:
            raise ValueError(f"{owner}(samples_per_batch={samples_per_batch!r}): expected an int >= 0")
        self.samples_per_batch = samples_per_batch
        self.layouts = layouts
        self.log_metrics = log_metrics
        self.session: gm.Session | None = None
        self.metrics = Metrics()
        self.steps = 0
        self.samples = 0
        self._last_batch = -1

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        opts = self.options
        native = KerasAdapter(self.model)
        adapter = adapter_for(native, names=opts.names, layouts=self.layouts)
        mailbox = gm.open_mailbox(opts.mailbox) if isinstance(opts.mailbox, str) else opts.mailbox
        self.metrics = Metrics()
        kwargs = {
            **opts.session_kwargs(),
            "learner_id": opts.learner_id or default_learner_id(),
            "callbacks": (*opts.callbacks, self.metrics),
        }
        session = gm.Session(adapter, algorithm=opts.algorithm, mailbox=mailbox, **kwargs)
        try:
            session.open()
        except SchemaMismatch as e:
            fix = explain(native, e)
            if fix is None:
                raise
            raise SchemaMismatch(e.differences, fix=fix) from e
        self.session = session
        try:
            if opts.wait_for_learners is not None:
                session.wait_for(opts.wait_for_learners, timeout=opts.wait_timeout)
        except BaseException as e:
            self._abort(e)
            raise
        self._last_batch = -1

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._last_batch = -1  # Keras numbers the batches of each epoch from 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        session = self._session()
        steps = max(batch - self._last_batch, 1)  # steps_per_execution: one call for several steps
        self._last_batch = batch
        try:
            for _ in range(steps):
                session.step(samples=self.samples_per_batch)
        except BaseException as e:
            self._abort(e)
            raise
        self.steps += steps
        self.samples += steps * self.samples_per_batch
        if self.log_metrics and logs is not None:
            logs.update(self.values())

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.log_metrics and logs is not None and self.session is not None:
            logs.update(self.values())

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()

    def values(self) -> dict[str, float]:
        """The session's metrics (``{}`` outside training)."""
        if self.session is None:
            return {}
        return metric_values(self.session, self.metrics, steps=self.steps, samples=self.samples)

    def _session(self) -> gm.Session:
        if self.session is None:
            raise RuntimeError(f"{type(self).__name__}: the session is not open (fit has not begun)")
        return self.session

    def _abort(self, error: BaseException) -> None:
        """Training failed: leave the run at once (Keras has no callback for a failed ``fit``)."""
        session, self.session = self.session, None
        if session is not None:
            session.__exit__(type(error), error, error.__traceback__)
