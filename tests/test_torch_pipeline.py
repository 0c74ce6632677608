"""The torch device pipeline (``TorchPipeline``): deltas, quantization and alignment where the
parameters live. Run here on CPU tensors (``device_pipeline=True``), through the code a CUDA node
runs, and checked against the host path: same deltas, same blends, the same bytes in the store."""

from __future__ import annotations

import importlib.util
import random
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.adapters import torch as torch_adapter  # noqa: E402
from gradientmail_core.adapters.torch import TorchAdapter  # noqa: E402
from gradientmail_core.clock import FakeClock  # noqa: E402
from gradientmail_core.codec import quant  # noqa: E402
from gradientmail_core.protocol.run import open_run  # noqa: E402
from gradientmail_core.protocol.store import RunStore  # noqa: E402
from gradientmail_core.syncer.bridge import Bridge  # noqa: E402
from gradientmail_core.syncer.learner import Learner  # noqa: E402
from gradientmail_core.syncer.node import Node  # noqa: E402
from gradientmail_core.syncer.options import NodeOptions  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Net(torch.nn.Module):
    """Every parameter kind the pipeline handles: float32, bfloat16, float16, 0-d, and a tensor
    whose size is not a multiple of F4's block."""

    def __init__(self, seed: int, device: str = "cpu") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def param(shape, dtype):
            return torch.nn.Parameter(torch.randn(shape, generator=g).to(device, dtype))

        self.embed = param((6, 4), torch.float32)
        self.block = param((40,), torch.bfloat16)
        self.gate = param((), torch.float32)
        self.head = param((4, 4), torch.float16)


def train(model: Net, g: torch.Generator, target: Net) -> None:
    """A deterministic stand-in for an optimizer step: toward a target, plus seeded noise."""
    with torch.no_grad():
        for p, t in zip(model.parameters(), target.parameters(), strict=True):
            noise = torch.randn(p.shape, generator=g).to(p.device)
            p.copy_(p.float() - 0.1 * (p.float() - t.float()) + 0.01 * noise)


def representable(theta: dict[str, np.ndarray], model: Net) -> dict[str, np.ndarray]:
    """Thetas as a commit carries them: float32 values the parameter's dtype holds exactly."""
    dtypes = {n: s.dtype for n, s in zip(theta, TorchAdapter(model).schema(), strict=True)}
    return {n: quant.dequantize(quant.quantize(v, dtypes[n])) for n, v in theta.items()}


