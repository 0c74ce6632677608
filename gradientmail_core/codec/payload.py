"""Payloads: the one writer of the format's bytes (``header.py``) and its one strict reader.

- ``encode_payload(tensors, dtypes, *, kind, compression, chunk, f8_scales, stream)``: float32
  arrays, each stored in its dtype (or ``QTensor``s quantized already by a device quantizer,
  stored as they are) -> the payload's ``bytes``, or with ``stream=True`` a ``PayloadStream``
  that produces them piece by piece. ``chunk``: the payload is that chunk of a chunked payload
  (``plan.ChunkSpec``) of the tensors or of its pieces' values. Equal input gives equal bytes,
  streamed or not.
- ``decode_payload(data, expected, *, size, sha256, key, compression, max_bytes, kind, dtypes)``:
  whole bytes, or the parts of a stream decoded as they arrive (``size`` and ``sha256`` then
  required), checked against ``expected`` (shapes, or a ``ChunkSpec``) -> float32 arrays.

Writing. A payload's key carries the sha256 of its bytes, so a stream must know the hash before
its first byte goes out:

1. ``.safetensors``: the header follows from the dtypes and shapes alone. ``parts()`` quantizes
   an elementwise tensor (F32/F16/BF16 of float32 input) ``PIECE`` bytes of float32 at a time;
   any other whole, where its first stored part is needed, kept until its last has gone out (a
   tensor's data and scale need not be neighbours in the file). A stream runs ``parts()`` twice:
   a first pass hashes and forgets them, ``chunks()`` produces them again for the upload. The
   extra pass costs a quantize and a sha256 (a few GB/s), against a network that moves well
   under 1 GB/s.
2. ``.safetensors.zst``: the header holds every tensor's compressed size, known only once all are
   compressed. Each tensor is quantized and compressed once, into a spool (memory up to
   ``SPOOL_MEMORY``, a temporary file beyond), which ``parts()`` reads.

``chunks()`` hashes what it yields and raises ``PayloadCorrupt`` after the last chunk if the bytes
differ from the first pass, so a mailbox's ``put_stream`` aborts instead of storing them. A
stream's memory beyond the input tensors: about ``PIECE`` (plain F32/F16/BF16), one tensor's
quantized form (F8_E4M3, F4, I2), or ``SPOOL_MEMORY`` plus ``WORKERS`` tensors being compressed
and as many compressed ones waiting for the spool (zstd): never the whole payload. Whole bytes
are produced once and joined (no hash pass: the caller names the key from the result).

Reading. The header is checked against the expected layout as soon as it has arrived, before any
tensor is materialised; plain F32/F16/BF16 tensors are decoded into their output arrays ``PIECE``
bytes at a time as they arrive (unless all their bytes are here already), others once their
bytes (and scale) are in. The size, and with a ``sha256`` the hash (always, for parts), are
checked at the end, and nothing is returned before: bytes cut short, too long, or with any byte
changed are ``PayloadCorrupt``; a well-formed payload of other tensors ``PayloadLayoutMismatch``.

Threads (``Budget``): whole bytes, in memory anyway, are encoded and decoded ``WORKERS`` pieces or
tensors at a time, and a zstd stream compresses ``WORKERS`` tensors at once; a plain stream keeps
to one piece or tensor at a time (its memory bound). Threads start from ``PARALLEL_BYTES`` of
input; results are put in place in order, so the bytes never depend on them. The bytes a piece
is decoded from are those its producer yielded (``mailbox.contract``: a yielded chunk stays valid).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import struct
import tempfile
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Literal, overload

import numpy as np

from ..ahead import call, ordered
from ..errors import PayloadCorrupt, PayloadLayoutMismatch
from . import compress as zstd_codec
from . import quant, safetensors_io
from .header import (
    check_encodable,
    check_header,
    default_payload_cap,
    header_cap,
    header_info,
    metadata,
    storage_layout,
)
from .plan import ChunkSpec, is_whole, numel

PIECE = 4 << 20  # bytes of a plain tensor encoded, decoded or read (from the spool) at a time
SPOOL_MEMORY = 64 << 20  # a stream's compressed tensors kept in memory up to this; beyond, a temporary file
WORKERS = min(4, os.cpu_count() or 1)  # few, as this runs beside training (``bench/codec.py --workers``)
PARALLEL_BYTES = 8 << 20  # of float32 input or of payload: below this, thread start-up costs more than it saves

Chunk = bytes | bytearray | memoryview
Values = Mapping[str, np.ndarray] | Mapping[str, quant.QTensor]
Dtypes = Mapping[str, str] | str


# The same arguments; ``stream`` decides what comes back.
@overload
def encode_payload(tensors: Values, dtypes: Dtypes | None = ..., *, kind: str, compression: str = ...,
                   chunk: ChunkSpec | None = ..., f8_scales: Mapping[str, int] | None = ...,
                   stream: Literal[False] = ...) -> bytes: ...  # fmt: skip
@overload
def encode_payload(tensors: Values, dtypes: Dtypes | None = ..., *, kind: str, compression: str = ...,
                   chunk: ChunkSpec | None = ..., f8_scales: Mapping[str, int] | None = ...,
                   stream: Literal[True]) -> PayloadStream: ...  # fmt: skip
def encode_payload(
    tensors: Values,
    dtypes: Dtypes | None = None,
    *,
    kind: str,
    compression: str = "",
    chunk: ChunkSpec | None = None,
    f8_scales: Mapping[str, int] | None = None,
    stream: bool = False,
) -> bytes | PayloadStream:
    """Tensors -> the payload of ``kind``: its bytes, or with ``stream`` a ``PayloadStream`` of the
    same bytes. ``tensors``: float32 arrays, each stored in its ``dtypes`` (one for all, or by
    name), or ``QTensor``s quantized already (``dtypes``, if given, must be theirs).

    ``chunk``: the payload is that chunk; each of its pieces' values is either the whole tensor
    (cut here; tensors outside the chunk are ignored) or exactly the piece's (flat, or in the
    tensor's shape when whole). A piece quantizes to the slice of its whole tensor's quantization
    (pieces start on 32-element blocks); for an F8_E4M3 piece that means the whole tensor's
    scale byte (``quant.e4m3_scale_byte``), taken from the whole tensor when given, else from
    ``f8_scales``, which it must then be in. ``ValueError`` for anything that cannot be written."""
    source = _source(tensors, dtypes, compression, chunk, f8_scales)
    meta = None if chunk is None else chunk.meta
    if stream:
        # A plain stream is produced twice, each time a piece or a tensor at a time (its memory
        # bound); a zstd one compresses once, into its spool, WORKERS tensors at a time.
        workers = WORKERS if compression == "zstd" else 1
        return PayloadStream(_encoding(source, kind, compression, meta, Budget(workers, PIECE, SPOOL_MEMORY)))
    return _encoding(source, kind, compression, meta, Budget(WORKERS, PIECE)).join()


def decode_payload(
    data: bytes | bytearray | memoryview | Iterable[Chunk],
    expected: Mapping[str, Sequence[int]] | ChunkSpec,
    *,
    size: int | None = None,
    sha256: str | None = None,
    key: str | None = None,
    compression: str = "",
    max_bytes: int | None = None,
    kind: str | None = None,
    dtypes: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """A payload -> ``{name: float32 array of the expected shape}`` (fresh, writable arrays).

    ``data``: the whole bytes (hashed only if a ``sha256`` is given, held to ``size`` if one is), or
    an iterable of its parts, decoded as they arrive and returned once all ``size`` bytes have
    come and hash to ``sha256``.
    ``expected``: ``{name: shape}``, or a ``ChunkSpec`` (the chunk's pieces, ``{piece name:
    values}``, a part 1-D; its layout metadata expected; ``dtypes`` by tensor name). The header
    must describe exactly these tensors (with ``kind``, be of that kind; with ``dtypes``, store
    each in that logical dtype), checked in full before any tensor data is read. ``max_bytes``
    defaults to the layout's cap (``default_payload_cap``); a larger one is lowered to it. ``key``
    names the object in every message (for parts, "payload" without one)."""
    parts: Iterable[Chunk]
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data).cast("B")
        parts, size, workers = [view], view.nbytes if size is None else size, WORKERS
    elif size is None or sha256 is None:
        raise ValueError("decoding a payload's parts as they arrive needs its size and sha256 (its ref)")
    else:
        parts, key, workers = data, key or "payload", 1
    meta: Mapping[str, str] | None = None
    if isinstance(expected, ChunkSpec):
        spec = expected
        meta, expected = spec.meta, spec.expected
        dtypes = None if dtypes is None else {p.name: dtypes[p.name] for p in spec.pieces}
    cap = default_payload_cap(expected) if max_bytes is None else min(max_bytes, default_payload_cap(expected))
    if size > cap:
        raise PayloadCorrupt(f"{key or 'payload'}: {size} bytes, above the cap of {cap}")
    return _decode(parts, expected, size, sha256, compression, kind, dtypes, meta, key, Budget(workers, PIECE))


class PayloadStream:
    """A payload that can be produced again, piece by piece. ``size`` and ``sha256`` are known
    from the first pass; ``chunks()`` yields the bytes. Close it (or use ``with``) to drop a spool."""

    def __init__(self, encoding: Encoding) -> None:
        self._encoding = encoding
        digest, size = hashlib.sha256(encoding.head), len(encoding.head)
        for chunk in encoding.parts():
            digest.update(chunk)
            size += len(chunk)
        self.sha256: str = digest.hexdigest()
        self.size: int = size

    def chunks(self) -> Iterator[Chunk]:
        """The payload's bytes in order. After the last chunk, ``PayloadCorrupt`` if they were not
        the bytes the first pass hashed (the input changed underneath, or memory is failing)."""
        head = self._encoding.head
        digest, size = hashlib.sha256(head), len(head)
        yield head
        for chunk in self._encoding.parts():
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
        if self._encoding.spool is not None:
            self._encoding.spool.close()

    def __enter__(self) -> PayloadStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Budget:
    """``workers``: pieces or tensors in the works at once, on threads when more than one (numpy
    and zstd release the GIL). ``piece``: bytes of a plain tensor encoded, decoded or read at a
    time. ``spool_memory``: compressed tensors kept in memory up to this many bytes, the rest in a
    temporary file."""

    workers: int
    piece: int
    spool_memory: float = math.inf

    def workers_for(self, nbytes: int) -> int:
        return self.workers if nbytes >= PARALLEL_BYTES else 1


def _bounded(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> Generator[Any, None, None]:
    """``map(fn, items)`` in order, on ``workers`` threads, at most ``2 * workers`` items
    submitted and not yet handed on (so a thread that finishes before the oldest finds the next
    item waiting); with one worker, lazily on the caller's thread (``ahead.ordered``)."""
    return ordered(fn, items, threads=workers if workers > 1 else 0, queued=2 * workers, name="codec")


