"""What a run asks of its store: requests by kind, bytes up and down, bytes stored, per round and
per day. A model of the protocol (``docs/protocol.md``), not a measurement; ``bench/fleet.py``
counts the same quantities on a simulated store and ``tests/test_bill.py`` holds the two together
at small scale.

Requests are counted as a store bills them (HTTP requests), not as mailbox calls: a listing is one
request per page of ``LIST_PAGE`` keys, an object above the multipart threshold is
``2 + ceil(size / part)`` PUTs (create, parts, complete), a payload read is one ranged GET per part.

Per round ``r`` (``round_seconds = sync_every / fragments * step_seconds``), **each learner**:

- polls ``round_seconds / poll_interval`` times, plus once when its contribution is ready: one
  LIST of everything after the head's record (step 6), whose answer holds every snapshot record
  still stored, those of the open round and those the verify window keeps
  (``N * (verify_window + 1)`` keys);
- lists the leases every ``min(lease_timeout / 4, 5 * poll_interval)`` (``N`` keys) and the
  claims of the open round once;
- writes its contribution (one object per chunk, section 10) and its snapshot record;
- reads the claim, the round record (which lists every participant) and the commit: the quantized
  change (``commit_dtype``) or the full parameters;
- renews its lease every ``lease_timeout / 4`` (a PUT and a DELETE).

**The closer**, besides: reads every other contribution (record and chunks), writes the change and,
at a checkpoint (one version in ``checkpoint_every``), the parameters and the fp32 outer state
(momentum, and the master unless the parameters are F32 with no ``commit_dtype``), the claim of
``r + 1`` and the record; lists ``blobs/snapshots/``, ``claims/`` and ``blobs/rounds/`` for garbage
collection and deletes in batches of 1,000 keys.

The sizes of records (``*_RECORD``) were measured on ``bench/fleet.py``'s runs; a listing's answer
is counted at ``LIST_BYTES_PER_KEY`` (an S3 ``ListObjectsV2`` entry: key, date, ETag, size, class).
Not modelled: takeovers, retries, joins, ``verify``, authenticated runs' tags and signatures.

**With** ``DiLoCo.max_contributions = K`` (``docs/protocol.md``, "A fleet of any size"), the same,
except:

- the closer still polls the open round's snapshot records (``N`` keys a listing, not the verify
  window's) and lists the leases as above, but reads (record and chunks) only the ``K`` reported
  contributions with the lowest draw: ``min(K, N - 1)`` others' a round (an upper bound: when
  the draw picks the closer's own, it reads ``K - 1``; ``K (N - 1) / N`` on average);
- the round record lists at most ``K`` participants (its size, and the tape's growth, bounded by
  ``K``) and names the round's roster (``ROUND_RECORD_ROSTER``);
- the closer writes that roster, the ids its draw was taken over (one PUT of ``ROSTER`` plus
  ``ROSTER_PER_LEARNER`` bytes a learner), and GC lists ``blobs/rosters/`` (the verify window's,
  one page) and deletes one; the store holds the window's ``verify_window`` rosters;
- every other learner (a follower: the model's steady state, the run past its first commit) polls
  with one LIST of ``rounds/`` after the head's record (``FOLLOWER_POLL_KEYS``: one page) and, at
  the lease-listing cadence, lists only the claimant's leases (``CLAIMANT_LEASE_KEYS``) instead of
  all of ``leases/``; it still lists the open round's claims, reads the claim, the round record and
  the commit, writes its contribution and snapshot record and renews its lease.

Every learner still writes its contribution each round, so the PUTs (but the roster's), the bytes
up, what the store holds and the garbage collection (which lists every snapshot payload) do not
change with ``K``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..codec import header, safetensors_io
from ..config import DiLoCo

DAY = 86_400.0
LIST_PAGE = 1000  # keys per ListObjectsV2 page (S3, R2)
DELETE_BATCH = 1000  # keys per DeleteObjects request
PART = 8 << 20  # multipart part and ranged-read size (mailbox.multipart.DEFAULT_PART_SIZE)
STREAM_BYTES = 64 << 20  # payload bytes from here on are streamed (protocol.store.STREAM_BYTES)
# Record sizes in bytes, measured on bench/fleet.py's store (engine 84e6264, an unauthenticated run,
# 4 and 16 learners: round records of 1,467 and 3,356 bytes). Between checkpoints a round record
# also lists every participant's payload ref (section 9): not counted here.
SNAPSHOT_RECORD = 470
CLAIM_RECORD = 76
LEASE_RECORD = 94
ROUND_RECORD = 840  # without participants
ROUND_RECORD_PER_PARTICIPANT = 157
LIST_BYTES_PER_KEY = 250
# With max_contributions: the roster's ref in the round record (a size of four digits), and the
# roster, ``{"format":1,"learners":[...],"round":r}``: bench/fleet.py's ids of five characters,
# quoted, and a comma (longer ids cost more).
ROUND_RECORD_ROSTER = 202
ROSTER = 37
ROSTER_PER_LEARNER = 8
# With max_contributions, a follower's keys per listing: the round records after its head (at most
# about one a round: one page whatever the poll rate) and the claimant's lease (the renewal writes
# the new one before it deletes the old: 1-2 keys).
FOLLOWER_POLL_KEYS = 1
CLAIMANT_LEASE_KEYS = 2
KINDS = ("PUT", "GET", "LIST", "HEAD", "DELETE")  # HEAD: the protocol sends none (the mailbox has no HEAD)


def payload_bytes(elements: int, dtype: str) -> int:
    """Stored bytes of ``elements`` values of ``dtype`` (the codec's layout: F4/I2 with their
    scales), without the safetensors header."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "U8": 1}
    return sum(safetensors_io.numel(s) * sizes[d] for _, d, s in header.storage_layout((elements,), dtype))


