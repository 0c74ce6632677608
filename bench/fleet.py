"""A fleet of learners on one simulated store: what each node reads, writes and waits per round.

Drives N learners (``Node`` + ``Learner`` each, single-threaded, helper in ``_cluster.py``) over
one ``MemoryMailbox``. Every node reaches the store through its own ``Link``: each request costs
``latency`` seconds plus its bytes over ``bandwidth`` on that node's own fake clock, as the
simulation's injected latency does, and is counted by kind. An event queue in simulated time
decides who acts next: a training step every ``step_seconds``, a poll every ``poll_interval``
after the previous one ended (a poll that spent 3 s in requests starts its next one 3 s later).
A node's poll is atomic: its writes are visible to the others from the poll's start, its clock
moves by what its requests cost. So the figures are exact counts and simulated seconds, the same
on every machine; only the closer's CPU time and peak memory (``tracemalloc`` over its polls)
are measured on this one.

Per committed round, for the closer and for the followers (mean and worst): each request kind
(LIST calls, and LIST pages of 1,000 keys as S3 and R2 bill them; GET, PUT, DELETE), bytes up
and down, contribution payload bytes read (in contributions' worth), and the round's latency
from its first snapshot record landing to its record landing.

    python bench/fleet.py                        # 4, 16, 64, 256, 1024 learners
    python bench/fleet.py --learners 4 16 --rounds 6
    python bench/fleet.py --quick                # 4 and 16 learners, 4 rounds
    python bench/fleet.py --plot fleet.png       # also the figures against the fleet size
    python bench/fleet.py --load a.json b.json --plot fleet.png   # earlier --json runs together
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
import tracemalloc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cluster import Member, join  # noqa: E402

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.mailbox.contract import Chunk, Mailbox, close_stream  # noqa: E402
from gradientmail_core.mailbox.forwarding import ForwardingMailbox  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.syncer.options import NodeOptions  # noqa: E402

LIST_PAGE = 1000  # keys per page of a ListObjectsV2 answer (S3, R2): each page is a billed request
KINDS = ("LIST", "LIST pages", "GET", "PUT", "DELETE")


@dataclass
class Tally:
    """What one node asked of the store since the last reset."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    up: int = 0
    down: int = 0
    contribution_down: int = 0  # bytes of other learners' snapshot payloads read
    busy: float = 0.0  # simulated seconds spent in requests
    election: int = 0  # requests about claims (LIST and PUT under claims/) and single leases


