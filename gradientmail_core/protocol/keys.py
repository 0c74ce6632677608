"""Every storage key of the protocol, formatted and parsed here and nowhere else.

Numbers are zero-padded to a fixed width so that byte order is numeric order; a
property test holds us to that. All keys are relative to the mailbox prefix.

    manifest.json
    claims/{round:010d}/{n:03d}.json
    rounds/{round:010d}.json
    snapshots/{round:010d}/{learner}.json
    leases/{learner}/{seq:010d}.json          (role "both"; ".l.json" a learner, ".s.json" a syncer)
    blobs/init/{fragment:03d}-{sha256}.safetensors[.zst]
    blobs/rounds/{round:010d}/{kind}-{sha256}.safetensors[.zst]
    blobs/snapshots/{round:010d}/{learner}/{sha256}.safetensors[.zst]
    blobs/rosters/{round:010d}-{sha256}.json   a capped round's roster (``records.Roster``)
    barriers/{name}/{generation:010d}/{learner}.json   an arrival at a gm.Barrier (create-once)
    barriers/{name}/{generation:010d}.json             its outcome: released, or timed out

``work/`` is the work queues' folder (``gm.WorkQueue``, ``docs/protocol.md`` section 7): its keys
are formatted and parsed in ``workqueue/keys.py``; here it is only a folder whose record keys are
secret-tagged like the run's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_ROUND = 10**10 - 1
MAX_CLAIM = 999
MAX_SEQ = 10**10 - 1
MAX_FRAGMENT = 999

_LEARNER = r"[a-z0-9][a-z0-9-]{0,63}"
LEARNER_ID = re.compile(_LEARNER)

MANIFEST = "manifest.json"
CLAIMS = "claims/"
ROUNDS = "rounds/"
SNAPSHOTS = "snapshots/"
LEASES = "leases/"
BLOBS = "blobs/"
MEMBERS = "members/"  # the membership log of a members-only run: members/{seq:010d}-{sha256}.json
INIT_BLOBS = "blobs/init/"
ROUND_BLOBS = "blobs/rounds/"
SNAPSHOT_BLOBS = "blobs/snapshots/"
ROSTERS = "blobs/rosters/"

EXTENSIONS = {"": ".safetensors", "zstd": ".safetensors.zst"}
ROUND_BLOB_KINDS = ("theta", "outer", "change")

_SHA = r"[0-9a-f]{64}"
_EXT = r"\.safetensors(?:\.zst)?"
_CLAIM_RE = re.compile(r"claims/(\d{10})/(\d{3})\.json")
_ROUND_RE = re.compile(r"rounds/(\d{10})\.json")
_SNAPSHOT_RE = re.compile(rf"snapshots/(\d{{10}})/({_LEARNER})\.json")
_LEASE_RE = re.compile(rf"leases/({_LEARNER})/(\d{{10}})(\.[ls])?\.json")

# A node's role is in its lease key, so that one listing of ``leases/`` tells every observer who may
# close rounds: "both" trains and may close (no suffix: the keys of runs from before roles),
# "learner" only trains, "syncer" only closes.
ROLES = ("both", "learner", "syncer")
CLOSER_ROLES = ("both", "syncer")
_ROLE_SUFFIX = {"both": "", "learner": ".l", "syncer": ".s"}
_SUFFIX_ROLE = {v: k for k, v in _ROLE_SUFFIX.items()}
_INIT_BLOB_RE = re.compile(rf"blobs/init/(\d{{3}})-({_SHA})({_EXT})")
_ROUND_BLOB_RE = re.compile(rf"blobs/rounds/(\d{{10}})/(theta|outer|change)-({_SHA})({_EXT})")
_MEMBER_RE = re.compile(rf"members/(\d{{10}})-({_SHA})\.json")
_SNAPSHOT_BLOB_RE = re.compile(rf"blobs/snapshots/(\d{{10}})/({_LEARNER})/({_SHA})({_EXT})")
_ROSTER_RE = re.compile(rf"blobs/rosters/(\d{{10}})-({_SHA})\.json")
WORK = "work/"  # the work queues' folder (workqueue/keys.py)
BARRIERS = "barriers/"  # gm.Barrier: one folder per name, one generation per use of it
MAX_GENERATION = 10**10 - 1
_BARRIER_RE = re.compile(rf"barriers/({_LEARNER})/(\d{{10}})(?:/({_LEARNER}))?\.json")


def validate_learner_id(learner: str) -> str:
    if not isinstance(learner, str) or not LEARNER_ID.fullmatch(learner):
        raise ValueError(
            f"learner id {learner!r} is invalid: it must match [a-z0-9][a-z0-9-]{{0,63}} "
            "(lowercase letters, digits and '-', starting with a letter or digit)"
        )
    return learner


def padded(value: int, what: str, lo: int, hi: int) -> str:
    """``value``, an integer in ``lo..hi``, zero-padded to the digits of ``hi`` (so byte order is
    numeric order); ``ValueError`` naming ``what`` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{what} {value!r} out of range {lo}..{hi}")
    return f"{value:0{len(str(hi))}d}"


