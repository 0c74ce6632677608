"""The ``gradientmail`` command line against real runs: sessions in threads on a FileMailbox."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rich")
pytest.importorskip("matplotlib")

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.cli import main  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.protocol.records import RoundRecord, decode  # noqa: E402

CFG = gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2)


class Tiny(torch.nn.Module):
    """Two layers plus a bfloat16 parameter, so export has to keep dtypes apart."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.gain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))

    def forward(self, x):
        return self.body(x) * self.gain.float().mean()


def train(
    mailbox_dir: Path,
    learner: int,
    steps: int,
    *,
    started: threading.Barrier | None = None,
    step_sleep: float = 0.01,
    stop: threading.Event | None = None,
) -> None:
    # Each learner starts from its own random init: only the run's creator's init is used anyway.
    model = Tiny(seed=learner)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + learner)
    with gm.Session(
        model,
        algorithm=CFG,
        mailbox=gm.FileMailbox(mailbox_dir),
        learner_id=f"learner-{learner}",
        poll_interval=0.02,
        lease_timeout=2.0,
        # A learner that finishes after the others closes its last rounds below the quorum: by the
        # round timeout (30 s at its default floor; it made this module's fixture take 62 s once).
        round_timeout=2.0,
        seed=learner,
        callbacks=(),
    ) as session:
        if started is not None:
            started.wait(timeout=30)
        for _ in range(steps):
            if stop is not None and stop.is_set():
                break
            x = torch.randn(16, 8, generator=g)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            session.step(samples=16)
            time.sleep(step_sleep)


