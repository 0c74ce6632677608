"""A sharded node's costs per rank (issue 13): memory against the same training without
gradientmail, bytes moved against an unsharded node, and the per-step exchange.

Runs a ``--ranks``-rank FSDP2 node (``torchrun``, gloo on the CPU) training an MLP of about
``--params`` float32 parameters with Adam, twice: once without gradientmail (``train``), once as a
``gm.Session`` learner (``gm``) in a run whose rounds a ``gradientmail syncer`` process closes
(quorum 1, ``--fragments`` fragments, ``--chunk`` elements per chunk, F32 or ``--delta-dtype``
deltas). Every rank measures itself:

- ``floor``: its RSS before the model is built (torch, the process group);
- the peak RSS (``VmHWM``, reset at each mark through ``/proc/self/clear_refs``) over the training
  steps (the session's opening and closing included in ``gm``); with ``--device cuda`` the GPU
  allocator's instead (``memory_allocated`` before the model, ``max_memory_allocated`` reset
  after the first step): what the device holds, the figure the goal is about on a GPU;
- ``--anchors``: where the ranks keep their anchors (``device``, ``host``, ``disk``: one copy
  of the shards beside the parameters, in host memory, or in files); ``--closer node``: the
  sharded node closes the rounds itself (no syncer), its ranks holding their parts of the outer
  state;
- ``memory ratio`` = ``(peak_gm - floor) / (peak_train - floor)``: the node's memory with
  gradientmail over the same training without it (goal <= 1.10);
- ``bytes``: what the rank uploaded and downloaded (its chunks), and its share of the node's total
  (an unsharded node moves that total: the chunks' bytes are a plain node's payloads; goal
  ``1/ranks``);
- ``metered``: what the rank's sharded IO allocated (``Meter``): the largest tensor, the most one
  publish or commit allocated, the anchors (one copy of the rank's shards);
- ``exchange``: microseconds per ``Exchange`` (the per-step collective), empty and with a small
  message, measured before the session opens (``--exchanges`` calls);
- ``step``: the mean wall time of a training step, without and with gradientmail (the session's
  opening and closing left out).

glibc's mmap threshold is fixed as in ``bench/memory.py`` so RSS follows what is live.

``python bench/sharded_memory.py`` (about a minute on two cores); ``--params 50e6 --ranks 2``
for larger figures. Prints one JSON object per rank and mode, then a summary.
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
MMAP_THRESHOLD = 1 << 20
WIDTH = 1024


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


# ---- a rank -------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import gradientmail_core as gm
    from gradientmail_core.sharded.rank_host import RankHost
    from gradientmail_core.sharded.wire import Exchange, new_group

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:  # one GPU per rank; the training's group is NCCL (the session makes gloo groups of its own)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"mode": args.worker, "rank": rank}
    if args.worker == "gm":
        x = Exchange(new_group(), rank, world)
        for message, name in (
            (None, "exchange_us"),
            ({"actions": [{"a": "write", "f": 0, "v": 1, "m": 0.0}]}, "message_us"),
        ):
            for _ in range(20):
                x(message, done=True, failed=False)
            t0 = time.perf_counter()
            for _ in range(args.exchanges):
                x(message, done=True, failed=False)
            out[name] = (time.perf_counter() - t0) / args.exchanges * 1e6
    dist.barrier()
    out["floor"] = torch.cuda.memory_allocated() if cuda else _status("VmRSS")
    torch.manual_seed(0)
    layers = max(1, round(args.params / (WIDTH * WIDTH + WIDTH)))
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    if cuda:
        net = net.cuda()
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)

    def step() -> None:
        x = torch.randn(args.batch, WIDTH, generator=gen).to(args.device)
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()

    step()  # the optimizer's state exists from here on
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        _mark()
    session = None
    if args.worker == "gm":
        cfg = gm.DiLoCo(
            sync_every=args.sync_every,
            fragments=args.fragments,
            chunk_elements=args.chunk,
            delta_dtype=args.delta_dtype,
            quorum_size=1,
            alignment=gm.Overwrite(),  # a sharded node does not carry local steps yet
        )
        session = gm.Session(
            net,
            algorithm=cfg,
            mailbox=gm.FileMailbox(args.mailbox),
            learner_id="bench",
            poll_interval=0.05,
            role="both" if args.closer == "node" else "learner",
            anchors=args.anchors,
        )
        session.open()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
        if session is not None:
            session.step(samples=args.batch * world)
    out["step_ms"] = (time.perf_counter() - t0) / args.steps * 1e3
    if session is not None:
        assert isinstance(session.host, RankHost) and session.host.io is not None
        out["anchors"] = session.host.io.anchors.nbytes  # (let go at close)
        session.close()
    out["peak"] = torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")
    out["params"] = sum(p.numel() for p in net.parameters())
    if session is not None:
        rt = session.host
        assert isinstance(rt, RankHost) and rt.io is not None
        io = rt.io
        out.update(
            bytes_up=io.bytes_up,
            bytes_down=io.bytes_down,
            largest=io.meter.peak,
            op_peak=io.meter.op_peak,
            rounds=session.rounds_seen,
            closed=session.node.state.stats.committed if session.node is not None else None,
            exchanges_per_step=(rt.exchange.calls if rt.exchange else rt.collectives) / max(rt.steps, 1),
        )
    # One file per rank: the ranks' prints could interleave on the shared stdout.
    Path(args.mailbox).with_name(f"{args.worker}-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------


def run(args: argparse.Namespace, mode: str, mailbox: str) -> list[dict[str, Any]]:
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
        "MALLOC_TRIM_THRESHOLD_": str(MMAP_THRESHOLD),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", f"--nproc_per_node={args.ranks}", __file__, "--worker", mode, "--mailbox", mailbox]
    for name in (
        "params",
        "steps",
        "batch",
        "sync_every",
        "fragments",
        "chunk",
        "exchanges",
        "closer",
        "anchors",
        "device",
    ):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.delta_dtype:
        cmd += ["--delta-dtype", args.delta_dtype]
    syncer = None
    if mode == "gm" and args.closer == "node":
        create(args, mailbox, env)  # the sharded node closes the rounds itself
    elif mode == "gm":
        syncer = subprocess.Popen(
            [str(Path(sys.executable).with_name("gradientmail")), "syncer", f"file://{mailbox}", "--id", "sync"]
            + ["--poll-interval", "0.05", "--lease-timeout", "10"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # The syncer waits for a run; a sharded node waits for one too: a plain process creates it.
        create(args, mailbox, env)
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    finally:
        if syncer is not None:
            syncer.terminate()
            syncer.wait(timeout=30)
    if done.returncode != 0:
        sys.exit(f"{mode} run failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return [json.loads(Path(mailbox).with_name(f"{mode}-{r}.json").read_text()) for r in range(args.ranks)]


def create(args: argparse.Namespace, mailbox: str, env: dict[str, str]) -> None:
    """The run, created by a plain process holding the same (unsharded) model: a sharded node
    joins runs but does not create them."""
    code = f"""
