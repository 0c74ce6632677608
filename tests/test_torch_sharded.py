"""FSDP2 parameters cut into world-size-independent chunks (``adapters/torch_sharded.py``, issue 13).

The plan and the ownership are checked as properties over any shapes, chunk size and world size;
then three real gloo ranks ``fully_shard`` a small model, build the chunks they own and take a
commit back, and this process (the harness) compares what they wrote with an unsharded copy.
Run as a script, this file is one of those ranks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradientmail_core.adapters import torch_sharded as ts  # noqa: E402
from gradientmail_core.adapters import torch_transfer as tt  # noqa: E402
from gradientmail_core.codec.plan import BLOCK, Piece, chunk_plan, numel, offsets  # noqa: E402
from gradientmail_core.protocol.layout import Layout, chunk_owner, owned_chunks, shard_range, transfers  # noqa: E402

shapes_st = st.lists(
    st.one_of(
        st.just(()),
        st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
        st.tuples(st.integers(0, 70)),
    ),
    min_size=1,
    max_size=6,
).map(lambda shapes: [(f"t{i}", s) for i, s in enumerate(shapes)])


def _full(shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(numel(s)).astype(np.float32) for n, s in shapes}


@settings(max_examples=200, deadline=None)
@given(shapes=shapes_st, blocks=st.integers(1, 5))
def test_chunk_plan_cuts_every_tensor_once_on_block_boundaries(shapes, blocks):
    chunk = blocks * BLOCK
    plan = chunk_plan(shapes, chunk)
    seen: dict[str, list[tuple[int, int]]] = {n: [] for n, _ in shapes}
    for pieces in plan:
        assert sum(p.size for p in pieces) <= chunk
        for p in pieces:
            seen[p.name].append((p.start, p.stop))
            assert p.start % BLOCK == 0, "a quantizer block would straddle two chunks"
    for name, shape in shapes:
        ranges = seen[name]
        n = numel(shape)
        if n == 0:
            assert ranges == [(0, 0)] and plan[0].count(Piece(name, 0, 0)) == 1
            continue
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "tensor not cut into adjacent pieces"
        for _, stop in ranges[:-1]:
            assert stop % BLOCK == 0


def test_a_fragment_that_fits_is_one_chunk_of_whole_tensors():
    shapes = [("w", (3, 5)), ("b", (3,)), ("e", (0, 4))]
    assert chunk_plan(shapes, 96) == [[Piece("w", 0, 15), Piece("b", 0, 3), Piece("e", 0, 0)]]
    # Tensors start on a block: 15 elements of w, padding to 32, then b.
    assert offsets(shapes) == [0, 32, 64]
    with pytest.raises(ValueError, match="multiple of 32"):
        chunk_plan(shapes, 48)


def test_shard_ranges_follow_torch_chunk():
    # 5 rows over 4 ranks: torch.chunk gives 2, 2, 1 and nothing for the last rank.
    rows = [shard_range((5, 3), 4, c) for c in range(4)]
    assert rows == [(0, 6), (6, 12), (12, 15), (15, 15)]
    assert [Layout.shard0({"w": (5, 3)}, 4).holder("w", e) for e in (0, 5, 6, 12, 14)] == [0, 0, 1, 2, 2]
    for rows_, world in [(7, 3), (1, 2), (8, 4), (3, 5)]:
        pieces = [t.shape[0] for t in torch.chunk(torch.empty(rows_), world)]
        got = [shard_range((rows_,), world, c) for c in range(world)]
        assert [b - a for a, b in got] == pieces + [0] * (world - len(pieces))


@settings(max_examples=300, deadline=None)
@given(shapes=shapes_st, blocks=st.integers(1, 4), world=st.integers(1, 5), flat=st.booleans(), data=st.data())
def test_owned_chunks_assembled_from_shards_equal_chunks_cut_from_the_full_tensors(shapes, blocks, world, flat, data):
    chunk = blocks * BLOCK
    plan = chunk_plan(shapes, chunk)
    shape_of = dict(shapes)
    full = _full(shapes)
    if flat:  # FSDP1: any contiguous range per rank, in rank order (empty ones too)
        cuts = {
            n: tuple(sorted(data.draw(st.lists(st.integers(0, numel(s)), min_size=world - 1, max_size=world - 1))))
            for n, s in shapes
        }
        layout = Layout(world, {n: (0, *cuts[n], numel(s)) for n, s in shapes})
    else:  # FSDP2: Shard(0)
        layout = Layout.shard0(shape_of, world)
        for n, s in shapes:
            assert [layout.range(n, c) for c in range(world)] == [shard_range(s, world, c) for c in range(world)]
    local = {c: {n: full[n][slice(*layout.range(n, c))] for n, _ in shapes} for c in range(world)}  # each rank's
    owners = [chunk_owner(p, layout) for p in plan]
    owned = [owned_chunks(plan, layout, c) for c in range(world)]
    assert sorted(k for ks in owned for k in ks) == list(range(len(plan))), "owned chunks do not partition"
    moves = transfers(plan, layout)
    for k, pieces in enumerate(plan):
        me = owners[k]
        got_from_others = held = 0
        for i, p in enumerate(pieces):
            buf = np.full(p.size, np.nan, np.float32)
            lo, hi = layout.range(p.name, me)
            a, b = max(p.start, lo), min(p.stop, hi)
            if a < b:
                buf[a - p.start : b - p.start] = local[me][p.name][a - lo : b - lo]
                held += b - a
            for t in moves:
                if (t.chunk, t.index) == (k, i):
                    assert t.dst == me != t.src
                    slo = layout.range(p.name, t.src)[0]
                    assert np.isnan(buf[t.piece.start - p.start : t.piece.stop - p.start]).all(), "sent twice"
                    buf[t.piece.start - p.start : t.piece.stop - p.start] = local[t.src][p.name][
                        t.piece.start - slo : t.piece.stop - slo
                    ]
                    got_from_others += t.piece.size
            np.testing.assert_array_equal(buf, full[p.name][p.start : p.stop])
        assert held + got_from_others == sum(p.size for p in pieces), "an element received that the owner holds"
        if world == 1:
            assert not moves
        held = [0] * world
        for p in pieces:
            for c in range(world):
                lo, hi = layout.range(p.name, c)
                held[c] += max(0, min(p.stop, hi) - max(p.start, lo))
        assert held[me] == max(held), "the owner holds fewer of the chunk's elements than another rank"


# ---------------------------------------------------------------------------------------------
# Two real FSDP2 ranks on gloo


CHUNK = 64
WORLD = 3  # three ranks: a rank sends to two peers, and two ranks hold none of a one-row tensor


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(7, 13),
        torch.nn.Linear(13, 5),
        torch.nn.Linear(5, 1),  # one row: ranks 1 and 2 hold none of its weight
        torch.nn.Linear(1, 40),
    )
    m[3].to(torch.bfloat16)  # a second dtype in the fragment (and a byte offset to realign)
    return m


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    sharded = ts.find_sharded(model)
    assert sharded is not None and sharded.world == WORLD and sharded.coord == rank
    names = list(sharded.shapes)
    local = {n: sharded.local(n) for n in names}
    meter = ts.Meter()
    owned = tt.gather_chunks(sharded, names, CHUNK, local, meter=meter)
    for k, pieces in owned.items():
        for i, (_, values) in enumerate(pieces):
            np.save(out / f"r{rank}-c{k}-p{i}.npy", values.float().numpy())
    # A commit back: every owned chunk's values as 2 * theta + 1, then each rank's shards.
    commit = {k: [(p, (v.float() * 2 + 1).to(v.dtype)) for p, v in pieces] for k, pieces in owned.items()}
    tt.scatter_chunks(sharded, names, CHUNK, commit, local, meter=meter)
    reference = _model()
    applied = {}
    with torch.no_grad():
        for n, p in sharded.params.items():
            want = (reference.get_parameter(n).float() * 2 + 1).to(p.dtype)
            applied[n] = bool(torch.equal(p.full_tensor(), want))
    # Each rank's refs of its chunks (a made-up sha: the chunk index, repeated), known to every rank.
    fake = {k: (f"{k:02x}{rank:02x}" * 16, 1000 + k) for k in owned}
    refs = tt.gather_refs(sharded, fake)
    refused = {}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    for kind, shard in {
        "shard1": lambda m: fully_shard(m, shard_placement_fn=lambda p: Shard(p.ndim - 1)),
        "hsdp": lambda m: fully_shard(
            m, mesh=init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard"))
        ),
    }.items():
        other = torch.nn.Linear(6, 6)  # divisible by WORLD: FSDP2 refuses uneven Shard(1) itself
        shard(other)
        try:
            ts.find_sharded(other)
            refused[kind] = ""
        except ts.ShardingUnsupported as e:
            refused[kind] = str(e)
    report = {"peak": meter.peak, "owned": sorted(owned), "applied": applied, "refused": refused, "refs": refs}
    (out / f"r{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _distributed_ok() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


@pytest.mark.skipif(not _distributed_ok(), reason="torch.distributed with gloo is unavailable")
def test_fsdp2_ranks_build_the_chunks_of_the_unsharded_model_and_take_a_commit_back(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(tmp_path)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    outs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)

    model = _model()
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = chunk_plan(shapes, CHUNK)
    assert len(plan) > 4  # many chunks, some straddling the two ranks
    flat = {n: p.detach().float().reshape(-1).numpy() for n, p in model.named_parameters()}
    fragment_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reports = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD)]
    assert sorted(k for report in reports for k in report["owned"]) == list(range(len(plan)))
    # (the owner of a chunk holds most of it: here a rank may own none, and still sends its parts)
    assert sum(bool(report["owned"]) for report in reports) >= 2
    for report in reports:  # every rank learned every rank's refs, in chunk order
        want = {str(k): [f"{k:02x}{r:02x}" * 16, 1000 + k] for r, rep in enumerate(reports) for k in rep["owned"]}
        assert report["refs"] == want
    shape_of = dict(shapes)
    senders = {t.src for t in transfers(plan, Layout.shard0(shape_of, WORLD))}
    assert len(senders) == WORLD, "some rank sent nothing: the exchange is not exercised"
    for r, report in enumerate(reports):
        for k in report["owned"]:
            for i, p in enumerate(plan[k]):
                got = np.load(tmp_path / f"r{r}-c{k}-p{i}.npy", allow_pickle=False)
                np.testing.assert_array_equal(got, flat[p.name][p.start : p.stop], err_msg=f"chunk {k} {p}")
        assert all(report["applied"].values()), report["applied"]
        assert 0 < report["peak"] < fragment_bytes, f"rank {r} allocated {report['peak']} of {fragment_bytes} bytes"
        assert "Shard(dim=0) only" in report["refused"]["shard1"], report["refused"]
        assert "2-D device mesh" in report["refused"]["hsdp"], report["refused"]


def test_a_model_without_dtensors_is_not_sharded():
    assert ts.find_sharded(torch.nn.Linear(2, 2)) is None  # the plain adapter's business


def test_gpu_check_script_has_help_and_says_no_cuda_on_a_cpu_machine(capsys, monkeypatch):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--help"])
    with pytest.raises(SystemExit) as e:
        gpu_check.main()
    assert e.value.code == 0 and "FSDPStrategy" in capsys.readouterr().out
    if torch.cuda.is_available():
        return
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])
    assert gpu_check.main() == 0
    assert "no CUDA device" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--require-cuda"])
    assert gpu_check.main() == 2


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