# ---------------------------------------------------------------------------------------------
# The writer


@dataclass(frozen=True)
class Source:
    """What a payload is written from: its tensors' logical dtypes and shapes; ``whole(name)``,
    a tensor's stored arrays (``storage_layout``'s order); and for float32 input, ``flat(name)``,
    its flat values, of which an elementwise dtype is quantized a slice at a time."""

    dtypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    whole: Callable[[str], list[np.ndarray]]
    flat: Callable[[str], np.ndarray] | None = None

    def elementwise(self, name: str) -> bool:
        return self.flat is not None and self.dtypes[name] in quant.ELEMENTWISE


def _source(
    tensors: Values,
    dtypes: Dtypes | None,
    compression: str,
    chunk: ChunkSpec | None,
    f8_scales: Mapping[str, int] | None,
) -> Source:
    """The ``Source`` of ``encode_payload``'s arguments, checked."""
    scales = dict(f8_scales or {})
    values = tensors if chunk is None else _chunk_values(tensors, chunk, dtypes, scales)
    where = "" if chunk is None else f"chunk {chunk.k}: "
    if isinstance(dtypes, str):
        dtypes = dict.fromkeys(values, dtypes)
    elif dtypes is not None and chunk is not None:  # the fragment's dtypes: the chunk's of them
        dtypes = {name: dtypes[name] for name in values if name in dtypes}
    quantized = [isinstance(v, quant.QTensor) for v in values.values()]
    if any(quantized) and not all(quantized):
        raise ValueError(f"{where}tensors mix quantized and float32 values")
    if all(quantized):
        qs: dict[str, quant.QTensor] = dict(values)  # type: ignore[arg-type]
        found = {name: q.dtype for name, q in qs.items()}
        if dtypes is not None and dtypes != found:
            wrong = sorted(n for n in found if dtypes.get(n) != found[n])
            raise ValueError(f"{where}tensors {wrong[:10]} are quantized to {[found[n] for n in wrong[:10]]}, "
                             f"their dtypes are {[dtypes.get(n) for n in wrong[:10]]}")  # fmt: skip
        check_encodable(found, compression)
        return Source(found, {name: tuple(q.shape) for name, q in qs.items()}, lambda name: _arrays(qs[name]))
    if dtypes is None or set(dtypes) != set(values):
        missing = sorted(values) if dtypes is None else sorted(set(dtypes) ^ set(values))
        raise ValueError(f"{where}dtypes name {missing[:10]} not matching the float32 tensors")
    for name in values:
        if dtypes[name] == "F8_E4M3" and chunk is not None and name in _parts(chunk) and name not in scales:
            raise ValueError(f"{where}F8 piece of {name!r} needs the whole tensor's scale (f8_scales)")
    check_encodable(dtypes, compression)
    floats, logical = dict(values), dict(dtypes)
    return Source(
        logical,
        {name: tuple(int(d) for d in np.shape(x)) for name, x in floats.items()},
        lambda name: _arrays(quant.quantize(floats[name], logical[name], f8_scale=scales.get(name))),
        lambda name: np.ravel(floats[name]),
    )


