"""Verifying commits across a torch node and an MLX node, as real processes on one FileMailbox
(the nodes of tests/test_mlx_runs.py: mlx_node.py and mixed_torch_node.py, the same 2-layer MLP,
standard DiLoCo's barrier with a quorum of both nodes, a round every 4 steps: rounds 0..7).

- Honest: the MLX node creates the run and closes every round; the torch node follows with
  ``verify=1.0``, so it recomputes each of the MLX node's merges before applying it: every round
  is ``RoundVerified`` (the merge is the same bits on both). Once both have left,
  ``gradientmail verify`` finds every round of the window verified and exits 0.
- Forged: the torch node creates the run and its closer forges rounds 3 and 7 (the newest round
  of the run), writing records consistent with what it wrote (``forgery.forge``); the MLX node
  follows with ``verify=1.0``. It reports the forgery in round 3, applies neither it nor any
  later commit of the torch node, keeps stepping and leaves (its liveness); the torch node, whose
  rounds then wait for a contribution that never comes, finishes once the MLX node has left.
  ``gradientmail verify`` names round 3 and the torch node first, finds round 7 forged too, and
  exits 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
pytestmark = pytest.mark.slow
ARGS = ["--steps", "32"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _pair(tmp_path: Path, creator: tuple[str, str, list[str]], follower: tuple[str, str, list[str]]) -> dict:
    """Run the two node scripts ((script, learner id, extra args)), the creator first (it claims
    round 0, so it closes every round); each node's result line."""
    box = tmp_path / "mailbox"
    deadline = time.monotonic() + 150
    procs = []
    try:
        for i, (script, learner, extra) in enumerate((creator, follower)):
            if i == 1:
                while not (box / "claims" / f"{0:010d}" / "001.json").exists():
                    assert procs[0][0].poll() is None, procs[0][1].read_text()[-3000:]
                    assert time.monotonic() < deadline, "the creator never claimed round 0"
                    time.sleep(0.05)
            log = tmp_path / f"{learner}.log"
            argv = [sys.executable, str(HERE / script), "--mailbox", box.as_uri(), "--learner-id", learner,
                    "--out", str(tmp_path / learner), *ARGS, *extra]  # fmt: skip
            with open(log, "wb") as err:
                procs.append((subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=_env(), cwd=ROOT), log))
        out = {}
        for (p, log), (_, learner, _) in zip(procs, (creator, follower), strict=True):
            try:
                stdout, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{learner} timed out; its log ends:\n{log.read_text()[-3000:]}")
            assert p.returncode == 0, f"{learner} exited {p.returncode}:\n{log.read_text()[-3000:]}"
            out[learner] = json.loads(stdout.decode().strip().splitlines()[-1])
        return out
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _verify(box: Path, *args: str) -> tuple[int, str]:
    p = subprocess.run(
        [sys.executable, "-m", "gradientmail_core.cli", "verify", box.as_uri(), *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=120,
    )
    return p.returncode, p.stdout + p.stderr


def _seen(result: dict, event: str) -> list[int]:
    return [e["round"] for e in result["seen"] if e["event"] == event]


def test_a_torch_follower_verifies_every_merge_of_an_mlx_closer_and_verify_passes(tmp_path):
    res = _pair(tmp_path, ("mlx_node.py", "mlx-a", []), ("mixed_torch_node.py", "torch-b", ["--verify", "1.0"]))
    torch_b = res["torch-b"]
    assert _seen(torch_b, "RoundVerified") == list(range(8))
    assert _seen(torch_b, "Aligned") == list(range(8))
    assert not _seen(torch_b, "ForgedCommit") and not _seen(torch_b, "RoundUnverifiable")
    assert not _seen(res["mlx-a"], "RoundVerified")  # (the closer checks nothing: verify=0)
    rc, out = _verify(tmp_path / "mailbox")
    assert rc == 0, out
    assert out.count("  verified") == 8 and "8 verified, 0 mismatch, 0 unverifiable" in out


def test_an_mlx_follower_refuses_a_torch_closers_forged_commits_and_verify_names_the_first(tmp_path):
    res = _pair(
        tmp_path,
        ("mixed_torch_node.py", "torch-a", ["--forge", "3,7"]),
        ("mlx_node.py", "mlx-b", ["--verify", "1.0"]),
    )
    mlx_b = res["mlx-b"]
    assert _seen(mlx_b, "RoundVerified") == [0, 1, 2]
    assert _seen(mlx_b, "ForgedCommit") == [3]  # reported in the round it received
    assert _seen(mlx_b, "Aligned") == [0, 1, 2]  # never applied
    # It stopped contributing (its commits stopped), trained its 32 steps alone and left: the
    # forger's round 4 waited for it (a quorum of both) and closed once it had gone. So it saw
    # no later commit (those of a closer it no longer follows are refused: tests/test_verify.py).
    assert _seen(mlx_b, "CommitRefused") == [3]
    assert len(mlx_b["losses"]) == 2
    forged = next(e for e in mlx_b["seen"] if e["event"] == "ForgedCommit")
    assert forged["closer"] == "torch-a"
    assert _seen(res["torch-a"], "Aligned") == list(range(8))  # the forger went on, and finished
    rc, out = _verify(tmp_path / "mailbox")
    assert rc == 1, out
    lines = {int(x.split()[1]): x for x in out.splitlines() if x.startswith("round ")}
    assert sorted(lines) == list(range(8))
    assert [r for r, x in lines.items() if "  mismatch" in x] == [3, 7]
    assert all("  verified" in x for r, x in lines.items() if r not in (3, 7))
    assert "FIRST MISMATCH: round 3 (fragment 1 version 2), closed by torch-a" in out
