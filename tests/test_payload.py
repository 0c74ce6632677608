"""The payload format: round trips per dtype and codec, determinism, and strict validation."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from gradientmail_core.codec import compress, payload, quant, safetensors_io  # noqa: E402
from gradientmail_core.codec import header as fmt  # noqa: E402
from gradientmail_core.errors import PayloadCorrupt  # noqa: E402
from gradientmail_core.protocol.records import TensorSpec  # noqa: E402

CODECS = ["", "zstd"]
DTYPES = list(quant.DTYPES)


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "layers.0.weight": rng.standard_normal((33, 7)).astype(np.float32),  # odd last dim, 231 elements
        "layers.0.bias": rng.standard_normal(7).astype(np.float32),
        "momentum/embed": rng.standard_normal((64, 32)).astype(np.float32) * 1e-3,
        "scalar": np.array(-2.5, np.float32),
        "empty": np.zeros((0, 3), np.float32),
    }


def shapes(t: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {k: v.shape for k, v in t.items()}


def declared(data: bytes, compression: str = "") -> fmt.PayloadInfo:
    """What a payload's header declares."""
    return fmt.header_info(safetensors_io.read_header(data, max_header_bytes=1 << 20)[0], compression)


def rewrite_header(data: bytes, edit: Any) -> bytes:
    """Parse a plain payload's header, let ``edit`` change it, and write it back."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_matches_the_quantizer(dtype: str, codec: str) -> None:
    t = tensors()
    out = payload.decode_payload(
        payload.encode_payload(t, dtype, kind="theta", compression=codec), shapes(t), compression=codec
    )
    assert set(out) == set(t)
    for name, x in t.items():
        assert out[name].dtype == np.float32 and out[name].shape == x.shape
        np.testing.assert_array_equal(out[name], quant.dequantize(quant.quantize(x, dtype)))
        assert out[name].flags.writeable


@pytest.mark.parametrize("codec", CODECS)
def test_f32_is_exact_and_lower_precisions_are_exact_on_their_grids(codec: str) -> None:
    rng = np.random.default_rng(5)
    bf = quant.from_bf16_bits(rng.integers(0, 0x7F00, size=(40, 3), dtype=np.uint16))  # finite bf16 values
    f8 = (rng.choice(quant.E4M3_VALUES, size=50) * 2.0**-20).astype(np.float32)
    f8[0] = 448 * 2.0**-20
    f4 = (rng.choice(quant.E2M1_VALUES, size=(3, 32)) * 2.0**7).astype(np.float32)
    f4[:, 0] = 6 * 2.0**7
    h = rng.integers(0, 0x7C00, size=9, dtype=np.uint16).view(np.float16).astype(np.float32)  # finite f16 values
    t = {"f32": rng.standard_normal(70).astype(np.float32), "bf": bf, "h": h}
    t |= {"f8": f8, "f4": f4}
    dtypes = {"f32": "F32", "bf": "BF16", "h": "F16", "f8": "F8_E4M3", "f4": "F4"}
    data = payload.encode_payload(t, dtypes, kind="delta", compression=codec)
    out = payload.decode_payload(data, shapes(t), compression=codec)
    for name, x in t.items():
        np.testing.assert_array_equal(out[name], x, err_msg=name)
    assert declared(data, codec).dtypes == dtypes


@pytest.mark.parametrize("codec", CODECS)
def test_non_finite_values_survive_so_the_receiver_can_reject_them(codec: str) -> None:
    t = {"a": np.array([1.0, np.nan, np.inf], np.float32)}
    for dtype in DTYPES:
        out = payload.decode_payload(
            payload.encode_payload(t, dtype, kind="delta", compression=codec), {"a": (3,)}, compression=codec
        )
        assert not np.isfinite(out["a"]).all(), dtype


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_input_gives_equal_bytes(dtype: str, codec: str) -> None:
    t = tensors()
    a = payload.encode_payload(t, dtype, kind="theta", compression=codec)
    b = payload.encode_payload(
        {k: v.copy() for k, v in reversed(list(t.items()))}, dtype, kind="theta", compression=codec
    )
    assert a == b


def test_payload_metadata_names_format_kind_compression_and_dtypes() -> None:
    t = tensors()
    for codec in CODECS:
        info = declared(payload.encode_payload(t, "F4", kind="outer", compression=codec), codec)
        assert info == fmt.PayloadInfo("outer", codec, dict.fromkeys(t, "F4"), shapes(t))
    header, _ = safetensors_io.read_header(payload.encode_payload(t, "F4", kind="outer"), max_header_bytes=1 << 20)
    assert header["__metadata__"]["format"] == "gradientmail/1"
    assert header["__metadata__"]["compression"] == "none"


def test_stored_layout_per_dtype() -> None:
    t = {"w": np.ones((5, 13), np.float32)}  # 65 elements: 3 F4 blocks
    layout = {}
    for dtype in DTYPES:
        header, _ = safetensors_io.read_header(payload.encode_payload(t, dtype, kind="x"), max_header_bytes=1 << 20)
        layout[dtype] = {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
    assert layout == {
        "F32": {"w": ("F32", [5, 13])},
        "F16": {"w": ("F16", [5, 13])},
        "BF16": {"w": ("BF16", [5, 13])},
        "F8_E4M3": {"w": ("F8_E4M3", [5, 13]), "w#scale": ("U8", [1])},
        "F4": {"w": ("U8", [48]), "w#scale": ("U8", [3])},
        "I2": {"w": ("U8", [24]), "w#scale": ("U8", [3])},
    }


def test_zstd_payload_is_smaller_for_smooth_weights() -> None:
    x = {"w": (np.random.default_rng(0).standard_normal((256, 256)) * 0.02).astype(np.float32)}
    for dtype in ("F32", "BF16"):
        plain = payload.encode_payload(x, dtype, kind="theta")
        packed = payload.encode_payload(x, dtype, kind="theta", compression="zstd")
        assert len(packed) < 0.9 * len(plain), dtype


def test_real_safetensors_library_loads_plain_payloads() -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    t = tensors()
    loaded = safetensors_numpy.load(payload.encode_payload(t, "F32", kind="theta"))
    for name, x in t.items():
        np.testing.assert_array_equal(loaded[name], x)
    loaded = safetensors_numpy.load(payload.encode_payload(t, "F16", kind="theta"))
    np.testing.assert_array_equal(loaded["layers.0.bias"], t["layers.0.bias"].astype(np.float16))
    loaded = safetensors_numpy.load(payload.encode_payload(t, "F4", kind="theta"))
    assert loaded["layers.0.weight"].dtype == np.uint8 and loaded["layers.0.weight#scale"].shape == (8,)


def test_real_safetensors_library_loads_bf16_and_f8_payloads() -> None:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    t = tensors()
    loaded = safetensors_torch.load(payload.encode_payload(t, "BF16", kind="theta"))
    w = torch.from_numpy(t["layers.0.weight"]).to(torch.bfloat16)
    assert torch.equal(loaded["layers.0.weight"], w)
    loaded = safetensors_torch.load(payload.encode_payload(t, "F8_E4M3", kind="theta"))
    assert loaded["layers.0.weight"].dtype == torch.float8_e4m3fn and loaded["layers.0.weight#scale"].shape == (1,)


# ---------------------------------------------------------------------------------------------
# Schema digest, caps, encode errors


def test_schema_digest_is_stable_order_free_and_sensitive_to_every_field() -> None:
    a = [TensorSpec(name="w", dtype="F32", shape=[2, 3]), TensorSpec(name="b", dtype="BF16", shape=[3])]
    d = fmt.schema_digest(a)
    assert len(d) == 64 and int(d, 16) >= 0
    assert fmt.schema_digest(list(reversed(a))) == d
    for other in (
        [TensorSpec(name="w", dtype="F32", shape=[3, 2]), a[1]],
        [TensorSpec(name="w", dtype="F16", shape=[2, 3]), a[1]],
        [TensorSpec(name="v", dtype="F32", shape=[2, 3]), a[1]],
        a[:1],
    ):
        assert fmt.schema_digest(other) != d
    # pinned, so a change of the canonical form is a deliberate protocol change
    assert fmt.schema_digest([TensorSpec(name="w", dtype="F32", shape=[2])]) == fmt.sha256_hex(b'[["w","F32",[2]]]')


def test_default_cap_admits_every_encoding_of_the_expected_tensors() -> None:
    rng = np.random.default_rng(2)
    t = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate([(1,), (31, 3), (1000,), (0,)])}
    cap = fmt.default_payload_cap(shapes(t))
    for dtype in DTYPES:
        for codec in CODECS:
            assert len(payload.encode_payload(t, dtype, kind="x", compression=codec)) <= cap


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tensors": {"a#b": np.ones(1, np.float32)}}, "'#'"),
        ({"tensors": {"": np.ones(1, np.float32)}}, "invalid tensor name"),
        ({"tensors": {"__metadata__": np.ones(1, np.float32)}}, "reserved"),
        ({"dtypes": "F8_E5M2"}, "unknown dtype"),
        ({"dtypes": {"a": "F32", "b": "F32"}}, "not matching"),
        ({"compression": "gzip"}, "unknown compression"),
    ],
)
def test_encode_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"tensors": {"a": np.ones(1, np.float32)}, "dtypes": "F32", "kind": "x"} | kwargs
    with pytest.raises(ValueError, match=match):
        payload.encode_payload(args.pop("tensors"), args.pop("dtypes"), **args)


# ---------------------------------------------------------------------------------------------
# Validation on decode


@pytest.mark.parametrize("codec", CODECS)
def test_wrong_names_are_rejected(codec: str) -> None:
    t = tensors()
    data = payload.encode_payload(t, "F4", kind="theta", compression=codec)
    missing = {k: v for k, v in shapes(t).items() if k != "scalar"}
    with pytest.raises(PayloadCorrupt, match="unexpected"):
        payload.decode_payload(data, missing, compression=codec)
    with pytest.raises(PayloadCorrupt, match="missing"):
        payload.decode_payload(data, shapes(t) | {"other": (1,)}, compression=codec)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_wrong_shapes_are_rejected_before_any_tensor_is_read(
    dtype: str, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = tensors()
    data = payload.encode_payload(t, dtype, kind="theta", compression=codec)

    def no_materialising(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a tensor was materialised before the header was validated")

    monkeypatch.setattr(payload.quant, "dequantize", no_materialising)
    monkeypatch.setattr(compress, "decompress", no_materialising)
    wrong = shapes(t) | {"layers.0.weight": (7, 33)}  # the same size: only the shape tells
    with pytest.raises(PayloadCorrupt, match=r"expected shape \[7, 33\]"):
        payload.decode_payload(data, wrong, compression=codec)


def test_compression_other_than_the_keys_is_rejected() -> None:
    t = tensors()
    with pytest.raises(PayloadCorrupt, match="compression"):
        payload.decode_payload(payload.encode_payload(t, "F32", kind="theta", compression="zstd"), shapes(t))
    with pytest.raises(PayloadCorrupt, match="compression"):
        payload.decode_payload(payload.encode_payload(t, "F32", kind="theta"), shapes(t), compression="zstd")
    with pytest.raises(PayloadCorrupt, match="unknown compression"):
        payload.decode_payload(payload.encode_payload(t, "F32", kind="theta"), shapes(t), compression="lz4")


def test_kind_other_than_expected_is_rejected() -> None:
    t = tensors()
    data = payload.encode_payload(t, "F32", kind="theta")
    assert payload.decode_payload(data, shapes(t), kind="theta")
    with pytest.raises(PayloadCorrupt, match="kind 'theta', expected 'outer'"):
        payload.decode_payload(data, shapes(t), kind="outer")


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_and_oversized_payloads_are_rejected(codec: str) -> None:
    t = tensors()
    data = payload.encode_payload(t, "BF16", kind="theta", compression=codec)
    for cut in (0, 7, 8, 40, len(data) // 2, len(data) - 1):
        with pytest.raises(PayloadCorrupt):
            payload.decode_payload(data[:cut], shapes(t), compression=codec)
    with pytest.raises(PayloadCorrupt):
        payload.decode_payload(data + b"\0", shapes(t), compression=codec)
    with pytest.raises(PayloadCorrupt, match="above the cap"):
        payload.decode_payload(data, shapes(t), compression=codec, max_bytes=len(data) - 1)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h.pop("__metadata__"), "no __metadata__"),
        (lambda h: h["__metadata__"].update(format="gradientmail/2"), "format"),
        (lambda h: h["__metadata__"].pop("kind"), "kind"),
        (lambda h: h["__metadata__"].update(dtypes="{nope"), "not JSON"),
        (lambda h: h["__metadata__"].update(dtypes='{"w": "F64"}'), "must map names"),
        (lambda h: h["__metadata__"].update(dtypes='{"w": "F32", "v": "F32"}'), "shape for every tensor"),
        (lambda h: h["__metadata__"].update(shapes='{"w": [8, 4]}'), "expected shape"),
        (lambda h: h["__metadata__"].update(shapes='{"w": [-1]}'), "shape for every tensor"),
        (lambda h: h["__metadata__"].pop("shapes"), "not JSON"),
        (lambda h: h["__metadata__"].update(dtypes='{"w": "F4"}'), "missing|expected"),  # declared F4, stored F32
        (lambda h: h["w"].update(dtype="I32"), "expected F32"),
    ],
)
def test_tampered_headers_are_rejected(edit: Any, match: str) -> None:
    data = rewrite_header(payload.encode_payload({"w": np.ones((4, 8), np.float32)}, "F32", kind="x"), edit)
    with pytest.raises(PayloadCorrupt, match=match):
        payload.decode_payload(data, {"w": (4, 8)})


def test_f4_scale_tensor_of_the_wrong_size_is_rejected() -> None:
    t = {"w": np.ones(64, np.float32)}
    data = payload.encode_payload(t, "F4", kind="x")

    def edit(h: dict[str, Any]) -> None:
        h["w"] = {"dtype": "U8", "shape": [33], "data_offsets": [0, 33]}
        h["w#scale"] = {"dtype": "U8", "shape": [1], "data_offsets": [33, 34]}

    with pytest.raises(PayloadCorrupt, match="expected U8"):
        payload.decode_payload(rewrite_header(data, edit), {"w": (64,)})


def test_zstd_frame_declaring_more_than_the_tensor_is_rejected() -> None:
    bomb = compress.compress(bytes(1 << 20), 4)  # declares 1 MiB for a 16-byte tensor
    data = safetensors_io.write(
        {"w": ("U8", [len(bomb)], bomb)},
        {
            "format": "gradientmail/1",
            "kind": "x",
            "compression": "zstd",
            "dtypes": '{"w":"F32"}',
            "shapes": '{"w":[4]}',
        },
    )
    with pytest.raises(PayloadCorrupt, match="above the cap"):
        payload.decode_payload(data, {"w": (4,)}, compression="zstd")


# ---------------------------------------------------------------------------------------------
# Property


NAMES = st.text(st.characters(codec="ascii", categories=["L", "N"], include_characters="./_-"), min_size=1, max_size=20)


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        NAMES,
        hnp.arrays(
            np.float32,
            hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=20),
            elements=st.floats(-1e6, 1e6, width=32),
        ),
        max_size=4,
    ),
    st.sampled_from(DTYPES),
    st.sampled_from(CODECS),
)
def test_any_tensors_round_trip_like_the_quantizer(t: dict[str, np.ndarray], dtype: str, codec: str) -> None:
    data = payload.encode_payload(t, dtype, kind="p", compression=codec)
    assert data == payload.encode_payload(t, dtype, kind="p", compression=codec)
    out = payload.decode_payload(data, shapes(t), compression=codec, kind="p")
    for name, x in t.items():
        np.testing.assert_array_equal(out[name], quant.dequantize(quant.quantize(x, dtype)))
