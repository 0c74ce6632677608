"""A mailbox that injects faults: a real backend wrapper (never a mock) for the simulation, the
tests and chaos drills. It knows the protocol's keys (a rule may target a round), and it is a
development tool, not part of the product, so it lives beside the simulation, outside the wheel.

``FaultyMailbox(inner, rules, rng=..., node=..., clock=...)`` forwards the four operations (and
the ranged read ``get_prefix``, which is a GET to the rules) to ``inner`` and, driven by a seeded
``random.Random``, applies the first matching rules:

- ``error``: a transient store error (``MailboxUnavailable``, worded like a 503 or 409). At
  ``phase="before"`` the request is never sent; at ``"landed"`` (or ``"replied"``) the operation
  is applied and then the error is raised: a *lost acknowledgement*, so the caller does not know
  that its create-once write exists.
- ``retry_412``: a put lands, its reply is lost and the client's retry is answered "exists"
  (412): ``put_if_absent`` returns False for the caller's own write.
- ``crash``: raises ``InjectedCrash`` (a ``BaseException``, so no ``except Exception`` in the
  engine can swallow it): the process dies. ``"before"``: the request was never sent;
  ``"landed"``: it was applied, the reply never read; ``"replied"``: the call returns its reply
  normally and the crash hits on the next call (``pending_crash`` tells a driver that the
  process died after its last reply even if it made no further call).
- ``latency``: sleeps ``seconds`` on the injected clock before the request.
- ``flip``: a ``get`` of a payload (``blobs/``) returns the bytes with one bit flipped; readers
  must catch it by the sha256 in the reference.

Streams (``put_stream``, ``get_stream``) are a PUT and a GET to the rules. A rule with ``part=k``
fires inside the stream, at its chunk ``k`` (0-based): an ``error`` or ``crash`` is raised when
that chunk is taken from the writer's chunks (a part upload that fails: the backend must leave
nothing half-written) or instead of yielding it to the reader (a connection reset mid-download),
and a ``flip`` flips a bit of that chunk (without ``part``, of the first chunk). Rules without
``part`` fire around the call as usual; on a whole ``get`` or ``put_if_absent`` a rule's ``part``
is ignored (the object is one part). ``retry_412`` and the tracking of uncertain create-once
writes (``uncertain``) apply to ``put_if_absent`` only: a stream's bytes are not kept to compare.

Listings can be paginated (``page_size``): each page is a separate request (``list(prefix,
after=cursor)`` on the inner store) that may itself fail or be slow, as S3's are. Listings are
never stale: the contract promises list-after-write consistency.

Rules are matched by node, operation, key prefix and round (parsed from the key). Every
injected fault is logged (``log``, ``counts``); the outcome of create-once writes the caller
could not be sure of is tracked until the caller reads the key back (``resolved``).
"""

from __future__ import annotations

import builtins
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from gradientmail_core.clock import Clock
from gradientmail_core.errors import MailboxUnavailable
from gradientmail_core.mailbox.contract import Chunk, Mailbox, close_stream
from gradientmail_core.mailbox.forwarding import ForwardingMailbox
from gradientmail_core.protocol import keys

Op = Literal["put", "get", "list", "delete"]
Kind = Literal["error", "retry_412", "crash", "latency", "flip"]
Phase = Literal["before", "landed", "replied"]
OPS: tuple[Op, ...] = ("put", "get", "list", "delete")
KINDS: tuple[Kind, ...] = ("error", "retry_412", "crash", "latency", "flip")
PHASES: tuple[Phase, ...] = ("before", "landed", "replied")


