"""Closer latency: time from quorum to a durable commit, against the physical floor of a merge.

A merge must read every accepted contribution at least once, so the floor is the time to read
``contributions x params x 4`` bytes once from memory (measured here, on the same arrays, as a
float32 sum: one streaming read). The commit time is what ``Node._close`` does after quorum,
timed in its three parts on a ``FileMailbox`` with fsync on:

- ``compute``: ``Collector.commit`` (``commit.merge_commit``) up to its first payload write (merge, outer step, cast,
  payload encoding, the theta payload's sha256),
- ``write``:   from the first payload write to the end of the last (create-once, fsync; the
  later payloads are hashed on worker threads meanwhile),
- ``record``:  the round record (create-once, fsync): the commit point.

Judging (fetch + sha256 + decode of each snapshot and its tensors' norms, done as snapshots
arrive, before quorum) is timed separately. Contributions are F32 deltas, uncompressed; one
fragment of ``params``. Each measurement runs in a fresh worker process.

    python bench/closer.py                          # 25M and 100M params x 2, 8, 16 contributions
    python bench/closer.py --params 25e6 --contributions 2 8
    python bench/closer.py --engine before=/tmp/before   # and each row on another checkout
                                                         # (a git worktree), alternating

100M x 16 holds 6.4 GB of decoded deltas (plus the closer's 1.2 GB of state); the script skips
a size whose deltas would not fit in 60% of the memory available when it starts.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.adapters.base import NumpyAdapter  # noqa: E402
from gradientmail_core.mailbox import CreateOutcome, create_once  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.protocol.records import Snapshot  # noqa: E402
from gradientmail_core.protocol.run import open_run  # noqa: E402
from gradientmail_core.protocol.store import RunStore  # noqa: E402
from gradientmail_core.syncer.timing import Estimates  # noqa: E402

try:
    from gradientmail_core.syncer.collector import Collector
    from gradientmail_core.syncer.merger import FragmentMerger
except ImportError:  # an engine from before issue 35 (--engine): its Collector made a closer of its own
    from gradientmail_core.syncer.closer import Collector, compute_commit  # type: ignore[no-redef]
    from gradientmail_core.syncer.fragment import FragmentState

    FragmentMerger = None  # type: ignore[assignment,misc]

TENSOR = 1 << 22  # 4M params per tensor: a large transformer matrix


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def model(n_params: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    sizes = [TENSOR] * (n_params // TENSOR) + ([n_params % TENSOR] if n_params % TENSOR else [])
    return {f"layers.{i}.w": (0.02 * rng.standard_normal(s, dtype=np.float32)) for i, s in enumerate(sizes)}


def read_floor(arrays: list[np.ndarray], repeats: int = 3) -> float:
    """Seconds to stream every array once through the CPU (best of ``repeats``)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for a in arrays:
            np.add.reduce(a, axis=None)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(n_params: int, n_contrib: int, root: str) -> dict:
    params = model(n_params)
    cfg = gm.DiLoCo(sync_every=n_contrib, fragments=1, quorum_size=n_contrib)
    mailbox = gm.FileMailbox(root)  # fsync on: the commit is durable when the record is written
    store = RunStore(mailbox)
    adapter = NumpyAdapter(params)
    # (an engine from before open_run took a schema and a read function takes the adapter)
    model_args = (adapter,) if "adapter" in inspect.signature(open_run).parameters else (adapter.schema(), adapter.read)
    run, _ = open_run(store, *model_args, cfg, learner="closer", compression="", rng=random.Random(0))
    # Each contributor's snapshot of round 0: an F32 delta (the chunks of the run's plan) and its record.
    for i in range(n_contrib):
        rng = np.random.default_rng(1 + i)
        delta = {n: (1e-3 * rng.standard_normal(p.shape, dtype=np.float32)) for n, p in params.items()}
        learner = f"l{i:02d}"
        # the chunks of the run's plan (one payload for a fragment of one chunk), as a learner uploads them
        ref = store.put_fragment(
            lambda sha, lr=learner: keys.snapshot_blob_key(0, lr, sha, ""), delta, shapes=run.shapes[0],
            dtypes="F32", chunk_elements=run.chunk_elements, kind="delta", compression="",
        )  # fmt: skip
        del delta
        snap = Snapshot(
            learner=learner,
            round=0,
            local_step=n_contrib,
            steps=n_contrib,
            tokens=64 * n_contrib,
            base_version=0,
            step_seconds=0.1,
            schema_digest=run.digest,
            payload=ref,
            final=False,
            nonce="0123abcd",
        )
        store.put_record(keys.snapshot_key(0, learner), snap)
    gc.collect()

    if FragmentMerger is not None:
        merger = FragmentMerger.one_process(run, store)
        c = Collector(0, run, merger.load(0, 0, run.manifest.init[0], None, params), 0.0, Estimates(), merger)
    else:
        c = Collector(0, run, FragmentState.initial(params), 0.0, Estimates())
    judge = []
    for i in range(n_contrib):
        t0 = time.perf_counter()
        j = c.judge_snapshot(store, f"l{i:02d}")
        judge.append(time.perf_counter() - t0)
        assert j.reason is None, j.reason
    c.update(set(c.judged), 1.0)  # (every live learner reported: closes now)
    deltas = [
        a
        for j in c.accepted()
        for a in store.get_payload(j.snapshot.payload, run.shapes[0], chunk_elements=run.chunk_elements).values()
    ]
    floor = read_floor(deltas)
    del deltas

    marks: list[float] = []

    def write(key: str, data: bytes) -> None:
        marks.append(time.perf_counter())
        outcome, _ = create_once(mailbox, key, data if isinstance(data, bytes) else data.read())  # a stream
        assert outcome is not CreateOutcome.TAKEN
        marks.append(time.perf_counter())

    kw = dict(closer="closer", live=n_contrib, sync_seconds=None, now=1.0)
    t0 = time.perf_counter()
    if FragmentMerger is not None:
        commit = c.commit(compression="", write=write)
        rec, written = c.record(commit, **kw), sum(commit.sizes.values())  # type: ignore[arg-type]
    elif "write" in inspect.signature(compute_commit).parameters:
        commit = compute_commit(c, compression="", write=write, **kw)  # type: ignore[arg-type]
        rec, written = commit.record, sum(len(d) for d in commit.payloads.values())
    else:  # an engine from before payloads were written as they were hashed
        commit = compute_commit(c, compression="", **kw)  # type: ignore[arg-type]
        for key, data in commit.payloads.items():
            write(key, data)
        rec, written = commit.record, sum(len(d) for d in commit.payloads.values())
    t2 = time.perf_counter()
    outcome, _ = store.put_record(keys.round_key(0), rec)
    t3 = time.perf_counter()
    assert outcome is CreateOutcome.CREATED
    return {
        "compute": marks[0] - t0,
        "write": marks[-1] - marks[0],
        "record": t3 - t2,
        "total": t3 - t0,
        "floor": floor,
        "judge_each": statistics.median(judge),
        "judge_total": sum(judge),
        "bytes": 4 * n_params * n_contrib,
        "written": written,
        "load": os.getloadavg()[0],
        "engine": str(Path(gm.__file__).parent.parent),
    }


