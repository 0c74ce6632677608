"""The options of a node's membership in a run, defined once for every integration.

``GradientMailCallback``, ``MailboxDiLoCoStrategy`` and ``register_gradientmail`` take
``algorithm=`` and ``mailbox=`` plus any of these as keyword arguments (``**options``) and
build one :class:`SessionOptions` from them; the ``SessionDriver`` runs the session from it.
A misspelt option raises a ``TypeError`` naming the valid ones.

Imports no framework, so the options can be read and checked without Lightning or Accelerate.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.adapters.layouts import Layouts
from gradientmail_core.protocol import keys


@dataclass(frozen=True, kw_only=True)
class SessionOptions:
    """One node's options. All but the first six go to ``gm.Session`` on rank 0 only (on every
    rank of a sharded node), under the same names and with the same defaults (see there); an
    option ``gm.Session`` gains is added here, once, for every integration. ``module`` and
    ``names`` pick and name the parameters on every rank (``SessionDriver``)."""

    #: the run's ``gm.DiLoCo(...)`` config (required).
    algorithm: gm.DiLoCo
    #: a ``gm.Mailbox``, or a URL for ``gm.open_mailbox`` (opened on rank 0 only) (required).
    mailbox: gm.Mailbox | str
    #: the submodule whose parameters form the run: an attribute path (``"net"``, ``"model.backbone"``)
    #: or a callable given the trained module (None: all of it); see ``gradientmail_core.adapters.naming``.
    module: str | Callable[[Any], Any] | None = None
    #: this node's canonical parameter names -> the run's: a dict or a callable (None: the same).
    names: Mapping[str, str] | Callable[[str], str] | None = None
    #: the convention or ``{name: axes}`` this node shows its tensors in (``gm.Session(layouts=)``).
    layouts: Layouts | None = None
    #: block at the start of training until this many learners are live (None: do not wait).
    wait_for_learners: int | None = None
    #: seconds to wait for them (None: forever).
    wait_timeout: float | None = None
    #: this node's learner id (None: one restored from a checkpoint, else a fresh one).
    learner_id: str | None = None
    #: ``"both"`` (train and close rounds) or ``"learner"`` (train only, never close: e.g. a laptop on a home link);
    #: None: ``gm.Session``'s default (``"both"``; a sharded node closes with every rank its part).
    role: str | None = None
    #: a sharded (FSDP2) node's anchors: ``"device"``, ``"host"`` or ``"disk"`` (None: ``gm.Session``'s
    #: default, host memory on an accelerator); see ``docs/sharding.md``.
    anchors: str | None = None
    #: seconds between polls of the mailbox.
    poll_interval: float = 1.0
    #: seconds without a lease renewal after which a learner counts as gone.
    lease_timeout: float = 120.0
    #: seconds between lease renewals, 0 < lease_every < lease_timeout (None: lease_timeout / 4).
    lease_every: float | None = None
    #: seconds without a record from a round's closer before another node takes over (None: max(30, 10 x poll_interval)).
    round_timeout: float | None = None
    #: seconds ``close`` waits for this node's rounds in flight (None: lease_timeout + 2 x round_timeout).
    close_timeout: float | None = None
    #: payload compression, ``"off"`` or ``"zstd"``.
    compression: str = "off"
    #: callables that receive every ``gm.Event`` of the session.
    callbacks: Sequence[Callable[[ev.Event], None]] = (gm.log_events,)
    #: the session's clock (None: the system clock; tests pass a fake one).
    clock: gm.Clock | None = None
    #: seed of the session's random choices (None: a random one).
    seed: int | None = None
    #: the run's shared secret for authenticated objects (see docs/security.md).
    secret: bytes | str | None = None
    #: a file holding that secret, instead of ``secret``.
    secret_file: str | os.PathLike[str] | None = None
    #: this node's key file (Ed25519, created on first use): a members-only run (see docs/security.md).
    identity: str | os.PathLike[str] | None = None
    #: the owner key file of a run this node creates, if not its identity (signs the membership log).
    owner_key: str | os.PathLike[str] | None = None
    #: the share of the commits it follows that this node recomputes before applying them (see docs/security.md).
    verify: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "callbacks", tuple(self.callbacks))  # frozen: a list passed in is copied

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """Every option's name, in definition order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, owner: str, kwargs: Mapping[str, Any], *, also: Iterable[str] = ()) -> SessionOptions:
        """Build the options that ``owner(...)`` was called with, refusing unknown names.

        ``also``: the owner's own keyword parameters, named with the valid options when a
        name is unknown."""
        names = cls.option_names()
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(
                f"{owner}() got unexpected keyword arguments {unknown}; the valid options are "
                f"{sorted({*names, *also})} (see gradientmail_lightning.options.SessionOptions)"
            )
        return cls(**kwargs)

    def check(self, owner: str) -> None:
        """Refuse values that cannot work, before any training (errors name ``owner``)."""
        if not isinstance(self.algorithm, gm.DiLoCo):
            raise TypeError(f"{owner}(algorithm=...) must be a gm.DiLoCo(...), found {type(self.algorithm).__name__}")
        wait = self.wait_for_learners
        if wait is not None and (not isinstance(wait, int) or wait < 1):
            raise ValueError(f"{owner}(wait_for_learners={wait!r}): expected a positive int or None")
        if self.learner_id is not None:
            keys.validate_learner_id(self.learner_id)
        m = self.module
        if m is not None and not callable(m) and (not isinstance(m, str) or not all(m.split("."))):
            raise TypeError(
                f"{owner}(module={m!r}): expected an attribute path such as 'net' or 'model.backbone', or a callable"
            )
        if self.names is not None and not (isinstance(self.names, Mapping) or callable(self.names)):
            raise TypeError(f"{owner}(names=...) must be a dict or a callable, found {type(self.names).__name__}")

    def session_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``gm.Session`` besides ``algorithm`` and ``mailbox`` (an
        option left at None where the session's own default depends on the model is left out)."""
        out = {name: getattr(self, name) for name in self.option_names() if name not in _NOT_FOR_SESSION}
        for name in ("role", "anchors"):
            if out[name] is None:
                del out[name]
        return out


_NOT_FOR_SESSION = frozenset({"algorithm", "mailbox", "module", "names", "wait_for_learners", "wait_timeout"})
