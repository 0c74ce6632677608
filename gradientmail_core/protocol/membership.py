"""The membership log of a members-only run and the signatures every record carries: the
signed message, signing and checking a record, the log's entries (``Membership``), and writing,
reading and changing the log. ``members.py`` holds the policy a node applies with them
(``MemberAuth``); the format is described there and in ``docs/protocol.md`` section 8.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ProtocolError, RecordInvalid
from . import identity as ids
from . import keys
from .records import (
    MAX_RECORD_BYTES,
    Claim,
    KeyedRecord,
    Lease,
    Manifest,
    MemberEntry,
    RoundRecord,
    Snapshot,
    decode,
    encode,
    identity_bytes,
)

_DOMAIN = b"gradientmail/1\x00"
NO_PREV = "0" * 64


class SignatureInvalid(RecordInvalid):
    """A record of a members-only run that is unsigned, signed by a non-member or a revoked key,
    or whose signature does not verify: ignored, never judged."""


class NotAMember(ProtocolError):
    """This node's identity is not (or no longer) a member of the run."""


def message(run_id: str, kind: str, key: str, record: Any) -> bytes:
    """The bytes a node signs for ``record`` written under logical ``key`` in run ``run_id``."""
    return b"".join(
        [_DOMAIN, b"sig\x00", run_id.encode(), b"\x00", kind.encode(), b"\x00", key.encode(), b"\x00"]
        + [identity_bytes(record)]
    )


def sign_record(record: Any, identity: ids.Identity, run_id: str, key: str) -> Any:
    """``record`` with ``signer`` and ``sig`` set by ``identity`` for ``key`` in ``run_id``."""
    unsigned = dataclasses.replace(record, signer=identity.public_hex, sig=None, **_no_mac(record))
    return dataclasses.replace(unsigned, sig=identity.sign(message(run_id, type(record).__name__, key, unsigned)))


def _no_mac(record: Any) -> dict[str, Any]:
    return {"mac": None} if hasattr(record, "mac") else {}


def signature_ok(record: Any, run_id: str, key: str) -> bool:
    if record.signer is None or record.sig is None:
        return False
    return ids.verify(record.signer, record.sig, message(run_id, type(record).__name__, key, record))


def who(record: Any) -> str | None:
    """The learner id a record speaks for."""
    if isinstance(record, Manifest):
        return record.created_by
    if isinstance(record, RoundRecord):
        return record.closer
    if isinstance(record, Snapshot | Lease | Claim):
        return record.learner
    if isinstance(record, KeyedRecord):  # a work queue's
        return record.speaker()
    return None


def members_ref(seq: int, sha: str) -> str:
    return f"{seq:010d}-{sha}"


def parse_ref(ref: str) -> tuple[int, str]:
    seq, sha = ref.split("-", 1)
    return int(seq), sha


# ---- the membership log ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    seq: int
    sha: str
    record: MemberEntry


class Membership:
    """The membership log of one run as this node has read it."""

    def __init__(self, run_id: str, owner: str) -> None:
        self.run_id, self.owner = run_id, owner
        self.entries: dict[str, Entry] = {}  # sha -> valid entry
        self._bad: set[str] = set()
        self._members: dict[str, tuple[frozenset[str], frozenset[str]]] = {}  # sha -> (members, removed)
        self.head: Entry | None = None

    def check_entry(self, key: str, data: bytes | None) -> Entry:
        """Validate the object at membership key ``key``; ``RecordInvalid`` says why not."""
        parsed = keys.parse_member_key(key)
        if parsed is None:
            raise RecordInvalid(f"{key}: not a membership entry key")
        seq, sha = parsed
        if data is None:
            raise RecordInvalid(f"{key}: missing")
        if hashlib.sha256(data).hexdigest() != sha:
            raise RecordInvalid(f"{key}: its bytes do not hash to its name")
        rec = decode(data, MemberEntry, key=key)
        if rec.seq != seq or rec.run_id != self.run_id:
            raise RecordInvalid(f"{key}: an entry of another run or position (run {rec.run_id}, seq {rec.seq})")
        if rec.signer != self.owner:
            raise RecordInvalid(f"{key}: not signed by the run's owner")
        if not signature_ok(rec, self.run_id, keys.member_logical_key(seq)):
            raise RecordInvalid(f"{key}: the owner's signature does not verify")
        if (seq == 0) != (rec.prev == NO_PREV):
            raise RecordInvalid(f"{key}: entry {seq} names the wrong predecessor")
        if seq > 0:
            prev = self.entries.get(rec.prev)
            if prev is None or prev.seq != seq - 1:
                raise RecordInvalid(f"{key}: its predecessor {rec.prev[:12]}... is not entry {seq - 1} of the log")
        return Entry(seq, sha, rec)

    def add_listed(
        self, listed: list[str], read: Callable[[str], bytes | None], report: Callable[[str, str], None]
    ) -> None:
        """Take in the entries among ``listed`` (keys in byte order, so in seq order) not seen yet."""
        for key in listed:
            parsed = keys.parse_member_key(key)
            if parsed is None or parsed[1] in self.entries or key in self._bad:
                continue
            try:
                entry = self.check_entry(key, read(key))
            except RecordInvalid as e:
                self._bad.add(key)
                report(key, str(e))
                continue
            self.entries[entry.sha] = entry
            h = self.head
            if h is None or (entry.seq, _neg(entry.sha)) > (h.seq, _neg(h.sha)):
                self.head = entry

    def at(self, sha: str) -> tuple[frozenset[str], frozenset[str]] | None:
        """``(members, removed)`` after entry ``sha``; None if that entry is not known."""
        got = self._members.get(sha)
        if got is not None:
            return got
        chain: list[Entry] = []
        cur = self.entries.get(sha)
        while cur is not None and cur.sha not in self._members:
            chain.append(cur)
            cur = self.entries.get(cur.record.prev) if cur.seq > 0 else None
        if chain and chain[-1].seq > 0 and cur is None:
            return None
        members, removed = self._members[cur.sha] if cur is not None else (frozenset(), frozenset())
        for e in reversed(chain):
            removed = removed | frozenset(e.record.remove)
            members = (members | frozenset(e.record.add)) - removed
            self._members[e.sha] = (members, removed)
        return self._members.get(sha)

    def current(self) -> tuple[frozenset[str], frozenset[str]]:
        if self.head is None:
            return frozenset(), frozenset()
        got = self.at(self.head.sha)
        assert got is not None
        return got

    def head_ref(self) -> str | None:
        return None if self.head is None else members_ref(self.head.seq, self.head.sha)


