"""Typed access to a run's mailbox: records in, records out, payloads by reference.

``RunStore`` is the engine's single door to the store: validation (and, with a run secret,
authentication) and the handling of create-once conflicts happen in one place. Payloads move as
streams, verified and decoded as their parts arrive, so moving one never needs a joined copy. A
chunked payload is one object per chunk (``docs/protocol.md``, "Chunked payloads"); where each
part of one lives is listed in ``protocol/layout.py``'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from ..codec.header import sha256_hex
from ..codec.payload import PayloadStream, Values, decode_payload, encode_payload
from ..codec.plan import ChunkSpec, Piece, assemble, chunk_spec, chunk_specs, fragment_plan, is_one_whole_chunk
from ..errors import MailboxUnavailable, PayloadCorrupt, RecordInvalid
from ..mailbox import Chunk, CreateOutcome, Mailbox, create_once, read_many, read_stream, write_stream
from ..mailbox.contract import close_stream
from . import keys
from .records import PayloadRef, chunk_refs, decode, encode, join_refs

R = TypeVar("R")
# Bytes payloads from this size on are streamed (as views of PUT_PIECE; backends regroup them into
# parts): below it one PUT costs no more than one part would.
STREAM_BYTES = 64 << 20
PUT_PIECE = 8 << 20
# A stream smaller than this is joined and written as one create-once PUT, as every other object:
# its copy is small, and a PUT of it costs what one part would.
JOIN_BELOW = 1 << 20
# What a chunked payload may weigh beyond a whole one's cap, per chunk after the first: a header
# of its own (the fixed metadata, and the entries of the tensors it shares with its neighbours).
CHUNK_HEADER_ALLOWANCE = 4096


class RunStore:
    def __init__(self, mailbox: Mailbox, *, auth: Any = None, on_ignored: Callable[[str, str], None] | None = None):
        self.mailbox = mailbox
        self.auth = auth  # optional signer/verifier (run secret); None = unauthenticated run
        self.on_ignored = on_ignored or (lambda key, reason: None)
        self.bytes_up = 0
        self.bytes_down = 0
        # Objects fetched together ahead of their reads (``prefetch``): key -> bytes, each taken by
        # the first read of its key (``read_record``, a payload read), the rest by ``drop_prefetched``.
        self.ahead: dict[str, bytes] = {}

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
        return self.put_encoded(key, self.encode_record(record))

    def put_encoded(self, key: str, data: bytes) -> tuple[CreateOutcome, bytes | None]:
        """Create the record bytes ``data`` (``encode_record``'s) at ``key`` once."""
        self.bytes_up += len(data)
        return create_once(self.mailbox, key, data)

    def put_own(self, key: str, record: Any, nonce: str) -> bool:
        """Create ``record`` (a record with a ``nonce``) at ``key`` once. True if the key holds this
        writer's record: created now, or found with ``nonce``, our own earlier attempt whose reply
        was lost (a lost acknowledgement, not another writer). False: another writer's."""
        outcome, existing = self.put_record(key, record)
        if outcome is not CreateOutcome.TAKEN:
            return True
        try:
            return self.decode_record(existing, type(record), key).nonce == nonce
        except RecordInvalid:
            return False

    def decode_record(self, data: bytes | None, cls: type[R], key: str) -> R:
        record = decode(data, cls, key=key)
        if self.auth is not None:
            self.auth.verify(record, key)
        return record

    def prefetch(self, wanted: Sequence[str]) -> None:
        """Fetch these objects together (``read_many``: one round trip for all of them on a store
        whose reads run at once) and keep them for the reads that follow. Missing ones are not kept:
        their reads ask the store again, and find them missing or landed since."""
        todo = [k for k in dict.fromkeys(wanted) if k not in self.ahead]
        for k, data in zip(todo, read_many(self.mailbox, todo), strict=True):
            if data is not None:
                self.ahead[k] = data

    def peek(self, key: str) -> bytes | None:
        """The prefetched bytes of ``key`` (None if not fetched ahead), left for its read."""
        return self.ahead.get(key)

    def drop_prefetched(self) -> None:
        self.ahead.clear()

    def read_record(self, key: str, cls: type[R]) -> R | None:
        """The record at ``key``; None if it is missing. Raises ``RecordInvalid`` if corrupt."""
        data = self.ahead.pop(key, None)
        if data is None:
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
        """Write payload bytes (or a stream of them) under their content-addressed ``key``; re-putting
        one is harmless. A stream from ``JOIN_BELOW`` on, and bytes from ``STREAM_BYTES`` on, go out
        through ``write_stream`` (parts in parallel), never copied; a write that fails half-way leaves
        nothing under ``key``. Smaller ones are one create-once PUT."""
        blob = keys.parse_blob_key(key)
        assert blob is not None, f"{key} is not a payload key"
        if isinstance(data, PayloadStream):
            assert data.sha256 == blob.sha, f"{key} does not name the stream's sha256 {data.sha256}"
            if data.size < JOIN_BELOW:
                data = data.read()
        if isinstance(data, PayloadStream) or len(data) >= STREAM_BYTES:
            if isinstance(data, PayloadStream):
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
        chunk_elements: int | None = None,
    ) -> dict[str, np.ndarray] | None:
        """Fetch, verify and decode a payload as its parts arrive. None if it (or any chunk) is gone;
        ``PayloadCorrupt`` if cut short, too long, not hashing to its sha256 or listing another number
        of chunks than the plan of ``expected`` with the run's ``chunk_elements``;
        ``PayloadLayoutMismatch`` if intact but of other tensors, ``dtypes`` or chunk order. Nothing is
        returned before all of it is verified. ``max_bytes`` bounds the chunks' total (plus
        ``CHUNK_HEADER_ALLOWANCE`` per chunk after the first); each chunk is held to its own cap too."""
        specs = chunk_specs(expected, chunk_elements)
        if len(specs) == 1 and not specs[0].meta:
            if ref.more:
                raise PayloadCorrupt(f"{ref.key}: the ref lists {len(ref.more) + 1} chunks, the plan one")
            return self._get_chunk(ref, specs[0], dtypes=dtypes, max_bytes=max_bytes)
        refs = chunk_refs(ref)
        if len(refs) != len(specs):
            raise PayloadCorrupt(f"{ref.key}: the ref lists {len(refs)} chunks, the plan {len(specs)}")
        if max_bytes is not None:
            # Each chunk beyond the first repeats a header (metadata, the split tensor's entry).
            max_bytes += CHUNK_HEADER_ALLOWANCE * (len(refs) - 1)
            if (total := sum(r.size for r in refs)) > max_bytes:
                raise PayloadCorrupt(
                    f"{ref.key}: declared size {total} of {len(refs)} chunks exceeds the cap of {max_bytes}"
                )
        parts: list[dict[str, np.ndarray]] = []
        for r, s in zip(refs, specs, strict=True):
            got = self._get_chunk(r, s, dtypes=dtypes, max_bytes=max_bytes)
            if got is None:
                return None
            parts.append(got)
        return assemble([list(s.pieces) for s in specs], parts, expected)

    def get_chunk(
        self,
        ref: PayloadRef,
        pieces: Sequence[Piece],
        *,
        shapes: Mapping[str, Sequence[int]],
        k: int,
        n: int,
        dtypes: Mapping[str, str] | None = None,
        max_bytes: int | None = None,
        kind: str | None = None,
        tee: Callable[[Chunk], object] | None = None,
    ) -> dict[str, np.ndarray] | None:
        """Chunk ``k`` of ``n`` (``ref``: that chunk's own ref) of these ``pieces``, fetched, checked and
        decoded as ``{piece name: flat float32 values}``; None if gone, errors as ``get_payload``.
        ``tee(part)`` is handed each part of the bytes as it arrives (a closer's spool); they are
        verified once this returns."""
        if ref.more:
            raise PayloadCorrupt(f"{ref.key}: a chunk's ref lists chunks of its own")
        got = self._get_chunk(
            ref, chunk_spec(pieces, shapes, k, n), dtypes=dtypes, max_bytes=max_bytes, kind=kind, tee=tee
        )
        return None if got is None else {name: v.reshape(-1) for name, v in got.items()}

    def _get_chunk(
        self,
        ref: PayloadRef,
        s: ChunkSpec,
        *,
        dtypes: Mapping[str, str] | None,
        max_bytes: int | None,
        kind: str | None = None,
        tee: Callable[[Chunk], object] | None = None,
    ) -> dict[str, np.ndarray] | None:
        """One chunk's bytes, streamed into its decoder; None if it is gone."""
        cap = s.cap() if max_bytes is None else min(max_bytes, s.cap())
        if ref.size > cap:
            raise PayloadCorrupt(f"{ref.key}: declared size {ref.size} exceeds the cap of {cap} bytes")
        try:
            compression = keys.compression_of(ref.key)
        except ValueError as e:
            raise PayloadCorrupt(str(e)) from None
        ahead = self.ahead.pop(ref.key, None)
        chunks = iter((ahead,)) if ahead is not None else read_stream(self.mailbox, ref.key)
        if chunks is None:
            return None
        try:
            return decode_payload(
                self._counted(chunks, tee),
                s,
                size=ref.size,
                sha256=ref.sha256,
                compression=compression,
                max_bytes=cap,
                kind=kind,
                dtypes=dtypes,
                key=ref.key,
            )
        finally:
            close_stream(chunks)  # cancels the reads still in flight

    def put_chunk(
        self,
        key_for_sha: Callable[[str], str],
        values: Values,
        pieces: Sequence[Piece],
        *,
        shapes: Mapping[str, Sequence[int]],
        k: int,
        n: int,
        dtypes: Mapping[str, str] | str,
        kind: str,
        compression: str,
        f8_scales: Mapping[str, int] | None = None,
    ) -> PayloadRef:
        """Encode chunk ``k`` of ``n`` from its pieces' values (float32, or a ``QTensor``; an F8 piece of
        float values needs its tensor's scale byte in ``f8_scales``) and upload it: that chunk's ref."""
        s = chunk_spec(pieces, shapes, k, n)
        with encode_payload(
            values, dtypes, kind=kind, compression=compression, chunk=s, f8_scales=f8_scales, stream=True
        ) as data:
            return self.put_payload(key_for_sha, data)

    def put_fragment(
        self,
        key_for_sha: Callable[[str], str],
        tensors: Values,
        *,
        shapes: Mapping[str, Sequence[int]],
        dtypes: Mapping[str, str] | str,
        chunk_elements: int | None,
        kind: str,
        compression: str,
        on_chunk: Callable[[ChunkSpec, PayloadStream, PayloadRef], None] | None = None,
    ) -> PayloadRef:
        """Write a whole fragment (float32 arrays, or ``QTensor``s quantized already) as the chunks
        of its plan (``shapes``' order), one at a time, and return the ref naming them all.
        ``on_chunk(spec, stream, ref)`` is called after each chunk is written (the stream can be
        produced again then: a closer decodes its own contribution from it)."""
        out = []
        for s in chunk_specs(shapes, chunk_elements):
            with encode_payload(tensors, dtypes, kind=kind, compression=compression, chunk=s, stream=True) as data:
                ref = self.put_payload(key_for_sha, data)
                if on_chunk is not None:
                    on_chunk(s, data, ref)
            out.append(ref)
        return join_refs(out)

    @staticmethod
    def one_payload(shapes: Mapping[str, Sequence[int]], chunk_elements: int | None) -> bool:
        """Is a payload of these tensors one chunk of whole tensors (today's whole payload)?"""
        return chunk_elements is None or is_one_whole_chunk(fragment_plan(shapes, chunk_elements), shapes)

    def _counted(self, chunks: Iterable[Chunk], tee: Callable[[Chunk], object] | None = None) -> Iterator[Chunk]:
        for chunk in chunks:
            self.bytes_down += len(chunk)
            if tee is not None:
                tee(chunk)
            yield chunk
