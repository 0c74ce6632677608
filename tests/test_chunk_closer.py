"""The merger (``syncer/merger.py``; docs/protocol.md section 10): every commit is the one an
independent whole-tensor reference computes (``closer_reference.py``), bit for bit, for every merge
option, dtype and payload form, with fragments of many chunks (spooled on disk) and of one chunk
(held decoded in memory); the streamed norms equal ``fused._dot`` bit for bit; memory bounded by
chunks, not fragments; the spool emptied after each round and never trusted."""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from closer_reference import reference_commit
from hypothesis import given, settings
from hypothesis import strategies as st

import gradientmail_core as gm
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.aggregators import fused, leaves
from gradientmail_core.errors import MailboxUnavailable
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import RoundRecord, Snapshot, TensorSpec, chunk_refs
from gradientmail_core.protocol.run import RunInfo, open_run
from gradientmail_core.protocol.schedule import version_before
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer import merger as merger_mod
from gradientmail_core.syncer.collector import Collector
from gradientmail_core.syncer.commit import Commit, FragmentState
from gradientmail_core.syncer.merger import FragmentMerger
from gradientmail_core.syncer.spool import Spool
from gradientmail_core.syncer.timing import Estimates

# Tensors larger than a reduction leaf (32768) and a chunk that does not divide it: leaves, and
# the cosine's leaves, straddle the chunk boundaries; one tensor is whole inside a chunk.
SHAPES = {"embed.weight": (300, 130), "h.0.w": (257, 129), "h.0.b": (33,), "h.1.w": (70_000,)}
C = 32 * 1000
SMALL = {"embed.weight": (10, 7), "layers.0.w": (4, 4), "layers.1.w": (9, 5), "head.b": (4,)}
WHOLE = "whole"  # a run of one chunk per fragment (``chunk_elements=None``): held decoded in memory


class TypedAdapter(NumpyAdapter):
    """A numpy model whose schema says some tensors are stored in ``dtypes`` (BF16, F16)."""

    def __init__(self, params: dict[str, np.ndarray], dtypes: dict[str, str]) -> None:
        super().__init__(params)
        self.dtypes = dtypes

    def schema(self) -> list[TensorSpec]:
        return [TensorSpec(name=s.name, dtype=self.dtypes.get(s.name, "F32"), shape=s.shape) for s in super().schema()]


@dataclasses.dataclass
class Closed:
    record: bytes
    written: list[tuple[str, bytes]]
    commits: list[Commit]
    records: list[RoundRecord]


