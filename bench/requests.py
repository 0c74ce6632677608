"""Store requests per committed round per node, and what they cost on S3.

Drives N learners single-threaded over one in-memory mailbox with a fake clock, each
behind its own counting wrapper, so the figures are exact request counts (no timing).
Setup of the reference figure: 4 fragments, quorum 3, about 5 polls per round.

Target: requests per node per round do not grow with the node count beyond the snapshots a
closer must read (a record and a payload per contribution): the follower columns stay flat
and the closer's GETs grow by two per node.

    python bench/requests.py            # 3, 8 and 32 nodes
    python bench/requests.py --nodes 3 --rounds 200
"""

from __future__ import annotations

import argparse
import random

import numpy as np

import gradientmail_core as gm
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.protocol.run import open_run
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.bridge import Bridge
from gradientmail_core.syncer.learner import Learner
from gradientmail_core.syncer.node import Node
from gradientmail_core.syncer.options import NodeOptions

PRICE_PUT_LIST = 0.005 / 1000  # AWS S3 Standard, USD per request
PRICE_GET = 0.0004 / 1000
PRIOR_ART_LISTS = 97  # per committed round in total, 3 nodes / 4 fragments / quorum 3 / ~5 polls


def measure(n_nodes: int, rounds: int, *, fragments: int = 4, quorum: int = 3, polls_per_round: int = 5) -> dict:
    H = fragments * polls_per_round  # one step and one poll per tick: a round spans H/P = 5 polls
    cfg = gm.DiLoCo(sync_every=H, fragments=fragments, quorum_size=min(quorum, n_nodes))
    shared = gm.MemoryMailbox()
    clock = gm.FakeClock()
    opts = NodeOptions(poll_interval=1.0, lease_timeout=120.0, round_timeout=60.0)
    members = []
    for i in range(n_nodes):
        params = {f"w{j}": np.random.default_rng(j).standard_normal((16, 16)).astype(np.float32) for j in range(8)}
        counting = gm.CountingMailbox(shared)
        store = RunStore(counting)
        adapter = NumpyAdapter(params)
        run, created = open_run(
            store, adapter.schema(), adapter.read, cfg, learner=f"n{i}", compression="", rng=random.Random(i)
        )
        bridge = Bridge()
        node = Node(
            store, clock, run, learner=f"n{i}", nonce=f"{i + 1:08x}", emit=lambda e: None, options=opts, bridge=bridge
        )
        thetas = node.join(created=created)
        learner = Learner(adapter, run, bridge, clock, learner=f"n{i}", emit=lambda e: None)
        learner.start(node.state.head, thetas, {f: v for f, (v, _) in node.state.thetas.items()})
        members.append((params, counting, node, learner))
    for _, _, node, _ in members:
        node.state.list_leases(node.store)
    for _, counting, _, _ in members:
        counting.reset()
    start_head = members[0][2].head
    rng = np.random.default_rng(0)
    while members[0][2].head - start_head < rounds:
        for params, _, node, learner in members:
            for p in params.values():
                p -= np.float32(0.01) * rng.standard_normal(p.shape).astype(np.float32)
            learner.step(8)
            node.tick()
            learner.drain()
        clock.advance(1.0)
    committed = members[0][2].head - start_head
    totals = {op: sum(m[1].counts.get(op, 0) for m in members) for op in ("LIST", "GET", "PUT", "DELETE")}
    per_node = {op: v / committed / n_nodes for op, v in totals.items()}
    closer_member = max(members, key=lambda m: m[2].stats.committed)
    closer = closer_member[1].counts
    others = [m for m in members if m is not closer_member]
    follower = {op: sum(m[1].counts.get(op, 0) for m in others) / len(others) / committed for op in totals}
    cost = (totals["LIST"] + totals["PUT"]) * PRICE_PUT_LIST + totals["GET"] * PRICE_GET
    return {
        "nodes": n_nodes,
        "rounds": committed,
        "per_node": per_node,
        "lists_per_round_total": totals["LIST"] / committed,
        "closer_per_round": {op: closer.get(op, 0) / committed for op in ("LIST", "GET", "PUT", "DELETE")},
        "follower_per_round": follower,
        "usd_per_round": cost / committed,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="*", default=[3, 8, 32])
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args()
    print("requests per committed round (4 fragments, quorum 3, ~5 polls per round, lease_timeout 120 s)")
    print(
        f"{'nodes':>5} | {'LIST/node':>9} {'GET/node':>9} {'PUT/node':>9} {'DEL/node':>9} | "
        f"{'LIST total':>10} {'vs prior art':>12} | {'closer L/G/P/D':>22} | {'follower L/G/P/D':>22} | "
        f"{'USD/round':>10}"
    )
    for n in args.nodes:
        r = measure(n, args.rounds)
        p, c = r["per_node"], r["closer_per_round"]
        ratio = r["lists_per_round_total"] / PRIOR_ART_LISTS
        closer = f"{c['LIST']:.1f}/{c['GET']:.1f}/{c['PUT']:.1f}/{c['DELETE']:.1f}"
        f_ = r["follower_per_round"]
        follower = f"{f_['LIST']:.2f}/{f_['GET']:.2f}/{f_['PUT']:.2f}/{f_['DELETE']:.2f}"
        print(
            f"{n:>5} | {p['LIST']:>9.2f} {p['GET']:>9.2f} {p['PUT']:>9.2f} {p['DELETE']:>9.2f} | "
            f"{r['lists_per_round_total']:>10.1f} {ratio:>11.2f}x | {closer:>22} | {follower:>22} | "
            f"{r['usd_per_round']:>10.6f}"
        )


if __name__ == "__main__":
    main()
