"""The torch quantizers (``adapters/torch_quant.py``, what a CUDA node runs on its device) write
the bytes of the numpy quantizers, for every dtype and every kind of float32 input.

The tests run on the CPU here, and on CUDA too when a GPU is present: one code path serves both.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

torch = pytest.importorskip("torch")

from gradientmail_core.adapters import torch_quant as tq  # noqa: E402
from gradientmail_core.codec import quant  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
X86 = platform.machine().lower() in ("x86_64", "amd64")


def device_bytes(x: np.ndarray, dtype: str, device: str) -> quant.QTensor:
    q = tq.quantize(torch.from_numpy(x.copy()).to(device), dtype)
    return tq.to_qtensor(q, q.data.cpu(), None if q.scale is None else q.scale.cpu())


def assert_same_bytes(x: np.ndarray, dtype: str, device: str) -> None:
    want, got = quant.quantize(x, dtype), device_bytes(x, dtype, device)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
    if got.data.tobytes() != want.data.tobytes():
        a, b = want.data.reshape(-1).view(np.uint8), got.data.reshape(-1).view(np.uint8)
        i = np.flatnonzero(a != b)[:5]
        raise AssertionError(f"{dtype} on {device}: bytes {i} numpy {a[i]} torch {b[i]}")
    if want.scale is None:
        assert got.scale is None
    else:
        assert got.scale is not None and got.scale.tobytes() == want.scale.tobytes(), (want.scale, got.scale)


def nonfinite_f4_is_platform_free(x: np.ndarray, dtype: str) -> bool:
    # numpy codes the values inside an F4 block holding inf/NaN by the host FPU's NaN rules; the
    # torch quantizer writes x86's (the block decodes to NaN either way). Elsewhere, skip those.
    return X86 or dtype != "F4" or bool(np.isfinite(x).all())


def float32_bits(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    """Any float32 at all (NaN payloads, infinities, subnormals), from raw bits."""
    return hnp.arrays(np.uint32, shape).map(lambda u: u.view(np.float32))


def mixed_floats(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    """Ordinary magnitudes of one scale, spiced with zeros, subnormals, huge and non-finite values."""
    specials = st.sampled_from(
        [float(np.float32(v)) for v in (0.0, -0.0, 1e-45, -3e-39, 1e-40, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan)]
    )
    ordinary = st.floats(-1024, 1024, width=32) | st.floats(-(2.0**-10), 2.0**-10, width=32)
    return hnp.arrays(np.float32, shape, elements=ordinary | specials)


SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), dtype=st.sampled_from(quant.DTYPES))
def test_device_quantizer_writes_the_numpy_bytes(device, data, dtype) -> None:
    shape = data.draw(SHAPES)
    x = data.draw(float32_bits(shape) | mixed_floats(shape))
    if nonfinite_f4_is_platform_free(x, dtype):
        assert_same_bytes(x, dtype, device)


def midpoints(grid: np.ndarray) -> np.ndarray:
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    return np.concatenate([mids, -mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))])


def ties() -> dict[str, np.ndarray]:
    """Inputs exactly halfway between two neighbours of each target grid, and their neighbours."""
    rng = np.random.default_rng(0)
    high = rng.integers(0, 0x7F80, 4000, dtype=np.uint32) << 16  # finite bf16 patterns
    f16 = rng.integers(0x3800, 0x47FF, 4000, dtype=np.uint32) << 13  # f16's normal range
    # The largest grid value sets the scale to 1 (F8: per tensor; F4: per block of 32, so each
    # block of the E2M1 ties carries a 6).
    e2m1 = midpoints(quant.E2M1_VALUES)
    blocks = np.concatenate([np.concatenate([[6.0], e2m1[i : i + 31]]) for i in range(0, e2m1.size, 31)])
    return {
        "bf16": np.concatenate([(high | 0x8000), (high | 0x7FFF), (high | 0x18000)]).view(np.float32),
        "f16": np.concatenate([(f16 | 0x1000), (f16 | 0x3000)]).view(np.float32),
        "e4m3": np.concatenate([[448.0], midpoints(quant.E4M3_VALUES)]).astype(np.float32),
        "e2m1": blocks.astype(np.float32),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", quant.DTYPES)
@pytest.mark.parametrize("grid", ["bf16", "f16", "e4m3", "e2m1"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-100, 2.0**60])
def test_ties_round_to_even_like_numpy(device, dtype, grid, scale) -> None:
    with np.errstate(over="ignore"):
        x = ties()[grid] * np.float32(scale)
    assert_same_bytes(x[np.isfinite(x)], dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", quant.DTYPES)
@pytest.mark.parametrize(
    "x",
    [
        np.zeros(0, np.float32),
        np.zeros((3, 0, 2), np.float32),
        np.array(2.75, np.float32),
        np.array(-np.inf, np.float32),
        np.zeros(70, np.float32),
        np.full(33, -0.0, np.float32),
        np.array([np.nan] * 31 + [1.0, 3e38, -np.inf], np.float32),
        np.array([1e-45, -1e-45, 1.2e-38, 5e-39], np.float32),
    ],
    ids=["empty", "empty-3d", "0-d", "0-d-inf", "zeros", "neg-zeros", "nonfinite-blocks", "subnormal"],
)
def test_edge_shapes_and_values(device, dtype, x) -> None:
    if nonfinite_f4_is_platform_free(x, dtype):
        assert_same_bytes(x, dtype, device)


@pytest.mark.parametrize("dtype", quant.DTYPES)
def test_chunked_conversion_writes_the_same_bytes(monkeypatch, dtype) -> None:
    monkeypatch.setattr(tq, "CHUNK", 64)  # tensors here span many chunks, the last one partial
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(1000) * np.exp2(rng.integers(-20, 20, 1000))).astype(np.float32)
    assert_same_bytes(x.reshape(8, 125), dtype, "cpu")
