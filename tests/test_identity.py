"""Per-node identities and members-only runs (protocol/identity.py, protocol/members.py).

Key files, signed records bound to run/kind/key, the membership log, and deterministic runs
(FakeClock, ``adversary_sim.SimRun``) in which a revoked member keeps writing, a node copies a
member's public key, and records are replayed from another run or round.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from adversary_sim import SimRun

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.errors import MissingExtra, RecordInvalid
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import identity as ids
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.auth import Unauthenticated
from gradientmail_core.protocol.guard import GuardedMailbox
from gradientmail_core.protocol.identity import Identity
from gradientmail_core.protocol.members import (
    MemberAuth,
    NotAMember,
    SignatureInvalid,
    change,
    read_log,
    sign_record,
)
from gradientmail_core.protocol.records import (
    Manifest,
    PayloadRef,
    RoundRecord,
    Snapshot,
    TensorSpec,
    decode,
    encode,
)
from gradientmail_core.protocol.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
CFG = gm.DiLoCo(sync_every=2, fragments=2, in_flight=1, quorum_size=3)
NAMES = "abck"
IDS = {n: Identity.from_seed(bytes([i + 1]) * 32) for i, n in enumerate(NAMES)}


def params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}


def train_step(m) -> int:
    """Each learner pulls towards its own target, so every contribution shows in the result."""
    target = np.float32(1 + NAMES.index(m.name[0]) if m.name[0] in NAMES else 9)
    for v in m.params.values():
        v -= np.float32(0.1) * (v - target)
    return 4


def manifest_of(sim: SimRun) -> Manifest:
    m = next(iter(sim.members.values()))
    rec = m.store.read_record(keys.MANIFEST, Manifest)
    assert rec is not None
    return rec


def members_run(names: str = NAMES, *, secret: bytes | None = None) -> tuple[SimRun, dict[str, MemberAuth]]:
    """A members-only run: ``a`` creates it (and owns it), the others are added, all join."""
    sim = SimRun(CFG, secret=secret)
    auths: dict[str, MemberAuth] = {}

    def auth(n: str) -> MemberAuth:
        from gradientmail_core.protocol.auth import policy

        auths[n] = MemberAuth(policy(secret), identity=IDS[n])
        return auths[n]

    sim.join(IDS[names[0]].learner_id(names[0]), params(0), auth=auth(names[0]))
    change(sim.mailbox, manifest_of(sim), IDS[names[0]], add=[IDS[n].public_hex for n in names[1:]])
    for i, n in enumerate(names[1:]):
        sim.join(IDS[n].learner_id(n), params(i + 1), auth=auth(n))
    sim.see_each_other()
    return sim, auths


def tape(sim: SimRun) -> list[RoundRecord]:
    store = next(iter(sim.members.values())).store
    out = []
    for k in store.keys(keys.ROUNDS):
        rec = store.read_record(k, RoundRecord)
        assert rec is not None
        out.append(rec)
    return out


def final(sim: SimRun, names: str) -> dict[str, dict[str, np.ndarray]]:
    """The parameters each learner leaves with (the newest commit, as ``Session.close`` loads)."""
    for m in sim.members.values():
        m.learner.drain()
        m.learner.write_newest()
    return {n: sim.members[IDS[n].learner_id(n)].params for n in names}


def same(p: dict[str, np.ndarray], q: dict[str, np.ndarray]) -> bool:
    return p.keys() == q.keys() and all(np.array_equal(p[k], q[k]) for k in p)


# ---- key files --------------------------------------------------------------------------------


def test_a_key_file_is_created_once_private_and_reloaded(tmp_path):
    path = tmp_path / "node.key"
    a = Identity.load(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    b = Identity.load(path)
    assert a.public_hex == b.public_hex and ids.PUBKEY.fullmatch(a.public_hex)
    assert not [p for p in tmp_path.iterdir() if p.name != "node.key"]  # no temporary file left
    assert "PRIVATE" not in repr(a) and a.fingerprint in repr(a)


def test_a_raw_hex_seed_is_a_key_file_too(tmp_path):
    path = tmp_path / "seed.key"
    path.write_text("11" * 32 + "\n")
    path.chmod(0o600)
    assert Identity.load(path).public_hex == Identity.from_seed(b"\x11" * 32).public_hex


@pytest.mark.parametrize(
    "content, mode, match",
    [
        (b"not a key", 0o600, "is not an Ed25519 private key"),
        (b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", 0o600, "is not an Ed25519 private key"),
        (None, 0o644, "readable by others"),
        (b"x" * 20000, 0o600, "not a key file"),
    ],
)
def test_a_bad_key_file_is_refused_with_a_clear_error(tmp_path, content, mode, match):
    path = tmp_path / "bad.key"
    path.write_bytes(Identity.generate().pem() if content is None else content)
    path.chmod(mode)
    with pytest.raises(ValueError, match=match) as e:
        Identity.load(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("kind", ["rsa", "ec"])
def test_an_rsa_or_ec_key_is_refused(tmp_path, kind):
    # A PEM PKCS#8 private key that parses, of another algorithm: refused by its type, by name.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    key = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if kind == "rsa"
        else ec.generate_private_key(ec.SECP256R1())
    )
    path = tmp_path / f"{kind}.key"
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)
    held = "RSAPrivateKey" if kind == "rsa" else "ECPrivateKey"
    with pytest.raises(ValueError, match=f"holds a {held}, not an Ed25519 private key"):
        Identity.load(path)


def test_a_key_file_in_a_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Identity.load(tmp_path / "nope" / "node.key")


def test_without_cryptography_an_identity_raises_missing_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.asymmetric", None)
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.asymmetric.ed25519", None)
    with pytest.raises(MissingExtra, match="identity"):
        Identity.generate()


def test_importing_the_core_does_not_import_cryptography():
    code = "import sys, gradientmail_core as gm\ngm.Session\nprint('cryptography' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_learner_ids_carry_the_fingerprint():
    me = IDS["a"]
    assert me.learner_id("a") == f"a-{me.fingerprint}"
    assert me.learner_id(me.learner_id("a")) == me.learner_id("a")
    long = me.learner_id("x" * 64)
    assert len(long) == 64 and ids.names_key(long, me.public_hex)
    assert not ids.names_key(long, IDS["b"].public_hex)


# ---- signed records ---------------------------------------------------------------------------


def test_records_of_an_open_run_keep_their_bytes():
    snap = Snapshot(learner="a", round=1, local_step=1, steps=1, tokens=1, base_version=0, step_seconds=0.1,
                    schema_digest="ab" * 32, payload=PayloadRef(key="blobs/x", sha256="ab" * 32, size=1))  # fmt: skip
    data = encode(snap)
    assert b"signer" not in data and b"sig" not in data and b"owner" not in data
    assert decode(data, Snapshot) == snap


def test_a_members_run_signs_every_record_and_names_its_membership():
    sim, _ = members_run()
    for r in range(4):
        sim.train(train_step, 1)
        sim.sync(r)
    recs = tape(sim)
    assert [r.round for r in recs] == [0, 1, 2, 3]
    assert all(r.signer and r.sig and r.members for r in recs)
    assert all(len(r.participants) >= CFG.quorum_size for r in recs)
    man = manifest_of(sim)
    assert man.owner == IDS["a"].public_hex and man.signer == IDS["a"].public_hex
    log = read_log(sim.mailbox, man)
    assert log.head is not None and log.head.seq == 1
    assert log.current()[0] == {IDS[n].public_hex for n in NAMES}
    ps = final(sim, NAMES)
    assert all(same(ps["a"], ps[n]) for n in NAMES)
    assert not [e for m in sim.members.values() for e in m.of(ev.IgnoredObject)]


def test_a_members_run_with_a_secret_too():
    sim, _ = members_run(secret=b"0123456789abcdef-test-secret")
    for r in range(3):
        sim.train(train_step, 1)
        sim.sync(r)
    assert all(r.signer and r.mac for r in tape(sim))


def test_a_node_without_an_identity_or_membership_is_refused():
    sim, _ = members_run("ab")
    with pytest.raises(RecordInvalid, match="admits members only"):
        sim.join("plain", params(5))
    with pytest.raises(NotAMember, match="gradientmail members add"):
        sim.join(IDS["c"].learner_id("c"), params(5), auth=MemberAuth(identity=IDS["c"]))


def test_a_node_with_an_identity_joins_an_open_run():
    sim = SimRun(CFG)
    sim.join("a", params(0))
    sim.join("b", params(1))
    sim.join(IDS["c"].learner_id("c"), params(2), auth=MemberAuth(identity=IDS["c"]))
    sim.see_each_other()
    for r in range(3):
        sim.train(train_step, 1)
        sim.sync(r)
    assert len(tape(sim)) == 3


# ---- revocation: the revoked node keeps writing ---------------------------------------------------

REVOKE_AT = 3
ROUNDS = 8


def revocation_run(*, keeps_writing: bool) -> SimRun:
    """4 members, ``k`` leaves the run at round ``REVOKE_AT``: revoked while it keeps writing (it never
    reads the log again, so it believes it is a member), or simply stopped there."""
    sim, auths = members_run()
    k = IDS["k"].learner_id("k")
    honest = {IDS[n].learner_id(n) for n in "abc"}
    for r in range(ROUNDS):
        if r == REVOKE_AT:
            if keeps_writing:
                auths["k"].refresh = lambda: None  # never reads the log again
                change(sim.mailbox, manifest_of(sim), IDS["a"], remove=[IDS["k"].public_hex])
                sim.see_each_other()  # every honest node lists the leases, so reads the log
            else:
                stopped = sim.members.pop(k)
                stopped.node.lease.release()
        sim.train(train_step, 1)
        sim.sync(r, waiting=lambda m: m.name in honest)
    return sim


def test_a_revoked_member_that_keeps_writing_changes_nothing():
    revoked = revocation_run(keeps_writing=True)
    stopped = revocation_run(keeps_writing=False)
    a, b = final(revoked, "abc"), final(stopped, "abc")
    for n in "abc":
        assert same(a[n], b[n]), n  # bit-identical to the run where it stopped at the revocation round
        assert same(a[n], a["a"])
    k = IDS["k"].learner_id("k")
    recs = tape(revoked)
    assert [r.round for r in recs] == list(range(ROUNDS))
    assert all(k in {p.learner for p in r.participants} for r in recs[:REVOKE_AT])
    assert not any(k in {p.learner for p in r.participants} | {x.learner for x in r.rejected} for r in recs[REVOKE_AT:])
    assert all(r.closer != k for r in recs)
    assert int(recs[REVOKE_AT].members[:10]) == 2 and int(recs[REVOKE_AT - 1].members[:10]) == 1
    # it did keep writing: snapshots and leases after the revocation, each reported once as ignored
    node_k = revoked.members[k]
    assert node_k.node.state.stats.published > REVOKE_AT and node_k.node.lease.seq > 0
    ignored = [e for n in "abc" for e in revoked.members[IDS[n].learner_id(n)].of(ev.IgnoredObject)]
    assert {e.key.split("/")[0] for e in ignored} >= {"snapshots", "leases"}
    assert all("revoked" in e.reason for e in ignored), {e.reason for e in ignored}
    keys_reported = [(e.learner, e.key) for e in ignored]
    assert len(keys_reported) == len(set(keys_reported))  # once each
    assert not any(revoked.members[IDS[n].learner_id(n)].of(ev.ContributionRejected) for n in "abc")


def test_a_revoked_key_cannot_be_admitted_again():
    sim, _ = members_run("ab")
    man = manifest_of(sim)
    change(sim.mailbox, man, IDS["a"], remove=[IDS["b"].public_hex])
    with pytest.raises(ValueError, match="cannot be admitted again"):
        change(sim.mailbox, man, IDS["a"], add=[IDS["b"].public_hex])
    with pytest.raises(ValueError, match="not the owner"):
        change(sim.mailbox, man, IDS["b"], add=[IDS["c"].public_hex])


# ---- impostors and replays ------------------------------------------------------------------------


class Impostor(Identity):
    """Claims another member's public key, but signs with a key pair of its own."""

    def __init__(self, victim: Identity) -> None:
        super().__init__(Identity.generate()._key)
        self.public_hex, self.fingerprint = victim.public_hex, victim.fingerprint


