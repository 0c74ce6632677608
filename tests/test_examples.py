"""The examples run, in a quick configuration (tiny model, few steps), and print a sane last line.

Each runs as a subprocess exactly as a user would start it; only the command-line options differ
from the defaults."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.timeout(600)


def run_example(script: str, *args: str, cwd: Path) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,  # a hang, not a speed limit: generous for a loaded 2-core machine
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{script} printed nothing\n{proc.stderr[-3000:]}"
    return lines[-1]


def test_synthetic(tmp_path: Path) -> None:
    args = ["--learners", "2", "--steps", "40", "--sync-every", "10", "--step-sleep", "0"]
    last = run_example("synthetic.py", *args, "--mailbox", str(tmp_path / "mb"), cwd=tmp_path)
    assert last == "all learners hold identical parameters: True"


# "2 nodes, 12 s: newest committed round 3; held-out loss 4.853 -> 4.120 nats/char ..."
_LM_LAST = re.compile(r"^2 nodes, \d+ s: newest committed round (-?\d+); held-out loss ([\d.]+) -> ([\d.]+) nats/char")


def _check_lm(last: str) -> None:
    m = _LM_LAST.match(last)
    assert m, last
    newest, before, after = int(m.group(1)), float(m.group(2)), float(m.group(3))
    assert newest >= 0  # some round committed and was loaded
    assert math.isfinite(after) and 0 < after and math.isfinite(before)
    assert after != before  # the evaluated model is the trained one, not the untrained copy


def test_lightning_lm(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    args = ["--nodes", "2", "--steps", "20", "--sync-every", "10", "--batch", "8", "--size", "quick"]
    args += ["--mailbox", f"file://{tmp_path / 'mb'}", "--log-dir", str(tmp_path / "logs")]
    _check_lm(run_example("lightning_lm.py", *args, cwd=tmp_path))


def test_accelerate_lm(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    args = ["--nodes", "2", "--steps", "20", "--sync-every", "10", "--batch", "8", "--accumulate", "1"]
    args += ["--size", "quick", "--cpu", "--mailbox", f"file://{tmp_path / 'mb'}"]
    _check_lm(run_example("accelerate_lm.py", *args, cwd=tmp_path))


def test_torch_learner_over_moto_s3(tmp_path: Path, s3_server: str) -> None:
    boto3 = pytest.importorskip("boto3")
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="example")
    args = ["--mailbox", "s3://example/runs/quick", "--endpoint-url", s3_server, "--learner-id", "solo"]
    args += ["--steps", "40", "--sync-every", "10", "--fragments", "2", "--poll-interval", "0.05"]
    summary = json.loads(run_example("torch_learner.py", *args, cwd=tmp_path))
    assert summary["learner"] == "solo" and summary["steps"] == 40
    assert summary["rounds_seen"] >= 1
    assert math.isfinite(summary["initial_loss"]) and math.isfinite(summary["final_loss"])
    assert summary["final_loss"] < summary["initial_loss"]
