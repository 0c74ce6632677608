"""One learner process of ``bench/goodput.py``: the charlm ``quick`` transformer on the standard
library's text, trained with ``gm.Session`` over ``gm.S3Mailbox`` through this node's fault proxy.

Steps are paced to a fixed period (``--step-ms``): compute, then sleep to the period, as a GPU's
fixed step time would; the factor in ``--control`` (re-read every step; 1 when absent) multiplies the
period, which is how the harness makes this node a straggler. So the pace is the schedule's, not the
CPU contention of a small shared box. ``session.step()`` may block (``in_flight``); that time counts
against the period too.

It writes a JSONL log (``--log``, appended, flushed per line so a SIGKILL loses at most the line
being written): a ``start`` line, one ``step`` line per computed step (``n``: steps this process
computed), every ``gm.events`` event with its fields, each line stamped with ``t`` (``time.time()``).
When ``--stop`` exists it stops training and keeps the session open (the background follows the
tape) until ``--close`` exists, then closes (which leaves the model on the newest commit) and writes
its parameters (``{id}.npz``) and a summary (``{id}.json``) under ``--out``.

The algorithm is what ``README.md`` and ``docs/options.md`` tell a user to write:
``gm.DiLoCo(sync_every=H, fragments=P)`` with every other option at its default (RDA, quorum 1,
``in_flight=min(2, P)``, no ``overlap_steps``, the default alignment, ``gm.Adaptive()``).
``--alignment`` and ``--overlap`` exist to compare, and the harness reports which ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
# bench/requests.py would shadow the ``requests`` package boto3 and moto need: bench/ leaves sys.path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]
sys.path.insert(0, str(_ROOT / "examples"))

import charlm  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import gradientmail_core as gm  # noqa: E402

BATCH = 16
LR = 3e-3


def algorithm(sync_every: int, fragments: int, alignment: str = "default", overlap: int | None = None) -> gm.DiLoCo:
    rules = {"default": None, "overwrite": gm.Overwrite(), "carry": gm.Carry(), "adaptive": gm.Adaptive()}
    return gm.DiLoCo(sync_every=sync_every, fragments=fragments, alignment=rules[alignment], overlap_steps=overlap)


class Log:
    """JSONL, one flushed line per record, from the training and the background thread."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole process
        self._lock = threading.Lock()

    def write(self, ev: str, **data: object) -> None:
        line = json.dumps({"t": time.time(), "ev": ev, **data}, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def event(self, e: gm.events.Event) -> None:
        self.write(type(e).__name__, **{f.name: getattr(e, f.name) for f in fields(e)})


def factor(control: Path | None) -> float:
    if control is None:
        return 1.0
    try:
        return max(float(control.read_text().strip() or 1.0), 0.01)
    except (OSError, ValueError):
        return 1.0


def unpublished(session: gm.Session) -> int | None:
    """Fragment-steps this learner trained and has not handed to a contribution (nor dropped at
    an alignment): read from the learner's counters, for the goodput ledger only."""
    learner = session.learner
    return None if learner is None else int(sum(learner.steps_since))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--learner-id", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--log", required=True, type=Path)
    p.add_argument("--stop", required=True, type=Path)
    p.add_argument("--close", required=True, type=Path)
    p.add_argument("--control", type=Path, default=None)
    p.add_argument("--step-ms", type=float, default=200.0)
    p.add_argument("--sync-every", type=int, default=32)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--alignment", default="default", choices=("default", "overwrite", "carry", "adaptive"))
    p.add_argument("--overlap", type=int, default=None)
    p.add_argument("--lease-timeout", type=float, default=4.0)
    p.add_argument("--poll-interval", type=float, default=0.1)
    p.add_argument("--round-timeout", type=float, default=None)
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    torch.set_num_threads(1)
    log = Log(a.log)
    log.write("start", pid=os.getpid(), learner=a.learner_id, incarnation=a.incarnation)
    text = charlm.stdlib_text(max_chars=1_000_000)
    data = charlm.encode(text["train"])
    size = charlm.SIZES["quick"]
    model = charlm.CharTransformer(size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed * 1_000_003 + sum(map(ord, a.learner_id)) * 1009 + a.incarnation)
    period = a.step_ms / 1000.0

    mailbox = gm.S3Mailbox(a.bucket, a.prefix, endpoint_url=a.endpoint)
    steps = 0
    with gm.Session(
        model,
        algorithm=algorithm(a.sync_every, a.fragments, a.alignment, a.overlap),
        mailbox=mailbox,
        learner_id=a.learner_id,
        poll_interval=a.poll_interval,
        lease_timeout=a.lease_timeout,
        round_timeout=a.round_timeout,
        callbacks=(log.event,),
    ) as session:
        log.write("joined")
        deadline = time.monotonic()
        while not a.stop.exists():
            x, y = charlm.sample_batch(data, batch=BATCH, block=size.block, generator=g)
            loss = model.loss(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            session.step(samples=BATCH)
            steps += 1
            log.write("step", n=steps, loss=round(float(loss), 4))
            deadline = max(deadline + period * factor(a.control), time.monotonic())
            time.sleep(max(deadline - time.monotonic(), 0.0))
        log.write("stopped", n=steps, unpublished=unpublished(session))
        while not a.close.exists():  # no more training; the background keeps following the tape
            time.sleep(0.05)
        log.write("closing", n=steps, unpublished=unpublished(session))
    a.out.mkdir(parents=True, exist_ok=True)
    np.savez(a.out / f"{a.learner_id}.npz", **{n: v.detach().numpy() for n, v in model.named_parameters()})
    summary = {"learner": a.learner_id, "steps": steps, "rounds_seen": session.rounds_seen}
    (a.out / f"{a.learner_id}.json").write_text(json.dumps(summary, sort_keys=True))
    log.write("closed", n=steps, unpublished=unpublished(session))


if __name__ == "__main__":
    main()
