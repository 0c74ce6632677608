"""A closer's local spool: the contribution chunks it judged, kept for the merge passes
(``docs/protocol.md`` section 10, "The spool").

Each chunk is named by its sha256 and kept either on disk (its encoded bytes, checked against the
sha256 on every read) for a fragment of several chunks, or decoded in memory (``hold``: read-only
float32 arrays) for a fragment of one chunk. Each entry is tagged with the newest round that needs
it (``drop_through``); an entry past ``max_bytes``, or leaving less than ``RESERVE_BYTES`` free on
its disk, is not kept (the merge downloads it again).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO

import numpy as np

from ..codec.payload import decode_payload
from ..codec.plan import ChunkSpec
from ..errors import PayloadCorrupt, PayloadLayoutMismatch
from ..mailbox import Chunk
from ..protocol import keys
from ..protocol.records import PayloadRef

PREFIX = "gradientmail-spool-"
READ_BYTES = 1 << 20  # bytes per read of a spooled file
MAX_BYTES = 64 << 30  # default bound on what one node's spool holds
RESERVE_BYTES = 1 << 30  # free space a spool never takes on its disk


class Spool:
    """Content-addressed chunk bytes on local disk, per node (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, max_bytes: int = MAX_BYTES) -> None:
        self.root = (
            Path(root) if root is not None else Path(os.environ.get("GRADIENTMAIL_SPOOL_DIR") or tempfile.gettempdir())
        )
        self.max_bytes = max_bytes
        self.dir: Path | None = None
        self.entries: dict[str, tuple[int, int]] = {}  # sha256 -> (size, newest round that needs it)
        self.held: dict[str, tuple[dict[str, np.ndarray], int]] = {}  # sha256 -> (decoded, round)
        self.bytes = 0
        self._finalizer: weakref.finalize | None = None

    # ---- writing ----------------------------------------------------------------------------
    def _directory(self) -> Path:
        if self.dir is None:
            self.root.mkdir(parents=True, exist_ok=True)
            _sweep(self.root)
            self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.root))
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        return self.dir

    def room(self, size: int) -> bool:
        """Would an entry of ``size`` bytes be kept?"""
        if self.bytes + size > self.max_bytes:
            return False
        try:
            free = shutil.disk_usage(self._directory()).free
        except OSError:
            return False
        return free - size >= RESERVE_BYTES

    @contextlib.contextmanager
    def writer(self, sha256: str, size: int, round: int) -> Iterator[Writer | None]:
        """A file to write the bytes of ``sha256`` into as they arrive; kept only if the block exits
        normally, the writer is ``commit``ted (by the caller that checked their sha256) and exactly
        ``size`` bytes were written. None when the entry is here already (its round raised) or no room."""
        if sha256 in self.entries:
            kept, r = self.entries[sha256]
            self.entries[sha256] = (kept, max(r, round))  # needed through the later round too
            yield None
            return
        w = None
        if self.room(size):
            try:
                w = Writer(self._directory(), sha256, size)
            except OSError:
                w = None  # a spool that cannot write keeps nothing: the chunk is read again later
        if w is None:
            yield None
            return
        try:
            yield w
        except BaseException:
            w.abort()
            raise
        if w.close():
            self.entries[sha256] = (size, round)
            self.bytes += size
        else:
            w.abort()

    def put(self, sha256: str, chunks: Iterable[Chunk], size: int, round: int) -> bool:
        """Keep the bytes ``chunks`` yields (all of them, now; ``PayloadStream.chunks()``, which
        raises if they are not the bytes it hashed) as entry ``sha256``. True if the spool holds
        it afterwards; False (nothing kept) if it has no room or the bytes did not come out whole."""
        try:
            with self.writer(sha256, size, round) as w:
                if w is None:
                    return sha256 in self.entries
                for c in chunks:
                    w.write(c)
                w.commit()
        except PayloadCorrupt:
            return False
        return sha256 in self.entries

    def hold(self, sha256: str, values: Mapping[str, np.ndarray], round: int) -> None:
        """Keep a chunk decoded in memory (its pieces' flat float32 values, made read-only: a reader
        that scales them works on a copy), needed through ``round``."""
        if sha256 in self.held:
            self.held[sha256] = (self.held[sha256][0], max(self.held[sha256][1], round))
            return
        kept = {}
        for name, v in values.items():
            a = np.asarray(v, np.float32).reshape(-1)
            a.setflags(write=False)
            kept[name] = a
        self.held[sha256] = (kept, round)

    def decoded(self, sha256: str) -> dict[str, np.ndarray] | None:
        got = self.held.get(sha256)
        return None if got is None else got[0]

    # ---- reading ----------------------------------------------------------------------------
    def read(
        self, ref: PayloadRef, s: ChunkSpec, *, dtypes: Mapping[str, str], cap: int
    ) -> dict[str, np.ndarray] | None:
        """Chunk ``s`` of a payload (``ref``: the chunk's ref) from this spool: held decoded, or its
        bytes on disk, verified and decoded again (``{piece name: flat values}``); None when not
        here, or damaged on disk (then dropped: read it from the store again)."""
        held = self.decoded(ref.sha256)
        if held is not None:
            if {n: v.size for n, v in held.items()} != {p.name: p.size for p in s.pieces}:
                raise PayloadLayoutMismatch(f"{ref.key}: its chunk holds other tensors than chunk {s.k}'s")
            return held
        if ref.sha256 not in self.entries or ref.size > cap:
            return None
        try:
            compression = keys.compression_of(ref.key)
        except ValueError as e:
            raise PayloadCorrupt(str(e)) from None
        try:
            got = decode_payload(
                self.chunks(ref.sha256), s, size=ref.size, sha256=ref.sha256, compression=compression,
                max_bytes=cap, dtypes=dtypes, key=ref.key,
            )  # fmt: skip
        except PayloadLayoutMismatch:
            raise
        except (PayloadCorrupt, OSError):
            self.discard(ref.sha256)  # damaged on disk (or gone): read it from the store again
            return None
        return {name: v.reshape(-1) for name, v in got.items()}

    def chunks(self, sha256: str) -> Iterator[bytes]:
        """The bytes of entry ``sha256``, as they are on disk (the reader checks them: ``decode_payload``)."""
        assert self.dir is not None and sha256 in self.entries, sha256
        left = self.entries[sha256][0]
        with open(self.dir / sha256, "rb", buffering=0) as f:
            # Reads of at most what is left (a read of n bytes allocates n first), then one more:
            # a file grown on disk ends in bytes the reader's size check refuses.
            while piece := f.read(max(1, min(READ_BYTES, left))):
                left -= len(piece)
                yield piece

    # ---- forgetting -------------------------------------------------------------------------
    def discard(self, sha256: str) -> None:
        self.held.pop(sha256, None)
        got = self.entries.pop(sha256, None)
        if got is not None and self.dir is not None:
            self.bytes -= got[0]
            with contextlib.suppress(OSError):
                os.unlink(self.dir / sha256)

    def drop_through(self, round: int) -> None:
        """Delete every entry no round after ``round`` needs."""
        for sha in [s for s, (_, r) in [*self.entries.items(), *self.held.items()] if r <= round]:
            self.discard(sha)

    def close(self) -> None:
        """Delete the spool's directory and everything in it (a later write makes a new one)."""
        self.entries.clear()
        self.held.clear()
        self.bytes = 0
        if self._finalizer is not None:
            self._finalizer()  # rmtree, once
        self.dir, self._finalizer = None, None


