"""``gradientmail cost``: what a run would cost per day on three object stores.

    gradientmail cost --params 7e9 --learners 1000 --sync-every 100 --fragments 8 \\
        --delta-dtype I2 --step-seconds 1

Requests by kind (PUT, GET, LIST, HEAD, DELETE), bytes uploaded, downloaded and stored, from the
protocol's model (``cli/bill.py``: idle polling included; ``--max-contributions K`` models the
bounded protocol of ``DiLoCo.max_contributions``), and their price on AWS S3
Standard, Cloudflare R2 Standard and Hugging Face Storage Buckets. Every price is a constant
below, with the page it was read from and the date; where no price was published, it says so and
a flag sets it. Given a run's URL, the config, the model's size, the fleet and the step time are read
from its manifest and round records (any flag given wins); otherwise nothing is read from a store and
the run need not exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from ..config import DiLoCo
from ..mailbox import Mailbox
from . import bill
from .overview import read_manifest, read_records, round_numbers, schema_size

# What ``gradientmail cost --help`` says (the module's docstring is for readers of the code).
DESCRIPTION = """\
What a run would cost per day on AWS S3 Standard, Cloudflare R2 and Hugging Face Storage Buckets:
requests by kind (PUT, GET, LIST, HEAD, DELETE), bytes uploaded, downloaded and stored, from a model
of the protocol (idle polling included), and their price on each store.

  gradientmail cost --params 7e9 --learners 1000 --sync-every 100 --fragments 8 \\
      --delta-dtype I2 --step-seconds 1
  gradientmail cost file:///tmp/run        the config, model size, fleet and step time of that run