def _deltas(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]], n: int, special: str) -> list[dict]:
    out = []
    for i in range(n):
        scale = 1e-2 * (i + 1)
        d = {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
        if special == "zero" and i == 1:
            d = {k: np.zeros(s, np.float32) for k, s in shapes.items()}  # no direction at all
        if special == "zero_tensor" and i == 0:
            d["h.0.b"] = np.zeros(shapes["h.0.b"], np.float32)
            d["h.1.w"] = np.zeros(shapes["h.1.w"], np.float32)  # a split tensor with no direction
        if special == "large" and i == n - 1:
            d = {k: v * np.float32(50) for k, v in d.items()}  # clipped, or an outlier
        if special == "nonfinite" and i == 0:
            d["h.1.w"].reshape(-1)[-3] = np.inf  # in its last chunk
        out.append(d)
    return out


def close_rounds(
    cfg: gm.DiLoCo,
    *,
    shapes: dict[str, tuple[int, ...]] = SHAPES,
    n: int = 3,
    rounds: int = 2,
    compression: str = "",
    special: str = "",
    final: bool = False,
    param_dtypes: dict[str, str] | None = None,
    spool_root: Path | None = None,
) -> Closed:
    """Close ``rounds`` consecutive rounds of a one-fragment run with ``n`` snapshots each, through
    ``Collector`` and ``merge_commit`` on one merger: the payloads written (in order) and each record. Each
    commit is checked against the whole-tensor reference, bit for bit."""
    rng = np.random.default_rng(7)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    store = RunStore(MemoryMailbox())
    adapter = TypedAdapter(params, param_dtypes or {})
    run, _ = open_run(
        store, adapter.schema(), adapter.read, cfg, learner="c", compression=compression, rng=random.Random(0)
    )
    merger = FragmentMerger.one_process(run, store, Spool(spool_root) if spool_root is not None else None)
    state = merger.load(0, 0, run.manifest.init[0], None)
    records, written, commits, recs = [], [], [], []
    for r in range(rounds):
        for i, delta in enumerate(_deltas(rng, shapes, n, special)):
            learner = f"l{i}"
            ref = store.put_fragment(
                lambda sha, lr=learner, rr=r: keys.snapshot_blob_key(rr, lr, sha, compression),
                delta,
                shapes=run.shapes[0],
                dtypes=run.delta_dtypes(0),
                chunk_elements=run.chunk_elements,
                kind="delta",
                compression=compression,
            )
            snap = Snapshot(
                learner=learner,
                round=r,
                local_step=4,
                steps=4 + i,
                tokens=16 * (i + 1),
                base_version=version_before(r, run.P),
                step_seconds=0.1,
                schema_digest=run.digest,
                payload=ref,
                final=final,
                nonce="0123abcd",
            )
            store.put_record(keys.snapshot_key(r, learner), snap)
        c = Collector(r, run, state, 0.0, Estimates(), merger)
        for i in reversed(range(n)):
            c.judge_snapshot(store, f"l{i}")
        c.update({f"l{i}" for i in range(n)}, 1.0)
        mine: list[tuple[str, bytes]] = []

        def write(key: str, data, mine=mine) -> None:
            mine.append((key, data if isinstance(data, bytes) else data.read()))

        before = state
        commit = c.commit(compression=compression, write=write)
        rec = c.record(commit, closer="c", live=n, now=2.0, sync_seconds=0.5)
        merger.landed(0, rec.version)
        merger.spool.drop_through(r)
        _check(store, run, commit, rec, mine, before, compression)
        written += mine
        records.append(store.encode_record(rec))
        commits.append(commit)
        recs.append(rec)
        state = commit.state
    merger.close()
    return Closed(b"\n".join(records), written, commits, recs)


def _check(
    store: RunStore, run: RunInfo, commit: Commit, rec: RoundRecord, written: list, before: FragmentState,
    compression: str,
) -> None:  # fmt: skip
    """``commit`` is the reference's: payloads (keys, bytes, order), digests, cosine, new state."""
    ref = reference_commit(store, run, rec, before.theta, before.master, before.momentum, compression)
    assert [k for k, _ in written] == list(ref.payloads), rec.round
    assert all(data == ref.payloads[k] for k, data in written), rec.round
    assert (rec.theta_digest, rec.outer_digest, rec.cosine) == (ref.theta_digest, ref.outer_digest, ref.cosine)
    for part in ("theta", "master", "momentum"):
        for name, v in getattr(ref, part).items():
            got = getattr(commit.state, part)[name]
            assert np.asarray(got).tobytes() == np.asarray(v, np.float32).tobytes(), (rec.round, part, name)


def assert_same(a: Closed, b: Closed) -> None:
    assert a.record == b.record
    assert [k for k, _ in a.written] == [k for k, _ in b.written]
    for (k, x), (_, y) in zip(a.written, b.written, strict=True):
        assert x == y, k
    for x, y in zip(a.commits, b.commits, strict=True):
        sx, sy = x.state, y.state
        for part in ("theta", "master", "momentum"):
            for name, v in getattr(sx, part).items():
                assert v.tobytes() == getattr(sy, part)[name].tobytes(), (part, name)


def cfg_of(chunks: int | str, **kw) -> gm.DiLoCo:
    return gm.DiLoCo(sync_every=4, fragments=1, chunk_elements=None if chunks == WHOLE else chunks, **kw)  # type: ignore[arg-type]


CONFIGS = {
    "mean-f32": dict(merge=gm.WeightedMean()),
    "rda-f32": dict(),
    "rda-direct-bf16-deltas": dict(delta_dtype="BF16"),
    "mean-f16-deltas": dict(merge=gm.WeightedMean(), delta_dtype="F16"),
    "rda-f4-deltas-i2-commits": dict(delta_dtype="F4", commit_dtype="I2"),
    "rda-i2-deltas-f4-commits": dict(delta_dtype="I2", commit_dtype="F4"),
    "mean-f8-deltas-f8-commits": dict(merge=gm.WeightedMean(), delta_dtype="F8_E4M3", commit_dtype="F8_E4M3"),
    "mean-i2-deltas-i2-commits-gap": dict(
        merge=gm.WeightedMean(), delta_dtype="I2", commit_dtype="I2", gap_projection=True
    ),
    "rda-f4-deltas-i2-commits-gap": dict(delta_dtype="F4", commit_dtype="I2", gap_projection=True),
    "rda-bf16-commits": dict(commit_dtype="BF16"),
    "rda-f32-commits": dict(commit_dtype="F32"),
    "rda-clip": dict(clip_norm=0.5),
    "mean-clip-f4": dict(merge=gm.WeightedMean(), clip_norm=0.5, delta_dtype="F4"),
    "rda-clip-none-clipped": dict(clip_norm=1e6),
    "rda-checkpoints-f8": dict(delta_dtype="F4", commit_dtype="F8_E4M3", checkpoint_every=3),
    "rda-outliers": dict(outlier_factor=3.0),
    "rda-no-direct": dict(merge=gm.RDA(direct_pattern="nothing-matches")),
}


@pytest.mark.parametrize("chunks", [C, WHOLE])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_commit_is_the_whole_tensor_references_bytes(name: str, chunks: int | str) -> None:
    cfg = cfg_of(chunks, **CONFIGS[name])
    special = {"rda-clip": "large", "mean-clip-f4": "large", "rda-outliers": "large"}.get(name, "")
    rounds = 4 if name == "rda-checkpoints-f8" else 2  # versions 1, 2 between checkpoints, 3 one
    closed = close_rounds(cfg, special=special, rounds=rounds)
    if name == "rda-outliers":
        assert b'"outlier"' in closed.record
    if name == "rda-checkpoints-f8":
        assert closed.records[0].checkpoint == 0 and closed.records[2].checkpoint is None


@pytest.mark.parametrize(
    "special,kw",
    [
        ("zero", dict()),
        ("zero_tensor", dict()),
        ("zero_tensor", dict(merge=gm.WeightedMean())),
        ("nonfinite", dict(delta_dtype="BF16")),
        ("large", dict(clip_norm=0.3, commit_dtype="F4")),
    ],
)
@pytest.mark.parametrize("chunks", [C, WHOLE])
def test_zero_clipped_and_nonfinite_contributions_commit_the_references_bytes(special: str, kw: dict, chunks) -> None:
    closed = close_rounds(cfg_of(chunks, **kw), special=special)
    if special == "nonfinite":
        assert b'"nonfinite"' in closed.record


@pytest.mark.parametrize("n", [1, 2, 4])
def test_one_two_and_four_contributions_and_final_rounds(n: int) -> None:
    for final in (False, True):
        for chunks in (C, WHOLE):
            close_rounds(cfg_of(chunks, commit_dtype="BF16"), n=n, final=final)


@pytest.mark.parametrize("compression", ["", "zstd"])
def test_bf16_and_f16_parameters_and_compressed_payloads(compression: str) -> None:
    if compression:
        pytest.importorskip("zstandard")
    dtypes = {"embed.weight": "BF16", "h.1.w": "F16"}
    for kw in (dict(), dict(commit_dtype="F8_E4M3", delta_dtype="F4", checkpoint_every=2)):
        for chunks in (C, WHOLE):
            close_rounds(cfg_of(chunks, **kw), compression=compression, param_dtypes=dtypes, rounds=3)


def test_a_tensor_over_a_reduction_chunk_commits_the_references_bytes() -> None:
    # 2**20 + 4000 elements: the norms' pairwise trees span two of fused._CHUNK; chunks of 96*1024,
    # and one chunk (a tensor over the in-memory merge's block)
    shapes = {"big": (1024 + 4, 1024), "b": (100,)}
    for chunks in (96 * 1024, WHOLE):
        close_rounds(cfg_of(chunks, clip_norm=2.0, delta_dtype="F4"), shapes=shapes, special="large", rounds=1)


def test_threaded_reads_and_payload_encoding_commit_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = cfg_of(C, commit_dtype="I2", delta_dtype="F4")
    inline = close_rounds(cfg)
    # a fragment of one chunk whose tensor spans the in-memory merge's blocks: merged on threads
    shapes = {"big": (1024 + 4, 1024), "b": (100,)}
    whole = cfg_of(WHOLE, clip_norm=2.0, delta_dtype="F4")
    inline_whole = close_rounds(whole, shapes=shapes, special="large", rounds=1)
    # several small tensors held in memory: merged side by side on threads, the cosine summed on a
    # worker while the payloads are written
    several = {"a": (300, 200), "b": (5000,), "c": (64, 64), "d": (7,), "e": (1000, 3)}
    rda = cfg_of(WHOLE, clip_norm=2.0)
    inline_several = close_rounds(rda, shapes=several, n=4)
    assert all(rec.cosine is not None for rec in inline_several.records)
    monkeypatch.setattr(merger_mod, "THREADED_BYTES", 0)
    assert_same(inline, close_rounds(cfg))
    assert_same(inline_whole, close_rounds(whole, shapes=shapes, special="large", rounds=1))
    assert_same(inline_several, close_rounds(rda, shapes=several, n=4))


# ---- the streamed norm ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    size=st.one_of(st.integers(0, 3000), st.integers(30_000, 140_000), st.integers((1 << 20) - 50, (1 << 20) + 70_000)),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=8),
    seed=st.integers(0, 2**31),
    magnitude=st.integers(-20, 20),
)
def test_a_streamed_norm_is_dot_of_the_whole_tensor_bit_for_bit(size: int, cuts: list[int], seed: int, magnitude: int):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(size) * 2.0**magnitude).astype(np.float32)
    bounds = sorted({0, size, *(min(size, 32 * c) for c in cuts)})
    d, cos = leaves.dot_range(size, 0, size), leaves.cosine_range(size, 0, size)  # one process: every element
    a = x.astype(np.float64) * 0.37
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        d.feed(x[lo:hi])
        cos.feed(a[lo:hi])
    assert leaves.dot_total(size, leaves.combine_leaves(size, "dot", [d.finish()])) == fused._dot(x, x)
    squares: list[float] = []
    fused.merge_tensor([], [], radial=False, cosine=[(x, 0.37)], squares=squares)
    assert leaves.combine_leaves(size, "cosine", [cos.finish()]) == squares


