"""The engine's view of the mailbox, hardened against hostile objects in a shared bucket
(``docs/security.md``, "Validation where input enters" and "Authenticated runs").

``GuardedMailbox`` wraps the user's mailbox (logical keys in and out) and adds: read caps by key
kind (a larger object reads back as its first ``cap + 1`` bytes, which every decoder rejects);
non-protocol objects in the record folders reported once (``IgnoredObject``); secret-tagged record
keys in authenticated runs (listings drop every record object without a valid tag); and an object
under a payload key whose bytes do not hash to its name, written by no node, replaced.
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from ..mailbox.contract import (
    Chunk,
    Mailbox,
    close_stream,
    read_each,
    read_prefix,
    read_stream,
    validate_key,
    write_stream,
)
from ..mailbox.forwarding import ForwardingMailbox
from . import keys
from .auth import Policy, Unauthenticated
from .records import MAX_MANIFEST_BYTES, MAX_RECORD_BYTES

if TYPE_CHECKING:
    from .members import MemberAuth


def _loosen(bound: str) -> str:
    """A listing bound that also admits tagged physical keys: ``x.json`` -> ``x``.

    For keys K > L = S + ".json", the physical name of K is > S (it starts with S, or differs
    from S at an earlier position in its favour), so listing after S and filtering logical keys
    after L loses nothing. The same holds for prefixes.
    """
    return bound[:-5] if bound.endswith(".json") else bound


class GuardedMailbox(ForwardingMailbox):
    def __init__(
        self,
        inner: Mailbox,
        *,
        auth: Policy | MemberAuth | None = None,
        on_ignored: Callable[[str, str], None] | None = None,
        max_record_bytes: int = MAX_RECORD_BYTES,
        max_manifest_bytes: int = MAX_MANIFEST_BYTES,
        max_payload_bytes: int | None = None,
        max_reported: int = 4096,
        known: Callable[[str], bool] = keys.is_known_key,
    ) -> None:
        for name, v in (("max_record_bytes", max_record_bytes), ("max_manifest_bytes", max_manifest_bytes)):
            if not isinstance(v, int) or v < 1024:
                raise ValueError(f"{name}={v!r}: expected an integer >= 1024")
        super().__init__(inner)
        self.auth: Policy | MemberAuth = auth if auth is not None else Unauthenticated()
        self.on_ignored = on_ignored or (lambda key, reason: None)
        # The keys listed in the record folders that are not reported: the run's, and those of a
        # package built on the run when its user says so (``workqueue.keys.is_known``).
        self.known = known
        self.max_record_bytes = max_record_bytes
        self.max_manifest_bytes = max_manifest_bytes
        self.max_payload_bytes = max_payload_bytes
        self.max_reported = max_reported
        self.ignored = 0  # distinct keys ignored (the first max_reported are also reported)
        self._seen: set[str] = set()
        attach = getattr(self.auth, "attach", None)
        if attach is not None:  # members-only runs: the policy reads the membership log through us
            attach(self, self._report)

    def __repr__(self) -> str:
        return f"GuardedMailbox({self.inner!r}, auth={self.auth!r})"

    def limit_payloads(self, max_bytes: int) -> None:
        """Cap payload reads once the run's schema is known."""
        self.max_payload_bytes = max_bytes

    # ---- the four operations ------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes) -> bool:
        physical = self._physical(key)
        if self.inner.put_if_absent(physical, data):
            return True
        blob = keys.parse_blob_key(key)
        if blob is None or blob.sha != hashlib.sha256(data).hexdigest():
            return False
        existing = self._read(physical, len(data) + 1)
        if existing is None or existing == data:
            return False  # ours (or gone: the caller's create-once loop tries again)
        self._report(key, "a payload name held bytes that do not hash to it; replaced them")
        self.inner.delete([physical])
        return self.inner.put_if_absent(physical, data)

    def get(self, key: str) -> bytes | None:
        return self._read(self._physical(key), self._limit(key))

    def get_many(self, wanted: builtins.list[str]) -> builtins.list[bytes | None]:
        """``get`` of each key (``read_many``): through the store's own ``get_many`` where it has one
        (each answer then cut at its cap), else on as many threads as the store says its reads may
        use at once (``concurrent_reads``: each ``get`` checks its own object; nothing is shared)."""
        inner_many = getattr(self.inner, "get_many", None)
        if inner_many is None:
            return read_each(self.get, wanted, int(getattr(self.inner, "concurrent_reads", 0) or 0))
        found = inner_many([self._physical(k) for k in wanted])
        out: builtins.list[bytes | None] = []
        for k, data in zip(wanted, found, strict=True):
            limit = self._limit(k)
            out.append(data if data is None or limit < 0 or len(data) <= limit else bytes(data[:limit]))
        return out

    def get_prefix(self, key: str, n: int) -> bytes | None:
        """The first ``n`` bytes of what ``get`` returns: never more than the cap plus one."""
        limit = self._limit(key)
        return self._read(self._physical(key), n if limit < 0 or 0 <= n < limit else limit)

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        """Streams are for payloads: without ``create_once`` a squatted payload name is simply
        overwritten by the backend's stream."""
        return write_stream(self.inner, self._physical(key), chunks, create_once=create_once)

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        """What ``get`` returns, in chunks: never more than the cap plus one byte."""
        stream = read_stream(self.inner, self._physical(key), part_size=part_size)
        limit = self._limit(key)
        return stream if stream is None or limit < 0 else _capped(stream, limit)

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        found = self._list(prefix, after)
        refuse = getattr(self.auth, "refuse", None)
        if refuse is None:
            return found
        # Members-only runs: keys that name a non-member's learner are dropped by name.
        self.auth.listed(prefix)  # type: ignore[union-attr]
        out = []
        for k in found:
            why = refuse(k)
            if why is None:
                out.append(k)
            else:
                self._report(k, why)
        return out

    def _list(self, prefix: str, after: str) -> builtins.list[str]:
        if not self.auth.authenticated:
            out = self.inner.list(prefix, after)
            for k in out:
                if keys.is_record_key(k) and not self.known(k):
                    self._report(k, "not a key of the protocol")
            return out
        found: builtins.list[str] = []
        for k in self.inner.list(_loosen(prefix), _loosen(after)):
            if keys.is_record_key(k):
                logical = self._logical(k)
                if logical is None:
                    self._report(k, "no valid run tag in its name: written without the run secret")
                    continue
                k = logical
            if k.startswith(prefix) and k > after:
                found.append(k)
        found.sort()
        return found

    def delete(self, keys_: Iterable[str]) -> None:
        if isinstance(keys_, str):
            raise TypeError(f"delete() takes an iterable of keys, not the string {keys_!r}")
        self.inner.delete([self._physical(k) for k in keys_])

    # ---- helpers ------------------------------------------------------------------------

    def _physical(self, key: str) -> str:
        tag = self.auth.tag(key) if keys.is_record_key(key) and key.endswith(".json") else None
        return key if tag is None else keys.tag_key(key, tag)

    def _logical(self, physical: str) -> str | None:
        parsed = keys.untag_key(physical)
        if parsed is None:
            return None
        logical, tag = parsed
        try:
            validate_key(logical)
        except ValueError:
            return None
        return logical if hmac.compare_digest(tag, self.auth.tag(logical) or "") else None

    def _limit(self, key: str) -> int:
        """The most bytes a read of ``key`` takes: its cap plus one (enough to see that an object
        is over the cap), or -1 for no cap."""
        if key == keys.MANIFEST:
            cap: int | None = self.max_manifest_bytes
        elif key.startswith(keys.BLOBS):
            cap = self.max_payload_bytes
        else:
            cap = self.max_record_bytes
        return -1 if cap is None else cap + 1

    def _read(self, physical: str, limit: int) -> bytes | None:
        """At most ``limit`` bytes of the object (all of it for -1), transferring no more where
        the inner mailbox can read a prefix."""
        if limit < 0:
            return self.inner.get(physical)
        data = read_prefix(self.inner, physical, limit)
        if data is not None and len(data) > limit:
            return bytes(data[:limit])
        return data

    def _report(self, key: str, reason: str) -> None:
        if key in self._seen:
            return
        self.ignored += 1
        if len(self._seen) < self.max_reported:
            self._seen.add(key)
            self.on_ignored(key, reason)


def _capped(stream: Iterator[Chunk], limit: int) -> Iterator[Chunk]:
    """The first ``limit`` bytes of ``stream``; the rest is never read (the stream is closed)."""
    try:
        for chunk in stream:
            view = memoryview(chunk).cast("B")
            if view.nbytes >= limit:
                if limit:
                    yield view[:limit]
                return
            limit -= view.nbytes
            yield chunk
    finally:
        close_stream(stream)
