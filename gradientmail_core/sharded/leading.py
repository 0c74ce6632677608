"""A closing sharded node: rank 0's closer (``ShardCloser``, what its engine calls) and the other
ranks' closer thread (``CloserThread``). Each op goes down to the other ranks (the ``down``
channel) and runs on every rank at once (``run_op``): each rank's ``syncer.kernel.FragmentCloser``
does its part over the ranges its shards hold, the ranks meeting in ``pooling.GlooRanks``' phases.
A rank that fails fails the op everywhere; rank 0 raises what a one-process closer would
(``MailboxUnavailable``: the node tries again on its next poll; ``Lost``: a contribution rejected)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import MailboxUnavailable, SessionFailed
from ..protocol.records import PayloadRef, chunk_refs, join_refs
from ..syncer.fragment import Accepted, CommitOp, FragmentState, Made, Verdict, discard
from ..syncer.kernel import FragmentCloser
from ..syncer.writing import Put
from .pooling import OpFailed

if TYPE_CHECKING:
    from .wire import Channel

_log = logging.getLogger(__name__)


def _refs(ref: PayloadRef) -> list[list[Any]]:
    return [[c.key, c.sha256, c.size] for c in chunk_refs(ref)]


def _unrefs(v: Any) -> PayloadRef:
    return join_refs([PayloadRef(key=str(k), sha256=str(s), size=int(n)) for k, s, n in v])


def run_op(kernel: FragmentCloser, op: Mapping[str, Any]) -> Any:
    """Run one closer op on this rank's closer (every rank runs it at once)."""
    kind = op["op"]
    if "round" in op:
        kernel.spool.drop_through(int(op["round"]) - 1)
    f = int(op["f"])
    if kind == "load":
        outer = _unrefs(op["outer"]) if op.get("outer") is not None else None
        return kernel.load(f, int(op["version"]), _unrefs(op["theta"]), outer)
    if kind == "judge":
        return kernel.judge(f, int(op["round"]), _unrefs(op["refs"]))
    if kind == "commit":
        accepted = tuple(
            Accepted(
                tuple(chunk_refs(_unrefs(a[0]))), float.fromhex(a[1]), {n: float.fromhex(v) for n, v in a[2].items()}
            )
            for a in op["accepted"]
        )
        c = CommitOp(
            f,
            int(op["round"]),
            int(op["version"]),
            bool(op["final"]),
            bool(op["checkpoint"]),
            str(op["compression"]),
            accepted,
        )
        return kernel.commit(c, kernel.store.put_blob if op["write"] else discard)
    if kind == "landed":  # (no collective: every rank just adopts the state it committed)
        return kernel.landed(f, int(op["version"]))
    raise AssertionError(f"unknown closer op {kind!r}")


class ShardCloser:
    """Rank 0's closer (``syncer.collector.Closer``): sends each op to the other ranks, runs it here
    and returns what a one-process closer returns (of rank 0's ranges; the node's learner gets no
    parameters from it: the ranks read each commit's chunks)."""

    def __init__(self, kernel: FragmentCloser, down: Channel, stopping: threading.Event) -> None:
        self.kernel, self.down, self.stopping = kernel, down, stopping
        self.spool = kernel.spool

    def _op(self, op: dict[str, Any]) -> Any:
        """Send ``op`` to the other ranks and run it here (rank 0's node thread, the only caller:
        the ops go out one at a time, in order)."""
        if self.stopping.is_set():
            raise SessionFailed("the node is stopping")
        for r in range(1, self.kernel.ranks.world):
            self.down.send(r, {"close": op})
        try:
            return run_op(self.kernel, op)
        except OpFailed as e:
            lost = e.lost
            if lost is not None:
                raise lost from None
            if e.unavailable:
                raise MailboxUnavailable(f"a rank of this node could not read the store: {e}") from None
            raise SessionFailed(f"fragment {op['f']}: the ranks failed an op ({op['op']}): {e}") from None

    def held(self, f: int) -> FragmentState | None:
        return self.kernel.held(f)

    def holds_any(self) -> bool:
        return self.kernel.holds_any()

    def forget(self, f: int, *, unless: int | None = None) -> None:
        self.kernel.forget(f, unless=unless)  # (the ranks let it go when a new state is loaded)

    def load(
        self, f: int, version: int, theta: PayloadRef, outer: PayloadRef | None, known: dict | None = None
    ) -> FragmentState:
        op = {
            "op": "load",
            "f": f,
            "version": version,
            "theta": _refs(theta),
            "outer": None if outer is None else _refs(outer),
        }
        return self._op(op)  # type: ignore[no-any-return]

    def judge(self, f: int, round: int, ref: PayloadRef) -> Verdict:
        return self._op({"op": "judge", "f": f, "round": round, "refs": _refs(ref)})  # type: ignore[no-any-return]

    def reserve(self, f: int) -> None:
        pass  # each rank allocates its ranges' new state as it commits

    def commit(self, op: CommitOp, put: Put | None) -> Made:
        assert put is not None, "a sharded closer writes as it commits"
        wire = {
            "op": "commit",
            "f": op.f,
            "round": op.round,
            "version": op.version,
            "final": op.final,
            "checkpoint": op.checkpoint,
            "compression": op.compression,
            "write": put is not discard,
            "accepted": [
                [_refs(join_refs(list(a.refs))), float(a.weight).hex(), {n: float(v).hex() for n, v in a.norms.items()}]
                for a in op.accepted
            ],
        }
        return self._op(wire)  # type: ignore[no-any-return]

    def landed(self, f: int, version: int) -> None:
        self._op({"op": "landed", "f": f, "version": version})


class CloserThread:
    """Ranks > 0: runs the ops rank 0 sends, one at a time, on a thread of its own."""

    def __init__(self, name: str) -> None:
        self.ops: queue.Queue[Mapping[str, Any] | None] = queue.Queue()
        self.kernel: FragmentCloser | None = None
        self.thread: threading.Thread | None = None
        self.name = name

    def start(self, kernel: FragmentCloser) -> None:
        self.kernel = kernel
        self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self.thread.start()

    def put(self, op: Mapping[str, Any]) -> None:
        self.ops.put(op)

    def stop(self, timeout: float) -> None:
        self.ops.put(None)
        if self.thread is not None:
            self.thread.join(timeout=timeout)
        if self.kernel is not None:
            self.kernel.close()

    def _loop(self) -> None:
        assert self.kernel is not None
        while True:
            op = self.ops.get()
            if op is None:
                return
            try:
                run_op(self.kernel, op)
            except OpFailed as e:  # every rank learned it; rank 0 decides what it means
                _log.debug("closer op %s failed: %s", op.get("op"), e)
            except Exception:  # outside a phase (a collective itself failed): keep serving ops
                _log.exception("closer op %s failed on this rank", op.get("op"))
