"""Every CUDA path gradientmail has, run on a GPU machine, one line of result each.

    python bench/gpu_check.py                      # everything, in at most --total-seconds (450)
    python bench/gpu_check.py --skip overhead      # leave out the step-overhead benchmark
    python bench/gpu_check.py --only lightning-mp accelerate-fsdp
    python bench/gpu_check.py --overhead-args "--pairs 5 --steps 300"

Each check runs in its own process group, stopped at its own time limit or when the total runs
out (``--total-seconds``, default 450: the whole script ends within 8 minutes), and prints
``ok``, ``FAIL``, ``unsupported``, ``skip`` or ``timeout`` with a detail line; a failure never
stops the checks after it.

- ``quant``: ``adapters/torch_quant.quantize`` on CUDA writes the bytes ``codec/quant.quantize``
  writes, for every payload dtype (I2 and F4 included), on Gaussian data with specials and on a
  tensor longer than ``torch_quant.CHUNK`` (the chunked conversion).
- ``session``: two learners in real ``gm.Session``s on CUDA parameters, standard DiLoCo with
  BF16 and F4 deltas, once through the device pipeline and once through the host path: the final
  parameters must be bit-identical.
- ``sharded``: ``adapters/torch_sharded`` on FSDP2 DTensor parameters on CUDA, in a one-rank
  process group (nccl): the chunks it builds equal the chunks cut from an unsharded copy, and a
  commit scattered back lands in the parameters.
- ``fsdp-strategy``: Lightning ``FSDPStrategy`` (FSDP1, ``use_orig_params=True``, one unit per
  ``Linear``) on CUDA with ``GradientMailCallback``, beside a plain CUDA node in lockstep (quorum
  2): both end bit-identical at the newest commit (FSDP1 itself runs on CPU in the tests:
  ``tests/test_sharded_closer.py``; only Lightning's strategy refuses a CPU).
- ``lightning-mp``: Lightning ``ModelParallelStrategy`` on CUDA (``fully_shard`` in
  ``configure_model``, ``devices`` = the GPUs, at most 2) with ``GradientMailCallback``, beside a
  plain CUDA node in lockstep (quorum 2): both end bit-identical at the newest commit.
- ``accelerate-fsdp``: Accelerate's FSDP plugin at ``fsdp_version=2`` under torchrun, with
  ``accelerator.register_gradientmail``, beside a plain CUDA node: bit-identical.
- ``accelerate-fsdp1``: the same at ``fsdp_version=1`` with ``use_orig_params=True`` (FSDP1).
- ``trainer-fsdp``, ``trainer-fsdp1``: ``transformers.Trainer`` with its FSDP (``fsdp_config``
  version 2, or 1 with ``use_orig_params=True``) under torchrun and
  ``GradientMailTrainerCallback(module="model")``, beside a plain CUDA node: bit-identical (the
  Trainer's FSDP does not start on CPU: no dry run).
- ``dtensor-pipeline``: a sharded ``gm.Session`` on CUDA DTensor shards (FSDP2 under torchrun,
  one bf16 layer: deltas, the chunk exchange and alignment on the GPU; the sharded runtime
  quantizes its chunks on the host in this version), beside a plain CUDA node (the device
  pipeline): bit-identical.
- ``sharded-memory``: ``bench/sharded_memory.py --device cuda --anchors host`` on the GPUs (at
  most 2 ranks): each rank's peak GPU memory with gradientmail over the same FSDP2 training
  without it (goal <= 1.10), and its share of the node's bytes (its table printed).
- ``overhead``: ``bench/overhead.py --device cuda --params 100M --dtype bf16 --pairs 2`` (its table printed).
- ``tests``: the CUDA-parametrized cases of ``tests/test_torch_quant.py`` and
  ``tests/test_torch_pipeline.py`` (``pytest -k cuda``).

The paired checks run the sharded node and the plain node as separate processes over a
``FileMailbox`` in a temporary directory, with 1024-element chunks (``chunk_elements``), so with
two GPUs chunks straddle the ranks' shards.

``--cpu-dry-run`` runs quant, session, sharded, lightning-mp, accelerate-fsdp, accelerate-fsdp1
and dtensor-pipeline on CPU tensors (2 gloo ranks; the accelerate checks with ``fully_shard`` or
``FullyShardedDataParallel`` applied by hand, since Accelerate's FSDP plugin does not start on
CPU): it tries the script, not CUDA.

Exit status: 1 if any check failed or timed out, else 0 (``unsupported`` and ``skip`` are not
failures). Without CUDA it says so and checks nothing (status 0; ``--require-cuda`` makes that
status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEVICE = "cuda"  # "cpu" with --cpu-dry-run: the same checks on CPU tensors, to try the script itself
sys.path.insert(0, str(REPO))

# A check's exit status (the child process running it) -> what the summary prints.
OK, FAILED, UNSUPPORTED = 0, 1, 3
RESULT = "RESULT: "  # the child's last line starting with this is the check's detail line


class Failed(Exception):
    pass


class Unsupported(Exception):
    """The path exists in the frameworks but gradientmail does not support it (yet): reported as such."""


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
# subprocesses


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``argv`` in its own process group; on timeout kill the whole group (torchrun's and
    Lightning's workers included). Returns (exit status, stdout + stderr); 124 on timeout."""
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = 124
        out.seek(0)
        text = out.read().decode(errors="replace")
    if rc == 124:
        text += f"\n(stopped after {timeout:.0f} s)"
    return rc, text


