"""A sharded node's contribution has exactly a plain node's bytes (issue 13, docs/sharding.md
section 2), and takes a commit back as a plain node does: two real gloo ranks ``fully_shard`` a small model (a bf16 layer among fp32 ones, a
one-row weight, shard boundaries inside chunks), publish a fragment's delta through ``RankIO``
(delta shards, the F8 amax all-reduced, ``gather_chunks``, each rank's chunks uploaded), and rank 0
uploads the same delta as a plain node's publisher does (the whole tensors quantized, cut into the
plan's chunks: ``RunStore.put_fragment``). Every chunk's sha256 must match, for every delta dtype.
Then a theta uploaded as a closer writes it is announced, downloaded by each chunk's owner,
scattered and blended in (``mixing=0.5``) on every rank: the full parameters must be
``NumpyAdapter.write``'s blend of the full tensors, bit for bit (a bf16 layer included).
Run as a script, this file is one of the ranks.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

WORLD = 2
CHUNK = 64
CASES = [("F32", ""), ("BF16", ""), ("F8_E4M3", ""), ("F4", ""), ("I2", ""), ("F4", "zstd")]


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(9, 30), torch.nn.Linear(30, 1), torch.nn.Linear(1, 22))
    m[2].to(torch.bfloat16)
    return m


def _anchor(t: torch.Tensor) -> torch.Tensor:
    """An element-wise stand-in for the last commit (so the shards' anchors are the full one's)."""
    return (t.float() * 0.75 + 0.03125).to(t.dtype)


def _worker(out: Path) -> None:
    import numpy as np
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import gradientmail_core as gm
    from gradientmail_core.adapters.torch_sharded import find_sharded
    from gradientmail_core.adapters.torch_transfer import gather_refs
    from gradientmail_core.codec import quant
    from gradientmail_core.codec.header import schema_digest
    from gradientmail_core.mailbox.file import FileMailbox
    from gradientmail_core.protocol import keys
    from gradientmail_core.protocol.partition import plan
    from gradientmail_core.protocol.records import Manifest, PayloadRef, chunk_refs
    from gradientmail_core.protocol.run import RunInfo
    from gradientmail_core.protocol.store import RunStore
    from gradientmail_core.sharded.rank_io import RankIO
    from gradientmail_core.sharded.wire import Channel, Exchange, new_group

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    sharded = find_sharded(model)
    assert sharded is not None
    adapter = gm.adapters.adapter_for(model)
    schema = adapter.schema()
    store = RunStore(FileMailbox(str(out / "mailbox")))
    x, up, down = Exchange(new_group(), rank, WORLD), Channel(new_group()), Channel(new_group())
    full = {n: p.full_tensor() for n, p in sharded.params.items()}  # collective: every rank
    report = []
    for seq, (dtype, compression) in enumerate(CASES):
        cfg = gm.DiLoCo(sync_every=8, fragments=2, chunk_elements=CHUNK, delta_dtype=None if dtype == "F32" else dtype)
        cfg = cfg.for_tensors(len(schema))
        fragments = plan(schema, cfg.fragments, cfg.partition)
        init = [PayloadRef(key=keys.init_blob_key(f, "0" * 64), sha256="0" * 64, size=0) for f in range(cfg.fragments)]
        manifest = Manifest(
            run_id="0123456789abcdef",
            created_by="shard",
            schema=schema,
            schema_digest=schema_digest(schema),
            fragments=fragments,
            config=cfg.to_dict(),
            init=init,
        )
        run = RunInfo.from_manifest(manifest)
        io = RankIO(sharded, run, store, learner="shard", compression=compression, exchange=x, up=up, down=down)
        for f in range(run.P):
            io.anchors.set(f, {n: _anchor(sharded.local(n)) for n in run.fragments[f]})
            cap = io.publish(f, seq + 1, seq)
            mine = io.upload_owned(cap)
            got = gather_refs(sharded, {k: (r.sha256, r.size) for k, r in mine.items()})
            if rank != 0:
                continue
            with torch.no_grad():
                delta = {n: (_anchor(full[n]).float() - full[n].float()).numpy() for n in run.fragments[f]}
            dtypes = run.delta_dtypes(f)
            ref = store.put_fragment(
                functools.partial(keys.snapshot_blob_key, seq + 1, "plain", compression=compression),
                {n: quant.quantize(v, dtypes[n]) for n, v in delta.items()},
                shapes=run.shapes[f],
                dtypes=dtypes,
                chunk_elements=CHUNK,
                kind="delta",
                compression=compression,
            )
            want = [c.sha256 for c in chunk_refs(ref)]
            have = [got[k][0] for k in range(len(want))] if sorted(got) == list(range(len(want))) else sorted(got)
            owners = sorted({0 if k in mine else 1 for k in got})
            report.append(
                {
                    "dtype": dtype,
                    "compression": compression,
                    "f": f,
                    "same": want == have,
                    "n": len(want),
                    "owners": owners,
                }
            )
    # A commit on its way in: rank 0 uploads a theta of each fragment as a closer does, announces its
    # chunks (the down channel), every rank's downloader fetches its own, and the write blends it
    # in (mixing 0.5) on every rank: NumpyAdapter.write's formula, applied to the full tensors here.
    io.start()
    before = {n: p.full_tensor().detach() for n, p in sharded.params.items()}
    theta = {n: (t.float() * -0.5 + 0.25).to(t.dtype) for n, t in before.items()}
    for f in range(run.P):
        if rank == 0:
            ref = store.put_fragment(
                functools.partial(keys.round_blob_key, 7, "theta", compression=""),
                {n: theta[n].float().numpy() for n in run.fragments[f]},
                shapes=run.shapes[f],
                dtypes=run.fragment_dtypes(f),
                chunk_elements=CHUNK,
                kind="theta",
                compression="",
            )
            io.announce(f, 3, chunk_refs(ref))
        else:
            io.down_message(down.recv(0)[1])
        io.write(f, 3, 0.5)
    after = {n: p.full_tensor().detach() for n, p in sharded.params.items()}
    blended = {}
    for n, p in before.items():
        want = (p.float() * float(np.float32(0.5)) + theta[n].float() * float(np.float32(0.5))).to(p.dtype)
        blended[n] = bool(torch.equal(after[n], want)) and not torch.equal(after[n], p)
    if rank == 0:
        io.stopping.set()
        for t in io.threads:
            if t.name.endswith("refs-in"):
                t.join(timeout=30)
    else:
        io.stop_uploads()
        for t in io.threads:
            if t.name.endswith("upload"):
                t.join(timeout=30)
    io.stop_downloads()
    if rank == 0:
        (out / "report.json").write_text(json.dumps({"chunks": report, "blended": blended}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)
def test_a_sharded_nodes_chunks_are_a_plain_nodes_bytes_for_every_delta_dtype(tmp_path):
    (tmp_path / "mailbox").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
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
    got = json.loads((tmp_path / "report.json").read_text())
    assert got["blended"] and all(got["blended"].values()), got["blended"]  # a commit blended in, bit for bit
    report = got["chunks"]
    assert len(report) == 2 * len(CASES)
    for dtype, compression in CASES:  # chunks from both ranks in every case
        rows = [r for r in report if (r["dtype"], r["compression"]) == (dtype, compression)]
        assert sorted({o for r in rows for o in r["owners"]}) == [0, 1] and all(r["n"] > 2 for r in rows), rows
    assert all(r["same"] for r in report), [r for r in report if not r["same"]]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
