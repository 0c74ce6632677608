"""The payload reader: the one place a payload's bytes (``header.py``'s format) are checked and
decoded, as its parts arrive (``stream.decode_stream``) or from one buffer
(``payload.decode_payload``).

The header is checked against the expected layout as soon as it has arrived, before any tensor
is materialised. Plain F32/F16/BF16 tensors are then decoded into their output arrays
``budget.piece`` bytes at a time as they arrive; others, and those whose bytes have all arrived
(whole bytes), once their bytes (and scale) are in. The size, and with
a ``sha256`` the hash, are checked at the end, and nothing is returned before: a stream cut
short, too long, or with any byte changed is ``PayloadCorrupt``. ``budget.workers`` pieces or
tensors are decoded at once (threads from ``PARALLEL_BYTES`` of payload); the bytes a piece is
decoded from are those its producer yielded (``mailbox.contract``: a yielded chunk stays valid).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import PayloadCorrupt, PayloadLayoutMismatch
from . import compress as zstd_codec
from . import quant, safetensors_io
from .budget import Budget, bounded, call
from .header import check_header, header_cap, header_info, storage_layout
from .writer import ELEMENTWISE, Chunk


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


def decode_parts(
    chunks: Iterable[Chunk],
    expected: Mapping[str, Sequence[int]],
    *,
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
    tensors (arguments as ``stream.decode_stream``'s; the caller has held ``size`` to its cap).
    ``sha256`` None: the bytes are not hashed (whole bytes the caller holds). ``key``: the
    object the bytes come from, named in every message about them; None for whole bytes (the
    format's messages as they are)."""
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
            if compression != "zstd" and dtype in ELEMENTWISE and not src.has(stop - begin):
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

    out = dict(got for got in bounded(call, work(), budget.workers_for(size)) if got is not None)
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
            planes = zstd_codec.decompress_array(blob, np_dtype.itemsize, nbytes)
            if planes.size != nbytes:
                raise PayloadCorrupt(f"tensor {k!r}: decompressed to {planes.size} bytes, expected {nbytes}")
            arrays.append(planes.view(np_dtype).reshape(st_shape))
        else:
            arrays.append(np.frombuffer(blob, dtype=np_dtype).reshape(st_shape))
    return name, quant.dequantize(quant.QTensor(dtype, shape, arrays[0], arrays[1] if len(arrays) > 1 else None))
