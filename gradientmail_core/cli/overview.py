"""A run at a glance, read from its mailbox: what the ``gradientmail`` command line shows.

Pure reads: nothing here writes, deletes or joins the run, so it is safe to point at a live
run from any machine. Every record goes through the codec's validation; a store that cannot be
reached raises ``MailboxUnavailable``, a run written by another format version ``RecordInvalid``,
and a mailbox without a run ``NoRun``. Given the run's ``auth`` (its secret's MACs, a members-only
run's signatures: ``protocol.members.MemberAuth``), every record read is checked as the nodes check
it; one that fails is no commit (no lease, no claim) and is reported in ``failed`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..codec import quant, safetensors_io
from ..errors import ProtocolError, RecordInvalid, UnsupportedFormat
from ..mailbox import Mailbox
from ..protocol import keys
from ..protocol.records import Claim, Lease, Manifest, RoundRecord, decode
from ..protocol.run import RunInfo
from ..protocol.run import read_manifest as run_manifest
from ..protocol.schedule import fragment_of
from ..protocol.store import RunStore
from ..protocol.tape import newest_claim, read_newest
from ..workqueue.scan import QueueProgress, read_queues

# Bytes per element of the parameter dtypes a schema may hold.
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
# Round records fetched at once: a tape of thousands of rounds on S3 is latency-bound.
_FETCH_THREADS = 8


class NoRun(ProtocolError):
    """The mailbox holds no run (no ``manifest.json``). Check the URL, or start a learner."""


@dataclass(frozen=True)
class SchemaSize:
    tensors: int
    parameters: int
    bytes: int
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class LeaseInfo:
    """A learner holding a lease, as one listing sees it (liveness needs two looks: see ``watch``)."""

    learner: str
    key: str
    seq: int
    local_step: int
    tokens: int
    last_round: int | None  # newest round among those read that this learner contributed to
    in_open_round: bool  # it has published into the round being collected now
    role: str = "both"  # from its lease key: "both", "learner" (never closes) or "syncer" (never trains)
    waiting_for_closer: bool = False  # a learner-only node that sees no live node that may close rounds


@dataclass(frozen=True)
class Failed:
    """A record that fails its check (its MAC or signature, in an authenticated run): ignored."""

    key: str
    reason: str


@dataclass(frozen=True)
class Overview:
    manifest: Manifest
    run: RunInfo
    size: SchemaSize
    rounds_committed: int
    head: int  # newest committed round, -1 before the first commit
    versions: tuple[int, ...]  # per fragment
    recent: list[RoundRecord]  # the last rounds, oldest first
    leases: list[LeaseInfo]
    open_round: int
    open_contributors: list[str]
    open_claim: Claim | None  # the node closing the open round, if it has claimed it
    work: list[QueueProgress] = field(default_factory=list)  # the run's work queues (gm.WorkQueue)
    failed: list[Failed] = field(default_factory=list)  # records read that fail their check: ignored

    @property
    def open_fragment(self) -> int:
        return fragment_of(self.open_round, self.run.P)

    @property
    def waiting_for_closer(self) -> list[str]:
        """Learner-only nodes whose newest lease says they see no live node that may close rounds
        (a single look cannot judge liveness; they can, on their own clocks)."""
        return [le.learner for le in self.leases if le.waiting_for_closer]


def read_manifest(mailbox: Mailbox) -> RunInfo:
    """The run's manifest, validated. ``NoRun`` if there is none."""
    manifest = run_manifest(RunStore(mailbox))
    if manifest is None:
        raise NoRun(f"{keys.MANIFEST} is missing")
    return RunInfo.from_manifest(manifest)


def schema_size(run: RunInfo) -> SchemaSize:
    params = sum(int(np.prod(s.shape, dtype=np.int64)) for s in run.schema)
    nbytes = sum(int(np.prod(s.shape, dtype=np.int64)) * _ITEMSIZE[s.dtype] for s in run.schema)
    return SchemaSize(len(run.schema), params, nbytes, tuple(sorted({s.dtype for s in run.schema})))


