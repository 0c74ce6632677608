"""Verifying commits (issue 28): ``gradientmail verify`` recomputes rounds from their recorded
inputs, garbage collection keeps those inputs for the run's window, and followers with
``verify=`` refuse a forged commit. Deterministic single-threaded runs (``harness.Cluster``,
``adversary_sim.SimRun``); the real-process runs across torch and MLX are
``tests/test_verify_processes.py``.

A forging closer (``forgery.forge``) adds a small perturbation to the new master before it writes
its payloads, so its record is consistent with what it wrote: only recomputing the merge tells.
"""

from __future__ import annotations

import dataclasses
import json
import secrets

import numpy as np
import pytest
from adversary_sim import SimRun
from forgery import forge
from harness import Cluster, Member

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.cli import main
from gradientmail_core.mailbox import Mailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.auth import policy
from gradientmail_core.protocol.guard import GuardedMailbox
from gradientmail_core.protocol.identity import Identity
from gradientmail_core.protocol.members import MemberAuth, change
from gradientmail_core.protocol.records import Manifest, RoundRecord, Snapshot, chunk_refs, decode, encode
from gradientmail_core.protocol.run import RunInfo, read_manifest
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.options import NodeOptions
from gradientmail_core.syncer.verify import MISMATCH, UNVERIFIABLE, VERIFIED, RoundVerifier

CFG = gm.DiLoCo(sync_every=4, fragments=2)


def url() -> str:
    return f"memory://verify-{secrets.token_hex(6)}"


def finished(cfg: gm.DiLoCo, where: str, *, steps: int = 40, forged=None, names: str = "ab") -> Cluster:
    """A run of ``names`` over ``where`` that every node has left; ``a`` created it and closes
    its rounds (forging those ``forged`` names)."""
    c = Cluster(cfg, mailbox=gm.open_mailbox(where))
    ms = c.join_all(names)
    if forged is not None:
        forge(ms[0].node.merger, forged)
    c.run(steps)
    c.settle(20)
    for m in list(c.live()):
        c.close(m)
    return c


