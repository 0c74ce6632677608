"""The deterministic simulation (gradientmail_sim): many seeds of many nodes under faults
hold every invariant, every fault kind and critical path is reached, and a seed replays exactly.

``GM_SIM_SEEDS`` (default 140, the fewest the coverage test accepts: the rarest required paths, a
crash just before and just after the commit point, are each reached in 5 to 8 of them) and
``GM_SIM_ROUNDS`` (default 30) size the sweep;
``GM_SIM_SOAK=N`` adds a soak of N seeds from a random start (see docs/reliability.md);
``GM_SIM_FLEET_SEEDS`` (default 6) and ``GM_SIM_FLEET_ROUNDS`` (default 12) size the sweep of fleets of
64..96 learners (``--fleet``), most of them with ``max_contributions``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from gradientmail_sim import SimResult, run_many, run_seed

ROOT = Path(__file__).resolve().parent.parent

SEEDS = int(os.environ.get("GM_SIM_SEEDS", "140"))
ROUNDS = int(os.environ.get("GM_SIM_ROUNDS", "30"))
FLEET_SEEDS = int(os.environ.get("GM_SIM_FLEET_SEEDS", "6"))
FLEET_ROUNDS = int(os.environ.get("GM_SIM_FLEET_ROUNDS", "12"))

pytestmark = pytest.mark.timeout(1800)

# What the sweep must have reached at least once (engine events, auditor and fault-log counters).
MUST_REACH = [
    # takeovers and elections
    "took_over/lease_lost",
    "took_over/timeout",
    "took_over/unclaimed",
    "Superseded",
    "commit_race_lost",  # two closers wrote one round record: one lost the create-once race
    "preemptions",
    # a closer that crashed after writing its round payloads and before the record: recomputed
    "recovered_between_payload_and_record",
    # contributions rejected by the closer, each reason checked by the auditor
    "rejected/stale",
    "rejected/corrupt",
    "rejected/nonfinite",
    "rejected/zero_steps",
    "rejected/schema",
    "late",
    # nodes dying, stalling, leaving, rejoining
    "crashes",
    "chaos/kill",
    "chaos/stall",
    "chaos/leave",
    "chaos/brownout",
    "failed_starts",
    "rounds_verified",
    # checkpoint_every > 1: a round closed between checkpoints by another node than the closer of
    # the fragment's previous round, from a state it rebuilt by replaying (checked bit-exactly)
    "closed_between_checkpoints_by_another",
]
MUST_FAULT = [
    "crash/before",
    "crash/landed",
    "crash/replied",
    "crash/before/put/rounds",  # dies just before the commit point
    "crash/landed/put/rounds",  # dies just after it
    "crash/before/put/blobs/rounds",  # dies while writing the round's payloads
    "error/before",
    "error/landed",  # lost acknowledgement
    "retry_412/before",
    "latency/before",
    "flip/before",
    "paginated_lists",
]
# create-once writes whose outcome was unknown, resolved by reading them back, both ways
MUST_RESOLVE = ["ours/rounds", "theirs/rounds", "ours/claims", "theirs/claims", "ours/snapshots"]


@pytest.fixture(scope="module")
def sweep() -> list[SimResult]:
    return list(run_many(range(SEEDS), ROUNDS))


def test_every_seed_holds_every_invariant(sweep):
    failed = [r for r in sweep if not r.ok]
    assert not failed, "\n".join(r.summary() for r in failed[:10])
    assert all(r.rounds >= ROUNDS for r in sweep)


def test_every_fault_kind_and_critical_path_is_reached(sweep):
    stats: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    resolved: Counter[str] = Counter()
    for r in sweep:
        stats.update(r.stats)
        faults.update(r.faults)
        resolved.update(r.resolved)
    hours = sum(r.sim_seconds for r in sweep) / 3600
    print(f"\n{len(sweep)} seeds x {ROUNDS} rounds, {hours:.2f} simulated hours")
    print("stats:", dict(sorted(stats.items())))
    print("faults:", dict(sorted((k, v) for k, v in faults.items() if k.count("/") <= 1)))
    print("resolved:", dict(sorted(resolved.items())))
    if SEEDS < 140:
        pytest.skip("coverage is asserted over at least 140 seeds")
    assert not [k for k in MUST_REACH if not stats[k]], "never reached"
    assert not [k for k in MUST_FAULT if not faults[k]], "never injected"
    assert not [k for k in MUST_RESOLVE if not resolved[k]], "never resolved"


def test_the_sweep_mixes_checkpoints_error_feedback_and_chunks(sweep):
    # The invariants above held over runs that quantize deltas with and without error feedback,
    # checkpoint only every k-th version and chunk their payloads: each run's config as its
    # manifest says (the auditor read it), not the scenario drawn again.
    runs = [r.algorithm for r in sweep]
    assert all(c is not None for c in runs), [r.config.seed for r in sweep if r.algorithm is None]
    draws = [c for c in runs if c is not None]
    n = len(draws)
    assert sum(c.error_feedback and c.delta_dtype is not None for c in draws) >= n // 10
    assert sum(c.delta_dtype is not None and not c.error_feedback for c in draws) >= n // 10
    assert sum(c.checkpoint_every > 1 and c.error_feedback for c in draws) >= n // 20
    # the 2-bit frontier: I2 deltas under F4 commits (gm.DiLoCo.frugal's pair) and I2 commits
    assert sum(c.delta_dtype == "I2" and c.commit_dtype == "F4" and c.error_feedback for c in draws) >= n // 40
    assert sum(c.commit_dtype == "I2" and c.checkpoint_every > 1 for c in draws) >= n // 40
    # the closer's gap projection (gm.DiLoCo.frontier's), on I2 commits and others
    assert sum(c.gap_projection and c.commit_dtype == "I2" for c in draws) >= n // 40
    assert sum(c.gap_projection and c.commit_dtype != "I2" for c in draws) >= n // 20
    # chunked payloads (chunks that cut the wider model's tensors), with and without quantization
    assert sum(c.chunk_elements is not None for c in draws) >= n // 4
    assert sum(c.chunk_elements is not None and c.checkpoint_every > 1 for c in draws) >= n // 20
    assert sum(c.chunk_elements is not None and c.delta_dtype is None for c in draws) >= n // 10
    # max_contributions: below the learners (most snapshots past the draw unjudged) and at or above
    caps = [(r.algorithm.max_contributions, r.nodes) for r in sweep if r.algorithm is not None]
    assert sum(k is not None and k < nodes for k, nodes in caps) >= n // 10
    assert sum(k is not None and k >= nodes for k, nodes in caps) >= n // 40


def test_fleets_of_64_and_more_learners_hold_every_invariant_with_and_without_a_cap():
    # Fleets (64..96 learners, fewer rounds) under the same faults, crashes and takeovers: every
    # commit recomputed by the auditor (with a cap: the drawn ones judged in draw order), every
    # surviving learner bit-identical to the newest commit at the end.
    fleet = list(run_many(range(FLEET_SEEDS), FLEET_ROUNDS, fleet=True))
    failed = [r for r in fleet if not r.ok]
    assert not failed, "\n".join(r.summary() for r in failed[:10])
    assert all(r.rounds >= FLEET_ROUNDS and 64 <= r.nodes <= 96 and r.stats["survivors"] > 1 for r in fleet)
    caps = [(r.algorithm.max_contributions, r.nodes) for r in fleet if r.algorithm is not None]
    if FLEET_SEEDS >= 6:
        assert any(k is None for k, _ in caps) and any(k is not None and k < n for k, n in caps)
        assert any(k is not None and k >= n for k, n in caps)
    assert all(r.losses[1] < 0.5 * r.losses[0] for r in fleet), [r.config.seed for r in fleet]


def test_the_loss_falls_in_every_run(sweep):
    assert all(r.losses[1] < 0.5 * r.losses[0] for r in sweep), [
        r.config.seed for r in sweep if r.losses[1] >= 0.5 * r.losses[0]
    ]


def test_a_healthy_run_keeps_its_closer_and_commits_every_round():
    for seed in range(5):
        r = run_seed(seed, ROUNDS, faults=False)
        assert r.ok, r.summary()
        assert not any(k.startswith("took_over/") for k in r.stats) and not r.stats["Superseded"]
        assert not any(k.count("/") == 1 for k in r.faults) and r.rounds >= ROUNDS  # (pages are no fault)


def test_the_same_seed_gives_the_same_trace():
    a, b, c = run_seed(11, 30), run_seed(11, 30), run_seed(12, 30)
    assert a.trace_hash == b.trace_hash and a.stats == b.stats and a.faults == b.faults
    assert a.trace_hash != c.trace_hash


def test_a_seed_replays_exactly_from_the_printed_command_in_another_process():
    r = run_seed(11, 30)
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-m", "gradientmail_sim", "--seed", "11", "--rounds", "30"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"trace {r.trace_hash[:16]}" in out.stdout


def test_a_failing_seed_says_how_to_replay_it():
    r = run_seed(0, 20, mutant="count_twice")
    assert not r.ok
    assert "python -m gradientmail_sim --seed 0 --rounds 20 --mutant count_twice -v" in r.summary()


@pytest.mark.skipif(not os.environ.get("GM_SIM_SOAK"), reason="set GM_SIM_SOAK=N for a soak of N seeds")
def test_soak():
    start = int.from_bytes(os.urandom(4), "big") % 10**9
    n = int(os.environ["GM_SIM_SOAK"])
    failed = [r.summary() for r in run_many(range(start, start + n), ROUNDS) if not r.ok]
    assert not failed, "\n".join(failed[:20])
