"""The gradientmail demo: Decoupled DiLoCo between learner processes that share only a directory.

    python examples/demo.py                # 3 learners, a few minutes on 2 CPU cores
    python examples/demo.py --learners 4 --steps 400
    python examples/demo.py --quick        # a smaller model and fewer steps (what the tests run)
    python examples/demo.py --f32          # plain F32 deltas instead of gm.DiLoCo.frugal, to compare

What happens:

1. Several learner processes start on this machine (``examples/demo_learner.py``), each a
   PyTorch Lightning ``Trainer(strategy=MailboxDiLoCoStrategy(...))`` training a small
   character-level transformer on the Python standard library's own source files. They never
   talk to each other: everything goes through a ``FileMailbox`` in a temporary directory.
   Their config is ``gm.DiLoCo.frugal(...)`` (docs/options.md, "Presets"): each learner uploads
   its delta in 2-bit I2 with error feedback, the closer publishes each commit as an F4 change
   with the full parameters every 10th version, and every payload is zstd-compressed
   (``compression="zstd"``). A commit keeps half of each learner's own parameters
   (``mixing=0.5``, Streaming DiLoCo's; ``--mixing 0`` leaves it to the default rule,
   ``gm.Adaptive()``). ``--f32`` trains with
   plain F32 deltas and full commits instead.
2. A live view shows the rounds committed, the fragment versions, who contributed to each
   round, each learner's loss, speed and traffic, and what happens.
3. Part-way through, the learner that is closing rounds is killed with SIGKILL. Another one
   takes over the round it was closing; the killed learner is then restarted under the same
   id and rejoins the run from the newest committed parameters.
4. A single-process baseline then trains the same model on the same number of characters
   (what synchronous data-parallel training would compute), and the demo prints the config,
   the bytes that went through the mailbox against synchronous data-parallel's (and, for the
   preset, about what F32 deltas would have moved), the held-out loss of both and their ratio,
   and a plot.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import charlm  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.cli.overview import Overview, iter_records, read_manifest, read_overview  # noqa: E402
from gradientmail_core.protocol.records import RoundRecord  # noqa: E402
from gradientmail_core.protocol.run import RunInfo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRESS_EVERY = 10.0  # seconds between progress lines when the output is not a terminal


@dataclass(frozen=True)
class Settings:
    learners: int
    steps: int
    size: charlm.Size
    batch: int  # sequences per learner per step
    diloco: dict[str, Any]
    # ``gm.DiLoCo.frugal`` (docs/options.md, "Presets") over ``diloco``, or None: plain F32 deltas.
    preset: str | None = "frugal"
    compression: str = "zstd"  # the learners' sessions' payload compression
    lr: float = 3e-3
    seed: int = 0
    poll_interval: float = 0.1
    lease_timeout: float = 3.0
    kill_at: float | None = 0.4  # fraction of the steps at which a learner is killed
    eval_every: int = 25  # steps between held-out evaluations of the committed model
    eval_batches: int = 6

    @property
    def rounds(self) -> int:
        return self.steps * self.diloco["fragments"] // self.diloco["sync_every"]


def settings_from(args: argparse.Namespace) -> Settings:
    quick = args.quick
    size = charlm.SIZES["quick" if quick else "demo"]
    steps = args.steps or (80 if quick else 300)
    sync_every = args.sync_every or (10 if quick else 20)
    return Settings(
        learners=args.learners,
        steps=steps,
        size=size,
        batch=8 if quick else 16,
        diloco=dict(
            sync_every=sync_every,
            fragments=2,
            # A round closes once every live learner contributed (or this many did): a killed
            # learner holds rounds up only until its lease expires.
            quorum_size=args.quorum or args.learners,
            # A learner waits for its contribution to be merged once it has trained this many
            # steps past it, so no learner runs ahead of the rounds it has seen.
            overlap_steps=sync_every // 4 if args.overlap_steps is None else args.overlap_steps,
            # Streaming DiLoCo's mixing: a commit keeps this share of the learner's own parameters
            # instead of overwriting them. At 0 a commit drops the steps the learner took since its
            # contribution (up to overlap_steps of every H on that fragment): on this demo 1.10x the
            # baseline's loss at 0, about 1.03x at 0.5 (docs/cli.md, "The demo").
            mixing=0.5 if args.mixing is None else args.mixing,
        ),
        preset=None if args.f32 else "frugal",
        compression="off" if args.f32 else "zstd",
        seed=args.seed,
        lease_timeout=2.0 if quick else 3.0,
        kill_at=None if args.no_kill else args.kill_at,
        eval_every=20 if quick else 25,
        eval_batches=4 if quick else 6,
    )


# ---- learners --------------------------------------------------------------------------------


@dataclass
class Learner:
    id: str
    steps: int
    proc: subprocess.Popen[bytes] | None = None
    state: str = "starting"
    step: int = 0
    loss: float | None = None
    sent: int = 0
    received: int = 0
    banked_sent: int = 0  # traffic of earlier incarnations (before a kill)
    banked_received: int = 0
    offset: int = 0
    history: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=40))
    losses: list[tuple[int, float]] = field(default_factory=list)
    traffic: list[tuple[int, int]] = field(default_factory=list)  # (step, cumulative bytes)
    killed_at: int | None = None
    last_round: int | None = None  # the newest round it contributed to, as last seen

    @property
    def steps_per_second(self) -> float | None:
        if len(self.history) < 2 or self.state != "training":
            return None
        (t0, s0), (t1, s1) = self.history[0], self.history[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    @property
    def total_bytes(self) -> int:
        return self.banked_sent + self.sent + self.banked_received + self.received


class Demo:
    def __init__(self, settings: Settings, workdir: str) -> None:
        self.s = settings
        self.workdir = workdir
        self.mailbox_dir = os.path.join(workdir, "mailbox")
        self.url = f"file://{self.mailbox_dir}"
        for sub in ("metrics", "logs"):
            os.makedirs(os.path.join(workdir, sub), exist_ok=True)
        with open(os.path.join(workdir, "settings.json"), "w") as f:
            json.dump({**dataclasses.asdict(settings), "size": dataclasses.asdict(settings.size)}, f)
        self.learners = [Learner(f"learner-{i}", settings.steps) for i in range(settings.learners)]
        self.events: list[tuple[float, str]] = []
        self.t0 = time.time()
        self.overview: Overview | None = None
        self.kill_plan: tuple[Learner, float] | None = None  # (killed learner, restart time)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the learners share the cores: one thread each
        self.standby: subprocess.Popen[bytes] | None = None
        self.standby_file = os.path.join(workdir, "standby.json")
        self.killed_once = False
        self.kill_round: int | None = None  # the round open when a learner was killed
        self.rejoin_round: int | None = None  # the first round the restarted learner could join
        torch.set_num_threads(1)  # the learners use the cores; the baseline may take them later
        text = charlm.stdlib_text()
        self.train_data = charlm.encode(text["train"])
        self.heldout = charlm.heldout_batches(
            charlm.encode(text["heldout"]), batches=settings.eval_batches, batch=32, block=settings.size.block
        )
        self.eval_model = charlm.CharTransformer(settings.size, seed=0)
        # Named as in the learners' LightningModule (``self.model``), so the schemas match.
        self.eval_named = torch.nn.ModuleDict({"model": self.eval_model})
        self.mailbox = gm.FileMailbox(self.mailbox_dir)
        self.initial_loss = charlm.evaluate(self.eval_model, self.heldout)
        self.param_bytes = charlm.parameter_bytes(self.eval_model)
        self.evals: list[tuple[int, float]] = [(0, self.initial_loss)]  # (nominal step, held-out loss)
        self.next_eval = settings.eval_every

    def log(self, text: str) -> None:
        self.events.append((time.time() - self.t0, text))

    def elapsed(self) -> float:
        return time.time() - self.t0

    def progress_line(self) -> str:
        """Where training is, in one line (for a pipe or a log file)."""
        ov = self.overview
        steps = ", ".join(f"{lr.id} {lr.state}" + (f" {lr.step}/{lr.steps}" if lr.step else "") for lr in self.learners)
        if ov is None:
            return f"loading: no learner has created the run yet; {steps}"
        return f"training: {ov.rounds_committed} of about {self.s.rounds} rounds committed; {steps}"

    # ---- processes ---------------------------------------------------------------------

    def start_standby(self) -> None:
        """A learner process that loads everything now and becomes the restarted learner later."""
        cmd = [
            sys.executable,
            os.path.join(HERE, "demo_learner.py"),
            "--workdir",
            self.workdir,
            "--standby",
            self.standby_file,
        ]
        log = open(os.path.join(self.workdir, "logs", "standby.log"), "ab")  # noqa: SIM115 - child owns it
        self.standby = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()

    def restart(self, lr: Learner) -> None:
        assert lr.killed_at is not None and self.standby is not None
        go = {"id": lr.id, "steps": self.s.steps - lr.killed_at, "start_step": lr.killed_at}
        with open(self.standby_file + ".tmp", "w") as f:
            json.dump(go, f)
        os.replace(self.standby_file + ".tmp", self.standby_file)  # the standby sees all of it or nothing
        lr.proc, self.standby = self.standby, None
        lr.state = "restarting"
        lr.history.clear()

    def start(self, lr: Learner, *, start_step: int = 0) -> None:
        cmd = [
            sys.executable,
            os.path.join(HERE, "demo_learner.py"),
            "--workdir",
            self.workdir,
            "--id",
            lr.id,
            "--steps",
            str(self.s.steps - start_step),
            "--start-step",
            str(start_step),
        ]
        if start_step == 0:
            # First start: learner-0 creates the run, the others join it, and all of them begin
            # training together. A restarted learner joins the running run at once.
            cmd += ["--wait-for", str(self.s.learners)] + (["--join"] if lr is not self.learners[0] else [])
        log = open(os.path.join(self.workdir, "logs", f"{lr.id}.log"), "ab")  # noqa: SIM115 - child owns it
        lr.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        lr.state = "starting" if start_step == 0 else "restarting"
        lr.history.clear()

    def kill(self, lr: Learner) -> None:
        assert lr.proc is not None
        closing = self.overview.open_claim if self.overview else None
        role = f" while closing round {closing.round}" if closing and closing.learner == lr.id else ""
        lr.proc.send_signal(signal.SIGKILL)
        lr.proc.wait()
        lr.killed_at = lr.step
        lr.banked_sent += lr.sent
        lr.banked_received += lr.received
        lr.sent = lr.received = 0
        lr.state = "killed"
        self.killed_once = True
        self.kill_round = self.overview.open_round if self.overview else None
        # Restarted once its lease has lapsed, so that the others take over what it was doing
        # first (a learner back under the same id within the lease timeout just carries on).
        delay = self.s.lease_timeout + 1.0
        self.kill_plan = (lr, time.time() + delay)
        self.log(f"[bold red]{lr.id} killed with SIGKILL[/] at step {lr.step}{role}; restarting it in {delay:.0f} s")

    def poll_metrics(self, lr: Learner) -> None:
        path = os.path.join(self.workdir, "metrics", f"{lr.id}.jsonl")
        if not os.path.exists(path):
            return
        with open(path) as f:
            f.seek(lr.offset)
            chunk = f.read()
        end = chunk.rfind("\n") + 1  # a line being written stays for the next poll
        lr.offset += len(chunk[:end].encode())
        for line in chunk[:end].splitlines():
            m = json.loads(line)
            kind = m["kind"]
            if kind == "step":
                lr.state = "training"
                lr.step, lr.loss, lr.sent, lr.received = m["step"], m["loss"], m["sent"], m["received"]
                lr.history.append((m["t"], m["step"]))
                lr.losses.append((m["step"], m["loss"]))
                lr.traffic.append((m["step"], lr.total_bytes))
            elif kind == "event":
                self.log(f"{lr.id} {m['text']}")
                if lr.killed_at is not None and m["text"].startswith("joined at round "):
                    self.rejoin_round = int(m["text"].split()[3]) + 1
            elif kind == "start" and m["start_step"] > 0:
                self.log(f"{lr.id} restarted (same learner id), resuming its share at step {m['start_step']}")
            elif kind == "done":
                lr.state = "done"
                lr.sent, lr.received = m["sent"], m["received"]
                self.log(f"{lr.id} finished its {self.s.steps} steps and left the run")

    def tick(self) -> None:
        for lr in self.learners:
            self.poll_metrics(lr)
            if lr.proc is not None and lr.proc.poll() is not None and lr.state not in ("killed", "done", "failed"):
                lr.state = "done" if lr.proc.returncode == 0 else "failed"
                if lr.state == "failed":
                    self.log(
                        f"[bold red]{lr.id} exited with code {lr.proc.returncode}[/]; see "
                        f"{os.path.join(self.workdir, 'logs', lr.id + '.log')}"
                    )
        try:
            self.overview = read_overview(self.mailbox, last=6)
        except gm.ProtocolError:
            self.overview = None  # the run is not created yet
        for le in self.overview.leases if self.overview else ():
            lr = next((x for x in self.learners if x.id == le.learner), None)
            if lr is not None and le.last_round is not None:
                lr.last_round = le.last_round
        self.maybe_kill()
        self.maybe_evaluate()

    def maybe_kill(self) -> None:
        if self.kill_plan is not None:
            lr, at = self.kill_plan
            if time.time() >= at:
                self.kill_plan = None
                assert lr.killed_at is not None
                if self.standby is not None and self.standby.poll() is None:
                    self.restart(lr)
                else:
                    self.start(lr, start_step=lr.killed_at)
            return
        if self.s.kill_at is None or self.killed_once:
            return
        target = int(self.s.kill_at * self.s.steps)
        if not any(lr.step >= target for lr in self.learners):
            return
        # Kill the learner closing the open round, so the others have to take it over.
        claim = self.overview.open_claim if self.overview else None
        running = [lr for lr in self.learners if lr.state == "training"]
        victim = next((lr for lr in running if claim and lr.id == claim.learner), running[-1] if running else None)
        if victim is not None:
            self.kill(victim)

    def maybe_evaluate(self) -> None:
        ov = self.overview
        if ov is None or ov.head < 0 or not ov.recent:
            return
        # Steps per learner so far: the baseline's step with the same number of characters.
        step = sum(lr.step for lr in self.learners) // len(self.learners)
        if step < self.next_eval:
            return
        try:
            gm.align(self.eval_named, mailbox=self.mailbox)
        except gm.GradientMailError:
            return  # a payload pruned under our feet: try again next tick
        self.evals.append((step, charlm.evaluate(self.eval_model, self.heldout)))
        self.next_eval = (step // self.s.eval_every + 1) * self.s.eval_every

    @property
    def finished(self) -> bool:
        return all(lr.state in ("done", "failed") for lr in self.learners) and self.kill_plan is None

    def stop_all(self) -> None:
        for proc in [lr.proc for lr in self.learners] + [self.standby]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


# ---- the baseline ----------------------------------------------------------------------------


def train_baseline(s: Settings, data: torch.Tensor, heldout: list[Any], on_step: Any) -> tuple[list, list]:
    """One process, ``learners * batch`` sequences per step for ``steps`` steps: the same
    characters as all learners together, and exactly what synchronous data-parallel computes."""
    # Every core, unless other programs keep them busy: then one thread, since torch's threads
    # waiting on each other for a busy core make every step many times slower than one thread.
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores if os.getloadavg()[0] < cores / 2 else 1)
    model = charlm.CharTransformer(s.size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1000 * s.seed + 999)
    losses, evals = [], [(0, charlm.evaluate(model, heldout))]
    for step in range(1, s.steps + 1):
        x, y = charlm.sample_batch(data, batch=s.learners * s.batch, block=s.size.block, generator=g)
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append((step, loss.item()))
        if step % s.eval_every == 0 or step == s.steps:
            evals.append((step, charlm.evaluate(model, heldout)))
        on_step(step, losses[-1][1])
    return losses, evals


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--learners", type=int, default=3, help="learner processes (default 3)")
    ap.add_argument("--steps", type=int, help="optimizer steps per learner (default 300; 80 with --quick)")
    ap.add_argument("--sync-every", type=int, help="DiLoCo's H: local steps between syncs of a fragment")
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (about a minute)")
    ap.add_argument("--kill-at", type=float, default=0.4, help="kill a learner at this fraction of the steps")
    ap.add_argument("--no-kill", action="store_true", help="do not kill and restart a learner")
    ap.add_argument("--quorum", type=int, help="contributions that close a round (default: all learners)")
    ap.add_argument(
        "--overlap-steps", type=int, help="steps a learner trains past a contribution before it waits (default H/4)"
    )
    ap.add_argument(
        "--mixing",
        type=float,
        help="share of its own parameters a learner keeps at a commit (default 0.5; 0: gm.Adaptive())",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="where the mailbox, logs and plot go (default: a new temporary directory)")
    ap.add_argument("--plain", action="store_true", help="print lines instead of the live view")
    ap.add_argument(
        "--f32",
        action="store_true",
        help="train with plain F32 deltas, full parameters at every commit and no compression, "
        "instead of gm.DiLoCo.frugal with zstd (to compare their bytes and loss)",
    )
    args = ap.parse_args(argv)
    if args.learners < 2:
        ap.error("--learners must be at least 2")
    if not 0 < args.kill_at < 1:
        ap.error("--kill-at must be between 0 and 1")
    return args


def main(argv: list[str] | None = None) -> int:
    import demo_view as view
    from rich.console import Console
    from rich.live import Live

    args = parse_args(argv)
    s = settings_from(args)
    workdir = args.workdir or tempfile.mkdtemp(prefix="gradientmail-demo-")
    console = Console()
    demo = Demo(s, workdir)
    console.print(view.intro(demo))
    live = None
    if console.is_terminal and not args.plain:
        live = Live(view.dashboard(demo), console=console, auto_refresh=False)
    shown = 0
    for lr in demo.learners:
        demo.start(lr)
    if s.kill_at is not None:
        demo.start_standby()
    if live is None:
        # Piped or --plain: a line per phase and a progress line every few seconds, so a log
        # file never sits silent while processes load or train.
        console.print(
            f"{demo.elapsed():6.1f} s  started {s.learners} learner processes; each loads Python, torch and "
            "Lightning, then they join the run and train together",
            soft_wrap=True,
        )
    last_line = time.time()
    try:
        with live or contextlib.nullcontext():
            deadline = time.time() + 30 * 60
            while not demo.finished:
                time.sleep(0.5)
                demo.tick()
                if live is not None:
                    live.update(view.dashboard(demo), refresh=True)
                    continue
                for t, text in demo.events[shown:]:
                    console.print(f"{t:6.1f} s  {text}", soft_wrap=True)
                shown = len(demo.events)
                if time.time() - last_line >= PROGRESS_EVERY:
                    console.print(f"{demo.elapsed():6.1f} s  {demo.progress_line()}", soft_wrap=True)
                    last_line = time.time()
                if time.time() > deadline:
                    raise TimeoutError("the learners did not finish within 30 minutes")
    finally:
        demo.stop_all()
    failed = [lr.id for lr in demo.learners if lr.state == "failed"]
    if failed:
        console.print(f"[bold red]learner(s) {', '.join(failed)} failed; their logs are in {workdir}/logs[/]")
        return 1
    results = finish(demo, console)
    console.print(view.summary(demo, results))
    for line in view.where(results):
        console.print(line, soft_wrap=True)
    return 0


def finish(demo: Demo, console: Any) -> dict[str, Any]:
    """Evaluate the run, train the baseline, save the plot and ``summary.json``."""
    import demo_view as view
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    s = demo.s
    mailbox = demo.mailbox
    head = gm.align(demo.eval_named, mailbox=mailbox)
    diloco_loss = charlm.evaluate(demo.eval_model, demo.heldout)
    demo.evals.append((s.steps, diloco_loss))
    columns = (
        TextColumn("[bold]Baseline[/]: one process, {task.fields[batch]} sequences per step"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
    )
    if console.is_terminal:
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("baseline", total=s.steps, batch=s.learners * s.batch, loss="-")
            base_losses, base_evals = train_baseline(
                s,
                demo.train_data,
                demo.heldout,
                lambda step, loss: bar.update(task, completed=step, loss=f"{loss:.3f}"),
            )
    else:
        console.print(
            f"{demo.elapsed():6.1f} s  learners done (held-out loss {diloco_loss:.3f}); baseline: one process trains "
            f"the same model, {s.learners * s.batch} sequences per step, {s.steps} steps",
            soft_wrap=True,
        )
        every = max(s.steps // 5, 1)

        def on_step(step: int, loss: float) -> None:
            if step % every == 0:
                console.print(f"{demo.elapsed():6.1f} s  baseline step {step}/{s.steps}, training loss {loss:.3f}")

        base_losses, base_evals = train_baseline(s, demo.train_data, demo.heldout, on_step)
    records = list(iter_records(mailbox))
    steps_trained = sum(lr.step for lr in demo.learners)  # a restarted learner resumes its count
    diloco_bytes = sum(lr.total_bytes for lr in demo.learners)
    # Synchronous data-parallel: every step, each learner sends its gradient and receives the
    # average (one parameter-sized tensor each way; a ring all-reduce moves about as much).
    dp_bytes = 2 * demo.param_bytes * steps_trained
    run = read_manifest(mailbox)
    # Every learner but the run's creator joined it once, and the killed one again.
    joins = s.learners - 1 + sum(1 for lr in demo.learners if lr.killed_at is not None)
    f32_bytes = f32_estimate(run, records, joins)
    results = {
        "workdir": demo.workdir,
        "mailbox": demo.url,
        "learners": s.learners,
        "steps": s.steps,
        "parameters": sum(p.numel() for p in demo.eval_model.parameters()),
        "initial_loss": demo.initial_loss,
        "diloco_loss": diloco_loss,
        "baseline_loss": base_evals[-1][1],
        "loss_ratio": diloco_loss / base_evals[-1][1],
        "preset": s.preset,
        "compression": s.compression,
        "algorithm": run.cfg.to_dict(),  # as the run's manifest holds it
        "rounds_committed": len(records),
        "head": head,
        "takeovers": sum(1 for _, text in demo.events if "took over" in text),
        "rejected": sum(len(r.rejected) for r in records),
        "killed": [lr.id for lr in demo.learners if lr.killed_at is not None],
        "steps_trained": steps_trained,
        "learner_steps": {lr.id: lr.step for lr in demo.learners},
        "kill_round": demo.kill_round,
        "rejoin_round": demo.rejoin_round,
        "events": [f"{t:.1f} s {text}" for t, text in demo.events],
        "diloco_bytes": diloco_bytes,
        "data_parallel_bytes": dp_bytes,
        "communication_ratio": dp_bytes / max(diloco_bytes, 1),
        "f32_bytes_estimate": f32_bytes,
        "f32_communication_ratio": dp_bytes / max(f32_bytes, 1),
        "elapsed_seconds": time.time() - demo.t0,
        "gap": gap_breakdown(demo, records),
        "plot": os.path.join(demo.workdir, "demo.png"),
    }
    view.plot(demo, records, base_losses, base_evals, results, results["plot"])
    with open(os.path.join(demo.workdir, "summary.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results


def gap_breakdown(demo: Demo, records: list[RoundRecord]) -> dict[str, Any]:
    """What this run can count of its loss gap: learner steps that never reached a commit. A
    round merges the steps each participant trained since its previous contribution; a learner's
    steps after its last contribution are dropped at the end (as in DiLoCo), and a killed learner's
    steps since its last contribution die with it."""
    last_step: dict[str, int] = {}  # each learner's newest contribution, as the nominal step of its round
    before_kill: dict[str, int] = {}
    for rec in records:
        for p in rec.participants:
            last_step[p.learner] = max(last_step.get(p.learner, 0), rec.step)
            if demo.kill_round is not None and rec.round < demo.kill_round:
                before_kill[p.learner] = max(before_kill.get(p.learner, 0), rec.step)
    total = sum(lr.step for lr in demo.learners)  # a restarted learner resumes its count where it died
    killed = sum(max(lr.killed_at - before_kill.get(lr.id, 0), 0) for lr in demo.learners if lr.killed_at is not None)
    tail = sum(max(lr.step - last_step.get(lr.id, lr.step), 0) for lr in demo.learners)
    s = demo.s
    return {
        "learner_steps": total,
        "lost_to_kill": killed,
        "dropped_at_end": tail,
        "mixing": s.diloco.get("mixing", 0.0),
        "overlap_steps": s.diloco.get("overlap_steps"),
        "syncs_per_fragment": s.steps // s.diloco["sync_every"],
    }


def f32_estimate(run: RunInfo, records: list[RoundRecord], joins: int) -> int:
    """About the payload bytes the same run moves with plain F32 deltas and a full commit every
    round (``--f32``): the initial parameters written once and read by each of ``joins`` learners
    that join; then each round's participants upload their deltas, the closer reads the others'
    and writes the parameters and the outer momentum, and every other live learner reads the
    parameters. Leases and records are left out: on the demo's own ``--f32`` runs, quick and
    full, the estimate is about 7% under what the learners measured. The model is all F32."""
    total = 4 * sum(math.prod(s.shape) for s in run.schema) * (1 + joins)
    for r in records:
        fragment = 4 * sum(math.prod(shape) for shape in run.shapes[r.fragment].values())
        k = len(r.participants)
        total += fragment * (k + (k - 1) + 2 + max(r.live - 1, 0))
    return total


if __name__ == "__main__":
    sys.exit(main())
