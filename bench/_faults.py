"""One node's network in a box, with faults: a TCP proxy on 127.0.0.1 in front of the store that a
harness can cut (a partition), slow (delay and rate) and heal, and that can stop one request.

``FaultProxy(upstream)`` listens on ``proxy.url`` and forwards every connection to ``upstream``
(host, port). One proxy per node, so a fault reaches that node only:

- ``cut()``: a partition. Every open connection is dropped (both ends closed) and new ones are
  blackholed: the proxy stops accepting, so the kernel completes the handshake into the listen
  backlog and the client's request sits there unanswered, as over a dead link (the client times out
  by its own read timeout, or waits). ``heal()`` accepts them again and forwards what they sent:
  the retransmissions of a link that came back.
- ``slow(rtt_ms, mbit)``: every byte arrives ``rtt_ms / 2`` late, each way, and each direction
  moves at most ``mbit``; ``slow(0, None)`` (or ``heal()``) undoes it.
- ``stop_request(pattern, then)``: the next request whose first line matches ``pattern`` (a
  ``bytes`` regex, e.g. a PUT of a round record) is held, never forwarded, and ``then(match)`` is called
  (the harness kills the node there: a closer dead in the middle of its commit, after its round
  payloads and before its record).

Counters (``counters()``): connections forwarded (``accepted``), connections dropped by a cut
(``dropped``), cuts, requests stopped, bytes each way (``up``, ``down``). Threads, as ``_link.py``; at a node's request rates (tens
per second) the proxy's own CPU is small.
"""

from __future__ import annotations

import queue
import re
import socket
import threading
import time
from collections.abc import Callable

PIECE = 64 << 10


class FaultProxy:
    def __init__(self, upstream: tuple[str, int], *, backlog: int = 128) -> None:
        self.upstream = upstream
        self._server = socket.create_server(("127.0.0.1", 0), backlog=backlog)
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._healed = threading.Event()
        self._healed.set()
        self._closed = False
        self._delay = 0.0
        self._rate: float | None = None  # bytes per second per direction; None: unlimited
        self._free_at = {"up": 0.0, "down": 0.0}
        self._trap: tuple[re.Pattern[bytes], Callable[[bytes], None]] | None = None
        self.stats = {"accepted": 0, "dropped": 0, "cuts": 0, "stopped": 0, "up": 0, "down": 0}
        threading.Thread(target=self._accept, name="faults-accept", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def is_cut(self) -> bool:
        return not self._healed.is_set()

    # ---- faults ---------------------------------------------------------------------------

    def cut(self) -> None:
        with self._lock:
            if not self._healed.is_set():
                return
            self._healed.clear()
            self.stats["cuts"] += 1
            doomed, self._open = self._open, set()
            self.stats["dropped"] += len(doomed) // 2
        for s in doomed:
            _close(s)

    def heal(self) -> None:
        """End a cut (the held connections are accepted and forwarded) and any slowness."""
        self.slow(0.0, None)
        self._healed.set()

    def slow(self, rtt_ms: float, mbit: float | None) -> None:
        if rtt_ms < 0 or (mbit is not None and mbit <= 0):
            raise ValueError(f"slow(rtt_ms={rtt_ms}, mbit={mbit}): expected rtt_ms >= 0 and mbit > 0 or None")
        self._delay = rtt_ms / 2000.0
        self._rate = None if mbit is None else mbit * 1e6 / 8

    def stop_request(self, pattern: bytes, then: Callable[[bytes], None]) -> None:
        """Arm a trap: the next request whose bytes match ``pattern`` is never forwarded;
        ``then(match)`` runs in its place (once), with the bytes that matched. ``disarm()`` takes
        the trap back."""
        self._trap = (re.compile(pattern), then)

    def disarm(self) -> None:
        self._trap = None

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self.stats)

    def close(self) -> None:
        self._closed = True
        self._healed.set()
        _close(self._server)
        with self._lock:
            doomed, self._open = self._open, set()
        for s in doomed:
            _close(s)

    # ---- plumbing -------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            if not self._healed.is_set():
                # Blackholed: what connects now waits in the kernel's backlog until heal().
                self._healed.wait()
                continue
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            self._healed.wait()  # (cut between the wait above and the accept: hold it)
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                _close(client)
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.stats["accepted"] += 1
                self._open.update((client, server))
            self._pipe(client, server, "up")
            self._pipe(server, client, "down")

    def _pipe(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        pending: queue.Queue[tuple[float, bytes] | None] = queue.Queue(maxsize=64)

        def read() -> None:
            try:
                while data := src.recv(PIECE):
                    if way == "up" and (trap := self._trap) is not None and (m := trap[0].search(data)):
                        self._trap = None
                        with self._lock:
                            self.stats["stopped"] += 1
                        trap[1](m.group(0))
                        break  # never forwarded
                    pending.put((time.monotonic(), data))
            except OSError:
                pass
            pending.put(None)

        def write() -> None:
            while (item := pending.get()) is not None:
                sent_at, data = item
                wait = sent_at + self._delay - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self._transmit(way, len(data))
                try:
                    dst.sendall(data)
                except OSError:
                    break
            for s in (src, dst):
                with self._lock:
                    self._open.discard(s)
                _close(s)

        threading.Thread(target=read, name=f"faults-read-{way}", daemon=True).start()
        threading.Thread(target=write, name=f"faults-write-{way}", daemon=True).start()

    def _transmit(self, way: str, n: int) -> None:
        with self._lock:
            self.stats[way] += n
            rate = self._rate
            if rate is None:
                return
            start = max(time.monotonic(), self._free_at[way])
            self._free_at[way] = done = start + n / rate
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
