"""What verifying a round costs (``gradientmail verify``, ``Session(verify=)``), against what
closing it cost its closer: bytes read from the store and CPU seconds.

A run of ``contributions`` learners over one ``MemoryMailbox`` (numpy models of ``params`` F32
parameters in tensors of 250k, one fragment, F32 deltas, RDA), driven single-threaded until a few
rounds committed. Then, for its newest round:

- **closer**: what its closer did after the state was in hand: judge each snapshot (read the
  record and the payload, sha256, decode, finite check, norms), ``Collector.commit`` (merge, outer
  step, payloads encoded and hashed; here written to memory). Bytes: the snapshots read, and the
  payloads written.
- **verify, warm**: ``RoundVerifier.check`` holding the state of the fragment's previous round
  (what a follower with ``verify=1.0`` holds, and ``gradientmail verify`` for every round after a
  fragment's first): read each snapshot record and contribution, recompute, compare.
- **verify, cold**: the same without that state: the previous round's theta and outer state are read
  too (a follower with ``verify`` below 1, or the first round of each fragment in the CLI).

Bytes are exact (the store's counters); CPU is ``time.process_time`` (the merge's two threads both
count), the best of ``--repeat`` runs. A follower that verifies a round does not download that
round's parameters (the recomputed ones are applied), so its net extra download is the verification's
bytes minus the theta's.

    python bench/verify.py                                   # 1M and 4M params x 2, 4, 8 contributions
    python bench/verify.py --params 1e6 --contributions 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.adapters.base import NumpyAdapter  # noqa: E402
from gradientmail_core.clock import FakeClock  # noqa: E402
from gradientmail_core.mailbox.memory import MemoryMailbox  # noqa: E402
from gradientmail_core.protocol import keys  # noqa: E402
from gradientmail_core.protocol.records import RoundRecord, ref_size  # noqa: E402
from gradientmail_core.protocol.run import RunInfo, read_manifest  # noqa: E402
from gradientmail_core.protocol.schedule import round_of  # noqa: E402
from gradientmail_core.protocol.store import RunStore  # noqa: E402
from gradientmail_core.syncer.collector import Collector  # noqa: E402
from gradientmail_core.syncer.merger import FragmentMerger  # noqa: E402
from gradientmail_core.syncer.replay import (
    differences,  # noqa: E402
    recover,  # noqa: E402
)
from gradientmail_core.syncer.timing import Estimates  # noqa: E402
from gradientmail_core.syncer.verify import VERIFIED, RoundVerifier  # noqa: E402

TENSOR = 250_000


def build_run(params: int, contributions: int, rounds: int) -> MemoryMailbox:
    """A run of ``contributions`` learners that committed ``rounds`` rounds (quorum: all of them)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _cluster import join, see_each_other

    cfg = gm.DiLoCo(sync_every=2, fragments=1, quorum_size=contributions, chunk_elements=None)
    mb, clock = MemoryMailbox(), FakeClock()
    rng = np.random.default_rng(0)
    members = []
    for i in range(contributions):
        model = {f"w{t}": rng.standard_normal(TENSOR, dtype=np.float32) for t in range(params // TENSOR)}
        members.append(join(f"n{i}", NumpyAdapter(model), cfg=cfg, mailbox=mb, clock=clock, seed=i))
    see_each_other(members)
    store = RunStore(mb)
    while len(store.keys(keys.ROUNDS)) < rounds:
        for m in members:
            for v in m.learner.adapter.params.values():
                v += np.float32(0.01) * rng.standard_normal(v.shape, dtype=np.float32)
            m.step(8)
        for m in members:
            m.tick()
        clock.advance(1.0)
    return mb


def close_cost(store: RunStore, run: RunInfo, rec: RoundRecord) -> tuple[float, int, int]:
    """CPU seconds, bytes read and bytes written by the closer of ``rec`` once it held the state."""
    merger = FragmentMerger.one_process(run, store)
    prev = store.read_record(keys.round_key(round_of(rec.fragment, rec.version - 1, run.P)), RoundRecord)
    state = recover(merger, store, run, rec.fragment, prev)
    written = [0]

    def put(key: str, data) -> None:
        written[0] += len(data)
        data.read()  # (written to memory: the bytes are made)

    down, t0 = store.bytes_down, time.process_time()
    c = Collector(rec.round, run, state, 0.0, Estimates(), merger)
    for p in rec.participants:
        c.judge_snapshot(store, p.learner)
    commit = c.commit(compression="", write=put)
    cpu = time.process_time() - t0
    assert not differences(commit, rec), "the bench's closer did not commit the recorded round"
    merger.close()
    return cpu, store.bytes_down - down, written[0]


def verify_cost(store: RunStore, run: RunInfo, rec: RoundRecord, *, warm: bool) -> tuple[float, int]:
    v = RoundVerifier(store, run, keep=True)
    if warm:
        before = v.check_round(rec.round - run.P)
        assert before.status == VERIFIED, before
    down, t0 = store.bytes_down, time.process_time()
    check = v.check(rec)
    cpu = time.process_time() - t0
    assert check.status == VERIFIED, check
    v.close()
    return cpu, store.bytes_down - down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, nargs="+", default=[1e6, 4e6])
    ap.add_argument("--contributions", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; CPU s best of {args.repeat}; MB = 1e6 bytes")
    print(
        "| params | contributions | closer CPU s | verify warm CPU s | cold CPU s | warm / closer |"
        " closer read MB | closer wrote MB | verify warm read MB | cold read MB | theta MB |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for params in args.params:
        n_params = int(params) // TENSOR * TENSOR
        for k in args.contributions:
            mb = build_run(n_params, k, rounds=3)
            store = RunStore(mb)
            run = RunInfo.from_manifest(read_manifest(store))
            head = len(store.keys(keys.ROUNDS)) - 1
            rec = store.read_record(keys.round_key(head), RoundRecord)
            assert rec is not None and len(rec.participants) == k
            close = [close_cost(store, run, rec) for _ in range(args.repeat)]
            warm = [verify_cost(store, run, rec, warm=True) for _ in range(args.repeat)]
            cold = [verify_cost(store, run, rec, warm=False) for _ in range(args.repeat)]
            c_cpu, c_read, c_wrote = min(close)
            w_cpu, w_read = min(warm)
            k_cpu, k_read = min(cold)
            assert rec.theta is not None
            mb_ = 1e6
            print(
                f"| {n_params / 1e6:.0f}M | {k} | {c_cpu:.3f} | {w_cpu:.3f} | {k_cpu:.3f} | {w_cpu / c_cpu:.2f} |"
                f" {c_read / mb_:.1f} | {c_wrote / mb_:.1f} | {w_read / mb_:.1f} | {k_read / mb_:.1f} |"
                f" {ref_size(rec.theta) / mb_:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
