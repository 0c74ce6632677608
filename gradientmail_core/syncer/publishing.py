"""Contributing: upload what the training thread handed over (a delta payload, then the
snapshot record that names it)."""

from __future__ import annotations

from .. import events as ev
from ..mailbox import CreateOutcome
from ..protocol import keys
from ..protocol.records import Snapshot
from .bridge import Publish
from .closer import upload_form
from .state import NodeState


class Publishing(NodeState):
    def _publish_pending(self) -> None:
        while True:
            with self.bridge.lock:
                if not self.bridge.outbox:
                    return
                pub = self.bridge.outbox[0]
            self._publish(pub)
            with self.bridge.lock:
                self.bridge.outbox.popleft()

    def _publish(self, pub: Publish) -> None:
        if pub.round <= self.head:
            self.emit(ev.Skipped(self.me, pub.round, "round already committed"))
            return
        compression = self.opts.compression
        with pub.delta.stream(self.run.delta_dtypes(pub.fragment), compression=compression) as data:
            ref = self.store.put_payload(
                lambda sha: keys.snapshot_blob_key(pub.round, self.me, sha, compression), upload_form(data)
            )
            # Only a node closing rounds judges its own snapshot from memory (``closing``): a node
            # closing nothing never holds the payload joined.
            own = data.read() if self.collector is not None else None
        snap = Snapshot(
            learner=self.me,
            round=pub.round,
            local_step=pub.local_step,
            steps=pub.steps,
            tokens=pub.tokens,
            base_version=pub.base_version,
            step_seconds=max(pub.step_seconds, 0.0),
            schema_digest=self.run.digest,
            payload=ref,
            final=pub.final,
            nonce=self.nonce,
        )
        outcome, _ = self.store.put_record(keys.snapshot_key(pub.round, self.me), snap)
        if outcome is CreateOutcome.TAKEN:
            self.emit(ev.Skipped(self.me, pub.round, "this learner id already contributed to the round"))
            return
        self.stats.published += 1
        if outcome is CreateOutcome.CREATED and own is not None:  # what the store holds (not a retry's read-back)
            self.own_snapshots[pub.round] = (snap, own)
        self.snapshot_keys.setdefault(pub.round, set()).add(self.me)
        self.emit(ev.Published(self.me, pub.round, pub.fragment, pub.steps, pub.tokens, ref.size, pub.final))
