"""The faults a seed injects while the run is in its *faults* phase, beyond each node's
background store faults (``_background_faults``: latency, 503s, lost acks, 412 retries, bit
flips):

- preemption (``_tapper``): while one node's store call is "slow", another node ticks (often a
  rival closer of the same round), or the node is paused inside its call (``_pause_inside``);
- the chaos timer (``_chaos``): kill a node, arm it to die at its k-th next store call, stall it,
  make it leave, brown out part of the store for it, or let a ghost write a bad snapshot
  (``_ghost``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from gradientmail_core.codec.header import sha256_hex
from gradientmail_core.codec.payload import encode_payload
from gradientmail_core.codec.plan import chunk_specs
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import PayloadRef, Snapshot, encode, join_refs
from gradientmail_core.protocol.schedule import fragment_of, version_before

from .actors import NodeActions
from .audit import AuditMailbox
from .faults import Fault, Op, Phase
from .scenario import BROWNOUT_PREFIXES, CRASH_TARGETS, GHOST
from .state import SimNode


class Chaos(NodeActions):
    # ---- preemption and background faults ----------------------------------------------

    def _tapper(self, name: str) -> Callable[[Op, str], None]:
        """Preemption: while this node's request is "slow", another node ticks (often right
        before a commit or a claim), as concurrent processes interleave. This is what makes two
        closers race for one round record, GC run while a commit is in flight, and so on."""

        def tap(op: Op, key: str) -> None:
            if self.phase != "faults" or self.preempting:
                return
            contested = op == "put" and (key.startswith(keys.ROUNDS) or key.startswith(keys.CLAIMS))
            if self.rng.random() < (self.draw.p_pause_contested if contested else self.draw.p_pause):
                seconds = self.rng.uniform(0.3, 2.5 * self.draw.options.lease_timeout)
                self._trace(f"{self.T:.6f} {name} paused for {seconds:.3f} s inside {op} {key}")
                self.stats["chaos/pause_mid_call"] += 1
                self.preempting = True
                try:
                    self._pause_inside(self.nodes[name], seconds)
                finally:
                    self.preempting = False
                return
            if self.rng.random() >= (self.draw.p_preempt_contested if contested else self.draw.p_preempt):
                return
            others = [
                o for o in self.nodes.values() if o.name != name and o.state == "up" and self.T >= o.stalled_until
            ]
            if not others:
                return
            r = keys.parse_round_key(key) if contested else None
            rivals = [
                o for o in others if o.node is not None and o.node.state.collector and o.node.state.collector.round == r
            ]
            other = self.rng.choice(rivals or others)  # a rival closer of the same round, if any
            self._trace(f"{self.T:.6f} {name} {op} {key} is slow: {other.name} acts meanwhile")
            self.stats["preemptions"] += 1
            self.preempting = True
            try:
                self.stats["ticks"] += 1
                self._tick(other)
            finally:
                self.preempting = False

        return tap

    def _background_faults(self, name: str) -> list[Fault]:
        d = self.draw
        return [
            Fault(kind="latency", probability=d.p_latency, seconds=self.rng.uniform(0.01, 0.3)),
            Fault(kind="error", probability=d.p_error, message="HTTP 503 SlowDown (injected)"),
            Fault(
                kind="error",
                ops=("put",),
                phase="landed",
                probability=d.p_lost_ack,
                message="connection reset after the request was sent (injected)",
            ),
            Fault(
                kind="error",
                ops=("put",),
                probability=d.p_error / 2,
                message="HTTP 409 ConditionalRequestConflict (injected)",
            ),
            Fault(kind="retry_412", ops=("put",), probability=d.p_retry),
            Fault(kind="flip", ops=("get",), prefix=keys.BLOBS, probability=d.p_flip),
        ]

    def _pause_inside(self, paused: SimNode, seconds: float) -> None:
        """The node is paused (SIGSTOP) in the middle of a store call: the others run on for
        ``seconds`` (its events and the chaos timer wait), then its call proceeds, on its now
        stale view of the run."""
        until = self.T + seconds
        held = []
        while self.queue and self.queue[0][0] <= until:
            item = heapq.heappop(self.queue)
            at, _, name, kind, gen = item
            if name == paused.name or kind == "chaos":
                held.append(item)
                continue
            self._advance_to(at)
            self._dispatch(name, kind, gen)
        self._advance_to(until)
        for item in held:
            heapq.heappush(self.queue, item)

    # ---- the chaos timer ----------------------------------------------------------------

    def _chaos(self) -> None:
        up = [sn for sn in self.nodes.values() if sn.state == "up" and self.T >= sn.stalled_until]
        if not up:
            return
        sn = self.rng.choice(up)
        what = self.rng.choices(["kill", "arm", "stall", "leave", "brownout", "ghost"], weights=[2, 4, 3, 1, 2, 2])[0]
        lease = self.draw.options.lease_timeout
        if what == "kill":
            self._crash(sn, "killed (SIGKILL)")
            self.stats["chaos/kill"] += 1
        elif what == "arm":
            ops, prefix = self.rng.choice(CRASH_TARGETS)
            phase: Phase = self.rng.choice(["before", "landed", "replied"])
            # A node writes a round record (and its payloads) only when it closes a round, a few
            # times a run: armed on those, the crash comes within the next few such writes, or the
            # commit point itself is almost never hit.
            rare = ops == ("put",) and prefix in (keys.ROUNDS, keys.ROUND_BLOBS)
            skip = self.rng.randint(0, 2 if rare else 20)
            sn.faulty.arm_crash(after_calls=skip, phase=phase, ops=ops, prefix=prefix)
            self.stats["chaos/arm"] += 1
        elif what == "stall":
            sn.stalled_until = self.T + self.rng.uniform(0.2, 3 * lease)
            self._trace(f"{self.T:.6f} {sn.name} stalls until {sn.stalled_until:.6f}")
            self.stats["chaos/stall"] += 1
        elif what == "leave":
            if sum(1 for s in self.nodes.values() if s.state == "up") >= 2:
                self._leave(sn)
                self.stats["chaos/leave"] += 1
        elif what == "ghost":
            self._ghost()
        else:
            prefix = self.rng.choice(BROWNOUT_PREFIXES)
            rule = sn.faulty.add(
                Fault(
                    kind="error",
                    prefix=prefix,
                    probability=self.rng.uniform(0.5, 1.0),
                    times=self.rng.randint(5, 30),
                    message="HTTP 503 brownout (injected)",
                )
            )
            self._trace(f"{self.T:.6f} {sn.name} brownout on {prefix!r} ({rule.times} errors)")
            self.stats["chaos/brownout"] += 1

    def _ghost(self) -> None:
        """A broken contributor ("ghost", holding no lease) writes a bad snapshot into the open
        round: stale (relative to an older version), with a payload that does not hash to its
        reference, with non-finite values, with zero steps, or of another schema. The closer
        must reject it with that reason; a mutant that accepts it is caught by the auditor."""
        run = self.auditor.run
        if run is None:
            return
        r = self.auditor.head + 1
        key = keys.snapshot_key(r, GHOST)
        if self.store.get(key) is not None:
            return
        f, base = fragment_of(r, run.P), version_before(r, run.P)
        kinds = ["corrupt", "nonfinite", "zero_steps", "schema"] + (["stale", "stale"] if base > 0 else [])
        kind = self.rng.choice(kinds)
        g = np.random.default_rng([self.config.seed, r, 3])
        delta = {n: np.asarray(0.01 * g.standard_normal(s), np.float32) for n, s in run.shapes[f].items()}
        if kind == "nonfinite":
            next(iter(delta.values())).flat[0] = np.nan
        mb = AuditMailbox(self.store, self.auditor, GHOST)
        refs = []
        chunks = [
            encode_payload(delta, run.delta_dtypes(f), kind="delta", chunk=s)
            for s in chunk_specs(run.shapes[f], run.chunk_elements)
        ]
        for i, data in enumerate(chunks):
            sha = sha256_hex(data)
            if kind == "corrupt" and i == len(chunks) - 1:
                sha = sha256_hex(data + b"x")  # the reference does not match the bytes stored under it
            pkey = keys.snapshot_blob_key(r, GHOST, sha)
            mb.put_if_absent(pkey, data)
            refs.append(PayloadRef(key=pkey, sha256=sha, size=len(data)))
        snap = Snapshot(
            learner=GHOST,
            round=r,
            local_step=100,
            steps=0 if kind == "zero_steps" else 4,
            tokens=16,
            base_version=base - 1 if kind == "stale" else base,
            step_seconds=0.1,
            schema_digest=("0" * 64) if kind == "schema" else run.digest,
            payload=join_refs(refs),
        )
        mb.put_if_absent(key, encode(snap))
        self._trace(f"{self.T:.6f} ghost writes a {kind} snapshot into round {r}")
        self.stats[f"chaos/ghost/{kind}"] += 1
