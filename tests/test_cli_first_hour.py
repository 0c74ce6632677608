"""The command line as a new user meets it (issue 38): --version, pipes, watch without a terminal
and on SIGTERM, an idle run, verify over collected rounds, cost of a run URL, help texts, errors."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rich")

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.cli import main  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
CFG = gm.DiLoCo(sync_every=4, fragments=2, overlap_steps=0)  # every round commits before the next step


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One learner trained 48 steps (24 rounds, more than the verify window of 8) and left: its
    closer's claim of the next round stays behind, and no lease does."""
    path = tmp_path_factory.mktemp("first-hour") / "mailbox"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gm.Session(
        model,
        algorithm=CFG,
        mailbox=gm.FileMailbox(path),
        learner_id="learner-0",
        poll_interval=0.01,
        lease_timeout=2.0,
        callbacks=(),
    ) as session:
        for _ in range(48):
            x = torch.randn(8, 4)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            session.step(samples=8)
    mb = gm.FileMailbox(path)
    assert len(mb.list(keys.ROUNDS)) > 10
    assert not mb.list(keys.LEASES)
    return f"file://{path}"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def head(url: str) -> int:
    return len(gm.open_mailbox(url).list(keys.ROUNDS)) - 1


def run_module(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradientmail_core.cli", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        **kw,
    )


# ---- --version and pipes -----------------------------------------------------------------------


def test_version_prints_the_version() -> None:
    proc = run_module("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"gradientmail {gm.__version__}"


def test_rounds_json_into_a_pipe_closed_after_one_line_exits_quietly(finished_run: str) -> None:
    # ``gradientmail rounds --json | head -1``: a pipe of one page, closed after the first line
    # while the command still has lines to write.
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradientmail_core.cli", "rounds", finished_run, "--json"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        first = reader.readline()
    _, err = proc.communicate(timeout=120)
    assert json.loads(first)["round"] == 0
    assert len(first) * (head(finished_run) + 1) > 4096 + 8192, "the output must overflow the pipe and the buffer"
    assert proc.returncode == 0 and err == "", err


# ---- watch without a terminal, and on SIGTERM --------------------------------------------------


def test_watch_without_a_terminal_prints_lines_and_a_last_frame_on_sigterm(finished_run: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradientmail_core.cli", "watch", finished_run, "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]  # two refreshes, as they happen
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    n = head(finished_run) + 1
    for line in lines:
        assert re.match(rf"\s*\d+\.\d s  {n} rounds committed \(newest round {n - 1}\); idle since round", line), line
    assert proc.returncode == 0, err
    # The last frame: the whole status, once.
    assert f"Tape       {n} rounds committed" in rest and "Last 8 rounds" in rest
    assert "\x1b[" not in "".join(lines) + rest  # plain text, no terminal control codes


# ---- an idle run -------------------------------------------------------------------------------


def test_status_of_a_finished_run_says_it_is_idle_since_its_newest_commit(
    finished_run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert keys.claim_key(head(finished_run) + 1, 1) in gm.open_mailbox(finished_run).list(keys.CLAIMS)
    rc, out, err = cli(capsys, "status", finished_run)
    assert rc == 0, err
    assert f"idle since round {head(finished_run)} was committed: no learner holds a lease" in out
    assert "claimed by" not in out and "Open round" not in out


def test_watch_once_of_an_idle_run_shows_no_bar_of_contributions(
    finished_run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(capsys, "watch", finished_run, "--once")
    assert rc == 0, err
    assert "0/1" not in out and "contributions from learners" not in out
    assert f"idle since round {head(finished_run)}" in out


# ---- verify over rounds garbage collection has reached -----------------------------------------


def test_verify_from_round_0_says_once_that_old_rounds_were_collected(
    finished_run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(capsys, "verify", finished_run, "--rounds", "0:")
    assert rc == 0, err
    lines = out.splitlines()
    collected = [line for line in lines if "unverifiable" in line and line.startswith("rounds ")]
    assert len(collected) == 1, out
    assert "older than the run's verify window" in collected[0] and "nothing is lost" in collected[0]
    assert not [line for line in lines if line.startswith("round ") and "unverifiable" in line], out
    assert "restore it" not in out and "cannot be rebuilt" not in out
    h = head(finished_run)
    assert f"the run keeps the inputs of its newest 8 rounds (verify_window: rounds {h - 7}-{h})" in out
    assert "window 8:" not in out
    assert max(len(line) for line in lines) < 300


def test_verify_progress_bar_advances_round_by_round(finished_run: str) -> None:
    main_fd, term_fd = pty.openpty()  # stderr on a terminal: the bar is drawn there
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradientmail_core.cli", "verify", finished_run],
        stdout=subprocess.PIPE,
        stderr=term_fd,
        env={**ENV, "TERM": "xterm", "COLUMNS": "100"},
    )
    os.close(term_fd)
    drawn = b""
    while True:
        ready, _, _ = select.select([main_fd], [], [], 120)
        assert ready, "verify hung"
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # the terminal's other end closed: verify exited
            break
        if not chunk:
            break
        drawn += chunk
    os.close(main_fd)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    text = drawn.decode(errors="replace")
    for k in range(1, 9):
        assert f"{k}/8" in text, f"the bar never showed {k}/8: {text!r}"


# ---- cost of a run URL -------------------------------------------------------------------------


def test_cost_reads_the_config_fleet_and_step_time_of_a_run(
    finished_run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = cli(capsys, "cost", finished_run)
    assert rc == 0, err
    assert f"from the run at {finished_run}" in out
    assert "1 learners, 49.0 parameters (F32) in 2 fragments" in out and "sync_every=4" in out
    rc, out, err = cli(capsys, "cost", finished_run, "--learners", "64", "--json")
    assert rc == 0, err
    assert json.loads(out)["rounds_per_day"] > 0
    rc, out, err = cli(capsys, "cost")
    assert rc == 2 and "missing --params, --learners" in err and "give a run's URL" in err


# ---- help texts and docs -----------------------------------------------------------------------


def help_of(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["cost", "members"])
def test_help_is_prose_not_a_docstring(capsys: pytest.CaptureFixture[str], command: str) -> None:
    text = help_of(capsys, command)
    assert "``" not in text and "constant below" not in text
    assert text.count(f"gradientmail {command}") >= 2  # usage, and the examples


def test_every_option_has_help_and_says_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    syncer = help_of(capsys, "syncer", "file:///x", "--id", "s")
    assert re.search(r"--round-timeout S\s+\S", syncer) and "max(30, 10 x --poll-interval)" in syncer
    assert "seconds between refreshes (default 2)" in help_of(capsys, "watch", "file:///x")
    assert "The run at a glance:" in help_of(capsys, "status", "file:///x")


def test_the_cli_docs_cover_syncer_and_members() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    for command in ("syncer", "members"):
        assert f"## `{command}`" in text and f"gradientmail {command} " in text.split("## `status`")[0]


# ---- errors ------------------------------------------------------------------------------------


def test_a_missing_directory_says_no_run_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "status", f"file://{tmp_path / 'nope'}")
    assert rc == 2 and err.count("no run") == 1 and "does not exist" in err, err


def test_a_bare_path_suggests_its_file_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "status", str(tmp_path))
    assert rc == 2 and f"did you mean file://{tmp_path}?" in err, err
    rc, out, err = cli(capsys, "status", "runs/demo")
    assert f"did you mean file://{os.path.abspath('runs/demo')}?" in err, err
