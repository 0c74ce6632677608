"""Byte shuffle + zstd: lossless, smaller on real weights, and bounded on the way back."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradientmail_core.codec import compress, quant  # noqa: E402
from gradientmail_core.errors import MissingExtra, PayloadCorrupt  # noqa: E402

zstandard = pytest.importorskip("zstandard")


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([1, 2, 4, 8]))
def test_unshuffle_inverts_shuffle_for_any_length(blob: bytes, itemsize: int) -> None:
    planes = compress.shuffle(blob, itemsize)
    assert planes.size == len(blob)
    assert compress.unshuffle(planes, itemsize).tobytes() == blob


def test_shuffle_groups_byte_i_of_every_element_into_plane_i() -> None:
    x = np.array([0x04030201, 0x08070605], np.uint32)
    assert compress.shuffle(x.view(np.uint8), 4).tolist() == [1, 5, 2, 6, 3, 7, 4, 8]


@settings(max_examples=30, deadline=None)
@given(st.binary(max_size=3000), st.sampled_from([1, 2, 4]))
def test_decompress_inverts_compress(blob: bytes, itemsize: int) -> None:
    frame = compress.compress(blob, itemsize)
    assert compress.decompress(frame, itemsize, len(blob)).tobytes() == blob


def test_compress_is_deterministic() -> None:
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    assert compress.compress(x, 4) == compress.compress(x.copy(), 4)


def test_decompress_refuses_a_frame_declaring_more_than_the_cap() -> None:
    frame = compress.compress(bytes(10 << 20), 1)  # 10 MiB of zeros: a tiny frame
    assert len(frame) < 4096
    with pytest.raises(PayloadCorrupt, match="above the cap"):
        compress.decompress(frame, 1, 1 << 20)


def test_decompress_refuses_a_frame_without_a_declared_size() -> None:
    cctx = zstandard.ZstdCompressor(write_content_size=False)
    with cctx.stream_writer(out := _Sink(), closefd=False) as w:
        w.write(b"abc" * 100)
    with pytest.raises(PayloadCorrupt, match="content size"):
        compress.decompress(out.data, 1, 1 << 20)


class _Sink:
    def __init__(self) -> None:
        self.data = b""

    def write(self, b: bytes) -> int:
        self.data += bytes(b)
        return len(b)


@pytest.mark.parametrize(
    "mangle",
    [lambda f: f + b"junk", lambda f: f[:-5], lambda f: b"\0" * len(f), lambda f: b"", lambda f: f + f],
    ids=["trailing", "truncated", "garbage", "empty", "two-frames"],
)
def test_decompress_refuses_anything_but_one_valid_frame(mangle: object) -> None:
    frame = compress.compress(np.arange(1000, dtype=np.float32), 4)
    with pytest.raises(PayloadCorrupt):
        compress.decompress(mangle(frame), 4, 1 << 20)  # type: ignore[operator]


def test_missing_zstandard_is_a_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)  # makes `import zstandard` fail
    with pytest.raises(MissingExtra, match=r"gradientmail\[zstd\]"):
        compress.compress(b"abc", 1)


def trained_mlp_weights() -> list[np.ndarray]:
    """A small MLP trained for a few hundred steps: weights with realistic statistics."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead (and fight other tests)
    try:
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.GELU(),
            torch.nn.Linear(256, 256),
            torch.nn.GELU(),
            torch.nn.Linear(256, 10),
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(256, 64)
        y = (x[:, :10] * torch.arange(1, 11)).argmax(1)
        for _ in range(200):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    # Training replaced the initial values (whose low mantissa bits, from the uniform RNG,
    # would compress unrealistically well).
    assert float(loss.detach()) < 0.05
    return [p.detach().numpy().copy() for p in model.parameters()]


def test_zstd_shrinks_trained_weights_and_round_trips_exactly() -> None:
    ws = trained_mlp_weights()
    # Targets (SPEC 4.4): 16% for fp32, 31% for bf16 on GPT-2; this MLP gives 16.9% and 33.7%.
    for dtype, at_least in (("F32", 0.15), ("BF16", 0.30)):
        stored = [quant.quantize(w, dtype).data for w in ws]
        raw = sum(a.nbytes for a in stored)
        frames = [compress.compress(a, a.dtype.itemsize) for a in stored]
        assert 1 - sum(map(len, frames)) / raw >= at_least, dtype
        # The byte shuffle is what makes floats compress.
        unshuffled = sum(len(compress.compress(a, 1)) for a in stored)
        assert sum(map(len, frames)) < unshuffled
        for a, f in zip(stored, frames):
            back = compress.decompress(f, a.dtype.itemsize, a.nbytes)
            assert back.tobytes() == a.tobytes()
            assert back.flags.writeable
