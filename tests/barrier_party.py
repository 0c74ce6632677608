"""One party of a ``gm.Barrier`` test in its own process: waits at a barrier ``--times`` times and
prints one JSON line per release (the set it was released with). Started by tests/test_barrier.py."""

from __future__ import annotations

import argparse
import json
import sys

import gradientmail_core as gm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--endpoint-url")
    ap.add_argument("--id", required=True)
    ap.add_argument("--name", default="eval")
    ap.add_argument("--parties", required=True, help="a count, or comma-separated learner ids")
    ap.add_argument("--times", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    mailbox = gm.open_mailbox(args.url, **options)
    parties: int | list[str] = int(args.parties) if args.parties.isdigit() else args.parties.split(",")
    barrier = gm.Barrier(mailbox=mailbox, learner_id=args.id, poll_interval=0.05)
    for i in range(args.times):
        try:
            arrived = barrier.wait(args.name, parties=parties, timeout=args.timeout)
        except gm.BarrierTimeout as e:
            print(json.dumps({"use": i, "timeout": str(e)}), flush=True)
            return 3
        print(json.dumps({"use": i, "arrived": sorted(arrived)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