def put_requests(size: int, threshold: int = PART) -> int:
    """PUT-class requests to write one object: one up to the multipart threshold, else create,
    parts and complete. (Payloads below ``STREAM_BYTES`` handed over whole are one PUT.)"""
    return 1 if size <= threshold else 2 + math.ceil(size / PART)


def get_requests(size: int) -> int:
    """GETs to read one object: one ranged GET per part."""
    return max(1, math.ceil(size / PART))


def pages(keys: float) -> float:
    return max(1.0, math.ceil(keys / LIST_PAGE))


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """A run as far as its store sees it."""

    cfg: DiLoCo
    params: int  # parameters of the model
    learners: int
    step_seconds: float
    poll_interval: float = 1.0
    lease_timeout: float = 120.0
    param_dtype: str = "BF16"  # the published parameters' dtype (the init payloads, theta)
    multipart_threshold: int = PART  # S3Mailbox's (the hf profile: 2 GB)

    def __post_init__(self) -> None:
        if not isinstance(self.params, int) or self.params < self.cfg.fragments:
            raise ValueError(f"RunShape(params={self.params!r}): expected an integer >= fragments")
        if not isinstance(self.learners, int) or self.learners < 1:
            raise ValueError(f"RunShape(learners={self.learners!r}): expected an integer >= 1")
        for name in ("step_seconds", "poll_interval", "lease_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RunShape({name}={getattr(self, name)!r}): expected a number > 0")
        if self.param_dtype not in ("F32", "F16", "BF16"):
            raise ValueError(f"RunShape(param_dtype={self.param_dtype!r}): expected F32, F16 or BF16")

    @property
    def capped(self) -> bool:
        """Whether the run merges at most ``max_contributions`` a round (the bounded protocol)."""
        return self.cfg.max_contributions is not None

    @property
    def participants(self) -> int:
        """Participants a round record lists: every learner, or at most ``max_contributions``."""
        k = self.cfg.max_contributions
        return self.learners if k is None else min(k, self.learners)

    @property
    def merged_others(self) -> int:
        """Other learners' contributions the closer reads a round."""
        k = self.cfg.max_contributions
        return self.learners - 1 if k is None else min(k, self.learners - 1)

    @property
    def round_record(self) -> int:
        """Bytes of a round record."""
        roster = ROUND_RECORD_ROSTER if self.capped else 0
        return ROUND_RECORD + ROUND_RECORD_PER_PARTICIPANT * self.participants + roster

    @property
    def roster(self) -> int:
        """Bytes of a capped round's roster (every learner reported); 0 uncapped."""
        return ROSTER + ROSTER_PER_LEARNER * self.learners if self.capped else 0

    @property
    def round_seconds(self) -> float:
        return self.cfg.sync_every / self.cfg.fragments * self.step_seconds

    @property
    def rounds_per_day(self) -> float:
        return DAY / self.round_seconds

    @property
    def chunks(self) -> int:
        """Objects per payload of one fragment (section 10)."""
        c = self.cfg.chunk_elements
        return 1 if c is None else math.ceil(self.fragment_elements / c)

    @property
    def fragment_elements(self) -> int:
        return math.ceil(self.params / self.cfg.fragments)

    def chunk_bytes(self, dtype: str) -> list[int]:
        """The stored size of each chunk of one fragment's payload in ``dtype``."""
        n, c = self.fragment_elements, self.cfg.chunk_elements or self.fragment_elements
        return [payload_bytes(min(c, n - i), dtype) for i in range(0, n, c)]


