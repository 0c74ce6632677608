"""What the Lightning callback and the Accelerate hook share: a ``gm.Session`` driven from a
trainer's hooks. A data-parallel node runs it on rank 0 and mirrors it to the other ranks
(``replicas.py``); a node whose parameters are FSDP2 DTensors runs it on every rank, under one
learner id, and the session keeps the ranks in step (``shards.py``).

The integrations only translate their framework's hooks into four calls: ``start`` (join the
run), ``step`` (after each real optimizer step), ``close`` (end of training) and ``abort``
(training failed). Checkpoint state and logged metrics live here too, so both integrations
save the same state and log the same names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

import gradientmail_core as gm
from gradientmail_core.adapters import adapter_for
from gradientmail_core.adapters.torch import TorchAdapter
from gradientmail_core.adapters.torch_sharded import ShardedTorchAdapter
from gradientmail_core.session import default_learner_id

from .metrics import Metrics, metric_values
from .options import SessionOptions
from .replicas import Replicas
from .shards import Shards

_log = logging.getLogger(__name__)
_STATE_FORMAT = 1


class SessionDriver:
    """Runs one ``gm.Session`` per training run for an integration.

    ``options`` (see :class:`SessionOptions`) say which run to join and how. A data-parallel
    node builds the session on rank 0 only; its other ranks never build one and never touch the
    mailbox. A sharded node (FSDP2 DTensor parameters) builds one on every rank, under rank 0's
    learner id, and every rank steps and closes it. ``wait_for_learners`` makes ``start`` block
    until that many learners are live, so the nodes of a run start training together. ``owner``
    names the integration in errors.
    """

    def __init__(self, options: SessionOptions, *, owner: str) -> None:
        options.check(owner)
        self.options = options
        self.owner = owner
        # Checkpointed state.
        self.learner_id: str | None = options.learner_id
        self.steps = 0
        self.samples = 0
        self.round = -1
        self._id_from_checkpoint = False
        # Per training run.
        self.session: gm.Session | None = None
        self.replicas: Replicas | None = None
        self.shards: Shards | None = None
        self.metrics = Metrics()
        # What builds a session (tests replace it to watch the calls each rank makes).
        self.session_factory: Callable[..., gm.Session] = gm.Session

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self.replicas is not None or self.shards is not None

    @property
    def leader(self) -> bool:
        group = self.replicas or self.shards
        return group is None or group.leader

    def start(self, module: torch.nn.Module) -> None:
        """Join the run and give every rank the newest committed parameters (a data-parallel
        node joins on rank 0 and mirrors; a sharded node joins on every rank). ``module``: what
        the trainer trains; the options' ``module`` and ``names`` pick and name its parameters."""
        if self.started:
            raise RuntimeError(f"{self.owner}: the session was already started; close it before starting again")
        # Every rank builds the same adapter: the parameters by their names in the run, found in the
        # module without its wrappers (ShardingUnsupported for a sharded layout it cannot cut).
        adapter = adapter_for(
            module, module=self.options.module, names=self.options.names, layouts=self.options.layouts
        )
        if isinstance(adapter, ShardedTorchAdapter):
            self._start_sharded(adapter, Shards(adapter.sharded))
            return
        assert isinstance(adapter, TorchAdapter), type(adapter)
        replicas = Replicas(list(adapter.params.items()))
        self.replicas = replicas
        if replicas.leader:
            try:
                self._open(adapter)
            except BaseException:
                replicas.mirror(None, failed=True)
                self.replicas = None
                raise
        try:
            replicas.mirror(None)
        except BaseException as e:
            self.abort(e)
            raise

    def _start_sharded(self, adapter: Any, shards: Shards) -> None:
        """Every rank opens a session under rank 0's learner id (opening is collective inside
        the session); rank 0 alone waits for the other learners, and every rank then agrees on
        whether that worked."""
        leader_id = (self.learner_id or default_learner_id()) if shards.leader else None
        self.learner_id = shards.same_id(leader_id)
        self.shards = shards
        try:
            self._open(adapter, wait=False, callbacks=shards.leader)
        except BaseException:
            self.shards = None
            raise
        session = self._session()
        error: BaseException | None = None
        if shards.leader:
            try:
                self._wait_for_learners(session)
                self.round = session.progress.round
            except BaseException as e:
                error = e
        if shards.agree(error is not None):
            failure = error or shards.failed_elsewhere("waiting for the other learners")
            self.abort(failure)
            raise failure

    def _open(self, adapter: Any, *, wait: bool = True, callbacks: bool = True) -> None:
        if self.learner_id is None:
            self.learner_id = default_learner_id()
        opts = self.options
        mailbox = gm.open_mailbox(opts.mailbox) if isinstance(opts.mailbox, str) else opts.mailbox
        self.metrics = Metrics()
        session_kwargs = {
            **opts.session_kwargs(),
            "learner_id": self.learner_id,
            # A sharded node's ranks > 0 keep only the metrics: the user's callbacks (by default
            # the event log) hear each event once, from rank 0.
            "callbacks": (*opts.callbacks, self.metrics) if callbacks else (self.metrics,),
        }
        session = self.session_factory(adapter, algorithm=opts.algorithm, mailbox=mailbox, **session_kwargs)
        session.open()
        self.session = session
        if not wait:
            return
        try:
            self._wait_for_learners(session)
        except BaseException as e:
            session.__exit__(type(e), e, e.__traceback__)
            self.session = None
            raise
        self.round = session.progress.round

    def _wait_for_learners(self, session: gm.Session) -> None:
        opts = self.options
        if opts.wait_for_learners is not None:
            session.wait_for(opts.wait_for_learners, timeout=opts.wait_timeout)
        self.metrics.changed_fragments.clear()

    def step(self, samples: int, steps: int = 1) -> None:
        """After ``steps`` real optimizer steps (on every rank) that processed ``samples``
        samples on this rank: step the session on rank 0, mirror alignments to the others
        (a sharded node: step the session on every rank)."""
        if self.shards is not None:
            self._step_sharded(self.shards, samples, steps)
            return
        replicas = self._replicas()
        total = replicas.total(int(samples))
        changed: set[str] | None = None
        if replicas.leader:
            session = self._session()
            try:
                for share in spread(total, steps):
                    session.step(samples=share)
            except BaseException:
                replicas.mirror(None, failed=True)
                raise
            changed = self._changed_names(session)
            self.round = session.progress.round
        replicas.mirror(changed)
        self.steps += steps
        self.samples += total

    def _step_sharded(self, shards: Shards, samples: int, steps: int) -> None:
        # Every rank makes the same calls: session.step is a collective of the node's ranks.
        total = shards.total(int(samples))
        session = self._session()
        for share in spread(total, steps):
            session.step(samples=share)
        if shards.leader:
            self.round = session.progress.round
        self.steps += steps
        self.samples += total

    def _changed_names(self, session: gm.Session) -> set[str]:
        fragments = self.metrics.changed_fragments
        if not fragments:
            return set()
        assert session.learner is not None
        plan = session.learner.run.fragments
        names = {n for f in fragments for n in plan[f]}
        fragments.clear()
        return names

    def close(self) -> None:
        """Wait for this node's rounds in flight, then give every rank the newest committed
        parameters (the session's ``close``). Collective: every rank calls it."""
        if self.shards is not None:
            shards, session = self.shards, self._session()
            try:
                session.close()  # collective on a sharded node
                if shards.leader:
                    self.round = session.progress.round
            finally:
                self._reset()
            return
        replicas = self._replicas()
        if replicas.leader:
            session = self._session()
            try:
                session.close()
            except BaseException:
                replicas.mirror(None, failed=True)
                self._reset()
                raise
            self.round = session.progress.round
        try:
            replicas.mirror(None)
        finally:
            self._reset()

    def abort(self, error: BaseException | None = None) -> None:
        """Training failed: leave the run at once, without collectives (peers may be gone)."""
        session = self.session
        self._reset()
        if session is not None:
            e = error or RuntimeError("training stopped")
            session.__exit__(type(e), e, e.__traceback__)

    def _reset(self) -> None:
        self.session = None
        self.replicas = None
        self.shards = None

    def _replicas(self) -> Replicas:
        if self.replicas is None:
            raise RuntimeError(f"{self.owner}: the session is not started")
        return self.replicas

    def _session(self) -> gm.Session:
        assert self.session is not None, "rank 0 (every rank of a sharded node) holds the session once started"
        return self.session

    # ---- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain values only (loadable by torch's weights-only checkpoint loader)."""
        return {
            "format": _STATE_FORMAT,
            "learner_id": self.learner_id,
            "steps": self.steps,
            "samples": self.samples,
            "round": self.round,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"{self.owner}: checkpoint state has format {state.get('format')!r}, expected {_STATE_FORMAT}; "
                "it was written by another version of gradientmail"
            )
        if self.started:
            raise RuntimeError(f"{self.owner}: load its state before the session starts (before training)")
        saved = state.get("learner_id")
        if saved is not None and self.learner_id is not None and saved != self.learner_id:
            _log.warning(
                "%s: keeping learner_id=%r given explicitly; the checkpoint was written by %r",
                self.owner,
                self.learner_id,
                saved,
            )
        elif saved is not None:
            self.learner_id = str(saved)
        self.steps = int(state["steps"])
        self.samples = int(state["samples"])
        self.round = int(state["round"])

    # ---- metrics ------------------------------------------------------------------------

    def values(self) -> dict[str, float]:
        """The metrics to log, on rank 0 (``{}`` on the other ranks and before the start)."""
        session = self.session
        if session is None or not self.leader:
            return {}
        return metric_values(session, self.metrics, steps=self.steps, samples=self.samples)


