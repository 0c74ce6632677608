"""Rounds end to end on a deterministic single-threaded cluster: the tape, quorum,
garbage collection, and the effect of every DiLoCo option."""

from __future__ import annotations

import functools
import json
import queue

import numpy as np
import pytest
from harness import Cluster

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.codec.header import header_info
from gradientmail_core.codec.safetensors_io import read_header
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import RoundRecord, decode


def records(c: Cluster) -> list[RoundRecord]:
    return [decode(c.mailbox.get(k), RoundRecord, key=k) for k in c.mailbox.list(keys.ROUNDS)]


def assert_tape_contiguous(c: Cluster) -> list[RoundRecord]:
    recs = records(c)
    assert [r.round for r in recs] == list(range(len(recs)))
    P = c.cfg.fragments
    for r in recs:
        assert r.fragment == r.round % P and r.version == r.round // P + 1
    return recs


def assert_identical(members) -> None:
    first = members[0].params
    for m in members[1:]:
        for n in first:
            assert np.array_equal(first[n], m.params[n]), (m.name, n)


def finish(c: Cluster) -> None:
    """Let the run settle and every live member leave (each then holds the newest commit: that the
    members end identical is by construction). In an audited cluster, also: every round the tape
    holds was recomputed by the auditor as it was written, without a violation."""
    c.settle()
    for m in c.live():
        c.close(m)
    if c.auditor is not None:
        assert_audited(c)


def assert_audited(c: Cluster) -> None:
    """The auditor of ``c`` recomputed every round of the tape as it was written, and found nothing wrong."""
    assert c.auditor is not None, "not an audited cluster: Cluster(..., audit=True)"
    c.auditor.check_tape()
    assert not c.auditor.violations, "\n".join(map(str, c.auditor.violations[:5]))
    assert c.auditor.stats["rounds_verified"] == len(records(c)) > 0, c.auditor.stats


def test_three_learners_commit_a_contiguous_tape_and_end_identical():
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=2, quorum_size=3), audit=True)
    ms = c.join_all("abc")
    c.run(80)
    finish(c)
    recs = assert_tape_contiguous(c)
    assert len(recs) == 80 // 8 * 2
    assert all(len(r.participants) == 3 for r in recs)
    assert_identical(ms)
    # the closer stays put while it lives
    assert {r.closer for r in recs} == {"a"}


def test_quorum_waits_for_quorum_size_accepted_snapshots():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, quorum_size=2))
    a, b = c.join_all("ab")
    # only a trains: its snapshot alone never closes a quorum-2 round while b is live
    for _ in range(8):
        a.train()
        c.tick_all()
        c.clock.advance(0.05)
    assert c.head() == -1
    for _ in range(4):
        b.train()
    c.settle(10)
    recs = records(c)
    assert recs and sorted(p.learner for p in recs[0].participants) == ["a", "b"]


def test_round_closes_when_every_live_learner_reported_below_quorum():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, quorum_size=5))
    c.join_all("ab")
    c.run(4)
    c.settle(5)
    recs = records(c)
    assert len(recs) == 1 and len(recs[0].participants) == 2


def test_garbage_collection_keeps_manifest_init_tape_and_last_2p_rounds():
    # verify_window=0: only what the run itself needs (the window: tests/test_verify.py)
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, verify_window=0), audit=True)  # (deletes nothing the run needs)
    ms = c.join_all("ab")
    c.run(80)
    finish(c)
    head = c.head()
    assert head >= 30
    left = c.mailbox.list("")
    P = 2
    for k in left:
        if k == keys.MANIFEST or k.startswith(keys.ROUNDS) or k.startswith(keys.INIT_BLOBS):
            continue
        b = keys.parse_blob_key(k)
        if b is not None and b.kind in ("theta", "outer", "change"):
            assert b.round > head - 2 * P, k
            continue
        claim = keys.parse_claim_key(k)
        if claim is not None:
            assert claim[0] > head, k  # the next round's claim
            continue
        pytest.fail(f"unexpected key left after GC: {k}")
    # nothing a live record references was deleted
    for r in records(c)[-P:]:
        for ref in (r.theta, r.outer):
            assert ref is not None and c.mailbox.get(ref.key) is not None
    assert_identical(ms)


