"""The other ranks' part of a closing sharded node: rank 0's closer announces each op
(``pooling.GlooRanks.begin``), and each rank > 0 runs it on its closer thread (``CloserThread``,
``run_op``) while rank 0 runs it on its node thread: every rank's ``syncer.merger.FragmentMerger``
does its part over the ranges its shards hold, the ranks meeting in ``GlooRanks``' phases."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping
from typing import Any

from ..errors import MailboxUnavailable
from ..syncer.commit import Lost, discard
from ..syncer.merger import FragmentMerger
from .pooling import OpFailed
from .wire import unwire

_log = logging.getLogger(__name__)


def run_op(kernel: FragmentMerger, message: Mapping[str, Any]) -> Any:
    """Run one op rank 0 announced on this rank's closer."""
    args = {k: unwire(v) for k, v in message["args"].items()}
    if message["op"] == "commit":
        kernel.spool.drop_through(args["op"].round - 1)
        return kernel.commit(args["op"], kernel.store.put_blob if args["write"] else discard)
    if "round" in args:
        kernel.spool.drop_through(int(args["round"]) - 1)
    return getattr(kernel, message["op"])(**args)


class CloserThread:
    """Ranks > 0: runs the ops rank 0 sends, one at a time, on a thread of its own."""

    def __init__(self, name: str) -> None:
        self.ops: queue.Queue[Mapping[str, Any] | None] = queue.Queue()
        self.kernel: FragmentMerger | None = None
        self.thread: threading.Thread | None = None
        self.name = name

    def start(self, kernel: FragmentMerger) -> None:
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
        while (op := self.ops.get()) is not None:
            try:
                run_op(self.kernel, op)
            except (OpFailed, Lost, MailboxUnavailable) as e:  # every rank learned it; rank 0 decides
                _log.debug("closer op %s failed: %s", op.get("op"), e)
            except Exception:  # outside a phase (a collective itself failed): keep serving ops
                _log.exception("closer op %s failed on this rank", op.get("op"))
