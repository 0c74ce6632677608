"""Start learner processes (examples/torch_learner.py) and read what they leave behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LEARNER = ROOT / "examples" / "torch_learner.py"

# Short timeouts keep takeovers quick; leaving waits up to 60 s for the last rounds (the default,
# lease + 2 rounds = 6 s here, can run out on a loaded machine and leave a learner a commit behind),
# as the sharded and role harnesses do.
FAST = ["--poll-interval", "0.05", "--lease-timeout", "3", "--round-timeout", "1.5", "--close-timeout", "60"]


class Node:
    def __init__(self, out_dir: Path, learner: str, mailbox: str, *args: str, endpoint: str | None = None):
        self.learner, self.out = learner, out_dir / f"out-{learner}"
        self.events_path = out_dir / f"events-{learner}.jsonl"
        cmd = [
            sys.executable,
            str(LEARNER),
            "--mailbox",
            mailbox,
            "--learner-id",
            learner,
            "--out",
            str(self.out),
            "--events",
            str(self.events_path),
            *FAST,
            *args,
        ]
        if endpoint:
            cmd += ["--endpoint-url", endpoint]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.log = open(out_dir / f"log-{learner}.txt", "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.close()

    def kill(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.events_path.exists():
            return []
        rows = [json.loads(line) for line in self.events_path.read_text().splitlines() if line.strip()]
        return [r for r in rows if kind is None or r["event"] == kind]

    def params(self) -> dict[str, np.ndarray]:
        with np.load(str(self.out) + ".npz", allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    def summary(self) -> dict:
        return json.loads(Path(str(self.out) + ".json").read_text())


def wait_until(predicate, timeout: float = 120, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def same_params(nodes: list[Node]) -> str | None:
    """None when every node left with the same parameters; otherwise what differs and, per node,
    the newest commit it aligned with per fragment and any round it gave up on or skipped (the
    message a failed run needs to be told from a slow one)."""
    params = [n.params() for n in nodes]
    if identical(*params):
        return None
    differ = sorted(k for k in params[0] if any(not np.array_equal(p[k], params[0][k]) for p in params[1:]))
    lines = [f"parameters differ in {differ}"]
    for n in nodes:
        newest: dict[int, tuple[int, int]] = {}
        for e in n.events("Aligned"):
            newest[e["fragment"]] = max(newest.get(e["fragment"], (-1, -1)), (e["version"], e["round"]))
        odd = [e for e in n.events() if e["event"] in ("GaveUp", "Skipped", "StoreFailure", "Left")]
        lines.append(f"{n.learner}: newest (version, round) per fragment {dict(sorted(newest.items()))}; {odd}")
    return "\n".join(lines)


def identical(*params: dict[str, np.ndarray]) -> bool:
    first = params[0]
    return all(p.keys() == first.keys() and all(np.array_equal(p[k], first[k]) for k in first) for p in params[1:])
