"""``scripts/mutants.py``: its table still fits the code (every anchor found exactly once, every
mutated file still compiles, every test it names exists, the simulation's mutants all listed), and
the runner says caught, missed, or why it could not apply a mutation.

The mutations themselves run with ``python scripts/mutants.py`` (``--quick`` in scripts/test.sh)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("mutants_script", ROOT / "scripts" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


mutants = _load()


def test_every_mutation_has_a_unique_name_and_applies_to_the_code_as_it_is():
    table = mutants.everything()
    names = [m.name for m in table]
    assert len(names) == len(set(names))
    for m in mutants.MUTATIONS:
        text = (ROOT / m.file).read_text()
        assert text.count(m.original) == 1, f"{m.name}: its anchor is in {m.file} {text.count(m.original)} times"
        assert m.original != m.replacement and m.why and m.tests, m.name
        if m.file.endswith(".py"):
            compile(text.replace(m.original, m.replacement), m.file, "exec")


def test_every_test_a_mutation_names_exists():
    for m in mutants.everything():
        for node in m.tests:
            path, _, rest = node.partition("::")
            assert (ROOT / path).is_file(), (m.name, node)
            if rest:
                name = re.sub(r"\[.*\]$", "", rest)
                assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), (m.name, node)


def test_every_simulation_mutant_is_listed():
    from gradientmail_sim.mutants import MUTANTS

    assert {name for name, _ in mutants.SIM_MUTANTS} == set(MUTANTS)


def test_the_quick_subset_has_a_mutation_of_each_cheap_finding():
    quick = {m.name for m in mutants.everything() if m.quick}
    assert 10 <= len(quick) < len(mutants.everything())
    assert {"carry-keeps-the-steps-twice", "streamed-reads-skip-the-sha256", "i2-deltas-sent-as-f32"} <= quick


def _run(m, tmp_path: Path) -> str:  # type: ignore[no-untyped-def]
    return mutants.run_one(m, mutants.tree_files(ROOT), 300, sys.executable, False).line


def test_a_mutation_whose_anchor_moved_is_missed_and_says_where(tmp_path):
    m = mutants.M(
        "gone", "gradientmail_core/aggregators/merge.py", "text that is not there", "x", "tests/test_merge.py", "?"
    )
    assert _run(m, tmp_path) == "missed gone (anchor not found in gradientmail_core/aggregators/merge.py)"
    bad = mutants.M("bad", "gradientmail_core/aggregators/merge.py", "def contribution_weight(", "def (", "x", "?")
    assert _run(bad, tmp_path).startswith(
        "missed bad (the mutated gradientmail_core/aggregators/merge.py does not compile"
    )


@pytest.mark.timeout(600)
def test_the_runner_reports_a_caught_a_missed_and_a_mistyped_mutation(tmp_path):
    test = "tests/test_merge.py::test_contribution_weight_is_tokens_times_tokens_per_step"
    weight = "return float(tokens) * (float(tokens) / float(steps))"
    caught = mutants.M("w", "gradientmail_core/aggregators/merge.py", weight, "return float(tokens)", test, "?")
    assert _run(caught, tmp_path) == f"caught w by {test}"
    harmless = mutants.M("c", "gradientmail_core/aggregators/merge.py", weight, weight + "  # a comment", test, "?")
    assert _run(harmless, tmp_path) == "missed c"
    nowhere = mutants.M("n", "gradientmail_core/aggregators/merge.py", weight, "return 0.0", test + "_typo", "?")
    assert _run(nowhere, tmp_path) == "missed n (pytest exited 4: the tests did not run)"
