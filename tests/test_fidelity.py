"""Fidelity to the prior art (gradientmail 0.0.1): the behaviours issue 17 lists, each with the
test that fails without its fix. Deterministic: a fake clock, single-threaded clusters, no
wall-clock thresholds."""

from __future__ import annotations

import queue
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from harness import SHAPES, Cluster, make_params

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.aggregators.merge import merge
from gradientmail_core.clock import FakeClock
from gradientmail_core.codec.payload import encode_payload
from gradientmail_core.config import RDA, WeightedMean
from gradientmail_core.errors import MailboxUnavailable
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.lease import LeaseWriter
from gradientmail_core.protocol.records import Claim, Lease, RoundRecord, Snapshot, decode, encode
from gradientmail_core.protocol.run import open_run, read_manifest
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.collector import Collector, Judged
from gradientmail_core.syncer.host import ProcessHost, join_run
from gradientmail_core.syncer.marker import RestartMarker
from gradientmail_core.syncer.merger import FragmentMerger
from gradientmail_core.syncer.options import NodeOptions
from gradientmail_core.syncer.timing import Estimates

REPO = Path(__file__).resolve().parents[1]
OPTS = NodeOptions(poll_interval=0.1, lease_timeout=2.0, round_timeout=1.0)


def joined(store: RunStore, cfg: gm.DiLoCo, name: str, clock: FakeClock, seed: int = 0):
    events: list[ev.Event] = []
    node, learner = join_run(
        store,
        NumpyAdapter(make_params(seed)),
        cfg,
        clock,
        learner=name,
        nonce=f"{seed + 1:08x}",
        emit=events.append,
        options=OPTS,
        rng=random.Random(seed),
    )
    return node, learner, events


# ---- 1. fragments clamped to the tensor count -------------------------------------------------


def test_more_fragments_than_tensors_is_clamped_recorded_and_joinable() -> None:
    store, clock = RunStore(MemoryMailbox()), FakeClock()
    cfg = gm.DiLoCo(sync_every=8, fragments=8)  # the model has 4 tensors
    node, _, events = joined(store, cfg, "a", clock)
    assert node.run.P == len(SHAPES)
    manifest = read_manifest(store)
    assert manifest is not None and manifest.config["fragments"] == len(SHAPES)
    assert len(manifest.fragments) == len(SHAPES)
    assert [e for e in events if isinstance(e, ev.FragmentsClamped)] == [ev.FragmentsClamped("a", 8, len(SHAPES))]
    # A node with the same user config joins (no RunConfigMismatch for fragments).
    node_b, _, events_b = joined(store, cfg, "b", clock, seed=1)
    assert node_b.run.P == len(SHAPES)
    assert any(isinstance(e, ev.FragmentsClamped) for e in events_b)
    # Another config still differs.
    with pytest.raises(gm.RunConfigMismatch):
        joined(store, gm.DiLoCo(sync_every=8, fragments=2), "c", clock, seed=2)


# ---- 2. the overlap wait is not step time -------------------------------------------------------


def test_time_blocked_on_the_overlap_bound_is_not_counted_as_step_time() -> None:
    c = Cluster(gm.DiLoCo(sync_every=2, fragments=1, overlap_steps=0))
    a = c.join("a")
    published: list[float] = []
    outbox_publish = a.node.bridge.publish

    def record(p):
        published.append(p.step_seconds)
        outbox_publish(p)

    a.node.bridge.publish = record  # type: ignore[method-assign]
    blocked = []

    def wait():
        c.clock.advance(100.0)  # blocked on the overlap bound: the node uploads and commits
        blocked.append(1)
        a.node.tick()
        try:
            return a.node.bridge.inbox.get_nowait()
        except queue.Empty:
            return None

    for _ in range(12):
        c.clock.advance(1.0)  # one second of training per step
        a.learner.step(4, wait=wait)
    assert blocked and len(published) >= 3
    # Every contribution after the first (whose first step has no predecessor) reports 1 s/step.
    assert published[1:] == [1.0] * (len(published) - 1)


# ---- 3. the round record's grace is the realized one --------------------------------------------


