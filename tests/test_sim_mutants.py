"""Mutation check: each deliberately broken engine (gradientmail_sim/mutants.py) is caught
by the simulation within a few hundred seeds, so its power to find these bugs cannot decay."""

from __future__ import annotations

import pytest

from gradientmail_sim import run_seed
from gradientmail_sim.mutants import MUTANTS

MAX_SEEDS = 300
# Rounds per seed: at 30 every mutant is still caught within 35 seeds (stale_view_is_fatal, the
# slowest, at seed 34; at 50 rounds it was seed 29, for 1.6x the time).
ROUNDS = 30

# What should catch each mutant (a substring of the first violation), to keep the check honest.
CAUGHT_BY = {
    "skip_readback": ("never claimed it", "aligned fragment", "no progress", "differ", "steady"),
    "accept_stale": ("is stale",),
    "sweep_newest": ("the newest of its fragment",),
    "no_claim_next": ("reason='unclaimed'",),
    "remote_clock_lease": ("lease lost",),
    "skip_sha_check": (
        "differ from the merge",
        "differs from the recomputed",
        "different from the newest commit",
        "was never written intact",  # a ghost's payload that does not match its sha256, accepted
        "aligned fragment",  # a learner aligned with damaged parameters it trusted
        # between checkpoints, a new closer replays the round from the intact payloads and finds
        # that the recorded commit is not their merge: it stops rather than close from it
        "does not give the committed change",
        # a learner rebuilding parameters from the checkpoint and damaged changes it trusted
        "do not hash to the record's theta_digest",
    ),
    "count_twice": ("differ from the merge", "outer_digest"),
    "stale_view_is_fatal": ("raised ProtocolError",),
    # Checkpoints: what GC deletes and what a new closer rebuilds between them.
    "gc_forgets_checkpoints": ("a recovery of fragment",),
    "gc_ignores_window": ("inside the verify window",),
    "replay_skips_contribution": (
        "differs from the recomputed",
        "theta_digest",
        "aligned fragment",
        "different from the newest commit",
    ),
    # The arithmetic itself: the engine's functions are patched wherever they are called, so only
    # the independent float64 reference can catch these.
    "weights_not_normalised": ("differ from the float64 recomputation",),
    "rda_length_unweighted": ("differ from the float64 recomputation",),
    "nesterov_without_momentum": ("differ from the float64 recomputation",),
    "outer_lr_twice": ("differ from the float64 recomputation",),
    # gap_projection: the auditor projects with its own import of the function, and in float64
    "pullback_also_pushes": ("differ from the merge", "differs from the recomputed", "outer_digest", "float64"),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_is_caught(mutant):
    assert set(CAUGHT_BY) == set(MUTANTS)
    for seed in range(MAX_SEEDS):
        r = run_seed(seed, ROUNDS, mutant=mutant)
        if not r.ok:
            print(f"\n{mutant}: caught at seed {seed}: {r.violations[0][:200]}")
            assert any(why in r.violations[0] for why in CAUGHT_BY[mutant]), r.violations[0]
            break
    else:
        pytest.fail(f"mutant {mutant} survived {MAX_SEEDS} seeds")


def _patch_points() -> tuple:
    from gradientmail_core import mailbox
    from gradientmail_core.aggregators import fused, merge, outer
    from gradientmail_core.protocol import store
    from gradientmail_core.protocol.lease import LeaseWriter
    from gradientmail_core.syncer import collector, merger, replay
    from gradientmail_core.syncer.closing import Closing
    from gradientmail_core.syncer.election import Election
    from gradientmail_core.syncer.gc import GarbageCollector
    from gradientmail_core.syncer.state import NodeState

    return (
        mailbox.create_once,
        store.create_once,
        collector.version_before,
        merger.merge_and_step,
        fused.rda_radius,
        GarbageCollector.collect,
        Election.try_claim,
        NodeState.list_leases,
        Closing.fragment_state,
        GarbageCollector._checkpoint_rounds,
        GarbageCollector._window,
        replay._contributions,
        replay.differences,
        LeaseWriter.renew,
        store.RunStore.get_payload,
        store.RunStore.get_chunk,
        merge.normalized,
        merge._normalized,
        fused.merge_tensor,
        outer.outer_step_tensor,
        outer.final_step_tensor,
        outer.drop_pullback,
    )


def test_mutants_leave_the_engine_as_they_found_it():
    before = _patch_points()
    for m in MUTANTS:
        run_seed(0, 5, mutant=m)
    after = _patch_points()
    assert before == after
