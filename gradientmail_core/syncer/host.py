"""The host of a node: what a ``gm.Session`` delegates to (``EngineHost``, handed ``HostSetup``),
how every node joins a run (``join_run``), and ``ProcessHost``, the host of a node that is this
process: a background thread runs ``Node.tick`` and does all the node's I/O, the ``Learner`` runs
on the training thread and never waits on the store, and the ``Bridge`` carries what passes
between them (a failure of the background work is re-raised on the training thread). A rank of a
sharded node has ``sharded/runtime.py``'s host, whose rank 0 drives a ``ProcessHost``."""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from .. import events as ev
from ..adapters.base import Adapter
from ..adapters.handles import Mover
from ..clock import Clock
from ..config import DiLoCo
from ..errors import MailboxUnavailable, SessionFailed
from ..mailbox import Mailbox
from ..protocol.auth import Policy
from ..protocol.guard import GuardedMailbox
from ..protocol.members import MemberAuth
from ..protocol.run import max_payload_bytes, open_run
from ..protocol.store import RunStore
from ..protocol.tape import fetch_theta
from .bridge import Bridge, CommitNotice, View
from .learner import Learner
from .marker import RestartMarker
from .node import Node
from .options import NodeOptions
from .placement import Placement


@dataclass(frozen=True)
class Progress:
    """A read-only view of the run as this session sees it."""

    round: int
    versions: tuple[int, ...]
    live_learners: int
    local_step: int
    tokens: int
    rounds_seen: int
    closing_round: int | None

    @classmethod
    def of(cls, view: View, versions: Mapping[int, int], local_step: int, tokens: int) -> Progress:
        """The node's ``view`` with this learner's own counts (``versions``: fragment -> version)."""
        return cls(
            round=view.head,
            versions=tuple(versions[f] for f in sorted(versions)),
            live_learners=view.live,
            local_step=local_step,
            tokens=tokens,
            rounds_seen=view.rounds_seen,
            closing_round=view.closer_of,
        )


@dataclass(frozen=True, kw_only=True)
class HostSetup:
    """What a session hands its host: the node's settings, checked and fixed when it is built."""

    adapter: Adapter
    algorithm: DiLoCo
    mailbox: Mailbox
    auth: Policy | MemberAuth
    options: NodeOptions
    clock: Clock
    role: str  # "both" or "learner"
    nonce: str  # this process's, in its lease
    rng: random.Random  # draws the run id if this node creates the run, then the node's own draws
    close_timeout: float
    emit: Callable[[ev.Event], None]

    def store(self, learner_id: str) -> RunStore:
        """The run's store as ``learner_id`` reads it: guarded, authenticated as the run is."""

        def ignored(key: str, why: str) -> None:
            self.emit(ev.IgnoredObject(learner_id, key, why))

        guard = GuardedMailbox(self.mailbox, auth=self.auth, on_ignored=ignored)
        return RunStore(guard, auth=self.auth, on_ignored=ignored)


class EngineHost(Protocol):
    """Everything a session asks of its host."""

    @property
    def learner_id(self) -> str:
        """The id the node runs under (a sharded node's rank > 0 takes rank 0's when it opens)."""
        ...

    @property
    def node(self) -> Node | None:
        """The node this process runs (None before ``open``, and on a sharded node's ranks > 0)."""
        ...

    @property
    def learner(self) -> Learner | None:
        """The learner this process runs (None where ``node`` is)."""
        ...

    @property
    def progress(self) -> Progress:
        """The run as this node sees it, with this process's step counts."""
        ...

    def open(self) -> None:
        """Join the run (creating it if the mailbox is empty) and start the background work;
        nothing when open already. Collective on a sharded node."""
        ...

    def step(self, samples: int) -> None:
        """One optimizer step of ``samples``; raises ``SessionFailed`` for a failure of the
        background work. Collective on a sharded node."""
        ...

    def wait_for(self, learners: int, timeout: float | None) -> None:
        """Block until ``learners`` learners were seen since the wait began (``TimeoutError``)."""
        ...

    def close(self) -> None:
        """Wait for this node's rounds in flight, load the newest committed parameters and leave
        (raises ``SessionFailed`` for a failure on the way). Collective on a sharded node."""
        ...

    def abort(self) -> None:
        """Leave at once, waiting for no round: the training loop failed."""
        ...


# ---- joining a run ---------------------------------------------------------------------