@dataclass
class Traffic:
    """Requests by kind and bytes, for one node over one round (or a whole run over a day)."""

    requests: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    list_calls: float = 0.0  # LIST calls as the mailbox counts them (one per listing, all pages)
    up: float = 0.0
    down: float = 0.0
    list_down: float = 0.0  # of ``down``, the bytes of listings' answers

    def add(self, kind: str, n: float, *, up: float = 0.0, down: float = 0.0) -> None:
        self.requests[kind] += n
        self.up += up
        self.down += down

    def scaled(self, k: float) -> Traffic:
        r = {kk: v * k for kk, v in self.requests.items()}
        return Traffic(r, self.list_calls * k, self.up * k, self.down * k, self.list_down * k)

    def plus(self, other: Traffic) -> Traffic:
        r = {k: self.requests[k] + other.requests[k] for k in KINDS}
        return Traffic(
            r,
            self.list_calls + other.list_calls,
            self.up + other.up,
            self.down + other.down,
            self.list_down + other.list_down,
        )


def _list(t: Traffic, calls: float, keys: float) -> None:
    t.list_calls += calls
    answer = calls * max(keys, 1) * LIST_BYTES_PER_KEY
    t.list_down += answer
    t.add("LIST", calls * pages(keys), down=answer)


def _objects(t: Traffic, kind: str, sizes: list[int], *, threshold: int, share: float = 1.0) -> None:
    """Write (PUT) or read (GET) one payload of chunks ``sizes``, ``share`` of the times."""
    for s in sizes:
        if kind == "PUT":
            t.add("PUT", share * put_requests(s, threshold), up=share * s)
        else:
            t.add("GET", share * get_requests(s), down=share * s)


def learner_round(shape: RunShape) -> Traffic:
    """What one learner that does not close asks per round (with ``max_contributions``: a follower)."""
    if shape.capped:
        return _node_round(shape, FOLLOWER_POLL_KEYS, CLAIMANT_LEASE_KEYS)
    return _node_round(shape, shape.learners * (shape.cfg.verify_window + 1), shape.learners)


def _node_round(shape: RunShape, poll_keys: float, lease_keys: float) -> Traffic:
    """A learner's round whose polls list ``poll_keys`` keys and whose lease listings ``lease_keys``."""
    cfg, rs = shape.cfg, shape.round_seconds
    t = Traffic()
    polls = rs / shape.poll_interval + 1  # (+1: the poll woken by its ready contribution)
    _list(t, polls, poll_keys)
    _list(t, rs / min(shape.lease_timeout / 4, 5 * shape.poll_interval), lease_keys)
    _list(t, 1, 1)  # the open round's claims
    delta = cfg.delta_dtype or shape.param_dtype
    _objects(t, "PUT", shape.chunk_bytes(delta), threshold=shape.multipart_threshold)
    t.add("PUT", 1, up=SNAPSHOT_RECORD)
    t.add("GET", 1, down=CLAIM_RECORD)
    t.add("GET", 1, down=shape.round_record)
    _objects(t, "GET", shape.chunk_bytes(cfg.commit_dtype or shape.param_dtype), threshold=0)
    renewals = rs / (shape.lease_timeout / 4)
    t.add("PUT", renewals, up=renewals * LEASE_RECORD)
    t.add("DELETE", renewals)
    return t


