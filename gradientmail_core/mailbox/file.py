"""A mailbox on a POSIX directory: the embedded default for single-machine runs and demos.

Each key is a file under the root (``rounds/0000000007.json`` is ``ROOT/rounds/0000000007.json``).
Create-once is atomic across processes: the bytes go to a temporary file first (fsynced),
then ``os.link`` gives it its final name, which fails if the name exists. A reader therefore
sees either no object or the whole object, never a half-written one. Payloads stream:
``put_stream`` writes the temporary file chunk by chunk and links it in the same way,
``get_stream`` reads the file in parts; neither holds a joined copy of the object.

Temporary files live in ``ROOT/~tmp/``; ``~`` is not a key character, so that directory can
never be listed or collide with a key. One limitation a directory has and a bucket has not:
a key cannot be both an object and a prefix ending in '/' of another key (``a`` and ``a/b``);
the protocol's keys never do that.
"""

from __future__ import annotations

import builtins
import errno
import os
import random
import re
import secrets
import stat
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

from ..errors import MailboxUnavailable
from .contract import Chunk, check_list_args, check_object_key, check_object_keys

TMP_DIR = "~tmp"
# get_stream's default part: large enough that the per-read overhead vanishes against the
# copy, small enough that a reader holds a few MB, not the payload.
READ_PART = 8 << 20
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
# A delete may remove an empty parent directory between our mkdir and our link; each retry
# recreates it. Three threads churning one directory needed at most 11 tries in 4,500 puts, but
# once on a loaded 2-core machine lost 64 in a row: from the fifth try on, a short random pause.
_LINK_TRIES = 64
_JITTER = random.Random()  # its own generator: no caller's seeded sequence moves
# Errors a shared or network directory gives while it is briefly unhealthy (NFS server
# restarting, disk momentarily full). Anything else (permissions, a bad path) is a real error.
_TRANSIENT_ERRNOS = {
    errno.EIO,
    errno.EAGAIN,
    errno.EINTR,
    errno.EBUSY,
    errno.ETIMEDOUT,
    errno.ESTALE,
    errno.ENOSPC,
    getattr(errno, "EDQUOT", errno.ENOSPC),
}


