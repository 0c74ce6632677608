"""Typed access to a run's mailbox: records in, records out, payloads by reference.

``RunStore`` is the engine's single door to the store: the node, the lease, the run and the
tape readers read, write, list and delete only through it, so validation (and, with a run
secret, authentication) and the handling of create-once conflicts happen in one place.

Payloads move as streams (``mailbox.write_stream`` / ``read_stream``): a ``PayloadStream`` goes
out as it is produced, and a payload read is verified and decoded as its parts arrive
(``codec.stream``), so moving one never needs a joined copy of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np

from ..codec.payload import sha256_hex
from ..codec.stream import PayloadStream, decode_stream
from ..errors import MailboxUnavailable, PayloadCorrupt, RecordInvalid
from ..mailbox import Chunk, CreateOutcome, Mailbox, create_once, read_stream, write_stream
from . import keys
from .records import PayloadRef, decode, encode

R = TypeVar("R")
# Bytes payloads from this size on are streamed (as views of PUT_PIECE; backends regroup them into
# parts): below it one PUT costs no more than one part would.
STREAM_BYTES = 64 << 20
PUT_PIECE = 8 << 20
# A stream smaller than this is joined and written as one create-once PUT, as every other object:
# its copy is small, and a PUT of it costs what one part would.
JOIN_BELOW = 1 << 20


class RunStore:
    def __init__(self, mailbox: Mailbox, *, auth: Any = None, on_ignored: Callable[[str, str], None] | None = None):
        self.mailbox = mailbox
        self.auth = auth  # optional signer/verifier (run secret); None = unauthenticated run
        self.on_ignored = on_ignored or (lambda key, reason: None)
        self.bytes_up = 0
        self.bytes_down = 0

    def limit_payloads(self, max_bytes: int) -> None:
        """Cap payload reads at the run's largest payload, once the run is known (with a guard
        underneath; a bare mailbox is read uncapped, as the benchmarks and tests do)."""
        limit = getattr(self.mailbox, "limit_payloads", None)
        if limit is not None:
            limit(max_bytes)

    # ---- records ----------------------------------------------------------------------
    def encode_record(self, record: Any) -> bytes:
        if self.auth is not None:
            record = self.auth.sign(record)
        return encode(record)

    def put_record(self, key: str, record: Any) -> tuple[CreateOutcome, bytes | None]:
        data = self.encode_record(record)
        self.bytes_up += len(data)
        return create_once(self.mailbox, key, data)

    def decode_record(self, data: bytes | None, cls: type[R], key: str) -> R:
        record = decode(data, cls, key=key)
        if self.auth is not None:
            self.auth.verify(record, key)
        return record

    def read_record(self, key: str, cls: type[R]) -> R | None:
        """The record at ``key``; None if it is missing. Raises ``RecordInvalid`` if corrupt."""
        data = self.mailbox.get(key)
        if data is None:
            return None
        self.bytes_down += len(data)
        return self.decode_record(data, cls, key)

    def try_record(self, key: str, cls: type[R]) -> R | None:
        """Like ``read_record`` but a corrupt or forged record is reported and skipped."""
        try:
            return self.read_record(key, cls)
        except RecordInvalid as e:
            self.on_ignored(key, str(e))
            return None

    # ---- listing and deleting ---------------------------------------------------------
    def keys(self, prefix: str, after: str = "") -> list[str]:
        """Every key under ``prefix`` that sorts after ``after``, in byte order."""
        return self.mailbox.list(prefix, after)

    def delete(self, doomed: Iterable[str]) -> None:
        """Remove objects (keys that do not exist are ignored)."""
        self.mailbox.delete(doomed)

    # ---- payloads ---------------------------------------------------------------------
    def put_payload(self, key_for_sha: Callable[[str], str], data: bytes | PayloadStream) -> PayloadRef:
        """Write a content-addressed payload (its bytes, or a stream of them). Re-putting one that
        exists is harmless."""
        sha = data.sha256 if isinstance(data, PayloadStream) else sha256_hex(data)
        key = key_for_sha(sha)
        self.put_blob(key, data)
        return PayloadRef(key=key, sha256=sha, size=len(data))

    def put_blob(self, key: str, data: bytes | PayloadStream) -> None:
        """Write payload bytes (or a stream of them) under their content-addressed ``key`` (the
        caller hashed them to name it). Re-putting one is harmless: the key names the bytes.

        A stream from ``JOIN_BELOW`` on, and bytes from ``STREAM_BYTES`` on, go out through ``write_stream`` (on S3 a
        multipart upload, parts in parallel): a stream as it is produced, bytes as views of
        ``PUT_PIECE``, never copied. A write that fails half-way (the store, or a stream whose
        bytes come out differently the second time) leaves nothing under ``key``. Smaller ones
        are one create-once PUT, as every other object."""
        blob = keys.parse_blob_key(key)
        assert blob is not None, f"{key} is not a payload key"
        if isinstance(data, PayloadStream) and data.size < JOIN_BELOW:
            assert data.sha256 == blob.sha, f"{key} does not name the stream's sha256 {data.sha256}"
            data = data.read()
        if isinstance(data, PayloadStream) or len(data) >= STREAM_BYTES:
            if isinstance(data, PayloadStream):
                assert data.sha256 == blob.sha, f"{key} does not name the stream's sha256 {data.sha256}"
                chunks: Iterable[Chunk] = data.chunks()
            else:
                view = memoryview(data)
                chunks = (view[i : i + PUT_PIECE] for i in range(0, len(view), PUT_PIECE))
            if not write_stream(self.mailbox, key, chunks):
                # Only a store that cannot replace an object (no streams) keeps other bytes under
                # the name: damaged in transit or at rest. Transient for the caller.
                raise MailboxUnavailable(f"{key}: the store holds bytes that are not ours under this name; retry")
            self.bytes_up += len(data)
            return
        outcome, existing = create_once(self.mailbox, key, data)
        if outcome is CreateOutcome.TAKEN:
            if existing is not None and sha256_hex(existing) != blob.sha:
                # The read-back does not hash to the name: damaged in transit (or at rest). Transient.
                raise MailboxUnavailable(f"{key}: reading it back gave bytes that do not match its sha256; retry")
            # Same name means same sha256; different bytes under it means the store is lying.
            raise PayloadCorrupt(f"{key}: holds different bytes than its sha256 name says")
        self.bytes_up += len(data)

    def get_payload(
        self,
        ref: PayloadRef,
        expected: Mapping[str, tuple[int, ...]],
        *,
        max_bytes: int | None = None,
        dtypes: Mapping[str, str] | None = None,
    ) -> dict[str, np.ndarray] | None:
        """Fetch, verify and decode a payload as its parts arrive. None if it is gone;
        ``PayloadCorrupt`` if bad: cut short, too long, not hashing to ``ref.sha256``
        (``PayloadLayoutMismatch`` if intact but of other tensors, or other ``dtypes``). Nothing
        decoded is returned before the whole payload has been verified."""
        if max_bytes is not None and ref.size > max_bytes:
            raise PayloadCorrupt(f"{ref.key}: declared size {ref.size} exceeds the cap of {max_bytes} bytes")
        try:
            compression = keys.compression_of(ref.key)
        except ValueError as e:
            raise PayloadCorrupt(str(e)) from None
        chunks = read_stream(self.mailbox, ref.key)
        if chunks is None:
            return None
        try:
            return decode_stream(
                self._counted(chunks),
                expected,
                size=ref.size,
                sha256=ref.sha256,
                compression=compression,
                max_bytes=max_bytes,
                dtypes=dtypes,
                key=ref.key,
            )
        finally:
            close = getattr(chunks, "close", None)  # cancels the reads still in flight
            if close is not None:
                close()

    def _counted(self, chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        for chunk in chunks:
            self.bytes_down += len(chunk)
            yield chunk