def verify_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["verify", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def statuses(out: str) -> dict[int, str]:
    """``{round: status}`` from ``gradientmail verify``'s table (a span ``rounds A-B`` of collected
    rounds stands for each of them)."""
    found = {}
    for line in out.splitlines():
        if line.startswith("round "):
            parts = line.split()
            found[int(parts[1])] = next(s for s in (VERIFIED, MISMATCH, UNVERIFIABLE) if f"  {s}" in line)
        elif line.startswith("rounds ") and "  unverifiable: older than" in line:
            lo, hi = map(int, line.split()[1].split("-"))
            found.update(dict.fromkeys(range(lo, hi + 1), UNVERIFIABLE))
    return found


def verifier(mailbox: Mailbox, auth=None) -> tuple[RoundVerifier, int]:
    store = RunStore(mailbox, auth=auth)
    run = RunInfo.from_manifest(read_manifest(store))
    rounds = [r for k in mailbox.list(keys.ROUNDS) if (r := keys.parse_round_key(k)) is not None]
    return RoundVerifier(store, run), rounds[-1]


# ---- gradientmail verify ------------------------------------------------------------------------


def test_an_honest_finished_run_verifies_every_round_of_its_window(capsys):
    where = url()
    c = finished(CFG, where)
    head = c.head()
    assert head >= 12
    rc, out, err = verify_cli(capsys, where)
    assert rc == 0, err
    assert statuses(out) == {r: VERIFIED for r in range(head - 7, head + 1)}  # the default window: 8
    assert "8 verified, 0 mismatch, 0 unverifiable" in out
    # Older rounds' inputs were collected: unverifiable, with the reason, and no failure.
    rc, out, err = verify_cli(capsys, where, "--rounds", "0:")
    assert rc == 0, err
    got = statuses(out)
    assert got == {r: UNVERIFIABLE if r <= head - 8 else VERIFIED for r in range(head + 1)}
    span = next(x for x in out.splitlines() if x.startswith("rounds 0-"))  # said once for them all
    assert span.startswith(f"rounds 0-{head - 8}  ") and "older than the run's verify window" in span


def test_verify_names_the_first_forged_round_and_its_closer_and_fails(capsys):
    where = url()
    c = finished(CFG, where, forged=lambda r: r in (15, 17))
    head = c.head()
    assert head >= 18
    rc, out, err = verify_cli(capsys, where)
    assert rc == 1, out + err
    got = statuses(out)
    assert [r for r, s in got.items() if s == MISMATCH] == [15, 17]
    assert all(s == VERIFIED for r, s in got.items() if r not in (15, 17))  # later rounds build on what was committed
    assert (
        "FIRST MISMATCH: round 15 (fragment 1 version 8), closed by a: recomputing the merge gives another theta" in out
    )
    rc, out, err = verify_cli(capsys, where, "--json", "--rounds", "14:16")
    assert rc == 1
    lines = [json.loads(x) for x in out.splitlines()]
    assert [(x["round"], x["status"], x["closer"]) for x in lines[:-1]] == [
        (14, VERIFIED, "a"),
        (15, MISMATCH, "a"),
        (16, VERIFIED, "a"),
    ]
    summary = lines[-1]["summary"]
    assert (summary["verified"], summary["mismatch"], summary["first_mismatch"]["round"]) == (2, 1, 15)
    assert all(x["bytes_read"] > 0 and x["cpu_seconds"] >= 0 for x in lines[:-1])


def test_a_forged_newest_round_of_a_finished_run_is_caught(capsys):
    where = url()
    c = Cluster(CFG, mailbox=gm.open_mailbox(where))
    a, b = c.join_all("ab")
    c.run(30)
    c.settle(10)
    newest = c.head() + 1
    forge(a.node.merger, lambda r: r == newest)
    while c.head() < newest:  # train until the forged round commits, then everyone leaves
        c.run(1)
    for m in list(c.live()):
        c.close(m)
    assert c.head() == newest
    rc, out, err = verify_cli(capsys, where)
    assert rc == 1
    got = statuses(out)
    assert got[newest] == MISMATCH and all(s == VERIFIED for r, s in got.items() if r != newest)
    assert f"FIRST MISMATCH: round {newest} " in out and "closed by a" in out


@pytest.mark.parametrize("chunked", [False, True])
def test_rounds_between_checkpoints_verify_and_a_forged_one_is_caught(capsys, chunked):
    cfg = dataclasses.replace(
        CFG, commit_dtype="F4", checkpoint_every=3, quorum_size=2, chunk_elements=32 if chunked else None
    )
    where = url()
    forged = 14  # fragment 0, version 8: between the checkpoints of versions 6 and 9
    c = finished(cfg, where, forged=lambda r: r == forged)
    head = c.head()
    recs = {r: decode(c.mailbox.get(keys.round_key(r)), RoundRecord) for r in range(head + 1)}
    assert head >= 18 and not recs[forged].is_checkpoint  # only its change and digests are written
    assert (len(chunk_refs(recs[head].change)) > 1) == chunked
    rc, out, err = verify_cli(capsys, where)
    assert rc == 1, err
    got = statuses(out)
    assert got[forged] == MISMATCH
    for r, s in got.items():
        if r == forged:
            continue
        # A later round of fragment 0 whose state is replayed through the forged round cannot be
        # rebuilt (until a checkpoint names the state again); every other round verifies.
        through = r > forged and r % 2 == 0 and not any(recs[q].is_checkpoint for q in range(forged + 2, r, 2))
        assert s == (UNVERIFIABLE if through else VERIFIED), (r, out)


def test_inputs_that_contradict_their_record_are_a_mismatch(capsys):
    where = url()
    c = finished(CFG, where)
    head = c.head()
    mb = c.mailbox

    def rewrite(key: str, **fields) -> None:
        rec = decode(mb.get(key), Snapshot if key.startswith(keys.SNAPSHOTS) else RoundRecord, key=key)
        mb.delete([key])
        mb.put_if_absent(key, encode(dataclasses.replace(rec, **fields)))

    rec = decode(mb.get(keys.round_key(head)), RoundRecord)
    p = rec.participants[0]
    rewrite(keys.round_key(head), participants=[dataclasses.replace(p, weight=p.weight * 2), *rec.participants[1:]])
    other = rec.participants[0].learner
    snap_key = keys.snapshot_key(head - 1, other)
    rewrite(snap_key, tokens=decode(mb.get(snap_key), Snapshot).tokens + 1)
    rc, out, err = verify_cli(capsys, where, "--rounds", f"{head - 1}:{head}")
    assert rc == 1
    lines = out.splitlines()
    assert "mismatch" in lines[0] and f"{other}'s snapshot record of round {head - 1} does not name" in lines[0]
    assert "mismatch" in lines[1] and f"{p.learner}'s weight" in lines[1]


def test_an_input_gone_makes_a_round_unverifiable_not_a_mismatch(capsys):
    where = url()
    c = finished(CFG, where)
    head = c.head()
    rec = decode(c.mailbox.get(keys.round_key(head - 2)), RoundRecord)
    snap = decode(c.mailbox.get(keys.snapshot_key(head - 2, rec.participants[0].learner)), Snapshot)
    c.mailbox.delete([snap.payload.key])
    rc, out, err = verify_cli(capsys, where)
    assert rc == 0, err
    got = statuses(out)
    assert got[head - 2] == UNVERIFIABLE and list(got.values()).count(VERIFIED) == 7
    assert snap.payload.key in out and "is gone" in out


def test_verify_refuses_bad_arguments_and_a_missing_run(capsys, tmp_path):
    for bad in (["--rounds", "5:2"], ["--rounds", "x"], ["--sample", "0"], ["--sample", "1.5"]):
        with pytest.raises(SystemExit) as e:
            main(["verify", url(), *bad])
        assert e.value.code == 2
    capsys.readouterr()
    rc, out, err = verify_cli(capsys, f"file://{tmp_path / 'none'}")
    assert rc == 2 and "no run at" in err


def test_a_sample_verifies_that_share_of_the_rounds(capsys):
    where = url()
    finished(CFG, where)
    rc, out, err = verify_cli(capsys, where, "--rounds", "0:", "--sample", "0.5", "--seed", "3")
    assert rc == 0
    n = len(statuses(out))
    rc, again, _ = verify_cli(capsys, where, "--rounds", "0:", "--sample", "0.5", "--seed", "3")
    assert statuses(again) == statuses(out) and 0 < n < 20  # a seeded draw of about half of 20


# ---- garbage collection keeps the window --------------------------------------------------------


@pytest.mark.parametrize("window", [8, 3])
def test_gc_keeps_the_inputs_of_the_newest_rounds_and_no_more(window):
    c = finished(dataclasses.replace(CFG, verify_window=window), url(), steps=60)
    head, P = c.head(), 2
    mb = c.mailbox
    snapshot_rounds = {keys.parse_snapshot_key(k)[0] for k in mb.list(keys.SNAPSHOTS)}
    blob_rounds = {keys.parse_blob_key(k).round for k in mb.list(keys.SNAPSHOT_BLOBS)}
    state_rounds = {keys.parse_blob_key(k).round for k in mb.list(keys.ROUND_BLOBS)}
    window_rounds = set(range(head - window + 1, head + 1))
    assert snapshot_rounds == blob_rounds == window_rounds
    assert state_rounds == set(range(head - max(window + P, 2 * P) + 1, head + 1))
    v, _ = verifier(mb)
    assert [v.check_round(r).status for r in sorted(window_rounds)] == [VERIFIED] * window


def test_a_window_of_zero_keeps_what_it_kept_before_and_verifies_nothing():
    c = finished(dataclasses.replace(CFG, verify_window=0), url())
    assert c.mailbox.list(keys.SNAPSHOTS) == [] and c.mailbox.list(keys.SNAPSHOT_BLOBS) == []
    v, head = verifier(c.mailbox)
    check = v.check_round(head)
    assert check.status == UNVERIFIABLE and "snapshot record" in check.reason


def test_verify_window_is_a_validated_run_option_left_out_of_the_manifest_by_default():
    with pytest.raises(ValueError, match="verify_window=-1"):
        gm.DiLoCo(sync_every=4, fragments=2, verify_window=-1)
    assert "verify_window" not in CFG.to_dict()
    assert gm.DiLoCo.from_dict(CFG.to_dict()).verify_window == 8
    mine = dataclasses.replace(CFG, verify_window=16)
    assert mine.to_dict()["verify_window"] == 16
    with pytest.raises(gm.RunConfigMismatch, match="verify_window"):
        mine.check_matches(CFG.to_dict())


# ---- followers that verify ----------------------------------------------------------------------


def applied(m: Member) -> set[int]:
    return {e.round for e in m.of(ev.Aligned)}


def test_a_follower_with_verify_never_applies_a_forged_commit_and_reports_it_in_its_round():
    c = Cluster(CFG)
    a = c.join("a")
    b = c.join("b", verify=1.0)
    control = c.join("c")  # verify=0: applies whatever is committed
    for m in c.live():
        m.node.state.list_leases(m.node.store)
    forge(a.node.merger, lambda r: r == 9)
    c.run(60)
    c.settle(20)
    assert c.head() >= 14
    (forged,) = b.of(ev.ForgedCommit)
    assert (forged.round, forged.fragment, forged.closer) == (9, 1, "a")
    assert "another theta" in forged.reason and forged.evidence is None  # (an open run: nothing signed)
    refused = [e.round for e in b.of(ev.CommitRefused)]
    assert refused == list(range(9, c.head() + 1))  # that round, then every later commit of its closer
    assert {e.round for e in b.of(ev.RoundVerified)} == set(range(0, 9))  # each one before it, recomputed
    assert max(applied(b)) == 8 and 9 in applied(control)
    # The forged parameters never reached b's model (it holds fragment 1 as committed before them);
    # the control's model took them.
    rec = decode(c.mailbox.get(keys.round_key(9)), RoundRecord)
    assert b.learner.versions[1] == rec.version - 1 and b.node.state.thetas[1][0] == rec.version - 1
    assert control.learner.versions[1] >= rec.version
    assert not control.of(ev.ForgedCommit) and not a.of(ev.ForgedCommit)


def test_verified_commits_are_the_parameters_a_node_would_have_downloaded():
    """A follower that verifies every round ends where one that does not ends: the recomputed
    parameters it applies are the committed ones, bit for bit; and it downloads less."""
    runs = {}
    for fraction in (0.0, 1.0):
        c = Cluster(CFG)
        a = c.join("a")
        b = c.join("b", verify=fraction)
        for m in c.live():
            m.node.state.list_leases(m.node.store)
        c.run(40)
        c.settle(20)
        runs[fraction] = (c, a, b)
    (c0, _, b0), (c1, _, b1) = runs[0.0], runs[1.0]
    assert c0.head() == c1.head() and len(b1.of(ev.RoundVerified)) == c1.head() + 1
    for f in range(2):
        for n, v in b0.learner.anchors[f].items():
            assert np.array_equal(v, b1.learner.anchors[f][n]), n
    assert not b0.of(ev.RoundVerified)


def test_the_rounds_a_node_verifies_are_drawn_at_random_per_node():
    c = Cluster(dataclasses.replace(CFG, quorum_size=3))
    c.join("a")
    b = c.join("b", verify=0.5)
    d = c.join("d", verify=0.5)
    for m in c.live():
        m.node.state.list_leases(m.node.store)
    c.run(80)
    c.settle(20)
    seen_b = {e.round for e in b.of(ev.RoundVerified)}
    seen_d = {e.round for e in d.of(ev.RoundVerified)}
    n = c.head() + 1
    assert n >= 30 and 0.25 * n < len(seen_b) < 0.75 * n and 0.25 * n < len(seen_d) < 0.75 * n
    assert seen_b != seen_d


def test_verify_must_be_a_fraction():
    for bad in (-0.1, 1.5, True, "all"):
        with pytest.raises(ValueError, match="verify="):
            NodeOptions(verify=bad)
    with pytest.raises(ValueError, match="verify="):
        gm.Session(object.__new__(_Model), algorithm=CFG, mailbox=gm.MemoryMailbox(), verify=2.0, callbacks=())


class _Model:
    """(never built: the options are refused before the model is looked at)"""


# ---- authenticated runs: the evidence -----------------------------------------------------------

IDS = {n: Identity.from_seed(bytes([i + 11]) * 32) for i, n in enumerate("ab")}


def _steps(sim: SimRun, n: int) -> None:
    for _ in range(n):
        for m in sim.members.values():
            for v in m.params.values():
                v -= np.float32(0.1) * (v - np.float32(2.0))
            m.learner.step(4)
        sim.tick_all()


def test_a_mismatch_in_a_members_only_run_names_the_signed_record_that_proves_it():
    sim = SimRun(gm.DiLoCo(sync_every=2, fragments=2, in_flight=1, quorum_size=2))
    a_id, b_id = IDS["a"].learner_id("a"), IDS["b"].learner_id("b")
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    a = sim.join(a_id, params, auth=MemberAuth(identity=IDS["a"]))
    manifest = a.store.read_record(keys.MANIFEST, Manifest)
    change(sim.mailbox, manifest, IDS["a"], add=[IDS["b"].public_hex])
    sim.join(b_id, {k: v.copy() for k, v in params.items()}, auth=MemberAuth(identity=IDS["b"]))
    sim.see_each_other()
    forge(a.node.merger, lambda r: r == 3)
    _steps(sim, 16)
    reader = MemberAuth()  # a read-only tool: no identity, checks every signature
    guard = GuardedMailbox(sim.mailbox, auth=reader)
    RunStore(guard, auth=reader).read_record(keys.MANIFEST, Manifest)
    v, head = verifier(guard, auth=reader)
    assert head >= 5
    checks = {r: v.check_round(r) for r in range(head + 1)}
    assert {r for r, x in checks.items() if x.status == MISMATCH} == {3}
    assert checks[3].closer == a_id
    assert checks[3].evidence == f"rounds/0000000003.json, signed by {a_id}'s Ed25519 key {IDS['a'].public_hex}"
    assert all(x.status == VERIFIED for r, x in checks.items() if r != 3)


def test_a_mismatch_in_a_secret_run_names_its_mac(capsys, tmp_path):
    secret = "s" * 32
    sim = SimRun(gm.DiLoCo(sync_every=2, fragments=2, in_flight=1, quorum_size=2), secret=secret)
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((4, 3)).astype(np.float32)}
    a = sim.join("a", params)
    sim.join("b", {k: v.copy() for k, v in params.items()})
    sim.see_each_other()
    forge(a.node.merger, lambda r: r == 4)
    _steps(sim, 16)
    auth = policy(secret)
    guard = GuardedMailbox(sim.mailbox, auth=auth)
    RunStore(guard, auth=auth).read_record(keys.MANIFEST, Manifest)
    v, _ = verifier(guard, auth=auth)
    check = v.check_round(4)
    assert check.status == MISMATCH and "MAC verifies under the run secret" in (check.evidence or "")


