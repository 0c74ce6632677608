"""The work queue in authenticated runs (``workqueue/auth.py``): its records signed and checked
as the run's own, its keys secret-tagged with a run secret; an open run's queue unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
from adversary_sim import SimRun

import gradientmail_core as gm
from gradientmail_core.clock import FakeClock
from gradientmail_core.errors import ProtocolError
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.identity import Identity
from gradientmail_core.protocol.members import MemberAuth, change
from gradientmail_core.protocol.records import Manifest, encode
from gradientmail_core.workqueue import keys as queue_keys
from gradientmail_core.workqueue.records import QueueInfo, UnitDone

SECRET = "q" * 32
CFG = gm.DiLoCo(sync_every=2, fragments=1)


def params() -> dict[str, np.ndarray]:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}


def queue(mailbox, holder: str, **kw) -> gm.WorkQueue:
    return gm.WorkQueue(mailbox, units=4, holder=holder, clock=FakeClock(), poll_interval=1.0, **kw)


def plant_done(mailbox, physical_key: str, unit: int) -> None:
    """An outsider's done marker: a well-formed record, unsigned, straight into the store."""
    mailbox.put_if_absent(physical_key, encode(UnitDone(queue="data", unit=unit, attempt=1, holder="x", nonce="0" * 8)))


def test_an_open_runs_queue_records_keep_their_bytes():
    info = QueueInfo(queue="data", units=4, lease_timeout=60.0, created_by="a")
    assert set(json.loads(encode(info))) == {"queue", "units", "lease_timeout", "created_by", "format"}


def test_with_a_secret_the_queue_is_tagged_and_maced_and_planted_records_do_not_count():
    sim = SimRun(CFG, secret=SECRET)
    sim.join("a", params())
    raw = sim.mailbox
    # Before anyone opens the queue, an outsider plants done markers under the plain names.
    plant_done(raw, queue_keys.unit_done_key("data", 0), 0)
    q = queue(raw, "a", secret=SECRET)
    q.open()
    stored = [k for k in raw.list(keys.WORK)]
    assert stored and all(keys.untag_key(k) is not None for k in stored if k != queue_keys.unit_done_key("data", 0))
    info = json.loads(raw.get(stored[-1]))
    assert info["mac"] and info["created_by"] == "a"
    got = set()
    while (hold := q.next_unit(wait=False)) is not None:
        got.add(hold.unit)
        q.complete(hold)
    assert got == {0, 1, 2, 3}  # the planted marker of unit 0 did not count
    assert q.finished()
    # A queue without the secret sees none of the run's records (only the planted one); one with
    # another secret refuses the run.
    assert queue(raw, "b").progress().done == 1
    with pytest.raises(gm.errors.RecordInvalid, match="MAC does not verify"):
        queue(raw, "b", secret="z" * 32).open()


def test_an_authenticated_queue_needs_the_run():
    with pytest.raises(ProtocolError, match="has none yet"):
        queue(MemoryMailbox(), "a", secret=SECRET).open()


def test_in_a_members_only_run_records_are_signed_and_a_non_members_do_not_count(tmp_path):
    seeds = {n: bytes([40 + i]) * 32 for i, n in enumerate("ab")}
    ids = {n: Identity.from_seed(seed) for n, seed in seeds.items()}
    files = {n: _key_file(tmp_path, n, seed) for n, seed in seeds.items()}
    sim = SimRun(CFG)
    a_id = ids["a"].learner_id("a")
    node = sim.join(a_id, params(), auth=MemberAuth(identity=ids["a"]))
    change(sim.mailbox, node.store.read_record(keys.MANIFEST, Manifest), ids["a"], add=[ids["b"].public_hex])
    qa = gm.WorkQueue(sim.mailbox, units=4, holder="a", clock=FakeClock(), identity=files["a"])
    assert qa.holder == a_id
    qa.open()
    # A non-member (no key of the run) plants a done marker of unit 1, unsigned.
    plant_done(sim.mailbox, queue_keys.unit_done_key("data", 1), 1)
    qb = gm.WorkQueue(sim.mailbox, units=4, holder="b", clock=FakeClock(), identity=files["b"])
    assert qb.progress().done == 0
    hold = qb.claim()
    assert hold is not None
    claim = json.loads(sim.mailbox.get(queue_keys.unit_claim_key("data", hold.unit, 1)))
    assert claim["signer"] == ids["b"].public_hex and claim["sig"]
    # Without an identity, a members-only run's queue is refused.
    with pytest.raises(ProtocolError, match="members only"):
        gm.WorkQueue(sim.mailbox, units=4, holder="c", secret_file=_secret_file(tmp_path)).open()


def _key_file(tmp_path, name: str, seed: bytes):
    """A node's key file: the raw seed in hex, readable by its owner only."""
    path = tmp_path / f"{name}.key"
    path.write_text(seed.hex() + "\n")
    path.chmod(0o600)
    return path


def _secret_file(tmp_path):
    path = tmp_path / "run.secret"
    path.write_text(SECRET)
    return path
