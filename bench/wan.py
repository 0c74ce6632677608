"""Rounds over a wide-area link: round time against the bandwidth floor, per role, before and after
streaming and multipart transfers (issue 18), in one run.

A moto S3 server runs on 127.0.0.1 (its own process); every node reaches it through its own
``_link.Link`` (a local proxy: ``--mbit`` each way, ``--rtt-ms`` round trip, a TCP window of
``--window-mb``), so each node has its own internet connection and the store is far from all of
them. ``--nodes`` nodes (a process each, with its proxy; ``gm.Session``) train a numpy model of
``--fragment-mb`` MB of float32 with
``DiLoCo(fragments=1, quorum_size=nodes)``: the whole model is one fragment, and the training
steps take ``--step-ms``, so a round is as long as its transfers make it.

Per round a follower uploads its delta and downloads the new parameters; the closer uploads its
delta, the parameters and the outer state, and downloads the other deltas. The floor of a role
is ``max(bytes up, bytes down) / rate`` per round (the link is full duplex); the round's floor is
the largest role's. Bytes are counted by the proxies, so they include HTTP. A round is also a
chain no transfer can overlap (the deltas up, the closer reads them, writes the new parameters,
the followers read them): ``chain`` is that chain's bytes over the rate, ``(closer up + closer
down + follower down) / rate`` with two nodes, the floor a round of this protocol can reach.

Two configurations over fresh buckets, one after the other:

- ``before``: ``S3Mailbox(part_size=5 GiB, max_concurrency=1)`` behind a wrapper without
  ``put_stream``/``get_stream``: one PUT and one GET per payload, the payload joined in memory
  (what a node did before issue 18).
- ``after``: ``S3Mailbox()`` with its defaults (``--part-mb``/``--concurrency`` override them):
  multipart uploads and parallel ranged GETs, payloads streamed.

``python bench/wan.py`` (quick: 16 MB fragments, 4 rounds); ``--fragment-mb 256 --rounds 3`` for
the figures in bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# bench/requests.py would shadow the ``requests`` package moto needs: bench/ leaves sys.path, and
# the proxy module is loaded by its path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
_spec = importlib.util.spec_from_file_location("_link", _HERE / "_link.py")
assert _spec is not None and _spec.loader is not None
_link = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_link)
Link = _link.Link

import gradientmail_core as gm  # noqa: E402

TENSORS = 8
for _name, _value in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}.items():
    os.environ.setdefault(_name, _value)


class Joined:
    """A mailbox with the four operations only: ``write_stream``/``read_stream`` fall back to one
    joined ``bytes`` per payload, one PUT and one GET (the path before streams)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, bytes(data))

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def list(self, prefix: str, after: str = "") -> list[str]:
        return self.inner.list(prefix, after)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)


@dataclass
class NodeResult:
    name: str
    role: str = "follower"
    commits: list[float] = field(default_factory=list)  # monotonic time each new round was seen
    marks: list[tuple[int, int]] = field(default_factory=list)  # link counters at those times
    error: str = ""


def build_model(nbytes: int, seed: int) -> dict[str, np.ndarray]:
    n = max(nbytes // 4 // TENSORS, 1)
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(TENSORS)}


def run_node(
    name: str, model: dict[str, np.ndarray], mailbox: Any, link: Link, args: argparse.Namespace, out: NodeResult
) -> None:
    cfg = gm.DiLoCo(sync_every=args.sync_every, fragments=1, quorum_size=args.nodes)
    session = gm.Session(
        model,
        algorithm=cfg,
        mailbox=mailbox,
        learner_id=name,
        poll_interval=0.05,
        lease_timeout=600.0,
        round_timeout=600.0,
        callbacks=(),
        seed=int(name[-1]),
    )
    try:
        session.open()
        session.wait_for(args.nodes, timeout=600)
        seen = 0
        while seen < args.rounds:
            for a in model.values():
                np.multiply(a, np.float32(0.999), out=a)
            session.step(1)
            time.sleep(args.step_ms / 1000)
            if session.rounds_seen > seen:
                seen = session.rounds_seen
                out.commits.append(time.monotonic())
                out.marks.append(link.counters())
        assert session.node is not None
        out.role = "closer" if session.node.state.stats.committed else "follower"
    except Exception as e:  # reported in the table, the other configuration still runs
        out.error = f"{type(e).__name__}: {e}"
    finally:
        try:
            session.close()
        except Exception as e:
            out.error = out.error or f"close: {type(e).__name__}: {e}"


def mailbox_for(label: str, bucket: str, url: str, args: argparse.Namespace) -> Any:
    if label == "before":
        return Joined(gm.S3Mailbox(bucket, endpoint_url=url, part_size=5 << 30, max_concurrency=1, probe=False))
    opts: dict[str, Any] = {}
    if args.part_mb:
        opts["part_size"] = int(args.part_mb * (1 << 20))
    if args.concurrency:
        opts["max_concurrency"] = args.concurrency
    return gm.S3Mailbox(bucket, endpoint_url=url, probe=False, **opts)


