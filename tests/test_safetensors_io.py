"""The safetensors container: canonical bytes, loadable by the real library, strict reading."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradientmail_core.codec import safetensors_io as sio  # noqa: E402
from gradientmail_core.errors import PayloadCorrupt  # noqa: E402

CAP = 1 << 20


def read(data: bytes, expected: dict[str, tuple[str, Any]] | None = None) -> dict[str, np.ndarray]:
    """The container's tensors as raw arrays (views of ``data``), read with the module's strict
    header reader and layout check (the engine decodes payloads itself: ``codec/payload.py``;
    its cap on the whole is tested in ``test_payload.py``)."""
    header, start = sio.read_header(data, max_header_bytes=CAP)
    entries = {k: v for k, v in header.items() if k != sio.METADATA_KEY}
    if expected is not None:
        sio.check_layout(entries, expected)
    out = {}
    for name, e in entries.items():
        begin, stop = e["data_offsets"]
        arr = np.frombuffer(memoryview(data)[start + begin : start + stop], dtype=sio.NUMPY_DTYPES[e["dtype"]])
        out[name] = arr.reshape(e["shape"])
    return out


def sample() -> dict[str, tuple[str, list[int], Any]]:
    rng = np.random.default_rng(0)
    return {
        "w": ("F32", [3, 5], rng.standard_normal((3, 5)).astype(np.float32)),
        "h": ("F16", [7], rng.standard_normal(7).astype(np.float16)),
        "b": ("U8", [3], np.array([1, 2, 255], np.uint8)),
        "s": ("F32", [], np.array(2.5, np.float32)),
        "e": ("F32", [0, 4], np.zeros((0, 4), np.float32)),
    }


def raw_file(header: Any, data: bytes = b"", *, pad: bool = True) -> bytes:
    """A file with an arbitrary header, to feed the reader malformed input."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def entry(dtype: str, shape: list[Any], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# ---------------------------------------------------------------------------------------------
# Writing


def test_write_is_canonical_whatever_the_insertion_order() -> None:
    t = sample()
    a = sio.write(t, {"k": "v", "a": "b"})
    b = sio.write(dict(reversed(list(t.items()))), {"a": "b", "k": "v"})
    assert a == b


def test_header_is_space_padded_so_data_starts_8_byte_aligned() -> None:
    data = sio.write(sample(), {"x": "y"})
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    text = data[8 : 8 + n]
    assert text.rstrip(b" ").endswith(b"}")
    assert set(text[len(text.rstrip(b" ")) :]) <= {ord(" ")}


def test_tensors_are_laid_out_widest_first_so_each_is_aligned_to_its_element_size() -> None:
    header, start = sio.read_header(sio.write(sample()), max_header_bytes=CAP)
    for name, e in header.items():
        assert (start + e["data_offsets"][0]) % sio.DTYPE_SIZES[e["dtype"]] == 0, name


def test_write_rejects_a_size_mismatch_and_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="needs 12 bytes"):
        sio.write({"x": ("F32", [3], b"\0" * 8)})
    with pytest.raises(ValueError, match="unknown dtype"):
        sio.write({"x": ("F4", [2], b"\0")})


def test_real_safetensors_library_loads_what_we_write() -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    t = sample()
    loaded = safetensors_numpy.load(sio.write(t, {"format": "x"}))
    assert set(loaded) == set(t)
    for name, (_, shape, arr) in t.items():
        assert loaded[name].dtype == arr.dtype
        assert loaded[name].shape == tuple(shape)
        np.testing.assert_array_equal(loaded[name], arr)


def test_real_safetensors_library_loads_bf16_and_f8_e4m3() -> None:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    bits = np.array([0x3F80, 0xC000, 0x0001, 0x7F7F], np.uint16)  # 1, -2, tiny, max bf16
    codes = np.array([0x38, 0xB8, 0x7E, 0x01], np.uint8)  # 1, -1, 448, 2**-9
    data = sio.write({"b": ("BF16", [2, 2], bits), "f8": ("F8_E4M3", [4], codes)})
    loaded = safetensors_torch.load(data)
    assert loaded["b"].dtype == torch.bfloat16 and loaded["b"].shape == (2, 2)
    np.testing.assert_array_equal(loaded["b"].view(torch.int16).numpy().view(np.uint16), bits.reshape(2, 2))
    assert loaded["f8"].dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(loaded["f8"].float().numpy(), [1.0, -1.0, 448.0, 2.0**-9])


# ---------------------------------------------------------------------------------------------
# Reading


def test_read_returns_raw_arrays_matching_the_expected_layout() -> None:
    t = sample()
    out = read(sio.write(t), {k: (d, s) for k, (d, s, _) in t.items()})
    for name, (_, shape, arr) in t.items():
        assert out[name].shape == tuple(shape)
        np.testing.assert_array_equal(out[name], arr)


def test_read_returns_bf16_and_f8_as_bit_patterns() -> None:
    data = sio.write({"b": ("BF16", [2], np.array([1, 2], np.uint16)), "f": ("F8_E4M3", [1], b"\x7e")})
    out = read(data)
    assert out["b"].dtype == np.uint16 and out["f"].dtype == np.uint8


