"""Records: canonical JSON, and every malformed input becomes a typed error."""

from __future__ import annotations

import json

import pytest

from gradientmail_core.errors import ProtocolError, RecordInvalid
from gradientmail_core.protocol.records import (
    FORMAT,
    MAX_RECORD_BYTES,
    Claim,
    Lease,
    Participant,
    PayloadRef,
    RoundRecord,
    Snapshot,
    decode,
    encode,
)

SHA = "ab" * 32


def snapshot(**kw) -> Snapshot:
    base = dict(
        learner="a",
        round=3,
        local_step=40,
        steps=10,
        tokens=320,
        base_version=1,
        step_seconds=0.02,
        schema_digest=SHA,
        payload=PayloadRef(key="blobs/snapshots/0000000003/a/" + SHA + ".safetensors", sha256=SHA, size=100),
    )
    return Snapshot(**{**base, **kw})


def record() -> RoundRecord:
    return RoundRecord(
        round=3,
        step=40,
        fragment=1,
        version=2,
        closer="a",
        participants=[Participant(learner="a", weight=1.5, steps=10, tokens=320, payload_sha256=SHA)],
        theta=PayloadRef(key="blobs/rounds/0000000003/theta-" + SHA + ".safetensors", sha256=SHA, size=10),
        cosine=None,
        x_step=0.1,
    )


@pytest.mark.parametrize(
    "rec",
    [
        snapshot(),
        record(),
        Claim(round=1, n=2, learner="b", nonce="deadbeef"),
        Lease(learner="c", nonce="0123abcd", seq=4, local_step=9, tokens=99),
    ],
)
def test_records_round_trip_through_canonical_json(rec):
    data = encode(rec)
    assert decode(data, type(rec)) == rec
    # canonical: sorted keys, no whitespace; re-encoding is byte-identical
    assert data == json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()
    assert encode(decode(data, type(rec))) == data


def mutate(rec, **changes) -> bytes:
    d = json.loads(encode(rec))
    for k, v in changes.items():
        if v is ...:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d).encode()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"steps": -1}, "below the minimum"),
        ({"steps": 1.5}, "integer"),
        ({"steps": True}, "integer"),
        ({"steps": "10"}, "integer"),
        ({"learner": "UP"}, "does not match"),
        ({"learner": "../x"}, "does not match"),
        ({"round": 2**70}, "integer"),
        ({"step_seconds": "fast"}, "number"),
        ({"payload": {"key": "blobs/x", "sha256": SHA}}, "missing field"),
        ({"payload": {"key": "x", "sha256": SHA, "size": 1}}, "does not match"),
        ({"payload": "blobs/x"}, "object"),
        ({"tokens": ...}, "missing field"),
        ({"extra": 1}, "unknown field"),
        ({"format": 2}, "format version 2"),
        ({"format": ...}, "format version None"),
        ({"final": "yes"}, "boolean"),
    ],
)
def test_bad_fields_are_typed_errors_naming_the_field(changes, match):
    with pytest.raises(RecordInvalid, match=match):
        decode(mutate(snapshot(), **changes), Snapshot, key="snapshots/x.json")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b"\xff\xfe",
        b'{"format": 1',
        b"1e999",
        b'{"format": NaN}',
        b'{"format": Infinity}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_malformed_json_is_a_typed_error(data):
    with pytest.raises(RecordInvalid):
        decode(data, Snapshot)


def test_truncated_and_oversized_records_are_refused():
    data = encode(record())
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(RecordInvalid):
            decode(data[:cut], RoundRecord)
    with pytest.raises(RecordInvalid, match="cap"):
        decode(b" " * (MAX_RECORD_BYTES + 1), RoundRecord)
    with pytest.raises(RecordInvalid, match="missing"):
        decode(None, RoundRecord)


def test_record_invalid_is_a_protocol_error_with_the_key():
    with pytest.raises(ProtocolError, match="rounds/0000000001.json"):
        decode(b"{}", RoundRecord, key="rounds/0000000001.json")


def test_non_finite_numbers_are_refused_on_encode_and_decode():
    with pytest.raises(ValueError):
        encode(snapshot(step_seconds=float("nan")))
    d = json.loads(encode(snapshot()))
    d["step_seconds"] = 1e400
    with pytest.raises(RecordInvalid):
        decode(json.dumps(d).encode(), Snapshot)


def test_format_version_is_current():
    assert json.loads(encode(snapshot()))["format"] == FORMAT
