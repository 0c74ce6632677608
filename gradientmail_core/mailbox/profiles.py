"""Store profiles: what each S3-compatible store needs from the client, and what it is probed for.

``S3Mailbox(..., profile="aws" | "r2" | "hf" | "minio" | "gcs")`` picks one; ``None`` (the default)
is the plain S3 behaviour with the original probe (create-once only). A profile sets client
options (checksum headers, addressing, how create-once is spelt), upload rules (equal parts,
multipart threshold) and the guarantees the probe checks before the first write
(``docs/backends.md``, "Store profiles").

The guarantees, each checked by one probe step (``GUARANTEES``):

- ``create-once``: a second ``PutObject`` with ``If-None-Match: *`` answers 412.
- ``if-match``: a GET with ``If-Match`` of another ETag answers 412 (ranged reads of one
  stream are pinned to the object's ETag with it).
- ``ranged-get``: ``Range: bytes=0-0`` answers 206 with one byte (parallel ranged reads).
- ``list-order``: ``ListObjectsV2`` lists in byte order; ``StartAfter`` is honoured, or (``hf``)
  at least ignored harmlessly: the client filters ``<= after`` itself.
- ``multipart``: a multipart upload completes into the object it was given.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..errors import StoreUnsupported

T = TypeVar("T")

GUARANTEES = ("create-once", "if-match", "ranged-get", "list-order", "multipart")


@dataclass(frozen=True, kw_only=True)
class StoreProfile:
    """How to talk to one kind of store. Frozen; the shipped ones are in ``PROFILES``."""

    name: str
    checksums: str = "when_supported"  # botocore's request_checksum_calculation / response_checksum_validation
    equal_parts: bool = False  # every multipart part but the last the same size
    multipart_threshold: int | None = None  # objects up to this size go as one PUT; None: part_size
    gcs_preconditions: bool = False  # create-once spelt x-goog-if-generation-match: 0
    start_after_optional: bool = False  # the store may ignore StartAfter (filtered client-side)
    min_retry_delay: float = 0.0  # a floor under the first retry wait (R2: 1 write per second per key)
    region: str | None = None  # default region when none is given
    endpoint_url: str | None = None  # default endpoint when none is given
    probe: tuple[str, ...] = GUARANTEES  # the guarantees checked before the first write


class S3Access(Protocol):
    """What the probe here and the transfers in ``multipart.py`` use of an ``S3Mailbox``: its client,
    names and limits, and its retry and error classification (so those modules never import it)."""

    client: Any
    bucket: str
    profile: StoreProfile
    checksums: str
    part_size: int
    max_concurrency: int
    multipart_threshold: int
    _root: str
    _client_error: type[Exception]
    _transient_errors: tuple[type[Exception], ...]

    def _put(self, key: str, data: bytes) -> bool: ...
    def _retried(self, op: str, key: str, fn: Callable[[], T]) -> T: ...
    def _retried_raw(self, fn: Callable[[], T], what: str) -> T: ...
    def _is_transient(self, exc: Any) -> bool: ...
    def _where(self, key: str) -> str: ...


PROFILES: dict[str, StoreProfile] = {
    "aws": StoreProfile(name="aws"),
    # R2: a create-once race on one key may answer 429 (at most one write per second per key);
    # it is retried, and a 412 after it is read back. Multipart parts must be equal except the last.
    "r2": StoreProfile(name="r2", equal_parts=True, min_retry_delay=1.0, region="auto"),
    # Hugging Face Storage Buckets (s3.hf.co): newer checksum headers are rejected; StartAfter may
    # be ignored; multipart is recommended only from 2 GB.
    "hf": StoreProfile(
        name="hf",
        checksums="when_required",
        start_after_optional=True,
        multipart_threshold=2_000_000_000,
        region="us-east-1",
    ),
    "minio": StoreProfile(name="minio"),
    # Google Cloud Storage through its XML API (HMAC keys): If-None-Match is not a write
    # precondition there; x-goog-if-generation-match: 0 is.
    "gcs": StoreProfile(
        name="gcs",
        checksums="when_required",
        gcs_preconditions=True,
        region="auto",
        endpoint_url="https://storage.googleapis.com",
    ),
}

# Without a profile: the client's defaults, and the probe checks create-once only.
PLAIN = StoreProfile(name="plain", probe=("create-once",))


def profile_named(name: str | None) -> StoreProfile:
    if name is None:
        return PLAIN
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"profile={name!r}: expected None or one of {sorted(PROFILES)}") from None


def gcs_precondition_hook(request: object, **_: object) -> None:
    """botocore ``before-sign`` handler: ``If-None-Match: *`` on a write becomes GCS's own
    ``x-goog-if-generation-match: 0`` (create only if no live object has the name)."""
    headers = request.headers  # type: ignore[attr-defined]
    if request.method in ("PUT", "POST") and headers.get("If-None-Match") == "*":  # type: ignore[attr-defined]
        del headers["If-None-Match"]
        headers["x-goog-if-generation-match"] = "0"


def probe_guarantees(mb: S3Access, key: str, data: bytes) -> None:
    """Check every guarantee of ``mb.profile.probe`` but create-once (already checked) on the probe
    object ``key``, which holds ``data``; raise ``StoreUnsupported`` naming the first one missing."""
    checks = {"if-match": _if_match, "ranged-get": _ranged_get, "list-order": _list_order, "multipart": _multipart}
    for name in mb.profile.probe:
        if name in checks:
            checks[name](mb, key, data)


def _fail(mb: S3Access, guarantee: str, found: str, needed: str) -> StoreUnsupported:
    return StoreUnsupported(
        f"the S3 store at {mb.client.meta.endpoint_url} (bucket {mb.bucket!r}, profile {mb.profile.name!r}) "
        f"lacks the {guarantee!r} guarantee: {found}. gradientmail needs {needed}. Use another store or "
        "profile (docs/backends.md, 'Store profiles'), or probe=False if you know better."
    )


def _if_match(mb: S3Access, key: str, data: bytes) -> None:
    try:
        mb.client.get_object(Bucket=mb.bucket, Key=mb._root + key, IfMatch='"0123456789abcdef0123456789abcdef"')
    except mb._client_error as exc:
        if _status(exc) == 412:
            return
        raise
    raise _fail(mb, "if-match", "a GET with If-Match of another ETag returned the object", "412 on If-Match")


def _ranged_get(mb: S3Access, key: str, data: bytes) -> None:
    resp = mb.client.get_object(Bucket=mb.bucket, Key=mb._root + key, Range="bytes=1-2")
    body = resp["Body"].read()
    status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if status != 206 or body != data[1:3]:
        raise _fail(mb, "ranged-get", f"Range: bytes=1-2 answered HTTP {status} with {len(body)} bytes", "206")


def _list_order(mb: S3Access, key: str, data: bytes) -> None:
    base = f"{key}.{secrets.token_hex(4)}/"
    names = [base + n for n in ("a-", "a", "b")]  # byte order: 'a' < 'a-' < 'b'
    for n in names:
        mb.client.put_object(Bucket=mb.bucket, Key=mb._root + n, Body=b"")
    try:
        page = mb.client.list_objects_v2(Bucket=mb.bucket, Prefix=mb._root + base, StartAfter=mb._root + base + "a")
        listed = [obj["Key"][len(mb._root) :] for obj in page.get("Contents", ())]
        if listed != sorted(listed):
            raise _fail(mb, "list-order", f"ListObjectsV2 listed {listed}", "keys in byte order")
        if listed != sorted(names)[1:] and not (mb.profile.start_after_optional and listed == sorted(names)):
            raise _fail(mb, "list-order", f"StartAfter={base}a listed {listed}", "StartAfter honoured")
    finally:
        mb.client.delete_objects(Bucket=mb.bucket, Delete={"Objects": [{"Key": mb._root + n} for n in names]})


def _multipart(mb: S3Access, key: str, data: bytes) -> None:
    target = mb._root + key + ".multipart"
    created = mb.client.create_multipart_upload(Bucket=mb.bucket, Key=target)
    upload_id = created["UploadId"]
    try:
        part = mb.client.upload_part(Bucket=mb.bucket, Key=target, UploadId=upload_id, PartNumber=1, Body=data)
        mb.client.complete_multipart_upload(
            Bucket=mb.bucket,
            Key=target,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
        )
        got = mb.client.get_object(Bucket=mb.bucket, Key=target)["Body"].read()
    except mb._client_error as exc:
        mb.client.abort_multipart_upload(Bucket=mb.bucket, Key=target, UploadId=upload_id)
        if _status(exc) in (400, 403, 404, 405, 501):
            raise _fail(mb, "multipart", f"a one-part upload failed ({exc})", "multipart uploads") from exc
        raise
    finally:
        mb.client.delete_object(Bucket=mb.bucket, Key=target)
    if got != data:
        raise _fail(mb, "multipart", "a one-part upload completed into other bytes", "multipart uploads")


def _status(exc: Any) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
