"""Rank 0's hooks into the engine for a closing sharded node, and the other ranks' closer thread
(``closing.py`` does the work on every rank).

``ShardCloser`` stands where ``syncer/closing.py`` and ``streamed.py`` would load a fragment's
state, judge a snapshot or commit (``Bridge.closer``, ``Collector.sharded``): it sends the op down
to the other ranks (the ``down`` channel), runs it here on the node thread and returns what a
one-process closer returns. ``CloserThread`` runs the ops on each rank > 0, one at a time."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..codec.chunked import chunk_specs
from ..errors import MailboxUnavailable, SessionFailed
from ..protocol import keys
from ..protocol.records import PayloadRef, RoundRecord, chunk_refs, digest_of, join_refs
from ..protocol.run import RunInfo
from ..protocol.store import RunStore
from ..syncer.closer import FragmentState, Written
from ..syncer.spool import Spool
from ..syncer.streamed import Made, Verdict
from ..syncer.streamed import _Lost as ContributionLost
from .closing import RankCloser
from .pooling import OpFailed, hexf, ref_wire, unhexf

if TYPE_CHECKING:
    from ..syncer.closer import Collector, Judged
    from .wire import Channel

_log = logging.getLogger(__name__)


class ShardCloser:
    """Rank 0's hooks for ``syncer/closing.py`` and ``streamed.py`` (``Bridge.closer``): each sends
    its op to the other ranks, runs it here and returns what a one-process closer returns."""

    def __init__(self, ranker: RankCloser, down: Channel, stopping: threading.Event) -> None:
        self.ranker, self.down, self.stopping = ranker, down, stopping

    def _op(self, op: dict[str, Any]) -> Any:
        """Send ``op`` to the other ranks and run it here (rank 0's node thread, the only caller:
        the ops go out one at a time, in order)."""
        if self.stopping.is_set():
            raise SessionFailed("the node is stopping")
        for r in range(1, self.ranker.world):
            self.down.send(r, {"close": op})
        try:
            return self.ranker.run_op(op)
        except OpFailed as e:
            if e.unavailable:
                raise MailboxUnavailable(f"a rank of this node could not read the store: {e}") from None
            raise

    def state(self, run: RunInfo, f: int, rec: RoundRecord | None, held: FragmentState | None) -> FragmentState:
        version = rec.version if rec is not None else 0
        if held is not None and held.version == version:
            return held  # this node's own commit: every rank holds its ranges of it
        if rec is None:
            theta, outer = run.manifest.init[f], None
        else:
            if rec.theta is None or rec.outer is None:
                raise SessionFailed(f"round {rec.round} names no parameters or outer state: not for sharded closers")
            theta, outer = rec.theta, rec.outer
        op: dict[str, Any] = {
            "op": "state",
            "f": f,
            "version": version,
            "theta": [ref_wire(c) for c in chunk_refs(theta)],
        }
        if outer is not None:
            op["outer"] = [ref_wire(c) for c in chunk_refs(outer)]
        try:
            self._op(op)
        except OpFailed as e:
            raise SessionFailed(f"fragment {f}: the ranks could not load the outer state: {e}") from None
        return FragmentState(version, {}, {}, {}, checkpoint=version)

    def landed(self, f: int, version: int) -> None:
        """The record of this node's commit of fragment ``f`` at ``version`` is written: the ranks
        let the state it started from go."""
        self._op({"op": "landed", "f": f, "version": version})

    def judge(self, store: RunStore, spool: Spool | None, run: RunInfo, f: int, ref: PayloadRef, round: int) -> Verdict:
        op = {"op": "judge", "f": f, "round": round, "refs": [ref_wire(c) for c in chunk_refs(ref)]}
        got = self._op(op)
        if got["status"] != "ok":
            return Verdict(got["status"])
        return Verdict("ok", bool(got["finite"]), {n: unhexf(v) for n, v in got["norms"].items()})

    def commit(self, c: Collector, accepted: list[Judged], *, final: bool, checkpoint: bool, compression: str) -> Made:
        """The commit's payloads, written by the ranks. Its state here is the version only: the
        ranks hold the arrays (``RankCloser.states``)."""
        run, f, r = c.run, c.fragment, c.round
        op = {
            "op": "commit",
            "f": f,
            "round": r,
            "version": c.state.version,
            "final": final,
            "checkpoint": checkpoint,
            "compression": compression,
            "accepted": [
                [
                    [ref_wire(x) for x in chunk_refs(j.snapshot.payload)] if j.snapshot is not None else [],
                    hexf(j.weight),
                    {n: hexf(v) for n, v in (j.norms or {}).items()},
                ]
                for j in accepted
            ],
        }
        try:
            got = self._op(op)
        except OpFailed as e:
            lost = e.lost
            if lost is not None:  # rejected there as any closer rejects a contribution it cannot read
                raise ContributionLost(accepted[lost[0]], lost[1], lost[2]) from None
            raise
        counts = {
            "theta": len(run.plan(f)),
            "change": len(run.plan(f)),
            "outer": len(chunk_specs(run.outer_shapes(f), run.chunk_elements)),
        }
        refs: dict[str, PayloadRef] = {}
        shas: dict[str, list[str]] = {}
        payloads: dict[str, Any] = {}
        for kind_written, chunks in got["parts"].items():
            kind, written = kind_written.split("/")
            n = counts[kind]
            if sorted(int(k) for k in chunks) != list(range(n)):
                raise SessionFailed(f"round {r}: the ranks wrote chunks {sorted(chunks)} of the {kind}'s {n}")
            ordered = [chunks[str(k)] for k in range(n)]
            shas[kind_written] = [sha for sha, _ in ordered]
            if written == "1":
                zip_ = compression
                made = [
                    PayloadRef(key=keys.round_blob_key(r, kind, sha, zip_), sha256=sha, size=size)
                    for sha, size in ordered
                ]
                refs[kind] = join_refs(made)
                for ref in made:
                    payloads[ref.key] = Written(ref.size, ref.sha256)
        theta_digest = digest_of(shas["theta/1" if checkpoint and compression == "" else "theta/0"])
        outer_digest = None if checkpoint else digest_of(shas["outer/0"])
        cosine = None if got["cosine"] is None else unhexf(got["cosine"])
        v = c.state.version + 1
        state = FragmentState(v, {}, {}, {}, v if checkpoint else c.state.checkpoint)
        return Made(refs, theta_digest, outer_digest, cosine, payloads, state)


class CloserThread:
    """Ranks > 0: runs the ops rank 0 sends, one at a time, on a thread of its own."""

    def __init__(self, name: str) -> None:
        self.ops: queue.Queue[Mapping[str, Any] | None] = queue.Queue()
        self.ranker: RankCloser | None = None
        self.thread: threading.Thread | None = None
        self.name = name

    def start(self, ranker: RankCloser) -> None:
        self.ranker = ranker
        self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self.thread.start()

    def put(self, op: Mapping[str, Any]) -> None:
        self.ops.put(op)

    def stop(self, timeout: float) -> None:
        self.ops.put(None)
        if self.thread is not None:
            self.thread.join(timeout=timeout)
        if self.ranker is not None:
            self.ranker.spool.close()

    def _loop(self) -> None:
        assert self.ranker is not None
        while True:
            op = self.ops.get()
            if op is None:
                return
            try:
                self.ranker.run_op(op)
            except OpFailed as e:  # every rank learned it; rank 0 decides what it means
                _log.debug("closer op %s failed: %s", op.get("op"), e)
            except Exception:  # outside a phase (a collective itself failed): keep serving ops
                _log.exception("closer op %s failed on this rank", op.get("op"))
