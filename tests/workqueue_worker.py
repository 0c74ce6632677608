"""A worker process for tests/test_workqueue_processes.py: takes units from a gm.WorkQueue on a
FileMailbox and "trains" on each (sleeps in small steps, renewing its hold), printing one line
per event. ``--stall``: hold the first unit forever (renewing), until killed."""

from __future__ import annotations

import argparse
import sys
import time

import gradientmail_core as gm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("holder")
    ap.add_argument("--units", type=int, required=True)
    ap.add_argument("--lease-timeout", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stall", action="store_true")
    args = ap.parse_args()
    q = gm.WorkQueue(
        gm.FileMailbox(args.path),
        units=args.units,
        holder=args.holder,
        lease_timeout=args.lease_timeout,
        renew_every=args.lease_timeout / 10,
        poll_interval=0.05,
    )

    def say(*words: object) -> None:
        print(*words, flush=True)

    while (hold := q.next_unit()) is not None:
        say("hold", hold.unit, hold.attempt)
        try:
            while args.stall:
                time.sleep(0.02)
                q.renew(hold)
            for step in range(args.steps):
                time.sleep(0.02)
                q.renew(hold, consumed=step + 1)
            say("done" if q.complete(hold) else "done-elsewhere", hold.unit, hold.attempt)
        except gm.HoldLost as e:
            say("lost", hold.unit, hold.attempt, str(e).replace("\n", " "))
    say("finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
