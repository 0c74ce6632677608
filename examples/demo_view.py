"""What the demo shows: the introduction, the live dashboard, the summary and the plot.

Rendering only: ``examples/demo.py`` owns the processes and the numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gradientmail_core.cli import views
from gradientmail_core.cli.plot import draw_participants
from gradientmail_core.config import FRUGAL
from gradientmail_core.protocol.records import RoundRecord

if TYPE_CHECKING:
    from demo import Demo, Settings

COLORS = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
BASELINE = "#d62728"
STATE_STYLE = {
    "training": "green",
    "starting": "yellow",
    "restarting": "yellow",
    "killed": "bold red",
    "done": "dim",
    "failed": "bold red",
}


def intro(demo: Demo) -> RenderableType:
    s = demo.s
    kill = (
        f"At step {int(s.kill_at * s.steps)} the learner closing rounds is killed (SIGKILL) and restarted."
        if s.kill_at is not None
        else "No learner is killed (--no-kill)."
    )
    text = (
        f"{s.learners} learner processes train a {s.size.layers}-layer character-level transformer "
        f"({views.human_count(sum(p.numel() for p in demo.eval_model.parameters()))} parameters) on the Python "
        f"standard library's source, {s.steps} steps each, with Decoupled DiLoCo "
        f"(H={s.diloco['sync_every']}, {s.diloco['fragments']} fragments, quorum {s.diloco['quorum_size']}), "
        f"{config(s)}.\n"
        f"They share nothing but the mailbox [bold]{demo.url}[/].\n{kill}"
    )
    return Panel(text, title="gradientmail demo", title_align="left", border_style="cyan")


def config(s: Settings) -> str:
    """The run's config in words, with the call that builds it."""
    mixing = s.diloco.get("mixing", 0.0)
    mixed = f", mixing={mixing:g} (a commit keeps that share of each learner's own parameters)" if mixing else ""
    if s.preset == "frugal":
        return (
            f"[bold]gm.DiLoCo.frugal[/] (I2 deltas with error feedback, F4 commits, a checkpoint every "
            f"{FRUGAL['checkpoint_every']}th version){mixed} and compression={s.compression!r}"
        )
    return f"plain F32 deltas with the full parameters at every commit{mixed}, compression={s.compression!r}"


