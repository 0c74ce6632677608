"""Joining a run: the one sequence every node goes through before its first step.

Open the run (creating it if the mailbox is empty), cap payload reads at the run's largest
payload, take a lease and read the newest parameters, then load them into the model. ``Session``,
the simulation and the benchmarks' single-threaded cluster all join through here.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .. import events as ev
from ..adapters.base import Adapter
from ..adapters.handles import Mover
from ..clock import Clock
from ..config import DiLoCo
from ..protocol.run import max_payload_bytes, open_run
from ..protocol.store import RunStore
from ..protocol.tape import fetch_theta
from .bridge import Bridge
from .learner import Learner
from .marker import RestartMarker
from .node import Node, NodeOptions


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

    ``io``: how the learner moves fragments (default ``FragmentIO`` over ``adapter``). With
    ``bridge.follow`` set (a sharded node), the node reads no parameters: each fragment's newest
    commit (or its initial parameters) is handed to ``bridge.follow`` and loaded from there.
    """
    if role not in ("both", "learner"):
        raise ValueError(f"role={role!r}: a training node's role is 'both' or 'learner' (a syncer is gm.Syncer)")
    run, created = open_run(
        store, adapter.schema(), adapter.read, cfg, learner=learner, compression=options.compression, rng=rng
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
    )
    # Before joining: the learner says whether it consumes its anchors (``Bridge.lend``), which
    # decides whether the node keeps the parameters it reads.
    trainer = Learner(adapter, run, node.bridge, clock, learner=learner, emit=emit, io=io)
    trainer.reload = lambda f: fetch_theta(store, run, f, node.newest.get(f))
    predecessor = marker.open(run.manifest.run_id) if marker is not None else None
    try:
        thetas = node.join(created=created, predecessor=predecessor)
    except BaseException:
        if marker is not None:
            marker.close()
        raise
    if marker is not None:
        marker.hold(nonce)
    follow = node.bridge.follow
    incoming = {f: follow(f, node.newest.get(f)) for f in thetas} if follow is not None else None
    trainer.start(node.head, thetas, {f: v for f, (v, _) in node.thetas.items()}, incoming, lent=node.lent)
    return node, trainer