def _round(r: int) -> str:
    return padded(r, "round", 0, MAX_ROUND)


def _ext(compression: str) -> str:
    try:
        return EXTENSIONS[compression]
    except KeyError:
        raise ValueError(f"unknown compression {compression!r}; expected one of {sorted(EXTENSIONS)}") from None


def compression_of(key: str) -> str:
    """The codec a payload was written with, from its key's extension."""
    for compression, extension in EXTENSIONS.items():
        if key.endswith(extension):
            return compression
    raise ValueError(f"key {key!r} is not a payload key")


# ---- formatting -------------------------------------------------------------------------


def claims_prefix(r: int) -> str:
    return f"{CLAIMS}{_round(r)}/"


def claim_key(r: int, n: int) -> str:
    return f"{claims_prefix(r)}{padded(n, 'claim number', 1, MAX_CLAIM)}.json"


def round_key(r: int) -> str:
    return f"{ROUNDS}{_round(r)}.json"


def snapshots_prefix(r: int) -> str:
    return f"{SNAPSHOTS}{_round(r)}/"


def snapshot_key(r: int, learner: str) -> str:
    return f"{snapshots_prefix(r)}{validate_learner_id(learner)}.json"


def lease_prefix(learner: str) -> str:
    return f"{LEASES}{validate_learner_id(learner)}/"


def validate_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role={role!r}: expected one of {', '.join(map(repr, ROLES))}")
    return role


def lease_key(learner: str, seq: int, role: str = "both") -> str:
    return f"{lease_prefix(learner)}{padded(seq, 'lease sequence', 0, MAX_SEQ)}{_ROLE_SUFFIX[validate_role(role)]}.json"


def init_blob_key(fragment: int, sha: str, compression: str = "") -> str:
    _check_sha(sha)
    return f"{INIT_BLOBS}{padded(fragment, 'fragment', 0, MAX_FRAGMENT)}-{sha}{_ext(compression)}"


def round_blobs_prefix(r: int) -> str:
    return f"{ROUND_BLOBS}{_round(r)}/"


def round_blob_key(r: int, kind: str, sha: str, compression: str = "") -> str:
    if kind not in ROUND_BLOB_KINDS:
        raise ValueError(f"round blob kind {kind!r} not in {ROUND_BLOB_KINDS}")
    _check_sha(sha)
    return f"{round_blobs_prefix(r)}{kind}-{sha}{_ext(compression)}"


def snapshot_blobs_prefix(r: int) -> str:
    return f"{SNAPSHOT_BLOBS}{_round(r)}/"


def snapshot_blob_key(r: int, learner: str, sha: str, compression: str = "") -> str:
    _check_sha(sha)
    return f"{snapshot_blobs_prefix(r)}{validate_learner_id(learner)}/{sha}{_ext(compression)}"


def roster_key(r: int, sha: str) -> str:
    """Round ``r``'s roster (a capped round's draw was taken over it), named by the sha256 of its
    bytes: the round record names it, so the record's MAC or signature covers it too."""
    _check_sha(sha)
    return f"{ROSTERS}{_round(r)}-{sha}.json"


def member_key(seq: int, sha: str) -> str:
    """Entry ``seq`` of the membership log, named by the sha256 of its bytes (no one can take the
    name of an entry the owner is about to write)."""
    _check_sha(sha)
    return f"{MEMBERS}{padded(seq, 'membership entry', 0, MAX_SEQ)}-{sha}.json"


def member_logical_key(seq: int) -> str:
    """The name a membership entry's signature binds (its sha256 cannot be inside its own bytes)."""
    return f"{MEMBERS}{padded(seq, 'membership entry', 0, MAX_SEQ)}.json"


def parse_member_key(key: str) -> tuple[int, str] | None:
    """``(seq, sha256)`` of a membership entry key."""
    m = _MEMBER_RE.fullmatch(key)
    return (int(m[1]), m[2]) if m else None


def _check_sha(sha: str) -> None:
    if not re.fullmatch(_SHA, sha):
        raise ValueError(f"{sha!r} is not a lowercase hex sha256")


# ---- parsing (None for anything that is not a key of that kind) -------------------------


def parse_claim_key(key: str) -> tuple[int, int] | None:
    m = _CLAIM_RE.fullmatch(key)
    return (int(m[1]), int(m[2])) if m and int(m[2]) >= 1 else None


def parse_round_key(key: str) -> int | None:
    m = _ROUND_RE.fullmatch(key)
    return int(m[1]) if m else None


def parse_snapshot_key(key: str) -> tuple[int, str] | None:
    m = _SNAPSHOT_RE.fullmatch(key)
    return (int(m[1]), m[2]) if m else None


def parse_lease_key(key: str) -> tuple[str, int] | None:
    """``(learner, seq)`` of a lease key of any role (``lease_role`` tells the role)."""
    m = _LEASE_RE.fullmatch(key)
    return (m[1], int(m[2])) if m else None


