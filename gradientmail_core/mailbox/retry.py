"""Retries for transient store errors: the backoff policy and the loop every backend uses."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..clock import Clock
from ..errors import MailboxUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Exponential backoff for transient store errors.

    Waits ``base_delay * multiplier**i`` (capped at ``max_delay``) between attempts. With an
    ``rng``, each wait is drawn from [wait/2, wait] ("equal jitter") so that nodes that
    failed together do not retry in lockstep; without one, waits are deterministic.
    """

    attempts: int = 5
    base_delay: float = 0.05
    max_delay: float = 2.0
    multiplier: float = 2.0
    rng: random.Random | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError(
                f"RetryPolicy delays must be >= 0, got base_delay={self.base_delay!r}, max_delay={self.max_delay!r}"
            )
        if self.multiplier < 1:
            raise ValueError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier!r}")

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th consecutive failure (1-based)."""
        wait = min(self.max_delay, self.base_delay * self.multiplier ** (failures - 1))
        if self.rng is not None:
            wait = wait / 2 + self.rng.uniform(0.0, wait / 2)
        return wait


def call_with_retries(fn: Callable[[], T], *, policy: RetryPolicy, clock: Clock, what: str) -> T:
    """Run ``fn``, retrying while it raises ``MailboxUnavailable``; sleep through ``clock``.

    ``fn`` signals a transient failure by raising ``MailboxUnavailable`` (backends classify
    their own errors); any other exception propagates at once. ``what`` names the operation
    and key for the final error, e.g. ``"PUT rounds/0000000007.json"``.
    """
    last: MailboxUnavailable | None = None
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except MailboxUnavailable as exc:
            last = exc
            if attempt == policy.attempts:
                break
            wait = policy.delay(attempt)
            log.debug("%s failed (attempt %d/%d), retrying in %.3fs: %s", what, attempt, policy.attempts, wait, exc)
            clock.sleep(wait)
    raise MailboxUnavailable(
        f"{what} failed {policy.attempts} times; last error: {last}. The store is unreachable or "
        "overloaded: check the endpoint, network and credentials. This is transient: the run keeps "
        "going and retries later."
    ) from last
