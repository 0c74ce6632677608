"""A work queue's records in an authenticated run: signed and checked as the run's own records are.

``gm.WorkQueue(..., secret=, secret_file=, identity=)`` (the keywords of ``gm.Session``) reads and
writes through ``GuardedMailbox`` with the run's policy, bound to the run by its manifest:

- **with a secret**, the queue's keys are secret-tagged like the run's record keys, so nobody without
  the secret can take a unit's claim or done marker first or plant one (objects without a valid
  tag are not listed), and every record carries the secret's MAC;
- **with an identity** (a members-only run), every record is signed by its holder, whose id carries
  its key's fingerprint, and counts only while the signer is a member. Where there is no secret, a
  bucket writer can still create keys: each listed claim, heartbeat, release and done marker is
  then read and checked once (cached) before it counts.

``QueueRecords()`` (no policy) is an open run's queue: records unsigned, nothing checked beyond
their fields, exactly as before.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ..errors import ProtocolError, RecordInvalid
from ..mailbox import Mailbox
from ..protocol.keys import MANIFEST
from ..protocol.records import Manifest, decode, encode
from ..protocol.store import RunStore
from . import keys
from .records import QueueInfo, UnitClaim, UnitDone, UnitHold, UnitRelease

R = TypeVar("R")
_CACHE = 65536


def record_class(key: str) -> type | None:
    """The record kind a work queue key holds."""
    if keys.parse_queue_info_key(key) is not None:
        return QueueInfo
    if keys.parse_unit_claim_key(key) is not None:
        return UnitClaim
    if keys.parse_unit_hold_key(key) is not None:
        return UnitHold
    if keys.parse_unit_release_key(key) is not None:
        return UnitRelease
    if keys.parse_unit_done_key(key) is not None:
        return UnitDone
    return None


class QueueRecords:
    """How one node's work queue writes and reads its records (module docstring). ``auth``: the
    run's policy (``members.node_policy``); None for an open run."""

    def __init__(self, auth: Any = None) -> None:
        self.auth = auth
        self.bound = auth is None
        self._ok: dict[str, bool] = {}

    def bind(self, mailbox: Mailbox) -> None:
        """Read and verify the run's manifest (which keys every MAC, tag and signature to the run)."""
        manifest = RunStore(mailbox, auth=self.auth).read_record(MANIFEST, Manifest)
        if manifest is None:
            raise ProtocolError(
                f"an authenticated work queue belongs to a run, and this mailbox has none yet ({MANIFEST} is "
                "missing): open the queue once this node's Session has joined the run"
            )
        if getattr(self.auth, "members_only", False) and getattr(self.auth, "identity", None) is None:
            raise ProtocolError("this run admits members only: open the work queue with identity= as well")
        self.bound = True

    def encode(self, record: Any) -> bytes:
        return encode(self.auth.sign(record) if self.auth is not None else record)

    def decode(self, data: bytes | None, cls: type[R], key: str) -> R:
        """Decode and check a record (``RecordInvalid`` when it fails)."""
        record = decode(data, cls, key=key)
        if self.auth is not None:
            self.auth.verify(record, key)
        return record

    def trusted(self, mailbox: Mailbox, key: str) -> bool:
        """Whether a listed key counts. Only a members-only run without a secret reads each one
        (once: its record is create-once): elsewhere a listed key was written by the run."""
        if not getattr(self.auth, "members_only", False) or getattr(self.auth, "authenticated", False):
            return True
        ok = self._ok.get(key)
        if ok is None:
            cls = record_class(key)
            if cls is None:
                return False
            data = mailbox.get(key)
            if data is None:
                return False  # deleted meanwhile (a heartbeat renewed): not cached
            try:
                self.decode(data, cls, key)
                ok = True
            except RecordInvalid:
                ok = False
            if len(self._ok) >= _CACHE:
                self._ok.clear()
            self._ok[key] = ok
        return ok

    def exists(self, mailbox: Mailbox, key: str, cls: type) -> bool:
        """Whether a record that counts is at ``key`` (a done marker, before claiming or renewing)."""
        data = mailbox.get(key)
        if data is None:
            return False
        if self.auth is None:
            return True
        try:
            self.decode(data, cls, key)
            return True
        except RecordInvalid:
            return False