def _parts(chunk: ChunkSpec) -> set[str]:
    """The tensors of which the chunk holds a part, not the whole."""
    return {p.name for p in chunk.pieces if not is_whole(p, chunk.shapes)}


def _chunk_values(tensors: Values, s: ChunkSpec, dtypes: Dtypes | None, scales: dict[str, int]) -> dict[str, Any]:
    """Each piece's values, in the logical shape it is stored with, from its whole tensor (cut:
    float32 views, or ``QTensor`` codes and scales sliced) or from the piece's own values. An F8
    piece of a whole float32 tensor gets that tensor's scale in ``scales``."""
    out: dict[str, Any] = {}
    for p in s.pieces:
        if p.name not in tensors:
            raise ValueError(f"chunk {s.k}: no values for {p.name!r}, the pieces are {[q.name for q in s.pieces][:10]}")
        v, full, shape = tensors[p.name], s.shapes[p.name], s.expected[p.name]
        n = numel(v.shape if isinstance(v, quant.QTensor) else np.shape(v))
        if n not in (p.size, numel(full)):
            raise ValueError(f"chunk {s.k}: {p.name!r} has {n} values, the piece {p.size}, its tensor {numel(full)}")
        if isinstance(v, quant.QTensor):
            q = v if n == p.size else _slice_quantized(v, p.start, p.stop, numel(full))
            out[p.name] = quant.QTensor(q.dtype, shape, q.data, q.scale)
            continue
        if n != p.size:  # the whole tensor, of which this is a part
            dtype = dtypes if isinstance(dtypes, str) else (dtypes or {}).get(p.name)
            if dtype == "F8_E4M3":
                scales.setdefault(p.name, quant.e4m3_scale_byte(quant.e4m3_amax(v)))
            v = np.asarray(v).reshape(-1)[p.start : p.stop]
        arr = np.asarray(v, dtype=np.float32)
        out[p.name] = arr if arr.shape == shape else arr.reshape(shape)
    return out


