"""Quantizers: exact where exact is due, RNE ties, error bounds, and torch's bits."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from gradientmail_core.codec import quant  # noqa: E402

F32_MAX = float(np.finfo(np.float32).max)
TINY = 1e-40  # a float32 subnormal


def f32(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


def random_bits(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def weights(n: int, seed: int = 0) -> np.ndarray:
    """Values spread over many binades, both signs."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp(rng.uniform(-12, 6, n))).astype(np.float32)


def roundtrip(x: np.ndarray, dtype: str) -> np.ndarray:
    return quant.dequantize(quant.quantize(x, dtype))


# ---------------------------------------------------------------------------------------------
# BF16


def test_bf16_ties_round_to_even() -> None:
    # 1 + 2**-8 is halfway between 1 (even mantissa) and 1 + 2**-7 (odd): goes down.
    # 1 + 3 * 2**-8 is halfway between 1 + 2**-7 (odd) and 1 + 2**-6 (even): goes up.
    bits = quant.to_bf16_bits(f32(1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20))
    assert bits.tolist() == [0x3F80, 0x3F82, 0xBF80, 0x3F81]


def test_bf16_matches_torch_bit_for_bit() -> None:
    torch = pytest.importorskip("torch")
    x = random_bits(200_000)
    x = np.concatenate([x[np.isfinite(x)], f32(F32_MAX, -F32_MAX, 0.0, -0.0, TINY)])
    ours = quant.to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)


def test_bf16_nan_is_canonical_and_overflow_is_inf() -> None:
    nans = np.array([0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0x7FFFFFFF], np.uint32).view(np.float32)
    assert quant.to_bf16_bits(nans).tolist() == [0x7FC0] * 4
    assert quant.to_bf16_bits(f32(np.inf, -np.inf, F32_MAX)).tolist() == [0x7F80, 0xFF80, 0x7F80]


def test_bf16_is_exact_for_representable_values() -> None:
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    x = quant.from_bf16_bits(bits)
    finite = np.isfinite(x)
    np.testing.assert_array_equal(quant.to_bf16_bits(x[finite]), bits[finite])


def test_bf16_relative_error_is_at_most_2_pow_minus_8() -> None:
    x = weights(100_000)
    err = np.abs(roundtrip(x, "BF16") - x)
    assert np.all(err <= np.abs(x) * 2.0**-8)


# ---------------------------------------------------------------------------------------------
# F16


def test_f16_ties_round_to_even_and_subnormals_are_kept() -> None:
    x = f32(1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 2**-24, 65504, 65520, 1e6)
    h = quant.to_f16(x).view(np.uint16).tolist()
    assert h == [0x3C00, 0x3C02, 0x0000, 0x0002, 0x0001, 0x7BFF, 0x7C00, 0x7C00]


def test_f16_matches_torch_bit_for_bit() -> None:
    torch = pytest.importorskip("torch")
    x = np.concatenate([weights(100_000), random_bits(100_000)])
    x = x[np.isfinite(x)]
    theirs = torch.from_numpy(x).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(quant.to_f16(x).view(np.uint16), theirs)


def test_f16_relative_error_in_normal_range_is_at_most_2_pow_minus_11() -> None:
    x = weights(100_000)
    x = x[(np.abs(x) >= 2.0**-14) & (np.abs(x) <= 65504)]
    err = np.abs(roundtrip(x, "F16") - x)
    assert np.all(err <= np.abs(x) * 2.0**-11)


# ---------------------------------------------------------------------------------------------
# F8 E4M3


def test_e4m3_value_table_is_the_fn_format() -> None:
    v = quant.E4M3_VALUES
    assert v.size == 127 and v[0] == 0 and v[1] == 2.0**-9 and v[8] == 2.0**-6 and v[0x38] == 1 and v[126] == 448
    assert np.all(np.diff(v) > 0)


def test_e4m3_codes_match_torch_including_every_midpoint() -> None:
    torch = pytest.importorskip("torch")
    g = quant.E4M3_VALUES.astype(np.float64)
    mids = ((g[1:] + g[:-1]) / 2).astype(np.float32)  # exact in float32: ties
    x = weights(100_000)
    x = np.concatenate([x[np.abs(x) <= 448], mids, -mids, g.astype(np.float32), np.nextafter(mids, np.float32(0))])
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    codes, _ = quant.quantize_e4m3(x, scale_byte=127)  # scale 2**0: the codes of x itself
    np.testing.assert_array_equal(codes, theirs)


def test_e4m3_ties_round_to_even() -> None:
    # between 1 (0x38, even) and 1.125 (0x39): down; between 1.125 and 1.25 (0x3A): up;
    # subnormal: 2**-10 between 0 and 2**-9 (code 1): down; 3 * 2**-10: up to code 2.
    codes, _ = quant.quantize_e4m3(f32(1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -1.0625, 464.0, 1e9), scale_byte=127)
    assert codes.tolist() == [0x38, 0x3A, 0x00, 0x02, 0xB8, 0x7E, 0x7E]


