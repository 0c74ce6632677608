"""Edges of the public API: ``close()`` giving up on a stalled run, ``gm.align`` on a run
with no commit, and the ``MissingExtra`` message."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import gradientmail_core as gm
from gradientmail_core import events as ev
from gradientmail_core.errors import MissingExtra


def params(value: float = 0.0) -> dict[str, np.ndarray]:
    return {"w": np.full(6, value, np.float32), "b": np.full(3, value, np.float32)}


def test_close_gives_up_with_gave_up_when_no_round_commits() -> None:
    """Round 0 needs two contributions (quorum 2) and the second live learner never trains:
    nothing commits. ``close()`` waits ``close_timeout`` on the session's clock, then emits
    ``GaveUp`` and returns, leaving the model on the newest committed (initial) parameters."""
    mb, clock = gm.MemoryMailbox(), gm.FakeClock()
    cfg = gm.DiLoCo(sync_every=4, fragments=1, quorum_size=2)
    fast = {"poll_interval": 0.01, "lease_timeout": 1000.0, "clock": clock}
    seen_a: list[ev.Event] = []
    pa, pb = params(), params()
    idle = gm.Session(pb, algorithm=cfg, mailbox=mb, learner_id="idle", callbacks=(), **fast)
    idle.open()
    a = gm.Session(pa, algorithm=cfg, mailbox=mb, learner_id="a", callbacks=(seen_a.append,), close_timeout=30, **fast)
    a.open()
    try:
        a.wait_for(2, timeout=None)
        for _ in range(4):
            pa["w"] += np.float32(1.0)
            a.step()
        assert a.learner is not None and [p.round for p in a.learner.published] == [0]

        # Time passes only when this thread says so, one second per few real milliseconds.
        done = threading.Event()

        def advance() -> None:
            while not done.wait(0.005):
                clock.advance(1.0)

        ticker = threading.Thread(target=advance, daemon=True)
        ticker.start()
        started = clock.now()
        try:
            a.close()
        finally:
            done.set()
            ticker.join()
        gave_up = [e for e in seen_a if isinstance(e, ev.GaveUp)]
        assert len(gave_up) == 1, seen_a
        assert gave_up[0].round == -1 and "close" in gave_up[0].reason
        assert clock.now() - started >= 30  # it waited the whole close_timeout first
        assert not [e for e in seen_a if isinstance(e, ev.Committed | ev.Aligned)]
        assert np.array_equal(pa["w"], np.zeros(6, np.float32))  # the newest committed: the initial ones
    finally:
        a.host.abort()
        idle.host.abort()


def test_align_returns_minus_one_on_a_run_with_no_commit_and_loads_the_initial_parameters() -> None:
    mb = gm.MemoryMailbox()
    cfg = gm.DiLoCo(sync_every=4, fragments=2)
    with gm.Session(params(1.0), algorithm=cfg, mailbox=mb, learner_id="a", callbacks=(), poll_interval=0.01):
        pass  # created the run, trained nothing: no round committed
    target = params(7.0)
    assert gm.align(target, mailbox=mb) == -1
    assert all(np.array_equal(v, np.full_like(v, 1.0)) for v in target.values())


def test_align_returns_the_newest_round_once_one_committed() -> None:
    # The counterpart of the test above: align's -1 means "none", not "always".
    mb = gm.MemoryMailbox()
    cfg = gm.DiLoCo(sync_every=2, fragments=1)
    p = params(1.0)
    with gm.Session(p, algorithm=cfg, mailbox=mb, learner_id="a", callbacks=(), poll_interval=0.01) as s:
        for _ in range(2):
            p["w"] += np.float32(1.0)
            s.step()
    target = params(7.0)
    assert gm.align(target, mailbox=mb) == 0
    assert np.array_equal(target["w"], p["w"]) and not np.array_equal(target["w"], np.full(6, 1.0, np.float32))


def test_missing_extra_names_the_extra_and_the_pip_command() -> None:
    e = MissingExtra("s3", "boto3")
    assert isinstance(e, ImportError) and isinstance(e, gm.GradientMailError)
    assert e.extra == "s3"
    assert str(e) == "boto3 is not installed; install it with: pip install 'gradientmail[s3]'"
    assert str(MissingExtra("zstd")) == "zstd is not installed; install it with: pip install 'gradientmail[zstd]'"


def test_s3_mailbox_without_boto3_raises_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradientmail_core.mailbox.s3 import S3Mailbox

    for name in [m for m in sys.modules if m == "boto3" or m.startswith(("boto3.", "botocore"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "boto3", None)  # `import boto3` now fails as if not installed
    with pytest.raises(MissingExtra, match=r"pip install 'gradientmail\[s3\]'") as info:
        S3Mailbox("bucket", "run")
    assert info.value.extra == "s3" and "boto3" in str(info.value)
