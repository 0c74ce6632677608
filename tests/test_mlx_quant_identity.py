"""Torch and MLX nodes upload byte-identical payloads for the same parameters (SPEC 4.4).

Each case builds the same parameters in torch and in MLX, reads them through each framework's
adapter, forms the delta the way a node does (``anchor - local`` in float32), and encodes it in
every payload dtype. The bytes must be equal to each other and to the pure-numpy encoding.
Half-precision parameters are cast by each framework itself, so these cases also check that
torch and MLX agree on the float32 -> bf16/f16 rounding of a model.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from gradientmail_core.adapters.mlx import MLXAdapter  # noqa: E402
from gradientmail_core.adapters.torch import TorchAdapter  # noqa: E402
from gradientmail_core.codec import quant  # noqa: E402
from gradientmail_core.codec.payload import decode_payload, encode_payload  # noqa: E402

DELTA_DTYPES = ["F32", "F16", "BF16", "F8_E4M3", "F4", "I2"]
PARAM_DTYPES = {
    "F32": (torch.float32, mx.float32),
    "BF16": (torch.bfloat16, mx.bfloat16),
    "F16": (torch.float16, mx.float16),
}
F32 = np.float32


def _edge_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    tiny = np.float32(2.0**-149)  # smallest float32 subnormal
    c: dict[str, np.ndarray] = {
        # random, sizes not multiples of 32, a spread of magnitudes
        "normal": rng.standard_normal((37, 19)).astype(F32),
        "wide": (rng.standard_normal(97) * 10.0 ** rng.integers(-30, 30, 97)).astype(F32),
        "odd_block": rng.standard_normal(33).astype(F32) * F32(1e-3),
        "short_block": rng.standard_normal(31).astype(F32),
        "matrix_7x5": rng.standard_normal((7, 5)).astype(F32),
        "scalar": np.array(0.3, F32),
        "empty": np.zeros((0,), F32),
        # zeros, including a negative zero and all-zero F4 blocks
        "zeros": np.zeros(64, F32),
        "signed_zeros": np.array([0.0, -0.0] * 20, F32),
        # at and past each format's maximum
        "f16_max": np.array([65504.0, -65504.0, 65519.0, 65520.0, 1e5, -1e6, 1.0], F32),
        "bf16_max": np.array([3.3895314e38, 3.39e38, -3.4e38, np.finfo(F32).max, 1.0], F32),
        "e4m3_max": np.array([448.0, -448.0, 447.0, 1.0, 0.5, 2.0**-6], F32),
        "e4m3_past_max": np.array([449.0, 464.0, -480.0, 1.0, 2.0**-9], F32),
        "e2m1_max": np.resize(np.array([6.0, -6.0, 5.9, 0.1], F32), 40),
        "e2m1_past_max": np.resize(np.array([6.5, 7.0, -12.0, 1.0, 0.2], F32), 45),
        # subnormal-sized values: float32 subnormals, f16/e4m3 subnormal ranges
        "f32_subnormal": np.array([tiny, -tiny, 3 * tiny, 1e-40, -1e-39, 1.1754942e-38], F32),
        "f16_subnormal": np.array([6e-8, 5.96e-8, 2.98e-8, 1e-6, -3e-5, 6.1e-5], F32),
        "e4m3_subnormal": np.array([448.0, 2.0**-9, 3 * 2.0**-10, 2.0**-10, 5 * 2.0**-10, -(2.0**-7)], F32),
        "e2m1_subnormal_block": np.resize(np.array([6.0, 0.25, 0.75, -0.5, 1e-3], F32), 32),
        "tiny_block": np.full(40, 1e-39, F32),
        # exact ties for round-to-nearest-even
        "bf16_ties": np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 256 + 1, 256 + 3], F32),
        "f16_ties": np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 2048 + 1, 2048 + 3, -(1 + 2.0**-11)], F32),
        "e4m3_ties": np.array([448.0, 1 + 2.0**-4, 1 + 3 * 2.0**-4, 17.0, 19.0, -(2.0**-9 + 2.0**-10)], F32),
        "e2m1_ties": np.resize(np.array([6.0, 2.5, 3.5, 5.0, 0.25, 0.75, 1.25, 1.75, -2.5, -5.0], F32), 35),
    }
    return c


CASES = _edge_cases()


class _TorchParams(torch.nn.Module):
    def __init__(self, values: dict[str, np.ndarray], dtype) -> None:
        super().__init__()
        for name, v in values.items():
            self.register_parameter(name, torch.nn.Parameter(torch.from_numpy(v.copy()).to(dtype)))


class _MLXParams(nn.Module):
    def __init__(self, values: dict[str, np.ndarray], dtype) -> None:
        super().__init__()
        for name, v in values.items():
            self[name] = mx.array(v).astype(dtype)


def _deltas(adapter, anchor: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    local = adapter.read(list(anchor))
    return {n: np.subtract(anchor[n], local[n], dtype=np.float32) for n in local}


def _payloads(
    values: dict[str, np.ndarray], param_dtype: str, delta_dtype: str, *, via: str = "params"
) -> tuple[bytes, bytes, bytes]:
    """(torch, MLX, numpy) payload bytes of the deltas that carry ``values``.

    ``via="params"``: the parameters are ``-values`` and the anchor is zero, so the adapters'
    reads matter. ``via="anchor"``: the anchor is ``values`` and the parameters zero, so the
    delta is exactly ``values`` (a subtraction from +0 would drop the sign of -0).
    """
    t_dt, m_dt = PARAM_DTYPES[param_dtype]
    zeros = {n: np.zeros_like(v) for n, v in values.items()}
    if via == "params":
        params, anchor = {n: np.asarray(-v, F32) for n, v in values.items()}, zeros  # asarray: -0d is a scalar
    else:
        params, anchor = zeros, values
    t = TorchAdapter(_TorchParams(params, t_dt))
    m = MLXAdapter(_MLXParams(params, m_dt))
    ref = {n: np.subtract(anchor[n], params[n], dtype=np.float32) for n in values}
    return (
        encode_payload(_deltas(t, anchor), delta_dtype, kind="delta"),
        encode_payload(_deltas(m, anchor), delta_dtype, kind="delta"),
        encode_payload(ref, delta_dtype, kind="delta"),
    )


@pytest.mark.parametrize("delta_dtype", DELTA_DTYPES)
@pytest.mark.parametrize("param_dtype", list(PARAM_DTYPES))
def test_torch_and_mlx_encode_identical_delta_bytes(param_dtype, delta_dtype):
    finite = {n: v for n, v in CASES.items() if param_dtype == "F32" or np.all(np.abs(v) < 6e4)}
    t_bytes, m_bytes, ref = _payloads(finite, param_dtype, delta_dtype)
    assert t_bytes == m_bytes
    if param_dtype == "F32":  # and both equal the framework-free encoding of the same values
        assert m_bytes == ref
    # sanity: the case really exercised the quantizer (decodes, right shapes)
    decoded = decode_payload(m_bytes, {n: v.shape for n, v in finite.items()}, kind="delta")
    assert decoded.keys() == finite.keys()


@pytest.mark.parametrize("delta_dtype", DELTA_DTYPES)
def test_each_edge_case_alone_gives_identical_bytes(delta_dtype):
    # One tensor per payload, so a per-tensor F8 scale is set by that case's own maximum.
    for name, v in CASES.items():
        for via in ("params", "anchor"):
            t_bytes, m_bytes, ref = _payloads({"x": v}, "F32", delta_dtype, via=via)
            assert t_bytes == m_bytes == ref, (name, via)
        assert ref == encode_payload({"x": v}, delta_dtype, kind="delta"), name


def test_non_finite_deltas_encode_identically():
    v = np.array([np.inf, -np.inf, np.nan, 1.0, -2.0] * 8, F32)
    for delta_dtype in DELTA_DTYPES:
        for via in ("params", "anchor"):
            t_bytes, m_bytes, ref = _payloads({"x": v}, "F32", delta_dtype, via=via)
            assert t_bytes == m_bytes == ref, (delta_dtype, via)


@pytest.mark.parametrize("param_dtype", list(PARAM_DTYPES))
def test_writes_round_half_precision_parameters_like_torch(param_dtype):
    # A commit (or a mixing blend) that is not representable in the parameter dtype is rounded
    # identically by both adapters, so torch and MLX nodes hold the same bits after aligning.
    t_dt, m_dt = PARAM_DTYPES[param_dtype]
    # 0-d parameters are left out: TorchAdapter.write turns them into shape (1,) through
    # np.ascontiguousarray and copy_ refuses (reported; MLX's are covered in test_mlx_adapter).
    cases = {n: v for n, v in CASES.items() if v.ndim}
    shapes = {n: v.shape for n, v in cases.items()}
    t_model = _TorchParams({n: np.zeros(s, F32) for n, s in shapes.items()}, t_dt)
    m_model = _MLXParams({n: np.zeros(s, F32) for n, s in shapes.items()}, m_dt)
    TorchAdapter(t_model).write(cases)
    MLXAdapter(m_model).write(cases)
    for n in cases:
        t_p, m_p = getattr(t_model, n).detach(), m_model[n]
        if param_dtype == "F32":
            t_bits, m_bits = t_p.numpy().view(np.uint32), np.array(m_p).view(np.uint32)
        else:
            t_bits = t_p.view(torch.int16).numpy().view(np.uint16)
            m_bits = np.array(m_p.view(mx.uint16))
        assert np.array_equal(t_bits, m_bits), n


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=1, max_dims=2, max_side=70),
        elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
    ),
    delta_dtype=st.sampled_from(DELTA_DTYPES),
)
def test_random_arrays_encode_identically(values, delta_dtype):
    t_bytes, m_bytes, ref = _payloads({"x": values}, "F32", delta_dtype)
    assert t_bytes == m_bytes == ref


def test_quantizer_cases_cover_each_formats_edges():
    # Guards the cases above: they must hit saturation, ties and subnormals, or they test little.
    assert quant.to_f16(CASES["f16_max"])[3] == np.inf
    assert quant.to_bf16_bits(CASES["bf16_ties"][:1])[0] == quant.to_bf16_bits(np.array([1.0], F32))[0]
    codes, scale = quant.quantize_e4m3(CASES["e4m3_subnormal"])
    assert scale == 127 and codes[1] == 1 and codes[2] == 2  # 2**-9 and the tie 1.5 * 2**-9 -> 2 * 2**-9
    _, k = quant.quantize_e4m3(CASES["e4m3_past_max"])
    assert k == 128
