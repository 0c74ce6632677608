"""The store bill: ``cli/bill.py``'s model of a run's requests and bytes, held against what
``bench/fleet.py`` counts on a simulated store, and ``gradientmail cost`` printing its price."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import gradientmail_core as gm
from gradientmail_core.cli import bill, main
from gradientmail_core.cli.cost import R2, S3, egress_per_day, hf_prices, price_day

ROOT = Path(__file__).resolve().parents[1]


def _fleet():
    # bench/fleet.py puts bench/ on sys.path for its own imports: restored here, or bench/requests.py
    # would shadow the requests library for every later import (moto's server among them).
    saved = list(sys.path)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import fleet
    finally:
        sys.path[:] = saved
    return fleet


@pytest.mark.parametrize("n", [4, 16])
def test_the_model_matches_the_requests_a_small_fleet_makes(n):
    fleet = _fleet()
    rounds = 6
    # Near-zero latency: rounds take their nominal 5 s, as the model assumes.
    r = fleet.measure(n, rounds, latency=0.001, bandwidth=1e9)
    shape = bill.RunShape(
        cfg=gm.DiLoCo(sync_every=20, fragments=4, quorum_size=n),
        params=8 * 32 * 32,
        learners=n,
        step_seconds=1.0,
        param_dtype="F32",
    )
    learner, closer = bill.learner_round(shape), bill.closer_round(shape)
    f, c = r.follower_mean, r.closer
    # The measured window is 30 s: it may miss the one lease renewal (every 30 s) the model
    # spreads over the rounds, hence the slack on PUT and DELETE.
    assert f["GET"] == pytest.approx(learner.requests["GET"], abs=0.2)
    assert f["PUT"] == pytest.approx(learner.requests["PUT"], abs=0.25)
    assert f["LIST"] == pytest.approx(learner.list_calls, rel=0.15)
    assert c["GET"] == pytest.approx(closer.requests["GET"], abs=0.2)
    assert c["PUT"] == pytest.approx(closer.requests["PUT"], abs=0.25)
    # Bytes: a follower uploads its contribution and its snapshot record (payload headers and
    # lease renewals are the slack); the closer downloads the others' contributions.
    assert f["up"] == pytest.approx(learner.up, rel=0.1)
    contribution = bill.payload_bytes(8 * 32 * 32 // 4, "F32")
    assert c["contribution_down"] == pytest.approx((n - 1) * contribution, rel=0.1)


@pytest.mark.parametrize(("n", "k"), [(4, 2), (16, 4)])
def test_the_capped_model_matches_the_requests_a_small_capped_fleet_makes(n, k):
    fleet = _fleet()
    rounds = 6
    r = fleet.measure(n, rounds, latency=0.001, bandwidth=1e9, max_contributions=k)
    shape = bill.RunShape(
        cfg=gm.DiLoCo(sync_every=20, fragments=4, quorum_size=n, max_contributions=k),
        params=8 * 32 * 32,
        learners=n,
        step_seconds=1.0,
        param_dtype="F32",
    )
    learner, closer = bill.learner_round(shape), bill.closer_round(shape)
    f, c = r.follower_mean, r.closer
    # Followers: a page a poll and a lease listing, whatever N.
    assert f["LIST"] == pytest.approx(learner.list_calls, rel=0.15)
    assert f["LIST pages"] == pytest.approx(learner.requests["LIST"], rel=0.15)
    assert f["GET"] == pytest.approx(learner.requests["GET"], abs=0.2)
    assert f["PUT"] == pytest.approx(learner.requests["PUT"], abs=0.25)
    assert c["PUT"] == pytest.approx(closer.requests["PUT"], abs=0.25)
    # The closer reads min(K, N - 1) others' contributions at most (the model's figure); when the
    # draw picks its own, K - 1: K (N - 1) / N on average (6 rounds: slack of one contribution).
    assert c["GET"] <= closer.requests["GET"] + 0.2
    assert c["GET"] >= closer.requests["GET"] - 2 * (k / n + 1)
    contribution = bill.payload_bytes(8 * 32 * 32 // 4, "F32")
    assert c["contribution_down"] <= k * contribution * 1.1


def test_the_model_counts_what_grows_with_the_fleet():
    small, large = (
        bill.RunShape(
            cfg=gm.DiLoCo(sync_every=100, fragments=8, delta_dtype="I2"), params=10**9, learners=n, step_seconds=1.0
        )
        for n in (10, 1000)
    )
    a, b = bill.learner_round(small), bill.learner_round(large)
    # A learner's own payloads do not grow with the fleet; its listings do (every snapshot record
    # of the open round and the verify window is in each poll's answer: pages of 1,000 keys).
    assert a.requests["PUT"] == b.requests["PUT"]
    assert a.list_calls == b.list_calls
    assert b.requests["LIST"] > 5 * a.requests["LIST"]
    # The closer reads every other contribution: its record and its chunks (I2 chunks of 16 Mi
    # values are 4.7 MB: one GET each).
    ca, cb = bill.closer_round(small), bill.closer_round(large)
    assert cb.requests["GET"] - ca.requests["GET"] == pytest.approx(990 * (1 + large.chunks), rel=0.01)


def _shape(n, k=None, **kw):
    cfg = gm.DiLoCo(sync_every=100, fragments=8, delta_dtype="I2", max_contributions=k, **kw)
    return bill.RunShape(cfg=cfg, params=10**9, learners=n, step_seconds=1.0)


@pytest.mark.parametrize("k", [16, 32])
def test_with_max_contributions_the_closer_reads_at_most_k_contributions_whatever_the_fleet(k):
    contribution = sum(_shape(10).chunk_bytes("I2"))
    closers = {n: bill.closer_round(_shape(n, k)) for n in (2 * k, 1000, 10_000)}
    gets = {n: c.requests["GET"] for n, c in closers.items()}
    # K records and K payloads (one GET per chunk), whatever N, against N - 1 of each uncapped; and
    # its own round record read back once.
    assert gets[2 * k] == gets[1000] == gets[10_000] == pytest.approx(k * (1 + _shape(10).chunks) + 1)
    uncapped = bill.closer_round(_shape(10_000))
    assert uncapped.requests["GET"] == pytest.approx(9_999 * (1 + _shape(10).chunks) + 1)
    # Its bytes read other than listings' answers: K contributions' worth and records, whatever N.
    read = {n: c.down - c.list_down for n, c in closers.items()}
    assert read[2 * k] == read[1000] == read[10_000]
    own = _shape(1000, k).round_record  # its own record, read back
    assert k * contribution < read[1000] < k * (contribution + bill.SNAPSHOT_RECORD) + own + 1000
    assert uncapped.down - uncapped.list_down > 9_999 * contribution
    # What still grows with N are the listings' answers (LIST_BYTES_PER_KEY a key): the open round's
    # snapshot records a poll, every lease, blobs/snapshots/ for GC. At 10,000 learners they are
    # under half of the K contributions' worth.
    assert closers[1000].list_down < closers[10_000].list_down < 0.5 * read[10_000]
    # Fewer than K others when the fleet is smaller: min(K, N - 1).
    small = bill.closer_round(_shape(5, k))
    assert small.requests["GET"] == pytest.approx(4 * (1 + _shape(10).chunks) + 1)


def test_with_max_contributions_a_followers_requests_do_not_grow_with_the_fleet():
    a, b, c = (bill.learner_round(_shape(n, 16)) for n in (16, 1000, 100_000))
    assert a.requests == b.requests == c.requests
    assert a.list_calls == b.list_calls == c.list_calls
    # Bytes too, once N >= K: the round record lists at most K participants.
    assert a.down == b.down == c.down and a.up == b.up == c.up
    # One page a poll and a lease listing, plus the claims: against N (W + 1) keys a poll uncapped.
    polls = 100 / 8 + 1
    assert b.requests["LIST"] == pytest.approx(polls + 12.5 / 5 + 1)
    uncapped = bill.learner_round(_shape(100_000))
    assert uncapped.requests["LIST"] > 500 * b.requests["LIST"]
    # It still writes its contribution and record and renews its lease: the PUTs do not change.
    assert b.requests["PUT"] == uncapped.requests["PUT"] and b.up == uncapped.up


def test_with_max_contributions_the_round_record_and_the_tape_are_bounded_by_k():
    shape = _shape(1000, 16)
    capped, uncapped = bill.day(shape), bill.day(_shape(1000))
    assert capped.tape_growth == pytest.approx(
        capped.rounds * (bill.ROUND_RECORD + 16 * bill.ROUND_RECORD_PER_PARTICIPANT + bill.ROUND_RECORD_ROSTER)
    )
    assert uncapped.tape_growth == pytest.approx(
        uncapped.rounds * (bill.ROUND_RECORD + 1000 * bill.ROUND_RECORD_PER_PARTICIPANT)
    )
    # Every learner still uploads each round: what is stored differs by the tape, and the rosters of
    # the verify window (a capped round's ids, not in its record) the closer writes.
    roster = bill.ROSTER + 1000 * bill.ROSTER_PER_LEARNER
    assert shape.roster == roster
    assert uncapped.stored - capped.stored == pytest.approx(
        (uncapped.tape_growth - capped.tape_growth) / 2 - shape.cfg.verify_window * roster
    )
    assert capped.traffic.up == pytest.approx(
        uncapped.traffic.up - (uncapped.tape_growth - capped.tape_growth) + capped.rounds * roster
    )


def test_max_contributions_at_or_above_the_fleet_still_merges_every_contribution():
    # K >= N: the closer reads all N - 1 others, as uncapped; only the listings differ.
    capped, uncapped = bill.closer_round(_shape(16, 64)), bill.closer_round(_shape(16))
    assert capped.requests["GET"] == uncapped.requests["GET"]
    assert capped.requests["PUT"] == uncapped.requests["PUT"] + 1  # (the round's roster)


def test_multipart_and_ranged_reads_are_counted_per_part():
    assert bill.put_requests(5 << 20) == 1
    assert bill.put_requests(64 << 20) == 2 + 8
    assert bill.put_requests(64 << 20, threshold=2_000_000_000) == 1
    assert bill.get_requests(100) == 1
    assert bill.get_requests((32 << 20) + 1) == 5


def test_payload_bytes_follow_the_codec_layout():
    assert bill.payload_bytes(64, "F32") == 256
    assert bill.payload_bytes(64, "BF16") == 128
    assert bill.payload_bytes(64, "I2") == 2 * 8 + 2  # two blocks of 32: 8 bytes of codes and a scale each
    assert bill.payload_bytes(64, "F4") == 2 * 16 + 2


def test_egress_is_billed_in_monthly_tiers():
    assert egress_per_day(1.0, R2.egress) == 0.0
    # 20 GB a day = 600 GB a month: 100 free, 500 at $0.09.
    assert egress_per_day(20.0, S3.egress) == pytest.approx(500 * 0.09 / 30)
    # 1 TB a day = 30 TB a month: 100 GB free, to 10 TB at 0.09, the next 20 TB at 0.085.
    month = 30 * 1024
    expected = (10 * 1024 - 100) * 0.09 + (month - 10 * 1024) * 0.085
    assert egress_per_day(1024.0, S3.egress) == pytest.approx(expected / 30)


def test_a_day_is_priced_request_by_request():
    t = bill.Traffic()
    t.add("PUT", 2000, up=0)
    t.add("GET", 1000, down=float(bill.DAY))
    t.add("LIST", 1000)
    d = bill.Day(t, stored=30 * 2**30, tape_growth=0, rounds=1, learner=t, closer=t)
    s3 = price_day(d, S3, egress_share=0.0)
    assert s3["requests"] == pytest.approx(2 * 0.005 + 0.0004 + 0.005)
    assert s3["storage"] == pytest.approx(0.023)  # 30 GB for a day: one GB-month
    assert s3["egress"] == 0.0
    hf = price_day(d, hf_prices(25.0), egress_share=1.0)
    assert hf["requests"] == 0.0 and hf["egress"] == 0.0


BILL_7B = ["--params", "7e9", "--learners", "1000", "--sync-every", "100", "--fragments", "8"]
BILL_7B += ["--delta-dtype", "I2", "--step-seconds", "1"]


def test_cost_prints_each_store_and_where_its_prices_come_from(capsys):
    assert main(["cost", *BILL_7B]) == 0
    out = capsys.readouterr().out
    for name in ("AWS S3 Standard", "Cloudflare R2", "Hugging Face Buckets"):
        assert name in out
    assert "6912 rounds a day" in out
    assert "developers.cloudflare.com/r2/pricing" in out and "read 2026-12-02" in out


def test_cost_json_for_a_thousand_learners_of_a_7b_model():
    out = subprocess.run(
        [sys.executable, "-m", "gradientmail_core.cli", "cost", *BILL_7B, "--commit-dtype", "I2", "--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    got = json.loads(out.stdout)
    assert got["rounds_per_day"] == pytest.approx(6912)
    usd = got["usd_per_day"]
    # The same requests cost more on S3 than on R2 (Class A at $4.50 against $5 per million);
    # R2 and the HF buckets charge no egress.
    assert usd["AWS S3 Standard"]["requests"] > usd["Cloudflare R2"]["requests"] > 0
    assert usd["Cloudflare R2"]["egress"] == usd["Hugging Face Buckets"]["egress"] == 0
    # Every learner reads each round's I2 change (7e9 / 8 values at 9 bits per 32): a floor on egress.
    change = math.ceil(7e9 / 8) * 9 / 32
    assert got["bytes_down"] > 999 * change * 6912


def test_cost_max_contributions_bounds_what_the_closer_reads():
    def run(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "gradientmail_core.cli", "cost", *BILL_7B, *extra, "--json"],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        return json.loads(out.stdout)

    full, k16, k32 = run(), run("--max-contributions", "16"), run("--max-contributions", "32")
    assert full["max_contributions"] is None and k16["max_contributions"] == 16
    # The same uploads and storage less the tape; fewer requests and bytes read, more so with a lower K.
    assert full["bytes_up"] > k32["bytes_up"] > k16["bytes_up"]
    assert full["requests"]["GET"] > k32["requests"]["GET"] > k16["requests"]["GET"]
    # Listings do not depend on K: the followers list a page or two, the closer as uncapped.
    assert full["requests"]["LIST"] > 5 * k32["requests"]["LIST"] and k32["requests"]["LIST"] == k16["requests"]["LIST"]
    # One PUT more a round, the closer's roster of the ids its draw was taken over.
    assert k16["requests"]["PUT"] - full["requests"]["PUT"] == pytest.approx(k16["rounds_per_day"])
    assert full["bytes_down"] > k32["bytes_down"] > k16["bytes_down"]
    for store in ("AWS S3 Standard", "Cloudflare R2"):
        assert (
            full["usd_per_day"][store]["total"]
            > k32["usd_per_day"][store]["total"]
            > k16["usd_per_day"][store]["total"]
        )


def test_cost_prints_the_cap_and_refuses_a_bad_one(capsys):
    assert main(["cost", *BILL_7B, "--max-contributions", "16"]) == 0
    out = capsys.readouterr().out
    assert "max_contributions=16" in out and "one follower, per round" in out
    assert main(["cost", *BILL_7B, "--max-contributions", "0"]) == 2
    assert "max_contributions" in capsys.readouterr().err


def test_cost_refuses_a_config_a_run_would_refuse(capsys):
    assert main(["cost", *BILL_7B, "--checkpoint-every", "4"]) == 2
    assert "commit_dtype" in capsys.readouterr().err