def _slice_quantized(q: quant.QTensor, start: int, stop: int, n: int) -> quant.QTensor:
    """Elements ``[start, stop)`` of a whole tensor of ``n`` quantized already: its codes and
    scales, sliced (views). F4/I2: 16/8 bytes and one scale per block of 32 (the piece starts on
    a block); F8: the codes, and the tensor's scale; the rest element-wise."""
    assert start % 32 == 0 and 0 <= start <= stop <= n, f"[{start}, {stop}) is not a piece of a {n}-tensor"
    flat = np.asarray(q.data).reshape(-1)
    if q.dtype in ("F4", "I2"):
        per = 16 if q.dtype == "F4" else 8
        lo, hi = start // 32, -(-stop // 32)
        assert q.scale is not None
        return quant.QTensor(q.dtype, (stop - start,), flat[lo * per : hi * per], q.scale[lo:hi])
    return quant.QTensor(q.dtype, (stop - start,), flat[start:stop], q.scale)


def _arrays(q: quant.QTensor) -> list[np.ndarray]:
    return [q.data] if q.scale is None else [q.data, q.scale]


@dataclass(frozen=True)
class Encoding:
    """A payload's bytes, which can be produced again: ``head``, then what ``parts()`` yields
    (read from ``spool``, the compressed tensors, for zstd)."""

    head: bytes
    parts: Callable[[], Iterator[Chunk]]
    spool: Spool | None = None

    def join(self) -> bytes:
        """The bytes, produced once, as one ``bytes``; the spool is closed after."""
        try:
            return b"".join([self.head, *self.parts()])
        finally:
            if self.spool is not None:
                self.spool.close()


