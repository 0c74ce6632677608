"""Canonical parameter names (``adapters/naming.py``), ``module=`` and ``names=``, and the
``SchemaMismatch`` that says the fix (``protocol/schema.py``).

The run of four real processes: a plain node, a ``torch.compile``d one (compiled whole and per
block), a one-process ``DistributedDataParallel`` one and a Lightning node holding the network as
``self.net`` (``module="net"``), each naming its parameters differently in its own model, train one
run in lockstep. In this process: the names each wrapper gets, ties, the mapping options, and the
mismatch message on a plain node, an MLX node and (in ``torchrun`` processes) a sharded one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from node_procs import round_records, run_nodes  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.adapters import adapter_for  # noqa: E402
from gradientmail_core.adapters.naming import canonical_parameters, select  # noqa: E402

HERE = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
ALGO = gm.DiLoCo(sync_every=4, fragments=2)
OVERWRITE = gm.Overwrite()  # sharded nodes do not carry local steps yet (gm.Adaptive(), the default, does)
QUIET = {"poll_interval": 0.05, "lease_timeout": 5.0, "callbacks": ()}


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


class Holder(torch.nn.Module):
    """A module holding the network one attribute deeper, as a LightningModule's ``self.net``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = net()


NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.timeout(300)
def test_plain_compiled_ddp_and_lightning_module_net_nodes_train_one_run(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    mb = tmp_path / "mb"
    kinds = ["plain", "compiled", "ddp", "lightning"]
    run_nodes(
        [
            [
                "python",
                str(HERE / "names_node.py"),
                k,
                "--mailbox",
                str(mb),
                "--out",
                str(tmp_path / k),
                "--seed",
                str(i + 1),
            ]
            for i, k in enumerate(kinds)
        ],  # fmt: skip
        logs=tmp_path / "logs",
    )
    reports = {k: json.loads((tmp_path / f"{k}.json").read_text()) for k in kinds}
    own = {k: r["own_names"] for k, r in reports.items()}
    assert own["plain"] == NAMES
    assert own["compiled"] == ["_orig_mod.0._orig_mod.weight", "_orig_mod.0._orig_mod.bias", "_orig_mod.2.weight",
                               "_orig_mod.2.bias"]  # fmt: skip
    assert own["ddp"] == [f"module.{n}" for n in NAMES]
    assert own["lightning"] == [f"net.{n}" for n in NAMES]
    for k, r in reports.items():
        assert r["schema"] == NAMES, k
        assert [a[0] for a in r["aligned"]] == [0, 1, 2, 3] and all(a[1] == sorted(kinds) for a in r["aligned"]), k
    # Every round merged every node's contribution of the steps since its last one.
    records = round_records(mb)
    assert sorted(records) == [0, 1, 2, 3]
    for r, rec in records.items():
        steps = {p["learner"]: p["steps"] for p in rec["participants"]}
        assert steps == dict.fromkeys(kinds, 2 if r == 0 else 4), r
    finals = {k: dict(np.load(tmp_path / f"{k}.npz")) for k in kinds}
    for k in kinds:
        assert finals[k].keys() == set(NAMES)
        for n in NAMES:
            assert finals[k][n].tobytes() == finals["plain"][n].tobytes(), (k, n)


def test_wrappers_are_removed_at_any_depth_and_a_tied_parameter_is_named_once() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = net()
    model[0] = torch.compile(model[0], backend="eager")
    model[2] = checkpoint_wrapper(model[2])
    wrapped = torch.compile(model, backend="eager")
    assert [n for n, _ in wrapped.named_parameters()][0] == "_orig_mod.0._orig_mod.weight"
    assert list(canonical_parameters(wrapped)) == NAMES
    assert [s.name for s in adapter_for(wrapped).schema()] == NAMES

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    assert list(canonical_parameters(Tied())) == ["embed.weight", "body.weight", "body.bias"]


def test_a_tied_weight_travels_once_and_stays_one_tensor_after_every_commit() -> None:
    class TiedLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(12, 6)
            self.head = torch.nn.Linear(6, 12, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.embed(x)))

    model = TiedLM()
    storage = model.embed.weight.data_ptr()
    checks: list[bool] = []

    def on_commit(e: gm.events.Event) -> None:
        if isinstance(e, gm.events.Aligned):
            checks.append(model.head.weight is model.embed.weight and model.head.weight.data_ptr() == storage)

    mailbox = gm.MemoryMailbox()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.arange(12).repeat(2)
    lockstep = gm.DiLoCo(sync_every=2, fragments=1, in_flight=1, overlap_steps=0)  # each commit aligned in step
    with gm.Session(model, algorithm=lockstep, mailbox=mailbox,
                    **{**QUIET, "callbacks": [on_commit]}) as session:  # fmt: skip
        assert [s.name for s in session.adapter.schema()] == ["embed.weight"]
        for _ in range(8):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), x.roll(1)).backward()
            opt.step()
            session.step(samples=len(x))
    assert len(checks) >= 4 and all(checks)
    assert model.head.weight is model.embed.weight and model.head.weight.data_ptr() == storage


