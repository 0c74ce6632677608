"""What a simulation run is asked to do (``SimConfig``), what it reports (``SimResult``), and
everything its seed decides about the run's shape (``draw_scenario``): the number of nodes,
the DiLoCo configuration, the node options and the fault rates. A *fleet* (``SimConfig.fleet``,
``--fleet``) draws 64..96 nodes, and a cap (``DiLoCo.max_contributions``) in two thirds of them; other
seeds draw a cap in three in ten (``_cap``, from a side rng: seeds without a cap keep their runs).

Also the tiny model every node trains (``SHAPES``: a few tensors, ``SIZE`` floats in all; a run
with chunked payloads trains ``WIDE_SHAPES``, whose larger tensors its small chunks cut) and the
store faults the chaos timer picks from.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from gradientmail_core.config import RDA, DiLoCo, Overwrite, WeightedMean
from gradientmail_core.protocol import keys
from gradientmail_core.syncer.options import NodeOptions

from .faults import Op

GHOST = "ghost"
SHAPES = {"embed.weight": (4, 3), "layers.0.w": (3, 3), "layers.1.w": (3, 3), "head.b": (3,)}
CRASH_TARGETS: list[tuple[tuple[Op, ...] | None, str]] = [
    (None, ""),
    (None, ""),
    (("put",), keys.ROUNDS),
    (("put",), keys.ROUND_BLOBS),
    (("put",), keys.CLAIMS),
    (("put",), keys.SNAPSHOTS),
    (("put",), keys.SNAPSHOT_BLOBS),
    (("list",), ""),
    (("get",), keys.ROUNDS),
    (("delete",), ""),
    (("put",), keys.LEASES),
]
# Chunked seeds: tensors of more than 32 elements, so that chunks of 32 or 64 cut them, and a chunk
# holds the end of one tensor and the start of the next.
WIDE_SHAPES = {"embed.weight": (8, 9), "layers.0.w": (3, 3), "layers.1.w": (5, 8), "head.b": (3,)}


def size_of(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(int(np.prod(s)) for s in shapes.values())


SIZE = size_of(SHAPES)


def _views(flat: np.ndarray, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for n, s in shapes.items():
        size = int(np.prod(s))
        out[n] = flat[at : at + size].reshape(s)
        at += size
    return out


BROWNOUT_PREFIXES = [keys.ROUNDS, keys.SNAPSHOTS, keys.BLOBS, keys.CLAIMS, keys.LEASES, ""]


@dataclass(frozen=True)
class SimConfig:
    seed: int
    rounds: int = 50
    faults: bool = True
    nodes: int | None = None  # None: 3..6, drawn from the seed (64..96 in a fleet)
    verbose: bool = False
    mutant: str | None = None  # only recorded here; the caller enters the mutant's context
    fleet: bool = False  # a fleet of 64..96 learners, most often with a cap (``max_contributions``)

    def command(self) -> str:
        extra = "" if self.faults else " --no-faults"
        extra += " --fleet" if self.fleet else ""
        extra += f" --nodes {self.nodes}" if self.nodes else ""
        extra += f" --mutant {self.mutant}" if self.mutant else ""
        return f"python -m gradientmail_sim --seed {self.seed} --rounds {self.rounds}{extra} -v"


@dataclass
class SimResult:
    config: SimConfig
    violations: list[str]
    trace_hash: str
    stats: Counter[str]
    faults: Counter[str]
    resolved: Counter[str]
    sim_seconds: float
    rounds: int
    losses: tuple[float, float] = (0.0, 0.0)  # loss of the initial and of the final parameters
    algorithm: DiLoCo | None = None  # the run's config as its manifest says (None: no run was created)
    nodes: int = 0  # the simulated processes (learners)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        head = (
            f"seed {self.config.seed}: {'ok' if self.ok else 'FAILED'}, {self.rounds} rounds in "
            f"{self.sim_seconds:.0f} simulated s, trace {self.trace_hash[:16]}"
        )
        if self.ok:
            return head
        return "\n".join([head, *(f"  - {v}" for v in self.violations[:10]), f"  replay: {self.config.command()}"])


@dataclass
class _Draw:
    """Everything the seed decides about the run's shape."""

    nodes: int
    cfg: DiLoCo
    options: NodeOptions
    fault_share: float
    p_error: float
    p_lost_ack: float
    p_retry: float
    p_latency: float
    p_flip: float
    chaos_every: float
    p_preempt: float
    p_preempt_contested: float
    p_pause: float
    p_pause_contested: float
    shapes: dict[str, tuple[int, ...]]  # the model every node trains

    @property
    def size(self) -> int:
        return size_of(self.shapes)


def _two_bit(dtype: str | None, which: str, parity: int) -> str | None:
    """``I2`` in place of ``which`` for an even ``parity``, else ``dtype`` as drawn."""
    return "I2" if dtype == which and parity % 2 == 0 else dtype


