"""Members-only runs: who may take part, signed by each node, revocable.

The format and its rules (the owner-signed, append-only log, the signed message, which records
count) are in ``docs/protocol.md`` section 8; what this protects against in ``docs/security.md``.

Here: signing and checking a record (``sign_record``, ``signature_ok``), the log as read
(``Membership``), writing, reading and changing it (``write_entry``, ``read_log``, ``change``), and
``MemberAuth``, the policy a node applies with them (the interface of ``auth.Unauthenticated`` /
``auth.RunAuth``, which it wraps: a run can have a shared secret too).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ProtocolError, RecordInvalid
from . import identity as ids
from . import keys
from .auth import Policy, Unauthenticated, record_key
from .auth import policy as secret_policy
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

# ---- signatures --------------------------------------------------------------------------------

_DOMAIN = b"gradientmail/1\x00"
NO_PREV = "0" * 64


class SignatureInvalid(RecordInvalid):
    """A record of a members-only run that is unsigned, signed by a non-member or a revoked key,
    or whose signature does not verify: ignored, never judged."""


class NotAMember(ProtocolError):
    """This node's identity is not (or no longer) a member of the run."""


def message(run_id: str, kind: str, key: str, record: Any) -> bytes:
    """The bytes a node signs for ``record`` written under logical ``key`` in run ``run_id``."""
    return b"\x00".join([_DOMAIN + b"sig", run_id.encode(), kind.encode(), key.encode(), identity_bytes(record)])


def sign_record(record: Any, identity: ids.Identity, run_id: str, key: str) -> Any:
    """``record`` with ``signer`` and ``sig`` set by ``identity`` for ``key`` in ``run_id``."""
    no_mac = {"mac": None} if hasattr(record, "mac") else {}  # a membership entry has none
    unsigned = dataclasses.replace(record, signer=identity.public_hex, sig=None, **no_mac)
    return dataclasses.replace(unsigned, sig=identity.sign(message(run_id, type(record).__name__, key, unsigned)))


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

    def read(self, mailbox: Any, report: Callable[[str, str], None] = lambda key, why: None) -> None:
        """Take in the entries not seen yet: one LIST (keys in byte order, so in seq order), a GET each."""
        for key in mailbox.list(keys.MEMBERS):
            parsed = keys.parse_member_key(key)
            if parsed is None or parsed[1] in self.entries or key in self._bad:
                continue
            try:
                entry = self.check_entry(key, mailbox.get(key))
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


def read_log(
    mailbox: Any, manifest: Manifest, report: Callable[[str, str], None] = lambda key, why: None
) -> Membership:
    """The membership log of the run ``manifest`` describes, read from ``mailbox``."""
    if manifest.owner is None:
        raise ProtocolError("this run is open to anyone: it has no membership (it was created without an identity)")
    m = Membership(manifest.run_id, manifest.owner)
    m.read(mailbox, report)
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
    m.read(mailbox)
    if m.head is None or keys.member_key(m.head.seq, m.head.sha) != key:
        raise ProtocolError(f"another change of the membership was written at the same time ({key} lost); run it again")
    return key, m


# ---- the policy --------------------------------------------------------------------------------