def closer_round(shape: RunShape) -> Traffic:
    """What the closer asks per round: a learner's round, less what it need not read (its own
    commit, the claim), plus judging every other contribution (with ``max_contributions``: the
    drawn ones), the commit and GC."""
    cfg, n, thr = shape.cfg, shape.learners, shape.multipart_threshold
    # With max_contributions the closer still polls the open round's snapshot records (not the
    # verify window's) and lists every lease.
    t = _node_round(shape, n, n) if shape.capped else learner_round(shape)
    t.add("GET", -1, down=-CLAIM_RECORD)
    t.add("GET", -1, down=-shape.round_record)
    commit = shape.chunk_bytes(cfg.commit_dtype or shape.param_dtype)
    t.add("GET", -sum(get_requests(s) for s in commit), down=-sum(commit))
    delta = shape.chunk_bytes(cfg.delta_dtype or shape.param_dtype)
    others = shape.merged_others
    t.add("GET", others, down=others * SNAPSHOT_RECORD)
    _objects(t, "GET", delta, threshold=0, share=others)
    every = cfg.checkpoint_every
    if cfg.commit_dtype is not None:
        _objects(t, "PUT", commit, threshold=thr)
    _objects(t, "PUT", shape.chunk_bytes(shape.param_dtype), threshold=thr, share=1 / every)
    master = shape.param_dtype != "F32" or cfg.commit_dtype is not None
    outer = [s * (2 if master else 1) for s in shape.chunk_bytes("F32")]
    _objects(t, "PUT", outer, threshold=thr, share=1 / every)
    t.add("PUT", 2, up=CLAIM_RECORD + shape.round_record)
    t.add("GET", 1, down=shape.round_record)  # its record read back (a damaged one is written again)
    kept = _kept_contribution_rounds(cfg)
    _list(t, 1, n * shape.chunks * kept)  # blobs/snapshots/
    _list(t, 1, 1)  # claims/
    _list(t, 1, 2 * cfg.fragments * shape.chunks * 3)  # blobs/rounds/ (theta, outer, change per round)
    doomed = n * (1 + shape.chunks) + 1 + 3 * shape.chunks / every
    if shape.capped:  # the roster, written before the record; GC lists the window's and deletes one
        t.add("PUT", 1, up=shape.roster)
        _list(t, 1, cfg.verify_window + 1)
        doomed += 1
    t.add("DELETE", math.ceil(doomed / DELETE_BATCH))
    return t


def _kept_contribution_rounds(cfg: DiLoCo) -> float:
    """Rounds of contributions the store holds on average: the open one, the verify window's, and
    between checkpoints the chain since its fragment's newest checkpoint (section 9; on average
    half of ``checkpoint_every - 1`` versions of each fragment, a version every ``P`` rounds)."""
    chain = cfg.fragments * (cfg.checkpoint_every - 1) / 2
    return 1 + max(cfg.verify_window, chain)


@dataclass(frozen=True)
class Day:
    """A whole run over one day."""

    traffic: Traffic
    stored: float  # bytes held on average
    tape_growth: float  # bytes of round records added (never deleted)
    rounds: float
    learner: Traffic  # one learner, per round
    closer: Traffic  # the closer, per round


def day(shape: RunShape) -> Day:
    cfg, n = shape.cfg, shape.learners
    learner, closer = learner_round(shape), closer_round(shape)
    per_round = learner.scaled(n - 1).plus(closer)
    rounds = shape.rounds_per_day
    contribution = sum(shape.chunk_bytes(cfg.delta_dtype or shape.param_dtype))
    theta = sum(shape.chunk_bytes(shape.param_dtype))
    master = shape.param_dtype != "F32" or cfg.commit_dtype is not None
    outer = sum(shape.chunk_bytes("F32")) * (2 if master else 1)
    change = sum(shape.chunk_bytes(cfg.commit_dtype)) if cfg.commit_dtype else 0
    every = cfg.checkpoint_every
    record = shape.round_record
    stored = (
        n * contribution * _kept_contribution_rounds(cfg)
        + cfg.fragments * theta  # the initial parameters
        + cfg.fragments * (theta + outer)  # every fragment's newest checkpoint
        + 2 * cfg.fragments * (change + (theta + outer) / every)  # round payloads kept 2P rounds
        + rounds * record / 2  # the tape, over the day
        + cfg.verify_window * shape.roster  # the window's rosters (capped runs)
    )
    return Day(per_round.scaled(rounds), stored, rounds * record, rounds, learner, closer)
