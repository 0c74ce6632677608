"""The base of every mailbox that wraps another: it forwards all five operations to ``inner``.

A wrapper (counting, fault injection, the guard, the simulation's auditor) derives from
``ForwardingMailbox`` and overrides only what it changes. Whatever it does not override,
including the optional ranged read, reaches the inner mailbox unchanged, so stacking
wrappers never turns a ranged read into a whole download.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable

from .contract import Mailbox, read_prefix


class ForwardingMailbox:
    """A mailbox that is ``inner``, unchanged. A ``RangedMailbox`` whatever ``inner`` is:
    ``get_prefix`` uses the inner one where it exists and cuts a whole ``get`` otherwise."""

    def __init__(self, inner: Mailbox) -> None:
        self.inner = inner

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, data)

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def get_prefix(self, key: str, n: int) -> bytes | None:
        return read_prefix(self.inner, key, n)

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        return self.inner.list(prefix, after)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
