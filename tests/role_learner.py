"""A learner node process over numpy parameters, with a role (``tests/test_roles_processes.py``).

Trains a dict of float32 arrays toward a fixed target with seeded noise, one ``session.step``
per step; writes its final parameters (``OUT.npz``) and its events (one JSON line each).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np

import gradientmail_core as gm

SHAPES = {"embed.weight": (16, 8), "layers.0.w": (8, 8), "layers.1.w": (8, 8), "head.b": (8,)}


def params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mailbox", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--role", default="learner")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--quorum", type=int, default=2)
    p.add_argument("--overlap-steps", type=int, default=None)
    p.add_argument("--poll-interval", type=float, default=0.05)
    p.add_argument("--lease-timeout", type=float, default=3.0)
    p.add_argument("--wait-for", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", required=True)
    p.add_argument("--events", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sink = open(args.events, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def to_file(e: gm.events.Event) -> None:
        sink.write(json.dumps({"event": type(e).__name__, **vars(e)}, default=str) + "\n")

    model = params(0)
    target = params(7)
    rng = np.random.default_rng(abs(hash(args.id)) % 2**31)
    algorithm = gm.DiLoCo(
        sync_every=args.sync_every,
        fragments=args.fragments,
        quorum_size=args.quorum,
        overlap_steps=args.overlap_steps,
    )
    with gm.Session(
        model,
        algorithm=algorithm,
        mailbox=gm.open_mailbox(args.mailbox),
        learner_id=args.id,
        role=args.role,
        poll_interval=args.poll_interval,
        lease_timeout=args.lease_timeout,
        # a stalled run (no node that may close) must not make close() give up before it resumes
        close_timeout=600.0,
        callbacks=[gm.log_events, to_file],
    ) as session:
        if args.wait_for > 1:
            session.wait_for(learners=args.wait_for, timeout=300)
        for _ in range(args.steps):
            for n, a in model.items():
                a -= np.float32(0.1) * (a - target[n]) + np.float32(0.01) * rng.standard_normal(a.shape).astype(
                    np.float32
                )
            session.step(samples=4)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    np.savez(args.out + ".npz", **model)
    print(json.dumps({"learner": args.id, "rounds_seen": session.rounds_seen}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
