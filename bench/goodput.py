"""Goodput under chaos: N learner processes over moto's S3 server, each through its own fault proxy,
under a seeded fault schedule; then the same config and length without faults (the twin).

    PYTHONPATH=. python bench/goodput.py                       # 8 learners, a fault every 15 s, 10 min
    PYTHONPATH=. python bench/goodput.py --minutes 1 --learners 4 --plot /tmp/goodput.png

Each learner is ``bench/goodput_learner.py`` (the charlm ``quick`` model, steps paced to
``--step-ms``, the DiLoCo config a user is told to write). Each reaches the store through a
``bench/_faults.py`` proxy. Faults, one every ``--fault-every`` s in rotation (every kind once per
shuffled cycle), each on a node under no other fault:

- ``kill``: SIGKILL, restart with the same id after 3-10 s;
- ``freeze``: SIGSTOP for 2-4 lease timeouts, then SIGCONT;
- ``cut``: the node's proxy cut (a partition) for 20-40 s, then healed;
- ``straggle``: the node's step period 3x for 20-40 s;
- ``closer_kill``: every proxy armed to stop the next PUT of a round record; the node making it
  (the closer, its round payloads written, its record not) is SIGKILLed there and restarted.

Measures (``analyse``), over the window ``[t0, t0 + minutes)`` that starts at the first commit:
step efficiency (committed rounds per minute over the twin's), goodput (the share of computed
fragment-steps that reached a commit, and where the rest went), capacity (merged fragment-steps over
the twin's), time from each kill to the next commit and to the victim's first merged contribution,
held-out loss over time, the end state (survivors bit-identical with the newest commit, the tape
contiguous), and synchronous and elastic data parallel modelled from the same fault log. Prints
a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
# bench/requests.py would shadow the ``requests`` package moto needs: bench/ leaves sys.path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "examples"))

import numpy as np  # noqa: E402

from bench._faults import FaultProxy  # noqa: E402

LEARNER = _ROOT / "bench" / "goodput_learner.py"
KINDS = ("kill", "freeze", "cut", "straggle", "closer_kill")
RECORD_PUT = rb"PUT /\S*/rounds/\d{10}\.json"


@dataclass
class Options:
    learners: int = 8
    minutes: float = 10.0
    fault_every: float = 15.0
    seed: int = 0
    step_ms: float = 200.0
    sync_every: int = 32
    fragments: int = 2
    alignment: str = "default"  # the library's (gm.Adaptive()), what a user who names none gets
    overlap: int | None = None
    lease_timeout: float = 4.0
    poll_interval: float = 0.1
    round_timeout: float | None = None
    eval_every: float = 30.0
    # Elastic data parallel: a membership change (a replica leaving or rejoining) stalls every
    # replica for this long (re-forming the group, the new one loading the state); a freeze or a cut
    # is first noticed after elastic_detect_s (a collective's timeout). See README section 16.
    elastic_restart_s: float = 10.0
    elastic_detect_s: float | None = None  # None: the bench's lease_timeout, as ours detects
    # how long each fault lasts (uniform in the range, drawn from the seed)
    restart_s: tuple[float, float] = (3.0, 10.0)  # a killed node is restarted after
    freeze_leases: tuple[float, float] = (2.0, 4.0)  # SIGSTOP for this many lease timeouts
    cut_s: tuple[float, float] = (20.0, 40.0)
    straggle_s: tuple[float, float] = (20.0, 40.0)
    settle_s: float = 90.0  # after the window, at most this long for every victim to contribute again
    workdir: Path | None = None
    plot: Path | None = None
    twin: bool = True
    verbose: bool = False


# ---- one node ---------------------------------------------------------------------------------


class Node:
    def __init__(self, name: str, opts: Options, upstream: tuple[str, int], bucket: str, prefix: str, tmp: Path):
        self.name, self.opts, self.bucket, self.prefix, self.tmp = name, opts, bucket, prefix, tmp
        self.proxy = FaultProxy(upstream)
        self.control = tmp / f"control-{name}"
        self.control.write_text("1")
        self.log = tmp / f"{name}.jsonl"
        self.incarnation = -1
        self.proc: subprocess.Popen[bytes] | None = None
        self.busy = False  # under a fault now (the schedule picks nodes that are not)
        self.start()

    def start(self) -> None:
        self.incarnation += 1
        o = self.opts
        cmd = [sys.executable, str(LEARNER), "--bucket", self.bucket, "--prefix", self.prefix]
        cmd += ["--endpoint", self.proxy.url, "--learner-id", self.name, "--out", str(self.tmp / "out")]
        cmd += ["--log", str(self.log), "--stop", str(self.tmp / "stop"), "--close", str(self.tmp / "close")]
        cmd += ["--control", str(self.control), "--step-ms", str(o.step_ms), "--sync-every", str(o.sync_every)]
        cmd += ["--fragments", str(o.fragments), "--alignment", o.alignment, "--seed", str(o.seed)]
        cmd += ["--lease-timeout", str(o.lease_timeout), "--poll-interval", str(o.poll_interval)]
        cmd += ["--incarnation", str(self.incarnation)]
        if o.overlap is not None:
            cmd += ["--overlap", str(o.overlap)]
        if o.round_timeout is not None:
            cmd += ["--round-timeout", str(o.round_timeout)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
        out = open(self.tmp / f"{self.name}.stderr", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        out.close()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def tail(self) -> str:
        p = self.tmp / f"{self.name}.stderr"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""


# ---- the store, watched -----------------------------------------------------------------------


class Watcher:
    """Lists ``rounds/`` of the run every 0.2 s, straight from the server (no proxy): when each
    round record was first seen; and evaluates the newest commit on held-out text every
    ``eval_every`` s."""

    def __init__(self, client: Any, bucket: str, prefix: str, endpoint: str, eval_every: float) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self.seen: dict[int, float] = {}
        self.losses: list[tuple[float, int, float]] = []  # (time, head, held-out loss)
        self._stop = threading.Event()
        self._last = ""
        self._evaluator = Evaluator(bucket, prefix, endpoint)
        self.eval_every = eval_every
        self._threads = [
            threading.Thread(target=self._watch, daemon=True, name="watch"),
            threading.Thread(target=self._eval, daemon=True, name="eval"),
        ]
        for t in self._threads:
            t.start()

    def rounds(self) -> int:
        return len(self.seen)

    def _watch(self) -> None:
        pre = f"{self.prefix}/rounds/"
        while not self._stop.is_set():
            try:
                kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": pre}
                if self._last:
                    kw["StartAfter"] = self._last
                for page in self.client.get_paginator("list_objects_v2").paginate(**kw):
                    for o in page.get("Contents", []):
                        m = re.search(r"rounds/(\d{10})\.json$", o["Key"])
                        if m:
                            self.seen.setdefault(int(m.group(1)), time.time())
                            self._last = max(self._last, o["Key"])
            except Exception as e:  # the server is ours; a hiccup is retried
                logging.getLogger(__name__).debug("watch: %s", e)
            self._stop.wait(0.2)

    def evaluate_now(self) -> None:
        if self.seen:
            try:
                head, loss = self._evaluator.newest()
                self.losses.append((time.time(), head, loss))
            except Exception as e:
                logging.getLogger(__name__).warning("eval: %s", e)

    def _eval(self) -> None:
        while not self._stop.wait(self.eval_every):
            self.evaluate_now()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


class Evaluator:
    """The newest committed parameters of the run, on fixed held-out windows of text."""

    def __init__(self, bucket: str, prefix: str, endpoint: str) -> None:
        import charlm
        import torch

        import gradientmail_core as gm
        from gradientmail_core.adapters import adapter_for

        torch.set_num_threads(1)
        self.charlm, self.torch = charlm, torch
        self.model = charlm.CharTransformer(charlm.SIZES["quick"], seed=0)
        self.schema = adapter_for(self.model).schema()
        text = charlm.stdlib_text(max_chars=1_000_000)
        block = charlm.SIZES["quick"].block
        self.batches = charlm.heldout_batches(charlm.encode(text["heldout"]), batches=16, batch=32, block=block)
        self.mailbox = gm.S3Mailbox(bucket, prefix, endpoint_url=endpoint)

    def params(self, upto: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """The newest committed round and parameters; ``upto``: as of that round (what a node that
        left there holds)."""
        from gradientmail_core.protocol import keys
        from gradientmail_core.protocol.run import RunInfo, read_manifest
        from gradientmail_core.protocol.store import RunStore
        from gradientmail_core.protocol.tape import fetch_theta, load_newest, newest_records, round_keys

        store = RunStore(self.mailbox)
        if upto is None:
            _, head, newest = load_newest(store, self.schema)
            return head, {n: v for theta in newest.values() for n, v in theta.items()}
        manifest = read_manifest(store)
        assert manifest is not None
        run = RunInfo.from_manifest(manifest)
        listed = [k for k in round_keys(store) if (r := keys.parse_round_key(k)) is not None and r <= upto]
        recs = newest_records(store, run, listed)
        out: dict[str, np.ndarray] = {}
        for f in range(run.P):
            theta = fetch_theta(store, run, f, recs.get(f))
            assert theta is not None, f"the parameters of fragment {f} as of round {upto} are gone"
            out.update(theta)
        return max((r.round for r in recs.values()), default=-1), out

    def newest(self) -> tuple[int, float]:
        head, params = self.params()
        with self.torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.torch.from_numpy(np.array(params[n])))
        return head, self.charlm.evaluate(self.model, self.batches)


# ---- one run ----------------------------------------------------------------------------------


@dataclass
class RunData:
    name: str
    faults: bool
    t0: float
    t1: float
    end: float
    nodes: list[str]
    logs: dict[str, list[dict[str, Any]]]
    records: list[dict[str, Any]]
    seen: dict[int, float]
    losses: list[tuple[float, int, float]]
    fault_log: list[dict[str, Any]]
    identical: bool
    contiguous: bool
    exits: dict[str, int]
    proxies: dict[str, dict[str, int]] = field(default_factory=dict)


def run_once(opts: Options, endpoint: str, name: str, faults: bool, say) -> RunData:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = f"goodput-{name}-{os.getpid()}"
    client.create_bucket(Bucket=bucket)
    prefix = f"runs/{name}"
    tmp = Path(tempfile.mkdtemp(prefix=f"goodput-{name}-", dir=opts.workdir))
    host, port = endpoint.removeprefix("http://").split(":")
    names = [f"n{i}" for i in range(opts.learners)]
    rng = random.Random(f"{opts.seed}")
    fault_log: list[dict[str, Any]] = []
    nodes: dict[str, Node] = {}
    watcher = Watcher(client, bucket, prefix, endpoint, opts.eval_every)
    for n in names:
        nodes[n] = Node(n, opts, (host, int(port)), bucket, prefix, tmp)
        if len(nodes) == 1:
            time.sleep(1.0)  # the first creates the run; the others join it
    try:
        _wait(lambda: watcher.rounds() >= 1, 180, "the first commit", nodes)
        t0 = time.time()
        t1 = t0 + 60 * opts.minutes
        say(f"[{name}] first commit; window of {opts.minutes:g} min starts ({'faults' if faults else 'no faults'})")
        if faults:
            _chaos(opts, nodes, rng, watcher, fault_log, t1, say)
            # Settle: every victim runs again; wait until each has contributed to a commit again.
            _settle(opts, nodes, fault_log, watcher, tmp, say)
        else:
            while time.time() < t1:
                time.sleep(0.2)
        watcher.evaluate_now()
        (tmp / "stop").touch()
        quiet_since, last = time.time(), watcher.rounds()
        while time.time() - quiet_since < opts.lease_timeout + 2.0:
            time.sleep(0.1)
            if watcher.rounds() != last:
                quiet_since, last = time.time(), watcher.rounds()
        time.sleep(1.0)
        (tmp / "close").touch()
        exits = {}
        for n, node in nodes.items():
            assert node.proc is not None
            try:
                exits[n] = node.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                node.kill()
                exits[n] = -9
            if exits[n] != 0:
                say(f"[{name}] {n} exited {exits[n]}:\n{node.tail()}")
        end = time.time()
        watcher.stop()
        watcher.evaluate_now()
    except BaseException:
        for node in nodes.values():
            node.kill()
        watcher.stop()
        raise
    finally:
        for node in nodes.values():
            node.proxy.close()
    records, contiguous = _tape(client, bucket, prefix, opts.fragments)
    logs = {n: [json.loads(line) for line in _lines(tmp / f"{n}.jsonl")] for n in names}
    identical = _identical(watcher._evaluator, tmp / "out", logs)
    return RunData(
        name=name,
        faults=faults,
        t0=t0,
        t1=t1,
        end=end,
        nodes=names,
        logs=logs,
        records=records,
        seen=dict(watcher.seen),
        losses=list(watcher.losses),
        fault_log=fault_log,
        identical=identical,
        contiguous=contiguous,
        exits=exits,
        proxies={n: node.proxy.counters() for n, node in nodes.items()},
    )


def _lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):  # a SIGKILL can leave half a line
            out.append(line)
    return out


def _wait(pred, timeout: float, what: str, nodes: dict[str, Node]) -> None:
    deadline = time.time() + timeout
    while not pred():
        if time.time() > deadline:
            tails = "\n".join(f"--- {n}\n{node.tail()}" for n, node in nodes.items())
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")
        time.sleep(0.1)


def _chaos(opts: Options, nodes: dict[str, Node], rng: random.Random, watcher: Watcher, fault_log, t1, say) -> None:
    """The fault schedule: one fault every ``fault_every`` s until ``t1``, and the timers that end
    each (restart, SIGCONT, heal, pace back)."""
    timers: list[tuple[float, int, Any]] = []
    seq = iter(range(10**9))
    kinds: list[str] = []
    next_fault = time.time() + opts.fault_every / 2
    lock = threading.RLock()

    def later(delay: float, fn) -> None:  # (also called from a proxy's thread: a closer kill)
        with lock:
            heapq.heappush(timers, (time.time() + delay, next(seq), fn))

    def due() -> Any:
        with lock:
            return heapq.heappop(timers)[2] if timers and timers[0][0] <= time.time() else None

    def restart(node: Node, entry: dict[str, Any]) -> None:
        node.start()
        entry["restarted"] = time.time()
        node.busy = False

    while time.time() < t1:
        while (fn := due()) is not None:
            fn()
        now = time.time()
        if now >= t1 or now < next_fault:
            time.sleep(0.02)
            continue
        next_fault += opts.fault_every
        free = [n for n in nodes.values() if not n.busy]
        if not free:
            continue
        if not kinds:
            kinds = list(KINDS)
            rng.shuffle(kinds)
        kind = kinds.pop()
        node = rng.choice(free)
        entry: dict[str, Any] = {"kind": kind, "node": node.name, "t": now, "round": watcher.rounds()}
        if kind == "kill":
            node.busy = True
            node.kill()
            later(rng.uniform(*opts.restart_s), lambda node=node, entry=entry: restart(node, entry))
        elif kind == "freeze":
            node.busy = True
            node.signal(signal.SIGSTOP)
            d = rng.uniform(*opts.freeze_leases) * opts.lease_timeout
            entry["until"] = now + d

            def thaw(node=node) -> None:
                node.signal(signal.SIGCONT)
                node.busy = False

            later(d, thaw)
        elif kind == "cut":
            node.busy = True
            node.proxy.cut()
            d = rng.uniform(*opts.cut_s)
            entry["until"] = now + d

            def heal(node=node) -> None:
                node.proxy.heal()
                node.busy = False

            later(d, heal)
        elif kind == "straggle":
            node.busy = True
            node.control.write_text("3")
            d = rng.uniform(*opts.straggle_s)
            entry["until"] = now + d

            def pace(node=node) -> None:
                node.control.write_text("1")
                node.busy = False

            later(d, pace)
        else:  # closer_kill: whoever PUTs the next round record is killed right there
            entry["node"] = None
            delay = rng.uniform(*opts.restart_s)
            armed = [n for n in nodes.values() if not n.busy]

            def fire(node: Node, request: bytes, entry=entry, armed=armed, delay=delay) -> None:
                with lock:
                    if entry["node"] is not None or node.busy:
                        return  # (the request was dropped all the same: its client retries)
                    for other in armed:
                        other.proxy.disarm()
                    entry["node"], entry["t"] = node.name, time.time()
                    node.busy = True
                node.kill()
                entry["mid_commit"] = _mid_commit(watcher, node, int(re.findall(rb"\d{10}", request)[-1]))
                later(delay, lambda: restart(node, entry))

            for n in armed:
                n.proxy.stop_request(RECORD_PUT, lambda request, n=n: fire(n, request))

            def give_up(entry=entry, armed=armed) -> None:
                with lock:
                    if entry["node"] is None:
                        entry["node"] = "-"
                        entry["missed"] = True
                        for other in armed:
                            other.proxy.disarm()

            later(max(opts.fault_every, 30.0), give_up)  # (a commit comes every few seconds)
        fault_log.append(entry)
        say(
            f"  t={now - (t1 - 60 * opts.minutes):6.1f}s {kind:<11} {entry['node'] or '(next closer)'} at round {entry['round']}"
        )
    # the window is over: every fault still running ends now (a killed node restarts now), so
    # what follows the window is fault-free, as in the twin
    for node in nodes.values():
        node.proxy.disarm()
    now = time.time()
    for e in fault_log:
        if e.get("until", 0) > now:
            e["until"] = now
    with lock:
        rest, timers[:] = sorted(timers), []
    for _, _, fn in rest:
        fn()


def _mid_commit(watcher: Watcher, node: Node, r: int) -> dict[str, Any]:
    """What the store held when the closer died making round ``r``'s record: its round payloads,
    no record, and whose claim is the newest."""
    client, bucket, prefix = watcher.client, watcher.bucket, watcher.prefix
    blobs = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/blobs/rounds/{r:010d}/").get("KeyCount", 0)
    rec = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/rounds/{r:010d}.json").get("KeyCount", 0)
    claims = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/claims/{r:010d}/").get("Contents", [])
    claimant = None
    if claims:
        newest = max(claims, key=lambda o: o["Key"])
        try:
            claimant = json.loads(client.get_object(Bucket=bucket, Key=newest["Key"])["Body"].read()).get("learner")
        except Exception:
            claimant = None
    return {"round": r, "round_blobs": blobs, "record": rec, "claimant": claimant, "victim": node.name}


def _settle(opts: Options, nodes: dict[str, Node], fault_log, watcher: Watcher, tmp: Path, say) -> None:
    """After the window: every node runs; wait (at most ``settle_s``) until each victim of a kill
    has published into a round that committed since its restart."""
    deadline = time.time() + opts.settle_s
    victims = {
        e["node"] for e in fault_log if e["kind"] in ("kill", "closer_kill") and e.get("node") not in (None, "-")
    }
    while time.time() < deadline:
        for node in nodes.values():
            if node.proc is not None and node.proc.poll() is not None and node.busy:
                pass  # a restart timer may still be pending: restart it now
            if node.proc is not None and node.proc.poll() is not None:
                node.start()
                node.busy = False
        pending = [v for v in victims if not _contributed_since_restart(nodes[v])]
        if not pending:
            return
        time.sleep(0.5)
    say(f"  settle: {opts.settle_s:g} s passed before every victim contributed again")


def _contributed_since_restart(node: Node) -> bool:
    """Whether the node's current process has had a contribution merged: a round it published
    that it then aligned with as a participant. (Its process, not the one before: a restarted
    process writes its first line a second or two after it starts, so "the newest start line in the
    log" would be the killed process's for that while.)"""
    lines = [json.loads(s) for s in _lines(node.log)]
    start = next(
        (i for i, e in enumerate(lines) if e["ev"] == "start" and e.get("incarnation") == node.incarnation), None
    )
    if start is None:
        return False
    inc = lines[start:]
    mine = {e["round"] for e in inc if e["ev"] == "Published"}
    return any(e["ev"] == "Aligned" and e["round"] in mine and node.name in e.get("participants", ()) for e in inc)


def _tape(client: Any, bucket: str, prefix: str, P: int) -> tuple[list[dict[str, Any]], bool]:
    recs = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/rounds/"):
        for o in page.get("Contents", []):
            if re.search(r"rounds/\d{10}\.json$", o["Key"]):
                recs.append(json.loads(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()))
    recs.sort(key=lambda r: r["round"])
    contiguous = [r["round"] for r in recs] == list(range(len(recs))) and all(
        r["fragment"] == r["round"] % P and r["version"] == r["round"] // P + 1 for r in recs
    )
    return recs, contiguous


def _identical(evaluator: Evaluator, out: Path, logs: dict[str, list[dict[str, Any]]]) -> bool:
    """Every survivor left bit-identical with the commit of the round it left at (its last
    ``Left``), and those that left last with the newest commit. (Learners leave when they have no
    round in flight: one whose schedule had a round due that the others' had not contributes to it,
    closes it alone after they left, and leaves one commit later.)"""
    head, newest = evaluator.params()
    at: dict[int, dict[str, np.ndarray]] = {head: newest}
    lefts = {n: next((e["round"] for e in reversed(log) if e["ev"] == "Left"), None) for n, log in logs.items()}
    if not lefts or any(r is None for r in lefts.values()) or max(r for r in lefts.values() if r is not None) != head:
        return False
    for n, r in lefts.items():
        assert r is not None
        path = out / f"{n}.npz"
        if not path.exists():
            return False
        if r not in at:
            at[r] = evaluator.params(upto=r)[1]
        committed = at[r]
        with np.load(path, allow_pickle=False) as z:
            if set(z.files) != set(committed) or not all(np.array_equal(z[k], committed[k]) for k in z.files):
                return False
    return True


# ---- analysis ---------------------------------------------------------------------------------


def incarnations(log: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for e in log:
        if e["ev"] == "start":
            out.append([])
        if out:
            out[-1].append(e)
    return out


def ledger(run: RunData, P: int) -> dict[str, Any]:
    """Where every computed fragment-step went. One step trains every fragment: P fragment-steps.
    A fragment's steps reach a commit through that fragment's contribution (the record's
    participant ``steps``); the rest were lost to a kill (computed by a process that died before
    contributing them), dropped by an alignment (``Aligned.dropped``), rejected, never merged
    (published, in no record), skipped (handed to a contribution whose round had committed) or
    unpublished when the run ended. Under Carry (and Adaptive while it carries) a contribution that
    missed its round is not lost: its steps ride on in the local delta (``Aligned.carried``) and
    count as merged when the fragment's next contribution from the same process lands."""
    by_round = {r["round"]: r for r in run.records}
    merged_store = sum(p["steps"] for r in run.records for p in r["participants"])
    out = dict.fromkeys(("computed", "merged", "lost_to_kill", "dropped", "rejected", "never_merged"), 0)
    out.update(skipped=0, unpublished_at_end=0, carried_merged=0)
    for n in run.nodes:
        incs = incarnations(run.logs[n])
        for inc in incs:
            steps = max((e["n"] for e in inc if e["ev"] in ("step", "stopped", "closing", "closed")), default=0)
            computed = steps * P
            published = dropped = recovered = 0
            # Per fragment: contributions handed over that no commit merged (never merged, rejected,
            # or skipped unsent), which Carry keeps in the local delta (``Aligned.carried``): the
            # fragment's next contribution that lands merges them, and they count as merged there.
            pending: dict[int, list[tuple[str, int]]] = {}
            carried: dict[int, int] = {}
            for e in inc:
                if e["ev"] == "Aligned":
                    dropped += e.get("dropped", 0)
                    f, c = e["fragment"], e.get("carried", 0)
                    carried[f] = c
                    if not c:
                        pending.pop(f, None)
                elif e["ev"] == "Published":
                    published += e["steps"]
                    f = e["fragment"]
                    rec = by_round.get(e["round"])
                    if rec is not None and any(
                        p["learner"] == n and p["steps"] == e["steps"] for p in rec["participants"]
                    ):
                        out["merged"] += e["steps"]
                        extra = carried.pop(f, 0)
                        out["carried_merged"] += extra
                        for bucket, s in pending.pop(f, []):
                            take = min(s, extra)
                            out[bucket] -= take
                            out["merged"] += take
                            extra -= take
                        out["merged"] += extra  # steps of skipped contributions, counted in ``rest``
                        recovered += extra
                    else:
                        bucket = (
                            "rejected"
                            if rec is not None and any(x["learner"] == n for x in rec.get("rejected", []))
                            else "never_merged"
                        )
                        out[bucket] += e["steps"]
                        pending.setdefault(f, []).append((bucket, e["steps"]))
            out["computed"] += computed
            out["dropped"] += dropped
            rest = computed - published - dropped - recovered
            closing = [e for e in inc if e["ev"] in ("closing", "closed") and e.get("unpublished") is not None]
            killed = not any(e["ev"] == "closed" for e in inc)
            if killed:
                out["lost_to_kill"] += rest
            else:
                unpub = closing[-1]["unpublished"] if closing else rest
                out["unpublished_at_end"] += unpub
                out["skipped"] += rest - unpub
    # From the store: equals "merged" less "carried_merged" (the records count a contribution's steps
    # since its last contribution, SPEC 3.3), unless a kill took a log's last lines.
    out["merged_in_records"] = merged_store
    c = max(out["computed"], 1)
    out["goodput"] = out["merged"] / c
    out["shares"] = {
        k: out[k] / c for k in ("lost_to_kill", "dropped", "rejected", "never_merged", "skipped", "unpublished_at_end")
    }
    return out


def dropped_by_cause(run: RunData, opts: Options) -> dict[str, int]:
    """The fragment-steps alignments dropped, by what the node was going through: a partition or a
    freeze (an alignment up to two lease timeouts after it ended: the steps it trained while the
    commits could not reach it), straggling, its first alignments after a (re)start (``rejoin``), or
    none of these (``in_flight``: the steps trained while its contribution was on its way, which
    Overwrite drops in every round)."""
    out = dict.fromkeys(("partition_or_freeze", "straggling", "rejoin", "in_flight"), 0)
    spans: dict[str, list[tuple[float, float, str]]] = {n: [] for n in run.nodes}
    for e in run.fault_log:
        n = e.get("node")
        if n in spans and e["kind"] in ("cut", "freeze"):
            spans[n].append((e["t"], e["until"] + 2 * opts.lease_timeout, "partition_or_freeze"))
        elif n in spans and e["kind"] == "straggle":
            spans[n].append((e["t"], e["until"], "straggling"))
    for n in run.nodes:
        for inc in incarnations(run.logs[n]):
            aligned = 0
            for e in inc:
                if e["ev"] != "Aligned":
                    continue
                aligned += 1
                if not e.get("dropped"):
                    continue
                cause = next((c for a, b, c in spans[n] if a <= e["t"] <= b), None)
                if cause is None:
                    cause = "rejoin" if aligned <= opts.fragments and inc[0].get("incarnation", 0) > 0 else "in_flight"
                out[cause] += e["dropped"]
    return out


def restarts(run: RunData) -> list[dict[str, float]]:
    """Per kill: seconds from the restart to the process's first line (start-up: Python, torch, the
    text), to its session's join and to its first step."""
    out = []
    for e in run.fault_log:
        n, back = e.get("node"), e.get("restarted")
        if n not in run.logs or back is None:
            continue
        inc = next((i for i in incarnations(run.logs[n]) if i and i[0]["t"] >= back), None)
        if inc is None:
            continue
        joined = next((x["t"] for x in inc if x["ev"] == "joined"), None)
        first = next((x["t"] for x in inc if x["ev"] == "step"), None)
        out.append(
            {
                "to_start_s": inc[0]["t"] - back,
                "to_joined_s": None if joined is None else joined - back,
                "to_first_step_s": None if first is None else first - back,
            }
        )
    return out


def in_window(run: RunData) -> list[int]:
    return [r for r, t in run.seen.items() if run.t0 <= t < run.t1]


def availability(run: RunData, opts: Options) -> dict[str, list[tuple[float, float, str]]]:
    """Per node, the intervals it could not train (killed until its next first step, frozen, cut)
    or trained slowly (straggling), from the fault log and the logs' first steps."""
    out: dict[str, list[tuple[float, float, str]]] = {n: [] for n in run.nodes}
    for e in run.fault_log:
        n = e.get("node")
        if n in (None, "-"):
            continue
        if e["kind"] in ("kill", "closer_kill"):
            back = _first_step_after(run.logs[n], e.get("restarted", e["t"]))
            out[n].append((e["t"], back if back is not None else run.end, "killed"))
        elif e["kind"] == "freeze":
            out[n].append((e["t"], e["until"], "frozen"))
        elif e["kind"] == "cut":
            out[n].append((e["t"], e["until"], "cut off"))
        elif e["kind"] == "straggle":
            out[n].append((e["t"], e["until"], "straggling"))
    return out


def _first_step_after(log: list[dict[str, Any]], t: float) -> float | None:
    return next((e["t"] for e in log if e["ev"] == "step" and e["t"] >= t), None)


def data_parallel(run: RunData, opts: Options) -> dict[str, float]:
    """Synchronous and elastic data parallel under the same fault log, on a 0.1 s grid over the
    window. Pace 1 is one step per period for the whole group.

    - synchronous: stalls while any node is killed, frozen or cut off; runs at a third of the pace
      while one straggles.
    - elastic: continues with the live nodes; a kill or a return of a killed node is a membership
      change that stalls everyone ``elastic_restart_s``; a freeze or a cut stalls everyone first for
      ``elastic_detect_s`` (until the collective times out), then a change; its return another;
      a straggler sets the pace.
    Step efficiency: mean pace. Capacity: node-steps over N x window. Goodput (as the paper counts
    it): node-steps that reached the model over node-steps the available nodes could have run."""
    detect = opts.elastic_detect_s if opts.elastic_detect_s is not None else opts.lease_timeout
    R = opts.elastic_restart_s
    avail = availability(run, opts)
    stalls: list[tuple[float, float]] = []
    for ivs in avail.values():
        for a, b, what in ivs:
            if what == "killed":
                stalls += [(a, a + R), (b, b + R)]
            elif what in ("frozen", "cut off"):
                stalls += [(a, a + detect + R), (b, b + R)]
    dt = 0.1
    ts = np.arange(run.t0, run.t1, dt)
    N = len(run.nodes)
    down = np.zeros((N, len(ts)), bool)
    slow = np.zeros((N, len(ts)), bool)
    for i, n in enumerate(run.nodes):
        for a, b, what in avail[n]:
            m = (ts >= a) & (ts < b)
            (slow if what == "straggling" else down)[i] |= m
    stalled = np.zeros(len(ts), bool)
    for a, b in stalls:
        stalled |= (ts >= a) & (ts < b)
    any_slow = slow.any(axis=0)
    pace_sync = np.where(down.any(axis=0), 0.0, np.where(any_slow, 1 / 3, 1.0))
    live = (~down).sum(axis=0)
    slow_live = (slow & ~down).any(axis=0)
    pace_el = np.where(stalled, 0.0, np.where(slow_live, 1 / 3, 1.0))
    could = (np.where(slow, 1 / 3, 1.0) * ~down).sum(axis=0)  # node-steps per period the nodes could run
    sync_steps = pace_sync * N
    el_steps = pace_el * live
    return {
        "dp_step_efficiency": float(pace_sync.mean()),
        "dp_capacity": float(sync_steps.sum() / (N * len(ts))),
        "dp_goodput": float(sync_steps.sum() / max(could.sum(), 1e-9)),
        "elastic_dp_step_efficiency": float(pace_el.mean()),
        "elastic_dp_capacity": float(el_steps.sum() / (N * len(ts))),
        "elastic_dp_goodput": float(el_steps.sum() / max(could.sum(), 1e-9)),
        "available_share": float(could.sum() / (N * len(ts))),
        "elastic_detect_s": detect,
        "elastic_restart_s": R,
    }


def kill_recovery(run: RunData) -> list[dict[str, Any]]:
    out = []
    commits = sorted(run.seen.items(), key=lambda kv: kv[1])
    by_round = {r["round"]: r for r in run.records}
    for e in run.fault_log:
        if e["kind"] not in ("kill", "closer_kill") or e.get("node") in (None, "-"):
            continue
        n, t = e["node"], e["t"]
        next_commit = next((ts - t for _, ts in commits if ts > t), None)
        restarted = e.get("restarted")
        victim = None
        if restarted is not None:
            incs = [inc for inc in incarnations(run.logs[n]) if inc and inc[0]["t"] >= restarted - 1.0]
            for inc in incs[:1]:
                for ev in inc:
                    if ev["ev"] == "Published":
                        rec = by_round.get(ev["round"])
                        if rec and any(p["learner"] == n for p in rec["participants"]) and ev["round"] in run.seen:
                            victim = run.seen[ev["round"]] - t
                            break
        out.append(
            {
                "kind": e["kind"],
                "node": n,
                "t": t - run.t0,
                "to_next_commit_s": next_commit,
                "to_victim_merged_s": victim,
                "mid_commit": e.get("mid_commit"),
            }
        )
    return out


def analyse(chaos: RunData, twin: RunData | None, opts: Options) -> dict[str, Any]:
    P = opts.fragments
    lc = ledger(chaos, P)
    res: dict[str, Any] = {}
    rounds_c = len(in_window(chaos))
    minutes = opts.minutes
    res["rounds_per_min"] = rounds_c / minutes
    merged_window = sum(
        p["steps"] for r in chaos.records if r["round"] in set(in_window(chaos)) for p in r["participants"]
    )
    if twin is not None:
        lt = ledger(twin, P)
        rounds_t = len(in_window(twin))
        res["twin_rounds_per_min"] = rounds_t / minutes
        res["step_efficiency"] = rounds_c / max(rounds_t, 1)
        merged_twin = sum(
            p["steps"] for r in twin.records if r["round"] in set(in_window(twin)) for p in r["participants"]
        )
        res["capacity"] = merged_window / max(merged_twin, 1)
        res["twin_goodput"] = lt["goodput"]
        res["twin_breakdown"] = lt["shares"]
        res["twin_identical"], res["twin_contiguous"] = twin.identical, twin.contiguous
        res["twin_loss"] = twin.losses[-1][2] if twin.losses else None
    res["goodput"] = lc["goodput"]
    res["breakdown"] = lc["shares"]
    res["dropped_by_cause"] = {k: v / max(lc["computed"], 1) for k, v in dropped_by_cause(chaos, opts).items()}
    if twin is not None:
        res["twin_dropped_by_cause"] = {k: v / max(lt["computed"], 1) for k, v in dropped_by_cause(twin, opts).items()}
    rs = restarts(chaos)
    for k in ("to_start_s", "to_joined_s", "to_first_step_s"):
        xs = [r[k] for r in rs if r[k] is not None]
        res[f"median_restart_{k}"] = statistics.median(xs) if xs else None
    res["ledger"] = {k: v for k, v in lc.items() if isinstance(v, int)}
    kills = kill_recovery(chaos)
    res["kills"] = len(kills)
    res["kills_recovered"] = sum(k["to_victim_merged_s"] is not None for k in kills)
    res["closer_kills_mid_commit"] = sum(
        1 for k in kills if k["mid_commit"] and k["mid_commit"]["round_blobs"] > 0 and not k["mid_commit"]["record"]
    )
    tc = [k["to_next_commit_s"] for k in kills if k["to_next_commit_s"] is not None]
    tv = [k["to_victim_merged_s"] for k in kills if k["to_victim_merged_s"] is not None]
    res["median_kill_to_commit_s"] = statistics.median(tc) if tc else None
    res["median_kill_to_victim_merged_s"] = statistics.median(tv) if tv else None
    res["faults"] = {k: sum(e["kind"] == k and e.get("node") != "-" for e in chaos.fault_log) for k in KINDS}
    res["closer_kills_missed"] = sum(bool(e.get("missed")) for e in chaos.fault_log)
    res["identical"] = chaos.identical
    res["contiguous"] = chaos.contiguous
    res["loss"] = chaos.losses[-1][2] if chaos.losses else None
    if twin is not None and res["loss"] is not None and res.get("twin_loss"):
        res["loss_vs_twin"] = res["loss"] / res["twin_loss"]
    dp = data_parallel(chaos, opts)
    res.update(dp)
    # ours, counted as the DP figures are: merged steps over what the available nodes could compute
    could_steps = dp["available_share"] * opts.learners * 60 * minutes / (opts.step_ms / 1000) * P
    res["goodput_of_available"] = merged_window / max(could_steps, 1)
    res["loss_curve"] = [(round(t - chaos.t0, 1), h, round(v, 4)) for t, h, v in chaos.losses]
    if twin is not None:
        res["twin_loss_curve"] = [(round(t - twin.t0, 1), h, round(v, 4)) for t, h, v in twin.losses]
    res["exits_nonzero"] = {n: c for n, c in chaos.exits.items() if c != 0}
    res["kill_detail"] = kills
    res["config"] = {
        "learners": opts.learners,
        "minutes": minutes,
        "fault_every": opts.fault_every,
        "seed": opts.seed,
        "step_ms": opts.step_ms,
        "algorithm": f"gm.DiLoCo(sync_every={opts.sync_every}, fragments={opts.fragments}"
        + (f", alignment={opts.alignment}" if opts.alignment != "default" else "")
        + (f", overlap_steps={opts.overlap}" if opts.overlap is not None else "")
        + ")",
        "lease_timeout": opts.lease_timeout,
        "poll_interval": opts.poll_interval,
        "round_timeout": opts.round_timeout,
    }
    return res


# ---- the picture ------------------------------------------------------------------------------


def plot(chaos: RunData, twin: RunData | None, opts: Options, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = chaos.t0
    fig, axes = plt.subplots(
        3, 1, figsize=(14, 3 + 0.45 * len(chaos.nodes) + 5), sharex=True, height_ratios=[len(chaos.nodes), 3, 3]
    )
    ax = axes[0]
    colors = {
        "training": "#8fd18f",
        "killed": "#d62728",
        "rejoining": "#ff9f40",
        "frozen": "#7f5fbf",
        "cut off": "#555555",
        "straggling": "#f2d04b",
    }
    avail = availability(chaos, opts)
    for i, n in enumerate(chaos.nodes):
        y = len(chaos.nodes) - 1 - i
        for inc in incarnations(chaos.logs[n]):
            steps = [e["t"] for e in inc if e["ev"] == "step"]
            if steps:
                ax.broken_barh([(steps[0] - t0, steps[-1] - steps[0])], (y - 0.35, 0.7), color=colors["training"])
                if inc[0]["incarnation"] > 0:
                    merged_t = _first_merged(chaos, n, inc)
                    end = (merged_t if merged_t is not None else steps[-1]) - steps[0]
                    ax.broken_barh([(steps[0] - t0, end)], (y - 0.35, 0.7), color=colors["rejoining"], alpha=0.8)
        for a, b, what in avail[n]:
            ax.broken_barh([(a - t0, b - a)], (y - 0.35, 0.7), color=colors[what])
        closed = [e["t"] - t0 for e in chaos.logs[n] if e["ev"] == "Committed"]
        ax.plot(
            closed,
            [y] * len(closed),
            "|",
            color="#1f4fbf",
            markersize=9,
            label="closing (a commit)" if i == 0 else None,
        )
    ax.set_yticks(range(len(chaos.nodes)), list(reversed(chaos.nodes)))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(
        handles + [plt.Line2D([], [], marker="|", color="#1f4fbf", ls="")],
        list(colors) + ["closing (a commit)"],
        loc="upper center",
        ncol=7,
        bbox_to_anchor=(0.5, 1.18),
        fontsize=8,
    )
    ax.axvline(0, color="k", lw=0.5)
    ax.axvline(chaos.t1 - t0, color="k", lw=0.5)
    ax.set_title("goodput under chaos: every node", loc="left", fontsize=10, pad=28)
    ax = axes[1]
    pts = [
        (chaos.seen[r["round"]] - t0, len(r["participants"]), r.get("live", 0))
        for r in chaos.records
        if r["round"] in chaos.seen
    ]
    if pts:
        xs, q, live = zip(*pts, strict=True)
        ax.step(xs, live, where="post", color="#999999", label="live learners (record)")
        ax.plot(xs, q, ".", color="#1f77b4", markersize=3, label="participants per round")
    ax.set_ylabel("quorum")
    ax.set_ylim(0, len(chaos.nodes) + 0.5)
    ax.legend(loc="lower right", fontsize=8)
    ax = axes[2]
    if chaos.losses:
        ax.plot(
            [t - t0 for t, _, _ in chaos.losses], [v for _, _, v in chaos.losses], "o-", color="#d62728", label="chaos"
        )
    if twin is not None and twin.losses:
        ax.plot(
            [t - twin.t0 for t, _, _ in twin.losses],
            [v for _, _, v in twin.losses],
            "o-",
            color="#2ca02c",
            label="fault-free twin",
        )
    ax.set_ylabel("held-out loss (nats/char)")
    ax.set_xlabel("seconds since the first commit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _first_merged(run: RunData, n: str, inc: list[dict[str, Any]]) -> float | None:
    by_round = {r["round"]: r for r in run.records}
    for ev in inc:
        if ev["ev"] == "Published" and ev["round"] in run.seen:
            rec = by_round.get(ev["round"])
            if rec and any(p["learner"] == n for p in rec["participants"]):
                return run.seen[ev["round"]]
    return None


# ---- main -------------------------------------------------------------------------------------


def start_server() -> tuple[Any, str]:
    import moto.server as server_mod

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def bench(opts: Options, say=print) -> tuple[dict[str, Any], RunData, RunData | None]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server, endpoint = start_server()
    try:
        chaos = run_once(opts, endpoint, "chaos", True, say)
        twin = run_once(opts, endpoint, "twin", False, say) if opts.twin else None
    finally:
        server.stop()
    res = analyse(chaos, twin, opts)
    if opts.plot is not None:
        plot(chaos, twin, opts, opts.plot)
    return res, chaos, twin


def report(res: dict[str, Any], say=print) -> None:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    say("")
    say(
        f"config: {res['config']['algorithm']}, {res['config']['learners']} learners, {res['config']['step_ms']:g} ms steps"
    )
    say(
        f"faults: {res['faults']} (closer kills mid-commit {res['closer_kills_mid_commit']}, missed {res['closer_kills_missed']})"
    )
    rows = [
        (
            "step efficiency (rounds/min vs twin)",
            res.get("step_efficiency"),
            res.get("dp_step_efficiency"),
            res.get("elastic_dp_step_efficiency"),
        ),
        (
            "capacity (merged steps vs twin)",
            res.get("capacity"),
            res.get("dp_capacity"),
            res.get("elastic_dp_capacity"),
        ),
        (
            "goodput of available compute",
            res.get("goodput_of_available"),
            res.get("dp_goodput"),
            res.get("elastic_dp_goodput"),
        ),
    ]
    say(f"{'':40s} {'ours':>8s} {'sync DP':>8s} {'elastic':>8s}")
    for name, a, b, c in rows:
        say(f"{name:40s} {f(a):>8s} {f(b):>8s} {f(c):>8s}")
    say(f"goodput (merged / computed): {f(res['goodput'])}  (twin {f(res.get('twin_goodput'))})")
    say("  where the rest went: " + ", ".join(f"{k} {v:.3f}" for k, v in res["breakdown"].items()))
    if "twin_breakdown" in res:
        say("  twin:                " + ", ".join(f"{k} {v:.3f}" for k, v in res["twin_breakdown"].items()))
    say("  dropped, by cause:   " + ", ".join(f"{k} {v:.3f}" for k, v in res["dropped_by_cause"].items()))
    say(
        f"restart -> process up {f(res['median_restart_to_start_s'])} s, -> joined {f(res['median_restart_to_joined_s'])} s, "
        f"-> first step {f(res['median_restart_to_first_step_s'])} s (medians)"
    )
    say(
        f"kills {res['kills']}, recovered {res['kills_recovered']}; median kill->commit {f(res['median_kill_to_commit_s'])} s, "
        f"kill->victim merged {f(res['median_kill_to_victim_merged_s'])} s"
    )
    say(f"held-out loss: chaos {f(res['loss'])}, twin {f(res.get('twin_loss'))}, ratio {f(res.get('loss_vs_twin'))}")
    say(
        f"identical {res['identical']}, contiguous {res['contiguous']} (twin {res.get('twin_identical')}, {res.get('twin_contiguous')})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Options()
    p.add_argument("--learners", type=int, default=d.learners)
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--fault-every", type=float, default=d.fault_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--step-ms", type=float, default=d.step_ms)
    p.add_argument("--sync-every", type=int, default=d.sync_every)
    p.add_argument("--fragments", type=int, default=d.fragments)
    p.add_argument("--alignment", default=d.alignment, choices=("default", "overwrite", "carry", "adaptive"))
    p.add_argument("--overlap", type=int, default=None)
    p.add_argument("--lease-timeout", type=float, default=d.lease_timeout)
    p.add_argument("--poll-interval", type=float, default=d.poll_interval)
    p.add_argument("--round-timeout", type=float, default=None)
    p.add_argument("--elastic-restart-s", type=float, default=d.elastic_restart_s)
    p.add_argument("--elastic-detect-s", type=float, default=None)
    p.add_argument("--eval-every", type=float, default=d.eval_every)
    p.add_argument("--no-twin", action="store_true")
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--save", type=Path, default=None, help="write both runs' raw data (JSON) here")
    p.add_argument("--load", type=Path, default=None, help="analyse raw data written by --save; run nothing")
    a = p.parse_args()
    opts = Options(
        learners=a.learners,
        minutes=a.minutes,
        fault_every=a.fault_every,
        seed=a.seed,
        step_ms=a.step_ms,
        sync_every=a.sync_every,
        fragments=a.fragments,
        alignment=a.alignment,
        overlap=a.overlap,
        lease_timeout=a.lease_timeout,
        poll_interval=a.poll_interval,
        round_timeout=a.round_timeout,
        elastic_restart_s=a.elastic_restart_s,
        elastic_detect_s=a.elastic_detect_s,
        eval_every=a.eval_every,
        twin=not a.no_twin,
        plot=a.plot,
        workdir=a.workdir,
    )
    if a.load is not None:
        raw = json.loads(a.load.read_text())
        for r in (raw["chaos"], raw["twin"]):
            if r:
                r["seen"] = {int(k): v for k, v in r["seen"].items()}  # (JSON keys are strings)
        chaos, twin = (RunData(**r) if r else None for r in (raw["chaos"], raw["twin"]))
        assert chaos is not None
        # the data parallel models are re-read with this invocation's costs (a sensitivity check)
        costs = {"elastic_restart_s": a.elastic_restart_s, "elastic_detect_s": a.elastic_detect_s}
        opts = Options(**{**raw["options"], **costs, "plot": a.plot, "workdir": None})
        res = analyse(chaos, twin, opts)
        if a.plot is not None:
            plot(chaos, twin, opts, a.plot)
    else:
        res, chaos, twin = bench(opts, say=lambda s: print(s, file=sys.stderr, flush=True))
    if a.save is not None:
        o = {k: v for k, v in asdict(opts).items() if k not in ("plot", "workdir")}
        a.save.write_text(json.dumps({"options": o, "chaos": asdict(chaos), "twin": asdict(twin) if twin else None}))
    report(res, say=lambda s: print(s, file=sys.stderr, flush=True))
    slim = {k: v for k, v in res.items() if k not in ("kill_detail",)}
    print(json.dumps(slim, default=float))


if __name__ == "__main__":
    main()