def _run_all(argvs: list[list[str]], timeout: float, env: dict[str, str]) -> list[tuple[int, str]]:
    """Several commands at once (the nodes of one run); each gets the same deadline."""
    results: list[tuple[int, str]] = [(124, "")] * len(argvs)

    def one(i: int) -> None:
        results[i] = _run(argvs[i], timeout, env)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(argvs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _clean_env() -> dict[str, str]:
    """This environment without a launcher's rank variables (each node sets up its own)."""
    launch = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in launch}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def check_tests(args: argparse.Namespace) -> str:
    files = ["tests/test_torch_quant.py", "tests/test_torch_pipeline.py"]
    rc, out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", *files], args.budget)
    last = out.rstrip().splitlines()[-1] if out.strip() else "(no output)"
    if rc != 0:
        raise Failed(f"pytest exit {rc}: {last}\n{_tail(out)}")
    return last


def check_sharded(args: argparse.Namespace) -> str:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0")
    env.update(WORLD_SIZE="1", LOCAL_RANK="0")
    rc, out = _run([sys.executable, __file__, "--sharded-worker", DEVICE], args.budget, env)
    if rc != 0:
        raise Failed(f"exit {rc}\n{_tail(out)}")
    return out.strip().splitlines()[-1]


def sharded_worker(device: str) -> None:
    """One rank, FSDP2 on ``device``: chunks built from the DTensor shards against an unsharded copy."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gradientmail_core.adapters import torch_sharded as ts
    from gradientmail_core.adapters import torch_transfer as tt

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
    owned = tt.gather_chunks(sharded, names, chunk, local, meter=meter)
    ref = {n: p.detach().reshape(-1) for n, p in model().named_parameters()}
    for k, pieces in owned.items():
        for p, values in pieces:
            if not torch.equal(values, ref[p.name][p.start : p.stop]):
                raise SystemExit(f"chunk {k} piece {p}: differs from the unsharded model")
    commit = {k: [(p, v * 2 + 1) for p, v in pieces] for k, pieces in owned.items()}
    tt.scatter_chunks(sharded, names, chunk, commit, local, meter=meter)
    for n, p in sharded.params.items():
        if not torch.equal(p.full_tensor().reshape(-1), ref[n] * 2 + 1):
            raise SystemExit(f"{n}: the scattered commit did not land")
    dist.destroy_process_group()
    print(
        f"FSDP2 on one {device} rank ({backend}): {len(owned)} chunks of {chunk} == the unsharded model's; commit applied"
    )


def check_sharded_memory(args: argparse.Namespace) -> str:
    argv = [sys.executable, "bench/sharded_memory.py", "--device", "cuda", "--anchors", "host"]
    argv += ["--ranks", str(_ranks()), "--params", "50e6", "--steps", "24"]
    rc, out = _run(argv, args.budget - 2)
    print(_tail(out, 12))
    if rc != 0:
        raise Failed(f"{' '.join(argv[1:])}: exit {rc}")
    ratios = [line.split("(ratio ")[1].split(";")[0] for line in out.splitlines() if "(ratio " in line]
    return f"{' '.join(argv[1:])}: memory ratio per rank {', '.join(ratios)} (goal <= 1.10)"


def check_overhead(args: argparse.Namespace) -> str:
    argv = [sys.executable, "bench/overhead.py", "--device", "cuda", "--params", "100M", "--dtype", "bf16"]
    argv += shlex.split(args.overhead_args)
    rc, out = _run(argv, min(args.overhead_timeout, args.budget - 2))
    print(_tail(out, 40))
    if rc != 0:
        raise Failed(f"{' '.join(argv[1:])}: exit {rc}")
    return f"{' '.join(argv[1:])}: table above"


# ---------------------------------------------------------------------------------------------
# issue 13: sharded nodes through every integration, each beside a plain node

NODE_STEPS = 12  # sync_every=4, fragments=2: a round every 2 steps
CHUNK = 1024  # chunk_elements: net.0.weight (256 x 64) spans 16 chunks; with 2 ranks some straddle


def _ranks() -> int:
    """Ranks of a sharded node: one per GPU (NCCL wants distinct devices), at most 2; 2 on CPU."""
    import torch

    return 2 if DEVICE == "cpu" else max(1, min(2, torch.cuda.device_count()))


def _node_argv(kind: str, mailbox: str, out: Path, *extra: str) -> list[str]:
    argv = [sys.executable, __file__, "--worker", kind, "--device", DEVICE, "--mailbox", mailbox, "--out", str(out)]
    return [*argv, *extra]


def _torchrun(ranks: int, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *argv[1:]]


def _paired(args: argparse.Namespace, kind: str, launcher: Callable[[list[str]], list[str]], *extra: str) -> str:
    """The sharded node ``kind`` and a plain node in lockstep (quorum 2) on a fresh FileMailbox;
    both must end with the same parameters, bit for bit, after at least a few rounds."""
    with tempfile.TemporaryDirectory(prefix="gm-gpu-check-") as tmp:
        root = Path(tmp)
        mailbox = f"file://{root / 'mailbox'}"
        sharded = launcher(
            _node_argv(kind, mailbox, root / "sharded", "--seed", "1", "--learner-id", "sharded", *extra)
        )
        plain = _node_argv("plain", mailbox, root / "plain", "--seed", "2", "--learner-id", "plain", *extra)
        results = _run_all([sharded, plain], args.budget - 5, _clean_env())
        for name, (rc, out) in zip(("sharded node", "plain node"), results):
            if rc == UNSUPPORTED:
                raise Unsupported(f"{name}: {_last_result(out)}")
            if rc != 0:
                raise Failed(f"{name}: exit {rc}\n{_tail(out, 30)}")
        a, b = _load_params(root / "sharded"), _load_params(root / "plain")
        if a.keys() != b.keys():
            raise Failed(f"parameter names differ: {sorted(a)} vs {sorted(b)}")
        differ = [n for n in a if a[n].tobytes() != b[n].tobytes()]
        if differ:
            raise Failed(f"final parameters differ from the plain node's: {differ}")
        info = json.loads((root / "sharded" / "result.json").read_text())
        rounds = _rounds(root / "mailbox")
        if rounds < 3:
            raise Failed(f"only {rounds} rounds committed in {NODE_STEPS} steps")
        first = {n: p for n, p in _Init.params(info["bf16_head"]).items()}
        if all(first[n].tobytes() == a[n].tobytes() for n in a):
            raise Failed("the parameters never changed")
    return (
        f"{info['ranks']} rank(s) on {DEVICE} ({info['backend']}) + a plain {DEVICE} node, {NODE_STEPS} steps, "
        f"{rounds} rounds: final parameters bit-identical"
    )


def _last_result(out: str) -> str:
    lines = [x[len(RESULT) :] for x in out.splitlines() if x.startswith(RESULT)]
    return lines[-1] if lines else _tail(out, 5)


def _load_params(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "params.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _rounds(mailbox_dir: Path) -> int:
    import gradientmail_core as gm
    from gradientmail_core.protocol import keys

    return sum(keys.parse_round_key(k) is not None for k in gm.FileMailbox(mailbox_dir).list(keys.ROUNDS))


def check_fsdp_strategy(args: argparse.Namespace) -> str:
    return _paired(args, "lightning-fsdp1", lambda argv: argv)  # Lightning starts the other ranks itself


def check_lightning_mp(args: argparse.Namespace) -> str:
    return _paired(args, "lightning-mp", lambda argv: argv)  # Lightning starts the other ranks itself


def check_accelerate_fsdp(args: argparse.Namespace) -> str:
    return _paired(args, "accelerate-fsdp2", lambda argv: _torchrun(_ranks(), argv))


def check_accelerate_fsdp1(args: argparse.Namespace) -> str:
    return _paired(args, "accelerate-fsdp1", lambda argv: _torchrun(_ranks(), argv))


def check_trainer_fsdp(args: argparse.Namespace) -> str:
    return _paired(args, "trainer-fsdp2", lambda argv: _torchrun(_ranks(), argv))


def check_trainer_fsdp1(args: argparse.Namespace) -> str:
    return _paired(args, "trainer-fsdp1", lambda argv: _torchrun(_ranks(), argv))


def check_dtensor_pipeline(args: argparse.Namespace) -> str:
    return _paired(args, "sharded-session", lambda argv: _torchrun(_ranks(), argv), "--bf16-head")


# ---- the nodes (run as `gpu_check.py --worker KIND ...`) ---------------------------------------


class _Init:
    """The nodes' network: ``net.0`` (fp32) and ``net.3`` (bf16 with ``--bf16-head``), the same
    names in every node. The forward pass goes through the ``Sequential`` (FSDP2's root hooks)."""

    @staticmethod
    def seq(bf16_head: bool) -> Any:
        import torch

        class Cast(torch.nn.Module):
            def __init__(self, dtype: torch.dtype) -> None:
                super().__init__()
                self.dtype = dtype

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x.to(self.dtype)

        head = torch.bfloat16 if bf16_head else torch.float32
        torch.manual_seed(0)  # the same initial parameters on every node and rank
        seq = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), Cast(head), torch.nn.Linear(256, 64))
        seq[3].to(head)
        return seq

    @staticmethod
    def params(bf16_head: bool) -> dict[str, np.ndarray]:
        return {f"net.{n}": p.detach().float().numpy() for n, p in _Init.seq(bf16_head).named_parameters()}


