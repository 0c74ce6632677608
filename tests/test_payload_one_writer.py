"""One writer and one reader of the payload format (``codec/payload.py``): ``encode_payload`` and
``decode_payload`` run them over whole bytes, and with ``stream=True`` / parts over parts. The bytes are the ones the codec has always written (pinned in
``golden/payload_bytes.json``, made by the two writers before they were one), whatever the
threads and piece sizes, and the two readers accept and refuse the same bytes."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradientmail_core.codec import payload, plan, quant
from gradientmail_core.errors import PayloadCorrupt

DTYPES = ["F32", "BF16", "F16", "F8_E4M3", "F4", "I2"]
CODECS = ["", "zstd"]
GOLDEN = Path(__file__).parent / "golden" / "payload_bytes.json"
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Names from an alphabet where "w!" sorts between "w" and "w#scale": a scaled tensor's data and
# scale are then not neighbours in the file, and the writer must hold the one for the other.
names_st = st.lists(st.sampled_from(["w", "w!", "w.b", "a/x", "z", "m0"]), min_size=1, max_size=5, unique=True)
shape_st = st.lists(st.integers(0, 9), max_size=3).map(tuple)


@st.composite
def payloads(draw: st.DrawFn) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Random tensors (some with zeros, NaN, infinities, tiny and huge values) and a dtype each."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tensors, dtypes = {}, {}
    for name in draw(names_st):
        shape = draw(shape_st)
        x = (rng.standard_normal(shape) * 10.0 ** draw(st.integers(-30, 30))).astype(np.float32)
        if x.size and draw(st.booleans()):
            flat = x.reshape(-1)
            flat[rng.integers(0, x.size, 3)] = [np.nan, np.inf, 0.0][draw(st.integers(0, 2))]
        tensors[name], dtypes[name] = x, draw(st.sampled_from(DTYPES))
    return tensors, dtypes


@contextlib.contextmanager
def threads_and_small_pieces() -> Iterator[None]:
    """Every pass on three threads, whatever the size, and pieces of a few elements."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(payload, "PARALLEL_BYTES", 0)
        mp.setattr(payload, "WORKERS", 3)
        mp.setattr(payload, "PIECE", 24)
        yield


# ---------------------------------------------------------------------------------------------
# The same bytes


@PROPERTY
@given(payloads(), st.sampled_from(CODECS), st.booleans())
def test_the_one_shot_bytes_are_the_stream_bytes(p, codec: str, one_dtype: bool) -> None:
    tensors, dtypes = p
    dtypes = next(iter(dtypes.values())) if one_dtype else dtypes
    one = payload.encode_payload(tensors, dtypes, kind="delta", compression=codec)
    with payload.encode_payload(tensors, dtypes, kind="delta", compression=codec, stream=True) as s:
        assert (s.size, s.sha256) == (len(one), hashlib.sha256(one).hexdigest())
        assert s.read() == one
    quantized = {n: quant.quantize(x, dtypes if isinstance(dtypes, str) else dtypes[n]) for n, x in tensors.items()}
    assert payload.encode_payload(quantized, kind="delta", compression=codec) == one
    assert payload.encode_payload(quantized, kind="delta", compression=codec, stream=True).read() == one


@PROPERTY
@given(payloads(), st.sampled_from(CODECS))
def test_threads_and_piece_sizes_change_no_byte(p, codec: str) -> None:
    tensors, dtypes = p
    one = payload.encode_payload(tensors, dtypes, kind="delta", compression=codec)
    shapes = {n: x.shape for n, x in tensors.items()}
    want = payload.decode_payload(one, shapes, compression=codec)
    with threads_and_small_pieces():
        assert payload.encode_payload(tensors, dtypes, kind="delta", compression=codec) == one
        assert payload.encode_payload(tensors, dtypes, kind="delta", compression=codec, stream=True).read() == one
        got = payload.decode_payload(one, shapes, compression=codec)
        # The threaded reader over parts that cut pieces and tensors anywhere.
        parts = [one[i : i + 37] for i in range(0, len(one), 37)]
        sha = hashlib.sha256(one).hexdigest()
        streamed = payload._decode(parts, shapes, len(one), sha, codec, None, None, None, "k", payload.Budget(3, 24))
    for name in tensors:
        np.testing.assert_array_equal(got[name], want[name])
        np.testing.assert_array_equal(streamed[name], want[name])