def _encoding(source: Source, kind: str, compression: str, meta: Mapping[str, str] | None, budget: Budget) -> Encoding:
    """``source``'s payload of ``kind`` (``meta``: a chunk's layout metadata, ``LAYOUT_KEYS``)."""
    head_meta = metadata(kind, compression, source.dtypes, source.shapes, meta)
    workers = budget.workers_for(4 * sum(math.prod(s) for s in source.shapes.values()))
    if compression == "zstd":
        spool = Spool(budget.spool_memory, budget.piece)
        try:
            for blobs in _bounded(functools.partial(_compressed, source), list(source.dtypes), workers):
                for k, blob in blobs:
                    spool.add(k, blob)
        except BaseException:
            spool.close()
            raise
        head, order = safetensors_io.header({k: ("U8", (size,)) for k, size in spool.sizes.items()}, head_meta)
        return Encoding(head, lambda: (piece for k in order for piece in spool.pieces(k)), spool)

    # stored name -> (logical name, part index, safetensors dtype, stored shape)
    stored: dict[str, tuple[str, int, str, tuple[int, ...]]] = {}
    for name, dtype in source.dtypes.items():
        for i, (suffix, st_dtype, st_shape) in enumerate(storage_layout(source.shapes[name], dtype)):
            stored[name + suffix] = (name, i, st_dtype, tuple(st_shape))
    head, order = safetensors_io.header({k: (v[2], v[3]) for k, v in stored.items()}, head_meta)
    return Encoding(head, lambda: _plain_parts(source, [stored[k][:2] for k in order], budget.piece, workers))


def _compressed(source: Source, name: str) -> list[tuple[str, bytes]]:
    layout = storage_layout(source.shapes[name], source.dtypes[name])
    out = []
    for (suffix, _, _), arr in zip(layout, source.whole(name), strict=True):
        arr = np.ascontiguousarray(arr)
        out.append((name + suffix, zstd_codec.compress(arr.reshape(-1).view(np.uint8), arr.dtype.itemsize)))
    return out


