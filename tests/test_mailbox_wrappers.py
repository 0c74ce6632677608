"""Every wrapper mailbox forwards every operation, the optional ranged read and streams included.

A wrapper that drops ``get_prefix`` does not break anything visibly: the guard falls back to
downloading whole objects through it, which is exactly what the ranged read exists to avoid.
So these tests find every wrapper (every ``ForwardingMailbox`` in the package) and check that a
ranged read through it reaches the inner mailbox's ranged read. A wrapper that joins a stream
breaks nothing visibly either (the payload still arrives), it just holds the whole payload in
memory: the stream tests check that chunks pass through every wrapper one by one.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import pkgutil
import random
from collections.abc import Callable, Iterable, Iterator

import pytest

import gradientmail_core
import gradientmail_sim
from gradientmail_core.errors import MailboxUnavailable, MissingExtra
from gradientmail_core.mailbox import (
    Chunk,
    CountingMailbox,
    ForwardingMailbox,
    Mailbox,
    RangedMailbox,
    StreamingMailbox,
    read_prefix,
    read_stream,
    write_stream,
)
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.auth import RunAuth
from gradientmail_core.protocol.guard import GuardedMailbox
from gradientmail_core.protocol.records import MAX_RECORD_BYTES
from gradientmail_sim.audit import AuditMailbox, Auditor
from gradientmail_sim.faults import Fault, FaultyMailbox, InjectedCrash

KEY = "blobs/object.bin"
DATA = b"0123456789"


_EXTRAS = frozenset({"torch", "mlx", "boto3", "botocore", "zstandard", "lightning", "accelerate", "rich", "matplotlib"})


def _modules() -> builtins.list[str]:
    names = []
    # the product's wrappers and the development package's (the fault injector, the auditor)
    packages = [(gradientmail_core.__path__, "gradientmail_core."), (gradientmail_sim.__path__, "gradientmail_sim.")]
    for info in (i for path, prefix in packages for i in pkgutil.walk_packages(path, prefix)):
        if info.name == "gradientmail_core.adapters.mlx" or info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            importlib.import_module(info.name)
        except MissingExtra:  # a module of an extra that is not installed (torch, ...) defines no wrapper
            continue
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in _EXTRAS:
                raise
            continue
        names.append(info.name)
    return names


MODULES = _modules()


def _subclasses(cls: type) -> builtins.list[type]:
    found: dict[type, None] = {}
    todo = [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found and sub.__module__.startswith(("gradientmail_core.", "gradientmail_sim.")):
                found[sub] = None
                todo.append(sub)
    return builtins.list(found)


# How to build each wrapper around ``inner``; a wrapper whose constructor takes more than
# ``inner`` needs an entry here (the test below says so).
FACTORIES: dict[type, Callable[[Mailbox], Mailbox]] = {
    ForwardingMailbox: ForwardingMailbox,
    CountingMailbox: CountingMailbox,
    FaultyMailbox: lambda inner: FaultyMailbox(inner, rng=random.Random(0), node="a"),
    GuardedMailbox: GuardedMailbox,
    AuditMailbox: lambda inner: AuditMailbox(inner, Auditor(inner), "a"),
}
WRAPPERS = builtins.list(dict.fromkeys([*FACTORIES, *_subclasses(ForwardingMailbox)]))


def wrap(cls: type, inner: Mailbox) -> Mailbox:
    factory = FACTORIES.get(cls)
    if factory is not None:
        return factory(inner)
    try:
        wrapper: Mailbox = cls(inner)
    except TypeError as exc:
        pytest.fail(f"{cls.__qualname__}({inner!r}) failed ({exc}): add it to FACTORIES in {__name__}")
    return wrapper


class Recorder:
    """An inner mailbox with the four operations only; records every call it gets."""

    def __init__(self) -> None:
        self.store = MemoryMailbox()
        self.calls: builtins.list[str] = []

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.calls.append("put_if_absent")
        return self.store.put_if_absent(key, data)

    def get(self, key: str) -> bytes | None:
        self.calls.append("get")
        return self.store.get(key)

    def list(self, prefix: str, after: str = "") -> builtins.list[str]:
        self.calls.append("list")
        return self.store.list(prefix, after)

    def delete(self, keys: Iterable[str]) -> None:
        self.calls.append("delete")
        self.store.delete(keys)


class RangedRecorder(Recorder):
    """The same, with the ranged read."""

    def get_prefix(self, key: str, n: int) -> bytes | None:
        self.calls.append("get_prefix")
        return self.store.get_prefix(key, n)


class StreamingRecorder(RangedRecorder):
    """The same, with the streams; records the chunks it is handed and whether a read was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks_in: builtins.list[bytes] = []
        self.closed_reads = 0

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        self.calls.append("put_stream")
        self.chunks_in = [bytes(c) for c in chunks]
        return self.store.put_stream(key, self.chunks_in, create_once=create_once)

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        self.calls.append("get_stream")
        stream = self.store.get_stream(key, part_size=part_size)
        return None if stream is None else self._watched(stream)

    def _watched(self, stream: Iterator[Chunk]) -> Iterator[Chunk]:
        try:
            yield from stream
        finally:
            self.closed_reads += 1


