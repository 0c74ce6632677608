"""``gradientmail``: watch and inspect a run from its mailbox.

    gradientmail status URL                 the run at a glance
    gradientmail watch URL                  the same, live
    gradientmail rounds URL [--from N]      the tape, as a table or JSON lines
    gradientmail plot URL -o run.png        participants, cosine, timings, throughput per round
    gradientmail export URL -o model.safetensors
    gradientmail verify URL [--rounds A:B] [--sample F] [--json]   recompute commits from their inputs
    gradientmail syncer URL --id NAME       a node that only closes rounds (runs until interrupted)
    gradientmail members list|add|remove URL [--owner-key F] [PUBKEY...]   who may join (members-only runs)
    gradientmail members key --identity F    a node's public key
    gradientmail cost [URL] [--params N --learners N --sync-every H --fragments P --step-seconds S ...]
                                            requests, bytes and USD per day on S3, R2, HF buckets
    gradientmail --version

URL is ``file:///path``, ``s3://bucket/prefix`` (with ``--endpoint-url`` for R2, MinIO...) or
``memory://name`` (tests). In an authenticated run (``--secret-file``, or a members-only run's
signatures) every record read is checked as the nodes check it, and one that fails is reported,
never shown as a commit. Every command only reads, but ``members add|remove`` (one entry of a
members-only run's membership log, ``gradientmail members --help``) and ``syncer`` (a node of the
run: its lease and the commits of the rounds it closes). ``rich`` and ``matplotlib`` (the ``cli``
extra) are imported by the commands that use them, so ``--help`` and ``rounds --json`` need
neither.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from ..errors import GradientMailError, MailboxUnavailable, MissingExtra, ProtocolError, RecordInvalid
from ..mailbox import Mailbox, open_mailbox
from ..protocol.keys import MANIFEST
from .overview import NoRun

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("url", help="the run's mailbox: file:///path, s3://bucket/prefix or memory://name")
    common.add_argument("--endpoint-url", help="S3-compatible endpoint (R2, MinIO, moto), for s3:// URLs")
    common.add_argument("--region", help="S3 region, for s3:// URLs")
    common.add_argument(
        "--secret-file", help="the run secret of an authenticated run (objects without its tag are ignored)"
    )

    p = argparse.ArgumentParser(prog="gradientmail", description="Watch and inspect a gradientmail run.")
    p.add_argument("--version", action="version", version=f"gradientmail {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "status",
        parents=[common],
        help="the run at a glance",
        description="The run at a glance: its config and schema, the rounds committed, the open round and who "
        "closes it (or that the run is idle), the learners holding a lease and the last rounds. One look; "
        "`gradientmail watch` refreshes it.",
    )
    s.add_argument("--last", type=_positive, default=8, metavar="N", help="rounds to show (default 8)")

    w = sub.add_parser(
        "watch",
        parents=[common],
        help="the run at a glance, refreshing live",
        description="`gradientmail status`, refreshed every --interval seconds, with a bar of the rounds "
        "committed. On a terminal it redraws in place; piped or redirected it prints one line per refresh, "
        "and the whole status once more when it stops (SIGINT, SIGTERM, --iterations).",
    )
    w.add_argument("--last", type=_positive, default=8, metavar="N", help="rounds to show (default 8)")
    w.add_argument(
        "--interval", type=_positive_float, default=2.0, metavar="S", help="seconds between refreshes (default 2)"
    )
    w.add_argument(
        "--total", type=_positive, metavar="ROUNDS", help="rounds the run is expected to commit (for the bar)"
    )
    stop = w.add_mutually_exclusive_group()
    stop.add_argument("--once", action="store_true", help="draw one frame and exit")
    stop.add_argument("--iterations", type=_positive, metavar="N", help="exit after N refreshes")

    r = sub.add_parser("rounds", parents=[common], help="the committed rounds (the tape)")
    r.add_argument("--from", dest="start", type=_nonneg, default=0, metavar="N", help="first round to show")
    r.add_argument("--json", action="store_true", help="one JSON record per line instead of a table")

    pl = sub.add_parser("plot", parents=[common], help="per-round charts saved to a PNG")
    pl.add_argument("-o", "--output", required=True, metavar="FILE.png")
    pl.add_argument("--from", dest="start", type=_nonneg, default=0, metavar="N", help="first round to plot")

    e = sub.add_parser("export", parents=[common], help="the newest committed parameters as safetensors")
    e.add_argument("-o", "--output", required=True, metavar="FILE.safetensors")

    from .verify import add_parser as add_verify

    add_verify(sub, common)

    from .syncer import add_parser as add_syncer

    add_syncer(sub, common)

    from .members import add_parser

    add_parser(sub)

    from .cost import add_parser as add_cost

    add_cost(sub)
    return p


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return v


def _nonneg(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return v


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return v


def version() -> str:
    """The installed distribution's version (the package's own when it runs from a checkout)."""
    from importlib import metadata

    try:
        return metadata.version("gradientmail")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        package = sys.modules.get(__name__.partition(".")[0])
        return str(getattr(package, "__version__", "unknown"))


def open_url(url: str, *, endpoint_url: str | None = None, region: str | None = None) -> Mailbox:
    """Open a mailbox URL for reading. A ``file://`` directory that does not exist is ``NoRun``
    (opening a ``FileMailbox`` would create it, and a read-only tool must not)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    options: dict[str, Any] = {}
    if scheme == "s3":
        options = {k: v for k, v in (("endpoint_url", endpoint_url), ("region", region)) if v is not None}
    elif endpoint_url or region:
        raise ValueError("--endpoint-url and --region apply to s3:// URLs only")
    if scheme == "file":
        host = "" if parts.netloc in ("", "localhost") else parts.netloc
        if host + parts.path and not os.path.isdir(host + parts.path):
            raise NoRun(f"the directory {host + parts.path!r} does not exist")
    return open_mailbox(url, **options)