def test_e4m3_scale_is_the_smallest_power_of_two_that_fits() -> None:
    for amax, byte in [(448.0, 127), (449.0, 128), (1.0, 119), (224.0, 126), (224.5, 127), (F32_MAX, 247)]:
        _, scale = quant.quantize_e4m3(f32(amax / 3, -amax))
        assert scale == byte, amax
        assert amax <= 448 * 2.0 ** (scale - 127) and (scale == 0 or amax > 448 * 2.0 ** (scale - 128))


@pytest.mark.parametrize("k", [-127, -60, -9, 0, 5, 60, 119])
def test_e4m3_grid_values_times_a_power_of_two_are_exact(k: int) -> None:
    g = np.concatenate([quant.E4M3_VALUES, -quant.E4M3_VALUES]).astype(np.float64) * 2.0**k
    x = g.astype(np.float32)
    assert np.all(x.astype(np.float64) == g)  # representable in float32 at this k
    q = quant.quantize(x, "F8_E4M3")
    assert q.scale is not None and q.scale.tolist() == [127 + k]
    np.testing.assert_array_equal(quant.dequantize(q), x)


def test_e4m3_error_is_bounded_relative_to_the_value_and_the_scale() -> None:
    for seed in range(3):
        x = weights(50_000, seed)
        q = quant.quantize(x, "F8_E4M3")
        assert q.scale is not None
        scale = 2.0 ** (int(q.scale[0]) - 127)
        err = np.abs(quant.dequantize(q).astype(np.float64) - x)
        # half a step: 2**-4 relative in the normal range, 2**-10 * scale below it
        assert np.all(err <= 2.0**-4 * np.abs(x) + 2.0**-10 * scale)
        assert np.max(err) <= np.max(np.abs(x)) / 14


def test_e4m3_non_finite_values_become_nan_and_the_rest_keep_their_scale() -> None:
    x = f32(1.0, np.nan, np.inf, -np.inf, 3.0)
    out = roundtrip(x, "F8_E4M3")
    assert np.isnan(out[1:4]).all()
    np.testing.assert_array_equal(out[[0, 4]], [1.0, 3.0])


# ---------------------------------------------------------------------------------------------
# F4 E2M1


def test_e2m1_ties_round_to_even() -> None:
    mids = f32(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = np.zeros(32, np.float32)
    x[:15] = np.concatenate([mids, -mids, [6.0]])  # amax 6: the block's scale is 2**0
    packed, scale = quant.quantize_f4(x)
    assert scale.tolist() == [127]
    values = quant.dequantize_f4(packed, scale, (32,))
    np.testing.assert_array_equal(values[:14], expect + [-v for v in expect])


def test_f4_packs_two_codes_per_byte_low_nibble_first() -> None:
    x = np.zeros(32, np.float32)
    x[:4] = [0.5, 1.0, -6.0, 3.0]  # codes 1, 2, 0xF, 5; amax 6 so the scale is 1
    packed, scale = quant.quantize_f4(x)
    assert scale.tolist() == [127]
    assert packed.size == 16 and packed[:2].tolist() == [0x21, 0x5F] and not packed[2:].any()


def test_f4_scale_per_block_is_the_smallest_power_of_two_that_fits() -> None:
    rng = np.random.default_rng(3)
    x = weights(32 * 200) * np.repeat(np.exp(rng.uniform(-30, 30, 200)), 32).astype(np.float32)
    x[:32] = 0  # an all-zero block has scale 127
    _, scale = quant.quantize_f4(x)
    assert scale[0] == 127
    for b in range(1, 200):
        amax = float(np.max(np.abs(x[32 * b : 32 * b + 32])))
        m, e = math.frexp(amax / 6)  # exact: amax / 6 in float64 is correctly rounded, frexp exact
        k = e - 1 if m == 0.5 else e
        assert scale[b] == max(k, -127) + 127, b


@pytest.mark.parametrize("k", [-127, -40, 0, 3, 40, 125])
def test_f4_grid_values_times_a_power_of_two_are_exact(k: int) -> None:
    rng = np.random.default_rng(k + 200)
    grid = np.concatenate([quant.E2M1_VALUES, -quant.E2M1_VALUES])
    x = (rng.choice(grid, size=(5, 32)) * np.float32(2.0**k)).astype(np.float32)
    x[:, 0] = np.float32(6 * 2.0**k)  # each block's amax is 6 * 2**k, so its scale is 2**k
    q = quant.quantize(x, "F4")
    assert q.scale is not None and set(q.scale.tolist()) == {127 + k}
    np.testing.assert_array_equal(quant.dequantize(q), x)


def test_f4_error_is_bounded_by_each_blocks_scale() -> None:
    x = weights(32 * 500 + 7)  # not a multiple of 32
    q = quant.quantize(x, "F4")
    assert q.scale is not None and q.scale.size == 501 and q.data.size == 501 * 16
    out = quant.dequantize(q)
    padded = np.concatenate([np.abs(out - x), np.zeros(32 - 7, np.float32)]).reshape(-1, 32)
    block_scale = 2.0 ** (q.scale.astype(np.float64) - 127)
    amax = np.concatenate([np.abs(x), np.zeros(25, np.float32)]).reshape(-1, 32).max(axis=1)
    assert np.all(padded.max(axis=1) <= block_scale)  # half the widest step (4 -> 6)
    assert np.all(block_scale <= np.maximum(amax / 3, 2.0**-127))


def test_f4_a_non_finite_value_makes_only_its_block_nan() -> None:
    x = np.ones(96, np.float32)
    x[40] = np.inf
    x[70] = np.nan
    q = quant.quantize(x, "F4")
    assert q.scale is not None and q.scale.tolist() == [125, 255, 255]  # 1 <= 6 * 2**-2
    out = quant.dequantize(q)
    np.testing.assert_array_equal(out[:32], 1.0)
    assert np.isnan(out[32:]).all()


# ---------------------------------------------------------------------------------------------
# Every dtype


DTYPES = quant.DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (33,), (7, 5), (2, 3, 31)])
def test_every_dtype_keeps_shape_including_0d_and_empty(dtype: str, shape: tuple[int, ...]) -> None:
    x = np.full(shape, 1.5, np.float32)
    out = roundtrip(x, dtype)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == shape
    np.testing.assert_array_equal(out, x)  # 1.5 is on every grid
    assert out.flags.writeable


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_stay_zero(dtype: str) -> None:
    np.testing.assert_array_equal(roundtrip(np.zeros((4, 40), np.float32), dtype), 0)


