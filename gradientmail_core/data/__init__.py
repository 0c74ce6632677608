"""Data loading from a ``gm.WorkQueue``: the indices of the units this node gets.

A dataset of ``length`` items is cut into the queue's ``units`` contiguous shards
(``unit_range``). Framework-free: ``iter_indices`` (one index at a time) and ``index_batches``
(numpy index arrays, for MLX or anything else). ``WorkSampler`` is a ``torch.utils.data.Sampler``
over the same indices, for a ``DataLoader`` (Lightning, Accelerate); it imports torch when used.

A unit is recorded done once the consumer has pulled every one of its indices, that is when it
asks for the index after the unit's last one (or the iteration ends). Stopping the iteration
early (``close()``, ``break`` then garbage collection, an exception) gives the unit back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .indices import index_batches, iter_indices, unit_indices, unit_range

if TYPE_CHECKING:
    from .torch import WorkSampler

__all__ = ["WorkSampler", "index_batches", "iter_indices", "unit_indices", "unit_range"]


def __getattr__(name: str) -> Any:
    if name == "WorkSampler":
        from .torch import WorkSampler

        return WorkSampler
    raise AttributeError(f"module 'gradientmail_core.data' has no attribute {name!r}")
