"""``gm.Session``: the user's handle on a run, used inside their own training loop."""

from __future__ import annotations

import logging
import math
import os
import queue
import random
import re
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import events as ev
from .adapters import adapter_for
from .clock import Clock, SystemClock
from .config import DiLoCo
from .errors import MailboxUnavailable, SessionFailed
from .mailbox import Mailbox
from .protocol import keys
from .protocol.auth import policy as auth_policy
from .protocol.guard import GuardedMailbox
from .protocol.members import MemberAuth, node_policy
from .protocol.store import RunStore
from .protocol.tape import load_newest
from .syncer.bridge import Bridge, CommitNotice
from .syncer.join import join_run
from .syncer.learner import Learner
from .syncer.marker import RestartMarker
from .syncer.node import Node, NodeOptions

if TYPE_CHECKING:
    from .sharded.runtime import ShardedRuntime

_log = logging.getLogger(__name__)


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


def default_learner_id() -> str:
    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-") or "node"
    return f"{host[:48].strip('-') or 'node'}-{os.getpid()}"


class Session:
    def __init__(
        self,
        model: Any,
        *,
        algorithm: DiLoCo,
        mailbox: Mailbox,
        learner_id: str | None = None,
        role: str | None = None,
        poll_interval: float = 1.0,
        lease_timeout: float = 120.0,
        lease_every: float | None = None,
        round_timeout: float | None = None,
        close_timeout: float | None = None,
        compression: str = "off",
        callbacks: Sequence[Callable[[ev.Event], None]] = (ev.log_events,),
        clock: Clock | None = None,
        seed: int | None = None,
        secret: bytes | str | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        identity: str | os.PathLike[str] | None = None,
        owner_key: str | os.PathLike[str] | None = None,
        anchors: str | None = None,
    ) -> None:
        self.learner_id = keys.validate_learner_id(learner_id if learner_id is not None else default_learner_id())
        if not isinstance(algorithm, DiLoCo):
            raise TypeError(f"algorithm must be a gm.DiLoCo(...), found {type(algorithm).__name__}")
        if role not in (None, "both", "learner"):
            raise ValueError(
                f"role={role!r}: expected 'both' (train and close rounds) or 'learner' (train only); "
                "a node that only closes rounds is gm.Syncer (`gradientmail syncer URL --id NAME`)"
            )
        self.options = NodeOptions.from_user(
            poll_interval=poll_interval,
            lease_timeout=lease_timeout,
            lease_every=lease_every,
            round_timeout=round_timeout,
            compression=compression,
        )
        # docs/security.md: shared secret, identities, or neither; validated before any I/O
        self.auth, self.identity = node_policy(secret, secret_file, identity, owner_key)
        if self.identity is not None:
            self.learner_id = self.identity.learner_id(self.learner_id)
        self.model = model
        self.adapter = adapter_for(model)
        self.algorithm = algorithm
        # A model whose parameters are FSDP2 DTensors: every rank opens this session, and the
        # sharded runtime keeps them in step (gradientmail_core/sharded, docs/sharding.md).
        sharded_mod = sys.modules.get(f"{__package__}.adapters.torch_sharded")  # loaded if the model is sharded
        sharded = (
            self.adapter.sharded
            if sharded_mod is not None and isinstance(self.adapter, sharded_mod.ShardedTorchAdapter)
            else None
        )
        # role None: "both" (train and close rounds); a sharded node closes with every rank its part
        self.role = role if role is not None else "both"
        self.mailbox = mailbox
        self.clock = clock or SystemClock()
        self.callbacks = list(callbacks)
        self.close_timeout = (
            close_timeout if close_timeout is not None else lease_timeout + 2 * self.options.round_timeout
        )
        self._rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "big"))
        self.nonce = f"{self._rng.getrandbits(64):016x}"
        self.bridge = Bridge()
        self._marker = RestartMarker(self.learner_id)  # a restart on this host resumes the id at once
        self.node: Node | None = None
        self.learner: Learner | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._sharded: ShardedRuntime | None = None
        # Where a sharded node's ranks keep their anchors ("device", "host", "disk"; None: "host"
        # on an accelerator, else "device"): sharded/anchors.py. A plain node keeps them as before.
        self.anchors = anchors
        if anchors is not None and sharded is None:
            raise ValueError(
                f"anchors={anchors!r} places a sharded (FSDP2) node's anchors; this model is not sharded, so leave it "
                "unset"
            )
        if sharded is not None:
            from .sharded.runtime import ShardedRuntime

            self._sharded = ShardedRuntime(self, sharded)

    # ---- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> Session:
        self.open()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.close()
        else:
            self._shutdown()  # the loop failed: leave without waiting for rounds

    def emit(self, event: ev.Event) -> None:
        ev.deliver(self.callbacks, event)

    def _store(self) -> RunStore:
        """The run's store as this session reads it: guarded, authenticated as the run is."""

        def ignored(key: str, why: str) -> None:
            self.emit(ev.IgnoredObject(self.learner_id, key, why))

        guard = GuardedMailbox(self.mailbox, auth=self.auth, on_ignored=ignored)
        return RunStore(guard, auth=self.auth, on_ignored=ignored)

    def open(self) -> None:
        """Join the run (creating it if the mailbox is empty) and start the background work.
        On a sharded model, collective: every rank opens (``docs/sharding.md``)."""
        if self._sharded is not None:
            if self._sharded.exchange is None:
                self._sharded.open()
            return
        if self.node is not None:
            return
        node, learner = join_run(
            self._store(),
            self.adapter,
            self.algorithm,
            self.clock,
            learner=self.learner_id,
            nonce=self.nonce,
            emit=self.emit,
            options=self.options,
            rng=self._rng,
            bridge=self.bridge,
            marker=self._marker,
            role=self.role,
        )
        self.node, self.learner = node, learner
        self._thread = threading.Thread(target=self._background, name=f"gradientmail-{self.learner_id}", daemon=True)
        self._thread.start()

    def _background(self) -> None:
        assert self.node is not None
        failures = 0
        while not self._stop.is_set():
            try:
                self.node.tick()
                failures = 0
            except MailboxUnavailable as e:
                failures += 1
                self.emit(ev.StoreFailure(self.learner_id, str(e)))
            except BaseException as e:  # re-raised on the training thread, never swallowed
                self.bridge.failure = e
                self.emit(ev.BackgroundFailed(self.learner_id, f"{type(e).__name__}: {e}"))
                return
            delay = self.options.poll_interval * min(2**failures, 16)
            self.bridge.wake.wait(delay)
            self.bridge.wake.clear()

    def _check(self) -> None:
        if self.bridge.failure is not None:
            raise SessionFailed(
                f"the background work of learner {self.learner_id!r} failed: {self.bridge.failure}"
            ) from self.bridge.failure
        if self.learner is None:
            raise RuntimeError("the session is not open: use `with gm.Session(...) as session:` or call open()")

    # ---- the training loop ------------------------------------------------------------

    def step(self, samples: int = 1) -> None:
        """Call once per optimizer step, with the samples (or tokens) that step processed. On a
        sharded model every rank calls it (a collective), with the node's samples."""
        if self._sharded is not None:
            self._sharded.step(samples)
            return
        self._check()
        assert self.learner is not None
        self.learner.step(int(samples), wait=self._wait_commit)

    def _wait_commit(self, timeout: float | None = None) -> CommitNotice | None:
        if self._sharded is not None:
            self._sharded.before_wait()  # what the learner did goes to every rank before it blocks
        self._check()
        try:
            return self.bridge.inbox.get(timeout=timeout or self.options.poll_interval)
        except queue.Empty:
            return None

    @property
    def batch_size(self) -> int | None:
        g = self.algorithm.global_batch_size
        return None if g is None else math.ceil(g / max(self.bridge.view.live, 1))

    @property
    def rounds_seen(self) -> int:
        return self.bridge.view.rounds_seen

    @property
    def progress(self) -> Progress:
        v = self.bridge.view
        lr = self.learner
        rt = self._sharded  # ranks > 0 of a sharded node: no learner, rank 0's view
        return Progress(
            round=v.head,
            versions=tuple(lr.versions[f] for f in sorted(lr.versions)) if lr else (),
            live_learners=v.live,
            local_step=lr.local_step if lr else rt.steps if rt else 0,
            tokens=lr.tokens if lr else rt.tokens if rt else 0,
            rounds_seen=v.rounds_seen,
            closing_round=v.closer_of,
        )

    def wait_for(self, learners: int, timeout: float | None = None) -> None:
        """Block until ``learners`` distinct learners (this one included) have been seen since
        the wait began: live at a listing of the leases, or contributing. A learner that joined
        and left again between two looks still counts, so two learners waiting for each other
        cannot miss one another. On a sharded model it waits on rank 0 only (the other ranks
        return at once, and wait in their next ``step`` for rank 0)."""
        if self._sharded is not None and not self._sharded.leader:
            return
        self._check()
        deadline = None if timeout is None else self.clock.now() + timeout
        view = self.bridge.view
        mark = view.listing
        seen = {lr for lr, n in view.sightings.items() if n >= mark} | {self.learner_id}
        while len(seen) < learners:
            if deadline is not None and self.clock.now() >= deadline:
                raise TimeoutError(f"only {len(seen)} of {learners} learners seen after {timeout} s")
            self._check()
            self._stop.wait(min(self.options.poll_interval, 0.2))
            seen |= {lr for lr, n in self.bridge.view.sightings.items() if n > mark}

    # ---- leaving ----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for this node's rounds in flight, then load the newest committed parameters.
        On a sharded model, collective: every rank closes."""
        if self._sharded is not None:
            if self._sharded.exchange is not None:
                self._sharded.close()
            return
        if self._closed or self.learner is None:
            return
        try:
            self._check()
            if self.algorithm.flush_on_close:
                self._flush()
            self._wait_in_flight()
            self.bridge.leaving = True
        finally:
            self._shutdown()
        self._check()

    def _flush(self) -> None:
        lr = self.learner
        assert lr is not None and lr.cfg.in_flight is not None
        in_flight = lr.cfg.in_flight
        for _ in range(lr.run.P):
            if not self._wait_until(
                lambda: lr.next_round - lr.aligned <= in_flight or lr.next_round <= self.bridge.view.head, "flush"
            ):
                return
            lr.maybe_publish(final=True)

    def _wait_in_flight(self) -> None:
        """Publish the rounds already due by the schedule (``in_flight`` may have held them
        back), then wait until they have committed. Learners that trained the same number of
        steps thus contribute to the same rounds and leave with the same parameters."""
        lr = self.learner
        assert lr is not None
        self._wait_until(lambda: not lr.maybe_publish() and not lr.published, "close")

    def _wait_until(self, done: Callable[[], bool], what: str) -> bool:
        lr = self.learner
        assert lr is not None
        last_head, since = self.bridge.view.head, self.clock.now()
        while True:
            lr.drain()
            # A round that committed without this node's contribution no longer waits on us.
            while lr.published and lr.published[0].round <= self.bridge.view.head:
                lr.published.popleft()
            if done():
                return True
            c = self._wait_commit()
            if c is not None:
                lr.apply(c)
            head = self.bridge.view.head
            if head != last_head:
                last_head, since = head, self.clock.now()
            elif self.clock.now() - since > self.close_timeout:
                self.emit(
                    ev.GaveUp(
                        self.learner_id,
                        head,
                        f"no round committed for {self.close_timeout:.0f} s while waiting to {what}",
                    )
                )
                return False

    def _shutdown(self) -> None:
        if self._sharded is not None:
            self._sharded._teardown()  # after a failure: stop here without waiting on the other ranks
            return
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.bridge.wake.set()
        if self._thread is not None:
            self._thread.join()
        if self.learner is not None:
            self.learner.drain()
            self.learner.write_newest()
        if self.node is not None:
            try:
                self.node.leave()
            except MailboxUnavailable as e:
                self.emit(ev.StoreFailure(self.learner_id, f"could not release the lease: {e}"))
        self._marker.close()


def align(
    model: Any,
    *,
    mailbox: Mailbox,
    secret: bytes | str | None = None,
    secret_file: str | os.PathLike[str] | None = None,
) -> int:
    """Load the newest committed parameters into ``model`` without joining the run.

    Returns the newest committed round, or -1 if none has committed yet. An authenticated
    run needs its ``secret`` (or ``secret_file``).
    """
    adapter = adapter_for(model)
    auth = MemberAuth(auth_policy(secret, secret_file))  # reads open, secret and members-only runs
    _, head, thetas = load_newest(RunStore(GuardedMailbox(mailbox, auth=auth), auth=auth), adapter.schema())
    for theta in thetas.values():
        adapter.write(theta)
    return head