@settings(max_examples=60, deadline=None)
@given(
    size=st.one_of(st.integers(0, 3000), st.integers(30_000, 140_000), st.integers((1 << 20) - 50, (1 << 20) + 70_000)),
    ranks=st.lists(st.integers(0, 1 << 21), max_size=6),
    pieces=st.integers(1, 4),
    seed=st.integers(0, 2**31),
)
def test_a_tensor_split_between_ranks_pools_to_the_whole_tensors_sums_bit_for_bit(
    size: int, ranks: list[int], pieces: int, seed: int
):
    # A sharded closer's ranks each hold any contiguous range (any cut, not only 32-aligned), fed
    # in a few pieces; their parts pooled give the one-process norm and cosine squares.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(size).astype(np.float32)
    a = x.astype(np.float64) * 0.37
    bounds = sorted({0, size, *(min(size, c) for c in ranks)})
    dots, coss = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        d, c = leaves.dot_range(size, lo, hi), leaves.cosine_range(size, lo, hi)
        steps = sorted({lo, hi, *rng.integers(lo, hi + 1, size=pieces - 1).tolist()})
        for p, q in zip(steps[:-1], steps[1:], strict=True):
            d.feed(x[p:q])
            c.feed(a[p:q])
        dots.append(d.finish())
        coss.append(c.finish())
    assert leaves.dot_total(size, leaves.combine_leaves(size, "dot", dots)) == fused._dot(x, x)
    squares: list[float] = []
    fused.merge_tensor([], [], radial=False, cosine=[(x, 0.37)], squares=squares)
    assert leaves.combine_leaves(size, "cosine", coss) == squares
    if len(dots) > 1:  # a rank's parts missing: a leaf is not covered, and it says so
        with pytest.raises(ValueError):
            leaves.combine_leaves(size, "dot", dots[1:])


