"""Accelerate nodes as real processes (tests/accelerate_node.py) over a FileMailbox: one
process per node with gradient accumulation, and a node of 2 processes under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("torch")

from accelerate_node import make_model  # noqa: E402
from node_procs import (  # noqa: E402
    assert_same_params,
    newest_params,
    params,
    participants,
    result,
    round_records,
    run_nodes,
)


def node(mailbox: Path, out: Path, *extra: str, processes: int = 1) -> list[str]:
    launch = (
        ["python"]
        if processes == 1
        else [
            "python",
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
        ]
    )
    return [*launch, "tests/accelerate_node.py", "--mailbox", f"file://{mailbox}", "--out", str(out), *extra]


@pytest.mark.timeout(240)
def test_two_accelerate_nodes_step_only_on_real_optimizer_steps(tmp_path: Path) -> None:
    mb = tmp_path / "mailbox"
    common = ("--batches", "10", "--accumulate", "2", "--wait", "2", "--quorum", "2")
    run_nodes(
        [
            node(mb, tmp_path / "a", *common, "--seed", "1", "--learner-id", "acc-a"),
            node(mb, tmp_path / "b", *common, "--seed", "2", "--learner-id", "acc-b"),
        ],
        logs=tmp_path / "logs",
    )
    newest = newest_params(make_model(), mb)
    for n in "ab":
        r = result(tmp_path / n)
        # 10 batches, accumulating 2: 5 real optimizer steps, and the session saw exactly those.
        assert r["steps"] == r["session_steps"] == 5
        assert r["samples"] == 5 * 2 * 16
        assert_same_params(params(tmp_path / n), newest)
    rounds = round_records(mb)
    assert sorted(rounds) == [0, 1]  # steps 2 and 4 (sync_every=4, fragments=2)
    assert all(participants(r) == {"acc-a", "acc-b"} for r in rounds.values())


@pytest.mark.timeout(240)
def test_two_process_accelerate_node_stays_in_sync_and_only_the_main_process_uses_the_mailbox(
    tmp_path: Path,
) -> None:
    mb = tmp_path / "mailbox"
    batches = 12
    common = ("--batches", str(batches), "--wait", "2", "--quorum", "2")
    run_nodes(
        [
            node(mb, tmp_path / "pair", *common, "--seed", "1", "--learner-id", "pair", processes=2),
            node(mb, tmp_path / "one", *common, "--seed", "2", "--learner-id", "one"),
        ],
        logs=tmp_path / "logs",
    )
    r0, r1 = result(tmp_path / "pair", 0), result(tmp_path / "pair", 1)
    assert (r0["world_size"], r1["world_size"]) == (2, 2)
    assert r0["steps"] == r1["steps"] == r0["session_steps"] == batches
    assert r0["aligned"] >= batches // 2 - 1
    assert r0["sync_checks"] == r1["sync_checks"] == batches + 1
    assert r0["sync_mismatches"] == r1["sync_mismatches"] == 0
    assert r0["mailbox_calls"] > 0 and r1["mailbox_calls"] == 0
    assert r0["samples"] == 2 * result(tmp_path / "one")["samples"]
    learners = set().union(*(participants(r) for r in round_records(mb).values()))
    assert learners == {"pair", "one"}
    newest = newest_params(make_model(), mb)
    for out, rank in ((tmp_path / "pair", 0), (tmp_path / "pair", 1), (tmp_path / "one", 0)):
        assert_same_params(params(out, rank), newest)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", ["accelerate-fsdp", "accelerate-fsdp1"])
def test_register_gradientmail_on_a_sharded_model_learns_closes_and_ends_bit_identical(check: str) -> None:
    # ``accelerator.register_gradientmail`` on a 2-process node whose model is sharded by hand on
    # the CPU (FSDP2 ``fully_shard``, or FSDP1 ``FullyShardedDataParallel(use_orig_params=True)``:
    # Accelerate's FSDP plugin does not start on a CPU), beside a plain node that only learns: the
    # sharded node closes every round and both end bit-identical (``bench/gpu_check.py``'s check,
    # run in its CPU dry-run mode; on a GPU the same check runs the plugin itself).
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    argv = [sys.executable, str(root / "bench" / "gpu_check.py"), "--check", check, "--cpu-dry-run", "--budget", "150"]
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "final parameters bit-identical" in done.stdout, done.stdout[-2000:]
