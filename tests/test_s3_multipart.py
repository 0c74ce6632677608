"""S3 streams over a real HTTP endpoint (moto on 127.0.0.1): multipart uploads, parallel ranged reads.

Faults are injected with botocore event hooks, as the store or the network would cause them: a part
upload that fails once or for good, a writer that dies mid-stream, a connection reset in the middle
of a part's body, a part that arrives corrupt, an object replaced while it is read. The rule they
all check: nothing half-written ever appears under the key, and no multipart upload is left behind.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from harness import RecordingClock

from gradientmail_core.codec.payload import encode_payload
from gradientmail_core.errors import MailboxUnavailable, PayloadCorrupt
from gradientmail_core.mailbox import multipart
from gradientmail_core.mailbox.retry import RetryPolicy
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.store import RunStore

pytest.importorskip("boto3")

MiB = 1 << 20
PART = 5 * MiB
SIZE = 17_000_000  # four parts of 5 MiB: three full, one short
DATA = os.urandom(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()
KEY = "blobs/rounds/0000000001/payload.safetensors"


@pytest.fixture
def s3(s3_server: str, s3_bucket: str, s3_client: Any) -> Any:
    from gradientmail_core.mailbox.s3 import S3Mailbox

    def make(**kwargs: Any) -> S3Mailbox:
        kwargs.setdefault("part_size", PART)
        kwargs.setdefault("max_concurrency", 4)
        kwargs.setdefault("retry", RetryPolicy(attempts=3, base_delay=0.01))
        kwargs.setdefault("clock", RecordingClock())
        return S3Mailbox(s3_bucket, "run", endpoint_url=s3_server, **kwargs)

    make.raw = s3_client  # type: ignore[attr-defined]
    make.bucket = s3_bucket  # type: ignore[attr-defined]
    return make


def chunks(data: bytes = DATA, step: int = 1_000_003) -> Iterator[memoryview]:
    view = memoryview(data)
    for i in range(0, len(data), step):
        yield view[i : i + step]


def requests(mailbox: Any, *operations: str) -> list[tuple[str, dict[str, str]]]:
    """Record (operation, headers) of every request of ``operations`` the mailbox sends."""
    seen: list[tuple[str, dict[str, str]]] = []
    for op in operations:
        mailbox.client.meta.events.register(
            f"before-send.s3.{op}",
            lambda request, op=op, **_: seen.append((op, {k: _text(v) for k, v in request.headers.items()})),
        )
    return seen


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def leftovers(s3: Any) -> list[Any]:
    return list(s3.raw.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []))


def absent(s3: Any, key: str = KEY) -> bool:
    return "Contents" not in s3.raw.list_objects_v2(Bucket=s3.bucket, Prefix=f"run/{key}")


def read_all(mailbox: Any, key: str = KEY, **kwargs: Any) -> bytes:
    stream = mailbox.get_stream(key, **kwargs)
    assert stream is not None
    return b"".join(bytes(c) for c in stream)


# ---- the happy path -----------------------------------------------------------------------------


def test_a_large_stream_goes_up_in_parts_and_comes_back_in_ranged_gets(s3: Any) -> None:
    mailbox = s3()
    seen = requests(mailbox, "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "PutObject", "GetObject")
    assert mailbox.put_stream(KEY, chunks()) is True
    ops = [op for op, _ in seen]
    assert ops.count("CreateMultipartUpload") == 1 and ops.count("CompleteMultipartUpload") == 1
    assert ops.count("UploadPart") == 4 and "PutObject" not in ops
    head = s3.raw.head_object(Bucket=s3.bucket, Key=f"run/{KEY}")
    assert head["ContentLength"] == SIZE and head["ETag"].strip('"').endswith("-4")  # a multipart object
    seen.clear()
    assert hashlib.sha256(read_all(mailbox)).hexdigest() == SHA
    ranges = sorted(h["Range"] for op, h in seen if op == "GetObject")
    assert ranges == sorted(f"bytes={s}-{min(s + PART, SIZE) - 1}" for s in range(0, SIZE, PART))
    # Every range after the first is pinned to the object the first one found.
    assert sum("If-Match" in h for _, h in seen) == 3
    assert leftovers(s3) == []


# ---- part sizes and the 10,000-part limit ----------------------------------------------------------


def _largest_object(part_size: int, *, equal: bool) -> int:
    # What the upload can carry: the sizes it cuts parts at, within S3's part-count limit.
    return sum(itertools.islice(multipart.part_sizes(part_size, equal=equal), multipart.MAX_PARTS))


def test_part_sizes_grow_within_the_part_limit_or_stay_equal() -> None:
    sizes = multipart.part_sizes(8 * MiB, equal=False)
    first = [next(sizes) for _ in range(2 * multipart.GROW_EVERY + 1)]
    assert set(first[: multipart.GROW_EVERY]) == {8 * MiB} and first[multipart.GROW_EVERY] == 16 * MiB
    assert first[-1] == 32 * MiB
    assert _largest_object(8 * MiB, equal=False) > 5 * (1 << 40)  # S3's largest object, 5 TiB
    assert _largest_object(multipart.MIN_PART, equal=False) > 5 * (1 << 40)
    assert _largest_object(8 * MiB, equal=True) == 10_000 * 8 * MiB
    huge = multipart.part_sizes(multipart.MAX_PART, equal=False)
    assert {next(huge) for _ in range(3 * multipart.GROW_EVERY)} == {multipart.MAX_PART}
    assert _largest_object(PART, equal=True) == 10_000 * PART


def test_cut_makes_parts_of_the_planned_sizes_whatever_the_chunks() -> None:
    data = os.urandom(10_000)
    pieces = [data[:1], data[1:2500], memoryview(data)[2500:2600], bytearray(data[2600:9999]), data[9999:]]
    parts = list(multipart.cut(pieces, iter([1000, 2000, 3000, 4000, 5000])))
    assert [len(p) for p in parts] == [1000, 2000, 3000, 4000]
    assert b"".join(parts) == data
    whole = bytes(range(256)) * 4
    assert list(multipart.cut([whole], iter([1024, 1024]))) == [whole]  # one exact bytes chunk: not copied
    assert list(multipart.cut([], iter([8]))) == []


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> int:
    """Parts of 1 KiB, on moto too, so that many parts cost little."""
    import moto.s3.models

    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 1024)
    monkeypatch.setattr(multipart, "MIN_PART", 1024)
    monkeypatch.setattr(multipart, "GROW_EVERY", 4)
    return 1024


TPART = 1024
TSIZE = 4 * TPART + 300  # five parts of 1 KiB, the last short
TDATA = os.urandom(TSIZE)
TSHA = hashlib.sha256(TDATA).hexdigest()


@pytest.fixture
def tiny(s3: Any, small_parts: int) -> Any:
    """Mailboxes with 1 KiB parts: the fault tests move a few KiB, not 17 MB."""

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("part_size", TPART)
        return s3(**kwargs)

    make.raw, make.bucket = s3.raw, s3.bucket  # type: ignore[attr-defined]
    return make


def test_a_stream_within_the_threshold_is_one_put(tiny: Any) -> None:
    mailbox = tiny(multipart_threshold=8 * TPART)
    seen = requests(mailbox, "CreateMultipartUpload", "PutObject")
    assert mailbox.put_stream(KEY, chunks(TDATA, step=300))
    assert [op for op, _ in seen] == ["PutObject"]
    assert read_all(mailbox, part_size=TSIZE) == TDATA


def test_memory_stays_within_max_concurrency_parts(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multipart, "GROW_EVERY", 10_000)  # equal parts: the bound is in parts
    mailbox = tiny(max_concurrency=2)
    lock = threading.Lock()
    state = {"produced": 0, "sent": 0, "worst": 0}

    def sent(params: dict[str, Any], **_: Any) -> None:
        with lock:
            state["sent"] += len(params["Body"])

    mailbox.client.meta.events.register("before-parameter-build.s3.UploadPart", sent)

    def producer() -> Iterator[memoryview]:
        for chunk in chunks(os.urandom(64 * TPART), step=700):
            with lock:
                state["produced"] += len(chunk)
                state["worst"] = max(state["worst"], state["produced"] - state["sent"])
            yield chunk

    assert mailbox.put_stream(KEY, producer())
    # Bytes taken from the writer but not yet handed to a request: the parts in flight, the one
    # being filled, and the chunk in hand. Never the whole 64-part object.
    assert state["worst"] <= (2 + 2) * TPART, state


def test_any_number_of_parts_growing_parts_included(s3: Any, small_parts: int) -> None:
    mailbox = s3(part_size=small_parts, max_concurrency=3)
    data = os.urandom(40 * small_parts + 17)
    seen: list[int] = []
    mailbox.client.meta.events.register(
        "before-parameter-build.s3.UploadPart", lambda params, **_: seen.append(len(params["Body"]))
    )
    assert mailbox.put_stream(KEY, chunks(data, step=700))
    # 4 parts of 1 KiB, 4 of 2 KiB, 4 of 4 KiB, then 8 KiB parts: the size doubles every 4 parts.
    k = small_parts
    assert sorted(seen) == sorted([k] * 4 + [2 * k] * 4 + [4 * k] * 4 + [8 * k, len(data) - 36 * k])
    assert read_all(mailbox, part_size=3 * small_parts) == data


def test_a_stream_beyond_the_part_limit_with_equal_parts_fails_and_leaves_nothing(
    s3: Any, small_parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(multipart, "MAX_PARTS", 5)
    mailbox = s3(part_size=small_parts, profile="r2", probe=False)
    with pytest.raises(ValueError, match="more than 5 parts"):
        mailbox.put_stream(KEY, chunks(os.urandom(6 * small_parts), step=small_parts))
    assert absent(s3) and leftovers(s3) == []
    assert mailbox.put_stream(KEY, chunks(os.urandom(5 * small_parts), step=small_parts))


# ---- failed uploads -------------------------------------------------------------------------------


def fail_part(mailbox: Any, number: int, times: int | None) -> list[int]:
    """Part ``number``'s upload fails with a connection error ``times`` times (None: always)."""
    from botocore.exceptions import ConnectionClosedError

    failed: list[int] = []

    def hook(request: Any, **_: Any) -> None:
        if f"partNumber={number}&" in request.url + "&" and (times is None or len(failed) < times):
            failed.append(number)
            raise ConnectionClosedError(endpoint_url=request.url)

    mailbox.client.meta.events.register("before-send.s3.UploadPart", hook)
    return failed