def test_a_node_that_copies_a_members_public_key_is_ignored_from_its_first_record():
    def run(with_impostor: bool) -> SimRun:
        sim, _ = members_run("abc")
        if with_impostor:
            fake = Impostor(IDS["b"])
            sim.join(fake.learner_id("mallory"), params(7), auth=MemberAuth(identity=fake))
            sim.see_each_other()
        for r in range(5):
            sim.train(train_step, 1)
            sim.sync(r, waiting=lambda m: not m.name.startswith("mallory"))
        return sim

    clean, attacked = run(False), run(True)
    for n in "abc":
        assert same(final(clean, "abc")[n], final(attacked, "abc")[n])
    mallory = Impostor(IDS["b"]).learner_id("mallory")
    assert all(mallory not in {p.learner for p in r.participants} for r in tape(attacked))
    assert all(not r.rejected for r in tape(attacked))
    ignored = [e for n in "abc" for e in attacked.members[IDS[n].learner_id(n)].of(ev.IgnoredObject)]
    first_lease = keys.lease_key(mallory, 0)
    assert any(e.key == first_lease and "does not verify" in e.reason for e in ignored), ignored
    assert any(e.key.startswith("snapshots/") and mallory in e.key for e in ignored)


def _policy_for(identity: Identity, run_id: str) -> tuple[MemberAuth, MemoryMailbox]:
    """A members-only run's policy bound to ``run_id`` (its genesis written to a fresh mailbox)."""
    mb = MemoryMailbox()
    pol = MemberAuth(identity=identity)
    GuardedMailbox(mb, auth=pol)
    man = Manifest(run_id=run_id, created_by=identity.learner_id("a"), schema=[TensorSpec(name="w", dtype="F32", shape=[1])],
                   schema_digest="00" * 32, fragments=[["w"]])  # fmt: skip
    pol.sign(man)
    return pol, mb


