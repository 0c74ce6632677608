"""``gm.Syncer``: a node that trains nothing and only closes rounds (``docs/options.md``, "gm.Syncer").

It waits for the run's manifest (it never creates one), holds a lease of role "syncer" and drives a
``Node`` with no learner. Put it next to the store and start the laptops with ``role="learner"``:
the rounds are merged where the bandwidth is.

    with gm.Syncer(gm.open_mailbox(url), syncer_id="sync-1") as syncer:
        syncer.run()                    # until stop() (another thread, a signal) or Ctrl-C
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

from .. import events as ev
from ..clock import Clock, SystemClock
from ..errors import MailboxUnavailable
from ..mailbox import Mailbox
from ..protocol import keys
from ..protocol.guard import GuardedMailbox
from ..protocol.run import RunInfo, max_payload_bytes, read_manifest
from ..protocol.store import RunStore
from .marker import RestartMarker
from .node import Node
from .options import NodeOptions

_log = logging.getLogger(__name__)
_DEFAULT = NodeOptions()  # (the keywords' defaults are the options')


class Syncer:
    """A node that only closes rounds (see the module). ``open()`` waits for the run and joins it;
    ``tick()`` is one poll (tests drive it on a fake clock); ``run()`` polls until ``stop()``;
    ``close()`` releases the lease. A context manager: ``__exit__`` closes."""

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        syncer_id: str,
        poll_interval: float = _DEFAULT.poll_interval,
        lease_timeout: float = _DEFAULT.lease_timeout,
        lease_every: float | None = None,
        round_timeout: float | None = None,
        compression: str = _DEFAULT.compression,
        callbacks: Sequence[Callable[[ev.Event], None]] = _DEFAULT.callbacks,
        clock: Clock | None = None,
        seed: int | None = None,
        secret: bytes | str | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        identity: str | os.PathLike[str] | None = None,
    ) -> None:
        me = keys.validate_learner_id(syncer_id)
        self.options = NodeOptions.of(locals())  # the keywords that name an option
        fixed = self.options.resolve(me)  # docs/security.md; before any I/O
        self.syncer_id, self.auth, self.clock, self.nonce = fixed.learner_id, fixed.auth, fixed.clock, fixed.nonce
        self._rng = fixed.rng
        self.mailbox = mailbox
        self.callbacks = list(self.options.callbacks)
        self._marker = RestartMarker(self.syncer_id)
        self._stop = threading.Event()
        self.node: Node | None = None
        self._closed = False

    # ---- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> Syncer:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def emit(self, event: ev.Event) -> None:
        ev.deliver(self.callbacks, event)

    def stop(self) -> None:
        """Make ``run()`` (or an ``open()`` waiting for the run) return; safe from any thread or a
        signal handler."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def open(self) -> bool:
        """Wait for the run (its manifest) and join it. False if ``stop()`` came first."""
        if self.node is not None:
            return True
        if self._closed:
            raise RuntimeError("this syncer is closed; make a new gm.Syncer")

        def ignored(key: str, why: str) -> None:
            self.emit(ev.IgnoredObject(self.syncer_id, key, why))

        store = RunStore(GuardedMailbox(self.mailbox, auth=self.auth, on_ignored=ignored), auth=self.auth)
        said = False
        failures = 0
        while True:
            if self._stop.is_set():
                return False
            try:
                manifest = read_manifest(store)
                failures = 0
            except MailboxUnavailable as e:
                failures += 1
                self.emit(ev.StoreFailure(self.syncer_id, str(e)))
                manifest = None
            if manifest is not None:
                break
            if not said and failures == 0:
                said = True
                self.emit(ev.WaitingForRun(self.syncer_id, f"no {keys.MANIFEST} yet"))
            self._pause(self.options.poll_interval * min(2**failures, 16))
        run = RunInfo.from_manifest(manifest)
        store.limit_payloads(max_payload_bytes(run))
        node = Node(
            store,
            self.clock,
            run,
            learner=self.syncer_id,
            nonce=self.nonce,
            emit=self.emit,
            options=self.options,
            rng=self._rng,
            role="syncer",
        )
        predecessor = self._marker.open(run.manifest.run_id)
        try:
            node.join(created=False, predecessor=predecessor)
        except BaseException:
            self._marker.close()
            raise
        self._marker.hold(self.nonce)
        self.node = node
        return True

    def tick(self) -> None:
        """One poll: follow the tape, claim, close or take over rounds."""
        if self.node is None:
            raise RuntimeError("the syncer has not joined a run: call open() first")
        self.node.tick()

    def run(self) -> None:
        """Poll until ``stop()`` (or KeyboardInterrupt), then release the lease. Transient store
        errors are reported (``StoreFailure``) and retried with a growing pause."""
        try:
            if not self.open():
                return
            failures = 0
            while not self._stop.is_set():
                try:
                    self.tick()
                    failures = 0
                except MailboxUnavailable as e:
                    failures += 1
                    self.emit(ev.StoreFailure(self.syncer_id, str(e)))
                self._pause(self.options.poll_interval * min(2**failures, 16))
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def close(self) -> None:
        """Leave the run: release the lease, so that the others stop counting on this syncer at their
        next look at the leases (another node that may close takes the open round over)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.node is not None:
            try:
                self.node.leave()
            except MailboxUnavailable as e:
                self.emit(ev.StoreFailure(self.syncer_id, f"could not release the lease: {e}"))
        self._marker.close()

    def _pause(self, seconds: float) -> None:
        if isinstance(self.clock, SystemClock):
            self._stop.wait(seconds)
        else:
            self.clock.sleep(seconds)  # a fake clock: time moves only when told


__all__ = ["Syncer"]
