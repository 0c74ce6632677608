"""No rank of a sharded node allocates a fragment's bytes (issue 13, docs/sharding.md), measured by
the operating system, not by the code's own ``Meter`` (which counts only what the code reports).

Two real gloo ranks ``fully_shard`` a model whose fragments are many like-sized tensors (32 MiB of
float32 each), and run each fragment operation of ``RankIO`` in turn: a publish (the delta,
``gather_chunks``, the rank's chunks encoded and uploaded) and a commit taken back (its chunks
downloaded, scattered into the shards, with and without blending). Around each one a rank resets
its peak resident set (``VmHWM``, through ``/proc/self/clear_refs``) and reads it after: the peak
over the operation, threads included, less the resident set before it. glibc's mmap threshold is
fixed (``MALLOC_MMAP_THRESHOLD_``) so every large buffer is mapped when allocated and unmapped when
freed, and the resident set follows what is live. Each operation must stay below one fragment's
bytes (a rank holds half of it; a whole fragment gathered on a rank, ``full_tensor()`` of its
tensors, is a fragment more), and the same probe around a ``full_tensor()`` of a fragment's tensors
must see at least a fragment (the measurement can fail).
Run as a script, this file is one of the ranks.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

WORLD = 2
WIDTH = 1024
LAYERS = 16  # two fragments of 8 weights of 4 MiB (and their biases)
CHUNK = 3 << 16  # 768 KiB of float32: chunks straddle the ranks' shards
MMAP_THRESHOLD = 256 << 10


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak(fn) -> int:  # type: ignore[no-untyped-def]
    """The most the resident set rose above its level before ``fn()`` while it ran."""
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    fn()
    return _status("VmHWM") - before


def _worker(out: Path) -> None:
    import functools

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import gradientmail_core as gm
    from gradientmail_core.adapters.torch_sharded import find_sharded
    from gradientmail_core.codec.header import schema_digest
    from gradientmail_core.mailbox.file import FileMailbox
    from gradientmail_core.protocol import keys
    from gradientmail_core.protocol.partition import plan
    from gradientmail_core.protocol.records import Manifest, PayloadRef, chunk_refs
    from gradientmail_core.protocol.run import RunInfo
    from gradientmail_core.protocol.store import RunStore
    from gradientmail_core.sharded.rank_io import RankIO
    from gradientmail_core.sharded.wire import Channel, Exchange, new_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    sharded = find_sharded(model)
    assert sharded is not None
    schema = gm.adapters.adapter_for(model).schema()
    store = RunStore(FileMailbox(str(out / "mailbox")))
    cfg = gm.DiLoCo(sync_every=8, fragments=2, chunk_elements=CHUNK).for_tensors(len(schema))
    init = [PayloadRef(key=keys.init_blob_key(f, "0" * 64), sha256="0" * 64, size=0) for f in range(cfg.fragments)]
    manifest = Manifest(
        run_id="0123456789abcdef",
        created_by="shard",
        schema=schema,
        schema_digest=schema_digest(schema),
        fragments=plan(schema, cfg.fragments, cfg.partition),
        config=cfg.to_dict(),
        init=init,
    )
    run = RunInfo.from_manifest(manifest)
    x, up, down = Exchange(new_group(), rank, WORLD), Channel(new_group()), Channel(new_group())
    io = RankIO(sharded, run, store, learner="shard", compression="", exchange=x, up=up, down=down)
    with torch.no_grad():
        for f in range(run.P):
            io.anchors.set(f, {n: sharded.local(n) * 0.5 for n in run.fragments[f]})
    # A commit of each fragment, uploaded before anything is measured (the whole fragment is the
    # test's, on rank 0 only; a closer writes it chunk by chunk).
    thetas: dict[int, list[PayloadRef]] = {}
    for f in range(run.P):
        with torch.no_grad():
            whole = {n: (sharded.params[n].full_tensor() * -0.5).numpy() for n in run.fragments[f]}
        if rank == 0:
            ref = store.put_fragment(
                functools.partial(keys.round_blob_key, 2 + f, "theta", compression=""),
                whole,
                shapes=run.shapes[f],
                dtypes=run.fragment_dtypes(f),
                chunk_elements=CHUNK,
                kind="theta",
                compression="",
            )
            thetas[f] = chunk_refs(ref)
        del whole
    io.start()
    peaks: dict[str, int] = {}

    def publish(f: int) -> None:
        io.upload_owned(io.publish(f, 1, f))

    def commit(f: int, v: int, mixing: float) -> None:
        if rank == 0:
            io.announce(f, v, thetas[f])
        else:
            io.down_message(down.recv(0)[1])
        io.write(f, v, mixing)

    def gathered(f: int) -> None:
        whole = [sharded.params[n].full_tensor() for n in run.fragments[f]]  # what must not happen
        del whole

    for f in range(run.P):
        peaks[f"publish {f}"] = _peak(lambda f=f: publish(f))
        peaks[f"commit {f}"] = _peak(lambda f=f: commit(f, 1, 0.0))
        peaks[f"blended commit {f}"] = _peak(lambda f=f: commit(f, 2, 0.5))
        peaks[f"control: full_tensor of fragment {f}"] = _peak(lambda f=f: gathered(f))
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
    report = {"peaks": peaks, "fragment_bytes": [run.fragment_bytes(f) for f in range(run.P)]}
    report["shard_bytes"] = [sum(sharded.local(n).numel() * 4 for n in run.fragments[f]) for f in range(run.P)]
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(
    not (
        torch.distributed.is_available()
        and torch.distributed.is_gloo_available()
        and os.access("/proc/self/clear_refs", os.W_OK)
    ),
    reason="torch.distributed with gloo, and a writable /proc/self/clear_refs (Linux), are needed",
)
def test_no_rank_allocates_a_fragment_in_a_publish_or_a_commit_as_the_os_measures_it(tmp_path):
    (tmp_path / "mailbox").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(WORLD),
        OMP_NUM_THREADS="1",
        MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD),
        MALLOC_TRIM_THRESHOLD_=str(MMAP_THRESHOLD),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(tmp_path)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    outs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    for r in range(WORLD):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        print(f"rank {r}, MiB:", {k: round(v / 2**20, 1) for k, v in report["peaks"].items()})
        fragment = report["fragment_bytes"]
        for what, peak in report["peaks"].items():
            f = int(what.rsplit(" ", 1)[1])
            if what.startswith("control"):  # the probe sees a fragment gathered on a rank
                assert peak >= 0.9 * fragment[f], (r, what, peak, fragment[f])
            else:
                assert peak < fragment[f], (r, what, peak / fragment[f], "of a fragment")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
