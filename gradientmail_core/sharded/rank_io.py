"""One rank's part of a sharded node: its shards' anchors, the two fragment operations every rank
performs together, and the background work on the chunks it owns (``docs/sharding.md``, 3 and 6).

- ``publish(f, r, seq)`` (training thread, collective): the delta of this rank's shard of fragment
  ``f`` (``anchor - local`` in float32, on the parameters' device), the F8 tensors' amax
  all-reduced (``MAX``: exact), then ``gather_chunks``: the chunks this rank owns. Ranks > 0 hand
  them to their uploader thread, which encodes and uploads them one chunk at a time and sends the
  refs to rank 0 (``up``); rank 0 uploads its own from the contribution's ``upload`` (node thread).
- ``announce(f, v, refs)`` (rank 0's node thread): a commit's theta chunk refs, sent to every
  other rank (``down``) and queued here; each rank's downloader fetches and decodes the chunks it
  owns, in the parameters' dtype (which holds a theta exactly), on their device.
- ``write(f, v, mixing)`` (training thread, collective): every rank agrees that its chunks of
  ``(f, v)`` are ready (else every rank raises ``SessionFailed``), ``scatter_chunks`` puts each
  rank's part into its anchors of ``f``, and the shards are set from them:
  ``mixing*current + (1-mixing)*theta`` in float32 (``NumpyAdapter.write``'s roundings: two
  products and a sum, no fused multiply-add), or a copy.
- ``newest()`` (local): every shard set to its anchor (``Learner.write_newest``).

Every allocation of an operation is metered (``torch_sharded.Meter``): ``meter.peak`` is the
largest tensor or array one allocated, ``meter.op_peak`` the most one publish or one commit
allocated in all; neither ever reaches a fragment's bytes unless one chunk does.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..adapters.torch_sharded import Meter, ShardedParams, ShardingUnsupported
from ..adapters.torch_transfer import Chunk, gather_chunks, scatter_chunks
from ..codec import quant
from ..codec.plan import fragment_plan
from ..errors import MailboxUnavailable, SessionFailed
from ..protocol import keys
from ..protocol.layout import owned_chunks
from ..protocol.records import PayloadRef
from ..protocol.run import RunInfo
from ..protocol.store import RunStore
from .anchors import Anchors, default_place
from .wire import Channel, Exchange

RETRIES = 5  # a chunk's upload or download, after the store's own retries, before the node fails


def chunk_elements(run: RunInfo) -> int:
    """The run's chunk size; ``ShardingUnsupported`` for a run that stores whole fragments."""
    return chunk_elements_of(run.cfg)


def chunk_elements_of(cfg: Any) -> int:
    c = getattr(cfg, "chunk_elements", None)
    if c is None:
        raise ShardingUnsupported(
            "this run stores whole fragments (its manifest has no chunk_elements: it was created before "
            "chunked payloads, or with chunk_elements=None); a sharded node needs a run created with a chunk "
            "size (gm.DiLoCo(chunk_elements=...), the default for new runs): start a new run (a new mailbox "
            "prefix), or gather the model onto one process and join as a plain node"
        )
    return int(c)


@dataclass
class Captured:
    """A publish as one rank captured it: the chunks it owns (float32 delta values), the F8
    scale bytes, and, as they go up, their refs."""

    fragment: int
    round: int
    seq: int
    owned: dict[int, Chunk]
    f8_scales: dict[str, int] | None
    meter: Meter
    refs: dict[int, PayloadRef] = field(default_factory=dict)


def _host(values: torch.Tensor, meter: Meter) -> np.ndarray:
    """A piece's float32 values as a host array (a view on the CPU, a copy from a device)."""
    if values.device.type != "cpu":
        meter.note(values.numel() * 4)
    return np.asarray(values.detach().to("cpu", torch.float32).numpy()).reshape(-1)


def _retrying(what: str, fn: Callable[[], Any], stopping: threading.Event) -> Any:
    for attempt in range(RETRIES):
        try:
            return fn()
        except MailboxUnavailable:
            if attempt == RETRIES - 1 or stopping.is_set():
                raise
            time.sleep(min(0.5 * 2**attempt, 8.0))
    raise AssertionError(what)  # pragma: no cover


