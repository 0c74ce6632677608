"""Fuzzing the decoders hostile bytes reach first: records (and the manifest's run info), the
safetensors header, and payloads. Whatever the input, the only exception is the typed one
(``RecordInvalid`` / ``ProtocolError`` / ``PayloadCorrupt``), and no input allocates more than
a bounded amount of memory. (Time per input is not asserted here: a wall-clock threshold fails
on a loaded machine; a benchmark is the place to measure it.)

CI runs a short pass; ``GM_FUZZ_EXAMPLES=20000 pytest tests/test_fuzz_decoders.py -s`` runs a
long one and prints how many inputs each target saw.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import tracemalloc
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradientmail_core.codec import safetensors_io  # noqa: E402
from gradientmail_core.codec.header import schema_digest  # noqa: E402
from gradientmail_core.codec.payload import decode_payload, encode_payload  # noqa: E402
from gradientmail_core.config import DiLoCo  # noqa: E402
from gradientmail_core.errors import PayloadCorrupt, ProtocolError, RecordInvalid  # noqa: E402
from gradientmail_core.mailbox.contract import validate_key  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.protocol.records import (  # noqa: E402
    Claim,
    Lease,
    Manifest,
    Participant,
    PayloadRef,
    Rejection,
    RoundRecord,
    Snapshot,
    TensorSpec,
    canonical_json,
    decode,
    encode,
    to_dict,
)
from gradientmail_core.protocol.run import RunInfo  # noqa: E402

EXAMPLES = int(os.environ.get("GM_FUZZ_EXAMPLES", "150"))
MAX_PEAK_BYTES = 64 << 20  # per input, whatever sizes the input declares
SEEN: Counter[str] = Counter()

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # no time limit per input: a loaded CI machine must not fail the run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    print(f"\nfuzz inputs per target: {dict(SEEN)} (total {sum(SEEN.values())})")


def bounded(target: str, fn, *args, **kw):
    """Run ``fn`` on one input; assert it stayed within the memory bound. Counts the input
    under ``target`` and its outcome under ``target:accepted`` or ``target:refused``."""
    SEEN[target] += 1
    tracemalloc.start()  # traces Python and numpy allocations, only while the decoder runs
    outcome = "refused"
    try:
        out = fn(*args, **kw)
        outcome = "accepted"
        return out
    finally:
        SEEN[f"{target}:{outcome}"] += 1
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < MAX_PEAK_BYTES, f"{target}: one input allocated {peak >> 20} MiB"


# ---- valid seeds ---------------------------------------------------------------------------

SHA = "ab" * 32
REF = PayloadRef(key=keys.snapshot_blob_key(3, "a", SHA), sha256=SHA, size=123)
SCHEMA = [TensorSpec(name="w", dtype="F32", shape=[4, 3]), TensorSpec(name="b", dtype="BF16", shape=[3])]
CFG = DiLoCo(sync_every=4, fragments=2)
SEEDS = {
    Manifest: Manifest(run_id="0123456789abcdef", created_by="a", schema=SCHEMA, schema_digest=schema_digest(SCHEMA),
                       fragments=[["w"], ["b"]], config=CFG.to_dict(),
                       init=[dataclasses.replace(REF, key=keys.init_blob_key(f, SHA)) for f in range(2)]),
    Claim: Claim(round=3, n=1, learner="a", nonce="deadbeef"),
    Lease: Lease(learner="a", nonce="deadbeef", seq=7, local_step=10, tokens=100),
    Snapshot: Snapshot(learner="a", round=3, local_step=10, steps=4, tokens=64, base_version=1, step_seconds=0.1,
                       schema_digest=SHA, payload=REF, mac="cd" * 32),
    RoundRecord: RoundRecord(round=3, step=8, fragment=1, version=2, closer="a",
                             participants=[Participant(learner="a", weight=1.5, steps=4, tokens=64,
                                                       payload_sha256=SHA)],
                             rejected=[Rejection(learner="b", reason="nonfinite")], theta=REF, outer=REF,
                             cosine=0.5, x_step=0.1),
}  # fmt: skip
CLASSES = list(SEEDS)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e308, -0.0, 5e-324])
    | st.text(max_size=40)
    | st.sampled_from(["a", "../x", "blobs/../x", "blobs//x", "/abs", SHA, "F32", "x" * 600, "\u0000"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=25,
)


def _set_path(obj, path: list, value):
    """Replace the element at a (wrapped) index path inside nested dicts/lists by ``value``."""
    if not path or not isinstance(obj, dict | list) or not obj:
        return value
    k = list(obj)[path[0] % len(obj)] if isinstance(obj, dict) else path[0] % len(obj)
    obj[k] = _set_path(obj[k], path[1:], value)
    return obj


@st.composite
def record_inputs(draw):
    cls = draw(st.sampled_from(CLASSES))
    seed = to_dict(SEEDS[cls])
    how = draw(st.sampled_from(["bytes", "field", "drop", "extra", "flip", "object"]))
    if how == "bytes":
        return cls, draw(st.binary(max_size=2048))
    if how == "field":
        path = draw(st.lists(st.integers(0, 50), min_size=1, max_size=4))
        return cls, canonical_json(_set_path(seed, path, draw(json_values)))
    if how == "drop":
        seed.pop(draw(st.sampled_from(sorted(seed))))
        return cls, canonical_json(seed)
    if how == "extra":
        seed[draw(st.text(max_size=10))] = draw(json_values)
        return cls, json.dumps(seed).encode()
    if how == "flip":
        data = bytearray(canonical_json(seed))
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        return cls, bytes(data[: draw(st.integers(0, len(data)))])
    fields = {f.name: draw(json_values) for f in dataclasses.fields(cls) if draw(st.booleans())}
    fields["format"] = 1
    return cls, json.dumps(fields).encode()


@FUZZ
@given(record_inputs())
@example((Snapshot, encode(SEEDS[Snapshot])))  # a valid record: the decoder must accept it
def test_fuzz_record_decoder_raises_only_record_invalid(inp):
    cls, data = inp
    try:
        rec = bounded("records", decode, data, cls, key="fuzz")
    except RecordInvalid:
        return
    assert isinstance(rec, cls)
    # What decodes is clean: it re-encodes canonically to itself, and any payload ref it holds
    # names a valid key inside blobs/ (a backend never sees a hostile name).
    assert decode(encode(rec), cls, key="again") == rec
    for ref in _refs(rec):
        assert validate_key(ref.key).startswith(keys.BLOBS)
    if cls is Manifest:
        try:
            bounded("manifest", RunInfo.from_manifest, rec)
        except ProtocolError:
            pass


def _refs(rec) -> list[PayloadRef]:
    out = []
    for f in dataclasses.fields(rec):
        v = getattr(rec, f.name)
        out += (
            [v]
            if isinstance(v, PayloadRef)
            else [x for x in v if isinstance(x, PayloadRef)]
            if isinstance(v, list)
            else []
        )
    return out


def test_deeply_nested_and_huge_records_are_rejected_cheaply():
    for data in (
        b"[" * 200_000 + b"]" * 200_000,
        b'{"format":1,"x":"' + b"a" * (2 << 20) + b'"}',
        b'{"format":1,"round":' + b"9" * 5000 + b"}",
        b'{"format":1,"round":1e999}',
    ):
        with pytest.raises(RecordInvalid):
            bounded("records", decode, data, Snapshot, key="fuzz")


# ---- payloads ------------------------------------------------------------------------------

EXPECTED = {"w": (5, 7), "b": (7,), "s": ()}
DTYPE_CHOICES = ("F32", "F16", "BF16", "F8_E4M3", "F4", "I2")
# A valid payload, run before the generated inputs: the reader must accept it.
VALID_PAYLOAD = encode_payload(
    {n: np.linspace(-1, 1, int(np.prod(s))).reshape(s).astype(np.float32) for n, s in EXPECTED.items()},
    "BF16",
    kind="delta",
)


def _valid_payload(draw, compression: str) -> bytes:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = {n: rng.standard_normal(s).astype(np.float32) for n, s in EXPECTED.items()}
    dtypes = {n: draw(st.sampled_from(DTYPE_CHOICES)) for n in EXPECTED}
    return encode_payload(values, dtypes, kind=draw(st.sampled_from(["delta", "theta"])), compression=compression)


def _header_of(draw) -> dict:
    """A header with arbitrary entries, including absurd shapes and offsets."""
    entry = st.fixed_dictionaries({
        "dtype": st.sampled_from([*safetensors_io.DTYPE_SIZES, "F4", "Q8", 3]),
        "shape": st.lists(st.one_of(st.integers(-2, 10), st.sampled_from([2**31, 2**40, 2**63])), max_size=4),
        "data_offsets": st.lists(st.one_of(st.integers(-5, 300), st.just(2**64)), min_size=0, max_size=3),
    })  # fmt: skip
    header = draw(st.dictionaries(st.sampled_from(["w", "b", "s", "w#scale", "x"]), entry, max_size=5))
    if draw(st.booleans()):
        header["__metadata__"] = {
            "format": "gradientmail/1",
            "kind": "delta",
            "compression": "none",
            "dtypes": json.dumps({n: draw(st.sampled_from(DTYPE_CHOICES)) for n in EXPECTED}),
        }
    return header


@st.composite
def payload_inputs(draw):
    compression = draw(st.sampled_from(["", "zstd"]))
    how = draw(st.sampled_from(["bytes", "valid", "flip", "truncate", "length", "header", "append"]))
    if how == "bytes":
        return compression, draw(st.binary(max_size=4096))
    if how == "header":
        text = json.dumps(_header_of(draw)).encode()
        return compression, struct.pack("<Q", len(text)) + text + draw(st.binary(max_size=512))
    data = bytearray(_valid_payload(draw, compression))
    if how == "flip":
        (n,) = struct.unpack_from("<Q", data)
        for _ in range(draw(st.integers(1, 6))):  # mostly inside the header, where parsing happens
            i = draw(st.integers(0, min(len(data) - 1, 8 + n + 64)))
            data[i] = draw(st.integers(0, 255))
    elif how == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif how == "length":
        data[:8] = struct.pack("<Q", draw(st.sampled_from([0, 1, 7, len(data), 2**31, 2**63, 2**64 - 1])))
    elif how == "append":
        data += draw(st.binary(min_size=1, max_size=64))
    return compression, bytes(data)


@FUZZ
@given(payload_inputs())
@example(("", VALID_PAYLOAD))
def test_fuzz_payload_reader_raises_only_payload_corrupt(inp):
    compression, data = inp
    try:
        out = bounded("payloads", decode_payload, data, EXPECTED, compression=compression)
    except PayloadCorrupt:
        return
    assert set(out) == set(EXPECTED)
    for n, shape in EXPECTED.items():
        assert out[n].dtype == np.float32 and out[n].shape == shape


@FUZZ
@given(payload_inputs())
@example(("", VALID_PAYLOAD))
def test_fuzz_safetensors_header_raises_only_payload_corrupt(inp):
    _, data = inp
    try:
        header, start = bounded("headers", safetensors_io.read_header, data, max_header_bytes=1 << 16)
    except PayloadCorrupt:
        return
    assert 8 < start <= len(data) and isinstance(header, dict)


def test_zstd_bomb_is_refused_before_allocating():
    zstandard = pytest.importorskip("zstandard")
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))  # 64 MiB of zeros in a few KB
    values = {n: np.zeros(s, np.float32) for n, s in EXPECTED.items()}
    good = encode_payload(values, "F32", kind="delta", compression="zstd")
    header, start = safetensors_io.read_header(good, max_header_bytes=1 << 16)
    meta = header["__metadata__"]
    tensors = {n: ("U8", (len(bomb) if n == "w" else e["data_offsets"][1] - e["data_offsets"][0],),
                   bomb if n == "w" else good[start + e["data_offsets"][0]: start + e["data_offsets"][1]])
               for n, e in header.items() if n != "__metadata__"}  # fmt: skip
    evil = safetensors_io.write(tensors, meta)
    with pytest.raises(PayloadCorrupt, match="declares"):
        bounded("payloads", decode_payload, evil, EXPECTED, compression="zstd")


def test_fuzz_counts_are_positive():
    """Each fuzz target, run here (whatever ran before), sees EXAMPLES inputs, and its inputs
    reach both outcomes: some decode and some are refused. A generator that only ever made
    garbage (or only valid seeds) would pass the targets above while testing little."""
    targets = {
        "records": test_fuzz_record_decoder_raises_only_record_invalid,
        "payloads": test_fuzz_payload_reader_raises_only_payload_corrupt,
        "headers": test_fuzz_safetensors_header_raises_only_payload_corrupt,
    }
    for target, run in targets.items():
        before = Counter(SEEN)
        run()
        seen = SEEN - before
        assert seen[target] >= EXAMPLES, f"{target}: only {seen[target]} inputs"
        assert seen[f"{target}:accepted"] > 0, f"{target}: no input decoded: {dict(seen)}"
        assert seen[f"{target}:refused"] > 0, f"{target}: every input decoded: {dict(seen)}"
        assert seen[f"{target}:accepted"] + seen[f"{target}:refused"] == seen[target]


# ---- members-only runs: signed records and membership entries --------------------------------


def _signed_seeds():
    """A members-only run's policy (bound to its run, its log holding entry 0) and valid signed
    records of it: a snapshot, a lease, a claim, a round record, and entry 0 of the log."""
    from gradientmail_core.mailbox.memory import MemoryMailbox
    from gradientmail_core.protocol.guard import GuardedMailbox
    from gradientmail_core.protocol.identity import Identity
    from gradientmail_core.protocol.members import MemberAuth

    me = Identity.from_seed(b"\x07" * 32)
    mb = MemoryMailbox()
    pol = MemberAuth(identity=me)
    GuardedMailbox(mb, auth=pol)
    name = me.learner_id("a")
    manifest = pol.sign(dataclasses.replace(SEEDS[Manifest], created_by=name))
    ref = PayloadRef(key=keys.snapshot_blob_key(3, name, SHA), sha256=SHA, size=123)
    recs = [
        pol.sign(dataclasses.replace(SEEDS[Snapshot], learner=name, payload=ref, mac=None)),
        pol.sign(dataclasses.replace(SEEDS[Lease], learner=name)),
        pol.sign(dataclasses.replace(SEEDS[Claim], learner=name)),
        pol.sign(dataclasses.replace(SEEDS[RoundRecord], closer=name)),
    ]
    (entry_key,) = mb.list(keys.MEMBERS)
    return pol, manifest, {type(r): (keys_of(r), encode(r)) for r in recs}, (entry_key, mb.get(entry_key))


def keys_of(rec) -> str:
    from gradientmail_core.protocol.auth import record_key

    return record_key(rec)


SIGNED_POLICY, SIGNED_MANIFEST, SIGNED, SIGNED_ENTRY = _signed_seeds()


@st.composite
def signed_inputs(draw):
    """Valid signed records and membership entries, and their mutations (bytes, fields, the
    signature, the signer, the key they are read under), and random bytes."""
    from gradientmail_core.protocol.records import MemberEntry

    kind = draw(st.sampled_from([*SIGNED, MemberEntry]))
    key, data = SIGNED_ENTRY if kind is MemberEntry else SIGNED[kind]
    how = draw(st.sampled_from(["valid", "bytes", "flip", "field", "sig", "signer", "key"]))
    if how == "valid":
        return kind, key, data
    if how == "bytes":
        return kind, key, draw(st.binary(max_size=1024))
    raw = json.loads(data)
    if how == "flip":
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            buf[draw(st.integers(0, len(buf) - 1))] = draw(st.integers(0, 255))
        return kind, key, bytes(buf)
    if how == "field":
        path = draw(st.lists(st.integers(0, 50), min_size=1, max_size=3))
        return kind, key, canonical_json(_set_path(raw, path, draw(json_values)))
    if how == "sig":
        raw["sig"] = draw(st.sampled_from(["00" * 64, raw["sig"][::-1], raw["sig"][:-2] + "00", "zz", None]))
        return kind, key, canonical_json(raw)
    if how == "signer":
        raw["signer"] = draw(st.sampled_from(["11" * 32, "00" * 32, raw["signer"][::-1], "x"]))
        return kind, key, canonical_json(raw)
    other = draw(st.sampled_from([keys.snapshot_key(4, "a-0000000000000000"), keys.round_key(5), keys.MANIFEST,
                                  keys.member_key(1, SHA), keys.lease_key("b", 1), keys.claim_key(3, 2)]))  # fmt: skip
    return kind, other, data


def _read_signed(kind, key, data):
    from gradientmail_core.protocol.members import Membership
    from gradientmail_core.protocol.records import MemberEntry

    if kind is MemberEntry:
        log = Membership(SIGNED_MANIFEST.run_id, SIGNED_MANIFEST.owner)
        return log.check_entry(key, data)
    rec = decode(data, kind, key=key)
    SIGNED_POLICY._tape.clear()  # judged alone, not against the rounds fuzzed before it
    SIGNED_POLICY.verify(rec, key)
    return rec


@FUZZ
@given(signed_inputs())
def test_fuzz_signed_records_and_membership_entries_raise_only_record_invalid(inp):
    kind, key, data = inp
    try:
        bounded("signed", _read_signed, kind, key, data)
    except RecordInvalid:  # SignatureInvalid is one
        return


def test_fuzz_signed_inputs_reach_both_outcomes():
    before = Counter(SEEN)
    test_fuzz_signed_records_and_membership_entries_raise_only_record_invalid()
    seen = SEEN - before
    assert seen["signed"] >= EXAMPLES
    assert seen["signed:accepted"] > 0 and seen["signed:refused"] > 0, dict(seen)
