"""The records of the protocol: frozen dataclasses and one codec to canonical JSON.

Every field is type- and range-checked on the way in; a record that fails is a
``RecordInvalid`` (a ``ProtocolError``), never a ``KeyError`` from deep inside.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import RecordInvalid, UnsupportedFormat
from .identity import PUBKEY as _PUBKEY
from .identity import SIG as _SIG
from .keys import LEARNER_ID as _LEARNER
from .keys import ROLES

FORMAT = 1
MAX_RECORD_BYTES = 1 << 20
MAX_MANIFEST_BYTES = 64 << 20
MAX_LIST = 100_000
MAX_INT = 2**63 - 1
MAX_ROSTER = 1_000_000  # learners a roster names
MAX_ROSTER_BYTES = MAX_ROSTER * 67 + 64  # (an id is at most 64 characters, quoted, and a comma)

_SHA = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(r"[0-9a-f]{8,64}")
_MAC = re.compile(r"[0-9a-f]{64}")
_LAYOUT = re.compile(r"(?:[a-z][a-z0-9]{0,15}(?:,[a-z][a-z0-9]{0,15}){0,15})?")
_MEMBERS_REF = re.compile(r"\d{10}-[0-9a-f]{64}")
# A payload key: under blobs/, no empty, '.' or '..' segment (checked on decode, so a hostile ref
# can never name a key outside the payload folders or one a backend refuses).
_KEY = re.compile(r"blobs/(?:[A-Za-z0-9_-][A-Za-z0-9._-]*/)*[A-Za-z0-9_-][A-Za-z0-9._-]*")

REJECT_REASONS = ("zero_steps", "schema", "stale", "missing", "corrupt", "nonfinite", "outlier", "late")


def _meta(omit: bool = False, **check: Any) -> dict[str, Any]:
    """A field's checks on decode; ``omit``: left out of the JSON while it holds its default, so the
    records that do not use it keep the bytes they had before it existed."""
    return {"check": check, "omit_default": True} if omit else {"check": check}


def sha(**kw: Any) -> Any:
    return field(metadata=_meta(pattern=_SHA), **kw)


def learner_field(**kw: Any) -> Any:
    return field(metadata=_meta(pattern=_LEARNER), **kw)


def nonneg(**kw: Any) -> Any:
    return field(metadata=_meta(min=0), **kw)


@dataclass(frozen=True, kw_only=True)
class Signed:
    """The fields every record of a run carries for its policy (``protocol/auth.py``): the record
    format, the run secret's MAC, and in a members-only run the signer's key and signature. A base
    of fields only: the records that derive from it add their own and behave as plain records."""

    format: int = FORMAT
    mac: str | None = field(default=None, metadata=_meta(pattern=_MAC))
    signer: str | None = field(default=None, metadata=_meta(pattern=_PUBKEY, omit=True))
    sig: str | None = field(default=None, metadata=_meta(pattern=_SIG, omit=True))


@typing.runtime_checkable
class KeyedRecord(typing.Protocol):
    """A record of a package built on the run (the work queue's) that names its own key and the
    learner id it speaks for, so the run's policy tags, signs and checks it without knowing its kind."""

    def logical_key(self) -> str: ...

    def speaker(self) -> str: ...


@dataclass(frozen=True, kw_only=True)
class PayloadRef:
    """A payload by reference: its key, sha256 and size. A chunked payload's ref is chunk 0, ``more``
    listing chunks 1..n-1 in order; left out of the JSON when empty (a one-chunk ref's bytes)."""

    key: str = field(metadata=_meta(pattern=_KEY, max_len=512))
    sha256: str = sha()
    size: int = nonneg()
    more: list[PayloadRef] = field(default_factory=list, hash=False, metadata=_meta(max_len=MAX_LIST, omit=True))


def chunk_refs(ref: PayloadRef) -> list[PayloadRef]:
    """The refs of a payload's chunks, in order (each without ``more``)."""
    if not ref.more:
        return [ref]
    return [dataclasses.replace(ref, more=[]), *ref.more]


def join_refs(refs: list[PayloadRef]) -> PayloadRef:
    """One ref naming these chunks in order (the inverse of ``chunk_refs``)."""
    assert refs, "a payload has at least one chunk"
    assert not any(r.more for r in refs), "a chunk's ref has no chunks of its own"
    return dataclasses.replace(refs[0], more=list(refs[1:])) if len(refs) > 1 else refs[0]


def digest_of(shas: list[str]) -> str:
    """The digest of a payload whose chunks hash to ``shas`` (in order): the sha256 itself for one
    chunk, else the sha256 of the hex strings concatenated."""
    if len(shas) == 1:
        return shas[0]
    return hashlib.sha256("".join(shas).encode("ascii")).hexdigest()


def ref_digest(ref: PayloadRef) -> str:
    """A payload's digest: ``ref.sha256`` for one chunk, else ``digest_of`` its chunks' sha256s.
    What ``Participant.payload_sha256``, ``theta_digest`` and ``outer_digest`` hold."""
    return digest_of([r.sha256 for r in chunk_refs(ref)])


def ref_size(ref: PayloadRef) -> int:
    """Bytes of every chunk of a payload."""
    return sum(r.size for r in chunk_refs(ref))


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    name: str = field(metadata=_meta(max_len=1024, min_len=1))
    dtype: str = field(metadata=_meta(choices=("F32", "F16", "BF16")))
    shape: list[int] = field(metadata=_meta(min=0, max_len=16))
    # The axis order when it is not the reference (torch's) order, as axis labels ("in,out": a
    # Flax or Keras dense kernel); adapters/layouts.py. Left out of the JSON when "", so the
    # schemas of runs without layouts keep their bytes and digests.
    layout: str = field(default="", metadata=_meta(omit=True, pattern=_LAYOUT))


@dataclass(frozen=True, kw_only=True)
class Manifest(Signed):
    run_id: str = field(metadata=_meta(pattern=_NONCE))
    created_by: str = learner_field()
    schema: list[TensorSpec] = field(metadata=_meta(min_len=1))
    schema_digest: str = sha()
    fragments: list[list[str]] = field(metadata=_meta(min_len=1))
    config: dict[str, Any] = field(default_factory=dict)
    init: list[PayloadRef] = field(default_factory=list)
    owner: str | None = field(default=None, metadata=_meta(pattern=_PUBKEY, omit=True))  # members-only runs


@dataclass(frozen=True, kw_only=True)
class Claim(Signed):
    round: int = nonneg()
    n: int = field(metadata=_meta(min=1, max=999))
    learner: str = learner_field()
    nonce: str = field(metadata=_meta(pattern=_NONCE))


@dataclass(frozen=True, kw_only=True)
class Lease(Signed):
    learner: str = learner_field()
    nonce: str = field(metadata=_meta(pattern=_NONCE))
    seq: int = nonneg()
    local_step: int = nonneg()
    tokens: int = nonneg()
    # The holder's role, as its key names it (``keys.lease_key``); left out of the JSON when
    # "both", so the leases of a node without a role keep the bytes they had before roles.
    role: str = field(default="both", metadata=_meta(choices=ROLES, omit=True))
    # A learner-only node sees no live node that may close rounds: the run waits (for
    # ``gradientmail status``, which reads one look and cannot judge liveness). Left out when False.
    waiting_for_closer: bool = field(default=False, metadata=_meta(omit=True))


@dataclass(frozen=True, kw_only=True)
class Snapshot(Signed):
    learner: str = learner_field()
    round: int = nonneg()
    local_step: int = nonneg()
    steps: int = nonneg()
    tokens: int = nonneg()
    base_version: int = nonneg()
    step_seconds: float = nonneg()
    schema_digest: str = sha()
    payload: PayloadRef = field(metadata=_meta())
    final: bool = False
    nonce: str = field(default="00000000", metadata=_meta(pattern=_NONCE))


@dataclass(frozen=True, kw_only=True)
class Participant:
    learner: str = learner_field()
    weight: float = nonneg()
    steps: int = nonneg()
    tokens: int = nonneg()
    payload_sha256: str = sha()
    final: bool = False


@dataclass(frozen=True, kw_only=True)
class Rejection:
    learner: str = learner_field()
    reason: str = field(metadata=_meta(choices=REJECT_REASONS))


@dataclass(frozen=True, kw_only=True)
class RoundRecord(Signed):
    round: int = nonneg()
    step: int = nonneg()
    fragment: int = nonneg()
    version: int = field(metadata=_meta(min=1))
    closer: str = learner_field()
    participants: list[Participant] = field(metadata=_meta(min_len=1))
    rejected: list[Rejection] = field(default_factory=list)
    theta: PayloadRef | None = None
    theta_digest: str = sha(default="0" * 64)
    outer: PayloadRef | None = None
    change: PayloadRef | None = None
    cosine: float | None = None
    final: bool = False
    live: int = nonneg(default=0)
    quorum_seconds: float = nonneg(default=0.0)
    grace_seconds: float = nonneg(default=0.0)  # realized: from quorum to the close
    grace_planned: float | None = field(default=None, metadata=_meta(min=0))  # the window planned at quorum
    x_step: float | None = field(default=None, metadata=_meta(min=0))
    x_quorum: float | None = field(default=None, metadata=_meta(min=0))
    x_sync: float | None = field(default=None, metadata=_meta(min=0))
    members: str | None = field(default=None, metadata=_meta(pattern=_MEMBERS_REF, omit=True))  # judged under it
    # A commit between checkpoints (``checkpoint_every > 1``; docs/protocol.md, "Checkpoints") has
    # no ``theta`` and no ``outer``; instead: the version of the fragment's checkpoint it builds on,
    # the sha256 of the outer payload it would have written uncompressed, and the payload of each
    # participant (same order), which a recovering closer merges again. Left out when unset, so a
    # checkpoint's record has the bytes it had before.
    checkpoint: int | None = field(default=None, metadata=_meta(min=0, omit=True))
    outer_digest: str | None = field(default=None, metadata=_meta(pattern=_SHA, omit=True))
    contributions: list[PayloadRef] | None = field(default=None, metadata=_meta(min_len=1, max_len=MAX_LIST, omit=True))
    # Under ``max_contributions`` (docs/protocol.md section 12): the ``Roster`` the closer took the
    # round's draw over, by key, sha256 and size (its ids are not inline: the record's size does not
    # grow with the fleet). Left out when unset, so the records of uncapped runs keep their bytes.
    roster: PayloadRef | None = field(default=None, metadata=_meta(omit=True))

    @property
    def is_checkpoint(self) -> bool:
        """Does this record name the full parameters and outer state (else: replayed from ``checkpoint``)?"""
        return self.checkpoint is None


@dataclass(frozen=True, kw_only=True)
class Roster:
    """The learners a capped round's closer took its draw over (``DiLoCo.max_contributions``):
    those whose snapshot records it listed for round ``round`` (or had judged), ascending, less any
    it ignored (signed by no member: in no record). Stored at ``keys.roster_key`` under the sha256 of
    these bytes; the round record's ``roster`` names it. Unsigned: the signed record binds it."""

    round: int = nonneg()
    learners: list[str] = field(metadata=_meta(pattern=_LEARNER, max_len=MAX_ROSTER))
    format: int = FORMAT


@dataclass(frozen=True, kw_only=True)
class MemberEntry:
    """One entry of a members-only run's membership log, ``members/{seq}-{sha256}.json``, signed by
    the run's owner. Entry 0 opens the log; each later one names the sha256 of the entry before it.
    ``add``/``remove`` are public keys (hex); a removed key is never a member again."""

    run_id: str = field(metadata=_meta(pattern=_NONCE))
    seq: int = nonneg()
    prev: str = sha()
    add: list[str] = field(default_factory=list, metadata=_meta(pattern=_PUBKEY, max_len=10_000))
    remove: list[str] = field(default_factory=list, metadata=_meta(pattern=_PUBKEY, max_len=10_000))
    note: str = field(default="", metadata=_meta(max_len=256))
    format: int = FORMAT
    signer: str | None = field(default=None, metadata=_meta(pattern=_PUBKEY, omit=True))
    sig: str | None = field(default=None, metadata=_meta(pattern=_SIG, omit=True))


R = TypeVar("R")

_LIMITS = {Manifest: MAX_MANIFEST_BYTES, Roster: MAX_ROSTER_BYTES}


def to_dict(record: Any) -> dict[str, Any]:
    d = dataclasses.asdict(record)
    _omit(record, d)
    return d


def _omit(record: Any, d: dict[str, Any]) -> None:
    """Leave out of ``d`` (``asdict(record)``) what is left out of the JSON, in nested records too
    (a ``PayloadRef`` without chunks inside a round record keeps the bytes it had)."""
    for f in _omitted_if_default(type(record)):  # type: ignore[arg-type]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if d.get(f.name, default) == default:
            d.pop(f.name, None)
    for f in dataclasses.fields(record):
        value, out = getattr(record, f.name), d.get(f.name)
        if dataclasses.is_dataclass(value):
            _omit(value, out)  # type: ignore[arg-type]
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]) and isinstance(out, list):
            for v, o in zip(value, out, strict=True):
                _omit(v, o)


