"""Payloads as one ``bytes``: the format (``header.py``) written and read whole.

The format has one writer (``writer.py``) and one reader (``reader.py``); ``stream.py`` runs them
over parts, this module over whole bytes. ``encode_payload`` and ``encode_quantized`` produce the
writer's bytes once and join them (no hash pass: the caller names the key from the result);
``decode_payload`` is the reader over one buffer, not hashed (the caller has checked the bytes,
or does not need to). The output, or the input, is all in memory anyway, so both work on
``WORKERS`` pieces or tensors at a time (threads from ``budget.PARALLEL_BYTES``), and compressed
tensors wait for their place in memory, as they are.

The names of the format (``SCALE``, ``storage_layout``, ``metadata``, ``header_info``,
``check_header``, ``PayloadInfo``, the caps, ``schema_digest``, ``sha256_hex``) stay importable
from here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import PayloadCorrupt
from . import compress as codec  # the byte-plane zstd codec (tests patch it as ``payload.codec``)
from . import quant, reader, safetensors_io, stream, writer
from .budget import Budget
from .header import (
    COMPRESSIONS,
    FORMAT,
    LAYOUT_KEYS,
    SCALE,
    PayloadInfo,
    check_header,
    default_payload_cap,
    header_cap,
    header_info,
    metadata,
    schema_digest,
    sha256_hex,
    storage_layout,
)

# Threads a one-shot encode or decode uses (``bench/codec.py --workers`` sets it); a stream's
# are ``stream.WORKERS``.
WORKERS = min(4, os.cpu_count() or 1)


def encode_payload(
    tensors: Mapping[str, np.ndarray],
    dtypes: Mapping[str, str] | str,
    *,
    kind: str,
    compression: str = "",
    meta: Mapping[str, str] | None = None,
    f8_scales: Mapping[str, int] | None = None,
) -> bytes:
    """float32 tensors -> payload bytes, each stored in its dtype. Equal input gives equal bytes.
    ``meta``: a chunk's layout metadata (``LAYOUT_KEYS``); ``f8_scales``: the E8M0 scale byte an
    F8_E4M3 tensor is encoded with (a piece takes its whole tensor's), else its own."""
    source = writer.floats(tensors, dtypes, compression, f8_scales)
    return _join(source, kind, compression, meta)


def encode_quantized(
    tensors: Mapping[str, quant.QTensor], *, kind: str, compression: str = "", meta: Mapping[str, str] | None = None
) -> bytes:
    """Tensors quantized already (by a device-side quantizer) -> payload bytes: the bytes
    ``encode_payload`` gives for the float32 tensors they are the quantization of."""
    return _join(writer.quantized(tensors, compression), kind, compression, meta)


def _join(source: writer.Source, kind: str, compression: str, meta: Mapping[str, str] | None) -> bytes:
    budget = Budget(workers=WORKERS, piece=stream.PIECE, spool_memory=math.inf)
    return writer.encoding(source, kind=kind, compression=compression, meta=meta, budget=budget).join()


def decode_payload(
    data: bytes | memoryview,
    expected: Mapping[str, Sequence[int]],
    *,
    compression: str = "",
    max_bytes: int | None = None,
    kind: str | None = None,
    dtypes: Mapping[str, str] | None = None,
    meta: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Payload bytes -> {name: float32 array of the expected shape} (fresh, writable arrays).

    The header must describe exactly the ``expected`` tensors (and, with ``kind``, be of that
    kind; with ``dtypes``, store each in that logical dtype); this is checked in full before any
    tensor data is read. A well-formed payload of other tensor names, shapes or dtypes raises
    ``PayloadLayoutMismatch`` (a ``PayloadCorrupt``); broken bytes raise ``PayloadCorrupt``.
    """
    view = memoryview(data).cast("B")
    cap = default_payload_cap(expected) if max_bytes is None else max_bytes
    if view.nbytes > cap:
        raise PayloadCorrupt(f"payload is {view.nbytes} bytes, above the cap of {cap}")
    return reader.decode_parts(
        [view],
        expected,
        size=view.nbytes,
        sha256=None,
        compression=compression,
        kind=kind,
        dtypes=dtypes,
        meta=meta,
        key=None,
        budget=Budget(workers=WORKERS, piece=stream.PIECE),
    )


def payload_info(data: bytes | memoryview, compression: str = "", *, max_header_bytes: int = 64 << 20) -> PayloadInfo:
    """Kind, compression and logical dtypes of a payload, from its header alone."""
    header, _ = safetensors_io.read_header(data, max_header_bytes=max_header_bytes)
    return header_info(header, compression)


def payload_dtypes(data: bytes | memoryview, compression: str = "") -> dict[str, str]:
    return payload_info(data, compression).dtypes


__all__ = [
    "COMPRESSIONS",
    "FORMAT",
    "LAYOUT_KEYS",
    "SCALE",
    "WORKERS",
    "PayloadInfo",
    "check_header",
    "codec",
    "decode_payload",
    "default_payload_cap",
    "encode_payload",
    "encode_quantized",
    "header_cap",
    "header_info",
    "metadata",
    "payload_dtypes",
    "payload_info",
    "schema_digest",
    "sha256_hex",
    "storage_layout",
]
