"""What the payload writer and reader may hold and do at once (``Budget``), and the bounded,
ordered map that spreads their work over a few threads (``bounded``).

The bytes never depend on the budget: pieces and tensors are encoded and decoded independently,
and put in their place in order. A stream keeps to one piece or tensor at a time (its memory
bound; ``stream.py``), whole bytes in memory use ``WORKERS`` (``payload.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

from ..ahead import call as call
from ..ahead import ordered

PARALLEL_BYTES = 8 << 20  # of float32 input or of payload: below this, thread start-up costs more than it saves


@dataclass(frozen=True)
class Budget:
    """``workers``: pieces or tensors in the works at once, on threads when more than one (numpy
    and zstd release the GIL; few, as this runs beside training). ``piece``: bytes of a plain
    tensor encoded, decoded or read at a time. ``spool_memory``: compressed tensors kept in
    memory up to this many bytes, the rest in a temporary file."""

    workers: int = 1
    piece: int = 4 << 20
    spool_memory: float = 64 << 20

    def workers_for(self, nbytes: int) -> int:
        return self.workers if nbytes >= PARALLEL_BYTES else 1


def bounded(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> Generator[Any, None, None]:
    """``map(fn, items)`` in order, on ``workers`` threads, at most ``2 * workers`` items
    submitted and not yet handed on (so a thread that finishes before the oldest finds the next
    item waiting); with one worker, lazily on the caller's thread (``ahead.ordered``)."""
    return ordered(fn, items, threads=workers if workers > 1 else 0, queued=2 * workers, name="codec")
