"""The mailbox contract: four operations on a shared store, and the optional ranged read.

A mailbox is a flat key space of immutable objects (section 3.1 of the spec). Backends
provide ``put_if_absent``, ``get``, ``list`` and ``delete``; everything else in the
protocol is built from those four. A backend that can read part of an object cheaply (a
ranged GET, a bounded file read) also provides ``get_prefix``; ``read_prefix`` is how
callers use it, falling back to a whole ``get`` where it is missing.
``docs/backends.md`` says how to write a backend or a wrapper.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Mailbox(Protocol):
    """The whole surface a backend provides. Keys are relative to the mailbox root.

    Every operation validates its keys (``ValueError``) before any I/O. Transient store
    failures surface as ``MailboxUnavailable`` once the backend's own retries are spent.
    """

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data`` unless it exists. True only if this call created it."""
        ...

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if there is no such object."""
        ...

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        """Every key that starts with ``prefix`` and sorts strictly after ``after``, in byte order."""
        ...

    def delete(self, keys: Iterable[str]) -> None:
        """Remove the objects; keys that do not exist are ignored."""
        ...


@runtime_checkable
class RangedMailbox(Mailbox, Protocol):
    """A mailbox that can also read the start of an object without transferring the rest.

    Optional: the engine reads through ``read_prefix``, which works with any ``Mailbox``. The
    guard uses it to cap reads (a record at most its size limit plus one byte), so a hostile
    multi-gigabyte object under a record key costs a few kilobytes, not a download.
    """

    def get_prefix(self, key: str, n: int) -> bytes | None:
        """The first ``n`` bytes of the object (all of it for ``n < 0``), or None if there is none.

        Validates ``key`` and fails like ``get``; an object shorter than ``n`` comes back whole.
        """
        ...


def read_prefix(mailbox: Mailbox, key: str, n: int) -> bytes | None:
    """``mailbox.get_prefix(key, n)`` where the mailbox offers it; else the whole object, cut to ``n``."""
    get_prefix: Callable[[str, int], bytes | None] | None = getattr(mailbox, "get_prefix", None)
    if get_prefix is not None:
        return get_prefix(key, n)
    data = mailbox.get(key)
    return data if data is None or n < 0 or len(data) <= n else bytes(data[:n])