def worker(args: argparse.Namespace) -> None:
    """One node (``--worker``): its link, its session; prints its result as one JSON line."""
    host, port = args.endpoint.removeprefix("http://").split(":")
    link = Link((host, int(port)), mbit=args.mbit, rtt_ms=args.rtt_ms, window=int(args.window_mb * (1 << 20)))
    name = f"node{args.index}"
    res = NodeResult(name)
    model = build_model(int(args.fragment_mb * 1e6), seed=args.index)
    run_node(name, model, mailbox_for(args.worker, args.bucket, link.url, args), link, args, res)
    link.close()
    print(json.dumps(dataclasses.asdict(res)), flush=True)


def run_config(label: str, endpoint: str, args: argparse.Namespace) -> list[NodeResult]:
    import boto3

    bucket = f"wan-{label}-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    passed = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("only", "worker", "index", "endpoint", "bucket")
    ]
    procs = []
    for i in range(args.nodes):
        cmd = [
            sys.executable,
            __file__,
            f"--worker={label}",
            f"--index={i}",
            f"--endpoint={endpoint}",
            f"--bucket={bucket}",
        ]
        procs.append(subprocess.Popen([*cmd, *passed], stdout=subprocess.PIPE, text=True))
        time.sleep(0.5)  # node0 creates the run
    results = []
    for i, p in enumerate(procs):
        out, _ = p.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if lines:
            row = json.loads(lines[-1])
            results.append(NodeResult(**{**row, "marks": [tuple(m) for m in row["marks"]]}))
        else:
            results.append(NodeResult(f"node{i}", error=f"exit {p.returncode}"))
    return results


def start_store() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in its own process, on a free port; its endpoint once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=str(_HERE.parent),
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def summarize(label: str, results: list[NodeResult], args: argparse.Namespace) -> list[str]:
    rate = args.mbit * 1e6 / 8
    rows = []
    moved: dict[str, tuple[float, float]] = {}
    for r in results:
        if r.error or len(r.commits) < 2:
            rows.append(f"| {label} | {r.name} | {r.role} | - | - | - | - | - | {r.error or 'too few rounds'} |")
            continue
        # From the first round seen to the last: the first one includes the join.
        n = len(r.commits) - 1
        per_round = (r.commits[-1] - r.commits[0]) / n
        up = (r.marks[-1][0] - r.marks[0][0]) / n
        down = (r.marks[-1][1] - r.marks[0][1]) / n
        floor = max(up, down) / rate
        moved[r.role] = (up, down)
        intervals = [b - a for a, b in zip(r.commits, r.commits[1:])]
        spread = statistics.pstdev(intervals) if len(intervals) > 1 else 0.0
        rows.append(
            f"| {label} | {r.name} | {r.role} | {up / 1e6:.1f} | {down / 1e6:.1f} | {floor:.2f} | "
            f"{per_round:.2f} ± {spread:.2f} | {floor / per_round:.0%} | |"
        )
    if len(results) == 2 and set(moved) == {"closer", "follower"}:
        chain = (sum(moved["closer"]) + moved["follower"][1]) / rate
        rows.append(f"| {label} | | chain | | | {chain:.2f} | | | transfers one round must make in turn |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbit", type=float, default=100.0, help="link rate per node and direction, Mbit/s")
    ap.add_argument("--rtt-ms", type=float, default=80.0, help="round trip to the store, ms")
    ap.add_argument("--window-mb", type=float, default=4.0, help="TCP window per connection, MiB")
    ap.add_argument("--fragment-mb", type=float, default=16.0, help="model (= fragment) size, MB of float32")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="rounds each node sees per configuration")
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=10.0, help="training step time")
    ap.add_argument("--part-mb", type=float, default=0, help="after: part size (default: S3Mailbox's)")
    ap.add_argument("--concurrency", type=int, default=0, help="after: max_concurrency (default: S3Mailbox's)")
    ap.add_argument("--only", choices=("both", "before", "after"), default="both")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    ap.add_argument("--bucket", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    server, endpoint = start_store()
    print(
        f"{args.nodes} nodes, a {args.fragment_mb:g} MB fragment (float32), link {args.mbit:g} Mbit/s each way, "
        f"RTT {args.rtt_ms:g} ms, window {args.window_mb:g} MiB, {os.cpu_count()} CPUs\n"
    )
    lines = [
        "| config | node | role | MB up/round | MB down/round | floor s | round s | floor/round | note |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    try:
        for label in ("before", "after"):
            if args.only in ("both", label):
                t0 = time.monotonic()
                results = run_config(label, endpoint, args)
                lines += summarize(label, results, args)
                print(f"{label}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    finally:
        server.terminate()
        server.wait()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