@pytest.mark.parametrize("dtype", ["BF16", "F8_E4M3", "F4", "I2"])
def test_delta_dtype_is_what_learners_upload(dtype):
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, delta_dtype=dtype))
    seen = {}
    inner_put = c.mailbox.put_if_absent

    def spy(key, data):
        b = keys.parse_blob_key(key)
        if b is not None and b.kind == "snapshot":
            seen[key] = data
        return inner_put(key, data)

    c.mailbox.put_if_absent = spy  # type: ignore[method-assign]
    ms = c.join_all("ab")
    c.run(12)
    finish(c)
    assert seen
    for data in seen.values():
        assert set(header_info(read_header(data, max_header_bytes=1 << 20)[0], "").dtypes.values()) == {dtype}
    assert_identical(ms)


def test_smaller_delta_dtypes_upload_fewer_bytes():
    sizes = {}
    for dtype in ("F32", "BF16", "F8_E4M3", "F4", "I2"):
        c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, delta_dtype=dtype), shapes={"w": (64, 64), "b": (64,)})
        a = c.join("a")
        c.run(8)
        sizes[dtype] = sum(e.bytes for e in a.of(ev.Published))
    assert sizes["F32"] > sizes["BF16"] > sizes["F8_E4M3"] > sizes["F4"] > sizes["I2"]
    assert sizes["F4"] < sizes["F32"] / 6
    assert sizes["I2"] < sizes["F32"] / 10


def test_commit_dtype_learners_download_the_change_and_rebuild_identical_parameters():
    shapes = {"w": (64, 64), "b": (64,)}
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, commit_dtype="F4"), shapes=shapes)
    got = []
    inner_get = c.mailbox.get

    def spy(key):
        data = inner_get(key)
        b = keys.parse_blob_key(key)
        if b is not None and data is not None:
            got.append((b.kind, len(data)))
        return data

    c.mailbox.get = spy  # type: ignore[method-assign]
    ms = c.join_all("ab")
    c.run(40)
    finish(c)
    kinds = [k for k, _ in got]
    assert kinds.count("change") >= 8
    # a learner that holds the previous version never downloads full parameters again
    assert kinds.count("theta") <= 2
    recs = records(c)
    assert all(r.change is not None for r in recs)
    assert_identical(ms)
    # and the parameters are what the record says
    from gradientmail_core.protocol.rebuild import theta_digest

    run = ms[0].node.run
    assert theta_digest(run, 0, {n: ms[0].params[n] for n in run.fragments[0]}) == recs[-1].theta_digest


def test_mixing_keeps_a_share_of_the_local_parameters():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, mixing=0.25))
    a = c.join("a")
    for _ in range(4):
        a.train()
    before = {n: p.copy() for n, p in a.params.items()}
    # commit arrives; align applies mixing
    for _ in range(6):
        a.node.tick()
        c.clock.advance(0.05)
    notice = a.learner.bridge.inbox.get_nowait()
    a.learner.apply(notice)
    for n in a.params:
        expected = np.float32(0.25) * before[n] + np.float32(0.75) * notice.theta[n]
        np.testing.assert_allclose(a.params[n], expected, rtol=1e-6)
        assert not np.allclose(a.params[n], notice.theta[n])


def test_in_flight_bounds_rounds_published_but_not_aligned():
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=4, in_flight=2))
    a = c.join("a")
    # train without ticking: nothing commits, so at most in_flight rounds are handed over
    for _ in range(40):
        a.train()
    assert [p.round for p in a.learner.published] == [0, 1]
    c.settle(20)
    for _ in range(8):
        a.train()
    assert a.learner.aligned >= 1


def test_overlap_zero_is_a_barrier():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, in_flight=1, overlap_steps=0))
    a = c.join("a")

    def wait():
        a.node.tick()
        c.clock.advance(0.05)
        try:
            return a.learner.bridge.inbox.get_nowait()
        except queue.Empty:  # nothing committed yet; any other failure propagates
            return None

    for step in range(1, 13):
        for n, p in a.params.items():
            p -= np.float32(0.1) * (p - a.target[n])
        a.learner.step(4, wait=wait)
        if step % 4 == 0:
            # step() returned only once the round it published had committed and aligned
            assert a.learner.aligned == step // 4 - 1
            assert not a.learner.published


