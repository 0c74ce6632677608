"""``gradientmail syncer URL --id NAME``: a node that trains nothing and only closes rounds
(``gm.Syncer``), with one line per round it closes. Stops cleanly, releasing its lease, on
SIGINT or SIGTERM.

It never creates a run: started before the learners, it waits for the manifest and says so.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any, TextIO

from .. import events as ev
from ..mailbox import Mailbox, open_mailbox
from ..syncer.options import NodeOptions

_DEFAULT = NodeOptions()
# The node's options this command takes as flags, each named as the option is (``--poll-interval``:
# ``poll_interval``) and handed to ``gm.Syncer`` by that name; the common parser's --secret-file too.
_TIMES = (
    ("poll_interval", "seconds between polls"),
    ("lease_timeout", "seconds without a lease renewal after which a node counts as gone (as the learners use)"),
    (
        "round_timeout",
        "seconds without a commit of the open round after which it is taken over, at the least (the wait also "
        "grows with the round times the records predict)",
    ),
)
_OPTIONS = (*(name for name, _ in _TIMES), "compression", "secret_file", "identity")


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "syncer",
        parents=[common],
        help="close the run's rounds without training (a node next to the store)",
        description=(
            "Join the run at URL as a syncer: a node that closes rounds (merges the learners' "
            "contributions and commits) and trains nothing. Learners started with role='learner' "
            "never close rounds themselves. Runs until interrupted (SIGINT/SIGTERM), then releases "
            "its lease."
        ),
    )
    s.add_argument("--id", dest="syncer_id", required=True, metavar="NAME", help="this syncer's id ([a-z0-9-])")
    for name, what in _TIMES:
        flag = "--" + name.replace("_", "-")
        default = getattr(_DEFAULT, name)
        shown = "max(30, 10 x --poll-interval)" if default is None else f"{default:g}"
        s.add_argument(flag, type=_positive_float, default=default, metavar="S", help=f"{what} (default {shown})")
    s.add_argument(
        "--compression", choices=("off", "zstd"), default=_DEFAULT.compression, help="compression of the commits"
    )
    s.add_argument("--identity", metavar="FILE", help="this node's key file, for a members-only run")


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return v


class _Lines:
    """The syncer's events as one line each: a line per round it closes, and what it waits for."""

    def __init__(self, out: TextIO, url: str) -> None:
        self.out, self.url = out, url
        self.participants: dict[int, tuple[str, ...]] = {}

    def __call__(self, e: ev.Event) -> None:
        line = self.line(e)
        if line is not None:
            print(line, file=self.out, flush=True)

    def line(self, e: ev.Event) -> str | None:
        if isinstance(e, ev.WaitingForRun):
            return f"{e.learner}: no run at {self.url} yet ({e.where}); waiting for a learner to create it"
        if isinstance(e, ev.Joined):
            head = f"round {e.round}" if e.round >= 0 else "no round committed yet"
            return f"{e.learner}: joined the run ({head}; {e.live} live learner{'s' if e.live != 1 else ''})"
        if isinstance(e, ev.RoundClosed):
            self.participants[e.round] = e.participants
            return None
        if isinstance(e, ev.Committed):
            who = self.participants.pop(e.round, ())
            return (
                f"round {e.round}  fragment {e.fragment} v{e.version}  contributors {len(who)}: "
                f"{', '.join(who) or '-'}  {e.bytes_written} bytes written"
            )
        if isinstance(e, ev.TookOver):
            was = f" from {e.previous}" if e.previous else ""
            return f"{e.learner}: took round {e.round} over{was} ({e.reason})"
        if isinstance(e, ev.Superseded):
            return f"{e.learner}: round {e.round} was committed by {e.by}; following it"
        if isinstance(e, ev.ContributionRejected):
            return f"{e.learner}: round {e.round}: rejected {e.contributor} ({e.reason})"
        if isinstance(e, ev.StoreFailure | ev.BackgroundFailed):
            return f"{e.learner}: {type(e).__name__}: {' '.join(str(getattr(e, 'error', '')).split())[:300]}"
        if isinstance(e, ev.Left):
            return f"{e.learner}: left the run at round {e.round} (lease released)"
        return None


def _open(url: str, endpoint_url: str | None, region: str | None) -> Mailbox:
    # Unlike the reading commands, a file:// directory that does not exist yet is fine: the
    # syncer waits there for the learners to create the run.
    options = {k: v for k, v in (("endpoint_url", endpoint_url), ("region", region)) if v is not None}
    return open_mailbox(url, **options)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from ..syncer.standalone import Syncer

    mailbox = _open(args.url, args.endpoint_url, args.region)
    options = {name: getattr(args, name) for name in _OPTIONS}
    syncer = Syncer(mailbox, syncer_id=args.syncer_id, callbacks=[_Lines(out, args.url)], **options)

    def stop(signum: int, frame: Any) -> None:
        syncer.stop()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        syncer.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
