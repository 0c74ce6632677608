"""Every CUDA path gradientmail has, run on a GPU machine, one line of result each.

    python bench/gpu_check.py                      # everything (a few minutes on one GPU)
    python bench/gpu_check.py --skip overhead      # leave out the step-overhead benchmark
    python bench/gpu_check.py --overhead-args "--pairs 5 --steps 300"

Checks (each prints ``ok``, ``FAIL``, ``skip`` or ``not built``, with a detail line):

- ``quant``: ``adapters/torch_quant.quantize`` on CUDA writes the bytes ``codec/quant.quantize``
  writes, for every payload dtype (I2 and F4 included), on Gaussian data with specials and on a
  tensor longer than ``torch_quant.CHUNK`` (the chunked conversion).
- ``session``: two learners in real ``gm.Session``s on CUDA parameters, standard DiLoCo with
  BF16 and F4 deltas, once through the device pipeline and once through the host path: the final
  parameters must be bit-identical.
- ``tests``: the CUDA-parametrized cases of ``tests/test_torch_quant.py`` and
  ``tests/test_torch_pipeline.py`` (``pytest -k cuda``).
- ``sharded``: ``adapters/torch_sharded`` on FSDP2 DTensor parameters on CUDA, in a one-rank
  process group (nccl): the chunks it builds equal the chunks cut from an unsharded copy, and a
  commit scattered back lands in the parameters (issue 13's groundwork; the protocol path is not
  built yet).
- ``overhead``: ``bench/overhead.py --device cuda --params 100M --dtype bf16 --pairs 2`` (its table printed).

``--cpu-dry-run`` runs quant, session and sharded on CPU tensors: it tries the script, not CUDA.
- ``fsdp-strategy``, ``accelerate-fsdp``, ``dtensor-pipeline``: not built yet (issue 13).

Exit status: 1 if any built check failed, else 0. Without CUDA it says so and checks nothing
(status 0; ``--require-cuda`` makes that status 2).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEVICE = "cuda"  # "cpu" with --cpu-dry-run: the same checks on CPU tensors, to try the script itself
sys.path.insert(0, str(REPO))

NOT_BUILT = {
    "fsdp-strategy": "Lightning FSDPStrategy with GradientMailCallback: not built yet (issue 13)",
    "accelerate-fsdp": "Accelerate FSDP plugin (FSDP2) with register_gradientmail: not built yet (issue 13)",
    "dtensor-pipeline": "the device pipeline on DTensor shards (a sharded Session on CUDA): not built yet (issue 13)",
}


class Failed(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# quant: device quantizers against numpy


def check_quant(args: argparse.Namespace) -> str:
    import torch

    from gradientmail_core.adapters import torch_quant as tq
    from gradientmail_core.codec import quant

    rng = np.random.default_rng(0)
    x = rng.standard_normal(1_000_003).astype(np.float32)
    x[::997] *= 1e-30  # tiny values, flushed by E8M0 scales
    x[5::1009] = 0.0
    finite = x.copy()
    specials = x.copy()
    specials[7::4099] = np.float32(np.inf)
    specials[11::8191] = np.float32(np.nan)
    long = rng.standard_normal(tq.CHUNK + 37).astype(np.float32)
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    cases = []
    for dtype in quant.DTYPES:
        cases.append((dtype, "gaussian", finite))
        # numpy codes the values of an F4 block holding inf/NaN by the host FPU's rules; the torch
        # quantizer writes x86's (the block decodes to NaN either way).
        if dtype != "F4" or x86:
            cases.append((dtype, "specials", specials))
        if dtype in ("BF16", "F4", "I2"):
            cases.append((dtype, f"{long.size} elements", long))
    for dtype, label, arr in cases:
        want = quant.quantize(arr, dtype)
        q = tq.quantize(torch.from_numpy(arr).to(DEVICE), dtype)
        got = tq.to_qtensor(q, q.data.cpu(), None if q.scale is None else q.scale.cpu())
        if got.data.tobytes() != want.data.tobytes():
            a, b = want.data.reshape(-1).view(np.uint8), got.data.reshape(-1).view(np.uint8)
            i = np.flatnonzero(a != b)[:5]
            raise Failed(f"{dtype} ({label}): bytes differ at {i.tolist()}: numpy {a[i]} cuda {b[i]}")
        if (want.scale is None) != (got.scale is None) or (
            want.scale is not None and got.scale is not None and want.scale.tobytes() != got.scale.tobytes()
        ):
            raise Failed(f"{dtype} ({label}): scale bytes differ")
    return f"{len(cases)} cases, {', '.join(quant.DTYPES)}: the numpy bytes"


# ---------------------------------------------------------------------------------------------
# session: device pipeline against host path through real Sessions


def _net(device: str):
    import torch

    g = torch.Generator().manual_seed(20)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Parameter(torch.randn(64, 48, generator=g).to(device))
            self.block = torch.nn.Parameter(torch.randn(4099, generator=g).to(device, torch.bfloat16))
            self.gate = torch.nn.Parameter(torch.randn((), generator=g).to(device))
            self.head = torch.nn.Parameter(torch.randn(48, 48, generator=g).to(device, torch.float16))

    return Net()


def _sessions(pipeline: bool, delta_dtype: str) -> list[list]:
    import torch

    import gradientmail_core as gm
    from gradientmail_core.adapters.torch import TorchAdapter

    cfg = gm.DiLoCo(sync_every=3, fragments=1, in_flight=1, overlap_steps=0, quorum_size=2, delta_dtype=delta_dtype)
    mailbox = gm.MemoryMailbox()
    models = [_net(DEVICE) for _ in range(2)]  # equal: whichever joins first creates the run
    errors: list[BaseException] = []
    rounds: list[int] = []

    def worker(i: int) -> None:
        try:
            adapter = TorchAdapter(models[i], device_pipeline=pipeline)
            if (adapter.pipeline is not None) != pipeline:
                raise Failed(f"device_pipeline={pipeline} gave pipeline {adapter.pipeline}")
            g = torch.Generator(device=DEVICE).manual_seed(i)
            opts = dict(learner_id=f"w{i}", poll_interval=0.01, lease_timeout=30.0, callbacks=())
            with gm.Session(adapter, algorithm=cfg, mailbox=mailbox, **opts) as s:
                s.wait_for(learners=2, timeout=60)
                for _ in range(4 * cfg.sync_every):
                    with torch.no_grad():
                        for p in models[i].parameters():  # a deterministic "training step"
                            noise = torch.randn(p.shape, generator=g, device=DEVICE)
                            p.add_((noise * 1e-2).to(p.dtype))
                    s.step(samples=4)
            rounds.append(s.rounds_seen)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    if len(rounds) != 2 or min(rounds) < 3:
        raise Failed(f"device_pipeline={pipeline}, {delta_dtype}: rounds seen {rounds}, expected 3 or more each")
    return [[p.detach().cpu() for p in m.parameters()] for m in models]


def check_session(args: argparse.Namespace) -> str:
    import torch

    out = []
    for delta_dtype in ("BF16", "F4"):
        host, dev = _sessions(False, delta_dtype), _sessions(True, delta_dtype)
        for m, (a, b) in enumerate(zip(host, dev, strict=True)):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if not torch.equal(x, y):
                    raise Failed(f"delta_dtype={delta_dtype}: learner {m} parameter {i} differs (device vs host path)")
        if torch.equal(host[0][0], _net("cpu").embed.detach()):
            raise Failed(f"delta_dtype={delta_dtype}: the parameters never changed")
        out.append(delta_dtype)
    return f"2 learners, 12 steps, delta_dtype {'/'.join(out)}: device pipeline == host path, bit for bit"


# ---------------------------------------------------------------------------------------------
# subprocess checks


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        parts = [x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr)]
        return 124, "".join(parts) + f"\n(stopped after {timeout:.0f} s)"
    return p.returncode, p.stdout + p.stderr


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def check_tests(args: argparse.Namespace) -> str:
    files = ["tests/test_torch_quant.py", "tests/test_torch_pipeline.py"]
    rc, out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", *files], 900)
    last = out.rstrip().splitlines()[-1] if out.strip() else "(no output)"
    if rc != 0:
        raise Failed(f"pytest exit {rc}: {last}\n{_tail(out)}")
    return last


def check_sharded(args: argparse.Namespace) -> str:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0")
    env.update(WORLD_SIZE="1", LOCAL_RANK="0")
    rc, out = _run([sys.executable, __file__, "--sharded-worker", DEVICE], 300, env)
    if rc != 0:
        raise Failed(f"exit {rc}\n{_tail(out)}")
    return out.strip().splitlines()[-1]


def sharded_worker(device: str) -> None:
    """One rank, FSDP2 on ``device``: chunks built from the DTensor shards against an unsharded copy."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gradientmail_core.adapters import torch_sharded as ts

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" and dist.is_nccl_available() else "gloo")
    backend = dist.get_backend()

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(300, 257), torch.nn.Linear(257, 3)).to(device)

    m = model()
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    sharded = ts.find_sharded(m)
    assert sharded is not None, "fully_shard gave no DTensor parameters"
    names, chunk, meter = list(sharded.shapes), 4096, ts.Meter()
    local = {n: sharded.local(n) for n in names}
    owned = ts.gather_chunks(sharded, names, chunk, local, meter=meter)
    ref = {n: p.detach().reshape(-1) for n, p in model().named_parameters()}
    for k, pieces in owned.items():
        for p, values in pieces:
            if not torch.equal(values, ref[p.name][p.start : p.stop]):
                raise SystemExit(f"chunk {k} piece {p}: differs from the unsharded model")
    commit = {k: [(p, v * 2 + 1) for p, v in pieces] for k, pieces in owned.items()}
    ts.scatter_chunks(sharded, names, chunk, commit, local, meter=meter)
    for n, p in sharded.params.items():
        if not torch.equal(p.full_tensor().reshape(-1), ref[n] * 2 + 1):
            raise SystemExit(f"{n}: the scattered commit did not land")
    dist.destroy_process_group()
    print(
        f"FSDP2 on one {device} rank ({backend}): {len(owned)} chunks of {chunk} == the unsharded model's; commit applied"
    )