class InjectedCrash(BaseException):
    """The process dies here (injected). Drop all in-memory state of the node that raised it."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One rule. Matches a call when every given selector matches; then fires with
    ``probability`` (after letting ``skip`` matching calls through, at most ``times`` times)."""

    kind: Kind
    ops: tuple[Op, ...] | None = None  # None: every operation
    prefix: str = ""  # key (or listing prefix) starts with this
    node: str | None = None
    rounds: tuple[int, int] | None = None  # inclusive range of the round named by the key
    phase: Phase = "before"
    probability: float = 1.0
    skip: int = 0
    times: int | None = None
    seconds: float = 0.0  # latency
    part: int | None = None  # streams: fire at this chunk (0-based) instead of around the call
    message: str = "HTTP 503 SlowDown (injected)"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Fault(kind={self.kind!r}): expected one of {KINDS}")
        if self.phase not in PHASES:
            raise ValueError(f"Fault(phase={self.phase!r}): expected one of {PHASES}")
        if self.ops is not None and not set(self.ops) <= set(OPS):
            raise ValueError(f"Fault(ops={self.ops!r}): expected a tuple of {OPS}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"Fault(probability={self.probability!r}): expected a number in [0, 1]")
        if self.kind == "retry_412" and self.ops not in (None, ("put",)):
            raise ValueError("Fault(kind='retry_412') applies to puts only")
        if self.kind == "flip" and self.ops not in (None, ("get",)):
            raise ValueError("Fault(kind='flip') applies to gets only")
        if self.part is not None and (self.part < 0 or self.kind not in ("error", "crash", "flip")):
            raise ValueError(f"Fault(part={self.part!r}): expected an index >= 0 on an error, crash or flip")


@dataclass(frozen=True)
class FaultEvent:
    seq: int
    node: str
    op: Op
    key: str
    kind: Kind
    phase: Phase

    def describe(self) -> str:
        return f"fault #{self.seq} [{self.node}] {self.kind}/{self.phase} {self.op} {self.key}"


def round_of(key: str) -> int | None:
    """The round a key belongs to (claims, rounds, snapshots and their payloads), else None."""
    if (r := keys.parse_round_key(key)) is not None:
        return r
    for parse in (keys.parse_claim_key, keys.parse_snapshot_key):
        parsed = parse(key)
        if parsed is not None:
            return parsed[0]
    b = keys.parse_blob_key(key)
    return b.round if b is not None else None


def key_class(key: str) -> str:
    """A coarse name for where a key lives, for counters: 'rounds', 'blobs/rounds', ..."""
    if key.startswith(keys.BLOBS):
        return "/".join(key.split("/")[:2])
    return key.split("/", 1)[0] if "/" in key else key


@dataclass
class _RuleState:
    matched: int = 0
    fired: int = 0


@dataclass
class FaultLog:
    """Everything injected, shared by the wrappers of one simulation (or one per wrapper)."""

    events: list[FaultEvent] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)  # "kind/phase" and "kind/phase/op/keyclass"
    resolved: Counter[str] = field(default_factory=Counter)  # "ours|theirs|absent/keyclass"
    keep_events: bool = True

    def add(self, ev: FaultEvent) -> None:
        if self.keep_events:
            self.events.append(ev)
        self.counts[f"{ev.kind}/{ev.phase}"] += 1
        self.counts[f"{ev.kind}/{ev.phase}/{ev.op}/{key_class(ev.key)}"] += 1