def test_round_record_grace_is_the_realized_window_with_the_plan_beside_it() -> None:
    params = make_params(0)
    store = RunStore(MemoryMailbox())
    cfg = gm.DiLoCo(sync_every=4, fragments=1)
    adapter = NumpyAdapter(params)
    run, _ = open_run(store, adapter.schema(), adapter.read, cfg, learner="c", compression="", rng=random.Random(0))
    delta = {k: np.full(v.shape, 0.01, np.float32) for k, v in params.items()}
    ref = store.put_payload(
        lambda sha: keys.snapshot_blob_key(0, "a", sha, ""), encode_payload(delta, "F32", kind="delta")
    )
    snap = Snapshot(
        learner="a", round=0, local_step=4, steps=4, tokens=16, base_version=0, step_seconds=1.0,
        schema_digest=run.digest, payload=ref, nonce="0123abcd",
    )  # fmt: skip
    store.put_record(keys.snapshot_key(0, "a"), snap)
    merger = FragmentMerger.one_process(run, store)
    state = merger.load(0, 0, run.manifest.init[0], None, params)
    col = Collector(0, run, state, 0.0, Estimates(x_step=1.0, x_quorum=0.5, x_sync=0.5), merger)
    col.judge_snapshot(store, "a")
    # Quorum at t=2 with a planned window; everyone live reported at t=3, so it closes then.
    assert not col.update({"a", "b"}, 2.0)
    planned = col.grace
    assert planned > 1.0
    col.judged["b"] = Judged("b", "stale")
    assert col.update({"a", "b"}, 3.0)
    rec = col.record(col.commit(compression=""), closer="c", live=2, now=3.0, sync_seconds=None)
    assert rec.grace_seconds == 1.0  # quorum to close
    assert rec.grace_planned == round(planned, 6)
    # The new field round-trips, and a record without it (an older node's) still decodes.
    assert decode(encode(rec), RoundRecord) == rec
    old = encode(rec).replace(b',"grace_planned":' + str(rec.grace_planned).encode(), b"")
    assert b"grace_planned" not in old and decode(old, RoundRecord).grace_planned is None


# ---- 4. unclaimed rounds and restarts do not wait -----------------------------------------------


def test_an_unclaimed_round_is_claimed_at_once() -> None:
    c = Cluster(gm.DiLoCo(sync_every=2, fragments=1))
    a, b = c.join_all("ab")
    orig = a.node.election.try_claim
    a.node.election.try_claim = lambda r, n, **kw: False if r == 1 else orig(r, n, **kw)  # type: ignore[method-assign]
    while c.head() < 0:  # only a polls: it commits round 0 and dies before it claims round 1
        a.train()
        a.node.tick()
        c.clock.advance(0.05)
    c.crash(a)
    assert c.mailbox.list(keys.claims_prefix(1)) == []
    now = c.clock.now()
    b.node.tick()  # b sees round 0 committed and the open round unclaimed: claims it, no wait
    assert c.clock.now() == now
    assert [(e.round, e.reason) for e in b.of(ev.TookOver)] == [(1, "unclaimed")]
    assert b.node.state.collector is not None and b.node.state.collector.round == 1


def test_a_takeover_whose_state_read_fails_resumes_its_own_claim_on_the_next_poll() -> None:
    c = Cluster(gm.DiLoCo(sync_every=2, fragments=1))
    a, b = c.join_all("ab")
    c.run(4)
    r = c.head() + 1
    b.node.tick()
    fo = b.node.election.watching
    assert fo is not None and fo.round == r and fo.claim is not None and fo.claim.learner == "a"
    orig = b.node.closing.fragment_state
    failures = [1]

    def flaky(f: int):
        if failures:
            failures.pop()
            raise MailboxUnavailable("GET outer: HTTP 503 (injected)")
        return orig(f)

    b.node.closing.fragment_state = flaky  # type: ignore[method-assign]
    assert b.node.election.try_claim(r, fo.claim.n + 1, previous="a", reason="timeout")  # a is still live
    with pytest.raises(MailboxUnavailable):
        b.node._open(r)  # the node closes the round it claimed: its state read fails
    assert b.node.state.collector is None
    b.node.tick()  # b holds the newest claim: it resumes closing at once, no second timeout
    assert b.node.state.collector is not None and b.node.state.collector.round == r


def test_an_invalid_claim_does_not_block_the_round() -> None:
    c = Cluster(gm.DiLoCo(sync_every=2, fragments=1))
    a, b = c.join_all("ab")
    orig = a.node.election.try_claim
    a.node.election.try_claim = lambda r, n, **kw: False if r == 1 else orig(r, n, **kw)  # type: ignore[method-assign]
    while c.head() < 0:  # only a polls: it commits round 0 and dies before it claims round 1
        a.train()
        a.node.tick()
        c.clock.advance(0.05)
    c.crash(a)
    c.mailbox.put_if_absent(keys.claim_key(1, 1), b"not a claim")
    b.node.tick()
    mine = decode(c.mailbox.get(keys.claim_key(1, 2)), Claim)
    assert mine.learner == "b" and b.node.state.collector is not None and b.node.state.collector.round == 1


