"""The host of a node that is one process (``host.EngineHost``): a background thread runs
``Node.tick``, one poll at a time, and does all of the node's I/O; the ``Learner`` runs on the
training thread, in ``step``, and never waits on the store; the ``Bridge`` carries what passes
between them, and a failure of the background work, re-raised on the training thread.

A session over any model that is not sharded delegates to one. A sharded node's rank 0 runs one
too (``sharded/lead_rank.py``), its learner moving fragments through a recording IO, and drives it
through the methods below: ``join`` with that IO, ``settle``, ``stop``, ``leave``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from .. import events as ev
from ..adapters.handles import Mover
from ..errors import MailboxUnavailable, SessionFailed
from ..protocol.store import RunStore
from .bridge import Bridge, CommitNotice
from .host import HostSetup, Progress
from .join import join_run
from .learner import Learner
from .marker import RestartMarker
from .node import Node


class ProcessHost:
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

    def join(self, store: RunStore, *, io: Mover | None = None) -> None:
        """Join the run in ``store`` (``join_run``; ``io``: how the learner moves fragments) and
        start the node's thread."""
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
