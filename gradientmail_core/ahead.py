"""Work done a few items ahead, in order: each ``make()`` of a sequence computed up to ``ahead_n``
ahead on worker threads while the caller uses the one before (the next chunk read and decoded
while this one is merged, the next payload chunk hashed while this one is written)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def ahead(
    makes: Sequence[Callable[[], T]],
    *,
    threaded: bool,
    ahead_n: int = 2,
    name: str = "commit",
    drop: Callable[[T], None] | None = None,
) -> Generator[T, None, None]:
    """Each ``make()`` in order, up to ``ahead_n`` of them computed ahead on worker threads (the
    next chunks read, or hashed, while this one is used). ``drop``: for each result computed but
    not handed out (the caller stopped early)."""
    if not threaded:
        for make in makes:
            yield make()
        return
    pending: deque[Future[T]] = deque()
    with ThreadPoolExecutor(max_workers=ahead_n, thread_name_prefix=f"gradientmail-{name}") as pool:
        try:
            for make in makes:
                pending.append(pool.submit(make))
                if len(pending) > ahead_n:
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
