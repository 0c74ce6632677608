"""One deterministic learner process for the adversary tests (tests/test_adversary_processes.py).

A linear-regression model held as a dict of float32 numpy arrays, trained on data seeded by
(learner, step), with ``sync_every == fragments`` so every step publishes exactly one round and
``overlap_steps=0`` so it waits for that round: the run's result does not depend on timing.

    python tests/adversary_learner.py --mailbox DIR --learner-id a --steps 12 --out OUT [--secret-file F]
        [--identity F [--ignore-revocation]]

Writes ``OUT.npz`` (final parameters) and ``OUT.events.jsonl`` (one event per line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.mailbox.file import FileMailbox  # noqa: E402

D_IN, D_OUT, BATCH = 8, 3, 16


def make_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    return {"w": (0.1 * rng.standard_normal((D_IN, D_OUT))).astype(np.float32), "b": np.zeros(D_OUT, np.float32)}


def train_step(model: dict[str, np.ndarray], learner: str, step: int, *, lr: float = 0.05, inner: int = 2) -> None:
    """A few SGD steps of least squares on batches seeded by (learner, step): deterministic."""
    w_true = np.random.default_rng(99).standard_normal((D_IN, D_OUT)).astype(np.float32)
    for i in range(inner):
        rng = np.random.default_rng([sum(map(ord, learner)), step, i])
        x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
        y = x @ w_true + np.float32(0.1) * rng.standard_normal((BATCH, D_OUT)).astype(np.float32)
        err = x @ model["w"] + model["b"] - y
        model["w"] -= np.float32(lr) * (x.T @ err / BATCH).astype(np.float32)
        model["b"] -= np.float32(lr) * err.mean(axis=0).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mailbox", required=True)
    p.add_argument("--learner-id", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--learners", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--secret-file", default=None)
    p.add_argument("--outlier-factor", type=float, default=None)
    p.add_argument("--identity", default=None, help="this node's key file: a members-only run")
    p.add_argument("--ignore-revocation", action="store_true", help="never read the membership log again")
    a = p.parse_args(argv)

    events = open(a.out + ".events.jsonl", "w")  # noqa: SIM115 - closed below

    def record(e: gm.events.Event) -> None:
        row = {"event": type(e).__name__, **{k: v for k, v in dataclasses.asdict(e).items()}}
        events.write(json.dumps(row, default=str) + "\n")
        events.flush()

    model = make_model()
    cfg = gm.DiLoCo(
        sync_every=2, fragments=2, in_flight=1, overlap_steps=0, quorum_size=a.learners, outlier_factor=a.outlier_factor
    )
    with gm.Session(
        model,
        algorithm=cfg,
        mailbox=FileMailbox(a.mailbox, fsync=False),
        learner_id=a.learner_id,
        poll_interval=0.05,
        lease_timeout=3.0,
        round_timeout=5.0,
        callbacks=[record, gm.log_events],
        seed=sum(map(ord, a.learner_id)),
        secret_file=a.secret_file,
        identity=a.identity,
    ) as session:
        if a.ignore_revocation:  # a member that keeps writing after its key was revoked
            session.auth.refresh = lambda: None  # type: ignore[union-attr]  # never reads the log again
        session.wait_for(a.learners, timeout=60)
        for step in range(a.steps):
            train_step(model, a.learner_id, step)
            session.step(samples=BATCH)
    np.savez(a.out + ".npz", **model)
    events.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
