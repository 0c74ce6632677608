"""Garbage collection after a commit: what no node will read again is deleted by the closer."""

from __future__ import annotations

from ..protocol import keys
from ..protocol.schedule import fragment_of, round_of
from ..protocol.store import RunStore
from .state import NodeState


class GarbageCollector:
    def __init__(self, store: RunStore, state: NodeState) -> None:
        self.store, self.state = store, state

    def collect(self, r: int) -> None:
        """After committing r: snapshot records, rosters and claims of rounds <= r, leases abandoned long
        ago, and the payloads no reader needs: snapshot payloads of rounds <= r and round payloads of
        rounds <= r - 2P, except what a recovery replays (``_checkpoint_rounds``) and what verifying the
        newest rounds needs (``_window``)."""
        store, s = self.store, self.state
        P = s.run.P
        ck = self._checkpoint_rounds()
        records_from, contributions_from, states_from = self._window(r)
        doomed = [
            keys.snapshot_key(rr, lr)
            for rr, ls in s.snapshot_keys.items()
            if rr <= r and rr < records_from
            for lr in ls
        ]
        for k in store.keys(keys.SNAPSHOT_BLOBS):
            b = keys.parse_blob_key(k)
            if b is None or (
                b.round is not None
                and b.round <= r
                and b.round <= ck[fragment_of(b.round, P)]
                and b.round < contributions_from
            ):
                doomed.append(k)
        if s.run.cfg.max_contributions is not None:
            # A capped round's roster goes with its snapshot records (what checking its draw reads
            # besides the record), and so do the rosters of closes given up (no record names them).
            for k in store.keys(keys.ROSTERS):
                b = keys.parse_blob_key(k)
                if b is None or (b.round is not None and b.round <= r and b.round < records_from):
                    doomed.append(k)
        for k in store.keys(keys.CLAIMS):
            parsed = keys.parse_claim_key(k)
            if parsed is None or parsed[0] <= r:
                doomed.append(k)
        cutoff = r - 2 * P
        if cutoff >= 0:
            for k in store.keys(keys.ROUND_BLOBS):
                b = keys.parse_blob_key(k)
                if (
                    b is not None
                    and b.round is not None
                    and b.round <= cutoff
                    and b.round < ck[fragment_of(b.round, P)]
                    and b.round < states_from
                ):
                    doomed.append(k)
        doomed += s.liveness.abandoned()
        if doomed:
            store.delete(doomed)
        for rr in [rr for rr in s.snapshot_keys if rr <= r and rr < records_from]:
            del s.snapshot_keys[rr]

    def _window(self, r: int) -> tuple[int, int, int]:
        """What verifying each of the newest ``W = verify_window`` rounds (``r - W + 1`` to ``r``)
        needs, as the first round of each kind kept: ``(snapshot records and rosters, snapshot
        payloads, round payloads)`` (``docs/protocol.md`` section 11, "The window"). ``W = 0``: nothing more than
        the run needs (every bound past ``r``)."""
        cfg = self.state.run.cfg
        w = cfg.verify_window
        if w == 0:
            return r + 1, r + 1, r + 1
        k, P = cfg.checkpoint_every, self.state.run.P
        first = r - w + 1
        return first, first - (k - 1) * P, first - k * P

    def _checkpoint_rounds(self) -> list[int]:
        """Per fragment, the round of its newest checkpoint (-1: the initial parameters): a recovery needs
        its payloads and every change and contribution after it, until a newer checkpoint commits."""
        out, P = [], self.state.run.P
        for f in range(P):
            rec = self.state.newest.get(f)
            if rec is None or rec.checkpoint == 0:
                out.append(-1)
            else:
                out.append(rec.round if rec.checkpoint is None else round_of(f, rec.checkpoint, P))
        return out
