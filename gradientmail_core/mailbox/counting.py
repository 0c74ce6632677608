"""A request-counting wrapper, for tests, benchmarks and cost estimates."""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .contract import Chunk, Mailbox, close_stream, read_many
from .forwarding import ForwardingMailbox


class CountingMailbox(ForwardingMailbox):
    """Wraps a mailbox and counts calls and bytes; for tests, benchmarks and cost estimates.

    ``counts`` has one entry per operation (LIST, GET, PUT, DELETE) and counts calls to
    the wrapped mailbox, not HTTP requests (an S3 listing of many pages is one LIST). A
    ranged read (``get_prefix``) is a GET of the bytes it returned. A stream is one PUT or GET
    (however many parts the backend sends), and its bytes count as they pass.
    """

    OPS = ("LIST", "GET", "PUT", "DELETE")

    def __init__(self, inner: Mailbox) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.counts: dict[str, int] = dict.fromkeys(self.OPS, 0)
        self.bytes_up = 0
        self.bytes_down = 0

    def reset(self) -> None:
        with self._lock:
            self.counts = dict.fromkeys(self.OPS, 0)
            self.bytes_up = 0
            self.bytes_down = 0

    def _count(self, op: str, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.counts[op] += 1
            self.bytes_up += up
            self.bytes_down += down

    def put_if_absent(self, key: str, data: bytes) -> bool:
        # Counted even when it raises: a failed request still costs a request.
        self._count("PUT", up=len(data))
        return super().put_if_absent(key, data)

    def get(self, key: str) -> bytes | None:
        return self._counted_read(super().get, key)

    def get_prefix(self, key: str, n: int) -> bytes | None:
        return self._counted_read(super().get_prefix, key, n)

    def get_many(self, wanted: builtins.list[str]) -> builtins.list[bytes | None]:
        """``read_many`` through this wrapper: a GET counted for each key, fetched as the wrapped
        mailbox fetches several at once (its ``get_many``, or threads where it allows them)."""
        found = read_many(self.inner, wanted)
        for data in found:
            self._count("GET", down=len(data) if data is not None else 0)
        return found

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        self._count("PUT")
        return super().put_stream(key, self._passing(chunks, up=True), create_once=create_once)

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        try:
            stream = super().get_stream(key, part_size=part_size)
        finally:
            self._count("GET")
        return None if stream is None else self._passing(stream, up=False)

    def _passing(self, chunks: Iterable[Chunk], *, up: bool) -> Iterator[Chunk]:
        it = iter(chunks)
        try:
            for chunk in it:
                n = memoryview(chunk).nbytes
                with self._lock:
                    if up:
                        self.bytes_up += n
                    else:
                        self.bytes_down += n
                yield chunk
        finally:
            close_stream(it)

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        self._count("LIST")
        return super().list(prefix, after)

    def delete(self, keys: Iterable[str]) -> None:
        self._count("DELETE")
        super().delete(keys)

    def _counted_read(self, read: Callable[..., bytes | None], *args: Any) -> bytes | None:
        try:
            data = read(*args)
        except BaseException:
            self._count("GET")
            raise
        self._count("GET", down=len(data) if data is not None else 0)
        return data