def run_learners(mailbox_dir: Path, n: int, steps: int, **kw) -> list[threading.Thread]:
    threads = [threading.Thread(target=train, args=(mailbox_dir, i, steps), kwargs=kw, daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run three learners trained to the end; its ``file://`` URL."""
    path = tmp_path_factory.mktemp("cli") / "mailbox"
    barrier = threading.Barrier(3)
    for t in run_learners(path, 3, 40, started=barrier):
        t.join(timeout=120)
        assert not t.is_alive()
    mb = gm.FileMailbox(path)
    assert len(mb.list(keys.ROUNDS)) >= 4, "the run should have committed a few rounds"
    return f"file://{path}"


def records(url: str) -> list[RoundRecord]:
    mb = gm.open_mailbox(url)
    return [decode(mb.get(k), RoundRecord, key=k) for k in mb.list(keys.ROUNDS)]


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


# ---- status, rounds, watch ---------------------------------------------------------------


def test_status_shows_config_schema_and_tape(finished_run: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "status", finished_run)
    assert rc == 0, err
    recs = records(finished_run)
    head = recs[-1]
    assert "H=4 P=2" in out and "quorum=2" in out
    assert "5 tensors, 165 parameters, 652 B (BF16/F32)" in out  # 161 fp32 + 4 bf16
    assert f"{len(recs)} rounds committed (newest round {head.round})" in out
    versions = {r.fragment: r.version for r in recs}
    assert f"fragment versions 0:v{versions[0]}  1:v{versions[1]}" in out
    assert f"Last {min(8, len(recs))} rounds" in out
    assert "No learner holds a lease" in out  # every learner closed its session


def test_status_lists_live_learners_with_their_last_contribution(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mailbox"
    stop = threading.Event()
    threads = run_learners(path, 2, 2000, step_sleep=0.02, stop=stop)
    try:
        mb = gm.FileMailbox(path)
        deadline = time.monotonic() + 60
        while len(mb.list(keys.ROUNDS)) < 4:
            assert time.monotonic() < deadline, "no rounds committed"
            time.sleep(0.05)
        rc, out, err = run_cli(capsys, "status", f"file://{path}")
        assert rc == 0, err
        assert "Learners holding a lease (2)" in out
        for learner in ("learner-0", "learner-1"):
            assert learner in out
        assert "round " in out  # a last contribution is shown
        rc, out, err = run_cli(capsys, "watch", f"file://{path}", "--iterations", "3", "--interval", "0.3")
        assert rc == 0, err
        assert "lease renewed" in out and "s ago" in out  # liveness judged by seeing the lease change
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def test_rounds_table_shows_every_round(finished_run: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "rounds", finished_run)
    assert rc == 0, err
    recs = records(finished_run)
    assert f"{len(recs)} rounds of run" in out
    for rec in recs:
        names = ", ".join(p.learner for p in rec.participants)
        assert f"{len(rec.participants)}: {names}" in out


def test_rounds_json_lines_are_the_records(finished_run: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "rounds", finished_run, "--json", "--from", "2")
    assert rc == 0, err
    lines = out.splitlines()
    recs = [r for r in records(finished_run) if r.round >= 2]
    assert len(lines) == len(recs)
    for line, rec in zip(lines, recs, strict=True):
        parsed = decode(line.encode(), RoundRecord, key="stdout")
        assert parsed == rec


def test_watch_once_draws_the_progress_and_the_status(finished_run: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "watch", finished_run, "--once")
    assert rc == 0, err
    n = len(records(finished_run))
    assert "Rounds committed" in out and f"{n}/?" in out
    # Every learner has left: no bar of the open round's contributions, the run is idle.
    assert f"Round {n} (fragment {n % 2})" not in out
    assert f"idle since round {n - 1} was committed" in out and f"Round {n} opens when a learner joins" in out
    assert f"{n} rounds committed" in out


# ---- plot and export ---------------------------------------------------------------------


def test_plot_writes_a_png(finished_run: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "run.png"
    rc, out, err = run_cli(capsys, "plot", finished_run, "-o", str(png))
    assert rc == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    assert str(png) in out


def test_export_loads_into_a_model_equal_to_align(
    finished_run: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    load_file = pytest.importorskip("safetensors.torch").load_file
    out_file = tmp_path / "model.safetensors"
    rc, out, err = run_cli(capsys, "export", finished_run, "-o", str(out_file))
    assert rc == 0, err
    state = load_file(str(out_file))
    assert state["gain"].dtype == torch.bfloat16 and state["body.0.weight"].dtype == torch.float32

    exported = Tiny(seed=7)
    exported.load_state_dict(state, strict=True)
    aligned = Tiny(seed=8)
    head = gm.align(aligned, mailbox=gm.open_mailbox(finished_run))
    assert head == records(finished_run)[-1].round
    assert f"round {head}" in out
    for (name, a), (_, b) in zip(exported.state_dict().items(), aligned.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # And not merely the initial parameters: training moved them.
    assert not torch.equal(exported.body[0].weight, Tiny(seed=0).body[0].weight)


def test_export_before_any_commit_gives_the_initial_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mailbox"
    with gm.Session(
        Tiny(seed=3),
        algorithm=CFG,
        mailbox=gm.FileMailbox(path),
        learner_id="solo",
        poll_interval=0.02,
        lease_timeout=2.0,
        callbacks=(),
    ):
        pass
    out_file = tmp_path / "init.safetensors"
    rc, out, err = run_cli(capsys, "export", f"file://{path}", "-o", str(out_file))
    assert rc == 0, err
    assert "initial parameters" in out
    state = pytest.importorskip("safetensors.torch").load_file(str(out_file))
    for name, p in Tiny(seed=3).state_dict().items():
        assert torch.equal(state[name], p), name


def test_rich_and_matplotlib_load_only_when_a_command_draws(finished_run: str) -> None:
    code = (
        "import sys\n"
        "from gradientmail_core.cli import main\n"
        f"assert main(['rounds', {finished_run!r}, '--json']) == 0\n"
        "assert 'rich' not in sys.modules and 'matplotlib' not in sys.modules, 'imported eagerly'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_console_script_module_runs(finished_run: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gradientmail_core.cli", "rounds", finished_run, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == len(records(finished_run))


# ---- errors: exit code 2 and one line saying what to do ----------------------------------


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    rc, out, err = run_cli(capsys, *args)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"gradientmail {args[0]}: error: "), err
    return err


@pytest.mark.parametrize("command", ["status", "watch", "rounds", "plot", "export"])
def test_a_directory_without_a_run_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    extra = ["-o", str(tmp_path / "out")] if command in ("plot", "export") else []
    extra += ["--once"] if command == "watch" else []
    err = one_line_error(capsys, command, f"file://{tmp_path}", *extra)
    assert "no run at" in err and "start a learner" in err
    assert not (tmp_path / "out").exists()


def test_a_missing_directory_is_no_run_and_is_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    err = one_line_error(capsys, "status", f"file://{missing}")
    assert "does not exist" in err
    assert not missing.exists()


def test_an_empty_memory_mailbox_is_no_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert "no run at memory://cli-empty" in one_line_error(capsys, "rounds", "memory://cli-empty", "--json")


def test_an_unreachable_store_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("boto3")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = one_line_error(capsys, "status", "s3://bucket/run", "--endpoint-url", f"http://127.0.0.1:{port}")
    assert "cannot reach the store" in err and "--endpoint-url" in err


def test_a_run_of_another_format_version_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    mb = gm.open_mailbox("memory://cli-format-2")
    mb.put_if_absent(keys.MANIFEST, json.dumps({"format": 2, "anything": "new"}).encode())
    err = one_line_error(capsys, "status", "memory://cli-format-2")
    assert "format version 2" in err and "upgrade gradientmail" in err


def test_a_corrupt_round_record_is_a_clear_error(
    finished_run: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A copy of the finished run whose newest record claims a future format.
    src = gm.open_mailbox(finished_run)
    url = "memory://cli-corrupt-round"
    dst = gm.open_mailbox(url)
    for k in [keys.MANIFEST, *src.list(keys.ROUNDS)]:
        dst.put_if_absent(k, src.get(k))
    last = src.list(keys.ROUNDS)[-1]
    dst.delete([last])
    dst.put_if_absent(last, json.dumps({**json.loads(src.get(last)), "format": 9}).encode())
    err = one_line_error(capsys, "rounds", url)
    assert last in err and "format version 9" in err


def test_a_bad_url_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "unknown mailbox URL scheme" in one_line_error(capsys, "status", "ftp://host/run")
    assert "s3:// URLs only" in one_line_error(capsys, "status", "memory://x", "--endpoint-url", "http://h")


def test_an_authenticated_run_needs_its_secret_file(tmp_path):
    import numpy as np

    import gradientmail_core as gm
    from gradientmail_core.cli import main

    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    params = {"w": np.zeros(4, np.float32)}
    url = f"file://{tmp_path / 'mb'}"
    with gm.Session(
        params,
        algorithm=gm.DiLoCo(sync_every=2, fragments=1),
        mailbox=gm.open_mailbox(url),
        learner_id="a",
        poll_interval=0.02,
        lease_timeout=2,
        secret_file=secret,
        callbacks=(),
    ) as s:
        for _ in range(4):
            params["w"] += 1
            s.step()
    assert main(["rounds", url]) == 2
    assert main(["rounds", url, "--json", "--secret-file", str(secret)]) == 0
