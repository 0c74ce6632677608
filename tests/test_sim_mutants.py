"""Mutation check: each deliberately broken engine (gradientmail_core/sim/mutants.py) is caught
by the simulation within a few hundred seeds, so its power to find these bugs cannot decay."""

from __future__ import annotations

import pytest

from gradientmail_core.sim import run_seed
from gradientmail_core.sim.mutants import MUTANTS

MAX_SEEDS = 300

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
    ),
    "count_twice": ("differ from the merge",),
    "stale_view_is_fatal": ("raised ProtocolError",),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_is_caught(mutant):
    assert set(CAUGHT_BY) == set(MUTANTS)
    for seed in range(MAX_SEEDS):
        r = run_seed(seed, 50, mutant=mutant)
        if not r.ok:
            print(f"\n{mutant}: caught at seed {seed}: {r.violations[0][:200]}")
            assert any(why in r.violations[0] for why in CAUGHT_BY[mutant]), r.violations[0]
            break
    else:
        pytest.fail(f"mutant {mutant} survived {MAX_SEEDS} seeds")


def test_mutants_leave_the_engine_as_they_found_it():
    from gradientmail_core import mailbox
    from gradientmail_core.protocol import store
    from gradientmail_core.syncer import closer, node

    before = (
        mailbox.create_once,
        store.create_once,
        closer.version_before,
        closer.merge_with_cosine,
        node.Node._collect_garbage,
        node.Node._try_claim,
        store.RunStore.get_payload,
    )
    for m in MUTANTS:
        run_seed(0, 5, mutant=m)
    after = (
        mailbox.create_once,
        store.create_once,
        closer.version_before,
        closer.merge_with_cosine,
        node.Node._collect_garbage,
        node.Node._try_claim,
        store.RunStore.get_payload,
    )
    assert before == after