def check_overhead(args: argparse.Namespace) -> str:
    argv = [sys.executable, "bench/overhead.py", "--device", "cuda", "--params", "100M", "--dtype", "bf16"]
    argv += shlex.split(args.overhead_args)
    rc, out = _run(argv, args.overhead_timeout)
    print(_tail(out, 40))
    if rc != 0:
        raise Failed(f"{' '.join(argv[1:])}: exit {rc}")
    return f"{' '.join(argv[1:])}: table above"


CHECKS: dict[str, Callable[[argparse.Namespace], str]] = {
    "quant": check_quant,
    "session": check_session,
    "tests": check_tests,
    "sharded": check_sharded,
    "overhead": check_overhead,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", nargs="*", default=[], choices=sorted(CHECKS), help="checks to leave out")
    ap.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run only these checks")
    ap.add_argument("--overhead-args", default="--pairs 2", help="extra flags for bench/overhead.py")
    ap.add_argument("--overhead-timeout", type=float, default=420.0, help="seconds before overhead.py is stopped")
    ap.add_argument("--require-cuda", action="store_true", help="exit 2 (not 0) on a machine without CUDA")
    ap.add_argument("--sharded-worker", metavar="DEVICE", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-dry-run", action="store_true", help="run quant, session and sharded on CPU tensors")
    args = ap.parse_args()
    if args.sharded_worker:
        sharded_worker(args.sharded_worker)
        return 0
    try:
        import torch
    except ImportError:
        print("no torch installed: nothing to check (pip install torch, then the project)")
        return 2 if args.require_cuda else 0
    if args.cpu_dry_run:
        global DEVICE
        DEVICE = "cpu"
        args.only = [n for n in args.only or ("quant", "session", "sharded") if n in ("quant", "session", "sharded")]
        print("--cpu-dry-run: the CUDA checks on CPU tensors (tries the script; proves nothing about CUDA)")
    elif not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}): no check run; run this on a GPU machine")
        return 2 if args.require_cuda else 0
    else:
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    names = [n for n in (args.only or CHECKS) if n not in args.skip]
    failed = []
    for name in names:
        t0 = time.perf_counter()
        try:
            detail, status = CHECKS[name](args), "ok"
        except Exception as e:  # every check reports; the exit status sums them up
            detail, status = f"{type(e).__name__}: {e}", "FAIL"
            if not isinstance(e, Failed):
                detail += "\n" + _tail(traceback.format_exc(), 12)
            failed.append(name)
        print(f"[{status:>4}] {name:<17} {time.perf_counter() - t0:6.1f}s  {detail}", flush=True)
    for name, why in NOT_BUILT.items():
        print(f"[not built] {name:<12} {why}")
    print(f"{len(names) - len(failed)}/{len(names)} built checks passed" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
