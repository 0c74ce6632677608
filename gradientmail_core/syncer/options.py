"""A node's options, declared once: what ``gm.Session``, ``gm.Syncer``, ``gradientmail syncer`` and
the engine's host all hand the node (``NodeOptions``), checked when it is built."""

from __future__ import annotations

from dataclasses import dataclass

_COMPRESSION = {"off": "", "none": "", "": "", "zstd": "zstd"}  # user-facing name -> payload suffix


@dataclass(frozen=True)
class NodeOptions:
    poll_interval: float = 1.0
    lease_timeout: float = 120.0
    round_timeout: float = 60.0  # floor of the follower's no-record timeout
    compression: str = ""
    lease_every: float | None = None  # lease renewal interval; None: lease_timeout / 4
    verify: float = 0.0  # share of the commits it follows that a node recomputes first (follower.CommitScreen)

    def __post_init__(self) -> None:
        if not self.poll_interval > 0 or not self.lease_timeout > self.poll_interval:
            raise ValueError(f"need 0 < poll_interval ({self.poll_interval}) < lease_timeout ({self.lease_timeout})")
        if self.lease_every is not None and not 0 < self.lease_every < self.lease_timeout:
            raise ValueError(f"need 0 < lease_every ({self.lease_every}) < lease_timeout ({self.lease_timeout})")
        if isinstance(self.verify, bool) or not isinstance(self.verify, int | float) or not 0.0 <= self.verify <= 1.0:
            raise ValueError(f"verify={self.verify!r}: expected a fraction of rounds in [0, 1] (0: verify none)")

    @classmethod
    def from_user(
        cls,
        *,
        poll_interval: float,
        lease_timeout: float,
        lease_every: float | None,
        round_timeout: float | None,
        compression: str,
        verify: float = 0.0,
    ) -> NodeOptions:
        """The options as ``gm.Session`` and ``gm.Syncer`` take them: compression by its user-facing
        name (``"off"``/``"zstd"``), ``round_timeout`` None for ``max(30, 10 x poll_interval)``."""
        if compression not in _COMPRESSION:
            raise ValueError(f"compression={compression!r}: expected 'off' or 'zstd'")
        return cls(
            poll_interval=poll_interval,
            lease_timeout=lease_timeout,
            lease_every=lease_every,
            round_timeout=round_timeout if round_timeout is not None else max(30.0, 10 * poll_interval),
            compression=_COMPRESSION[compression],
            verify=verify,
        )

    @property
    def lease_interval(self) -> float:
        return self.lease_timeout / 4 if self.lease_every is None else self.lease_every

    @property
    def lease_list_interval(self) -> float:
        return min(self.lease_timeout / 4, 5 * self.poll_interval)
