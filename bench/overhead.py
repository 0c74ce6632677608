"""Step overhead: the same training loop with and without gradientmail, side by side.

Arms (each a fresh worker process, so one arm's background thread never runs during another's
block; workers alternate arm by arm, the order flipping every pair, so drift in the machine's
speed hits every arm alike):

- ``plain``:     a torch loop (forward, backward, AdamW step),
- ``session``:   the same loop with ``session.step()`` after each optimizer step,
- ``lightning``: the same model and optimizer in a ``lightning.Trainer`` (one CPU device),
- ``lightning-gm``: the same Trainer with ``strategy=MailboxDiLoCoStrategy(...)``,
- ``jax``:       the same MLP as a pytree in a ``jax.jit``-ed optax loop (AdamW),
- ``jax-gm``:    the same loop with ``params = session.step(samples=n, params=params)`` after each step,
- ``session-host``: ``session`` with the torch adapter's device pipeline off (``--device`` mode:
  host copies of every published fragment and host-side alignment, the path before the pipeline).

gradientmail runs as a lone learner on a ``FileMailbox`` (fsync on) in a temp dir, so the same
process also closes every round (judge, merge, outer step, payload writes): the worst case for
the training process. Torch trains on one thread, leaving the other core to the background, as
on a node whose accelerator does the training.

Per block, after a warm-up of one round: wall time per step (median and mean), CPU time of the
training thread per step, and CPU time of the whole process per step (training + background).
Ratios are per pair of adjacent blocks (this arm / its baseline), then the median over pairs.
Beside them, two direct figures per step, as a share of the step: the wall time spent inside
gradientmail's call on the training thread, and the background's CPU time.

    python bench/overhead.py                          # 20 ms and 200 ms steps, all arms
    python bench/overhead.py --target-ms 20 --pairs 8 --arms plain session
    python bench/overhead.py --arms jax jax-gm                 # the jitted JAX loop
    git worktree add /tmp/before <commit>             # before/after in one run:
    python bench/overhead.py --arms plain session --engine before=/tmp/before

``--device`` mode sizes the model by parameter count instead of by step time: ``--params`` of
parameters in ``--dtype``, a stack of square linear layers on ``--device``, ``--steps`` timed
steps per block. On CUDA the training loop runs asynchronously, so the clock is read after a
``torch.cuda.synchronize()`` every ``MARK_EVERY`` steps and the per-step figures are per-mark means.
The session arm uses the device pipeline (deltas, quantization and alignment on the GPU):

    python bench/overhead.py --device cuda --params 100M --dtype bf16   # arms plain session session-host
    python bench/overhead.py --device cpu --params 200K --dtype bf16 --steps 40 --pairs 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BASELINE = {"session": "plain", "session-host": "plain", "lightning-gm": "lightning", "jax-gm": "jax"}
DEPTH = 8  # square layers of the --device model
MARK_EVERY = {"cpu": 1, "cuda": 10}  # steps between two clock readings (and, on CUDA, syncs)
DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def build(width: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 256),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batches(batch: int):
    """Inputs, and targets from a fixed random linear teacher: the loss stays away from zero, so
    no arm drifts into float32 subnormals (which slow a CPU step down several times)."""
    import torch

    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(256, 256, generator=g) / 16
    xs = [torch.randn(batch, 256, generator=g) for _ in range(8)]
    return [(x, x @ teacher) for x in xs]


def calibrate(target_ms: float, batch: int) -> int:
    """Width of the MLP whose plain step takes about ``target_ms`` on one thread."""
    import torch

    torch.set_num_threads(1)
    data = batches(batch)
    width = 256
    while True:
        model, opt = build(width)
        for i in range(3):
            _step(model, opt, data[i % 8])
        t0 = time.perf_counter()
        for i in range(5):
            _step(model, opt, data[i % 8])
        ms = (time.perf_counter() - t0) / 5 * 1000
        if ms >= target_ms or width >= 8192:
            return width
        width = int(width * max(1.1, min(2.0, (target_ms / ms) ** 0.5)))


def parse_count(text: str) -> int:
    """'100M' -> 100_000_000 (K, M, G suffixes)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def sized_width(n_params: int) -> int:
    """Width (a multiple of 64) of DEPTH square layers holding at least ``n_params`` parameters."""
    width = 64
    while DEPTH * (width * width + width) < n_params:
        width += 64
    return width


