"""A wide-area link in a box: a local TCP proxy with a rate limit and a delay, for benchmarks.

``Link(upstream, mbit=100, rtt_ms=80)`` listens on 127.0.0.1 (``link.port``) and forwards every
connection to ``upstream`` (host, port). It stands for one node's internet connection: every
connection through it shares its rate, per direction (full duplex: uploads and downloads do not
slow each other), and every byte arrives ``rtt_ms / 2`` after it was sent, each way.

Per connection and direction, a reader thread takes bytes from the sender as they come, stamped
with their time, into a queue holding at most ``window`` bytes (a TCP window: a single connection
moves at most ``window / rtt`` bytes per second, as a real one does); a writer thread releases each
piece once its delay has passed and the link has had the time to serialize it (the link is one
queue per direction: ``n`` bytes occupy it for ``n / rate`` seconds). Counters give the bytes each
direction carried. Threads, not asyncio: the benchmark's nodes are threads already, and at these
rates (tens of MB/s) the proxy's own CPU is small.
"""

from __future__ import annotations

import queue
import socket
import threading
import time

PIECE = 64 << 10  # bytes per read: 5 ms of a 100 Mbit/s link


class _Direction:
    """One direction of the link: a single queue that serializes what every connection sends."""

    def __init__(self, rate: float) -> None:
        self.rate = rate  # bytes per second
        self.lock = threading.Lock()
        self.free_at = 0.0
        self.bytes = 0

    def transmit(self, n: int) -> None:
        """Wait for ``n`` bytes to cross the link (behind what is queued before them)."""
        with self.lock:
            start = max(time.monotonic(), self.free_at)
            self.free_at = start + n / self.rate
            self.bytes += n
            done = self.free_at
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class Link:
    def __init__(
        self, upstream: tuple[str, int], *, mbit: float = 100.0, rtt_ms: float = 80.0, window: int = 4 << 20
    ) -> None:
        if mbit <= 0 or rtt_ms < 0 or window < PIECE:
            raise ValueError(f"Link(mbit={mbit}, rtt_ms={rtt_ms}, window={window}): expected mbit > 0, rtt >= 0")
        self.upstream = upstream
        self.rate = mbit * 1e6 / 8
        self.delay = rtt_ms / 2000.0
        self.window = window
        self.up = _Direction(self.rate)  # node -> store
        self.down = _Direction(self.rate)  # store -> node
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="link-accept", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def counters(self) -> tuple[int, int]:
        """(bytes up, bytes down) carried so far."""
        return self.up.bytes, self.down.bytes

    def close(self) -> None:
        self._closed = True
        self._server.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ends = threading.Semaphore(0)  # released by each direction once it is done
            self._pipe(client, server, self.up, ends)
            self._pipe(server, client, self.down, ends)
            threading.Thread(target=self._reap, args=(ends, client, server), name="link-reap", daemon=True).start()

    @staticmethod
    def _reap(ends: threading.Semaphore, *socks: socket.socket) -> None:
        ends.acquire()
        ends.acquire()
        for s in socks:
            s.close()

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: _Direction, ends: threading.Semaphore) -> None:
        pending: queue.Queue[tuple[float, bytes] | None] = queue.Queue(maxsize=max(self.window // PIECE, 1))

        def read() -> None:
            try:
                while data := src.recv(PIECE):
                    pending.put((time.monotonic(), data))
            except OSError:
                pass
            pending.put(None)

        def write() -> None:
            broken = False
            while (item := pending.get()) is not None:
                if broken:
                    continue  # the other end is gone: drain until the reader stops
                sent_at, data = item
                wait = sent_at + self.delay - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                direction.transmit(len(data))
                try:
                    dst.sendall(data)
                except OSError:
                    broken = True
                    try:
                        src.shutdown(socket.SHUT_RDWR)  # the reader's recv returns, it stops
                    except OSError:
                        pass
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            ends.release()

        threading.Thread(target=read, name="link-read", daemon=True).start()
        threading.Thread(target=write, name="link-write", daemon=True).start()