def test_module_selects_through_wrappers_and_names_maps_to_the_runs_names() -> None:
    holder = Holder()
    ddp_like = torch.compile(holder, backend="eager")
    assert select(ddp_like, "net") is holder.net
    assert select(holder, lambda m: m.net) is holder.net
    assert [s.name for s in adapter_for(ddp_like, module="net").schema()] == NAMES
    with pytest.raises(ValueError, match=r"has no submodule 'nett' \(it has \['net'\]\)"):
        select(holder, "nett")
    renamed = adapter_for(holder, names=lambda n: n.removeprefix("net."))
    assert [s.name for s in renamed.schema()] == NAMES
    assert [s.name for s in adapter_for(net(), names={"0.weight": "first.weight"}).schema()][:2] == [
        "first.weight", "0.bias"]  # fmt: skip
    with pytest.raises(ValueError, match="not parameters of this node"):
        adapter_for(net(), names={"0.wieght": "x"})
    with pytest.raises(ValueError, match="maps both"):
        adapter_for(net(), names=lambda n: "same")
    # A dict of arrays (NumpyAdapter) is renamed too.
    arrays = {"a": np.zeros(3, np.float32)}
    assert [s.name for s in adapter_for(arrays, names={"a": "b"}).schema()] == ["b"]


def test_a_plain_node_whose_names_are_one_level_deeper_is_told_to_pass_module() -> None:
    mailbox = gm.MemoryMailbox()
    with gm.Session(net(), algorithm=ALGO, mailbox=mailbox, learner_id="run", **QUIET):
        pass
    with pytest.raises(gm.SchemaMismatch) as e:
        gm.Session(Holder(), algorithm=ALGO, mailbox=mailbox, learner_id="deeper", **QUIET).open()
    assert "net.0.weight: in this model, not in the run" in str(e.value)
    assert "every name of this node starts with 'net.'" in str(e.value) and "pass module='net'" in str(e.value)
    # Following the advice joins: the submodule itself, or names= that drop the prefix.
    with gm.Session(Holder().net, algorithm=ALGO, mailbox=mailbox, learner_id="sub", **QUIET):
        pass
    with gm.Session(Holder(), algorithm=ALGO, mailbox=mailbox, learner_id="mapped",
                    names=lambda n: n.removeprefix("net."), **QUIET):  # fmt: skip
        pass
    # The other way round: the run's names are one level deeper than this node's.
    deep = gm.MemoryMailbox()
    with gm.Session(Holder(), algorithm=ALGO, mailbox=deep, learner_id="run", **QUIET):
        pass
    with pytest.raises(gm.SchemaMismatch, match=r"names=lambda n: 'net.' \+ n"):
        gm.Session(net(), algorithm=ALGO, mailbox=deep, learner_id="shallow", **QUIET).open()
    # gm.align checks the same way.
    with pytest.raises(gm.SchemaMismatch, match="pass module='net'"):
        gm.align(Holder(), mailbox=mailbox)


