"""Payload streams: the same bytes as the one-shot encoder, produced in bounded memory, and a
download that is decoded as it arrives but accepted only whole and hashing to its reference."""

from __future__ import annotations

import hashlib
import random
import tracemalloc
from collections.abc import Iterable, Iterator

import numpy as np
import pytest

from gradientmail_core.codec import compress, payload, quant
from gradientmail_core.errors import MailboxUnavailable, PayloadCorrupt, PayloadLayoutMismatch
from gradientmail_core.mailbox import Chunk, memory
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol import store as store_module
from gradientmail_core.protocol.records import PayloadRef
from gradientmail_core.protocol.store import RunStore
from gradientmail_sim.faults import Fault, FaultyMailbox

CODECS = ["", "zstd"]


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "layers.0.weight": rng.standard_normal((300, 70)).astype(np.float32),
        "layers.0.bias": rng.standard_normal(70).astype(np.float32),
        "layers.0": rng.standard_normal((33, 7)).astype(np.float32),  # sorts before its '.'-named peers
        "momentum/embed": rng.standard_normal((64, 32)).astype(np.float32) * 1e-3,
        "scalar": np.array(-2.5, np.float32),
        "empty": np.zeros((0, 3), np.float32),
    }


def shapes(t: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {k: v.shape for k, v in t.items()}


def pieces(data: bytes, size: int = 777) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload, "PIECE", 1000)  # tensors span several pieces


# ---------------------------------------------------------------------------------------------
# The same bytes


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", quant.DTYPES)
def test_streamed_payload_is_the_one_shot_payload_byte_for_byte(dtype: str, codec: str) -> None:
    t = tensors()
    one = payload.encode_payload(t, dtype, kind="delta", compression=codec)
    with payload.encode_payload(t, dtype, kind="delta", compression=codec, stream=True) as s:
        assert (s.size, s.sha256) == (len(one), hashlib.sha256(one).hexdigest())
        assert s.read() == one
        assert s.read() == one  # produced again, the same
    quantized = {n: quant.quantize(x, dtype) for n, x in t.items()}
    assert payload.encode_payload(quantized, kind="delta", compression=codec, stream=True).read() == one


@pytest.mark.parametrize("codec", CODECS)
def test_streamed_payload_of_mixed_dtypes_is_the_one_shot_payload(codec: str) -> None:
    t = tensors(1)
    dtypes = dict(zip(t, ["F32", "BF16", "F8_E4M3", "F4", "F16", "BF16"], strict=True))
    one = payload.encode_payload(t, dtypes, kind="theta", compression=codec)
    assert payload.encode_payload(t, dtypes, kind="theta", compression=codec, stream=True).read() == one