def join_run(
    store: RunStore,
    adapter: Adapter,
    cfg: DiLoCo,
    clock: Clock,
    *,
    learner: str,
    nonce: str,
    emit: Callable[[ev.Event], None],
    options: NodeOptions,
    rng: random.Random,
    node_rng: random.Random | None = None,
    bridge: Bridge | None = None,
    marker: RestartMarker | None = None,
    role: str = "both",
    io: Mover | None = None,
    placement: Placement | None = None,
) -> tuple[Node, Learner]:
    """Join (or create) the run in ``store`` as ``learner``; return its node and learner.

    ``rng`` draws the run id if this call creates the run; ``node_rng`` (default ``rng``) is the
    node's own. Raises ``RunConfigMismatch`` or ``SchemaMismatch`` before anything is written
    but the lease, ``DuplicateLearner`` if the id is taken by a live process, and
    ``MailboxUnavailable`` when the store cannot be reached (nothing committed is touched).

    ``marker``: this host's record of who holds the learner id (``syncer.marker``); a lease left
    by this id's previous process on this host, now dead, is then taken over without waiting. The
    caller closes the marker when it leaves.

    ``role``: "both" (trains and may close rounds) or "learner" (trains, never closes). A node that
    only closes rounds joins through ``syncer.standalone.Syncer`` instead.

    ``io``: how the learner moves fragments (default ``FragmentIO`` over ``adapter``).
    ``placement``: how the node moves parameters and who merges (``Node``; a sharded node's ranks
    read their own chunks, and the learner loads each fragment from ``Placement.joining``).
    """
    if role not in ("both", "learner"):
        raise ValueError(f"role={role!r}: a training node's role is 'both' or 'learner' (a syncer is gm.Syncer)")
    run, created = open_run(
        store, adapter.schema(), adapter.read, cfg, learner=learner, compression=options.payload_compression, rng=rng
    )
    if run.P != cfg.fragments:
        emit(ev.FragmentsClamped(learner, cfg.fragments, run.P))
    store.limit_payloads(max_payload_bytes(run))
    node = Node(
        store,
        clock,
        run,
        learner=learner,
        nonce=nonce,
        emit=emit,
        options=options,
        bridge=bridge,
        rng=node_rng or rng,
        role=role,
        placement=placement,
    )
    # Before joining: the learner says whether it consumes its anchors (``Bridge.lend``), which
    # decides whether the node keeps the parameters it reads.
    trainer = Learner(adapter, run, node.bridge, clock, learner=learner, emit=emit, io=io)
    trainer.reload = lambda f: fetch_theta(store, run, f, node.state.newest.get(f))
    predecessor = marker.open(run.manifest.run_id) if marker is not None else None
    try:
        thetas = node.join(created=created, predecessor=predecessor)
    except BaseException:
        if marker is not None:
            marker.close()
        raise
    if marker is not None:
        marker.hold(nonce)
    s = node.state
    incoming = node.placement.joining(s.newest, list(thetas))
    cosines = {f: rec.cosine for f, rec in s.newest.items()}
    trainer.start(s.head, thetas, {f: v for f, (v, _) in s.thetas.items()}, incoming, lent=s.lent, cosines=cosines)
    return node, trainer


# ---- a node that is one process ---------------------------------------------------------


