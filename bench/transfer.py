"""One node's upload and download of one large payload: S3Mailbox streams against boto3's TransferManager.

Both move the same bytes through the same moto server (a separate process on 127.0.0.1, so the
server's copy of the object is not in the measured process) with the same part size and the same
number of parallel requests:

- ``gm put``: ``S3Mailbox.put_stream`` of chunks produced on the fly (1 MiB at a time).
- ``gm get``: ``S3Mailbox.get_stream``, each part dropped as it arrives.
- ``tm put``: ``client.upload_fileobj`` of a read-only file object producing the same bytes.
- ``tm get``: ``client.download_fileobj`` into a seekable sink that drops what it is given.

Every transfer runs in a fresh worker process, arms alternating, so that peak RSS
(``resource.getrusage``: the process's high-water mark, not Python's allocations alone) belongs to
one transfer: the figure is the peak minus the worker's RSS just before it started. Throughput
ratio = gm / tm for each direction (goal >= 0.9); the median over ``--repeat`` pairs.

    python bench/transfer.py                   # 256 MB, 8 MiB parts, 8 in parallel
    python bench/transfer.py --size-mb 1000    # the issue's 1 GB figure
    python bench/transfer.py --part-mb 5 8 16 32 --size-mb 256   # the part-size sweep
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20
BLOCK = os.urandom(MiB)


def payload(size: int) -> Any:
    """``size`` bytes, 1 MiB at a time, each block stamped with its index (no two parts alike)."""
    for i, start in enumerate(range(0, size, MiB)):
        block = i.to_bytes(8, "little") + BLOCK[8:]
        yield block[: min(MiB, size - start)]


class Producer:
    """A read-only, non-seekable file object over ``payload`` (what upload_fileobj reads)."""

    def __init__(self, size: int) -> None:
        self.it, self.buf = payload(size), b""

    def read(self, n: int = -1) -> bytes:
        pieces, have = [self.buf], len(self.buf)
        while n < 0 or have < n:  # one join per read, not one per block
            nxt = next(self.it, None)
            if nxt is None:
                break
            pieces.append(nxt)
            have += len(nxt)
        data = b"".join(pieces)
        out, self.buf = (data, b"") if n < 0 else (data[:n], data[n:])
        return out


class Sink:
    """A seekable file object that drops what it is given (what download_fileobj writes to)."""

    def __init__(self) -> None:
        self.pos = self.written = 0

    def write(self, data: bytes) -> int:
        self.written += len(data)
        return len(data)

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.pos


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> None:
    """One transfer in this process; prints a JSON line."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    from gradientmail_core.mailbox.s3 import S3Mailbox

    part, size = args.part_mb * MiB, args.size_mb * 1_000_000
    mb = S3Mailbox(
        "bench", "t", endpoint_url=args.endpoint, part_size=part, max_concurrency=args.concurrency, probe=False
    )
    client = boto3.client("s3", endpoint_url=args.endpoint)
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=args.concurrency)
    key = f"t/blobs/{args.arm.split()[0]}-{args.part_mb}.bin"
    base = rss_now()
    t0 = time.perf_counter()
    moved = size
    if args.arm == "gm put":
        mb.put_stream(key[2:], payload(size))
    elif args.arm == "tm put":
        client.upload_fileobj(Producer(size), "bench", key, Config=config)
    elif args.arm == "gm get":
        moved = sum(len(c) for c in mb.get_stream(key[2:]) or ())
    else:
        sink = Sink()
        client.download_fileobj("bench", key, sink, Config=config)
        moved = sink.written
    seconds = time.perf_counter() - t0
    assert moved == size, (args.arm, moved, size)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"arm": args.arm, "seconds": seconds, "mb_s": size / seconds / 1e6, "rss_added": peak - base}))


def run(args: argparse.Namespace, arm: str, part_mb: int, endpoint: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", arm, "--endpoint", endpoint, "--size-mb", str(args.size_mb)]
    cmd += ["--part-mb", str(part_mb), "--concurrency", str(args.concurrency)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256, help="payload size in MB (1e6 bytes); 1000 for the 1 GB figure")
    p.add_argument("--part-mb", type=int, nargs="+", default=[8], help="part size(s) in MiB")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeat", type=int, default=2, help="pairs of runs per arm and direction")
    p.add_argument("--endpoint", help="an S3 endpoint with a bucket 'bench'; default: a moto server started here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.arm, args.part_mb = args.worker, args.part_mb[0]
        worker(args)
        return
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        code = (
            "import logging,sys,time; logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
            "from moto.server import ThreadedMotoServer\n"
            "s=ThreadedMotoServer(ip_address='127.0.0.1',port=0,verbose=False); s.start()\n"
            "h,p=s.get_host_and_port(); print(f'http://{h}:{p}',flush=True); sys.stdin.read()"
        )
        server = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert server.stdout is not None
        endpoint = server.stdout.readline().strip()
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    try:
        load = os.getloadavg()[0]
        print(f"{args.size_mb} MB payload, {args.concurrency} parallel requests, endpoint {endpoint}, load {load:.1f}")
        print("| part | direction | gm MB/s | tm MB/s | ratio gm/tm | gm peak RSS added | tm peak RSS added |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for part_mb in args.part_mb:
            for direction in ("put", "get"):
                rows: dict[str, list[dict[str, Any]]] = {"gm": [], "tm": []}
                for i in range(args.repeat):
                    for who in ("gm", "tm") if i % 2 == 0 else ("tm", "gm"):
                        rows[who].append(run(args, f"{who} {direction}", part_mb, endpoint))
                ratios = [g["mb_s"] / t["mb_s"] for g, t in zip(rows["gm"], rows["tm"], strict=True)]
                gm_rate = statistics.median(r["mb_s"] for r in rows["gm"])
                tm_rate = statistics.median(r["mb_s"] for r in rows["tm"])
                gm_rss = max(r["rss_added"] for r in rows["gm"]) / MiB
                tm_rss = max(r["rss_added"] for r in rows["tm"]) / MiB
                print(
                    f"| {part_mb} MiB | {direction} | {gm_rate:.0f} | {tm_rate:.0f} | {statistics.median(ratios):.2f} "
                    f"| {gm_rss:.0f} MiB | {tm_rss:.0f} MiB |",
                    flush=True,
                )
    finally:
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