class FaultyMailbox(ForwardingMailbox):
    """Wraps ``inner`` and injects the faults its ``rules`` describe (see the module doc)."""

    def __init__(
        self,
        inner: Mailbox,
        rules: Iterable[Fault] = (),
        *,
        rng: random.Random,
        node: str = "",
        clock: Clock | None = None,
        page_size: int | None = None,
        log: FaultLog | None = None,
    ) -> None:
        if page_size is not None and page_size < 1:
            raise ValueError(f"page_size={page_size!r}: expected None or an integer >= 1")
        super().__init__(inner)
        self.rng, self.node, self.clock, self.page_size = rng, node, clock, page_size
        self.rules: builtins.list[Fault] = builtins.list(rules)
        self._state: dict[int, _RuleState] = {}
        self.log = log if log is not None else FaultLog()
        self.enabled = True
        self.pending_crash: FaultEvent | None = None
        self.calls = 0
        # Create-once writes whose outcome the caller could not know, until it reads them back.
        self.uncertain: dict[str, bytes] = {}
        self.tap: Callable[[Op, str], None] | None = None

    # ---- scripting ----------------------------------------------------------------------

    def add(self, rule: Fault) -> Fault:
        self.rules.append(rule)
        return rule

    def remove(self, rule: Fault) -> None:
        for i, r in enumerate(self.rules):
            if r is rule:
                del self.rules[i]
                self._state.pop(id(rule), None)
                return

    def clear(self) -> None:
        self.rules.clear()
        self._state.clear()

    def arm_crash(
        self, *, after_calls: int = 0, phase: Phase = "before", ops: tuple[Op, ...] | None = None, prefix: str = ""
    ) -> Fault:
        """Crash at the ``after_calls``-th next matching call (0: the very next one)."""
        return self.add(
            Fault(kind="crash", ops=ops, prefix=prefix, node=self.node, phase=phase, skip=after_calls, times=1)
        )

    # ---- the four operations ------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes) -> bool:
        data = bytes(data)
        self._tap("put", key)
        fired = self._enter("put", key)
        retry = self._take(fired, "retry_412")
        try:
            self._before("put", key, fired)
        except MailboxUnavailable:
            self.uncertain[key] = data
            raise
        created = self.inner.put_if_absent(key, data)
        if retry is not None and created:
            self._record(retry, "put", key)
            self.uncertain[key] = data
            return False
        try:
            self._after("put", key, fired)
        except (MailboxUnavailable, InjectedCrash):
            self.uncertain[key] = data
            raise
        if created:
            self.uncertain.pop(key, None)
        return created

    def get(self, key: str) -> bytes | None:
        return self._read(key, None)

    def get_prefix(self, key: str, n: int) -> bytes | None:
        """A ranged read is a GET to the rules: every rule on ``"get"`` applies to it, flips included."""
        return self._read(key, n)

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        """A PUT to the rules; those with ``part`` fail the stream at that chunk."""
        self._tap("put", key)
        fired = self._enter("put", key)
        around = [f for f in fired if f.part is None]
        self._before("put", key, around)
        parts = [f for f in fired if f.part is not None and f.kind != "flip"]
        written = super().put_stream(key, self._parts("put", key, chunks, parts), create_once=create_once)
        self._after("put", key, around)
        return written

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        """A GET to the rules; those with ``part`` (and flips) act on the chunks as they pass."""
        self._tap("get", key)
        fired = self._enter("get", key)
        around = [f for f in fired if f.part is None and f.kind != "flip"]
        self._before("get", key, around)
        stream = super().get_stream(key, part_size=part_size)
        self._after("get", key, around)
        parts = [f for f in fired if f.part is not None or f.kind == "flip"]
        if stream is None or not parts:
            return stream
        return self._parts("get", key, stream, parts)

    def _parts(self, op: Op, key: str, chunks: Iterable[Chunk], rules: builtins.list[Fault]) -> Iterator[Chunk]:
        """``chunks``, with each rule of ``rules`` applied at its chunk (a flip without ``part``: the first)."""
        it = iter(chunks)
        try:
            for i, chunk in enumerate(it):
                for rule in rules:
                    if (rule.part or 0) != i:
                        continue
                    ev = self._record(rule, op, key)
                    if rule.kind == "crash":
                        raise InjectedCrash(ev.describe())
                    if rule.kind == "error":
                        raise MailboxUnavailable(f"{op.upper()} {key} (part {i}): {rule.message}")
                    if rule.kind == "flip" and len(chunk) and key.startswith(keys.BLOBS):
                        b = bytearray(chunk)
                        bit = self.rng.randrange(len(b) * 8)
                        b[bit // 8] ^= 1 << (bit % 8)
                        chunk = b
                yield chunk
        finally:
            close_stream(it)

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        self._tap("list", prefix)
        if self.page_size is None:
            fired = self._enter("list", prefix)
            self._before("list", prefix, fired)
            listed = self.inner.list(prefix, after)
            self._after("list", prefix, fired)
            return listed
        out: builtins.list[str] = []
        cursor = after
        while True:  # one request per page, each of which may fail or be slow
            fired = self._enter("list", prefix)
            self._before("list", prefix, fired)
            page = self.inner.list(prefix, cursor)[: self.page_size]
            self._after("list", prefix, fired)
            out += page
            if len(page) < self.page_size:
                if len(out) >= self.page_size:
                    self.log.counts["paginated_lists"] += 1
                return out
            cursor = page[-1]

    def delete(self, keys: Iterable[str]) -> None:
        todo = builtins.list(keys) if not isinstance(keys, str) else keys
        # Rules match the smallest key: callers may build the batch from a set, in any order.
        first = min(todo) if todo and not isinstance(todo, str) else ""
        self._tap("delete", first)
        fired = self._enter("delete", first)
        self._before("delete", first, fired)
        self.inner.delete(todo)
        self._after("delete", first, fired)

    def __repr__(self) -> str:
        return f"FaultyMailbox({self.inner!r}, node={self.node!r}, {len(self.rules)} rules)"

    # ---- machinery ----------------------------------------------------------------------

    def _read(self, key: str, n: int | None) -> bytes | None:
        """``get(key)`` (``n`` None) or ``get_prefix(key, n)``, through the rules for "get"."""
        self._tap("get", key)
        fired = self._enter("get", key)
        self._before("get", key, fired)
        data = self.inner.get(key) if n is None else super().get_prefix(key, n)
        self._after("get", key, fired)
        ours = self.uncertain.get(key)
        # A ranged read that came back full length may have stopped short of the object's end:
        # if what it saw is the start of our bytes, whose the object is stays unknown.
        cut = n is not None and n >= 0 and data is not None and len(data) >= n
        if ours is not None and not (cut and data == ours[:n]):
            del self.uncertain[key]
            outcome = "absent" if data is None else "ours" if data == ours else "theirs"
            self.log.resolved[f"{outcome}/{key_class(key)}"] += 1
        flip = self._take(fired, "flip")
        if flip is not None and data and key.startswith(keys.BLOBS):
            self._record(flip, "get", key)
            i = self.rng.randrange(len(data) * 8)
            b = bytearray(data)
            b[i // 8] ^= 1 << (i % 8)
            data = bytes(b)
        return data

    def _tap(self, op: Op, key: str) -> None:
        """Before each operation (once, however many pages): deliver a crash left pending by the
        previous reply, then let ``tap`` run (a simulation preempts the caller here: other
        nodes act while this request is "slow")."""
        if self.pending_crash is not None:
            raise InjectedCrash(self.pending_crash.describe())
        if self.tap is not None and self.enabled:
            self.tap(op, key)

    def _enter(self, op: Op, key: str) -> builtins.list[Fault]:
        """Deliver a crash left pending by the previous reply, then pick the rules that fire."""
        self.calls += 1
        if self.pending_crash is not None:
            raise InjectedCrash(self.pending_crash.describe())
        if not self.enabled or not self.rules:
            return []
        fired: builtins.list[Fault] = []
        r = None
        state = self._state
        for rule in self.rules:
            ops = rule.ops
            if ops is not None and op not in ops:
                continue
            if rule.node is not None and rule.node != self.node:
                continue
            if rule.prefix and not key.startswith(rule.prefix):
                continue
            kind = rule.kind
            if kind == "flip" and (op != "get" or not key.startswith(keys.BLOBS)):
                continue
            if kind == "retry_412" and op != "put":
                continue
            if rule.rounds is not None:
                r = round_of(key) if r is None else r
                if r is None or not rule.rounds[0] <= r <= rule.rounds[1]:
                    continue
            st = state.get(id(rule))
            if st is None:
                st = state[id(rule)] = _RuleState()
            if rule.times is not None and st.fired >= rule.times:
                continue
            st.matched += 1
            if st.matched <= rule.skip:
                continue
            if rule.probability < 1.0 and self.rng.random() >= rule.probability:
                continue
            st.fired += 1
            fired.append(rule)
        return fired

    @staticmethod
    def _take(fired: builtins.list[Fault], kind: Kind) -> Fault | None:
        return next((f for f in fired if f.kind == kind), None)

    def _record(self, rule: Fault, op: Op, key: str) -> FaultEvent:
        ev = FaultEvent(
            len(self.log.events) if self.log.keep_events else sum(self.log.counts.values()),
            self.node,
            op,
            key,
            rule.kind,
            rule.phase,
        )
        self.log.add(ev)
        return ev

    def _before(self, op: Op, key: str, fired: builtins.list[Fault]) -> None:
        for rule in fired:
            if rule.kind == "latency" and self.clock is not None:
                self._record(rule, op, key)
                self.clock.sleep(rule.seconds)
        for rule in fired:
            if rule.phase != "before":
                continue
            if rule.kind == "crash":
                raise InjectedCrash(self._record(rule, op, key).describe())
            if rule.kind == "error":
                self._record(rule, op, key)
                raise MailboxUnavailable(f"{op.upper()} {key}: {rule.message}")

    def _after(self, op: Op, key: str, fired: builtins.list[Fault]) -> None:
        for rule in fired:
            if rule.phase == "before":
                continue
            if rule.kind == "crash":
                ev = self._record(rule, op, key)
                if rule.phase == "landed":
                    raise InjectedCrash(ev.describe())
                self.pending_crash = ev  # "replied": the reply arrives, the process dies next
            elif rule.kind == "error":
                self._record(rule, op, key)
                raise MailboxUnavailable(f"{op.upper()} {key}: {rule.message} (after the request was applied)")