def ratio(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _bar(done: float, total: float) -> Table:
    t = Table.grid(padding=(0, 1))
    t.add_row(ProgressBar(total=max(total, 1), completed=min(done, total), width=40), f"{done:.0f}/{total:.0f}")
    return t


def dashboard(demo: Demo) -> RenderableType:
    s, ov = demo.s, demo.overview
    top = Table.grid(padding=(0, 2))
    top.add_column(style="bold cyan", no_wrap=True)
    top.add_column()
    top.add_row("Learner steps", _bar(sum(lr.step for lr in demo.learners), s.learners * s.steps))
    committed = ov.rounds_committed if ov else 0
    # About steps * P / H rounds; a restarted learner trains its last steps alone, adding a few.
    top.add_row("Rounds committed", _bar(committed, max(s.rounds, committed)))
    if ov is not None:
        versions = "  ".join(f"{f}:v{v}" for f, v in enumerate(ov.versions))
        claim = f"claimed by {ov.open_claim.learner}" if ov.open_claim else "not claimed yet"
        got = ", ".join(ov.open_contributors) or "none yet"
        top.add_row("Fragment versions", versions)
        top.add_row("Open round", f"{ov.open_round} (fragment {ov.open_fragment}), {claim}; contributions: {got}")
    first, last = demo.evals[0], demo.evals[-1]
    top.add_row(
        "Held-out loss",
        f"{last[1]:.3f} nats/char for the committed model at step {last[0]} (untrained: {first[1]:.3f})",
    )

    learners = Table(title="Learners", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("learner", "state", "step", "loss", "steps/s", "sent", "received", "last contribution"):
        learners.add_column(name, justify="left" if name in ("learner", "state") else "right")
    for lr in demo.learners:
        sps = lr.steps_per_second
        contributed = lr.last_round
        learners.add_row(
            lr.id,
            Text(lr.state, style=STATE_STYLE.get(lr.state, "")),
            f"{lr.step}/{s.steps}",
            "-" if lr.loss is None else f"{lr.loss:.3f}",
            "-" if sps is None else f"{sps:.1f}",
            views.human_bytes(lr.banked_sent + lr.sent),
            views.human_bytes(lr.banked_received + lr.received),
            "-" if contributed is None else f"round {contributed}",
        )
    parts: list[RenderableType] = [top, learners]
    if ov is not None and ov.recent:
        parts.append(views.rounds(ov.recent, title="Last rounds (the tape; a yellow closer took over)"))
    events = Text()
    for t, text in demo.events[-7:]:
        events.append(f"{t:6.1f} s  ")
        events.append(Text.from_markup(text))
        events.append("\n")
    parts.append(Panel(events or Text("(nothing yet)", style="dim"), title="What happened", title_align="left"))
    return Group(*parts)


def summary(demo: Demo, r: dict[str, Any]) -> RenderableType:
    s, dim = demo.s, "[dim]"
    above = 100 * (r["loss_ratio"] - 1)
    lines = [
        f"[bold]Config[/]: {config(s)}",
        "",
        f"[bold]Communication[/]: [bold]{ratio(r['communication_ratio'])}x less[/] than synchronous data-parallel",
        f"  {views.human_bytes(r['diloco_bytes'])} through the mailbox, against "
        f"{views.human_bytes(r['data_parallel_bytes'])} {dim}(one gradient up and one average down per step "
        "and learner)[/]",
    ]
    if s.preset is not None:
        lines.append(
            f"  plain F32 deltas (--f32) would have moved about {views.human_bytes(r['f32_bytes_estimate'])} "
            f"in these rounds: {ratio(r['f32_communication_ratio'])}x less than data-parallel "
            f"{dim}(payloads only, estimated)[/]"
        )
    lines += [
        "",
        f"[bold]Held-out loss[/]: [bold]{r['loss_ratio']:.3f}x the baseline's[/] "
        f"({abs(above):.1f}% {'above' if above >= 0 else 'below'}; nats per character, lower is better)",
        f"  [bold]{r['diloco_loss']:.3f}[/]  DiLoCo: {r['learners']} learner processes sharing only a mailbox "
        f"{dim}({r['rounds_committed']} rounds committed)[/]",
        f"  [bold]{r['baseline_loss']:.3f}[/]  one process on the same data and compute {dim}({r['learners']}x larger "
        "batches: what synchronous data-parallel computes)[/]",
        f"  {r['initial_loss']:.3f}  the untrained model",
        *gap_lines(r),
        "",
        f"[bold]Faults[/]: {', '.join(r['killed']) or 'no learner'} killed with SIGKILL and restarted; "
        f"{r['takeovers']} takeover(s); {r['rejected']} rejected contribution(s)",
    ]
    return Panel(
        "\n".join(lines), title=f"Summary after {r['elapsed_seconds']:.0f} s", title_align="left", border_style="green"
    )


def gap_lines(r: dict[str, Any]) -> list[str]:
    """What the loss gap is made of: what this run counts, and what only other runs can separate."""
    g, dim = r["gap"], "[dim]"
    share = (g["lost_to_kill"] + g["dropped_at_end"]) / max(g["learner_steps"], 1)
    return [
        f"  [bold]The {100 * (r['loss_ratio'] - 1):.1f}% gap[/], counted in this run: {100 * share:.1f}% of the "
        f"{g['learner_steps']} learner steps never reached a commit ({g['lost_to_kill']} died with the killed "
        f"learner, {g['dropped_at_end']} came after a learner's last contribution and were dropped at the end, as "
        "in DiLoCo).",
        f"  The rest, which one run cannot split: DiLoCo's own at this length ({g['syncs_per_fragment']} syncs per "
        f"fragment, each learner stepping on a {r['learners']}x smaller batch than the baseline) and the learners "
        f"training past their contributions (overlap_steps={g['overlap_steps']}; a commit keeps "
        f"mixing={g['mixing']:g} of a learner's own steps since). {dim}Measured on this demo: --mixing 0 about "
        '1.10x, --overlap-steps 0 about 0.5% less, --no-kill no change (docs/cli.md, "The demo").[/]',
    ]


def where(r: dict[str, Any]) -> list[str]:
    """Paths and commands, printed outside any box so that they copy cleanly."""
    return [
        f"Plot saved to [bold]{r['plot']}[/]",
        f"Inspect the run: [bold]gradientmail status {r['mailbox']}[/]",
        "  [dim](also: gradientmail watch | rounds | plot -o FILE.png | export -o FILE.safetensors, same URL)[/]",
    ]


# ---- the plot --------------------------------------------------------------------------------


def _smooth(points: list[tuple[int, float]], alpha: float = 0.1) -> tuple[list[int], list[float]]:
    xs, ys, m = [], [], None
    for x, y in points:
        m = y if m is None else (1 - alpha) * m + alpha * y
        xs.append(x)
        ys.append(m)
    return xs, ys


def plot(
    demo: Demo,
    records: list[RoundRecord],
    base_losses: list[tuple[int, float]],
    base_evals: list[tuple[int, float]],
    r: dict[str, Any],
    path: str,
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s = demo.s
    fig = Figure(figsize=(13, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    (ax_eval, ax_train), (ax_rounds, ax_bytes) = fig.subplots(2, 2)
    killed = [(lr, lr.killed_at) for lr in demo.learners if lr.killed_at is not None]

    ax_eval.plot(*zip(*demo.evals), marker="o", color=COLORS[0], label=f"DiLoCo, {s.learners} learners")
    ax_eval.plot(*zip(*base_evals), marker="s", color=BASELINE, label="single process, same compute")
    ax_eval.set_title(
        f"Held-out loss: DiLoCo {r['diloco_loss']:.3f}, baseline {r['baseline_loss']:.3f}", loc="left", fontsize=11
    )
    ax_eval.set_xlabel("step (per learner; the baseline's batch is the learners' together)")
    ax_eval.set_ylabel("nats per character")

    for i, lr in enumerate(demo.learners):
        ax_train.plot(*_smooth(lr.losses), color=COLORS[i % len(COLORS)], lw=1, label=lr.id)
    ax_train.plot(*_smooth(base_losses), color=BASELINE, lw=1.5, label="baseline")
    ax_train.set_title("Training loss (smoothed)", loc="left", fontsize=11)
    ax_train.set_xlabel("step")
    ax_train.set_ylabel("nats per character")

    for ax in (ax_eval, ax_train):
        for lr, step in killed:
            ax.axvline(step, color="black", ls=":", lw=1)
            ax.annotate(
                f"{lr.id} killed\nand restarted",
                (step, 1),
                xycoords=("data", "axes fraction"),
                xytext=(4, -4),
                textcoords="offset points",
                va="top",
                fontsize=8,
            )
        ax.legend(fontsize=8, loc="center right")

    if records:
        draw_participants(ax_rounds, records)
    # The labels go between the bars' tops and the legend (draw_participants leaves headroom above
    # the bars for it), so that neither covers a bar.
    top = max((max(rec.live, len(rec.participants)) for rec in records), default=s.learners)
    for key, what, lift in (("kill_round", "killed", 0.55), ("rejoin_round", "rejoined", 0.12)):
        if r.get(key) is not None:
            ax_rounds.axvline(r[key] - 0.5, color="black", ls=":", lw=1)
            ax_rounds.annotate(
                f"{', '.join(r['killed'])} {what}",
                (r[key] - 0.5, top + lift),
                xytext=(4, 0),
                textcoords="offset points",
                va="bottom",
                fontsize=8,
            )
    ax_rounds.set_xlabel("round")

    for i, lr in enumerate(demo.learners):
        if lr.traffic:
            xs, ys = zip(*lr.traffic)
            ax_bytes.plot(xs, [y / 1e6 for y in ys], color=COLORS[i % len(COLORS)], lw=1.2, label=f"{lr.id} (DiLoCo)")
    steps = [1, s.steps]
    ax_bytes.plot(
        steps,
        [2 * demo.param_bytes * x / 1e6 for x in steps],
        color=BASELINE,
        ls="--",
        label="synchronous data-parallel",
    )
    ax_bytes.set_title(
        f"Bytes each learner sent and received: {ratio(r['communication_ratio'])}x less than data-parallel",
        loc="left",
        fontsize=11,
    )
    ax_bytes.set_xlabel("step")
    ax_bytes.set_ylabel("MB (cumulative, log scale)")
    ax_bytes.set_yscale("log")  # a frugal run moves orders of magnitude less than data-parallel
    ax_bytes.legend(fontsize=8)
    preset = "gm.DiLoCo.frugal" if s.preset == "frugal" else "F32 deltas"
    fig.suptitle(
        f"gradientmail demo: {s.learners} learners, Decoupled DiLoCo ({preset}) over a shared directory", fontsize=12
    )
    fig.savefig(path, dpi=100)