@pytest.mark.parametrize(
    "expected, match",
    [
        ({"w": ("F32", [3, 5])}, "unexpected"),  # a tensor too many
        ({**{k: (d, s) for k, (d, s, _) in sample().items()}, "z": ("F32", [1])}, "missing"),
        ({**{k: (d, s) for k, (d, s, _) in sample().items()}, "w": ("F32", [5, 3])}, r"expected F32 \[5, 3\]"),
        ({**{k: (d, s) for k, (d, s, _) in sample().items()}, "w": ("F16", [3, 5])}, r"expected F16"),
    ],
)
def test_read_rejects_a_layout_other_than_expected(expected: dict[str, Any], match: str) -> None:
    with pytest.raises(PayloadCorrupt, match=match):
        read(sio.write(sample()), expected)


@pytest.mark.parametrize("cut", [0, 5, 8, 20, -1, -13])
def test_truncated_data_is_rejected(cut: int) -> None:
    data = sio.write(sample())
    with pytest.raises(PayloadCorrupt):
        sio.read_header(data[:cut], max_header_bytes=CAP)


def test_header_above_the_cap_is_rejected_before_it_is_parsed() -> None:
    data = sio.write(sample())
    (n,) = struct.unpack("<Q", data[:8])
    with pytest.raises(PayloadCorrupt, match="header length"):
        sio.read_header(data, max_header_bytes=n - 1)
    huge = struct.pack("<Q", 1 << 62) + b"{}"
    with pytest.raises(PayloadCorrupt, match="header length"):
        sio.read_header(huge, max_header_bytes=1 << 63)


def test_header_longer_than_the_file_is_rejected() -> None:
    with pytest.raises(PayloadCorrupt, match="claims"):
        sio.read_header(struct.pack("<Q", 64) + b"{}", max_header_bytes=CAP)


def test_trailing_bytes_are_rejected() -> None:
    with pytest.raises(PayloadCorrupt, match="trailing"):
        sio.read_header(sio.write(sample()) + b"\0", max_header_bytes=CAP)


def test_overlapping_offsets_are_rejected() -> None:
    header = {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}
    with pytest.raises(PayloadCorrupt, match="overlaps"):
        sio.read_header(raw_file(header, b"\0" * 12), max_header_bytes=CAP)


def test_a_gap_between_tensors_is_rejected() -> None:
    header = {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}
    with pytest.raises(PayloadCorrupt, match="gap"):
        sio.read_header(raw_file(header, b"\0" * 12), max_header_bytes=CAP)


@pytest.mark.parametrize(
    "bad, match",
    [
        (entry("F32", [3], 0, 8), "needs 12 bytes"),  # span does not match dtype x shape
        (entry("F33", [2], 0, 8), "unknown dtype"),
        (entry("F32", [-2], 0, 8), "non-negative"),
        (entry("F32", [True, 2], 0, 8), "non-negative"),
        (entry("F32", [2.0], 0, 8), "non-negative"),
        (entry("F32", [2], 0, 16), "not within"),  # beyond the data
        (entry("F32", [2], 8, 0), "not within"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0]}, "not within"),
        ({"dtype": "F32", "shape": [2]}, "exactly"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}, "exactly"),
        ([1, 2], "exactly"),
    ],
)
def test_malformed_entries_are_rejected(bad: Any, match: str) -> None:
    with pytest.raises(PayloadCorrupt, match=match):
        sio.read_header(raw_file({"t": bad}, b"\0" * 8), max_header_bytes=CAP)


@pytest.mark.parametrize(
    "header, match",
    [
        (b"\xff\xfe{}", "UTF-8 JSON"),
        (b"{not json}", "UTF-8 JSON"),
        (b"[1, 2]", "expected an object"),
        (b'{"a": 1, "a": 2}', "duplicate key"),
        (b'{"__metadata__": {"k": NaN}}', "non-JSON constant|str to str"),
        (b'{"__metadata__": {"k": 1}}', "str to str"),
        (b'{"__metadata__": "x"}', "str to str"),
    ],
)
def test_malformed_headers_are_rejected(header: bytes, match: str) -> None:
    with pytest.raises(PayloadCorrupt, match=match):
        sio.read_header(raw_file(header), max_header_bytes=CAP)


def test_an_unpadded_header_from_another_writer_is_accepted() -> None:
    data = raw_file({"a": entry("U8", [3], 0, 3)}, b"abc", pad=False)
    assert bytes(read(data)["a"]) == b"abc"


_DTYPES = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I64": np.int64, "U16": np.uint16}


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.text(st.characters(codec="utf-8", exclude_characters="#"), min_size=1, max_size=12).filter(
            lambda s: s != "__metadata__"
        ),
        st.tuples(st.sampled_from(sorted(_DTYPES)), st.lists(st.integers(0, 4), max_size=3)),
        max_size=5,
    ),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
)
def test_write_then_read_round_trips(layout: dict[str, tuple[str, list[int]]], meta: dict[str, str]) -> None:
    rng = np.random.default_rng(1)
    tensors = {
        name: (dt, shape, rng.integers(0, 250, size=shape).astype(_DTYPES[dt])) for name, (dt, shape) in layout.items()
    }
    data = sio.write(tensors, meta)
    header, _ = sio.read_header(data, max_header_bytes=CAP)
    assert header.get("__metadata__", {}) == meta
    out = read(data, layout)
    for name, (_, shape, arr) in tensors.items():
        np.testing.assert_array_equal(out[name].reshape(shape), arr)