def overflowed(optimizer: Any) -> bool:
    """From a post-step hook of ``optimizer``: whether the GradScaler found inf/NaN gradients in this
    step. A scaler skips a plain optimizer's ``step`` then (its hooks never run), but calls the
    step of an optimizer that scales itself (fused AdamW, the Trainer's default) with ``found_inf``
    set for the step to skip its own update: the hook runs while ``found_inf`` is set. Reading the
    flag waits for the device (once per optimizer step, only under a scaler)."""
    found = getattr(optimizer, "found_inf", None)
    return found is not None and bool(found.item() if isinstance(found, torch.Tensor) else found)


def first_batch_len(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (searching tuples, lists and dicts),
    else ``len(batch)``, else 1."""
    t = _first_tensor(batch)
    if t is not None:
        return int(t.shape[0]) if t.dim() > 0 else 1
    try:
        return len(batch)
    except TypeError:
        return 1


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, Mapping):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        for item in x:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


SamplesFn = Callable[[Any], int]


def spread(samples: int, steps: int) -> list[int]:
    """``samples`` shared over ``steps`` optimizer steps taken on them (manual optimization that
    steps several times on one batch): as evenly as integers allow, the first steps taking the
    remainder. Each step reports its share, so a round that holds only some of those steps still
    weighs what it trained on (a contribution reporting no samples weighs nothing; a round of
    such contributions only could never close)."""
    share, extra = divmod(max(int(samples), 0), steps)
    return [share + (1 if i < extra else 0) for i in range(steps)]
