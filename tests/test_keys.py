"""Keys: parse inverts format, byte order is numeric order, and bad ids never reach I/O."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradientmail_core.mailbox.contract import check_object_key, validate_key  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.workqueue import keys as queue_keys  # noqa: E402

rounds = st.integers(0, keys.MAX_ROUND)
learners = st.from_regex(keys.LEARNER_ID, fullmatch=True)
shas = st.text("0123456789abcdef", min_size=64, max_size=64)
comp = st.sampled_from(["", "zstd"])


@given(rounds, st.integers(1, keys.MAX_CLAIM))
def test_claim_keys_round_trip(r, n):
    assert keys.parse_claim_key(keys.claim_key(r, n)) == (r, n)


@given(rounds)
def test_round_keys_round_trip(r):
    assert keys.parse_round_key(keys.round_key(r)) == r


@given(rounds, learners)
def test_snapshot_keys_round_trip(r, learner):
    assert keys.parse_snapshot_key(keys.snapshot_key(r, learner)) == (r, learner)


@given(learners, st.integers(0, keys.MAX_SEQ))
def test_lease_keys_round_trip(learner, seq):
    assert keys.parse_lease_key(keys.lease_key(learner, seq)) == (learner, seq)


@given(st.integers(0, keys.MAX_FRAGMENT), rounds, learners, shas, comp, st.sampled_from(keys.ROUND_BLOB_KINDS))
def test_blob_keys_round_trip(fragment, r, learner, sha, compression, kind):
    b = keys.parse_blob_key(keys.init_blob_key(fragment, sha, compression))
    assert (b.kind, b.fragment, b.sha, b.compression) == ("init", fragment, sha, compression)
    b = keys.parse_blob_key(keys.round_blob_key(r, kind, sha, compression))
    assert (b.kind, b.round, b.sha, b.compression) == (kind, r, sha, compression)
    b = keys.parse_blob_key(keys.snapshot_blob_key(r, learner, sha, compression))
    assert (b.kind, b.round, b.learner, b.sha) == ("snapshot", r, learner, sha)
    b = keys.parse_blob_key(keys.roster_key(r, sha))
    assert (b.kind, b.round, b.sha, b.compression) == ("roster", r, sha, "")
    for k in (
        keys.init_blob_key(fragment, sha, compression),
        keys.round_blob_key(r, kind, sha, compression),
        keys.roster_key(r, sha),
    ):
        assert validate_key(k) == k and keys.is_known_key(k)


@given(rounds, rounds)
def test_byte_order_is_numeric_order(a, b):
    assert (keys.round_key(a) < keys.round_key(b)) == (a < b)
    assert (keys.claims_prefix(a) < keys.claims_prefix(b)) == (a < b)
    assert (keys.snapshots_prefix(a) < keys.snapshots_prefix(b)) == (a < b)
    assert (keys.round_blobs_prefix(a) < keys.round_blobs_prefix(b)) == (a < b)
    assert (keys.roster_key(a, "f" * 64) < keys.roster_key(b, "0" * 64)) == (a < b)


@given(st.integers(1, keys.MAX_CLAIM), st.integers(1, keys.MAX_CLAIM), rounds)
def test_claim_order_is_numeric_order(n, m, r):
    assert (keys.claim_key(r, n) < keys.claim_key(r, m)) == (n < m)


def test_rounds_sort_before_snapshots_so_one_listing_returns_both():
    # the node lists everything after rounds/{head} and relies on this order
    assert keys.round_key(keys.MAX_ROUND) < keys.snapshots_prefix(0)
    assert keys.LEASES < keys.MANIFEST < keys.ROUNDS < keys.SNAPSHOTS
    assert keys.CLAIMS < keys.ROUNDS and keys.BLOBS < keys.ROUNDS


@pytest.mark.parametrize(
    "bad", ["../x", "a/../b", "/abs", "a\\b", "a\x00b", "a//b", "", "./a", "a/./b", "sp ace", "é", "a" * 600]
)
def test_hostile_keys_are_rejected(bad):
    with pytest.raises(ValueError, match="invalid mailbox key"):
        validate_key(bad)


@pytest.mark.parametrize("bad", ["", "A", "-a", "a_b", "a.b", "a/b", "..", "a" * 65, " a", "a\n"])
def test_bad_learner_ids_are_rejected(bad):
    with pytest.raises(ValueError, match="learner id"):
        keys.validate_learner_id(bad)
    with pytest.raises(ValueError):
        keys.snapshot_key(0, bad)


@pytest.mark.parametrize(
    "key",
    [
        "rounds/1.json",
        "rounds/00000000001.json",
        "rounds/0000000001.json.bak",
        "claims/0000000001/000.json",
        "snapshots/0000000001/UP.json",
        "snapshots/0000000001/a/b.json",
        "leases/a/1.json",
    ],
)
def test_near_miss_keys_do_not_parse(key):
    assert keys.parse_round_key(key) is None
    assert keys.parse_claim_key(key) is None
    assert keys.parse_snapshot_key(key) is None
    assert keys.parse_lease_key(key) is None


def test_numbers_out_of_range_are_refused():
    with pytest.raises(ValueError):
        keys.round_key(-1)
    with pytest.raises(ValueError):
        keys.round_key(keys.MAX_ROUND + 1)
    with pytest.raises(ValueError):
        keys.claim_key(0, 0)
    with pytest.raises(ValueError):
        keys.init_blob_key(0, "nothex")


# ---- the work queue -----------------------------------------------------------------------

queues = learners
units = st.integers(0, queue_keys.MAX_UNIT)
attempts = st.integers(1, queue_keys.MAX_ATTEMPT)
seqs = st.integers(0, keys.MAX_SEQ)


@given(queues, units, attempts, seqs)
def test_work_keys_round_trip_and_are_valid_keys(q, u, n, seq):
    assert queue_keys.parse_queue_info_key(queue_keys.queue_info_key(q)) == q
    assert queue_keys.parse_unit_claim_key(queue_keys.unit_claim_key(q, u, n)) == (q, u, n)
    assert queue_keys.parse_unit_done_key(queue_keys.unit_done_key(q, u)) == (q, u)
    assert queue_keys.parse_unit_hold_key(queue_keys.unit_hold_key(q, u, n, seq)) == (q, u, n, seq)
    assert queue_keys.parse_unit_release_key(queue_keys.unit_release_key(q, u, n)) == (q, u, n)
    for k in (
        queue_keys.queue_info_key(q),
        queue_keys.unit_claim_key(q, u, n),
        queue_keys.unit_done_key(q, u),
        queue_keys.unit_hold_key(q, u, n, seq),
        queue_keys.unit_release_key(q, u, n),
    ):
        assert check_object_key(k) == k and queue_keys.is_known(k) and not keys.is_known_key(k)
        # tagged in an authenticated run, like the run's own record keys (workqueue/auth.py)
        assert k.startswith(queue_keys.queue_prefix(q)) and keys.is_record_key(k)
        assert keys.untag_key(keys.tag_key(k, "0" * keys.TAG_HEX)) == (k, "0" * keys.TAG_HEX)
    assert queue_keys.unit_claim_key(q, u, n).startswith(queue_keys.unit_claims_prefix(q, u))
    assert queue_keys.unit_done_key(q, u).startswith(queue_keys.unit_done_prefix(q))
    assert queue_keys.unit_hold_key(q, u, n, seq).startswith(queue_keys.unit_holds_prefix(q, u, n))


@given(queues, units, units, attempts, attempts, seqs, seqs)
def test_work_key_byte_order_is_numeric_order(q, u, v, n, m, s, t):
    assert (queue_keys.unit_claim_key(q, u, n) < queue_keys.unit_claim_key(q, v, n)) == (u < v)
    assert (queue_keys.unit_claim_key(q, u, n) < queue_keys.unit_claim_key(q, u, m)) == (n < m)
    assert (queue_keys.unit_done_key(q, u) < queue_keys.unit_done_key(q, v)) == (u < v)
    assert (queue_keys.unit_hold_key(q, u, n, s) < queue_keys.unit_hold_key(q, u, n, t)) == (s < t)
    assert (queue_keys.unit_hold_key(q, u, n, s) < queue_keys.unit_hold_key(q, u, m, t)) == (
        n < m or (n == m and s < t)
    )
    assert (queue_keys.unit_release_key(q, u, n) < queue_keys.unit_release_key(q, v, m)) == ((u, n) < (v, m))


@given(queues, units, attempts, seqs)
def test_one_listing_of_a_queue_returns_its_kinds_in_order(q, u, n, seq):
    # claims/ < done/ < holds/ < queue.json < released/, all under work/{queue}/
    ordered = [
        queue_keys.unit_claim_key(q, queue_keys.MAX_UNIT, queue_keys.MAX_ATTEMPT),
        queue_keys.unit_done_key(q, 0),
        queue_keys.unit_done_key(q, queue_keys.MAX_UNIT),
        queue_keys.unit_hold_key(q, 0, 1, 0),
        queue_keys.unit_hold_key(q, queue_keys.MAX_UNIT, queue_keys.MAX_ATTEMPT, keys.MAX_SEQ),
        queue_keys.queue_info_key(q),
        queue_keys.unit_release_key(q, 0, 1),
    ]
    assert ordered == sorted(ordered)
    assert queue_keys.unit_claim_key(q, u, n) < queue_keys.unit_done_key(q, 0)
    assert queue_keys.unit_hold_key(q, u, n, seq) < queue_keys.queue_info_key(q) < queue_keys.unit_release_key(q, u, n)


@pytest.mark.parametrize(
    "key",
    [
        "work/data/claims/1/001.json",
        "work/data/claims/0000000001/000.json",
        "work/data/claims/0000000001/0001.json",
        "work/Data/done/0000000001.json",
        "work/data/done/0000000001.json.bak",
        "work/data/holds/0000000001/001/1.json",
        "work/data/holds/0000000001/000/0000000001.json",
        "work/data/released/0000000001/000.json",
        "work/data/queue.json.tmp",
        "work/a/b/queue.json",
        "claims/0000000001/001.json",
    ],
)
def test_near_miss_work_keys_do_not_parse(key):
    assert queue_keys.parse_unit_claim_key(key) is None
    assert queue_keys.parse_unit_done_key(key) is None
    assert queue_keys.parse_unit_hold_key(key) is None
    assert queue_keys.parse_unit_release_key(key) is None
    assert queue_keys.parse_queue_info_key(key) is None


def test_work_numbers_and_names_out_of_range_are_refused():
    for bad in (
        lambda: queue_keys.unit_claim_key("data", 0, 0),
        lambda: queue_keys.unit_claim_key("data", 0, queue_keys.MAX_ATTEMPT + 1),
        lambda: queue_keys.unit_done_key("data", -1),
        lambda: queue_keys.unit_done_key("data", queue_keys.MAX_UNIT + 1),
        lambda: queue_keys.unit_done_key("data", True),
        lambda: queue_keys.unit_hold_key("data", 0, 1, -1),
        lambda: queue_keys.queue_info_key("../x"),
        lambda: queue_keys.queue_info_key("Data"),
    ):
        with pytest.raises(ValueError):
            bad()


# ---- node roles in lease keys ---------------------------------------------------------------

roles = st.sampled_from(keys.ROLES)
tags = st.from_regex(r"[0-9a-f]{32}", fullmatch=True)


@given(learners, st.integers(0, keys.MAX_SEQ), roles)
def test_lease_keys_with_a_role_round_trip(learner, seq, role):
    k = keys.lease_key(learner, seq, role)
    assert keys.parse_lease_key(k) == (learner, seq) and keys.lease_role(k) == role
    assert validate_key(k) == k and keys.is_known_key(k)
    if role == "both":  # the keys of runs from before roles
        assert k == keys.lease_key(learner, seq) == f"leases/{learner}/{seq:010d}.json"


@given(learners, st.integers(0, keys.MAX_SEQ), st.integers(0, keys.MAX_SEQ), roles, roles)
def test_lease_byte_order_is_sequence_order_whatever_the_roles(learner, s, t, ra, rb):
    # a node's newest lease is the last one listed, even across a restart under another role
    if s != t:
        assert (keys.lease_key(learner, s, ra) < keys.lease_key(learner, t, rb)) == (s < t)


@given(learners, st.integers(0, keys.MAX_SEQ), roles, learners, st.integers(0, keys.MAX_SEQ), roles, tags, tags)
def test_tagged_lease_keys_with_a_role_round_trip_and_keep_their_order(la, sa, ra, lb, sb, rb, ta, tb):
    a, b = keys.lease_key(la, sa, ra), keys.lease_key(lb, sb, rb)
    pa, pb = keys.tag_key(a, ta), keys.tag_key(b, tb)
    assert keys.untag_key(pa) == (a, ta) and validate_key(pa) == pa
    assert keys.parse_lease_key(pa) is None and keys.lease_role(pa) is None  # a tagged key is no plain key
    if a != b:
        assert (a < b) == (pa < pb)


@pytest.mark.parametrize(
    "key",
    [
        "leases/a/0000000001.x.json",
        "leases/a/0000000001.L.json",
        "leases/a/0000000001.l.s.json",
        "leases/a/0000000001..json",
    ],
)
def test_near_miss_role_lease_keys_do_not_parse(key):
    assert keys.parse_lease_key(key) is None and keys.lease_role(key) is None


def test_an_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role"):
        keys.lease_key("a", 1, "closer")
