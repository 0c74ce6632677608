"""A small character-level transformer, and text every Python install ships: its own standard
library's source files. Used by ``examples/demo.py``; copy it for your own experiments.

    text = stdlib_text()                   # {"train": str, "heldout": str}
    model = CharTransformer(SIZES["demo"])
    x, y = sample_batch(encode(text["train"]), batch=16, block=64, generator=g)
    loss = model.loss(x, y)

Characters are 7-bit ASCII (anything else becomes '?'), so the vocabulary is 128 symbols and
an untrained model's loss is about ln(128) = 4.85 nats per character.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 128


@dataclass(frozen=True)
class Size:
    layers: int
    width: int
    heads: int
    block: int  # context length in characters


SIZES = {
    "demo": Size(layers=2, width=64, heads=4, block=64),
    "quick": Size(layers=1, width=32, heads=2, block=32),
}


# ---- data ------------------------------------------------------------------------------------


def stdlib_text(max_chars: int = 3_000_000, heldout_every: int = 10) -> dict[str, str]:
    """The top-level ``.py`` files of the standard library, in name order; every
    ``heldout_every``-th file is held out, so the held-out text is code the model never saw."""
    root = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    train: list[str] = []
    heldout: list[str] = []
    total = 0
    for i, name in enumerate(names):
        try:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        (heldout if i % heldout_every == heldout_every - 1 else train).append(text)
        total += len(text)
        if total >= max_chars:
            break
    return {"train": "\n".join(train), "heldout": "\n".join(heldout)}


def encode(text: str) -> torch.Tensor:
    """Characters -> int64 codes in [0, 128); non-ASCII becomes '?'."""
    data = text.encode("ascii", errors="replace")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def decode(codes: torch.Tensor) -> str:
    return bytes(codes.to(torch.uint8).tolist()).decode("ascii", errors="replace")


def sample_batch(
    data: torch.Tensor, *, batch: int, block: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``block`` characters and, as targets, the same windows shifted by one."""
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=generator)
    x = torch.stack([data[s : s + block] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + block + 1] for s in starts.tolist()])
    return x, y


def heldout_batches(
    data: torch.Tensor, *, batches: int, batch: int, block: int, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of held-out windows, the same on every call with the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [sample_batch(data, batch=batch, block=block, generator=g) for _ in range(batches)]


# ---- model -----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.heads = size.heads
        self.norm1 = nn.LayerNorm(size.width)
        self.qkv = nn.Linear(size.width, 3 * size.width)
        self.proj = nn.Linear(size.width, size.width)
        self.norm2 = nn.LayerNorm(size.width)
        self.mlp = nn.Sequential(
            nn.Linear(size.width, 4 * size.width), nn.GELU(), nn.Linear(4 * size.width, size.width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """GPT-style decoder. Parameter names hold ``embed`` for the embeddings, which
    ``gm.RDA()`` merges by plain weighted mean (their rows are updated sparsely)."""

    def __init__(self, size: Size, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.size = size
        self.tok_embed = nn.Embedding(VOCAB, size.width)
        self.pos_embed = nn.Embedding(size.block, size.width)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's scaled init of the residual projections keeps the residual stream small.
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * size.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.tok_embed(x) + self.pos_embed(pos)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


@torch.no_grad()
def evaluate(model: CharTransformer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy (nats per character) over fixed held-out batches."""
    was_training = model.training
    model.eval()
    total = sum(float(model.loss(x, y)) for x, y in batches) / len(batches)
    model.train(was_training)
    return total


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