# ---- memory ---------------------------------------------------------------------------------------


CHUNK = 1 << 14  # elements: 128 chunks of the fragment below


def _round_peak(by_chunks: bool, tmp_path: Path) -> tuple[int, int]:
    """tracemalloc's peak while a closer judges 3 snapshots of a fragment of 128 chunks (or, not
    ``by_chunks``, of one chunk: held decoded in memory) and commits them (F32, no commit dtype:
    the new parameters are the master), above what it held before, and the fragment's float32
    bytes."""
    shapes = {f"w{i}": (1 << 18,) for i in range(8)}  # 8 MiB of float32
    chunks = CHUNK if by_chunks else None
    cfg = gm.DiLoCo(sync_every=4, fragments=1, chunk_elements=chunks, merge=gm.WeightedMean(), clip_norm=1e6)
    rng = np.random.default_rng(1)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    store = RunStore(MemoryMailbox())
    adapter = NumpyAdapter(params)
    run, _ = open_run(store, adapter.schema(), adapter.read, cfg, learner="c", compression="", rng=random.Random(0))
    for i in range(3):
        delta = {k: (1e-2 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
        ref = store.put_fragment(
            lambda sha, lr=f"l{i}": keys.snapshot_blob_key(0, lr, sha, ""),
            delta,
            shapes=run.shapes[0],
            dtypes=run.delta_dtypes(0),
            chunk_elements=run.chunk_elements,
            kind="delta",
            compression="",
        )
        snap = Snapshot(learner=f"l{i}", round=0, local_step=4, steps=4, tokens=16, base_version=0,
                        step_seconds=0.1, schema_digest=run.digest, payload=ref, final=False, nonce="0123abcd")  # fmt: skip
        store.put_record(keys.snapshot_key(0, f"l{i}"), snap)
        del delta
    merger = FragmentMerger.one_process(run, store, Spool(tmp_path))
    c = Collector(0, run, merger.load(0, 0, run.manifest.init[0], None, params), 0.0, Estimates(), merger)
    merger.reserve(0)  # the new master and momentum: state, allocated before quorum either way

    def write(key: str, data) -> None:
        for _ in data.chunks():  # sent, not kept
            pass

    # the per-thread scratch buffers of the merge and the norms (1.25 MiB, once per thread), then measure
    fused._buffers(fused._STEP)
    fused._scratch(fused._LEAF)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(3):
            c.judge_snapshot(store, f"l{i}")
        c.update({"l0", "l1", "l2"}, 1.0)
        commit = c.commit(compression="", write=write)
        rec = c.record(commit, closer="c", live=3, now=2.0, sync_seconds=None)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(rec.participants) == 3
    return peak, run.fragment_bytes(0)


def _peak_in_a_process(by_chunks: bool, tmp_path: Path) -> tuple[int, int]:
    """``_round_peak`` in a fresh interpreter: tracemalloc counts every thread's allocations, and a
    test session may have left some running (a moto server)."""
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import test_chunk_closer as t; "
        "print(*t._round_peak(sys.argv[2] == '1', Path(sys.argv[3])))"
    )
    here = Path(__file__).resolve().parent
    argv = [sys.executable, "-c", code, str(here), "1" if by_chunks else "0", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(here.parent)}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, check=True).stdout.split()
    return int(out[-2]), int(out[-1])