def test_register_gradientmail_with_module_joins_the_run_of_the_bare_network() -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    import gradientmail_lightning  # noqa: F401  (adds Accelerator.register_gradientmail)

    mailbox = gm.MemoryMailbox()
    with gm.Session(net(), algorithm=ALGO, mailbox=mailbox, learner_id="run", **QUIET):
        pass
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True)
        holder = Holder()
        torch.nn.init.zeros_(holder.net[0].weight)  # not the run's: joining loads the run's values
        model, optimizer = accelerator.prepare(holder, torch.optim.SGD(holder.parameters(), lr=0.1))
        handle = accelerator.register_gradientmail(model, optimizer, algorithm=ALGO, mailbox=mailbox, module="net",
                                                   learner_id="accelerate", **QUIET)  # fmt: skip
        with handle:
            assert torch.equal(holder.net[0].weight, net()[0].weight)
            assert handle.session is not None and [s.name for s in handle.session.adapter.schema()] == NAMES
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_an_mlx_node_gets_the_same_mismatch_and_fix() -> None:
    pytest.importorskip("mlx.core")
    import mlx.nn as mnn

    class MLXNet(mnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [mnn.Linear(4, 8), mnn.Linear(8, 2)]

    class MLXHolder(mnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLXNet()

    mailbox = gm.MemoryMailbox()
    with gm.Session(MLXNet(), algorithm=ALGO, mailbox=mailbox, learner_id="run", **QUIET):
        pass
    with pytest.raises(gm.SchemaMismatch, match="pass module='net'"):
        gm.Session(MLXHolder(), algorithm=ALGO, mailbox=mailbox, learner_id="mlx", **QUIET).open()
    with gm.Session(MLXHolder(), algorithm=ALGO, mailbox=mailbox, learner_id="mlx-mapped",
                    names=lambda n: n.removeprefix("net."), **QUIET):  # fmt: skip
        pass


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available() and TORCHRUN.exists()),
    reason="torch.distributed with gloo (and torchrun) is unavailable",
)
def test_sharded_fsdp2_and_fsdp1_nodes_whose_names_differ_raise_schema_mismatch_with_the_fix_on_every_rank(
    tmp_path: Path,
) -> None:
    mb = tmp_path / "mb"
    with gm.Session(net(), algorithm=gm.DiLoCo(sync_every=4, fragments=2, chunk_elements=64, alignment=OVERWRITE),
                    mailbox=gm.FileMailbox(mb), learner_id="run", **QUIET):  # fmt: skip
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", __file__, str(mb), str(tmp_path / "rank")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for kind, rank in [(k, r) for k in ("fsdp2", "fsdp1") for r in (0, 1)]:
        got = json.loads((tmp_path / f"rank-{kind}-{rank}.json").read_text())
        assert got["type"] == "SchemaMismatch", (kind, rank, got)
        assert "net.0.weight: in this model, not in the run" in got["message"]
        assert "pass module='net'" in got["message"]
        assert got["fixed"] == NAMES  # module='net' on the same sharded node gives the run's names


def _sharded_mismatch(mailbox: str, out: str) -> None:
    """One rank of a 2-rank node of ``Holder`` (names ``net.0.weight``...), sharded with FSDP2 and
    then with FSDP1, opening a session on the run a plain ``net()`` created (``0.weight``...)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fsdp2 = Holder()
    for layer in fsdp2.net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(fsdp2)
    fsdp1 = FullyShardedDataParallel(Holder(), use_orig_params=True, device_id=torch.device("cpu"))
    algo = gm.DiLoCo(sync_every=4, fragments=2, chunk_elements=64, alignment=OVERWRITE)
    for kind, model in (("fsdp2", fsdp2), ("fsdp1", fsdp1)):
        got: dict[str, object] = {}
        try:
            gm.Session(model, algorithm=algo, mailbox=gm.FileMailbox(mailbox), learner_id="shard", **QUIET).open()
            got = {"type": "opened", "message": ""}
        except Exception as e:
            got = {"type": type(e).__name__, "message": str(e)}
        got["fixed"] = [s.name for s in adapter_for(model, module="net").schema()]
        Path(f"{out}-{kind}-{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    _sharded_mismatch(sys.argv[1], sys.argv[2])
