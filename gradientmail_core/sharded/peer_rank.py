"""A rank > 0 of a sharded node: it runs no protocol thread. In ``open`` and in each ``step`` it
takes part in exchanges until rank 0's step is done, performing what rank 0's learner did
(``RankHost.execute``); a receiver thread takes what rank 0's node thread sends down (a commit's
chunk refs for its downloader, a closer op for its closer thread). Its own background failure (an
upload, a download, a channel) is its flag in the next exchange.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from .. import events as ev
from ..errors import SchemaMismatch, SessionFailed
from ..protocol.run import RunInfo, initial_fragments, max_payload_bytes, read_manifest
from ..syncer.bridge import View
from ..syncer.host import Progress
from ..syncer.learner import Learner
from ..syncer.node import Node
from .leading import CloserThread
from .rank_host import LINGER, RankHost
from .recording import Together


class PeerRank:
    """A rank > 0's role (``rank_host.RankRole``) over its ``RankHost``."""

    def __init__(self, host: RankHost) -> None:
        self.host = host
        self.closer_thread = CloserThread(f"gradientmail-r{self.host.rank}-closer")  # ranks > 0
        self.failure: BaseException | None = None  # a background failure of this rank
        self.view = View()  # rank 0's, as the exchanges bring it
        self._early: list[Mapping[str, Any]] = []  # commits announced before the run was known
        self._lock = threading.Lock()
        self._receiver: threading.Thread | None = None

    node: Node | None = None  # the engine runs on rank 0
    learner: Learner | None = None

    @property
    def progress(self) -> Progress:
        return Progress.of(self.view, {}, self.host.steps, self.host.tokens)

    def wait_for(self, learners: int, timeout: float | None) -> None:
        """Rank 0 waits; this rank returns at once and waits for rank 0 in its next ``step``."""

    # ---- opening ------------------------------------------------------------------------

    def join(self) -> None:
        self._receiver = threading.Thread(
            target=self._down_receiver, name=f"gradientmail-r{self.host.rank}-refs", daemon=True
        )
        self._receiver.start()
        self._take_part()

    def _build(self, opening: Mapping[str, Any]) -> None:
        """At the opening exchange: the run rank 0 joined, read from the store, under its id."""
        self.host.learner_id = str(opening["learner"])
        store = self.host.setup.store(self.host.learner_id)
        manifest = read_manifest(store)
        if manifest is None or manifest.run_id != opening["run"]:
            raise SessionFailed(f"rank {self.host.rank} does not see the run {opening['run']} that rank 0 joined")
        run = RunInfo.from_manifest(manifest)
        store.limit_payloads(max_payload_bytes(run))
        io = self.host.rank_io(run, store, str(opening["compression"]))
        io.start()
        self.host.ranker = self.host.merger_for(run, store)
        self.closer_thread.start(self.host.ranker)  # ops rank 0 sent before now wait in its queue
        with self._lock:
            self.host.io = io
            early, self._early = self._early, []
        for message in early:
            io.down_message(message)

    def _down_receiver(self) -> None:
        try:
            while True:
                _, message = self.host.down_ch.recv(0)
                if message.get("stop"):
                    return
                if "close" in message:  # an op of closing a round: the closer thread runs it
                    self.closer_thread.put(message["close"])
                    continue
                with self._lock:
                    io = self.host.io
                    if io is None:
                        self._early.append(message)
                        continue
                io.down_message(message)
        except BaseException as e:
            if self.host.io is None or not self.host.io.stopping.is_set():
                self._local_failure(e)

    def _local_failure(self, e: BaseException) -> None:
        if self.failure is None:
            self.failure = e
            self.host.setup.emit(
                ev.BackgroundFailed(self.host.learner_id, f"rank {self.host.rank}: {type(e).__name__}: {e}")
            )

    # ---- taking part in rank 0's exchanges------------------------------------------------------------

    def step(self, samples: int) -> None:
        self._take_part()

    def _take_part(self) -> bool:
        """Take part in exchanges until rank 0's step is done; True when it closed."""
        while True:
            t0 = time.perf_counter()
            message, done, failed = self.host.ex(None, done=False, failed=self._failed())
            self.host.exchange_seconds += time.perf_counter() - t0
            if failed:
                why = message.get("error") if isinstance(message, dict) and 0 in failed else None
                schema = message.get("schema") if isinstance(message, dict) and 0 in failed else None
                if schema is not None:  # rank 0's model does not fit the run, nor does this rank's
                    raise SchemaMismatch(list(schema["differences"]), fix=schema["fix"])
                raise Together(why or f"rank(s) {failed} of this node failed (their logs say why)")
            if message:
                if "create" in message:  # rank 0 creates the run: the initial chunks of this rank
                    fragments = initial_fragments(self.host.setup.adapter.schema(), self.host.setup.algorithm)
                    store = self.host.setup.store(self.host.learner_id)
                    self.host.upload_init(store, fragments, str(message["create"]["compression"]))
                if "open" in message:
                    ok = True
                    try:
                        self._build(message["open"])
                    except BaseException as e:
                        self._local_failure(e)
                        ok = False
                    if not self.host.ex.agree(ok):
                        raise Together(f"a rank of this node could not open the run: {self.failure or 'see its log'}")
                if "view" in message:
                    head, live, seen, closer = message["view"]
                    self.view = View(head=head, live=live, rounds_seen=seen, closer_of=closer)
                self.host.execute(message.get("actions", []), [None] * len(message.get("actions", [])))
                if message.get("close"):
                    return True
            if done:
                return False

    def _failed(self) -> bool:
        io = self.host.io
        return self.failure is not None or (io is not None and io.failure is not None)

    # ---- closing ------------------------------------------------------------------------

    def close(self) -> None:
        while not self._take_part():
            pass
        io = self.host.io
        assert io is not None
        io.stop_uploads()
        for t in io.threads:
            if t.name.endswith("upload"):
                t.join()
        if self._receiver is not None:
            self._receiver.join()
        self.closer_thread.stop(timeout=LINGER)
        io.stopping.set()
        io.stop_downloads()
        io.anchors.close()
        self.host.release(barrier=True)

    def failed_here(self, e: BaseException) -> None:
        self.host.teardown()

    def stop_work(self) -> None:
        io = self.host.io
        if io is not None:
            io.stop_uploads()  # its uploader tells rank 0 it is done
            for t in io.threads:
                if t.name.endswith("upload"):
                    t.join(timeout=LINGER)
        elif self.host.up is not None:  # no uploader yet: rank 0's receiver still waits for this rank
            self.host.quietly(self.host.up.send, 0, {"stop": True}, timeout=LINGER)
        if self._receiver is not None:
            self._receiver.join(timeout=LINGER)
        self.closer_thread.stop(timeout=LINGER)

    def threads(self) -> list[Any]:
        return [self._receiver, self.closer_thread.thread, *(self.host.io.threads if self.host.io is not None else [])]
