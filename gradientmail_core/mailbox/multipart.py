"""Large objects on S3: multipart uploads with parts in parallel, parallel ranged reads.

``S3Mailbox.put_stream`` and ``get_stream`` are built here; records and claims never come here
(they stay small single ``PutObject`` calls with ``If-None-Match``).

Upload. The writer's chunks are cut into parts (``part_sizes``). A stream that ends within
``multipart_threshold`` bytes is one ``PutObject``; a longer one is a multipart upload whose
parts go up ``max_concurrency`` at a time. Memory is bounded: at most ``max_concurrency`` parts
are in flight plus the one being filled. Every part is retried on its own (``RetryPolicy``); a
part that still fails, or a writer that raises, aborts the upload (``AbortMultipartUpload``), so
no parts are left billed and nothing appears under the key: an object exists only once
``CompleteMultipartUpload`` succeeded, and then it is whole.

Part sizes. S3 allows at most 10,000 parts of 5 MiB to 5 GiB (the last may be smaller).
The stream's length is unknown up front, so: when the store accepts parts of different sizes
(AWS, MinIO, GCS), the part size doubles after every ``GROW_EVERY`` parts, which covers any
object up to S3's 5 TiB limit within 10,000 parts; a store that requires equal parts except
the last (Cloudflare R2) keeps ``part_size`` throughout and refuses a stream beyond
``10,000 * part_size`` with a clear error (raise ``part_size``).

Download. The first ranged GET (``part_size`` bytes) tells the object's size and ETag from its
headers, before its body is read; the remaining ranges are then fetched ``max_concurrency`` at a
time, each pinned to that ETag with ``If-Match`` (an object replaced mid-read fails the read
instead of mixing two objects), and yielded in order. A part whose transfer breaks (connection
reset, short body) is fetched again.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from ..errors import MailboxUnavailable
from .contract import Chunk
from .profiles import S3Access

log = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's smallest part, except the last
MAX_PART = 5 * 1024 * MiB  # S3's largest part
MAX_PARTS = 10_000  # S3's (and R2's) most parts in one upload
# Parts before the part size doubles, where unequal parts are allowed: 900 keeps objects up to
# 7 GB (8 MiB parts) in equal parts, and lets 10,000 parts of 5 MiB and up carry 5 TiB.
GROW_EVERY = 900
# Measured on moto over loopback (bench/transfer.py, docs/backends.md "Part size"); 8 MiB is also
# boto3's own multipart_chunksize and the size AWS suggests for byte-range reads.
DEFAULT_PART_SIZE = 8 * MiB


def part_sizes(part_size: int, *, equal: bool) -> Iterator[int]:
    """The size of each part in turn (the last part of an object may be shorter).

    ``equal``: ``part_size`` for every part (R2). Otherwise ``part_size`` for the first
    ``GROW_EVERY`` parts, then twice that for the next ``GROW_EVERY``, and so on, capped at
    ``MAX_PART``: 10,000 parts then hold more than S3's 5 TiB object limit from any part size
    of at least 5 MiB, while an object of a few GB keeps equal parts.
    """
    for n in itertools.count():
        yield part_size if equal else min(MAX_PART, part_size << (n // GROW_EVERY))


def cut(chunks: Iterable[Chunk], sizes: Iterator[int]) -> Iterator[bytes | bytearray]:
    """The bytes of ``chunks`` cut into parts of ``sizes`` (the last part may be shorter).

    A ``bytes`` chunk that is exactly one part is passed on as it is; everything else is
    copied into the part's own buffer, so the writer may reuse its chunk buffers at once.
    """
    size = next(sizes)
    buf = bytearray(size)
    filled = 0
    for chunk in chunks:
        if isinstance(chunk, bytes) and filled == 0 and len(chunk) == size:
            yield chunk
            size = next(sizes)
            buf = bytearray(size)
            continue
        view = memoryview(chunk).cast("B")
        while view.nbytes:
            take = min(size - filled, view.nbytes)
            buf[filled : filled + take] = view[:take]
            filled += take
            view = view[take:]
            if filled == size:
                yield buf
                size = next(sizes)
                buf, filled = bytearray(size), 0
    if filled:
        del buf[filled:]
        yield buf


# ---- upload ----------------------------------------------------------------------------------


def upload(mb: S3Access, key: str, chunks: Iterable[Chunk], *, create_once: bool) -> bool:
    """``S3Mailbox.put_stream``: one PUT for a short stream, a multipart upload otherwise."""
    parts = cut(chunks, part_sizes(mb.part_size, equal=mb.profile.equal_parts))
    head: list[bytes | bytearray] = []
    held = 0
    for part in parts:
        head.append(part)
        held += len(part)
        if held > mb.multipart_threshold:
            return _multipart(mb, key, itertools.chain(head, parts), create_once=create_once)
    data = head[0] if len(head) == 1 else b"".join(head)
    if create_once:
        return mb._put(key, bytes(data))
    mb._retried("PUT", key, lambda: mb.client.put_object(Bucket=mb.bucket, Key=mb._root + key, Body=data))
    return True


def _multipart(mb: S3Access, key: str, parts: Iterator[bytes | bytearray], *, create_once: bool) -> bool:
    full = mb._root + key
    extra: dict[str, Any] = {"ChecksumAlgorithm": "CRC32"} if mb.checksums == "when_supported" else {}
    created = mb._retried("PUT", key, lambda: mb.client.create_multipart_upload(Bucket=mb.bucket, Key=full, **extra))
    upload_id = str(created["UploadId"])
    log.debug("multipart upload %s of %s started", upload_id, mb._where(key))
    try:
        done = _upload_parts(mb, key, upload_id, parts)
        written = _complete(mb, key, upload_id, done, create_once=create_once)
    except BaseException:
        _abort(mb, key, upload_id)
        raise
    if not written:
        _abort(mb, key, upload_id)  # 412: the key was taken; the parts must not stay billed
    return written


def _upload_parts(mb: S3Access, key: str, upload_id: str, parts: Iterator[bytes | bytearray]) -> list[dict[str, Any]]:
    done: dict[int, dict[str, Any]] = {}
    inflight: set[Future[tuple[int, dict[str, Any]]]] = set()

    def collect(finished: Iterable[Future[tuple[int, dict[str, Any]]]]) -> None:
        for f in finished:
            number, info = f.result()
            done[number] = info

    pool = ThreadPoolExecutor(mb.max_concurrency, thread_name_prefix="gradientmail-s3-put")
    try:
        for number, part in enumerate(parts, 1):
            if number > MAX_PARTS:
                raise ValueError(
                    f"PUT {mb._where(key)}: the object needs more than {MAX_PARTS} parts of "
                    f"{mb.part_size} bytes (the store requires equal parts): raise part_size to at "
                    "least the object's size / 10,000"
                )
            if len(inflight) >= mb.max_concurrency:
                finished, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                collect(finished)
            inflight.add(pool.submit(_upload_part, mb, key, upload_id, number, part))
            del part  # the pool holds it until sent: no more than max_concurrency parts in memory
        collect(wait(inflight).done)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [done[n] for n in sorted(done)]


def _upload_part(
    mb: S3Access, key: str, upload_id: str, number: int, body: bytes | bytearray
) -> tuple[int, dict[str, Any]]:
    def send() -> dict[str, Any]:
        return dict(
            mb.client.upload_part(
                Bucket=mb.bucket, Key=mb._root + key, UploadId=upload_id, PartNumber=number, Body=body
            )
        )

    resp = mb._retried("PUT", f"{key} (part {number})", send)
    info: dict[str, Any] = {"PartNumber": number, "ETag": resp["ETag"]}
    info.update((k, v) for k, v in resp.items() if k.startswith("Checksum") and k != "ChecksumType")
    return number, info


def _complete(mb: S3Access, key: str, upload_id: str, parts: list[dict[str, Any]], *, create_once: bool) -> bool:
    """Complete the upload; False if ``create_once`` found the key taken (412)."""
    uncertain = False
    full = mb._root + key
    condition = {"IfNoneMatch": "*"} if create_once else {}

    def attempt() -> bool:
        nonlocal uncertain
        try:
            mb.client.complete_multipart_upload(
                Bucket=mb.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}, **condition
            )
        except mb._client_error as exc:
            status, code = _status(exc), _code(exc)
            if status == 412:
                return False
            if code == "NoSuchUpload" and uncertain:
                return True  # an earlier attempt completed it; its reply was lost
            if mb._is_transient(exc):
                uncertain = True
                raise MailboxUnavailable(f"PUT {mb._where(key)} (complete): {exc}") from exc
            raise
        except mb._transient_errors as exc:
            uncertain = True
            raise MailboxUnavailable(f"PUT {mb._where(key)} (complete): {exc}") from exc
        return True

    return mb._retried_raw(attempt, f"PUT {mb._where(key)} (complete)")


def _abort(mb: S3Access, key: str, upload_id: str) -> None:
    try:
        mb._retried(
            "DELETE",
            key,
            lambda: mb.client.abort_multipart_upload(Bucket=mb.bucket, Key=mb._root + key, UploadId=upload_id),
        )
    except Exception as exc:  # noqa: BLE001 - keep the error that made us abort; the lifecycle rule cleans up
        log.warning(
            "could not abort multipart upload %s of %s (%s); the bucket's AbortIncompleteMultipartUpload "
            "lifecycle rule removes its parts (docs/backends.md)",
            upload_id,
            mb._where(key),
            exc,
        )


# ---- download --------------------------------------------------------------------------------


class _Changed(Exception):
    """The object was replaced or deleted between two ranged reads of one stream."""


def download(mb: S3Access, key: str, part_size: int | None) -> Iterator[Chunk] | None:
    """``S3Mailbox.get_stream``: None if absent, else the object's parts in order."""
    size = part_size or mb.part_size
    first = mb._retried("GET", key, lambda: _open(mb, key, 0, size, None))
    if first is None:
        return None
    total, etag, body, ranged = first
    if not ranged:  # the store ignored Range: this body is the whole object
        return _sequential(mb, key, body, total, size)
    return _parts(mb, key, size, total, etag, body)