class Link(ForwardingMailbox):
    """One node's path to the store: every request costs ``latency + bytes / bandwidth`` on the
    node's clock (slept, as ``FaultyMailbox``'s latency is) and is tallied; the fleet hears of
    snapshot records and round records as they land (``on_write``)."""

    def __init__(self, inner: Mailbox, clock: gm.FakeClock, *, latency: float, bandwidth: float, fleet: Fleet):
        super().__init__(inner)
        self.clock, self.latency, self.bandwidth, self.fleet = clock, latency, bandwidth, fleet
        self.tally = Tally()

    def _cost(self, op: str, nbytes: int = 0, *, up: bool = False, key: str = "") -> None:
        self.tally.counts[op] += 1
        self._move(nbytes, up=up, key=key, seconds=self.latency)

    def _move(self, nbytes: int, *, up: bool, key: str, seconds: float = 0.0) -> None:
        """``nbytes`` moved up or down (a contribution's if ``key`` is one), on this node's clock."""
        t = self.tally
        if up:
            t.up += nbytes
        else:
            t.down += nbytes
            if key.startswith(keys.SNAPSHOT_BLOBS):
                t.contribution_down += nbytes
        seconds += nbytes / self.bandwidth
        t.busy += seconds
        self.clock.sleep(seconds)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._cost("PUT", len(data), up=True)
        self.tally.election += key.startswith(keys.CLAIMS)
        if key.startswith(keys.SNAPSHOT_BLOBS):
            self.fleet.contribution_sizes.append(len(data))
        created = super().put_if_absent(key, data)
        if created:
            self.fleet.landed(key, self.clock.now())
        return created

    def get(self, key: str) -> bytes | None:
        data = super().get(key)
        self._cost("GET", len(data) if data is not None else 0, key=key)
        return data

    def get_many(self, wanted: list[str]) -> list[bytes | None]:
        """GETs issued together (``read_many``, as a store that runs reads at once serves them):
        each is counted, the batch costs one round trip plus all its bytes over the bandwidth."""
        found = [super(Link, self).get(k) for k in wanted]
        for k, data in zip(wanted, found, strict=True):
            self.tally.counts["GET"] += 1
            self._move(len(data) if data is not None else 0, up=False, key=k)
        if wanted:
            self.tally.busy += self.latency
            self.clock.sleep(self.latency)
        return found

    def get_prefix(self, key: str, n: int) -> bytes | None:
        data = super().get_prefix(key, n)
        self._cost("GET", len(data) if data is not None else 0, key=key)
        return data

    def put_stream(self, key: str, chunks: Iterable[Chunk], *, create_once: bool = False) -> bool:
        self._cost("PUT")
        return super().put_stream(key, self._passing(chunks, up=True, key=key), create_once=create_once)

    def get_stream(self, key: str, *, part_size: int | None = None) -> Iterator[Chunk] | None:
        self._cost("GET")
        stream = super().get_stream(key, part_size=part_size)
        return None if stream is None else self._passing(stream, up=False, key=key)

    def _passing(self, chunks: Iterable[Chunk], *, up: bool, key: str) -> Iterator[Chunk]:
        it = iter(chunks)
        try:
            for chunk in it:
                self._move(memoryview(chunk).nbytes, up=up, key=key)
                yield chunk
        finally:
            close_stream(it)

    def list(self, prefix: str, after: str = "") -> list[str]:
        found = super().list(prefix, after)
        self._cost("LIST", sum(len(k) for k in found))
        self.tally.election += prefix.startswith(keys.CLAIMS) or (
            prefix.startswith(keys.LEASES) and prefix != keys.LEASES
        )
        self.tally.counts["LIST pages"] += max(1, math.ceil(len(found) / LIST_PAGE))
        return found

    def delete(self, doomed: Iterable[str]) -> None:
        self._cost("DELETE")
        super().delete(doomed)


@dataclass
class Result:
    learners: int
    rounds: int
    contribution_bytes: float
    closer: dict
    follower_mean: dict
    follower_max: dict
    latency_median: float
    latency_max: float
    closer_cpu_per_round: float
    closer_peak_mib: float
    follower_cpu_per_round: float
    record_bytes: dict
    wall_seconds: float


