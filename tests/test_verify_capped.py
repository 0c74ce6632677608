"""Trusting no closer under a cap (issue 39): a capped round's record names its roster, the learners
the closer took the draw over, by key and sha256; ``gradientmail verify`` and ``verify=`` take the
draw again over it and name a closer that merged others than the draw takes. Deterministic
single-threaded runs (``harness.Cluster``) over a memory store."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets

import numpy as np
import pytest
from adversary_sim import PoisonAdapter, SimRun
from harness import Cluster
from test_verify import _steps, statuses, verifier, verify_cli

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.auth import policy
from gradientmail_core.protocol.guard import GuardedMailbox
from gradientmail_core.protocol.records import Roster, RoundRecord, decode, encode
from gradientmail_core.protocol.schedule import draw_order, draw_problem
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer import closing
from gradientmail_core.syncer.verify import MISMATCH, UNVERIFIABLE, VERIFIED

NAMES = ["a", "b", "c", "d", "e"]
K = 2
CFG = gm.DiLoCo(sync_every=4, fragments=2, quorum_size=len(NAMES), max_contributions=K)


def url() -> str:
    return f"memory://capped-{secrets.token_hex(6)}"


def capped_run(where: str, *, steps: int = 40, verify: float = 0.0, cfg: gm.DiLoCo = CFG) -> Cluster:
    """Five learners merged two a round over ``where``; ``e`` verifies ``verify`` of the rounds.
    Left running (the caller closes it: ``leave``)."""
    c = Cluster(cfg, mailbox=gm.open_mailbox(where))
    for name in NAMES:
        c.join(name, verify=verify if name == "e" else 0.0)
    for m in c.live():
        m.node.state.list_leases(m.node.store)
    c.run(steps)
    c.settle(20)
    return c


def leave(c: Cluster) -> None:
    for m in list(c.live()):
        c.close(m)


def record(c: Cluster, r: int) -> RoundRecord:
    return decode(c.mailbox.get(keys.round_key(r)), RoundRecord)


def roster(c: Cluster, rec: RoundRecord) -> Roster:
    return decode(c.mailbox.get(rec.roster.key), Roster)


def forge_draw(monkeypatch: pytest.MonkeyPatch, forged: int) -> None:
    """Every closer in the process takes round ``forged``'s draw backwards (the highest draws
    merged), and writes the honest roster and a record consistent with the merge it made. The
    verifiers' draw (``syncer/verify.py``'s) is untouched."""
    honest = closing.draw_order

    def backwards(run_id, r, learners):
        order = honest(run_id, r, learners)
        return order[::-1] if r == forged else order

    monkeypatch.setattr(closing, "draw_order", backwards)


# ---- the check, a pure function -----------------------------------------------------------


def test_the_draw_takes_the_shortest_prefix_holding_k_accepted_and_nothing_else():
    order = ["p", "q", "s", "t", "u"]
    assert draw_problem(order, 2, {"p", "q"}, set()) is None
    assert draw_problem(order, 2, {"p", "s"}, {"q"}) is None  # a rejected one is replaced by the next
    assert draw_problem(order, 9, {"q", "u"}, {"p", "s", "t"}) is None  # fewer than K: every one judged
    skipped = draw_problem(order, 2, {"p", "s"}, set())
    assert skipped is not None and skipped.startswith("q, place 2 of 5 in the draw") and "neither merged" in skipped
    past = draw_problem(order, 2, {"p", "q"}, {"t"})
    assert past is not None and past.startswith("t, place 4 of 5") and "rejected past the 2 accepted" in past
    outside = draw_problem(order, 2, {"p", "x"}, {"q", "s", "t", "u"})
    assert outside is not None and "x was merged but is not in the roster" in outside
    assert draw_problem(order, 9, {"q", "u"}, {"p", "s"}) is not None  # t skipped while fewer than K


# ---- an honest capped run -----------------------------------------------------------------------


def test_a_capped_run_names_a_roster_in_each_record_and_every_round_of_its_window_verifies(capsys):
    where = url()
    c = capped_run(where)
    leave(c)
    head = c.head()
    assert head >= 12
    run_id = c.members["a"].node.run.manifest.run_id
    for r in range(head - 7, head + 1):
        rec = record(c, r)
        ros = roster(c, rec)
        assert rec.roster.key == keys.roster_key(r, rec.roster.sha256)
        assert hashlib.sha256(c.mailbox.get(rec.roster.key)).hexdigest() == rec.roster.sha256
        # Every learner reported (quorum = all five): the roster names them, the record the two drawn.
        assert ros.round == r and ros.learners == NAMES
        drawn = draw_order(run_id, r, NAMES)[:K]
        assert sorted(p.learner for p in rec.participants) == sorted(drawn) and rec.rejected == []
        # The record's size does not grow with the roster: its ids are not inline.
        data = c.mailbox.get(keys.round_key(r))
        assert set(json.loads(data)["roster"]) == {"key", "sha256", "size"}
        assert all(f'"{x}"'.encode() not in data for x in set(NAMES) - set(drawn) - {rec.closer})
    rc, out, err = verify_cli(capsys, where)
    assert rc == 0, out + err
    assert statuses(out) == {r: VERIFIED for r in range(head - 7, head + 1)}
    # Older rounds' rosters went with their snapshot records (kept for the verify window only).
    kept = {keys.parse_blob_key(k).round for k in c.mailbox.list(keys.ROSTERS)}
    assert kept == set(range(head - 7, head + 1))


def test_an_uncapped_run_writes_no_roster():
    c = capped_run(url(), steps=20, cfg=dataclasses.replace(CFG, max_contributions=None))
    leave(c)
    assert c.head() >= 4 and c.mailbox.list(keys.ROSTERS) == []
    assert all(record(c, r).roster is None for r in range(c.head() + 1))
    assert b'"roster"' not in c.mailbox.get(keys.round_key(c.head()))


# ---- a closer that does not take the draw -------------------------------------------------------


def test_verify_names_a_closer_that_merged_others_than_the_draw_takes(capsys, monkeypatch):
    where = url()
    forged = 15
    forge_draw(monkeypatch, forged)
    c = capped_run(where)
    leave(c)
    head = c.head()
    assert head >= forged + 3
    rec = record(c, forged)
    run_id = c.members["a"].node.run.manifest.run_id
    order = draw_order(run_id, forged, NAMES)
    assert roster(c, rec).learners == NAMES  # the roster is honest
    assert sorted(p.learner for p in rec.participants) == sorted(order[-K:])  # the merge is of the highest draws
    rc, out, err = verify_cli(capsys, where)
    assert rc == 1, out + err
    got = statuses(out)
    assert got[forged] == MISMATCH and all(s == VERIFIED for r, s in got.items() if r != forged), out
    assert (
        f"FIRST MISMATCH: round {forged} (fragment 1 version 8), closed by {rec.closer}: not the round's draw: "
        f"{order[0]}, place 1 of 5 in the draw over the roster, was neither merged nor rejected" in out
    )


def test_a_record_rewritten_to_merge_one_outside_the_draw_is_named_for_its_draw(capsys):
    where = url()
    c = capped_run(where)
    leave(c)
    r = c.head() - 2
    rec = record(c, r)
    order = draw_order(c.members["a"].node.run.manifest.run_id, r, NAMES)
    # The second drawn swapped for the last in the draw (its weight and payload kept: the draw is
    # checked before the merge is recomputed, so the draw is what is named).
    participants = [dataclasses.replace(p, learner=order[-1]) if p.learner == order[1] else p for p in rec.participants]
    c.mailbox.delete([keys.round_key(r)])
    c.mailbox.put_if_absent(keys.round_key(r), encode(dataclasses.replace(rec, participants=participants)))
    rc, out, err = verify_cli(capsys, where, "--rounds", str(r))
    assert rc == 1
    assert (
        f"mismatch: not the round's draw: {order[1]}, place 2 of 5 in the draw over the roster, was neither "
        "merged nor rejected while 1 of max_contributions=2 were accepted" in out
    )


def test_a_follower_with_verify_refuses_a_commit_that_is_not_the_draw_and_names_its_closer(monkeypatch):
    forged = 15
    forge_draw(monkeypatch, forged)
    c = capped_run(url(), steps=60, verify=1.0)
    e = c.members["e"]
    assert c.head() >= forged + 2
    rec = record(c, forged)
    (found,) = e.of(ev.ForgedCommit)
    assert (found.round, found.fragment, found.closer) == (forged, 1, rec.closer)
    assert "not the round's draw" in found.reason and found.evidence is None  # (an open run: nothing signed)
    assert {x.round for x in e.of(ev.RoundVerified)} >= set(range(forged)) - {
        r for r in range(forged) if record(c, r).closer == "e"
    }
    assert forged in {x.round for x in e.of(ev.CommitRefused)}
    assert not c.members["b"].of(ev.ForgedCommit)  # (a node that does not verify applies it)
    leave(c)


# ---- the roster itself ----------------------------------------------------------------------------


def test_a_roster_replaced_in_the_store_or_gone_makes_its_round_unverifiable_naming_it(capsys):
    where = url()
    c = capped_run(where)
    leave(c)
    head = c.head()
    tampered, gone = record(c, head - 1), record(c, head - 3)
    fake = encode(Roster(round=head - 1, learners=["a", "b"]))
    c.mailbox.delete([tampered.roster.key, gone.roster.key])
    c.mailbox.put_if_absent(tampered.roster.key, fake)
    rc, out, err = verify_cli(capsys, where)
    assert rc == 0, out + err  # (what the store holds proves nothing against the closer)
    got = statuses(out)
    assert got[head - 1] == got[head - 3] == UNVERIFIABLE
    assert [r for r, s in got.items() if s != VERIFIED] == [head - 3, head - 1]
    lines = {int(x.split()[1]): x for x in out.splitlines() if x.startswith("round ")}
    assert f"its roster {tampered.roster.key} holds {len(fake)} bytes that do not hash" in lines[head - 1]
    assert f"its roster {gone.roster.key} is gone; inside the run's verify window" in lines[head - 3]


def test_a_capped_record_without_a_roster_or_with_another_rounds_is_a_mismatch(capsys):
    where = url()
    c = capped_run(where)
    leave(c)
    head = c.head()
    bare, other = record(c, head - 1), record(c, head)
    for rec in (dataclasses.replace(bare, roster=None), dataclasses.replace(other, roster=bare.roster)):
        c.mailbox.delete([keys.round_key(rec.round)])
        c.mailbox.put_if_absent(keys.round_key(rec.round), encode(rec))
    rc, out, err = verify_cli(capsys, where, "--rounds", f"{head - 1}:")
    assert rc == 1
    lines = out.splitlines()
    assert f"round {head - 1} merges at most max_contributions=2 but its record names no roster" in lines[0]
    assert f"names {bare.roster.key} as its roster, which is not round {head}'s roster key" in lines[1]


def test_a_draw_not_taken_in_a_secret_run_is_named_with_the_mac_that_proves_it(monkeypatch):
    secret = "s" * 32
    forged = 4
    forge_draw(monkeypatch, forged)
    cfg = gm.DiLoCo(sync_every=2, fragments=2, in_flight=1, quorum_size=3, max_contributions=1)
    sim = SimRun(cfg, secret=secret)
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((4, 3)).astype(np.float32)}
    for name in "abc":
        sim.join(name, {k: v.copy() for k, v in params.items()})
    sim.see_each_other()
    sim.members = {n: sim.members[n] for n in "bca"}  # the closer ticks last: it lists all three
    _steps(sim, 16)
    auth = policy(secret)
    guard = GuardedMailbox(sim.mailbox, auth=auth)
    v, head = verifier(guard, auth=auth)
    assert head > forged
    checks = {r: v.check_round(r) for r in range(head + 1)}
    v.close()
    # (the record is tagged and MAC'd: the roster, outside the record folders, is neither)
    assert sim.mailbox.list(keys.ROSTERS) and all(c.status == VERIFIED for r, c in checks.items() if r != forged)
    rec = RunStore(guard, auth=auth).read_record(keys.round_key(forged), RoundRecord)
    assert rec.mac is not None and decode(sim.mailbox.get(rec.roster.key), Roster).learners == ["a", "b", "c"]
    check = checks[forged]
    assert check.status == MISMATCH and check.reason.startswith("not the round's draw: ")
    assert "MAC verifies under the run secret" in (check.evidence or "")


def test_an_outlier_among_the_drawn_counts_toward_k_and_its_rounds_verify():
    # One learner's deltas are 50 times the others': drawn, it is accepted and then rejected as an
    # outlier, which leaves its place taken (the next in the draw is not read).
    cfg = gm.DiLoCo(sync_every=2, fragments=2, in_flight=1, quorum_size=4, max_contributions=2, outlier_factor=3.0)
    sim = SimRun(cfg)
    rng = np.random.default_rng(2)
    params = {"w": rng.standard_normal((4, 3)).astype(np.float32)}
    for name in "abcd":
        copy = {k: v.copy() for k, v in params.items()}
        sim.join(name, copy, PoisonAdapter(copy, 50.0) if name == "d" else None)
    sim.see_each_other()
    sim.members = {n: sim.members[n] for n in "bcda"}  # the closer ticks last: it lists all four
    _steps(sim, 24)
    v, head = verifier(sim.mailbox)
    checks = {r: v.check_round(r) for r in range(head - 7, head + 1)}
    v.close()
    recs = {r: decode(sim.mailbox.get(keys.round_key(r)), RoundRecord) for r in checks}
    outliers = [r for r, rec in recs.items() if any(x.reason == "outlier" for x in rec.rejected)]
    assert outliers and all(len(recs[r].participants) == 1 for r in outliers)
    assert all(c.status == VERIFIED for c in checks.values()), {r: c.reason for r, c in checks.items()}