def build_sized(width: int, dtype: str, device: str):
    import torch

    torch.manual_seed(0)
    layers = []
    for i in range(DEPTH):
        layers += [torch.nn.Linear(width, width)] + ([torch.nn.GELU()] if i < DEPTH - 1 else [])
    model = torch.nn.Sequential(*layers).to(device, getattr(torch, DTYPES[dtype]))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batches_sized(width: int, batch: int, dtype: str, device: str):
    """As ``batches``, for the --device model, already on the device."""
    import torch

    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(width, width, generator=g) / width**0.5
    xs = [torch.randn(batch, width, generator=g) for _ in range(8)]
    as_device = {"device": device, "dtype": getattr(torch, DTYPES[dtype])}
    return [(x.to(**as_device), (x @ teacher).to(**as_device)) for x in xs]


def _step(model, opt, xy) -> None:
    x, y = xy
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


# ---- workers (one block of one arm, in a fresh process) -------------------------------------


class Timed:
    """Wraps the call gradientmail adds to a step and sums its wall and CPU time while ``on``:
    the overhead on the training thread itself, measured directly (not as a noisy difference)."""

    def __init__(self, fn) -> None:
        self.fn, self.on, self.wall, self.cpu = fn, False, 0.0, 0.0

    def __call__(self, *a, **k):
        if not self.on:
            return self.fn(*a, **k)
        w, c = time.perf_counter(), time.thread_time()
        try:
            return self.fn(*a, **k)
        finally:
            self.wall += time.perf_counter() - w
            self.cpu += time.thread_time() - c


def worker(
    arm: str,
    width: int,
    steps: int,
    warmup: int,
    batch: int,
    sync_every: int,
    fragments: int,
    poll: float,
    device: str | None = None,
    dtype: str = "f32",
    delta_dtype: str | None = None,
) -> dict:
    import torch

    import gradientmail_core as gm
    from gradientmail_core.adapters.torch import TorchAdapter

    torch.set_num_threads(1)
    cfg = gm.DiLoCo(sync_every=sync_every, fragments=fragments, delta_dtype=delta_dtype)
    every = MARK_EVERY[device.split(":")[0]] if device else 1
    sync = torch.cuda.synchronize if device and device.startswith("cuda") else lambda: None
    with tempfile.TemporaryDirectory() as d:
        session_opts = dict(learner_id="bench", poll_interval=poll, callbacks=())
        if arm in ("plain", "session", "session-host"):
            model, opt = build_sized(width, dtype, device) if device else build(width)
            data = batches_sized(width, batch, dtype, device) if device else batches(batch)
            marks: list[tuple[float, float, float]] = []
            # --device mode: session runs the device pipeline (also on the CPU, for a smoke run of
            # its code), session-host the host path (host copies of the fragments), as before it
            trained = model
            if device and arm != "plain":
                trained = TorchAdapter(model, device_pipeline=arm == "session")
            session = (
                gm.Session(trained, algorithm=cfg, mailbox=gm.FileMailbox(d), **session_opts)
                if arm != "plain"
                else None
            )
            timed = Timed(session.step if session is not None else lambda samples: None)
            if session is not None:
                session.open()
            for i in range(warmup + steps + 1):
                if i >= warmup and (i - warmup) % every == 0:
                    sync()
                    marks.append((time.perf_counter(), time.thread_time(), time.process_time()))
                    timed.on = i < warmup + steps
                _step(model, opt, data[i % 8])
                timed(samples=batch)
            if session is not None:
                session.host.abort()  # leave without waiting for rounds in flight: not timed
        elif arm in ("jax", "jax-gm"):
            marks, timed = _jax(arm, width, steps, warmup, batch, cfg, d, session_opts)
        else:
            marks, timed = _lightning(arm, width, steps, warmup, batch, cfg, d, session_opts)
        rounds = len(gm.FileMailbox(d).list("rounds/")) if arm in BASELINE else 0
    walls = [(b[0] - a[0]) / every for a, b in zip(marks, marks[1:])]
    return {
        "arm": arm,
        "median": statistics.median(walls),
        "mean": statistics.fmean(walls),
        "thread_cpu": (marks[-1][1] - marks[0][1]) / steps,
        "process_cpu": (marks[-1][2] - marks[0][2]) / steps,
        "rounds": rounds,
        "load": os.getloadavg()[0],
        "call_wall": timed.wall / steps,
        "call_cpu": timed.cpu / steps,
    }