# ---- failed downloads ------------------------------------------------------------------------------


class _Breaking:
    """A response body that delivers half of what is asked, then breaks (or flips a bit)."""

    def __init__(self, inner: Any, *, flip: bool) -> None:
        self.inner, self.flip = inner, flip

    def read(self, n: int | None = None) -> bytes:
        from botocore.exceptions import ResponseStreamingError

        data = self.inner.read(n)
        if self.flip:
            return bytes([data[0] ^ 1]) + data[1:]
        raise ResponseStreamingError(error=f"connection reset by peer after {len(data) // 2} bytes")

    def close(self) -> None:
        self.inner.close()


def break_range(mailbox: Any, start: int, *, flip: bool, times: int = 1) -> list[str]:
    """The body of the ranged GET that starts at ``start`` breaks (or arrives corrupt), ``times`` times."""
    hit: list[str] = []

    def hook(parsed: dict[str, Any], **_: Any) -> None:
        if str(parsed.get("ContentRange", "")).startswith(f"bytes {start}-") and len(hit) < times:
            hit.append(parsed["ContentRange"])
            parsed["Body"] = _Breaking(parsed["Body"], flip=flip)

    mailbox.client.meta.events.register("after-call.s3.GetObject", hook)
    return hit


def test_create_once_streams_refuse_a_taken_key_and_leave_no_upload(tiny: Any) -> None:
    mailbox = tiny()
    assert mailbox.put_stream(KEY, chunks(TDATA, step=300), create_once=True) is True
    assert mailbox.put_stream(KEY, chunks(b"x" * TSIZE, step=300), create_once=True) is False
    assert read_all(mailbox) == TDATA and leftovers(tiny) == []
    assert mailbox.put_stream(KEY, chunks(b"y" * TSIZE, step=300)) is True  # payloads: replacing is allowed
    assert read_all(mailbox) == b"y" * TSIZE