class Fleet:
    def __init__(
        self,
        n: int,
        *,
        sync_every: int = 20,
        fragments: int = 4,
        step_seconds: float = 1.0,
        poll_interval: float = 1.0,
        latency: float = 0.03,
        bandwidth: float = 100e6,
        params: int = 8,
        width: int = 32,
        seed: int = 0,
        max_contributions: int | None = None,
        keep_events: bool = False,
    ) -> None:
        self.n, self.step_seconds, self.poll = n, step_seconds, poll_interval
        self.cfg = gm.DiLoCo(
            sync_every=sync_every, fragments=fragments, quorum_size=n, max_contributions=max_contributions
        )
        self.store = gm.MemoryMailbox()
        self.T = 0.0
        self.queue: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.first_snapshot: dict[int, float] = {}
        self.committed: dict[int, float] = {}
        self.contribution_sizes: list[int] = []
        self.rng = np.random.default_rng(seed)
        opts = NodeOptions(poll_interval=poll_interval, lease_timeout=120.0, round_timeout=60.0)
        self.members: list[Member] = []
        self.links: list[Link] = []
        self.params: list[dict[str, np.ndarray]] = []
        for i in range(n):
            clock = gm.FakeClock()
            link = Link(self.store, clock, latency=latency, bandwidth=bandwidth, fleet=self)
            model = {
                f"w{j}": np.random.default_rng(j).standard_normal((width, width)).astype(np.float32)
                for j in range(params)
            }
            self.members.append(
                join(
                    f"n{i:04d}",
                    model,
                    cfg=self.cfg,
                    mailbox=link,
                    clock=clock,
                    options=opts,
                    seed=i,
                    keep_events=keep_events,
                )
            )
            self.links.append(link)
            self.params.append(model)
        for m in self.members:
            m.node.state.list_leases(m.node.store)
        for i in range(n):
            phase = (i / n) * 0.01  # a node's steps and polls are not all at the same instant
            self._push(phase, i, "step")
            self._push(phase + 0.005, i, "tick")
        self.cpu = [0.0] * n
        self.peak = 0
        self.watch_memory = 0  # the node whose polls tracemalloc watches (the creator closes the rounds)
        self.dead: set[int] = set()

    def _push(self, at: float, i: int, kind: str) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (at, self.seq, i, kind))

    def landed(self, key: str, at: float) -> None:
        if (s := keys.parse_snapshot_key(key)) is not None:
            self.first_snapshot.setdefault(s[0], at)
        elif (r := keys.parse_round_key(key)) is not None:
            self.committed.setdefault(r, at)
            if self.n >= 256:  # the large fleets take minutes a round: say how far they are
                print(f"    round {r} committed at simulated {at:.1f} s", file=sys.stderr, flush=True)

    def run_until(self, rounds: int) -> None:
        """Run until ``rounds`` rounds have committed in all."""
        while len(self.committed) < rounds:
            at, _, i, kind = heapq.heappop(self.queue)
            if i in self.dead:
                continue  # killed (SIGKILL): no more steps or polls; its lease stays behind
            self.T = at
            m = self.members[i]
            clock = m.node.clock
            now = clock.now()
            if now < at:
                clock.advance(at - now)
            if kind == "step":
                for p in self.params[i].values():
                    p -= np.float32(0.01) * self.rng.standard_normal(p.shape).astype(np.float32)
                m.step(8)
                if m.node.bridge.outbox:  # a contribution is ready: the session wakes its poll
                    self._push(clock.now() + 0.01, i, "wake")
                self._push(at + self.step_seconds, i, "step")
            else:
                c0 = time.process_time()
                watch = i == self.watch_memory
                if watch:
                    tracemalloc.start()
                m.tick()
                if watch:
                    self.peak = max(self.peak, tracemalloc.get_traced_memory()[1])
                    tracemalloc.stop()
                self.cpu[i] += time.process_time() - c0
                if kind == "tick":
                    self._push(clock.now() + self.poll, i, "tick")
                # ("wake": an extra poll for a ready contribution; the periodic one stays queued)

    def reset(self) -> None:
        for link in self.links:
            link.tally = Tally()
        self.cpu = [0.0] * self.n
        self.peak = 0


def measure(n: int, rounds: int, *, warmup: int = 2, **kw: float | int | None) -> Result:
    wall = time.perf_counter()
    fleet = Fleet(n, **kw)  # type: ignore[arg-type]
    fleet.run_until(warmup)
    fleet.reset()
    start = len(fleet.committed)
    fleet.run_until(start + rounds)
    done = sorted(fleet.committed)[start:]
    closers = [i for i, m in enumerate(fleet.members) if m.node.state.stats.committed]
    closer = max(closers, key=lambda i: fleet.members[i].node.state.stats.committed)
    if closer != fleet.watch_memory:
        print(f"  note: node {closer} closed most rounds, memory was watched on node {fleet.watch_memory}")

    def per_round(t: Tally) -> dict:
        out = {k: v / rounds for k, v in t.counts.items()}
        out.update(up=t.up / rounds, down=t.down / rounds, contribution_down=t.contribution_down / rounds)
        return out

    rows = [per_round(link.tally) for i, link in enumerate(fleet.links) if i != closer]
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}
    worst = {k: max(r[k] for r in rows) for k in rows[0]} if rows else {}
    lat = [fleet.committed[r] - fleet.first_snapshot[r] for r in done if r in fleet.first_snapshot]
    contribution = float(np.mean(fleet.contribution_sizes))
    return Result(
        n,
        rounds,
        contribution,
        per_round(fleet.links[closer].tally),
        mean,
        worst,
        float(np.median(lat)),
        float(max(lat)),
        fleet.cpu[closer] / rounds,
        fleet.peak / 2**20,
        sum(c for i, c in enumerate(fleet.cpu) if i != closer) / max(n - 1, 1) / rounds,
        _record_bytes(fleet.store),
        time.perf_counter() - wall,
    )


