"""Helpers for the integration tests that run nodes as real processes: start them, wait for
them, and read back what they and the mailbox hold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import gradientmail_core as gm
from gradientmail_core.protocol import keys

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# Set in this process by in-process Lightning tests (Trainer construction exports them); a node
# inheriting them would take another node's MASTER_PORT or rank.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")  # fmt: skip


def run_nodes(commands: list[list[str]], *, logs: Path, timeout: float = 150) -> None:
    """Run ``commands`` (argv lists; a leading "python" means this interpreter) at once and
    wait for all; on a failure or timeout kill them all and fail with their output."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    procs = []
    for i, cmd in enumerate(commands):
        argv = [sys.executable if cmd[0] == "python" else cmd[0], *cmd[1:]]
        out = open(logs / f"node-{i}.log", "wb")  # noqa: SIM115 - closed below
        # A session per node, so a node's children (Lightning's rank 1, torchrun's workers)
        # can be killed with it.
        p = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((p, out))
    failed: list[tuple[int, object]] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p, _ in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                failed = [(i, "timeout") for i, c in enumerate(codes) if c is None]
                break
            time.sleep(0.1)
    finally:
        for p, out in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            out.close()
    if failed:
        report = "\n".join(
            f"--- node {i} ({rc}):\n{(logs / f'node-{i}.log').read_text(errors='replace')[-6000:]}" for i, rc in failed
        )
        raise AssertionError(f"node processes failed:\n{report}")


def result(out: Path, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"result-rank{rank}.json").read_text())


def params(out: Path, rank: int = 0) -> dict[str, np.ndarray]:
    with np.load(out / f"params-rank{rank}.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def round_records(mailbox_dir: Path) -> dict[int, dict[str, Any]]:
    """Every round record on the tape, by round."""
    mb = gm.FileMailbox(mailbox_dir)
    out = {}
    for k in mb.list(keys.ROUNDS):
        r = keys.parse_round_key(k)
        if r is not None:
            data = mb.get(k)
            assert data is not None
            out[r] = json.loads(data)
    return out


def participants(record: dict[str, Any]) -> set[str]:
    return {p["learner"] for p in record["participants"]}


def newest_params(model: Any, mailbox_dir: Path) -> dict[str, np.ndarray]:
    """``gm.align`` into a fresh model: the newest committed parameters, by name."""
    assert gm.align(model, mailbox=gm.FileMailbox(mailbox_dir)) >= 0
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def assert_same_params(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].tobytes() == b[n].tobytes(), f"{n} differs"
