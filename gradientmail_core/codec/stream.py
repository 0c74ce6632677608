"""Payloads as streams: produced, hashed and compressed piece by piece; read, verified and
decoded as parts arrive. The bytes are ``payload.encode_payload``'s, byte for byte.

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
tensors (zstd): never the whole payload.

Reading (``decode_stream``): the header is checked against the expected layout as soon as it has
arrived; plain F32/F16/BF16 tensors are decoded into their output arrays piece by piece, others
once their bytes (and scale) are in. The sha256 and size are checked at the end, and nothing is
returned before: a stream cut short, too long, or with any byte changed is ``PayloadCorrupt``.
"""

from __future__ import annotations

import hashlib
import struct
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

import numpy as np

from ..errors import PayloadCorrupt, PayloadLayoutMismatch
from . import quant, safetensors_io
from .payload import (
    SCALE,
    WORKERS,
    _check,
    check_header,
    default_payload_cap,
    header_cap,
    header_info,
    metadata,
    storage_layout,
)
from .payload import codec as zstd_codec

Chunk = bytes | bytearray | memoryview
PIECE = 4 << 20  # bytes per piece of a plain stream (and per read of the spool)
SPOOL_MEMORY = 64 << 20  # compressed tensors kept in memory up to this; beyond, a temporary file
# Quantized elementwise: a slice of the input quantizes to the same slice of the output.
ELEMENTWISE = ("F32", "F16", "BF16")


def _u8(arr: np.ndarray) -> memoryview:
    return safetensors_io.as_bytes(np.ascontiguousarray(arr))


class PayloadStream:
    """A payload that can be produced again, piece by piece. ``size`` and ``sha256`` are known
    from the first pass; ``chunks()`` yields the bytes. Close it (or use ``with``) to drop a spool."""

    def __init__(self, head: bytes, parts: Callable[[], Iterator[Chunk]], spool: IO[bytes] | None = None) -> None:
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
    if isinstance(dtypes, str):
        dtypes = dict.fromkeys(tensors, dtypes)
    if set(dtypes) != set(tensors):
        raise ValueError(f"dtypes name {sorted(set(dtypes) ^ set(tensors))[:10]} not matching the tensors")
    _check(dtypes, compression)
    shapes = {name: tuple(int(d) for d in np.shape(x)) for name, x in tensors.items()}
    source = _FloatSource(tensors, dtypes, f8_scales or {})
    return _stream(source, dict(dtypes), shapes, kind, compression, meta)


def stream_quantized(
    tensors: Mapping[str, quant.QTensor], *, kind: str, compression: str = "", meta: Mapping[str, str] | None = None
) -> PayloadStream:
    """Tensors quantized already -> the stream of ``encode_quantized(tensors, ...)``'s bytes."""
    dtypes = {name: q.dtype for name, q in tensors.items()}
    _check(dtypes, compression)
    shapes = {name: tuple(q.shape) for name, q in tensors.items()}
    return _stream(_QuantizedSource(tensors), dtypes, shapes, kind, compression, meta)


def _arrays(q: quant.QTensor) -> list[np.ndarray]:
    return [q.data] if q.scale is None else [q.data, q.scale]


class _QuantizedSource:
    """Stored tensors of tensors quantized already: views of their arrays."""

    def __init__(self, tensors: Mapping[str, quant.QTensor]) -> None:
        self.tensors = tensors

    def restart(self) -> None:
        pass

    def whole(self, name: str) -> list[np.ndarray]:
        return _arrays(self.tensors[name])

    def pieces(self, name: str, part: int) -> Iterator[Chunk]:
        view = _u8(_arrays(self.tensors[name])[part])
        for i in range(0, view.nbytes, PIECE):
            yield view[i : i + PIECE]


class _FloatSource:
    """Stored tensors of float32 tensors, quantized piece by piece where the dtype allows."""

    def __init__(self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str], scales: Mapping[str, int]) -> None:
        self.tensors, self.dtypes, self.scales = tensors, dtypes, scales
        # A whole-tensor quantization (scaled dtypes) kept until each of its parts has gone out.
        self._held: dict[str, tuple[list[np.ndarray], set[int]]] = {}

    def restart(self) -> None:
        self._held.clear()  # a pass given up half-way leaves nothing behind

    def whole(self, name: str) -> list[np.ndarray]:
        return _arrays(quant.quantize(self.tensors[name], self.dtypes[name], f8_scale=self.scales.get(name)))

    def pieces(self, name: str, part: int) -> Iterator[Chunk]:
        dtype = self.dtypes[name]
        if dtype in ELEMENTWISE:
            flat = np.ravel(self.tensors[name])
            step = PIECE // 4
            for i in range(0, flat.size, step):
                yield _u8(quant.quantize(flat[i : i + step], dtype).data)
            return
        arrays, left = self._held.get(name) or (self.whole(name), set(range(len(storage_layout((0,), dtype)))))
        left.discard(part)
        if left:
            self._held[name] = (arrays, left)
        else:
            self._held.pop(name, None)
        view = _u8(arrays[part])
        for i in range(0, view.nbytes, PIECE):
            yield view[i : i + PIECE]


