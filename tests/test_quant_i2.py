"""I2 (``codec/quant_i2.py``): the layout, the grid and its scale search, the zero and NaN
blocks, the same bytes from numpy, torch (host and device pipeline) and MLX, strict payload
reading, and a run whose deltas and commits travel as I2."""

from __future__ import annotations

import importlib.util
import struct

import numpy as np
import pytest
from harness import Cluster

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.codec import payload, quant, safetensors_io
from gradientmail_core.codec.header import header_info
from gradientmail_core.codec.quant_i2 import I2_BLOCK, dequantize_i2, i2_sizes, quantize_i2
from gradientmail_core.errors import PayloadCorrupt
from gradientmail_core.protocol import keys

F32 = np.float32
HAS_TORCH = importlib.util.find_spec("torch") is not None


def roundtrip(x: np.ndarray) -> np.ndarray:
    return quant.dequantize(quant.quantize(x, "I2"))


def dtypes_of(data: bytes, compression: str = "") -> dict[str, str]:
    """The logical dtypes a payload's header declares."""
    return header_info(safetensors_io.read_header(data, max_header_bytes=1 << 20)[0], compression).dtypes


def rel_error(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.linalg.norm(x.astype(np.float64) - y) / np.linalg.norm(x.astype(np.float64)))


def inputs() -> dict[str, np.ndarray]:
    """Odd sizes, every magnitude, specials: what the byte-identity tests feed all quantizers."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 300, dtype=np.uint64).astype(np.uint32).view(F32)
    specials = np.array([0.0, -0.0, 1e-45, -3e-39, 2.0**-126, 3e38, -3.4e38, 2.0, -4.0, 1.5, 6.0], F32)
    return {
        "gauss": rng.standard_normal((37, 19)).astype(F32),
        "heavy": (rng.standard_t(3, 1000) * 1e-5).astype(F32),
        "wide": (rng.standard_normal(97) * 10.0 ** rng.integers(-40, 38, 97)).astype(F32),
        "bits": bits,  # any float32: NaN payloads, infinities, subnormals
        "specials": np.resize(specials, 70),
        "signs": (np.sign(rng.standard_normal(64)) * 0.01).astype(F32),
        "ties": np.array([3.0, 3.0, 3.0, 2.0, -2.0, np.nextafter(F32(2.0), F32(3.0))] * 6, F32),
        "zeros": np.array([0.0, -0.0] * 20, F32),
        "scalar": np.array(0.3, F32),
        "empty": np.zeros((3, 0), F32),
        "one": np.array([2.0], F32),
        "sparse": (rng.standard_normal(333) * (rng.random(333) < 0.1)).astype(F32),
    }


# ---------------------------------------------------------------------------------------------
# Layout


def test_codes_pack_four_a_byte_lowest_bits_first_with_a_scale_per_block() -> None:
    # On the grid at 2**0 (so that scale is exact): codes 3 -> 1, 1 -> 0, -1 -> 2, -3 -> 3.
    x = np.array([3.0, 1.0, -1.0, -3.0, 1.0], F32)
    packed, scale = quantize_i2(x)
    assert packed.tolist() == [1 | 0 << 2 | 2 << 4 | 3 << 6, 0, 0, 0, 0, 0, 0, 0]  # padding codes 0
    assert scale.tolist() == [127]
    np.testing.assert_array_equal(dequantize_i2(packed, scale, (5,)), x)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (1,), (4,), (31,), (32,), (33,), (7, 5), (2, 3, 37)])
def test_sizes_and_shapes_for_odd_sizes(shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(0).standard_normal(shape).astype(F32)
    q = quant.quantize(x, "I2")
    nbytes, nblocks = i2_sizes(x.size)
    assert (nbytes, nblocks) == (-(-x.size // 32) * 8, -(-x.size // 32))
    assert q.data.dtype == np.uint8 and q.data.shape == (nbytes,) and q.scale is not None
    assert q.scale.shape == (nblocks,) and q.storage_dtype == "U8"
    out = quant.dequantize(q)
    assert out.shape == shape and out.dtype == F32 and out.flags.writeable


def test_blocks_are_independent_and_padding_does_not_count() -> None:
    # A last block of one value 2.0 is exact at scale 2 (inner level); were the 31 zeros of its
    # padding counted, a smaller scale would win and 2.0 would come back as 0.75.
    np.testing.assert_array_equal(roundtrip(np.array([2.0], F32)), [2.0])
    x = np.random.default_rng(1).standard_normal(40).astype(F32)
    out = roundtrip(x)
    np.testing.assert_array_equal(out[:32], roundtrip(x[:32]))
    np.testing.assert_array_equal(out[32:], roundtrip(x[32:]))


# ---------------------------------------------------------------------------------------------
# The grid and the scale


def test_gaussian_error_is_near_the_two_bit_optimum() -> None:
    # Lloyd-Max at four levels with the exact sigma: 0.343. Measured here 0.344 (F4: 0.115); a
    # scale fixed from the absmax alone gave 0.349. Seeded, so the figure is reproducible.
    x = np.random.default_rng(0).standard_normal(1 << 16).astype(F32)
    err = rel_error(x, roundtrip(x))
    f4 = rel_error(x, quant.dequantize(quant.quantize(x, "F4")))
    assert 0.33 < err < 0.35 and f4 < 0.12


def test_constant_magnitude_and_heavy_tailed_blocks_get_their_own_scale() -> None:
    rng = np.random.default_rng(3)
    # Signs times one magnitude per block: the search finds the scale whose level is closest.
    signs = (np.sign(rng.standard_normal(4096)) * np.repeat(np.exp(rng.standard_normal(128)), 32)).astype(F32)
    assert rel_error(signs, roundtrip(signs)) < 0.2
    heavy = rng.standard_t(4, 1 << 14).astype(F32)
    assert rel_error(heavy, roundtrip(heavy)) < 0.48


def test_grid_values_are_exact_and_quantizing_twice_changes_nothing() -> None:
    x = np.array([1.5] * 32 + [0.75, -0.25, 0.25, -0.75] * 8 + [-1.5], F32)  # each block on its grid
    np.testing.assert_array_equal(roundtrip(x), x)
    y = roundtrip(np.random.default_rng(2).standard_normal(1000).astype(F32) * F32(1e-3))
    np.testing.assert_array_equal(roundtrip(y), y)


def test_of_equally_good_scales_the_first_tried_the_largest_is_kept() -> None:
    # 24 ones and 8 twos. Scale 1 (levels 1 and 3; a two is a tie at twice the scale: inner, 1)
    # misses each two by 1; scale 1/2 (levels 1/2 and 3/2) misses every value by 1/2: a squared
    # error of 8 either way. The search keeps the first of equals, the larger scale.
    x = np.array([1.0] * 24 + [2.0] * 8, F32)
    packed, scale = quantize_i2(x)
    assert scale.tolist() == [127]  # 2**0
    np.testing.assert_array_equal(dequantize_i2(packed, scale, x.shape), np.ones(32, F32))


def test_a_tie_at_twice_the_scale_goes_to_the_inner_level() -> None:
    # [3, 3, 3, 2]: scale 1 fits the 3s exactly; 2 is halfway between the levels 1 and 3.
    np.testing.assert_array_equal(roundtrip(np.array([3.0, 3.0, 3.0, 2.0, -2.0], F32)), [3, 3, 3, 1, -1])
    above = np.array([3.0, 3.0, 3.0, np.nextafter(F32(2.0), F32(3.0))], F32)
    np.testing.assert_array_equal(roundtrip(above), [3, 3, 3, 3])


def test_zero_blocks_are_exact_and_zeros_elsewhere_take_their_sign() -> None:
    q = quant.quantize(np.array([0.0, -0.0] * 16 + [0.0, -0.0, 1.0, -1.0], F32), "I2")
    assert q.scale is not None and q.scale[0] == 0
    assert not q.data[:8].any()  # a zero block's codes are 0
    out = quant.dequantize(q)
    assert np.array_equal(out[:32], np.zeros(32)) and not np.signbit(out[:32]).any()
    # no zero level: the zeros become the inner level of their sign (the scale, 0.25, is the
    # one that spends the least error on them and the ones together: 0.25, against 2 at 1.0)
    np.testing.assert_array_equal(out[32:], [0.25, -0.25, 0.75, -0.75])


def test_a_block_with_inf_or_nan_decodes_to_nan_like_f4() -> None:
    x = np.random.default_rng(4).standard_normal(128).astype(F32)
    x[5], x[70] = np.inf, np.nan
    q = quant.quantize(x, "I2")
    assert q.scale is not None and q.scale[[0, 2]].tolist() == [255, 255]
    assert not q.data[0:8].any() and not q.data[16:24].any()  # their codes are 0
    out = quant.dequantize(q)
    f4 = quant.dequantize(quant.quantize(x, "F4"))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(f4))
    assert np.isnan(out[:32]).all() and np.isfinite(out[32:64]).all()


def test_huge_and_tiny_values_stay_finite_and_close() -> None:
    out = roundtrip(np.array([3.4e38, -3.4e38, 3e38, 1.0], F32))
    assert np.isfinite(out).all() and out[0] > 2.5e38 and out[1] < -2.5e38
    tiny = np.array([1e-45, -1e-45, 3e-39, 2.0**-126, 0.0], F32)
    assert np.all(np.abs(roundtrip(tiny) - tiny) <= 2.0**-126)


def test_bytes_do_not_depend_on_flush_to_zero_mode() -> None:
    """Another library (torch here) may make the FPU flush subnormals to zero, on input too;
    the scale search reads magnitudes from their bits, so blocks whose values are mostly
    subnormal next to a small normal maximum keep their bytes."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    small = (rng.standard_normal((64, 32)) * 2.0**-128).astype(F32)
    small[:, 0] = F32(2.0**-122)  # a normal maximum; the rest of each block is subnormal
    x = np.concatenate([small.reshape(-1), rng.standard_normal(100).astype(F32)])
    want = quant.quantize(x, "I2")
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        # the mode is on: float arithmetic now reads these subnormals as zeros
        assert not (small[:, 1:] * F32(2.0**100)).any()
        got = quant.quantize(x, "I2")
    finally:
        torch.set_flush_denormal(False)
    assert got.data.tobytes() == want.data.tobytes() and got.scale.tobytes() == want.scale.tobytes()