def _holding(inner: Recorder) -> Recorder:
    inner.store.put_if_absent(KEY, DATA)
    return inner


def test_the_wrappers_are_found() -> None:
    assert {CountingMailbox, FaultyMailbox, GuardedMailbox, AuditMailbox} <= set(_subclasses(ForwardingMailbox))


def test_every_mailbox_that_wraps_another_is_a_forwarding_mailbox() -> None:
    """A class with the mailbox operations whose constructor takes an ``inner`` is a wrapper."""
    strays = []
    for name in MODULES:
        for _, cls in inspect.getmembers(importlib.import_module(name), inspect.isclass):
            if cls.__module__ != name or not all(hasattr(cls, op) for op in ("put_if_absent", "get", "list", "delete")):
                continue
            params = builtins.list(inspect.signature(cls.__init__).parameters)
            if params[1:2] == ["inner"] and not issubclass(cls, ForwardingMailbox):
                strays.append(f"{name}.{cls.__qualname__}")
    assert not strays, f"wrappers that do not derive from ForwardingMailbox: {strays}"


@pytest.mark.parametrize("cls", WRAPPERS, ids=lambda cls: cls.__qualname__)
def test_a_ranged_read_reaches_the_inner_ranged_read(cls: type) -> None:
    inner = _holding(RangedRecorder())
    mailbox = wrap(cls, inner)
    assert isinstance(mailbox, RangedMailbox)
    assert mailbox.get_prefix(KEY, 4) == b"0123"
    assert "get_prefix" in inner.calls and "get" not in inner.calls, inner.calls
    assert mailbox.get_prefix(KEY, 100) == DATA
    assert mailbox.get_prefix("blobs/missing.bin", 4) is None
    assert "get" not in inner.calls, inner.calls


@pytest.mark.parametrize("cls", WRAPPERS, ids=lambda cls: cls.__qualname__)
def test_a_ranged_read_over_a_mailbox_without_one_cuts_a_whole_get(cls: type) -> None:
    inner = _holding(Recorder())
    mailbox = wrap(cls, inner)
    assert isinstance(mailbox, RangedMailbox)
    assert mailbox.get_prefix(KEY, 4) == b"0123"
    assert mailbox.get_prefix(KEY, 0) == b""
    assert mailbox.get_prefix(KEY, 100) == DATA
    assert mailbox.get_prefix(KEY, -1) == DATA
    assert mailbox.get_prefix("blobs/missing.bin", 4) is None
    assert set(inner.calls) == {"get"}


@pytest.mark.parametrize("inner_cls", [Recorder, RangedRecorder])
@pytest.mark.parametrize("cls", WRAPPERS, ids=lambda cls: cls.__qualname__)
def test_the_four_operations_reach_the_inner_mailbox(cls: type, inner_cls: type[Recorder]) -> None:
    inner = inner_cls()
    mailbox = wrap(cls, inner)
    assert mailbox.put_if_absent(KEY, DATA) is True
    assert inner.store.get(KEY) == DATA
    assert mailbox.get(KEY) == DATA
    assert mailbox.list("blobs/") == [KEY]
    mailbox.delete([KEY])
    assert inner.store.get(KEY) is None
    assert inner.calls == ["put_if_absent", "get", "list", "delete"]


# ---- what each wrapper does to a ranged read ------------------------------------------------


def test_read_prefix_prefers_the_ranged_read_and_cuts_a_whole_get_otherwise() -> None:
    ranged, plain = _holding(RangedRecorder()), _holding(Recorder())
    assert read_prefix(ranged, KEY, 3) == b"012" and ranged.calls == ["get_prefix"]
    assert read_prefix(plain, KEY, 3) == b"012" and plain.calls == ["get"]
    assert read_prefix(plain, KEY, -1) == DATA and read_prefix(plain, "blobs/none.bin", 3) is None


def test_counting_counts_a_ranged_read_as_a_get_of_the_bytes_it_returned() -> None:
    counting = CountingMailbox(_holding(RangedRecorder()))
    assert counting.get_prefix(KEY, 4) == b"0123"
    assert counting.get_prefix("blobs/missing.bin", 4) is None
    assert counting.counts == {"LIST": 0, "GET": 2, "PUT": 0, "DELETE": 0}
    assert (counting.bytes_up, counting.bytes_down) == (0, 4)