def _open(mb: S3Access, key: str, start: int, size: int, etag: str | None) -> tuple[int, str | None, Any, bool] | None:
    """A ranged GET of ``size`` bytes from ``start``: (object size, ETag, unread body, whether the
    store honoured the range), or None if there is no object."""
    kwargs: dict[str, Any] = {"Range": f"bytes={start}-{start + size - 1}"}
    if etag is not None:
        kwargs["IfMatch"] = etag
    try:
        resp = mb.client.get_object(Bucket=mb.bucket, Key=mb._root + key, **kwargs)
    except mb._client_error as exc:
        status = _status(exc)
        if etag is not None and status in (404, 412):
            raise _Changed(f"HTTP {status}") from exc
        if status == 404 and _code(exc) != "NoSuchBucket":
            return None
        if status == 416 and start == 0:
            return 0, None, None, True  # a range of an empty object
        raise
    content_range = str(resp.get("ContentRange") or "")
    # "bytes 0-8388607/17000000"; a store that ignores Range answers 200 with the whole object.
    ranged = "/" in content_range
    total = int(content_range.rsplit("/", 1)[1]) if ranged else int(resp["ContentLength"])
    return total, resp.get("ETag"), resp["Body"], ranged or total <= size


def _read(mb: S3Access, key: str, body: Any, want: int) -> bytes:
    try:
        data = body.read(want)
    finally:
        body.close()
    if len(data) != want:
        raise MailboxUnavailable(f"GET {mb._where(key)}: the part ended after {len(data)} of {want} bytes")
    return bytes(data)


