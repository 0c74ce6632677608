"""``python -m gradientmail_sim``: run one seed (verbose trace), a range, or a soak.

python -m gradientmail_sim --seed 123 --rounds 50 -v     # replay one seed, print its trace
python -m gradientmail_sim --seeds 0:1000                 # a range, summary at the end
python -m gradientmail_sim --soak 100000                  # a long soak from a random start
python -m gradientmail_sim --seeds 0:300 --mutant accept_stale   # is this mutant caught?
python -m gradientmail_sim --seeds 0:8 --fleet --rounds 12  # fleets of 64..96 learners
python -m gradientmail_sim --goodput                      # the paper's Table 1 simulated (goodput.py)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter

from .mutants import MUTANTS
from .world import SimResult, run_many, run_seed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gradientmail_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seed", type=int, help="run this one seed")
    p.add_argument("--seeds", help="a range START:STOP of seeds")
    p.add_argument("--soak", type=int, metavar="N", help="run N seeds starting at a random seed")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: 3..6 from the seed)")
    p.add_argument("--fleet", action="store_true", help="fleets of 64..96 learners, most with max_contributions")
    p.add_argument("--no-faults", action="store_true", help="no faults, no chaos: a healthy run")
    p.add_argument("--mutant", default=None, choices=sorted(MUTANTS), help="run a deliberately broken engine")
    p.add_argument("--workers", type=int, default=None, help="processes (default: every CPU)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the trace of a single seed")
    p.add_argument(
        "--goodput",
        action="store_true",
        help="goodput of 1..16 learners under the paper's failure model, beside data parallel "
        "(--seed picks the fault times; every other parameter: bench/goodput_table.py)",
    )
    a = p.parse_args(argv)

    if a.goodput:
        from .goodput import FailureModel, TimeScale, describe, run_table, table

        model, scale, seed = FailureModel(), TimeScale(), a.seed or 0
        print(describe(model, scale, seed), flush=True)
        rows = run_table([1, 2, 4, 8, 16], model, scale, seed, workers=a.workers or 2)
        print(table(rows))
        return 0 if all(r.tape_ok and r.unrecovered == 0 for r in rows) else 1

    if a.seed is not None:
        if a.verbose:
            logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
        r = run_seed(
            a.seed, a.rounds, faults=not a.no_faults, nodes=a.nodes, verbose=a.verbose, mutant=a.mutant, fleet=a.fleet
        )
        print(r.summary())
        print("stats:", dict(sorted(r.stats.items())))
        print("faults:", dict(sorted((k, v) for k, v in r.faults.items() if k.count("/") <= 1)))
        print("create-once outcomes resolved by read-back:", dict(sorted(r.resolved.items())))
        print(f"loss: {r.losses[0]:.4f} -> {r.losses[1]:.4f}")
        return 0 if r.ok else 1
    if a.seeds:
        start, stop = (int(x) for x in a.seeds.split(":"))
    elif a.soak:
        start = int.from_bytes(os.urandom(4), "big")
        stop = start + a.soak
    else:
        p.error("give --seed, --seeds or --soak")
    t0 = time.monotonic()
    failed: list[SimResult] = []
    totals: Counter[str] = Counter()
    seconds = 0.0
    n = 0
    for n, r in enumerate(
        run_many(
            range(start, stop),
            a.rounds,
            faults=not a.no_faults,
            nodes=a.nodes,
            mutant=a.mutant,
            workers=a.workers,
            fleet=a.fleet,
        ),
        1,
    ):
        seconds += r.sim_seconds
        totals.update(r.stats)
        totals.update({f"fault/{k}": v for k, v in r.faults.items() if k.count("/") <= 1})
        totals.update({f"resolved/{k}": v for k, v in r.resolved.items()})
        if not r.ok:
            failed.append(r)
            print(r.summary(), flush=True)
        if n % 1000 == 0:
            print(f"... {n} seeds, {len(failed)} failed, {time.monotonic() - t0:.0f} s", flush=True)
    print(
        f"{n} seeds ({start}..{stop - 1}), {len(failed)} failed, {seconds / 3600:.2f} simulated hours, "
        f"{time.monotonic() - t0:.0f} s wall"
    )
    for k, v in sorted(totals.items()):
        print(f"  {k}: {v}")
    for r in failed:
        print(f"replay: {r.config.command()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
