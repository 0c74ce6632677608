"""``gm.Session``: the user's handle on a run, used inside their own training loop.

The session checks its arguments and keeps the user's view (``progress``, ``batch_size``); the
engine runs in its host (``syncer/host.EngineHost``), chosen once, here, from the model: one
process (``syncer/host.ProcessHost``) or one rank of a sharded node
(``sharded/runtime.sharded_host``).
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import events as ev
from .adapters import adapter_for
from .adapters.base import Adapter
from .adapters.layouts import Layouts
from .adapters.naming import Names
from .clock import Clock
from .config import DiLoCo
from .mailbox import Mailbox
from .protocol import keys
from .protocol.auth import policy as auth_policy
from .protocol.guard import GuardedMailbox
from .protocol.members import MemberAuth
from .protocol.store import RunStore
from .protocol.tape import load_newest
from .syncer.host import EngineHost, HostSetup, ProcessHost, Progress
from .syncer.options import NodeOptions

if TYPE_CHECKING:
    from .adapters.torch_sharded import ShardedParams
    from .syncer.learner import Learner
    from .syncer.node import Node

__all__ = ["Progress", "Session", "align", "default_learner_id"]

_DEFAULT = NodeOptions()  # (the keywords' defaults are the options')


def default_learner_id() -> str:
    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-") or "node"
    return f"{host[:48].strip('-') or 'node'}-{os.getpid()}"


class Session:
    def __init__(
        self,
        model: Any,
        *,
        algorithm: DiLoCo,
        mailbox: Mailbox,
        learner_id: str | None = None,
        role: str | None = None,
        poll_interval: float = _DEFAULT.poll_interval,
        lease_timeout: float = _DEFAULT.lease_timeout,
        lease_every: float | None = None,
        round_timeout: float | None = None,
        close_timeout: float | None = None,
        compression: str = _DEFAULT.compression,
        callbacks: Sequence[Callable[[ev.Event], None]] = _DEFAULT.callbacks,
        clock: Clock | None = None,
        seed: int | None = None,
        secret: bytes | str | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        identity: str | os.PathLike[str] | None = None,
        owner_key: str | os.PathLike[str] | None = None,
        anchors: str | None = None,
        verify: float = 0.0,
        names: Names | None = None,
        layouts: Layouts | None = None,
    ) -> None:
        me = keys.validate_learner_id(learner_id if learner_id is not None else default_learner_id())
        if not isinstance(algorithm, DiLoCo):
            raise TypeError(f"algorithm must be a gm.DiLoCo(...), found {type(algorithm).__name__}")
        if role not in (None, "both", "learner"):
            raise ValueError(
                f"role={role!r}: expected 'both' (train and close rounds) or 'learner' (train only); "
                "a node that only closes rounds is gm.Syncer (`gradientmail syncer URL --id NAME`)"
            )
        o = self.options = NodeOptions.of(locals())  # the keywords that name an option
        fixed = o.resolve(me, owner_key)  # docs/security.md: shared secret, identities, or neither
        self.auth, self.identity, self.clock, self.nonce = fixed.auth, fixed.identity, fixed.clock, fixed.nonce
        self.model = model
        # names=: this node's canonical parameter names -> the run's (adapters/naming.py); layouts=:
        # the axis orders and leaf names of another framework's layers (adapters/layouts.py)
        self.adapter = adapter_for(model, names=names, layouts=layouts)
        self._tree = _tree_of(self.adapter)  # a pytree of JAX arrays: step(params=...) swaps it
        self.algorithm = algorithm
        # role None: "both" (train and close rounds); a sharded node closes with every rank its part
        self.role = role if role is not None else "both"
        self.mailbox = mailbox
        self.callbacks = list(o.callbacks)
        self.close_timeout = close_timeout if close_timeout is not None else o.lease_timeout + 2 * o.round_timeout_floor
        # Where a sharded node's ranks keep their anchors ("device", "host", "disk"; None: "host"
        # on an accelerator, else "device"): sharded/anchors.py. A plain node keeps them as before.
        self.anchors = anchors
        setup = HostSetup(
            adapter=self.adapter,
            algorithm=algorithm,
            mailbox=mailbox,
            auth=self.auth,
            options=self.options,
            clock=self.clock,
            role=self.role,
            nonce=self.nonce,
            rng=fixed.rng,
            close_timeout=self.close_timeout,
            emit=self.emit,
        )
        self.host: EngineHost = _host_for(setup, fixed.learner_id, anchors)

    # ---- what the host runs -------------------------------------------------------------

    @property
    def learner_id(self) -> str:
        return self.host.learner_id

    @property
    def node(self) -> Node | None:
        """The node this process runs (None before ``open``, and on a sharded node's ranks > 0)."""
        return self.host.node

    @property
    def learner(self) -> Learner | None:
        return self.host.learner

    # ---- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> Session:
        self.open()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.close()
        else:
            self.host.abort()  # the loop failed: leave without waiting for rounds

    def emit(self, event: ev.Event) -> None:
        ev.deliver(self.callbacks, event)

    def open(self) -> None:
        """Join the run (creating it if the mailbox is empty) and start the background work.
        On a sharded model, collective: every rank opens (``docs/sharding.md``)."""
        self.host.open()

    # ---- the training loop ------------------------------------------------------------

    def step(self, samples: int = 1, *, params: Any = None) -> Any:
        """Call once per optimizer step, with the samples (or tokens) that step processed. On a
        sharded model every rank calls it (a collective), with the node's samples.

        A session opened on a pytree of JAX arrays takes the step's new tree, ``params``, and
        returns the tree to train on next (the same one, or one with aligned leaves):
        ``params = session.step(samples=n, params=params)``."""
        if self._tree is None:
            if params is not None:
                raise TypeError("step(params=...) is for a session opened on a pytree of JAX arrays")
            self.host.step(samples)
            return None
        if params is None:
            raise TypeError(
                "this session trains a pytree of JAX arrays: pass the new tree and train on the one returned, "
                "params = session.step(samples=n, params=params)"
            )
        self._tree.params = params
        self.host.step(samples)
        return self._tree.params

    @property
    def params(self) -> Any:
        """A JAX pytree session's newest tree (after ``open``: the run's parameters); else None."""
        return None if self._tree is None else self._tree.params

    @property
    def batch_size(self) -> int | None:
        g = self.algorithm.global_batch_size
        return None if g is None else math.ceil(g / max(self.host.progress.live_learners, 1))

    @property
    def rounds_seen(self) -> int:
        return self.host.progress.rounds_seen

    @property
    def progress(self) -> Progress:
        """The run as this session sees it; on a sharded node's ranks > 0, rank 0's view and
        this rank's own step counts."""
        return self.host.progress

    def wait_for(self, learners: int, timeout: float | None = None) -> None:
        """Block until ``learners`` distinct learners (this one included) have been seen since
        the wait began: live at a listing of the leases, or contributing. A learner that joined
        and left again between two looks still counts, so two learners waiting for each other
        cannot miss one another. On a sharded model it waits on rank 0 only (the other ranks
        return at once, and wait in their next ``step`` for rank 0)."""
        self.host.wait_for(learners, timeout)

    # ---- leaving ----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for this node's rounds in flight, then load the newest committed parameters.
        On a sharded model, collective: every rank closes."""
        self.host.close()


def _tree_of(adapter: Any) -> Any:
    """The ``TreeParams`` behind ``adapter`` (through renaming and layouts), or None. Its module is
    loaded only for a pytree of JAX arrays, so a torch or MLX model never imports JAX here."""
    jax_mod = sys.modules.get(f"{__package__}.adapters.jax")
    while jax_mod is not None and adapter is not None:
        if isinstance(adapter, jax_mod.JaxAdapter):
            return adapter.source if isinstance(adapter.source, jax_mod.TreeParams) else None
        adapter = getattr(adapter, "inner", None)  # base.Renamed, layouts.Laid
    return None


def _sharded_params(adapter: Adapter) -> ShardedParams | None:
    """The FSDP parameters behind ``adapter``, when the model is sharded (its module is loaded
    only for such a model, so a plain model never imports torch here)."""
    sharded_mod = sys.modules.get(f"{__package__}.adapters.torch_sharded")
    if sharded_mod is not None and isinstance(adapter, sharded_mod.ShardedTorchAdapter):
        params: ShardedParams = adapter.sharded
        return params
    return None


def _host_for(setup: HostSetup, learner_id: str, anchors: str | None) -> EngineHost:
    """The engine host for this session's model: chosen once, when the session is built."""
    sharded = _sharded_params(setup.adapter)
    if sharded is not None and setup.options.verify > 0:
        raise ValueError(
            f"verify={setup.options.verify!r}: a sharded node's ranks hold no whole fragment to recompute a commit "
            "with; leave verify at 0 and check the run with `gradientmail verify URL` instead"
        )
    if sharded is None:
        if anchors is not None:
            raise ValueError(
                f"anchors={anchors!r} places a sharded (FSDP2) node's anchors; this model is not sharded, so leave it "
                "unset"
            )
        return ProcessHost(setup, learner_id)
    # Every rank of a sharded node opens this session; its host keeps them in step (docs/sharding.md).
    from .sharded.runtime import sharded_host

    return sharded_host(setup, learner_id, sharded, anchors=anchors)


def align(
    model: Any,
    *,
    mailbox: Mailbox,
    secret: bytes | str | None = None,
    secret_file: str | os.PathLike[str] | None = None,
    names: Names | None = None,
    layouts: Layouts | None = None,
) -> int:
    """Load the newest committed parameters into ``model`` without joining the run.

    Returns the newest committed round, or -1 if none has committed yet. An authenticated
    run needs its ``secret`` (or ``secret_file``); ``names`` maps the model's names to the run's
    and ``layouts`` as for ``Session``. A pytree of JAX arrays cannot change in place: align it with
    a ``Session`` instead and read ``session.params``.
    """
    adapter = adapter_for(model, names=names, layouts=layouts)
    if _tree_of(adapter) is not None:
        raise TypeError("gm.align cannot write into a pytree of JAX arrays (they are immutable): open a gm.Session")
    auth = MemberAuth(auth_policy(secret, secret_file))  # reads open, secret and members-only runs
    _, head, thetas = load_newest(RunStore(GuardedMailbox(mailbox, auth=auth), auth=auth), adapter.schema())
    for theta in thetas.values():
        adapter.write(theta)
    return head
