from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradientmail_core.protocol.schedule import (  # noqa: E402
    fragment_of,
    gap,
    nominal_step,
    version_after,
    version_before,
)


@st.composite
def h_and_p(draw: st.DrawFn) -> tuple[int, int]:
    H = draw(st.integers(1, 500))
    P = draw(st.integers(1, H))
    return H, P


def test_nominal_steps_are_staggered_within_each_block_of_h() -> None:
    # H=10, P=4: fragments due at 2, 5, 7, 10, then 12, 15, 17, 20.
    assert [nominal_step(r, 10, 4) for r in range(8)] == [2, 5, 7, 10, 12, 15, 17, 20]
    assert [fragment_of(r, 4) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [gap(r, 10, 4) for r in range(8)] == [2, 3, 2, 3, 2, 3, 2, 3]


def test_round_before_the_first_is_step_zero() -> None:
    assert nominal_step(-1, 10, 4) == 0
    assert gap(0, 10, 4) == nominal_step(0, 10, 4) == 2


def test_one_fragment_is_standard_diloco() -> None:
    assert [nominal_step(r, 100, 1) for r in range(3)] == [100, 200, 300]
    assert [gap(r, 100, 1) for r in range(3)] == [100, 100, 100]


def test_versions_count_the_fragments_earlier_commits() -> None:
    assert [version_before(r, 3) for r in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert [version_after(r, 3) for r in range(7)] == [1, 1, 1, 2, 2, 2, 3]


@given(h_and_p(), st.integers(0, 50))
def test_any_p_consecutive_gaps_sum_to_h(hp: tuple[int, int], start: int) -> None:
    H, P = hp
    gaps = [gap(r, H, P) for r in range(start, start + P)]
    assert sum(gaps) == H
    assert all(H // P <= g <= -(-H // P) for g in gaps)


@given(h_and_p(), st.integers(0, 20))
def test_each_fragment_is_synced_once_per_h_steps(hp: tuple[int, int], r: int) -> None:
    H, P = hp
    assert fragment_of(r + P, P) == fragment_of(r, P)
    assert nominal_step(r + P, H, P) - nominal_step(r, H, P) == H
    assert version_before(r + P, P) == version_after(r, P)
    # Rounds of one block of H steps cover every fragment exactly once.
    block = r // P
    assert sorted(fragment_of(q, P) for q in range(block * P, block * P + P)) == list(range(P))