class Writer:
    """One entry being written: a temporary file, renamed to its sha256 when complete. The bytes
    are hashed by whoever hands them over (``decode_payload`` as it decodes them, a
    ``PayloadStream`` as it produces them again), not a second time here; every later read of
    the entry checks them against the sha256 anyway."""

    def __init__(self, directory: Path, sha256: str, size: int) -> None:
        self.sha256, self.size = sha256, size
        self.final = directory / sha256
        fd, name = tempfile.mkstemp(prefix=".part-", dir=directory)
        self.tmp = Path(name)
        self.file: IO[bytes] | None = os.fdopen(fd, "wb")
        self.written = 0
        self.committed = False

    def write(self, chunk: Chunk) -> None:
        if self.file is None:
            return
        try:
            self.file.write(chunk)
        except OSError:  # disk full, gone: keep nothing, the reader carries on without us
            self.abort()
            return
        self.written += memoryview(chunk).nbytes

    def commit(self) -> None:
        """The bytes are complete and their sha256 was checked as they passed: keep them."""
        self.committed = True

    def close(self) -> bool:
        """Rename into place if committed and complete; False (and nothing kept) otherwise."""
        if self.file is None:
            return False
        try:
            self.file.close()
        except OSError:
            self.file = None
            return False
        self.file = None
        if not (self.committed and self.written == self.size):
            return False
        try:
            os.replace(self.tmp, self.final)
        except OSError:
            return False
        return True

    def abort(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


def _sweep(root: Path) -> None:
    """Remove spool directories under ``root`` whose process is gone (killed before it cleaned up)."""
    try:
        found = list(root.glob(PREFIX + "*"))
    except OSError:
        return
    for d in found:
        pid = d.name[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass  # alive (another user's, or no permission to signal it)
