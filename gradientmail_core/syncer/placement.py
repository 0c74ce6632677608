"""Where a node's parameters live, and so how they move (``Placement``): the one seam between the
engine and a sharded node: how a commit's parameters are read and applied, how a contribution is
uploaded, which merger closes its rounds. ``OneProcess`` is every node whose model is in this
process; a sharded node's rank 0 passes ``sharded.lead_rank.OverRanks``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from ..adapters.handles import Incoming
from ..codec.payload import PayloadStream, decode_payload
from ..codec.plan import ChunkSpec
from ..errors import PayloadCorrupt, PayloadLayoutMismatch, RecordInvalid
from ..protocol import keys
from ..protocol.rebuild import rebuild_theta, theta_digest
from ..protocol.records import PayloadRef, RoundRecord, Snapshot, chunk_refs
from ..protocol.run import RunInfo, payload_cap
from ..protocol.store import RunStore
from ..protocol.tape import fetch_theta, read_newest
from .bridge import Bridge, Publish
from .merger import FragmentMerger

Theta = dict[str, np.ndarray]

# The most payload bytes a closer fetches ahead at once for one batch of drawn contributions (the
# rest are streamed as they are judged, as without a cap).
PREFETCH_BYTES = 256 << 20


class Placement(Protocol):
    """How a node's parameters move between the store and its model, and who merges."""

    # The merger that closes this node's rounds; it holds the outer state of the fragments this
    # node closed, and the spool of the contributions of the rounds it closes.
    merger: FragmentMerger
    # Whether the node may poll as a fleet's follower (``max_contributions``: rounds only).
    fleet_polls: bool

    def read_newest(self) -> tuple[dict[int, RoundRecord], dict[int, Theta]]:
        """At join: each fragment's newest record, and the parameters this process holds of it."""
        ...

    def joining(self, newest: Mapping[int, RoundRecord], fragments: list[int]) -> dict[int, Incoming] | None:
        """At join: each fragment's parameters on their way into the model (None: the learner
        stages those ``read_newest`` returned)."""
        ...

    def upload(self, pub: Publish, *, learner: str, compression: str, keep: bool) -> tuple[PayloadRef, bool]:
        """Upload ``pub``'s delta; returns its ref, and whether its chunks were kept in the merger's
        spool as uploaded (only with ``keep``: this node closes rounds and judges it from there)."""
        ...

    def prefetch_contributions(self, r: int, snapshots: Mapping[str, str]) -> None:
        """Before judging a batch of round ``r``'s contributions (learner -> snapshot key, the
        records fetched already): fetch the payloads this process reads, together."""
        ...

    def fetch_commit(self, rec: RoundRecord, prev: tuple[int, Theta | None] | None) -> Theta | None:
        """The parameters of commit ``rec`` this process holds (``prev``: the fragment's previous
        version, to rebuild from the change); raises ``PayloadCorrupt`` for a damaged read."""
        ...

    def incoming(self, f: int, rec: RoundRecord, theta: Theta) -> Incoming | None:
        """Commit ``rec``'s parameters on their way into the model, handed to the training thread."""
        ...


class OneProcess:
    """A node whose model is in this process (see the module)."""

    fleet_polls = True

    def __init__(self, store: RunStore, run: RunInfo, bridge: Bridge, merger: FragmentMerger | None = None) -> None:
        self.store, self.run, self.bridge = store, run, bridge
        self.merger = merger or FragmentMerger.one_process(run, store)

    def read_newest(self) -> tuple[dict[int, RoundRecord], dict[int, Theta]]:
        return read_newest(self.store, self.run)

    def joining(self, newest: Mapping[int, RoundRecord], fragments: list[int]) -> dict[int, Incoming] | None:
        return None

    def incoming(self, f: int, rec: RoundRecord, theta: Theta) -> Incoming | None:
        stage = self.bridge.stage  # e.g. moves the theta to the device here, off the training thread
        return stage(theta) if stage is not None else None

    def fetch_commit(self, rec: RoundRecord, prev: tuple[int, Theta | None] | None) -> Theta | None:
        f, run = rec.fragment, self.run
        if rec.change is not None and prev is not None and prev[1] is not None and prev[0] == rec.version - 1:
            change = self.store.get_payload(
                rec.change, run.shapes[f], max_bytes=payload_cap(run, f), chunk_elements=run.chunk_elements
            )
            if change is not None:
                theta = rebuild_theta(run, f, prev[1], change)
                if theta_digest(run, f, theta) == rec.theta_digest:
                    return theta
        return fetch_theta(self.store, run, f, rec)  # (between checkpoints: rebuilt from the checkpoint)

    # ---- contributions ------------------------------------------------------------------

    def upload(self, pub: Publish, *, learner: str, compression: str, keep: bool) -> tuple[PayloadRef, bool]:
        """In a chunked run (``docs/protocol.md``, "Chunked payloads") a fragment larger than one
        chunk is uploaded as the chunks of its plan, cut from the quantized delta."""

        def key_for_sha(sha: str) -> str:
            return keys.snapshot_blob_key(pub.round, learner, sha, compression)

        if self.store.one_payload(self.run.shapes[pub.fragment], self.run.chunk_elements):
            with pub.delta.stream(self.run.delta_dtypes(pub.fragment), compression=compression) as data:
                ref = self.store.put_payload(key_for_sha, data)
                return ref, keep and self._hold_own(pub, data, ref)
        return self._put_chunks(pub, key_for_sha, compression, keep)

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
                spooled.append(self.merger.spool.put(ref.sha256, data.chunks(), data.size, pub.round))

        ref = self.store.put_fragment(
            key_for_sha,
            pub.delta.quantized(dtypes),
            shapes=shapes,
            dtypes=dtypes,
            chunk_elements=self.run.chunk_elements,
            kind="delta",
            compression=compression,
            on_chunk=spool,
        )
        return ref, keep and len(spooled) == len(self.run.plan(f)) and all(spooled)

    def _hold_own(self, pub: Publish, data: PayloadStream, ref: PayloadRef) -> bool:
        """The payload just uploaded (one chunk), decoded as the closer decodes a contribution from the
        stream produced again and held decoded in the spool; False if it does not decode (then it is
        read back like any contribution)."""
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
        self.merger.spool.hold(ref.sha256, own, pub.round)
        return True

    def prefetch_contributions(self, r: int, snapshots: Mapping[str, str]) -> None:
        """The payloads the records place in the learner's own folder, up to ``PREFETCH_BYTES``, so
        that a batch costs the store's round trip about twice, not twice per contribution."""
        payloads, budget = [], PREFETCH_BYTES
        for learner, key in snapshots.items():
            try:
                snap = self.store.decode_record(self.store.peek(key), Snapshot, key)
            except (RecordInvalid, ValueError):
                continue  # (judged as it is read: corrupt, unsigned or missing)
            for x in chunk_refs(snap.payload):
                if keys.in_snapshot_folder(x.key, x.sha256, r, learner) and x.size <= budget:
                    payloads.append(x.key)
                    budget -= x.size
        self.store.prefetch(payloads)
