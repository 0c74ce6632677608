"""One chunk of a chunked payload, encoded and decoded (``docs/protocol.md``, "Chunked payloads";
the plan is ``plan.py``'s).

A chunk is an ordinary payload (``header.py``) holding its pieces: a whole tensor under its
name and shape, part of a tensor under the tensor's name with the 1-D shape ``[stop - start]``,
plus the metadata ``"pieces"`` (canonical JSON ``{name: [start, stop]}`` of the partial pieces)
and ``"chunk"`` (``"k/n"``, when ``n > 1``). One chunk of whole tensors has neither: it is the
whole-fragment payload, byte for byte.

Quantization cannot see the cut: every piece starts at a multiple of 32 inside its tensor, so
an F4/I2 piece's codes and scales are a byte slice of the whole tensor's (``slice_quantized``);
BF16/F16/F32 are element-wise; an F8_E4M3 piece is encoded with the whole tensor's scale
(``f8_scales``; ``quant.e4m3_scale_byte``), which every chunk holding part of it stores.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import quant
from .header import canonical, default_payload_cap
from .plan import Piece, fragment_plan, is_whole, piece_shape
from .stream import Chunk, PayloadStream, decode_stream, stream_payload, stream_quantized

Values = Mapping[str, np.ndarray] | Mapping[str, quant.QTensor]


@dataclass(frozen=True)
class ChunkSpec:
    """Chunk ``k`` of ``n`` of a payload: its pieces, and the full shapes of the payload's tensors."""

    k: int
    n: int
    pieces: tuple[Piece, ...]
    shapes: Mapping[str, tuple[int, ...]]

    @property
    def expected(self) -> dict[str, tuple[int, ...]]:
        """Stored tensor name -> the logical shape it is stored with."""
        return {p.name: piece_shape(p, self.shapes) for p in self.pieces}

    @property
    def meta(self) -> dict[str, str]:
        """The chunk's layout metadata: empty for one chunk of whole tensors."""
        out = {}
        partial = {p.name: [p.start, p.stop] for p in self.pieces if not is_whole(p, self.shapes)}
        if partial:
            out["pieces"] = canonical(partial)
        if self.n > 1:
            out["chunk"] = f"{self.k}/{self.n}"
        return out

    def cap(self) -> int:
        """The largest acceptable payload of this chunk (F32 data, scales, zstd framing, header)."""
        return default_payload_cap(self.expected)


def spec(pieces: Sequence[Piece], shapes: Mapping[str, Sequence[int]], k: int, n: int) -> ChunkSpec:
    return ChunkSpec(k, n, tuple(pieces), {name: tuple(int(d) for d in s) for name, s in shapes.items()})


def chunk_specs(shapes: Mapping[str, Sequence[int]], chunk_elements: int | None) -> list[ChunkSpec]:
    """Every chunk of a payload of these tensors (in this order)."""
    plan = fragment_plan(shapes, chunk_elements)
    return [spec(pieces, shapes, k, len(plan)) for k, pieces in enumerate(plan)]


def slice_quantized(q: quant.QTensor, piece: Piece, shape: Sequence[int]) -> quant.QTensor:
    """The piece of a whole tensor quantized already (``shape``: the tensor's): its codes and
    scales, sliced (views). F4/I2: 16/8 bytes and one scale per block of 32 (the piece starts on
    a block); F8: the codes, and the tensor's scale; the rest element-wise."""
    n = int(np.prod(shape, dtype=np.int64))
    if piece.start == 0 and piece.stop == n:
        return q
    assert piece.start % 32 == 0 and 0 <= piece.start <= piece.stop <= n, f"{piece} is not a piece of a {n}-tensor"
    flat = np.asarray(q.data).reshape(-1)
    if q.dtype in ("F4", "I2"):
        per = 16 if q.dtype == "F4" else 8
        lo, hi = piece.start // 32, -(-piece.stop // 32)
        assert q.scale is not None
        return quant.QTensor(q.dtype, (piece.size,), flat[lo * per : hi * per], q.scale[lo:hi])
    return quant.QTensor(q.dtype, (piece.size,), flat[piece.start : piece.stop], q.scale)


def split(tensors: Values, s: ChunkSpec) -> dict[str, Any]:
    """The chunk's piece values of whole tensors: float32 views (a whole tensor as it is, part of
    one as a 1-D slice of its flat values) or ``slice_quantized`` views of ``QTensor``s."""
    out: dict[str, Any] = {}
    for p in s.pieces:
        t = tensors[p.name]
        if isinstance(t, quant.QTensor):
            out[p.name] = slice_quantized(t, p, s.shapes[p.name])
        elif is_whole(p, s.shapes):
            out[p.name] = t
        else:
            out[p.name] = np.asarray(t).reshape(-1)[p.start : p.stop]
    return out


