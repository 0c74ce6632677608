"""Four real processes, four frameworks, one run: a torch, an MLX, a Flax NNX and a Keras 3 (jax
backend) node train the same small transformer LM (tests/test_four_frameworks_nodes.py) over a
FileMailbox, in lockstep (quorum 4, no overlap).

Checks: every round's record lists all four as accepted and rejects none; the torch node created
the run, so its schema is in torch's layout and the Flax and Keras nodes joined through
``layouts="torch"``; all four end bit-identical; each held-out loss fell. The same run with four
torch nodes, and the 2% figure, are a measurement in bench/README.md, not a test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

# Found, not imported: the nodes import them, each in its own process.
_missing = [m for m in ("torch", "mlx", "jax", "flax", "optax", "keras") if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"needs {', '.join(_missing)}", allow_module_level=True)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NODES = HERE / "test_four_frameworks_nodes.py"
pytestmark = pytest.mark.slow


def start(framework: str, learner: str, box: Path, out: Path, extra: list[str]) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["KERAS_BACKEND"] = "jax"
    env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"  # one thread each: four nodes share the cores
    log = out.parent / f"{learner}.log"
    args = ["--framework", framework, "--mailbox", box.as_uri(), "--learner-id", learner, "--out", str(out), *extra]
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, str(NODES), *args], stdout=subprocess.PIPE, stderr=err, env=env,
                                cwd=ROOT)  # fmt: skip
    return proc, log


def run_nodes(tmp_path: Path, nodes: list[tuple[str, str]], extra: list[str], timeout: float = 240) -> list[dict]:
    """Start ``nodes`` ((framework, learner id), the creator first) on one FileMailbox and wait."""
    box = tmp_path / "mailbox"
    deadline = time.monotonic() + timeout
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for i, (framework, learner) in enumerate(nodes):
            if i == 1:  # the creator (torch) makes the run, in its layout, before the others join
                while not (box / "manifest.json").exists():
                    p0, log0 = procs[0]
                    assert p0.poll() is None, f"the creator exited early:\n{log0.read_text()[-3000:]}"
                    assert time.monotonic() < deadline, "the creator never made the run"
                    time.sleep(0.05)
            procs.append(start(framework, learner, box, tmp_path / learner, extra))
        results = []
        for proc, log in procs:
            try:
                stdout, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{log.stem} timed out; its log ends:\n{log.read_text()[-3000:]}")
            assert proc.returncode == 0, f"{log.stem} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            results.append(json.loads(stdout.decode().strip().splitlines()[-1]))
        return results
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


FOUR = [("torch", "torch-a"), ("mlx", "mlx-b"), ("flax", "flax-c"), ("keras", "keras-d")]
STEPS = 24  # a round every 4 steps (H=8, P=2): rounds 0..5


def test_torch_mlx_flax_and_keras_nodes_train_one_run_in_lockstep(tmp_path):
    results = run_nodes(tmp_path, FOUR, ["--steps", str(STEPS)])
    box = tmp_path / "mailbox"
    manifest = json.loads((box / "manifest.json").read_text())
    layouts = {s["name"]: s.get("layout", "") for s in manifest["schema"]}
    assert layouts["block.proj.weight"] == "" and "block.proj.kernel" not in layouts  # torch's names and order

    rounds = [json.loads(p.read_text()) for p in sorted((box / "rounds").glob("*.json"))]
    assert [r["round"] for r in rounds] == list(range(STEPS // 4)), "one record per round, no gaps"
    ids = sorted(learner for _, learner in FOUR)
    for r in rounds:
        assert sorted(p["learner"] for p in r["participants"]) == ids, r
        assert r["rejected"] == [], r

    params = []
    for _, learner in FOUR:
        with np.load(tmp_path / f"{learner}.npz", allow_pickle=False) as f:
            params.append(dict(f))
    assert sorted(params[0]) == sorted(layouts)
    for name in params[0]:
        bits = [p[name].view(np.uint32) for p in params]
        for (framework, _), b in zip(FOUR[1:], bits[1:]):
            assert np.array_equal(bits[0], b), f"{name} differs between torch and {framework}"
    # every node trained: the held-out loss is well below a uniform guess's (ln 96 = 4.56)
    for res in results:
        assert res["held_out_loss"] < 3.9, res