@functools.cache
def _omitted_if_default(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    """Fields left out of the JSON while they hold their default (``metadata["omit_default"]``)."""
    return tuple(f for f in dataclasses.fields(cls) if f.metadata.get("omit_default"))


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, no NaN: the same object always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode()


def encode(record: Any) -> bytes:
    data = canonical_json(to_dict(record))
    limit = _LIMITS.get(type(record), MAX_RECORD_BYTES)
    assert len(data) <= limit, f"{type(record).__name__} of {len(data)} bytes exceeds {limit}"
    return data


def signing_bytes(record: Any, without: tuple[str, ...] = ("mac",)) -> bytes:
    """Canonical bytes of a record without its ``mac`` field (what an HMAC covers)."""
    d = to_dict(record)
    for name in without:
        d.pop(name, None)
    return canonical_json(d)


def identity_bytes(record: Any) -> bytes:
    """Without ``mac`` and ``sig`` too: what a node's signature covers (``protocol.members``)."""
    return signing_bytes(record, ("mac", "sig"))


def decode(data: bytes | None, cls: type[R], *, key: str = "?") -> R:
    """Parse and validate a record. Raises ``RecordInvalid`` naming the key and the field."""
    if data is None:
        raise RecordInvalid(f"{key}: record is missing")
    limit = _LIMITS.get(cls, MAX_RECORD_BYTES)  # type: ignore[call-overload,arg-type]
    if len(data) > limit:
        raise RecordInvalid(f"{key}: record of {len(data)} bytes exceeds the {limit}-byte cap")
    try:
        raw = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RecordInvalid(f"{key}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise RecordInvalid(f"{key}: expected a JSON object, found {type(raw).__name__}")
    fmt = raw.get("format")
    if fmt != FORMAT:
        raise UnsupportedFormat(
            f"{key}: format version {fmt!r}, this gradientmail reads version {FORMAT}; "
            "upgrade gradientmail on every node of the run"
        )
    return _build(cls, raw, key)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    # Resolving the annotations compiles every one of them; done per decode it was most of a
    # node's CPU time per poll.
    return typing.get_type_hints(cls)


def _build(cls: type[R], raw: Any, where: str) -> R:
    if not isinstance(raw, dict):
        raise RecordInvalid(f"{where}: expected an object for {cls.__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown := set(raw) - set(fields):
        raise RecordInvalid(f"{where}: unknown field(s) {sorted(unknown)[:5]} in {cls.__name__}")
    hints = _type_hints(cls)  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecordInvalid(f"{where}: missing field {name!r} in {cls.__name__}")
            continue
        values[name] = _check(hints[name], raw[name], f.metadata.get("check", {}), f"{where}.{name}")
    if cls is PayloadRef and any(m.more for m in values.get("more", ())):
        raise RecordInvalid(f"{where}.more: a chunk's ref lists chunks of its own")
    return cls(**values)


def _check(tp: Any, v: Any, check: dict[str, Any], where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(inner, v, check, where)
    if tp is bool:
        if not isinstance(v, bool):
            raise RecordInvalid(f"{where}: expected a boolean, found {type(v).__name__}")
        return v
    if tp is int:
        if not isinstance(v, int) or isinstance(v, bool) or not -MAX_INT <= v <= MAX_INT:
            raise RecordInvalid(f"{where}: expected an integer, found {v!r:.40}")
        _range(v, check, where)
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise RecordInvalid(f"{where}: expected a finite number, found {v!r:.40}")
        _range(v, check, where)
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise RecordInvalid(f"{where}: expected a string, found {type(v).__name__}")
        if "pattern" in check and not check["pattern"].fullmatch(v):
            raise RecordInvalid(f"{where}: {v[:80]!r} does not match {check['pattern'].pattern}")
        if "choices" in check and v not in check["choices"]:
            raise RecordInvalid(f"{where}: {v[:80]!r} is not one of {check['choices']}")
        if len(v) > check.get("max_len", 4096) or len(v) < check.get("min_len", 0):
            raise RecordInvalid(f"{where}: string length {len(v)} out of range")
        return v
    if origin is list:
        if not isinstance(v, list):
            raise RecordInvalid(f"{where}: expected a list, found {type(v).__name__}")
        if len(v) > check.get("max_len", MAX_LIST) or len(v) < check.get("min_len", 0):
            raise RecordInvalid(f"{where}: list of length {len(v)} out of range")
        (inner,) = typing.get_args(tp)
        elem_check = {k: c for k, c in check.items() if k in ("min", "max", "pattern", "choices")}
        return [_check(inner, x, elem_check, f"{where}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            raise RecordInvalid(f"{where}: expected an object, found {type(v).__name__}")
        return v
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, where)  # type: ignore[arg-type]
    raise AssertionError(f"unsupported record field type {tp!r}")


def _range(v: float, check: dict[str, Any], where: str) -> None:
    if "min" in check and v < check["min"]:
        raise RecordInvalid(f"{where}: {v} is below the minimum {check['min']}")
    if "max" in check and v > check["max"]:
        raise RecordInvalid(f"{where}: {v} is above the maximum {check['max']}")
