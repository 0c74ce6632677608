"""Two nodes over moto's HTTP server with 5 MiB parts and ~17 MB payloads: every contribution and
every commit payload goes up as a multipart upload and comes back in several ranged GETs, and the
nodes end with bit-identical parameters (the engine end to end, not just the mailbox)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

import gradientmail_core as gm
from gradientmail_core.adapters import adapter_for
from gradientmail_core.mailbox.retry import RetryPolicy
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.host import join_run
from gradientmail_core.syncer.options import NodeOptions

pytest.importorskip("boto3")

PART = 5 << 20
ROWS, COLS = 2075, 2048  # 4.25M fp32 values: a 17 MB delta, 4 parts of 5 MiB


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": (0.02 * rng.standard_normal((ROWS, COLS))).astype(np.float32)}


def watch(mailbox: Any, seen: list[tuple[str, dict[str, str]]]) -> None:
    for op in ("CreateMultipartUpload", "UploadPart", "PutObject", "GetObject"):
        mailbox.client.meta.events.register(
            f"before-send.s3.{op}",
            lambda request, op=op, **_: seen.append(
                (op, {k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()})
            ),
        )


def test_two_nodes_move_17mb_payloads_in_5mib_parts_and_end_identical(s3_server: str, s3_bucket: str) -> None:
    cfg = gm.DiLoCo(sync_every=2, fragments=1, quorum_size=2)
    clock = gm.FakeClock()
    seen: list[tuple[str, dict[str, str]]] = []
    members = []
    for i, name in enumerate(("a", "b")):
        mailbox = gm.S3Mailbox(
            s3_bucket,
            "run",
            endpoint_url=s3_server,
            part_size=PART,
            max_concurrency=4,
            retry=RetryPolicy(attempts=3, base_delay=0.01),
        )
        watch(mailbox, seen)
        params = model()
        node, learner = join_run(
            RunStore(mailbox),
            adapter_for(params),
            cfg,
            clock,
            learner=name,
            nonce=f"{i + 1:08x}",
            emit=lambda e: None,
            options=NodeOptions(poll_interval=1.0, lease_timeout=120.0, round_timeout=60.0),
            rng=random.Random(i),
            node_rng=random.Random(i),
        )
        members.append((params, node, learner))
    for _, node, _ in members:
        node.state.list_leases(node.store)
    seen.clear()  # the init upload is the first node's: count only the rounds' traffic
    rng = np.random.default_rng(1)
    for _ in range(4 * cfg.sync_every):
        for params, _, learner in members:
            params["w"] -= (1e-3 * rng.standard_normal((ROWS, COLS))).astype(np.float32)
            learner.step(32)
        for _ in range(3):
            for _, node, learner in members:
                node.tick()
                learner.drain()
        clock.advance(1.0)
    for _ in range(5):
        for _, node, learner in members:
            node.tick()
            learner.drain()
        clock.advance(1.0)

    heads = [node.state.head for _, node, _ in members]
    assert min(heads) >= 2, heads  # two rounds committed, each with both contributions
    a, b = members[0][0]["w"], members[1][0]["w"]
    assert a.tobytes() == b.tobytes()
    ops = [op for op, _ in seen]
    # Two contributions per round plus the commit's payloads, each in 4 parts of 5 MiB.
    assert ops.count("CreateMultipartUpload") >= 2 * 2 + 2
    assert ops.count("UploadPart") >= 4 * ops.count("CreateMultipartUpload")
    blob_gets = [h for op, h in seen if op == "GetObject" and "Range" in h and h.get("If-Match")]
    assert len(blob_gets) >= 2 * 3  # every payload read past its first part in pinned ranged GETs
