"""``open_mailbox``: a backend from a URL. The one place in the package that names the backends."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

from .contract import Mailbox


def open_mailbox(url: str, **kwargs: Any) -> Mailbox:
    """Open ``memory://name``, ``file:///abs/path`` (or ``file://rel/path``) or ``s3://bucket/prefix``.

    Keyword arguments go to the backend's constructor (for S3: ``endpoint_url``, ``region``...).
    An S3 URL may carry some of them as query options, e.g.
    ``s3://bucket/run?profile=r2&endpoint_url=https://ACCOUNT.r2.cloudflarestorage.com&part_size=16777216``
    (``S3_URL_OPTIONS``); keyword arguments win over the URL's.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        from .memory import MemoryMailbox

        name = parts.netloc + parts.path
        return MemoryMailbox(name or None, **kwargs)
    if scheme == "file":
        from .file import FileMailbox

        # file:///abs and file://localhost/abs are absolute; file://rel/path is relative to cwd.
        host = "" if parts.netloc in ("", "localhost") else parts.netloc
        path = host + parts.path
        if not path:
            raise ValueError(f"mailbox URL {url!r} has no path; use file:///absolute/path or file://relative/path")
        return FileMailbox(path, **kwargs)
    if scheme == "s3":
        from .s3 import S3Mailbox

        if not parts.netloc:
            raise ValueError(f"mailbox URL {url!r} has no bucket; use s3://bucket/prefix")
        return S3Mailbox(parts.netloc, parts.path.strip("/"), **{**_s3_options(url, parts.query), **kwargs})
    if not scheme:
        # A bare path: what a user types first. Say the URL it would be.
        import os.path

        raise ValueError(
            f"{url!r} is not a mailbox URL (it has no scheme): did you mean file://{os.path.abspath(url)}? "
            "Mailbox URLs are file:///path, s3://bucket/prefix or memory://name"
        )
    raise ValueError(
        f"unknown mailbox URL scheme in {url!r}; expected memory://name, file:///path or s3://bucket/prefix"
    )


# S3Mailbox options an s3:// URL may carry, and how each is parsed.
S3_URL_OPTIONS: dict[str, type] = {
    "profile": str,
    "endpoint_url": str,
    "region": str,
    "part_size": int,
    "multipart_threshold": int,
    "max_concurrency": int,
    "request_checksums": str,
}


def _s3_options(url: str, query: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        kind = S3_URL_OPTIONS.get(name)
        if kind is None:
            raise ValueError(f"mailbox URL {url!r}: unknown option {name!r}; expected one of {sorted(S3_URL_OPTIONS)}")
        try:
            out[name] = kind(value)
        except ValueError:
            raise ValueError(f"mailbox URL {url!r}: option {name}={value!r} is not an integer") from None
    return out
