"""``WorkSampler``: a ``torch.utils.data.Sampler`` over the indices a ``gm.WorkQueue`` hands
this node. Use it as a ``DataLoader``'s ``sampler=`` (Lightning: ``use_distributed_sampler=False``
when the node has several ranks; Accelerate keeps a custom sampler as it is)."""

from __future__ import annotations

from collections.abc import Iterator, Sized

from ..errors import MissingExtra
from ..workqueue.queue import WorkQueue
from .indices import iter_indices

try:
    from torch.utils.data import Sampler
except ImportError as e:  # pragma: no cover - exercised without torch only
    raise MissingExtra("torch", "torch") from e

__all__ = ["WorkSampler"]


class WorkSampler(Sampler[int]):
    """Indices of the units ``queue`` hands this node (``gradientmail_core.data.unit_range``
    cuts the dataset into the queue's units). ``data``: the dataset, or its length.

    Each ``iter()`` continues the queue; it ends once every unit is done, so one queue is one
    pass over the data (use a queue per epoch: ``name=f"epoch-{e}"``). No ``len()``: how many
    indices this node gets depends on the others. The sampler runs in the ``DataLoader``'s main
    process (workers only load items), so ``num_workers`` does not matter to it; with
    prefetching, a unit counts as done once the loader has fetched its last index.
    """

    def __init__(self, queue: WorkQueue, data: Sized | int, *, shuffle: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.queue = queue
        self.length = data if isinstance(data, int) else len(data)
        self.shuffle, self.seed = shuffle, seed

    def __iter__(self) -> Iterator[int]:
        return iter_indices(self.queue, self.length, shuffle=self.shuffle, seed=self.seed)
