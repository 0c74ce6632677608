"""The engine host: what a ``gm.Session`` delegates to.

The session is the user's object: its arguments, their checks, its properties. The engine runs in
a host, chosen once when the session is built, from the model:

- ``syncer/process_host.py`` (``ProcessHost``): the node is this process. A thread runs
  ``Node.tick`` (all of the node's I/O), the ``Learner`` runs on the training thread, the
  ``Bridge`` sits between them.
- ``sharded/runtime.py`` (``sharded_host``): this process is one rank of a sharded (FSDP) node.
  Rank 0 runs a ``ProcessHost`` whose learner records what every rank then does on its shards.

The session hands its host the settings below (``HostSetup``) and speaks to it only through
``EngineHost``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .. import events as ev
from ..adapters.base import Adapter
from ..clock import Clock
from ..config import DiLoCo
from ..mailbox import Mailbox
from ..protocol.auth import Policy
from ..protocol.guard import GuardedMailbox
from ..protocol.members import MemberAuth
from ..protocol.store import RunStore
from .bridge import View
from .state import NodeOptions

if TYPE_CHECKING:
    from .learner import Learner
    from .node import Node


@dataclass(frozen=True)
class Progress:
    """A read-only view of the run as this session sees it."""

    round: int
    versions: tuple[int, ...]
    live_learners: int
    local_step: int
    tokens: int
    rounds_seen: int
    closing_round: int | None

    @classmethod
    def of(cls, view: View, versions: Mapping[int, int], local_step: int, tokens: int) -> Progress:
        """The node's ``view`` with this learner's own counts (``versions``: fragment -> version)."""
        return cls(
            round=view.head,
            versions=tuple(versions[f] for f in sorted(versions)),
            live_learners=view.live,
            local_step=local_step,
            tokens=tokens,
            rounds_seen=view.rounds_seen,
            closing_round=view.closer_of,
        )


@dataclass(frozen=True, kw_only=True)
class HostSetup:
    """What a session hands its host: the node's settings, checked and fixed when it is built."""

    adapter: Adapter
    algorithm: DiLoCo
    mailbox: Mailbox
    auth: Policy | MemberAuth
    options: NodeOptions
    clock: Clock
    role: str  # "both" or "learner"
    nonce: str  # this process's, in its lease
    rng: random.Random  # draws the run id if this node creates the run, then the node's own draws
    close_timeout: float
    emit: Callable[[ev.Event], None]

    def store(self, learner_id: str) -> RunStore:
        """The run's store as ``learner_id`` reads it: guarded, authenticated as the run is."""

        def ignored(key: str, why: str) -> None:
            self.emit(ev.IgnoredObject(learner_id, key, why))

        guard = GuardedMailbox(self.mailbox, auth=self.auth, on_ignored=ignored)
        return RunStore(guard, auth=self.auth, on_ignored=ignored)


class EngineHost(Protocol):
    """Everything a session asks of its host."""

    @property
    def learner_id(self) -> str:
        """The id the node runs under (a sharded node's rank > 0 takes rank 0's when it opens)."""
        ...

    @property
    def node(self) -> Node | None:
        """The node this process runs (None before ``open``, and on a sharded node's ranks > 0)."""
        ...

    @property
    def learner(self) -> Learner | None:
        """The learner this process runs (None where ``node`` is)."""
        ...

    @property
    def progress(self) -> Progress:
        """The run as this node sees it, with this process's step counts."""
        ...

    def open(self) -> None:
        """Join the run (creating it if the mailbox is empty) and start the background work;
        nothing when open already. Collective on a sharded node."""
        ...

    def step(self, samples: int) -> None:
        """One optimizer step of ``samples``; raises ``SessionFailed`` for a failure of the
        background work. Collective on a sharded node."""
        ...

    def wait_for(self, learners: int, timeout: float | None) -> None:
        """Block until ``learners`` learners were seen since the wait began (``TimeoutError``)."""
        ...

    def close(self) -> None:
        """Wait for this node's rounds in flight, load the newest committed parameters and leave
        (raises ``SessionFailed`` for a failure on the way). Collective on a sharded node."""
        ...

    def abort(self) -> None:
        """Leave at once, waiting for no round: the training loop failed."""
        ...
