"""A sharded node that closes rounds (issue 13): every rank judges, merges and steps the part of
each fragment it holds (``gradientmail_core/syncer/merger.py`` over its ranges), and the commits are the bytes a
one-process closer writes. Real processes: a 2-rank FSDP2 node under ``torchrun`` (gloo, CPU) and
a plain node that only learns (``role="learner"``), so the sharded node closes every round; the
two end bit-identical, so the sharded closer's parameters are the ones a plain closer would have
published (the plain node applies them as they are stored)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_sharded_session import check_contributions, finish, plain, sharded, snapshots

import gradientmail_core as gm
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import RoundRecord, Snapshot, chunk_refs
from gradientmail_core.protocol.run import RunInfo, read_manifest
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.merger import FragmentMerger
from gradientmail_core.syncer.replay import recompute, recover

torch = pytest.importorskip("torch")


def recompute_every_round(mailbox: Path) -> list[str]:
    """Commit every round of the run again with a one-process merger (from the state its previous
    record names and the contributions its record lists) and check the stored commit is the one
    it writes, byte for byte: the parameters and outer state (their chunks' sha256s, the theta
    digest), the change and the cosine. Returns each round's closer."""
    store = RunStore(gm.FileMailbox(str(mailbox)))
    manifest = read_manifest(store)
    assert manifest is not None
    run = RunInfo.from_manifest(manifest)
    newest: dict[int, RoundRecord | None] = {}
    closers = []
    r = 0
    while (rec := store.try_record(keys.round_key(r), RoundRecord)) is not None:
        f = rec.fragment
        merger = FragmentMerger.one_process(run, store)
        state = recover(merger, store, run, f, newest.get(f))
        refs = []
        for p in rec.participants:
            snap = store.read_record(keys.snapshot_key(r, p.learner), Snapshot)
            assert snap is not None, (r, p.learner)
            refs.append(snap.payload)
        mine = recompute(merger, store, run, state, rec, refs)
        merger.close()
        for field in ("theta", "outer", "change"):
            ours, theirs = mine.refs.get(field), getattr(rec, field)
            assert (ours is None) == (theirs is None), (r, field)
            if ours is not None:
                assert [x.sha256 for x in chunk_refs(ours)] == [x.sha256 for x in chunk_refs(theirs)], (r, field)
        assert (mine.theta_digest, mine.outer_digest, mine.cosine) == (
            rec.theta_digest,
            rec.outer_digest,
            rec.cosine,
        ), r
        newest[f] = rec
        closers.append(rec.closer)
        r += 1
    return closers


def _closed_by_shard(tmp_path: Path, *extra: str, steps: int = 24) -> tuple[dict, list[dict]]:
    mailbox = tmp_path / "mailbox"
    mailbox.mkdir()
    run = ("--steps", str(steps), "--keep", *extra)
    a = plain(mailbox, tmp_path / "plain", *run, "--role", "learner")
    b = sharded(mailbox, tmp_path / "shard", *run)
    finish(a, b)
    want, got = np.load(tmp_path / "plain.npz"), np.load(tmp_path / "shard.npz")
    for n in want:
        assert want[n].tobytes() == got[n].tobytes(), f"{n} differs"
    report = json.loads((tmp_path / "plain.json").read_text())
    ranks = [json.loads((tmp_path / f"shard.r{r}.json").read_text()) for r in range(2)]
    return report, ranks


def test_a_two_rank_node_closes_every_round_and_a_plain_learner_ends_bit_identical(tmp_path):
    report, ranks = _closed_by_shard(tmp_path)
    assert [a[0] for a in report["aligned"]] == list(range(6))
    assert all(a[3] == ["plain", "shard"] for a in report["aligned"]), report["aligned"]
    assert recompute_every_round(tmp_path / "mailbox") == ["shard"] * 6


@pytest.mark.parametrize(
    "extra",
    [
        # RDA (each tensor's merged norm pooled over the ranks), clipping (RDA's norms of the
        # clipped contributions: a pass of its own), the cosine, and an F8 change (one scale per
        # tensor: the ranks' maxima) from which the parameters are rebuilt.
        ("--merge", "rda", "--clip-norm", "0.02", "--commit-dtype", "F8_E4M3"),
        # F4 deltas and an F4 change (blocks of 32 counted from each tensor's start), no momentum.
        ("--delta-dtype", "F4", "--commit-dtype", "F4", "--momentum", "0"),
    ],
    ids=["rda-clip-f8", "f4"],
)
def test_a_sharded_closer_commits_the_bytes_of_a_one_process_closer(tmp_path, extra):
    report, _ = _closed_by_shard(tmp_path, *extra, steps=16)
    assert len(report["aligned"]) == 4
    assert recompute_every_round(tmp_path / "mailbox") == ["shard"] * 4