def round_numbers(mailbox: Mailbox, start: int = 0) -> list[int]:
    """Committed rounds ``>= start``, in order (the tape is never garbage-collected)."""
    after = keys.round_key(start - 1) if start > 0 else ""
    listed = mailbox.list(keys.ROUNDS, after=after)
    return [r for k in listed if (r := keys.parse_round_key(k)) is not None]


def read_records(
    mailbox: Mailbox, rounds: list[int], *, auth: Any = None, failed: list[Failed] | None = None
) -> list[RoundRecord]:
    """The records of ``rounds``, in that order (fetched concurrently). With ``auth`` each is
    checked in round order (a members-only run's membership rules depend on it); one that fails, or
    does not decode (damaged in the store), is left out and added to ``failed`` with what to do
    (without ``failed``: raised, ``RecordInvalid``)."""

    def fetch(r: int) -> bytes | None:
        return mailbox.get(keys.round_key(r))

    if len(rounds) <= 2:
        blobs = [fetch(r) for r in rounds]
    else:
        with ThreadPoolExecutor(_FETCH_THREADS) as pool:
            blobs = list(pool.map(fetch, rounds))
    out = []
    for r, data in zip(rounds, blobs, strict=True):
        key = keys.round_key(r)
        try:
            rec = decode(data, RoundRecord, key=key)
        except UnsupportedFormat:
            raise  # (written by a newer gradientmail: upgrading is the remedy, as the error says)
        except RecordInvalid as e:
            if failed is None:
                raise
            failed.append(Failed(key, f"{e}; {damaged_remedy(r, r < rounds[-1])}"))
            continue
        try:
            if auth is not None:
                auth.verify(rec, key)
        except RecordInvalid as e:
            if failed is None:
                raise
            failed.append(Failed(key, str(e)))
            continue
        out.append(rec)
    return out


def damaged_remedy(r: int, built_on: bool) -> str:
    """What to do about round ``r``'s record on the tape that does not decode (``built_on``: later
    rounds are committed after it)."""
    fix = "if its closer still runs it writes the record again within a round timeout; else "
    if built_on:
        return (
            fix + "restore the object from a copy of the bucket (later rounds build on it: it cannot be closed again)"
        )
    return fix + (
        f"restore the object from a copy of the bucket, or delete {keys.round_key(r)} so that round {r} is closed again from "
        "its contributions (no round builds on it yet), then restart the nodes that stopped"
    )


def iter_records(
    mailbox: Mailbox, start: int = 0, *, batch: int = 256, auth: Any = None, failed: list[Failed] | None = None
) -> Iterator[RoundRecord]:
    """Every committed record from round ``start`` on, oldest first (``auth``, ``failed``: as
    ``read_records``)."""
    rounds = round_numbers(mailbox, start)
    for i in range(0, len(rounds), batch):
        yield from read_records(mailbox, rounds[i : i + batch], auth=auth, failed=failed)


def read_leases(
    mailbox: Mailbox, *, auth: Any = None, failed: list[Failed] | None = None
) -> dict[str, tuple[str, Lease | None]]:
    """``{learner: (newest lease key, its record or None if unreadable)}``; a lease that fails
    ``auth``'s check is unreadable, and added to ``failed``."""
    newest: dict[str, str] = {}
    for k in mailbox.list(keys.LEASES):
        parsed = keys.parse_lease_key(k)
        if parsed is not None:
            newest[parsed[0]] = k  # listed in byte order: the last key of a learner is its newest
    out: dict[str, tuple[str, Lease | None]] = {}
    for learner, k in sorted(newest.items()):
        data = mailbox.get(k)
        if data is None:
            continue  # renewed (or released) between the listing and the read
        try:
            lease = decode(data, Lease, key=k)
        except RecordInvalid:
            out[learner] = (k, None)
            continue
        try:
            if auth is not None:
                auth.verify(lease, k)
        except RecordInvalid as e:
            out[learner] = (k, None)
            if failed is not None:
                failed.append(Failed(k, str(e)))
            continue
        out[learner] = (k, lease)
    return out


