"""``gradientmail verify URL``: recompute each round's commit from its recorded inputs and compare.

    gradientmail verify URL [--rounds A:B] [--sample F] [--seed N] [--json]

Each round chosen is recomputed from the state its fragment started from and its recorded
contributions, through the one closer (``syncer/verify.py``), and reported ``verified``,
``mismatch`` (with the closer, and in an authenticated run the signed record that proves it) or
``unverifiable`` (with the reason: an input collected, or damaged). By default the rounds are the
run's verify window, the newest ``verify_window`` rounds, whose inputs garbage collection keeps.
Exit status: 0 when no round mismatches, 1 when one does, 2 on an error (no run, no store).
Nothing is written to the store; the contributions read are spooled in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from ..mailbox import Mailbox
from ..protocol.run import max_payload_bytes
from ..protocol.store import RunStore
from ..syncer.verify import MISMATCH, UNVERIFIABLE, VERIFIED, RoundCheck, RoundVerifier
from .overview import read_manifest, round_numbers

EXIT_MISMATCH = 1


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    v = sub.add_parser(
        "verify",
        parents=[common],
        help="recompute each round's commit from its recorded inputs (exit 1 if one does not match)",
        description="Recompute each round's commit from the state its fragment started from and its recorded "
        "contributions, and compare it bit for bit with the record: theta, outer state, change and digests. "
        "Exit 0 when no round mismatches, 1 when one does, 2 on an error.",
    )
    v.add_argument(
        "--rounds",
        type=_range,
        metavar="A:B",
        help="rounds A to B, both included ('A:' to the newest, ':B', or one round N); "
        "default: the run's verify window (its newest verify_window rounds)",
    )
    v.add_argument(
        "--sample", type=_fraction, default=1.0, metavar="F", help="verify this fraction of them, drawn at random"
    )
    v.add_argument("--seed", type=int, default=None, help="seed of the --sample draw (default: random)")
    v.add_argument("--json", action="store_true", help="one JSON object per round, then a summary line")


def _range(text: str) -> tuple[int | None, int | None]:
    a, sep, b = text.partition(":")
    try:
        lo = int(a) if a.strip() else None
        hi = (int(b) if b.strip() else None) if sep else lo
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B, A:, :B or N with round numbers, got {text!r}") from None
    if (lo is not None and lo < 0) or (hi is not None and hi < 0) or (lo is None and hi is None and not sep):
        raise argparse.ArgumentTypeError(f"expected round numbers >= 0, got {text!r}")
    if lo is not None and hi is not None and lo > hi:
        raise argparse.ArgumentTypeError(f"the first round is after the last: {text!r}")
    return lo, hi


def _fraction(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return v


def run(mailbox: Mailbox, args: argparse.Namespace, auth: Any) -> int:
    info = read_manifest(mailbox)
    store = RunStore(mailbox, auth=auth)
    store.limit_payloads(max_payload_bytes(info))
    rounds = round_numbers(mailbox)
    head = rounds[-1] if rounds else -1
    window = info.cfg.verify_window
    lo, hi = args.rounds if args.rounds is not None else (max(head - window + 1, 0), head)
    lo, hi = 0 if lo is None else lo, head if hi is None else min(hi, head)
    rng = random.Random(args.seed)
    chosen = [r for r in range(lo, hi + 1) if args.sample >= 1.0 or rng.random() < args.sample]
    out = _Output(args.json, args.url, info.manifest.run_id, oldest_kept=head - window + 1)
    verifier = RoundVerifier(store, info)
    checks: list[RoundCheck] = []
    try:
        with out.progress(len(chosen)) as advance:
            for r in chosen:
                t0 = time.process_time()
                check = verifier.check_round(r, head=head)
                out.round(check, time.process_time() - t0)
                checks.append(check)
                advance()
            out.flush()
    finally:
        verifier.close()
    counts = {s: sum(c.status == s for c in checks) for s in (VERIFIED, MISMATCH, UNVERIFIABLE)}
    first = next((c for c in checks if c.status == MISMATCH), None)
    out.summary(counts, first, rounds=(lo, hi), head=head, window=window, sampled=len(chosen))
    return EXIT_MISMATCH if first is not None else 0


class _Output:
    """Lines on stdout (a row per round, or JSON), a progress bar on stderr while it runs."""

    def __init__(self, as_json: bool, url: str, run_id: str, *, oldest_kept: int) -> None:
        self.as_json, self.url, self.run_id = as_json, url, run_id
        self.oldest_kept = oldest_kept  # the oldest round whose inputs garbage collection keeps
        # Consecutive rounds older than the window whose inputs are gone: one line for them all.
        self.collected: list[RoundCheck] = []
        self.outside = {VERIFIED: 0, UNVERIFIABLE: 0}

    def progress(self, total: int) -> Any:
        import contextlib

        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:  # rich is in the cli extra; without it, no bar
            return contextlib.nullcontext(lambda: None)

        @contextlib.contextmanager
        def bar() -> Any:
            console = Console(stderr=True)
            with Progress(
                TextColumn("[bold]verifying"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
                disable=not console.is_terminal,
            ) as p:
                task = p.add_task("rounds", total=total)

                def advance() -> None:
                    p.advance(task)
                    p.refresh()  # at once: a round can take seconds, the bar must not wait for a tick

                yield advance

        return bar()

    def round(self, c: RoundCheck, cpu: float) -> None:
        if c.round < self.oldest_kept and c.status in self.outside:
            self.outside[c.status] += 1
        if self.as_json:
            sys.stdout.write(json.dumps({**c.to_dict(), "cpu_seconds": round(cpu, 6)}, sort_keys=True) + "\n")
            sys.stdout.flush()
            return
        if c.round < self.oldest_kept and c.status == UNVERIFIABLE:
            # Older than the window: its inputs (or those its fragment's state is rebuilt from) were
            # collected, as garbage collection should. Said once for a whole span, not per round.
            if self.collected and self.collected[-1].round != c.round - 1:
                self.flush()
            self.collected.append(c)
            return
        self.flush()
        where = f"round {c.round:>6}  fragment {c.fragment}:v{c.version}  closer {c.closer}"
        why = f": {c.reason}" if c.reason else ""
        line = f"{where}  {c.status}{why}"
        if c.evidence:
            line += f" [evidence: {c.evidence}]"
        print(line, flush=True)

    def flush(self) -> None:
        """The line for the span of collected rounds held back, if any."""
        if not self.collected or self.as_json:
            return
        lo, hi = self.collected[0].round, self.collected[-1].round
        span = f"round {lo:>6}" if lo == hi else f"rounds {lo}-{hi}"
        print(
            f"{span}  unverifiable: older than the run's verify window, so garbage collection has removed "
            f"the inputs {'it' if lo == hi else 'they'} would be recomputed from (as it should; nothing is lost)",
            flush=True,
        )
        self.collected = []

    def summary(
        self,
        counts: dict[str, int],
        first: RoundCheck | None,
        *,
        rounds: tuple[int, int],
        head: int,
        window: int,
        sampled: int,
    ) -> None:
        lo, hi = rounds
        if self.as_json:
            doc = {
                "run_id": self.run_id,
                "head": head,
                "window": window,
                "rounds": [lo, hi] if hi >= lo else None,
                "checked": sampled,
                **counts,
                "first_mismatch": None if first is None else first.to_dict(),
            }
            sys.stdout.write(json.dumps({"summary": doc}, sort_keys=True) + "\n")
            return
        span = f"rounds {lo}-{hi}" if hi >= lo else "no round"
        print(
            f"{self.url} (run {self.run_id}): {sampled} round(s) checked of {span}, head {head}: "
            f"{counts[VERIFIED]} verified, {counts[MISMATCH]} mismatch, {counts[UNVERIFIABLE]} unverifiable"
        )
        kept, gone = self.outside[VERIFIED], self.outside[UNVERIFIABLE]
        if kept or gone:
            parts = [f"{gone} unverifiable for that reason"] if gone else []
            if kept:
                parts.append(f"{kept} verified while collection had not reached {'it' if kept == 1 else 'them'} yet")
            print(
                f"the run keeps the inputs of its newest {window} rounds (verify_window: rounds "
                f"{max(self.oldest_kept, 0)}-{head}); of the {kept + gone} older rounds checked, {' and '.join(parts)}"
            )
        if first is not None:
            proof = f"; evidence: {first.evidence}" if first.evidence else ""
            print(
                f"FIRST MISMATCH: round {first.round} (fragment {first.fragment} version {first.version}), "
                f"closed by {first.closer}: {first.reason}{proof}"
            )
