"""A tensor's float64 reductions (its squared norm, the cosine's leaf squares) when the tensor
is not in one array: a range of it held by one process (all of it, or a sharded closer's rank's
part), fed as consecutive pieces (a chunked payload's), the ranges' parts then pooled
(``Pooled``). Every result is the one ``fused.py`` computes over the whole tensor, bit for bit:
the same leaves, each summed over its own elements as one array, added along the same tree."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .fused import _LEAF, _dot_leaves, _dot_total, _scratch

# A closer sees each tensor as consecutive pieces, one per chunk: every float64 reduction runs over
# the same leaves, in the same order, along the same tree; a leaf that straddles two pieces is
# completed from the next one (at most ``_LEAF`` elements carried).


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


class Pooled:
    """One float64 sum per tensor (``kind``: ``"dot"``, a squared norm's leaves; ``"cosine"``, the
    cosine's leaf squares) over one rank's ``ranges``, pooled over the ranks as JSON (a cut leaf's
    values as base64 of their bytes, a sum as a float: JSON writes floats exactly).
    ``start()`` inside the phase (an attempt begins afresh), ``feed`` the range's values in order,
    return ``wire()`` from the phase; ``leaves``/``totals`` on what the phase pooled."""

    def __init__(self, kind: str, sizes: Mapping[str, int], ranges: Mapping[str, tuple[int, int]]) -> None:
        self.kind, self.sizes, self.bounds = kind, dict(sizes), dict(ranges)
        self.ranges: dict[str, LeafRange] = {}

    def start(self) -> None:
        make = dot_range if self.kind == "dot" else cosine_range
        self.ranges = {n: make(size, *self.bounds[n]) for n, size in self.sizes.items()}

    def feed(self, name: str, values: np.ndarray) -> None:
        self.ranges[name].feed(values)

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, r in self.ranges.items():
            parts: dict[str, Any] = {}
            for i, p in r.finish().items():
                if isinstance(p, tuple):
                    parts[str(i)] = [p[0], base64.b64encode(np.ascontiguousarray(p[1]).tobytes()).decode()]
                else:
                    parts[str(i)] = float(p).hex()
            out[name] = parts
        return out

    def leaves(self, pooled: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
        dtype = np.float32 if self.kind == "dot" else np.float64
        out = {}
        for name, size in self.sizes.items():
            ranks = []
            for got in pooled:
                parts: dict[int, Any] = {}
                for i, p in got.get(name, {}).items():
                    parts[int(i)] = (
                        (int(p[0]), np.frombuffer(base64.b64decode(p[1]), dtype=dtype))
                        if isinstance(p, list)
                        else float.fromhex(p)
                    )
                ranks.append(parts)
            out[name] = combine_leaves(size, self.kind, ranks)
        return out

    def totals(self, pooled: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Each tensor's squared norm (``kind == "dot"``), the one-process bits."""
        return {n: dot_total(self.sizes[n], leaves) for n, leaves in self.leaves(pooled).items()}
