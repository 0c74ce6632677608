"""Store profiles over a real HTTP endpoint (moto on 127.0.0.1).

moto behaves like AWS S3. The other stores' quirks are played by botocore event hooks: a store
that ignores ``StartAfter`` (Hugging Face), one that answers a create-once race with 429 (R2),
one that ignores ``If-Match`` or ``Range`` (what the probe must catch), and GCS's
``x-goog-if-generation-match`` header seen on the wire.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from harness import RecordingClock

from gradientmail_core.errors import StoreUnsupported
from gradientmail_core.mailbox import multipart, open_mailbox
from gradientmail_core.mailbox.profiles import PROFILES, profile_named

pytest.importorskip("boto3")


@pytest.fixture
def s3(s3_server: str, s3_bucket: str, s3_client: Any) -> Any:
    from gradientmail_core.mailbox.s3 import S3Mailbox

    def make(**kwargs: Any) -> S3Mailbox:
        kwargs.setdefault("clock", RecordingClock())
        return S3Mailbox(s3_bucket, "run", endpoint_url=s3_server, **kwargs)

    make.raw, make.bucket, make.server = s3_client, s3_bucket, s3_server  # type: ignore[attr-defined]
    return make


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def drop_param(mailbox: Any, operation: str, name: str) -> list[str]:
    """The store ignores ``name`` on ``operation``: the parameter never reaches the wire."""
    dropped: list[str] = []

    def hook(params: dict[str, Any], **_: Any) -> None:
        if params.pop(name, None) is not None:
            dropped.append(name)

    mailbox.client.meta.events.register(f"before-parameter-build.s3.{operation}", hook)
    return dropped


# ---- every profile passes its probe on a store that keeps every guarantee ---------------------------


@pytest.mark.parametrize("name", ["aws", "r2", "hf", "minio"])
def test_each_profile_probes_every_guarantee_and_works(s3: Any, name: str) -> None:
    mailbox = s3(profile=name)
    seen: list[str] = []
    for op in ("PutObject", "GetObject", "ListObjectsV2", "CreateMultipartUpload", "CompleteMultipartUpload"):
        mailbox.client.meta.events.register(f"before-send.s3.{op}", lambda op=op, **_: seen.append(op))
    assert mailbox.put_if_absent("rounds/0000000001.json", b"{}") is True
    assert {"GetObject", "ListObjectsV2", "CreateMultipartUpload", "CompleteMultipartUpload"} <= set(seen)
    assert mailbox.put_if_absent("rounds/0000000001.json", b"{}") is False
    assert mailbox.list("") == ["rounds/0000000001.json"]  # the probe's objects are gone
    assert s3.raw.list_objects_v2(Bucket=s3.bucket).get("KeyCount") == 1


def test_without_a_profile_the_probe_checks_create_once_only(s3: Any) -> None:
    mailbox = s3()
    seen: list[str] = []
    mailbox.client.meta.events.register("before-send.s3", lambda event_name, **_: seen.append(event_name))
    assert mailbox.put_if_absent("rounds/0000000001.json", b"{}")
    assert not any("Multipart" in e or "List" in e or "GetObject" in e for e in seen), seen


def test_profiles_set_client_options(s3: Any) -> None:
    hf = s3(profile="hf", probe=False)
    config = hf.client.meta.config
    assert (config.request_checksum_calculation, config.response_checksum_validation) == ("when_required",) * 2
    assert hf.multipart_threshold == 2_000_000_000 and hf.part_size == multipart.DEFAULT_PART_SIZE
    r2 = s3(profile="r2", probe=False)
    assert PROFILES["r2"].equal_parts and r2.retry.base_delay >= 1.0  # R2: one write per second per key
    assert s3(profile="aws", probe=False).client.meta.config.request_checksum_calculation == "when_supported"
    assert s3(profile="hf", probe=False, request_checksums="when_supported").checksums == "when_supported"
    with pytest.raises(ValueError, match="profile='b2'"):
        profile_named("b2")
    with pytest.raises(ValueError, match="part_size"):
        s3(part_size=1 << 20)
    with pytest.raises(ValueError, match="multipart_threshold"):
        s3(part_size=8 << 20, multipart_threshold=1 << 20)


def test_open_mailbox_takes_s3_options_from_the_url(s3: Any) -> None:
    url = f"s3://{s3.bucket}/run?profile=r2&part_size={6 << 20}&max_concurrency=3&endpoint_url={s3.server}"
    mailbox = open_mailbox(url, probe=False)
    assert (mailbox.profile.name, mailbox.part_size, mailbox.max_concurrency) == ("r2", 6 << 20, 3)
    assert mailbox.prefix == "run" and mailbox.client.meta.endpoint_url == s3.server
    assert open_mailbox(url, probe=False, part_size=7 << 20).part_size == 7 << 20  # keywords win
    with pytest.raises(ValueError, match="unknown option 'colour'"):
        open_mailbox(f"s3://{s3.bucket}/run?colour=red")
    with pytest.raises(ValueError, match="not an integer"):
        open_mailbox(f"s3://{s3.bucket}/run?part_size=big")


# ---- a store that ignores StartAfter (Hugging Face) -----------------------------------------------------


def test_a_store_that_ignores_start_after_costs_a_filter_not_correctness(s3: Any) -> None:
    mailbox = s3(profile="hf")
    dropped = drop_param(mailbox, "ListObjectsV2", "StartAfter")
    names = [f"rounds/{r:010d}.json" for r in range(5)] + ["snapshots/0000000001/a.json"]
    for n in names:
        assert mailbox.put_if_absent(n, b"{}")
    assert dropped  # the probe met the ignoring store, and the hf profile accepted it
    assert mailbox.list("", after="rounds/0000000002.json") == names[3:]
    assert mailbox.list("rounds/", after="rounds/0000000004.json") == []
    assert mailbox.list("rounds/", after="rounds/00000000") == names[:5]


def test_a_profile_that_relies_on_start_after_refuses_a_store_that_ignores_it(s3: Any) -> None:
    mailbox = s3(profile="aws")
    drop_param(mailbox, "ListObjectsV2", "StartAfter")
    with pytest.raises(StoreUnsupported, match="'list-order'.*StartAfter"):
        mailbox.put_if_absent("rounds/0000000001.json", b"{}")
    with pytest.raises(StoreUnsupported):  # and keeps refusing
        mailbox.put_if_absent("rounds/0000000001.json", b"{}")


# ---- the probe names the missing guarantee ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "param", "guarantee"),
    [("GetObject", "IfMatch", "if-match"), ("GetObject", "Range", "ranged-get"), ("PutObject", "IfNoneMatch", "")],
)
def test_the_probe_names_the_guarantee_a_store_lacks(s3: Any, operation: str, param: str, guarantee: str) -> None:
    mailbox = s3(profile="minio")
    drop_param(mailbox, operation, param)
    expected = f"lacks the '{guarantee}' guarantee" if guarantee else "ignores If-None-Match"
    with pytest.raises(StoreUnsupported, match=expected):
        mailbox.put_if_absent("rounds/0000000001.json", b"{}")
    assert "Contents" not in s3.raw.list_objects_v2(Bucket=s3.bucket)  # the probe cleaned up


def test_a_store_without_multipart_uploads_is_refused_by_name(s3: Any) -> None:
    from botocore.awsrequest import AWSResponse

    class Body:
        def stream(self, **_: Any) -> Any:
            yield b"<?xml version='1.0'?><Error><Code>NotImplemented</Code><Message>no</Message></Error>"

    mailbox = s3(profile="aws")
    mailbox.client.meta.events.register(
        "before-send.s3.UploadPart", lambda request, **_: AWSResponse(request.url, 501, {}, Body())
    )
    with pytest.raises(StoreUnsupported, match="'multipart'"):
        mailbox.put_if_absent("rounds/0000000001.json", b"{}")
    assert s3.raw.list_multipart_uploads(Bucket=s3.bucket).get("Uploads") is None


# ---- R2: a create-once race answered with 429 -----------------------------------------------------------


def answer_429_after(s3: Any, mailbox: Any, store: bytes) -> list[int]:
    """The next PutObject is not sent; ``store`` lands under its key (a racer, or our own write
    whose reply was lost), and the store answers 429 TooManyRequests."""
    from botocore.awsrequest import AWSResponse

    class Body:
        def stream(self, **_: Any) -> Any:
            yield b"<?xml version='1.0'?><Error><Code>TooManyRequests</Code><Message>slow</Message></Error>"

    fired: list[int] = []

    def hook(request: Any, **_: Any) -> Any:
        if fired:
            return None
        fired.append(429)
        s3.raw.put_object(Bucket=s3.bucket, Key=request.url.split(f"/{s3.bucket}/")[1], Body=store)
        return AWSResponse(request.url, 429, {"Content-Type": "application/xml"}, Body())

    mailbox.client.meta.events.register("before-send.s3.PutObject", hook)
    return fired


def test_r2_a_429_race_is_retried_and_read_back(s3: Any) -> None:
    key = "claims/0000000001/001.json"
    mailbox = s3(profile="r2", probe=False)
    fired = answer_429_after(s3, mailbox, b"ours")
    assert mailbox.put_if_absent(key, b"ours") is True  # 429, retry: 412, read back: our bytes
    assert fired == [429]
    assert mailbox.clock.sleeps == [1.0]  # R2 takes one write per second per key
    other = s3(profile="r2", probe=False)
    answer_429_after(s3, other, b"theirs")
    assert other.put_if_absent("claims/0000000001/002.json", b"ours") is False  # a racer won


def test_r2_parts_are_equal_but_the_last(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import moto.s3.models

    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 1024)
    monkeypatch.setattr(multipart, "MIN_PART", 1024)
    monkeypatch.setattr(multipart, "GROW_EVERY", 2)
    sizes: dict[str, list[int]] = {"r2": [], "aws": []}
    data = os.urandom(7 * 1024 + 5)
    for name, seen in sizes.items():
        mailbox = s3(profile=name, probe=False, part_size=1024)
        mailbox.client.meta.events.register(
            "before-parameter-build.s3.UploadPart", lambda params, seen=seen, **_: seen.append(len(params["Body"]))
        )
        assert mailbox.put_stream(f"blobs/{name}.bin", [data])
        assert b"".join(mailbox.get_stream(f"blobs/{name}.bin") or ()) == data
    assert sorted(sizes["r2"]) == [5] + [1024] * 7
    assert sorted(sizes["aws"]) == [1024, 1024, 1024 + 5, 2048, 2048]  # grows every 2 parts


# ---- GCS: create-once is x-goog-if-generation-match: 0 ------------------------------------------------------


def test_gcs_create_once_is_sent_as_a_generation_precondition(s3: Any) -> None:
    mailbox = s3(profile="gcs", probe=False, part_size=5 << 20)
    sent: list[dict[str, str]] = []
    for op in ("PutObject", "CompleteMultipartUpload"):
        mailbox.client.meta.events.register(
            f"before-send.s3.{op}",
            lambda request, **_: sent.append({k.lower(): _text(v) for k, v in request.headers.items()}),
        )
    mailbox.put_if_absent("rounds/0000000001.json", b"{}")
    mailbox.put_stream("blobs/big.bin", [os.urandom(11 << 20)], create_once=True)
    mailbox.put_stream("blobs/plain.bin", [b"x"])
    assert [h.get("x-goog-if-generation-match") for h in sent] == ["0", "0", None]
    assert not any("if-none-match" in h for h in sent)
    assert mailbox.client.meta.endpoint_url == s3.server  # the given endpoint wins over storage.googleapis.com
