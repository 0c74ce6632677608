"""A round record damaged in the store after it landed (truncated: a half-written copy, a restore
gone wrong, a hand edit): no follower can read it, and the tape is followed only in order.

The node that wrote it reads its records back (``Closing.recheck``) and writes a damaged one again,
the same bytes: the run goes on. Where that node is gone, every follower stops within a bounded
time (``RecordDamaged``) with the key and the remedy, and the commits before it stay readable."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Cluster

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import RoundRecord, decode

DAMAGED = 5


class Truncating(MemoryMailbox):
    """Stores the first write of round ``DAMAGED``'s record cut in half; ``then`` runs after it."""

    def __init__(self) -> None:
        super().__init__()
        self.then = lambda: None
        self.done = False

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key == keys.round_key(DAMAGED) and not self.done:
            self.done = True
            ok = super().put_if_absent(key, data[: len(data) // 2])
            self.then()
            return ok
        return super().put_if_absent(key, data)


def cluster(mb: Truncating, quorum: int) -> Cluster:
    return Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=quorum, overlap_steps=2), mailbox=mb)


def test_the_writer_reads_its_record_back_and_writes_it_again_and_the_run_goes_on():
    mb = Truncating()
    c = cluster(mb, quorum=2)
    a, b = c.join_all(["a", "b"])
    c.run(120, ticks_per_step=2)
    assert mb.done
    (repaired,) = [e for m in (a, b) for e in m.of(ev.RecordRepaired)]
    assert repaired.round == DAMAGED and repaired.key == keys.round_key(DAMAGED)
    # repaired within the first read-back (two polls after the write), not a round timeout later
    written = next(e for m in (a, b) for e in m.events if isinstance(e, ev.Committed) and e.round == DAMAGED)
    assert written.learner == repaired.learner
    recs = [decode(mb.get(k), RoundRecord, key=k) for k in mb.list(keys.ROUNDS)]
    assert [r.round for r in recs] == list(range(len(recs))) and len(recs) > 2 * DAMAGED
    assert a.node.state.head == b.node.state.head == recs[-1].round
    for m in (a, b):
        c.close(m)  # each ends at the newest commit
    for n in a.params:
        assert np.array_equal(a.params[n], b.params[n])


def test_without_its_writer_every_follower_stops_within_the_bound_naming_the_key_and_the_remedy():
    mb = Truncating()
    c = cluster(mb, quorum=1)
    mb.then = lambda: c.crash(c.members["a"])  # the closer dies the moment its damaged record lands
    a, b = c.join_all(["a", "b"])
    opts = c.options
    bound = opts.round_timeout_floor + opts.lease_timeout
    with pytest.raises(gm.RecordDamaged) as err:
        c.run(10_000, ticks_per_step=2)
    stuck = next(e for e in b.of(ev.IgnoredObject) if e.key == keys.round_key(DAMAGED))
    assert stuck is not None and c.clock.now() <= bound + 8 * opts.round_timeout_floor
    text = str(err.value)
    assert keys.round_key(DAMAGED) in text and "its closer (a, probably" in text
    assert "restore the object" in text and f"delete {keys.round_key(DAMAGED)}" in text
    # nothing committed before it is lost: every earlier record reads back as its commit
    for r in range(DAMAGED):
        rec = decode(mb.get(keys.round_key(r)), RoundRecord, key=keys.round_key(r))
        assert rec.round == r
    assert b.node.state.head == DAMAGED - 1


def test_status_and_rounds_say_what_to_do_about_a_damaged_record(tmp_path, capsys):
    from gradientmail_core.cli import main

    url = f"file://{tmp_path / 'run'}"
    mb = gm.open_mailbox(url)
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2), mailbox=mb)
    c.join_all(["a", "b"])
    c.run(40, ticks_per_step=2)
    for m in list(c.members.values()):
        c.close(m)
    rounds = mb.list(keys.ROUNDS)
    for key, later in ((rounds[-3], True), (rounds[-1], False)):
        data = mb.get(key)
        mb.delete([key])
        mb.put_if_absent(key, data[: len(data) // 2])
        for command in ("status", "rounds"):
            rc = main([command, url])
            out, err = capsys.readouterr()
            text = " ".join((out + err).split())
            assert f"{key} fails its check" in text and "restore the object from a copy of the bucket" in text, text
            assert ("later rounds build on it" in text) == later and (f"or delete {key}" in text) == (not later)
            assert rc == (1 if command == "rounds" else 0)
        mb.delete([key])
        mb.put_if_absent(key, data)