class ProcessHost:
    """The host of a node that is one process (see the module)."""

    def __init__(self, setup: HostSetup, learner_id: str, *, before_wait: Callable[[], None] | None = None) -> None:
        """``before_wait``: called on the training thread whenever the learner is about to block
        for a commit (a sharded node's ranks hear what the learner did before it waits)."""
        self.setup = setup
        self.learner_id = learner_id
        self.before_wait = before_wait
        self.bridge = Bridge()
        self.marker = RestartMarker(learner_id)  # a restart on this host resumes the id at once
        self.node: Node | None = None
        self.learner: Learner | None = None
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.closed = False

    # ---- joining ----------------------------------------------------------------------

    def store(self) -> RunStore:
        return self.setup.store(self.learner_id)

    def open(self) -> None:
        if self.node is None:
            self.join(self.store())

    def join(self, store: RunStore, *, io: Mover | None = None, placement: Placement | None = None) -> None:
        """Join the run in ``store`` (``join_run``; ``io``: how the learner moves fragments,
        ``placement``: how the node moves parameters) and start the node's thread."""
        s = self.setup
        self.node, self.learner = join_run(
            store,
            s.adapter,
            s.algorithm,
            s.clock,
            learner=self.learner_id,
            nonce=s.nonce,
            emit=s.emit,
            options=s.options,
            rng=s.rng,
            bridge=self.bridge,
            marker=self.marker,
            role=s.role,
            io=io,
            placement=placement,
        )
        self.thread = threading.Thread(target=self._background, name=f"gradientmail-{self.learner_id}", daemon=True)
        self.thread.start()

    def _background(self) -> None:
        assert self.node is not None
        emit, poll = self.setup.emit, self.setup.options.poll_interval
        failures = 0
        while not self._stop.is_set():
            try:
                self.node.tick()
                failures = 0
            except MailboxUnavailable as e:
                failures += 1
                emit(ev.StoreFailure(self.learner_id, str(e)))
            except BaseException as e:  # re-raised on the training thread, never swallowed
                self.bridge.failure = e
                emit(ev.BackgroundFailed(self.learner_id, f"{type(e).__name__}: {e}"))
                return
            self.bridge.wake.wait(poll * min(2**failures, 16))
            self.bridge.wake.clear()

    def check(self) -> None:
        """Raise the background work's failure (``SessionFailed``), or say the node is not open."""
        if self.bridge.failure is not None:
            raise SessionFailed(
                f"the background work of learner {self.learner_id!r} failed: {self.bridge.failure}"
            ) from self.bridge.failure
        if self.learner is None:
            raise RuntimeError("the session is not open: use `with gm.Session(...) as session:` or call open()")

    # ---- the training loop ------------------------------------------------------------

    def step(self, samples: int) -> None:
        self.check()
        assert self.learner is not None
        self.learner.step(int(samples), wait=self.wait_commit)

    def wait_commit(self, timeout: float | None = None) -> CommitNotice | None:
        """The next commit for the learner, waiting up to ``timeout`` (default: one poll)."""
        if self.before_wait is not None:
            self.before_wait()
        self.check()
        try:
            return self.bridge.inbox.get(timeout=timeout or self.setup.options.poll_interval)
        except queue.Empty:
            return None

    @property
    def progress(self) -> Progress:
        lr = self.learner
        return Progress.of(
            self.bridge.view, lr.versions if lr else {}, lr.local_step if lr else 0, lr.tokens if lr else 0
        )

    def wait_for(self, learners: int, timeout: float | None) -> None:
        """Block until ``learners`` distinct learners (this one included) have been seen since the
        wait began: live at a listing of the leases, or contributing. A learner that joined and
        left again between two looks still counts, so two learners waiting for each other cannot
        miss one another."""
        self.check()
        clock = self.setup.clock
        deadline = None if timeout is None else clock.now() + timeout
        view = self.bridge.view
        mark = view.listing
        seen = {lr for lr, n in view.sightings.items() if n >= mark} | {self.learner_id}
        while len(seen) < learners:
            if deadline is not None and clock.now() >= deadline:
                raise TimeoutError(f"only {len(seen)} of {learners} learners seen after {timeout} s")
            self.check()
            self._stop.wait(min(self.setup.options.poll_interval, 0.2))
            seen |= {lr for lr, n in self.bridge.view.sightings.items() if n > mark}

    # ---- leaving ----------------------------------------------------------------------

    def close(self) -> None:
        if self.closed or self.learner is None:
            return
        try:
            self.settle()
            self.bridge.leaving = True
        finally:
            self.abort()
        self.check()

    def settle(self) -> None:
        """What leaving waits for: with ``flush_on_close``, the steps since each fragment's last
        round published as final contributions; the rounds already due by the schedule published
        (``in_flight`` may have held them back); then every round this node contributed to
        committed. Learners that trained the same number of steps thus contribute to the same
        rounds and leave with the same parameters."""
        self.check()
        lr = self.learner
        assert lr is not None
        self.bridge.settling = True
        if self.setup.algorithm.flush_on_close:
            self._flush(lr)
        self._wait_until(lambda: not lr.maybe_publish() and not lr.published, "close")

    def _flush(self, lr: Learner) -> None:
        assert lr.cfg.in_flight is not None
        in_flight = lr.cfg.in_flight
        for _ in range(lr.run.P):
            if not self._wait_until(
                lambda: lr.next_round - lr.aligned <= in_flight or lr.next_round <= self.bridge.view.head, "flush"
            ):
                return
            lr.maybe_publish(final=True)

    def _wait_until(self, done: Callable[[], bool], what: str) -> bool:
        lr = self.learner
        assert lr is not None
        clock, close_timeout = self.setup.clock, self.setup.close_timeout
        last_head, since = self.bridge.view.head, clock.now()
        while True:
            lr.drain()
            # A round that committed without this node's contribution no longer waits on us.
            while lr.published and lr.published[0].round <= self.bridge.view.head:
                lr.published.popleft()
            if done():
                return True
            c = self.wait_commit()
            if c is not None:
                lr.apply(c)
            head = self.bridge.view.head
            if head != last_head:
                last_head, since = head, clock.now()
            elif clock.now() - since > close_timeout:
                reason = f"no round committed for {close_timeout:.0f} s while waiting to {what}"
                self.setup.emit(ev.GaveUp(self.learner_id, head, reason))
                return False

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the node's thread, waiting up to ``timeout``; True once it has ended (or never ran)."""
        self._stop.set()
        self.bridge.wake.set()
        if self.thread is not None:
            self.thread.join(timeout)
        return self.thread is None or not self.thread.is_alive()

    def leave(self) -> None:
        """Release the lease and the restart marker (the thread stopped)."""
        self.closed = True
        try:
            if self.node is not None:
                self.node.leave()
        except MailboxUnavailable as e:
            self.setup.emit(ev.StoreFailure(self.learner_id, f"could not release the lease: {e}"))
        finally:
            self.marker.close()

    def abort(self) -> None:
        """Stop, load the newest committed parameters this node holds, and leave."""
        if self.closed:
            return
        self.closed = True
        self.stop()
        if self.learner is not None:
            self.learner.drain()
            self.learner.write_newest()
        self.leave()