def _plain_parts(source: Source, order: list[tuple[str, int]], piece: int, workers: int) -> Iterator[Chunk]:
    """The data section of a ``.safetensors`` payload; ``order``: (tensor, part index) of each
    stored tensor, in file order."""

    def work() -> Iterator[tuple[str, int, Callable[[], Any] | None]]:
        # (tensor, part, what to compute): part -1 is a piece of an elementwise tensor; a part
        # of another tensor computes its stored arrays where first needed, else nothing.
        seen: set[str] = set()
        for name, part in order:
            if source.elementwise(name):
                assert source.flat is not None
                flat, dtype, step = source.flat(name), source.dtypes[name], max(piece // 4, 1)
                for i in range(0, flat.size, step):
                    yield name, -1, functools.partial(_quantized_piece, flat[i : i + step], dtype)
            else:
                yield name, part, None if name in seen else functools.partial(source.whole, name)
                seen.add(name)

    left = {name: len(storage_layout((0,), source.dtypes[name])) for name, _ in order}
    held: dict[str, list[np.ndarray]] = {}
    results = _bounded(_run, work(), workers)
    try:
        for name, part, got in results:
            if part < 0:
                view = _u8(got)
            else:
                if got is not None:
                    held[name] = got
                view = _u8(held[name][part])
                left[name] -= 1
                if not left[name]:
                    del held[name]
            del got  # only ``view`` (a piece, or the part being sent) stays while the next is made
            yield from _slices(view, piece)
    finally:
        results.close()  # stops its threads, if any


def _quantized_piece(values: np.ndarray, dtype: str) -> np.ndarray:
    return quant.quantize(values, dtype).data


def _run(item: tuple[str, int, Callable[[], Any] | None]) -> tuple[str, int, Any]:
    name, part, fn = item
    return name, part, None if fn is None else fn()


def _u8(arr: np.ndarray) -> memoryview:
    return safetensors_io.as_bytes(np.ascontiguousarray(arr))


def _slices(view: memoryview, piece: int) -> Iterator[memoryview]:
    for i in range(0, view.nbytes, piece):
        yield view[i : i + piece]


class Spool:
    """Compressed tensors waiting for their place in the file (their names, not the order they
    were compressed in, decide it): kept as they are while they fit in ``memory`` bytes, the rest
    in a temporary file. Read back ``piece`` bytes at a time."""

    def __init__(self, memory: float, piece: int) -> None:
        self.memory, self.piece, self.kept = memory, piece, 0
        self.sizes: dict[str, int] = {}
        self.held: dict[str, bytes] = {}
        self.offsets: dict[str, int] = {}
        self.file: IO[bytes] | None = None
        self.closed = False

    def add(self, k: str, blob: bytes) -> None:
        self.sizes[k] = len(blob)
        if self.kept + len(blob) <= self.memory:
            self.held[k] = blob
            self.kept += len(blob)
            return
        if self.file is None:
            self.file = tempfile.TemporaryFile()  # noqa: SIM115 - the spool owns it
        self.offsets[k] = self.file.tell()
        self.file.write(blob)

    def pieces(self, k: str) -> Iterator[Chunk]:
        if self.closed:
            raise ValueError("the payload's spool is closed")
        if k in self.held:
            yield from _slices(memoryview(self.held[k]), self.piece)
            return
        assert self.file is not None
        at, size = self.offsets[k], self.sizes[k]
        while size > 0:
            self.file.seek(at)
            got = self.file.read(min(size, self.piece))
            if not got:
                raise PayloadCorrupt(f"payload spool ended early at {k!r}")
            at, size = at + len(got), size - len(got)
            yield got

    def close(self) -> None:
        self.closed = True
        self.held.clear()
        if self.file is not None:
            self.file.close()
            self.file = None


# ---------------------------------------------------------------------------------------------
# The reader


class _Incoming:
    """Exact-size reads from a chunk iterator, counting (and, with a ``sha256`` to check,
    hashing) every byte that arrives."""

    def __init__(self, chunks: Iterable[Chunk], size: int, key: str, sha256: str | None) -> None:
        self.it, self.size, self.key, self.sha256 = iter(chunks), size, key, sha256
        self.digest = None if sha256 is None else hashlib.sha256()
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
            if self.digest is not None:
                self.digest.update(view)
            self.buf = view
            return True
        return False

    def has(self, n: int) -> bool:
        """Are the next ``n`` bytes here already (no wait, no copy to read them)?"""
        return self.buf.nbytes >= n

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

    def drain(self, piece: int) -> None:
        """Read (and hash) the rest, ``piece`` bytes at a time."""
        left = self.size - self.got + self.buf.nbytes
        while left > 0:
            left -= self.read(min(left, piece)).nbytes

    def finish(self) -> None:
        if self.buf.nbytes or self._pull():
            raise PayloadCorrupt(f"{self.key}: bytes after the last tensor")
        if self.got != self.size:
            raise PayloadCorrupt(f"{self.key}: cut short at {self.got} of {self.size} bytes")
        if self.digest is not None and self.digest.hexdigest() != self.sha256:
            raise PayloadCorrupt(
                f"{self.key}: expected sha256 {str(self.sha256)[:12]}..., found {self.digest.hexdigest()[:12]}..."
            )


def _decode(
    chunks: Iterable[Chunk],
    expected: Mapping[str, Sequence[int]],
    size: int,
    sha256: str | None,
    compression: str,
    kind: str | None,
    dtypes: Mapping[str, str] | None,
    meta: Mapping[str, str] | None,
    key: str | None,
    budget: Budget,
) -> dict[str, np.ndarray]:
    """The ``size`` bytes ``chunks`` yields -> ``{name: float32 array}`` of the ``expected``
    tensors (the caller has held ``size`` to its cap). ``sha256`` None: the bytes are not hashed.
    ``key`` None: whole bytes, the format's messages as they are."""
    src = _Incoming(chunks, size, key or "payload", sha256)
    limit = min(header_cap(expected), safetensors_io.HARD_HEADER_CAP)
    head = bytes(src.read(min(size, 8)))
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    if 2 <= n <= limit and 8 + n <= size:
        head += src.read(n)
    try:  # a payload too short for its prefix, or a header length out of bounds, is refused here
        header, _ = safetensors_io.read_header(head, max_header_bytes=limit, total=size)
    except PayloadCorrupt as e:
        if key is None:
            raise
        raise PayloadCorrupt(f"{key}: {e}") from None
    info = header_info(header, compression)
    try:
        entries, layout = check_header(header, info, expected, kind=kind, dtypes=dtypes, meta=meta)
    except PayloadLayoutMismatch:
        if sha256 is not None:
            # Intact bytes of other tensors (a ``schema`` rejection) or damaged ones (``corrupt``):
            # only the hash tells, as it does when the payload is read whole.
            src.drain(budget.piece)
            src.finish()
        raise

    def work() -> Iterator[Callable[[], tuple[str, np.ndarray] | None]]:
        # Each tensor's decoding as its bytes arrive: an elementwise one a piece at a time into
        # its output array (then that array, shaped), unless all its bytes are here already
        # (whole bytes, a small tensor): then, as any other, in one go once its last part is in.
        held: dict[str, memoryview] = {}
        for k in sorted(entries, key=lambda e: entries[e]["data_offsets"][0]):
            begin, stop = entries[k]["data_offsets"]
            name = k.split("#", 1)[0]
            dtype, shape = info.dtypes[name], tuple(int(d) for d in expected[name])
            if compression != "zstd" and dtype in quant.ELEMENTWISE and not src.has(stop - begin):
                np_dtype = safetensors_io.NUMPY_DTYPES[layout[k][0]]
                flat = np.empty(safetensors_io.numel(shape), np.float32)
                assert flat.size * np_dtype.itemsize == stop - begin  # check_header matched the layout
                step = max(budget.piece // np_dtype.itemsize, 1)
                for i in range(0, flat.size, step):
                    raw = src.read(min(step, flat.size - i) * np_dtype.itemsize)
                    yield functools.partial(_piece_into, flat[i : i + step], raw, np_dtype, dtype)
                    del raw  # not kept while the next piece arrives
                yield functools.partial(_shaped, name, flat, shape)
                continue
            held[k] = src.read(stop - begin)
            parts = [name + s for s, _, _ in storage_layout(shape, dtype)]
            if all(p in held for p in parts):
                stored = [(p, layout[p], held.pop(p)) for p in parts]
                yield functools.partial(_whole, name, dtype, shape, stored, compression == "zstd")
                del stored  # (its bytes not kept while the next tensor's arrive)

    out = dict(got for got in _bounded(call, work(), budget.workers_for(size)) if got is not None)
    src.finish()
    return {name: out[name] for name in expected}


def _shaped(name: str, flat: np.ndarray, shape: tuple[int, ...]) -> tuple[str, np.ndarray]:
    return name, flat.reshape(shape)


def _piece_into(out: np.ndarray, raw: memoryview, np_dtype: np.dtype, dtype: str) -> None:
    values = np.frombuffer(raw, dtype=np_dtype)
    out[:] = values if dtype == "F32" else quant.dequantize(quant.QTensor(dtype, (values.size,), values))


def _whole(
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    stored: list[tuple[str, tuple[str, tuple[int, ...]], memoryview]],
    zstd: bool,
) -> tuple[str, np.ndarray]:
    """A tensor from its stored parts (``(stored name, (safetensors dtype, shape), bytes)`` in
    ``storage_layout``'s order), each decompressed first for zstd."""
    arrays = []
    for k, (st_dtype, st_shape), blob in stored:
        np_dtype = safetensors_io.NUMPY_DTYPES[st_dtype]
        if zstd:
            nbytes = safetensors_io.DTYPE_SIZES[st_dtype] * safetensors_io.numel(st_shape)
            planes = zstd_codec.decompress(blob, np_dtype.itemsize, nbytes)
            if planes.size != nbytes:
                raise PayloadCorrupt(f"tensor {k!r}: decompressed to {planes.size} bytes, expected {nbytes}")
            arrays.append(planes.view(np_dtype).reshape(st_shape))
        else:
            arrays.append(np.frombuffer(blob, dtype=np_dtype).reshape(st_shape))
    return name, quant.dequantize(quant.QTensor(dtype, shape, arrays[0], arrays[1] if len(arrays) > 1 else None))