# ---------------------------------------------------------------------------------------------
# The same bytes everywhere


def torch_bytes(x: np.ndarray, device: str) -> quant.QTensor:
    import torch

    from gradientmail_core.adapters import torch_quant as tq

    q = tq.quantize(torch.from_numpy(x.copy()).to(device), "I2")
    assert q.scale is not None
    return tq.to_qtensor(q, q.data.cpu(), q.scale.cpu())


DEVICES = ["cpu"]
if HAS_TORCH:
    import torch

    DEVICES += ["cuda"] if torch.cuda.is_available() else []


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(inputs()))
def test_torch_writes_the_numpy_bytes(name: str, device: str) -> None:
    x = inputs()[name]
    want, got = quant.quantize(x, "I2"), torch_bytes(x, device)
    assert got.shape == want.shape and got.data.tobytes() == want.data.tobytes(), name
    assert got.scale is not None and want.scale is not None and got.scale.tobytes() == want.scale.tobytes()


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_chunks_give_the_bytes_of_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradientmail_core.adapters import torch_quant as tq

    x = np.random.default_rng(5).standard_normal(1000).astype(F32)  # the last chunk ends in padding
    monkeypatch.setattr(tq, "CHUNK", 8 * I2_BLOCK)
    assert torch_bytes(x, "cpu").data.tobytes() == quant.quantize(x, "I2").data.tobytes()


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_the_device_pipeline_captures_the_host_paths_bytes() -> None:
    import torch

    from gradientmail_core.adapters.torch import TorchAdapter

    model = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Linear(9, 3))
    adapter = TorchAdapter(model, device_pipeline=True)  # on CPU tensors: the same code as CUDA
    assert adapter.pipeline is not None
    names = [s.name for s in adapter.schema()]
    anchor = {n: v + F32(0.01) * np.arange(v.size, dtype=F32).reshape(v.shape) for n, v in adapter.read(names).items()}
    adapter.pipeline.align(adapter.pipeline.stage(anchor))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9).add_(0.003)
    local = adapter.read(names)
    got = adapter.pipeline.capture(names).encode(dict.fromkeys(names, "I2"))
    for n in names:
        want = quant.quantize(np.subtract(anchor[n], local[n], dtype=F32), "I2")
        assert got[n].dtype == "I2" and got[n].data.tobytes() == want.data.tobytes(), n
        assert got[n].scale is not None and want.scale is not None
        assert got[n].scale.tobytes() == want.scale.tobytes(), n


