"""The README's demo, in its reduced mode: learner processes, a kill and a restart, a summary,
trained with ``gm.DiLoCo.frugal`` and zstd."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
# The demo runs in its own process: find these without importing them here (lightning alone is
# 3 s of every test worker's collection).
_missing = [m for m in ("lightning", "rich", "matplotlib") if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"the demo needs {', '.join(_missing)}", allow_module_level=True)

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.cli.overview import read_manifest  # noqa: E402
from gradientmail_core.config import FRUGAL  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(900)  # about a minute on an idle 2-core machine; far more on a busy one
def test_quick_demo_trains_survives_a_kill_and_reports_sane_numbers(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--quick", "--plain", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=880,
        cwd=tmp_path,
    )
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + logs
    s = json.loads((tmp_path / "summary.json").read_text())

    for name in ("initial_loss", "diloco_loss", "baseline_loss"):
        assert math.isfinite(s[name]), (name, s[name])
    assert s["initial_loss"] > 4.0  # about ln(128) for an untrained character model
    assert s["diloco_loss"] < s["initial_loss"] - 0.5
    assert s["baseline_loss"] < s["initial_loss"] - 0.5
    assert s["communication_ratio"] > 1
    assert s["diloco_bytes"] > 0 and s["data_parallel_bytes"] > s["diloco_bytes"]
    assert s["rounds_committed"] >= s["steps"] * 2 // 10 // 2  # fragments=2, H=10: a round per 5 steps

    # The run is gm.DiLoCo.frugal over the demo's own options, as its manifest says, and every
    # delta went out zstd-compressed (compression is each session's own: not in the manifest).
    cfg = read_manifest(gm.FileMailbox(str(tmp_path / "mailbox"))).cfg
    assert {name: getattr(cfg, name) for name in FRUGAL} == FRUGAL
    assert (cfg.sync_every, cfg.fragments, cfg.quorum_size, cfg.overlap_steps) == (10, 2, s["learners"], 2)
    assert (s["preset"], s["compression"], s["algorithm"]) == ("frugal", "zstd", cfg.to_dict())
    deltas = [p.name for p in (tmp_path / "mailbox" / "blobs" / "snapshots").rglob("*") if p.is_file()]
    assert deltas and all(name.endswith(".zst") for name in deltas), deltas
    # It moved a fraction of what F32 deltas would have (an estimate of their payloads alone, which
    # a --quick --f32 run measures at 6.0x less than data-parallel against the estimate's 6.8x;
    # this config measured 21.5x).
    assert s["communication_ratio"] > 2 * s["f32_communication_ratio"], s
    assert math.isfinite(s["loss_ratio"]) and s["loss_ratio"] == s["diloco_loss"] / s["baseline_loss"]

    # One learner was killed and restarted, and every learner trained all its steps.
    assert len(s["killed"]) == 1
    assert s["learner_steps"] == {f"learner-{i}": s["steps"] for i in range(s["learners"])}
    assert any("restarted" in e for e in s["events"]), s["events"]

    png = Path(s["plot"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = proc.stdout
    assert "Held-out loss" in out and "less than synchronous data-parallel" in out
    assert "x the baseline's" in out and "gm.DiLoCo.frugal" in out and "plain F32 deltas (--f32)" in out
    assert str(png) in out.replace("\n", "")
    assert f"gradientmail status {s['mailbox']}" in out.replace("\n", "")
    # Piped, every phase says it is on: loading, training (a progress line), the baseline.
    assert "started 3 learner processes" in out and "learners done (held-out loss" in out
    assert f"baseline step {s['steps']}/{s['steps']}" in out
    # The gap's breakdown: what this run counts, and what it cannot separate.
    gap = s["gap"]
    assert gap["learner_steps"] == sum(s["learner_steps"].values()) and gap["mixing"] == 0.5
    assert 0 <= gap["lost_to_kill"] <= s["steps"] and gap["dropped_at_end"] >= 0
    said = " ".join(out.replace("│", " ").split())  # the summary panel, unwrapped
    assert f"never reached a commit ({gap['lost_to_kill']} died with the killed learner" in said
    assert "The rest, which one run cannot split" in said
