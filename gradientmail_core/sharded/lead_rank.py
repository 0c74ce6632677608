"""Rank 0 of a sharded node: it runs the engine (a ``ProcessHost``: ``join_run``, the node thread,
the learner) with ``RecordingIO`` in place of ``FragmentIO``, so what its learner does to the model
is recorded, and sends it to every rank in one exchange at the end of each step, and before its
learner blocks for a commit (``before_wait``), so the publish a commit waits for has gone out.
Every rank, this one too, then performs the actions on its shards (``RankHost.execute``).

It is also the engine's way to the other ranks: ``record_publish`` and ``record`` (the handles of
``recording.py``), and the node's placement (``OverRanks``): a commit's chunk refs sent down
(``announce``), each contribution uploaded by its ranks, and the merger, built here, whose ops go
down to the other ranks' merger threads. Its own failure goes to the other ranks as a failed
exchange (``fail``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import events as ev
from ..adapters.handles import Incoming
from ..errors import SchemaMismatch, SessionFailed
from ..protocol.records import PayloadRef, RoundRecord, chunk_refs
from ..protocol.run import RunInfo, create_run, max_payload_bytes, read_manifest
from ..protocol.schema import check_schema
from ..protocol.store import RunStore
from ..protocol.tape import newest_records, round_keys
from ..syncer.bridge import Publish
from ..syncer.host import ProcessHost, Progress
from ..syncer.learner import Learner
from ..syncer.merger import FragmentMerger
from ..syncer.node import Node
from .rank_host import LINGER, RankHost
from .rank_io import RankIO, chunk_elements
from .recording import RecordingIO, ShardContribution, ShardIncoming, Together, check_config

_log = logging.getLogger(__name__)


class LeadRank:
    """Rank 0's role (``rank_host.RankRole``) over its ``RankHost``."""

    def __init__(self, host: RankHost) -> None:
        self.host = host
        self.engine = ProcessHost(host.setup, host.learner_id, before_wait=self.before_wait)
        self.pending: list[tuple[dict[str, Any], ShardContribution | None]] = []
        self.seq = 0
        self._sent_view: list[Any] | None = None

    @property
    def io(self) -> RankIO | None:  # (``recording.Recorder``)
        return self.host.io

    @property
    def node(self) -> Node | None:
        return self.engine.node

    @property
    def learner(self) -> Learner | None:
        return self.engine.learner

    @property
    def progress(self) -> Progress:
        if self.engine.learner is not None:
            return self.engine.progress
        return Progress.of(self.engine.bridge.view, {}, self.host.steps, self.host.tokens)

    def wait_for(self, learners: int, timeout: float | None) -> None:
        """Rank 0 waits; the other ranks return at once and wait in their next ``step``."""
        self.engine.wait_for(learners, timeout)

    # ---- opening ------------------------------------------------------------------------

    def join(self) -> None:
        engine, s = self.engine, self.host.setup
        store = engine.store()
        manifest = read_manifest(store)
        if manifest is None:  # an empty mailbox: this node creates the run, every rank its chunks
            upload = functools.partial(self._create, store)
            manifest, _ = create_run(
                store, s.adapter.schema(), s.algorithm, upload, learner=self.host.learner_id, rng=s.rng
            )
        check_schema(manifest.schema, s.adapter.schema())  # before any lease, as a plain node's join does
        run = RunInfo.from_manifest(manifest)
        chunk_elements(run)  # ShardingUnsupported for a run of whole fragments, before any lease
        check_config(run.cfg)
        store.limit_payloads(max_payload_bytes(run))
        self.host.io = self.host.rank_io(run, store, s.options.payload_compression)
        self.host.io.start()
        if s.role == "both":  # this node closes rounds too: every rank its ranges
            self.host.ranker = self.host.merger_for(run, store, relay=True)  # announces each op to the other ranks
        merger = self.host.ranker if self.host.ranker is not None else FragmentMerger.one_process(run, store)
        engine.join(store, io=RecordingIO(self), placement=OverRanks(self, store, run, merger))
        opening = {
            "learner": self.host.learner_id,
            "compression": s.options.payload_compression,
            "run": run.manifest.run_id,
        }
        self.flush(done=True, extra={"open": opening})

    def _create(self, store: RunStore, fragments: list[list[str]]) -> list[PayloadRef]:
        """``create_run``'s upload: every rank is told, then uploads the initial chunks it owns.
        (``create_run`` checked the plan's record sizes before: a refusal reaches no rank.)"""
        compression = self.host.setup.options.payload_compression
        self.host.ex({"create": {"compression": compression}}, done=False, failed=False)
        return self.host.upload_init(store, fragments, compression)

    # ---- the engine's hooks -------------------------------------------------------------

    def record(self, action: dict[str, Any], handle: ShardContribution | None = None) -> None:
        self.pending.append((action, handle))

    def record_publish(self, f: int, r: int) -> ShardContribution:
        self.seq += 1
        c = ShardContribution(self, f, r, self.seq)
        self.record({"a": "publish", "f": f, "r": r, "seq": self.seq}, c)
        return c

    def announce(self, f: int, rec: RoundRecord | None) -> Incoming:
        """The node thread: a commit of fragment ``f`` (None: the initial parameters) is on the
        tape; every rank starts fetching its chunks of the theta."""
        io = self.host.io
        assert io is not None
        if rec is None:
            ref, v = io.run.manifest.init[f], 0
        else:
            if rec.theta is None:
                raise SessionFailed(
                    f"round {rec.round} names no parameters (between checkpoints): not for sharded nodes"
                )
            ref, v = rec.theta, rec.version
        io.announce(f, v, chunk_refs(ref))
        return ShardIncoming(self, f, v)

    # ---- the exchange -------------------------------------------------------------------

    def _view(self) -> list[Any] | None:
        v = self.engine.bridge.view
        now = [v.head, v.live, v.rounds_seen, v.closer_of]
        if now == self._sent_view:
            return None
        self._sent_view = now
        return now

    def flush(self, *, done: bool, extra: Mapping[str, Any] | None = None) -> None:
        """Tell every rank what the learner did since the last exchange, and do it here too."""
        batch, self.pending = self.pending, []
        message: dict[str, Any] = dict(extra or {})
        if batch:
            message["actions"] = [a for a, _ in batch]
        view = self._view()
        if view is not None:
            message["view"] = view
        t0 = time.perf_counter()
        _, _, failed = self.host.ex(message or None, done=done, failed=False)
        self.host.exchange_seconds += time.perf_counter() - t0
        if failed:
            raise Together(f"rank(s) {failed} of this node failed (their logs say why)")
        if "open" in message and not self.host.ex.agree(True):
            raise Together("a rank of this node could not open the run (its log says why)")
        self.host.execute([a for a, _ in batch], [h for _, h in batch])

    def before_wait(self) -> None:
        """The learner is about to wait for a commit: what it recorded goes out first."""
        if self.pending:
            self.flush(done=False)

    # ---- stepping and closing -----------------------------------------------------------

    def step(self, samples: int) -> None:
        self.engine.step(samples)
        self.flush(done=True)

    def close(self) -> None:
        engine = self.engine
        assert engine.learner is not None and self.host.io is not None
        engine.settle()
        self.flush(done=False)  # every capture done: the node thread's uploads can finish
        engine.stop()
        engine.check()
        engine.learner.drain()
        self.record({"a": "newest"})
        self.flush(done=True, extra={"close": True})
        # The other ranks finish their uploads and say so (the refs receiver ends); then they stop listening.
        for t in self.host.io.threads:
            if t.name.endswith("refs-in"):
                t.join()
        for r in range(1, self.host.world):
            self.host.down_ch.send(r, {"stop": True})
        self.host.io.stopping.set()
        self.host.io.stop_downloads()
        self.host.io.anchors.close()
        if self.host.ranker is not None:
            self.host.ranker.spool.close()
        self._leave()
        self.host.release(barrier=True)

    def _leave(self) -> None:
        try:
            self.engine.leave()
        except Exception as e:  # the lease runs out on its own
            self.host.setup.emit(ev.StoreFailure(self.host.learner_id, f"could not release the lease: {e}"))

    def failed_here(self, e: BaseException) -> None:
        self.fail(e)

    def fail(self, e: BaseException) -> None:
        """Rank 0 failed (in its step, its close, its node thread): every other rank is waiting in
        an exchange; tell them, then stop here."""
        message: dict[str, Any] = {"error": f"rank 0: {type(e).__name__}: {e}"}
        if isinstance(e, SchemaMismatch):  # every rank raises it, as rank 0 does
            message["schema"] = {"differences": e.differences, "fix": e.fix}
        try:
            self.host.ex(message, done=True, failed=True)
        except Exception as sent:  # pragma: no cover - the group itself is gone
            _log.warning("could not tell the other ranks that rank 0 failed: %s", sent)
        self.host.teardown()

    def stop_work(self) -> None:
        io = self.host.io
        ended = self.engine.stop(timeout=LINGER)
        if self.host.down is not None and ended:
            for r in range(1, self.host.world):
                self.host.quietly(self.host.down.send, r, {"stop": True}, timeout=LINGER)
        for t in io.threads if io is not None else []:
            if t.name.endswith("refs-in"):
                t.join(timeout=LINGER)
        self._leave()

    def threads(self) -> list[Any]:
        return [*(self.host.io.threads if self.host.io is not None else []), self.engine.thread]