def test_a_lease_of_a_known_dead_predecessor_is_taken_over_at_once() -> None:
    store, clock = RunStore(MemoryMailbox()), FakeClock()
    old = LeaseWriter(store, clock, "a", "aaaaaaaa", 30.0)
    old.acquire(poll=1.0)  # then the process dies: its lease stays
    fast = LeaseWriter(store, clock, "a", "bbbbbbbb", 30.0)
    fast.acquire(poll=1.0, predecessor="aaaaaaaa")
    assert clock.now() == 0.0
    [key] = store.keys(keys.lease_prefix("a"))
    assert decode(store.mailbox.get(key), Lease).nonce == "bbbbbbbb"
    # A lease of anyone else (or without a known predecessor) is still watched first.
    slow = LeaseWriter(store, clock, "a", "cccccccc", 30.0)
    slow.acquire(poll=1.0, predecessor="aaaaaaaa")
    assert clock.now() >= 1.5 * 30.0


def test_the_restart_marker_names_only_a_dead_predecessor(tmp_path: Path) -> None:
    first = RestartMarker("a", tmp_path)
    assert first.open("run1") is None  # no predecessor yet
    first.hold("aaaaaaaa")
    assert RestartMarker("a", tmp_path).open("run1") is None  # held by a session of this process
    first.close()
    second = RestartMarker("a", tmp_path)
    assert second.open("run1") == "aaaaaaaa"
    second.close()
    # Held by a live process elsewhere on this host: no predecessor; once it died: its nonce.
    code = textwrap.dedent(
        """
        import sys
        from gradientmail_core.syncer.marker import RestartMarker
        m = RestartMarker("a", sys.argv[1]); m.open("run1"); m.hold("cccccccc")
        print("held", flush=True); sys.stdin.read()
        """
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        assert RestartMarker("a", tmp_path).open("run1") is None
    finally:
        p.kill()
        p.wait()
    third = RestartMarker("a", tmp_path)
    assert third.open("run1") == "cccccccc"
    third.close()


def test_a_session_restarted_on_this_host_resumes_its_id_without_waiting(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'mailbox'}"
    code = textwrap.dedent(
        """
        import os, sys
        import numpy as np
        import gradientmail_core as gm
        params = {"w": np.zeros((2, 2), np.float32), "b": np.zeros((2,), np.float32)}
        s = gm.Session(params, algorithm=gm.DiLoCo(sync_every=2, fragments=1), mailbox=gm.open_mailbox(sys.argv[1]),
                       learner_id="x", poll_interval=0.05, lease_timeout=60.0, callbacks=())
        s.open()
        os._exit(0)  # dies holding the id: no close, its lease stays behind
        """
    )
    subprocess.run([sys.executable, "-c", code, url], cwd=REPO, check=True, timeout=120)
    mb = gm.open_mailbox(url)
    assert mb.list(keys.lease_prefix("x"))
    clock = FakeClock()
    params = {"w": np.zeros((2, 2), np.float32), "b": np.zeros((2,), np.float32)}
    s = gm.Session(
        params, algorithm=gm.DiLoCo(sync_every=2, fragments=1), mailbox=mb, learner_id="x",
        poll_interval=0.05, lease_timeout=60.0, callbacks=(), clock=clock,
    )  # fmt: skip
    with s:
        assert clock.now() == 0.0  # no 1.5 x 15 s watch of the dead process's lease


# ---- 5. lease_every ----------------------------------------------------------------------------


def test_lease_every_sets_the_renewal_interval_and_is_validated() -> None:
    cfg = gm.DiLoCo(sync_every=2, fragments=1)
    params = make_params(0)
    s = gm.Session(params, algorithm=cfg, mailbox=gm.MemoryMailbox(), lease_timeout=10.0, lease_every=1.5, callbacks=())
    assert s.options.lease_interval == 1.5
    with s:
        assert s.node is not None and s.node.lease.interval == 1.5
    assert (
        gm.Session(params, algorithm=cfg, mailbox=gm.MemoryMailbox(), lease_timeout=10.0).options.lease_interval == 2.5
    )
    for bad in (0.0, -1.0, 10.0, 11.0):
        with pytest.raises(ValueError, match="lease_every"):
            gm.Session(params, algorithm=cfg, mailbox=gm.MemoryMailbox(), lease_timeout=10.0, lease_every=bad)


# ---- 6. a delta of another layout or dtype is `schema` ------------------------------------------


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: encode_payload(d, "F32", kind="delta"), "schema"),  # the run's delta_dtype is BF16
        (lambda d: encode_payload({**d, "head.b": np.zeros(5, np.float32)}, "BF16", kind="delta"), "schema"),
        (lambda d: encode_payload({k: v for k, v in d.items() if k != "head.b"}, "BF16", kind="delta"), "schema"),
        (lambda d: encode_payload(d, "BF16", kind="delta")[:-3], "corrupt"),
        (lambda d: encode_payload(d, "BF16", kind="delta"), None),
    ],
)
def test_a_delta_of_another_layout_or_dtype_is_rejected_as_schema(make, reason) -> None:
    params = make_params(0)
    store = RunStore(MemoryMailbox())
    cfg = gm.DiLoCo(sync_every=4, fragments=1, delta_dtype="BF16")
    adapter = NumpyAdapter(params)
    run, _ = open_run(store, adapter.schema(), adapter.read, cfg, learner="c", compression="", rng=random.Random(0))
    delta = {k: np.full(v.shape, 0.01, np.float32) for k, v in params.items()}
    ref = store.put_payload(lambda sha: keys.snapshot_blob_key(0, "z", sha, ""), make(delta))
    snap = Snapshot(
        learner="z", round=0, local_step=4, steps=4, tokens=16, base_version=0, step_seconds=1.0,
        schema_digest=run.digest, payload=ref, nonce="0123abcd",
    )  # fmt: skip
    store.put_record(keys.snapshot_key(0, "z"), snap)
    merger = FragmentMerger.one_process(run, store)
    col = Collector(0, run, merger.load(0, 0, run.manifest.init[0], None, params), 0.0, Estimates(), merger)
    assert col.judge_snapshot(store, "z").reason == reason


