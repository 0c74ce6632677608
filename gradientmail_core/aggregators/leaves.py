"""A tensor's float64 reductions (its squared norm, the cosine's leaf squares) when the tensor
is not in one array: fed as consecutive pieces (a chunked payload, ``syncer/streamed.py``), or
split between processes (a sharded closer's ranks, ``sharded/closing.py``). Every result is the
one ``fused.py`` computes over the whole tensor, bit for bit: the same leaves, each summed over
its own elements as one array, added along the same tree."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from .fused import _LEAF, _dot_leaves, _dot_total, _scratch

# ---- the same quantities over a tensor that arrives in pieces (a chunked payload's) ------------
# A closer that merges chunk by chunk (``syncer/streamed.py``) sees each tensor as consecutive
# pieces, one per chunk. These compute what the whole-tensor functions above compute, bit for bit:
# every float64 reduction runs over the same leaves, in the same order, along the same tree; a leaf
# that straddles two pieces is completed from the next one (at most ``_LEAF`` elements carried).


class _LeafSums:
    """The leaf sums of a tensor fed as consecutive pieces: ``leaf_sum(values[lo:hi])`` of each
    leaf ``(lo, hi)`` in order, each over the leaf's elements as one contiguous array."""

    def __init__(self, leaves: Sequence[tuple[int, int]], dtype: type, leaf_sum: Callable[[np.ndarray], float]) -> None:
        self._leaves, self._dtype, self._leaf_sum = leaves, dtype, leaf_sum
        self._i = 0  # the leaf being filled
        self._at = 0  # elements fed so far
        self._carry: np.ndarray | None = None
        self._held = 0  # elements of the current leaf in ``_carry``
        self.sums: list[float] = []

    def feed(self, values: np.ndarray) -> None:
        x: np.ndarray = np.asarray(values, dtype=self._dtype).reshape(-1)
        pos = 0
        while pos < x.size:
            assert self._i < len(self._leaves), "fed more elements than the tensor has"
            lo, hi = self._leaves[self._i]
            take = min(hi - self._at, x.size - pos)
            if self._held == 0 and take == hi - lo:
                self.sums.append(self._leaf_sum(x[pos : pos + take]))  # the whole leaf in this piece
            else:
                if self._carry is None:
                    self._carry = np.empty(_LEAF, self._dtype)
                self._carry[self._held : self._held + take] = x[pos : pos + take]
                self._held += take
                if self._held == hi - lo:
                    self.sums.append(self._leaf_sum(self._carry[: self._held]))
                    self._held = 0
            pos += take
            self._at += take
            if self._at == hi:
                self._i += 1
                if self._i == len(self._leaves):
                    self._carry = None  # the tensor is complete: only a tensor still open holds one

    def finish(self) -> list[float]:
        assert self._i == len(self._leaves) and self._held == 0, "fed fewer elements than the tensor has"
        self._carry = None
        return self.sums


def _square_sum(x: np.ndarray) -> float:
    out = _scratch(x.size)
    np.square(x, out=out, dtype=np.float64)
    return float(np.add.reduce(out))


def _self_product_sum(a: np.ndarray) -> float:
    out = _scratch(a.size)
    np.multiply(a, a, out=out)
    return float(np.add.reduce(out))


_LEAF_SUMS: dict[str, Callable[[np.ndarray], float]] = {"dot": _square_sum, "cosine": _self_product_sum}