def test_the_closers_memory_is_chunks_not_fragments(tmp_path: Path) -> None:
    peak, fragment = _peak_in_a_process(True, tmp_path)
    # a few chunks (merged float32, the cosine's float64 sum, one decoded contribution chunk and
    # its bytes, the outer step's scratch), the reductions' carried leaves and the bookkeeping
    assert peak < 12 * 4 * CHUNK + 2 * 8 * fused._LEAF + (512 << 10), (peak, fragment)
    assert peak < fragment // 4
    # the meter sees a closer that holds whole fragments: a fragment of one chunk is held, 3 deltas
    whole, _ = _peak_in_a_process(False, tmp_path)
    assert whole > 2 * fragment, (whole, fragment)


# ---- the spool ------------------------------------------------------------------------------------


def test_a_damaged_spool_file_is_read_again_from_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = gm.DiLoCo(sync_every=4, fragments=1, chunk_elements=C, delta_dtype="F4", commit_dtype="I2")
    expected = close_rounds(cfg, rounds=1)
    flipped: list[Path] = []
    orig = FragmentMerger.commit

    def flip_then_commit(self, op, put):
        assert self.spool.entries
        for sha in sorted(self.spool.entries)[:3]:  # a byte of a few chunks, on disk
            path = self.spool.dir / sha
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x40
            path.write_bytes(bytes(data))
            flipped.append(path)
        return orig(self, op, put)

    monkeypatch.setattr(FragmentMerger, "commit", flip_then_commit)
    got = close_rounds(cfg, rounds=1, spool_root=tmp_path)
    assert flipped
    assert_same(expected, got)


