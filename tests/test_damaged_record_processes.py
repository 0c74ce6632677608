"""A round record truncated over moto's S3 HTTP server the moment it lands, under three learner
processes (tests/chaos_learner.py): its writer reads it back and writes it again; the run goes on,
the tape is contiguous and every learner ends with the newest commit, bit for bit."""

from __future__ import annotations

import json
import signal
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
from gradientmail_core.protocol.tape import load_newest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from chaos_learner import SHAPES  # noqa: E402
from test_chaos import Learner, rounds, wait_until  # noqa: E402

pytestmark = [pytest.mark.timeout(180)]

NAMES = ["a", "b", "c"]
PREFIX = "runs/chaos"  # (where tests/chaos_learner.py's sessions run, under the test's bucket)


def test_a_record_truncated_as_it_lands_over_s3_is_written_again_and_the_run_goes_on(tmp_path, s3_server):
    bucket = "damaged-record"
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket=bucket)
    mb = gm.S3Mailbox(bucket, PREFIX, endpoint_url=s3_server)
    learners = {n: Learner(n, tmp_path, s3_server, bucket, seed=0) for n in NAMES}
    try:
        wait_until(lambda: rounds(mb) >= 3, 60, "the first three commits")
        target = rounds(mb) + 2
        key = f"{PREFIX}/{keys.round_key(target)}"
        deadline = time.monotonic() + 60
        while True:  # cut it the moment it lands, before the followers' next poll reads it
            try:
                data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
                break
            except s3.exceptions.NoSuchKey:
                assert time.monotonic() < deadline, f"round {target} never committed"
                time.sleep(0.005)
        s3.put_object(Bucket=bucket, Key=key, Body=data[: len(data) // 2])
        wait_until(lambda: rounds(mb) >= target + 6, 60, f"6 more commits after the damaged round {target}")
        (tmp_path / "stop-training").touch()
        stable_since, last = time.monotonic(), rounds(mb)
        while time.monotonic() - stable_since < 2.0:
            time.sleep(0.1)
            if rounds(mb) != last:
                stable_since, last = time.monotonic(), rounds(mb)
        time.sleep(0.5)
        (tmp_path / "close").touch()
        for lr in learners.values():
            assert lr.proc is not None
            assert lr.proc.wait(timeout=60) == 0, f"{lr.name} failed:\n{lr.log()}"
    except BaseException:
        for lr in learners.values():
            if lr.proc is not None and lr.proc.poll() is None:
                lr.proc.send_signal(signal.SIGCONT)
                lr.proc.kill()
        raise

    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == data  # the writer's own bytes again
    recs = [decode(mb.get(k), RoundRecord, key=k) for k in mb.list(keys.ROUNDS)]
    assert [r.round for r in recs] == list(range(len(recs)))
    summaries = [json.loads((tmp_path / "out" / f"{n}.json").read_text()) for n in NAMES]
    repaired = [s["learner"] for s in summaries if s["events"].get("RecordRepaired")]
    assert repaired == [recs[target].closer]
    probe = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    _, head, newest = load_newest(RunStore(mb), NumpyAdapter(probe).schema())
    assert head == len(recs) - 1
    committed = {n: v for theta in newest.values() for n, v in theta.items()}
    for name in NAMES:
        with np.load(tmp_path / "out" / f"{name}.npz", allow_pickle=False) as z:
            for n in SHAPES:
                assert np.array_equal(z[n], committed[n]), f"{name} ends with {n} different from the newest commit"
