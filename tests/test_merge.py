from __future__ import annotations

import math

import numpy as np
import pytest
from closer_reference import merge_with_cosine

from gradientmail_core.aggregators.merge import (
    clip,
    contribution_weight,
    fragment_norm,
    mean_pairwise_cosine,
    memo_norms,
    merge,
    outlier_mask,
    rda,
    sq_norms,
    weighted_mean,
)
from gradientmail_core.config import RDA, WeightedMean


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_contribution_weight_is_tokens_times_tokens_per_step() -> None:
    assert contribution_weight(100, 4) == 2500.0
    assert contribution_weight(0, 4) == 0.0
    # Huge token counts stay finite (Python float), and the merge normalises before float32 math.
    assert math.isfinite(contribution_weight(10**12, 1))


def test_weighted_mean_matches_hand_computation() -> None:
    out = weighted_mean([f32(1, 2), f32(3, 6)], [1.0, 3.0])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, f32(2.5, 5.0))  # (1*1 + 3*3)/4, (1*2 + 3*6)/4


def test_weighted_mean_survives_weights_beyond_float32_range() -> None:
    out = weighted_mean([f32(1, 2), f32(3, 6)], [1e40, 3e40])
    np.testing.assert_allclose(out, f32(2.5, 5.0), rtol=1e-6)


def test_rda_averages_norms_and_directions_separately() -> None:
    # |d1| = 5, |d2| = 2: radius 3.5; units (0.6, 0.8) and (0, 1) average to (0.3, 0.9).
    out = rda([f32(3, 4), f32(0, 2)], [1.0, 1.0])
    expected = 3.5 * np.array([0.3, 0.9]) / math.sqrt(0.3**2 + 0.9**2)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_rda_with_unequal_weights() -> None:
    # Weights 3:1: radius (3*5 + 1*2)/4 = 4.25; direction (3*(0.6, 0.8) + (0, 1))/4 = (0.45, 0.85).
    out = rda([f32(3, 4), f32(0, 2)], [3.0, 1.0])
    expected = 4.25 * np.array([0.45, 0.85]) / math.sqrt(0.45**2 + 0.85**2)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_rda_of_cancelling_directions_is_zero_even_when_the_mean_is_not() -> None:
    deltas = [f32(2, 0), f32(-5, 0)]
    np.testing.assert_array_equal(rda(deltas, [1.0, 1.0]), f32(0, 0))
    np.testing.assert_array_equal(weighted_mean(deltas, [1.0, 1.0]), f32(-1.5, 0))


def test_rda_counts_a_zero_delta_in_the_radius_but_not_the_direction() -> None:
    out = rda([f32(0, 4), f32(0, 0)], [1.0, 1.0])
    np.testing.assert_allclose(out, f32(0, 2))  # radius (4 + 0)/2 along (0, 1)


def test_rda_keeps_the_tensor_shape_and_uses_the_whole_tensor_norm() -> None:
    a = np.array([[3, 0], [0, 4]], dtype=np.float32)
    out = rda([a, a], [1.0, 2.0])
    np.testing.assert_allclose(out, a, rtol=1e-6)


def test_merge_with_rda_uses_the_weighted_mean_for_embeddings() -> None:
    deltas = [
        {"tok_embed.weight": f32(2, 0), "h.0.w": f32(2, 0)},
        {"tok_embed.weight": f32(-5, 0), "h.0.w": f32(-5, 0)},
    ]
    out = merge(deltas, [1.0, 1.0], RDA())
    assert list(out) == ["tok_embed.weight", "h.0.w"]
    np.testing.assert_array_equal(out["tok_embed.weight"], f32(-1.5, 0))
    np.testing.assert_array_equal(out["h.0.w"], f32(0, 0))
    custom = merge(deltas, [1.0, 1.0], RDA(direct_pattern="h.0"))
    np.testing.assert_array_equal(custom["tok_embed.weight"], f32(0, 0))
    np.testing.assert_array_equal(custom["h.0.w"], f32(-1.5, 0))


def test_merge_with_weighted_mean_treats_every_tensor_alike() -> None:
    deltas = [{"embed": f32(2, 0), "w": f32(2, 0)}, {"embed": f32(-5, 0), "w": f32(-5, 0)}]
    out = merge(deltas, [1.0, 1.0], WeightedMean())
    np.testing.assert_array_equal(out["embed"], f32(-1.5, 0))
    np.testing.assert_array_equal(out["w"], f32(-1.5, 0))