def run_worker(n_params: int, n_contrib: int, engine: str | None, tmp: str | None) -> dict:
    env = dict(os.environ)
    if engine:  # another checkout of gradientmail (--engine NAME=PATH): before/after
        env["PYTHONPATH"] = os.pathsep.join([engine, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--worker", str(n_params), str(n_contrib)] + (["--dir", tmp] if tmp else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(
            f"worker {n_params} x {n_contrib} ({engine or 'this checkout'}) failed:\n{out.stderr[-3000:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, nargs="*", default=[25e6, 100e6])
    ap.add_argument("--contributions", type=int, nargs="*", default=[2, 8, 16])
    ap.add_argument("--dir", default=None, help="where the FileMailbox lives (default: a temp dir)")
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs of each row and arm (alternating); rows show the median"
    )
    ap.add_argument(
        "--engine",
        action="append",
        default=[],
        type=lambda v: tuple(v.split("=", 1)),
        metavar="NAME=PATH",
        help="also run every row on the gradientmail checkout at PATH (e.g. a git worktree of an older "
        "commit), alternating with this one: before/after in one run",
    )
    ap.add_argument("--worker", type=int, nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            print(json.dumps(measure(args.worker[0], args.worker[1], d)))
        return
    print(f"closer latency on FileMailbox (fsync on), F32 deltas, one fragment; load average {os.getloadavg()}")
    arms: list[tuple[str, str | None]] = [("this", None), *args.engine]
    head = (
        f"{'params':>7} {'contrib':>7} {'engine':>7} | {'floor s':>7} {'GB/s':>5} | {'compute':>8} {'write':>6} "
        f"{'record':>6} {'total s':>8} | {'x floor':>7} | {'judge each s':>12} {'judge/floor':>11} | {'load':>4}"
    )
    print(head)
    print("-" * len(head))
    rows = []
    for p in args.params:
        n_params = int(p)
        for n in args.contributions:
            need = 4 * n_params * (n + 6)  # deltas + closer state + outputs
            if need > 0.6 * available_bytes():
                print(
                    f"{n_params / 1e6:>6.0f}M {n:>7} | skipped: needs ~{need / 2**30:.1f} GiB, "
                    f"{available_bytes() / 2**30:.1f} GiB available"
                )
                continue
            results: dict[str, dict] = {}
            runs: dict[str, list[dict]] = {name: [] for name, _ in arms}
            # Arms alternate, the order flipping every repeat; each arm's row is its median total.
            for rep in range(args.repeat):
                for name, path in arms if (len(rows) + rep) % 2 == 0 else list(reversed(arms)):
                    runs[name].append(run_worker(n_params, n, path, args.dir))
            for name, _ in arms:
                r = results[name] = sorted(runs[name], key=lambda x: x["total"])[len(runs[name]) // 2]
                print(
                    f"{n_params / 1e6:>6.0f}M {n:>7} {name:>7} | {r['floor']:>7.3f} "
                    f"{r['bytes'] / r['floor'] / 1e9:>5.1f} | {r['compute']:>8.2f} {r['write']:>6.2f} "
                    f"{r['record']:>6.3f} {r['total']:>8.2f} | {r['total'] / r['floor']:>6.1f}x | "
                    f"{r['judge_each']:>12.2f} {r['judge_total'] / r['floor']:>10.1f}x | {r['load']:>4.1f}",
                    flush=True,
                )
            rows.append((n_params, n, results))
    if args.engine:
        print("\nbefore/after (total s, x floor; compute s):")
        for n_params, n, results in rows:
            this = results["this"]
            for name, _ in args.engine:
                o = results[name]
                print(
                    f"{n_params / 1e6:>6.0f}M {n:>3}: {name} {o['total']:.2f} s ({o['total'] / o['floor']:.1f}x) -> "
                    f"{this['total']:.2f} s ({this['total'] / this['floor']:.1f}x), {o['total'] / this['total']:.2f}x "
                    f"faster; compute {o['compute']:.2f} -> {this['compute']:.2f} s"
                )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