def _node_net(device: str, bf16_head: bool = False) -> Any:
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Init.seq(bf16_head)

        def forward(self, x: Any) -> Any:
            return self.net(x).float()

    return Net().to(device)


def _batch(seed: int, rank: int, step: int, device: str) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed * 100_003 + rank * 1009 + step)
    x = torch.randn(16, 64, generator=g)
    return x.to(device), (x.roll(1, dims=1) * 0.5).to(device)


def _algorithm() -> Any:
    import gradientmail_core as gm

    # Overwrite: a sharded node does not carry local steps across commits yet (gm.Adaptive(), the default)
    return gm.DiLoCo(
        sync_every=4, fragments=2, overlap_steps=0, quorum_size=2, chunk_elements=CHUNK, alignment=gm.Overwrite()
    )


def _options(w: argparse.Namespace, role: str) -> dict[str, Any]:
    # The sharded node closes every round (its ranks merging their parts, the closer's code on a
    # GPU machine); the plain node only learns.
    return {"learner_id": w.learner_id, "role": role, "poll_interval": 0.05, "lease_timeout": 30.0, "callbacks": ()}


def _save(w: argparse.Namespace, params: dict[str, Any], **info: Any) -> None:
    os.makedirs(w.out, exist_ok=True)
    np.savez(os.path.join(w.out, "params.npz"), **{n: p.detach().float().cpu().numpy() for n, p in params.items()})
    Path(w.out, "result.json").write_text(json.dumps({"bf16_head": w.bf16_head, **info}))


