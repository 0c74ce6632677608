"""A fleet of any size (``DiLoCo.max_contributions``, issue 27): each round merges at most K
contributions drawn by hash among those reported, the closer reads no more than those, followers
poll nothing that grows with the fleet, and takeovers still work. Deterministic clusters (fake
clock, one thread), every commit recomputed by the simulation's auditor."""

from __future__ import annotations

import pytest
from harness import Cluster
from test_engine_rounds import assert_identical, assert_tape_contiguous, finish, records
from test_engine_takeover import took_over

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.mailbox import CountingMailbox, ForwardingMailbox, read_many
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.guard import GuardedMailbox
from gradientmail_core.protocol.schedule import draw

NAMES = [f"n{i:02d}" for i in range(8)]


class Recorder(ForwardingMailbox):
    """Notes every GET and LIST of one node (prefix and keys returned)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gets: list[str] = []
        self.lists: list[tuple[str, list[str]]] = []

    def get(self, key):
        self.gets.append(key)
        return super().get(key)

    def get_stream(self, key, *, part_size=None):
        self.gets.append(key)
        return super().get_stream(key, part_size=part_size)

    def list(self, prefix, after=""):
        found = super().list(prefix, after)
        self.lists.append((prefix, found))
        return found


def _cluster(k: int | None, n: int = 8, **cfg) -> tuple[Cluster, dict[str, Recorder]]:
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=n, max_contributions=k, **cfg), audit=True)
    paths = {}
    for name in NAMES[:n]:
        paths[name] = Recorder(c.path(name))
        c.join(name, mailbox=paths[name])
    for m in c.live():
        m.node.state.list_leases(m.node.store)
    return c, paths


def test_each_round_merges_the_k_lowest_draws_of_the_reported_and_learners_stay_bit_identical():
    c, _ = _cluster(3)
    c.run(24)
    finish(c)
    recs = assert_tape_contiguous(c)
    assert len(recs) >= 8
    run_id = c.members["n00"].node.run.manifest.run_id
    for rec in recs:
        # quorum = every learner: all 8 reported, so the drawn three are the 8's lowest draws
        drawn = sorted(NAMES, key=lambda lr: (draw(run_id, rec.round, lr), lr))[:3]
        assert sorted(p.learner for p in rec.participants) == sorted(drawn), rec.round
        assert rec.rejected == [] and rec.live == 8
    # the draw changes with the round: over the rounds, everyone is merged at some point
    assert {p.learner for r in recs for p in r.participants} == set(NAMES)
    assert not took_over(c)  # the followers' timeout counts the round's training: no false alarm
    assert_identical(list(c.members.values()))


def test_the_closer_reads_only_the_drawn_contributions_and_followers_list_neither_leases_nor_snapshots():
    c, paths = _cluster(2)
    c.run(8)  # the first commits: from here on the followers poll as a fleet's
    for p in paths.values():
        p.gets.clear()
        p.lists.clear()
    c.run(16)
    recs = [r for r in records(c) if r.round >= 2]
    for name, p in paths.items():
        read = {k for k in p.gets if k.startswith(keys.SNAPSHOT_BLOBS)}
        closed = [r for r in recs if r.closer == name]
        rounds_read = {k.split("/")[2] for k in read}
        assert len(read) <= 2 * len(rounds_read), (name, sorted(read))  # at most 2 payloads a round
        if closed:
            continue
        assert not read, f"{name} closes no round but read contributions: {sorted(read)}"
        prefixes = {prefix for prefix, _ in p.lists}
        assert "" not in prefixes, f"{name} listed the whole store: {prefixes}"
        assert keys.LEASES not in prefixes, f"{name} listed every lease"
        assert all(not k.startswith(keys.SNAPSHOTS) for _, found in p.lists for k in found)
    closer = recs[-1].closer
    assert any(k.startswith(keys.SNAPSHOT_BLOBS) for k in paths[closer].gets)


def test_a_rejected_draw_is_replaced_by_the_next_in_the_draw():
    c, _ = _cluster(2, n=4)
    c.run(8)
    bad = "n03"
    m = c.members[bad]
    real = m.node.store.put_record

    def corrupt_snapshots(key, record):  # n03's snapshot records name a payload that is not there
        if key.startswith(keys.SNAPSHOTS):
            record = type(record)(**{**record.__dict__, "steps": 0})
        return real(key, record)

    m.node.store.put_record = corrupt_snapshots
    c.run(16)
    finish(c)
    run_id = m.node.run.manifest.run_id
    later = [r for r in assert_tape_contiguous(c) if r.round >= 4]
    assert later
    for rec in later:
        order = sorted(NAMES[:4], key=lambda lr: (draw(run_id, rec.round, lr), lr))
        merged = sorted(p.learner for p in rec.participants)
        rejected = [x.learner for x in rec.rejected]
        if bad in order[:2]:  # drawn, rejected (zero steps), replaced by the third
            assert rejected == [bad] and merged == sorted(lr for lr in order[:3] if lr != bad), rec.round
        else:
            assert not rejected and merged == sorted(order[:2]), rec.round


def test_a_dead_closer_is_taken_over_by_a_follower_watching_only_its_lease():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=4, max_contributions=2), audit=True)
    a = c.join("a")
    others = [c.join(n) for n in "bcd"]
    for m in c.live():
        m.node.state.list_leases(m.node.store)
    c.run(12)
    assert {r.closer for r in records(c)} == {"a"}
    c.crash(a)
    c.run(80)
    finish(c)
    recs = assert_tape_contiguous(c)
    assert {r.closer for r in recs} - {"a"}, "nobody took the rounds over"
    events = took_over(c)
    assert events and events[0].previous == "a" and events[0].reason in ("lease_lost", "timeout")
    assert_identical(others)


def test_without_the_option_the_closer_merges_everyone_and_followers_list_as_before():
    c, paths = _cluster(None, n=4)
    c.run(16)
    recs = records(c)
    assert recs and all(len(r.participants) == 4 for r in recs)
    follower = next(n for n in paths if n != recs[-1].closer)
    assert "" in {prefix for prefix, _ in paths[follower].lists}


@pytest.mark.parametrize("k", [0, -1, 1.5, True, "3"])
def test_max_contributions_must_be_a_positive_integer(k):
    with pytest.raises(ValueError, match="max_contributions"):
        gm.DiLoCo(sync_every=4, fragments=1, max_contributions=k)


def test_read_many_fetches_through_get_many_threads_or_one_by_one_and_the_guard_cuts_at_its_cap():
    box = MemoryMailbox()
    for i in range(5):
        box.put_if_absent(f"k{i}", bytes([i]) * (i + 1))
    want = ["k3", "nope", "k0"]
    assert read_many(box, want) == [b"\x03" * 4, None, b"\x00"]
    counted = CountingMailbox(box)
    assert read_many(counted, want) == [b"\x03" * 4, None, b"\x00"]
    assert counted.counts["GET"] == 3 and counted.bytes_down == 5

    class Threaded(ForwardingMailbox):
        concurrent_reads = 4

    assert read_many(Threaded(box), want) == [b"\x03" * 4, None, b"\x00"]

    class Batched(ForwardingMailbox):
        batches: list[list[str]] = []

        def get_many(self, wanted):
            self.batches.append(list(wanted))
            return [self.inner.get(k) for k in wanted]

    batched = Batched(box)
    assert read_many(CountingMailbox(batched), want) == [b"\x03" * 4, None, b"\x00"]
    assert batched.batches == [want]  # one batch, through the counting wrapper
    guard = GuardedMailbox(Threaded(box))
    assert read_many(guard, ["k4"]) == [b"\x04" * 5]


def test_a_stalled_closer_is_taken_over_by_timeout_counted_from_the_followers_own_contribution():
    from gradientmail_core.syncer.options import NodeOptions

    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, quorum_size=2, max_contributions=1), audit=True)
    c.options = NodeOptions(poll_interval=0.1, lease_timeout=5.0, round_timeout=0.5)
    a, b = c.join_all("ab")
    c.run(8)
    c.settle(4)
    head = c.head()
    assert head >= 0 and b.node.state.polls_fleet()
    for _ in range(30):  # nobody trains: no contribution, no timer, no takeover (only lease loss would)
        b.node.tick()
        c.clock.advance(0.05)
    assert not b.of(ev.TookOver) and c.head() == head
    for _ in range(4):  # b contributes; a (SIGSTOP) does not poll again within the lease timeout
        b.train()
    for _ in range(30):  # 1.5 s: past round_timeout, well within lease_timeout
        b.node.tick()
        b.learner.drain()
        c.clock.advance(0.05)
    assert c.head() == head + 1
    tk = b.of(ev.TookOver)
    assert tk and tk[0].reason == "timeout" and tk[0].previous == "a"
    a.node.tick()  # a resumes: it finds the record and steps down
    assert a.of(ev.Superseded)
    c.run(8)
    finish(c)
    assert_tape_contiguous(c)
    assert_identical([a, b])


def test_over_a_real_s3_endpoint_the_drawn_are_fetched_on_the_connection_pool(s3_server, s3_bucket, monkeypatch):
    import threading

    from gradientmail_core.mailbox.s3 import S3Mailbox

    threads: set[int] = set()
    real_get, real_prefix = S3Mailbox.get, S3Mailbox.get_prefix

    def get(self, key):
        threads.add(threading.get_ident())
        return real_get(self, key)

    def get_prefix(self, key, n):  # (what the guard's capped reads use)
        threads.add(threading.get_ident())
        return real_prefix(self, key, n)

    monkeypatch.setattr(S3Mailbox, "get", get)
    monkeypatch.setattr(S3Mailbox, "get_prefix", get_prefix)
    box = S3Mailbox(s3_bucket, "runs/fleet", endpoint_url=s3_server)
    guarded = GuardedMailbox(box)
    for i in range(6):
        box.put_if_absent(f"snapshots/0000000000/k{i}.json", b"x" * (i + 1))
    got = read_many(guarded, [f"snapshots/0000000000/k{i}.json" for i in range(6)] + ["snapshots/0000000000/no.json"])
    assert got == [b"x" * (i + 1) for i in range(6)] + [None]
    assert len(threads) > 1  # run at once on the pool, not one after the other

    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=4, max_contributions=2), mailbox=box)
    c.join_all([f"s{i}" for i in range(4)])
    c.run(12)
    finish(c)
    recs = assert_tape_contiguous(c)
    assert len(recs) >= 4 and all(len(r.participants) == 2 for r in recs)
    assert_identical(list(c.members.values()))


def test_a_commit_retried_after_a_failure_takes_the_draw_again():
    from gradientmail_core.errors import MailboxUnavailable

    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, quorum_size=1, max_contributions=1), audit=True)
    down = {"once": False}

    class Flaky(ForwardingMailbox):  # the round record's PUT fails once (the store answers 503)
        def put_if_absent(self, key, data):
            if down["once"] and key.startswith(keys.ROUNDS):
                down["once"] = False
                raise MailboxUnavailable("503 Slow Down")
            return super().put_if_absent(key, data)

    a = c.join("a", mailbox=Flaky(c.path("a")))
    run_id = a.node.run.manifest.run_id
    pool = sorted((f"p{i}" for i in range(12)), key=lambda lr: draw(run_id, 0, lr))
    late = pool[0] if draw(run_id, 0, pool[0]) < draw(run_id, 0, "a") else None
    assert late is not None, "the run id drew 'a' first: pick another pool"
    early, late = c.join(pool[1]), c.join(late)
    for m in c.live():
        m.node.state.list_leases(m.node.store)
    for _ in range(4):
        a.train()
        early.train()
    early.node.tick()  # early's snapshot of round 0 lands
    down["once"] = True
    with pytest.raises(MailboxUnavailable):
        a.node.tick()  # a judges the draw among a and early, and its commit fails
    assert c.head() == -1
    for _ in range(4):
        late.train()
    late.node.tick()  # a lower draw is listed before the retry
    a.node.tick()
    rec = records(c)[0]
    assert [p.learner for p in rec.participants] == [late.name]
    c.run(8)
    finish(c)
