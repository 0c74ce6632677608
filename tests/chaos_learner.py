"""One learner process for the chaos test (tests/test_chaos.py): a tiny numpy model trained with
``gm.Session`` over an S3 endpoint, until told to stop.

It trains until the file ``--stop-training`` exists, then keeps its session open (the
background thread keeps polling and aligning) until ``--close`` exists, closes the session
(which leaves the model at the newest committed parameters) and writes them, with a summary,
under ``--out``. The test kills (SIGKILL), pauses (SIGSTOP) and restarts these processes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

import gradientmail_core as gm

SHAPES = {"embed.weight": (16, 8), "layers.0.w": (8, 8), "layers.1.w": (8, 8), "head.b": (8,)}
# overlap_steps=0: a learner waits for its round before training on, so when training stops
# no round is due but unpublished and every learner can end at the same newest commit.
ALGORITHM = dict(sync_every=6, fragments=2, quorum_size=1, overlap_steps=0)


def target() -> dict[str, np.ndarray]:
    g = np.random.default_rng(1234)
    return {n: g.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def loss(params: dict[str, np.ndarray], goal: dict[str, np.ndarray]) -> float:
    return float(sum(((params[n].astype(np.float64) - goal[n]) ** 2).sum() for n in SHAPES))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--learner-id", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--stop-training", required=True, type=Path)
    p.add_argument("--close", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.02)
    a = p.parse_args()

    g = np.random.default_rng([a.seed, os.getpid()])
    model = {n: g.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    goal = target()
    seen: Counter[str] = Counter()

    def count(e: gm.events.Event) -> None:
        seen[type(e).__name__] += 1
        if isinstance(e, gm.events.TookOver):
            seen[f"TookOver/{e.reason}"] += 1
        gm.log_events(e)

    mailbox = gm.S3Mailbox(a.bucket, a.prefix, endpoint_url=a.endpoint)
    with gm.Session(
        model,
        algorithm=gm.DiLoCo(**ALGORITHM),
        mailbox=mailbox,
        learner_id=a.learner_id,
        poll_interval=0.05,
        lease_timeout=2.0,
        round_timeout=1.0,
        callbacks=(count,),
    ) as session:
        joined_loss = loss(model, goal)
        steps = 0
        while not a.stop_training.exists():
            for n, v in model.items():
                v -= np.float32(0.05) * (v - goal[n])
                v += np.float32(0.01) * g.standard_normal(v.shape).astype(np.float32)
            session.step(samples=4)
            steps += 1
            time.sleep(a.step_sleep)
        while not a.close.exists():  # no more training; the background keeps following the tape
            time.sleep(0.05)
    a.out.mkdir(parents=True, exist_ok=True)
    np.savez(a.out / f"{a.learner_id}.npz", **model)
    summary = {
        "learner": a.learner_id,
        "steps": steps,
        "joined_loss": joined_loss,
        "final_loss": loss(model, goal),
        "rounds_seen": session.rounds_seen,
        "events": dict(seen),
    }
    (a.out / f"{a.learner_id}.json").write_text(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