def test_merge_is_byte_identical_across_calls() -> None:
    rng = np.random.default_rng(0)
    deltas = [{"w": rng.standard_normal((64, 33)).astype(np.float32)} for _ in range(5)]
    weights = [float(w) for w in rng.uniform(1, 100, 5)]
    a = merge(deltas, weights, RDA())
    b = merge(deltas, weights, RDA())
    assert a["w"].tobytes() == b["w"].tobytes()


def test_merge_refuses_weights_summing_to_zero() -> None:
    with pytest.raises(ValueError, match="sum to zero"):
        merge([{"w": f32(1)}], [0.0], WeightedMean())


def test_clip_norm_scales_each_contribution_to_the_bound_before_merging() -> None:
    big = {"a": f32(6, 0), "b": f32(8)}  # whole-fragment norm 10
    small = {"a": f32(0, 1), "b": f32(0)}
    assert fragment_norm(big) == 10.0
    clipped = clip(big, 5.0)
    np.testing.assert_allclose(clipped["a"], f32(3, 0))
    np.testing.assert_allclose(clipped["b"], f32(4))
    assert clip(small, 5.0)["a"] is small["a"]  # within the bound: untouched
    out = merge([big, small], [1.0, 1.0], WeightedMean(), clip_norm=5.0)
    np.testing.assert_allclose(out["a"], f32(1.5, 0.5))
    np.testing.assert_allclose(out["b"], f32(2))


def test_cosine_of_whole_fragment_deltas() -> None:
    a = {"x": f32(1, 0), "y": f32(0)}
    b = {"x": f32(0, 0), "y": f32(3)}  # orthogonal to a once flattened
    assert mean_pairwise_cosine([a, b]) == 0.0
    assert mean_pairwise_cosine([a, a]) == pytest.approx(1.0)
    minus_a = {"x": f32(-2, 0), "y": f32(0)}
    assert mean_pairwise_cosine([a, minus_a]) == pytest.approx(-1.0)
    # Pairs (a,a)=1, (a,b)=0, (a,b)=0 average to 1/3.
    assert mean_pairwise_cosine([a, a, b]) == pytest.approx(1 / 3)


def test_cosine_needs_two_contributions_and_counts_zero_vectors_as_zero() -> None:
    a = {"x": f32(1, 2)}
    assert mean_pairwise_cosine([a]) is None
    assert mean_pairwise_cosine([]) is None
    assert mean_pairwise_cosine([a, {"x": f32(0, 0)}]) == 0.0


def test_cosine_does_not_depend_on_tensor_insertion_order() -> None:
    rng = np.random.default_rng(1)
    a = {k: rng.standard_normal(50).astype(np.float32) for k in "pqr"}
    b = {k: rng.standard_normal(50).astype(np.float32) for k in "pqr"}
    b_reversed = {k: b[k] for k in reversed(list(b))}
    assert mean_pairwise_cosine([a, b]) == mean_pairwise_cosine([a, b_reversed])


def test_outlier_mask_flags_norms_far_above_the_median_of_the_others() -> None:
    deltas = [{"w": f32(n)} for n in (1.0, 1.2, 0.9, 10.0)]
    assert outlier_mask(deltas, factor=3.0) == [False, False, False, True]
    # Two contributions: only the much larger one is flagged.
    assert outlier_mask([{"w": f32(1)}, {"w": f32(-10)}], factor=3.0) == [False, True]
    assert outlier_mask([{"w": f32(1)}, {"w": f32(2)}], factor=3.0) == [False, False]
    # One contribution has no peers to be compared with.
    assert outlier_mask([{"w": f32(1e9)}], factor=3.0) == [False]


def test_outlier_mask_cannot_be_gamed_by_a_colluding_pair_below_half() -> None:
    deltas = [{"w": f32(n)} for n in (1.0, 1.0, 1.0, 50.0, 50.0)]
    assert outlier_mask(deltas, factor=3.0) == [False, False, False, True, True]


def test_outlier_factor_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="factor"):
        outlier_mask([{"w": f32(1)}], factor=1.0)


# ---- the fused pass: the same bytes as the plain definitions -----------------------------------

# Sizes around the chunking: empty, one element, a partial leaf, several merge steps with a ragged
# tail, and more than one reduction chunk (1M elements) with an odd remainder.
_SIZES = [0, 1, 1000, 3 * 32768 + 5, (1 << 20) + (1 << 18) + 12347]


def _pairwise_sq(a: np.ndarray) -> float:
    """The reference norm: numpy's own pairwise float64 sum of the squares, 1M elements at a time."""
    x = a.reshape(-1).astype(np.float64)
    return sum((float(np.add.reduce(x[s : s + (1 << 20)] ** 2)) for s in range(0, x.size, 1 << 20)), 0.0)


