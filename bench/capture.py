"""Training-thread cost of publishing a fragment: the copy a contribution used to take against
the anchor turned into the delta in place (``FragmentIO.capture`` against ``FragmentIO.consume``).

Both run on the training thread between two steps. ``capture`` copies the fragment (the delta is
computed later, on the node's thread, over that copy); ``consume`` computes ``anchor - params``
into the anchor's own arrays (what a follower does since its anchors are lent to it:
``syncer/learner.py``), so the fragment is never copied. Per framework, alternating the two
``--repeats`` times on the same fragment, the median time of each and their ratio, plus the
bytes each allocates (tracemalloc's peak during one call: numpy's allocations, torch's own
allocator is not traced, so its copy reads ~0).

    python bench/capture.py --params 25e6 --frameworks numpy torch
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TENSORS = 4


def model(framework: str, params: int) -> tuple[Any, list[str]]:
    n = max(params // TENSORS, 1)
    rng = np.random.default_rng(0)
    arrays = {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(TENSORS)}
    if framework == "numpy":
        return arrays, list(arrays)
    if framework == "torch":
        import torch

        torch.set_num_threads(1)
        return torch.nn.ParameterDict({k: torch.nn.Parameter(torch.from_numpy(v)) for k, v in arrays.items()}), list(
            arrays
        )
    raise SystemExit(f"unknown framework {framework!r}")


def timed(call: Callable[[], Any]) -> tuple[float, int]:
    tracemalloc.start()
    t0 = time.perf_counter()
    out = call()
    dt = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del out
    return dt, peak


def bench(framework: str, params: int, repeats: int) -> dict[str, float]:
    from gradientmail_core.adapters import adapter_for
    from gradientmail_core.adapters.handles import FragmentIO

    m, names = model(framework, params)
    io = FragmentIO(adapter_for(m))
    assert io.consumes, f"{framework}: the adapter cannot subtract in place"
    base = io.adapter.read(names)
    anchor = {n: (v + np.float32(1e-3)).astype(np.float32) for n, v in base.items()}
    times: dict[str, list[float]] = {"capture": [], "consume": []}
    peaks: dict[str, int] = {}
    for i in range(repeats):
        for arm in ("capture", "consume") if i % 2 == 0 else ("consume", "capture"):
            if arm == "capture":
                dt, peak = timed(lambda: io.capture(names, anchor, keep=False))
            else:
                fresh = {n: v.copy() for n, v in anchor.items()}  # consumed: a new one each time
                dt, peak = timed(lambda fresh=fresh: io.consume(names, fresh))  # type: ignore[misc]
            times[arm].append(dt)
            peaks[arm] = max(peaks.get(arm, 0), peak)
    cap, con = statistics.median(times["capture"]), statistics.median(times["consume"])
    return {
        "capture_ms": cap * 1e3,
        "consume_ms": con * 1e3,
        "ratio": con / cap,
        "capture_mb": peaks["capture"] / 1e6,
        "consume_mb": peaks["consume"] / 1e6,
    }


def main() -> None:
    import sys

    sys.path.insert(0, str(REPO))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=25e6, help="the fragment's parameters (fp32)")
    ap.add_argument("--frameworks", nargs="+", choices=["numpy", "torch"], default=["numpy", "torch"])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    mb = 4 * args.params / 1e6
    print(f"a fragment of {args.params:.3g} fp32 parameters ({mb:.0f} MB), {args.repeats} calls per arm")
    print(
        "| framework | capture (copy) ms | consume (in place) ms | consume / capture | allocated: capture | consume |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for fw in args.frameworks:
        r = bench(fw, int(args.params), args.repeats)
        print(
            f"| {fw} | {r['capture_ms']:.1f} | {r['consume_ms']:.1f} | {r['ratio']:.2f} | "
            f"{r['capture_mb']:.0f} MB | {r['consume_mb']:.0f} MB |"
        )


if __name__ == "__main__":
    main()
