"""The outer step, pinned by a golden JSON fixture.

Regenerate the fixture (only if the formula in SPEC 4.3 changes) with
``python tests/test_outer.py``: it writes float64 reference values of the formula.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from gradientmail_core.aggregators.outer import final_step, outer_step

GOLDEN = Path(__file__).parent / "golden" / "outer_nesterov.json"


def _inputs() -> dict[str, Any]:
    # Small hand-chosen vectors; a 2x2 tensor checks that shapes survive.
    return {
        "lr": 0.7,
        "beta": 0.9,
        "theta0": {"w": [[0.5, -1.25], [2.0, 0.0]], "b": [0.1, -0.3, 1.5]},
        "deltas": [
            {"w": [[0.01, -0.02], [0.5, 0.0]], "b": [0.2, 0.0, -0.1]},
            {"w": [[0.03, 0.02], [-0.25, 0.125]], "b": [0.1, -0.4, 0.0]},
            {"w": [[-0.05, 0.0], [0.3, -0.2]], "b": [0.0, 0.05, 0.7]},
            {"w": [[0.0, 0.0], [0.0, 0.0]], "b": [0.0, 0.0, 0.0]},
        ],
    }


def _reference_float64(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The SPEC 4.3 formula in float64 on the float32-rounded inputs."""

    def as64(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=np.float32).astype(np.float64)

    lr, beta = spec["lr"], spec["beta"]
    theta = {k: as64(v) for k, v in spec["theta0"].items()}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    out = []
    for delta in spec["deltas"]:
        for k in theta:
            d = as64(delta[k])
            m[k] = beta * m[k] + d
            theta[k] = theta[k] - lr * (d + beta * m[k])
        out.append(
            {"theta": {k: v.tolist() for k, v in theta.items()}, "momentum": {k: v.tolist() for k, v in m.items()}}
        )
    return out


def _f32(tensors: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}


def _run(golden: dict[str, Any]) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    theta = _f32(golden["theta0"])
    momentum = {k: np.zeros_like(v) for k, v in theta.items()}
    steps = []
    for delta in golden["deltas"]:
        theta, momentum = outer_step(theta, momentum, _f32(delta), lr=golden["lr"], beta=golden["beta"])
        steps.append((theta, momentum))
    return steps


def test_nesterov_outer_step_matches_the_golden_fixture() -> None:
    golden = json.loads(GOLDEN.read_text())
    steps = _run(golden)
    assert len(steps) == len(golden["expected"]) == 4
    for (theta, momentum), expected in zip(steps, golden["expected"], strict=True):
        for k in theta:
            assert theta[k].dtype == np.float32 and momentum[k].dtype == np.float32
            np.testing.assert_allclose(theta[k], expected["theta"][k], rtol=0, atol=1e-6)
            np.testing.assert_allclose(momentum[k], expected["momentum"][k], rtol=0, atol=1e-6)


def test_nesterov_outer_step_is_byte_identical_across_calls() -> None:
    golden = json.loads(GOLDEN.read_text())
    first, second = _run(golden), _run(golden)
    for (t1, m1), (t2, m2) in zip(first, second, strict=True):
        for k in t1:
            assert t1[k].tobytes() == t2[k].tobytes()
            assert m1[k].tobytes() == m2[k].tobytes()


def test_outer_step_does_not_mutate_its_inputs() -> None:
    theta, momentum, delta = {"w": np.ones(3, np.float32)}, {"w": np.ones(3, np.float32)}, {"w": np.ones(3, np.float32)}
    new_theta, new_momentum = outer_step(theta, momentum, delta, lr=0.7, beta=0.9)
    for t in (theta, momentum, delta):
        np.testing.assert_array_equal(t["w"], np.ones(3, np.float32))
    assert new_theta["w"] is not theta["w"] and new_momentum["w"] is not momentum["w"]


