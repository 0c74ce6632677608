"""gm.WorkQueue: units handed out by create-once claims, re-issued after a holder's lease lapses,
recorded done once. Deterministic: MemoryMailbox and FakeClock, seeded kills and restarts."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

import gradientmail_core as gm
from gradientmail_core.errors import MailboxUnavailable
from gradientmail_core.protocol.records import decode
from gradientmail_core.workqueue import keys as queue_keys
from gradientmail_core.workqueue.queue import QueueMismatch
from gradientmail_core.workqueue.records import UnitDone
from gradientmail_core.workqueue.scan import read_queues, scan_queue

TIMEOUT = 10.0


def queue(mb, clock, holder, units=6, **kw):
    kw.setdefault("lease_timeout", TIMEOUT)
    return gm.WorkQueue(mb, units=units, holder=holder, clock=clock, poll_interval=1.0, **kw)


def done_records(mb, name="data"):
    out = {}
    for k in mb.list(queue_keys.unit_done_prefix(name)):
        parsed = queue_keys.parse_unit_done_key(k)
        assert parsed is not None
        out[parsed[1]] = decode(mb.get(k), UnitDone, key=k)
    return out


def test_one_node_consumes_every_unit_once_and_leaves_no_heartbeats():
    mb, clock = gm.MemoryMailbox(), gm.FakeClock()
    q = queue(mb, clock, "a", units=5)
    seen = []
    while (hold := q.next_unit()) is not None:
        clock.advance(TIMEOUT / 2)
        q.renew(hold)  # a heartbeat is due
        assert q.complete(hold)
        seen.append(hold.unit)
    assert sorted(seen) == list(range(5)) and len(seen) == 5
    assert seen == [(seen[0] + i) % 5 for i in range(5)]  # consecutive from the node's cursor
    assert sorted(done_records(mb)) == list(range(5))
    assert q.finished()
    assert not [k for k in mb.list(queue_keys.queue_prefix("data")) if queue_keys.parse_unit_hold_key(k)]
    p = q.progress()
    assert (p.done, p.in_progress, p.left, p.reissued) == (5, 0, 0, 0)


def test_two_nodes_racing_for_one_unit_create_once_decides():
    mb, clock = gm.MemoryMailbox(), gm.FakeClock()
    a, b = queue(mb, clock, "a", units=1), queue(mb, clock, "b", units=1)
    scan = b.refresh()  # b looks before a claims: unit 0 is free in b's view
    ha = a.claim()
    assert ha is not None and (ha.unit, ha.attempt) == (0, 1)
    assert b._try_claim(0, scan.attempts.get(0, 0) + 1) is None  # attempt 1 is taken
    assert b.claim() is None  # held by a live holder
    assert a.complete(ha)
    assert b.next_unit() is None  # every unit done


def test_a_dead_holders_unit_comes_back_only_after_its_lease_lapses_on_the_observers_clock():
    mb = gm.MemoryMailbox()
    ca, cb = gm.FakeClock(), gm.FakeClock(start=1000.0)  # unrelated clocks: never compared
    a, b = queue(mb, ca, "a", units=1), queue(mb, cb, "b", units=1)
    ha = a.claim()
    assert ha is not None
    assert b.claim() is None  # first sight of a's claim: b starts watching it
    cb.advance(TIMEOUT - 0.5)
    assert b.claim() is None
    # a renews: the heartbeat changes, b's watch starts over.
    ca.advance(TIMEOUT / 2)
    a.renew(ha)
    cb.advance(1.0)
    assert b.claim() is None
    cb.advance(TIMEOUT - 0.5)
    assert b.claim() is None
    # a dies (stops renewing); a whole timeout later on b's clock the unit is handed out again.
    cb.advance(1.0)
    hb = b.claim()
    assert hb is not None and (hb.unit, hb.attempt) == (0, 2)
    # a comes back from its stall: its hold expired on its own clock, and attempt 2 exists.
    ca.advance(TIMEOUT)
    with pytest.raises(gm.HoldLost):
        a.renew(ha)
    assert b.complete(hb)
    rec = done_records(mb)[0]
    assert (rec.attempt, rec.holder) == (2, "b")


def test_a_holder_sees_its_unit_handed_out_again_at_its_next_renewal():
    mb, clock = gm.MemoryMailbox(), gm.FakeClock()
    a, b = queue(mb, clock, "a", units=1), queue(mb, clock, "b", units=1)
    ha = a.claim()
    assert ha is not None and b.claim() is None
    clock.advance(TIMEOUT)
    hb = b.claim()  # a did not renew within the timeout
    assert hb is not None and hb.attempt == 2
    with pytest.raises(gm.HoldLost):
        a.renew(ha, force=True)
    assert a.held == []


def test_a_zombie_finishing_first_is_recorded_and_the_new_holder_drops_the_unit():
    mb, clock = gm.MemoryMailbox(), gm.FakeClock()
    a, b = queue(mb, clock, "a", units=1), queue(mb, clock, "b", units=1)
    ha = a.claim()
    b.claim()
    clock.advance(TIMEOUT)
    hb = b.claim()
    assert hb is not None
    assert a.complete(ha)  # the old holder finishes anyway: the data was consumed
    with pytest.raises(gm.HoldLost):
        b.renew(hb, force=True)
    assert done_records(mb)[0].attempt == 1


def test_a_released_unit_is_taken_at_once():
    mb, clock = gm.MemoryMailbox(), gm.FakeClock()
    a, b = queue(mb, clock, "a", units=1), queue(mb, clock, "b", units=1)
    ha = a.claim()
    assert ha is not None and b.claim() is None
    a.release(ha)
    hb = b.claim()
    assert hb is not None and hb.attempt == 2
    assert (b.progress().in_progress, b.progress().reissued) == (1, 1)


def test_a_restarted_run_resumes_with_the_units_not_consumed():
    mb, clock = gm.MemoryMailbox(), gm.FakeClock()
    first = [queue(mb, clock, f"n{i}", units=10) for i in range(2)]
    consumed = set()
    for q in first:
        for _ in range(2):
            hold = q.claim()
            assert hold is not None and q.complete(hold)
            consumed.add(hold.unit)
    stranded = first[0].claim()  # held when the whole run stops
    assert stranded is not None
    # Everyone restarts (same ids, new processes: new nonces).
    again = [queue(mb, clock, f"n{i}", units=10) for i in range(2)]
    got = []
    while True:
        progressed = False
        for q in again:
            hold = q.claim()
            if hold is not None:
                progressed = True
                got.append(hold.unit)
                assert q.complete(hold)
        if again[0].finished():
            break
        if not progressed:
            clock.advance(1.0)
    assert sorted(got) == sorted(set(range(10)) - consumed)  # each unit left, once
    assert stranded.unit in got
    assert sorted(done_records(mb)) == list(range(10))


def test_units_must_match_and_the_lease_timeout_is_the_queues():
    mb, clock = gm.MemoryMailbox(), gm.FakeClock()
    queue(mb, clock, "a", units=4, lease_timeout=7.0).open()
    with pytest.raises(QueueMismatch):
        queue(mb, clock, "b", units=5).open()
    other = queue(mb, clock, "b", units=4, lease_timeout=99.0)
    other.open()
    assert other.lease_timeout == 7.0 and other.renew_every == 7.0 / 4
    with pytest.raises(ValueError):
        gm.WorkQueue(mb, units=0, holder="a")
    with pytest.raises(ValueError):
        gm.WorkQueue(mb, units=3, holder="Bad_Id")
    with pytest.raises(ValueError):
        gm.WorkQueue(mb, units=3, holder="a", name="../x")


class _Flaky(gm.MemoryMailbox):
    down = False

    def put_if_absent(self, key, data):
        if self.down:
            raise MailboxUnavailable("down")
        return super().put_if_absent(key, data)


def test_a_done_marker_the_store_refused_is_written_later_and_the_unit_stays_held():
    mb, clock = _Flaky(), gm.FakeClock()
    a, b = queue(mb, clock, "a", units=1), queue(mb, clock, "b", units=1)
    ha = a.claim()
    assert ha is not None
    mb.down = True
    assert a.complete(ha)
    assert a.held == [ha]
    mb.down = False
    assert b.claim() is None
    clock.advance(TIMEOUT / 2)
    a.heartbeat()  # renews it and records it done
    assert a.held == [] and sorted(done_records(mb)) == [0]


def test_status_reads_every_queue():
    mb, clock = gm.MemoryMailbox(), gm.FakeClock()
    a = queue(mb, clock, "a", units=4, name="epoch-0")
    h = a.claim()
    assert h is not None and a.complete(h)
    a.claim()
    queue(mb, clock, "b", units=3, name="epoch-1").open()
    got = {p.name: (p.units, p.done, p.in_progress, p.left) for p in read_queues(mb)}
    assert got == {"epoch-0": (4, 1, 1, 2), "epoch-1": (3, 0, 0, 3)}


# ---- the simulation: 4 nodes, seeded kills and restarts -------------------------------------


@dataclass
class Slot:
    holder: str
    q: gm.WorkQueue | None = None
    hold: gm.workqueue.Hold | None = None
    need: int = 0
    worked: int = 0


def simulate(seed: int, *, units: int, kills: bool, nodes: int = 4) -> dict:
    rng = random.Random(seed)
    mb, clock = gm.MemoryMailbox(), gm.FakeClock()
    need = {u: rng.randint(1, 6) for u in range(units)}  # steps of work per unit
    slots = [Slot(f"node-{i}") for i in range(nodes)]

    def start(s: Slot) -> None:
        s.q = gm.WorkQueue(
            mb,
            units=units,
            holder=s.holder,
            clock=clock,
            lease_timeout=TIMEOUT,
            renew_every=2.5,
            nonce=f"{rng.getrandbits(64):016x}",
        )
        s.hold, s.worked = None, 0

    for s in slots:
        start(s)
    completions: Counter[int] = Counter()
    started: Counter[int] = Counter()
    killed_holding: list[int] = []
    kill_count = 0
    for _step in range(5000):
        clock.advance(1.0)
        for s in rng.sample(slots, len(slots)):
            if s.q is None:
                if rng.random() < 0.2:
                    start(s)
                continue
            if kills and rng.random() < 0.03:
                if s.hold is not None:
                    killed_holding.append(s.hold.unit)
                s.q = s.hold = None  # SIGKILL: nothing written, nothing released
                kill_count += 1
                continue
            if s.hold is None:
                s.hold = s.q.claim()
                if s.hold is not None:
                    started[s.hold.unit] += 1
                    s.worked = 0
            else:
                s.q.renew(s.hold)  # never lost: live nodes renew well within the timeout
                s.worked += 1
                if s.worked >= need[s.hold.unit]:
                    assert s.q.complete(s.hold), "a live holder's unit was recorded by someone else"
                    completions[s.hold.unit] += 1
                    s.hold = None
            # Never two live holders of one unit at once.
            holding = Counter(x.hold.unit for x in slots if x.q is not None and x.hold is not None)
            assert not holding or max(holding.values()) == 1, holding
        if len(mb.list(queue_keys.unit_done_prefix("data"))) == units:
            break
    else:
        raise AssertionError(f"seed {seed}: not every unit finished")
    scan = scan_queue(mb, "data")
    return {
        "completions": completions,
        "started": started,
        "done": done_records(mb),
        "attempts": scan.attempts,
        "killed_holding": killed_holding,
        "kills": kill_count,
    }


@pytest.mark.parametrize("seed", range(25))
def test_simulation_without_kills_does_every_unit_exactly_once(seed):
    out = simulate(seed, units=24, kills=False)
    assert out["completions"] == Counter(range(24))
    assert out["started"] == Counter(range(24))  # never handed out twice
    assert set(out["attempts"].values()) == {1}
    assert sorted(out["done"]) == list(range(24))


@pytest.mark.parametrize("seed", range(40))
def test_simulation_with_kills_and_restarts_does_every_unit(seed):
    out = simulate(seed, units=24, kills=True)
    # Every unit recorded done once (create-once), each by a holder that finished it.
    assert sorted(out["done"]) == list(range(24))
    assert out["completions"] == Counter(range(24))
    # Consumed at least once; a unit held by a killed node was handed out again.
    assert all(out["started"][u] >= 1 for u in range(24))
    for u in out["killed_holding"]:
        assert out["attempts"][u] >= 2 and out["done"][u].attempt >= 2
    more = {u for u, n in out["started"].items() if n > 1}
    assert more <= set(out["killed_holding"])  # only a dead holder's unit is started twice


def test_the_simulation_kills_holders_for_most_seeds():
    hit = sum(bool(simulate(seed, units=24, kills=True)["killed_holding"]) for seed in range(10))
    assert hit >= 5


def test_work_records_round_trip_and_refuse_bad_fields():
    from gradientmail_core.errors import RecordInvalid
    from gradientmail_core.protocol.records import encode
    from gradientmail_core.workqueue.records import QueueInfo, UnitClaim, UnitHold, UnitRelease

    recs = [
        QueueInfo(queue="data", units=10, lease_timeout=5.0, created_by="a"),
        UnitClaim(queue="data", unit=3, attempt=2, holder="a", nonce="0123abcd"),
        UnitHold(queue="data", unit=3, attempt=2, holder="a", nonce="0123abcd", seq=4, consumed=7),
        UnitRelease(queue="data", unit=3, attempt=2, holder="a", nonce="0123abcd"),
        UnitDone(queue="data", unit=3, attempt=2, holder="a", nonce="0123abcd"),
    ]
    for rec in recs:
        assert decode(encode(rec), type(rec)) == rec
    for bad in (
        b'{"format":1,"queue":"data","unit":3,"attempt":0,"holder":"a","nonce":"0123abcd"}',
        b'{"format":1,"queue":"data","unit":-1,"attempt":1,"holder":"a","nonce":"0123abcd"}',
        b'{"format":1,"queue":"data","unit":3,"attempt":1,"holder":"A","nonce":"0123abcd"}',
        b'{"format":1,"queue":"data","unit":3,"attempt":1,"holder":"a","nonce":"0123abcd","x":1}',
        b'{"format":2,"queue":"data","unit":3,"attempt":1,"holder":"a","nonce":"0123abcd"}',
    ):
        with pytest.raises(RecordInvalid):
            decode(bad, UnitClaim)
