"""The mailbox contract (spec 3.1), run against every backend, plus each backend's own promises.

Tests taking the ``mailbox`` / ``mailbox_target`` fixture run once per backend: memory, file,
and S3 over HTTP against a moto server. To check a new backend, add it to that fixture in
``conftest.py`` (see ``docs/backends.md``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("hypothesis")
from harness import RecordingClock  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradientmail_core.errors import MailboxUnavailable, MissingExtra, StoreUnsupported  # noqa: E402
from gradientmail_core.mailbox import (  # noqa: E402
    CountingMailbox,
    CreateOutcome,
    Mailbox,
    RetryPolicy,
    call_with_retries,
    create_once,
    open_mailbox,
)
from gradientmail_core.mailbox.contract import validate_prefix  # noqa: E402
from gradientmail_core.mailbox.file import TMP_DIR, FileMailbox  # noqa: E402
from gradientmail_core.mailbox.memory import MemoryMailbox  # noqa: E402

if TYPE_CHECKING:
    from conftest import MailboxTarget

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# ---- create-once ------------------------------------------------------------------------


def test_put_if_absent_creates_once_and_keeps_the_first_body(mailbox: Mailbox) -> None:
    assert mailbox.put_if_absent("rounds/0000000001.json", b"first") is True
    assert mailbox.put_if_absent("rounds/0000000001.json", b"second") is False
    assert mailbox.get("rounds/0000000001.json") == b"first"


def test_get_of_a_missing_key_is_none(mailbox: Mailbox) -> None:
    assert mailbox.get("rounds/0000000001.json") is None
    mailbox.put_if_absent("rounds/0000000002.json", b"")
    assert mailbox.get("rounds/0000000002.json") == b""  # empty is an object, not a miss
    assert mailbox.get("rounds/0000000001.json") is None


def test_create_once_reports_created_ours_or_taken(mailbox: Mailbox) -> None:
    assert create_once(mailbox, "claims/0000000001/001.json", b"me") == (CreateOutcome.CREATED, None)
    # The same bytes already there: our earlier write whose reply was lost, or a retry that saw 412.
    assert create_once(mailbox, "claims/0000000001/001.json", b"me") == (CreateOutcome.ALREADY_OURS, b"me")
    # Someone else's bytes: taken, and we learn what they wrote.
    assert create_once(mailbox, "claims/0000000001/001.json", b"you") == (CreateOutcome.TAKEN, b"me")
    assert mailbox.get("claims/0000000001/001.json") == b"me"


_RACER = r"""
import json, os, sys, threading, time
from gradientmail_core.mailbox import open_mailbox
url, options, key, go, first, threads = sys.argv[1:7]
mailbox = open_mailbox(url, **json.loads(options))
mailbox.put_if_absent(f"warmup/{first}.json", b"x")  # connect (and, on S3, probe) before the race
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.0005)
outcomes = {}
def race(me):
    outcomes[me] = "won" if mailbox.put_if_absent(key, f"racer {me}".encode()) else "lost"
racers = [threading.Thread(target=race, args=(int(first) + i,)) for i in range(int(threads))]
for t in racers:
    t.start()
for t in racers:
    t.join()