def test_a_damaged_spool_file_whose_store_copy_is_gone_rejects_the_contribution(tmp_path: Path) -> None:
    cfg = gm.DiLoCo(sync_every=4, fragments=1, chunk_elements=C)
    rng = np.random.default_rng(3)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    store = RunStore(MemoryMailbox())
    adapter = NumpyAdapter(params)
    run, _ = open_run(store, adapter.schema(), adapter.read, cfg, learner="c", compression="", rng=random.Random(0))
    refs = {}
    for i, delta in enumerate(_deltas(rng, SHAPES, 3, "")):
        learner = f"l{i}"
        refs[learner] = store.put_fragment(
            lambda sha, lr=learner: keys.snapshot_blob_key(0, lr, sha, ""),
            delta,
            shapes=run.shapes[0],
            dtypes=run.delta_dtypes(0),
            chunk_elements=run.chunk_elements,
            kind="delta",
            compression="",
        )
        snap = Snapshot(learner=learner, round=0, local_step=4, steps=4, tokens=16 * (i + 1), base_version=0,
                        step_seconds=0.1, schema_digest=run.digest, payload=refs[learner], final=False,
                        nonce="0123abcd")  # fmt: skip
        store.put_record(keys.snapshot_key(0, learner), snap)

    def collector(learners: list[str]) -> Collector:
        merger = FragmentMerger.one_process(run, store, Spool(tmp_path))
        c = Collector(0, run, merger.load(0, 0, run.manifest.init[0], None, params), 0.0, Estimates(), merger)
        for lr in learners:
            c.judge_snapshot(store, lr)
        c.update(set(learners), 1.0)
        return c

    c = collector(["l0", "l1", "l2"])
    spool = c.merger.spool
    victim = chunk_refs(refs["l1"])[2]
    path = spool.dir / victim.sha256
    path.write_bytes(b"\0" + path.read_bytes()[1:])
    store.delete([victim.key])  # GC'd, or the store lost it
    with pytest.raises(MailboxUnavailable):
        c.commit(compression="")
    assert c.judged["l1"].reason == "missing" and victim.sha256 not in spool.entries
    # the next attempt commits without it: the parameters of a round that never had it
    commit = c.commit(compression="")
    rec = c.record(commit, closer="c", live=3, now=2.0, sync_seconds=None)
    assert [p.learner for p in rec.participants] == ["l0", "l2"]
    assert [(x.learner, x.reason) for x in rec.rejected] == [("l1", "missing")]
    clean = collector(["l0", "l2"]).commit(compression="")
    assert commit.theta_digest == clean.theta_digest and commit.payloads == clean.payloads


def _spool_files(spool: Spool) -> set[str]:
    return set() if spool.dir is None else set(os.listdir(spool.dir))


def test_the_spool_is_emptied_after_each_commit_and_removed_on_close() -> None:
    from harness import Cluster
    from test_engine_rounds import assert_identical, finish

    cfg = gm.DiLoCo(sync_every=4, fragments=2, quorum_size=3, delta_dtype="F4", chunk_elements=32)
    cluster = Cluster(cfg, shapes=dict(SMALL))
    ms = cluster.join_all("abc")
    peak = 0
    for _ in range(40):
        cluster.run(1)
        for m in ms:
            sp = m.node.spool
            # nothing of a committed round stays; on disk exactly the entries (no partial files)
            assert all(r > m.node.state.head for _, r in sp.entries.values()), (m.name, m.node.state.head, sp.entries)
            assert _spool_files(sp) == set(sp.entries)
            peak = max(peak, len(sp.entries))
    assert peak > 0  # the closer did spool chunks
    cluster.settle()
    for m in ms:  # every round committed: nothing left to keep
        assert not m.node.spool.entries and not _spool_files(m.node.spool)
    dirs = [m.node.spool.dir for m in ms if m.node.spool.dir is not None]
    assert dirs and all(d.exists() for d in dirs)
    finish(cluster)  # each node leaves (Node.leave): its spool directory goes
    assert_identical(ms)
    assert not any(d.exists() for d in dirs)


