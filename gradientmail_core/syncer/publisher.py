"""Contributing: upload what the training thread handed over (the payload, by the node's
placement), then write the snapshot record that names it."""

from __future__ import annotations

from collections.abc import Callable

from .. import events as ev
from ..mailbox import CreateOutcome
from ..protocol import keys
from ..protocol.records import Snapshot, ref_size
from ..protocol.store import RunStore
from .bridge import Bridge, Publish
from .placement import Placement
from .state import NodeState


class Publisher:
    def __init__(
        self,
        store: RunStore,
        state: NodeState,
        placement: Placement,
        bridge: Bridge,
        emit: Callable[[ev.Event], None],
        *,
        nonce: str,
        compression: str,
    ) -> None:
        self.store, self.state, self.placement, self.bridge, self.emit = store, state, placement, bridge, emit
        self.nonce, self.compression = nonce, compression

    def publish_pending(self) -> None:
        """Upload what the training thread handed over, in order; a failed upload stays first in
        the outbox and is retried on the next poll."""
        while True:
            with self.bridge.lock:
                if not self.bridge.outbox:
                    return
                pub = self.bridge.outbox[0]
            self.publish(pub)
            with self.bridge.lock:
                self.bridge.outbox.popleft()

    def publish(self, pub: Publish) -> None:
        s, me = self.state, self.state.me
        if pub.round <= s.head:
            self.emit(ev.Skipped(me, pub.round, "round already committed"))
            return
        # A node closing rounds keeps its contribution's chunks in its spool as it uploads them, and
        # judges it from there (``closer.Collector.judge_snapshot``): a node closing nothing keeps nothing.
        ref, kept = self.placement.upload(pub, learner=me, compression=self.compression, keep=s.collector is not None)
        snap = Snapshot(
            learner=me,
            round=pub.round,
            local_step=pub.local_step,
            steps=pub.steps,
            tokens=pub.tokens,
            base_version=pub.base_version,
            step_seconds=max(pub.step_seconds, 0.0),
            schema_digest=s.run.digest,
            payload=ref,
            final=pub.final,
            nonce=self.nonce,
        )
        outcome, _ = self.store.put_record(keys.snapshot_key(pub.round, me), snap)
        if outcome is CreateOutcome.TAKEN:
            self.emit(ev.Skipped(me, pub.round, "this learner id already contributed to the round"))
            return
        s.stats.published += 1
        if outcome is CreateOutcome.CREATED and kept:  # not a retry's read-back
            s.own_snapshots[pub.round] = snap
        s.snapshot_keys.setdefault(pub.round, set()).add(me)
        s.contributed = max(s.contributed, pub.round)
        s.uploaded[pub.fragment] = max(s.uploaded.get(pub.fragment, -1), pub.round)
        self.emit(ev.Published(me, pub.round, pub.fragment, pub.steps, pub.tokens, ref_size(ref), pub.final))
