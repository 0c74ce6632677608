"""The closer's commit computation: judged snapshots, payload order, hashing on threads."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.aggregators.merge import sq_norms
from gradientmail_core.codec.header import sha256_hex
from gradientmail_core.codec.payload import decode_payload, encode_payload
from gradientmail_core.config import DiLoCo
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import Snapshot
from gradientmail_core.protocol.run import open_run
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer import merger as merger_mod
from gradientmail_core.syncer.collector import Collector
from gradientmail_core.syncer.merger import FragmentMerger
from gradientmail_core.syncer.timing import Estimates

SHAPES = {"embed.weight": (40, 16), "h.0.w": (64, 33), "h.0.b": (33,)}


def collected(cfg: DiLoCo, n: int, *, stale: int | None = None) -> tuple[Collector, RunStore]:
    """A collector of round 0 that has judged ``n`` snapshots (``stale``: one against version 1)."""
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    store = RunStore(MemoryMailbox())
    adapter = NumpyAdapter(params)
    run, _ = open_run(store, adapter.schema(), adapter.read, cfg, learner="c", compression="", rng=random.Random(0))
    for i in range(n):
        delta = {k: (1e-2 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
        learner = f"l{i}"
        ref = store.put_payload(
            lambda sha, lr=learner: keys.snapshot_blob_key(0, lr, sha, ""), encode_payload(delta, "F32", kind="delta")
        )
        snap = Snapshot(
            learner=learner,
            round=0,
            local_step=4,
            steps=4,
            tokens=16 * (i + 1),
            base_version=1 if i == stale else 0,
            step_seconds=0.1,
            schema_digest=run.digest,
            payload=ref,
            final=False,
            nonce="0123abcd",
        )
        store.put_record(keys.snapshot_key(0, learner), snap)
    merger = FragmentMerger.one_process(run, store)
    c = Collector(0, run, merger.load(0, 0, run.manifest.init[0], None, params), 0.0, Estimates(), merger)
    for i in reversed(range(n)):
        c.judge_snapshot(store, f"l{i}")
    c.update({f"l{i}" for i in range(n)}, 1.0)
    return c, store


def commit_bytes(cfg: DiLoCo, n: int, compression: str = "") -> tuple[bytes, dict[str, bytes], list[str]]:
    c, store = collected(cfg, n)
    written: list[str] = []
    payloads: dict[str, bytes] = {}

    def write(key: str, data) -> None:  # a stream, read as it is written
        written.append(key)
        payloads[key] = data.read()

    commit = c.commit(compression=compression, write=write)
    assert list(commit.sizes) == written and commit.payloads == {}
    return store.encode_record(c.record(commit, closer="c", live=n, now=1.0, sync_seconds=None)), payloads, written


def test_an_accepted_snapshot_carries_its_tensor_norms_and_a_rejected_one_none() -> None:
    c, store = collected(DiLoCo(sync_every=4, fragments=1), 3, stale=1)
    assert c.judged["l1"].reason == "stale" and c.judged["l1"].norms is None
    for lr in ("l0", "l2"):
        j = c.judged[lr]
        assert j.reason is None and j.snapshot is not None
        delta = store.get_payload(j.snapshot.payload, c.run.shapes[0])
        assert delta is not None and j.norms == sq_norms(delta)


@pytest.mark.parametrize("compression", ["", "zstd"])
def test_payloads_are_written_in_a_fixed_order_before_the_record_exists(compression: str) -> None:
    if compression:
        pytest.importorskip("zstandard")
    cfg = DiLoCo(sync_every=4, fragments=1, commit_dtype="BF16")
    record, payloads, written = commit_bytes(cfg, 3, compression)
    assert [keys.parse_blob_key(k).kind for k in written] == ["theta", "outer", "change"]  # type: ignore[union-attr]
    assert written == list(payloads)
    for key, data in payloads.items():
        assert sha256_hex(data) in key


def test_hashing_on_threads_commits_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = DiLoCo(sync_every=4, fragments=1)
    inline = commit_bytes(cfg, 3)
    monkeypatch.setattr(merger_mod, "THREADED_BYTES", 0)
    assert commit_bytes(cfg, 3) == inline


def test_a_failed_write_stops_the_commit_before_the_next_payload() -> None:
    c, _ = collected(DiLoCo(sync_every=4, fragments=1), 2)
    written: list[str] = []

    def write(key: str, data: bytes) -> None:
        written.append(key)
        raise ConnectionError("store down")

    with pytest.raises(ConnectionError):
        c.commit(compression="", write=write)
    assert len(written) == 1
    # The next attempt (the node retries on its next poll) commits what a fresh closer would.
    again = c.commit(compression="")
    fresh, _ = collected(DiLoCo(sync_every=4, fragments=1), 2)
    expected = fresh.commit(compression="")
    record = c.record(again, closer="c", live=2, now=1.0, sync_seconds=None)
    assert record == fresh.record(expected, closer="c", live=2, now=1.0, sync_seconds=None)
    assert again.payloads == expected.payloads and again.sizes == expected.sizes


def test_the_commit_writes_its_new_state_into_the_arrays_reserved_before_quorum() -> None:
    c, _ = collected(DiLoCo(sync_every=4, fragments=1), 2)
    assert 0 in c.merger.reserved
    master, momentum = c.merger.reserved[0]
    commit = c.commit(compression="")
    assert 0 not in c.merger.reserved
    assert all(commit.state.master[n] is master[n] and commit.state.momentum[n] is momentum[n] for n in SHAPES)


@pytest.mark.parametrize("commit_dtype", [None, "BF16"])
def test_the_outer_payload_holds_the_master_only_when_theta_is_not_the_master(commit_dtype: str | None) -> None:
    c, _ = collected(DiLoCo(sync_every=4, fragments=1, commit_dtype=commit_dtype), 3)
    commit = c.commit(compression="")
    run, rec = c.run, c.record(commit, closer="c", live=3, now=1.0, sync_seconds=None)
    assert rec.outer is not None and rec.theta is not None
    outer = decode_payload(commit.payloads[rec.outer.key], run.outer_shapes(0))
    theta = decode_payload(commit.payloads[rec.theta.key], run.shapes[0])
    assert {k.split("/")[0] for k in outer} == ({"momentum"} if commit_dtype is None else {"momentum", "master"})
    # what a taking-over closer rebuilds is the state the commit continues with, bit for bit
    master, momentum = run.split_outer(0, outer, theta)
    for n in SHAPES:
        assert np.array_equal(master[n], commit.state.master[n])
        assert np.array_equal(momentum[n], commit.state.momentum[n])
    if commit_dtype is not None:
        assert any(not np.array_equal(master[n], theta[n]) for n in SHAPES)