class MemberAuth:
    """Signs what this node writes and checks what it reads, in a members-only run.

    ``inner``: the run-secret policy underneath (``Unauthenticated`` or ``RunAuth``): its MACs and
    key tags apply as well. ``identity``: this node's key pair (None for a read-only tool).
    ``owner``: the key that signs the membership log of a run this node creates (default: its
    identity).
    """

    def __init__(
        self,
        inner: Policy | None = None,
        *,
        identity: ids.Identity | None = None,
        owner: ids.Identity | None = None,
    ) -> None:
        self.inner: Policy = inner if inner is not None else Unauthenticated()
        self.inner.members_ok = True  # the inner policy leaves members-only manifests to us
        self.identity = identity
        self.owner_identity = owner or identity
        self.run_id: str | None = None
        self.membership: Membership | None = None  # None: an open run (no owner in the manifest)
        self._mailbox: Any = None
        self._report: Callable[[str, str], None] = lambda key, why: None
        self._tape: dict[int, int] = {}  # round -> membership seq named by its verified record
        self._leases_ok: dict[str, bool] = {}
        self._fps: tuple[str | None, frozenset[str], frozenset[str]] | None = None

    def __repr__(self) -> str:
        fp = self.identity.fingerprint if self.identity else None
        return f"MemberAuth(identity={fp!r}, run_id={self.run_id!r}, inner={self.inner!r})"

    @property
    def authenticated(self) -> bool:  # secret-tagged keys: the inner policy's
        return self.inner.authenticated

    @property
    def members_only(self) -> bool:
        return self.membership is not None

    def tag(self, key: str) -> str | None:
        return self.inner.tag(key)

    def attach(self, mailbox: Any, report: Callable[[str, str], None]) -> None:
        """Called by ``GuardedMailbox``: where to list and read the membership log, and report."""
        self._mailbox, self._report = mailbox, report

    # ---- the log ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Read the membership log's new entries."""
        if self.membership is not None and self._mailbox is not None:
            self.membership.read(self._mailbox, self._report)

    def _bind(self, manifest: Manifest) -> None:
        if manifest.run_id == self.run_id:
            return
        self.run_id = manifest.run_id
        self.membership = Membership(manifest.run_id, manifest.owner) if manifest.owner else None
        self._tape.clear()
        self.refresh()

    # ---- signing --------------------------------------------------------------------------------

    def sign(self, record: Any) -> Any:
        if isinstance(record, Manifest):
            record = self._sign_manifest(record)
        elif self.identity is not None and self.run_id is not None:
            if self.membership is not None:
                self._check_self()
                if isinstance(record, RoundRecord):
                    ref = self._ref_for(record)
                    record = dataclasses.replace(record, members=ref)
                    if ref is not None:
                        self._tape[record.round] = parse_ref(ref)[0]
            record = sign_record(record, self.identity, self.run_id, record_key(record))
        return self.inner.sign(record)

    def _ref_for(self, record: RoundRecord) -> str | None:
        """The membership a round record names: the newest entry this node has read in which its
        closer and every participant are members (a snapshot judged before this node read a
        revocation keeps the revocation for the next round), and no older than an earlier round's."""
        m = self.membership
        assert m is not None and self.identity is not None
        floor = max((s for r, s in self._tape.items() if r < record.round), default=0)
        need = {self.identity.fingerprint} | {p.learner.rsplit("-", 1)[-1] for p in record.participants}
        e = m.head
        while e is not None and e.seq >= floor:
            state = m.at(e.sha)
            if state is not None and need <= {ids.fingerprint(k) for k in state[0]}:
                return members_ref(e.seq, e.sha)
            e = m.entries.get(e.record.prev) if e.seq > 0 else None
        return None if m.head is None else members_ref(m.head.seq, m.head.sha)

    def _sign_manifest(self, manifest: Manifest) -> Manifest:
        if self.identity is None:
            return manifest
        if manifest.owner is None:  # a run this node creates: entry 0 of its log admits the creator
            assert self.owner_identity is not None
            if self._mailbox is None:
                raise ProtocolError("a members-only run is created through a GuardedMailbox (it writes the log)")
            manifest = dataclasses.replace(manifest, owner=self.owner_identity.public_hex)
            entry = MemberEntry(
                run_id=manifest.run_id, seq=0, prev=NO_PREV, add=[self.identity.public_hex], note="genesis"
            )
            write_entry(self._mailbox, entry, self.owner_identity)
        signed = sign_record(manifest, self.identity, manifest.run_id, keys.MANIFEST)
        self._bind(signed)
        return signed

    def _check_self(self) -> None:
        assert self.identity is not None and self.membership is not None
        me = self.identity.public_hex
        members, removed = self.membership.current()
        if me not in members and me not in removed:
            self.refresh()  # just added?
            members, removed = self.membership.current()
        if me not in members:
            what = "was revoked from" if me in removed else "is not a member of"
            raise NotAMember(
                f"this node's identity {self.identity.fingerprint} {what} the run {self.run_id}; "
                + (
                    "it cannot take part any more (a revoked key is never admitted again: use a new identity)"
                    if me in removed
                    else f"ask the run's owner to run: gradientmail members add URL --owner-key OWNER.key {me}"
                )
            )

    # ---- verifying ------------------------------------------------------------------------------

    def verify(self, record: Any, key: str) -> None:
        self.inner.verify(record, key)
        if isinstance(record, Manifest):
            if record.owner is not None:
                self._check_signed(record, record.run_id, key)
            self._bind(record)
            return
        if self.membership is None or isinstance(record, MemberEntry):
            return
        assert self.run_id is not None
        if key != (expected := record_key(record)):
            raise SignatureInvalid(f"{key}: holds a record that belongs at {expected} (copied or replayed)")
        self._check_signed(record, self.run_id, key)
        if isinstance(record, RoundRecord):
            self._check_round(record, key)
            return
        members, removed = self.membership.current()
        if record.signer not in members:
            raise SignatureInvalid(self._not_member(key, record.signer, removed))

    def _check_signed(self, record: Any, run_id: str, key: str) -> None:
        if record.signer is None or record.sig is None:
            raise SignatureInvalid(f"{key}: unsigned, in a members-only run")
        name = who(record)
        if name is None or not ids.names_key(name, record.signer):
            raise SignatureInvalid(
                f"{key}: learner id {name!r} does not carry the fingerprint of its signer {ids.fingerprint(record.signer)}"
            )
        if not signature_ok(record, run_id, key):
            raise SignatureInvalid(
                f"{key}: the signature of {ids.fingerprint(record.signer)} does not verify (forged, altered, or "
                "replayed from another run, round, fragment or key)"
            )

    def _check_round(self, record: RoundRecord, key: str) -> None:
        m = self.membership
        assert m is not None
        ref = record.members
        if ref is None:
            raise SignatureInvalid(f"{key}: names no membership, in a members-only run")
        seq, sha = parse_ref(ref)
        state = m.at(sha)
        if state is None:
            self.refresh()
            state = m.at(sha)
        if state is None or m.entries[sha].seq != seq:
            raise SignatureInvalid(f"{key}: names membership entry {ref[:24]}..., which is not in the log")
        if record.signer not in state[0]:
            raise SignatureInvalid(self._not_member(key, record.signer, state[1], f" as of entry {seq}"))
        fps = {ids.fingerprint(k) for k in state[0]}
        outside = [p.learner for p in record.participants if p.learner.rsplit("-", 1)[-1] not in fps]
        if outside:
            raise SignatureInvalid(f"{key}: merges {outside[0]}, which is not a member as of entry {seq}")
        older = [s for r, s in self._tape.items() if r < record.round and s > seq]
        if older:
            raise SignatureInvalid(
                f"{key}: names membership entry {seq}, older than entry {max(older)} an earlier round named"
            )
        self._tape[record.round] = seq
        if len(self._tape) > 4096:
            for r in sorted(self._tape)[:2048]:
                del self._tape[r]

    def _not_member(self, key: str, signer: str | None, removed: frozenset[str], when: str = "") -> str:
        fp = ids.fingerprint(signer) if signer else "?"
        if signer in removed:
            return f"{key}: signed by {fp}, whose membership was revoked{when}"
        return f"{key}: signed by {fp}, which is not a member of the run{when}"

    # ---- listings (GuardedMailbox) ----------------------------------------------------------------

    def listed(self, prefix: str) -> None:
        """A listing of ``prefix`` is about to be filtered: the leases' listing also reads the log."""
        if prefix == keys.LEASES:
            self.refresh()

    def refuse(self, key: str) -> str | None:
        """Why a listed record key is dropped before anything reads it (None: keep it).

        Snapshot and lease keys name their learner, and so the fingerprint of the key that must
        sign them: a non-member's are dropped by name. A lease is also read once and verified, as
        liveness is judged from lease names alone."""
        m = self.membership
        if m is None:
            return None
        lease = None
        if (snap := keys.parse_snapshot_key(key)) is not None:
            learner = snap[1]
        elif (lease := keys.parse_lease_key(key)) is not None:
            learner = lease[0]
        else:
            return None
        fps, gone = self._fingerprints()
        fp = learner.rsplit("-", 1)[-1]
        if fp not in fps:
            if fp in gone:
                return "its learner's key was revoked from the run"
            return "its learner's key is not a member of the run"
        if lease is not None and self.identity is not None and not learner.endswith(self.identity.fingerprint):
            return self._check_lease(key)
        return None

    def _check_lease(self, key: str) -> str | None:
        if key not in self._leases_ok:
            data = self._mailbox.get(key) if self._mailbox is not None else None
            if data is None:
                return None  # gone meanwhile: renewed
            if len(self._leases_ok) > 65536:
                self._leases_ok.clear()
            try:
                self.verify(decode(data, Lease, key=key), key)
            except RecordInvalid as e:
                self._leases_ok[key] = False
                return str(e)
            self._leases_ok[key] = True
        return None if self._leases_ok[key] else "its signature does not verify"

    def _fingerprints(self) -> tuple[frozenset[str], frozenset[str]]:
        """Fingerprints of the members and of the revoked keys, as of the newest entry read."""
        m = self.membership
        head = None if m is None or m.head is None else m.head.sha
        if self._fps is None or self._fps[0] != head:
            members, removed = (frozenset(), frozenset()) if m is None else m.current()
            fps = frozenset(ids.fingerprint(k) for k in members), frozenset(ids.fingerprint(k) for k in removed)
            self._fps = (head, *fps)
        return self._fps[1], self._fps[2]


def node_policy(
    secret: bytes | str | None,
    secret_file: str | os.PathLike[str] | None,
    identity: str | os.PathLike[str] | None,
    owner_key: str | os.PathLike[str] | None = None,
) -> tuple[Policy | MemberAuth, ids.Identity | None]:
    """What a node signs and checks with, from its keywords, checked before any I/O: the run secret's
    policy, under ``MemberAuth`` with this node's key pair when it has an ``identity``. Returns the
    policy and the identity."""
    auth = secret_policy(secret, secret_file)
    if identity is None:
        if owner_key is not None:
            raise ValueError("owner_key= names the owner of a run this node creates: it needs identity= too")
        return auth, None
    me = ids.Identity.load(identity)
    owner = ids.Identity.load(owner_key) if owner_key is not None else None
    return MemberAuth(auth, identity=me, owner=owner), me