def test_an_abandoned_rounds_spool_is_emptied_when_another_node_commits_it() -> None:
    from harness import Cluster
    from test_engine_rounds import assert_identical, assert_tape_contiguous, finish

    from gradientmail_core import events as ev
    from gradientmail_core.syncer.options import NodeOptions

    cluster = Cluster(gm.DiLoCo(sync_every=4, fragments=1, quorum_size=2, chunk_elements=32), shapes=dict(SMALL))
    cluster.options = NodeOptions(poll_interval=0.1, lease_timeout=5.0, round_timeout=0.5)
    a, b = cluster.join_all("ab")
    cluster.run(4)
    cluster.settle(4)
    head = a.node.state.head
    assert head == b.node.state.head >= 0
    for _ in range(4):  # a publishes and judges its own snapshot (quorum 2: it waits), then stalls (SIGSTOP)
        a.train()
    a.node.tick()
    assert (
        a.node.state.collector is not None
        and a.node.state.collector.round == head + 1
        and "a" in a.node.state.collector.judged
    )
    for _ in range(4):
        b.train()
    assert a.node.spool.entries, "a closer judging a chunked round spools its contributions"
    for _ in range(30):  # b takes the round over (timeout) and commits it
        b.node.tick()
        b.learner.drain()
        cluster.clock.advance(0.05)
    assert b.node.state.head == head + 1 and a.node.state.head == head
    a.node.tick()  # a resumes: it sees b's record, steps down, drops what it spooled
    assert a.of(ev.Superseded)
    assert all(r > head + 1 for _, r in a.node.spool.entries.values())
    assert _spool_files(a.node.spool) == set(a.node.spool.entries)
    cluster.run(8)
    finish(cluster)
    assert_tape_contiguous(cluster)
    assert_identical([a, b])


def test_the_spool_keeps_nothing_past_its_bound(tmp_path: Path) -> None:
    cfg = gm.DiLoCo(sync_every=4, fragments=1, chunk_elements=C, commit_dtype="BF16")
    expected = close_rounds(cfg, rounds=1)
    tiny = Spool(tmp_path, max_bytes=1)
    assert not tiny.put("0" * 64, [b"ab"], 2, 0) and not tiny.entries
    # a closer whose spool has no room reads each chunk from the store again: the same commit
    orig = Spool.__init__

    def small(self, root=None, *, max_bytes=1):
        orig(self, tmp_path, max_bytes=max_bytes)

    mp = pytest.MonkeyPatch()
    mp.setattr(Spool, "__init__", small)
    try:
        assert_same(expected, close_rounds(cfg, rounds=1))
    finally:
        mp.undo()


def test_a_spool_that_cannot_write_reads_from_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = gm.DiLoCo(sync_every=4, fragments=1, chunk_elements=C, delta_dtype="F4", merge=gm.RDA(), clip_norm=0.2)
    expected = close_rounds(cfg, rounds=1, special="large")
    blocked = tmp_path / "a-file"
    blocked.write_bytes(b"not a directory")
    orig = Spool.__init__
    monkeypatch.setattr(Spool, "__init__", lambda self, root=None, **kw: orig(self, blocked / "spool", **kw))
    assert_same(expected, close_rounds(cfg, rounds=1, special="large"))


def test_a_spool_left_by_a_dead_process_is_swept(tmp_path: Path) -> None:
    dead = tmp_path / "gradientmail-spool-999999999-x"
    dead.mkdir()
    (dead / "abc").write_bytes(b"x")
    sp = Spool(tmp_path)
    assert sp.put("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", [b""], 0, 0)
    assert not dead.exists() and sp.dir is not None and sp.dir.exists()
    sp.close()
    assert not any(tmp_path.iterdir())


# ---- engine runs: every object stored is the same ---------------------------------------------------


def _objects(mailbox) -> dict[str, bytes]:
    return {k: mailbox.get(k) for k in mailbox.list("")}