def test_mlx_deltas_encode_to_the_numpy_bytes() -> None:
    # An MLX learner's delta goes through the MLX adapter as a node takes it: captured (a copy of
    # the parameters read from MLX) or consumed (MLX's subtract_from into the anchor's own
    # arrays); either way its I2 payload is the bytes numpy encodes for anchor - parameters,
    # computed here from the values the MLX model was built from.
    mx = pytest.importorskip("mlx.core")
    nn = pytest.importorskip("mlx.nn")
    from gradientmail_core.adapters.handles import FragmentIO
    from gradientmail_core.adapters.mlx import MLXAdapter

    values = {n: v for n, v in inputs().items() if v.size and np.isfinite(v).all()}
    anchor = {n: (v * F32(0.5) + F32(0.25)).astype(F32) for n, v in values.items()}

    class Params(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for n, v in values.items():
                self[n] = mx.array(v)

    io = FragmentIO(MLXAdapter(Params()))
    assert io.consumes  # the path an MLX learner takes when its node lends it the anchors
    names = list(values)
    dtypes = dict.fromkeys(names, "I2")
    want = payload.encode_payload(
        {n: np.subtract(anchor[n], values[n], dtype=F32) for n in names}, dtypes, kind="delta"
    )
    captured = io.capture(names, anchor).encode(dtypes, compression="")
    consumed = io.consume(names, {n: a.copy() for n, a in anchor.items()}).encode(dtypes, compression="")
    assert captured == want and consumed == want
    assert dtypes_of(want) == dtypes


# ---------------------------------------------------------------------------------------------
# Payloads


@pytest.mark.parametrize("codec", ["", "zstd"])
def test_payload_round_trip(codec: str) -> None:
    if codec and importlib.util.find_spec("zstandard") is None:
        pytest.skip("zstandard not installed")
    t = {"w": np.random.default_rng(6).standard_normal((33, 7)).astype(F32), "b": np.array(-2.5, F32)}
    data = payload.encode_payload(t, "I2", kind="delta", compression=codec)
    assert dtypes_of(data, codec) == {"w": "I2", "b": "I2"}
    out = payload.decode_payload(data, {n: v.shape for n, v in t.items()}, compression=codec, kind="delta")
    for n, v in t.items():
        np.testing.assert_array_equal(out[n], roundtrip(v))


def test_a_short_or_mislabelled_i2_payload_is_rejected() -> None:
    t = {"w": np.ones((5, 13), F32)}  # 65 values: 3 blocks, 24 code bytes
    data = payload.encode_payload(t, "I2", kind="delta")
    expected = {"w": (5, 13)}
    with pytest.raises(PayloadCorrupt):
        payload.decode_payload(data[:-3], expected)  # truncated
    # the same tensor stored as F4 (48 code bytes) but labelled I2: the layout check names it
    f4 = payload.encode_payload(t, "F4", kind="delta")
    relabelled = f4.replace(b'{\\"w\\":\\"F4\\"}', b'{\\"w\\":\\"I2\\"}')
    assert relabelled != f4
    with pytest.raises(PayloadCorrupt, match="w"):
        payload.decode_payload(relabelled, expected)


# ---------------------------------------------------------------------------------------------
# A run


def test_a_run_with_i2_deltas_and_commits_ends_identical_and_matches_its_digests() -> None:
    from gradientmail_core.protocol.rebuild import theta_digest
    from gradientmail_core.protocol.records import RoundRecord, decode

    shapes = {"w": (16, 12), "b": (12,)}
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, delta_dtype="I2", commit_dtype="I2"), shapes=shapes)
    uploaded: dict[str, bytes] = {}  # every contribution's payload, as it went up (GC deletes them later)
    put = c.mailbox.put_if_absent

    def spy(key: str, data: bytes) -> bool:
        b = keys.parse_blob_key(key)
        if b is not None and b.kind == "snapshot":
            uploaded[key] = bytes(data)
        return put(key, data)

    c.mailbox.put_if_absent = spy  # type: ignore[method-assign]
    ms = c.join_all("ab")
    c.run(32)
    c.settle()
    for m in c.live():
        c.close(m)
    recs = [decode(c.mailbox.get(k), RoundRecord, key=k) for k in c.mailbox.list(keys.ROUNDS)]
    assert len(recs) >= 6 and all(r.change is not None for r in recs)
    for r in recs[-2:]:
        assert r.change is not None
        assert set(dtypes_of(c.mailbox.get(r.change.key)).values()) == {"I2"}
    assert all(e.bytes > 0 for m in ms for e in m.of(ev.Published))
    # The deltas went up as I2: every tensor of every contribution, and its data is exactly the
    # two-bit codes (four a byte, blocks of 32) and a scale byte per block, after the header.
    run = ms[0].node.run
    assert len(uploaded) >= 12
    for key, data in uploaded.items():
        b = keys.parse_blob_key(key)
        assert b is not None and b.round is not None
        f = b.round % run.P
        assert dtypes_of(data) == dict.fromkeys(run.fragments[f], "I2"), key
        (header,) = struct.unpack("<Q", data[:8])
        want = sum(sum(i2_sizes(int(np.prod(run.shapes[f][n])))) for n in run.fragments[f])
        assert len(data) - 8 - header == want, key
    first = ms[0].params
    for m in ms[1:]:
        for n in first:
            assert np.array_equal(first[n], m.params[n]), (m.name, n)
    for r in recs[-2:]:
        assert theta_digest(run, r.fragment, {n: first[n] for n in run.fragments[r.fragment]}) == r.theta_digest