class OverRanks:
    """A sharded node's ``syncer.placement.Placement``: every rank reads and uploads the chunks it
    owns; the node thread on rank 0 reads records only, and hands each commit's record to
    ``LeadRank.announce`` (nothing whole is fetched)."""

    fleet_polls = False  # (its follower lists every poll, as before fleets were polled by rounds only)

    def __init__(self, lead: LeadRank, store: RunStore, run: RunInfo, merger: FragmentMerger) -> None:
        self.lead, self.store, self.run, self.merger = lead, store, run, merger

    def read_newest(self) -> tuple[dict[int, RoundRecord], dict[int, dict[str, np.ndarray]]]:
        recs = newest_records(self.store, self.run, round_keys(self.store))
        return recs, {f: {} for f in range(self.run.P)}

    def joining(self, newest: Mapping[int, RoundRecord], fragments: list[int]) -> dict[int, Incoming]:
        return {f: self.lead.announce(f, newest.get(f)) for f in fragments}

    def upload(self, pub: Publish, *, learner: str, compression: str, keep: bool) -> tuple[PayloadRef, bool]:
        delta = pub.delta
        assert isinstance(delta, ShardContribution)  # (what RecordingIO captures)
        return delta.upload(self.store, self.run, pub.fragment, pub.round, learner, compression), False

    def prefetch_contributions(self, r: int, snapshots: Mapping[str, str]) -> None:
        pass  # the ranks read their own chunks of each payload

    def fetch_commit(
        self, rec: RoundRecord, prev: tuple[int, dict[str, np.ndarray] | None] | None
    ) -> dict[str, np.ndarray]:
        return {}  # the ranks fetch their own chunks (``incoming``)

    def incoming(self, f: int, rec: RoundRecord, theta: dict[str, np.ndarray]) -> Incoming:
        return self.lead.announce(f, rec)
