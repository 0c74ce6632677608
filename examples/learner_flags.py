"""The flags every learner example takes (``torch_learner.py``, ``jax_learner.py``,
``keras_learner.py``): one run's options, so nodes of any framework start with the same line."""

from __future__ import annotations

import argparse


def parse(description: str | None, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mailbox", required=True, help="file:///path, s3://bucket/prefix or memory://name")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (R2, MinIO, moto)")
    p.add_argument("--learner-id", default=None)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--quorum", type=int, default=1)
    p.add_argument(
        "--overlap-steps",
        type=int,
        default=None,
        help="block once a round published this many steps ago has not committed",
    )
    p.add_argument(
        "--max-contributions", type=int, default=None, help="each round merges at most this many, drawn by hash"
    )
    p.add_argument("--delta-dtype", default=None)
    p.add_argument("--commit-dtype", default=None)
    p.add_argument("--compression", default="off")
    p.add_argument("--poll-interval", type=float, default=0.5)
    p.add_argument("--lease-timeout", type=float, default=30.0)
    p.add_argument("--round-timeout", type=float, default=None)
    p.add_argument(
        "--close-timeout", type=float, default=None, help="how long leaving waits for a round to commit (seconds)"
    )
    p.add_argument("--wait-for", type=int, default=1, help="learners to wait for before training")
    p.add_argument("--seed", type=int, default=0, help="model init seed (the run's creator decides)")
    p.add_argument("--data-seed", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (a slower machine)")
    p.add_argument("--out", default=None, help="write final parameters (.npz) and a .json summary here")
    p.add_argument("--events", default=None, help="append one JSON line per event to this file")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)