print(json.dumps(outcomes))  # one write: prints from several threads would interleave
"""


def test_sixteen_concurrent_racers_have_exactly_one_winner(mailbox_target: MailboxTarget, tmp_path: Path) -> None:
    key = "rounds/0000000007.json"
    # Memory is shared only within a process, so its racers are threads. The file backend must
    # be atomic across processes: 16 of them. On S3 atomicity is the server's, so 4 processes
    # of 4 threads each race just as hard while starting 12 fewer boto3 interpreters.
    procs, threads = {"memory": (0, 16), "file": (16, 1), "s3": (4, 4)}[mailbox_target.kind]
    outcomes: dict[int, str] = {}
    if procs == 0:
        mailbox = mailbox_target.open()
        barrier = threading.Barrier(threads)

        def race(me: int) -> None:
            barrier.wait()
            outcomes[me] = "won" if mailbox.put_if_absent(key, f"racer {me}".encode()) else "lost"

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(race, range(threads)))
    else:
        go = str(tmp_path / "go")
        opts = json.dumps(mailbox_target.options)
        children = [
            run_python(_RACER, mailbox_target.url, opts, key, go, str(i * threads), str(threads)) for i in range(procs)
        ]
        for p in children:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            assert line == "ready", p.communicate()[1]
        Path(go).touch()
        for p in children:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            outcomes.update((int(me), outcome) for me, outcome in json.loads(out).items())
        mailbox = mailbox_target.open()
    assert len(outcomes) == 16
    winners = [me for me, outcome in outcomes.items() if outcome == "won"]
    assert len(winners) == 1, outcomes
    assert mailbox.get(key) == f"racer {winners[0]}".encode()


# ---- list -------------------------------------------------------------------------------

# Byte order across '-' (0x2D) < '.' (0x2E) < '/' (0x2F) < '0': a directory walk that sorted
# plain names would put "a/b/c" before "a/b.json".
LIST_KEYS = [
    "A",
    "a-c",
    "a.b",
    "a/b-c/d",
    "a/b.json",
    "a/b/c",
    "a/b0",
    "a0",
    "b/x",
    "blobs/x/y",
    "rounds/0000000001.json",
    "rounds/0000000002.json",
    "rounds/0000000010.json",
    "snapshots/0000000002/a.json",
]


def test_list_is_byte_ordered_and_honours_prefix_and_after(mailbox: Mailbox) -> None:
    for k in random.Random(0).sample(LIST_KEYS, len(LIST_KEYS)):
        assert mailbox.put_if_absent(k, k.encode())
    expected = sorted(LIST_KEYS)
    assert mailbox.list("") == expected
    prefixes = ["", "a", "a/", "a/b", "a/b/", "b", "rounds/", "rounds/00000000", "zzz"]
    afters = ["", "a", "a/", "a/b", "a/b.json", "a/b/", "a/b/c", "a0", "blobs/", "rounds/0000000001.json", "z"]
    for prefix in prefixes:
        for after in afters:
            want = [k for k in expected if k.startswith(prefix) and k > after]
            assert mailbox.list(prefix, after) == want, (prefix, after)
            assert mailbox.list(prefix, after=after) == want


def test_list_returns_every_page_beyond_a_thousand_keys(mailbox: Mailbox) -> None:
    keys = [f"many/{i:05d}.json" for i in range(1010)]  # S3 pages at 1,000
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lambda k: mailbox.put_if_absent(k, b"x"), keys))
    mailbox.put_if_absent("other.json", b"x")
    assert mailbox.list("many/") == keys
    assert mailbox.list("many/", after=keys[3]) == keys[4:]
    assert mailbox.list("") == [*keys, "other.json"]
    mailbox.delete(k for k in keys)  # a generator, and more than one DeleteObjects batch
    assert mailbox.list("") == ["other.json"]


# ---- delete -----------------------------------------------------------------------------


def test_delete_is_idempotent(mailbox: Mailbox) -> None:
    mailbox.put_if_absent("snapshots/0000000001/a.json", b"a")
    mailbox.put_if_absent("snapshots/0000000001/b.json", b"b")
    mailbox.delete(["snapshots/0000000001/a.json", "snapshots/0000000001/missing.json"])
    mailbox.delete(["snapshots/0000000001/a.json"])
    mailbox.delete([])
    assert mailbox.get("snapshots/0000000001/a.json") is None
    assert mailbox.list("") == ["snapshots/0000000001/b.json"]
    # A deleted key can be created again (leases and claims are).
    assert mailbox.put_if_absent("snapshots/0000000001/a.json", b"again") is True
    assert mailbox.get("snapshots/0000000001/a.json") == b"again"


# ---- key validation ---------------------------------------------------------------------

BAD_KEYS = ["", "..", "a/../b", "./a", "/abs", "a//b", "a\\b", "a\x00b", "a b", "é", "a/"]
BAD_PREFIXES = [k for k in BAD_KEYS if k not in ("", "a/")]  # "" lists everything; "a/" is a fine prefix


def _every_op_refuses(mailbox: Mailbox) -> None:
    for bad in BAD_KEYS:
        with pytest.raises(ValueError):
            mailbox.put_if_absent(bad, b"x")
        with pytest.raises(ValueError):
            mailbox.get(bad)
        with pytest.raises(ValueError):
            mailbox.delete(["fine.json", bad])  # nothing is deleted when one key is bad
    for bad in BAD_PREFIXES:
        with pytest.raises(ValueError):
            mailbox.list(bad)
        with pytest.raises(ValueError):
            mailbox.list("", after=bad)


def test_invalid_keys_are_rejected_before_any_io(mailbox: Mailbox) -> None:
    mailbox.put_if_absent("fine.json", b"x")
    _every_op_refuses(mailbox)
    assert mailbox.list("") == ["fine.json"]
    with pytest.raises(TypeError):
        mailbox.delete("fine.json")  # type: ignore[arg-type]  # a str would be deleted char by char
    assert mailbox.get("fine.json") == b"x"


def test_s3_rejects_invalid_keys_without_contacting_the_store(free_port: int) -> None:
    # Nothing listens on this port: any request would end in MailboxUnavailable, not ValueError.
    mailbox = open_mailbox("s3://bucket/p", endpoint_url=f"http://127.0.0.1:{free_port}", clock=RecordingClock())
    _every_op_refuses(mailbox)


# ---- the helpers: counting, URLs, retries -----------------------------------------------


def test_counting_mailbox_counts_requests_and_bytes_across_threads() -> None:
    counting = CountingMailbox(MemoryMailbox())
    counting.put_if_absent("a.json", b"12345")
    counting.put_if_absent("a.json", b"123")

    def reads(_: int) -> None:
        for _ in range(250):
            counting.get("a.json")
            counting.get("missing.json")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(reads, range(8)))
    counting.list("")
    counting.delete(["a.json"])
    assert counting.counts == {"LIST": 1, "GET": 4000, "PUT": 2, "DELETE": 1}
    assert (counting.bytes_up, counting.bytes_down) == (8, 2000 * 5)
    counting.reset()
    assert counting.counts == {"LIST": 0, "GET": 0, "PUT": 0, "DELETE": 0}
    assert (counting.bytes_up, counting.bytes_down) == (0, 0)


def test_open_mailbox_understands_each_scheme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = open_mailbox("memory://shared-run"), open_mailbox("memory://shared-run")
    a.put_if_absent("k.json", b"v")
    assert b.get("k.json") == b"v"  # same name, same store
    assert open_mailbox("memory://other-run").get("k.json") is None
    assert MemoryMailbox().get("k.json") is None  # unnamed: private

    absolute = open_mailbox(f"file://{tmp_path}/abs")
    assert isinstance(absolute, FileMailbox) and absolute.path == str(tmp_path / "abs")
    monkeypatch.chdir(tmp_path)
    relative = open_mailbox("file://rel/dir")
    assert isinstance(relative, FileMailbox) and relative.path == str(tmp_path / "rel" / "dir")

    s3 = open_mailbox("s3://my-training/runs/run-1/", endpoint_url="http://127.0.0.1:9", probe=False)
    assert (s3.bucket, s3.prefix) == ("my-training", "runs/run-1")  # type: ignore[attr-defined]
    for url in ["ftp://x/y", "/plain/path", "s3:///no-bucket"]:
        with pytest.raises(ValueError, match="mailbox URL"):
            open_mailbox(url)


def test_retry_policy_backs_off_exponentially_up_to_the_cap() -> None:
    policy = RetryPolicy(attempts=8, base_delay=0.05, max_delay=1.0, multiplier=2)
    assert [policy.delay(i) for i in range(1, 8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    jittered = RetryPolicy(rng=random.Random(7))
    for i in range(1, 5):
        plain = RetryPolicy().delay(i)
        assert plain / 2 <= jittered.delay(i) <= plain
    for bad in [{"attempts": 0}, {"base_delay": -1.0}, {"multiplier": 0.5}]:
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


def test_call_with_retries_retries_only_transient_errors_and_names_the_operation() -> None:
    clock = RecordingClock()
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise MailboxUnavailable("connection reset")
        return "ok"

    assert call_with_retries(flaky, policy=RetryPolicy(), clock=clock, what="GET k") == "ok"
    assert clock.sleeps == [0.05, 0.1]

    clock = RecordingClock()

    def down() -> None:
        raise MailboxUnavailable("connection refused")

    with pytest.raises(MailboxUnavailable, match=r"GET rounds/0000000001\.json failed 5 times.*connection refused"):
        call_with_retries(down, policy=RetryPolicy(), clock=clock, what="GET rounds/0000000001.json")
    assert clock.sleeps == [0.05, 0.1, 0.2, 0.4]

    def broken() -> None:
        raise KeyError("a bug, not the network")

    clock = RecordingClock()
    with pytest.raises(KeyError):
        call_with_retries(broken, policy=RetryPolicy(), clock=clock, what="GET k")
    assert clock.sleeps == []


# ---- FileMailbox --------------------------------------------------------------------------

_WRITER = r"""
import sys
from gradientmail_core.mailbox.file import FileMailbox
mailbox = FileMailbox(sys.argv[1])
count, size = int(sys.argv[2]), int(sys.argv[3])
for i in range(count):
    assert mailbox.put_if_absent(f"big/{i:03d}.bin", bytes([i % 251]) * size)
