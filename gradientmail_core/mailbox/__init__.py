"""The mailbox contract: four operations on a shared store, and the helpers around them.

A mailbox is a flat key space of immutable objects (section 3.1 of the spec). Backends
provide ``put_if_absent``, ``get``, ``list`` and ``delete``; everything else in the
protocol is built from those four. ``docs/backends.md`` says how to write a new one.

This module also holds what every backend and the engine share: the retry loop for
transient store errors, ``create_once`` (the read-back that resolves a create-once write
whose outcome is unknown), a request-counting wrapper, and ``open_mailbox`` for URLs.
"""

from __future__ import annotations

import builtins
import enum
import logging
import random
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit

from ..clock import Clock
from ..errors import MailboxUnavailable
from ..protocol.keys import validate_key, validate_prefix

log = logging.getLogger(__name__)

T = TypeVar("T")


@runtime_checkable
class Mailbox(Protocol):
    """The whole surface a backend provides. Keys are relative to the mailbox root.

    Every operation validates its keys (``ValueError``) before any I/O. Transient store
    failures surface as ``MailboxUnavailable`` once the backend's own retries are spent.
    """

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data`` unless it exists. True only if this call created it."""
        ...

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if there is no such object."""
        ...

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        """Every key that starts with ``prefix`` and sorts strictly after ``after``, in byte order."""
        ...

    def delete(self, keys: Iterable[str]) -> None:
        """Remove the objects; keys that do not exist are ignored."""
        ...


# ---- key checks shared by the backends --------------------------------------------------


def check_object_key(key: str) -> str:
    """A key naming an object: a valid key that does not end with '/' (that is a prefix)."""
    validate_key(key)
    if key.endswith("/"):
        raise ValueError(f"invalid mailbox key {key!r}: an object key cannot end with '/'")
    return key


def check_list_args(prefix: str, after: str) -> None:
    validate_prefix(prefix)
    validate_prefix(after)


def check_object_keys(keys: Iterable[str]) -> builtins.list[str]:
    """Materialize and validate every key first, so a bad key in the middle deletes nothing."""
    if isinstance(keys, str):
        # A bare string is iterable; deleting its characters one by one is never meant.
        raise TypeError(f"delete() takes an iterable of keys, not the string {keys!r}")
    out = [check_object_key(k) for k in keys]
    return builtins.list(dict.fromkeys(out))


# ---- retries ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Exponential backoff for transient store errors.

    Waits ``base_delay * multiplier**i`` (capped at ``max_delay``) between attempts. With an
    ``rng``, each wait is drawn from [wait/2, wait] ("equal jitter") so that nodes that
    failed together do not retry in lockstep; without one, waits are deterministic.
    """

    attempts: int = 5
    base_delay: float = 0.05
    max_delay: float = 2.0
    multiplier: float = 2.0
    rng: random.Random | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError(
                f"RetryPolicy delays must be >= 0, got base_delay={self.base_delay!r}, max_delay={self.max_delay!r}"
            )
        if self.multiplier < 1:
            raise ValueError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier!r}")

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th consecutive failure (1-based)."""
        wait = min(self.max_delay, self.base_delay * self.multiplier ** (failures - 1))
        if self.rng is not None:
            wait = wait / 2 + self.rng.uniform(0.0, wait / 2)
        return wait


def call_with_retries(fn: Callable[[], T], *, policy: RetryPolicy, clock: Clock, what: str) -> T:
    """Run ``fn``, retrying while it raises ``MailboxUnavailable``; sleep through ``clock``.

    ``fn`` signals a transient failure by raising ``MailboxUnavailable`` (backends classify
    their own errors); any other exception propagates at once. ``what`` names the operation
    and key for the final error, e.g. ``"PUT rounds/0000000007.json"``.
    """
    last: MailboxUnavailable | None = None
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except MailboxUnavailable as exc:
            last = exc
            if attempt == policy.attempts:
                break
            wait = policy.delay(attempt)
            log.debug("%s failed (attempt %d/%d), retrying in %.3fs: %s", what, attempt, policy.attempts, wait, exc)
            clock.sleep(wait)
    raise MailboxUnavailable(
        f"{what} failed {policy.attempts} times; last error: {last}. The store is unreachable or "
        "overloaded: check the endpoint, network and credentials. This is transient: the run keeps "
        "going and retries later."
    ) from last


# ---- create-once with read-back ---------------------------------------------------------


class CreateOutcome(enum.Enum):
    CREATED = "created"  # this call created the object
    ALREADY_OURS = "already_ours"  # it exists with exactly our bytes (our earlier write, or an identical one)
    TAKEN = "taken"  # someone else created it with other bytes


def create_once(mailbox: Mailbox, key: str, data: bytes) -> tuple[CreateOutcome, bytes | None]:
    """Create-once write whose outcome is always known.

    A put whose reply was lost, or whose retry saw 412 for our own write, looks like
    "exists"; reading the object back and comparing bytes tells ours from someone else's.
    Returns ``(CREATED, None)``, ``(ALREADY_OURS, data)`` or ``(TAKEN, existing_bytes)``.
    """
    data = bytes(data)
    # A False put followed by a missing object means it was deleted in between (GC of a
    # finished round); trying again settles it. Bounded because it cannot recur forever.
    for _ in range(3):
        if mailbox.put_if_absent(key, data):
            return CreateOutcome.CREATED, None
        existing = mailbox.get(key)
        if existing is None:
            continue
        if existing == data:
            return CreateOutcome.ALREADY_OURS, existing
        return CreateOutcome.TAKEN, existing
    raise MailboxUnavailable(
        f"create-once of {key!r} kept finding the object present and then gone (3 tries); "
        "something is deleting it concurrently. Retry later."
    )


# ---- request counting -------------------------------------------------------------------


class CountingMailbox:
    """Wraps a mailbox and counts calls and bytes; for tests, benchmarks and cost estimates.

    ``counts`` has one entry per operation (LIST, GET, PUT, DELETE) and counts calls to
    the wrapped mailbox, not HTTP requests (an S3 listing of many pages is one LIST).
    """

    OPS = ("LIST", "GET", "PUT", "DELETE")

    def __init__(self, inner: Mailbox) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self.counts: dict[str, int] = dict.fromkeys(self.OPS, 0)
        self.bytes_up = 0
        self.bytes_down = 0

    def reset(self) -> None:
        with self._lock:
            self.counts = dict.fromkeys(self.OPS, 0)
            self.bytes_up = 0
            self.bytes_down = 0

    def _count(self, op: str, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.counts[op] += 1
            self.bytes_up += up
            self.bytes_down += down

    def put_if_absent(self, key: str, data: bytes) -> bool:
        # Counted even when it raises: a failed request still costs a request.
        self._count("PUT", up=len(data))
        return self.inner.put_if_absent(key, data)

    def get(self, key: str) -> bytes | None:
        try:
            data = self.inner.get(key)
        except BaseException:
            self._count("GET")
            raise
        self._count("GET", down=len(data) if data is not None else 0)
        return data

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        self._count("LIST")
        return self.inner.list(prefix, after)

    def delete(self, keys: Iterable[str]) -> None:
        self._count("DELETE")
        self.inner.delete(keys)

    def __repr__(self) -> str:
        return f"CountingMailbox({self.inner!r})"


# ---- URLs -------------------------------------------------------------------------------


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
