"""The indices of the units a ``gm.WorkQueue`` hands this node (``gradientmail_core.data``)."""

from __future__ import annotations

from collections.abc import Generator, Iterator

import numpy as np

from ..workqueue.queue import HoldLost, WorkQueue


def unit_range(unit: int, units: int, length: int) -> range:
    """The items of ``unit``: ``[unit*length//units, (unit+1)*length//units)`` (sizes differ by
    at most one; a unit is empty when there are fewer items than units)."""
    if not 0 <= unit < units:
        raise ValueError(f"unit {unit} out of range 0..{units - 1}")
    return range(unit * length // units, (unit + 1) * length // units)


def unit_indices(unit: int, units: int, length: int, *, shuffle: bool = False, seed: int = 0) -> list[int]:
    """The indices of ``unit``, shuffled with a generator seeded by ``(seed, unit)`` when asked:
    a unit handed out again is read in the same order."""
    r = unit_range(unit, units, length)
    if not shuffle:
        return list(r)
    order = np.random.default_rng([seed, unit]).permutation(len(r))
    return [r.start + int(i) for i in order]


def iter_indices(queue: WorkQueue, length: int, *, shuffle: bool = False, seed: int = 0) -> Generator[int, None, None]:
    """Indices of the units ``queue`` hands this node, unit after unit, until every unit is
    done. Renews the unit held as it goes; a unit lost to another holder is dropped."""
    if length < 0:
        raise ValueError(f"length={length}: expected >= 0")
    while True:
        hold = queue.next_unit()
        if hold is None:
            return
        finished = False
        try:
            for i, index in enumerate(unit_indices(hold.unit, queue.units, length, shuffle=shuffle, seed=seed)):
                queue.renew(hold, consumed=i)
                yield index
            queue.complete(hold)
            finished = True
        except HoldLost:
            finished = True  # nothing to give back
        finally:
            if not finished:
                queue.release(hold)


def index_batches(
    queue: WorkQueue,
    length: int,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
) -> Iterator[np.ndarray]:
    """``iter_indices`` in int64 numpy arrays of ``batch_size`` (batches may span two units).
    For MLX: ``mx.array(data[batch])``. ``drop_last``: a short last batch is not yielded (its
    units still count as done)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: expected >= 1")
    it = iter_indices(queue, length, shuffle=shuffle, seed=seed)
    try:
        buf: list[int] = []
        for index in it:
            buf.append(index)
            if len(buf) == batch_size:
                yield np.asarray(buf, dtype=np.int64)
                buf = []
        if buf and not drop_last:
            yield np.asarray(buf, dtype=np.int64)
    finally:
        it.close()