def values(n: int, seed: int) -> np.ndarray:
    # Integer arithmetic (exact everywhere), then one correctly rounded scaling per element.
    k = (np.arange(n, dtype=np.uint64) + np.uint64(seed)) * np.uint64(2654435761) % np.uint64(2**32)
    x = ((k % np.uint64(20001)).astype(np.int64) - 10000).astype(np.float64) * (10.0 ** (seed % 5 - 3))
    x = x.astype(np.float32)
    if n > 7:
        x[3], x[5], x[7] = np.float32(0.0), np.float32(-0.0), np.float32(1e-30)
    return x


def golden_tensors() -> dict[str, np.ndarray]:
    shapes = {"w": (40, 17), "w!": (33,), "layers.0.bias": (70,), "scalar": (), "empty": (0, 3), "m/emb": (5, 64)}
    return {name: values(int(np.prod(s)), i).reshape(s) for i, (name, s) in enumerate(shapes.items())}


def golden_special() -> dict[str, np.ndarray]:
    x = values(96, 9)
    x[10], x[40], x[70] = np.nan, np.inf, -np.inf
    return {"special": x}


@pytest.mark.parametrize("threaded", [False, True])
def test_payload_bytes_are_the_ones_the_codec_has_always_written(threaded: bool) -> None:
    golden = json.loads(GOLDEN.read_text())
    got = {}
    with threads_and_small_pieces() if threaded else contextlib.nullcontext():
        for dtype in DTYPES:
            t = golden_tensors()
            got[f"whole {dtype}"] = hashlib.sha256(payload.encode_payload(t, dtype, kind="delta")).hexdigest()
            special = payload.encode_payload(golden_special(), dtype, kind="theta")
            got[f"special {dtype}"] = hashlib.sha256(special).hexdigest()
            shapes = {n: v.shape for n, v in t.items()}
            for s in plan.chunk_specs(shapes, 256):
                chunk = payload.encode_payload(t, dtype, kind="theta", chunk=s, stream=True)
                got[f"chunk {s.k}/{s.n} {dtype}"] = chunk.sha256
    assert got == golden


# ---------------------------------------------------------------------------------------------
# One reader: the same bytes accepted and refused alike


@PROPERTY
@given(payloads(), st.sampled_from(CODECS), st.data())
def test_the_one_shot_and_the_stream_reader_agree_on_any_damage(p, codec: str, data: st.DataObject) -> None:
    tensors, dtypes = p
    good = payload.encode_payload(tensors, dtypes, kind="delta", compression=codec)
    damage = data.draw(st.sampled_from(["flip", "cut", "extend", "header length"]))
    bad = bytearray(good)
    if damage == "flip":
        at = data.draw(st.integers(0, len(bad) - 1))
        bad[at] ^= 1 << data.draw(st.integers(0, 7))
    elif damage == "cut":
        bad = bad[: data.draw(st.integers(0, len(bad) - 1))]
    elif damage == "extend":
        bad += b"\0" * data.draw(st.integers(1, 9))
    else:
        bad[:8] = data.draw(st.sampled_from([0, 1, 10**9, len(bad), 2**63])).to_bytes(8, "little")
    shapes = {n: x.shape for n, x in tensors.items()}
    outcomes = []
    for read in ("whole", "stream"):
        try:
            if read == "whole":
                got = payload.decode_payload(bytes(bad), shapes, compression=codec)
            else:
                got = payload.decode_payload(
                    [bad[i : i + 50] for i in range(0, len(bad), 50)],
                    shapes,
                    size=len(bad),
                    sha256=hashlib.sha256(bad).hexdigest(),  # intact, as far as the hash can tell
                    compression=codec,
                    key="blobs/k",
                )
            outcomes.append(("decoded", {n: v.tobytes() for n, v in got.items()}))
        except PayloadCorrupt as e:
            outcomes.append((type(e).__name__, str(e).removeprefix("blobs/k: ")))
    assert outcomes[0] == outcomes[1]


def test_a_stream_names_its_key_when_its_framing_is_broken() -> None:
    good = payload.encode_payload({"w": np.ones(8, np.float32)}, "F32", kind="delta")
    bad = (10**9).to_bytes(8, "little") + good[8:]
    with pytest.raises(PayloadCorrupt, match=r"^safetensors header length is 1000000000 bytes"):
        payload.decode_payload(bad, {"w": (8,)})
    with pytest.raises(PayloadCorrupt, match=r"^blobs/k: safetensors header length is 1000000000 bytes"):
        payload.decode_payload([bad], {"w": (8,)}, size=len(bad), sha256=hashlib.sha256(bad).hexdigest(), key="blobs/k")