def test_local_sgd_settings_apply_the_delta_as_is() -> None:
    theta = {"w": np.array([1.0, 2.0], np.float32)}
    zeros = {"w": np.zeros(2, np.float32)}
    delta = {"w": np.array([0.25, -0.5], np.float32)}
    new_theta, new_momentum = outer_step(theta, zeros, delta, lr=1.0, beta=0.0)
    np.testing.assert_array_equal(new_theta["w"], np.array([0.75, 2.5], np.float32))
    np.testing.assert_array_equal(new_momentum["w"], delta["w"])


def test_final_step_subtracts_the_delta_without_momentum() -> None:
    theta = {"w": np.array([1.0, 2.0], np.float32)}
    delta = {"w": np.array([0.25, -0.5], np.float32)}
    out = final_step(theta, delta)
    assert out["w"].dtype == np.float32
    np.testing.assert_array_equal(out["w"], np.array([0.75, 2.5], np.float32))
    np.testing.assert_array_equal(theta["w"], np.array([1.0, 2.0], np.float32))


if __name__ == "__main__":
    spec = _inputs()
    spec["expected"] = _reference_float64(spec)
    # One line per input and per expected step: reviewable in a diff, still plain JSON.
    body = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in spec.items() if k != "expected"]
    steps = ",\n".join(f"    {json.dumps(step)}" for step in spec["expected"])
    GOLDEN.write_text("{\n" + ",\n".join([*body, f'  "expected": [\n{steps}\n  ]']) + "\n}\n")


def _pullback_by_hand(d: np.ndarray, master: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """``drop_pullback`` written plainly: each block of 32 from element 0, one at a time."""
    out = d.astype(np.float32).copy()
    for lo in range(0, d.size, 32):
        g = (master[lo : lo + 32] - theta[lo : lo + 32]).astype(np.float32)
        dot = sum(float(a) * float(b) for a, b in zip(out[lo : lo + 32], g, strict=True))
        sq = sum(float(b) * float(b) for b in g)
        c = min(max(dot / sq, -1.0), 0.0) if sq > 0 else 0.0
        out[lo : lo + 32] -= np.float32(c) * g
    return out


def test_drop_pullback_takes_out_what_pulls_back_along_the_gap_per_block() -> None:
    from gradientmail_core.aggregators.outer import drop_pullback

    rng = np.random.default_rng(3)
    n = 70_000 + 13  # spans _CHUNK, ends in a short block
    theta = rng.standard_normal(n).astype(np.float32)
    gap = (0.01 * rng.standard_normal(n)).astype(np.float32)
    gap[:32] = 0  # a block without rounding keeps its delta
    master = theta + gap
    # blocks that pull back (a delta along -gap, more than the whole gap in some), push on, or neither
    along = np.repeat(rng.uniform(-2.0, 1.0, (n + 31) // 32), 32)[:n].astype(np.float32)
    d = (along * -(master - theta) + 1e-3 * rng.standard_normal(n)).astype(np.float32)
    got = d.copy()
    drop_pullback(got, master, theta)
    want = _pullback_by_hand(d, master, theta)
    assert np.allclose(got, want, rtol=0, atol=1e-7)
    assert np.array_equal(got[:32], d[:32])
    g = (master - theta).astype(np.float64)
    for lo in range(32, n - 32, 32):
        after = float(np.dot(got[lo : lo + 32].astype(np.float64), g[lo : lo + 32]))
        before = float(np.dot(d[lo : lo + 32].astype(np.float64), g[lo : lo + 32]))
        # a block pulling back by at most the gap keeps no component along it; one pushing on is untouched
        if before >= 0:
            assert np.array_equal(got[lo : lo + 32], d[lo : lo + 32])
        elif before / float(np.dot(g[lo : lo + 32], g[lo : lo + 32])) >= -1:
            assert abs(after) <= 1e-5 * float(np.linalg.norm(d[lo : lo + 32]) * np.linalg.norm(g[lo : lo + 32]))
    again = d.copy()
    drop_pullback(again, master, theta)
    assert again.tobytes() == got.tobytes()