def read_overview(mailbox: Mailbox, *, last: int = 8, auth: Any = None) -> Overview:
    """Everything ``gradientmail status`` shows, from one pass over the mailbox (``auth``: the
    run's, to check every record read; those that fail are in ``failed``)."""
    run = read_manifest(mailbox)
    rounds = round_numbers(mailbox)
    head = rounds[-1] if rounds else -1
    failed: list[Failed] = []
    recent = read_records(mailbox, rounds[-max(last, run.P) :], auth=auth, failed=failed)
    versions = [0] * run.P
    for rec in recent:
        versions[rec.fragment] = max(versions[rec.fragment], rec.version)
    open_round = head + 1
    contributors = sorted(
        parsed[1]
        for k in mailbox.list(keys.snapshots_prefix(open_round))
        if (parsed := keys.parse_snapshot_key(k)) is not None
    )
    last_round: dict[str, int] = {}
    for rec in recent:
        for p in rec.participants:
            last_round[p.learner] = rec.round
    leases = [
        LeaseInfo(
            learner=learner,
            key=k,
            seq=lease.seq if lease else -1,
            local_step=lease.local_step if lease else 0,
            tokens=lease.tokens if lease else 0,
            last_round=last_round.get(learner),
            in_open_round=learner in contributors,
            role=keys.lease_role(k) or "both",
            waiting_for_closer=bool(lease and lease.waiting_for_closer),
        )
        for learner, (k, lease) in read_leases(mailbox, auth=auth, failed=failed).items()
    ]
    return Overview(
        manifest=run.manifest,
        run=run,
        size=schema_size(run),
        rounds_committed=len(rounds),
        head=head,
        versions=tuple(versions),
        recent=recent[-last:] if last > 0 else [],
        leases=leases,
        open_round=open_round,
        open_contributors=contributors,
        open_claim=newest_claim(
            RunStore(mailbox, auth=auth, on_ignored=lambda k, why: failed.append(Failed(k, why))), open_round
        ),
        work=read_queues(mailbox),
        failed=failed,
    )


def newest_parameters(
    mailbox: Mailbox, *, attempts: int = 3, auth: Any = None, failed: list[Failed] | None = None
) -> tuple[RunInfo, int, dict[str, np.ndarray]]:
    """The newest committed parameters of every fragment (float32), as ``gm.align`` loads them.

    Returns ``(run, head, {name: array})``. A commit landing between the listing and the reads
    can prune the payload just listed; the listing is then simply taken again. With ``auth``, a
    record that fails its check is no commit: skipped, and added to ``failed``.
    """
    run = read_manifest(mailbox)

    def ignored(key: str, why: str) -> None:
        if failed is not None and keys.parse_round_key(key) is not None:
            failed.append(Failed(key, why))

    recs, thetas = read_newest(RunStore(mailbox, auth=auth, on_ignored=ignored), run, attempts=attempts)
    head = max((r.round for r in recs.values()), default=-1)
    values = {n: v for theta in thetas.values() for n, v in theta.items()}
    return run, head, {s.name: values[s.name] for s in run.schema}


def export_safetensors(mailbox: Mailbox, *, auth: Any = None, failed: list[Failed] | None = None) -> tuple[int, bytes]:
    """The newest committed parameters as one safetensors file, each tensor in its own dtype.

    Returns ``(head round, file bytes)``; ``safetensors.torch.load_file`` loads the file.
    """
    run, head, values = newest_parameters(mailbox, auth=auth, failed=failed)
    tensors = {}
    for s in run.schema:
        q = quant.quantize(values[s.name], s.dtype)
        tensors[s.name] = (q.storage_dtype, tuple(s.shape), q.data)
    meta = {"gradientmail.run_id": run.manifest.run_id, "gradientmail.round": str(head)}
    return head, safetensors_io.write(tensors, meta)
