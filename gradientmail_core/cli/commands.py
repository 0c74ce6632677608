"""The subcommands. Each takes an open mailbox and the parsed arguments, prints, and returns
an exit code; errors propagate to ``main``, which turns them into one line and exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
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


def watch(mailbox: Mailbox, args: argparse.Namespace) -> int:
    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn
    from rich.text import Text

    from . import views

    console = _console()
    clock = SystemClock()
    leases = _LeaseWatcher(clock)
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
    first: tuple[float, int] | None = None

    def frame(warning: str | None = None) -> Any:
        nonlocal first
        ov = read_overview(mailbox, last=args.last, auth=_auth(args))
        now = clock.now()
        if first is None:
            first = (now, ov.rounds_committed)
        rate = ""
        if now - first[0] > 0 and ov.rounds_committed > first[1]:
            rate = f"{60 * (ov.rounds_committed - first[1]) / (now - first[0]):.1f} rounds/min"
        progress.update(rounds_task, completed=ov.rounds_committed, note=rate)
        progress.update(
            open_task,
            description=f"Round {ov.open_round} (fragment {ov.open_fragment})",
            completed=len(ov.open_contributors),
            total=max(sum(le.role != "syncer" for le in ov.leases), len(ov.open_contributors), 1),
            note="contributions from learners holding a lease",
        )
        parts = [progress, Text(), views.status(ov, args.url, leases.observe(ov))]
        if warning:
            parts.insert(0, Text(warning, style="bold red"))
        return Group(*parts)

    if args.once:
        console.print(frame())
        return 0
    shown = frame()
    done = 1
    with Live(shown, console=console, auto_refresh=False, transient=False) as live:
        live.refresh()
        while args.iterations is None or done < args.iterations:
            clock.sleep(args.interval)
            try:
                shown = frame()
            except MailboxUnavailable as e:  # transient: keep the last frame and say so
                shown = Group(
                    Text(f"store unreachable, retrying: {' '.join(str(e).split())[:200]}", style="bold red"), shown
                )
            live.update(shown, refresh=True)
            done += 1
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
