"""Payload codec throughput and zstd size on realistic weights.

Trains a small character-level transformer in torch on Python's standard library source for
a short while, takes its weights, and prints, per storage dtype, the encode (quantize +
serialize) and decode throughput in GB/s of fp32 input, side by side with a plain memory copy
of the same bytes measured in the same run; then the zstd size reduction and speed for fp32
and bf16 weights; then zstd on one large tensor (the weights tiled to ``--mt-mb``) single-threaded
against zstd's multi-threaded mode (``--threads``); then the streaming encoder
(``encode_payload(..., stream=True)``: hash pass + upload pass) against the one-shot one. Not a test: run
``python bench/codec.py`` (``--synthetic`` skips the training: random weights, sizes only).
"""

from __future__ import annotations

import argparse
import glob
import os
import time
from collections.abc import Callable

import numpy as np

from gradientmail_core.codec import compress, payload, quant


def corpus(limit: int) -> bytes:
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    out = bytearray()
    for path in files:
        with open(path, "rb") as f:
            out += f.read()
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def train_weights(d_model: int, layers: int, steps: int, seconds: float, seed: int) -> dict[str, np.ndarray]:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    torch.set_num_threads(os.cpu_count() or 1)
    text = torch.tensor(list(corpus(4 << 20)), dtype=torch.long)
    ctx, batch = 128, 8

    class CharLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(256, d_model)
            self.pos = nn.Embedding(ctx, d_model)
            layer = nn.TransformerEncoderLayer(
                d_model, max(1, d_model // 64), 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))

    model = CharLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    t0 = time.perf_counter()
    loss = float("nan")
    done = 0
    while done < steps:
        done += 1
        idx = torch.randint(0, len(text) - ctx - 1, (batch,))
        x = torch.stack([text[i : i + ctx] for i in idx])
        y = torch.stack([text[i + 1 : i + ctx + 1] for i in idx])
        logits = model(x)
        loss_t = nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss_t.backward()
        opt.step()
        loss = float(loss_t.detach())
        if time.perf_counter() - t0 > seconds:
            break
    n = sum(p.numel() for p in model.parameters())
    print(
        f"trained a {layers}-layer d={d_model} char transformer ({n / 1e6:.1f}M params) "
        f"for {done} steps in {time.perf_counter() - t0:.0f}s, loss {loss:.2f}"
    )
    return {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}


CLOCK: Callable[[], float] = time.perf_counter


def best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=60.0, help="training time budget")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time, steadier on a shared machine (use with --workers 1)",
    )
    ap.add_argument("--workers", type=int, default=payload.WORKERS, help="threads encoding/decoding tensors")
    ap.add_argument("--threads", default="0,1,2,4,8", help="zstd thread counts for the large tensor (0: single mode)")
    ap.add_argument("--mt-mb", type=int, default=256, help="size of the large tensor (MB of fp32)")
    ap.add_argument("--synthetic", action="store_true", help="random weights instead of a trained model")
    ap.add_argument("--only", choices=("all", "threads", "stream"), default="all", help="run one section")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    payload.WORKERS = args.workers

    if args.synthetic:
        rng = np.random.default_rng(args.seed)
        d = args.d_model
        weights = {f"blocks.{i}.{n}": (rng.standard_normal(shape) * 0.02).astype(np.float32)
                   for i in range(args.layers) for n, shape in (("attn", (3 * d, d)), ("mlp", (4 * d, d)))}  # fmt: skip
    else:
        weights = train_weights(args.d_model, args.layers, args.steps, args.seconds, args.seed)
    if args.only == "threads":
        zstd_threads(weights, args)
        return
    if args.only == "stream":
        streaming(weights, args)
        return
    shapes = {k: v.shape for k, v in weights.items()}
    nbytes = sum(v.nbytes for v in weights.values())
    gb = nbytes / 1e9
    print(
        f"{len(weights)} tensors, {nbytes / 1e6:.1f} MB of fp32; {args.clock} clock, {args.workers} worker(s), "
        f"best of {args.repeat}\n"
    )

    # The baseline: copying the same fp32 bytes, as numpy arrays and as Python bytes.
    dst = {k: np.empty_like(v) for k, v in weights.items()}

    def copy_all() -> None:
        for k, v in weights.items():
            np.copyto(dst[k], v)

    t_copy = best_of(copy_all, args.repeat)
    # An encoder must produce a fresh buffer, and first-touching fresh pages is part of its
    # cost (a large allocation is always fresh memory): the bytes copy pays it too.
    whole = b"".join(v.tobytes() for v in weights.values())
    t_bytes = best_of(lambda: bytearray(whole), args.repeat)
    print(
        f"memory copy of the same bytes: np.copyto into existing arrays {gb / t_copy:.2f} GB/s, "
        f"into a fresh buffer (bytearray) {gb / t_bytes:.2f} GB/s\n"
    )

    print(
        f"{'dtype':<9} {'bytes':>9} {'encode GB/s':>12} {'/copyto':>8} {'/bytes':>7} "
        f"{'decode GB/s':>12} {'/copyto':>8} {'/bytes':>7} {'max abs err / amax':>19}"
    )
    for dtype in quant.DTYPES:
        data = payload.encode_payload(weights, dtype, kind="bench")
        t_enc = best_of(lambda: payload.encode_payload(weights, dtype, kind="bench"), args.repeat)  # noqa: B023
        t_dec = best_of(lambda: payload.decode_payload(data, shapes), args.repeat)  # noqa: B023
        out = payload.decode_payload(data, shapes)
        err = max(float(np.max(np.abs(out[k] - v)) / max(float(np.max(np.abs(v))), 1e-30)) for k, v in weights.items())
        print(
            f"{dtype:<9} {len(data) / 1e6:>7.1f}MB {gb / t_enc:>12.2f} {t_copy / t_enc:>8.3f} {t_bytes / t_enc:>7.3f} "
            f"{gb / t_dec:>12.2f} {t_copy / t_dec:>8.3f} {t_bytes / t_dec:>7.3f} {err:>19.2e}"
        )

    print("\nzstd per tensor (GB/s of uncompressed bytes, shuffle included; 'smaller' is the size reduction):")
    print(
        f"{'dtype':<6} {'variant':<22} {'raw MB':>8} {'zstd MB':>8} {'smaller':>8} {'compress GB/s':>14} {'decompress GB/s':>16}"
    )
    for dtype in ("F32", "BF16"):
        stored = [quant.quantize(v, dtype).data for v in weights.values()]
        raw = sum(a.nbytes for a in stored)
        item = stored[0].dtype.itemsize
        for variant, level, shuffle_by in (
            ("shuffle + tuned", None, item),
            ("shuffle + level 3", 3, item),
            ("no shuffle, tuned", None, 1),
        ):
            frames = [compress.compress(a, shuffle_by, level=level) for a in stored]
            t_c = best_of(lambda: [compress.compress(a, shuffle_by, level=level) for a in stored], args.repeat)  # noqa: B023
            t_d = best_of(
                lambda: [compress.decompress(f, shuffle_by, a.nbytes) for f, a in zip(frames, stored)],  # noqa: B023
                args.repeat,
            )
            size = sum(map(len, frames))
            print(
                f"{dtype:<6} {variant:<22} {raw / 1e6:>8.1f} {size / 1e6:>8.1f} {1 - size / raw:>8.1%} "
                f"{raw / 1e9 / t_c:>14.2f} {raw / 1e9 / t_d:>16.2f}"
            )
        # The whole payload: quantize + compress + serialize, with the codec's worker threads.
        plain = len(payload.encode_payload(weights, dtype, kind="bench"))
        zst_data = payload.encode_payload(weights, dtype, kind="bench", compression="zstd")
        t_c = best_of(lambda: payload.encode_payload(weights, dtype, kind="bench", compression="zstd"), args.repeat)  # noqa: B023
        t_d = best_of(lambda: payload.decode_payload(zst_data, shapes, compression="zstd"), args.repeat)  # noqa: B023
        print(
            f"{dtype:<6} {'payload encode/decode':<22} {plain / 1e6:>8.1f} {len(zst_data) / 1e6:>8.1f} "
            f"{1 - len(zst_data) / plain:>8.1%} {raw / 1e9 / t_c:>14.2f} {raw / 1e9 / t_d:>16.2f}"
        )

    zstd_threads(weights, args)
    streaming(weights, args)


