"""Deterministic many-node simulation of the engine with fault injection (SPEC 9).

    from gradientmail_sim import run_seed
    result = run_seed(123, rounds=50)
    assert result.ok, result.summary()

or from a shell: ``python -m gradientmail_sim --seed 123 --rounds 50 -v``. See
``docs/reliability.md``.
"""

from __future__ import annotations

from .audit import AuditMailbox, Auditor, Violation
from .world import SimConfig, SimResult, Simulation, run_many, run_seed

__all__ = ["AuditMailbox", "Auditor", "SimConfig", "SimResult", "Simulation", "Violation", "run_many", "run_seed"]