def _stream(
    source: Any,
    dtypes: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    kind: str,
    compression: str,
    meta: Mapping[str, str] | None = None,
) -> PayloadStream:
    head_meta = metadata(kind, compression, dtypes, shapes, meta)
    # stored name -> (logical name, part index, safetensors dtype, stored shape)
    stored: dict[str, tuple[str, int, str, tuple[int, ...]]] = {}
    for name in dtypes:
        for i, (suffix, st_dtype, st_shape) in enumerate(storage_layout(shapes[name], dtypes[name])):
            stored[name + suffix] = (name, i, st_dtype, tuple(st_shape))
    if compression == "zstd":
        return _zstd_stream(source, dtypes, shapes, head_meta)
    head, order = safetensors_io.header({k: (v[2], v[3]) for k, v in stored.items()}, head_meta)

    def parts() -> Iterator[Chunk]:
        source.restart()
        for k in order:
            name, i, _, _ = stored[k]
            yield from source.pieces(name, i)

    return PayloadStream(head, parts)


def _bounded(fn: Callable[[str], Any], names: list[str], workers: int) -> Iterator[Any]:
    """``map(fn, names)`` on ``workers`` threads, at most ``workers`` results waiting at a time."""
    if workers <= 1 or len(names) <= 1:
        yield from map(fn, names)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gradientmail-codec") as pool:
        pending: deque[Future[Any]] = deque()
        for name in names:
            pending.append(pool.submit(fn, name))
            if len(pending) >= workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _zstd_stream(
    source: Any, dtypes: dict[str, str], shapes: dict[str, tuple[int, ...]], metadata: dict
) -> PayloadStream:
    def compress_one(name: str) -> list[tuple[str, bytes]]:
        out = []
        for (suffix, _, _), arr in zip(storage_layout(shapes[name], dtypes[name]), source.whole(name), strict=True):
            arr = np.ascontiguousarray(arr)
            out.append((name + suffix, zstd_codec.compress(arr.reshape(-1).view(np.uint8), arr.dtype.itemsize)))
        return out

    # Names, not logical order, decide where a blob sits in the file; the spool is read by offset.
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY)  # noqa: SIM115 - the stream owns it
    where: dict[str, tuple[int, int]] = {}
    try:
        for blobs in _bounded(compress_one, list(dtypes), WORKERS):
            for k, blob in blobs:
                where[k] = (spool.tell(), len(blob))
                spool.write(blob)
    except BaseException:
        spool.close()
        raise
    head, order = safetensors_io.header({k: ("U8", (size,)) for k, (_, size) in where.items()}, metadata)

    def parts() -> Iterator[Chunk]:
        for k in order:
            offset, size = where[k]
            spool.seek(offset)
            while size > 0:
                piece = spool.read(min(size, PIECE))
                if not piece:
                    raise PayloadCorrupt(f"payload spool ended early at {k!r}")
                size -= len(piece)
                yield piece

    return PayloadStream(head, parts, spool)


# ---------------------------------------------------------------------------------------------
# Reading


