"""A node's options, declared once (``NodeOptions``): what ``gm.Session`` and ``gm.Syncer`` build
from their keywords (``NodeOptions.of``), ``gradientmail syncer`` from its flags (its defaults are
these), and what the engine's host and the ``Node`` read. Checked when built; what they fix before
any I/O (the policy, the id, the clock, the draws) is ``NodeOptions.resolve``."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .. import events as ev
from ..clock import Clock, SystemClock
from ..protocol.auth import Policy
from ..protocol.identity import Identity
from ..protocol.members import MemberAuth, node_policy

_COMPRESSION = {"off": "", "none": "", "": "", "zstd": "zstd"}  # user-facing name -> payload suffix


@dataclass(frozen=True, kw_only=True)
class NodeOptions:
    poll_interval: float = 1.0
    lease_timeout: float = 120.0
    # floor of the follower's no-record timeout; None: max(30, 10 x poll_interval)
    round_timeout: float | None = None
    compression: str = "off"  # of the payloads this node writes: "off" or "zstd"
    lease_every: float | None = None  # lease renewal interval; None: lease_timeout / 4
    verify: float = 0.0  # share of the commits it follows that a node recomputes first (follower.CommitScreen)
    # (not in the repr: a simulation's trace prints the options, and a secret is no one's to print)
    callbacks: tuple[Callable[[ev.Event], None], ...] = field(default=(ev.log_events,), repr=False)
    clock: Clock | None = field(default=None, repr=False)  # None: the system's
    # of the node's draws (its nonce, the run id it creates); None: from the OS
    seed: int | None = field(default=None, repr=False)
    # docs/security.md: a shared secret (or a file holding it), an identity, or neither
    secret: bytes | str | None = field(default=None, repr=False)
    secret_file: str | os.PathLike[str] | None = field(default=None, repr=False)
    identity: str | os.PathLike[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.poll_interval > 0 or not self.lease_timeout > self.poll_interval:
            raise ValueError(f"need 0 < poll_interval ({self.poll_interval}) < lease_timeout ({self.lease_timeout})")
        if self.lease_every is not None and not 0 < self.lease_every < self.lease_timeout:
            raise ValueError(f"need 0 < lease_every ({self.lease_every}) < lease_timeout ({self.lease_timeout})")
        if self.compression not in _COMPRESSION:
            raise ValueError(f"compression={self.compression!r}: expected 'off' or 'zstd'")
        if isinstance(self.verify, bool) or not isinstance(self.verify, int | float) or not 0.0 <= self.verify <= 1.0:
            raise ValueError(f"verify={self.verify!r}: expected a fraction of rounds in [0, 1] (0: verify none)")
        object.__setattr__(self, "callbacks", tuple(self.callbacks))

    @classmethod
    def of(cls, keywords: Mapping[str, Any]) -> NodeOptions:
        """The options among a user object's keyword arguments, by name: ``gm.Session`` and
        ``gm.Syncer`` pass their ``locals()`` (their keywords are these fields, with these defaults:
        tests/test_session.py). An option the object does not take keeps its default (a syncer
        verifies nothing)."""
        return cls(**{f.name: keywords[f.name] for f in fields(cls) if f.name in keywords})

    def resolve(self, learner_id: str, owner_key: str | os.PathLike[str] | None = None) -> Resolved:
        """What a node running as ``learner_id`` fixes from these options, before any I/O (raises
        for a bad secret or key file). ``owner_key``: the owner of a run this node creates."""
        auth, identity = node_policy(self.secret, self.secret_file, self.identity, owner_key)
        rng = random.Random(self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "big"))
        return Resolved(
            learner_id=identity.learner_id(learner_id) if identity is not None else learner_id,
            auth=auth,
            identity=identity,
            clock=self.clock or SystemClock(),
            rng=rng,
            nonce=f"{rng.getrandbits(64):016x}",
        )

    @property
    def payload_compression(self) -> str:
        """The compression as payload keys name it (``""`` or ``"zstd"``)."""
        return _COMPRESSION[self.compression]

    @property
    def round_timeout_floor(self) -> float:
        return self.round_timeout if self.round_timeout is not None else max(30.0, 10 * self.poll_interval)

    @property
    def lease_interval(self) -> float:
        return self.lease_timeout / 4 if self.lease_every is None else self.lease_every

    @property
    def lease_list_interval(self) -> float:
        return min(self.lease_timeout / 4, 5 * self.poll_interval)


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """What a node fixes from its options before any I/O (``NodeOptions.resolve``)."""

    learner_id: str  # the id it runs under: with an identity, the one that names its key
    auth: Policy | MemberAuth  # docs/security.md: what it signs and checks with
    identity: Identity | None
    clock: Clock
    rng: random.Random  # the run id if this node creates the run, then the node's own draws
    nonce: str  # this process's, in its lease: the rng's first draw
