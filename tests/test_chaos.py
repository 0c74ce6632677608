"""Chaos with real processes: four learners (tests/chaos_learner.py) train one run over moto's
S3 HTTP server while random learners are killed (SIGKILL) and restarted with their id, or
paused (SIGSTOP) past their lease and resumed (SIGCONT). Bounded: at most CYCLES cycles in
CHAOS_SECONDS, then every learner runs again, trains a little, stops training, follows the
tape until it is quiet, and closes.

At the end every learner holds bit-identical parameters, equal to the newest committed ones;
the tape is contiguous with versions rising by one per fragment; and the loss fell.
``GM_CHAOS_SEED`` picks the victims and timings (printed on failure).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("boto3")
import boto3  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.adapters.base import NumpyAdapter  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.protocol.records import RoundRecord, decode  # noqa: E402
from gradientmail_core.protocol.store import RunStore  # noqa: E402
from gradientmail_core.protocol.tape import fetch_theta, load_newest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from chaos_learner import SHAPES, loss, target  # noqa: E402

pytestmark = [pytest.mark.timeout(240)]

LEARNERS = ["a", "b", "c", "d"]
CYCLES = 10
CHAOS_SECONDS = 30.0
SCRIPT = Path(__file__).with_name("chaos_learner.py")


class Learner:
    def __init__(self, name: str, tmp: Path, endpoint: str, bucket: str, seed: int) -> None:
        self.name, self.tmp, self.endpoint, self.bucket, self.seed = name, tmp, endpoint, bucket, seed
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.starts += 1
        log = open(self.tmp / f"log-{self.name}.txt", "ab")  # noqa: SIM115 - the child owns it
        cmd = [
            sys.executable,
            str(SCRIPT),
            "--bucket",
            self.bucket,
            "--prefix",
            "runs/chaos",
            "--endpoint",
            self.endpoint,
            "--learner-id",
            self.name,
            "--out",
            str(self.tmp / "out"),
            "--stop-training",
            str(self.tmp / "stop-training"),
            "--close",
            str(self.tmp / "close"),
            "--seed",
            str(self.seed),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def log(self) -> str:
        return (self.tmp / f"log-{self.name}.txt").read_text(errors="replace")[-4000:]


def rounds(mb: gm.Mailbox) -> int:
    return len(mb.list(keys.ROUNDS))


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def test_learners_killed_and_paused_at_random_end_identical_over_s3(tmp_path, s3_server):
    seed = int(os.environ.get("GM_CHAOS_SEED", "0"))
    rng = random.Random(seed)
    bucket = f"chaos-{os.getpid()}-{seed}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    mb = gm.S3Mailbox(bucket, "runs/chaos", endpoint_url=s3_server)
    learners = {n: Learner(n, tmp_path, s3_server, bucket, seed) for n in LEARNERS}
    log: list[str] = []
    try:
        wait_until(lambda: rounds(mb) >= 3, 60, "the first three commits")
        t0 = time.monotonic()
        for cycle in range(CYCLES):
            if time.monotonic() - t0 > CHAOS_SECONDS:
                break
            victim = learners[rng.choice(LEARNERS)]
            before = rounds(mb)
            if rng.random() < 0.5:
                victim.signal(signal.SIGKILL)
                assert victim.proc is not None
                victim.proc.wait()
                time.sleep(rng.uniform(0.1, 1.5))
                victim.start()
                log.append(f"cycle {cycle}: killed and restarted {victim.name} at round {before}")
            else:
                pause = rng.uniform(0.5, 4.0)  # often past the 2 s lease
                victim.signal(signal.SIGSTOP)
                time.sleep(pause)
                victim.signal(signal.SIGCONT)
                log.append(f"cycle {cycle}: paused {victim.name} for {pause:.1f} s at round {before}")
            time.sleep(rng.uniform(0.3, 1.5))
        # Quiet: everyone runs again; the run must keep committing.
        head = rounds(mb)
        wait_until(lambda: rounds(mb) >= head + 4, 60, f"4 more commits after the chaos (head {head})")
        (tmp_path / "stop-training").touch()
        stable_since, last = time.monotonic(), rounds(mb)
        while time.monotonic() - stable_since < 2.0:  # the tape is quiet for 2 s: all rounds in flight landed
            time.sleep(0.1)
            if rounds(mb) != last:
                stable_since, last = time.monotonic(), rounds(mb)
        time.sleep(0.5)  # every learner's background polls (every 0.05 s) has seen the last commit
        (tmp_path / "close").touch()
        for lr in learners.values():
            assert lr.proc is not None
            assert lr.proc.wait(timeout=60) == 0, f"{lr.name} failed:\n{lr.log()}"
    except BaseException:
        for lr in learners.values():
            if lr.proc is not None and lr.proc.poll() is None:
                lr.proc.send_signal(signal.SIGCONT)
                lr.proc.kill()
        print(f"GM_CHAOS_SEED={seed}", *log, sep="\n")
        raise

    # The tape: contiguous, versions rising by one per fragment.
    recs = [decode(mb.get(k), RoundRecord, key=k) for k in mb.list(keys.ROUNDS)]
    assert [r.round for r in recs] == list(range(len(recs))), "the tape has a gap"
    P = 2
    assert all(r.fragment == r.round % P and r.version == r.round // P + 1 for r in recs)

    # Every learner ends with the newest committed parameters, bit for bit.
    probe = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    run, head, newest = load_newest(RunStore(mb), NumpyAdapter(probe).schema())
    assert head == len(recs) - 1
    committed = {n: v for theta in newest.values() for n, v in theta.items()}
    for name in LEARNERS:
        with np.load(tmp_path / "out" / f"{name}.npz", allow_pickle=False) as z:
            params = {k: z[k] for k in z.files}
        for n in SHAPES:
            assert np.array_equal(params[n], committed[n]), f"{name} ends with {n} different from the newest commit"

    # The loss fell, from the run's initial parameters to the newest committed ones.
    init = {n: v for f in range(run.P) for n, v in (fetch_theta(RunStore(mb), run, f, None) or {}).items()}
    assert loss(committed, target()) < 0.5 * loss(init, target()), log
    summaries = [json.loads((tmp_path / "out" / f"{n}.json").read_text()) for n in LEARNERS]
    assert all(s["final_loss"] == summaries[0]["final_loss"] for s in summaries)
    print(f"GM_CHAOS_SEED={seed}: {len(recs)} rounds", *log, sep="\n")
