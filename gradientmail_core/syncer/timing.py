"""Time estimates carried in round records, and the grace window they give (SPEC 3.6).

Every input is a duration measured on one node's own monotonic clock; wall clocks are never
compared across machines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def ema(prev: float | None, x: float, decay: float = 0.1) -> float:
    """Exponential moving average; the first sample seeds it."""
    if prev is None:
        return float(x)
    return (1.0 - decay) * prev + decay * x


def grace_seconds(
    *,
    x_step: float | None,
    x_quorum: float | None,
    x_sync: float | None,
    gap: int,
    in_flight: int,
    overlap_steps: int | None,
) -> float:
    """Seconds the closer keeps collecting after quorum:
    ``min(0.5 * max(ahead*x_step - (x_quorum + x_sync), 0), gap*x_step)``, ``ahead = in_flight *
    gap`` steps (or ``overlap_steps`` if smaller): half the slack learners have before they need
    this round's commit, at most a round's worth of steps. Zero while any estimate is missing."""
    if x_step is None or x_quorum is None or x_sync is None:
        return 0.0
    ahead = in_flight * gap
    if overlap_steps is not None and overlap_steps < ahead:
        ahead = overlap_steps
    slack = ahead * x_step - (x_quorum + x_sync)
    return float(min(0.5 * max(slack, 0.0), gap * x_step))


@dataclass
class Estimates:
    """The estimates a round record carries (seconds): a step, quorum after opening, a commit."""

    x_step: float | None = None
    x_quorum: float | None = None
    x_sync: float | None = None

    @classmethod
    def from_record(cls, rec: Any) -> Estimates:
        return cls() if rec is None else cls(rec.x_step, rec.x_quorum, rec.x_sync)