def _full(module: Any) -> dict[str, Any]:
    """Full parameters of a module whose parameters may be DTensors (collective for those)."""
    from torch.distributed.tensor import DTensor

    return {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in module.named_parameters()}


def _init_dist(device: str) -> tuple[int, str]:
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_backend()


def _shard(module: Any) -> None:
    """FSDP2 on ``module.net``: each layer with parameters, then the Sequential (the root)."""
    from torch.distributed.fsdp import fully_shard

    for layer in module.net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(module.net)


def worker_plain(w: argparse.Namespace) -> None:
    import torch

    import gradientmail_core as gm

    model = _node_net(w.device, w.bf16_head)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mailbox = gm.open_mailbox(w.mailbox)
    with gm.Session(model, algorithm=_algorithm(), mailbox=mailbox, **_options(w, "learner")) as session:
        session.wait_for(2, timeout=120)
        for step in range(NODE_STEPS):
            x, y = _batch(w.seed, 0, step, w.device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            session.step(samples=len(x))
    _save(w, dict(model.named_parameters()), ranks=1, backend="none")
    print(f"{RESULT}plain node: {session.rounds_seen} rounds seen")


def worker_sharded_session(w: argparse.Namespace) -> None:
    """A sharded gm.Session on every rank of an FSDP2 model (under torchrun)."""
    import torch
    import torch.distributed as dist

    import gradientmail_core as gm

    rank, backend = _init_dist(w.device)
    model = _node_net(w.device, w.bf16_head)
    _shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mailbox = gm.open_mailbox(w.mailbox)
    with gm.Session(model, algorithm=_algorithm(), mailbox=mailbox, **_options(w, "both")) as session:
        if rank == 0:
            session.wait_for(2, timeout=120)
        dist.barrier()
        for step in range(NODE_STEPS):
            x, y = _batch(w.seed, rank, step, w.device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            session.step(samples=len(x) * dist.get_world_size())
    full = _full(model)
    if rank == 0:
        _save(w, full, ranks=dist.get_world_size(), backend=backend)
        print(f"{RESULT}sharded session: {dist.get_world_size()} ranks")
    dist.destroy_process_group()


def worker_lightning(w: argparse.Namespace, fsdp1: bool = False) -> None:
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    import gradientmail_core as gm
    from gradientmail_lightning import GradientMailCallback

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Init.seq(w.bf16_head)

        def configure_model(self) -> None:
            if not fsdp1:
                _shard(self)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    ranks = _ranks()
    callback = GradientMailCallback(
        algorithm=_algorithm(),
        mailbox=gm.open_mailbox(w.mailbox),
        wait_for_learners=2,
        wait_timeout=120,
        log_metrics=False,
        **_options(w, "both"),
    )
    strategy = (
        FSDPStrategy(use_orig_params=True, auto_wrap_policy={torch.nn.Linear}) if fsdp1 else ModelParallelStrategy()
    )
    trainer = Trainer(
        accelerator=w.device, devices=ranks, strategy=strategy, max_steps=NODE_STEPS, callbacks=[callback],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = [_batch(w.seed, 0, s, "cpu") for s in range(NODE_STEPS * ranks)]  # Lightning splits it over the ranks
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    module = Module()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False))
    if fsdp1:  # the root FSDP1 unit wraps the LightningModule: gather its parameters, named as the module's
        from torch.distributed.fsdp import FullyShardedDataParallel

        root = trainer.strategy.model
        with FullyShardedDataParallel.summon_full_params(root):
            full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in root.named_parameters()}
    else:
        full = _full(module)
    if trainer.global_rank == 0:
        import torch.distributed as dist

        name = "FSDPStrategy (FSDP1)" if fsdp1 else "ModelParallelStrategy"
        _save(w, full, ranks=trainer.world_size, backend=dist.get_backend() if dist.is_initialized() else "none")
        print(f"{RESULT}{name}: {trainer.world_size} ranks, {callback.driver.steps} session steps")