class RankIO:
    def __init__(
        self,
        sharded: ShardedParams,
        run: RunInfo,
        store: RunStore,
        *,
        learner: str,
        compression: str,
        exchange: Exchange,
        up: Channel,
        down: Channel,
        anchors: str | None = None,
    ) -> None:
        self.sharded, self.run, self.store = sharded, run, store
        self.learner, self.compression = learner, compression
        self.exchange, self.up, self.down = exchange, up, down
        self.rank, self.world = sharded.coord, sharded.world
        self.C = chunk_elements(run)
        self.plans = [fragment_plan(run.shapes[f], self.C) for f in range(run.P)]
        self.owned = [owned_chunks(self.plans[f], sharded.layout, self.rank) for f in range(run.P)]
        self.device = sharded.device
        self.anchors = Anchors(sharded, anchors or default_place(self.device), rank=self.rank)
        # This rank's allocations (the largest, and the most one operation made), in all and by fragment.
        self.meter = Meter()
        self.meters = [Meter() for _ in range(run.P)]
        self.failure: BaseException | None = None
        self.stopping = threading.Event()
        self._cond = threading.Condition()
        self._ready: dict[tuple[int, int], tuple[dict[int, Chunk], Meter] | BaseException] = {}
        self._refs: dict[tuple[int, int], Any] = {}  # rank 0: (seq, rank) -> the rank's message
        self._uploads: queue.Queue[Captured | None] = queue.Queue()
        self._downloads: queue.Queue[tuple[int, int, list[PayloadRef]] | None] = queue.Queue()
        self.threads: list[threading.Thread] = []
        self.bytes_up = 0
        self.bytes_down = 0

    # ---- background threads -------------------------------------------------------------

    def start(self) -> None:
        self._thread(self._download_loop, "download")
        if self.rank == 0:
            self._thread(self._up_receiver, "refs-in")
        else:
            self._thread(self._upload_loop, "upload")

    def _thread(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=f"gradientmail-r{self.rank}-{name}", daemon=True)
        t.start()
        self.threads.append(t)

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            if self.failure is None:
                self.failure = e
            self._cond.notify_all()

    # ---- publish ------------------------------------------------------------------------

    @torch.no_grad()
    def publish(self, f: int, r: int, seq: int) -> Captured:
        """Training thread, collective: this rank's owned chunks of fragment ``f``'s delta."""
        names = self.run.fragments[f]
        op = Meter()
        delta = {}
        for n in names:
            local = self.sharded.local(n)
            d = op.empty(local.numel(), torch.float32, local.device)
            self.anchors.load_into(f, n, d, op)
            d.sub_(local)  # float32(anchor) - float32(local), rounded once: np.subtract(..., float32)
            delta[n] = d
        dtypes = self.run.delta_dtypes(f)
        scales = self._f8_scales([n for n in names if dtypes[n] == "F8_E4M3"], delta, op)
        owned = gather_chunks(self.sharded, names, self.C, delta, meter=op)
        return Captured(f, r, seq, owned, scales, op)

    def _f8_scales(self, names: list[str], delta: Mapping[str, torch.Tensor], op: Meter) -> dict[str, int] | None:
        """F8_E4M3 has one scale per tensor: each rank's finite absolute maximum, all-reduced (MAX)."""
        if not names:
            return None
        local = torch.zeros(len(names), dtype=torch.float32, device=self.device)
        for i, n in enumerate(names):
            d = delta[n]
            if d.numel():
                op.note(d.numel() * 4, transient=True)
                local[i] = torch.where(torch.isfinite(d), d.abs(), torch.zeros((), device=d.device)).max()
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.sharded.group)
        return {n: int(quant.e4m3_scale_byte(np.float32(a))) for n, a in zip(names, local.cpu().tolist())}

    def queue_upload(self, cap: Captured) -> None:
        self._uploads.put(cap)

    def upload_owned(self, cap: Captured) -> dict[int, PayloadRef]:
        """Encodes and uploads this rank's chunks of a publish, one at a time, each released once
        it is up (a retry after a failure picks up where it stopped)."""
        f, n = cap.fragment, len(self.plans[cap.fragment])
        dtypes = self.run.delta_dtypes(f)
        key_for_sha = functools.partial(keys.snapshot_blob_key, cap.round, self.learner, compression=self.compression)
        for k in sorted(cap.owned):
            pieces = cap.owned[k]
            values = {p.name: _host(v, cap.meter) for p, v in pieces}
            ref: PayloadRef = _retrying(
                "upload",
                functools.partial(
                    self.store.put_chunk,
                    key_for_sha,
                    values,
                    [p for p, _ in pieces],
                    shapes=self.run.shapes[f],
                    k=k,
                    n=n,
                    dtypes={p.name: dtypes[p.name] for p, _ in pieces},
                    kind="delta",
                    compression=self.compression,
                    f8_scales=cap.f8_scales,
                ),
                self.stopping,
            )
            cap.refs[k] = ref
            self.bytes_up += ref.size
            del cap.owned[k]
        self.meter.fold(cap.meter)
        self.meters[f].fold(cap.meter)
        return dict(cap.refs)

    def _upload_loop(self) -> None:  # ranks > 0
        while True:
            cap = self._uploads.get()
            if cap is None:
                self.up.send(0, {"stop": True})
                return
            try:
                refs = self.upload_owned(cap)
                message: dict[str, Any] = {"seq": cap.seq, "refs": {str(k): _wire(r) for k, r in refs.items()}}
            except BaseException as e:
                self._fail(e)
                message = {"seq": cap.seq, "error": f"{type(e).__name__}: {e}"}
            self.up.send(0, message)

    def _up_receiver(self) -> None:  # rank 0: every other rank's refs, in their order
        senders = set(range(1, self.world))
        try:
            while senders:
                src, message = self.up.recv()
                if message.get("stop"):
                    senders.discard(src)
                    continue
                with self._cond:
                    self._refs[(int(message["seq"]), src)] = message
                    self._cond.notify_all()
        except BaseException as e:
            if not self.stopping.is_set():
                self._fail(e)

    def others_refs(self, seq: int) -> dict[int, PayloadRef]:
        """Rank 0 (node thread): the refs the other ranks uploaded for publish ``seq``. Messages of
        earlier publishes nobody asked for (contributions the node dropped) are let go."""
        want = [(seq, r) for r in range(1, self.world)]
        with self._cond:
            while not all(w in self._refs for w in want):
                if self.failure is not None or self.stopping.is_set():
                    raise SessionFailed(f"a rank of this node could not upload its chunks: {self.failure}")
                self._cond.wait(0.5)
            for old in [k for k in self._refs if k[0] < seq]:
                del self._refs[old]
            messages = [self._refs.pop(w) for w in want]
        out: dict[int, PayloadRef] = {}
        for r, message in zip(range(1, self.world), messages):
            if "error" in message:
                raise SessionFailed(f"rank {r} of this node could not upload its chunks: {message['error']}")
            out.update({int(k): _unwire(v) for k, v in message["refs"].items()})
        return out

    # ---- commits ------------------------------------------------------------------------

    def announce(self, f: int, v: int, refs: list[PayloadRef]) -> None:
        """Rank 0 (node thread): a commit's theta chunks, to every rank's downloader (this one's too)."""
        message = {"f": f, "v": v, "refs": [_wire(r) for r in refs]}
        for r in range(1, self.world):
            self.down.send(r, message)
        self._downloads.put((f, v, refs))

    def down_message(self, message: Mapping[str, Any]) -> None:
        """Ranks > 0: a commit rank 0 announced (``down``), for the downloader."""
        self._downloads.put((int(message["f"]), int(message["v"]), [_unwire(r) for r in message["refs"]]))

    def _download_loop(self) -> None:
        while True:
            job = self._downloads.get()
            if job is None:
                return
            f, v, refs = job
            try:
                got: tuple[dict[int, Chunk], Meter] | BaseException = self._download(f, v, refs)
            except BaseException as e:
                got = e
            with self._cond:
                self._ready[(f, v)] = got
                self._cond.notify_all()

    def _download(self, f: int, v: int, refs: list[PayloadRef]) -> tuple[dict[int, Chunk], Meter]:
        plan, shapes = self.plans[f], self.run.shapes[f]
        if len(refs) != len(plan):
            raise SessionFailed(f"fragment {f} version {v}: {len(refs)} chunks named, the plan has {len(plan)}")
        dtypes = self.run.fragment_dtypes(f)
        params = self.sharded.params
        op = Meter()
        out: dict[int, Chunk] = {}
        for k in self.owned[f]:
            pieces = plan[k]
            values: dict[str, np.ndarray] | None = _retrying(
                "download",
                functools.partial(
                    self.store.get_chunk,
                    refs[k],
                    pieces,
                    shapes=shapes,
                    k=k,
                    n=len(plan),
                    dtypes={p.name: dtypes[p.name] for p in pieces},
                ),
                self.stopping,
            )
            if values is None:
                raise SessionFailed(
                    f"fragment {f} version {v}: chunk {k} ({refs[k].key}) is gone from the store (collected "
                    "after newer commits while this node was behind); restart the node to rejoin"
                )
            self.bytes_down += refs[k].size
            chunk: Chunk = []
            for p in pieces:
                a = np.asarray(values[p.name], dtype=np.float32).reshape(-1)
                op.note(a.nbytes)
                t = torch.from_numpy(a).to(device=self.device, dtype=params[p.name].dtype)  # exact: a theta
                if t.data_ptr() != a.ctypes.data:  # a copy (another dtype or device): the float32 one goes
                    op.note(t.numel() * t.element_size())
                chunk.append((p, t))
            out[k] = chunk
        return out, op

    def _wait_ready(self, f: int, v: int) -> tuple[dict[int, Chunk], Meter] | BaseException:
        with self._cond:
            while (f, v) not in self._ready:
                if self.failure is not None:
                    return self.failure
                if self.stopping.is_set():
                    return SessionFailed("the session is closing")
                self._cond.wait(0.5)
            got = self._ready.pop((f, v))
            for old in [key for key in self._ready if key[0] == f and key[1] < v]:
                del self._ready[old]  # commits the learner skipped (it applies the newest only)
            return got

    @torch.no_grad()
    def write(self, f: int, v: int, mixing: float) -> None:
        """Training thread, collective: fragment ``f`` set to commit ``v`` (blended by ``mixing``)."""
        got = self._wait_ready(f, v)
        if not self.exchange.agree(not isinstance(got, BaseException)):
            why = f": {got}" if isinstance(got, BaseException) else " (another rank could not read its chunks)"
            raise SessionFailed(f"fragment {f} version {v} could not be loaded{why}")
        assert not isinstance(got, BaseException)
        owned, op = got
        names = self.run.fragments[f]
        shards = {n: self.sharded.local(n) for n in names}
        if not mixing:  # the commit's parameters straight into the shards, then kept as the anchors
            scatter_chunks(self.sharded, names, self.C, owned, shards, meter=op)
            self.anchors.set(f, shards)
        else:
            theta = self.anchors.target(f, names, op)
            scatter_chunks(self.sharded, names, self.C, owned, theta, meter=op)
            keep, take = float(np.float32(mixing)), float(np.float32(1.0 - mixing))
            for n, p in shards.items():
                mixed = p.float() * keep
                mixed += theta[n].float() * take
                op.note(2 * mixed.numel() * 4, transient=True)  # two float32 temporaries of one shard
                p.copy_(mixed)
            self.anchors.set(f, theta)
        self.meter.fold(op)
        self.meters[f].fold(op)

    @torch.no_grad()
    def newest(self) -> None:
        """Every shard set to the newest commit this node aligned with (local: no collective)."""
        op = Meter()
        for f in self.anchors.fragments():
            for n in self.run.fragments[f]:
                self.anchors.load_into(f, n, self.sharded.local(n), op)

    # ---- leaving ------------------------------------------------------------------------

    def stop_uploads(self) -> None:
        """Ranks > 0: the uploader finishes what is queued, then tells rank 0 it is done."""
        self._uploads.put(None)

    def stop_downloads(self, timeout: float = 10.0) -> None:
        """The downloader finishes what it is doing and ends; waited for (at most ``timeout``
        seconds), so no thread of ours is inside torch when the interpreter exits (a daemon thread
        caught there aborts the process at exit: "terminate called without an active exception")."""
        self._downloads.put(None)
        for t in self.threads:
            if t.name.endswith("download") and t is not threading.current_thread():
                t.join(timeout=timeout)


def _wire(ref: PayloadRef) -> list[Any]:
    assert not ref.more
    return [ref.key, ref.sha256, ref.size]


def _unwire(v: list[Any]) -> PayloadRef:
    return PayloadRef(key=str(v[0]), sha256=str(v[1]), size=int(v[2]))
