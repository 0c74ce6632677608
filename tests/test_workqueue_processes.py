"""gm.WorkQueue with real processes: 4 workers over a FileMailbox, one SIGKILLed while it holds a
unit and restarted. Every unit ends done; the killed worker's unit is handed out again.
No wall-clock assertions: only generous deadlines for things that must happen eventually."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import gradientmail_core as gm
from gradientmail_core.protocol.records import decode
from gradientmail_core.workqueue import keys as queue_keys
from gradientmail_core.workqueue.records import UnitDone
from gradientmail_core.workqueue.scan import scan_queue

TESTS = Path(__file__).resolve().parent
UNITS = 16
DEADLINE = 240.0


def start(path: Path, holder: str, log: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, str(TESTS / "workqueue_worker.py"), str(path), holder, "--units", str(UNITS), *extra]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, cwd=TESTS.parent, stdout=out, stderr=subprocess.STDOUT)


def lines(log: Path) -> list[list[str]]:
    return [ln.split() for ln in log.read_text().splitlines() if ln.strip()] if log.exists() else []


def wait_for(pred, what: str, procs=()) -> None:
    deadline = time.monotonic() + DEADLINE
    while not pred():
        for p in procs:
            assert p.poll() in (None, 0), f"a worker failed with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def test_four_workers_with_one_killed_mid_unit_and_restarted_finish_every_unit(tmp_path):
    path = tmp_path / "mailbox"
    path.mkdir()
    logs = {h: tmp_path / f"{h}.log" for h in ("w0", "w1", "w2", "w3")}
    procs: list[subprocess.Popen] = []
    try:
        victim = start(path, "w0", logs["w0"], "--stall")
        procs.append(victim)
        wait_for(lambda: any(ln[0] == "hold" for ln in lines(logs["w0"])), "the victim to hold a unit", procs)
        held = next(ln for ln in lines(logs["w0"]) if ln[0] == "hold")
        unit = int(held[1])
        for h in ("w1", "w2", "w3"):
            procs.append(start(path, h, logs[h]))
        # Let the others get going, then kill the victim in the middle of its unit.
        wait_for(lambda: any(ln[0] == "done" for h in ("w1", "w2", "w3") for ln in lines(logs[h])), "a unit done")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        assert victim.returncode == -signal.SIGKILL
        procs.append(start(path, "w0", logs["w0"]))  # restarted with the same id, a new process
        for p in procs[1:]:
            p.wait(timeout=DEADLINE)
            assert p.returncode == 0, {h: log.read_text()[-2000:] for h, log in logs.items()}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    mb = gm.FileMailbox(path)
    scan = scan_queue(mb, "data")
    assert scan.done == set(range(UNITS))
    records = {}
    for u in range(UNITS):
        k = queue_keys.unit_done_key("data", u)
        records[u] = decode(mb.get(k), UnitDone, key=k)
    # The killed worker's unit was handed out again, and finished by that later attempt.
    assert scan.attempts[unit] >= 2 and records[unit].attempt >= 2
    events = [ln for log in logs.values() for ln in lines(log)]
    done = Counter(int(ln[1]) for ln in events if ln[0] == "done")
    assert set(done) == set(range(UNITS))
    assert not any(ln[0] == "done" and ln[1:3] == held[1:3] for ln in events)  # the victim never finished it
    if not any(ln[0] == "lost" for ln in events):
        # Nobody stalled past the lease timeout (a starved worker would say "lost"): nothing
        # was finished twice, and no finish found another holder's marker.
        assert set(done.values()) == {1}
        assert all(ln[0] != "done-elsewhere" for ln in events)
    # Every worker that ran to the end printed "finished": none waited forever on a dead holder.
    for h, log in logs.items():
        assert lines(log)[-1] == ["finished"], (h, log.read_text()[-2000:])