def _neg(sha: str) -> str:
    # Among valid entries of one seq (the owner wrote two at once), the smallest sha256 is the head.
    return "".join(f"{15 - int(c, 16):x}" for c in sha)


# ---- writing the log (the creator, and ``gradientmail members``) --------------------------------


def write_entry(mailbox: Any, entry: MemberEntry, owner: ids.Identity) -> str:
    """Sign ``entry`` with the owner's key and create it; returns its key."""
    signed = sign_record(entry, owner, entry.run_id, keys.member_logical_key(entry.seq))
    data = encode(signed)
    assert len(data) <= MAX_RECORD_BYTES
    key = keys.member_key(entry.seq, hashlib.sha256(data).hexdigest())
    mailbox.put_if_absent(key, data)
    return key


def read_log(mailbox: Any, manifest: Manifest, report: Callable[[str, str], None] | None = None) -> Membership:
    """The membership log of the run ``manifest`` describes, read from ``mailbox``."""
    if manifest.owner is None:
        raise ProtocolError("this run is open to anyone: it has no membership (it was created without an identity)")
    m = Membership(manifest.run_id, manifest.owner)
    m.add_listed(mailbox.list(keys.MEMBERS), mailbox.get, report or (lambda key, why: None))
    return m


def change(
    mailbox: Any,
    manifest: Manifest,
    owner: ids.Identity,
    *,
    add: Sequence[str] = (),
    remove: Sequence[str] = (),
) -> tuple[str, Membership]:
    """Append an entry adding and removing public keys; returns its key and the log after it."""
    if manifest.owner != owner.public_hex:
        raise ValueError(
            f"--owner-key {owner.path or ''} is not the owner of this run (its owner key is {ids.fingerprint(manifest.owner)}"
            f", this one is {owner.fingerprint})"
            if manifest.owner
            else "this run is open to anyone: it has no owner (it was created without an identity)"
        )
    for k in [*add, *remove]:
        if not ids.PUBKEY.fullmatch(k):
            raise ValueError(f"{k!r} is not a public key (64 lowercase hex characters; see gradientmail members key)")
    m = read_log(mailbox, manifest)
    if m.head is None:
        raise ProtocolError("the run's membership log is empty: its creator did not finish creating it")
    members, removed = m.current()
    again = sorted(set(add) & removed)
    if again:
        raise ValueError(f"{ids.fingerprint(again[0])} was revoked and cannot be admitted again; use a new identity")
    entry = MemberEntry(
        run_id=manifest.run_id,
        seq=m.head.seq + 1,
        prev=m.head.sha,
        add=sorted(set(add) - members),
        remove=sorted(set(remove)),
    )
    key = write_entry(mailbox, entry, owner)
    m.add_listed(mailbox.list(keys.MEMBERS), mailbox.get, lambda k, why: None)
    if m.head is None or keys.member_key(m.head.seq, m.head.sha) != key:
        raise ProtocolError(f"another change of the membership was written at the same time ({key} lost); run it again")
    return key, m
