"""Per-round charts of a run's tape, drawn with matplotlib's Agg canvas.

No pyplot: figures are built on ``matplotlib.figure.Figure`` directly, so plotting from a
process that already uses matplotlib interactively changes none of its global state.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..errors import MissingExtra
from ..protocol.records import RoundRecord

ACCEPTED, REJECTED, LIVE = "#2a9d8f", "#e76f51", "#264653"


def new_figure(rows: int, *, width: float = 10.0, row_height: float = 2.4) -> tuple[Any, list[Any]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - matplotlib is in the cli extra
        raise MissingExtra("cli", "matplotlib") from e
    fig = Figure(figsize=(width, row_height * rows + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def throughput(rec: RoundRecord) -> float | None:
    """Estimated tokens per second of the learners in a round: each participant's tokens per
    step over the run's step-time estimate (the x_step EMA the record carries)."""
    if not rec.x_step:
        return None
    return sum(p.tokens / p.steps for p in rec.participants if p.steps) / rec.x_step


def draw_participants(ax: Any, records: Sequence[RoundRecord]) -> None:
    x = [r.round for r in records]
    accepted = [len(r.participants) for r in records]
    rejected = [len(r.rejected) for r in records]
    ax.bar(x, accepted, width=0.85, color=ACCEPTED, label="accepted contributions")
    ax.bar(x, rejected, width=0.85, bottom=accepted, color=REJECTED, label="rejected")
    ax.step(x, [r.live for r in records], where="mid", color=LIVE, lw=1.2, label="live learners (closer's view)")
    top = max([a + b for a, b in zip(accepted, rejected)] + [r.live for r in records])
    ax.set_ylim(0, top * 1.45 + 0.5)  # headroom for the legend above the bars
    ax.set_ylabel("learners")
    ax.set_title("Contributions per round", loc="left", fontsize=10)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper left", fontsize=8, ncols=3)


def draw_cosine(ax: Any, records: Sequence[RoundRecord]) -> None:
    pts = [(r.round, r.cosine) for r in records if r.cosine is not None]
    if pts:
        ax.plot(*zip(*pts), marker=".", color="#6a4c93", lw=1)
    else:
        ax.text(
            0.5,
            0.5,
            "no round had two or more contributions",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="gray",
        )
    ax.axhline(0, color="gray", lw=0.6)
    ax.set_ylabel("cosine")
    ax.set_title("Mean pairwise cosine of the merged deltas (agreement between learners)", loc="left", fontsize=10)


def draw_timing(ax: Any, records: Sequence[RoundRecord]) -> None:
    x = [r.round for r in records]
    quorum = [r.quorum_seconds for r in records]
    ax.bar(x, quorum, width=0.85, color="#457b9d", label="round start to quorum")
    ax.bar(
        x,
        [r.grace_seconds for r in records],
        width=0.85,
        bottom=quorum,
        color="#f4a261",
        label="grace window after quorum",
    )
    ax.set_ylim(0, max(q + r.grace_seconds for q, r in zip(quorum, records)) * 1.35 or 1)
    ax.set_ylabel("seconds")
    ax.set_title("Closing a round", loc="left", fontsize=10)
    ax.legend(loc="upper left", fontsize=8, ncols=2)


def draw_throughput(ax: Any, records: Sequence[RoundRecord]) -> None:
    pts = [(r.round, t) for r in records if (t := throughput(r)) is not None]
    if pts:
        ax.plot(*zip(*pts), marker=".", color="#1d3557", lw=1)
        ax.set_ylim(bottom=0)
    ax.set_ylabel("tokens / s")
    ax.set_title("Throughput of the contributing learners (estimated from step times)", loc="left", fontsize=10)


def plot_rounds(records: Sequence[RoundRecord], path: str | os.PathLike[str], *, title: str = "") -> None:
    """Save participants, cosine, quorum/grace times and throughput per round to a PNG."""
    fig, axes = new_figure(4)
    if not records:
        axes[0].text(0.5, 0.5, "no round committed yet", ha="center", va="center", transform=axes[0].transAxes)
    else:
        draw_participants(axes[0], records)
        draw_cosine(axes[1], records)
        draw_timing(axes[2], records)
        draw_throughput(axes[3], records)
    axes[-1].set_xlabel("round")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.savefig(os.fspath(path), dpi=110, format="png")
