"""An in-process mailbox: a sorted dict behind a lock. For tests and simulation.

Mailboxes opened with the same name share one store for the life of the process, so
``open_mailbox("memory://run")`` in two places (two simulated nodes, a CLI call in a test)
talks to the same data, as two machines sharing a bucket would.
"""

from __future__ import annotations

import bisect
import builtins
import threading
from collections.abc import Iterable, Iterator

from .contract import Chunk, check_list_args, check_object_key, check_object_keys

STREAM_PART = 1 << 20  # get_stream's default chunk: small, so tests see several chunks


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, bytes] = {}
        # Kept sorted so list() is a bisect plus a slice rather than a sort per poll.
        self.keys: builtins.list[str] = []


_REGISTRY: dict[str, _Store] = {}
_REGISTRY_LOCK = threading.Lock()


def _store_named(name: str | None) -> _Store:
    if name is None:
        return _Store()
    with _REGISTRY_LOCK:
        return _REGISTRY.setdefault(name, _Store())


class MemoryMailbox:
    """Thread-safe in-process mailbox. ``name=None`` gives a private, unshared store."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self._store = _store_named(name)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_object_key(key)
        data = bytes(data)  # a bytearray or memoryview must not change under us later
        s = self._store
        with s.lock:
            if key in s.objects:
                return False
            s.objects[key] = data
            bisect.insort(s.keys, key)
            return True

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        """``StreamingMailbox.put_stream``: the chunks are joined (the store is memory anyway) and
        stored at once; without ``create_once`` an existing object is replaced."""
        check_object_key(key)
        data = b"".join(chunks)
        s = self._store
        with s.lock:
            if key in s.objects:
                if create_once:
                    return False
            else:
                bisect.insort(s.keys, key)
            s.objects[key] = data
            return True

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        """``StreamingMailbox.get_stream``: views of the stored bytes, ``part_size`` at a time."""
        if part_size is not None and part_size < 1:
            raise ValueError(f"part_size={part_size!r}: expected None or an integer >= 1")
        data = self.get(key)
        if data is None:
            return None
        step = part_size or STREAM_PART
        view = memoryview(data)
        return (view[i : i + step] for i in range(0, len(data), step))

    def get(self, key: str) -> bytes | None:
        check_object_key(key)
        with self._store.lock:
            return self._store.objects.get(key)

    def get_prefix(self, key: str, n: int) -> bytes | None:
        """The first ``n`` bytes of the object (all of it for ``n < 0``); None if there is none."""
        data = self.get(key)
        return data if data is None or n < 0 else data[:n]

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        check_list_args(prefix, after)
        s = self._store
        with s.lock:
            # Keys are ASCII (validate_key), so str order is byte order.
            start = max(bisect.bisect_left(s.keys, prefix), bisect.bisect_right(s.keys, after))
            end = start
            while end < len(s.keys) and s.keys[end].startswith(prefix):
                end += 1
            return s.keys[start:end]

    def delete(self, keys: Iterable[str]) -> None:
        todo = check_object_keys(keys)
        s = self._store
        with s.lock:
            for key in todo:
                if s.objects.pop(key, None) is not None:
                    s.keys.pop(bisect.bisect_left(s.keys, key))

    def __repr__(self) -> str:
        return f"MemoryMailbox({self.name!r})"
