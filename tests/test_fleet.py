"""A fleet of unlike nodes in one run (issue 13): a 4-rank FSDP2 node, a 2-rank FSDP2 node, a plain
torch node and an MLX node train one MLP through one FileMailbox, every round merging all four
(quorum 4, ``overlap_steps=0``), and end with bit-identical parameters. The 4-rank node creates
the run and closes the rounds (its ranks merging their parts), so what it commits is read and
applied by a 2-rank node, a single process and MLX alike. Nothing stored depends on a node's
world size or framework: 32-element chunks cut every weight across ranks and payloads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core")
torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available() and TORCHRUN.exists()),
    reason="torch.distributed with gloo (and torchrun) is unavailable",
)


def _start(argv: list[str], log: Path, out: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")]))
    with open(log, "wb") as err, open(out, "wb") as stdout:
        return subprocess.Popen(argv, stdout=stdout, stderr=err, env=env, cwd=ROOT, start_new_session=True)


def test_a_four_rank_a_two_rank_a_plain_and_an_mlx_node_train_one_run_and_end_bit_identical(tmp_path):
    box = tmp_path / "mailbox"
    common = ["--steps", "16", "--chunk-elements", "32", "--quorum", "4", "--learners", "4"]
    nodes = {
        "four": [str(TORCHRUN), "--standalone", "--nproc_per_node=4", str(HERE / "mixed_torch_node.py")],
        "two": [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(HERE / "mixed_torch_node.py")],
        "plain": [sys.executable, str(HERE / "mixed_torch_node.py")],
        "mlx": [sys.executable, str(HERE / "mlx_node.py")],
    }
    procs = {}
    deadline = time.monotonic() + 240
    try:
        for i, (name, argv) in enumerate(nodes.items()):
            if i == 1:  # the 4-rank node creates the run (and closes its rounds)
                while not (box / "manifest.json").exists():
                    assert procs["four"].poll() is None, (tmp_path / "four.log").read_text()[-3000:]
                    assert time.monotonic() < deadline, "the 4-rank node never created the run"
                    time.sleep(0.05)
            args = ["--mailbox", box.as_uri(), "--learner-id", name, "--out", str(tmp_path / name), *common]
            procs[name] = _start([*argv, *args], tmp_path / f"{name}.log", tmp_path / f"{name}.out")
        for name, p in procs.items():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} timed out; its log ends:\n{(tmp_path / f'{name}.log').read_text()[-3000:]}")
            assert p.returncode == 0, f"{name} exited {p.returncode}:\n{(tmp_path / f'{name}.log').read_text()[-4000:]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    rounds = [json.loads(p.read_text()) for p in sorted((box / "rounds").glob("*.json"))]
    assert [r["round"] for r in rounds] == list(range(4)), "16 steps, a round every 4 steps"
    for r in rounds:
        assert sorted(p["learner"] for p in r["participants"]) == sorted(nodes), r
        assert r["rejected"] == [], r
    assert {r["closer"] for r in rounds} == {"four"}, [r["closer"] for r in rounds]
    assert any(r["theta"].get("more") for r in rounds), "no fragment is stored in several chunks"
    params = {}
    for name in nodes:
        with np.load(tmp_path / f"{name}.npz", allow_pickle=False) as f:
            params[name] = dict(f)
    want = params["plain"]
    for name, got in params.items():
        assert sorted(got) == sorted(want), name
        for n in want:
            assert got[n].dtype == np.float32 and got[n].tobytes() == want[n].tobytes(), f"{name}: {n} differs"
    for name in nodes:  # each node printed its losses: the model learned
        first, last = json.loads((tmp_path / f"{name}.out").read_text().strip().splitlines()[-1])["losses"]
        assert last < first, (name, first, last)
