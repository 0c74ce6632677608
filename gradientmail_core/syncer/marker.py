"""A local marker of the process that holds a learner id on this host, so that a process
restarted under the same id takes its dead predecessor's lease over at once, instead of
watching the lease for 1.5 renewal intervals (``LeaseWriter.acquire``).

The marker is a file per (run, learner id) holding the holder's nonce, on which that process keeps
a POSIX record lock (``fcntl.lockf``). Such a lock dies with its process and is not inherited by
forked children, so a process that takes the lock knows the nonce in the file is a dead
process's. In every other case the lease is watched as before: the marker only ever shortens
that wait.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
import threading

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no marker, the lease is watched
    fcntl = None  # type: ignore[assignment]

_NONCE = re.compile(r"[0-9a-f]{8,64}")
# Markers this process holds: POSIX locks are per process, so a second session of this process
# would take the lock (and closing its descriptor would drop the first one's).
_HELD: set[str] = set()
_HELD_LOCK = threading.Lock()


def default_directory() -> str:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"gradientmail-{uid}")


class RestartMarker:
    def __init__(self, learner: str, directory: str | os.PathLike[str] | None = None) -> None:
        self.learner = learner
        self.directory = os.fspath(directory) if directory is not None else default_directory()
        self.path: str | None = None
        self._fd: int | None = None

    def open(self, run_id: str) -> str | None:
        """Lock the marker of ``run_id`` for this learner id. Returns the nonce it holds when
        that is a dead process's (the lock was free), else None (and nothing is held)."""
        if fcntl is None or self._fd is not None:
            return None
        name = hashlib.sha256(f"{run_id}/{self.learner}".encode()).hexdigest()[:32]
        path = os.path.join(self.directory, name)
        with _HELD_LOCK:
            if path in _HELD:
                return None
            fd = self._lock(path)
            if fd is None:
                return None
            _HELD.add(path)
        self.path, self._fd = path, fd
        try:
            old = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        except OSError:
            return None
        return old if _NONCE.fullmatch(old) else None

    def _lock(self, path: str) -> int | None:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            st = os.stat(self.directory)
            # Only a private directory of ours: nobody else may plant a marker for us to trust.
            if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
                return None
            fd = os.open(
                path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0), 0o600
            )
        except OSError:
            return None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return fd

    def hold(self, nonce: str) -> None:
        """Record ``nonce`` (this process's) in the marker, once its lease is written."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, nonce.encode("ascii"), 0)
        except OSError:
            pass

    def close(self) -> None:
        """Release the marker (the lock); the file stays, naming the process that left."""
        if self._fd is None:
            return
        fd, path = self._fd, self.path
        self._fd = self.path = None
        os.close(fd)
        with _HELD_LOCK:
            _HELD.discard(path or "")
