"""Sharded (FSDP2) nodes through the integrations: Lightning ``ModelParallelStrategy`` with
``GradientMailCallback`` on two CPU ranks (gloo), as real processes (tests/sharded_lightning_node.py).

- The plumbing, with a stand-in session that checks at every call that both ranks make the same
  call (open, one step per real optimizer step with the node's samples, close) under one learner
  id, and that the learner id and counters survive a Lightning checkpoint on every rank.
- Issue 13's must-show: a 2-rank FSDP2 ``gm.Session`` node (torchrun, gloo), a 2-rank Lightning
  ``ModelParallelStrategy`` node and a plain node in lockstep (quorum 3, ``overlap_steps=0``), with
  64-element chunks that straddle the shards: all three end bit-identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from node_procs import run_nodes  # noqa: E402

from gradientmail_lightning.callback import check_sharded_module  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is unavailable"
)

NODE = "tests/sharded_lightning_node.py"
OPEN, STEP, CLOSE, WAIT, EXIT = 1, 2, 3, 4, 9


def lightning(mailbox: Path, out: Path, *extra: str) -> list[str]:
    return ["python", NODE, "lightning", "--mailbox", f"file://{mailbox}", "--out", str(out), *extra]


def results(out: Path, ranks: int = 2) -> list[dict]:
    return [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.timeout(120)
def test_model_parallel_ranks_make_the_same_session_calls_and_resume_as_one_learner(tmp_path: Path) -> None:
    mb = tmp_path / "mailbox"
    first = ("--steps", "4", "--accumulate", "2", "--wait", "1", "--fake-session")
    run_nodes([lightning(mb, tmp_path / "a", *first, "--save", str(tmp_path / "ckpt"))], logs=tmp_path / "logs-a")
    ranks = results(tmp_path / "a")
    for r in ranks:
        assert r["world_size"] == 2 and r["global_step"] == 4 and r["steps"] == 4
        assert r["samples"] == 4 * 2 * 8 * 2  # steps x accumulated batches x batch x ranks
        # Lightning's ModelParallelStrategy with fully_shard: Shard(0) DTensors on a 1-D mesh.
        assert set(r["mesh_ndim"].values()) == {1}
        assert all(p == ["S(0)"] for p in r["placements"].values()), r["placements"]
    learner = ranks[0]["learner_id"]
    assert learner and ranks[1]["learner_id"] == learner  # rank 0's id, given to rank 1
    step = [STEP, 32, learner]  # one session step per real optimizer step, the node's samples
    assert ranks[0]["calls"] == [[OPEN, 0, learner], [WAIT, 1, learner], *[step] * 4, [CLOSE, 0, learner]]
    assert ranks[1]["calls"] == [[OPEN, 0, learner], *[step] * 4, [CLOSE, 0, learner]]  # rank 0 alone waits

    # Resumed: every rank loads rank 0's callback state (Lightning keeps no per-rank callback
    # state), so the node rejoins under its learner id and counts on from 4 steps.
    again = ("--steps", "6", "--accumulate", "2", "--fake-session", "--resume", str(tmp_path / "ckpt"))
    run_nodes([lightning(mb, tmp_path / "b", *again)], logs=tmp_path / "logs-b")
    for r in results(tmp_path / "b"):
        assert r["learner_id"] == learner and r["global_step"] == 6 and r["steps"] == 6
        assert r["calls"] == [[OPEN, 0, learner], *[step] * 2, [CLOSE, 0, learner]]


def test_model_parallel_without_fully_shard_is_refused_when_training_starts() -> None:
    plain = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=2)
    with pytest.raises(ValueError, match="fully_shard"):
        check_sharded_module(trainer, plain)  # type: ignore[arg-type]
    check_sharded_module(SimpleNamespace(strategy=ModelParallelStrategy(), world_size=1), plain)  # type: ignore[arg-type]