def takeover(n: int, **kw: float | int | None) -> dict:
    """Kill the closer after 2 committed rounds; what the next commit (by a follower that takes the
    round over) costs each of the others in election requests (claims listed and written, single
    leases listed), and how long it took in simulated seconds."""
    fleet = Fleet(n, keep_events=True, **kw)  # type: ignore[arg-type]
    fleet.run_until(2)
    closer = max(range(n), key=lambda i: fleet.members[i].node.state.stats.committed)
    fleet.dead.add(closer)
    fleet.reset()
    t0, start = fleet.T, len(fleet.committed)
    fleet.run_until(start + 1)
    events = [e for i, m in enumerate(fleet.members) if i != closer for e in m.events if type(e).__name__ == "TookOver"]
    per = [link.tally.election for i, link in enumerate(fleet.links) if i != closer]
    return {
        "learners": n,
        "seconds": fleet.T - t0,
        "took_over": [(e.learner, e.reason) for e in events],
        "election_mean": sum(per) / len(per),
        "election_max": max(per),
        "requests_max": max(sum(t.tally.counts[k] for k in ("LIST", "GET", "PUT", "DELETE")) for t in fleet.links),
    }


def _record_bytes(store: gm.MemoryMailbox) -> dict:
    """Mean stored size of each kind of record (what ``cli/bill.py``'s constants come from)."""
    kinds = {"round": keys.ROUNDS, "snapshot": keys.SNAPSHOTS, "claim": keys.CLAIMS, "lease": keys.LEASES}
    out = {}
    for name, prefix in kinds.items():
        sizes = [len(store.get(k) or b"") for k in store.list(prefix)]
        out[name] = float(np.mean(sizes)) if sizes else float("nan")
    return out


def _kb(x: float) -> str:
    return f"{x / 1e3:.1f}"


