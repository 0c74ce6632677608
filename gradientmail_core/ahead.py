"""Work done a few items ahead, in order (``ordered``): ``fn(item)`` of each item computed on up to
``threads`` worker threads while the caller uses the result before (the next chunk read and
decoded while this one is merged, the next payload chunk hashed while this one is written, a
payload's tensors encoded side by side). numpy, hashlib and zstd release the GIL."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    threads: int,
    queued: int,
    name: str = "work",
    drop: Callable[[R], None] | None = None,
) -> Generator[R, None, None]:
    """``map(fn, items)`` in order, on ``threads`` worker threads (0: lazily on the caller's
    thread), at most ``queued`` items submitted and not yet handed on; ``items`` is drawn on the
    caller's thread as room frees. ``drop``: for each result computed but not handed out (the
    caller stopped early)."""
    if threads <= 0:
        yield from map(fn, items)
        return
    pending: deque[Future[R]] = deque()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"gradientmail-{name}") as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= queued:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                if not fut.cancel() and drop is not None:
                    try:
                        drop(fut.result())
                    except BaseException:  # noqa: S110 - its error is moot: the caller failed already
                        pass


def call(make: Callable[[], R]) -> R:
    return make()