def zstd_threads(weights: dict[str, np.ndarray], args: argparse.Namespace) -> None:
    """One large tensor: zstd's single-threaded mode against its multi-threaded one."""
    flat = np.concatenate([v.reshape(-1) for v in weights.values()])
    big = np.resize(flat, args.mt_mb * (1 << 20) // 4)  # tiled: trained bytes, any size
    print(f"\nzstd on one {big.nbytes / 1e6:.0f} MB tensor ({os.cpu_count()} CPUs; GB/s of uncompressed bytes):")
    print(
        f"{'dtype':<6} {'threads':>8} {'zstd MB':>8} {'compress GB/s':>14} {'decompress GB/s':>16} {'same bytes':>11}"
    )
    for dtype in ("F32", "BF16"):
        data = quant.quantize(big, dtype).data
        item = data.dtype.itemsize
        frames = {}
        for n in (int(x) for x in args.threads.split(",")):
            frame = compress.compress(data, item, threads=n)
            t_c = best_of(lambda: compress.compress(data, item, threads=n), args.repeat)  # noqa: B023
            t_d = best_of(lambda: compress.decompress(frame, item, data.nbytes), args.repeat)  # noqa: B023
            mode = "mt" if n else "st"
            same = frames.setdefault(mode, frame) == frame
            print(
                f"{dtype:<6} {n:>8} {len(frame) / 1e6:>8.1f} {data.nbytes / 1e9 / t_c:>14.2f} "
                f"{data.nbytes / 1e9 / t_d:>16.2f} {'yes' if same else 'NO':>11}"
            )


def streaming(weights: dict[str, np.ndarray], args: argparse.Namespace) -> None:
    """The streaming encoder (hash pass, then the bytes again) against the one-shot encoder."""
    gb = sum(v.nbytes for v in weights.values()) / 1e9
    print("\nstreaming encode (GB/s of fp32 input; stream = hash pass + upload pass, both counted):")
    print(f"{'dtype':<9} {'codec':<5} {'one-shot':>9} {'stream':>7} {'same bytes':>11}")
    for dtype, codec in (("F32", ""), ("BF16", ""), ("F8_E4M3", ""), ("BF16", "zstd")):

        def streamed() -> None:
            with payload.encode_payload(weights, dtype, kind="bench", compression=codec, stream=True) as s:  # noqa: B023
                for _ in s.chunks():
                    pass

        one = payload.encode_payload(weights, dtype, kind="bench", compression=codec)
        same = payload.encode_payload(weights, dtype, kind="bench", compression=codec, stream=True).read() == one
        t_one = best_of(lambda: payload.encode_payload(weights, dtype, kind="bench", compression=codec), args.repeat)  # noqa: B023
        t_stream = best_of(streamed, args.repeat)
        print(f"{dtype:<9} {codec or '-':<5} {gb / t_one:>9.2f} {gb / t_stream:>7.2f} {'yes' if same else 'NO':>11}")


if __name__ == "__main__":
    main()
