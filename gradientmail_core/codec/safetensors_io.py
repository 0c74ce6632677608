"""The safetensors container in pure Python + numpy: written, and its header read and checked.

Layout (the public safetensors format): an 8-byte little-endian header length ``N``, ``N`` bytes
of UTF-8 JSON (padded with spaces so the data starts 8-byte aligned), then the tensor data. The
header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data start) and may hold ``"__metadata__"``: a str -> str map.

We do it ourselves rather than through the ``safetensors`` package so that (a) the header is
validated against the layout the caller expects before any tensor is materialised, (b) dtypes
numpy lacks (BF16, F8) need no library support, and (c) the bytes are canonical: the same
tensors always give the same file, which content-addressed payload keys rely on. The real
library loads what we write.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import PayloadCorrupt

# Bytes per element of every dtype the format defines that we accept on read.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}

# The numpy array a tensor is read into. BF16 and F8 have no numpy dtype: they come back as
# their raw bit patterns (uint16 / uint8) for the quantization module to decode.
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "F8_E4M3": np.dtype("<u1"),
    "F8_E5M2": np.dtype("<u1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}

METADATA_KEY = "__metadata__"
# The safetensors library refuses headers above 100 MB; so do we, whatever the caller allows.
HARD_HEADER_CAP = 100_000_000


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def header(
    tensors: Mapping[str, tuple[str, Sequence[int]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """The bytes before the tensor data (length prefix and JSON header) of a file holding
    ``{name: (dtype, shape)}``, and the order the tensors' data follows it in.

    Tensors are laid out by element size, largest first, then by name (as the safetensors
    library does) so every tensor is aligned to its own element size. Knowing only dtypes and
    shapes, a writer can send this first and then each tensor's bytes as they are produced.
    """
    if METADATA_KEY in tensors:
        raise ValueError(f"{METADATA_KEY!r} is reserved and cannot be a tensor name")
    order = sorted(tensors, key=lambda name: (-DTYPE_SIZES.get(tensors[name][0], 0), name))
    entries: dict[str, Any] = {}
    offset = 0
    for name in order:
        dtype, shape = tensors[name]
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        size = DTYPE_SIZES[dtype] * numel(shape)
        entries[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"metadata must map str to str, got {k!r}: {v!r}")
        entries[METADATA_KEY] = dict(metadata)
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    # Pad with spaces (valid JSON whitespace) so the data section starts 8-byte aligned.
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write(tensors: Mapping[str, tuple[str, Sequence[int], Any]], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize ``{name: (dtype, shape, data)}`` to safetensors bytes, deterministically.

    ``data`` is anything bytes-like (bytes, memoryview, a C-contiguous numpy array) holding
    exactly ``DTYPE_SIZES[dtype] * numel(shape)`` bytes; arrays are joined without an extra copy.
    The layout is ``header``'s.
    """
    head, order = header({name: (dtype, shape) for name, (dtype, shape, _) in tensors.items()}, metadata)
    parts: list[Any] = []
    for name in order:
        dtype, shape, data = tensors[name]
        view = as_bytes(data)
        size = DTYPE_SIZES[dtype] * numel(shape)
        if view.nbytes != size:
            raise ValueError(f"tensor {name!r}: {dtype} {list(shape)} needs {size} bytes, got {view.nbytes}")
        parts.append(view)
    return b"".join([head, *parts])