def test_a_part_upload_that_fails_once_is_retried(tiny: Any) -> None:
    mailbox = tiny()
    failed = fail_part(mailbox, 2, times=1)
    assert mailbox.put_stream(KEY, chunks(TDATA, step=300))
    assert failed == [2] and mailbox.clock.sleeps == [0.01]
    assert read_all(mailbox) == TDATA and leftovers(tiny) == []


def test_a_part_upload_that_keeps_failing_aborts_the_whole_put(tiny: Any) -> None:
    mailbox = tiny()
    failed = fail_part(mailbox, 3, times=None)
    with pytest.raises(MailboxUnavailable, match=r"part 3"):
        mailbox.put_stream(KEY, chunks(TDATA, step=300))
    assert failed == [3, 3, 3]
    assert absent(tiny) and leftovers(tiny) == []  # nothing under the key, no parts left billed


def test_a_writer_that_dies_mid_stream_leaves_nothing(tiny: Any) -> None:
    mailbox = tiny()

    def dying() -> Iterator[memoryview]:
        for i, chunk in enumerate(chunks(TDATA, step=300)):
            if i == 8:
                raise RuntimeError("the encoder failed")
            yield chunk

    with pytest.raises(RuntimeError, match="encoder"):
        mailbox.put_stream(KEY, dying())
    assert absent(tiny) and leftovers(tiny) == []


