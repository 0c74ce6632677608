"""The subcommands. Each takes an open mailbox and the parsed arguments, prints, and returns
an exit code; errors propagate to ``main``, which turns them into one line and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from typing import Any

from ..clock import SystemClock
from ..errors import MailboxUnavailable, MissingExtra
from ..mailbox import Mailbox
from ..protocol.records import to_dict
from .overview import Failed, Overview, export_safetensors, iter_records, read_manifest, read_overview


def _console() -> Any:
    try:
        from rich.console import Console
    except ImportError as e:  # pragma: no cover - rich is in the cli extra
        raise MissingExtra("cli", "rich") from e
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        # Piped or captured: rich would assume 80 columns and squeeze the tables.
        console = Console(width=160)
    return console


def status(mailbox: Mailbox, args: argparse.Namespace) -> int:
    from . import views

    ov = read_overview(mailbox, last=args.last, auth=_auth(args))
    _console().print(views.status(ov, args.url))
    return 0


def _auth(args: argparse.Namespace) -> Any:
    """The run's policy ``main`` checks records with (None: records are only validated)."""
    return getattr(args, "auth", None)


def _report(failed: list[Failed]) -> None:
    """Each record that failed its check, one line on stderr."""
    for f in failed:
        print(f"gradientmail: {f.key} fails its check, ignored: {' '.join(f.reason.split())}", file=sys.stderr)


class _LeaseWatcher:
    """Seconds since each learner's lease last changed, on this observer's own clock (the
    protocol's notion of liveness: wall clocks of other machines are never compared)."""

    def __init__(self, clock: SystemClock) -> None:
        self.clock = clock
        self.seen: dict[str, tuple[str, float, bool]] = {}  # learner -> (key, changed at, seen changing)

    def observe(self, ov: Overview) -> dict[str, float | None]:
        now = self.clock.now()
        out: dict[str, float | None] = {}
        for le in ov.leases:
            prev = self.seen.get(le.learner)
            if prev is None:
                self.seen[le.learner] = (le.key, now, False)
            elif prev[0] != le.key:
                self.seen[le.learner] = (le.key, now, True)
            key, at, changing = self.seen[le.learner]
            out[le.learner] = now - at if changing else None
        return out