@pytest.mark.parametrize("dtype", ["F32", "F8_E4M3", "F4", "I2"])
def test_huge_values_up_to_float32_max_stay_finite(dtype: str) -> None:
    x = f32(F32_MAX, -F32_MAX, 3e38, 1e38, 1.0, 0.0)
    out = roundtrip(x, dtype)
    assert np.isfinite(out).all()
    assert np.all(np.abs(out.astype(np.float64) - x) <= F32_MAX / 3)
    assert out[0] > 2.5e38 and out[1] < -2.5e38


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_and_subnormal_values_do_not_break_anything(dtype: str) -> None:
    x = f32(TINY, -TINY, 3e-39, 2.0**-126, 0.0)
    out = roundtrip(x, dtype)
    assert np.isfinite(out).all()
    assert np.all(np.abs(out - x) <= 2.0**-126)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_is_deterministic_and_does_not_modify_its_input(dtype: str) -> None:
    x = weights(10_001)
    before = x.copy()
    a, b = quant.quantize(x, dtype), quant.quantize(x.copy(), dtype)
    np.testing.assert_array_equal(x, before)
    assert a.data.tobytes() == b.data.tobytes()
    assert (a.scale is None) == (b.scale is None)
    if a.scale is not None and b.scale is not None:
        assert a.scale.tobytes() == b.scale.tobytes()


def test_unknown_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown payload dtype"):
        quant.quantize(f32(1.0), "F8_E5M2")


def test_codes_do_not_depend_on_flush_to_zero_mode() -> None:
    """Another library (torch here) may switch the FPU to flush subnormals to zero; the codes
    must not change, since the rounding never produces a subnormal float32."""
    torch = pytest.importorskip("torch")
    x = np.concatenate([weights(20_000), f32(2.0**-126, 3 * 2.0**-10, 0.75, 0.25)])
    expected = {d: quant.quantize(x, d) for d in ("F8_E4M3", "F4", "I2")}
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for d, q in expected.items():
            assert quant.quantize(x, d).data.tobytes() == q.data.tobytes(), d
    finally:
        torch.set_flush_denormal(False)


BOUND = {"F32": 0.0, "F16": 2.0**-11, "BF16": 2.0**-8}


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40),
        elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False),
    ),
    st.sampled_from(DTYPES),
)
def test_round_trip_error_is_within_the_format_bound(x: np.ndarray, dtype: str) -> None:
    q = quant.quantize(x, dtype)
    out = quant.dequantize(q)
    assert out.shape == x.shape
    err = np.abs(out.astype(np.float64) - x)
    ax = np.abs(x.astype(np.float64))
    if dtype in BOUND:
        assert np.all(err <= BOUND[dtype] * ax + 2.0**-25)  # + half the smallest F16 subnormal
    elif dtype == "F8_E4M3":
        assert q.scale is not None
        assert np.all(err <= 2.0**-4 * ax + 2.0**-10 * 2.0 ** (int(q.scale[0]) - 127))
    elif dtype == "F4" and x.size:
        flat = np.concatenate([err.reshape(-1), np.zeros(-x.size % 32)]).reshape(-1, 32)
        amax = np.concatenate([ax.reshape(-1), np.zeros(-x.size % 32)]).reshape(-1, 32).max(axis=1)
        assert np.all(flat.max(axis=1) <= amax / 3)
    again = quant.dequantize(quant.quantize(out, dtype))
    np.testing.assert_array_equal(again, out)  # quantizing a quantized tensor is exact