def _jax(arm, width, steps, warmup, batch, cfg, d, session_opts):
    """The torch MLP's shapes as a pytree, trained by a jitted optax AdamW step; the clock is read
    after ``block_until_ready`` each step (as a loop that logs its loss does). XLA computes on one
    core, as the torch arms do on one thread: its thread pool is made while the process may run on
    one CPU only (no XLA flag bounds it), then every thread made after, the session's background
    included, may run on all of them again: the step leaves a core to the background, as an
    accelerator leaves the host's cores."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    import jax
    import jax.numpy as jnp
    import optax

    import gradientmail_core as gm

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    dims = [(256, width), (width, width), (width, 256)]
    params = {f"l{i}": {"kernel": jax.random.normal(k, dim) / dim[0] ** 0.5, "bias": jnp.zeros(dim[1])}
              for i, (k, dim) in enumerate(zip(keys, dims))}  # fmt: skip
    opt = optax.adamw(1e-4)
    data = [(jnp.asarray(x.numpy()), jnp.asarray(y.numpy())) for x, y in batches(batch)]
    jax.jit(lambda a: a @ a.T)(data[0][0]).block_until_ready()  # XLA's pool, made on one CPU
    os.sched_setaffinity(0, cpus)

    def loss_fn(p, x, y):
        for i in range(3):
            x = x @ p[f"l{i}"]["kernel"] + p[f"l{i}"]["bias"]
            x = jax.nn.gelu(x) if i < 2 else x
        return jnp.mean((x - y) ** 2)

    @jax.jit
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    session = None
    if arm == "jax-gm":
        session = gm.Session(params, algorithm=cfg, mailbox=gm.FileMailbox(d), **session_opts)
        session.open()
        params = session.params
    state = opt.init(params)
    timed = Timed(session.step if session is not None else lambda samples, params: params)
    marks = []
    for i in range(warmup + steps + 1):
        if i >= warmup:
            marks.append((time.perf_counter(), time.thread_time(), time.process_time()))
            timed.on = i < warmup + steps
        params, state, loss = step(params, state, *data[i % 8])
        loss.block_until_ready()
        params = timed(samples=batch, params=params)
    if session is not None:
        session.host.abort()
    return marks, timed


def _lightning(arm, width, steps, warmup, batch, cfg, d, session_opts):
    import lightning.pytorch as pl
    import torch

    import gradientmail_core as gm

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, _ = build(width)

        def training_step(self, b, i):
            return (self.net(b[0]) - b[1]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    marks: list[tuple[float, float, float]] = []
    timed = Timed(None)

    class Clock(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, b, i) -> None:
            if trainer.global_step > warmup:
                marks.append((time.perf_counter(), time.thread_time(), time.process_time()))
                timed.on = len(marks) <= steps

    n = warmup + steps + 2
    xy = batches(batch)
    data = torch.utils.data.TensorDataset(
        torch.cat([xy[i % 8][0] for i in range(n)]), torch.cat([xy[i % 8][1] for i in range(n)])
    )
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    kwargs = {}
    if arm == "lightning-gm":
        from gradientmail_lightning import MailboxDiLoCoStrategy

        kwargs["strategy"] = strategy = MailboxDiLoCoStrategy(algorithm=cfg, mailbox=gm.FileMailbox(d), **session_opts)
        timed.fn = strategy.callback.on_train_batch_end
        strategy.callback.on_train_batch_end = timed  # the per-step work of the integration
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=n,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
        **kwargs,
    )
    trainer.fit(Module(), loader)
    return marks[: steps + 1], timed


# ---- the parent: alternate workers, pair blocks, print ratios --------------------------------


def baseline(arm: str) -> str | None:
    return BASELINE.get(arm.split("@")[0])


def run_block(arm: str, args: argparse.Namespace, width: int, steps: int, warmup: int) -> dict:
    name, _, engine = arm.partition("@")
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--width",
        str(width),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--batch",
        str(args.batch),
        "--sync-every",
        str(args.sync_every),
        "--fragments",
        str(args.fragments),
        "--poll",
        str(args.poll),
    ]
    if args.device:
        cmd += ["--device", args.device, "--dtype", args.dtype]
    if args.delta_dtype:
        cmd += ["--delta-dtype", args.delta_dtype]
    # One torch thread in every arm (Lightning's DDP strategies otherwise set one per core).
    # Fixed malloc thresholds: glibc otherwise tunes them to the sizes a process has freed, and
    # the session arm's payload buffers then made its training steps ~15% cheaper than plain's.
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": str(256 << 20),
        "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    }
    if engine:  # an arm on another checkout of gradientmail (--engine NAME=PATH): before/after
        env["PYTHONPATH"] = os.pathsep.join([dict(args.engine)[engine], env.get("PYTHONPATH", "")])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"worker {arm} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(target_ms: float, args: argparse.Namespace) -> None:
    width = calibrate(target_ms, args.batch)
    round_steps = args.sync_every // args.fragments
    steps = max(int(args.seconds * 1000 / target_ms), 2 * round_steps)
    n_params = sum(p.numel() for p in build(width)[0].parameters())
    compare(args, width, steps, round_steps + 5, f"~{target_ms:.0f} ms step: MLP width {width} ({n_params:,} params)")


def measure_device(args: argparse.Namespace) -> None:
    width = sized_width(parse_count(args.params))
    every = MARK_EVERY[args.device.split(":")[0]]
    steps = -(-(args.steps or 300) // every) * every
    warmup = -(-max(args.sync_every // args.fragments + 5, 20) // every) * every
    n_params = DEPTH * (width * width + width)
    compare(args, width, steps, warmup, f"{args.device} {args.dtype}: {DEPTH} layers of {width} ({n_params:,} params)")


def compare(args: argparse.Namespace, width: int, steps: int, warmup: int, model: str) -> None:
    arms = args.arms + [f"session@{name}" for name, _ in args.engine]
    blocks: dict[str, list[dict]] = {a: [] for a in arms}
    for p in range(args.pairs):
        for arm in arms if p % 2 == 0 else list(reversed(arms)):
            blocks[arm].append(run_block(arm, args, width, steps, warmup))
    loads = [b["load"] for bs in blocks.values() for b in bs]
    print(
        f"\n{model}, {steps} timed steps per block, "
        f"{args.pairs} blocks per arm; load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print(
        f"{'arm':>16} | {'median ms':>9} {'mean ms':>8} | {'train CPU ms':>12} {'process CPU ms':>14} | "
        f"{'wall ratio':>10} {'(mean)':>7} {'train CPU':>9} {'proc CPU':>8} | {'in gm call':>10} "
        f"{'bg CPU':>7} | rounds/block"
    )
    for arm in arms:
        bs = blocks[arm]
        med = statistics.median(b["median"] for b in bs) * 1e3
        mean = statistics.median(b["mean"] for b in bs) * 1e3
        tcpu = statistics.median(b["thread_cpu"] for b in bs) * 1e3
        pcpu = statistics.median(b["process_cpu"] for b in bs) * 1e3
        base = baseline(arm)
        if base in blocks:
            pairs = list(zip(bs, blocks[base]))
            r_med = statistics.median(a["median"] / b["median"] for a, b in pairs)
            r_mean = statistics.median(a["mean"] / b["mean"] for a, b in pairs)
            r_t = statistics.median(a["thread_cpu"] / b["thread_cpu"] for a, b in pairs)
            r_p = statistics.median(a["process_cpu"] / b["process_cpu"] for a, b in pairs)
            ratios = f"{r_med:>10.3f} {r_mean:>7.3f} {r_t:>9.3f} {r_p:>8.3f}"
        else:
            ratios = f"{'(baseline)':>10} {'':>7} {'':>9} {'':>8}"
        rounds = statistics.median(b["rounds"] for b in bs)
        # Direct figures: wall time inside gradientmail's call on the training thread, and the
        # background's CPU, each per step as a share of the arm's median step.
        call = statistics.median(b["call_wall"] / b["median"] for b in bs)
        bg = statistics.median((b["process_cpu"] - b["thread_cpu"]) / b["median"] for b in bs)
        direct = f"{100 * call:>9.2f}% {100 * bg:>6.1f}%" if base else f"{'':>10} {'':>7}"
        print(
            f"{arm:>16} | {med:>9.2f} {mean:>8.2f} | {tcpu:>12.2f} {pcpu:>14.2f} | {ratios} | {direct} | {rounds:g}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-ms", type=float, nargs="*", default=[20.0, 200.0])
    ap.add_argument(
        "--arms",
        nargs="*",
        help="default: plain session lightning lightning-gm; with --device: plain session session-host",
    )
    ap.add_argument("--pairs", type=int, default=5, help="blocks per arm")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per block (at least two rounds)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sync-every", type=int, default=100)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--poll", type=float, default=1.0, help="the session's poll_interval")
    ap.add_argument(
        "--engine",
        action="append",
        default=[],
        type=lambda v: tuple(v.split("=", 1)),
        metavar="NAME=PATH",
        help="add an arm session@NAME run on the gradientmail checkout at PATH (e.g. a git worktree of an "
        "older commit): before/after in one run",
    )
    ap.add_argument("--device", help="size the model by --params on this torch device (cuda, cpu) instead")
    ap.add_argument("--params", default="100M", help="--device mode: parameters, e.g. 100M")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="--device mode: parameter dtype")
    ap.add_argument("--steps", type=int, help="--device mode: timed steps per block (default 300)")
    ap.add_argument("--delta-dtype", help="the DiLoCo delta_dtype (F32, F16, BF16, F8_E4M3, F4)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        r = worker(
            args.worker,
            args.width,
            args.steps,
            args.warmup,
            args.batch,
            args.sync_every,
            args.fragments,
            args.poll,
            args.device,
            args.dtype,
            args.delta_dtype,
        )
        print(json.dumps(r))
        return
    if args.arms is None:
        args.arms = (
            ["plain", "session", "session-host"] if args.device else ["plain", "session", "lightning", "lightning-gm"]
        )
    if args.device and not set(args.arms) <= {"plain", "session", "session-host"}:
        ap.error("--device mode runs the arms plain, session and session-host (e.g. --arms plain session)")
    print(
        f"step time with vs without gradientmail (lone learner closing every round, FileMailbox, "
        f"sync_every={args.sync_every}, fragments={args.fragments}, poll_interval={args.poll}, "
        f"delta_dtype={args.delta_dtype})"
    )
    if args.device:
        measure_device(args)
        return
    for target in args.target_ms:
        measure(target, args)


if __name__ == "__main__":
    main()
