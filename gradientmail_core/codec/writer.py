"""The payload writer: the one place a payload's bytes (``header.py``'s format) are produced.

``encoding(source, ...)`` gives an ``Encoding``: the header bytes and ``parts()``, which yields
the data section piece by piece, as often as it is called. A stream (``stream.PayloadStream``)
runs it twice, to hash and to send; a one-shot encode (``payload.encode_payload``) joins it once.

- ``.safetensors``: the header follows from the dtypes and shapes alone. ``parts()`` quantizes
  an elementwise tensor (F32/F16/BF16 of float32 input) ``budget.piece`` bytes of float32 at a
  time; any other whole, where its first stored part is needed, kept until its last has gone
  out (a tensor's data and scale need not be neighbours in the file).
- ``.safetensors.zst``: the header holds every tensor's compressed size, known only once all are
  compressed; ``encoding`` quantizes and compresses each tensor once, into a spool (memory up to
  ``budget.spool_memory``, a temporary file beyond), and ``parts()`` reads the spool.

``budget.workers`` pieces or tensors are in the works at once (threads from ``PARALLEL_BYTES`` of
input), in order, so the bytes never depend on it.
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from ..errors import PayloadCorrupt
from . import compress as zstd_codec
from . import quant, safetensors_io
from .budget import Budget, bounded
from .header import check_encodable, metadata, storage_layout

Chunk = bytes | bytearray | memoryview
# Quantized elementwise: a slice of the input quantizes to the same slice of the output.
ELEMENTWISE = ("F32", "F16", "BF16")


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
        return self.flat is not None and self.dtypes[name] in ELEMENTWISE


def floats(
    tensors: Mapping[str, np.ndarray],
    dtypes: Mapping[str, str] | str,
    compression: str,
    f8_scales: Mapping[str, int] | None = None,
) -> Source:
    """float32 tensors to be stored in ``dtypes`` (``ValueError`` for names, dtypes or a
    compression that cannot be written). ``f8_scales``: the E8M0 scale byte an F8_E4M3 tensor is
    encoded with (a piece takes its whole tensor's), else its own."""
    if isinstance(dtypes, str):
        dtypes = dict.fromkeys(tensors, dtypes)
    if set(dtypes) != set(tensors):
        raise ValueError(f"dtypes name {sorted(set(dtypes) ^ set(tensors))[:10]} not matching the tensors")
    check_encodable(dtypes, compression)
    scales, logical = f8_scales or {}, dict(dtypes)
    return Source(
        logical,
        {name: tuple(int(d) for d in np.shape(x)) for name, x in tensors.items()},
        lambda name: _arrays(quant.quantize(tensors[name], logical[name], f8_scale=scales.get(name))),
        lambda name: np.ravel(tensors[name]),
    )


def quantized(tensors: Mapping[str, quant.QTensor], compression: str) -> Source:
    """Tensors quantized already (by a device-side quantizer): stored as they are."""
    dtypes = {name: q.dtype for name, q in tensors.items()}
    check_encodable(dtypes, compression)
    return Source(dtypes, {name: tuple(q.shape) for name, q in tensors.items()}, lambda name: _arrays(tensors[name]))


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


def encoding(
    source: Source, *, kind: str, compression: str, meta: Mapping[str, str] | None, budget: Budget
) -> Encoding:
    """``source``'s payload of ``kind`` (``meta``: a chunk's layout metadata, ``LAYOUT_KEYS``)."""
    head_meta = metadata(kind, compression, source.dtypes, source.shapes, meta)
    workers = budget.workers_for(4 * sum(math.prod(s) for s in source.shapes.values()))
    if compression == "zstd":
        spool = Spool(budget.spool_memory, budget.piece)
        try:
            for blobs in bounded(functools.partial(_compressed, source), list(source.dtypes), workers):
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
    results = bounded(_run, work(), workers)
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
            yield from slices(view, piece)
    finally:
        results.close()  # stops its threads, if any


def _quantized_piece(values: np.ndarray, dtype: str) -> np.ndarray:
    return quant.quantize(values, dtype).data


def _run(item: tuple[str, int, Callable[[], Any] | None]) -> tuple[str, int, Any]:
    name, part, fn = item
    return name, part, None if fn is None else fn()


def _u8(arr: np.ndarray) -> memoryview:
    return safetensors_io.as_bytes(np.ascontiguousarray(arr))


def slices(view: memoryview, piece: int) -> Iterator[memoryview]:
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
            yield from slices(memoryview(self.held[k]), self.piece)
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
