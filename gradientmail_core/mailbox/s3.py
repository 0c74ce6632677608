"""A mailbox in an S3-compatible bucket (AWS S3, Cloudflare R2, MinIO, Ceph RGW, moto).

Create-once is ``PutObject`` with ``If-None-Match: *``: 412 means the key exists, 409 is a
concurrent conditional write to retry. boto3 is imported when a mailbox is built, never when
this module is imported, so the core stays importable without the ``s3`` extra.

botocore's own retries are switched off: every retry goes through ``RetryPolicy`` and the
injected clock, so tests and simulations control the waits, and so that a retried put that
answers 412 is seen by us and resolved by reading the object back (botocore would hand us
a bare 412 for what may be our own earlier write).

Payloads stream (``put_stream``, ``get_stream``): multipart uploads with parts in parallel and
parallel ranged reads, in ``multipart.py``. Store profiles (R2, Hugging Face, MinIO, GCS) and
the guarantees the probe checks are in ``profiles.py``.
"""

from __future__ import annotations

import builtins
import functools
import json
import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ..clock import Clock, SystemClock
from ..errors import MailboxUnavailable, MissingExtra, StoreUnsupported
from . import multipart
from .contract import Chunk, check_list_args, check_object_key, check_object_keys, validate_prefix
from .profiles import StoreProfile, gcs_precondition_hook, probe_guarantees, profile_named
from .retry import RetryPolicy, call_with_retries

log = logging.getLogger(__name__)

T = TypeVar("T")

CHECKSUM_MODES = ("when_supported", "when_required")
DELETE_BATCH = 1000  # the most keys one DeleteObjects request accepts
PROBE_PREFIX = "_probe/"  # '_' sorts before every protocol key; the probe object lives for one round trip

# Error codes that mean "try again", whatever their HTTP status.
_TRANSIENT_CODES = frozenset(
    {
        "ConditionalRequestConflict",  # 409: a concurrent conditional write to the same key
        "OperationAborted",
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "BadDigest",  # the body was damaged in transit
    }
)


def _status(exc: Any) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code") or "")


def _describe(exc: Any) -> str:
    message = exc.response.get("Error", {}).get("Message") or ""
    return f"HTTP {_status(exc)} {_code(exc)} {message}".strip()


def _is_transient(exc: Any) -> bool:
    status, code = _status(exc), _code(exc)
    return code in _TRANSIENT_CODES or status == 429 or (status >= 500 and status != 501)


