"""The simulated Table 1 (``gradientmail_sim/goodput.py``): the failure model's closed forms
give the paper's figures, data parallel's stalls are counted as the model says, and a small run of
real learners under it keeps its accounting and recovers every crash."""

from __future__ import annotations

import pytest

from gradientmail_sim.goodput import (
    PAPER_DP,
    PAPER_ELASTIC,
    PAPER_LEARNERS,
    FailureModel,
    GoodputRun,
    TimeScale,
    dp_goodput,
    fault_log,
    measure,
    table,
)

# Small: a 400 s horizon at the paper's 1.2M chips is ~15 interruptions of the cluster.
SMALL = TimeScale(horizon=400.0)


def test_default_recovery_times_give_the_papers_table_1_at_its_scale() -> None:
    model = FailureModel()
    lam = model.cluster_rate
    assert 1 / lam == pytest.approx(26.3, abs=0.05)  # 1.2M chips, a year each: a failure every ~26 s
    for m, paper in PAPER_LEARNERS.items():
        assert round(model.ideal(m), 2) == paper
    assert round(1 / (1 + lam * model.dp_restart), 2) == PAPER_DP
    assert round(1 / (1 + lam * model.elastic_restart), 2) == PAPER_ELASTIC


def test_data_parallel_stalls_once_per_interruption_that_finds_it_running() -> None:
    # 0 stalls to 50 (10 absorbed), 100 to 150, 190 to the horizon (counted up to it)
    assert dp_goodput([100.0, 0.0, 10.0, 190.0], 200.0, 50.0) == (pytest.approx(1 - 110 / 200), 3)
    assert dp_goodput([], 200.0, 50.0) == (1.0, 0)


def test_fault_log_is_the_seeds_and_each_learner_fails_at_its_share_of_the_cluster_rate() -> None:
    model = FailureModel()
    log = fault_log(4, model, 20_000.0, seed=1)
    assert log == fault_log(4, model, 20_000.0, seed=1)
    assert log != fault_log(4, model, 20_000.0, seed=2)
    expected = model.learner_rate(4) * 20_000.0  # ~190 per learner
    assert all(0.7 * expected < len(times) < 1.3 * expected for times in log)
    assert all(times == sorted(times) and times[-1] < 20_000.0 for times in log)


@pytest.fixture(scope="module")
def rows() -> dict[int, object]:
    return {m: measure(m, FailureModel(), SMALL, seed=0) for m in (1, 3)}


def test_every_crash_of_the_small_run_is_recovered_and_the_tape_is_contiguous(rows) -> None:
    for r in rows.values():
        assert r.crashes > 0 and r.tape_ok
        assert r.unrecovered == 0, r
        assert r.recovered + r.restarted_late == r.crashes
        assert r.crashes <= r.interruptions  # the rest found their learner down: absorbed
    three = rows[3]
    assert three.closer_crashes > 0 and sum(three.takeovers.values()) > 0  # a closer died, another took over


def test_goodput_is_what_reached_a_commit_and_every_step_is_accounted_for(rows) -> None:
    for r in rows.values():
        assert 0.0 < r.goodput <= 1.0
        assert r.merged <= r.computed <= r.capacity
        for part in (r.lost_to_kill, r.dropped_by_alignment, r.other_lost, r.unsent_at_end):
            assert part >= 0, r
        # goodput and the shares lost sum to the whole capacity
        lost = (r.capacity - r.computed, r.lost_to_kill, r.dropped_by_alignment, r.other_lost)
        assert r.goodput + sum(r.share(n) for n in lost) == pytest.approx(1.0)
        assert r.goodput <= r.up_share + 1e-9  # nothing is gained while a learner is down
        assert 0.0 < r.step_efficiency <= 1.0


def test_learners_keep_more_than_data_parallel_under_the_same_fault_log(rows) -> None:
    three = rows[3]
    assert three.goodput > three.dp
    assert three.step_efficiency > rows[1].step_efficiency  # one learner down stops no round
    text = table(list(rows.values()))
    assert text.count("\n") == 1 + len(rows) and "| 3 | 400,000 |" in text


def test_a_fault_free_run_loses_only_what_alignment_drops() -> None:
    r = GoodputRun(2, FailureModel(), TimeScale(horizon=200.0), seed=0, faults=False).run()
    assert r.crashes == r.interruptions == 0 and r.lost_to_kill == 0
    assert r.capacity - r.computed <= 2 * 4  # each learner at most its step in progress at the horizon short
    assert r.goodput >= 1 - r.share(r.dropped_by_alignment + r.other_lost + 2 * 4) - 1e-12


def test_a_run_replays_from_its_seed() -> None:
    a = GoodputRun(2, FailureModel(), SMALL, seed=5).run()
    b = GoodputRun(2, FailureModel(), SMALL, seed=5).run()
    assert (a.merged, a.crashes, a.kill_to_commit, a.takeovers) == (b.merged, b.crashes, b.kill_to_commit, b.takeovers)
