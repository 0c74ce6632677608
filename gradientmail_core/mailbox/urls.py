"""``open_mailbox``: a backend from a URL. The one place in the package that names the backends."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from .contract import Mailbox


def open_mailbox(url: str, **kwargs: Any) -> Mailbox:
    """Open ``memory://name``, ``file:///abs/path`` (or ``file://rel/path``) or ``s3://bucket/prefix``.

    Keyword arguments go to the backend's constructor (for S3: ``endpoint_url``, ``region``...).
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
        return S3Mailbox(parts.netloc, parts.path.strip("/"), **kwargs)
    raise ValueError(
        f"unknown mailbox URL scheme in {url!r}; expected memory://name, file:///path or s3://bucket/prefix"
    )