# ---- 7. early publish once max(min(quorum, live) - 1, 1) others published -----------------------


def test_a_round_counts_as_closing_once_the_others_would_meet_the_quorum_with_us() -> None:
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=1, quorum_size=3))
    a, _, _, _ = c.join_all("abcd")
    a.node.state.snapshot_keys = {0: {"b"}}
    a.node._publish_view()
    assert 0 not in a.node.bridge.view.others_published  # 1 other: with us 2, the quorum is 3
    a.node.state.snapshot_keys = {0: {"b", "c"}}
    a.node._publish_view()
    assert 0 in a.node.bridge.view.others_published  # 2 others: with us, the quorum
    # The quorum is every live learner: the round waits for us, so nobody publishes early.
    c3 = Cluster(gm.DiLoCo(sync_every=8, fragments=1, quorum_size=3))
    a3, _, _ = c3.join_all("abc")
    a3.node.state.snapshot_keys = {0: {"b", "c"}}
    a3.node._publish_view()
    assert 0 not in a3.node.bridge.view.others_published
    # quorum 1: one other is enough (never zero)
    c1 = Cluster(gm.DiLoCo(sync_every=8, fragments=1, quorum_size=1))
    a1, _ = c1.join_all("ab")
    a1.node.state.snapshot_keys = {0: set()}
    a1.node._publish_view()
    assert 0 not in a1.node.bridge.view.others_published
    a1.node.state.snapshot_keys = {0: {"b"}}
    a1.node._publish_view()
    assert 0 in a1.node.bridge.view.others_published


def test_a_laggard_in_an_all_learner_quorum_contributes_its_full_steps() -> None:
    # Why the prior art's count is not used when the quorum is every live learner: c lags the
    # others by one step; counting 2 others as "closing" would make it publish 7 steps of 8.
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=1, quorum_size=3))
    a, b, lag = c.join_all("abc")
    for _ in range(6):
        for m in (a, b, lag):
            m.train()
    for m in (a, b):
        m.train()
        m.train()
    c.settle(ticks=5)  # a and b have published round 0; c's node sees both snapshots
    assert {"a", "b"} <= lag.node.state.snapshot_keys.get(0, set())
    lag.train()  # its 7th step
    assert not lag.learner.published
    lag.train()
    c.settle()
    snaps = [e for e in lag.of(ev.Published) if e.round == 0]
    assert snaps and snaps[0].steps == 8


# ---- 8. RDA's direct_pattern is case-insensitive ------------------------------------------------


