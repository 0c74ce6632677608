"""A sharded node (FSDP2, issue 13) in a run with a plain node: real processes, gloo on CPU.

A 2-rank FSDP2 ``gm.Session`` node (``torchrun``, ``tests/sharded_node.py sharded``) and a plain
node (``sharded_node.py plain``: it creates the run and closes the rounds) train one tiny MLP in
lockstep (quorum 2, ``overlap_steps=0``) with 64-element chunks, so most chunks straddle the two
ranks' shards. Every round commits with both contributions, and what each node uploaded is
``anchor - local`` of its own parameters at that step, byte for byte (``check_contributions``; the
ending alone proves nothing there: ``close()`` loads the newest commit on every node). At the end
both nodes hold the newest commit: their full parameters are bit-identical (the sharded node's
gathered with ``full_tensor()``). The code's own ``Meter`` (the largest allocation, and the most one
publish or one commit allocated in all) never reports a fragment's bytes, and does report one when a
chunk is the whole fragment; what the ranks really allocate is measured by the operating system in
``tests/test_sharded_memory.py``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gradientmail_core as gm
from gradientmail_core.codec import quant
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import RoundRecord, Snapshot, chunk_refs
from gradientmail_core.protocol.run import RunInfo, read_manifest
from gradientmail_core.protocol.store import RunStore

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available() and TORCHRUN.exists()),
    reason="torch.distributed with gloo (and torchrun) is unavailable",
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    return env


def _start(cmd: list[str], log: Path, **kw: object) -> subprocess.Popen[bytes]:
    # Output to a file, not a pipe: a node that logs more than a pipe holds would block on it.
    with open(log, "wb") as sink:
        p = subprocess.Popen(cmd, env=_env(), stdout=sink, stderr=subprocess.STDOUT, **kw)  # type: ignore[call-overload]
    p.log = log  # type: ignore[attr-defined]
    return p


def plain(mailbox: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(HERE / "sharded_node.py"), "plain", "--mailbox", str(mailbox), "--id", "plain"]
    return _start([*cmd, "--out", str(out), *extra], out.with_suffix(".log"))


def sharded(mailbox: Path, out: Path, *extra: str, ranks: int = 2, name: str = "shard") -> subprocess.Popen[bytes]:
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}", str(HERE / "sharded_node.py"), "sharded"]
    cmd += ["--mailbox", str(mailbox), "--id", name, "--out", str(out), *extra]
    # start_new_session: its own process group, so the test can kill torchrun and every rank
    return _start(cmd, out.with_suffix(".log"), start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def finish(*procs: subprocess.Popen[bytes], timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        for q in procs:
            if q.poll() is None:
                # torchrun's workers live in process groups of their own: kill every descendant
                for d in descendants(q.pid):
                    try:
                        os.kill(d, signal.SIGKILL)
                    except OSError:
                        pass
                os.killpg(q.pid, signal.SIGKILL) if os.getpgid(q.pid) == q.pid else q.kill()
                q.wait()
    outs = [f"--- {p.args[2:6]} rc={p.returncode}\n" + p.log.read_text(errors="replace")[-8000:] for p in procs]  # type: ignore[attr-defined]
    assert all(p.returncode == 0 for p in procs), "\n\n".join(outs)


def snapshots(store: RunStore) -> list[Snapshot]:
    out = []
    for key in store.keys(keys.SNAPSHOTS):
        snap = store.read_record(key, Snapshot)
        assert snap is not None, key
        out.append(snap)
    return out


def check_contributions(mailbox: Path, locals_npz: Path, learner: str) -> int:
    """Every contribution ``learner`` uploaded (the run kept with ``--keep``) is, chunk for chunk,
    the bytes a plain node's publisher writes for ``anchor - local`` (float32, then quantized to the
    run's delta dtypes), computed here from the node's own parameters at that step
    (``--record-locals``) and the commit it was aligned with (``base_version``, read from the store).
    Returns how many contributions were checked."""
    store = RunStore(gm.FileMailbox(str(mailbox)))
    manifest = read_manifest(store)
    assert manifest is not None
    run = RunInfo.from_manifest(manifest)
    theta_refs = {(f, 0): manifest.init[f] for f in range(run.P)}
    for key in store.keys(keys.ROUNDS):
        rec = store.read_record(key, RoundRecord)
        assert rec is not None and rec.theta is not None, key
        theta_refs[rec.fragment, rec.version] = rec.theta
    local = np.load(locals_npz)
    ours = RunStore(gm.MemoryMailbox())
    checked = 0
    for snap in snapshots(store):
        if snap.learner != learner:
            continue
        r = snap.round
        f = r % run.P
        ref = theta_refs[f, snap.base_version]
        anchor = store.get_payload(ref, run.shapes[f], chunk_elements=run.chunk_elements)
        assert anchor is not None, (r, ref.key)
        tag = "final" if snap.final else str(snap.local_step)
        dtypes = run.delta_dtypes(f)
        want = ours.put_fragment(
            functools.partial(keys.snapshot_blob_key, r, learner, compression=keys.compression_of(snap.payload.key)),
            {
                n: quant.quantize(np.subtract(anchor[n], local[f"{tag}@{n}"], dtype=np.float32), dtypes[n])
                for n in run.fragments[f]
            },
            shapes=run.shapes[f],
            dtypes=dtypes,
            chunk_elements=run.chunk_elements,
            kind="delta",
            compression=keys.compression_of(snap.payload.key),
        )
        got = [c.sha256 for c in chunk_refs(snap.payload)]
        assert got == [c.sha256 for c in chunk_refs(want)], (
            f"{learner}'s contribution to round {r} is not anchor - local"
        )
        checked += 1
    return checked


def run_pair(tmp_path: Path, *extra: str, sharded_creates: bool = False) -> tuple[dict, list[dict]]:
    mailbox = tmp_path / "mailbox"
    mailbox.mkdir()
    if sharded_creates:  # the plain node starts once the sharded node has created the run
        b = sharded(mailbox, tmp_path / "shard", *extra)
        deadline = time.monotonic() + 60
        while not (mailbox / "manifest.json").exists():
            assert b.poll() is None and time.monotonic() < deadline, "the sharded node did not create the run"
            time.sleep(0.05)
        a = plain(mailbox, tmp_path / "plain", *extra)
    else:
        a = plain(mailbox, tmp_path / "plain", *extra)
        b = sharded(mailbox, tmp_path / "shard", *extra)
    finish(a, b)
    want, got = np.load(tmp_path / "plain.npz"), np.load(tmp_path / "shard.npz")
    assert sorted(want) == sorted(got)
    for n in want:
        assert want[n].dtype == got[n].dtype and want[n].tobytes() == got[n].tobytes(), f"{n} differs"
    ranks = [json.loads((tmp_path / f"shard.r{r}.json").read_text()) for r in range(2)]
    return json.loads((tmp_path / "plain.json").read_text()), ranks


def test_a_two_rank_fsdp2_node_and_a_plain_node_train_in_lockstep_and_end_bit_identical(tmp_path):
    report, ranks = run_pair(tmp_path, "--steps", "32", "--keep", "--record-locals")
    # What each node uploaded is anchor - local of its own parameters, byte for byte (the plain
    # node's check shows the computation here is a plain node's; the sharded node's, that its
    # ranks' chunks add up to it). The commits alone could not tell: every node applies them.
    assert check_contributions(tmp_path / "mailbox", tmp_path / "plain.locals.npz", "plain") == 8
    assert check_contributions(tmp_path / "mailbox", tmp_path / "shard.locals.npz", "shard") == 8
    # 32 steps, a round every 4 (P=2, H=8): 8 rounds, each merged from both nodes' contributions.
    assert [a[0] for a in report["aligned"]] == list(range(8))
    assert all(a[3] == ["plain", "shard"] for a in report["aligned"]), report["aligned"]
    lead, other = ranks
    assert lead["aligned"] == report["aligned"]  # rank 0 aligned with every commit
    assert lead["rounds_seen"] == other["rounds_seen"] == 8 and other["round"] == 7  # rank 0's view, mirrored
    for r in ranks:
        assert r["steps"] == 32
        assert all(o > 0 for o in r["owned"]), "a rank owns no chunk: the test exercises too little"
        assert all(n >= 1 for n in r["straddling"]) and sum(r["straddling"]) >= 4, "too few chunks straddle shards"
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0
        # Neither the largest allocation nor one publish's or commit's total reaches the
        # fragment's bytes (float32, what a plain node holds of it).
        for peak, op_peak, fragment in zip(r["peak"], r["op_peak"], r["fragment_bytes"]):
            assert 0 < peak <= op_peak < fragment, r
    # One collective per step (two when rank 0's learner acted), the same count on every rank.
    assert lead["exchanges"] == other["exchanges"] <= 3 * 32 + 20


def test_the_meter_reports_a_fragment_when_a_chunk_is_the_whole_fragment(tmp_path):
    # One chunk per fragment (4096 elements > every fragment): the chunk's owner gathers all of
    # it, and the meter says so. (The lockstep run still ends bit-identical.)
    _, ranks = run_pair(tmp_path, "--steps", "8", "--chunk", "4096")
    assert any(op >= fragment for r in ranks for op, fragment in zip(r["op_peak"], r["fragment_bytes"])), ranks


def test_a_rank_whose_uploads_fail_makes_every_rank_raise_session_failed_and_the_run_goes_on(tmp_path):
    mailbox = tmp_path / "mailbox"
    mailbox.mkdir()
    a = plain(mailbox, tmp_path / "plain", "--steps", "40")
    b = sharded(mailbox, tmp_path / "shard", "--steps", "40", "--break-rank", "1", "--break-after", "20")
    finish(a, b)
    ranks = [json.loads((tmp_path / f"shard.r{r}.json").read_text()) for r in range(2)]
    assert all(r.get("type") == "SessionFailed" for r in ranks), ranks
    assert "injected" in ranks[0]["failed"], ranks  # rank 0 says what failed on rank 1
    report = json.loads((tmp_path / "plain.json").read_text())
    assert ["plain"] in [a[3] for a in report["aligned"]], "the plain node did not go on alone"


def test_a_sharded_node_creates_a_run_of_f4_deltas_each_rank_uploading_its_initial_chunks(tmp_path):
    # Quantized deltas too (F4, scales per block): the two nodes still end bit-identical.
    report, _ = run_pair(
        tmp_path, "--steps", "16", "--delta-dtype", "F4", "--keep", "--record-locals", sharded_creates=True
    )
    assert check_contributions(tmp_path / "mailbox", tmp_path / "shard.locals.npz", "shard") == 4
    manifest = json.loads((tmp_path / "mailbox" / "manifest.json").read_text())
    assert manifest["created_by"] == "shard"
    assert any(ref.get("more") for ref in manifest["init"]), "the initial parameters are not chunked"
    assert len(report["aligned"]) == 4 and all(a[3] == ["plain", "shard"] for a in report["aligned"])


def test_a_four_rank_node_a_two_rank_node_and_a_plain_node_in_one_run_end_bit_identical(tmp_path):
    # Nothing stored depends on a node's world size: the two sharded nodes own and move their
    # chunks differently (two ranks of the 4-rank node hold no row of a 2-row weight) and write
    # the same bytes a plain node would.
    mailbox = tmp_path / "mailbox"
    mailbox.mkdir()
    three = ("--steps", "16", "--quorum", "3", "--learners", "3", "--keep", "--record-locals")
    a = plain(mailbox, tmp_path / "plain", *three)
    b = sharded(mailbox, tmp_path / "two", *three, name="two")
    c = sharded(mailbox, tmp_path / "four", *three, ranks=4, name="four")
    finish(a, b, c, timeout=240)
    want = np.load(tmp_path / "plain.npz")
    for node in ("two", "four"):
        got = np.load(tmp_path / f"{node}.npz")
        assert all(want[n].tobytes() == got[n].tobytes() for n in want), f"{node} differs from the plain node"
    report = json.loads((tmp_path / "plain.json").read_text())
    assert len(report["aligned"]) == 4 and all(a[3] == ["four", "plain", "two"] for a in report["aligned"])
    for node in ("two", "four"):  # each uploaded anchor - local of its own parameters
        assert check_contributions(mailbox, tmp_path / f"{node}.locals.npz", node) == 4
