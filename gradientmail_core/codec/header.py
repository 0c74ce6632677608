"""The payload format: named float32 tensors in their storage dtypes, in a safetensors file. This
module says what a payload of given tensors stores and declares, and checks a header read back;
``payload.py`` writes and reads the bytes.

Byte layout of ``.safetensors`` (``compression=""``): a standard safetensors file (8-byte
little-endian header length, canonical JSON header padded with spaces to 8-byte alignment, tensor
data laid out by element size then name: ``safetensors_io.header``). Per parameter ``name`` with
logical dtype:

=========  ==========================================  ==========================================
logical    ``name``                                    ``name#scale``
=========  ==========================================  ==========================================
F32        F32, the tensor's shape                     --
F16        F16, the tensor's shape                     --
BF16       BF16, the tensor's shape                    --
F8_E4M3    F8_E4M3 codes, the tensor's shape           U8 [1]: E8M0 scale of the tensor
F4         U8 [16 * nblocks]: E2M1 codes, low nibble   U8 [nblocks]: E8M0 scale per block of 32
           first, flattened, zero-padded to 32
I2         U8 [8 * nblocks]: 2-bit codes, four a byte,  U8 [nblocks]: scale per block of 32
           lowest bits first, flattened, zero-padded   (E8M0; 0 = zero block, 255 = NaN block)
=========  ==========================================  ==========================================

``__metadata__`` = ``{"format": "gradientmail/1", "kind": kind, "compression": "none" | "zstd",
"dtypes": canonical JSON {name: logical dtype}, "shapes": canonical JSON {name: shape}}``. The
logical shapes are there because the stored ones cannot always carry them (packed F4/I2, zstd).
'#' never occurs in parameter names, so auxiliary tensors cannot collide with them.

A chunk of a chunked payload (``docs/protocol.md``, "Chunked payloads"; ``plan.py``) is the
same format holding its pieces: a piece that is part of a tensor is stored under the tensor's
name with the 1-D logical shape ``[stop - start]``, and the metadata gains ``"pieces"`` (canonical
JSON ``{name: [start, stop]}`` of the partial pieces) and ``"chunk"`` (``"k/n"`` when ``n > 1``).
Both are absent from a payload of whole tensors in one chunk, which keeps today's bytes; a reader
is told which of them to expect (``meta``) and refuses any other (``PayloadLayoutMismatch``).

Byte layout of ``.safetensors.zst`` (``compression="zstd"``): the same container, with the
same tensor names and metadata, but each stored tensor above is replaced by a ``U8 [len]``
tensor holding ``compress.compress(its bytes, its element size)``: one zstd frame of the byte
planes. Tensors are compressed separately so a reader bounds each by its exact expected size.

Reading validates the header against the expected layout (names, shapes, dtypes, sizes,
metadata) before any tensor is materialised (``header_info``, ``check_header``); anything off is
``PayloadCorrupt``, and intact bytes of other tensors ``PayloadLayoutMismatch``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import PayloadCorrupt, PayloadLayoutMismatch
from . import quant, quant_i2, safetensors_io

FORMAT = "gradientmail/1"
SCALE = "#scale"
LAYOUT_KEYS = ("pieces", "chunk")  # the metadata of a chunk (absent from a whole payload)
COMPRESSIONS = {"": "none", "zstd": "zstd"}


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


class Spec(Protocol):
    """A tensor as a schema lists it (``protocol.records.TensorSpec`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...


def schema_digest(schema: Sequence[Spec]) -> str:
    """sha256 of the canonical JSON ``[[name, dtype, shape], ...]`` sorted by name, a tensor's
    layout appended to its row when it has one (``[name, dtype, shape, layout]``).

    Sorted so the digest names the set of tensors, not the order a framework registers them in
    (payloads are keyed by name, so two nodes listing the same tensors differently interoperate).
    A tensor in the reference layout adds nothing, so runs without layouts keep their digests.
    """
    rows = sorted(
        [s.name, s.dtype, [int(d) for d in s.shape], *([layout] if (layout := getattr(s, "layout", "")) else [])]
        for s in schema
    )
    return sha256_hex(canonical(rows).encode("ascii"))


# ---------------------------------------------------------------------------------------------
# What a payload stores and declares


def storage_layout(shape: Sequence[int], dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """[(suffix, safetensors dtype, shape)] of what a tensor of ``dtype`` is stored as."""
    shape = tuple(int(d) for d in shape)
    if dtype == "F8_E4M3":
        return [("", "F8_E4M3", shape), (SCALE, "U8", (1,))]
    if dtype == "F4":
        nbytes, nscales = quant.f4_sizes(safetensors_io.numel(shape))
        return [("", "U8", (nbytes,)), (SCALE, "U8", (nscales,))]
    if dtype == "I2":
        nbytes, nscales = quant_i2.i2_sizes(safetensors_io.numel(shape))
        return [("", "U8", (nbytes,)), (SCALE, "U8", (nscales,))]
    return [("", quant.STORAGE[dtype], shape)]


def header_cap(names: Any) -> int:
    # Per tensor: two entries of ~100 bytes, its shape (up to 16 dims) in the metadata, and its
    # name up to four times, JSON-escaped twice in the metadata (a non-ASCII char: 12+ bytes).
    return (1 << 20) + sum(1024 + 32 * len(n) for n in names)


def default_payload_cap(expected: Mapping[str, Sequence[int]]) -> int:
    """Largest acceptable payload for these tensors: F32 data (the widest dtype) plus scales,
    worst-case zstd framing overhead, and a header allowance."""
    total = header_cap(expected)
    for shape in expected.values():
        n = safetensors_io.numel(shape)
        total += 4 * n + n // 32 + 1 + n // 128 + 128
    return total


def check_encodable(dtypes: Mapping[str, str], compression: str) -> None:
    """``ValueError`` unless every name and dtype, and the compression, can be written."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}, expected one of {sorted(COMPRESSIONS)}")
    for name, dtype in dtypes.items():
        if not name or "#" in name or name == safetensors_io.METADATA_KEY:
            raise ValueError(f"invalid tensor name {name!r}: empty, reserved, or containing '#'")
        if dtype not in quant.DTYPES:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}, expected one of {quant.DTYPES}")


def metadata(
    kind: str,
    compression: str,
    dtypes: Mapping[str, str],
    shapes: Mapping[str, Sequence[int]],
    meta: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A payload's ``__metadata__`` (a chunk's layout keys added when given)."""
    out = {
        "format": FORMAT,
        "kind": kind,
        "compression": COMPRESSIONS[compression],
        "dtypes": canonical(dict(dtypes)),
        "shapes": canonical({name: [int(d) for d in shape] for name, shape in shapes.items()}),
    }
    for k, v in (meta or {}).items():
        assert k in LAYOUT_KEYS and isinstance(v, str), f"not a chunk's layout metadata: {k!r}"
        out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# A header read back


@dataclass(frozen=True)
class PayloadInfo:
    kind: str
    compression: str
    dtypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    layout: dict[str, str] = field(default_factory=dict)  # a chunk's "pieces" and "chunk" metadata


def header_info(header: Mapping[str, Any], compression: str) -> PayloadInfo:
    """The ``__metadata__`` of a parsed header, checked: ``PayloadCorrupt`` naming the field."""
    meta = header.get(safetensors_io.METADATA_KEY)
    if not isinstance(meta, dict):
        raise PayloadCorrupt("payload has no __metadata__; expected a gradientmail payload")
    if meta.get("format") != FORMAT:
        raise PayloadCorrupt(f"payload format is {meta.get('format')!r}, expected {FORMAT!r}")
    if compression not in COMPRESSIONS:
        raise PayloadCorrupt(f"unknown compression {compression!r}, expected one of {sorted(COMPRESSIONS)}")
    if meta.get("compression") != COMPRESSIONS[compression]:
        raise PayloadCorrupt(
            f"payload says compression {meta.get('compression')!r}, its key says {COMPRESSIONS[compression]!r}"
        )
    kind = meta.get("kind")
    if not isinstance(kind, str):
        raise PayloadCorrupt("payload metadata has no kind")
    try:
        dtypes = json.loads(meta.get("dtypes", ""))
    except ValueError:
        raise PayloadCorrupt(f"payload dtypes metadata is not JSON: {meta.get('dtypes')!r:.200}") from None
    if not isinstance(dtypes, dict) or not all(isinstance(d, str) and d in quant.DTYPES for d in dtypes.values()):
        raise PayloadCorrupt(f"payload dtypes metadata must map names to one of {quant.DTYPES}, found {dtypes!r:.200}")
    try:
        shapes = json.loads(meta.get("shapes", ""))
    except ValueError:
        raise PayloadCorrupt(f"payload shapes metadata is not JSON: {meta.get('shapes')!r:.200}") from None
    if (
        not isinstance(shapes, dict)
        or set(shapes) != set(dtypes)
        or not all(isinstance(s, list) and all(safetensors_io.is_int(d) and d >= 0 for d in s) for s in shapes.values())
    ):
        raise PayloadCorrupt(
            f"payload shapes metadata must give a shape for every tensor in dtypes, found {shapes!r:.200}"
        )
    layout = {k: meta[k] for k in LAYOUT_KEYS if k in meta}
    if not all(isinstance(v, str) for v in layout.values()):
        raise PayloadCorrupt(f"payload chunk metadata must be strings, found {layout!r:.200}")
    return PayloadInfo(kind, compression, dtypes, {k: tuple(v) for k, v in shapes.items()}, layout)


def check_header(
    header: Mapping[str, Any],
    info: PayloadInfo,
    expected: Mapping[str, Sequence[int]],
    *,
    kind: str | None = None,
    dtypes: Mapping[str, str] | None = None,
    meta: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[int, ...]]]]:
    """Check a parsed header against the expected tensors (see ``payload.decode_payload``);
    returns its tensor entries and the exact stored layout ``{stored name: (safetensors dtype,
    shape)}``. ``meta``: the chunk layout metadata expected (``LAYOUT_KEYS``; none for a whole
    payload)."""
    compression = info.compression
    if kind is not None and info.kind != kind:
        raise PayloadCorrupt(f"payload is of kind {info.kind!r}, expected {kind!r}")
    if info.layout != dict(meta or {}):
        raise PayloadLayoutMismatch(
            f"payload is chunk {info.layout.get('chunk', '0/1')} with pieces {info.layout.get('pieces', '{}')!r:.200}, "
            f"expected chunk {(meta or {}).get('chunk', '0/1')} with pieces {(meta or {}).get('pieces', '{}')!r:.200}"
        )
    if set(info.dtypes) != set(expected):
        missing, extra = sorted(set(expected) - set(info.dtypes)), sorted(set(info.dtypes) - set(expected))
        raise PayloadLayoutMismatch(
            f"payload tensors differ from the expected: missing {missing[:10]}, unexpected {extra[:10]}"
        )
    for name, shape in expected.items():
        if info.shapes[name] != tuple(shape):
            raise PayloadLayoutMismatch(
                f"tensor {name!r}: expected shape {list(shape)}, payload has {list(info.shapes[name])}"
            )
        if dtypes is not None and info.dtypes[name] != dtypes[name]:
            raise PayloadLayoutMismatch(
                f"tensor {name!r}: expected dtype {dtypes[name]}, payload has {info.dtypes[name]}"
            )

    # The exact stored layout follows from the expected shapes and the declared dtypes.
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in expected.items():
        for suffix, st_dtype, st_shape in storage_layout(shape, info.dtypes[name]):
            layout[name + suffix] = (st_dtype, st_shape)
    entries = {k: v for k, v in header.items() if k != safetensors_io.METADATA_KEY}
    if compression == "zstd":
        # Compressed sizes are free; the names are not, and each must be a U8 [n] blob.
        safetensors_io.check_names(entries, layout)
        for k, entry in entries.items():
            if entry["dtype"] != "U8" or len(entry["shape"]) != 1:
                raise PayloadCorrupt(
                    f"tensor {k!r}: expected a compressed U8 [n], found {entry['dtype']} {entry['shape']}"
                )
    else:
        safetensors_io.check_layout(entries, layout)
    return entries, layout
