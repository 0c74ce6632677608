"""The session metrics every integration logs (``gm/round``, ``gm/bytes_sent``, ...), gathered
from the session's events. Imports no framework, so the Keras callback shares them without torch."""

from __future__ import annotations

import math
import threading

import gradientmail_core as gm
from gradientmail_core import events as ev


class Metrics:
    """Session metrics gathered from its events (which arrive on two threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.aligned = 0
        self.participants: int | None = None
        self.cosine: float | None = None
        self._committed_here: set[int] = set()
        self.changed_fragments: set[int] = set()  # since the driver last looked (training thread)

    def __call__(self, event: ev.Event) -> None:
        with self._lock:
            if isinstance(event, ev.Published):
                self.bytes_sent += event.bytes
            elif isinstance(event, ev.Committed):
                self.bytes_sent += event.bytes_written
                self._committed_here.add(event.round)
            elif isinstance(event, ev.Aligned):
                self.aligned += 1
                self.changed_fragments.add(event.fragment)
                if event.round in self._committed_here:
                    self._committed_here.discard(event.round)  # computed here, nothing downloaded
                else:
                    self.bytes_received += event.bytes
                if event.participants:
                    self.participants = len(event.participants)
                if event.cosine is not None:
                    self.cosine = event.cosine


def metric_values(session: gm.Session, m: Metrics, *, steps: int, samples: int) -> dict[str, float]:
    """The metrics of a started session, under the names every integration logs."""
    p = session.progress
    out: dict[str, float] = {
        "gm/round": float(p.round),
        "gm/rounds_seen": float(p.rounds_seen),
        "gm/live_learners": float(p.live_learners),
        "gm/local_step": float(steps),
        "gm/samples": float(samples),
        "gm/bytes_sent": float(m.bytes_sent),
        "gm/bytes_received": float(m.bytes_received),
    }
    for f, v in enumerate(p.versions):
        out[f"gm/version_{f}"] = float(v)
    if m.participants is not None:
        out["gm/participants"] = float(m.participants)
    if m.cosine is not None and math.isfinite(m.cosine):
        out["gm/cosine"] = float(m.cosine)
    return out
