"""Create-once with read-back: a create-once write whose outcome is always known."""

from __future__ import annotations

import enum

from ..errors import MailboxUnavailable
from .contract import Mailbox


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