def table(results: list[Result]) -> str:
    head = (
        "| learners | rounds | follower LIST (pages) / GET / PUT / DEL per round | follower KB down / up | "
        "worst follower requests, KB down | closer LIST (pages) / GET / PUT / DEL | closer KB down "
        "(contributions' worth) | closer CPU s / round | follower CPU s / round | closer peak MiB | "
        "round latency s (median, max) | wall s |"
    )
    lines = [head, "| " + " | ".join(["---:"] * 12) + " |"]
    for r in results:
        f, w, c = r.follower_mean, r.follower_max, r.closer
        freq = f"{f['LIST']:.1f} ({f['LIST pages']:.1f}) / {f['GET']:.1f} / {f['PUT']:.1f} / {f['DELETE']:.2f}"
        wreq = w["LIST"] + w["GET"] + w["PUT"] + w["DELETE"]
        creq = f"{c['LIST']:.1f} ({c['LIST pages']:.1f}) / {c['GET']:.1f} / {c['PUT']:.1f} / {c['DELETE']:.2f}"
        worth = c["contribution_down"] / r.contribution_bytes
        lines.append(
            f"| {r.learners} | {r.rounds} | {freq} | {_kb(f['down'])} / {_kb(f['up'])} | {wreq:.1f}, {_kb(w['down'])} | "
            f"{creq} | {_kb(c['down'])} ({worth:.1f}) | {r.closer_cpu_per_round:.3f} | {r.follower_cpu_per_round:.3f} | {r.closer_peak_mib:.2f} | "
            f"{r.latency_median:.2f}, {r.latency_max:.2f} | {r.wall_seconds:.0f} |"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r.learners for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    ax.plot(
        n, [sum(r.follower_mean[k] for k in ("LIST", "GET", "PUT", "DELETE")) for r in results], "o-", label="follower"
    )
    ax.plot(n, [sum(r.closer[k] for k in ("LIST", "GET", "PUT", "DELETE")) for r in results], "s-", label="closer")
    ax.set(xscale="log", yscale="log", xlabel="learners", ylabel="requests per round", title="requests")
    ax.legend()
    ax = axes[1]
    ax.plot(n, [r.follower_mean["down"] / 1e3 for r in results], "o-", label="follower")
    ax.plot(n, [r.closer["down"] / 1e3 for r in results], "s-", label="closer")
    ax.set(xscale="log", yscale="log", xlabel="learners", ylabel="KB read per round", title="bytes down")
    ax.legend()
    ax = axes[2]
    ax.plot(n, [r.latency_median for r in results], "o-", label="round latency (median)")
    ax.plot(n, [r.closer_cpu_per_round for r in results], "s-", label="closer CPU s / round")
    ax.set(xscale="log", yscale="log", xlabel="learners", ylabel="seconds", title="time")
    ax.legend()
    fig.suptitle(f"bench/fleet.py: per committed round{title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--learners", type=int, nargs="*", default=[4, 16, 64, 256, 1024])
    ap.add_argument("--rounds", type=int, default=8, help="committed rounds measured, after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="committed rounds before measuring (default 2)")
    ap.add_argument("--quick", action="store_true", help="4 and 16 learners, 4 rounds")
    ap.add_argument("--latency", type=float, default=0.03, help="seconds per request (default 0.03)")
    ap.add_argument("--bandwidth", type=float, default=100e6, help="bytes per second per node (default 100e6)")
    ap.add_argument(
        "--max-contributions",
        type=int,
        default=None,
        metavar="K",
        help="DiLoCo(max_contributions=K): each round merges at most K contributions, drawn by hash",
    )
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="FILE.png", help="also plot the results")
    ap.add_argument(
        "--takeover", action="store_true", help="kill the closer after 2 rounds and count the takeover's requests"
    )
    ap.add_argument("--title", default="", help="with --load: added to the plot's title")
    ap.add_argument("--load", nargs="+", metavar="FILE", help="table (and plot) the results of earlier --json runs")
    args = ap.parse_args()
    if args.load:
        loaded = [Result(**r) for f in args.load for r in json.loads(Path(f).read_text())]
        loaded.sort(key=lambda r: r.learners)
        print(table(loaded))
        if args.plot:
            plot(loaded, args.plot, args.title)
        return
    sizes, rounds = ([4, 16], 4) if args.quick else (args.learners, args.rounds)
    cap = "" if args.max_contributions is None else f", max_contributions={args.max_contributions}"
    print(
        f"DiLoCo(sync_every=20, fragments=4, quorum_size=N{cap}), 8 x 32x32 fp32 tensors, 1 step/s, poll 1 s, "
        f"{args.latency * 1e3:.0f} ms + bytes at {args.bandwidth / 1e6:.0f} MB/s per request; {rounds} rounds"
    )
    if args.takeover:
        for n in sizes:
            t = takeover(n, latency=args.latency, bandwidth=args.bandwidth, max_contributions=args.max_contributions)
            print(
                f"  {n} learners: the round after the kill committed {t['seconds']:.0f} s later, taken over by "
                f"{t['took_over']}; election requests per surviving node: mean {t['election_mean']:.1f}, "
                f"max {t['election_max']}; most requests of any node in that time {t['requests_max']}",
                flush=True,
            )
        return
    results = []
    for n in sizes:
        r = measure(
            n,
            rounds,
            warmup=args.warmup,
            latency=args.latency,
            bandwidth=args.bandwidth,
            max_contributions=args.max_contributions,
        )
        results.append(r)
        print(f"  {n} learners: {r.wall_seconds:.0f} s wall", flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    if args.plot:
        plot(results, args.plot, cap)


if __name__ == "__main__":
    main()