def random_theta(model: Net, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    theta = {n: rng.standard_normal(tuple(p.shape)).astype(np.float32) for n, p in model.named_parameters()}
    return representable(theta, model)


# ---- the pieces ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mixing", [0.0, 0.3, 0.5, 0.9])
def test_aligning_on_the_device_blends_exactly_like_the_host_write(device, mixing) -> None:
    host, dev = Net(1, device), Net(1, device)
    pipeline = TorchAdapter(dev, device_pipeline=True).pipeline
    assert pipeline is not None
    for seed in (2, 3):  # twice: the second blend starts from a blended model
        theta = random_theta(host, seed)
        TorchAdapter(host, device_pipeline=False).write(theta, mixing)
        pipeline.align(pipeline.stage(theta), mixing)
        for (n, a), b in zip(host.named_parameters(), dev.parameters(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a.view(-1), b.view(-1)), n
            assert torch.equal(pipeline.anchors[n].float().cpu(), torch.from_numpy(theta[n]))  # the new anchor
    assert not all(torch.equal(a, b) for a, b in zip(host.parameters(), Net(1, device).parameters(), strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [None, *quant.DTYPES])
def test_a_captured_delta_encodes_to_the_host_paths_bytes(device, dtype) -> None:
    model = Net(1, device)
    adapter = TorchAdapter(model, device_pipeline=True)
    assert adapter.pipeline is not None
    theta = random_theta(model, 5)
    adapter.pipeline.align(adapter.pipeline.stage(theta))
    train(model, torch.Generator().manual_seed(0), Net(9, device))
    names = [s.name for s in adapter.schema()]
    dtypes = {s.name: dtype or s.dtype for s in adapter.schema()}
    captured = adapter.pipeline.capture(names)
    local = adapter.read(names)
    train(model, torch.Generator().manual_seed(1), Net(9, device))  # later steps do not leak into it
    got = captured.encode(dtypes)
    for n in names:
        want = quant.quantize(np.subtract(theta[n], local[n], dtype=np.float32), dtypes[n])
        assert got[n].dtype == want.dtype and got[n].shape == want.shape
        assert got[n].data.tobytes() == want.data.tobytes(), n
        assert (got[n].scale is None) == (want.scale is None)
        assert want.scale is None or got[n].scale.tobytes() == want.scale.tobytes()


class RecordingDevice(torch_adapter._Device):
    """The CPU device, noting which thread-side operation each pipeline call used."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.log: list[str] = []

    def side(self):
        self.log.append("side")
        return super().side()

    def mark(self):
        self.log.append("mark")
        return "event"

    def after(self, event) -> None:
        self.log.append(f"after {event}")

    def download(self, tensors):
        self.log.append("download")
        return super().download(tensors)


def test_the_training_threads_calls_only_queue_device_work() -> None:
    model = Net(1)
    adapter = TorchAdapter(model)
    device = RecordingDevice()
    pipeline = torch_adapter.TorchPipeline(adapter.params, device)
    staged = pipeline.stage(random_theta(model, 2))  # background
    assert device.log == ["side", "mark"]
    device.log.clear()
    pipeline.align(staged, 0.5)  # training thread: waits for the staging event on the device
    captured = pipeline.capture(["embed", "gate"])  # training thread
    assert device.log == ["after event", "mark"]
    device.log.clear()
    captured.encode({"embed": "F4", "gate": "BF16"})  # background: the only host wait
    assert device.log == ["side", "after event", "download"]


def test_the_pipeline_is_on_by_default_only_for_cuda_parameters() -> None:
    assert TorchAdapter(Net(1)).pipeline is None
    assert TorchAdapter(Net(1), device_pipeline=True).pipeline is not None
    if torch.cuda.is_available():
        assert TorchAdapter(Net(1, "cuda")).pipeline is not None


# ---- whole runs ----------------------------------------------------------------------------------


class NoHostCopies(TorchAdapter):
    """Fails if the learner falls back to host copies once training started."""

    training = False

    def read(self, names):
        assert not self.training, "a host read on the device path"
        return super().read(names)

    def write(self, values, mixing=0.0):
        assert not self.training, "a host write on the device path"
        super().write(values, mixing)


def run_cluster(
    cfg: gm.DiLoCo, *, pipeline: bool, compression: str = "", device: str = "cpu", steps: int = 30
) -> tuple[dict, list]:
    """Two torch learners driven single-threaded on a fake clock; every object in the store."""
    mailbox, clock = gm.MemoryMailbox(), FakeClock()
    members = []
    for i, name in enumerate(["a", "b"]):
        model = Net(10 + i, device)
        adapter = NoHostCopies(model, device_pipeline=pipeline)
        store = RunStore(mailbox)
        run, created = open_run(
            store, adapter.schema(), adapter.read, cfg, learner=name, compression=compression, rng=random.Random(i)
        )
        opts = NodeOptions(poll_interval=0.1, lease_timeout=2.0, round_timeout=1.0, compression=compression)
        bridge = Bridge()
        node = Node(
            store, clock, run, learner=name, nonce=f"{i + 1:08x}", emit=lambda e: None, options=opts, bridge=bridge
        )
        thetas = node.join(created=created)
        learner = Learner(adapter, run, bridge, clock, learner=name, emit=lambda e: None)
        learner.start(node.state.head, thetas, {f: v for f, (v, _) in node.state.thetas.items()})
        adapter.training = pipeline
        members.append((model, node, learner, torch.Generator().manual_seed(i), Net(7, device)))
    for _, node, *_ in members:
        node.state.list_leases(node.store)
    for step in range(steps + 40):
        for model, node, learner, g, target in members:
            if step < steps:
                train(model, g, target)
                learner.step(4)
            node.tick()
            learner.drain()
        clock.advance(0.05)
    objects = {k: mailbox.get(k) for k in mailbox.list("")}
    return objects, [[p.detach().cpu() for p in m[0].parameters()] for m in members]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("cfg", "compression"),
    [
        (gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2), ""),
        (gm.DiLoCo(sync_every=6, fragments=2, mixing=0.5, delta_dtype="F4", commit_dtype="F8_E4M3"), ""),
        (gm.DiLoCo(sync_every=4, fragments=2, delta_dtype="I2", commit_dtype="I2"), ""),
        pytest.param(
            gm.DiLoCo(sync_every=4, fragments=1, in_flight=1, quorum_size=2, delta_dtype="F8_E4M3"),
            "zstd",
            marks=pytest.mark.skipif(importlib.util.find_spec("zstandard") is None, reason="zstandard not installed"),
        ),
    ],
    ids=["param-dtypes", "mixing-f4", "i2", "f8-zstd"],
)
def test_a_run_on_the_device_path_stores_the_host_paths_bytes(cfg, compression, device) -> None:
    host_objects, host_params = run_cluster(cfg, pipeline=False, compression=compression, device=device)
    dev_objects, dev_params = run_cluster(cfg, pipeline=True, compression=compression, device=device)
    rounds = [k for k in host_objects if k.startswith("rounds/")]
    assert len(rounds) >= 4  # rounds committed, with snapshots from both learners' deltas
    assert sorted(dev_objects) == sorted(host_objects)
    for k in host_objects:
        assert dev_objects[k] == host_objects[k], k
    for a, b in zip(host_params, dev_params, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_sessions_on_the_device_path_match_the_host_path(device) -> None:
    """Standard DiLoCo (a barrier, every learner in every round) through real Sessions."""
    cfg = gm.DiLoCo(sync_every=3, fragments=1, in_flight=1, overlap_steps=0, quorum_size=2, delta_dtype="BF16")

    def run(pipeline: bool) -> list[list[torch.Tensor]]:
        mailbox = gm.MemoryMailbox()
        models = [Net(20, device) for _ in range(2)]  # equal: whichever joins first creates the run
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                adapter = TorchAdapter(models[i], device_pipeline=pipeline)
                g, target = torch.Generator().manual_seed(i), Net(7, device)
                opts = dict(learner_id=f"w{i}", poll_interval=0.01, lease_timeout=10.0, callbacks=())
                with gm.Session(adapter, algorithm=cfg, mailbox=mailbox, **opts) as s:
                    s.wait_for(learners=2, timeout=30)
                    for _ in range(4 * cfg.sync_every):
                        train(models[i], g, target)
                        s.step(samples=4)
                    assert (adapter.pipeline is not None) == pipeline
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        return [[p.detach().cpu() for p in m.parameters()] for m in models]

    host, dev = run(False), run(True)
    for a, b in zip(host, dev, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    assert not torch.equal(host[0][0], Net(20).embed.detach())  # trained and aligned