class _Incoming:
    """Exact-size reads from a chunk iterator, hashing and counting every byte that arrives."""

    def __init__(self, chunks: Iterable[Chunk], size: int, key: str) -> None:
        self.it, self.size, self.key = iter(chunks), size, key
        self.digest = hashlib.sha256()
        self.got = 0
        self.buf = memoryview(b"")

    def _pull(self) -> bool:
        for chunk in self.it:
            view = memoryview(chunk).cast("B")
            if not view.nbytes:
                continue
            self.got += view.nbytes
            if self.got > self.size:
                raise PayloadCorrupt(f"{self.key}: more than the {self.size} bytes its reference declares")
            self.digest.update(view)
            self.buf = view
            return True
        return False

    def read(self, n: int) -> memoryview:
        if self.buf.nbytes >= n:
            out, self.buf = self.buf[:n], self.buf[n:]
            return out
        joined = bytearray(n)
        filled = 0
        while filled < n:
            if not self.buf.nbytes and not self._pull():
                raise PayloadCorrupt(f"{self.key}: cut short at {self.got} of {self.size} bytes")
            k = min(n - filled, self.buf.nbytes)
            joined[filled : filled + k] = self.buf[:k]
            self.buf = self.buf[k:]
            filled += k
        return memoryview(joined)

    def drain(self) -> None:
        """Read (and hash) the rest, ``PIECE`` at a time."""
        left = self.size - self.got + self.buf.nbytes
        while left > 0:
            left -= self.read(min(left, PIECE)).nbytes

    def finish(self, sha256: str) -> None:
        if self.buf.nbytes or self._pull():
            raise PayloadCorrupt(f"{self.key}: bytes after the last tensor")
        if self.got != self.size:
            raise PayloadCorrupt(f"{self.key}: cut short at {self.got} of {self.size} bytes")
        if self.digest.hexdigest() != sha256:
            raise PayloadCorrupt(
                f"{self.key}: expected sha256 {sha256[:12]}..., found {self.digest.hexdigest()[:12]}..."
            )


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
    src = _Incoming(chunks, size, key)
    (n,) = struct.unpack("<Q", src.read(8))
    limit = min(header_cap(expected), safetensors_io.HARD_HEADER_CAP)
    if n < 2 or n > limit or 8 + n > size:
        raise PayloadCorrupt(f"{key}: safetensors header length is {n} bytes, expected between 2 and {limit}")
    start = bytes(src.read(n))
    header, _ = safetensors_io.read_header(struct.pack("<Q", n) + start, max_header_bytes=limit, total=size)
    info = header_info(header, compression)
    try:
        entries, layout = check_header(header, info, expected, kind=kind, dtypes=dtypes, meta=meta)
    except PayloadLayoutMismatch:
        # Intact bytes of other tensors (a ``schema`` rejection) or damaged ones (``corrupt``):
        # only the hash tells, as it does when the payload is read whole.
        src.drain()
        src.finish(sha256)
        raise

    out: dict[str, np.ndarray] = {}
    held: dict[str, np.ndarray] = {}
    for k in sorted(entries, key=lambda e: entries[e]["data_offsets"][0]):
        begin, stop = entries[k]["data_offsets"]
        name = k.split("#", 1)[0]
        st_dtype, st_shape = layout[k]
        np_dtype = safetensors_io.NUMPY_DTYPES[st_dtype]
        if compression != "zstd" and info.dtypes[name] in ELEMENTWISE:
            out[name] = _pieces_into(src, stop - begin, np_dtype, info.dtypes[name], tuple(expected[name]))
            continue
        blob = src.read(stop - begin)
        if compression == "zstd":
            nbytes = safetensors_io.DTYPE_SIZES[st_dtype] * safetensors_io.numel(st_shape)
            planes = zstd_codec.decompress_array(blob, np_dtype.itemsize, nbytes)
            if planes.size != nbytes:
                raise PayloadCorrupt(f"tensor {k!r}: decompressed to {planes.size} bytes, expected {nbytes}")
            held[k] = planes.view(np_dtype).reshape(st_shape)
        else:
            held[k] = np.frombuffer(blob, dtype=np_dtype).reshape(st_shape)
        suffixes = [s for s, _, _ in storage_layout(expected[name], info.dtypes[name])]
        if all(name + s in held for s in suffixes):
            arrays = [held.pop(name + s) for s in suffixes]
            shape = tuple(int(d) for d in expected[name])
            scale = arrays[1] if len(arrays) > 1 else None
            out[name] = quant.dequantize(quant.QTensor(info.dtypes[name], shape, arrays[0], scale))
    src.finish(sha256)
    return {name: out[name] for name in expected}


def _pieces_into(src: _Incoming, nbytes: int, np_dtype: np.dtype, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """An elementwise tensor's bytes, read ``PIECE`` at a time into a fresh float32 array."""
    flat = np.empty(safetensors_io.numel(shape), np.float32)
    step = max(PIECE // np_dtype.itemsize, 1)
    for i in range(0, flat.size, step):
        n = min(step, flat.size - i)
        raw = np.frombuffer(src.read(n * np_dtype.itemsize), dtype=np_dtype)
        if dtype == "F32":
            flat[i : i + n] = raw
        else:
            flat[i : i + n] = quant.dequantize(quant.QTensor(dtype, (n,), raw))
    assert flat.size * np_dtype.itemsize == nbytes  # check_header matched the layout
    return flat.reshape(shape)


__all__ = ["PIECE", "SCALE", "PayloadStream", "decode_stream", "stream_payload", "stream_quantized"]