def f8_scales(tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str], s: ChunkSpec) -> dict[str, int]:
    """The whole-tensor scale byte of each F8_E4M3 tensor the chunk holds part of."""
    return {
        p.name: quant.e4m3_scale_byte(quant.e4m3_amax(tensors[p.name]))
        for p in s.pieces
        if dtypes[p.name] == "F8_E4M3" and not is_whole(p, s.shapes)
    }


def stream_chunk(
    values: Values,
    s: ChunkSpec,
    dtypes: Mapping[str, str] | str,
    *,
    kind: str,
    compression: str = "",
    f8_scales: Mapping[str, int] | None = None,
) -> PayloadStream:
    """One chunk's payload stream from its pieces' values: ``values[name]`` is the piece's float32
    values (``piece.size`` of them, flat or in the tensor's shape when whole) or its ``QTensor``
    (``slice_quantized``). ``f8_scales``: the whole tensor's scale byte of each F8 tensor split
    over chunks (``quant.e4m3_scale_byte``); needed for float values, ignored for ``QTensor``s."""
    expected = s.expected
    if set(values) != set(expected):
        raise ValueError(f"chunk {s.k}: values for {sorted(values)[:10]}, the pieces are {sorted(expected)[:10]}")
    if isinstance(dtypes, str):
        dtypes = dict.fromkeys(expected, dtypes)
    quantized = [isinstance(v, quant.QTensor) for v in values.values()]
    if all(quantized):
        qs: dict[str, quant.QTensor] = {}
        for name, q in values.items():
            assert isinstance(q, quant.QTensor)
            if q.dtype != dtypes[name] or int(np.prod(q.shape, dtype=np.int64)) != int(np.prod(expected[name])):
                raise ValueError(
                    f"chunk {s.k}: {name!r} is {q.dtype} {q.shape}, expected {dtypes[name]} {expected[name]}"
                )
            qs[name] = (
                q if tuple(q.shape) == expected[name] else quant.QTensor(q.dtype, expected[name], q.data, q.scale)
            )
        return stream_quantized(qs, kind=kind, compression=compression, meta=s.meta)
    if any(quantized):
        raise ValueError(f"chunk {s.k}: mixes quantized and float32 pieces")
    floats: dict[str, np.ndarray] = {}
    scales = dict(f8_scales or {})
    for name, v in values.items():
        arr = np.asarray(v, dtype=np.float32)
        if arr.size != int(np.prod(expected[name], dtype=np.int64)):
            raise ValueError(f"chunk {s.k}: {name!r} has {arr.size} values, the piece {expected[name]}")
        floats[name] = arr if arr.shape == expected[name] else arr.reshape(expected[name])
        if dtypes[name] == "F8_E4M3" and expected[name] != s.shapes[name] and name not in scales:
            raise ValueError(f"chunk {s.k}: F8 piece of {name!r} needs the whole tensor's scale (f8_scales)")
    return stream_payload(
        floats, {n: dtypes[n] for n in floats}, kind=kind, compression=compression, meta=s.meta, f8_scales=scales
    )


def fragment_streams(
    tensors: Values,
    shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, str] | str,
    chunk_elements: int | None,
    *,
    kind: str,
    compression: str = "",
) -> Iterator[tuple[ChunkSpec, PayloadStream]]:
    """Every chunk of a whole fragment (float32 arrays, or ``QTensor``s quantized already), one
    stream at a time, in order: with ``chunk_elements`` None or a fragment that fits one chunk,
    the one stream of today's whole payload."""
    if isinstance(dtypes, str):
        dtypes = dict.fromkeys(shapes, dtypes)
    for s in chunk_specs(shapes, chunk_elements):
        values = split(tensors, s)
        quantized = any(isinstance(t, quant.QTensor) for t in tensors.values())
        scales = {} if quantized else f8_scales(tensors, dtypes, s)  # type: ignore[arg-type]
        yield s, stream_chunk(values, s, dtypes, kind=kind, compression=compression, f8_scales=scales)


def decode_chunk(
    chunks: Iterable[Chunk],
    s: ChunkSpec,
    *,
    size: int,
    sha256: str,
    compression: str = "",
    max_bytes: int | None = None,
    kind: str | None = None,
    dtypes: Mapping[str, str] | None = None,
    key: str = "payload",
) -> dict[str, np.ndarray]:
    """One chunk's bytes, verified (size, sha256, the layout of chunk ``s.k`` of ``s.n``) and
    decoded: ``{piece name: float32 values}`` (a whole tensor in its shape, a part 1-D).
    ``max_bytes`` defaults to the chunk's own cap; a larger one is lowered to it."""
    cap = s.cap() if max_bytes is None else min(max_bytes, s.cap())
    return decode_stream(
        chunks,
        s.expected,
        size=size,
        sha256=sha256,
        compression=compression,
        max_bytes=cap,
        kind=kind,
        dtypes=None if dtypes is None else {p.name: dtypes[p.name] for p in s.pieces},
        key=key,
        meta=s.meta,
    )