def worker_accelerate(w: argparse.Namespace, fsdp1: bool = False) -> None:
    """Accelerate under torchrun: the FSDP plugin at fsdp_version=2 (or 1, ``use_orig_params=True``)
    on CUDA; on CPU (dry run) ``fully_shard`` (or ``FullyShardedDataParallel``) by hand with
    ``Accelerator(cpu=True)``, since the plugin does not start there."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    import gradientmail_lightning  # noqa: F401  (adds Accelerator.register_gradientmail)
    from gradientmail_core.adapters.torch_sharded import find_sharded

    if w.device == "cpu":
        accelerator = Accelerator(cpu=True)
        model = _node_net("cpu", w.bf16_head)
        if fsdp1:
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
        else:
            _shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # not prepared: every step counts
        how = f"{'FullyShardedDataParallel' if fsdp1 else 'fully_shard'} by hand, Accelerator(cpu=True)"
    else:  # the model is built on the CPU; prepare shards it onto this process's GPU
        plugin = (
            FullyShardedDataParallelPlugin(fsdp_version=1, use_orig_params=True)
            if fsdp1
            else FullyShardedDataParallelPlugin(fsdp_version=2)
        )
        accelerator = Accelerator(fsdp_plugin=plugin)
        model = _node_net("cpu", w.bf16_head)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
        how = f"FSDP plugin fsdp_version={1 if fsdp1 else 2}, distributed_type={accelerator.distributed_type.value}"
    if find_sharded(model if fsdp1 else accelerator.unwrap_model(model)) is None:
        raise SystemExit(f"{how}: the prepared model's parameters are not sharded")
    handle = accelerator.register_gradientmail(
        model, optimizer, algorithm=_algorithm(), mailbox=w.mailbox, samples_per_step=16,
        wait_for_learners=2, wait_timeout=120, **_options(w, "both"),
    )  # fmt: skip
    rank = accelerator.process_index
    with handle:
        for step in range(NODE_STEPS):
            x, y = _batch(w.seed, rank, step, str(accelerator.device))
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    if fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    else:
        full = _full(accelerator.unwrap_model(model))
    if rank == 0:
        _save(w, full, ranks=accelerator.num_processes, backend=dist.get_backend())
        print(f"{RESULT}Accelerate ({how}): {accelerator.num_processes} ranks, {handle.steps} session steps")


def worker_trainer(w: argparse.Namespace, fsdp1: bool = False) -> None:
    """``transformers.Trainer`` under torchrun with its FSDP (``fsdp_config`` version 2, or 1 with
    ``use_orig_params=True``) and ``GradientMailTrainerCallback(module="model")``: the Trainer trains
    a module holding the network as ``self.model`` (its parameters: ``model.net...``), the run names
    them as the network does. The Trainer's FSDP does not start on CPU: CUDA only."""
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradientmail_lightning import GradientMailTrainerCallback

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = _node_net("cpu", w.bf16_head)

        def forward(self, x: Any, y: Any) -> dict[str, Any]:
            return {"loss": torch.nn.functional.mse_loss(self.model(x), y)}

    rank = int(os.environ.get("RANK", "0"))

    class Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return NODE_STEPS * 16

        def __getitem__(self, i: int) -> dict[str, Any]:
            x, y = _batch(w.seed, rank, i // 16, "cpu")
            return {"x": x[i % 16], "y": y[i % 16]}

    config: dict[str, Any] = {"fsdp_version": 1, "use_orig_params": True} if fsdp1 else {"fsdp_version": 2}
    args = TrainingArguments(
        output_dir=os.path.join(w.out, "hf"), max_steps=NODE_STEPS, per_device_train_batch_size=16,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", report_to=[], save_strategy="no",
        disable_tqdm=True, fsdp=True, fsdp_config=config, max_grad_norm=0.0, use_cpu=w.device == "cpu",
    )  # fmt: skip
    callback = GradientMailTrainerCallback(
        algorithm=_algorithm(), mailbox=w.mailbox, module="model", samples_per_step=16,
        wait_for_learners=2, wait_timeout=120, **_options(w, "both"),
    )  # fmt: skip
    seen: list[bool] = []

    class Sharded(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            seen.append(callback.driver.shards is not None)

    trainer = Trainer(model=Holder(), args=args, train_dataset=Batches(), callbacks=[callback, Sharded()])
    trainer.train()
    if not (seen and all(seen)):
        raise SystemExit("the Trainer's FSDP did not shard the model: the callback ran a plain data-parallel node")
    model = trainer.model
    if fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            full = {
                n.replace("_fsdp_wrapped_module.", "").removeprefix("model."): p.detach().clone()
                for n, p in model.named_parameters()
            }
    else:
        full = {n.removeprefix("model."): p for n, p in _full(model).items()}
    if rank == 0:
        _save(w, full, ranks=dist.get_world_size(), backend=dist.get_backend())
        print(f"{RESULT}Trainer FSDP{1 if fsdp1 else 2}: {dist.get_world_size()} ranks, {callback.driver.steps} steps")


WORKERS: dict[str, Callable[[argparse.Namespace], None]] = {
    "plain": worker_plain,
    "sharded-session": worker_sharded_session,
    "lightning-mp": worker_lightning,
    "lightning-fsdp1": lambda w: worker_lightning(w, fsdp1=True),
    "accelerate-fsdp2": worker_accelerate,
    "accelerate-fsdp1": lambda w: worker_accelerate(w, fsdp1=True),
    "trainer-fsdp2": worker_trainer,
    "trainer-fsdp1": lambda w: worker_trainer(w, fsdp1=True),
}


def run_worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True, choices=sorted(WORKERS))
    ap.add_argument("--device", required=True)
    ap.add_argument("--mailbox", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--learner-id")
    ap.add_argument("--bf16-head", action="store_true")
    w = ap.parse_args(argv)
    global DEVICE
    DEVICE = w.device
    import torch

    torch.set_num_threads(1)
    WORKERS[w.worker](w)


# ---------------------------------------------------------------------------------------------
# main: each check in its own process, within the total time limit

# name -> (function, seconds it may take at most, runs in --cpu-dry-run)
CHECKS: dict[str, tuple[Callable[[argparse.Namespace], str], float, bool]] = {
    "quant": (check_quant, 60, True),
    "session": (check_session, 90, True),
    "sharded": (check_sharded, 60, True),
    "fsdp-strategy": (check_fsdp_strategy, 60, False),
    "lightning-mp": (check_lightning_mp, 90, True),
    "accelerate-fsdp": (check_accelerate_fsdp, 90, True),
    "accelerate-fsdp1": (check_accelerate_fsdp1, 90, True),
    "trainer-fsdp": (check_trainer_fsdp, 90, False),
    "trainer-fsdp1": (check_trainer_fsdp1, 90, False),
    "dtensor-pipeline": (check_dtensor_pipeline, 90, True),
    "sharded-memory": (check_sharded_memory, 120, False),
    "overhead": (check_overhead, 240, False),
    "tests": (check_tests, 120, False),
}
MIN_SECONDS = 20  # a check that would get less than this is skipped


def run_check(name: str, args: argparse.Namespace) -> int:
    """In the child process: run one check, print its detail line, exit with its status."""
    try:
        detail, status = CHECKS[name][0](args), OK
    except Unsupported as e:
        detail, status = str(e), UNSUPPORTED
    except Exception as e:  # reported; the parent sums up
        detail, status = f"{type(e).__name__}: {e}", FAILED
        if not isinstance(e, Failed):
            detail += "\n" + _tail(traceback.format_exc(), 12)
    print(RESULT + detail.replace("\n", "\n  "), flush=True)
    return status


def main() -> int:
    if "--worker" in sys.argv:  # a node of a paired check (Lightning re-runs this line for its ranks)
        run_worker(sys.argv[1:])
        # Everything is written. A gloo group alive at exit can abort the process in the
        # interpreter's teardown ("terminate called without an active exception"): release the
        # default group and leave without the teardown, as the test nodes do.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            try:
                dist.barrier()
                dist.destroy_process_group()
            except Exception as e:  # (a peer gone already: nothing left to release together)
                print(f"could not release the process group: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", nargs="*", default=[], choices=sorted(CHECKS), help="checks to leave out")
    ap.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run only these checks")
    ap.add_argument("--total-seconds", type=float, default=450.0, help="time limit of the whole script")
    ap.add_argument("--overhead-args", default="--pairs 2", help="extra flags for bench/overhead.py")
    ap.add_argument("--overhead-timeout", type=float, default=240.0, help="seconds before overhead.py is stopped")
    ap.add_argument("--require-cuda", action="store_true", help="exit 2 (not 0) on a machine without CUDA")
    ap.add_argument("--sharded-worker", metavar="DEVICE", help=argparse.SUPPRESS)
    ap.add_argument("--check", choices=sorted(CHECKS), help=argparse.SUPPRESS)  # the child running one check
    ap.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the checks that can on CPU tensors")
    args = ap.parse_args()
    if args.sharded_worker:
        sharded_worker(args.sharded_worker)
        return 0
    try:
        import torch
    except ImportError:
        print("no torch installed: nothing to check (pip install torch, then the project)")
        return 2 if args.require_cuda else 0
    global DEVICE
    if args.cpu_dry_run:
        DEVICE = "cpu"
    if args.check:
        return run_check(args.check, args)
    if args.cpu_dry_run:
        args.only = [n for n in args.only or CHECKS if CHECKS[n][2]]
        print("--cpu-dry-run: the checks that can run on CPU tensors (tries the script; proves nothing about CUDA)")
    elif not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}): no check run; run this on a GPU machine")
        return 2 if args.require_cuda else 0
    else:
        gpus = torch.cuda.device_count()
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpus} x {torch.cuda.get_device_name(0)}")
    names = [n for n in (args.only or CHECKS) if n not in args.skip]
    deadline = time.monotonic() + args.total_seconds
    failed, counts = [], dict.fromkeys(("ok", "FAIL", "unsupported", "skip", "timeout"), 0)
    for name in names:
        left = deadline - time.monotonic()
        budget = min(CHECKS[name][1], left - 3)
        t0 = time.perf_counter()
        if budget < MIN_SECONDS:
            status, detail = "skip", f"{left:.0f} s left of --total-seconds {args.total_seconds:.0f}"
        else:
            argv = [sys.executable, __file__, "--check", name, "--budget", f"{budget - 5:.0f}"]
            argv += ["--overhead-args", args.overhead_args, "--overhead-timeout", str(args.overhead_timeout)]
            argv += ["--cpu-dry-run"] if args.cpu_dry_run else []
            rc, out = _run(argv, budget)
            detail = _last_result(out) if RESULT in out else _tail(out, 15)
            if name == "overhead":
                print(_tail(out.split(RESULT)[0], 40))
            status = {OK: "ok", UNSUPPORTED: "unsupported", 124: "timeout"}.get(rc, "FAIL")
            if status == "timeout":
                detail = f"stopped after {budget:.0f} s\n  {_tail(out, 15)}"
        counts[status] += 1
        if status in ("FAIL", "timeout"):
            failed.append(name)
        print(f"[{status:>11}] {name:<17} {time.perf_counter() - t0:6.1f}s  {detail}", flush=True)
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n) + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
