"""Lossless payload compression: byte shuffle into planes, then one zstd frame.

Float tensors barely compress as they are: the sign/exponent byte of each value is
predictable but sits between mantissa bytes that are noise. Transposing the ``n x itemsize``
byte matrix puts byte ``i`` of every element into plane ``i``, so the exponent plane becomes a
long run zstd can squeeze and the mantissa planes are passed through as (cheap) raw blocks.
The planes go into one frame, with a zstd block boundary at every plane.

The zstd frame always declares its content size; a reader checks it against a hard cap
before allocating anything, and refuses trailing bytes after the frame. Equal input gives equal
bytes (content-addressed keys depend on it): inputs from ``MT_BYTES`` on use zstd's
multi-threaded mode, whose frames differ from the single-threaded mode's but not with the number
of threads (1 and 16 workers write the same bytes), so the bytes depend on the input alone, never
on the machine. Readers need not know which mode wrote a frame.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import MissingExtra, PayloadCorrupt

# zstd tuned for byte planes of weights rather than a level: the gain is all in entropy-coding
# the exponent plane, whose bytes are near i.i.d., so matches barely help and finding them is
# what costs time. The "fast" strategy with a tiny hash table and the longest minimum match
# leaves almost everything to the literal (Huffman) coder: on a trained transformer's weights
# this was both smaller than level 3 (fp32 -16.9% vs -15.2%, bf16 -33.8% vs -30.5%) and over
# twice as fast (bench/codec.py).
# Fixed parameters: the same input gives the same frame.
PARAMS = {
    "window_log": 17,
    "hash_log": 8,
    "chain_log": 8,
    "search_log": 1,
    "min_match": 7,
    "target_length": 0,
    "strategy": 1,  # ZSTD_fast
}


def _zstd() -> ModuleType:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise MissingExtra("zstd", "zstandard") from None
    return zstandard


# Elements per step of the (un)shuffle: each step moves one cache-sized block plane by plane.
# A whole-array transpose with 1-byte elements runs at a fraction of that speed (2.3 vs 0.6 GB/s
# for the unshuffle of fp32 here).
_BLOCK = 1 << 16


def shuffle(blob: Any, itemsize: int) -> np.ndarray:
    """Bytes -> uint8 array of the ``itemsize`` byte planes, then any tail bytes."""
    raw = np.frombuffer(blob, dtype=np.uint8)
    if itemsize <= 1:
        return raw
    n = raw.size // itemsize
    out = np.empty(raw.size, dtype=np.uint8)
    elements, planes = raw[: n * itemsize].reshape(n, itemsize), out[: n * itemsize].reshape(itemsize, n)
    for j in range(0, n, _BLOCK):
        for k in range(itemsize):
            planes[k, j : j + _BLOCK] = elements[j : j + _BLOCK, k]
    out[n * itemsize :] = raw[n * itemsize :]
    return out


def unshuffle(data: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of ``shuffle``: a fresh, writable uint8 array in element order."""
    if itemsize <= 1:
        return np.array(data, dtype=np.uint8)
    n = data.size // itemsize
    out = np.empty(data.size, dtype=np.uint8)
    elements, planes = out[: n * itemsize].reshape(n, itemsize), data[: n * itemsize].reshape(itemsize, n)
    for j in range(0, n, _BLOCK):
        for k in range(itemsize):
            elements[j : j + _BLOCK, k] = planes[k, j : j + _BLOCK]
    out[n * itemsize :] = data[n * itemsize :]
    return out


# Inputs from this size on are compressed on ``THREADS`` threads (zstd's own workers, each on a
# job of 512 KiB with the window above). The mode, not the thread count, decides the bytes, so
# the switch is on the size alone. bench/codec.py --threads measures both modes.
MT_BYTES = 8 << 20
THREADS = max(1, min(8, os.cpu_count() or 1))


def _compressor(level: int | None, threads: int) -> Any:
    z = _zstd()
    if level is not None:
        return z.ZstdCompressor(level=level, write_content_size=True, write_checksum=False, threads=threads)
    params = z.ZstdCompressionParameters(**PARAMS, write_content_size=1, write_checksum=0, threads=threads)
    return z.ZstdCompressor(compression_params=params)


def compress(blob: Any, itemsize: int, *, level: int | None = None, threads: int | None = None) -> bytes:
    """Shuffle ``blob`` (anything bytes-like) by ``itemsize`` and zstd it into one frame.

    ``level`` picks a standard zstd level instead of the tuned parameters (for benchmarks);
    readers need not know which was used. ``threads`` overrides the choice by size (0: the
    single-threaded mode; any positive count: the multi-threaded one, whose bytes are the same
    for every count).
    """
    z = _zstd()
    planes = shuffle(blob, itemsize)
    if threads is None:
        threads = THREADS if planes.size >= MT_BYTES else 0
    cobj = _compressor(level, threads).compressobj(size=planes.size)  # size: the frame declares it
    # End a zstd block at every plane boundary. Literals are Huffman-coded per block, and a
    # block mixing the random mantissa bytes with the exponent plane gets one table for both:
    # on small tensors that halved the gain (a trained MLP: fp32 -11% -> -17%).
    n = planes.size // max(itemsize, 1)
    parts = []
    for i in range(max(itemsize, 1)):
        parts.append(cobj.compress(planes[i * n : (i + 1) * n if i < itemsize - 1 else planes.size]))
        parts.append(cobj.flush(z.COMPRESSOBJ_FLUSH_BLOCK))
    parts.append(cobj.flush(z.COMPRESSOBJ_FLUSH_FINISH))
    return b"".join(parts)


def decompress(data: Any, itemsize: int, max_size: int) -> np.ndarray:
    """Inverse of ``compress``, as a writable uint8 array. Raises ``PayloadCorrupt`` for anything
    but one valid frame of at most ``max_size`` bytes (never producing more)."""
    z = _zstd()
    try:
        size = z.frame_content_size(data)
    except z.ZstdError as e:
        raise PayloadCorrupt(f"not a zstd frame: {e}") from None
    if size < 0:
        raise PayloadCorrupt("zstd frame does not declare its content size")
    if size > max_size:
        raise PayloadCorrupt(f"zstd frame declares {size} bytes, above the cap of {max_size}")
    try:
        # With a declared content size zstandard allocates exactly that and fails if the frame
        # would write more; allow_extra_data=False rejects bytes after the frame.
        raw = z.ZstdDecompressor().decompress(data, max_output_size=max_size, allow_extra_data=False)
    except z.ZstdError as e:
        raise PayloadCorrupt(f"corrupt zstd frame: {e}") from None
    if len(raw) != size:
        raise PayloadCorrupt(f"zstd frame declared {size} bytes but produced {len(raw)}")
    return unshuffle(np.frombuffer(raw, dtype=np.uint8), itemsize)
