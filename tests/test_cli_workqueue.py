"""``gradientmail status`` shows the run's work queues: units done, in progress and left."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("rich")

from harness import make_params  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.adapters.base import NumpyAdapter  # noqa: E402
from gradientmail_core.cli import main  # noqa: E402
from gradientmail_core.cli.overview import read_overview  # noqa: E402
from gradientmail_core.protocol.run import open_run  # noqa: E402
from gradientmail_core.protocol.store import RunStore  # noqa: E402


def make_run(path: Path) -> gm.FileMailbox:
    mb = gm.FileMailbox(path)
    adapter = NumpyAdapter(make_params(0))
    open_run(
        RunStore(mb),
        adapter.schema(),
        adapter.read,
        gm.DiLoCo(sync_every=4, fragments=2),
        learner="creator",
        compression="",
        rng=random.Random(0),
    )
    return mb


def test_status_shows_units_done_in_progress_and_left(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mb = make_run(tmp_path / "mailbox")
    rc = main(["status", f"file://{tmp_path / 'mailbox'}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Work queues" not in out  # no queue, no table

    clock = gm.FakeClock()
    a = gm.WorkQueue(mb, units=10, holder="a", clock=clock, lease_timeout=5.0)
    b = gm.WorkQueue(mb, units=10, holder="b", clock=clock, lease_timeout=5.0)
    for _ in range(3):
        hold = a.claim()
        assert hold is not None and a.complete(hold)
    given_back = b.claim()
    assert given_back is not None
    b.release(given_back)  # handed out again below: re-issued
    assert a.claim() is not None and b.claim() is not None  # two in progress
    gm.WorkQueue(mb, units=4, holder="a", name="epoch-1").open()

    ov = read_overview(mb)
    got = {q.name: (q.units, q.done, q.in_progress, q.left, q.reissued) for q in ov.work}
    assert got == {"data": (10, 3, 2, 5, 1), "epoch-1": (4, 0, 0, 4, 0)}

    rc = main(["status", f"file://{tmp_path / 'mailbox'}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Work queues" in out
    rows = {
        line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()[:1] in (["data"], ["epoch-1"])
    }
    assert rows["data"] == ["10", "3", "2", "5", "1"]
    assert rows["epoch-1"] == ["4", "0", "0", "4", "0"]
