from __future__ import annotations

import pytest

from gradientmail_core.syncer.timing import ema, grace_seconds


def test_ema_is_seeded_by_the_first_sample_then_moves_a_tenth_of_the_way() -> None:
    assert ema(None, 4.0) == 4.0
    assert ema(4.0, 14.0) == pytest.approx(5.0)
    assert ema(4.0, 14.0, decay=0.5) == pytest.approx(9.0)


def _grace(**kw: object) -> float:
    args: dict[str, object] = dict(x_step=1.0, x_quorum=2.0, x_sync=1.0, gap=10, in_flight=2, overlap_steps=None)
    args.update(kw)
    return grace_seconds(**args)  # type: ignore[arg-type]


def test_grace_is_half_the_slack_after_quorum_and_commit() -> None:
    # ahead = 2*10 = 20 steps of 1 s; slack = 20 - (2 + 1) = 17; half = 8.5 < cap 10.
    assert _grace() == pytest.approx(8.5)


@pytest.mark.parametrize("missing", ["x_step", "x_quorum", "x_sync"])
def test_grace_is_zero_while_an_estimate_is_missing(missing: str) -> None:
    assert _grace(**{missing: None}) == 0.0


def test_grace_is_zero_when_quorum_and_commit_take_longer_than_learners_can_run_ahead() -> None:
    assert _grace(x_quorum=15.0, x_sync=10.0) == 0.0
    assert _grace(x_quorum=17.0, x_sync=3.0) == 0.0  # exactly no slack


def test_grace_is_capped_at_one_gap_of_steps() -> None:
    # slack = 4*10*1 - 0.5 = 39.5, half 19.75, capped at gap*x_step = 10.
    assert _grace(in_flight=4, x_quorum=0.25, x_sync=0.25) == pytest.approx(10.0)


def test_smaller_overlap_steps_limits_how_far_ahead_learners_run() -> None:
    # ahead = min(20, 8) = 8; slack = 8 - 3 = 5; half = 2.5.
    assert _grace(overlap_steps=8) == pytest.approx(2.5)
    assert _grace(overlap_steps=0) == 0.0  # standard DiLoCo's barrier: nobody runs ahead
    assert _grace(overlap_steps=100) == pytest.approx(8.5)  # larger than in_flight*gap: no effect
