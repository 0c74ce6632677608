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

import numpy as np
import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from node_procs import run_nodes  # noqa: E402
from sharded_node import model  # noqa: E402

from gradientmail_lightning.callback import check_sharded_module  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is unavailable"
)

NODE = "tests/sharded_lightning_node.py"
OPEN, STEP, CLOSE, WAIT, EXIT = 1, 2, 3, 4, 9


def lightning(mailbox: Path, out: Path, *extra: str) -> list[str]:
    return ["python", NODE, "--mailbox", str(mailbox), "--out", str(out), *extra]


def results(out: Path, ranks: int = 2) -> list[dict]:
    return [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.timeout(120)
def test_model_parallel_ranks_make_the_same_session_calls_and_resume_as_one_learner(tmp_path: Path) -> None:
    mb = tmp_path / "mailbox"
    first = ("--steps", "4", "--accumulate", "2", "--learners", "1", "--fake-session")
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


@pytest.mark.timeout(120)
def test_a_failed_wait_on_rank_0_raises_on_every_rank_instead_of_hanging(tmp_path: Path) -> None:
    # Rank 0 alone waits for the other learners; the stand-in session's wait times out there.
    args = ("--steps", "2", "--learners", "2", "--fake-session", "--expect-failure")
    run_nodes([lightning(tmp_path / "mailbox", tmp_path / "a", *args)], logs=tmp_path / "logs", timeout=100)
    r0, r1 = results(tmp_path / "a")
    assert r0["error"] == "TimeoutError" and "learners seen" in r0["message"], r0
    assert r1["error"] == "SessionFailed" and "another rank" in r1["message"], r1
    learner = r0["calls"][0][2]
    assert r0["calls"] == [[OPEN, 0, learner], [WAIT, 2, learner], [EXIT, 0, learner]]
    assert r1["calls"] == [[OPEN, 0, learner], [EXIT, 0, learner]]  # no step: both left at once


def test_model_parallel_without_fully_shard_is_refused_when_training_starts() -> None:
    plain = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=2)
    with pytest.raises(ValueError, match="fully_shard"):
        check_sharded_module(trainer, plain)  # type: ignore[arg-type]
    check_sharded_module(SimpleNamespace(strategy=ModelParallelStrategy(), world_size=1), plain)  # type: ignore[arg-type]


STEPS = 12  # sync_every=4, fragments=2: a round every 2 steps
RUN = ("--steps", str(STEPS), "--sync-every", "4", "--quorum", "3", "--learners", "3", "--chunk", "64")
RUN += ("--lease-timeout", "20")
SESSION_NODE = "tests/sharded_node.py"  # the torchrun Session node (and the plain node) of test_sharded_session


@pytest.mark.timeout(180)
def test_a_session_node_a_lightning_node_and_a_plain_node_in_lockstep_end_bit_identical(tmp_path: Path) -> None:
    mb = tmp_path / "mailbox"
    mb.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    torchrun = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

    def session_node(kind: str, name: str) -> list[str]:
        return [SESSION_NODE, kind, "--mailbox", str(mb), "--id", name, "--out", str(out / name), *RUN]

    run_nodes(
        [
            ["python", *session_node("plain", "plain")],  # creates the run and closes every round
            [*torchrun, *session_node("sharded", "shard")],  # 2 ranks, gm.Session on each
            lightning(mb, out / "lightning", "--id", "lightning", *RUN),  # 2 ranks, ModelParallelStrategy
        ],
        logs=tmp_path / "logs",
        timeout=160,
    )
    finals = {}
    for name, path in [("plain", "plain.npz"), ("shard", "shard.npz"), ("lightning", "lightning/params.npz")]:
        with np.load(out / path, allow_pickle=False) as z:
            finals[name] = {k: z[k] for k in z.files}
    names = sorted(n for n, _ in model().named_parameters())
    assert all(sorted(f) == names for f in finals.values())
    for n in names:  # bit for bit, the Session node's and the Lightning node's gathered with full_tensor()
        assert finals["plain"][n].tobytes() == finals["shard"][n].tobytes() == finals["lightning"][n].tobytes(), n
    initial = {n: p.detach().numpy() for n, p in model().named_parameters()}
    assert any(initial[n].tobytes() != finals["plain"][n].tobytes() for n in names)

    # Lockstep: every round committed with all three contributions, and the plain and the Session
    # node aligned with each commit.
    aligned = json.loads((out / "plain.json").read_text())["aligned"]
    assert [a[0] for a in aligned] == list(range(STEPS // 2)), aligned
    assert all(a[3] == ["lightning", "plain", "shard"] for a in aligned), aligned
    shard = [json.loads((out / f"shard.r{r}.json").read_text()) for r in range(2)]
    assert shard[0]["aligned"] == aligned
    ranks = results(out / "lightning")
    assert all(r["steps"] == STEPS and r["learner_id"] == "lightning" for r in ranks)
    # 64-element chunks straddle the two ranks' shards: the Session node's ranks exchanged pieces
    # (the Lightning node has the same plan, world size and chunks).
    assert all(r["exchanges"] > 0 for r in shard), shard