def test_flush_on_close_publishes_final_contributions_committed_without_momentum():
    cfg = gm.DiLoCo(sync_every=8, fragments=2, flush_on_close=True)
    c = Cluster(cfg)
    a = c.join("a")
    c.run(10)  # 2 rounds published at steps 4 and 8; 2 more steps are pending
    c.settle(10)
    assert a.learner.maybe_publish(final=True)
    c.settle(10)
    finals = [e for e in a.of(ev.Published) if e.final]
    assert finals and finals[0].steps > 0
    recs = records(c)
    assert recs[-1].final and recs[-1].participants[0].final
    # without momentum: master_new = master_old - delta exactly (lr and beta not applied)
    assert recs[-1].round == finals[0].round


def test_zstd_payloads_interoperate_with_uncompressed_nodes():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2), audit=True)
    a = c.join("a", compression="zstd")
    b = c.join("b", compression="")
    for m in (a, b):
        m.node.state.list_leases(m.node.store)
    c.run(24)
    finish(c)
    blob_keys = [k for k in c.mailbox.list(keys.BLOBS)]
    assert any(k.endswith(".safetensors.zst") for k in blob_keys)
    recs = records(c)
    assert all(len(r.participants) == 2 for r in recs)
    assert_identical([a, b])


def test_strided_partition_deals_blocks_round_robin():
    shapes = {f"blocks.{i}.w": (4, 4) for i in range(4)} | {"embed.weight": (8, 4), "head.w": (4, 4)}
    c = Cluster(
        gm.DiLoCo(sync_every=4, fragments=2, partition=gm.Strided(block_pattern=r"blocks\.(\d+)\.")), shapes=shapes
    )
    c.join("a")
    manifest = json.loads(c.mailbox.get(keys.MANIFEST))
    f0, f1 = manifest["fragments"]
    assert {"blocks.0.w", "blocks.2.w"} <= set(f0) and {"blocks.1.w", "blocks.3.w"} <= set(f1)
    c.run(8)
    assert c.head() >= 1


def test_weighted_mean_weights_contributions_by_tokens_per_step():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, quorum_size=2, merge=gm.WeightedMean()))
    a, b = c.join_all("ab")
    for _ in range(4):
        a.train(samples=8)
        b.train(samples=2)
    c.settle(10)
    rec = records(c)[0]
    w = {p.learner: p.weight for p in rec.participants}
    assert w["a"] == pytest.approx(32 * 8) and w["b"] == pytest.approx(8 * 2)


def test_losing_the_race_to_create_the_run_keeps_the_winners_identical_init_payloads():
    import random

    from gradientmail_core.adapters.base import NumpyAdapter
    from gradientmail_core.protocol.run import create_run, open_run, upload_values
    from gradientmail_core.protocol.store import RunStore

    mb = gm.MemoryMailbox()
    cfg = gm.DiLoCo(sync_every=4, fragments=2)
    params = {"a": np.ones((3, 3), np.float32), "b": np.zeros(4, np.float32)}
    a = NumpyAdapter(params)
    run, created = open_run(RunStore(mb), a.schema(), a.read, cfg, learner="a", compression="", rng=random.Random(0))
    assert created
    # b read "no manifest" just before a wrote it, and built the same initial payloads
    b, store = NumpyAdapter(dict(params)), RunStore(mb)
    upload = functools.partial(upload_values, store, b.read, b.schema(), cfg, "")
    manifest, created = create_run(store, b.schema(), cfg, upload, learner="b", rng=random.Random(1))
    assert not created and manifest.run_id == run.manifest.run_id
    assert all(mb.get(ref.key) is not None for ref in manifest.init)


def test_torch_adapter_writes_zero_dim_parameters_and_blends_in_float32():
    import torch

    from gradientmail_core.adapters.torch import TorchAdapter

    m = torch.nn.Module()
    m.t = torch.nn.Parameter(torch.tensor(1.0))
    a = TorchAdapter(m)
    a.write({"t": np.array(2.0, np.float32)})
    assert m.t.item() == 2.0
    a.write({"t": np.array(4.0, np.float32)}, mixing=0.25)
    assert m.t.item() == np.float32(0.25) * np.float32(2.0) + np.float32(0.75) * np.float32(4.0)