def test_faults_on_get_apply_to_a_ranged_read() -> None:
    inner = _holding(RangedRecorder())
    faulty = FaultyMailbox(inner, [Fault(kind="error", ops=("get",), times=1)], rng=random.Random(0), node="a")
    with pytest.raises(MailboxUnavailable, match="GET blobs/object.bin"):
        faulty.get_prefix(KEY, 4)
    assert inner.calls == []  # "before": the request was never sent
    assert faulty.get_prefix(KEY, 4) == b"0123" and inner.calls == ["get_prefix"]
    assert faulty.log.counts["error/before/get/blobs/object.bin"] == 1 and faulty.calls == 2


def test_a_flip_on_get_flips_a_bit_of_a_ranged_read() -> None:
    faulty = FaultyMailbox(_holding(RangedRecorder()), [Fault(kind="flip", times=1)], rng=random.Random(0))
    got = faulty.get_prefix(KEY, 4)
    assert got is not None and len(got) == 4 and got != b"0123"
    assert sum(bin(a ^ b).count("1") for a, b in zip(got, b"0123", strict=True)) == 1


def test_a_short_ranged_read_leaves_an_unknown_write_unresolved() -> None:
    faulty = FaultyMailbox(RangedRecorder(), [Fault(kind="error", ops=("put",), times=1)], rng=random.Random(0))
    with pytest.raises(MailboxUnavailable):
        faulty.put_if_absent(KEY, DATA)  # never sent: the caller cannot know that
    faulty.inner.put_if_absent(KEY, DATA)  # ... someone (it could have been us) wrote these bytes
    assert faulty.get_prefix(KEY, 4) == b"0123" and KEY in faulty.uncertain  # cannot tell yet
    assert faulty.get_prefix(KEY, len(DATA) + 1) == DATA and KEY not in faulty.uncertain
    assert faulty.log.resolved["ours/blobs/object.bin"] == 1


def test_the_guard_caps_a_ranged_read_and_maps_it_to_the_physical_key() -> None:
    inner = RangedRecorder()
    auth = RunAuth(b"a run secret of 16+ bytes")
    auth.bind("0123456789abcdef")
    record = keys.snapshot_key(1, "a")
    physical = keys.tag_key(record, auth.tag(record) or "")
    inner.store.put_if_absent(physical, b"{" + b" " * (2 * MAX_RECORD_BYTES))
    guard = GuardedMailbox(inner, auth=auth)
    assert guard.get_prefix(record, 10) == b"{" + b" " * 9
    assert len(guard.get_prefix(record, -1) or b"") == MAX_RECORD_BYTES + 1
    assert len(guard.get_prefix(record, 10 * MAX_RECORD_BYTES) or b"") == MAX_RECORD_BYTES + 1
    assert inner.calls == ["get_prefix"] * 3


# ---- streams ----------------------------------------------------------------------------------

CHUNKS = [b"0123", b"4567", b"89"]


@pytest.mark.parametrize("cls", WRAPPERS, ids=lambda cls: cls.__qualname__)
def test_a_stream_reaches_the_inner_stream_chunk_by_chunk(cls: type) -> None:
    inner = StreamingRecorder()
    mailbox = wrap(cls, inner)
    assert isinstance(mailbox, StreamingMailbox)
    assert write_stream(mailbox, KEY, iter(CHUNKS)) is True
    assert inner.chunks_in == CHUNKS  # handed on as they came, never joined
    stream = read_stream(mailbox, KEY, part_size=4)
    assert stream is not None
    assert [bytes(c) for c in stream] == CHUNKS
    assert read_stream(mailbox, "blobs/missing.bin") is None
    assert write_stream(mailbox, KEY, iter(CHUNKS), create_once=True) is False
    assert inner.calls == ["put_stream", "get_stream", "get_stream", "put_stream"], inner.calls


@pytest.mark.parametrize("cls", WRAPPERS, ids=lambda cls: cls.__qualname__)
def test_closing_a_stream_early_closes_the_inner_stream(cls: type) -> None:
    inner = StreamingRecorder()
    inner.store.put_if_absent(KEY, DATA)
    stream = read_stream(wrap(cls, inner), KEY, part_size=2)
    assert stream is not None
    assert bytes(next(stream)) == b"01"
    stream.close()  # type: ignore[attr-defined]
    assert inner.closed_reads == 1


