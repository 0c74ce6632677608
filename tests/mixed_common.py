"""What the node processes of tests/test_mlx_runs.py share: the run's config, the data, the CLI.

numpy and gradientmail_core only, so the MLX node stays free of torch. Every node trains the
same 2-layer MLP (parameter names ``layers.0.weight``, ``layers.0.bias``, ``layers.2.weight``,
``layers.2.bias``) on a synthetic regression drawn from one seed; each learner walks the data in
its own order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Iterator

import numpy as np

import gradientmail_core as gm

DIMS = (8, 16, 1)
LR = 0.05
BATCH = 16
# Standard DiLoCo's barrier (overlap_steps=0) with a quorum of both nodes: every round waits
# for both contributions, so the test can require both in every round. P=2, H=8: a round every
# 4 steps.
ALGORITHM = gm.DiLoCo(sync_every=8, fragments=2, in_flight=1, overlap_steps=0, quorum_size=2, merge=gm.WeightedMean())


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mailbox", required=True)
    ap.add_argument("--learner-id", required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", required=True, help="write the final parameters to OUT.npz")
    ap.add_argument("--data-seed", type=int, default=7)
    ap.add_argument("--learners", type=int, default=2, help="wait for this many learners before training")
    ap.add_argument("--chunk-elements", type=int, default=None, help="store fragments in chunks of this many elements")
    ap.add_argument("--delta-dtype", default=None)
    ap.add_argument("--quorum", type=int, default=None, help="the run's quorum (default: ALGORITHM's)")
    ap.add_argument("--verify", type=float, default=0.0, help="Session(verify=): share of commits to recompute")
    ap.add_argument("--forge", default="", help="rounds this node's closer forges (tests/forgery.py), e.g. 3,7")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    return args


def algorithm(args: argparse.Namespace) -> gm.DiLoCo:
    """``ALGORITHM`` with the run's payload layout and delta dtype from the flags."""
    extra: dict = {"delta_dtype": args.delta_dtype}
    if args.quorum is not None:
        extra["quorum_size"] = args.quorum
    if args.chunk_elements is not None:
        extra["chunk_elements"] = args.chunk_elements
    return dataclasses.replace(ALGORITHM, **extra)


# What the verification tests (tests/test_verify_processes.py) read back: every commit this node
# aligned with, verified, refused or found forged, in order.
SEEN: list[dict] = []
_KINDS = (gm.events.Aligned, gm.events.RoundVerified, gm.events.RoundUnverifiable, gm.events.ForgedCommit,
          gm.events.CommitRefused)  # fmt: skip


def session_options(args: argparse.Namespace) -> dict:
    """The Session keywords of the verification flags: ``verify=``, and the events kept in SEEN."""

    def keep(e: gm.events.Event) -> None:
        if isinstance(e, _KINDS):
            SEEN.append({"event": type(e).__name__, "round": e.round, "closer": getattr(e, "closer", None)})

    return {"verify": args.verify, "callbacks": (gm.log_events, keep)}


def opened(args: argparse.Namespace, session: gm.Session) -> None:
    """With ``--forge``: this node's closer forges those rounds from now on."""
    if args.forge:
        from forgery import forge

        rounds = {int(r) for r in args.forge.split(",")}
        assert session.node is not None
        forge(session.node.merger, lambda r: r in rounds)


def dataset(seed: int, n: int = 512) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, DIMS[0])).astype(np.float32)
    w = rng.standard_normal((DIMS[0], 1)).astype(np.float32)
    y = (np.tanh(x @ w) + 0.05 * rng.standard_normal((n, 1))).astype(np.float32)
    return x, y


def batches(x: np.ndarray, y: np.ndarray, learner: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(sum(learner.encode()))
    while True:
        idx = rng.permutation(len(x))
        for i in range(0, len(x) - BATCH + 1, BATCH):
            yield x[idx[i : i + BATCH]], y[idx[i : i + BATCH]]


def finish(args: argparse.Namespace, params: dict[str, np.ndarray], session: gm.Session, losses: list[float]) -> None:
    np.savez(args.out + ".npz", **params)
    print(json.dumps({"learner": args.learner_id, "losses": losses, "rounds_seen": session.rounds_seen, "seen": SEEN}))