class _Stop(Exception):
    """SIGTERM (``timeout 60 gradientmail watch URL``): stop and show the last frame."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop


class _IdleWatcher:
    """Since when this observer has seen the run idle (no learner holding a lease), on its clock."""

    def __init__(self, clock: SystemClock) -> None:
        self.clock = clock
        self.since: float | None = None

    def observe(self, ov: Overview) -> float | None:
        from .views import idle_line

        if idle_line(ov) is None:
            self.since = None
            return None
        now = self.clock.now()
        if self.since is None:
            self.since = now
        return now - self.since


def _plain_line(ov: Overview, elapsed: float, idle_for: float | None, rate: str) -> str:
    """One refresh of ``watch`` as a line, for a pipe or a log file."""
    from .views import idle_line

    head = f"newest round {ov.head}" if ov.head >= 0 else "none yet"
    line = f"{elapsed:7.1f} s  {ov.rounds_committed} rounds committed ({head})"
    idle = idle_line(ov, idle_for)
    if idle is not None:
        return f"{line}; {idle}"
    learners = sum(le.role != "syncer" for le in ov.leases)
    claim = ov.open_claim
    closer = f"closer {claim.learner}" if claim is not None else "not claimed yet"
    return (
        f"{line}; open round {ov.open_round} (fragment {ov.open_fragment}, {closer}): "
        f"{len(ov.open_contributors)}/{max(learners, len(ov.open_contributors))} contributions; "
        f"{learners} learner{'s' if learners != 1 else ''} holding a lease" + (f"; {rate}" if rate else "")
    )


def watch(mailbox: Mailbox, args: argparse.Namespace) -> int:
    """The status, refreshed. On a terminal, redrawn in place; otherwise (a pipe, a file) one line
    per refresh. Either way the last frame stays on screen when it stops: after --iterations, on
    SIGINT, and on SIGTERM."""
    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn
    from rich.text import Text

    from . import views

    console = _console()
    clock = SystemClock()
    leases = _LeaseWatcher(clock)
    idle = _IdleWatcher(clock)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[note]}"),
        console=console,
        auto_refresh=False,
    )
    rounds_task = progress.add_task("Rounds committed", total=args.total, note="")
    open_task = progress.add_task("Open round", total=1, note="")
    started = clock.now()
    first: tuple[float, int] | None = None

    def look() -> tuple[Overview, str, float | None, dict[str, float | None]]:
        """Read the run once: the overview, the commit rate seen so far, how long it is idle, and
        how long ago each lease changed (every look counts, drawn or not)."""
        nonlocal first
        ov = read_overview(mailbox, last=args.last, auth=_auth(args))
        now = clock.now()
        if first is None:
            first = (now, ov.rounds_committed)
        rate = ""
        if now - first[0] > 0 and ov.rounds_committed > first[1]:
            rate = f"{60 * (ov.rounds_committed - first[1]) / (now - first[0]):.1f} rounds/min"
        return ov, rate, idle.observe(ov), leases.observe(ov)

    def frame(ov: Overview, rate: str, idle_for: float | None, renewed: dict[str, float | None]) -> Any:
        progress.update(rounds_task, completed=ov.rounds_committed, note=rate)
        progress.update(
            open_task,
            description=f"Round {ov.open_round} (fragment {ov.open_fragment})",
            completed=len(ov.open_contributors),
            total=max(sum(le.role != "syncer" for le in ov.leases), len(ov.open_contributors), 1),
            note="contributions from learners holding a lease",
            visible=views.idle_line(ov) is None,  # an idle run collects nothing: its status says so instead
        )
        return Group(progress, Text(), views.status(ov, args.url, renewed, idle_for))

    seen = look()
    if args.once:
        console.print(frame(*seen))
        return 0
    terminal = console.is_terminal
    stop_signal = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_stop) if stop_signal else None
    live = Live(frame(*seen), console=console, auto_refresh=False, transient=False) if terminal else None
    warning: str | None = None
    try:
        with live or contextlib.nullcontext():
            if live is not None:
                live.refresh()
            else:
                print(_plain_line(seen[0], clock.now() - started, seen[2], seen[1]), flush=True)
            done = 1
            while args.iterations is None or done < args.iterations:
                clock.sleep(args.interval)
                done += 1
                try:
                    seen, warning = look(), None
                except MailboxUnavailable as e:  # transient: keep the last frame and say so
                    warning = f"store unreachable, retrying: {' '.join(str(e).split())[:200]}"
                if live is not None:
                    shown = frame(*seen)
                    live.update(Group(Text(warning, style="bold red"), shown) if warning else shown, refresh=True)
                elif warning:
                    print(f"{clock.now() - started:7.1f} s  {warning}", flush=True)
                else:
                    print(_plain_line(seen[0], clock.now() - started, seen[2], seen[1]), flush=True)
    except (_Stop, KeyboardInterrupt):
        pass  # asked to stop: the last frame below (on a terminal, Live leaves it on screen)
    finally:
        if stop_signal:
            signal.signal(signal.SIGTERM, previous)
    if live is None:
        console.print(frame(*seen))  # the whole status once, as the last thing in the log
    return 0


def rounds(mailbox: Mailbox, args: argparse.Namespace) -> int:
    # The manifest first, so a mailbox without a run is an error rather than empty output.
    run = read_manifest(mailbox)
    failed: list[Failed] = []
    records = iter_records(mailbox, args.start, auth=_auth(args), failed=failed)
    if args.json:
        for rec in records:
            sys.stdout.write(json.dumps(to_dict(rec), sort_keys=True) + "\n")
        _report(failed)
        return 1 if failed else 0
    from . import views

    recs = list(records)
    title = f"{len(recs)} rounds of run {run.manifest.run_id}" + (f" from round {args.start}" if args.start else "")
    _console().print(views.rounds(recs, title=title))
    _report(failed)
    return 1 if failed else 0


def plot(mailbox: Mailbox, args: argparse.Namespace) -> int:
    from .plot import plot_rounds

    run = read_manifest(mailbox)
    failed: list[Failed] = []
    recs = list(iter_records(mailbox, args.start, auth=_auth(args), failed=failed))
    plot_rounds(recs, args.output, title=f"gradientmail run {run.manifest.run_id} ({args.url})")
    _report(failed)
    print(f"wrote {args.output}: {len(recs)} rounds")
    return 0


def export(mailbox: Mailbox, args: argparse.Namespace) -> int:
    failed: list[Failed] = []
    head, data = export_safetensors(mailbox, auth=_auth(args), failed=failed)
    _report(failed)
    tmp = f"{args.output}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, args.output)  # never leave a half-written model under the final name
    where = f"round {head}" if head >= 0 else "the initial parameters (no round committed yet)"
    print(f"wrote {args.output}: parameters after {where}, {len(data)} bytes")
    return 0


def verify(mailbox: Mailbox, args: argparse.Namespace) -> int:
    from .verify import run

    return run(mailbox, args, _auth(args))