import torch, gradientmail_core as gm
torch.manual_seed(0)
layers = max(1, round({args.params} / ({WIDTH} * {WIDTH} + {WIDTH})))
net = torch.nn.Sequential(*[torch.nn.Linear({WIDTH}, {WIDTH}) for _ in range(layers)])
cfg = gm.DiLoCo(sync_every={args.sync_every}, fragments={args.fragments}, chunk_elements={args.chunk},
                delta_dtype={args.delta_dtype!r}, quorum_size=1, alignment=gm.Overwrite())
with gm.Session(net, algorithm=cfg, mailbox=gm.FileMailbox({mailbox!r}), learner_id="creator", role="learner",
                callbacks=[]):
    pass
"""
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=args.timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=8e6)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=1 << 18)
    ap.add_argument("--delta-dtype", default=None)
    ap.add_argument("--exchanges", type=int, default=500)
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one GPU per rank, NCCL; memory is the device's (torch.cuda.max_memory_allocated), not the RSS",
    )
    ap.add_argument(
        "--anchors",
        choices=("device", "host", "disk"),
        default="device",
        help="where the ranks keep their anchors (disk: a local file per fragment, none in memory)",
    )
    ap.add_argument(
        "--closer",
        choices=("syncer", "node"),
        default="syncer",
        help="who closes the rounds: a gradientmail syncer process (the node learns only), or the sharded node itself",
    )
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", choices=("train", "gm"), help=argparse.SUPPRESS)
    ap.add_argument("--mailbox", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.params = int(args.params)
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="gm-sharded-") as tmp:
        train = run(args, "train", str(Path(tmp) / "unused"))
        gm_rows = run(args, "gm", str(Path(tmp) / "mailbox"))
    for row in train + gm_rows:
        print(json.dumps(row))
    total_up = sum(r["bytes_up"] for r in gm_rows) or 1
    total_down = sum(r["bytes_down"] for r in gm_rows) or 1
    print(
        f"\n{args.ranks} ranks, {gm_rows[0]['params'] / 1e6:.1f}M params, P={args.fragments}, chunk={args.chunk}, "
        f"anchors on {args.anchors}, rounds closed by {'the node' if args.closer == 'node' else 'a syncer'}, "
        f"memory: {'the GPU allocator' if args.device == 'cuda' else 'the RSS'}"
    )
    for t, g in zip(train, gm_rows):
        ratio = (g["peak"] - g["floor"]) / max(t["peak"] - t["floor"], 1)
        print(
            f"rank {g['rank']}: memory {(t['peak'] - t['floor']) / 2**20:.0f} MiB -> {(g['peak'] - g['floor']) / 2**20:.0f} MiB "
            f"(ratio {ratio:.2f}; anchors {g['anchors'] / 2**20:.0f} MiB, largest allocation {g['largest'] / 2**20:.1f} MiB, "
            f"one operation at most {g['op_peak'] / 2**20:.1f} MiB); bytes up {g['bytes_up'] / total_up:.2f} of the node's, "
            f"down {g['bytes_down'] / total_down:.2f}; exchange {g['exchange_us']:.0f} us empty, {g['message_us']:.0f} us "
            f"with a message, {g['exchanges_per_step']:.2f} per step; step {t['step_ms']:.0f} -> {g['step_ms']:.0f} ms; "
            f"{g['rounds']} rounds" + (f", {g['closed']} closed by this node" if g.get("closed") is not None else "")
        )


if __name__ == "__main__":
    main()
