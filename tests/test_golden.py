"""Golden runs (``tests/golden_runs.py``): every case run again gives exactly the round records,
payload bytes and final parameters stored in ``tests/golden/runs/``, and covers what it claims.

A failure here means the numerics or the wire format changed. Do not regenerate the files to make
it pass: find the change (the message names the first fields that differ), and if it is meant,
justify it in a commit of its own (``tests/golden_runs.py``'s docstring).
"""

from __future__ import annotations

import copy
import functools
import json

import numpy as np
import pytest
from golden_runs import BY_NAME, CASES, RUNS, Outcome, differences, golden_path, run_case

import gradientmail_core as gm
from gradientmail_core.codec.plan import is_whole
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol.store import RunStore

NAMES = [c.name for c in CASES]


@functools.cache
def outcome(name: str) -> Outcome:
    """Each case runs once per session; the comparison and the coverage check share it."""
    return run_case(BY_NAME[name])


@pytest.mark.parametrize("name", NAMES)
def test_a_golden_run_writes_the_recorded_records_payloads_and_parameters(name: str) -> None:
    path = golden_path(name)
    assert path.exists(), f"no golden file {path}: written only deliberately (tests/golden_runs.py --write)"
    diffs = differences(json.loads(path.read_text()), outcome(name).golden)
    assert not diffs, (
        f"case {name} no longer matches {path.name}; first differences:\n  "
        + "\n  ".join(diffs)
        + "\nThe numerics or the wire format changed. Never regenerate to make a refactor pass."
    )


@pytest.mark.parametrize("name", NAMES)
def test_a_golden_run_covers_what_its_case_claims(name: str) -> None:
    o = outcome(name)
    missing = set(BY_NAME[name].expect) - coverage(o)
    assert not missing, f"case {name} claims {sorted(missing)} but its run shows none of it"
    assert len(o.records) >= 2 * o.run.P, "a few rounds of every fragment"
    assert any(len(r.participants) >= 2 for r in o.records), "at least one merge of several contributions"


def test_every_golden_file_is_a_case() -> None:
    assert sorted(p.stem for p in RUNS.glob("*.json")) == sorted(NAMES)


def test_the_recorded_manifests_read_as_the_rules_they_ran() -> None:
    # Recorded when Overwrite was the default and was not written: a manifest without an
    # ``alignment`` still reads as Overwrite (Blend with ``mixing``), whatever the default is now.
    for name in NAMES:
        config = json.loads(golden_path(name).read_text())["manifest"]["config"]
        cfg = gm.DiLoCo.from_dict(config)
        if "alignment" in config:
            assert cfg.alignment != gm.Overwrite(), name
        elif config["mixing"]:
            assert cfg.alignment == gm.Blend(mixing=config["mixing"]), name
        else:
            assert cfg.alignment == gm.Overwrite(), name
        assert cfg.to_dict() == config, name  # and writes the same manifest again


def test_differences_name_the_first_field_that_differs() -> None:
    expected = json.loads(golden_path(NAMES[0]).read_text())
    got = copy.deepcopy(expected)
    got["rounds"][1]["participants"][0]["weight"] += 1e-9
    key = sorted(got["payloads"])[3]
    got["payloads"][key]["sha256"] = "0" * 64
    del got["rounds"][-1]
    n = len(expected["rounds"])
    assert differences(expected, got) == [
        f"rounds: 2 of {n} entries differ",
        f"rounds: {n} entries expected, got {n - 1}",
        f"rounds[1].participants[0].weight: expected {expected['rounds'][1]['participants'][0]['weight']!r}, "
        f"got {got['rounds'][1]['participants'][0]['weight']!r}",
        f"payloads: 1 of {len(expected['payloads'])} entries differ",
        f'payloads.{key}.sha256: expected "{expected["payloads"][key]["sha256"]}", got "{"0" * 64}"',
    ]
    assert differences(expected, copy.deepcopy(expected)) == []


# ---- what a run shows -------------------------------------------------------------------------


def coverage(o: Outcome) -> set[str]:
    """The features a run's records and payloads show (the names used in ``Case.expect``)."""
    run, cfg = o.run, o.run.cfg
    plans = [run.plan(f) for f in range(run.P)]
    found: set[str] = set()
    if cfg.chunk_elements is None:
        found.add("whole")
    elif any(len(p) > 1 for p in plans):
        found.add("chunked")
        if any(len(p) == 1 for p in plans):
            found.add("one_chunk_fragment")
        if any(not is_whole(pc, run.shapes[f]) for f, p in enumerate(plans) for chunk in p for pc in chunk):
            found.add("split")
    if isinstance(cfg.merge, gm.RDA) and any(cfg.merge.is_direct(n) for names in run.fragments for n in names):
        found.add("direct")
    if any(k.endswith(".zst") for k in o.blobs):
        found.add("zstd")
    if any(x.reason == "outlier" for r in o.records for x in r.rejected):
        found.add("outlier")
    if any(r.change is not None for r in o.records):
        found.add("change")
    if any(not r.is_checkpoint for r in o.records):
        found.add("between_checkpoints")
    if any(s.final for s in o.snapshots):
        found.add("final_snapshot")
    if any(r.final for r in o.records):
        found.add("final_round")
    if len({r.closer for r in o.records}) > 1:
        found.add("takeover")
    if any(not run.master_is_theta(f) and cfg.commit_dtype is None for f in range(run.P)):
        found.add("master")
    if cfg.clip_norm is not None:
        norms = merged_norms(o)
        if min(norms) <= cfg.clip_norm < max(norms):
            found.add("clipped")  # some merged contributions were scaled down, some were not
    return found


def merged_norms(o: Outcome) -> list[float]:
    """The L2 norm of every contribution a round merged, decoded from the payloads written."""
    store = MemoryMailbox()
    for k, data in o.blobs.items():
        store.put_if_absent(k, data)
    reader = RunStore(store)
    snaps = {(s.round, s.learner): s for s in o.snapshots}
    norms = []
    for r in o.records:
        for p in r.participants:
            delta = reader.get_payload(
                snaps[r.round, p.learner].payload, o.run.shapes[r.fragment], chunk_elements=o.run.chunk_elements
            )
            assert delta is not None
            norms.append(float(np.sqrt(sum(np.sum(np.square(v, dtype=np.float64)) for v in delta.values()))))
    return norms
