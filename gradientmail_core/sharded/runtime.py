"""A ``gm.Session`` over an FSDP2- or FSDP1-sharded model: every rank of the node runs one, under
one learner id, and its engine host (``syncer/host.EngineHost``) is this rank's part of the node,
built here (``sharded_host``), which keeps the ranks in step (``docs/sharding.md``, section 6).

Rank 0 (``lead_rank.py``) runs the engine as any node does (a ``ProcessHost``: ``join_run``, the
``Node`` thread, the ``Learner``), with ``RecordingIO`` in place of ``FragmentIO`` (``recording.py``,
with the contribution and commit handles the engine holds): what its learner does to the model
(capture fragment f for round r, write commit (f, v) with ``mixing``) is recorded, not done. The records go to every
rank in one ``Exchange`` on the training threads, and every rank (rank 0 too) then performs them
on its shards, in the same order, at the same step: ``RankIO.publish``/``write`` are collectives.
Rank 0 exchanges at the end of each step, and before its learner blocks for a commit (lockstep),
so the publish a commit waits for has gone out. The other ranks (``peer_rank.py``) run no protocol
thread: in ``step`` they take part in exchanges until rank 0's step is done. What every rank does
alike (its groups, its ``RankIO``, the actions, the initial chunks when the node creates the run
through ``protocol/run.create_run``, stopping) is ``rank_host.py``.

Payloads never pass through the training threads: each rank uploads the chunks it owns from its
own background thread and sends the refs to rank 0 (``up``), whose contribution
(``ShardContribution.upload``, asked by the node's placement, ``lead_rank.OverRanks``) uploads
rank 0's chunks, collects the others' refs and returns the joined ref; rank 0's follower hands
each commit's record to ``LeadRank.announce`` (nothing whole is fetched), which sends the theta's
chunk refs to every rank (``down``), whose downloader fetches the chunks it owns.

A failure on any rank becomes ``SessionFailed`` on every rank at the same exchange: rank 0's
own (its node thread's, or an error in its step) is sent as a failed exchange; another rank's is
a flag in the next exchange. ``close`` is collective.
"""

from __future__ import annotations

import dataclasses
import logging

from ..adapters.torch_sharded import ShardedParams
from ..config import DEFAULT_ALIGNMENT, Overwrite
from ..syncer.host import HostSetup
from .anchors import check_place
from .lead_rank import LeadRank
from .peer_rank import PeerRank
from .rank_host import RankHost
from .recording import check_config, mesh_matches


def sharded_host(setup: HostSetup, learner_id: str, sharded: ShardedParams, *, anchors: str | None) -> RankHost:
    """This rank's host: rank 0 leads, the others are its peers. Refuses (``ShardingUnsupported``, or
    ``ValueError`` for ``anchors``) what a sharded node does not do, before any I/O, on every rank."""
    rank, world = mesh_matches(sharded)
    if setup.algorithm.alignment is DEFAULT_ALIGNMENT:
        # Left at the default (the very object DiLoCo fills in: a rule the user names is another
        # one): a sharded node keeps no snapshot of its chunks, so the run it creates aligns by
        # Overwrite, the rule it supports; a run it joins keeps the run's rule (checked there).
        setup = dataclasses.replace(setup, algorithm=dataclasses.replace(setup.algorithm, alignment=Overwrite()))
        if rank == 0:
            logging.getLogger(__name__).info(
                "a sharded node aligns by gm.Overwrite() (the default gm.Adaptive() keeps a snapshot per rank "
                "that sharded nodes do not keep yet)"
            )
    check_config(setup.algorithm)
    check_place(anchors)
    role = LeadRank if rank == 0 else PeerRank
    return RankHost(setup, learner_id, sharded, rank=rank, world=world, anchors=anchors, role=role)