class StreamedDot:
    """``_dot(t, t)`` (a tensor's squared norm, as ``sq_norms`` and the merge compute it) of a
    tensor of ``size`` elements fed as consecutive float32 pieces, bit for bit."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._sums = _LeafSums(_dot_leaves(size), np.float32, _square_sum)

    def feed(self, values: np.ndarray) -> None:
        self._sums.feed(values)

    def total(self) -> float:
        return _dot_total(self.size, self._sums.finish())


class StreamedCosine:
    """The cosine's leaf squares of one tensor (``merge_tensor``'s ``squares``: ``|a|^2`` of each
    ``_LEAF`` of ``a = sum_i d_i / |d_i|``, in float64) fed as consecutive pieces of ``a``."""

    def __init__(self, size: int) -> None:
        leaves = _cosine_leaves(size)
        self._sums = _LeafSums(leaves, np.float64, _self_product_sum)

    def feed(self, a: np.ndarray) -> None:
        self._sums.feed(a)

    def squares(self) -> list[float]:
        return self._sums.finish()


# ---- the same quantities over a tensor split between processes (a sharded closer's ranks) -------
# Each rank of a sharded closer holds a contiguous range of each tensor. It sums the leaves wholly
# inside its range and keeps the values of a leaf its range cuts (at most two per tensor); the
# ranks then pool their parts and every leaf is summed once, over its elements as one array: the
# leaf sums, and so the totals, are the whole tensor's, bit for bit.

Part = float | tuple[int, np.ndarray]  # a leaf's sum, or (first element, the values this rank holds)


class LeafRange:
    """The leaves of elements ``[lo, hi)`` of a tensor, fed as consecutive pieces: ``parts`` maps
    each leaf the range touches to its sum (the whole leaf is inside) or to ``(start, values)``
    (the part of a leaf the range cuts). ``combine_leaves`` pools the parts of every range."""

    def __init__(self, leaves: Sequence[tuple[int, int]], dtype: type, kind: str, lo: int, hi: int) -> None:
        leaf_sum = _LEAF_SUMS[kind]
        touched = [i for i, (a, b) in enumerate(leaves) if a < hi and b > lo]
        self.parts: dict[int, Part] = {}
        order = iter(touched)

        def one(values: np.ndarray) -> float:
            i = next(order)
            a, b = leaves[i]
            if lo <= a and b <= hi:
                self.parts[i] = leaf_sum(values)
            else:
                self.parts[i] = (max(a, lo), np.array(values, dtype=dtype, copy=True))
            return 0.0

        clipped = [(max(leaves[i][0], lo) - lo, min(leaves[i][1], hi) - lo) for i in touched]
        self._sums = _LeafSums(clipped, dtype, one)

    def feed(self, values: np.ndarray) -> None:
        self._sums.feed(values)

    def finish(self) -> dict[int, Part]:
        self._sums.finish()
        return self.parts


def dot_range(size: int, lo: int, hi: int) -> LeafRange:
    """``StreamedDot``'s leaves (float32 values, squared) of elements ``[lo, hi)``."""
    return LeafRange(_dot_leaves(size), np.float32, "dot", lo, hi)


def cosine_range(size: int, lo: int, hi: int) -> LeafRange:
    """``StreamedCosine``'s leaves (float64 values, squared) of elements ``[lo, hi)``."""
    return LeafRange(_cosine_leaves(size), np.float64, "cosine", lo, hi)


def _cosine_leaves(size: int) -> tuple[tuple[int, int], ...]:
    return tuple((lo, min(lo + _LEAF, size)) for lo in range(0, size, _LEAF))


def combine_leaves(size: int, kind: str, parts: Iterable[Mapping[int, Part]]) -> list[float]:
    """Every leaf's sum of a tensor of ``size`` elements from the ranges' ``parts`` (``LeafRange``):
    a leaf summed by one range as it is, a cut leaf summed here over its parts joined in order.
    ``ValueError`` if the parts do not cover every leaf exactly once."""
    leaves = _dot_leaves(size) if kind == "dot" else _cosine_leaves(size)
    dtype = np.float32 if kind == "dot" else np.float64
    sums: dict[int, float] = {}
    cuts: dict[int, list[tuple[int, np.ndarray]]] = {}
    for got in parts:
        for i, part in got.items():
            if isinstance(part, tuple):
                cuts.setdefault(int(i), []).append(part)
            elif int(i) in sums:
                raise ValueError(f"leaf {i} summed twice")
            else:
                sums[int(i)] = float(part)
    out = []
    for i, (a, b) in enumerate(leaves):
        if i in sums:
            if i in cuts:
                raise ValueError(f"leaf {i} both summed and cut")
            out.append(sums[i])
            continue
        pieces = sorted(cuts.get(i, []), key=lambda p: p[0])
        at = a
        for start, values in pieces:
            if start != at:
                raise ValueError(f"leaf {i} [{a}, {b}): a part starts at {start}, expected {at}")
            at += values.size
        if at != b:
            raise ValueError(f"leaf {i} [{a}, {b}): the parts end at {at}")
        joined = np.concatenate([np.asarray(v, dtype=dtype) for _, v in pieces]) if pieces else np.empty(0, dtype)
        out.append(_LEAF_SUMS[kind](joined))
    return out


def dot_total(size: int, leaves: Sequence[float]) -> float:
    """``_dot_total``: a tensor's squared norm from its leaf sums (``combine_leaves(..., "dot")``)."""
    return _dot_total(size, leaves)
