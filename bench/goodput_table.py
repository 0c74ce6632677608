"""The paper's Table 1, simulated on our engine: goodput of M = 1, 2, 4, 8, 16 learners under a
per-chip interruption rate, beside synchronous and elastic data parallel from the same fault times.

A thin command line over ``gradientmail_sim/goodput.py`` (the model, the run and what is measured
are described there): every parameter of the failure model and of the time scale is a flag, and
the heading prints them all.

    python bench/goodput_table.py                          # the table, 10,000 simulated s, 2 processes
    python bench/goodput_table.py --alignment carry        # the same with gm.Carry()
    python bench/goodput_table.py --learners 8 16 --horizon 20000 --seed 3
    python bench/goodput_table.py --chips 100000 --recovery 60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradientmail_sim.goodput import ALIGNMENTS, YEAR, FailureModel, TimeScale, describe, run_table, table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m, s = FailureModel(), TimeScale()
    ap.add_argument("--learners", type=int, nargs="+", default=[1, 2, 4, 8, 16], metavar="M")
    ap.add_argument("--chips", type=int, default=m.chips)
    ap.add_argument("--mtbf-years", type=float, default=m.mtbf_chip / YEAR, help="per chip")
    ap.add_argument("--recovery", type=float, default=m.recovery, help="R: a learner's seconds down per failure")
    ap.add_argument("--dp-restart", type=float, default=m.dp_restart, help="R_dp: data parallel's stall")
    ap.add_argument("--elastic-restart", type=float, default=m.elastic_restart, help="R_el: elastic DP's stall")
    ap.add_argument("--step-seconds", type=float, default=s.step_seconds)
    ap.add_argument("--sync-every", type=int, default=s.sync_every)
    ap.add_argument("--fragments", type=int, default=s.fragments)
    ap.add_argument("--poll", type=float, default=s.poll_interval, help="poll interval, s")
    ap.add_argument("--lease-timeout", type=float, default=s.lease_timeout)
    ap.add_argument("--round-timeout", type=float, default=s.round_timeout)
    ap.add_argument("--horizon", type=float, default=s.horizon, help="simulated seconds of training")
    ap.add_argument("--mid-call", type=float, default=s.mid_call, help="share of kills at a later store call")
    ap.add_argument("--alignment", choices=sorted(ALIGNMENTS), default=s.alignment)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    a = ap.parse_args(argv)
    model = FailureModel(
        chips=a.chips,
        mtbf_chip=a.mtbf_years * YEAR,
        recovery=a.recovery,
        dp_restart=a.dp_restart,
        elastic_restart=a.elastic_restart,
    )
    scale = TimeScale(
        step_seconds=a.step_seconds,
        sync_every=a.sync_every,
        fragments=a.fragments,
        poll_interval=a.poll,
        lease_timeout=a.lease_timeout,
        round_timeout=a.round_timeout,
        horizon=a.horizon,
        mid_call=a.mid_call,
        alignment=a.alignment,
    )
    print(describe(model, scale, a.seed), flush=True)
    t0 = time.monotonic()
    rows = run_table(a.learners, model, scale, a.seed, workers=a.workers)
    print(table(rows))
    print(f"({time.monotonic() - t0:.0f} s wall, {a.workers} processes)")
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0 if all(r.tape_ok and r.unrecovered == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
