"""The public Session API: validation before I/O, refusals with clear messages, and the
read-only views a training loop uses."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time

import numpy as np
import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.syncer.host import ProcessHost  # noqa: E402
from gradientmail_core.syncer.options import NodeOptions  # noqa: E402


def model(width: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Linear(width, 1))


class Untouchable:
    """A mailbox that fails the test if anything reaches it."""

    def put_if_absent(self, key, data):
        raise AssertionError("I/O before validation")

    get = list = delete = put_if_absent


FAST = {"poll_interval": 0.02, "lease_timeout": 2.0, "callbacks": ()}


@pytest.mark.parametrize("cls", [gm.Session, gm.Syncer])
def test_the_node_keywords_are_the_options_with_their_defaults(cls):
    # NodeOptions.of reads the user object's keywords by name: one that is misspelt, or whose default
    # drifts from the option's, would silently fall back to the option's default.
    params = inspect.signature(cls).parameters
    options = {f.name: f.default for f in dataclasses.fields(NodeOptions)}
    taken = set(params) & set(options)
    assert taken == set(options) - ({"verify"} if cls is gm.Syncer else set())  # a syncer verifies nothing
    for name in taken:
        assert params[name].default == options[name], name


def test_every_node_keyword_reaches_the_options():
    values = dict(poll_interval=0.5, lease_timeout=9.0, lease_every=2.0, round_timeout=3.0, compression="zstd",
                  callbacks=[print], clock=gm.FakeClock(), seed=7)  # fmt: skip
    s = gm.Session(model(), algorithm=gm.DiLoCo(sync_every=4, fragments=1), mailbox=Untouchable(), verify=0.5, **values)
    y = gm.Syncer(Untouchable(), syncer_id="sync-1", **values)
    assert s.options == NodeOptions(verify=0.5, **values)
    assert y.options == NodeOptions(**values)
    assert s.nonce == y.nonce  # the same seed, the same first draw


@pytest.mark.parametrize("bad", ["", "Upper", "-lead", "a_b", "a/b", "..", "x" * 65, "a b"])
def test_invalid_learner_id_is_refused_before_any_io(bad):
    with pytest.raises(ValueError, match="learner id"):
        gm.Session(model(), algorithm=gm.DiLoCo(sync_every=4, fragments=1), mailbox=Untouchable(), learner_id=bad)


def test_default_learner_id_is_valid():
    s = gm.Session(model(), algorithm=gm.DiLoCo(sync_every=4, fragments=1), mailbox=Untouchable())
    assert keys.LEARNER_ID.fullmatch(s.learner_id)


def test_second_live_session_in_this_process_with_the_same_id_is_refused():
    mb = gm.MemoryMailbox()
    cfg = gm.DiLoCo(sync_every=4, fragments=1)
    with gm.Session(model(), algorithm=cfg, mailbox=mb, learner_id="same", **FAST):
        with pytest.raises(gm.DuplicateLearner, match="already used by a live process"):
            with gm.Session(model(), algorithm=cfg, mailbox=mb, learner_id="same", **FAST):
                pass


def test_config_mismatch_names_the_differing_fields_before_training():
    mb = gm.MemoryMailbox()
    with gm.Session(model(), algorithm=gm.DiLoCo(sync_every=4, fragments=1), mailbox=mb, learner_id="a", **FAST):
        pass
    with pytest.raises(gm.RunConfigMismatch, match="sync_every") as e:
        gm.Session(
            model(), algorithm=gm.DiLoCo(sync_every=8, fragments=1, outer_lr=0.5), mailbox=mb, learner_id="b", **FAST
        ).open()
    assert "outer_lr" in str(e.value) and "fragments" not in str(e.value)


def test_schema_mismatch_names_the_differing_parameters():
    mb = gm.MemoryMailbox()
    cfg = gm.DiLoCo(sync_every=4, fragments=1)
    with gm.Session(model(4), algorithm=cfg, mailbox=mb, learner_id="a", **FAST):
        pass
    with pytest.raises(gm.SchemaMismatch, match=r"0\.weight") as e:
        gm.Session(model(5), algorithm=cfg, mailbox=mb, learner_id="b", **FAST).open()
    assert "[4, 3]" in str(e.value) and "[5, 3]" in str(e.value)


def test_batch_size_follows_the_live_learner_count():
    mb = gm.MemoryMailbox()
    cfg = gm.DiLoCo(sync_every=4, fragments=1, global_batch_size=10)
    with gm.Session(model(), algorithm=cfg, mailbox=mb, learner_id="a", **FAST) as a:
        assert a.batch_size == 10
        with gm.Session(model(), algorithm=cfg, mailbox=mb, learner_id="b", **FAST) as b:
            a.wait_for(learners=2, timeout=10)
            assert a.batch_size == 5 and b.batch_size == 5
        # b deleted its lease on close: a stops counting it within a lease listing
        deadline = a.clock.now() + 5
        while a.batch_size != 10 and a.clock.now() < deadline:
            time.sleep(0.02)
        assert a.batch_size == 10
    assert gm.Session(model(), algorithm=gm.DiLoCo(sync_every=4, fragments=1), mailbox=mb).batch_size is None


def test_wait_for_times_out_with_a_clear_message():
    with gm.Session(
        model(), algorithm=gm.DiLoCo(sync_every=4, fragments=1), mailbox=gm.MemoryMailbox(), learner_id="a", **FAST
    ) as s:
        with pytest.raises(TimeoutError, match="1 of 2 learners"):
            s.wait_for(learners=2, timeout=0.2)


def test_progress_and_align_see_the_committed_rounds():
    mb = gm.MemoryMailbox()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with gm.Session(m, algorithm=gm.DiLoCo(sync_every=4, fragments=2), mailbox=mb, learner_id="a", **FAST) as s:
        for _ in range(16):
            loss = m(torch.ones(2, 3)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            s.step(samples=2)
        p = s.progress
        assert p.local_step == 16 and p.tokens == 32 and len(p.versions) == 2
    assert s.rounds_seen >= 1
    fresh = model(4)
    with torch.no_grad():
        for q in fresh.parameters():
            q.zero_()
    head = gm.align(fresh, mailbox=mb)
    assert head == len(mb.list(keys.ROUNDS)) - 1
    for a, b in zip(m.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_align_on_an_empty_mailbox_says_there_is_no_run():
    with pytest.raises(gm.ProtocolError, match="no run"):
        gm.align(model(), mailbox=gm.MemoryMailbox())


class FailingAfterJoin:
    def __init__(self, inner):
        self.inner, self.fail = inner, False

    def put_if_absent(self, key, data):
        return self.inner.put_if_absent(key, data)

    def get(self, key):
        return self.inner.get(key)

    def list(self, prefix, after=""):
        if self.fail:
            raise RuntimeError("disk on fire")
        return self.inner.list(prefix, after)

    def delete(self, keys):
        return self.inner.delete(keys)


def test_background_failure_is_reraised_from_step_never_swallowed():
    mb = FailingAfterJoin(gm.MemoryMailbox())
    s = gm.Session(model(), algorithm=gm.DiLoCo(sync_every=4, fragments=1), mailbox=mb, learner_id="a", **FAST)
    s.open()
    mb.fail = True
    with pytest.raises(gm.SessionFailed, match="disk on fire"):
        for _ in range(500):
            s.step()
            time.sleep(0.01)
    with pytest.raises(gm.SessionFailed):
        s.close()


def test_transient_store_errors_do_not_kill_the_run():
    inner = gm.MemoryMailbox()
    flaky = {"n": 0, "on": False}

    class Flaky(FailingAfterJoin):
        def list(self, prefix, after=""):
            flaky["n"] += 1
            if flaky["on"] and flaky["n"] % 3 == 0:
                raise gm.MailboxUnavailable("503 Slow Down")
            return self.inner.list(prefix, after)

    seen = []
    with gm.Session(
        model(),
        algorithm=gm.DiLoCo(sync_every=4, fragments=1),
        mailbox=Flaky(inner),
        learner_id="a",
        poll_interval=0.01,
        lease_timeout=2.0,
        callbacks=(seen.append,),
    ) as s:
        flaky["on"] = True
        for _ in range(12):
            s.step()
            time.sleep(0.02)
    assert any(isinstance(e, gm.events.StoreFailure) for e in seen)
    assert len(inner.list(keys.ROUNDS)) >= 2


def test_step_does_no_io():
    mb = gm.CountingMailbox(gm.MemoryMailbox())
    with gm.Session(
        model(), algorithm=gm.DiLoCo(sync_every=1000, fragments=1), mailbox=mb, learner_id="a", **FAST
    ) as s:
        assert isinstance(s.host, ProcessHost)
        assert s.host.stop()  # park the background thread: only the training thread acts now
        before = dict(mb.counts)
        for _ in range(50):
            s.step()
        assert dict(mb.counts) == before


def test_numpy_dict_models_and_threads_share_a_run():
    mb = gm.MemoryMailbox()
    cfg = gm.DiLoCo(sync_every=4, fragments=1, quorum_size=2, overlap_steps=2)
    params = [{"w": np.zeros(3, np.float32)} for _ in range(2)]

    def run(i):
        with gm.Session(params[i], algorithm=cfg, mailbox=mb, learner_id=f"n{i}", **FAST) as s:
            s.wait_for(learners=2, timeout=10)
            for _ in range(12):
                params[i]["w"] += np.float32(i + 1)
                s.step()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert np.array_equal(params[0]["w"], params[1]["w"])
    assert params[0]["w"][0] != 0


def test_two_sessions_on_threads_joining_at_once_with_the_same_id_one_is_refused():
    mb = gm.MemoryMailbox()
    cfg = gm.DiLoCo(sync_every=4, fragments=1)
    barrier = threading.Barrier(2)
    outcomes: list[str] = []
    sessions = []

    def join():
        s = gm.Session({"w": np.zeros(4, np.float32)}, algorithm=cfg, mailbox=mb, learner_id="same", **FAST)
        barrier.wait()
        try:
            s.open()
            sessions.append(s)
            outcomes.append("joined")
        except gm.DuplicateLearner:
            outcomes.append("refused")

    ts = [threading.Thread(target=join) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for s in sessions:
        s.close()
    assert sorted(outcomes) == ["joined", "refused"]


def test_flush_on_close_publishes_the_remaining_steps_as_final_contributions():
    from gradientmail_core.protocol.records import RoundRecord, decode

    mb = gm.MemoryMailbox()
    cfg = gm.DiLoCo(sync_every=8, fragments=2, flush_on_close=True)
    params = {"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}
    seen: list = []
    with gm.Session(
        params,
        algorithm=cfg,
        mailbox=mb,
        learner_id="a",
        poll_interval=0.02,
        lease_timeout=2.0,
        callbacks=(seen.append,),
    ) as s:
        for _ in range(10):  # rounds 0 and 1 are due at steps 4 and 8; 2 more steps are left over
            for p in params.values():
                p += np.float32(1.0)
            s.step(samples=1)
            time.sleep(0.05)
        s.learner.drain()
        before_close = {n: p.copy() for n, p in params.items()}
    recs = [decode(mb.get(k), RoundRecord, key=k) for k in mb.list(keys.ROUNDS)]
    finals = [r for r in recs if r.final]
    assert finals and all(p.final for r in finals for p in r.participants)
    assert any(isinstance(e, gm.events.Published) and e.final and e.steps > 0 for e in seen)
    # a lone learner's final contributions are committed without momentum: the run ends on
    # exactly the parameters it had trained, not on an outer step past them
    for n in params:
        np.testing.assert_allclose(params[n], before_close[n], rtol=0, atol=1e-6)