def test_multithreaded_zstd_writes_the_same_bytes_for_any_thread_count() -> None:
    rng = np.random.default_rng(2)
    blob = (rng.standard_normal(compress.MT_BYTES // 4 + 1000) * 0.02).astype(np.float32)
    frames = {compress.compress(blob, 4, threads=n) for n in (1, 2, 3)}
    assert len(frames) == 1
    assert compress.compress(blob, 4) in frames  # the size picks the multi-threaded mode
    assert compress.decompress(frames.pop(), 4, blob.nbytes).tobytes() == blob.tobytes()
    # and the single-threaded mode's frame of the same bytes reads back the same
    assert compress.decompress(compress.compress(blob, 4, threads=0), 4, blob.nbytes).tobytes() == blob.tobytes()


# ---------------------------------------------------------------------------------------------
# Reading as parts arrive


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", ["F32", "BF16", "F8_E4M3", "F4"])
def test_stream_decodes_like_the_one_shot_decoder(dtype: str, codec: str) -> None:
    t = tensors()
    data = payload.encode_payload(t, dtype, kind="delta", compression=codec)
    sha = hashlib.sha256(data).hexdigest()
    want = payload.decode_payload(data, shapes(t), compression=codec)
    got = payload.decode_payload(pieces(data), shapes(t), size=len(data), sha256=sha, compression=codec)
    assert list(got) == list(t)
    for name in t:
        np.testing.assert_array_equal(got[name], want[name])


def test_tensors_are_decoded_before_the_last_part_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    t = tensors()
    data = payload.encode_payload(t, "BF16", kind="delta")
    events: list[str] = []
    dequantize = quant.dequantize

    def spy(q: quant.QTensor) -> np.ndarray:
        events.append("decode")
        return dequantize(q)

    monkeypatch.setattr(quant, "dequantize", spy)

    def parts() -> Iterator[bytes]:
        for p in pieces(data):
            events.append("part")
            yield p

    payload.decode_payload(parts(), shapes(t), size=len(data), sha256=hashlib.sha256(data).hexdigest())
    assert "decode" in events[: len(events) - events[::-1].index("part") - 1]  # some decode before the last part


# ---------------------------------------------------------------------------------------------
# Nothing half-written or damaged is accepted


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    "damage",
    ["cut short", "one byte flipped in a tensor", "one byte flipped in the header", "wrong sha256", "too long"],
)
def test_damaged_stream_is_rejected_with_payload_corrupt(damage: str, codec: str) -> None:
    t = tensors()
    data = payload.encode_payload(t, "BF16", kind="delta", compression=codec)
    sha, size = hashlib.sha256(data).hexdigest(), len(data)
    sent = {
        "cut short": data[: len(data) - 5],
        "one byte flipped in a tensor": flip(data, len(data) - 3),
        "one byte flipped in the header": flip(data, 40),
        "wrong sha256": data,
        "too long": data + b"\0",
    }[damage]
    if damage == "wrong sha256":
        sha = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(PayloadCorrupt):
        payload.decode_payload(pieces(sent), shapes(t), size=size, sha256=sha, compression=codec)


def test_intact_payload_of_other_tensors_is_a_layout_mismatch_and_a_damaged_one_corrupt() -> None:
    t = tensors()
    other = dict(t, extra=np.ones(3, np.float32))
    data = payload.encode_payload(other, "F32", kind="delta")
    sha = hashlib.sha256(data).hexdigest()
    with pytest.raises(PayloadLayoutMismatch):
        payload.decode_payload(pieces(data), shapes(t), size=len(data), sha256=sha)
    with pytest.raises(PayloadCorrupt) as e:
        payload.decode_payload(pieces(flip(data, len(data) - 1)), shapes(t), size=len(data), sha256=sha)
    assert not isinstance(e.value, PayloadLayoutMismatch)


def put(store: RunStore, s: payload.PayloadStream) -> PayloadRef:
    return store.put_payload(lambda sha: keys.snapshot_blob_key(3, "a", sha, ""), s)


def test_store_round_trips_a_stream_and_refuses_damaged_bytes() -> None:
    t = tensors()
    mailbox = MemoryMailbox()
    store = RunStore(mailbox)
    ref = put(store, payload.encode_payload(t, "BF16", kind="delta", stream=True))
    assert mailbox.get(ref.key) == payload.encode_payload(t, "BF16", kind="delta")
    got = store.get_payload(ref, shapes(t))
    assert got is not None and all(np.array_equal(got[n], quant.dequantize(quant.quantize(t[n], "BF16"))) for n in t)
    assert store.bytes_up == store.bytes_down == ref.size
    bad = PayloadRef(key=ref.key, sha256=hashlib.sha256(b"x").hexdigest(), size=ref.size)
    with pytest.raises(PayloadCorrupt):
        store.get_payload(bad, shapes(t))
    with pytest.raises(PayloadCorrupt):  # a reference declaring one byte more: cut short
        store.get_payload(PayloadRef(key=ref.key, sha256=ref.sha256, size=ref.size + 1), shapes(t))
    assert (
        store.get_payload(PayloadRef(key=keys.snapshot_blob_key(3, "a", "0" * 64, ""), sha256="0" * 64, size=9), {})
        is None
    )


def test_stream_whose_input_changes_before_the_upload_is_not_written() -> None:
    t = tensors()
    mailbox = MemoryMailbox()
    s = payload.encode_payload(t, "F32", kind="delta", stream=True)  # hashed now
    t["layers.0.bias"][0] += 1.0  # then the input changes underneath
    with pytest.raises(PayloadCorrupt, match="not written"):
        put(RunStore(mailbox), s)
    assert mailbox.list("blobs/") == []


# ---------------------------------------------------------------------------------------------
# Bounded memory


def peak_while(fn: object) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def drain(s: payload.PayloadStream) -> None:
    for _ in s.chunks():
        pass


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F8_E4M3"])
def test_encoding_a_64mb_payload_holds_pieces_not_the_payload(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    monkeypatch.setattr(payload, "PIECE", 1 << 20)
    rng = np.random.default_rng(3)
    t = {f"w{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(16)}  # 16 x 4 MiB
    encoded = len(payload.encode_payload(t, dtype, kind="delta"))
    peak = peak_while(lambda: drain(payload.encode_payload(t, dtype, kind="delta", stream=True)))
    # A few pieces, or one tensor's quantized form for a whole-tensor scale: never the payload.
    assert peak < 6 << 20, (peak, encoded)
    assert encoded >= 16 << 20


def test_encoding_a_zstd_payload_spools_beyond_its_memory_allowance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload, "SPOOL_MEMORY", 1 << 20)
    monkeypatch.setattr(payload, "WORKERS", 1)
    rng = np.random.default_rng(4)
    t = {f"w{i}": rng.standard_normal(1 << 19).astype(np.float32) for i in range(16)}  # 16 x 2 MiB
    encoded = len(payload.encode_payload(t, "F32", kind="delta", compression="zstd"))

    def run() -> None:
        with payload.encode_payload(t, "F32", kind="delta", compression="zstd", stream=True) as s:
            drain(s)

    peak = peak_while(run)
    assert peak < encoded // 2, (peak, encoded)  # one-shot: the blobs and their joined copy, 2x encoded


def test_decoding_a_64mb_payload_holds_its_output_and_pieces() -> None:
    rng = np.random.default_rng(5)
    t = {f"w{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(16)}
    data = payload.encode_payload(t, "F32", kind="delta")
    parts = pieces(data, 1 << 20)
    sha = hashlib.sha256(data).hexdigest()
    peak = peak_while(lambda: payload.decode_payload(iter(parts), shapes(t), size=len(data), sha256=sha))
    assert peak < len(data) + (8 << 20)  # the float32 output itself, plus a few pieces (one-shot: 2x)


def test_decoding_tensors_whole_in_large_parts_lets_each_part_go() -> None:
    # Parts larger than a tensor (a file or S3 read of 8 MiB): tensors whose bytes are all in one
    # part are decoded in one go, and a part is let go once its tensors are decoded, not kept
    # while the next part's arrive (that held one part more: 19.8 MiB over the output here).
    rng = np.random.default_rng(6)
    t = {f"w{i}": rng.standard_normal(1_562_000).astype(np.float32) for i in range(4)}
    data = payload.encode_payload(t, "F32", kind="delta")
    part = 8 << 20

    def parts() -> Iterator[bytes]:
        view = memoryview(data)
        for i in range(0, len(data), part):
            yield bytes(view[i : i + part])  # each a fresh buffer, as a mailbox's reads are

    sha = hashlib.sha256(data).hexdigest()
    peak = peak_while(lambda: payload.decode_payload(parts(), shapes(t), size=len(data), sha256=sha))
    assert peak < len(data) + 2 * part, (peak - len(data)) / 2**20  # the output, the part read and the next


# ---------------------------------------------------------------------------------------------
# Through the store, with faults in the parts


def faulty(*rules: Fault) -> tuple[MemoryMailbox, RunStore]:
    inner = MemoryMailbox()
    return inner, RunStore(FaultyMailbox(inner, list(rules), rng=random.Random(0)))


def test_a_part_upload_failing_leaves_nothing_and_a_retry_writes_the_payload() -> None:
    t = tensors()
    inner, store = faulty(Fault(kind="error", ops=("put",), part=2, times=1))
    s = payload.encode_payload(t, "F32", kind="delta", stream=True)
    with pytest.raises(MailboxUnavailable):
        put(store, s)
    assert inner.list("blobs/") == []
    ref = put(store, s)  # the next poll tries again
    assert inner.get(ref.key) == payload.encode_payload(t, "F32", kind="delta")


@pytest.mark.parametrize("kind", ["error", "flip"])
def test_a_download_reset_or_damaged_mid_way_is_not_accepted(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "STREAM_PART", 1000)  # parts of 1000 bytes: chunk 1 is mid-way
    t = tensors()
    inner, store = faulty(Fault(kind=kind, ops=("get",), part=1, times=1))  # type: ignore[arg-type]
    ref = RunStore(inner).put_payload(
        lambda sha: keys.snapshot_blob_key(3, "a", sha, ""), payload.encode_payload(t, "F32", kind="delta")
    )
    with pytest.raises(MailboxUnavailable if kind == "error" else PayloadCorrupt):
        store.get_payload(ref, shapes(t))
    got = store.get_payload(ref, shapes(t))  # read again: whole and intact
    assert got is not None and all(np.array_equal(got[n], t[n]) for n in t)


def test_large_bytes_payloads_are_streamed_and_small_ones_put_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "STREAM_BYTES", 4096)
    monkeypatch.setattr(store_module, "PUT_PIECE", 1000)
    calls: list[tuple[str, int]] = []

    class Spy(MemoryMailbox):
        def put_if_absent(self, key: str, data: bytes) -> bool:
            calls.append(("put_if_absent", 1))
            return super().put_if_absent(key, data)

        def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
            parts = list(chunks)
            calls.append(("put_stream", len(parts)))
            return super().put_stream(key, parts, create_once=create_once)

    inner = Spy()
    store = RunStore(inner)
    big = payload.encode_payload(tensors(), "F32", kind="delta")
    small = payload.encode_payload({"x": np.ones(3, np.float32)}, "F32", kind="delta")
    refs = [store.put_payload(lambda sha: keys.snapshot_blob_key(3, "a", sha, ""), d) for d in (big, small)]
    assert [inner.get(ref.key) for ref in refs] == [big, small]
    assert calls == [("put_stream", -(-len(big) // 1000)), ("put_if_absent", 1)]
