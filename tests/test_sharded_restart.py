"""A sharded node (FSDP2, 2 ranks under ``torchrun``) killed mid-round and restarted under the same
learner id (issue 13): the run goes on without it (the plain node commits alone once the lease is
gone, which the test waits for before restarting it), the restart takes the dead process's lease over at once (``RestartMarker``, same host),
every rank loads its part of the newest commit, and the node trains on in the run. After it
closes, its full parameters are exactly the commits it last aligned with, as stored."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from test_sharded_session import descendants, finish, plain, sharded

torch = pytest.importorskip("torch")

from gradientmail_core.mailbox.file import FileMailbox  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.protocol.records import RoundRecord  # noqa: E402
from gradientmail_core.protocol.run import RunInfo, read_manifest  # noqa: E402
from gradientmail_core.protocol.schedule import round_of  # noqa: E402
from gradientmail_core.protocol.store import RunStore  # noqa: E402
from gradientmail_core.protocol.tape import fetch_theta  # noqa: E402


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def commits(store: RunStore) -> dict[int, list[str]]:
    """Each committed round's participants, from the records in the store."""
    out = {}
    for k in store.keys(keys.ROUNDS):
        r = keys.parse_round_key(k)
        rec = store.try_record(k, RoundRecord) if r is not None else None
        if r is not None and rec is not None:
            out[r] = [p.learner for p in rec.participants]
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
@pytest.mark.parametrize("closer", ["plain", "shard"])
def test_a_sharded_node_killed_mid_round_restarts_under_its_id_and_trains_on(tmp_path, closer):
    # closer "shard": the sharded node creates the run and closes its rounds until it is killed
    # (every rank dies mid-round); the plain node then takes the open round over, recovering the
    # outer state the sharded closer's ranks wrote chunk by chunk.
    mailbox = tmp_path / "mailbox"
    mailbox.mkdir()
    common = ("--lease-timeout", "3")
    done = str(tmp_path / "done")  # the restarted node's training is over: the plain node stops too,
    # so no commit after the ones the restarted node aligned with is collected before the check
    keep = ("--steps", "2000", "--step-sleep", "0.02", "--until", done, *common)
    if closer == "shard":
        first = sharded(mailbox, tmp_path / "first", "--steps", "1000", "--stop-after", "14", *common)
        deadline = time.monotonic() + 60
        while not (mailbox / "manifest.json").exists():
            assert first.poll() is None and time.monotonic() < deadline, "the sharded node did not create the run"
            time.sleep(0.05)
        keeper = plain(mailbox, tmp_path / "plain", *keep)
    else:
        keeper = plain(mailbox, tmp_path / "plain", *keep)
        first = sharded(mailbox, tmp_path / "first", "--steps", "1000", "--stop-after", "14", *common)
    deadline = time.monotonic() + 90
    while not (tmp_path / "first.stopped0").exists():
        assert first.poll() is None and keeper.poll() is None, "a node ended before the kill"
        assert time.monotonic() < deadline, "the sharded node never got to the kill point"
        time.sleep(0.1)
    # 14 steps: the sharded node published round 3 (a round every 4 steps) and is half-way through
    # round 4 when the whole torchrun group dies.
    doomed = [first.pid, *descendants(first.pid)]  # torchrun starts its workers in groups of their own
    for pid in doomed:
        os.kill(pid, signal.SIGKILL)
    first.wait(timeout=30)
    while any(alive(pid) for pid in doomed[1:]):
        time.sleep(0.05)
    # The run goes on without it: the plain node commits alone once the dead node's lease is gone.
    # Restarted before that, the node would take its lease over at once and nobody would notice.
    store = RunStore(FileMailbox(str(mailbox)))
    killed_at = max(commits(store), default=-1)
    if closer == "shard":
        closers = {store.read_record(keys.round_key(r), RoundRecord).closer for r in range(killed_at + 1)}
        assert closers == {"shard"}, f"the sharded node did not close the rounds before the kill: {closers}"
    deadline = time.monotonic() + 90
    while not any(r > killed_at and who == ["plain"] for r, who in commits(store).items()):
        assert keeper.poll() is None, "the plain node ended"
        assert time.monotonic() < deadline, "the plain node never committed alone after the kill"
        time.sleep(0.1)
    again = sharded(mailbox, tmp_path / "again", "--steps", "24", "--touch", done, *common)
    finish(again, keeper, timeout=180)

    lead = json.loads((tmp_path / "again.r0.json").read_text())
    assert "Joined" in lead["events"]
    # It rejoined at a later round and contributed to the rounds it trained in after.
    assert lead["aligned"] and lead["aligned"][0][0] >= 3
    assert any("shard" in a[3] for a in lead["aligned"]), lead["aligned"]
    # Its parameters are the stored commits of the versions it last aligned with, bit for bit.
    manifest = read_manifest(store)
    assert manifest is not None
    run = RunInfo.from_manifest(manifest)
    got = np.load(tmp_path / "again.npz")
    for f, v in enumerate(lead["versions"]):
        rec = store.read_record(keys.round_key(round_of(f, v, run.P)), RoundRecord) if v else None
        theta = fetch_theta(store, run, f, rec)
        assert theta is not None, f"fragment {f} version {v} is gone"
        for n, want in theta.items():
            assert got[n].tobytes() == want.astype(np.float32).tobytes(), f"{n} is not version {v} of fragment {f}"
    keeper_report = json.loads((tmp_path / "plain.json").read_text())
    assert any(a[3] == ["plain"] for a in keeper_report["aligned"]), "the plain node never committed alone"
