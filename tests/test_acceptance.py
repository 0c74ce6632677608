from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradientmail_core.aggregators.acceptance import judge
from gradientmail_core.protocol.records import REJECT_REASONS

GOOD = {"w": np.ones((2, 3), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}


def _judge(**kw: Any) -> str | None:
    args: dict[str, Any] = dict(
        snapshot_steps=5,
        schema_digest_ok=True,
        base_version=3,
        current_version=3,
        payload=GOOD,
        payload_status="ok",
    )
    args.update(kw)
    return judge(**args)


def test_a_sound_snapshot_is_accepted() -> None:
    assert _judge() is None
    assert _judge(expected_shapes={"w": (2, 3), "b": [3]}) is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"snapshot_steps": 0}, "zero_steps"),
        ({"schema_digest_ok": False}, "schema"),
        ({"base_version": 2}, "stale"),
        ({"base_version": 4}, "stale"),
        ({"payload": None, "payload_status": "missing"}, "missing"),
        ({"payload": None, "payload_status": "corrupt"}, "corrupt"),
        ({"expected_shapes": {"w": (3, 2), "b": (3,)}}, "schema"),
        ({"expected_shapes": {"w": (2, 3)}}, "schema"),
        ({"payload": {**GOOD, "b": np.array([0, np.nan, 0], dtype=np.float32)}}, "nonfinite"),
        ({"payload": {**GOOD, "w": np.full((2, 3), -np.inf, dtype=np.float32)}}, "nonfinite"),
    ],
)
def test_each_failure_is_rejected_with_its_reason(change: dict[str, Any], reason: str) -> None:
    assert reason in REJECT_REASONS
    assert _judge(**change) == reason


def test_reasons_are_checked_in_spec_order() -> None:
    bad_payload = {"w": np.array([np.nan], dtype=np.float32)}
    everything_wrong: dict[str, Any] = dict(
        snapshot_steps=0, schema_digest_ok=False, base_version=0, current_version=1,
        payload=bad_payload, payload_status="missing",
    )  # fmt: skip
    order = ["zero_steps", "schema", "stale", "missing", "corrupt", "nonfinite"]
    fixes: list[dict[str, Any]] = [
        {"snapshot_steps": 1},
        {"schema_digest_ok": True},
        {"base_version": 1},
        {"payload_status": "corrupt"},
        {"payload_status": "ok"},
    ]
    for i, expected in enumerate(order):
        assert _judge(**everything_wrong) == expected
        if i < len(fixes):
            everything_wrong.update(fixes[i])