def _fetch(mb: S3Access, key: str, start: int, want: int, etag: str | None, body: Any = None) -> bytes:
    """The bytes ``[start, start + want)``, from ``body`` if given (the first request's), retried."""
    pending = [body]

    def attempt() -> bytes:
        b = pending.pop() if pending else None
        if b is None:
            opened = _open(mb, key, start, want, etag)
            if opened is None:
                raise _Changed("HTTP 404")
            b = opened[2]
        return _read(mb, key, b, want)

    try:
        return mb._retried("GET", key, attempt)
    except _Changed as exc:
        raise MailboxUnavailable(
            f"GET {mb._where(key)}: the object was replaced or deleted while it was read ({exc}); read it again"
        ) from exc


def _sequential(mb: S3Access, key: str, body: Any, total: int, size: int) -> Iterator[Chunk]:
    """The parts of one whole-object response, read in turn (a store that ignores Range)."""
    try:
        for start in range(0, total, size):
            try:
                data = body.read(min(size, total - start))
            except mb._transient_errors as exc:
                raise MailboxUnavailable(f"GET {mb._where(key)}: {exc}; read it again") from exc
            if not data:
                raise MailboxUnavailable(f"GET {mb._where(key)}: the object ended after {start} of {total} bytes")
            yield data
    finally:
        body.close()


def _parts(mb: S3Access, key: str, size: int, total: int, etag: str | None, body: Any) -> Iterator[Chunk]:
    if total == 0:
        if body is not None:
            body.close()
        return
    ranges = [(start, min(size, total - start)) for start in range(0, total, size)]
    if body is not None and len(ranges) == 1 and total <= size:
        yield _fetch(mb, key, 0, total, etag, body)
        return
    if etag is None:
        log.debug("GET %s: the store gave no ETag; ranged reads are not pinned", mb._where(key))
    pool = ThreadPoolExecutor(min(mb.max_concurrency, len(ranges)), thread_name_prefix="gradientmail-s3-get")
    queue: collections.deque[Future[bytes]] = collections.deque()
    todo = iter(enumerate(ranges))

    def submit() -> None:
        for i, (start, want) in todo:
            queue.append(pool.submit(_fetch, mb, key, start, want, etag, body if i == 0 else None))
            return

    try:
        for _ in range(mb.max_concurrency):
            submit()
        while queue:
            data = queue.popleft().result()
            submit()  # keeps max_concurrency parts in flight while the caller holds this one
            yield data
    finally:
        for f in queue:
            f.cancel()
        pool.shutdown(wait=False, cancel_futures=True)


def _status(exc: Any) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code") or "")
