"""Real processes training one run through a FileMailbox: torch + MLX nodes, and MLX + MLX.

The nodes are scripts beside this file (mlx_node.py, mixed_torch_node.py, training the same
2-layer MLP), and the two examples (examples/mlx_learner.py, examples/torch_learner.py). The
first node started creates the run and claims round 0, so it closes the rounds. Checks: both
learners contribute to every round, nothing is rejected, the first node commits, both end with
bit-identical parameters, the loss went down, and the MLX node never imports torch (asserted
inside mlx_node.py, which then exits non-zero).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
pytestmark = pytest.mark.slow


def _start(script: Path, args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as err:
        return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=err, env=env,
                                cwd=ROOT)  # fmt: skip


def _finish(proc: subprocess.Popen, log: Path, deadline: float) -> dict:
    try:
        stdout, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{proc.args[1]} timed out; its log ends:\n{log.read_text()[-3000:]}")
    assert proc.returncode == 0, f"{proc.args[1]} exited {proc.returncode}; its log ends:\n{log.read_text()[-3000:]}"
    return json.loads(stdout.decode().strip().splitlines()[-1])


def _run_pair(tmp_path: Path, nodes: list[tuple[Path, str]], args: list[str], rounds_expected: int) -> dict:
    """Start ``nodes`` ((script, learner id), creator first) on one FileMailbox; check the run."""
    box = tmp_path / "mailbox"
    deadline = time.monotonic() + 120
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for i, (script, learner) in enumerate(nodes):
            if i == 1:  # the creator must have made the run and claimed round 0 first
                claim = box / "claims" / f"{0:010d}" / "001.json"
                while not claim.exists():
                    p0, log0 = procs[0]
                    assert p0.poll() is None, f"{script} exited early; its log ends:\n{log0.read_text()[-3000:]}"
                    assert time.monotonic() < deadline, "the first node never claimed round 0"
                    time.sleep(0.05)
            log = tmp_path / f"{learner}.log"
            node_args = ["--mailbox", box.as_uri(), "--learner-id", learner, "--out", str(tmp_path / learner)]
            procs.append((_start(script, node_args + args, log), log))
        results = {learner: _finish(p, log, deadline) for (p, log), (_, learner) in zip(procs, nodes)}
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()

    ids = [learner for _, learner in nodes]
    rounds = [json.loads(p.read_text()) for p in sorted((box / "rounds").glob("*.json"))]
    assert [r["round"] for r in rounds] == list(range(rounds_expected)), "one committed record per round, no gaps"
    for r in rounds:
        assert sorted(p["learner"] for p in r["participants"]) == sorted(ids), r
        assert r["rejected"] == [], r
    assert rounds[0]["closer"] == ids[0]  # the creator claimed round 0...
    assert {r["closer"] for r in rounds} == {ids[0]}  # ...and the closer stays put while it lives

    params = []
    for learner in ids:
        with np.load(tmp_path / f"{learner}.npz", allow_pickle=False) as f:
            params.append(dict(f))
    assert sorted(params[0]) == sorted(params[1])
    for name in params[0]:
        a, b = params[0][name], params[1][name]
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, name
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{name} differs between the nodes"
    return results


NODE_ARGS = ["--steps", "32"]  # mixed_common.ALGORITHM: a round every 4 steps, rounds 0..7


def test_torch_and_mlx_processes_train_one_run(tmp_path):
    pytest.importorskip("torch")
    nodes = [(HERE / "mlx_node.py", "mlx-a"), (HERE / "mixed_torch_node.py", "torch-b")]
    results = _run_pair(tmp_path, nodes, NODE_ARGS, rounds_expected=8)
    for res in results.values():
        first_loss, last_loss = res["losses"]
        assert last_loss < 0.5 * first_loss, res


def test_torch_and_mlx_processes_train_a_chunked_run(tmp_path):
    # Chunks of 32 elements cut the 8x16 weight over four payloads per delta and per commit: the
    # MLX node reads and writes the same chunk lists as the torch node, and both end bit-identical.
    pytest.importorskip("torch")
    nodes = [(HERE / "mlx_node.py", "mlx-a"), (HERE / "mixed_torch_node.py", "torch-b")]
    args = [*NODE_ARGS, "--chunk-elements", "32", "--delta-dtype", "F4"]
    results = _run_pair(tmp_path, nodes, args, rounds_expected=8)
    rounds = [json.loads(p.read_text()) for p in sorted((tmp_path / "mailbox" / "rounds").glob("*.json"))]
    assert all(r["theta"].get("more") for r in rounds if r["fragment"] == 0) or all(
        r["theta"].get("more") for r in rounds if r["fragment"] == 1
    ), "a fragment of the run is stored in several chunks"
    for res in results.values():
        first_loss, last_loss = res["losses"]
        assert last_loss < 0.5 * first_loss, res


def test_two_mlx_processes_train_one_run(tmp_path):
    nodes = [(HERE / "mlx_node.py", "mlx-a"), (HERE / "mlx_node.py", "mlx-b")]
    results = _run_pair(tmp_path, nodes, NODE_ARGS, rounds_expected=8)
    for res in results.values():
        first_loss, last_loss = res["losses"]
        assert last_loss < 0.5 * first_loss, res


def test_mlx_example_and_torch_example_train_one_run(tmp_path):
    # The two examples share the model's parameter names and build the same run config from
    # the same flags; this is the README's "a Mac and a Linux box" setup on one machine.
    pytest.importorskip("torch")
    examples = ROOT / "examples"
    nodes = [(examples / "mlx_learner.py", "mac-1"), (examples / "torch_learner.py", "linux-1")]
    args = ["--steps", "20", "--sync-every", "10", "--quorum", "2", "--overlap-steps", "0", "--wait-for", "2",
            "--poll-interval", "0.05", "--lease-timeout", "3"]  # fmt: skip
    results = _run_pair(tmp_path, nodes, args, rounds_expected=4)  # a round every 5 steps
    for res in results.values():
        assert res["steps"] == 20 and res["final_loss"] < res["initial_loss"] - 0.3, res
