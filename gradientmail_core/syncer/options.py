"""A node's options, declared once (``NodeOptions``): what ``gm.Session`` and ``gm.Syncer`` build
from their keywords, ``gradientmail syncer`` from its flags (its defaults are these), and what the
engine's host and the ``Node`` read. Checked when built."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import events as ev
from ..clock import Clock

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
