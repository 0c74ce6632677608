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

Records are written and read through a ``RunStore`` (``put_record``, ``put_own``,
``decode_record``: signed and checked with the run's policy, as the run's own); with no policy it is
an open run's queue: records unsigned, nothing checked beyond their fields.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ..errors import ProtocolError, RecordInvalid
from ..protocol.keys import MANIFEST
from ..protocol.records import Manifest
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
    """Which of a queue's records count, for one node (module docstring). ``store``: the queue's
    ``RunStore``, with the run's policy (``members.node_policy``), or none for an open run."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.auth: Any = store.auth
        self.bound = self.auth is None
        self._ok: dict[str, bool] = {}

    def bind(self) -> None:
        """Read and verify the run's manifest (which keys every MAC, tag and signature to the run)."""
        manifest = self.store.read_record(MANIFEST, Manifest)
        if manifest is None:
            raise ProtocolError(
                f"an authenticated work queue belongs to a run, and this mailbox has none yet ({MANIFEST} is "
                "missing): open the queue once this node's Session has joined the run"
            )
        if getattr(self.auth, "members_only", False) and getattr(self.auth, "identity", None) is None:
            raise ProtocolError("this run admits members only: open the work queue with identity= as well")
        self.bound = True

    def trusted(self, key: str) -> bool:
        """Whether a listed key counts. Only a members-only run without a secret reads each one
        (once: its record is create-once): elsewhere a listed key was written by the run."""
        if not getattr(self.auth, "members_only", False) or getattr(self.auth, "authenticated", False):
            return True
        ok = self._ok.get(key)
        if ok is None:
            cls = record_class(key)
            if cls is None:
                return False
            data = self.store.mailbox.get(key)
            if data is None:
                return False  # deleted meanwhile (a heartbeat renewed): not cached
            try:
                self.store.decode_record(data, cls, key)
                ok = True
            except RecordInvalid:
                ok = False
            if len(self._ok) >= _CACHE:
                self._ok.clear()
            self._ok[key] = ok
        return ok

    def exists(self, key: str, cls: type) -> bool:
        """Whether a record that counts is at ``key`` (a done marker, before claiming or renewing)."""
        data = self.store.mailbox.get(key)
        if data is None:
            return False
        if self.auth is None:
            return True
        try:
            self.store.decode_record(data, cls, key)
            return True
        except RecordInvalid:
            return False
