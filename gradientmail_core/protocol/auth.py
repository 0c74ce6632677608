"""Authenticated runs: a run secret (``secret=`` or ``secret_file=``), a MAC on every record binding
its kind, logical key and fields, and secret-tagged record keys, so whoever lacks the secret can
neither forge a record nor take a key first. The keys, the MAC's message and what this protects
against: ``docs/security.md``, "Authenticated runs". A run without a secret uses ``Unauthenticated``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
from typing import Any

from ..errors import RecordInvalid
from . import keys
from .records import Claim, KeyedRecord, Lease, Manifest, RoundRecord, Snapshot, signing_bytes

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
_DOMAIN = b"gradientmail/1\x00"
_TAG_CACHE = 65536


def load_secret(secret: bytes | str | None = None, secret_file: str | os.PathLike[str] | None = None) -> bytes | None:
    """The run secret from ``secret`` or the file ``secret_file`` (surrounding whitespace, such
    as the newline ``echo`` adds, is stripped); None for an unauthenticated run."""
    if secret is not None and secret_file is not None:
        raise ValueError("pass either secret= or secret_file=, not both")
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                raw = f.read(MAX_SECRET_BYTES + 1)
        except OSError as e:
            raise ValueError(f"secret_file={os.fspath(secret_file)!r} cannot be read: {e}") from None
        if len(raw) > MAX_SECRET_BYTES:
            raise ValueError(f"secret_file={os.fspath(secret_file)!r} is larger than {MAX_SECRET_BYTES} bytes")
        secret = raw.strip()
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes | bytearray):
        raise TypeError(f"secret must be bytes or str, found {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the run secret is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} random bytes, e.g. "
            "python -c 'import secrets; print(secrets.token_hex(32))' > run.key"
        )
    return bytes(secret)


def record_key(record: Any) -> str:
    """The logical key a record belongs at, from its own fields."""
    try:
        if isinstance(record, Manifest):
            return keys.MANIFEST
        if isinstance(record, RoundRecord):
            return keys.round_key(record.round)
        if isinstance(record, Snapshot):
            return keys.snapshot_key(record.round, record.learner)
        if isinstance(record, Claim):
            return keys.claim_key(record.round, record.n)
        if isinstance(record, Lease):
            return keys.lease_key(record.learner, record.seq, record.role)
        if isinstance(record, KeyedRecord):  # a work queue's
            return record.logical_key()
    except ValueError as e:
        raise RecordInvalid(f"{type(record).__name__} names no valid key: {e}") from None
    raise TypeError(f"{type(record).__name__} is not a protocol record")


def _refuse_members_only(policy: Any, record: Any, key: str) -> None:
    if isinstance(record, Manifest) and record.owner is not None and not policy.members_ok:
        raise RecordInvalid(
            f"{key}: this run admits members only (it was created with an identity); start this node with "
            "identity='node.key' and have the run's owner add its public key (gradientmail members add)"
        )


class Unauthenticated:
    """The policy of a run without a secret: records unsigned, keys untagged."""

    authenticated = False
    members_ok = False  # True under members.MemberAuth, which checks members-only runs itself

    def sign(self, record: Any) -> Any:
        return record

    def verify(self, record: Any, key: str) -> None:
        _refuse_members_only(self, record, key)
        if isinstance(record, Manifest) and record.mac is not None:
            raise RecordInvalid(
                f"{key}: this run is authenticated (its manifest is signed) but this node has no run secret; "
                "start it with the run's secret= or secret_file="
            )

    def tag(self, key: str) -> str | None:
        return None


class RunAuth:
    """The policy of a run with a secret: signs what this node writes, verifies what it reads,
    and tags record keys. Bound to the run by the manifest it signs or verifies."""

    authenticated = True
    members_ok = False

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the run secret must be at least {MIN_SECRET_BYTES} bytes (see load_secret)")
        self._secret = secret
        self.run_id: str | None = None
        self._run_key: bytes | None = None
        self._tags: dict[str, str] = {}

    def __repr__(self) -> str:  # never show the secret
        return f"RunAuth(run_id={self.run_id!r})"

    # ---- keys ---------------------------------------------------------------------------

    def _key_for_run(self, run_id: str) -> bytes:
        return hmac.new(self._secret, _DOMAIN + b"run\x00" + run_id.encode(), hashlib.sha256).digest()

    def bind(self, run_id: str) -> None:
        """Key every later MAC and tag to ``run_id`` (done when the manifest is signed or verified)."""
        if run_id != self.run_id:
            self.run_id, self._run_key, self._tags = run_id, self._key_for_run(run_id), {}

    def _bound_key(self) -> bytes:
        assert self._run_key is not None, "a run-keyed operation before the manifest was read or written"
        return self._run_key

    def tag(self, key: str) -> str:
        """The secret tag of logical record key ``key`` in this run."""
        tag = self._tags.get(key)
        if tag is None:
            mac = hmac.new(self._bound_key(), _DOMAIN + b"key\x00" + key.encode(), hashlib.sha256)
            tag = mac.hexdigest()[: keys.TAG_HEX]
            if len(self._tags) >= _TAG_CACHE:
                self._tags.clear()
            self._tags[key] = tag
        return tag

    # ---- records ------------------------------------------------------------------------

    def _mac(self, key: str, record: Any) -> str:
        """Keyed by the run a manifest names, else by the run this policy is bound to."""
        run_key = self._key_for_run(record.run_id) if isinstance(record, Manifest) else self._bound_key()
        msg = b"\x00".join([_DOMAIN + b"mac", type(record).__name__.encode(), key.encode(), signing_bytes(record)])
        return hmac.new(run_key, msg, hashlib.sha256).hexdigest()

    def sign(self, record: Any) -> Any:
        """``record`` with its ``mac`` set. Signing a manifest binds this policy to its run."""
        signed = dataclasses.replace(record, mac=self._mac(record_key(record), record))
        if isinstance(record, Manifest):
            self.bind(record.run_id)
        return signed

    def verify(self, record: Any, key: str) -> None:
        """Raise ``RecordInvalid`` unless ``record`` was signed with this run's secret for ``key``."""
        _refuse_members_only(self, record, key)
        expected = record_key(record)
        if key != expected:
            raise RecordInvalid(f"{key}: holds a record that belongs at {expected} (copied or replayed)")
        if record.mac is None:
            what = "this run's manifest is not signed" if isinstance(record, Manifest) else "the record is unsigned"
            raise RecordInvalid(
                f"{key}: {what}, but this node has a run secret; it was written without the secret "
                "(for the manifest: the run was created without one, so use a new mailbox prefix or drop secret=)"
            )
        if not hmac.compare_digest(record.mac, self._mac(key, record)):
            what = "the run was created with a different secret, or" if isinstance(record, Manifest) else ""
            raise RecordInvalid(f"{key}: MAC does not verify: {what} the object was forged or altered")
        if isinstance(record, Manifest):
            self.bind(record.run_id)


Policy = Unauthenticated | RunAuth


def policy(secret: bytes | str | None = None, secret_file: str | os.PathLike[str] | None = None) -> Policy:
    """``RunAuth`` when a secret is given, else ``Unauthenticated``; validated before any I/O."""
    raw = load_secret(secret, secret_file)
    return Unauthenticated() if raw is None else RunAuth(raw)