"""


def test_file_readers_never_see_half_written_objects(tmp_path: Path) -> None:
    count, size = 24, 4 << 20
    mailbox = FileMailbox(tmp_path / "mb")
    writer = run_python(_WRITER, mailbox.path, str(count), str(size))
    expected = [f"big/{i:03d}.bin" for i in range(count)]
    seen: set[str] = set()
    while True:
        done = writer.poll() is not None
        listed = mailbox.list("")
        assert listed == expected[: len(listed)]  # only whole objects, in order; temp files never
        for i in range(min(len(listed) + 1, count)):  # also the one being written right now
            data = mailbox.get(expected[i])
            if data is not None:
                assert len(data) == size and data == bytes([i % 251]) * size
                seen.add(expected[i])
        if done:
            break
    assert writer.returncode == 0, writer.communicate()[1]
    assert seen == set(expected)


def test_file_list_never_walks_subtrees_that_sort_before_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mailbox = FileMailbox(tmp_path / "mb", fsync=False)
    sha = "0" * 64
    for k in [
        "manifest.json",
        f"blobs/init/000-{sha}.safetensors",
        f"blobs/rounds/0000000001/theta-{sha}.safetensors",
        "claims/0000000004/001.json",
        *[f"rounds/{r:010d}.json" for r in range(1, 6)],
        "snapshots/0000000006/a.json",
    ]:
        mailbox.put_if_absent(k, b"x")
    opened: list[str] = []
    real_scandir = os.scandir

    def recording_scandir(path: Any) -> Any:
        opened.append(os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", recording_scandir)
    got = mailbox.list("", after="rounds/0000000003.json")
    assert got == ["rounds/0000000004.json", "rounds/0000000005.json", "snapshots/0000000006/a.json"]
    visited = {os.path.relpath(p, mailbox.path) for p in opened}
    assert visited == {".", "rounds", "snapshots", os.path.join("snapshots", "0000000006")}


def test_file_delete_prunes_empty_directories_but_keeps_the_root(tmp_path: Path) -> None:
    mailbox = FileMailbox(tmp_path / "mb", fsync=False)
    mailbox.put_if_absent("blobs/rounds/0000000001/a.bin", b"x")
    mailbox.put_if_absent("blobs/rounds/0000000002/b.bin", b"x")
    mailbox.delete(["blobs/rounds/0000000001/a.bin"])
    assert sorted(os.listdir(tmp_path / "mb" / "blobs" / "rounds")) == ["0000000002"]
    mailbox.delete(["blobs/rounds/0000000002/b.bin"])
    assert os.listdir(tmp_path / "mb") == [TMP_DIR]


def test_file_puts_survive_concurrent_deletes_pruning_their_directory(tmp_path: Path) -> None:
    mailbox = FileMailbox(tmp_path / "mb", fsync=False)

    def churn(name: str) -> None:
        for i in range(300):
            # One shared directory: another thread's delete empties and prunes it between our
            # mkdir and our link often enough to matter.
            key = f"leases/shared/{name}-{i:010d}.json"
            assert mailbox.put_if_absent(key, name.encode())
            assert mailbox.get(key) == name.encode()
            mailbox.delete([key])

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(churn, ["a", "b", "c"]))
    assert mailbox.list("") == []


def test_file_listing_skips_temp_files_and_names_that_are_not_keys(tmp_path: Path) -> None:
    mailbox = FileMailbox(tmp_path / "mb", fsync=False)
    mailbox.put_if_absent("rounds/0000000001.json", b"x")
    (tmp_path / "mb" / TMP_DIR / "123-deadbeef").write_bytes(b"left by a crashed writer")
    (tmp_path / "mb" / "not a key").write_bytes(b"x")
    assert mailbox.list("") == ["rounds/0000000001.json"]


def test_file_keys_cannot_escape_the_root_through_a_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    mailbox = FileMailbox(tmp_path / "mb", fsync=False)
    os.symlink(outside, tmp_path / "mb" / "link")
    with pytest.raises(ValueError, match="outside the mailbox directory"):
        mailbox.put_if_absent("link/x.json", b"x")
    with pytest.raises(ValueError, match="outside the mailbox directory"):
        mailbox.get("link/x.json")
    assert list(outside.iterdir()) == []
    assert mailbox.list("") == []  # symlinks are not walked either


_SEGMENTS = st.text(alphabet="ab0-._", min_size=1, max_size=3).filter(lambda s: s not in (".", ".."))
_KEYS = st.lists(_SEGMENTS, min_size=1, max_size=3).map("/".join)


def _valid_prefix(s: str) -> bool:
    try:
        validate_prefix(s)
    except ValueError:
        return False
    return True


_BOUNDS = st.one_of(st.just(""), _KEYS, _KEYS.map(lambda k: k + "/"), _KEYS.map(lambda k: k[:-1])).filter(_valid_prefix)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keys=st.sets(_KEYS, max_size=20), prefix=_BOUNDS, after=_BOUNDS)
def test_file_and_memory_listing_match_the_reference_for_any_keys(keys: set[str], prefix: str, after: str) -> None:
    # A directory cannot hold both "a" and "a/b"; drop keys that are another's directory.
    keys = {k for k in keys if not any(o.startswith(k + "/") for o in keys)}
    want = [k for k in sorted(keys) if k.startswith(prefix) and k > after]
    with tempfile.TemporaryDirectory() as d:
        for mailbox in (FileMailbox(d, fsync=False), MemoryMailbox()):
            for k in keys:
                mailbox.put_if_absent(k, b"")
            assert mailbox.list(prefix, after) == want


# ---- S3: probe, transient errors, lost replies --------------------------------------------


@pytest.fixture
def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3_open(s3_server: str, s3_bucket: str) -> Callable[..., Any]:
    from gradientmail_core.mailbox.s3 import S3Mailbox

    def make(**kwargs: Any) -> S3Mailbox:
        kwargs.setdefault("clock", RecordingClock())
        return S3Mailbox(s3_bucket, "runs/run-1", endpoint_url=s3_server, **kwargs)

    return make


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_: Any) -> Any:
        yield self.data


def inject_errors(mailbox: Any, operation: str, status: int, code: str, times: int) -> list[int]:
    """Answer the next ``times`` requests of ``operation`` with an S3 error, without sending them."""
    from botocore.awsrequest import AWSResponse

    answered: list[int] = []

    def hook(request: Any, **_: Any) -> Any:
        if len(answered) >= times:
            return None
        answered.append(status)
        body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>injected</Message></Error>"
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body.encode()))

    mailbox.client.meta.events.register(f"before-send.s3.{operation}", hook)
    return answered


def test_s3_slow_down_and_conditional_conflict_are_retried_with_backoff(s3_open: Callable[..., Any]) -> None:
    mailbox = s3_open(probe=False)
    inject_errors(mailbox, "PutObject", 503, "SlowDown", times=2)
    assert mailbox.put_if_absent("a.json", b"a") is True
    assert mailbox.clock.sleeps == [0.05, 0.1]

    mailbox = s3_open(probe=False)
    answered = inject_errors(mailbox, "PutObject", 409, "ConditionalRequestConflict", times=1)
    assert mailbox.put_if_absent("b.json", b"b") is True
    assert answered == [409] and mailbox.clock.sleeps == [0.05]
    assert mailbox.get("b.json") == b"b"


def test_s3_persistent_5xx_becomes_mailbox_unavailable_after_bounded_retries(s3_open: Callable[..., Any]) -> None:
    mailbox = s3_open(probe=False)
    answered = inject_errors(mailbox, "GetObject", 500, "InternalError", times=100)
    with pytest.raises(MailboxUnavailable) as info:
        mailbox.get("rounds/0000000001.json")
    assert len(answered) == 5
    assert mailbox.clock.sleeps == [0.05, 0.1, 0.2, 0.4]
    message = str(info.value)
    assert "GET s3://" in message and "runs/run-1/rounds/0000000001.json" in message
    assert "InternalError" in message and "retries later" in message


def test_s3_connection_refused_becomes_mailbox_unavailable(free_port: int) -> None:
    clock = RecordingClock()
    mailbox = open_mailbox(
        "s3://bucket/p", endpoint_url=f"http://127.0.0.1:{free_port}", retry=RetryPolicy(attempts=3), clock=clock
    )
    with pytest.raises(MailboxUnavailable, match=r"LIST s3://bucket/p/rounds/ failed 3 times"):
        mailbox.list("rounds/")
    assert clock.sleeps == [0.05, 0.1]


def test_s3_errors_that_retrying_cannot_fix_are_raised_at_once(s3_open: Callable[..., Any]) -> None:
    from botocore.exceptions import ClientError

    mailbox = s3_open(probe=False)
    inject_errors(mailbox, "GetObject", 403, "AccessDenied", times=1)
    with pytest.raises(ClientError, match="AccessDenied"):
        mailbox.get("a.json")
    assert mailbox.clock.sleeps == []


def test_s3_put_whose_reply_was_lost_is_resolved_by_reading_back(
    s3_open: Callable[..., Any], s3_server: str, s3_bucket: str
) -> None:
    import boto3
    from botocore.exceptions import ReadTimeoutError

    bystander = boto3.client("s3", endpoint_url=s3_server)

    def fail_first_put(mailbox: Any, *, store: bytes | None, error: Exception) -> None:
        """The first PutObject is not sent; ``store`` (if any) lands in the bucket, then ``error``."""
        state = {"fired": False}

        def hook(request: Any, **_: Any) -> None:
            if state["fired"]:
                return
            state["fired"] = True
            if store is not None:
                bystander.put_object(Bucket=s3_bucket, Key=request.url.split(f"/{s3_bucket}/")[1], Body=store)
            raise error

        mailbox.client.meta.events.register("before-send.s3.PutObject", hook)

    timeout = ReadTimeoutError(endpoint_url=s3_server)
    # Our write landed, the reply did not: the retry sees 412, reads back our bytes: ours.
    mailbox = s3_open(probe=False)
    fail_first_put(mailbox, store=b"ours", error=timeout)
    assert mailbox.put_if_absent("claims/0000000001/001.json", b"ours") is True
    assert mailbox.clock.sleeps == [0.05]
    # The attempt failed and meanwhile someone else created the key: not ours.
    mailbox = s3_open(probe=False)
    fail_first_put(mailbox, store=b"theirs", error=timeout)
    assert mailbox.put_if_absent("claims/0000000001/002.json", b"ours") is False
    assert mailbox.get("claims/0000000001/002.json") == b"theirs"
    # The attempt timed out without writing anything: the retry simply creates it.
    mailbox = s3_open(probe=False)
    fail_first_put(mailbox, store=None, error=timeout)
    assert mailbox.put_if_absent("claims/0000000001/003.json", b"ours") is True
    assert mailbox.get("claims/0000000001/003.json") == b"ours"


def test_s3_store_that_ignores_if_none_match_is_refused(s3_open: Callable[..., Any]) -> None:
    mailbox = s3_open()

    def strip_condition(params: dict[str, Any], **_: Any) -> None:
        params.pop("IfNoneMatch", None)  # what a gateway that drops the header amounts to

    mailbox.client.meta.events.register("before-parameter-build.s3.PutObject", strip_condition)
    with pytest.raises(StoreUnsupported) as info:
        mailbox.put_if_absent("manifest.json", b"{}")
    message = str(info.value)
    assert "ignores If-None-Match" in message and mailbox.bucket in message
    assert "atomic create-once" in message and "MinIO" in message
    with pytest.raises(StoreUnsupported):  # refused for good, not just once
        mailbox.put_if_absent("manifest.json", b"{}")
    honest = s3_open()
    assert honest.list("") == []  # the probe cleaned up and nothing was written
    # probe=False trusts the store: the caller's explicit choice.
    trusting = s3_open(probe=False)
    trusting.client.meta.events.register("before-parameter-build.s3.PutObject", strip_condition)
    assert trusting.put_if_absent("manifest.json", b"{}") is True


def test_s3_store_that_rejects_conditional_writes_is_refused(s3_open: Callable[..., Any]) -> None:
    mailbox = s3_open()
    inject_errors(mailbox, "PutObject", 501, "NotImplemented", times=1)
    with pytest.raises(StoreUnsupported, match="rejects conditional writes"):
        mailbox.put_if_absent("manifest.json", b"{}")


def test_s3_probe_runs_once_and_leaves_no_trace(s3_open: Callable[..., Any]) -> None:
    mailbox = s3_open()
    puts: list[str] = []
    mailbox.client.meta.events.register("before-send.s3.PutObject", lambda request, **_: puts.append(request.url))
    assert mailbox.list("") == []  # reads do not probe: read-only credentials stay usable
    assert puts == []
    assert mailbox.put_if_absent("a.json", b"a") and mailbox.put_if_absent("b.json", b"b")
    assert len(puts) == 4 and sum("/_probe/" in url for url in puts) == 2  # probe twice, then our two
    assert mailbox.list("") == ["a.json", "b.json"]


def test_s3_mailboxes_with_sibling_prefixes_do_not_see_each_other(s3_server: str, s3_bucket: str) -> None:
    a = open_mailbox(f"s3://{s3_bucket}/runs/run-1", endpoint_url=s3_server)
    b = open_mailbox(f"s3://{s3_bucket}/runs/run-10", endpoint_url=s3_server)
    a.put_if_absent("k.json", b"a")
    b.put_if_absent("k.json", b"b")
    assert a.list("") == ["k.json"] and b.list("") == ["k.json"]
    assert a.get("k.json") == b"a"


def test_s3_config_maps_checksums_and_pool_size(s3_server: str) -> None:
    from gradientmail_core.mailbox.s3 import S3Mailbox

    mailbox = S3Mailbox("bucket", "p", endpoint_url=s3_server, request_checksums="when_required", max_concurrency=3)
    config = mailbox.client.meta.config
    assert config.request_checksum_calculation == "when_required"
    assert config.response_checksum_validation == "when_required"
    assert config.max_pool_connections == 3
    with pytest.raises(ValueError, match="request_checksums"):
        S3Mailbox("bucket", "p", request_checksums="always")


def test_s3_backend_loads_boto3_lazily_and_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = run_python(
        "import sys, gradientmail_core.mailbox, gradientmail_core.mailbox.s3; "
        "print(sorted(m for m in ('boto3', 'botocore') if m in sys.modules))"
    )
    out, err = probe.communicate(timeout=60)
    assert out.strip() == "[]", err
    from gradientmail_core.mailbox.s3 import S3Mailbox

    monkeypatch.setitem(sys.modules, "boto3", None)  # makes `import boto3` fail
    with pytest.raises(MissingExtra, match=r"gradientmail\[s3\]"):
        S3Mailbox("bucket", "p")


def test_file_mailbox_directory_planted_at_a_key_is_taken_not_a_crash(tmp_path):
    from gradientmail_core.errors import MailboxUnavailable
    from gradientmail_core.mailbox import create_once
    from gradientmail_core.mailbox.file import FileMailbox

    mb = FileMailbox(tmp_path)
    (tmp_path / "rounds" / "0000000001.json").mkdir(parents=True)
    assert mb.put_if_absent("rounds/0000000001.json", b"{}") is False
    assert mb.get("rounds/0000000001.json") is None
    with pytest.raises(MailboxUnavailable):
        create_once(mb, "rounds/0000000001.json", b"{}")