@pytest.mark.parametrize("cls", WRAPPERS, ids=lambda cls: cls.__qualname__)
def test_a_stream_over_a_mailbox_without_streams_joins_at_the_bottom(cls: type) -> None:
    inner = Recorder()
    mailbox = wrap(cls, inner)
    assert write_stream(mailbox, KEY, iter(CHUNKS)) is True
    assert write_stream(mailbox, KEY, iter(CHUNKS)) is True  # identical bytes already there
    assert write_stream(mailbox, KEY, [b"other"]) is False  # other bytes there: kept, reported
    assert write_stream(mailbox, KEY, iter(CHUNKS), create_once=True) is False
    stream = read_stream(mailbox, KEY)
    assert stream is not None and b"".join(stream) == DATA
    assert set(inner.calls) == {"put_if_absent", "get"}


def test_the_shipped_backends_stream() -> None:
    from gradientmail_core.mailbox.file import FileMailbox
    from gradientmail_core.mailbox.s3 import S3Mailbox

    for cls in (MemoryMailbox, FileMailbox, S3Mailbox):
        assert hasattr(cls, "put_stream") and hasattr(cls, "get_stream"), cls


def test_counting_counts_a_stream_once_and_its_bytes_as_they_pass() -> None:
    counting = CountingMailbox(StreamingRecorder())
    assert counting.put_stream(KEY, iter(CHUNKS))
    stream = counting.get_stream(KEY, part_size=4)
    assert stream is not None
    assert counting.counts == {"LIST": 0, "GET": 1, "PUT": 1, "DELETE": 0}
    assert (counting.bytes_up, counting.bytes_down) == (len(DATA), 0)
    next(stream)
    assert counting.bytes_down == 4
    assert b"".join([b"0123", *stream]) == DATA and counting.bytes_down == len(DATA)


def test_a_part_that_fails_to_upload_fails_the_stream_and_writes_nothing() -> None:
    inner = StreamingRecorder()
    faulty = FaultyMailbox(inner, [Fault(kind="error", ops=("put",), part=1, times=1)], rng=random.Random(0))
    with pytest.raises(MailboxUnavailable, match="part 1"):
        faulty.put_stream(KEY, iter(CHUNKS))
    assert inner.store.get(KEY) is None
    assert faulty.log.counts["error/before/put/blobs/object.bin"] == 1
    assert faulty.put_stream(KEY, iter(CHUNKS)) and inner.store.get(KEY) == DATA  # times=1: the retry passes


def test_a_stream_read_can_be_cut_mid_download_or_flipped_in_one_part() -> None:
    inner = _holding(StreamingRecorder())
    faulty = FaultyMailbox(inner, [Fault(kind="error", ops=("get",), part=1, times=1)], rng=random.Random(0))
    stream = faulty.get_stream(KEY, part_size=4)
    assert stream is not None and bytes(next(stream)) == b"0123"
    with pytest.raises(MailboxUnavailable, match="part 1"):
        next(stream)
    assert inner.closed_reads == 1
    faulty = FaultyMailbox(inner, [Fault(kind="flip", part=2, times=1)], rng=random.Random(0))
    got = [bytes(c) for c in faulty.get_stream(KEY, part_size=4) or ()]
    assert got[:2] == CHUNKS[:2] and got[2] != CHUNKS[2]
    assert sum(bin(a ^ b).count("1") for a, b in zip(got[2], CHUNKS[2], strict=True)) == 1
    crash = FaultyMailbox(inner, [Fault(kind="crash", ops=("get",), part=0)], rng=random.Random(0))
    with pytest.raises(InjectedCrash):
        list(crash.get_stream(KEY) or ())


def test_a_fault_before_a_stream_is_raised_before_any_request() -> None:
    inner = _holding(StreamingRecorder())
    faulty = FaultyMailbox(inner, [Fault(kind="error", times=2)], rng=random.Random(0))
    with pytest.raises(MailboxUnavailable):
        faulty.get_stream(KEY)
    with pytest.raises(MailboxUnavailable):
        faulty.put_stream(KEY, iter(CHUNKS))
    assert inner.calls == []


def test_the_guard_caps_a_stream_and_maps_it_to_the_physical_key() -> None:
    inner = StreamingRecorder()
    auth = RunAuth(b"a run secret of 16+ bytes")
    auth.bind("0123456789abcdef")
    record = keys.snapshot_key(1, "a")
    physical = keys.tag_key(record, auth.tag(record) or "")
    guard = GuardedMailbox(inner, auth=auth)
    big = b"{" + b" " * (3 * MAX_RECORD_BYTES)
    assert guard.put_stream(record, [big[:100], big[100:]], create_once=True)
    assert inner.store.get(physical) == big
    stream = guard.get_stream(record, part_size=1000)
    assert stream is not None
    assert b"".join(stream) == big[: MAX_RECORD_BYTES + 1]
    assert inner.closed_reads == 1  # the rest was never read
    guard.limit_payloads(5)
    guard.put_stream(KEY, iter(CHUNKS))
    assert b"".join(guard.get_stream(KEY, part_size=4) or ()) == DATA[:6]
