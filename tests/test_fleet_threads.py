"""``bench/fleet_threads.py``: real learner threads over one MemoryMailbox, counted per node and cut
per committed round. Structure only: the figures are wall-clock and the machine is shared, so no
threshold on time is asserted here."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    # Loaded by path: bench/ is not put on sys.path (bench/requests.py would shadow the library).
    spec = importlib.util.spec_from_file_location("fleet_threads", ROOT / "bench" / "fleet_threads.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fleet_threads"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_threaded_fleet_counts_every_node_and_every_committed_round(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "fleet.json"
    argv = ["--learners", "3", "6", "--rounds", "3", "--warmup", "1", "--step-ms", "5", "--poll", "0.05"]
    results = bench.main([*argv, "--timeout", "60", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "| learners |" in printed and "6 vs 3 learners" in printed
    assert [r.learners for r in results] == [3, 6]
    for r in results:
        names = [f"n{i:03d}" for i in range(r.learners)]
        assert sorted(r.nodes) == names, "every node is counted"
        for name, counts in r.nodes.items():
            assert set(counts) >= {"LIST", "GET", "PUT", "DELETE", "down", "up", "contribution_down"}, name
            assert counts["PUT"] > 0 and counts["up"] > 0, f"{name} contributed nothing in the measured rounds"
        assert len(r.closers) == r.rounds and set(r.closers) <= set(names)
        assert len(r.latency) == r.rounds and all(t >= 0 for t in r.latency)
        assert r.contribution_bytes > 0
        assert r.closer_mean["worth"] > 0, "the closer read the others' contributions"
        assert r.max_worth >= r.closer_mean["worth"]
        assert r.interval_median > 0 and r.gather_median >= 0 and r.close_median >= 0
        assert all(p is None or 1 <= p <= r.learners for p in r.participants)
        for d in (r.follower_mean, r.follower_max, r.closer_mean, r.closer_max):
            assert {"LIST", "GET", "PUT", "DELETE", "down", "up", "requests", "worth"} <= set(d)
            assert all(math.isfinite(v) for v in d.values())
        assert not [o for o in r.odd if "failed" in o or "abort" in o], r.odd
    saved = json.loads(out.read_text())
    assert [r["learners"] for r in saved] == [3, 6] and set(saved[1]["nodes"]) == set(results[1].nodes)


def test_max_contributions_passes_through_to_the_run():
    bench = _bench()
    fleet = bench.Fleet(3, max_contributions=2)
    assert fleet.cfg.max_contributions == 2 and fleet.cfg.quorum_size == 3
    assert bench.Fleet(3).cfg.max_contributions is None
