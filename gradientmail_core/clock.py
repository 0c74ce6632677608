"""Injected time. The core never calls ``time`` directly, so a simulation replays exactly."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds on this node's own clock. Never compared across machines."""
        ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class FakeClock:
    """A clock that only moves when told to (or when slept on). Thread-safe.

    ``drift`` scales how fast this node's clock runs relative to simulated time, so a
    simulation can give each node its own rate.
    """

    def __init__(self, start: float = 0.0, drift: float = 1.0) -> None:
        self._t = start
        self.drift = drift
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._t += seconds * self.drift

    def sleep(self, seconds: float) -> None:
        self.advance(max(seconds, 0.0))