def _reference_rda(deltas: list[np.ndarray], weights: list[float]) -> np.ndarray:
    p = [w / math.fsum(weights) for w in weights]
    radius, direction = 0.0, np.zeros_like(deltas[0])
    for d, p_i in zip(deltas, p):
        n = math.sqrt(_pairwise_sq(d))
        if n > 0.0:
            radius += p_i * n
            direction += np.float32(p_i / n) * d
    n_dir = math.sqrt(_pairwise_sq(direction))
    return np.zeros_like(direction) if n_dir == 0.0 else direction * np.float32(radius / n_dir)


def test_norms_are_numpys_pairwise_float64_sums_bit_for_bit() -> None:
    rng = np.random.default_rng(2)
    for size in _SIZES:
        a = rng.standard_normal(size).astype(np.float32)
        assert sq_norms({"a": a})["a"] == _pairwise_sq(a), size
        assert fragment_norm({"a": a}) == math.sqrt(_pairwise_sq(a))


def test_rda_in_one_pass_gives_the_bytes_of_the_plain_definition() -> None:
    rng = np.random.default_rng(3)
    for size in _SIZES[1:]:
        deltas = [rng.standard_normal(size).astype(np.float32) for _ in range(4)]
        deltas[2][:] = 0  # a zero contribution counts in the radius only
        for d in deltas:  # summed onto zeros, products of -0.0 give +0.0, not -0.0
            d[: size // 2] = -0.0
        weights = [float(w) for w in rng.uniform(1, 100, 4)]
        assert rda(deltas, weights).tobytes() == _reference_rda(deltas, weights).tobytes(), size


def test_merge_with_cosine_matches_the_separate_merge_and_cosine() -> None:
    rng = np.random.default_rng(4)
    shapes = {"embed.w": (300, 64), "big": (_SIZES[-1],), "odd": (129, 257), "one": (1,), "none": (0,)}
    deltas = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(5)]
    deltas[3] = {k: np.zeros_like(v) for k, v in deltas[3].items()}
    weights = [float(w) for w in rng.uniform(1, 100, 5)]
    for cfg, clip_norm in [(RDA(), None), (WeightedMean(), None), (RDA(), 300.0)]:
        merged, cosine = merge_with_cosine(deltas, weights, cfg, clip_norm=clip_norm)
        plain = merge(deltas, weights, cfg, clip_norm=clip_norm)
        assert list(merged) == list(plain) == list(shapes)
        for k in shapes:
            assert merged[k].tobytes() == plain[k].tobytes(), (cfg, clip_norm, k)
        assert cosine == mean_pairwise_cosine(deltas)
    # Against the float64 definition, to rounding.
    flat = [np.concatenate([d[k].reshape(-1) for k in sorted(d)]).astype(np.float64) for d in deltas]
    pairs = [(i, j) for i in range(5) for j in range(i + 1, 5)]
    cosines = [
        0.0
        if not (flat[i].any() and flat[j].any())
        else flat[i] @ flat[j] / np.linalg.norm(flat[i]) / np.linalg.norm(flat[j])
        for i, j in pairs
    ]
    assert cosine == pytest.approx(sum(cosines) / len(pairs), abs=1e-12)


def test_merge_can_hand_each_tensor_over_as_values_and_a_scale() -> None:
    rng = np.random.default_rng(5)
    deltas = [{"embed": rng.standard_normal(70).astype(np.float32), "w": rng.standard_normal(3000).astype(np.float32)}]
    deltas.append({k: -v for k, v in deltas[0].items()})  # the directions cancel: RDA gives zeros
    deltas.append({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in deltas[0].items()})
    for ds in (deltas[:2], deltas[1:]):
        plain = merge(ds, [1.0, 2.0], RDA())
        seen: dict[str, bytes] = {}

        def take(name: str, values: np.ndarray, scale: np.float32 | None, seen: dict = seen) -> None:
            seen[name] = (values * scale if scale is not None else values.copy()).tobytes()

        merged, _ = merge_with_cosine(ds, [1.0, 2.0], RDA(), each=take)
        assert merged == {}
        assert seen == {k: v.tobytes() for k, v in plain.items()}


def test_known_norms_are_used_instead_of_recomputed() -> None:
    d = {"w": f32(3, 4)}
    with memo_norms([(d["w"], 100.0)]):  # a deliberately wrong norm shows it was used
        assert fragment_norm(d) == 10.0
    assert fragment_norm(d) == 5.0
