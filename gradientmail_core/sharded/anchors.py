"""Where a rank of a sharded node keeps its anchors: one copy of its shards as of the newest commit
it aligned with, read at each publish (the delta is ``anchor - local``) and at close.

- ``"device"``: beside the parameters (the fastest; one more copy of the shards on the device).
- ``"host"``: in host memory (pinned when the parameters are on CUDA): the device holds what it
  holds without gradientmail, plus one operation's buffers. The default on an accelerator.
- ``"disk"``: a local file per fragment (a temporary directory per rank, removed at close): the
  process holds no copy at all; each publish reads the fragment's anchors back into the delta's
  own buffer, each commit writes them from the parameters it just set. For CPU nodes short of
  memory; the operating system may cache the files (reclaimable, not the process's memory).

An anchor is a commit's parameters, which the store holds too: nothing here needs to survive the
process (a restarted node reads the newest commit again), so the files are written plainly.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..adapters.torch_sharded import Meter, ShardedParams, ShardingUnsupported

PLACES = ("device", "host", "disk")


def default_place(device: torch.device) -> str:
    return "device" if device.type == "cpu" else "host"


def check_place(place: str | None) -> None:
    if place is not None and place not in PLACES:
        raise ShardingUnsupported(f"anchors={place!r}: expected one of {', '.join(map(repr, PLACES))} (or None)")


class Anchors:
    """One rank's anchors of every fragment it aligned with (see the module docstring)."""

    def __init__(self, sharded: ShardedParams, place: str, *, rank: int) -> None:
        check_place(place)
        self.sharded, self.place = sharded, place
        self._held: dict[int, dict[str, torch.Tensor]] = {}  # "device"/"host"
        self._files: dict[int, tuple[Path, dict[str, tuple[int, int]]]] = {}  # "disk": path, name -> (offset, bytes)
        self._dir: Path | None = None
        self.made: Path | None = None  # the directory of the files ("disk"), kept after close (tests)
        self._rank = rank

    def __contains__(self, f: int) -> bool:
        return f in self._held or f in self._files

    def fragments(self) -> list[int]:
        return sorted({*self._held, *self._files})

    @property
    def nbytes(self) -> int:
        """What the anchors take in this process's memory (none on disk)."""
        return sum(t.numel() * t.element_size() for a in self._held.values() for t in a.values())

    def _alloc(self, like: torch.Tensor) -> torch.Tensor:
        if self.place == "device" or like.device.type == "cpu":
            return torch.empty_like(like)
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.device.type == "cuda")

    # ---- reading --------------------------------------------------------------------------

    def load_into(self, f: int, name: str, out: torch.Tensor, op: Meter) -> None:
        """``out`` (flat, any dtype and device) := this rank's anchor of ``name`` in fragment ``f``."""
        if self.place != "disk":
            out.copy_(self._held[f][name])
            return
        path, layout = self._files[f]
        at, nbytes = layout[name]
        dtype = self.sharded.local(name).dtype
        direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
        if direct:
            raw = out.view(torch.uint8)
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            op.note(nbytes, transient=True)
        if nbytes:
            with open(path, "rb") as fh:
                fh.seek(at)
                got = fh.readinto(raw.numpy().data)
            if got != nbytes:
                raise OSError(f"{path}: read {got} of {nbytes} bytes of {name}'s anchor")
        if not direct:
            out.copy_(raw.view(dtype))

    # ---- writing --------------------------------------------------------------------------

    def target(self, f: int, names: Sequence[str], op: Meter) -> dict[str, torch.Tensor]:
        """Where a blended commit's parameters are scattered: the anchors themselves (in memory),
        or temporaries beside the shards (on disk; ``set`` writes them)."""
        if self.place != "disk":
            held = self._held.get(f)
            if held is None:
                held = self._held[f] = {n: self._alloc(self.sharded.local(n)) for n in names}
            return held
        out = {}
        for n in names:
            local = self.sharded.local(n)
            out[n] = op.empty(local.numel(), local.dtype, local.device)
        return out

    def set(self, f: int, values: Mapping[str, torch.Tensor]) -> None:
        """Fragment ``f``'s anchors := ``values`` (this rank's flat shards, their dtype)."""
        if self.place != "disk":
            held = self._held.get(f)
            if held is None:
                held = self._held[f] = {n: self._alloc(v) for n, v in values.items()}
            for n, v in values.items():
                if held[n] is not v:
                    held[n].copy_(v)
            return
        if self._dir is None:
            self._dir = self.made = Path(tempfile.mkdtemp(prefix=f"gradientmail-anchors-r{self._rank}-"))
        path = self._dir / f"fragment-{f}.bin"
        layout: dict[str, tuple[int, int]] = {}
        at = 0
        with open(path, "wb") as fh:
            for n, v in values.items():
                data = v.detach().contiguous()
                if data.device.type != "cpu":
                    data = data.cpu()
                nbytes = data.numel() * data.element_size()
                if nbytes:
                    fh.write(data.view(torch.uint8).numpy().data)
                layout[n] = (at, nbytes)
                at += nbytes
        self._files[f] = (path, layout)

    def close(self) -> None:
        self._held.clear()
        self._files.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
