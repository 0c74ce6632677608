"""A ``gm.Session`` over an FSDP2-sharded model: every rank of the node runs one, under one learner
id, and this keeps them in step (``docs/sharding.md``, section 6).

Rank 0 runs the engine as any node does (``join_run``, the ``Node`` thread, the ``Learner``), with
``RecordingIO`` in place of ``FragmentIO`` (``handles.py``, with the contribution and commit
handles the engine holds): what its learner does to the model (capture fragment f
for round r, write commit (f, v) with ``mixing``) is recorded, not done. The records go to every
rank in one ``Exchange`` on the training threads, and every rank (rank 0 too) then performs them
on its shards, in the same order, at the same step: ``RankIO.publish``/``write`` are collectives.
Rank 0 exchanges at the end of each step, and before its learner blocks for a commit (lockstep),
so the publish a commit waits for has gone out. The other ranks run no protocol thread: in
``step`` they take part in exchanges until rank 0's step is done.

Payloads never pass through the training threads: each rank uploads the chunks it owns from its
own background thread and sends the refs to rank 0 (``up``), whose contribution
(``ShardContribution.upload``, the node's upload hook) uploads rank 0's chunks, collects the
others' refs and returns the joined ref; rank 0's follower hands each commit's record to
``follow`` (``bridge.follow``: nothing whole is fetched), which sends the theta's chunk refs to
every rank (``down``), whose downloader fetches the chunks it owns.

A failure on any rank becomes ``SessionFailed`` on every rank at the same exchange: rank 0's
own (its node thread's, or an error in its step) is sent as a failed exchange; another rank's is
a flag in the next exchange. ``close`` is collective.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import events as ev
from ..adapters.handles import Incoming
from ..adapters.torch_sharded import ShardedParams, gather_chunks, gather_refs
from ..codec.payload import schema_digest
from ..config import DiLoCo
from ..errors import SessionFailed
from ..mailbox import CreateOutcome
from ..protocol import keys
from ..protocol.chunks import fragment_plan
from ..protocol.partition import plan as partition_plan
from ..protocol.records import Manifest, PayloadRef, RoundRecord, chunk_refs, join_refs
from ..protocol.run import RunInfo, check_record_size, max_payload_bytes, read_manifest
from ..protocol.store import RunStore
from ..syncer.bridge import View
from ..syncer.join import join_run
from ..syncer.kernel import FragmentCloser
from ..syncer.spool import Spool
from .anchors import check_place
from .handles import RecordingIO, ShardContribution, ShardIncoming, Together, check_config, mesh_matches
from .leading import CloserThread
from .pooling import GlooRanks
from .rank import RankIO, chunk_elements, chunk_elements_of
from .wire import Channel, Exchange, new_group

if TYPE_CHECKING:
    from ..session import Session

_log = logging.getLogger(__name__)


LINGER = 10.0  # seconds a failing rank waits for its peers' threads to stop


class ShardedRuntime:
    """The sharded part of one rank's ``Session`` (see the module docstring)."""

    def __init__(self, session: Session, sharded: ShardedParams) -> None:
        self.s, self.sharded = session, sharded
        self.rank, self.world = mesh_matches(sharded)
        check_config(session.algorithm)
        check_place(session.anchors)
        self.exchange: Exchange | None = None
        self.up: Channel | None = None
        self.down: Channel | None = None
        self.closing: Any = None  # the gloo group of the closer's ops (``pooling.GlooRanks``)
        self.ranker: FragmentCloser | None = None  # this rank's part of closing rounds
        self.closer_thread = CloserThread(f"gradientmail-r{self.rank}-closer")  # ranks > 0
        self.io: RankIO | None = None
        self.pending: list[tuple[dict[str, Any], ShardContribution | None]] = []
        self.seq = 0
        self.steps = 0
        self.tokens = 0
        self.closed = False
        self.created = False  # rank 0: this node created the run
        self.failure: BaseException | None = None  # ranks > 0: a background failure of this rank
        self._sent_view: list[Any] | None = None
        self._early: list[Mapping[str, Any]] = []  # ranks > 0: commits announced before the run was known
        self._lock = threading.Lock()
        self._receiver: threading.Thread | None = None
        self.exchange_seconds = 0.0  # training-thread time spent in exchanges (not in the actions)
        self.collectives = 0  # the exchange's collectives, once its group is released (else exchange.calls)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # ---- opening ------------------------------------------------------------------------

    def open(self) -> None:
        # Collective, in the same order on every rank: the groups of the exchange and the channels.
        self.exchange, self.up, self.down, self.closing = (
            Exchange(new_group(), self.rank, self.world),
            Channel(new_group()),
            Channel(new_group()),
            new_group(),
        )
        if self.leader:
            self._open_leader()
        else:
            self._receiver = threading.Thread(
                target=self._down_receiver, name=f"gradientmail-r{self.rank}-refs", daemon=True
            )
            self._receiver.start()
            self._guard(self._follow)

    def _open_leader(self) -> None:
        s = self.s
        try:
            store = s._store()
            manifest = read_manifest(store)
            if manifest is None:  # an empty mailbox: this node creates the run, every rank its chunks
                manifest = self._create(store)
            run = RunInfo.from_manifest(manifest)
            chunk_elements(run)  # ShardingUnsupported for a run of whole fragments, before any lease
            check_config(run.cfg)
            store.limit_payloads(max_payload_bytes(run))
            self.io = RankIO(
                self.sharded,
                run,
                store,
                learner=s.learner_id,
                compression=s.options.compression,
                exchange=self._x,
                up=self._up,
                down=self._down,
                anchors=self.s.anchors,
            )
            self.io.start()
            s.bridge.follow = self.follow
            if s.role == "both":  # this node closes rounds too: every rank its ranges
                self.ranker = self._ranker(run, store, relay=True)
                s.bridge.closer = self.ranker
            s.node, s.learner = join_run(
                store,
                s.adapter,
                s.algorithm,
                s.clock,
                learner=s.learner_id,
                nonce=s.nonce,
                emit=s.emit,
                options=s.options,
                rng=s._rng,
                bridge=s.bridge,
                marker=s._marker,
                role=s.role,
                io=RecordingIO(self),
            )
            s._thread = threading.Thread(target=s._background, name=f"gradientmail-{s.learner_id}", daemon=True)
            s._thread.start()
            opening = {"learner": s.learner_id, "compression": s.options.compression, "run": run.manifest.run_id}
            self.flush(done=True, extra={"open": opening})
        except Together as e:
            self._teardown()
            raise SessionFailed(str(e)) from e.__cause__
        except BaseException as e:
            self.fail(e)
            raise

    def _create(self, store: RunStore) -> Manifest:
        """Rank 0: create the run (the mailbox holds none). Every rank uploads the initial chunks it
        owns (``_upload_init``, collective); then rank 0 writes the manifest, create-once as any
        node does: if another node created the run meanwhile, this node joins theirs and deletes
        its initial chunks that are not theirs too."""
        s = self.s
        cfg = s.algorithm.for_tensors(len(s.adapter.schema()))
        fragments = self._fragments(cfg)
        shapes = self._shapes(fragments)
        check_record_size(shapes, cfg)  # before any rank uploads anything
        compression = s.options.compression
        self._x({"create": {"compression": compression}}, done=False, failed=False)
        refs = self._upload_init(store, cfg, compression)
        manifest = Manifest(
            run_id=f"{s._rng.getrandbits(64):016x}",
            created_by=s.learner_id,
            schema=s.adapter.schema(),
            schema_digest=schema_digest(s.adapter.schema()),
            fragments=fragments,
            config=cfg.to_dict(),
            init=refs,
        )
        outcome, existing = store.put_record(keys.MANIFEST, manifest)
        if outcome is CreateOutcome.TAKEN:
            theirs = store.decode_record(existing, Manifest, keys.MANIFEST)
            keep = {c.key for r in theirs.init for c in chunk_refs(r)}
            store.delete([c.key for r in refs for c in chunk_refs(r) if c.key not in keep])
            return theirs
        self.created = True
        return manifest

    def _fragments(self, cfg: DiLoCo) -> list[list[str]]:
        return partition_plan(self.s.adapter.schema(), cfg.fragments, cfg.partition)

    def _shapes(self, fragments: list[list[str]]) -> list[dict[str, tuple[int, ...]]]:
        return [{n: tuple(self.sharded.shapes[n]) for n in names} for names in fragments]

    def _upload_init(self, store: RunStore, cfg: DiLoCo, compression: str) -> list[PayloadRef]:
        """Every rank (training thread, collective): the chunks it owns of every fragment's initial
        parameters, uploaded (a plain node's bytes for them: ``put_chunk`` of the values in their
        dtype), their refs gathered. Any rank's failure raises on every rank."""
        fragments = self._fragments(cfg)
        c = chunk_elements_of(cfg)
        dtypes = {t.name: t.dtype for t in self.s.adapter.schema()}
        device = self.sharded.device
        out = []
        for f, (names, shapes) in enumerate(zip(fragments, self._shapes(fragments))):
            local = {n: self.sharded.local(n) for n in names}
            owned = gather_chunks(self.sharded, names, c, local)
            n_chunks = len(fragment_plan(shapes, c))
            key_for_sha = functools.partial(keys.init_blob_key, f, compression=compression)
            mine: dict[int, tuple[str, int]] = {}
            failure: BaseException | None = None
            try:
                for k, pieces in owned.items():
                    values = {p.name: v.detach().to("cpu", torch.float32).numpy().reshape(-1) for p, v in pieces}
                    ref = store.put_chunk(
                        key_for_sha,
                        values,
                        [p for p, _ in pieces],
                        shapes=shapes,
                        k=k,
                        n=n_chunks,
                        dtypes={p.name: dtypes[p.name] for p, _ in pieces},
                        kind="init",
                        compression=compression,
                    )
                    mine[k] = (ref.sha256, ref.size)
            except Exception as e:
                failure = e
            if not self._x.agree(failure is None):
                raise Together(f"the initial parameters could not be uploaded: {failure or 'see the other ranks'}")
            got = gather_refs(self.sharded, mine, device)
            if sorted(got) != list(range(n_chunks)):
                raise Together(f"fragment {f}: the ranks uploaded chunks {sorted(got)} of {n_chunks}")
            chunks = [
                PayloadRef(key=key_for_sha(sha), sha256=sha, size=size)
                for sha, size in (got[k] for k in range(n_chunks))
            ]
            out.append(join_refs(chunks))
        return out

    def _build(self, opening: Mapping[str, Any]) -> None:
        """Ranks > 0, at the opening exchange: the run rank 0 joined, read from the store."""
        s = self.s
        s.learner_id = str(opening["learner"])
        store = s._store()
        manifest = read_manifest(store)
        if manifest is None or manifest.run_id != opening["run"]:
            raise SessionFailed(f"rank {self.rank} does not see the run {opening['run']} that rank 0 joined")
        run = RunInfo.from_manifest(manifest)
        store.limit_payloads(max_payload_bytes(run))
        io = RankIO(
            self.sharded,
            run,
            store,
            learner=s.learner_id,
            compression=str(opening["compression"]),
            exchange=self._x,
            up=self._up,
            down=self._down,
            anchors=self.s.anchors,
        )
        io.start()
        self.ranker = self._ranker(run, store)
        self.closer_thread.start(self.ranker)  # ops rank 0 sent before now wait in its queue
        with self._lock:
            self.io = io
            early, self._early = self._early, []
        for message in early:
            io.down_message(message)

    def _ranker(self, run: RunInfo, store: RunStore, *, relay: bool = False) -> FragmentCloser:
        """This rank's closer; rank 0's (``relay``) announces each op to the other ranks."""

        def send(message: dict[str, Any]) -> None:
            for r in range(1, self.world):
                self._down.send(r, {"close": message})

        stopping = self.io.stopping if self.io is not None else None
        ranks = GlooRanks(self.closing, self.rank, self.world, send if relay else None, stopping)
        return FragmentCloser(run, store, ranks, self.sharded.layout, spool=Spool(), keep_theta=False)

    def _down_receiver(self) -> None:  # ranks > 0
        try:
            while True:
                _, message = self._down.recv(0)
                if message.get("stop"):
                    return
                if "close" in message:  # an op of closing a round: the closer thread runs it
                    self.closer_thread.put(message["close"])
                    continue
                with self._lock:
                    io = self.io
                    if io is None:
                        self._early.append(message)
                        continue
                io.down_message(message)
        except BaseException as e:
            if self.io is None or not self.io.stopping.is_set():
                self._local_failure(e)

    def _local_failure(self, e: BaseException) -> None:
        if self.failure is None:
            self.failure = e
            self.s.emit(ev.BackgroundFailed(self.s.learner_id, f"rank {self.rank}: {type(e).__name__}: {e}"))

    # ---- the engine's hooks (rank 0) ----------------------------------------------------

    def record(self, action: dict[str, Any], handle: ShardContribution | None = None) -> None:
        self.pending.append((action, handle))

    def record_publish(self, f: int, r: int) -> ShardContribution:
        self.seq += 1
        c = ShardContribution(self, f, r, self.seq)
        self.record({"a": "publish", "f": f, "r": r, "seq": self.seq}, c)
        return c

    def follow(self, f: int, rec: RoundRecord | None) -> Incoming:
        """Rank 0's node thread: a commit of fragment ``f`` (None: the initial parameters) is on the
        tape; every rank starts fetching its chunks of the theta."""
        io = self.io
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

    @property
    def _x(self) -> Exchange:
        assert self.exchange is not None
        return self.exchange

    @property
    def _up(self) -> Channel:
        assert self.up is not None
        return self.up

    @property
    def _down(self) -> Channel:
        assert self.down is not None
        return self.down

    def _view(self) -> list[Any] | None:
        v = self.s.bridge.view
        now = [v.head, v.live, v.rounds_seen, v.closer_of]
        if now == self._sent_view:
            return None
        self._sent_view = now
        return now

    def flush(self, *, done: bool, extra: Mapping[str, Any] | None = None) -> None:
        """Rank 0: tell every rank what the learner did since the last exchange, and do it here too."""
        batch, self.pending = self.pending, []
        message: dict[str, Any] = dict(extra or {})
        if batch:
            message["actions"] = [a for a, _ in batch]
        view = self._view()
        if view is not None:
            message["view"] = view
        t0 = time.perf_counter()
        _, _, failed = self._x(message or None, done=done, failed=False)
        self.exchange_seconds += time.perf_counter() - t0
        if failed:
            raise Together(f"rank(s) {failed} of this node failed (their logs say why)")
        if "open" in message and not self._x.agree(True):
            raise Together("a rank of this node could not open the run (its log says why)")
        self._execute([a for a, _ in batch], [h for _, h in batch])

    def before_wait(self) -> None:
        """Rank 0's learner is about to wait for a commit: what it recorded goes out first."""
        if self.pending:
            self.flush(done=False)

    def _follow(self) -> bool:
        """Ranks > 0: take part in exchanges until rank 0's step is done; True when it closed."""
        while True:
            t0 = time.perf_counter()
            message, done, failed = self._x(None, done=False, failed=self._failed())
            self.exchange_seconds += time.perf_counter() - t0
            if failed:
                why = message.get("error") if isinstance(message, dict) and 0 in failed else None
                raise Together(why or f"rank(s) {failed} of this node failed (their logs say why)")
            if message:
                if "create" in message:  # rank 0 creates the run: the initial chunks of this rank
                    self._upload_init(
                        self.s._store(),
                        self.s.algorithm.for_tensors(len(self.s.adapter.schema())),
                        str(message["create"]["compression"]),
                    )
                if "open" in message:
                    ok = True
                    try:
                        self._build(message["open"])
                    except BaseException as e:
                        self._local_failure(e)
                        ok = False
                    if not self._x.agree(ok):
                        raise Together(f"a rank of this node could not open the run: {self.failure or 'see its log'}")
                if "view" in message:
                    head, live, seen, closer = message["view"]
                    self.s.bridge.view = View(head=head, live=live, rounds_seen=seen, closer_of=closer)
                self._execute(message.get("actions", []), [None] * len(message.get("actions", [])))
                if message.get("close"):
                    return True
            if done:
                return False

    def _failed(self) -> bool:
        io = self.io
        return self.failure is not None or (io is not None and io.failure is not None)

    def _execute(self, actions: Sequence[Mapping[str, Any]], handles: Sequence[ShardContribution | None]) -> None:
        io = self.io
        assert io is not None or not actions
        for a, h in zip(actions, handles):
            assert io is not None
            kind = a["a"]
            if kind == "publish":
                cap = io.publish(int(a["f"]), int(a["r"]), int(a["seq"]))
                if h is not None:
                    h.captured = cap
                    h.ready.set()
                else:
                    io.queue_upload(cap)
            elif kind == "write":
                try:
                    io.write(int(a["f"]), int(a["v"]), float(a["m"]))
                except SessionFailed as e:  # every rank agreed it failed (RankIO.write)
                    raise Together(str(e)) from e
            elif kind == "newest":
                io.newest()
            else:
                raise AssertionError(f"unknown action {kind!r}")

    # ---- stepping -----------------------------------------------------------------------

    def _guard(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Together as e:
            self._teardown()
            raise SessionFailed(str(e)) from e.__cause__
        except BaseException as e:
            if self.leader:
                self.fail(e)
            else:
                self._teardown()
            raise

    def step(self, samples: int) -> None:
        if self.closed:
            raise RuntimeError("the session is closed")
        if self.exchange is None:
            raise RuntimeError("the session is not open: use `with gm.Session(...) as session:` or call open()")
        self.steps += 1
        self.tokens += int(samples)
        if self.leader:
            self._guard(self._lead_step, samples)
        else:
            self._guard(self._follow)

    def _lead_step(self, samples: int) -> None:
        s = self.s
        s._check()
        assert s.learner is not None
        s.learner.step(int(samples), wait=s._wait_commit)
        self.flush(done=True)

    # ---- leaving ------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        if self.leader:
            self._guard(self._lead_close)
        else:
            self._guard(self._follow_close)
        self.closed = True

    def _lead_close(self) -> None:
        s = self.s
        assert s.learner is not None and self.io is not None
        s._check()
        if s.algorithm.flush_on_close:
            s._flush()
        s._wait_in_flight()
        self.flush(done=False)  # every capture done: the node thread's uploads can finish
        s._stop.set()
        s.bridge.wake.set()
        if s._thread is not None:
            s._thread.join()
        s._check()
        s.learner.drain()
        self.record({"a": "newest"})
        self.flush(done=True, extra={"close": True})
        # The other ranks finish their uploads and say so (the refs receiver ends); then they stop listening.
        for t in self.io.threads:
            if t.name.endswith("refs-in"):
                t.join()
        for r in range(1, self.world):
            self._down.send(r, {"stop": True})
        self.io.stopping.set()
        self.io.stop_downloads()
        self.io.anchors.close()
        if self.ranker is not None:
            self.ranker.spool.close()
        self._leave()
        self._release(barrier=True)

    def _follow_close(self) -> None:
        while not self._follow():
            pass
        io = self.io
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
        self.s._closed = True
        self._release(barrier=True)

    def _release(self, *, barrier: bool) -> None:
        """Shut this node's gloo groups down once no thread of ours uses them (after a last
        collective, when closing: every rank is done with every channel). A group left alive until
        the interpreter exits can abort the process there: a gloo thread that still holds a
        finished operation's tensors needs the interpreter to let them go ("terminate called
        without an active exception")."""
        exchange = self.exchange
        if exchange is None:
            return
        if barrier:
            try:
                exchange.agree(True, timeout=6 * LINGER)
            except Exception as e:  # a rank never came (it failed while closing)
                _log.warning("a rank did not finish closing; the node's groups are left to the exit: %s", e)
                return
        self.collectives = exchange.calls
        threads = [self._receiver, self.closer_thread.thread, *(self.io.threads if self.io is not None else [])]
        if self.leader:
            threads.append(self.s._thread)
        if any(t is not None and t.is_alive() for t in threads):
            return  # a thread of ours is still in a group (a peer is gone): leave them to the exit
        groups = (exchange.group, *(c.group for c in (self.up, self.down) if c is not None), self.closing)
        self.exchange, self.up, self.down, self.closing = None, None, None, None
        for g in groups:
            if g is not None:
                try:
                    dist.destroy_process_group(g)
                except Exception as e:  # already gone (the user destroyed every group)
                    _log.debug("could not release a group: %s", e)

    def _leave(self) -> None:
        s = self.s
        s._closed = True
        if s.node is not None:
            try:
                s.node.leave()
            except Exception as e:  # the lease runs out on its own
                s.emit(ev.StoreFailure(s.learner_id, f"could not release the lease: {e}"))
        s._marker.close()

    def fail(self, e: BaseException) -> None:
        """Rank 0 failed (in its step, its close, its node thread): every other rank is waiting in
        an exchange; tell them, then stop here."""
        try:
            self._x({"error": f"rank 0: {type(e).__name__}: {e}"}, done=True, failed=True)
        except Exception as sent:  # pragma: no cover - the group itself is gone
            _log.warning("could not tell the other ranks that rank 0 failed: %s", sent)
        self._teardown()

    def _teardown(self) -> None:
        """After a failure (which every rank learned at the same exchange): stop this rank's work.
        The ranks stop each other's receivers, as they do when closing, each wait bounded by
        ``LINGER`` (a peer that is gone leaves a daemon thread behind, nothing more)."""
        if self.closed:
            return
        self.closed = True
        io = self.io
        if io is not None:
            io.stopping.set()
            io.stop_downloads()
            io.anchors.close()
        s = self.s
        if self.leader:
            s._stop.set()
            s.bridge.wake.set()
            if s._thread is not None:
                s._thread.join(timeout=LINGER)
            if self.down is not None and (s._thread is None or not s._thread.is_alive()):
                for r in range(1, self.world):
                    self._quietly(self.down.send, r, {"stop": True}, timeout=LINGER)
            for t in io.threads if io is not None else []:
                if t.name.endswith("refs-in"):
                    t.join(timeout=LINGER)
            self._leave()
        else:
            if io is not None:
                io.stop_uploads()  # its uploader tells rank 0 it is done
                for t in io.threads:
                    if t.name.endswith("upload"):
                        t.join(timeout=LINGER)
            elif self.up is not None:  # no uploader yet: rank 0's receiver still waits for this rank
                self._quietly(self.up.send, 0, {"stop": True}, timeout=LINGER)
            if self._receiver is not None:
                self._receiver.join(timeout=LINGER)
            self.closer_thread.stop(timeout=LINGER)
        s._closed = True
        self._release(barrier=False)

    @staticmethod
    def _quietly(fn: Any, *args: Any, **kw: Any) -> None:
        try:
            fn(*args, **kw)
        except Exception as e:  # the peer is gone: nothing left to tell it
            _log.debug("could not reach a rank while stopping: %s", e)