def test_rda_direct_pattern_matches_names_lowercased() -> None:
    rng = np.random.default_rng(0)
    deltas = [{n: (s * rng.standard_normal(4)).astype(np.float32) for n in ("Model.EMBED_Tokens", "h")} for s in (1, 3)]
    weights = [1.0, 2.0]
    rda, mean = merge(deltas, weights, RDA()), merge(deltas, weights, WeightedMean())
    np.testing.assert_array_equal(rda["Model.EMBED_Tokens"], mean["Model.EMBED_Tokens"])
    assert not np.array_equal(rda["h"], mean["h"])
    upper = merge(deltas, weights, RDA(direct_pattern="EMBED"))
    np.testing.assert_array_equal(upper["Model.EMBED_Tokens"], mean["Model.EMBED_Tokens"])


# ---- 9. wait_for counts every learner seen since it began ---------------------------------------


class _Drive:
    """Stands in for the session host's stop event: each wait runs one scripted slice of the cluster."""

    def __init__(self, clock: FakeClock, *slices) -> None:
        self.clock, self.slices = clock, list(slices)

    def wait(self, timeout: float | None = None) -> bool:
        if self.slices:
            self.slices.pop(0)()
        self.clock.advance(1.0)
        return False


def _session_over(c: Cluster, m, *slices) -> gm.Session:
    """A session whose host runs the cluster's member ``m`` (no thread of its own); each wait of
    the host runs the next of ``slices``."""
    s = gm.Session(m.params, algorithm=c.cfg, mailbox=c.mailbox, learner_id=m.name, clock=c.clock, callbacks=())
    host = s.host
    assert isinstance(host, ProcessHost)
    host.bridge, host.learner, host.node = m.node.bridge, m.learner, m.node
    host._stop = _Drive(c.clock, *slices)  # type: ignore[assignment]
    return s


def test_wait_for_counts_a_learner_that_was_live_at_one_listing_only() -> None:
    c = Cluster(gm.DiLoCo(sync_every=2, fragments=1))
    a = c.join("a")
    a.node.tick()

    def b_comes_and_goes() -> None:
        b = c.join("b")
        a.node.state.list_leases(a.node.store)  # a sees b live once
        a.node._publish_view()
        c.close(b)
        a.node.state.list_leases(a.node.store)  # and gone at the next listing
        a.node._publish_view()
        assert a.node.bridge.view.live == 1

    s = _session_over(c, a, b_comes_and_goes)
    s.wait_for(learners=2, timeout=10.0)


def test_wait_for_counts_a_learner_seen_only_by_its_contribution() -> None:
    c = Cluster(gm.DiLoCo(sync_every=2, fragments=1))
    a = c.join("a")
    a.node.tick()

    def b_contributes_between_two_lease_listings() -> None:
        a.node.state.list_leases(a.node.store)
        b = c.join("b")
        for _ in range(2):
            b.train()
        b.node.tick()  # uploads its snapshot
        c.close(b)
        a.node.tick()  # the lease listing is not due: only the snapshot shows b
        assert a.node.bridge.view.live == 1

    s = _session_over(c, a, b_contributes_between_two_lease_listings)
    s.wait_for(learners=2, timeout=10.0)


def test_wait_for_still_times_out_when_nobody_comes() -> None:
    c = Cluster(gm.DiLoCo(sync_every=2, fragments=1))
    a = c.join("a")
    s = _session_over(c, a)
    with pytest.raises(TimeoutError, match="1 of 2 learners"):
        s.wait_for(learners=2, timeout=5.0)


# ---- 10. a store that ignores StartAfter ---------------------------------------------------------


def test_s3_list_is_exact_when_the_store_ignores_start_after(s3_bucket: str, s3_server: str) -> None:
    mb = gm.open_mailbox(f"s3://{s3_bucket}/runs/r", endpoint_url=s3_server)
    names = [keys.round_key(i) for i in range(5)] + [keys.snapshot_key(3, "a"), keys.snapshot_key(4, "b")]
    for k in names:
        assert mb.put_if_absent(k, b"x")

    def drop_start_after(params, **kwargs) -> None:
        params.pop("StartAfter", None)  # what a store that ignores it answers

    mb.client.meta.events.register("provide-client-params.s3.ListObjectsV2", drop_start_after)
    raw = mb.client.list_objects_v2(Bucket=s3_bucket, Prefix="runs/r/", StartAfter="runs/r/" + keys.round_key(2))
    assert len(raw["Contents"]) == len(names)  # the hook works: the store lists everything
    after = keys.round_key(2)
    assert mb.list("", after) == sorted(k for k in names if k > after)
    assert mb.list(keys.ROUNDS, after) == [keys.round_key(3), keys.round_key(4)]
    assert mb.list(keys.ROUNDS) == [keys.round_key(i) for i in range(5)]
