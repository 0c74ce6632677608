"""What every rank of a sharded node holds and does, whether it leads (``lead_rank.py``: rank 0, which
runs the engine) or is its peer (``peer_rank.py``: the other ranks): the node's gloo groups (the
exchange, the up and down channels, the closer's group), its ``RankIO``, the actions every rank
performs in the same order, the initial chunks it uploads when the node creates the run, and how
it stops (``runtime.py`` says how it all fits).

A failure on any rank becomes ``SessionFailed`` on every rank at the same exchange (``Together``);
a rank then stops its own work (``RankRole.stop_work``) and releases the groups once no thread of its own
uses them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..adapters.torch_sharded import ShardedParams
from ..adapters.torch_transfer import gather_chunks, gather_refs
from ..codec.plan import fragment_plan
from ..errors import SessionFailed
from ..protocol import keys
from ..protocol.records import PayloadRef, join_refs
from ..protocol.run import RunInfo
from ..protocol.store import RunStore
from ..syncer.host import HostSetup, Progress
from ..syncer.learner import Learner
from ..syncer.merger import FragmentMerger
from ..syncer.node import Node
from ..syncer.spool import Spool
from .pooling import GlooRanks
from .rank_io import RankIO, chunk_elements_of
from .recording import ShardContribution, Together
from .wire import Channel, Exchange, new_group

_log = logging.getLogger(__name__)


LINGER = 10.0  # seconds a failing rank waits for its peers' threads to stop


class RankRole(Protocol):
    """What a rank does as the leader (``lead_rank.LeadRank``: rank 0, which runs the engine) or a
    peer (``peer_rank.PeerRank``: a rank > 0), given the ``RankHost`` that holds what they share."""

    @property
    def node(self) -> Node | None: ...

    @property
    def learner(self) -> Learner | None: ...

    @property
    def progress(self) -> Progress: ...

    def wait_for(self, learners: int, timeout: float | None) -> None: ...

    def join(self) -> None:
        """Join the run (the node's groups are open)."""
        ...

    def step(self, samples: int) -> None: ...

    def close(self) -> None: ...

    def failed_here(self, e: BaseException) -> None:
        """This rank failed on its own (not ``Together``): stop, telling the others if need be."""
        ...

    def stop_work(self) -> None:
        """After a failure: stop this rank's threads, each wait bounded by ``LINGER``."""
        ...

    def threads(self) -> list[Any]:
        """The threads of this rank that may use the node's groups (None: not started)."""
        ...


class RankHost:
    """One rank's part of a sharded node's host (``syncer/host.EngineHost``): what every rank
    holds, and its role (``role``: built over this host), which joins, steps and closes."""

    def __init__(
        self,
        setup: HostSetup,
        learner_id: str,
        sharded: ShardedParams,
        *,
        rank: int,
        world: int,
        anchors: str | None,
        role: Callable[[RankHost], RankRole],
    ) -> None:
        self.setup, self.learner_id, self.sharded = setup, learner_id, sharded
        self.rank, self.world = rank, world
        self.anchors = anchors  # where this rank keeps its anchors (``anchors.py``)
        self.exchange: Exchange | None = None
        self.up: Channel | None = None
        self.down: Channel | None = None
        self.merge_group: Any = None  # the gloo group of the merger's ops (``pooling.GlooRanks``)
        self.ranker: FragmentMerger | None = None  # this rank's part of closing rounds
        self.io: RankIO | None = None
        self.steps = 0
        self.tokens = 0
        self.closed = False
        self.exchange_seconds = 0.0  # training-thread time spent in exchanges (not in the actions)
        self.collectives = 0  # the exchange's collectives, once its group is released (else exchange.calls)
        self.role = role(self)

    @property
    def node(self) -> Node | None:
        return self.role.node

    @property
    def learner(self) -> Learner | None:
        return self.role.learner

    @property
    def progress(self) -> Progress:
        return self.role.progress

    def wait_for(self, learners: int, timeout: float | None) -> None:
        self.role.wait_for(learners, timeout)

    # ---- the session's calls --------------------------------------------------------------

    def open(self) -> None:
        if self.exchange is not None:
            return
        # Collective, in the same order on every rank: the groups of the exchange and the channels.
        self.exchange, self.up, self.down, self.merge_group = (
            Exchange(new_group(), self.rank, self.world),
            Channel(new_group()),
            Channel(new_group()),
            new_group(),
        )
        self._guard(self.role.join)

    def step(self, samples: int) -> None:
        if self.closed:
            raise RuntimeError("the session is closed")
        if self.exchange is None:
            raise RuntimeError("the session is not open: use `with gm.Session(...) as session:` or call open()")
        self.steps += 1
        self.tokens += int(samples)
        self._guard(self.role.step, samples)

    def close(self) -> None:
        if self.exchange is None or self.closed:
            return
        self._guard(self.role.close)
        self.closed = True

    def abort(self) -> None:
        self.teardown()

    def _guard(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Together as e:
            self.teardown()
            raise SessionFailed(str(e)) from e.__cause__
        except BaseException as e:
            self.role.failed_here(e)
            raise

    # ---- the exchange ---------------------------------------------------------------------

    @property
    def ex(self) -> Exchange:
        assert self.exchange is not None
        return self.exchange

    @property
    def up_ch(self) -> Channel:
        assert self.up is not None
        return self.up

    @property
    def down_ch(self) -> Channel:
        assert self.down is not None
        return self.down

    def rank_io(self, run: RunInfo, store: RunStore, compression: str) -> RankIO:
        return RankIO(
            self.sharded,
            run,
            store,
            learner=self.learner_id,
            compression=compression,
            exchange=self.ex,
            up=self.up_ch,
            down=self.down_ch,
            anchors=self.anchors,
        )

    def merger_for(self, run: RunInfo, store: RunStore, *, relay: bool = False) -> FragmentMerger:
        """This rank's closer; rank 0's (``relay``) announces each op to the other ranks."""

        def send(message: dict[str, Any]) -> None:
            for r in range(1, self.world):
                self.down_ch.send(r, {"close": message})

        stopping = self.io.stopping if self.io is not None else None
        ranks = GlooRanks(self.merge_group, self.rank, self.world, send if relay else None, stopping)
        return FragmentMerger(run, store, ranks, self.sharded.layout, spool=Spool(), keep_theta=False)

    def execute(self, actions: Sequence[Mapping[str, Any]], handles: Sequence[ShardContribution | None]) -> None:
        """Every rank, in the same order: what rank 0's learner did (``lead_rank.py`` records it)."""
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

    # ---- creating the run -----------------------------------------------------------------

    def upload_init(self, store: RunStore, fragments: list[list[str]], compression: str) -> list[PayloadRef]:
        """Every rank (training thread, collective), when the node creates the run: the chunks it
        owns of every fragment's initial parameters, uploaded (a plain node's bytes for them:
        ``put_chunk`` of the values in their dtype), their refs gathered. Any rank's failure raises
        on every rank."""
        c = chunk_elements_of(self.setup.algorithm)
        dtypes = {t.name: t.dtype for t in self.setup.adapter.schema()}
        device = self.sharded.device
        out = []
        for f, names in enumerate(fragments):
            shapes = {n: tuple(self.sharded.shapes[n]) for n in names}
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
            if not self.ex.agree(failure is None):
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

    # ---- stopping -------------------------------------------------------------------------

    def teardown(self) -> None:
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
        self.role.stop_work()
        self.release(barrier=False)

    def release(self, *, barrier: bool) -> None:
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
        if any(t is not None and t.is_alive() for t in self.role.threads()):
            return  # a thread of ours is still in a group (a peer is gone): leave them to the exit
        groups = (exchange.group, *(c.group for c in (self.up, self.down) if c is not None), self.merge_group)
        self.exchange, self.up, self.down, self.merge_group = None, None, None, None
        for g in groups:
            if g is not None:
                try:
                    dist.destroy_process_group(g)
                except Exception as e:  # already gone (the user destroyed every group)
                    _log.debug("could not release a group: %s", e)

    @staticmethod
    def quietly(fn: Any, *args: Any, **kw: Any) -> None:
        try:
            fn(*args, **kw)
        except Exception as e:  # the peer is gone: nothing left to tell it
            _log.debug("could not reach a rank while stopping: %s", e)