def _explain(url: str, e: BaseException) -> str:
    """One line: what went wrong, and what to do about it."""
    first = " ".join(str(e).split())
    if isinstance(e, NoRun):
        return f"no run at {url}: {first}. Check the URL and prefix, or start a learner to create the run."
    if isinstance(e, MailboxUnavailable):
        return (
            f"cannot reach the store at {url}: {first.split('. The store is')[0]}. "
            "Check the URL, --endpoint-url, the network and the credentials."
        )
    if isinstance(e, RecordInvalid):
        return f"cannot read the run at {url}: {first}"
    if isinstance(e, ProtocolError):
        return f"the run at {url} is not readable: {first}. Was it written by another gradientmail version?"
    if isinstance(e, MissingExtra):
        return first
    return f"{url}: {first}" if url else first


def _is_authenticated(mailbox: Mailbox) -> bool:
    import json

    data = mailbox.get(MANIFEST)
    try:
        return data is not None and json.loads(data).get("mac") is not None
    except (ValueError, AttributeError):
        return False


def _guarded(mailbox: Mailbox, secret_file: str | None) -> tuple[Mailbox, Any]:
    """The run as its nodes read it: tagged keys translated and unauthenticated objects hidden (a
    run secret), every record checked against the secret's MACs and a members-only run's
    signatures (``MemberAuth``, which reads open runs as they are). Returns the guarded mailbox and
    the policy the commands check records with; the manifest, if any, is verified here."""
    from ..protocol.auth import policy
    from ..protocol.guard import GuardedMailbox
    from ..protocol.members import MemberAuth
    from ..protocol.records import Manifest
    from ..protocol.store import RunStore
    from ..workqueue.keys import is_known

    auth = MemberAuth(policy(None, secret_file))
    guarded = GuardedMailbox(mailbox, auth=auth, known=is_known)  # status lists the work queues too
    if guarded.get(MANIFEST) is not None:  # (none: the command says there is no run)
        RunStore(guarded, auth=auth).read_record(MANIFEST, Manifest)  # verifies it, binds the run key
    return guarded, auth


def _parse_alone(
    command: str,
    doc: str | None,
    arguments: Callable[[argparse.ArgumentParser], None],
    argv: list[str],
    *,
    intermixed: bool = False,
) -> argparse.Namespace:
    """``gradientmail COMMAND ...`` by the command's own parser, for the commands that the common
    one does not fit (``cost`` takes no URL; ``members`` takes its public keys among the options)."""
    p = argparse.ArgumentParser(
        prog=f"gradientmail {command}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    arguments(p)
    args = p.parse_intermixed_args(argv) if intermixed else p.parse_args(argv)
    args.command = command
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # The reader went away (``gradientmail rounds --json | head -1``): what it wanted was
        # printed. Point stdout at /dev/null so that the interpreter's last flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _main(argv: list[str]) -> int:
    if argv[:1] == ["cost"]:  # a model of a run's config: the flags, or a run's manifest and records
        from . import cost

        args = _parse_alone("cost", cost.DESCRIPTION, cost.arguments, argv[1:])
        try:
            if args.url is not None:
                mailbox = open_url(args.url, endpoint_url=args.endpoint_url, region=args.region)
                mailbox, _ = _guarded(mailbox, args.secret_file)
                cost.from_run(args, mailbox)
            return cost.run(args)
        except BrokenPipeError:
            raise  # (an OSError: ``main`` ends quietly)
        except (GradientMailError, ValueError, OSError) as e:
            print(f"gradientmail cost: error: {_explain(args.url or '', e)}", file=sys.stderr)
            return EXIT_USAGE
    if argv[:1] == ["members"]:  # options and public keys in any order
        from . import members

        args = _parse_alone("members", members.DESCRIPTION, members.arguments, argv[1:], intermixed=True)
    else:
        args = _parser().parse_args(argv)
    from . import commands

    if args.command == "syncer":  # joins the run (writes its lease and the commits), unlike the others
        from . import syncer

        try:
            return syncer.run(args)
        except BrokenPipeError:
            raise  # (an OSError: ``main`` ends quietly)
        except (GradientMailError, ValueError, OSError) as e:
            print(f"gradientmail syncer: error: {_explain(args.url, e)}", file=sys.stderr)
            return EXIT_USAGE
    if args.command == "members":  # the one command that writes (one entry of the membership log)
        from . import members

        try:
            return members.run(args, open_url)
        except BrokenPipeError:
            raise  # (an OSError: ``main`` ends quietly)
        except (GradientMailError, ValueError, OSError) as e:
            print(f"gradientmail members {args.action}: error: {_explain(args.url or '', e)}", file=sys.stderr)
            return EXIT_USAGE
    try:
        mailbox = open_url(args.url, endpoint_url=args.endpoint_url, region=args.region)
        if not args.secret_file and _is_authenticated(mailbox):
            raise ValueError(
                "this run is authenticated (its manifest is signed): pass --secret-file with the run secret"
            )
        mailbox, args.auth = _guarded(mailbox, args.secret_file)
        return int(getattr(commands, args.command)(mailbox, args) or 0)
    except BrokenPipeError:
        raise
    except (GradientMailError, ValueError, OSError) as e:
        print(f"gradientmail {args.command}: error: {_explain(args.url, e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


__all__ = ["main", "open_url"]