def test_a_connection_reset_mid_download_is_retried(tiny: Any) -> None:
    mailbox = tiny()
    assert mailbox.put_stream(KEY, chunks(TDATA, step=300))
    hit = break_range(mailbox, 2 * TPART, flip=False)
    assert read_all(mailbox) == TDATA
    assert len(hit) == 1 and mailbox.clock.sleeps == [0.01]


def test_a_part_that_keeps_breaking_fails_the_read(tiny: Any) -> None:
    mailbox = tiny()
    assert mailbox.put_stream(KEY, chunks(TDATA, step=300))
    break_range(mailbox, TPART, flip=False, times=3)
    stream = mailbox.get_stream(KEY)
    assert stream is not None and len(next(stream)) == TPART
    with pytest.raises(MailboxUnavailable, match="failed 3 times"):
        next(stream)


def test_a_part_read_back_corrupt_is_caught_by_the_payloads_sha256(tiny: Any) -> None:
    # A payload of five 1 KiB parts; the fourth arrives with a bit flipped inside a float (no
    # layout check can see it). The store's reader (RunStore.get_payload: the payload's own
    # sha256, checked as its parts stream in) refuses it; read again, it decodes intact.
    store = RunStore(tiny())
    values = {"w": np.arange(1100, dtype=np.float32)}
    ref = store.put_payload(
        functools.partial(keys.round_blob_key, 1, "theta", compression=""),
        encode_payload(values, "F32", kind="theta"),
    )
    assert 3 * TPART + 8 < ref.size < 5 * TPART  # the flipped byte lies in the data
    hit = break_range(store.mailbox, 3 * TPART, flip=True)
    with pytest.raises(PayloadCorrupt, match="sha256"):
        store.get_payload(ref, {"w": (1100,)})
    assert len(hit) == 1
    got = store.get_payload(ref, {"w": (1100,)})
    assert got is not None and got["w"].tobytes() == values["w"].tobytes()


def test_an_object_replaced_while_it_is_read_fails_the_read(tiny: Any) -> None:
    mailbox = tiny(max_concurrency=1)
    assert mailbox.put_stream(KEY, chunks(TDATA, step=300))
    stream = mailbox.get_stream(KEY)
    assert stream is not None and bytes(next(stream)) == TDATA[:TPART]
    assert mailbox.put_stream(KEY, chunks(b"z" * TSIZE, step=300))
    with pytest.raises(MailboxUnavailable, match="replaced or deleted while it was read"):
        list(stream)


def test_empty_missing_and_early_closed_streams(tiny: Any) -> None:
    mailbox = tiny()
    assert mailbox.get_stream("blobs/missing.bin") is None
    assert mailbox.put_stream("blobs/empty.bin", iter([])) is True
    assert list(mailbox.get_stream("blobs/empty.bin") or ["not empty"]) == []
    assert mailbox.put_stream(KEY, chunks(TDATA, step=300))
    stream = mailbox.get_stream(KEY, part_size=TPART)
    assert stream is not None and bytes(next(stream)) == TDATA[:TPART]
    stream.close()  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        mailbox.get_stream("../bad")
    with pytest.raises(ValueError):
        mailbox.put_stream("../bad", iter([b"x"]))