def _cap(side: random.Random, n: int, fleet: bool) -> int | None:
    """``max_contributions`` for ``n`` learners: none in most seeds (a third of the fleets), else
    below the learners (a few in a fleet, so most snapshots go unjudged), else at least as many."""
    u = side.random()
    if u < (1 / 3 if fleet else 0.7):
        return None
    if u < (5 / 6 if fleet else 0.9):
        return side.randint(1, min(n - 1, 8)) if fleet else side.randint(1, n - 1)
    return side.randint(n, n + 2)


def draw_scenario(r: random.Random, nodes: int | None, fleet: bool = False) -> _Draw:
    """The run's shape, drawn from ``r`` (the simulation's rng, right after seeding it);
    ``nodes`` fixes the number of nodes instead of drawing it; ``fleet`` draws 64..96 of them."""
    n = nodes or (r.randint(64, 96) if fleet else r.choice([3, 3, 3, 4, 4, 5, 6]))
    P = r.choice([1, 2, 2, 3])
    H = P * r.choice([2, 3, 4])
    in_flight = r.randint(1, P)
    # Chunked payloads (chunks of 32 or 64 elements, over the wider model) in about a third of the
    # seeds; derived from the draws above (no draw of its own), so every other seed keeps its run.
    chunk = (32, 64)[in_flight % 2] if (n + H) % 3 == 0 else None
    cfg = DiLoCo(
        sync_every=H,
        fragments=P,
        in_flight=in_flight,
        quorum_size=r.choice([1, 1, 2]),
        merge=RDA() if r.random() < 0.5 else WeightedMean(),
        # DiLoCo's Nesterov (0.7, 0.9), a gentler one, and local SGD (1, 0)
        outer_lr=(lr_beta := r.choice([(0.7, 0.9), (0.4, 0.8), (1.0, 0.0)]))[0],
        outer_momentum=lr_beta[1],
        # Quantized commits in half the seeds, most of those with checkpoints only every k-th
        # version (the rounds between are replayed by a node that takes over).
        # Half of the F8 ones commit in I2 instead (the 2-bit frontier), derived from the draws
        # above like the deltas below, so no seed's draws shift.
        commit_dtype=(commit := _two_bit(r.choice([None, None, "F8_E4M3", "F4"]), "F8_E4M3", n + in_flight)),
        checkpoint_every=r.choice([1, 2, 3, 5]) if commit else 1,
        # Quantized deltas wherever commits are quantized, half of them with error feedback; I2
        # deltas under half of the F4 commits (``gm.DiLoCo.frugal``'s pair). Derived from the draws
        # above (no draw of their own), so every other seed keeps its run.
        delta_dtype=_two_bit(commit, "F4", n + in_flight),
        # The closer's projection of the pull back toward its rounding in half the quantized-commit
        # seeds, derived like the deltas.
        gap_projection=commit is not None and (n + H) % 2 == 0,
        error_feedback=commit is not None and (H // P) % 2 == 0,
        chunk_elements=chunk,
        # GC's verify window (none, a short one, the default), derived like the chunks: every other
        # seed keeps its draws.
        verify_window=(0, 3, 8)[(n + P + in_flight) % 3],
        # The rule every seed ran with before gm.Adaptive() was the default: every seed keeps its run.
        alignment=Overwrite(),
    )
    opts = NodeOptions(poll_interval=0.5, lease_timeout=3.0, round_timeout=2.0, compression="")
    faults = [r.uniform(0.0, 0.04), r.uniform(0.0, 0.03), r.uniform(0.0, 0.05), r.uniform(0.0, 0.1)]
    faults += [r.uniform(0.0, 0.08), r.uniform(2.5, 6.0), r.uniform(0.0, 0.03), r.uniform(0.05, 0.5)]
    faults += [r.uniform(0.0, 0.0015), r.uniform(0.0, 0.06)]
    # ``max_contributions`` from a side rng seeded by the fault draws above (no draw of ``r``'s own,
    # so every seed without a cap keeps its run).
    cfg = replace(cfg, max_contributions=_cap(random.Random(f"cap/{faults}"), n, fleet))
    p_error, p_lost_ack, p_retry, p_latency, p_flip, chaos_every, p_preempt, p_contested, p_pause, p_pc = faults
    return _Draw(
        nodes=n,
        cfg=cfg,
        options=opts,
        fault_share=0.6,
        p_error=p_error,
        p_lost_ack=p_lost_ack,
        p_retry=p_retry,
        p_latency=p_latency,
        p_flip=p_flip,
        chaos_every=chaos_every,
        p_preempt=p_preempt,
        p_preempt_contested=p_contested,
        p_pause=p_pause,
        p_pause_contested=p_pc,
        shapes=dict(WIDE_SHAPES if chunk is not None else SHAPES),
    )
