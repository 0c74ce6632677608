"""Garbage collection after a commit: what no node will read again is deleted by the closer."""

from __future__ import annotations

from ..protocol import keys
from .state import NodeState


class GarbageCollection(NodeState):
    def _collect_garbage(self, r: int) -> None:
        """After committing r: snapshots and their payloads of rounds <= r, claims of rounds
        <= r, round payloads of rounds <= r - 2P, and leases abandoned long ago."""
        store = self.store
        doomed = [keys.snapshot_key(rr, lr) for rr, ls in self.snapshot_keys.items() if rr <= r for lr in ls]
        for k in store.keys(keys.SNAPSHOT_BLOBS):
            b = keys.parse_blob_key(k)
            if b is None or (b.round is not None and b.round <= r):
                doomed.append(k)
        for k in store.keys(keys.CLAIMS):
            parsed = keys.parse_claim_key(k)
            if parsed is None or parsed[0] <= r:
                doomed.append(k)
        cutoff = r - 2 * self.run.P
        if cutoff >= 0:
            for k in store.keys(keys.ROUND_BLOBS):
                b = keys.parse_blob_key(k)
                if b is not None and b.round is not None and b.round <= cutoff:
                    doomed.append(k)
        doomed += self.liveness.abandoned()
        if doomed:
            store.delete(doomed)
        for rr in [rr for rr in self.snapshot_keys if rr <= r]:
            del self.snapshot_keys[rr]
