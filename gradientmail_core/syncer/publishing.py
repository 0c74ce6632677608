"""Contributing: upload what the training thread handed over (a delta payload, then the
snapshot record that names it).

In a chunked run (``docs/protocol.md``, "Chunked payloads") a fragment larger than one chunk is
uploaded as the chunks of its plan, cut from the quantized delta (``Contribution.quantized``). A
contribution that uploads itself (``upload(store, run, fragment, round, learner, compression) ->
PayloadRef``: a sharded node, whose ranks each upload their chunks) is asked to, and the node
writes the snapshot record naming the ref it returns.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import events as ev
from ..codec.payload import PayloadStream, decode_payload
from ..codec.plan import ChunkSpec
from ..errors import PayloadCorrupt, PayloadLayoutMismatch
from ..mailbox import CreateOutcome
from ..protocol import keys
from ..protocol.records import PayloadRef, Snapshot, ref_size
from ..protocol.run import payload_cap
from .bridge import Publish
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
        f, dtypes = pub.fragment, self.run.delta_dtypes(pub.fragment)

        def key_for_sha(sha: str) -> str:
            return keys.snapshot_blob_key(pub.round, self.me, sha, compression)

        # A node closing rounds keeps its contribution's chunks in its spool as it uploads them, and
        # judges it from there (``closer.Collector.judge_snapshot``): a node closing nothing keeps nothing.
        keep = self.collector is not None
        kept = False
        upload = getattr(pub.delta, "upload", None)
        if upload is not None:
            ref = upload(self.store, self.run, f, pub.round, self.me, compression)
        elif self.store.one_payload(self.run.shapes[f], self.run.chunk_elements):
            with pub.delta.stream(dtypes, compression=compression) as data:
                ref = self.store.put_payload(key_for_sha, data)
                kept = keep and self._hold_own(pub, data, ref)
        else:
            ref, kept = self._put_chunks(pub, key_for_sha, compression, keep)
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
        if outcome is CreateOutcome.CREATED and kept:  # not a retry's read-back
            self.own_snapshots[pub.round] = snap
        self.snapshot_keys.setdefault(pub.round, set()).add(self.me)
        self.contributed = max(self.contributed, pub.round)
        self.emit(ev.Published(self.me, pub.round, pub.fragment, pub.steps, pub.tokens, ref_size(ref), pub.final))

    def _put_chunks(
        self, pub: Publish, key_for_sha: Callable[[str], str], compression: str, keep: bool
    ) -> tuple[PayloadRef, bool]:
        """The delta as the chunks of its fragment's plan; with ``keep``, each chunk's bytes kept in
        the spool as uploaded (then True: the closer judges and merges them from there)."""
        f = pub.fragment
        shapes, dtypes = self.run.shapes[f], self.run.delta_dtypes(f)
        spooled: list[bool] = []

        def spool(s: ChunkSpec, data: PayloadStream, ref: PayloadRef) -> None:
            if keep:
                spooled.append(self.spool.put(ref.sha256, data.chunks(), data.size, pub.round))

        quantized = getattr(pub.delta, "quantized", None)
        if quantized is None:
            raise TypeError(f"{type(pub.delta).__name__} offers neither quantized() nor upload(): cannot chunk it")
        ref = self.store.put_fragment(
            key_for_sha,
            quantized(dtypes),
            shapes=shapes,
            dtypes=dtypes,
            chunk_elements=self.run.chunk_elements,
            kind="delta",
            compression=compression,
            on_chunk=spool,
        )
        return ref, keep and len(spooled) == len(self.run.plan(f)) and all(spooled)

    def _hold_own(self, pub: Publish, data: PayloadStream, ref: PayloadRef) -> bool:
        """The payload just uploaded (one chunk), decoded as the closer decodes a contribution (same
        shapes, dtypes and cap; hash checked) from the stream produced again, never joined, and held
        decoded in the spool: judging needs it decoded, so its bytes are not kept beside it. False
        if it does not decode: then it is read back like any contribution."""
        f = pub.fragment
        try:
            own = decode_payload(
                data.chunks(),
                self.run.shapes[f],
                size=data.size,
                sha256=data.sha256,
                compression=keys.compression_of(ref.key),
                max_bytes=payload_cap(self.run, f),
                dtypes=self.run.delta_dtypes(f),
                key=ref.key,
            )
        except (PayloadCorrupt, PayloadLayoutMismatch):
            return False
        self.spool.hold(ref.sha256, own, pub.round)
        return True