Without a URL, --params, --learners, --sync-every, --fragments and --step-seconds are required and
nothing is read from a store. With one, they are read from the run's manifest and its newest round
records, and any flag given wins. The prices and the pages they were read from are printed at the end
(docs/cli.md, "cost")."""

# Flags that are DiLoCo fields of the same name: with a run URL, given ones override its config.
_CFG_FLAGS = (
    "sync_every",
    "fragments",
    "delta_dtype",
    "commit_dtype",
    "checkpoint_every",
    "verify_window",
    "max_contributions",
)
_REQUIRED = ("params", "learners", "sync_every", "fragments", "step_seconds")
# Round records read from a run for its fleet and step time (the newest ones).
_RECENT = 16

GIB = 1 << 30  # the price sheets' GB


@dataclass(frozen=True)
class Prices:
    name: str
    per_1000: dict[str, float]  # request kind -> USD per 1,000 requests
    gb_month: float  # USD per GB stored for a month
    egress: tuple[tuple[float, float], ...]  # (up to this many GB a month, USD per GB), in order
    source: str
    note: str


# Read 2026-12-02. AWS S3 Standard, US East (N. Virginia). The stored copy of
# https://aws.amazon.com/s3/pricing/ shows its price cells as unrendered templates, so: storage
# $0.023 per GB-month as quoted by https://cloudburn.io/blog/amazon-s3-pricing (2026-03-13); PUT,
# COPY, POST, LIST $0.005 per 1,000 as quoted by https://www.cloudkaramchari.com/blog/understanding-
# per-1000-put-copy-post-or-list-requests-in-amazon-s3-pricing/. Not confirmed from a page this
# time: GET and all other requests (HEAD) $0.0004 per 1,000 (the figure bench/requests.py already
# used), DELETE free, and data transfer out to the internet: the first 100 GB a month free, then
# $0.09 / $0.085 / $0.07 / $0.05 per GB over 10 / 40 / 100 / more TB a month. Check them before
# relying on the egress line.
S3 = Prices(
    "AWS S3 Standard",
    {"PUT": 0.005, "LIST": 0.005, "GET": 0.0004, "HEAD": 0.0004, "DELETE": 0.0},
    0.023,
    ((100, 0.0), (10 * 1024, 0.09), (50 * 1024, 0.085), (150 * 1024, 0.07), (math.inf, 0.05)),
    "aws.amazon.com/s3/pricing (cells unrendered), cloudburn.io, cloudkaramchari.com; read 2026-12-02",
    "GET and egress prices not confirmed from a page",
)
# Read 2026-12-02 from https://developers.cloudflare.com/r2/pricing/ (cloudflare-docs
# src/content/docs/r2/pricing.mdx): Standard storage $0.015 / GB-month; Class A (PutObject,
# ListObjects, CreateMultipartUpload, UploadPart, CompleteMultipartUpload) $4.50 per million; Class
# B (GetObject, HeadObject) $0.36 per million; DeleteObject free; egress free. The free tier (10
# GB-month, 1 M Class A, 10 M Class B a month) is left out.
R2 = Prices(
    "Cloudflare R2",
    {"PUT": 0.0045, "LIST": 0.0045, "GET": 0.00036, "HEAD": 0.00036, "DELETE": 0.0},
    0.015,
    ((math.inf, 0.0),),
    "developers.cloudflare.com/r2/pricing; read 2026-12-02",
    "free tier left out",
)
# Read 2026-12-02. Hugging Face Storage Buckets: https://huggingface.co/docs/hub/storage-buckets
# sends to hf.co/storage for prices, which we could not read. https://huggingface.co/docs/hub/storage-limits
# prices private storage above the plan's included TB at $25/TB/month (in 1 TB increments): the
# default of --hf-tb-month. No per-request or egress price was found (none is charged as far as
# the pages say), but the Hub's rate limits apply (docs/hub/rate-limits; e.g. 3,000 API requests
# per 5 minutes for a Team organization): whether they cover a bucket's S3 API is not stated.
HF_TB_MONTH = 25.0


def hf_prices(tb_month: float) -> Prices:
    return Prices(
        "Hugging Face Buckets",
        dict.fromkeys(bill.KINDS, 0.0),
        tb_month * GIB / 1e12,  # a TB of 10^12 bytes, priced per GB of 2^30
        ((math.inf, 0.0),),
        "huggingface.co/docs/hub/storage-limits (hf.co/storage unread); read 2026-12-02",
        "no request or egress price published; rate limits may apply",
    )


def egress_per_day(gb_per_day: float, tiers: tuple[tuple[float, float], ...]) -> float:
    """USD a day for ``gb_per_day`` of egress, billed in monthly tiers (30 days)."""
    left, below, usd = gb_per_day * 30, 0.0, 0.0
    for upto, price in tiers:
        take = min(left, upto - below)
        usd += take * price
        left -= take
        below = upto
        if left <= 0:
            break
    return usd / 30


def price_day(d: bill.Day, p: Prices, *, egress_share: float) -> dict[str, float]:
    requests = sum(d.traffic.requests[k] / 1000 * p.per_1000[k] for k in bill.KINDS)
    storage = d.stored / GIB * p.gb_month / 30
    egress = egress_per_day(d.traffic.down * egress_share / GIB, p.egress)
    return {"requests": requests, "storage": storage, "egress": egress, "total": requests + storage + egress}


def add_parser(sub: argparse._SubParsersAction) -> None:
    arguments(
        sub.add_parser(
            "cost",
            help="requests, bytes and USD per day of a run's config on S3, R2, HF",
            description=DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", help="a run's mailbox, to read its config, size, fleet and step time from")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint (R2, MinIO, moto), for s3:// URLs")
    p.add_argument("--region", help="S3 region, for s3:// URLs")
    p.add_argument("--secret-file", help="the run secret of an authenticated run")
    p.add_argument("--params", type=float, help="model parameters (e.g. 7e9)")
    p.add_argument("--learners", type=int, help="learners in the fleet")
    p.add_argument("--sync-every", type=int, help="DiLoCo sync_every (H)")
    p.add_argument("--fragments", type=int, help="DiLoCo fragments (P)")
    p.add_argument("--step-seconds", type=float, help="seconds per training step")
    p.add_argument("--delta-dtype", help="DiLoCo delta_dtype (F32, BF16, F16, F8_E4M3, F4, I2)")
    p.add_argument("--commit-dtype", help="DiLoCo commit_dtype (the quantized change the followers read)")
    p.add_argument("--checkpoint-every", type=int, help="DiLoCo checkpoint_every (default 1)")
    p.add_argument("--verify-window", type=int, help="DiLoCo verify_window (default: DiLoCo's)")
    p.add_argument(
        "--max-contributions",
        type=int,
        help="DiLoCo max_contributions (K: the closer merges at most K a round, followers poll only the "
        "round records and the claimant's lease; default none: every contribution, every listing)",
    )
    p.add_argument("--param-dtype", help="the published parameters' dtype (default BF16, or the run's)")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between polls (default 1)")
    p.add_argument("--lease-timeout", type=float, default=120.0, help="seconds (default 120)")
    p.add_argument(
        "--egress-share",
        type=float,
        default=1.0,
        help="share of the bytes read that leave the store's network, billed as egress (default 1: "
        "every node outside it)",
    )
    p.add_argument("--hf-tb-month", type=float, default=HF_TB_MONTH, help="HF bucket USD per TB-month (default 25)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the tables")


@dataclass(frozen=True)
class RunFacts:
    """What ``cost URL`` read from a run: its config, model and fleet."""

    cfg: DiLoCo
    params: int
    param_dtype: str
    learners: int | None  # the most learners live at a close among the newest records
    step_seconds: float | None  # the newest record's step-time estimate
    rounds_read: int
    where: str


def from_run(args: argparse.Namespace, mailbox: Mailbox) -> None:
    """Read the run at ``args.url`` into ``args.run`` (``RunFacts``) for ``shape_of``."""
    run = read_manifest(mailbox)
    size = schema_size(run)
    by_dtype: dict[str, int] = {}
    for t in run.schema:
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + math.prod(t.shape)
    recent = read_records(mailbox, round_numbers(mailbox)[-_RECENT:])
    live = max((max(r.live, len(r.participants)) for r in recent), default=0)
    steps = [r.x_step for r in recent if r.x_step]
    args.run = RunFacts(
        cfg=run.cfg,
        params=size.parameters,
        param_dtype=max(by_dtype, key=lambda d: by_dtype[d]),
        learners=live or None,
        step_seconds=steps[-1] if steps else None,
        rounds_read=len(recent),
        where=f"{args.url} (run {run.manifest.run_id})",
    )


def shape_of(args: argparse.Namespace) -> bill.RunShape:
    """The run the flags describe, or the run read by ``from_run`` with the flags given over it
    (``DiLoCo`` validates the config as a run would)."""
    facts: RunFacts | None = getattr(args, "run", None)
    if facts is None:
        missing = [f"--{name.replace('_', '-')}" for name in _REQUIRED if getattr(args, name) is None]
        if missing:
            raise ValueError(
                f"missing {', '.join(missing)}: give a run's URL (gradientmail cost file:///path/to/run) to read "
                "them from the run, or every one of --params, --learners, --sync-every, --fragments, --step-seconds"
            )
    else:
        for name, got in (("learners", facts.learners), ("step_seconds", facts.step_seconds)):
            if getattr(args, name) is None and got is None:
                flag = f"--{name.replace('_', '-')}"
                raise ValueError(
                    f"the run at {facts.where} has committed no round yet, so its {name.replace('_', ' ')} is "
                    f"unknown: pass {flag}"
                )
    if not 0.0 <= args.egress_share <= 1.0:
        raise ValueError(f"--egress-share {args.egress_share}: expected a share in [0, 1]")
    given = {name: getattr(args, name) for name in _CFG_FLAGS if getattr(args, name) is not None}
    if facts is None:
        cfg = DiLoCo(**given)
    else:
        cfg = dataclasses.replace(facts.cfg, **given)
    params = args.params if args.params is not None else facts.params  # type: ignore[union-attr]
    if int(params) != params:
        raise ValueError(f"--params {params}: expected a whole number of parameters")

    def pick(name: str, default: Any) -> Any:
        value = getattr(args, name)
        return default if value is None else value

    return bill.RunShape(
        cfg=cfg,
        params=int(params),
        learners=pick("learners", facts.learners if facts else None),
        step_seconds=pick("step_seconds", facts.step_seconds if facts else None),
        poll_interval=args.poll_interval,
        lease_timeout=args.lease_timeout,
        param_dtype=pick("param_dtype", facts.param_dtype if facts else "BF16"),
    )


def _n(x: float) -> str:
    for unit, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= k:
            return f"{x / k:.2f}{unit}"
    return f"{x:.1f}"


def _b(x: float) -> str:
    for unit, k in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= k:
            return f"{x / k:.2f} {unit}"
    return f"{x:.0f} B"


def _cap(cfg: DiLoCo) -> str:
    return "" if cfg.max_contributions is None else f", max_contributions={cfg.max_contributions}"


def _requests(t: bill.Traffic) -> str:
    r = t.requests
    return (
        f"PUT {_n(r['PUT'])}  GET {_n(r['GET'])}  LIST {_n(r['LIST'])} ({_n(t.list_calls)} listings)  "
        f"HEAD {_n(r['HEAD'])}  DELETE {_n(r['DELETE'])}"
    )


def run(args: argparse.Namespace) -> int:
    shape = shape_of(args)
    d = bill.day(shape)
    stores = (S3, R2, hf_prices(args.hf_tb_month))
    priced = {p.name: price_day(d, p, egress_share=args.egress_share) for p in stores}
    if args.json:
        out = {
            "rounds_per_day": d.rounds,
            "max_contributions": shape.cfg.max_contributions,
            "requests": d.traffic.requests,
            "listings": d.traffic.list_calls,
            "bytes_up": d.traffic.up,
            "bytes_down": d.traffic.down,
            "bytes_stored": d.stored,
            "tape_growth": d.tape_growth,
            "usd_per_day": priced,
            "sources": {p.name: p.source for p in stores},
        }
        print(json.dumps(out, indent=1, sort_keys=True))
        return 0
    cfg = shape.cfg
    facts: RunFacts | None = getattr(args, "run", None)
    if facts is not None:
        print(
            f"from the run at {facts.where}: its manifest's config and schema, and from its newest "
            f"{facts.rounds_read} round record(s) the learners live at a close and the step-time estimate "
            "(flags given win; polls and lease timeout are the nodes' options, not in the run: the flags' defaults)"
        )
    print(
        f"{shape.learners} learners, {_n(shape.params)} parameters ({shape.param_dtype}) in {cfg.fragments} fragments "
        f"of {shape.chunks} chunk(s), sync_every={cfg.sync_every}, delta {cfg.delta_dtype or shape.param_dtype}, "
        f"commit {cfg.commit_dtype or shape.param_dtype}, checkpoint_every={cfg.checkpoint_every}, "
        f"verify_window={cfg.verify_window}{_cap(cfg)}; {shape.step_seconds:g} s steps, "
        f"polls every {shape.poll_interval:g} s"
    )
    print(f"a round every {shape.round_seconds:g} s: {d.rounds:.0f} rounds a day\n")
    one = "one follower, per round" if shape.capped else "one learner, per round"
    for who, t in ((one, d.learner), ("the closer, per round", d.closer)):
        print(f"{who:<24} {_requests(t)}; up {_b(t.up)}, down {_b(t.down)}")
    t = d.traffic
    print(f"{'the fleet, per day':<24} {_requests(t)}; up {_b(t.up)}, down {_b(t.down)}")
    print(f"{'stored (mean)':<24} {_b(d.stored)}; the tape grows {_b(d.tape_growth)} a day\n")
    print(f"USD per day (egress: {args.egress_share:.0%} of the bytes read)")
    print(f"  {'store':<22} {'requests':>12} {'storage':>10} {'egress':>12} {'total':>12}   note")
    for p in stores:
        c = priced[p.name]
        print(
            f"  {p.name:<22} {c['requests']:>12,.2f} {c['storage']:>10,.2f} {c['egress']:>12,.2f} "
            f"{c['total']:>12,.2f}   {p.note}"
        )
    print("\nprices: " + "; ".join(f"{p.name}: {p.source}" for p in stores))
    return 0