def stored_payloads(mailbox: Path) -> dict[str, list[str]]:
    """Every contribution (round and learner) and every commit's parameters, outer state and change
    (round and kind), as the sha256s of their chunks."""
    store = RunStore(gm.FileMailbox(str(mailbox)))
    out: dict[str, list[str]] = {}
    for snap in snapshots(store):
        out[f"contribution {snap.round} {snap.learner}"] = [c.sha256 for c in chunk_refs(snap.payload)]
    for key in store.keys(keys.ROUNDS):
        rec = store.read_record(key, RoundRecord)
        assert rec is not None
        for kind in ("theta", "outer", "change"):
            ref = getattr(rec, kind)
            out[f"{kind} {rec.round}"] = [] if ref is None else [c.sha256 for c in chunk_refs(ref)]
    return out


def test_anchors_on_the_device_in_host_memory_or_on_disk_upload_and_commit_the_same_bytes(tmp_path):
    # The same lockstep run three times, the sharded node (the closer) keeping its ranks' anchors
    # beside the parameters, in host memory (on this CPU machine, the same memory), or in a file
    # per fragment (the process holds no copy): its contributions are anchor - local of its own
    # parameters each time, and every contribution and commit is the same bytes in all three.
    seen = {}
    for place in ("device", "host", "disk"):
        run = tmp_path / place
        run.mkdir()
        report, ranks = _closed_by_shard(run, "--anchors", place, "--record-locals", steps=16)
        assert len(report["aligned"]) == 4 and all(a[3] == ["plain", "shard"] for a in report["aligned"])
        assert check_contributions(run / "mailbox", run / "shard.locals.npz", "shard") == 4
        for r in ranks:
            assert r["anchors_place"] == place
            if place == "disk":  # the files are gone after close
                assert r["anchors_dir"] and not Path(r["anchors_dir"]).exists()
        seen[place] = stored_payloads(run / "mailbox")
    assert len(seen["device"]) == 8 + 4 * 3, sorted(seen["device"])  # 2 contributions and 3 payloads a round
    for place in ("host", "disk"):
        differ = [k for k in seen["device"] if seen[place].get(k) != seen["device"][k]]
        assert not differ and seen[place].keys() == seen["device"].keys(), (place, differ)


def test_an_fsdp1_node_learns_and_closes_rounds_bit_identical_with_a_plain_node(tmp_path):
    # FSDP1 (FullyShardedDataParallel, use_orig_params=True: flat parameters, each rank a
    # contiguous range of each tensor that need not follow rows), one unit per Linear: the same
    # chunks, commits and parameters as FSDP2's.
    report, ranks = _closed_by_shard(tmp_path, "--fsdp", "1", steps=16)
    assert len(report["aligned"]) == 4 and all(a[3] == ["plain", "shard"] for a in report["aligned"])
    assert recompute_every_round(tmp_path / "mailbox") == ["shard"] * 4
    for r in ranks:
        for peak, op_peak, fragment in zip(r["peak"], r["op_peak"], r["fragment_bytes"]):
            assert 0 < peak <= op_peak < fragment, r


def test_a_commit_whose_record_could_not_be_written_is_computed_again_from_the_same_state(tmp_path):
    # The sharded closer's first two round records fail to write (a store outage): its ranks
    # keep the state each commit started from until the record lands, so the next poll commits
    # the same round again, from the same state, and every commit is still the one-process one.
    report, ranks = _closed_by_shard(tmp_path, "--fail-records", "2", steps=16)
    assert ranks[0]["injected"] == {"FailingRecords": 2}, "the record writes did not fail: the test exercised nothing"
    assert ranks[0]["events"].count("StoreFailure") >= 2, ranks[0]["events"]  # the node saw each one fail
    assert len(report["aligned"]) == 4 and all(a[3] == ["plain", "shard"] for a in report["aligned"])
    assert recompute_every_round(tmp_path / "mailbox") == ["shard"] * 4


def test_a_rank_that_cannot_read_a_contribution_for_a_while_delays_the_commit_and_changes_no_byte(tmp_path):
    # The last rank's first reads of contribution chunks fail (the store unavailable to it): the
    # op fails on every rank at the same phase, rank 0's node tries again on its next poll, and
    # the commits are the same bytes.
    report, ranks = _closed_by_shard(tmp_path, "--fail-reads", "3", steps=16)
    assert len(report["aligned"]) == 4 and all(a[3] == ["plain", "shard"] for a in report["aligned"])
    assert recompute_every_round(tmp_path / "mailbox") == ["shard"] * 4
    assert ranks[1]["injected"] == {"FailingReads": 3}, "no read failed: the test exercised nothing"
    assert "StoreFailure" in ranks[0]["events"], ranks[0]["events"]  # rank 0's node saw the op fail
