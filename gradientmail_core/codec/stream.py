"""Payloads as streams: produced, hashed and compressed piece by piece; read, verified and
decoded as parts arrive. The bytes are ``payload.encode_payload``'s, byte for byte: both are the
one writer's (``writer.py``), and both are read by the one reader (``reader.py``).

Writing (``stream_payload``, ``stream_quantized`` -> ``PayloadStream``). A payload's key carries
the sha256 of its bytes, so the hash must be known before the first byte goes out:

1. ``.safetensors``: the header follows from the dtypes and shapes alone. A first pass quantizes
   the tensors piece by piece (``PIECE`` bytes of float32 at a time), hashes and forgets them;
   ``chunks()`` does it again for the upload. The extra pass costs a quantize and a sha256 (a few
   GB/s), against a network that moves well under 1 GB/s.
2. ``.safetensors.zst``: the header holds every tensor's compressed size, known only once all are
   compressed. Each tensor is quantized and compressed once, in the first pass, into a spool
   (memory up to ``SPOOL_MEMORY``, a temporary file beyond), then hashed; ``chunks()`` reads the
   spool. Compression happens once; a tensor's quantized and compressed forms live while it is
   compressed (``WORKERS`` at a time).

``chunks()`` hashes what it yields and raises ``PayloadCorrupt`` after the last chunk if the bytes
differ from the first pass, so a mailbox's ``put_stream`` aborts instead of storing them.
Memory beyond the input tensors: about ``PIECE`` (plain F32/F16/BF16), one tensor's quantized
form (F8_E4M3, F4: a whole-tensor scale or block scales), or ``SPOOL_MEMORY`` plus ``WORKERS``
tensors being compressed and as many compressed ones waiting for the spool (zstd): never the
whole payload.

Reading (``decode_stream``): the header is checked against the expected layout as soon as it has
arrived; plain F32/F16/BF16 tensors are decoded into their output arrays piece by piece, others
once their bytes (and scale) are in, one at a time. The sha256 and size are checked at the end,
and nothing is returned before: a stream cut short, too long, or with any byte changed is
``PayloadCorrupt``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import PayloadCorrupt
from . import quant, reader, writer
from .budget import Budget
from .header import SCALE, default_payload_cap
from .writer import ELEMENTWISE, Chunk

PIECE = 4 << 20  # bytes per piece of a plain stream (and per read of the spool)
SPOOL_MEMORY = 64 << 20  # compressed tensors kept in memory up to this; beyond, a temporary file
WORKERS = min(4, os.cpu_count() or 1)  # tensors a zstd stream compresses at once


class PayloadStream:
    """A payload that can be produced again, piece by piece. ``size`` and ``sha256`` are known
    from the first pass; ``chunks()`` yields the bytes. Close it (or use ``with``) to drop a spool."""

    def __init__(self, head: bytes, parts: Callable[[], Iterator[Chunk]], spool: writer.Spool | None = None) -> None:
        self._head, self._parts, self._spool = head, parts, spool
        digest, size = hashlib.sha256(head), len(head)
        for chunk in parts():
            digest.update(chunk)
            size += len(chunk)
        self.sha256: str = digest.hexdigest()
        self.size: int = size

    def chunks(self) -> Iterator[Chunk]:
        """The payload's bytes in order. After the last chunk, ``PayloadCorrupt`` if they were not
        the bytes the first pass hashed (the input changed underneath, or memory is failing)."""
        digest, size = hashlib.sha256(self._head), len(self._head)
        yield self._head
        for chunk in self._parts():
            digest.update(chunk)
            size += len(chunk)
            yield chunk
        if size != self.size or digest.hexdigest() != self.sha256:
            raise PayloadCorrupt(
                f"payload produced again gave {size} bytes with sha256 {digest.hexdigest()[:12]}..., "
                f"the first pass {self.size} with {self.sha256[:12]}...; not written"
            )

    def read(self) -> bytes:
        """The whole payload as one ``bytes`` (small payloads, tests)."""
        return b"".join(self.chunks())

    def __len__(self) -> int:
        return self.size

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()
            self._spool = None

    def __enter__(self) -> PayloadStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Writing


def stream_payload(
    tensors: Mapping[str, np.ndarray],
    dtypes: Mapping[str, str] | str,
    *,
    kind: str,
    compression: str = "",
    meta: Mapping[str, str] | None = None,
    f8_scales: Mapping[str, int] | None = None,
) -> PayloadStream:
    """float32 tensors -> the stream of ``encode_payload(tensors, dtypes, ...)``'s bytes (``meta``
    and ``f8_scales`` as there)."""
    return _stream(writer.floats(tensors, dtypes, compression, f8_scales), kind, compression, meta)


def stream_quantized(
    tensors: Mapping[str, quant.QTensor], *, kind: str, compression: str = "", meta: Mapping[str, str] | None = None
) -> PayloadStream:
    """Tensors quantized already -> the stream of ``encode_quantized(tensors, ...)``'s bytes."""
    return _stream(writer.quantized(tensors, compression), kind, compression, meta)


def _stream(source: writer.Source, kind: str, compression: str, meta: Mapping[str, str] | None) -> PayloadStream:
    # A plain stream is produced twice, each time a piece or a tensor at a time (its memory
    # bound); a zstd one compresses once, into its spool, WORKERS tensors at a time.
    budget = Budget(workers=WORKERS if compression == "zstd" else 1, piece=PIECE, spool_memory=SPOOL_MEMORY)
    enc = writer.encoding(source, kind=kind, compression=compression, meta=meta, budget=budget)
    return PayloadStream(enc.head, enc.parts, enc.spool)


# ---------------------------------------------------------------------------------------------
# Reading


def decode_stream(
    chunks: Iterable[Chunk],
    expected: Mapping[str, Sequence[int]],
    *,
    size: int,
    sha256: str,
    compression: str = "",
    max_bytes: int | None = None,
    kind: str | None = None,
    dtypes: Mapping[str, str] | None = None,
    key: str = "payload",
    meta: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """``decode_payload`` of the bytes ``chunks`` yields, decoded as they arrive, returned only
    once all ``size`` bytes have come and hash to ``sha256`` (``PayloadCorrupt`` otherwise)."""
    cap = default_payload_cap(expected) if max_bytes is None else max_bytes
    if size > cap:
        raise PayloadCorrupt(f"{key}: {size} bytes, above the cap of {cap}")
    return reader.decode_parts(
        chunks,
        expected,
        size=size,
        sha256=sha256,
        compression=compression,
        kind=kind,
        dtypes=dtypes,
        meta=meta,
        key=key,
        budget=Budget(piece=PIECE),
    )


__all__ = [
    "ELEMENTWISE",
    "PIECE",
    "SCALE",
    "Chunk",
    "PayloadStream",
    "decode_stream",
    "stream_payload",
    "stream_quantized",
]
