"""Host memory a node holds: peak RSS added by gradientmail, per role, as a ratio to the model's
fp32 bytes.

Runs ``--nodes`` real processes (default 2) over a ``FileMailbox`` in a temporary folder, each
training a model of ``--params`` float32 parameters (numpy arrays, or a torch module with
``--framework torch``) with ``DiLoCo(fragments=P, quorum_size=nodes)``, for each P in
``--fragments``. Every process measures itself:

- ``base``: its RSS after building the model and training ``--warmup`` plain steps (the training
  loop's own memory: the steps are in place, so the loop alone has no further peak);
- then the peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` at each mark) over three
  windows: ``join`` (opening the session, up to every node seen), ``rounds`` (from then to the end
  of ``close()``: every round, the final ones included) and ``steady`` (the rounds after each
  fragment has been committed once, so every cache is warm);
- each figure is ``(peak - base) / (4 x params)``: the memory gradientmail added, in model copies.

A node's role is read from what it did: ``closer`` if it committed rounds, else ``follower``.
With ``--nodes 1`` the lone node closes every round itself. glibc's mmap threshold is fixed
(``MALLOC_MMAP_THRESHOLD_``) so that a freed payload buffer goes back to the system and RSS follows
what is live; with the default, glibc raises the threshold to the sizes freed and keeps later
buffers on its heap, so RSS would count freed memory as held.

``python bench/memory.py --params 25e6 --fragments 1 4 8`` (about a minute per fragment count on
two cores; ``--nodes 1`` for the lone closer; ``--overlap-steps 0`` for lockstep). ``--trace`` adds tracemalloc's peak (numpy's
allocations, no allocator slack; slower) to each row.

Chunked payloads (``docs/protocol.md`` section 10): ``--chunk-elements C`` sets the run's
``chunk_elements`` (default: ``DiLoCo``'s, ``2**24``; ``0`` for none: whole fragments).

Before/after: ``PYTHONPATH=<a git worktree of another commit> python bench/memory.py ...`` measures
that engine with this script (the script uses only ``gm.Session``'s public API).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TENSORS = 16  # the model's tensors: fragments up to 16 split it evenly
MMAP_THRESHOLD = 1 << 20  # every buffer of 1 MiB or more is its own mapping, unmapped when freed


# ---- measuring ----------------------------------------------------------------------------


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class Peak:
    """Peak RSS since the last ``mark()``: the kernel's ``VmHWM``, reset through ``clear_refs``."""

    def __init__(self, trace: bool) -> None:
        self.trace = trace
        if trace:
            import tracemalloc

            tracemalloc.start()

    def mark(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        if self.trace:
            import tracemalloc

            tracemalloc.reset_peak()

    def read(self) -> dict[str, int]:
        out = {"hwm": _status("VmHWM"), "rss": _status("VmRSS")}
        if self.trace:
            import tracemalloc

            out["traced_now"], out["traced_peak"] = tracemalloc.get_traced_memory()
        return out


# ---- the model ----------------------------------------------------------------------------


def build_model(framework: str, params: int, seed: int) -> tuple[Any, Any]:
    """``(model, train_step)``: ``TENSORS`` tensors of ``params / TENSORS`` float32 each, and an
    in-place step (a decay and a constant pull, so every round has a delta and no temporaries)."""
    import numpy as np

    n = max(params // TENSORS, 1)
    rng = np.random.default_rng(seed)
    arrays = {f"w{i:02d}": rng.standard_normal(n, dtype=np.float32) for i in range(TENSORS)}
    if framework == "numpy":

        def step() -> None:
            for a in arrays.values():
                np.multiply(a, np.float32(0.999), out=a)
                np.add(a, np.float32(1e-3), out=a)

        return arrays, step
    import torch

    torch.set_num_threads(1)
    module = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.from_numpy(v)) for k, v in arrays.items()})

    def torch_step() -> None:
        with torch.no_grad():
            for p in module.values():
                p.mul_(0.999).add_(1e-3)

    return module, torch_step


