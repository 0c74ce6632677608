"""Lightning nodes as real processes (tests/lightning_node.py) over a FileMailbox:
``Trainer(strategy=MailboxDiLoCoStrategy(...))`` with one process per node, with a node that
is a 2-rank gloo DDP group, and a node stopped and resumed from a Lightning checkpoint."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("torch")

from lightning_node import TinyRegressor  # noqa: E402
from node_procs import (  # noqa: E402
    assert_same_params,
    newest_params,
    params,
    participants,
    result,
    round_records,
    run_nodes,
)

STEPS = 16
# sync_every=4, fragments=2: a round every 2 steps.
ROUNDS_PER_RUN = STEPS // 2


def node(mailbox: Path, out: Path, *extra: str) -> list[str]:
    return ["python", "tests/lightning_node.py", "--mailbox", f"file://{mailbox}", "--out", str(out), *extra]


def read_csv(root: Path) -> list[dict[str, str]]:
    (path,) = root.glob("node/version_*/metrics.csv")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(240)
def test_two_lightning_nodes_end_bit_identical_at_the_newest_commit_and_log_metrics(tmp_path: Path) -> None:
    mb = tmp_path / "mailbox"
    common = ("--steps", str(STEPS), "--wait", "2", "--quorum", "2")
    run_nodes(
        [
            node(
                mb, tmp_path / "a", *common, "--seed", "1", "--learner-id", "node-a", "--csv", str(tmp_path / "csv-a")
            ),
            node(
                mb, tmp_path / "b", *common, "--seed", "2", "--learner-id", "node-b", "--csv", str(tmp_path / "csv-b")
            ),
        ],
        logs=tmp_path / "logs",
    )
    a, b = result(tmp_path / "a"), result(tmp_path / "b")
    assert a["steps"] == b["steps"] == STEPS and a["global_step"] == STEPS
    newest = newest_params(TinyRegressor(), mb)
    assert_same_params(params(tmp_path / "a"), newest)
    assert_same_params(params(tmp_path / "b"), newest)

    rounds = round_records(mb)
    assert sorted(rounds) == list(range(ROUNDS_PER_RUN))
    assert all(participants(r) == {"node-a", "node-b"} for r in rounds.values())  # quorum_size=2
    for res in (a, b):
        losses = res["losses"]
        assert sum(losses[-4:]) < sum(losses[:4]) / 2, losses

    last_rows = {n: [r for r in read_csv(tmp_path / f"csv-{n}") if r.get("gm/round")][-1] for n in "ab"}
    for n, last in last_rows.items():
        assert float(last["gm/local_step"]) == STEPS, n
        assert float(last["gm/live_learners"]) == 2
        assert float(last["gm/participants"]) == 2
        assert -1.0 <= float(last["gm/cosine"]) <= 1.0
        assert float(last["gm/bytes_sent"]) > 0
        assert {"gm/version_0", "gm/version_1", "gm/rounds_seen", "gm/samples"} <= set(last)
    # A node that did not close a round downloaded the commit it aligned with.
    assert max(float(last["gm/bytes_received"]) for last in last_rows.values()) > 0


@pytest.mark.timeout(240)
def test_ddp_node_of_two_ranks_stays_in_sync_and_only_rank_0_uses_the_mailbox(tmp_path: Path) -> None:
    mb = tmp_path / "mailbox"
    steps = 12
    common = ("--steps", str(steps), "--wait", "2", "--quorum", "2")
    run_nodes(
        [
            node(mb, tmp_path / "ddp", *common, "--devices", "2", "--seed", "1", "--learner-id", "ddp-node"),
            node(mb, tmp_path / "one", *common, "--seed", "2", "--learner-id", "one-node"),
        ],
        logs=tmp_path / "logs",
    )
    r0, r1 = result(tmp_path / "ddp", 0), result(tmp_path / "ddp", 1)
    assert (r0["world_size"], r1["world_size"]) == (2, 2)
    # Checked after every optimizer step and at the end, on both ranks, with alignments happening.
    assert r0["aligned"] >= steps // 2 - 1
    assert r0["sync_checks"] == r1["sync_checks"] == steps + 1
    assert r0["sync_mismatches"] == r1["sync_mismatches"] == 0
    # Only rank 0 holds a session and talks to the mailbox.
    assert r0["mailbox_calls"] > 0 and r1["mailbox_calls"] == 0
    assert r0["learner_id"] == "ddp-node" and r1["learner_id"] is None
    learners = set().union(*(participants(r) for r in round_records(mb).values()))
    assert learners == {"ddp-node", "one-node"}
    # The node's samples are its global batch: both ranks' batches.
    assert r0["samples"] == r1["samples"] == 2 * result(tmp_path / "one")["samples"]
    newest = newest_params(TinyRegressor(), mb)
    for out, rank in ((tmp_path / "ddp", 0), (tmp_path / "ddp", 1), (tmp_path / "one", 0)):
        assert_same_params(params(out, rank), newest)


@pytest.mark.timeout(240)
def test_node_resumed_from_a_lightning_checkpoint_rejoins_without_losing_a_round(tmp_path: Path) -> None:
    mb, ckpt = tmp_path / "mailbox", tmp_path / "ckpt"
    # No --learner-id: the first run derives one, the resumed run must take it from the checkpoint.
    run_nodes([node(mb, tmp_path / "first", "--steps", "8", "--ckpt-dir", str(ckpt))], logs=tmp_path / "logs1")
    first = result(tmp_path / "first")
    assert sorted(round_records(mb)) == [0, 1, 2, 3]
    run_nodes(
        [node(mb, tmp_path / "second", "--steps", str(STEPS), "--resume", str(ckpt / "last.ckpt"))],
        logs=tmp_path / "logs2",
    )
    second = result(tmp_path / "second")
    assert second["learner_id"] == first["learner_id"]
    assert second["global_step"] == STEPS
    assert second["steps"] == STEPS  # the local step count continues from the checkpoint
    assert second["samples"] == STEPS * 16
    rounds = round_records(mb)
    assert sorted(rounds) == list(range(ROUNDS_PER_RUN))  # contiguous: none lost, none twice
    assert all(participants(r) == {first["learner_id"]} for r in rounds.values())
    assert [r["version"] for _, r in sorted(rounds.items())] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert_same_params(params(tmp_path / "second"), newest_params(TinyRegressor(), mb))
