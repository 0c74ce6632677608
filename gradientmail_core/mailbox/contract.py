"""The mailbox contract: four operations on a shared store, and the optional ranged read.

A mailbox is a flat key space of immutable objects (section 3.1 of the spec). Backends
provide ``put_if_absent``, ``get``, ``list`` and ``delete``; everything else in the
protocol is built from those four. A backend that can read part of an object cheaply (a
ranged GET, a bounded file read) also provides ``get_prefix``; ``read_prefix`` is how
callers use it, falling back to a whole ``get`` where it is missing.

A backend that can move an object without holding all of it in memory (S3 multipart uploads and
parallel ranged GETs, a file written and read in chunks) also provides ``put_stream`` and
``get_stream`` (``StreamingMailbox``); ``write_stream`` and ``read_stream`` are how callers use
them, joining the chunks into one ``bytes`` only where the backend cannot stream.
``docs/backends.md`` says how to write a backend or a wrapper.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

# A chunk handed to ``put_stream`` or yielded by ``get_stream``: any contiguous byte buffer.
# A yielded chunk stays valid after the next one is requested (backends never reuse its memory).
Chunk = bytes | bytearray | memoryview


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


@runtime_checkable
class StreamingMailbox(Mailbox, Protocol):
    """A mailbox that writes and reads an object chunk by chunk, never holding all of it.

    Optional, like ``RangedMailbox``: callers go through ``write_stream`` and ``read_stream``,
    which work with any ``Mailbox``. For payloads (content-addressed, hundreds of MB to GBs), so
    that moving one costs a bounded buffer (on S3 about ``part_size * max_concurrency``), not a
    joined copy of the object.
    """

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        """Write the object under ``key`` from ``chunks``, consumed in order as they come.

        Readers see no object, or an older object under ``key``, or the whole new one, never
        part of one: a stream that fails (an exception from ``chunks`` or from the store) leaves
        nothing under ``key`` and nothing half-written behind it (an S3 multipart upload is
        aborted). Validates ``key`` before consuming anything.

        - ``create_once=False`` (payloads, whose keys are content-addressed): an existing
          object under ``key`` is replaced. Returns True.
        - ``create_once=True``: like ``put_if_absent``. True only if this call created the
          object; False (and nothing changed) if ``key`` existed. The chunks may then have been
          consumed or not.
        """
        ...

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        """The object's bytes in order, chunk by chunk as they arrive; None if there is no object.

        Whether the object exists is settled before this returns (the first request is made
        eagerly); the iterator then yields non-empty chunks (``part_size`` bytes each where the
        backend reads in parts, the backend's default for None; an empty object yields nothing).
        A store failure in the middle surfaces from the iterator as ``MailboxUnavailable`` once
        the backend's retries are spent. Closing the iterator early (``close()``, or dropping a
        ``for`` loop) cancels the reads still in flight. The bytes are not verified: the
        caller checks them against the sha256 it expects.
        """
        ...


def write_stream(mailbox: Mailbox, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
    """Write ``key`` from ``chunks`` through ``mailbox.put_stream`` where the mailbox offers it.

    Otherwise the chunks are joined into one ``bytes`` and written with ``put_if_absent``; an
    object already under ``key`` is then kept, not replaced, so with ``create_once=False`` it is
    read back: True if it holds exactly our bytes, False if it holds others (for a
    content-addressed key: damaged or planted bytes, which the caller handles).

    Returns True when ``key`` holds exactly the streamed bytes because of this call (or, without
    ``create_once``, identical ones already there); False when ``create_once`` found the key taken
    (or, without a streaming backend, found other bytes there). See ``StreamingMailbox.put_stream``.
    """
    put_stream: Callable[..., bool] | None = getattr(mailbox, "put_stream", None)
    if put_stream is not None:
        return put_stream(key, chunks, create_once=create_once)
    data = b"".join(chunks)
    # Present-then-gone means a concurrent delete (GC); trying again settles it, as in create_once.
    for _ in range(3):
        if mailbox.put_if_absent(key, data):
            return True
        if create_once:
            return False
        existing = mailbox.get(key)
        if existing is not None:
            return existing == data
    return False


def read_stream(mailbox: Mailbox, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
    """The object's bytes chunk by chunk (``mailbox.get_stream`` where the mailbox offers it), or None.

    Without a streaming backend the object is read whole with ``get`` and yielded as one chunk.
    See ``StreamingMailbox.get_stream`` for what the iterator promises.
    """
    get_stream: Callable[..., Iterator[Chunk] | None] | None = getattr(mailbox, "get_stream", None)
    if get_stream is not None:
        return get_stream(key, part_size=part_size)
    data = mailbox.get(key)
    if data is None:
        return None
    return iter((data,) if data else ())


def read_many(mailbox: Mailbox, keys: Sequence[str]) -> builtins.list[bytes | None]:
    """What ``get`` returns for each of ``keys``, in order, fetched together where the backend can:
    its own ``get_many`` if it has one (a benchmark's simulated store charges one round trip), a
    pool of threads over ``get`` where it says its reads may run at once (``concurrent_reads``: S3
    and the stores that speak its API), else one after the other (in-memory and directory stores,
    and every wrapper that does not say so, whose faults and counts stay in order)."""
    keys = list(keys)
    get_many: Callable[[builtins.list[str]], builtins.list[bytes | None]] | None = getattr(mailbox, "get_many", None)
    if get_many is not None:
        return get_many(keys)
    return read_each(mailbox.get, keys, int(getattr(mailbox, "concurrent_reads", 0) or 0))


def read_each(get: Callable[[str], bytes | None], keys: Sequence[str], workers: int) -> builtins.list[bytes | None]:
    """``get`` of each key, in order: on a pool of ``workers`` threads if more than one."""
    if workers > 1 and len(keys) > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(keys))) as pool:
            return builtins.list(pool.map(get, keys))
    return [get(k) for k in keys]


def close_stream(stream: Iterable[Chunk]) -> None:
    """Close a stream a wrapper stops reading early, so that the backend cancels its reads in flight."""
    close: Callable[[], None] | None = getattr(stream, "close", None)
    if close is not None:
        close()


# ---- the key rules: what every mailbox refuses before any I/O ------------------------------

_KEY_CHARS = re.compile(r"[A-Za-z0-9._/-]+")
MAX_KEY_BYTES = 512


def validate_key(key: str) -> str:
    """Refuse keys that could escape the prefix or confuse a backend, before any I/O."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid mailbox key {key!r}: empty or not a string")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"invalid mailbox key {key[:40]!r}...: longer than {MAX_KEY_BYTES} bytes")
    if key.startswith("/") or "\\" in key or "\x00" in key or "//" in key:
        raise ValueError(f"invalid mailbox key {key!r}: leading '/', '//', backslash or NUL")
    if any(part in ("", ".", "..") for part in key.rstrip("/").split("/")):
        raise ValueError(f"invalid mailbox key {key!r}: '.' or '..' path segment")
    if not _KEY_CHARS.fullmatch(key):
        raise ValueError(f"invalid mailbox key {key!r}: only A-Z a-z 0-9 . _ / - are allowed")
    return key


def validate_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a key-like string (may end with '/')."""
    if prefix == "":
        return prefix
    return validate_key(prefix)


# ---- the checks every mailbox operation makes before any I/O ----------------------------


def check_object_key(key: str) -> str:
    """A key naming an object: a valid key that does not end with '/' (that is a prefix)."""
    validate_key(key)
    if key.endswith("/"):
        raise ValueError(f"invalid mailbox key {key!r}: an object key cannot end with '/'")
    return key


def check_list_args(prefix: str, after: str) -> None:
    validate_prefix(prefix)
    validate_prefix(after)


def check_object_keys(keys: Iterable[str]) -> list[str]:
    """Materialize and validate every key first, so a bad key in the middle deletes nothing."""
    if isinstance(keys, str):
        # A bare string is iterable; deleting its characters one by one is never meant.
        raise TypeError(f"delete() takes an iterable of keys, not the string {keys!r}")
    out = [check_object_key(k) for k in keys]
    return list(dict.fromkeys(out))