# ---- one node -----------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import gradientmail_core as gm

    P, nodes = args.fragments[0], args.nodes
    model, train = build_model(args.framework, int(args.params), seed=args.index)
    for _ in range(args.warmup):
        train()
    peak = Peak(args.trace)
    peak.mark()
    base = peak.read()
    gap = args.gap
    chunks = {} if args.chunk_elements is None else {"chunk_elements": args.chunk_elements or None}
    overlap = gap if args.overlap_steps is None else args.overlap_steps
    cfg = gm.DiLoCo(sync_every=gap * P, fragments=P, quorum_size=nodes, overlap_steps=overlap, **chunks)
    session = gm.Session(
        model,
        algorithm=cfg,
        mailbox=gm.FileMailbox(args.mailbox, fsync=False),
        learner_id=f"node{args.index}",
        poll_interval=0.05,
        lease_timeout=60.0,
        round_timeout=60.0,
        callbacks=(),
        seed=args.index,
    )
    session.open()
    session.wait_for(nodes, timeout=300)
    windows = {"join": peak.read()}
    peak.mark()
    steady = None
    total_rounds = args.cycles * P
    for _ in range(gap * total_rounds):
        train()
        session.step(1)
        if steady is None and session.rounds_seen >= P:
            steady = peak.read()  # the first cycle: every fragment committed once
            peak.mark()
    session.close()
    end = peak.read()
    assert session.node is not None
    stats = session.node.state.stats
    windows["steady"] = end
    windows["rounds"] = end if steady is None else {k: max(v, end.get(k, 0)) for k, v in steady.items()}
    print(
        json.dumps(
            {
                "node": args.index,
                "fragments": P,
                "nodes": nodes,
                "role": "closer" if stats.committed else "follower",
                "committed": stats.committed,
                "rounds_seen": session.rounds_seen,
                "base": base,
                "windows": windows,
            }
        ),
        flush=True,
    )


# ---- the driver ---------------------------------------------------------------------------


def run_fragments(args: argparse.Namespace, P: int) -> list[dict[str, Any]]:
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
        "MALLOC_TRIM_THRESHOLD_": str(MMAP_THRESHOLD),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    with tempfile.TemporaryDirectory(prefix="gm-memory-") as tmp:
        procs = []
        for i in range(args.nodes):
            argv = [sys.executable, __file__, "--worker", "--index", str(i), "--mailbox", str(Path(tmp) / "mb")]
            argv += ["--params", str(args.params), "--fragments", str(P), "--nodes", str(args.nodes)]
            argv += ["--framework", args.framework, "--cycles", str(args.cycles), "--gap", str(args.gap)]
            if args.overlap_steps is not None:
                argv += ["--overlap-steps", str(args.overlap_steps)]
            argv += ["--warmup", str(args.warmup)] + (["--trace"] if args.trace else [])
            if args.chunk_elements is not None:
                argv += ["--chunk-elements", str(args.chunk_elements)]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        rows = []
        for p in procs:
            out, err = p.communicate(timeout=args.timeout)
            if p.returncode != 0:
                raise SystemExit(f"a node failed (exit {p.returncode}):\n{err[-4000:]}")
            rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def ratios(row: dict[str, Any], params: float) -> dict[str, float]:
    model = 4 * params
    base = row["base"]["rss"]
    out = {w: (row["windows"][w]["hwm"] - base) / model for w in ("join", "rounds", "steady")}
    if "traced_peak" in row["windows"]["rounds"]:
        out["traced"] = max(row["windows"][w]["traced_peak"] - row["base"]["traced_now"] for w in ("rounds", "steady"))
        out["traced"] /= model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=25e6)
    ap.add_argument("--fragments", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--framework", choices=["numpy", "torch"], default="numpy")
    ap.add_argument("--cycles", type=int, default=4, help="rounds per fragment")
    ap.add_argument("--gap", type=int, default=3, help="steps between rounds (sync_every = gap x fragments)")
    ap.add_argument(
        "--overlap-steps", type=int, default=None, help="the run's overlap_steps (default: --gap; 0: lockstep)"
    )
    ap.add_argument("--warmup", type=int, default=3, help="plain steps before joining")
    ap.add_argument("--trace", action="store_true", help="also tracemalloc's peak (slower)")
    ap.add_argument(
        "--chunk-elements", type=int, default=None, help="the run's chunk_elements (default DiLoCo's; 0: none)"
    )
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mailbox", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    model_mb = 4 * args.params / 1e6
    print(f"{args.nodes} node(s), {args.params:.3g} params ({model_mb:.0f} MB fp32, {args.framework}), FileMailbox")
    if args.chunk_elements is not None:
        print(f"chunk_elements={args.chunk_elements or None}")
    head = "| fragments | node | role | rounds committed | join | rounds (peak) | steady |"
    print(head + (" traced |" if args.trace else ""))
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |" + (" ---: |" if args.trace else ""))
    for P in args.fragments:
        t0 = time.monotonic()
        for row in sorted(run_fragments(args, P), key=lambda r: r["node"]):
            r = ratios(row, args.params)
            cells = [
                P,
                row["node"],
                row["role"],
                row["committed"],
                *(f"{r[w]:.2f}x" for w in ("join", "rounds", "steady")),
            ]
            if args.trace:
                cells.append(f"{r['traced']:.2f}x")
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
        print(f"<!-- fragments={P}: {time.monotonic() - t0:.0f} s -->", file=sys.stderr)


if __name__ == "__main__":
    main()
