"""Chunked payloads (``DiLoCo(chunk_elements=C)``; docs/protocol.md, "Chunked payloads";
docs/sharding.md sections 1 and 2): the plan, the chunk bytes against whole-tensor quantization,
refs with ``more``, refusals, one-chunk runs byte-identical to whole payloads, and runs whose
payloads are split into many chunks ending bit-identical to the same runs without chunks."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradientmail_core as gm
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.codec import plan as chunk_plans
from gradientmail_core.codec import quant
from gradientmail_core.codec.payload import decode_payload, encode_payload
from gradientmail_core.codec.plan import chunk_specs
from gradientmail_core.errors import PayloadCorrupt, PayloadLayoutMismatch, RecordInvalid
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import (
    Manifest,
    Participant,
    PayloadRef,
    RoundRecord,
    Snapshot,
    chunk_refs,
    decode,
    encode,
    join_refs,
    ref_digest,
    ref_size,
    to_dict,
)
from gradientmail_core.protocol.run import RECORD_REFS, RunInfo, open_run
from gradientmail_core.protocol.store import RunStore

DTYPES = ["F32", "F16", "BF16", "F8_E4M3", "F4", "I2"]
WIDE = {"embed.weight": (10, 7), "layers.0.w": (4, 4), "layers.1.w": (9, 5), "head.b": (4,)}

shape_st = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
shapes_st = st.lists(shape_st, min_size=1, max_size=6).map(lambda ss: [(f"t{i}", s) for i, s in enumerate(ss)])
chunk_st = st.integers(1, 6).map(lambda k: 32 * k)


# ---- the plan --------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(shapes_st, chunk_st)
def test_the_plan_covers_every_element_once_on_32_aligned_pieces(shapes, c):
    plan = chunk_plans.chunk_plan(shapes, c)
    sizes = {n: chunk_plans.numel(s) for n, s in shapes}
    starts = dict(zip((n for n, _ in shapes), chunk_plans.offsets(shapes), strict=True))
    end = max((starts[n] + sizes[n] for n in sizes), default=0)
    assert len(plan) == max(1, -(-end // c))
    seen = {n: np.zeros(sizes[n], int) for n in sizes}
    for k, pieces in enumerate(plan):
        for p in pieces:
            assert p.start % chunk_plans.BLOCK == 0  # a quantizer block never straddles two chunks
            assert k * c <= starts[p.name] + p.start and (p.size == 0 or starts[p.name] + p.stop <= (k + 1) * c)
            seen[p.name][p.start : p.stop] += 1
    assert all((v == 1).all() for v in seen.values())
    # the same plan whatever the world size: nothing in it depends on ranks (and None is one chunk)
    assert chunk_plans.fragment_plan(dict(shapes), c) == plan
    whole = chunk_plans.fragment_plan(dict(shapes), None)
    assert len(whole) == 1 and chunk_plans.is_one_whole_chunk(whole, dict(shapes))
    # every decoded chunk assembles back into the tensors
    tensors = {n: np.arange(sizes[n], dtype=np.float32).reshape(s) for n, s in shapes}
    parts = [{p.name: tensors[p.name].reshape(-1)[p.start : p.stop] for p in pieces} for pieces in plan]
    out = chunk_plans.assemble(plan, parts, dict(shapes))
    assert all(np.array_equal(out[n], tensors[n]) for n in tensors)


def test_assemble_refuses_missing_short_and_extra_pieces():
    shapes = {"a": (70,), "b": (3,)}
    plan = chunk_plans.fragment_plan(shapes, 64)  # a: 0..70 (padded to 96), b: 96..99
    assert [[p.name for p in c] for c in plan] == [["a"], ["a", "b"]]  # the end of one, the start of the next
    good = [{"a": np.zeros(64)}, {"a": np.zeros(6), "b": np.zeros(3)}]
    chunk_plans.assemble(plan, good, shapes)
    for bad in (
        good[:1],
        [good[0], {"a": np.zeros(6)}],
        [{"a": np.zeros(63)}, good[1]],
        [good[0], {**good[1], "c": np.zeros(1)}],
    ):
        with pytest.raises(PayloadCorrupt):
            chunk_plans.assemble(plan, bad, shapes)


# ---- chunk bytes: slices of whole-tensor quantization ------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compression", ["", "zstd"])
@pytest.mark.parametrize("c", [32, 96])
def test_a_chunk_holds_the_slices_of_the_whole_tensors_quantization(dtype, compression, c):
    if compression:
        pytest.importorskip("zstandard")
    rng = np.random.default_rng(3)
    shapes = {"a": (5, 27), "b": (3,), "c": (70,)}
    tensors = {n: (rng.standard_normal(s) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for n, s in shapes.items()}
    tensors["c"][5] = np.nan  # an F4/I2 NaN block and a non-finite F8 tensor stay what they were
    whole = {n: quant.quantize(v, dtype) for n, v in tensors.items()}
    scales = {n: quant.e4m3_scale_byte(quant.e4m3_amax(v)) for n, v in tensors.items()}  # the whole tensors'
    specs = chunk_specs(shapes, c)
    assert len(specs) == {32: 9, 96: 3}[c] and any(s.meta.get("pieces") for s in specs)
    for s in specs:
        # the pieces' own values, the whole tensors cut here, and their whole quantization cut here
        pieces = {p.name: tensors[p.name].reshape(-1)[p.start : p.stop] for p in s.pieces}
        from_pieces = encode_payload(pieces, dtype, kind="delta", compression=compression, chunk=s, f8_scales=scales)
        from_floats = encode_payload(tensors, dtype, kind="delta", compression=compression, chunk=s)
        from_q = encode_payload(whole, kind="delta", compression=compression, chunk=s, stream=True)
        assert from_pieces == from_floats == from_q.read()
        got = decode_payload(
            from_q.chunks(), s, size=from_q.size, sha256=from_q.sha256, compression=compression, kind="delta"
        )
        for p in s.pieces:  # decoded: the whole tensor's decoded values, sliced
            expect = quant.dequantize(whole[p.name]).reshape(-1)[p.start : p.stop]
            np.testing.assert_array_equal(got[p.name].reshape(-1), expect)


def test_an_f8_piece_without_its_tensors_scale_is_refused():
    s = chunk_specs({"w": (64,)}, 32)[1]
    with pytest.raises(ValueError, match="f8_scales"):
        encode_payload({"w": np.ones(32, np.float32)}, "F8_E4M3", kind="delta", chunk=s)


def test_the_f8_scale_of_a_tensor_is_the_max_of_its_parts():
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    x[7] = np.inf
    parts = [quant.e4m3_amax(x[i : i + 32]) for i in range(0, 100, 32)]
    assert quant.e4m3_scale_byte(max(parts)) == quant.quantize(x, "F8_E4M3").scale[0]


def test_a_one_chunk_fragment_is_the_whole_payload_byte_for_byte():
    shapes = {"a": (5, 6), "b": (3,)}
    t = {n: np.random.default_rng(1).standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    for c in (None, 64, 1 << 24):
        (s,) = chunk_specs(shapes, c)
        assert s.meta == {} and encode_payload(t, "F4", kind="theta", chunk=s) == encode_payload(t, "F4", kind="theta")


# ---- refs and records --------------------------------------------------------------------------


def _ref(i: int) -> PayloadRef:
    sha = hashlib.sha256(bytes([i])).hexdigest()
    return PayloadRef(key=keys.snapshot_blob_key(3, "a", sha), sha256=sha, size=100 + i)


def _snapshot(payload: PayloadRef) -> Snapshot:
    return Snapshot(learner="a", round=3, local_step=1, steps=1, tokens=1, base_version=0, step_seconds=0.1,
                    schema_digest="0" * 64, payload=payload)  # fmt: skip


def test_a_ref_with_more_round_trips_and_one_without_keeps_its_bytes():
    one, parts = _ref(0), [_ref(i) for i in range(3)]
    ref = join_refs(parts)
    assert chunk_refs(ref) == parts and join_refs(chunk_refs(ref)) == ref and chunk_refs(one) == [one]
    assert ref_size(ref) == 303 and ref_digest(one) == one.sha256
    assert ref_digest(ref) == hashlib.sha256("".join(p.sha256 for p in parts).encode()).hexdigest()
    snap = _snapshot(ref)
    assert decode(encode(snap), Snapshot) == snap
    raw = encode(_snapshot(one))
    assert b"more" not in raw and decode(raw, Snapshot) == _snapshot(one)
    who = [Participant(learner=x, weight=1.0, steps=1, tokens=1, payload_sha256=one.sha256) for x in "ab"]
    rec = RoundRecord(round=3, step=1, fragment=0, version=1, closer="a", participants=who, theta=one, change=ref,
                      contributions=[one, ref])  # fmt: skip
    raw = encode(rec)
    assert raw.count(b'"more"') == 2 and decode(raw, RoundRecord) == rec
    assert b"more" not in encode(dataclasses.replace(rec, change=one, contributions=[one]))


def test_a_chunk_ref_with_chunks_of_its_own_is_refused():
    d = to_dict(_snapshot(join_refs([_ref(0), _ref(1)])))
    d["payload"]["more"][0]["more"] = [to_dict(_ref(2))]
    with pytest.raises(RecordInvalid, match="chunks of its own"):
        decode(json.dumps(d).encode(), Snapshot)


# ---- the store: reads refuse anything but the plan's chunks ------------------------------------


def _written(c: int | None = 32, dtype: str = "F4"):
    store = RunStore(MemoryMailbox())
    rng = np.random.default_rng(5)
    t = {n: rng.standard_normal(s).astype(np.float32) for n, s in WIDE.items()}
    key = functools.partial(keys.snapshot_blob_key, 3, "a", compression="")
    ref = store.put_fragment(key, t, shapes=WIDE, dtypes=dtype, chunk_elements=c, kind="delta", compression="")
    return store, ref, t


def test_every_chunk_is_read_verified_and_assembled():
    store, ref, t = _written()
    plan = chunk_plans.fragment_plan(WIDE, 32)
    assert len(chunk_refs(ref)) == len(plan) > 3
    got = store.get_payload(ref, WIDE, chunk_elements=32, dtypes=dict.fromkeys(WIDE, "F4"))
    whole = {n: quant.dequantize(quant.quantize(v, "F4")) for n, v in t.items()}
    assert all(np.array_equal(got[n], whole[n]) for n in WIDE)
    with pytest.raises(PayloadLayoutMismatch):  # intact chunks of other dtypes
        store.get_payload(ref, WIDE, chunk_elements=32, dtypes=dict.fromkeys(WIDE, "F32"))


def test_a_damaged_missing_dropped_or_reordered_chunk_is_refused():
    store, ref, _ = _written(dtype="BF16")
    parts = chunk_refs(ref)

    def get(r):
        return store.get_payload(r, WIDE, chunk_elements=32)

    with pytest.raises(PayloadCorrupt, match="chunks"):
        get(join_refs(parts[:-1]))  # a chunk left out
    with pytest.raises(PayloadCorrupt, match="chunks"):
        get(parts[0])  # a whole-payload ref where the plan has several chunks
    with pytest.raises(PayloadLayoutMismatch):
        get(join_refs([parts[1], parts[0], *parts[2:]]))  # intact chunks, out of order
    with pytest.raises(PayloadCorrupt):
        get(join_refs([*parts[:-1], dataclasses.replace(parts[-1], size=parts[-1].size + 1)]))
    data = bytearray(store.mailbox.get(parts[2].key))
    data[-1] ^= 1
    store.mailbox.delete([parts[2].key])
    store.mailbox.put_if_absent(parts[2].key, bytes(data))
    with pytest.raises(PayloadCorrupt, match="sha256"):
        get(ref)
    store.mailbox.delete([parts[2].key])
    assert get(ref) is None  # a chunk gone: nothing half-assembled


def test_a_whole_payload_reader_refuses_a_chunk():
    store, ref, _ = _written()
    with pytest.raises(PayloadCorrupt):
        store.get_payload(ref, WIDE)  # read as a run without chunks


def test_chunks_put_one_by_one_are_the_fragments_chunks():
    store, ref, t = _written(dtype="F8_E4M3")
    plan = chunk_plans.fragment_plan(WIDE, 32)
    dtypes = dict.fromkeys(WIDE, "F8_E4M3")
    scales = {n: quant.e4m3_scale_byte(quant.e4m3_amax(v)) for n, v in t.items()}
    key = functools.partial(keys.snapshot_blob_key, 3, "a", compression="")
    mine = []
    for k, pieces in enumerate(plan):
        values = {p.name: chunk_plans.piece_view(t[p.name].reshape(-1), p) for p in pieces}
        mine.append(store.put_chunk(key, values, pieces, shapes=WIDE, k=k, n=len(plan), dtypes=dtypes, kind="delta",
                                    compression="", f8_scales=scales))  # fmt: skip
    assert join_refs(mine) == ref
    whole = {n: quant.dequantize(quant.quantize(v, "F8_E4M3")).reshape(-1) for n, v in t.items()}
    for k, (pieces, r) in enumerate(zip(plan, chunk_refs(ref), strict=True)):
        got = store.get_chunk(r, pieces, shapes=WIDE, k=k, n=len(plan), dtypes=dtypes, kind="delta")
        assert set(got) == {p.name for p in pieces}
        for p in pieces:
            assert np.array_equal(got[p.name], whole[p.name][p.start : p.stop])
        with pytest.raises(PayloadLayoutMismatch):
            store.get_chunk(r, pieces, shapes=WIDE, k=(k + 1) % len(plan), n=len(plan), dtypes=dtypes)


# ---- config --------------------------------------------------------------------------------------


def test_chunk_elements_defaults_for_new_runs_and_old_manifests_read_as_whole_fragments():
    d = gm.DiLoCo(sync_every=4, fragments=2)
    assert d.chunk_elements == 1 << 24 and d.to_dict()["chunk_elements"] == 1 << 24
    old = {k: v for k, v in d.to_dict().items() if k != "chunk_elements"}
    assert gm.DiLoCo.from_dict(old).chunk_elements is None
    d.check_matches(old)  # a node left at the default joins a run from before chunks
    none = gm.DiLoCo(sync_every=4, fragments=2, chunk_elements=None)
    assert "chunk_elements" not in none.to_dict() and gm.DiLoCo.from_dict(none.to_dict()) == none
    with pytest.raises(gm.RunConfigMismatch):
        gm.DiLoCo(sync_every=4, fragments=2, chunk_elements=64).check_matches(old)
    for bad in (0, 33, -32, 32.0, True):
        with pytest.raises(ValueError, match="chunk_elements"):
            gm.DiLoCo(sync_every=4, fragments=2, chunk_elements=bad)


def test_a_run_whose_records_would_not_fit_is_refused_at_creation():
    big = {"w": np.zeros(32 * (RECORD_REFS // 3 + 1), np.float32)}
    model = NumpyAdapter(big)
    cfg = gm.DiLoCo(sync_every=2, fragments=1, chunk_elements=32)
    with pytest.raises(ValueError, match="raise chunk_elements or fragments"):
        open_run(RunStore(MemoryMailbox()), model.schema(), model.read, cfg, learner="a", compression="",
                 rng=random.Random(0))  # fmt: skip
    store = RunStore(MemoryMailbox())
    run, _ = open_run(store, model.schema(), model.read, dataclasses.replace(cfg, chunk_elements=64 * 32),
                      learner="a", compression="", rng=random.Random(0))  # fmt: skip
    # checkpoint_every=1 (this run): every version is a checkpoint, whatever the participants
    n = len(run.plan(0))
    assert run.cfg.checkpoint_every == 1 and run.checkpoint_due(0, 1, final=False, participants=1)
    # between checkpoints, a record would list (participants + 1) x chunks refs (the change and
    # every contribution): past what a record holds, the round is written as a checkpoint
    ck = RunInfo.from_manifest(
        dataclasses.replace(run.manifest, config={**run.manifest.config, "commit_dtype": "F4", "checkpoint_every": 5})
    )
    fits = RECORD_REFS // n - 1  # the most participants whose refs fit: n * (fits + 1) <= RECORD_REFS
    assert n * (fits + 1) <= RECORD_REFS < n * (fits + 2)
    assert not ck.checkpoint_due(0, 1, final=False, participants=1)
    assert not ck.checkpoint_due(0, 1, final=False, participants=fits)
    assert ck.checkpoint_due(0, 1, final=False, participants=fits + 1)
    assert ck.checkpoint_due(0, 5, final=False, participants=1)  # a checkpoint version stays one


# ---- runs: one chunk is today's bytes; many chunks end bit-identical ----------------------------


def _objects(mailbox) -> dict[str, bytes]:
    return {k: mailbox.get(k) for k in mailbox.list("")}


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(delta_dtype="F4", commit_dtype="F8_E4M3", checkpoint_every=3, error_feedback=True)],
    ids=["plain", "quantized-checkpoints"],
)
def test_a_run_of_one_chunk_fragments_stores_the_bytes_of_whole_payloads(kw):
    from harness import Cluster
    from test_engine_rounds import finish

    def run(c):
        cluster = Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2, chunk_elements=c, **kw))
        cluster.join_all("ab")
        cluster.run(24)
        finish(cluster)
        return _objects(cluster.mailbox)

    # every payload of this model fits 128 elements (the largest, an outer state, is 112 on the line)
    whole, default, small = run(None), run(1 << 24), run(128)
    for chunked_run in (default, small):
        assert sorted(chunked_run) == sorted(whole)
        assert [k for k in whole if whole[k] != chunked_run[k]] == [keys.MANIFEST]  # its config names C
    assert len([k for k in whole if k.startswith(keys.ROUNDS)]) >= 8


def _same_params(xs, ys) -> None:
    for x, y in zip(xs, ys, strict=True):
        assert x.params.keys() == y.params.keys()
        for n in x.params:
            assert np.array_equal(x.params[n], y.params[n]), (x.name, n)


def _chunk_counts(mailbox) -> set[int]:
    out = set()
    for k in mailbox.list(keys.ROUNDS):
        rec = decode(mailbox.get(k), RoundRecord, key=k)
        out |= {len(chunk_refs(r)) for r in (rec.theta, rec.outer, rec.change, *(rec.contributions or [])) if r}
    return out


@pytest.mark.parametrize("compression", ["", "zstd"])
def test_a_chunked_run_ends_bit_identical_to_the_same_run_with_whole_payloads(compression):
    if compression:
        pytest.importorskip("zstandard")
    from harness import Cluster
    from test_engine_rounds import assert_identical, finish

    cfg = gm.DiLoCo(sync_every=4, fragments=2, quorum_size=3, delta_dtype="F4", commit_dtype="I2",
                    error_feedback=True, clip_norm=5.0)  # fmt: skip

    def run(c):
        cluster = Cluster(dataclasses.replace(cfg, chunk_elements=c), shapes=dict(WIDE), compression=compression)
        ms = cluster.join_all("abc")
        cluster.run(40)
        finish(cluster)
        assert_identical(ms)
        return cluster, ms

    (whole, a), (split, b) = run(None), run(32)
    _same_params(a, b)
    assert _chunk_counts(whole.mailbox) == {1} and max(_chunk_counts(split.mailbox)) >= 3
    # GC collects chunks as any payload: none of a snapshot older than the verify window (W), none
    # of a round older than 2P or than the state the window's oldest round starts from
    head, P, W = split.head(), cfg.fragments, cfg.verify_window
    blobs = [keys.parse_blob_key(k) for k in split.mailbox.list(keys.BLOBS)]
    assert head - W > 4
    assert not [b for b in blobs if b is not None and b.kind == "snapshot" and b.round <= head - W]
    assert not [b for b in blobs if b is not None and b.kind != "snapshot" and b.round is not None
                and b.round <= head - max(2 * P, W + P)]  # fmt: skip
    newest = {
        r.fragment: r for r in (decode(split.mailbox.get(k), RoundRecord) for k in split.mailbox.list(keys.ROUNDS))
    }
    live = {c.key for r in newest.values() for ref in (r.theta, r.outer, r.change) if ref for c in chunk_refs(ref)}
    assert live <= set(split.mailbox.list(keys.BLOBS))


def test_a_takeover_between_checkpoints_replays_a_chunked_run_bit_for_bit(monkeypatch):
    import harness
    from test_checkpoint_every import Lockstep, between_checkpoints, cfg
    from test_engine_rounds import records

    from gradientmail_core.syncer import replay

    monkeypatch.setattr(harness, "SHAPES", dict(WIDE))  # tensors the chunks of 64 cut
    replayed: list[int] = []
    orig = replay.replay_round
    monkeypatch.setattr(replay, "replay_round", lambda *a: replayed.append(a[-1].round) or orig(*a))

    def run(c: int | None, kill_at: int | None) -> Lockstep:
        ls = Lockstep(cfg(in_flight=1, chunk_elements=c))
        for step in range(36):
            if step == kill_at:
                assert between_checkpoints(ls.c, 0) and between_checkpoints(ls.c, 1)
                ls.down.add("s1")
                ls.quiet(120)  # past the lease timeout: s2 takes the open round over and replays
            ls.step()
        ls.quiet(60)
        return ls

    whole, split = run(None, None), run(64, kill_at=20)
    assert replayed and "s2" in {r.closer for r in records(split.c)}
    assert _chunk_counts(whole.c.mailbox) == {1} and max(_chunk_counts(split.c.mailbox)) >= 2
    _same_params(whole.learners, split.learners)
    for f in range(2):  # the outer state the new closer rebuilt is the whole-payload run's
        a, b = whole.syncers["s1"].merger.held(f), split.syncers["s2"].merger.held(f)
        assert a.version == b.version
        for n in a.master:
            assert np.array_equal(a.master[n], b.master[n]) and np.array_equal(a.momentum[n], b.momentum[n])


def test_a_node_uploads_its_contributions_through_its_placement(monkeypatch):
    """The seam a sharded node uses (``Placement.upload``): a placement that uploads each
    contribution its own way is asked to for every one, and the run is the same."""
    from harness import Cluster
    from test_engine_rounds import finish

    from gradientmail_core.syncer import placement

    calls: list[tuple[int, int, str]] = []

    def upload(self, pub, *, learner, compression, keep):
        calls.append((pub.fragment, pub.round, learner))
        dtypes = self.run.delta_dtypes(pub.fragment)
        ref = self.store.put_fragment(
            functools.partial(keys.snapshot_blob_key, pub.round, learner, compression=compression),
            pub.delta.quantized(dtypes),
            shapes=self.run.shapes[pub.fragment],
            dtypes=dtypes,
            chunk_elements=self.run.chunk_elements,
            kind="delta",
            compression=compression,
        )
        return ref, False  # (nothing kept in the spool: the closer reads it back)

    def run():
        cluster = Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2, chunk_elements=32), shapes=dict(WIDE))
        ms = cluster.join_all("ab")
        cluster.run(24)
        finish(cluster)
        return ms

    plain = run()
    monkeypatch.setattr(placement.OneProcess, "upload", upload)
    hooked = run()
    assert len(calls) >= 10 and {c[2] for c in calls} == {"a", "b"}
    _same_params(plain, hooked)


def test_torch_nodes_on_the_host_and_device_paths_store_the_same_chunks():
    pytest.importorskip("torch")
    import torch
    from test_torch_pipeline import run_cluster

    cfg = gm.DiLoCo(sync_every=4, fragments=2, delta_dtype="F8_E4M3", commit_dtype="F4", chunk_elements=32)
    host_objects, host_params = run_cluster(cfg, pipeline=False)
    dev_objects, dev_params = run_cluster(cfg, pipeline=True)
    assert sorted(dev_objects) == sorted(host_objects) and all(dev_objects[k] == host_objects[k] for k in host_objects)
    _, whole_params = run_cluster(dataclasses.replace(cfg, chunk_elements=None), pipeline=True)
    for a, b in zip(host_params, whole_params, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    manifest = decode(host_objects[keys.MANIFEST], Manifest, key=keys.MANIFEST)
    assert any(r.more for r in manifest.init)  # the bf16 block of 40 elements is cut


def test_nodes_over_s3_move_chunked_payloads(s3_server: str, s3_bucket: str) -> None:
    pytest.importorskip("boto3")
    from gradientmail_core.adapters import adapter_for
    from gradientmail_core.syncer.host import join_run
    from gradientmail_core.syncer.options import NodeOptions

    cfg = gm.DiLoCo(sync_every=2, fragments=1, quorum_size=2, delta_dtype="BF16", chunk_elements=64)
    clock = gm.FakeClock()
    members = []
    for i, name in enumerate("ab"):
        params = {n: np.random.default_rng(0).standard_normal(s).astype(np.float32) for n, s in WIDE.items()}
        node, learner = join_run(RunStore(gm.S3Mailbox(s3_bucket, "run", endpoint_url=s3_server)), adapter_for(params),
                                 cfg, clock, learner=name, nonce=f"{i + 1:08x}", emit=lambda e: None,
                                 options=NodeOptions(poll_interval=1.0, lease_timeout=120.0, round_timeout=60.0),
                                 rng=random.Random(i), node_rng=random.Random(i))  # fmt: skip
        members.append((params, node, learner))
    for _, node, _ in members:
        node.state.list_leases(node.store)
    rng = np.random.default_rng(1)
    for step in range(4 * cfg.sync_every + 5):
        for params, _, learner in members:
            if step < 4 * cfg.sync_every:  # then only settle: both align with the last commit
                for v in params.values():
                    v -= (1e-2 * rng.standard_normal(v.shape)).astype(np.float32)
                learner.step(8)
        for _ in range(3):
            for _, node, learner in members:
                node.tick()
                learner.drain()
        clock.advance(1.0)
    assert min(node.state.head for _, node, _ in members) >= 2
    (a, *_), (b, *_) = members
    assert all(a[n].tobytes() == b[n].tobytes() for n in WIDE)
    mailbox = members[0][1].store.mailbox
    assert max(_chunk_counts(mailbox)) >= 3
