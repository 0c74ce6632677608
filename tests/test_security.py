"""Security: no unpickling, run secrets, record MACs bound to run/kind/key, secret-tagged keys,
the hardened mailbox view, join checks, and authenticated runs that shrug off forgeries."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from adversary_sim import SimRun

pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core import events as ev  # noqa: E402
from gradientmail_core.codec.payload import encode_payload  # noqa: E402
from gradientmail_core.errors import RecordInvalid, RunConfigMismatch  # noqa: E402
from gradientmail_core.mailbox.contract import validate_key  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.protocol.auth import RunAuth, Unauthenticated, load_secret, policy, record_key  # noqa: E402
from gradientmail_core.protocol.guard import GuardedMailbox  # noqa: E402
from gradientmail_core.protocol.records import (  # noqa: E402
    MAX_RECORD_BYTES,
    Claim,
    Lease,
    Manifest,
    Participant,
    PayloadRef,
    RoundRecord,
    Snapshot,
    canonical_json,
    decode,
    encode,
    to_dict,
)
from gradientmail_core.protocol.store import RunStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECRET = b"0123456789abcdef-test-secret"
SHA = "ab" * 32

# ---- no unpickling anywhere -----------------------------------------------------------------

_FORBIDDEN = [
    (re.compile(r"\b(c?pickle|dill|cloudpickle|shelve|marshal)\b"), "a pickle-family module"),
    (re.compile(r"allow_pickle\s*=\s*True"), "allow_pickle=True"),
    (re.compile(r"\bjoblib\.load\b"), "joblib.load"),
]


def unpickling_sites(source: str) -> list[str]:
    """Lines of ``source`` that could unpickle: pickle-family modules, ``allow_pickle=True``, and
    ``torch.load(...)`` calls without ``weights_only=True``."""
    found = [f"{why}: {m.group(0)}" for rx, why in _FORBIDDEN for m in rx.finditer(source)]
    for m in re.finditer(r"\btorch\.load\s*\(", source):
        depth, i = 1, m.end()
        while depth and i < len(source):
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        if not re.search(r"weights_only\s*=\s*True", source[m.end() : i]):
            found.append(f"torch.load without weights_only=True: {source[m.start() : i][:80]}")
    return found


def test_the_unpickling_scanner_finds_what_it_looks_for():
    assert unpickling_sites("import pickle")
    assert unpickling_sites("np.load(f, allow_pickle=True)")
    assert unpickling_sites("torch.load(path,\n  map_location='cpu')")
    assert not unpickling_sites("torch.load(path,\n  map_location='cpu', weights_only=True)")
    assert not unpickling_sites("np.load(f, allow_pickle=False)")


def test_library_code_never_unpickles():
    files = sorted((ROOT / "gradientmail_core").rglob("*.py")) + sorted((ROOT / "gradientmail_lightning").rglob("*.py"))
    assert len(files) > 20
    bad = {str(f.relative_to(ROOT)): s for f in files if (s := unpickling_sites(f.read_text()))}
    assert not bad, f"library code that could unpickle (use safetensors or JSON): {bad}"


# ---- secrets -------------------------------------------------------------------------------


def test_secret_from_bytes_str_or_file(tmp_path):
    assert load_secret(SECRET) == SECRET
    assert load_secret(SECRET.decode()) == SECRET
    (tmp_path / "k").write_bytes(SECRET + b"\n")
    assert load_secret(secret_file=tmp_path / "k") == SECRET
    assert load_secret() is None
    assert isinstance(policy(), Unauthenticated) and isinstance(policy(SECRET), RunAuth)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"secret": "short"}, "at least 16"),
        ({"secret": SECRET, "secret_file": "x"}, "not both"),
        ({"secret_file": "/nonexistent/run.key"}, "cannot be read"),
        ({"secret": 12345}, "bytes or str"),
    ],
)
def test_bad_secrets_are_refused_with_a_clear_error(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        load_secret(**kw)


def test_session_refuses_a_bad_secret_before_any_io():
    mb = gm.MemoryMailbox()
    with pytest.raises(ValueError, match="at least 16"):
        gm.Session({"w": np.zeros(3, np.float32)}, algorithm=gm.DiLoCo(sync_every=2, fragments=1), mailbox=mb,
                   learner_id="a", secret="tiny", callbacks=())  # fmt: skip
    assert mb.list("") == []


def test_the_secret_never_shows_in_a_repr():
    auth = RunAuth(SECRET)
    auth.bind("0123456789abcdef")
    assert SECRET.decode() not in repr(auth) and SECRET.decode() not in repr(
        GuardedMailbox(gm.MemoryMailbox(), auth=auth)
    )


# ---- MACs ------------------------------------------------------------------------------------

REF = PayloadRef(key=keys.snapshot_blob_key(4, "a", SHA), sha256=SHA, size=100)
RECORDS = [
    Claim(round=4, n=2, learner="a", nonce="deadbeef"),
    Lease(learner="a", nonce="deadbeef", seq=9, local_step=3, tokens=12),
    Snapshot(learner="a", round=4, local_step=8, steps=2, tokens=32, base_version=2, step_seconds=0.1,
             schema_digest=SHA, payload=REF),
    RoundRecord(round=4, step=9, fragment=0, version=3, closer="a",
                participants=[Participant(learner="a", weight=1.0, steps=2, tokens=32, payload_sha256=SHA)],
                theta=dataclasses.replace(REF, key=keys.round_blob_key(4, "theta", SHA))),
]  # fmt: skip


def bound(secret: bytes = SECRET, run_id: str = "0123456789abcdef") -> RunAuth:
    auth = RunAuth(secret)
    auth.bind(run_id)
    return auth


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: type(r).__name__)
def test_signed_records_verify_and_survive_the_codec(rec):
    auth = bound()
    signed = auth.sign(rec)
    assert signed.mac is not None
    again = decode(encode(signed), type(rec), key=record_key(rec))
    auth.verify(again, record_key(rec))


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: type(r).__name__)
def test_a_mac_fails_for_another_run_another_secret_an_altered_field_or_no_mac(rec):
    signed = bound().sign(rec)
    key = record_key(rec)
    with pytest.raises(RecordInvalid, match="MAC does not verify"):
        bound(run_id="fedcba9876543210").verify(signed, key)
    with pytest.raises(RecordInvalid, match="MAC does not verify"):
        bound(secret=b"another-secret-of-16+bytes").verify(signed, key)
    changed = {"Claim": {"nonce": "cafebabe"}, "Lease": {"tokens": 13}, "Snapshot": {"tokens": 33},
               "RoundRecord": {"step": 10}}[type(rec).__name__]  # fmt: skip
    with pytest.raises(RecordInvalid, match="MAC does not verify"):
        bound().verify(dataclasses.replace(signed, **changed), key)
    with pytest.raises(RecordInvalid, match="unsigned"):
        bound().verify(rec, key)


def test_a_snapshot_replayed_into_another_round_or_learner_fails():
    auth = bound()
    snap = auth.sign(RECORDS[2])
    with pytest.raises(RecordInvalid, match="belongs at"):
        auth.verify(snap, keys.snapshot_key(5, "a"))  # the object copied to round 5's key
    with pytest.raises(RecordInvalid, match="MAC does not verify"):
        auth.verify(dataclasses.replace(snap, round=5), keys.snapshot_key(5, "a"))  # and its round edited
    with pytest.raises(RecordInvalid, match="MAC does not verify"):
        auth.verify(dataclasses.replace(snap, learner="b"), keys.snapshot_key(4, "b"))


def test_a_mac_covers_the_payload_hashes():
    auth = bound()
    snap = auth.sign(RECORDS[2])
    forged = dataclasses.replace(snap, payload=dataclasses.replace(REF, sha256="cd" * 32))
    with pytest.raises(RecordInvalid, match="MAC does not verify"):
        auth.verify(forged, keys.snapshot_key(4, "a"))


def test_a_signed_manifest_binds_the_policy_to_its_run():
    m = Manifest(run_id="00112233aabbccdd", created_by="a", schema=[], schema_digest=SHA, fragments=[[]])
    signer = RunAuth(SECRET)
    signed = signer.sign(m)
    assert signer.run_id == "00112233aabbccdd"
    reader = RunAuth(SECRET)
    reader.verify(signed, keys.MANIFEST)
    assert reader.run_id == signer.run_id and reader.tag("rounds/0000000001.json") == signer.tag(
        "rounds/0000000001.json"
    )
    with pytest.raises(RecordInvalid, match="different secret"):
        RunAuth(b"another-secret-of-16+bytes").verify(signed, keys.MANIFEST)
    with pytest.raises(RecordInvalid, match="no run secret"):
        Unauthenticated().verify(signed, keys.MANIFEST)


# ---- tagged keys ------------------------------------------------------------------------------

learners = st.from_regex(r"[a-z0-9][a-z0-9-]{0,20}", fullmatch=True)
rounds = st.integers(0, keys.MAX_ROUND)
record_keys = st.one_of(
    st.builds(keys.round_key, rounds),
    st.builds(keys.claim_key, rounds, st.integers(1, 999)),
    st.builds(keys.snapshot_key, rounds, learners),
    st.builds(keys.lease_key, learners, st.integers(0, keys.MAX_SEQ)),
)
tags = st.from_regex(r"[0-9a-f]{32}", fullmatch=True)


@given(record_keys, record_keys, tags, tags)
def test_tagging_preserves_byte_order_and_inverts(a, b, ta, tb):
    pa, pb = keys.tag_key(a, ta), keys.tag_key(b, tb)
    assert keys.untag_key(pa) == (a, ta) and validate_key(pa) == pa
    if a != b:
        assert (a < b) == (pa < pb)


@given(record_keys, tags)
def test_plain_parsers_never_take_a_tagged_key(k, t):
    p = keys.tag_key(k, t)
    assert not any(parse(p) for parse in (keys.parse_round_key, keys.parse_claim_key, keys.parse_snapshot_key,
                                          keys.parse_lease_key))  # fmt: skip


# ---- the guarded mailbox -----------------------------------------------------------------------


def test_authenticated_view_hides_untagged_objects_and_reports_each_once():
    inner = gm.MemoryMailbox()
    seen: list[tuple[str, str]] = []
    guard = GuardedMailbox(inner, auth=bound(), on_ignored=lambda k, why: seen.append((k, why)))
    assert guard.put_if_absent(keys.round_key(3), b"mine")
    physical = inner.list(keys.ROUNDS)
    assert len(physical) == 1 and keys.untag_key(physical[0])[0] == keys.round_key(3)
    inner.put_if_absent(keys.round_key(4), b"forged")
    inner.put_if_absent(keys.tag_key(keys.round_key(5), "0" * 32), b"forged, made-up tag")
    inner.put_if_absent(keys.tag_key(keys.round_key(6), keys.untag_key(physical[0])[1]), b"tag of another key")
    for _ in range(3):
        assert guard.list(keys.ROUNDS) == [keys.round_key(3)]
    assert guard.list("", after=keys.round_key(3)) == []
    assert guard.list("", after=keys.round_key(2)) == [keys.round_key(3)]
    assert guard.get(keys.round_key(3)) == b"mine" and guard.get(keys.round_key(4)) is None
    assert len(seen) == 3 and all("run tag" in why for _, why in seen)
    guard.delete([keys.round_key(3)])
    assert inner.list(keys.ROUNDS) == sorted(k for k, _ in seen)


def test_unauthenticated_view_reports_junk_in_record_folders():
    inner = gm.MemoryMailbox()
    seen = []
    guard = GuardedMailbox(inner, on_ignored=lambda k, why: seen.append(k))
    for k in (keys.snapshot_key(1, "a"), "snapshots/0000000001/A.json", "rounds/x.json", "blobs/whatever"):
        inner.put_if_absent(k, b"x")
    assert len(guard.list("")) == 4  # the engine's parsers skip junk and GC removes it
    guard.list("")
    assert seen == ["rounds/x.json", "snapshots/0000000001/A.json"]


class PrefixMailbox(gm.MemoryMailbox):
    """A backend with the optional ``get_prefix``; counts the bytes it hands out."""

    served = 0

    def get_prefix(self, key, n):
        data = self.get(key)
        out = None if data is None else data[:n]
        PrefixMailbox.served += len(out or b"")
        return out


@pytest.mark.parametrize("backend", [gm.MemoryMailbox, PrefixMailbox])
def test_oversized_records_are_cut_at_the_cap_and_rejected(backend):
    inner = backend()
    inner.put_if_absent(keys.snapshot_key(1, "a"), b"{" + b" " * (4 * MAX_RECORD_BYTES))
    store = RunStore(GuardedMailbox(inner))
    PrefixMailbox.served = 0
    with pytest.raises(RecordInvalid, match="exceeds"):
        store.read_record(keys.snapshot_key(1, "a"), Snapshot)
    if backend is PrefixMailbox:
        assert PrefixMailbox.served == MAX_RECORD_BYTES + 1


def test_a_squatted_payload_name_is_reclaimed():
    inner = gm.MemoryMailbox()
    seen = []
    store = RunStore(GuardedMailbox(inner, on_ignored=lambda k, why: seen.append(why)))
    data = encode_payload({"w": np.ones(3, np.float32)}, "F32", kind="delta")
    ref_key = keys.snapshot_blob_key(2, "a", __import__("hashlib").sha256(data).hexdigest())
    inner.put_if_absent(ref_key, b"garbage planted under the name")
    ref = store.put_payload(lambda sha: keys.snapshot_blob_key(2, "a", sha), data)
    assert ref.key == ref_key and inner.get(ref_key) == data and len(seen) == 1
    assert store.put_payload(lambda sha: keys.snapshot_blob_key(2, "a", sha), data) == ref  # idempotent


# ---- joining -----------------------------------------------------------------------------------

CFG = gm.DiLoCo(sync_every=2, fragments=2, in_flight=1, quorum_size=2)


def params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}


@pytest.mark.parametrize(
    "creator, joiner, match",
    [
        (None, SECRET, "not signed"),
        (SECRET, None, "no run secret"),
        (SECRET, b"another-secret-of-16+bytes", "different secret"),
    ],
)
def test_a_node_refuses_a_run_whose_manifest_it_cannot_verify(creator, joiner, match):
    sim = SimRun(CFG, secret=creator)
    sim.join("a", params())
    with pytest.raises(RecordInvalid, match=match):
        sim.join("b", params(), secret=joiner)


def test_a_node_with_the_secret_refuses_a_forged_manifest():
    mb = gm.MemoryMailbox()
    mb.put_if_absent(keys.MANIFEST, b'{"format":1,"run_id":"0123456789abcdef"}')
    with pytest.raises(RecordInvalid, match="manifest.json"):
        SimRun(CFG, secret=SECRET, mailbox=mb).join("a", params())


# ---- authenticated runs under attack (deterministic, single-threaded) --------------------------


def train_step(m) -> int:
    for v in m.params.values():
        v -= np.float32(0.1) * (v - np.float32(1.0))
    return 4


def run_three(secret, attack=None, rounds: int = 8) -> SimRun:
    sim = SimRun(CFG, secret=secret)
    for i, name in enumerate("abc"):
        sim.join(name, params(i))
    sim.see_each_other()
    for r in range(rounds):
        if attack:
            attack(sim, r)
        sim.train(train_step, 1)
        sim.sync(r)
    sim.close()
    return sim


def forge(sim: SimRun, r: int) -> None:
    """Without the secret: take the plain names of the next commit points, claims and honest
    snapshots, with well-formed records (that an unauthenticated run would accept)."""
    mb = sim.mailbox
    a = sim.members["a"]
    ref = PayloadRef(key=keys.round_blob_key(r, "theta", SHA), sha256=SHA, size=10)
    for rr in range(r, r + 3):
        rec = RoundRecord(round=rr, step=rr + 1, fragment=rr % 2, version=rr // 2 + 1, closer="mallory",
                          participants=[Participant(learner="mallory", weight=1.0, steps=1, tokens=1,
                                                    payload_sha256=SHA)], theta=ref)  # fmt: skip
        mb.put_if_absent(keys.round_key(rr), canonical_json(to_dict(rec)))
        mb.put_if_absent(keys.claim_key(rr, 1), encode(Claim(round=rr, n=1, learner="mallory", nonce="deadbeef")))
        for h in "abc":
            snap = Snapshot(learner=h, round=rr, local_step=1, steps=1, tokens=1, base_version=rr // 2,
                            step_seconds=0.1, schema_digest=a.node.run.digest, payload=ref)  # fmt: skip
            mb.put_if_absent(keys.snapshot_key(rr, h), encode(snap))
        mb.put_if_absent(keys.lease_key("mallory", rr), b"{}")


def test_authenticated_run_ignores_forged_commits_claims_and_snapshots_and_ends_identical():
    honest = run_three(SECRET)
    attacked = run_three(SECRET, forge)
    for name in "abc":
        for n in honest.members[name].params:
            assert np.array_equal(honest.members[name].params[n], attacked.members[name].params[n])
    ignored = [e for m in attacked.members.values() for e in m.of(ev.IgnoredObject)]
    assert {e.key.split("/")[0] for e in ignored} == {"rounds", "claims", "snapshots", "leases"}
    assert not any(m.of(ev.ContributionRejected) for m in attacked.members.values())
    assert all(m.node.follower.stuck is None for m in attacked.members.values())


def test_unauthenticated_run_stops_with_the_key_and_the_remedy_on_a_garbage_commit_point():
    # The documented limit: without a secret a party that writes first owns the commit point. Garbage
    # there is a record no node wrote (none rewrites it): the nodes stop, saying which key and what to do.
    def garbage(sim: SimRun, r: int) -> None:
        if r == 3:
            sim.mailbox.put_if_absent(keys.round_key(3), b"not a record")

    with pytest.raises(gm.RecordDamaged, match=r"rounds/0000000003\.json does not read back.*delete rounds/0000000003"):
        run_three(None, garbage)


def test_hostile_payload_refs_are_refused_at_decode_or_judged_corrupt():
    raw = to_dict(RECORDS[2])
    for bad in ("blobs/../manifest.json", "../x", "blobs//x", "/blobs/x", "rounds/0000000001.json", "blobs/./x"):
        raw["payload"]["key"] = bad
        with pytest.raises(RecordInvalid):
            decode(canonical_json(raw), Snapshot, key="k")


def test_align_reads_an_authenticated_run_with_its_secret_only():
    sim = run_three(SECRET, rounds=4)
    model = params(9)
    assert gm.align(model, mailbox=sim.mailbox, secret=SECRET) == 3
    for n in model:
        assert np.array_equal(model[n], sim.members["a"].params[n])
    with pytest.raises(RecordInvalid, match="no run secret"):
        gm.align(params(9), mailbox=sim.mailbox)


def test_a_session_with_a_secret_signs_everything_it_writes():
    mb = gm.MemoryMailbox()
    model = params()
    cfg = gm.DiLoCo(sync_every=2, fragments=1)
    with gm.Session(model, algorithm=cfg, mailbox=mb, learner_id="a", secret=SECRET, poll_interval=0.01,
                    lease_timeout=1.0, callbacks=()) as s:  # fmt: skip
        for _ in range(4):
            train_step(type("M", (), {"params": model})())
            s.step(samples=4)
    objects = [k for k in mb.list("") if not k.startswith(keys.BLOBS)]
    assert objects and all(k == keys.MANIFEST or keys.untag_key(k) is not None for k in objects)
    assert b'"mac":null' not in mb.get(keys.MANIFEST)


# ---- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{"outlier_factor": 1.0}, {"outlier_factor": float("inf")}, {"clip_norm": 0},
                                {"clip_norm": -1.0}, {"outlier_factor": True}, {"clip_norm": "1"}])  # fmt: skip
def test_defence_options_are_validated(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        gm.DiLoCo(sync_every=2, fragments=1, **kw)


def test_defence_options_live_in_the_manifest_and_must_match():
    cfg = gm.DiLoCo(sync_every=2, fragments=1, outlier_factor=3, clip_norm=2.5)
    assert cfg.outlier_factor == 3.0 and gm.DiLoCo.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(RunConfigMismatch, match="outlier_factor"):
        gm.DiLoCo(sync_every=2, fragments=1, clip_norm=2.5).check_matches(cfg.to_dict())
    old = {
        k: v
        for k, v in gm.DiLoCo(sync_every=2, fragments=1).to_dict().items()
        if k not in ("outlier_factor", "clip_norm")
    }
    gm.DiLoCo(sync_every=2, fragments=1).check_matches(old)  # manifests from before the options


# ---- bounded reads in the backends ---------------------------------------------------------------


def test_backends_read_a_bounded_prefix(mailbox):
    mailbox.put_if_absent("blobs/x", b"0123456789")
    mailbox.put_if_absent("blobs/empty", b"")
    assert mailbox.get_prefix("blobs/x", 4) == b"0123"
    assert mailbox.get_prefix("blobs/x", 100) == b"0123456789"
    assert mailbox.get_prefix("blobs/x", -1) == b"0123456789"
    assert mailbox.get_prefix("blobs/empty", 4) == b""
    assert mailbox.get_prefix("blobs/missing", 4) is None
    guard = GuardedMailbox(mailbox, max_payload_bytes=4)
    assert guard.get("blobs/x") == b"01234"  # cap + 1: enough to see it is over the cap


def test_file_mailbox_never_reads_through_a_planted_symlink_fifo_or_directory(tmp_path):
    import os

    mb = gm.FileMailbox(tmp_path / "mb")
    claims = tmp_path / "mb" / "claims" / "0000000001"
    claims.mkdir(parents=True)
    (claims / "001.json").symlink_to("/dev/zero")
    os.mkfifo(claims / "002.json")
    (claims / "003.json").mkdir()
    for n in (1, 2, 3):
        assert mb.get(keys.claim_key(1, n)) is None  # not /dev/zero forever, not a blocking pipe
    for n in (1, 2):
        assert mb.put_if_absent(keys.claim_key(1, n), b"x") is False
    assert mb.list(keys.CLAIMS) == []