def _snapshot(identity: Identity, r: int) -> Snapshot:
    return Snapshot(learner=identity.learner_id("a"), round=r, local_step=1, steps=1, tokens=1, base_version=r // 2,
                    step_seconds=0.1, schema_digest="00" * 32,
                    payload=PayloadRef(key=f"blobs/snapshots/{r:010d}/x/y", sha256="ab" * 32, size=1))  # fmt: skip


def test_records_replayed_from_another_run_round_fragment_or_key_are_rejected():
    me = IDS["a"]
    pol, _ = _policy_for(me, "1111111111111111")
    other, _ = _policy_for(me, "2222222222222222")  # same key, another run
    snap = pol.sign(_snapshot(me, 4))
    key = keys.snapshot_key(4, snap.learner)
    pol.verify(decode(encode(snap), Snapshot), key)  # the original verifies
    with pytest.raises(SignatureInvalid, match="does not verify"):
        other.verify(snap, key)  # an earlier run's record
    for r in (5, 6):  # another fragment's round, the same fragment's next round
        moved = dataclasses.replace(snap, round=r, base_version=r // 2)
        with pytest.raises(SignatureInvalid, match="does not verify"):
            pol.verify(moved, keys.snapshot_key(r, snap.learner))
        with pytest.raises(SignatureInvalid, match="belongs at"):
            pol.verify(snap, keys.snapshot_key(r, snap.learner))
    with pytest.raises(SignatureInvalid, match="does not verify"):
        pol.verify(dataclasses.replace(snap, steps=2), key)  # an altered field
    with pytest.raises(SignatureInvalid, match="unsigned"):
        pol.verify(dataclasses.replace(snap, sig=None), key)
    # a record signed for one kind is not another: the kind is in the signed bytes
    msg_rec = sign_record(_snapshot(me, 4), me, "1111111111111111", keys.round_key(4))
    with pytest.raises(SignatureInvalid):
        pol.verify(msg_rec, key)


def test_a_round_record_replayed_under_another_round_is_rejected():
    sim, _ = members_run("abc")
    for r in range(4):
        sim.train(train_step, 1)
        sim.sync(r)
    recs = tape(sim)
    store = sim.members[IDS["a"].learner_id("a")].store
    with pytest.raises(SignatureInvalid):
        store.auth.verify(recs[0], keys.round_key(2))  # same fragment, two rounds later
    with pytest.raises(SignatureInvalid):
        store.auth.verify(dataclasses.replace(recs[0], round=2, version=2), keys.round_key(2))


def test_forged_membership_entries_are_ignored():
    sim, _ = members_run("ab")
    man = manifest_of(sim)
    # a member (not the owner) signs an entry that admits a stranger; and junk under entry names
    forged = sign_record(
        dataclasses.replace(read_log(sim.mailbox, man).head.record, seq=2, add=[IDS["c"].public_hex], signer=None),  # type: ignore[union-attr]
        IDS["b"],
        man.run_id,
        keys.member_logical_key(2),
    )
    import hashlib

    data = encode(forged)
    sim.mailbox.put_if_absent(keys.member_key(2, hashlib.sha256(data).hexdigest()), data)
    sim.mailbox.put_if_absent(keys.member_key(2, "cd" * 32), b"junk")
    reported: list[tuple[str, str]] = []
    log = read_log(sim.mailbox, man, lambda k, why: reported.append((k, why)))
    assert log.head is not None and log.head.seq == 1
    assert IDS["c"].public_hex not in log.current()[0]
    assert len(reported) == 2


def test_unauthenticated_policy_reads_signed_records_of_an_open_run():
    me = IDS["a"]
    snap = sign_record(_snapshot(me, 2), me, "1111111111111111", keys.snapshot_key(2, me.learner_id("a")))
    Unauthenticated().verify(decode(encode(snap), Snapshot), keys.snapshot_key(2, me.learner_id("a")))
    store = RunStore(MemoryMailbox())
    assert store.decode_record(encode(snap), Snapshot, "k").sig == snap.sig


# ---- the command line -------------------------------------------------------------------------------


def test_members_commands_key_list_add_remove(tmp_path, capsys):
    from gradientmail_core.cli import main
    from gradientmail_core.mailbox.file import FileMailbox

    root = tmp_path / "run"
    sim = SimRun(CFG, mailbox=FileMailbox(root))
    sim.join(IDS["a"].learner_id("a"), params(0), auth=MemberAuth(identity=IDS["a"]))
    owner = tmp_path / "owner.key"
    owner.write_text(IDS["a"].pem().decode())
    owner.chmod(0o600)
    url = f"file://{root}"
    assert main(["members", "key", "--identity", str(tmp_path / "b.key")]) == 0
    pub_b = capsys.readouterr().out.strip()
    assert ids.PUBKEY.fullmatch(pub_b) and (tmp_path / "b.key").exists()
    assert main(["members", "add", url, "--owner-key", str(owner), pub_b]) == 0
    assert "admitted" in capsys.readouterr().out
    assert main(["members", "remove", url, pub_b, "--owner-key", str(owner)]) == 0  # any order
    assert main(["members", "list", url]) == 0
    out = capsys.readouterr().out
    assert f"revoked (1): {ids.fingerprint(pub_b)}" in out and IDS["a"].public_hex in out
    assert main(["members", "add", url, "--owner-key", str(tmp_path / "b.key"), pub_b]) == 2
    assert "not the owner" in capsys.readouterr().err
    assert main(["members", "add", url, "--owner-key", str(owner), "nothex"]) == 2
    assert "not a public key" in capsys.readouterr().err