def lease_role(key: str) -> str | None:
    """The role of the node holding lease ``key``: "both", "learner" or "syncer"."""
    m = _LEASE_RE.fullmatch(key)
    return _SUFFIX_ROLE[m[3] or ""] if m else None


@dataclass(frozen=True)
class BlobKey:
    kind: str  # "init", "theta", "outer", "change", "snapshot", "roster"
    sha: str
    compression: str
    round: int | None = None
    fragment: int | None = None
    learner: str | None = None


def parse_blob_key(key: str) -> BlobKey | None:
    if m := _INIT_BLOB_RE.fullmatch(key):
        return BlobKey("init", m[2], compression_of(key), fragment=int(m[1]))
    if m := _ROUND_BLOB_RE.fullmatch(key):
        return BlobKey(m[2], m[3], compression_of(key), round=int(m[1]))
    if m := _SNAPSHOT_BLOB_RE.fullmatch(key):
        return BlobKey("snapshot", m[3], compression_of(key), round=int(m[1]), learner=m[2])
    if m := _ROSTER_RE.fullmatch(key):
        return BlobKey("roster", m[2], "", round=int(m[1]))
    return None


def in_snapshot_folder(key: str, sha256: str, r: int, learner: str) -> bool:
    """Is ``key`` a payload of ``learner``'s snapshot of round ``r``, named by ``sha256``? A
    snapshot may only point into its own folder (so GC finds it, and nobody can make a closer
    read another learner's or a round's payload)."""
    b = parse_blob_key(key)
    return b is not None and (b.kind, b.round, b.learner, b.sha) == ("snapshot", r, learner, sha256)


# ---- authenticated runs: secret-tagged record keys --------------------------------------
#
# ``rounds/0000000007.json`` is stored as ``rounds/0000000007.{tag}.json`` (docs/security.md,
# "Forged commits"): the '.' before the tag sorts between '-' and every digit and letter, so physical
# byte order is logical byte order.

TAGGED_PREFIXES = (CLAIMS, ROUNDS, SNAPSHOTS, LEASES, WORK)  # (the work queues' too: docs/protocol.md section 7)
TAG_HEX = 32
_TAGGED_RE = re.compile(rf"((?:claims|rounds|snapshots|leases|work)/[A-Za-z0-9._/-]+)\.([0-9a-f]{{{TAG_HEX}}})\.json")


def is_record_key(key: str) -> bool:
    """True for keys of the protocol records tagged in authenticated runs: the per-round ones and
    the work queues'."""
    return key.startswith(TAGGED_PREFIXES)


def tag_key(key: str, tag: str) -> str:
    """The physical name of record key ``key`` in an authenticated run."""
    if not (is_record_key(key) and key.endswith(".json")) or not re.fullmatch(rf"[0-9a-f]{{{TAG_HEX}}}", tag):
        raise ValueError(f"cannot tag {key!r} with {tag!r}: not a record key or not a {TAG_HEX}-hex tag")
    return f"{key[:-5]}.{tag}.json"


def untag_key(key: str) -> tuple[str, str] | None:
    """``(logical key, tag)`` of a physical tagged key; None if ``key`` carries no tag."""
    m = _TAGGED_RE.fullmatch(key)
    return (m[1] + ".json", m[2]) if m else None


def validate_barrier_name(name: str) -> str:
    if not isinstance(name, str) or not LEARNER_ID.fullmatch(name):
        raise ValueError(
            f"barrier name {name!r} is invalid: it must match [a-z0-9][a-z0-9-]{{0,63}} "
            "(lowercase letters, digits and '-'), e.g. 'eval' or 'epoch-end'"
        )
    return name


def barrier_prefix(name: str) -> str:
    return f"{BARRIERS}{validate_barrier_name(name)}/"


def barrier_arrivals_prefix(name: str, generation: int) -> str:
    return f"{barrier_prefix(name)}{padded(generation, 'barrier generation', 0, MAX_GENERATION)}/"


def barrier_arrival_key(name: str, generation: int, learner: str) -> str:
    return f"{barrier_arrivals_prefix(name, generation)}{validate_learner_id(learner)}.json"


def barrier_outcome_key(name: str, generation: int) -> str:
    return f"{barrier_prefix(name)}{padded(generation, 'barrier generation', 0, MAX_GENERATION)}.json"


def parse_barrier_key(key: str) -> tuple[str, int, str | None] | None:
    """``(name, generation, learner)`` of an arrival, ``(name, generation, None)`` of an outcome."""
    m = _BARRIER_RE.fullmatch(key)
    return (m[1], int(m[2]), m[3]) if m else None


def is_known_key(key: str) -> bool:
    """True if ``key`` is any key the run's protocol writes (after untagging); a work queue's keys
    are ``workqueue.keys.is_known``'s."""
    parsers = (
        parse_claim_key,
        parse_round_key,
        parse_snapshot_key,
        parse_lease_key,
        parse_blob_key,
        parse_member_key,
        parse_barrier_key,
    )
    return key == MANIFEST or any(parse(key) is not None for parse in parsers)
