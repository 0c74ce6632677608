"""Rich renderables for a run's overview: the summary, the learners and the tape.

Shared by ``gradientmail status``/``watch`` and the demo's live display. Imports rich, so it
is imported only by code that displays something.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..protocol.records import RoundRecord
from .overview import Overview


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.2f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


def algorithm_line(config: Mapping[str, object]) -> str:
    merge = config.get("merge")
    partition = config.get("partition")
    parts = [
        f"H={config.get('sync_every')}",
        f"P={config.get('fragments')}",
        f"in_flight={config.get('in_flight')}",
        f"quorum={config.get('quorum_size')}",
        f"outer lr={config.get('outer_lr')} momentum={config.get('outer_momentum')}",
        f"merge={merge.get('kind') if isinstance(merge, dict) else merge}",
        f"partition={partition.get('kind') if isinstance(partition, dict) else partition}",
    ]
    optional = ("overlap_steps", "mixing", "delta_dtype", "commit_dtype", "global_batch_size")
    parts += [f"{k}={config[k]}" for k in optional if config.get(k) not in (None, 0, 0.0)]
    if config.get("flush_on_close"):
        parts.append("flush_on_close")
    return "DiLoCo " + " ".join(parts)


def idle_line(ov: Overview, idle_for: float | None = None) -> str | None:
    """The run is idle when no learner holds a lease: nothing trains, and the open round waits for
    one to join. Since when, as far as the store tells (its newest commit), and as far as this
    observer saw it (``idle_for``: seconds ``watch`` has seen it idle)."""
    if any(le.role != "syncer" for le in ov.leases):
        return None
    since = f"since round {ov.head} was committed" if ov.head >= 0 else "since it was created (no round committed)"
    seen = f", {idle_for:.0f} s as this watch saw it" if idle_for else ""
    syncers = [le.learner for le in ov.leases]
    waiting = f"; syncer {', '.join(syncers)} waits for learners" if syncers else ""
    return (
        f"idle {since}{seen}: no learner holds a lease{waiting}. Round {ov.open_round} opens when a learner "
        "joins the run."
    )


def summary(ov: Overview, url: str, idle_for: float | None = None) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    m, s = ov.manifest, ov.size
    t.add_row("Run", f"{m.run_id} at {url} (created by {m.created_by})")
    t.add_row("Algorithm", algorithm_line(m.config))
    t.add_row(
        "Schema",
        f"{s.tensors} tensors, {human_count(s.parameters)} parameters, {human_bytes(s.bytes)} "
        f"({'/'.join(s.dtypes)}) in {ov.run.P} fragment{'s' if ov.run.P != 1 else ''}",
    )
    versions = "  ".join(f"{f}:v{v}" for f, v in enumerate(ov.versions))
    head = f"newest round {ov.head}" if ov.head >= 0 else "no round committed yet"
    t.add_row("Tape", f"{ov.rounds_committed} rounds committed ({head}); fragment versions {versions}")
    idle = idle_line(ov, idle_for)
    if idle is not None:
        # A claim left by a node that has gone is no one closing anything: not shown as if it were.
        t.add_row("Idle", idle)
        return t
    claim = ov.open_claim
    if claim is None:
        closer = "no closer has claimed it yet"
    else:
        closer = f"claimed by {claim.learner}" + (f" (claim #{claim.n}: taken over)" if claim.n > 1 else "")
    got = ", ".join(ov.open_contributors) or "none yet"
    t.add_row("Open round", f"{ov.open_round} (fragment {ov.open_fragment}), {closer}; contributions: {got}")
    return t


def learners(ov: Overview, renewed: Mapping[str, float | None] | None = None) -> RenderableType:
    """Learners holding a lease. ``renewed``: seconds since this observer saw each lease change
    (``watch`` knows; a single look cannot tell a live learner from a crashed one)."""
    if not ov.leases:
        return Text("No learner holds a lease: none is running.", style="yellow")
    t = Table(title=f"Learners holding a lease ({len(ov.leases)})", title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("learner", style="bold")
    t.add_column("lease", justify="right")
    t.add_column("local step", justify="right")
    t.add_column("tokens", justify="right")
    t.add_column("last contribution", justify="right")
    t.add_column("open round", justify="center")
    if renewed is not None:
        t.add_column("lease renewed", justify="right")
    for le in ov.leases:
        row = [
            le.learner if le.role == "both" else f"{le.learner} [dim]({le.role})[/dim]",
            f"#{le.seq}" if le.seq >= 0 else "[red]unreadable[/red]",
            str(le.local_step),
            human_count(le.tokens),
            f"round {le.last_round}" if le.last_round is not None else "-",
            "[green]published[/green]" if le.in_open_round else "",
        ]
        if renewed is not None:
            age = renewed.get(le.learner)
            row.append("just seen" if age is None else f"{age:.0f} s ago")
        t.add_row(*row)
    return t


def rounds(records: Sequence[RoundRecord], *, title: str | None = None) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    right: dict[str, Any] = {"justify": "right", "no_wrap": True}
    for name in ("round", "step"):
        t.add_column(name, **right)
    t.add_column("fragment", no_wrap=True)
    # Names wrap on a narrow terminal, so that no column is ever dropped.
    t.add_column("closer", min_width=8)
    t.add_column("participants", ratio=3, min_width=12)
    t.add_column("rejected", ratio=1)
    for name in ("cosine", "quorum", "grace", "live"):
        t.add_column(name, **right)
    previous: str | None = None
    for rec in records:
        closer = Text(rec.closer)
        if previous is not None and rec.closer != previous:
            closer.stylize("bold yellow")  # the closer changed: a takeover, or the old one left
        previous = rec.closer
        names = ", ".join(p.learner for p in rec.participants)
        rejected = ", ".join(f"{x.learner} ({x.reason})" for x in rec.rejected)
        t.add_row(
            str(rec.round),
            str(rec.step),
            f"{rec.fragment}:v{rec.version}",
            closer,
            f"{len(rec.participants)}: {names}" + (" [final]" if rec.final else ""),
            Text(rejected, style="red") if rejected else "",
            "-" if rec.cosine is None else f"{rec.cosine:.3f}",
            f"{rec.quorum_seconds:.2f}s",
            f"{rec.grace_seconds:.2f}s",
            str(rec.live),
        )
    return t


def work(ov: Overview) -> Table:
    """The run's work queues: units done, in progress (claimed, not given back) and left."""
    t = Table(title="Work queues", title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("queue", style="bold")
    for name in ("units", "done", "in progress", "left", "re-issued"):
        t.add_column(name, justify="right")
    for q in ov.work:
        t.add_row(q.name, str(q.units), str(q.done), str(q.in_progress), str(q.left), str(q.reissued))
    return t


def waiting_line(ov: Overview, url: str) -> str | None:
    """The run waits for a node that may close rounds, as its learner-only nodes report it."""
    seen_by = ov.waiting_for_closer
    if not seen_by:
        return None
    return (
        f"the run is waiting: no node that may close rounds is live (seen by {', '.join(seen_by)}); "
        f"start one with `gradientmail syncer {url} --id NAME`"
    )


def failed(ov: Overview) -> RenderableType:
    """Records that fail their check (a MAC or signature): no commit, lease or claim; ignored."""
    lines = [f"{f.key} fails its check, ignored: {' '.join(f.reason.split())}" for f in ov.failed]
    return Text("\n".join(lines), style="bold red")


def status(
    ov: Overview, url: str, renewed: Mapping[str, float | None] | None = None, idle_for: float | None = None
) -> RenderableType:
    parts: list[RenderableType] = [summary(ov, url, idle_for), Text(), learners(ov, renewed)]
    if ov.failed:
        parts[1:1] = [Text(), failed(ov)]
    waiting = waiting_line(ov, url)
    if waiting is not None:
        parts[1:1] = [Text(), Text(waiting, style="bold red")]
    if ov.work:
        parts += [Text(), work(ov)]
    if ov.recent:
        parts += [Text(), rounds(ov.recent, title=f"Last {len(ov.recent)} rounds")]
    return Group(*parts)