RUNS = {
    "f4-i2-error-feedback-clip": dict(delta_dtype="F4", commit_dtype="I2", error_feedback=True, clip_norm=5.0),
    "rda-f8-checkpoints": dict(delta_dtype="F8_E4M3", commit_dtype="F8_E4M3", checkpoint_every=3, quorum_size=2),
    "mean-bf16-outliers": dict(merge=gm.WeightedMean(), delta_dtype="BF16", outlier_factor=4.0),
    "rda-f32": dict(),
    # the record's cosine steers the learners' alignment: the same cosine, the same runs
    "adaptive-alignment-f8": dict(alignment=gm.Adaptive(), delta_dtype="F8_E4M3"),
}


@pytest.mark.parametrize(
    "name,compression", [(name, "") for name in sorted(RUNS)] + [("f4-i2-error-feedback-clip", "zstd")]
)
def test_a_chunked_run_stores_the_same_objects_whatever_the_spool_and_threads(
    name: str, compression: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if compression:
        pytest.importorskip("zstandard")
    from harness import Cluster
    from test_engine_rounds import assert_identical, finish

    kw = dict(sync_every=4, fragments=2, quorum_size=3, chunk_elements=32) | RUNS[name]
    cfg = gm.DiLoCo(**kw)  # type: ignore[arg-type]

    def run() -> dict[str, bytes]:
        cluster = Cluster(cfg, shapes=dict(SMALL), compression=compression)
        ms = cluster.join_all("abc")
        cluster.run(40)
        finish(cluster)
        assert_identical(ms)
        return _objects(cluster.mailbox)

    spooled = run()
    # no room in the spool (every pass reads the store again) and every read and encoding threaded
    orig = Spool.__init__
    monkeypatch.setattr(Spool, "__init__", lambda self, root=None, **kw: orig(self, root, max_bytes=0))
    monkeypatch.setattr(merger_mod, "THREADED_BYTES", 0)
    unspooled = run()
    assert sorted(spooled) == sorted(unspooled)
    assert [k for k in spooled if spooled[k] != unspooled[k]] == []
    assert len([k for k in spooled if k.startswith(keys.ROUNDS)]) >= 8


def test_a_fragment_of_one_chunk_is_held_decoded_and_a_larger_one_spooled() -> None:
    params = {k: np.ones(s, np.float32) for k, s in SMALL.items()}
    for chunks, held in ((None, True), (1 << 24, True), (32, False)):
        cfg = gm.DiLoCo(sync_every=4, fragments=1, chunk_elements=chunks)
        store = RunStore(MemoryMailbox())
        adapter = NumpyAdapter(params)
        run, _ = open_run(store, adapter.schema(), adapter.read, cfg, learner="c", compression="", rng=random.Random(0))
        delta = {k: np.full(s, 0.5, np.float32) for k, s in SMALL.items()}
        ref = store.put_fragment(
            lambda sha: keys.snapshot_blob_key(0, "l0", sha, ""), delta, shapes=run.shapes[0],
            dtypes=run.delta_dtypes(0), chunk_elements=run.chunk_elements, kind="delta", compression="",
        )  # fmt: skip
        snap = Snapshot(learner="l0", round=0, local_step=4, steps=4, tokens=16, base_version=0, step_seconds=0.1,
                        schema_digest=run.digest, payload=ref, final=False, nonce="0123abcd")  # fmt: skip
        store.put_record(keys.snapshot_key(0, "l0"), snap)
        merger = FragmentMerger.one_process(run, store)
        c = Collector(0, run, merger.load(0, 0, run.manifest.init[0], None, params), 0.0, Estimates(), merger)
        assert c.judge_snapshot(store, "l0").reason is None
        spool = merger.spool
        assert (len(spool.held), len(spool.entries)) == ((1, 0) if held else (0, len(chunk_refs(ref))))
        spool.close()


def test_gap_projection_changes_the_commit_once_the_master_holds_rounding() -> None:
    base = dict(merge=gm.WeightedMean(), delta_dtype="I2", commit_dtype="I2")
    plain = close_rounds(cfg_of(C, **base), rounds=2)
    projected = close_rounds(cfg_of(C, **base, gap_projection=True), rounds=2)
    # round 0 starts from the initial parameters (no rounding yet): the same commit
    assert projected.records[0].theta_digest == plain.records[0].theta_digest
    # round 1's master held the I2 rounding of round 0's change: the projection moved the step
    first = projected.commits[1].state.master
    assert any(not np.array_equal(first[n], plain.commits[1].state.master[n]) for n in first)
