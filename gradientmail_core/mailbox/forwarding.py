"""The base of every mailbox that wraps another: it forwards every operation to ``inner``.

A wrapper (counting, fault injection, the guard, the simulation's auditor) derives from
``ForwardingMailbox`` and overrides only what it changes. Whatever it does not override,
including the optional ranged read and the streams, reaches the inner mailbox unchanged, so
stacking wrappers never turns a ranged read into a whole download nor a stream into a joined copy.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Iterator

from .contract import Chunk, Mailbox, read_prefix, read_stream, write_stream


class ForwardingMailbox:
    """A mailbox that is ``inner``, unchanged. A ``RangedMailbox`` and a ``StreamingMailbox``
    whatever ``inner`` is: ``get_prefix``, ``put_stream`` and ``get_stream`` use the inner ones
    where they exist and fall back on ``get`` / ``put_if_absent`` otherwise (``read_prefix``,
    ``write_stream``, ``read_stream``)."""

    def __init__(self, inner: Mailbox) -> None:
        self.inner = inner

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, data)

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def get_prefix(self, key: str, n: int) -> bytes | None:
        return read_prefix(self.inner, key, n)

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        return write_stream(self.inner, key, chunks, create_once=create_once)

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        return read_stream(self.inner, key, part_size=part_size)

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        return self.inner.list(prefix, after)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
