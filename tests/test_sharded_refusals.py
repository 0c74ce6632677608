"""What a sharded node refuses in this version, each with ``ShardingUnsupported`` saying what to do
(``docs/sharding.md``, section 6), checked in one real process: a one-rank gloo group, a model
``fully_shard``-ed on it. Runs as a script (the harness reads its JSON)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def _check() -> dict[str, str]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import gradientmail_core as gm
    from gradientmail_core.adapters.torch_sharded import ShardingUnsupported

    dist.init_process_group("gloo")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    ok = dict(sync_every=4, fragments=2, chunk_elements=64, alignment=gm.Overwrite())
    cases = {
        "role_both": (dict(ok), {"role": "both"}),  # accepted: a sharded node closes rounds too
        "default_alignment": (dict(sync_every=4, fragments=2, chunk_elements=64), {}),
        "whole_fragments": ({**ok, "chunk_elements": None}, {}),
        "checkpoint_every": ({**ok, "commit_dtype": "F4", "checkpoint_every": 4}, {}),
        "carry": ({**ok, "alignment": gm.Carry()}, {}),
        "adaptive": ({**ok, "alignment": gm.Adaptive()}, {}),  # named, not the default: refused
        "error_feedback": ({**ok, "delta_dtype": "F4", "error_feedback": True}, {}),
        "gap_projection": ({**ok, "commit_dtype": "I2", "gap_projection": True}, {}),
    }
    out = {}
    for name, (cfg, kw) in cases.items():
        try:
            gm.Session(model, algorithm=gm.DiLoCo(**cfg), mailbox=gm.MemoryMailbox(), **kw)
            out[name] = "accepted"
        except ShardingUnsupported as e:
            out[name] = str(e)
    # A run of whole fragments (created by a plain node with chunk_elements=None): refused at open.
    mailbox = gm.MemoryMailbox()
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with gm.Session(plain, algorithm=gm.DiLoCo(sync_every=4, fragments=2, chunk_elements=None), mailbox=mailbox):
        pass
    session = gm.Session(model, algorithm=gm.DiLoCo(**ok), mailbox=mailbox, learner_id="shard", callbacks=[])
    try:
        session.open()
        out["old_run"] = "accepted"
    except ShardingUnsupported as e:
        out["old_run"] = str(e)
    # Left at the default, the rule of the run a sharded node creates is Overwrite...
    mailbox = gm.MemoryMailbox()
    with gm.Session(model, algorithm=gm.DiLoCo(sync_every=4, fragments=2, chunk_elements=64), mailbox=mailbox):
        pass
    out["created_rule"] = json.loads(mailbox.get("manifest.json"))["config"].get("alignment", "omitted")
    # ...and a run a plain node created with the default (Adaptive) is refused at open, saying why.
    mailbox = gm.MemoryMailbox()
    with gm.Session(plain, algorithm=gm.DiLoCo(sync_every=4, fragments=2, chunk_elements=64), mailbox=mailbox):
        pass
    session = gm.Session(model, algorithm=gm.DiLoCo(sync_every=4, fragments=2, chunk_elements=64), mailbox=mailbox)
    try:
        session.open()
        out["adaptive_run"] = "accepted"
    except ShardingUnsupported as e:
        out["adaptive_run"] = str(e)
    # A session used before it is opened says so.
    try:
        gm.Session(model, algorithm=gm.DiLoCo(**ok), mailbox=gm.MemoryMailbox()).step()
        out["unopened"] = "accepted"
    except RuntimeError as e:
        out["unopened"] = str(e)
    dist.destroy_process_group()
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)
def test_a_sharded_node_refuses_what_it_does_not_do_yet_and_says_what_to_do():
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "RANK": "0", "WORLD_SIZE": "1"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["role_both"] == "accepted"
    assert "chunk_elements=None" in got["whole_fragments"]
    assert "checkpoint_every=4" in got["checkpoint_every"] and "checkpoint_every=1" in got["checkpoint_every"]
    assert "gm.Overwrite()" in got["carry"] and "Carry(" in got["carry"]
    # the default rule (Adaptive) is not a sharded node's: left at it, the node creates a run of
    # Overwrite; named, or the rule of the run it joins, it is refused with what to pass instead
    assert got["default_alignment"] == "accepted" and got["created_rule"] == "omitted", got
    assert "Adaptive(" in got["adaptive"] and "gm.Overwrite()" in got["adaptive"]
    assert "Adaptive(" in got["adaptive_run"] and "the node that creates the run" in got["adaptive_run"]
    assert "error_feedback=True" in got["error_feedback"]
    assert "gap_projection=True" in got["gap_projection"] and "without it" in got["gap_projection"]
    assert "stores whole fragments" in got["old_run"] and "chunk size" in got["old_run"]
    assert "not open" in got["unopened"]


if __name__ == "__main__":
    print(json.dumps(_check()))
