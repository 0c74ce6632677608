"""The README's demo, in its reduced mode: learner processes, a kill and a restart, a summary."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("rich")
pytest.importorskip("matplotlib")

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

    # One learner was killed and restarted, and every learner trained all its steps.
    assert len(s["killed"]) == 1
    assert s["learner_steps"] == {f"learner-{i}": s["steps"] for i in range(s["learners"])}
    assert any("restarted" in e for e in s["events"]), s["events"]

    png = Path(s["plot"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = proc.stdout
    assert "Held-out loss" in out and "less than synchronous data-parallel" in out
    assert str(png) in out.replace("\n", "")
    assert f"gradientmail status {s['mailbox']}" in out.replace("\n", "")