class FileMailbox:
    """Mailbox on a local or shared POSIX directory, safe for concurrent processes.

    ``fsync=False`` skips the file and directory fsyncs: faster on slow disks, but a power
    loss can then lose recent writes or keep a record while losing the payload it points to.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        # Resolved once, so the inside-the-root check compares resolved paths.
        self.path = os.path.realpath(os.fspath(path))
        self.fsync = fsync
        self._tmp = os.path.join(self.path, TMP_DIR)
        os.makedirs(self._tmp, exist_ok=True)

    def __repr__(self) -> str:
        return f"FileMailbox({self.path!r})"

    # ---- the four operations ------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_object_key(key)
        final = self._path(key)
        with self._transient("PUT", key):
            tmp = self._write_temp((data,))
            try:
                return self._link(tmp, final, key)
            finally:
                _unlink_quietly(tmp)

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        """Write ``key`` from ``chunks`` (``StreamingMailbox``): the temporary file is written chunk
        by chunk, then linked in as by ``put_if_absent``. Without ``create_once`` an existing
        object is replaced by an atomic rename (a reader holds the old file or the new one)."""
        check_object_key(key)
        final = self._path(key)
        with self._transient("PUT", key):
            tmp = self._write_temp(chunks)
            try:
                if self._link(tmp, final, key):
                    return True
                if create_once:
                    return False
                return self._replace(tmp, final, key)
            finally:
                _unlink_quietly(tmp)

    def get(self, key: str) -> bytes | None:
        return self.get_prefix(key, -1)

    def get_prefix(self, key: str, n: int) -> bytes | None:
        """The first ``n`` bytes of the object (all of it for ``n < 0``); None if there is none.

        Only a regular file is an object: a symlink, FIFO or device planted at a key (someone
        else writing into the directory) reads as absent, never as /dev/zero or a blocking pipe.
        """
        check_object_key(key)
        with self._transient("GET", key):
            f = self._open(key)
            if f is None:
                return None
            with f:
                return f.read(n)

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        """The object in chunks of ``part_size`` bytes (default ``READ_PART``), or None if there is none.

        The file is opened before this returns; a delete after that does not cut the stream short
        (POSIX keeps an open file's data).
        """
        check_object_key(key)
        if part_size is not None and part_size < 1:
            raise ValueError(f"part_size={part_size!r}: expected None or an integer >= 1")
        with self._transient("GET", key):
            f = self._open(key)
        return None if f is None else self._chunks(f, key, part_size or READ_PART)

    def _chunks(self, f: BinaryIO, key: str, size: int) -> Iterator[bytes]:
        # The file was opened outside the generator: one that is never started still closes
        # it when it is collected.
        with f:
            while True:
                with self._transient("GET", key):
                    chunk = f.read(size)
                if not chunk:
                    return
                yield chunk

    def _open(self, key: str) -> BinaryIO | None:
        """The object's file open for reading, or None. Only a regular file is an object: a
        symlink, FIFO or device planted at a key reads as absent, never as /dev/zero or a pipe."""
        try:
            fd = os.open(
                self._path(key),
                os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
            )
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                return None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return None
            return open(fd, "rb")  # the caller closes it
        except BaseException:
            os.close(fd)
            raise

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        check_list_args(prefix, after)
        out: builtins.list[str] = []
        with self._transient("LIST", prefix):
            self._walk(self.path, "", prefix, after, out)
        return out

    def delete(self, keys: Iterable[str]) -> None:
        todo = check_object_keys(keys)
        paths = [self._path(k) for k in todo]
        for key, path in zip(todo, paths):
            with self._transient("DELETE", key):
                try:
                    os.unlink(path)
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    continue
                except PermissionError:
                    # macOS answers unlink() of a directory with EPERM; it is a prefix, not an object.
                    if os.path.isdir(path):
                        continue
                    raise
                self._remove_empty_parents(os.path.dirname(path))

    # ---- helpers --------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        path = os.path.join(self.path, *key.split("/"))
        # Validated keys cannot climb out lexically; this catches a symlink planted in the tree.
        parent = os.path.realpath(os.path.dirname(path))
        if parent != self.path and not parent.startswith(self.path + os.sep):
            raise ValueError(f"mailbox key {key!r} resolves to {parent!r}, outside the mailbox directory {self.path!r}")
        return path

    def _replace(self, tmp: str, final: str, key: str) -> bool:
        """Put ``tmp`` in place of the object at ``final`` (atomic rename); False if a directory
        occupies the name."""
        for _ in range(_LINK_TRIES):
            try:
                os.replace(tmp, final)
            except IsADirectoryError:
                return False
            except FileNotFoundError:
                # The object and its parent were deleted since the link failed: link it afresh.
                if self._link(tmp, final, key):
                    return True
                continue
            if self.fsync:
                _fsync_dir(os.path.dirname(final))
            return True
        raise MailboxUnavailable(f"PUT {key!r} in {self.path!r}: could not replace the object; retry later")

    def _write_temp(self, chunks: Iterable[Chunk]) -> str:
        # pid + random: unique across processes and threads without coordination.
        tmp = os.path.join(self._tmp, f"{os.getpid()}-{secrets.token_hex(8)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(self._tmp, exist_ok=True)  # someone removed ~tmp; it is only scratch space
            fd = os.open(tmp, flags, 0o644)
        try:
            with open(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp

    def _link(self, tmp: str, final: str, key: str) -> bool:
        parent = os.path.dirname(final)
        for attempt in range(_LINK_TRIES):
            if attempt >= 4:
                # Threads or processes that keep creating and pruning one directory can fall into
                # step (each losing the same race every time): a short random pause breaks it.
                time.sleep(_JITTER.uniform(0.0, min(0.0005 * attempt, 0.01)))
            try:
                os.makedirs(parent, exist_ok=True)
            except (FileNotFoundError, FileExistsError, NotADirectoryError):
                # makedirs also raises FileExistsError when a concurrent delete prunes the
                # directory between its mkdir and its isdir check; only a file in the way is final.
                if self._object_above(parent):
                    raise ValueError(
                        f"mailbox key {key!r}: a leading part of it is an object in {self.path!r}"
                    ) from None
                continue
            try:
                os.link(tmp, final)
            except FileExistsError:
                # Something occupies the name (an object, or a directory someone planted there):
                # the key is taken. A directory reads back as absent, so create_once reports the
                # store as unavailable for this key and the node stalls on it instead of crashing.
                return False
            except FileNotFoundError:
                continue  # a concurrent delete pruned the empty parent between makedirs and link
            if self.fsync:
                # Makes the new name durable before we report success, so that after a crash
                # a record never survives without the payload written (and linked) before it.
                _fsync_dir(parent)
            return True
        raise MailboxUnavailable(
            f"PUT {key!r} in {self.path!r}: its directory kept disappearing under concurrent deletes "
            f"({_LINK_TRIES} tries); retry later"
        )

    def _object_above(self, directory: str) -> bool:
        while directory != self.path and directory.startswith(self.path + os.sep):
            if os.path.isfile(directory):
                return True
            directory = os.path.dirname(directory)
        return False

    def _walk(self, dirpath: str, rel: str, prefix: str, after: str, out: builtins.list[str]) -> None:
        """Append the keys under ``dirpath`` in byte order, skipping subtrees out of range.

        A directory ``d`` contributes keys that all start with ``d/``, so sorting a directory's
        entries by ``name`` for files and ``name + '/'`` for directories yields byte order; and
        a subtree whose ``rel/d/`` sorts before ``after`` without being a prefix of it holds no
        key greater than ``after`` and is never opened. The engine polls with
        ``after='rounds/...'``, which thus never walks ``blobs/``.
        """
        try:
            with os.scandir(dirpath) as it:
                entries = builtins.list(it)
        except (FileNotFoundError, NotADirectoryError):
            return  # removed by a concurrent delete: it holds nothing now
        items: builtins.list[tuple[str, bool, str]] = []
        for e in entries:
            if not _SEGMENT.fullmatch(e.name):
                continue  # ~tmp and anything else that cannot be a key
            try:
                if e.is_dir(follow_symlinks=False):
                    items.append((rel + e.name + "/", True, e.path))
                elif e.is_file(follow_symlinks=False):
                    items.append((rel + e.name, False, e.path))
            except OSError:
                continue  # vanished between scandir and stat
        items.sort()
        for key, is_dir, path in items:
            in_prefix = key.startswith(prefix)
            if not in_prefix and key > prefix and not prefix.startswith(key):
                break  # sorted: everything from here on is past the prefix range
            if is_dir:
                if not (in_prefix or prefix.startswith(key)):
                    continue
                if key <= after and not after.startswith(key):
                    continue  # the whole subtree sorts at or before `after`
                self._walk(path, key, prefix, after, out)
            elif in_prefix and key > after:
                out.append(key)

    def _remove_empty_parents(self, directory: str) -> None:
        # Opportunistic: rmdir fails on a non-empty directory, so a writer that just linked a
        # file is safe, and one that lost its directory between mkdir and link retries (_link).
        while directory != self.path and directory.startswith(self.path + os.sep):
            try:
                os.rmdir(directory)
            except OSError:
                return
            directory = os.path.dirname(directory)

    @contextmanager
    def _transient(self, op: str, key: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            if exc.errno in _TRANSIENT_ERRNOS:
                raise MailboxUnavailable(
                    f"{op} {key!r} in {self.path!r} failed: {exc}. Check that the directory is mounted, "
                    "writable and has free space; the run retries later."
                ) from exc
            raise


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the file itself is already durable
    finally:
        os.close(fd)