class S3Mailbox:
    """Mailbox under ``s3://bucket/prefix``, with boto3's default credential chain.

    - ``endpoint_url``: for R2, MinIO, moto and other S3-compatible stores (path-style
      addressing is then the default, which they all accept).
    - ``request_checksums``: ``"when_supported"`` (boto3's default) or ``"when_required"``
      (for stores that reject the newer checksum headers, e.g. Hugging Face Storage Buckets).
    - ``max_concurrency``: size of the HTTP connection pool, i.e. how many threads can talk to
      the store at once; also the parts one stream moves at once (multipart uploads, ranged reads).
    - ``part_size``: bytes per part of a stream (default ``multipart.DEFAULT_PART_SIZE``, 8 MiB;
      at least 5 MiB, which S3 requires of every part but the last). Memory per stream is about
      ``part_size * (max_concurrency + 1)``.
    - ``multipart_threshold``: a stream up to this many bytes is one ``PutObject`` (default
      ``part_size``; the ``hf`` profile: 2 GB, as Hugging Face recommends).
    - ``profile``: ``"aws"``, ``"r2"``, ``"hf"``, ``"minio"``, ``"gcs"`` or None (``profiles.py``).
    - ``probe``: before the first create-once write, check the guarantees the profile relies on
      (without a profile: that the store honours ``If-None-Match``) and refuse the store with
      ``StoreUnsupported`` naming the one missing.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        request_checksums: str | None = None,
        max_concurrency: int = 8,
        retry: RetryPolicy | None = None,
        clock: Clock | None = None,
        probe: bool = True,
        addressing_style: str | None = None,
        part_size: int | None = None,
        multipart_threshold: int | None = None,
        profile: str | None = None,
    ) -> None:
        if not isinstance(bucket, str) or not bucket or "/" in bucket:
            raise ValueError(f"S3 bucket name {bucket!r} is invalid: give the bare bucket name, without '/'")
        prefix = prefix.strip("/")
        validate_prefix(prefix)
        self.profile: StoreProfile = profile_named(profile)
        request_checksums = request_checksums or self.profile.checksums
        if request_checksums not in CHECKSUM_MODES:
            raise ValueError(f"request_checksums={request_checksums!r}; expected one of {CHECKSUM_MODES}")
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        part_size = multipart.DEFAULT_PART_SIZE if part_size is None else part_size
        if not isinstance(part_size, int) or not multipart.MIN_PART <= part_size <= multipart.MAX_PART:
            raise ValueError(
                f"part_size={part_size!r}: expected an int from {multipart.MIN_PART} (5 MiB, the smallest part "
                f"S3 accepts) to {multipart.MAX_PART} (5 GiB)"
            )
        threshold = multipart_threshold if multipart_threshold is not None else self.profile.multipart_threshold
        threshold = part_size if threshold is None else threshold
        if not isinstance(threshold, int) or threshold < part_size:
            raise ValueError(f"multipart_threshold={multipart_threshold!r}: expected an int >= part_size ({part_size})")
        region = region or self.profile.region
        endpoint_url = endpoint_url or self.profile.endpoint_url
        if retry is None:
            floor = self.profile.min_retry_delay
            retry = RetryPolicy(attempts=8, base_delay=floor, max_delay=4 * floor) if floor else RetryPolicy()
        try:
            import boto3
            import botocore.exceptions
            from botocore.config import Config
        except ImportError as exc:
            raise MissingExtra("s3", "boto3") from exc

        self.bucket = bucket
        self.prefix = prefix
        self._root = f"{prefix}/" if prefix else ""
        self.retry = retry
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.checksums = request_checksums
        self.max_concurrency = max_concurrency
        self.concurrent_reads = max_concurrency  # ``read_many``: GETs of several objects at once
        self.part_size = part_size
        self.multipart_threshold = threshold
        options: dict[str, Any] = {
            "region_name": region,
            "max_pool_connections": max_concurrency,
            "retries": {"total_max_attempts": 1, "mode": "standard"},  # we retry ourselves; see module doc
            "request_checksum_calculation": request_checksums,
            "response_checksum_validation": request_checksums,
            "s3": {"addressing_style": addressing_style or ("path" if endpoint_url else "auto")},
        }
        config = Config(**options)
        # A session per mailbox: boto3's default session is not safe to share across threads.
        self.client: Any = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )
        if self.profile.gcs_preconditions:
            self.client.meta.events.register("before-sign.s3", gcs_precondition_hook)
        self._client_error: type[Exception] = botocore.exceptions.ClientError
        self._transient_errors: tuple[type[Exception], ...] = (
            botocore.exceptions.HTTPClientError,  # connection reset, read timeout, broken stream
            botocore.exceptions.ConnectionError,  # refused, DNS, connect timeout
            botocore.exceptions.IncompleteReadError,
            botocore.exceptions.ChecksumError,
            botocore.exceptions.FlexibleChecksumError,
        )
        self._probe_pending = probe
        self._probe_failure: str | None = None
        self._probe_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"S3Mailbox({self.bucket!r}, {self.prefix!r}, endpoint_url={self.client.meta.endpoint_url!r})"

    # ---- the four operations ------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_object_key(key)
        self._ensure_probed()
        return self._put(key, bytes(data))

    def get(self, key: str) -> bytes | None:
        check_object_key(key)
        return self._retried("GET", key, lambda: self._get_request(key))

    def get_prefix(self, key: str, n: int) -> bytes | None:
        """The first ``n`` bytes of the object (a ranged GET; all of it for ``n < 0``), or None."""
        check_object_key(key)
        if n < 0:
            return self.get(key)
        if n == 0:
            return None if self.get_prefix(key, 1) is None else b""
        return self._retried("GET", key, lambda: self._get_request(key, n))

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        """``StreamingMailbox.put_stream``: one PUT up to ``multipart_threshold`` bytes, else a
        multipart upload, parts in parallel, aborted if anything fails (``multipart.py``)."""
        check_object_key(key)
        if create_once:
            self._ensure_probed()
        return multipart.upload(self, key, chunks, create_once=create_once)

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        """``StreamingMailbox.get_stream``: parallel ranged GETs of ``part_size`` bytes, in order."""
        check_object_key(key)
        if part_size is not None and part_size < 1:
            raise ValueError(f"part_size={part_size!r}: expected None or an integer >= 1")
        return multipart.download(self, key, part_size)

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        check_list_args(prefix, after)
        out: builtins.list[str] = []
        token: str | None = None
        while True:
            # Paged by hand so a failure retries one page, not the whole listing.
            page = self._retried("LIST", prefix, functools.partial(self._list_page, prefix, after, token))
            n = len(self._root)
            # Filtered here too: some stores ignore StartAfter (reported for Hugging Face buckets)
            # and list the whole prefix; the contract is keys strictly after ``after``.
            out.extend(k for k in (obj["Key"][n:] for obj in page.get("Contents", ())) if k > after)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return out

    def delete(self, keys: Iterable[str]) -> None:
        todo = check_object_keys(keys)
        for i in range(0, len(todo), DELETE_BATCH):
            batch = todo[i : i + DELETE_BATCH]
            self._retried("DELETE", batch[0], functools.partial(self._delete_batch, batch))

    # ---- requests -------------------------------------------------------------------------

    def _put(self, key: str, data: bytes) -> bool:
        # Set once an attempt failed in a way that may have written the object anyway (a lost
        # reply, a 5xx after the store committed): a later 412 may then be our own write.
        uncertain = False

        def attempt() -> bool:
            nonlocal uncertain
            try:
                created = self._guard("PUT", key, lambda: self._put_request(key, data))
            except MailboxUnavailable:
                uncertain = True
                raise
            if created or not uncertain:
                return created
            existing = self._guard("GET", key, lambda: self._get_request(key))
            if existing is None:
                raise MailboxUnavailable(f"PUT {self._where(key)}: got 412 but the object is gone; trying again")
            return existing == data

        return call_with_retries(attempt, policy=self.retry, clock=self.clock, what=f"PUT {self._where(key)}")

    def _put_request(self, key: str, data: bytes) -> bool:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._root + key, Body=data, IfNoneMatch="*")
        except self._client_error as exc:
            if _status(exc) == 412:
                return False
            raise
        return True

    def _get_request(self, key: str, n: int | None = None) -> bytes | None:
        ranged = {} if n is None else {"Range": f"bytes=0-{n - 1}"}
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._root + key, **ranged)
        except self._client_error as exc:
            # NoSuchBucket is a 404 too, but it is a configuration error, not a missing key.
            if _status(exc) == 404 and _code(exc) != "NoSuchBucket":
                return None
            if n is not None and _status(exc) == 416:
                return b""  # a range of an empty object
            raise
        body = resp["Body"]
        try:
            return bytes(body.read() if n is None else body.read(n))  # n: even if a store ignores Range
        finally:
            body.close()

    def _list_page(self, prefix: str, after: str, token: str | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._root + prefix}
        if token:
            kwargs["ContinuationToken"] = token
        elif after:
            kwargs["StartAfter"] = self._root + after
        return dict(self.client.list_objects_v2(**kwargs))

    def _delete_batch(self, batch: builtins.list[str]) -> None:
        resp = self.client.delete_objects(
            Bucket=self.bucket,
            Delete={"Objects": [{"Key": self._root + k} for k in batch], "Quiet": True},
        )
        errors = resp.get("Errors") or []
        if errors:
            # Deleting is idempotent, so retrying the whole batch is safe.
            first = errors[0]
            raise MailboxUnavailable(
                f"DeleteObjects refused {len(errors)} of {len(batch)} keys in s3://{self.bucket}, e.g. "
                f"{first.get('Key')!r}: {first.get('Code')} {first.get('Message', '')}"
            )

    # ---- retries and error classification -----------------------------------------------

    def _retried_raw(self, fn: Callable[[], T], what: str) -> T:
        """``fn`` retried while it raises ``MailboxUnavailable`` (it classifies errors itself)."""
        return call_with_retries(fn, policy=self.retry, clock=self.clock, what=what)

    @staticmethod
    def _is_transient(exc: Any) -> bool:
        return _is_transient(exc)

    def _retried(self, op: str, key: str, fn: Callable[[], T]) -> T:
        return call_with_retries(
            lambda: self._guard(op, key, fn), policy=self.retry, clock=self.clock, what=f"{op} {self._where(key)}"
        )

    def _guard(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request; turn transient botocore failures into ``MailboxUnavailable``."""
        try:
            return fn()
        except self._client_error as exc:
            if _is_transient(exc):
                raise MailboxUnavailable(f"{op} {self._where(key)}: {_describe(exc)}") from exc
            raise  # access denied, no such bucket...: retrying will not help, the caller must act
        except self._transient_errors as exc:
            raise MailboxUnavailable(f"{op} {self._where(key)}: {exc}") from exc

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._root}{key}"

    # ---- the If-None-Match probe ------------------------------------------------------------

    def _ensure_probed(self) -> None:
        if not self._probe_pending:
            return
        with self._probe_lock:
            if self._probe_failure is not None:
                raise StoreUnsupported(self._probe_failure)
            if not self._probe_pending:
                return
            try:
                self._probe()
            except StoreUnsupported as exc:
                self._probe_failure = str(exc)
                raise
            self._probe_pending = False

    def _probe(self) -> None:
        """Write a fresh key twice; a store honouring If-None-Match must refuse the second."""
        # Random, not from an injected rng: the name only has to differ across nodes and runs.
        key = f"{PROBE_PREFIX}{secrets.token_hex(16)}.json"
        endpoint = self.client.meta.endpoint_url
        # Different bodies, so that the read-back after an uncertain second put cannot
        # mistake the first write for the second.
        first = json.dumps({"gradientmail_probe": 1}).encode()
        second = json.dumps({"gradientmail_probe": 2}).encode()
        try:
            self._put(key, first)
            if self._put(key, second):
                raise StoreUnsupported(
                    f"the S3 store at {endpoint} (bucket {self.bucket!r}) ignores If-None-Match: a second "
                    f"create-once PutObject of {self._where(key)} succeeded instead of failing with 412 "
                    "PreconditionFailed. gradientmail needs atomic create-once writes: use a store that honours "
                    "'If-None-Match: *' (AWS S3 since 2024-08, Cloudflare R2, MinIO, Ceph RGW, moto>=5.0.15) "
                    "or a FileMailbox on a POSIX directory."
                )
            probe_guarantees(self, key, first)
        except self._client_error as exc:
            if _status(exc) == 501 or _code(exc) == "NotImplemented":
                raise StoreUnsupported(
                    f"the S3 store at {endpoint} (bucket {self.bucket!r}) rejects conditional writes "
                    f"({_describe(exc)}). gradientmail needs atomic create-once writes with 'If-None-Match: *' "
                    "(AWS S3 since 2024-08, Cloudflare R2, MinIO, Ceph RGW, moto>=5.0.15)."
                ) from exc
            raise
        finally:
            try:
                self.delete([key])
            except Exception as exc:  # noqa: BLE001 - a leftover probe object is harmless; keep the real error
                log.warning("could not delete the If-None-Match probe object %s: %s", self._where(key), exc)
