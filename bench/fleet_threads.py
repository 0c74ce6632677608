"""A fleet of real threads on one in-memory store: what each node reads, writes and waits per round.

Where ``bench/fleet.py`` drives its learners one at a time on fake clocks, here every learner is
a real ``gm.Session`` over ONE shared ``gm.MemoryMailbox``, on the system clock: the session's own
background thread runs ``Node.tick`` (all of the node's I/O), and a training thread per learner
trains a fake step (a small random update of its numpy parameters) every ``--step-ms`` and calls
``session.step``. So N learners are 2N threads contending for one store and one interpreter, as
they would on one machine. Each node reaches the store through its own counting wrapper (``Tap``):
LIST, GET, PUT and DELETE calls, bytes down and up, and the bytes of contribution payloads it
read (GETs of ``blobs/snapshots/...``), counted as "contributions' worth" (bytes over the mean
contribution payload size written in the run).

After ``--warmup`` committed rounds, the figures are cut at each round record's landing: the
requests and bytes of each node between two round records are that round's. The round's closer is
the node that wrote its record (checked against the record's ``closer``), the others are its
followers. A round's latency is the wall time from its first snapshot record landing to its round
record landing. The figures depend on the machine (threads share its cores, and a slow round
moves requests from one interval to the next): run it on a quiet one, and compare fleet sizes
from the same run.

    python bench/fleet_threads.py                          # 4 and 48 learners, 8 rounds, 100 ms steps
    python bench/fleet_threads.py --step-ms 20             # faster: 48 threads then outrun 2 cores
    python bench/fleet_threads.py --learners 4 16 --rounds 4 --json out.json
    python bench/fleet_threads.py --max-contributions 8    # DiLoCo(max_contributions=8)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradientmail_core as gm  # noqa: E402
from gradientmail_core import events as ev  # noqa: E402
from gradientmail_core.mailbox.contract import Chunk, Mailbox, close_stream  # noqa: E402
from gradientmail_core.mailbox.forwarding import ForwardingMailbox  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402

KINDS = ("LIST", "GET", "PUT", "DELETE")
FIELDS = (*KINDS, "down", "up", "contribution_down")


class Tap(ForwardingMailbox):
    """One node's path to the shared store: every request is counted (thread-safe; a node's
    session thread and its training thread may both come through), and the fleet hears of every
    record and contribution that lands."""

    def __init__(self, inner: Mailbox, name: str, fleet: Fleet) -> None:
        super().__init__(inner)
        self.name, self.fleet = name, fleet
        self.lock = threading.Lock()
        self.tally = dict.fromkeys(FIELDS, 0)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.tally)

    def _add(self, op: str | None = None, *, down: int = 0, up: int = 0, key: str = "") -> None:
        with self.lock:
            t = self.tally
            if op is not None:
                t[op] += 1
            t["down"] += down
            t["up"] += up
            if down and key.startswith(keys.SNAPSHOT_BLOBS):
                t["contribution_down"] += down

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._add("PUT", up=len(data))
        created = super().put_if_absent(key, data)
        if created:
            self.fleet.landed(self.name, key, data)
        return created

    def get(self, key: str) -> bytes | None:
        data = super().get(key)
        self._add("GET", down=len(data) if data is not None else 0, key=key)
        return data

    def get_prefix(self, key: str, n: int) -> bytes | None:
        data = super().get_prefix(key, n)
        self._add("GET", down=len(data) if data is not None else 0, key=key)
        return data

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        self._add("PUT")
        sent = [0]
        created = super().put_stream(key, self._passing(chunks, up=True, key=key, sent=sent), create_once=create_once)
        if created:
            self.fleet.landed(self.name, key, None, size=sent[0])
        return created

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        self._add("GET")
        stream = super().get_stream(key, part_size=part_size)
        return None if stream is None else self._passing(stream, up=False, key=key)

    def _passing(
        self, chunks: Iterable[Chunk], *, up: bool, key: str, sent: list[int] | None = None
    ) -> Iterator[Chunk]:
        it = iter(chunks)
        try:
            for chunk in it:
                n = memoryview(chunk).nbytes
                if up:
                    self._add(up=n)
                    if sent is not None:
                        sent[0] += n
                else:
                    self._add(down=n, key=key)
                yield chunk
        finally:
            close_stream(it)

    def list(self, prefix: str, after: str = "") -> list[str]:
        found = super().list(prefix, after)
        self._add("LIST", down=sum(len(k) for k in found))
        return found

    def delete(self, doomed: Iterable[str]) -> None:
        self._add("DELETE")
        super().delete(doomed)


@dataclass
class Landed:
    """A round record as it landed: when, by whom, and what it says."""

    round: int
    at: float
    writer: str
    closer: str | None
    participants: int | None
    tallies: dict[str, dict[str, int]]  # every node's counts at that moment (cumulative)


@dataclass
class Result:
    learners: int
    rounds: int
    max_contributions: int | None
    contribution_bytes: float
    follower_mean: dict
    follower_max: dict
    closer_mean: dict
    closer_max: dict
    max_worth: float  # the most contributions' worth any node read in one round
    latency: list[float]
    latency_median: float
    latency_max: float
    gather_median: float  # first snapshot record to the last one before the round record
    close_median: float  # that last snapshot record to the round record
    interval_median: float  # between consecutive round records
    closers: list[str]
    participants: list[int | None]
    nodes: dict[str, dict]  # every node's totals over the measured rounds
    events: dict[str, int]
    odd: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0


class Fleet:
    def __init__(
        self,
        n: int,
        *,
        max_contributions: int | None = None,
        sync_every: int = 20,
        fragments: int = 4,
        params: int = 8,
        width: int = 32,
        step_seconds: float = 0.02,
        poll_interval: float = 0.1,
    ) -> None:
        self.n, self.step_seconds = n, step_seconds
        self.cfg = gm.DiLoCo(
            sync_every=sync_every, fragments=fragments, quorum_size=n, max_contributions=max_contributions
        )
        self.store = gm.MemoryMailbox()
        self.lock = threading.Lock()
        self.first_snapshot: dict[int, float] = {}
        self.last_snapshot: dict[int, float] = {}
        self.landed_rounds: list[Landed] = []
        self.contribution_sizes: list[int] = []
        self.events: Counter[str] = Counter()
        self.committed = threading.Condition(self.lock)
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.names = [f"n{i:03d}" for i in range(n)]
        self.taps = {name: Tap(self.store, name, self) for name in self.names}
        self.sessions: list[gm.Session] = []
        self.models: list[dict[str, np.ndarray]] = []
        for i, name in enumerate(self.names):
            model = {
                f"w{j}": np.random.default_rng(j).standard_normal((width, width)).astype(np.float32)
                for j in range(params)
            }
            self.models.append(model)
            self.sessions.append(
                gm.Session(
                    model,
                    algorithm=self.cfg,
                    mailbox=self.taps[name],
                    learner_id=name,
                    poll_interval=poll_interval,
                    lease_timeout=120.0,
                    round_timeout=60.0,
                    callbacks=[self._event],
                    seed=i,
                )
            )
        self.threads: list[threading.Thread] = []

    def _event(self, e: ev.Event) -> None:
        with self.lock:
            self.events[type(e).__name__] += 1

    def landed(self, writer: str, key: str, data: bytes | None, size: int | None = None) -> None:
        now = time.perf_counter()
        if key.startswith(keys.SNAPSHOT_BLOBS):
            with self.lock:
                self.contribution_sizes.append(len(data) if data is not None else size or 0)
        elif (s := keys.parse_snapshot_key(key)) is not None:
            with self.lock:
                self.first_snapshot.setdefault(s[0], now)
                self.last_snapshot[s[0]] = now
        elif (r := keys.parse_round_key(key)) is not None:
            closer = participants = None
            try:
                record = json.loads(data or b"")
                closer, participants = record.get("closer"), len(record.get("participants") or [])
            except (ValueError, AttributeError):
                pass
            tallies = {name: tap.snapshot() for name, tap in self.taps.items()}
            with self.committed:
                self.landed_rounds.append(Landed(r, now, writer, closer, participants, tallies))
                self.committed.notify_all()

    # ---- running ------------------------------------------------------------------------

    def start(self) -> None:
        self.sessions[0].open()  # creates the run; the others join it
        for s in self.sessions[1:]:
            s.open()
        for i in range(self.n):
            t = threading.Thread(target=self._train, args=(i,), name=f"train-{self.names[i]}", daemon=True)
            self.threads.append(t)
        for t in self.threads:
            t.start()

    def _train(self, i: int) -> None:
        session, model = self.sessions[i], self.models[i]
        rng = np.random.default_rng(1000 + i)
        due = time.perf_counter()
        try:
            while not self.stop.is_set():
                for p in model.values():
                    p -= np.float32(0.01) * rng.standard_normal(p.shape).astype(np.float32)
                session.step(8)
                due = max(due + self.step_seconds, time.perf_counter())
                self.stop.wait(max(due - time.perf_counter(), 0.0))
        except BaseException as e:  # reported, and the wait below stops at once
            with self.committed:
                self.failures.append(f"{self.names[i]}: {type(e).__name__}: {e}")
                self.committed.notify_all()

    def wait_rounds(self, count: int, timeout: float) -> None:
        """Until ``count`` round records have landed in all."""
        deadline = time.perf_counter() + timeout
        with self.committed:
            while len(self.landed_rounds) < count and not self.failures:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"{len(self.landed_rounds)} of {count} rounds committed after {timeout:.0f} s")
                self.committed.wait(min(left, 1.0))
            if self.failures:
                raise RuntimeError("a learner failed: " + "; ".join(self.failures))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)
        for s in self.sessions:
            try:
                s.host.abort()  # stop its thread and leave, without waiting for rounds in flight
            except Exception as e:  # noqa: BLE001 (reported, not raised: the figures are taken)
                self.failures.append(f"abort: {type(e).__name__}: {e}")


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _diff(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a[k] - b[k] for k in FIELDS}


def measure(
    n: int, rounds: int, *, warmup: int = 2, max_contributions: int | None = None, timeout: float = 600.0, **kw: float
) -> Result:
    wall = time.perf_counter()
    fleet = Fleet(n, max_contributions=max_contributions, **kw)  # type: ignore[arg-type]
    try:
        fleet.start()
        fleet.wait_rounds(warmup + rounds, timeout)
    finally:
        fleet.finish()
    with fleet.lock:
        landed = list(fleet.landed_rounds[: warmup + rounds])
        sizes = list(fleet.contribution_sizes)
        first, last = dict(fleet.first_snapshot), dict(fleet.last_snapshot)
        events = dict(fleet.events)
    contribution = float(np.mean(sizes)) if sizes else float("nan")
    odd = list(fleet.failures)
    base = landed[warmup - 1].tallies if warmup else {name: dict.fromkeys(FIELDS, 0) for name in fleet.names}
    followers: list[dict[str, float]] = []
    closers: list[dict[str, float]] = []
    nodes = {name: dict.fromkeys(FIELDS, 0) for name in fleet.names}
    lat: list[float] = []
    gather: list[float] = []
    close: list[float] = []
    for rec in landed[warmup:]:
        if rec.closer is not None and rec.closer != rec.writer:
            odd.append(f"round {rec.round}: written by {rec.writer}, record says closer {rec.closer}")
        for name in fleet.names:
            d = _diff(rec.tallies[name], base[name])
            row = {**d, "requests": sum(d[k] for k in KINDS), "worth": d["contribution_down"] / contribution}
            (closers if name == rec.writer else followers).append(row)
            for k in FIELDS:
                nodes[name][k] += d[k]
        base = rec.tallies
        if rec.round in first:
            lat.append(rec.at - first[rec.round])
            gather.append(last[rec.round] - first[rec.round])
            close.append(rec.at - last[rec.round])
        else:
            odd.append(f"round {rec.round}: no snapshot record seen before it landed")
    nominal = fleet.step_seconds * fleet.cfg.sync_every / fleet.cfg.fragments  # a round every P-th of sync_every
    span = landed[max(warmup - 1, 0) :]  # the measured rounds and the one before them
    between = [b.at - a.at for a, b in zip(span, span[1:])]
    if between and _median(between) > 1.5 * nominal:
        odd.append(
            f"rounds every {_median(between):.2f} s (median) against {nominal:.2f} s by the schedule: the fleet fell "
            "behind its steps (the machine is saturated?), so per-round figures include the extra polls"
        )
    order = [r.round for r in landed]
    if order != sorted(order):
        odd.append(f"round records landed out of order: {order}")
    if events.get("BackgroundFailed") or events.get("StoreFailure") or events.get("GaveUp"):
        odd.append(f"events: {events}")

    def mean(rows: list[dict[str, float]]) -> dict:
        return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} if rows else {}

    def worst(rows: list[dict[str, float]]) -> dict:
        return {k: float(max(r[k] for r in rows)) for k in rows[0]} if rows else {}

    every = followers + closers
    return Result(
        learners=n,
        rounds=rounds,
        max_contributions=max_contributions,
        contribution_bytes=contribution,
        follower_mean=mean(followers),
        follower_max=worst(followers),
        closer_mean=mean(closers),
        closer_max=worst(closers),
        max_worth=max((r["worth"] for r in every), default=0.0),
        latency=lat,
        latency_median=_median(lat),
        latency_max=float(max(lat)) if lat else float("nan"),
        gather_median=_median(gather),
        close_median=_median(close),
        interval_median=_median(between),
        closers=[r.writer for r in landed[warmup:]],
        participants=[r.participants for r in landed[warmup:]],
        nodes=nodes,
        events=events,
        odd=odd,
        wall_seconds=time.perf_counter() - wall,
    )


# ---- reporting --------------------------------------------------------------------------


def _req(d: dict) -> str:
    return f"{d['LIST']:.1f} / {d['GET']:.1f} / {d['PUT']:.1f} / {d['DELETE']:.2f}"


def _kb(d: dict) -> str:
    return f"{d['down'] / 1e3:.1f} / {d['up'] / 1e3:.1f}"


def table(results: list[Result]) -> str:
    head = (
        "| learners | K | rounds | follower LIST / GET / PUT / DEL per round (mean) | follower KB down / up (mean) "
        "| follower contributions' worth (mean, worst) | worst follower requests, KB down "
        "| closer LIST / GET / PUT / DEL (mean) | closer KB down / up (mean) | closer contributions' worth "
        "(mean, worst) | round latency s (median, max) | of which gather, close s (median) "
        "| s between rounds (median) | closers | wall s |"
    )
    lines = [head, "| " + " | ".join(["---:"] * 15) + " |"]
    for r in results:
        f, fw, c, cw = r.follower_mean, r.follower_max, r.closer_mean, r.closer_max
        k = "-" if r.max_contributions is None else str(r.max_contributions)
        lines.append(
            f"| {r.learners} | {k} | {r.rounds} | {_req(f)} | {_kb(f)} | {f['worth']:.2f}, {fw['worth']:.2f} "
            f"| {fw['requests']:.0f}, {fw['down'] / 1e3:.1f} | {_req(c)} | {_kb(c)} | {c['worth']:.1f}, {cw['worth']:.1f} "
            f"| {r.latency_median:.2f}, {r.latency_max:.2f} | {r.gather_median:.2f}, {r.close_median:.2f} "
            f"| {r.interval_median:.2f} | {len(set(r.closers))} | {r.wall_seconds:.0f} |"
        )
    return "\n".join(lines)


def ratios(results: list[Result]) -> list[str]:
    """The largest fleet against the smallest: follower requests and bytes down, round latency."""
    out = [
        f"most contributions' worth any node read in a round: {r.learners} learners {r.max_worth:.2f}" for r in results
    ]
    if len(results) >= 2:
        a, b = results[0], results[-1]
        fa, fb = a.follower_mean, b.follower_mean
        out.append(
            f"{b.learners} vs {a.learners} learners: follower requests x{fb['requests'] / fa['requests']:.2f}, "
            f"follower bytes down x{fb['down'] / fa['down']:.2f}, "
            f"round latency (median) x{b.latency_median / a.latency_median:.2f}"
        )
    return out


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--learners", type=int, nargs="+", default=[4, 48])
    ap.add_argument("--rounds", type=int, default=8, help="committed rounds measured, after the warm-up (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="committed rounds before measuring (default 2)")
    ap.add_argument("--max-contributions", type=int, default=None, help="DiLoCo(max_contributions=K) (default None)")
    ap.add_argument(
        "--step-ms",
        type=float,
        default=100.0,
        help="milliseconds per training step (default 100: at 20, 48 learners on 2 cores fall behind the schedule)",
    )
    ap.add_argument("--poll", type=float, default=0.1, help="each session's poll interval, seconds (default 0.1)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per fleet size (default 600)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    print(
        f"DiLoCo(sync_every=20, fragments=4, quorum_size=N, max_contributions={args.max_contributions}), "
        f"8 x 32x32 fp32 tensors, a step every {args.step_ms:g} ms (a round every {args.step_ms * 5:g} ms), poll {args.poll:g} s, real threads over one "
        f"MemoryMailbox; {args.rounds} rounds after {args.warmup}",
        flush=True,
    )
    results = []
    for n in args.learners:
        r = measure(
            n,
            args.rounds,
            warmup=args.warmup,
            max_contributions=args.max_contributions,
            timeout=args.timeout,
            step_seconds=args.step_ms / 1e3,
            poll_interval=args.poll,
        )
        results.append(r)
        print(f"  {n} learners: {r.wall_seconds:.0f} s wall, closers {sorted(set(r.closers))}", flush=True)
        for line in r.odd:
            print(f"    odd: {line}", flush=True)
    print(table(results))
    for line in ratios(results):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return results


if __name__ == "__main__":
    main()