def as_bytes(data: Any) -> memoryview:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError("tensor data must be C-contiguous")
        # A flat uint8 view: memoryview.cast refuses 0-d and empty shapes.
        data = data.reshape(-1).view(np.uint8)
    view = memoryview(data)
    return view if view.nbytes == 0 else view.cast("B")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise PayloadCorrupt(f"safetensors header has duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise PayloadCorrupt(f"safetensors header contains non-JSON constant {name}")


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(
    data: bytes | memoryview, *, max_header_bytes: int, total: int | None = None
) -> tuple[dict[str, Any], int]:
    """Parse and strictly validate a safetensors header; returns ``(header, data_offset)``.

    The header is returned as parsed (tensor entries plus ``__metadata__`` when present). Nothing
    beyond the header is touched, so this is cheap even on a large payload. Every tensor's byte
    range is checked against its dtype and shape, and the ranges must tile the data section
    exactly: no gaps, no overlaps, no trailing bytes. ``total`` is the file's size when ``data``
    holds only its start (a stream: at least the header); by default ``len(data)``.
    """
    if total is None:
        total = len(data)
    if len(data) > total:
        raise PayloadCorrupt(f"payload has {len(data)} bytes, more than the {total} expected")
    if total < 8:
        raise PayloadCorrupt(f"payload is {total} bytes, shorter than the 8-byte safetensors length prefix")
    (n,) = struct.unpack_from("<Q", data, 0)
    cap = min(max_header_bytes, HARD_HEADER_CAP)
    if n < 2 or n > cap:
        raise PayloadCorrupt(f"safetensors header length is {n} bytes, expected between 2 and {cap}")
    if 8 + n > total:
        raise PayloadCorrupt(
            f"safetensors header claims {n} bytes but the payload has only {total - 8} after the prefix"
        )
    try:
        text = bytes(data[8 : 8 + n]).decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise PayloadCorrupt(f"safetensors header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise PayloadCorrupt(f"safetensors header is a JSON {type(header).__name__}, expected an object")

    data_offset = 8 + n
    data_len = total - data_offset
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == METADATA_KEY:
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise PayloadCorrupt(f"safetensors {METADATA_KEY} must map str to str, found {entry!r:.200}")
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise PayloadCorrupt(
                f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets; found {entry!r:.200}"
            )
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise PayloadCorrupt(f"tensor {name!r}: unknown dtype {dtype!r}, expected one of {sorted(DTYPE_SIZES)}")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise PayloadCorrupt(f"tensor {name!r}: shape must be a list of non-negative ints, found {shape!r:.200}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise PayloadCorrupt(
                f"tensor {name!r}: data_offsets {offsets!r:.100} not within the {data_len}-byte data section"
            )
        size = DTYPE_SIZES[dtype] * numel(shape)
        if offsets[1] - offsets[0] != size:
            raise PayloadCorrupt(
                f"tensor {name!r}: {dtype} {shape} needs {size} bytes, data_offsets span {offsets[1] - offsets[0]}"
            )
        spans.append((offsets[0], offsets[1], name))

    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            what = "overlaps the previous tensor" if begin < end else f"leaves a gap of {begin - end} bytes"
            raise PayloadCorrupt(f"tensor {name!r}: data_offsets [{begin}, {stop}] {what} (expected to start at {end})")
        end = stop
    if end != data_len:
        raise PayloadCorrupt(
            f"safetensors data section is {data_len} bytes but its tensors cover {end}: trailing bytes"
        )
    return header, data_offset


def check_layout(entries: Mapping[str, Any], expected: Mapping[str, tuple[str, Sequence[int]]]) -> None:
    """Raise ``PayloadCorrupt`` unless ``entries`` hold exactly the expected names, dtypes, shapes."""
    check_names(entries, expected)
    for name, (dtype, shape) in expected.items():
        entry = entries[name]
        if entry["dtype"] != dtype or list(entry["shape"]) != list(shape):
            raise PayloadCorrupt(
                f"tensor {name!r}: expected {dtype} {list(shape)}, found {entry['dtype']} {entry['shape']}"
            )


def check_names(entries: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raise ``PayloadCorrupt`` unless ``entries`` and ``expected`` have the same names."""
    missing = sorted(set(expected) - set(entries))
    extra = sorted(set(entries) - set(expected))
    if missing or extra:
        raise PayloadCorrupt(
            f"payload tensors differ from the expected layout: missing {missing[:10]}, unexpected {extra[:10]}"
        )