# ---- the read-only commands check records in authenticated runs ---------------------------------


def test_read_only_commands_name_a_record_that_fails_its_mac_and_skip_it(capsys, tmp_path):
    where = url()
    secret = "r" * 32
    sim = SimRun(
        gm.DiLoCo(sync_every=2, fragments=2, in_flight=1, quorum_size=2), secret=secret, mailbox=gm.open_mailbox(where)
    )
    rng = np.random.default_rng(2)
    params = {"w": rng.standard_normal((4, 3)).astype(np.float32)}
    sim.join("a", params)
    sim.join("b", {k: v.copy() for k, v in params.items()})
    sim.see_each_other()
    _steps(sim, 12)
    secret_file = tmp_path / "run.key"
    secret_file.write_text(secret)
    # Someone with write access replaces round 2's record (at its tagged name) with an altered copy.
    raw = sim.mailbox
    (physical,) = [k for k in raw.list(keys.ROUNDS) if keys.untag_key(k)[0] == keys.round_key(2)]
    altered = json.loads(raw.get(physical))
    altered["cosine"] = 0.5
    raw.delete([physical])
    raw.put_if_absent(physical, json.dumps(altered, sort_keys=True, separators=(",", ":")).encode())
    rc = main(["rounds", where, "--secret-file", str(secret_file), "--json"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert 2 not in [json.loads(x)["round"] for x in out.splitlines()] and len(out.splitlines()) >= 4
    assert "rounds/0000000002.json fails its check, ignored: rounds/0000000002.json: MAC does not verify" in err
    rc = main(["status", where, "--secret-file", str(secret_file), "--last", "8"])
    out, err = capsys.readouterr()
    assert rc == 0 and "rounds/0000000002.json fails its check, ignored" in " ".join(out.split())
    rc = main(["verify", where, "--secret-file", str(secret_file), "--rounds", "2"])
    out, err = capsys.readouterr()
    assert rc == 1 and "the record is not a commit" in out
    # The newest record altered too: export writes the newest commit of that fragment that passes.
    head = max(keys.parse_round_key(keys.untag_key(k)[0]) for k in raw.list(keys.ROUNDS))
    (newest,) = [k for k in raw.list(keys.ROUNDS) if keys.untag_key(k)[0] == keys.round_key(head)]
    altered = json.loads(raw.get(newest))
    altered["live"] += 1
    raw.delete([newest])
    raw.put_if_absent(newest, json.dumps(altered, sort_keys=True, separators=(",", ":")).encode())
    rc = main(["export", where, "--secret-file", str(secret_file), "-o", str(tmp_path / "m.safetensors")])
    out, err = capsys.readouterr()
    assert rc == 0 and f"wrote {tmp_path / 'm.safetensors'}: parameters after round {head - 1}," in out
    assert f"{keys.round_key(head)} fails its check, ignored" in err
    # Without the secret, the commands refuse the run rather than show what they cannot check.
    rc = main(["rounds", where])
    assert rc == 2 and "pass --secret-file" in capsys.readouterr().err


def test_status_in_a_members_only_run_names_a_lease_whose_signature_fails(capsys):
    where = url()
    sim = SimRun(gm.DiLoCo(sync_every=2, fragments=2, in_flight=1, quorum_size=2), mailbox=gm.open_mailbox(where))
    a_id = IDS["a"].learner_id("a")
    rng = np.random.default_rng(3)
    sim.join(a_id, {"w": rng.standard_normal((4, 3)).astype(np.float32)}, auth=MemberAuth(identity=IDS["a"]))
    _steps(sim, 4)
    (lease_key,) = [k for k in sim.mailbox.list(keys.LEASES) if k.startswith(keys.lease_prefix(a_id))]
    lease = json.loads(sim.mailbox.get(lease_key))
    lease["local_step"] += 1000  # altered after it was signed
    sim.mailbox.delete([lease_key])
    sim.mailbox.put_if_absent(lease_key, json.dumps(lease, sort_keys=True, separators=(",", ":")).encode())
    rc = main(["status", where])
    out, err = capsys.readouterr()
    assert rc == 0, err
    text = " ".join(out.split())
    assert f"{lease_key} fails its check, ignored" in text and "does not verify" in text
    assert "unreadable" in text
