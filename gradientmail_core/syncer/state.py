"""What a node knows between polls (``NodeState``): one plain object the node's parts are each
given; none of them inherits it. Who writes a field is said beside it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..protocol import keys
from ..protocol.lease import Liveness
from ..protocol.records import RoundRecord, Snapshot
from ..protocol.run import RunInfo
from ..protocol.schedule import fragment_of
from ..protocol.store import RunStore
from .collector import Collector


@dataclass
class NodeStats:
    committed: int = 0
    takeovers: int = 0
    superseded: int = 0
    published: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


@dataclass(eq=False)
class NodeState:
    run: RunInfo
    me: str
    # "both": trains and may close rounds; "learner": trains, never claims or takes over;
    # "syncer": closes rounds, trains nothing (no commit is handed to a training thread).
    role: str
    liveness: Liveness
    # Whether this node may poll as a fleet's follower (``polls_fleet``): a node whose parameters
    # live in this process (``placement.Placement.fleet_polls``).
    fleet_polls: bool = True
    # The tape as followed (the follower): the newest committed round and each fragment's record.
    head: int = -1
    newest: dict[int, RoundRecord] = field(default_factory=dict)
    # Each fragment's newest committed (version, parameters); parameters None where they were lent
    # to the training thread (``Follower.lends``): read from the store again if this node needs them.
    thetas: dict[int, tuple[int, dict[str, np.ndarray] | None]] = field(default_factory=dict)
    lent: bool = False  # the parameters read at join went to the training thread
    rounds_seen: int = 0
    # The round this node closes (``closing``), None while it closes none.
    collector: Collector | None = None
    # The open rounds' snapshots listed at the newest poll (the node's listing; the publisher adds
    # its own): round -> learners.
    snapshot_keys: dict[int, set[str]] = field(default_factory=dict)
    # This node's snapshots of rounds not yet committed whose chunks it kept in the spool as it
    # uploaded them (the publisher): its own contribution is judged from them when it closes the
    # round, instead of being read back from the store.
    own_snapshots: dict[int, Snapshot] = field(default_factory=dict)
    contributed: int = -1  # the newest round this node wrote a snapshot for (the publisher)
    uploaded: dict[int, int] = field(default_factory=dict)  # fragment -> the newest such round of it
    # fragment -> the newest round of it whose commit merged this node's contribution (the follower)
    landed: dict[int, int] = field(default_factory=dict)
    # Who this node has seen (``View.sightings``): learner -> number of the newest listing.
    listing: int = 0
    sightings: dict[str, int] = field(default_factory=dict)
    stats: NodeStats = field(default_factory=NodeStats)

    @property
    def may_close(self) -> bool:
        """May this node claim and close rounds (roles "both" and "syncer")?"""
        return self.role in keys.CLOSER_ROLES

    def list_leases(self, store: RunStore) -> None:
        """One LIST of ``leases/``: who is live, and a listing that saw each of them."""
        self.liveness.observe(store.keys(keys.LEASES))
        self.listed()

    def listed(self) -> None:
        """A listing happened: every learner live now was seen in it."""
        self.listing += 1
        for learner in self.liveness.live():
            self.sightings[learner] = self.listing

    def polls_fleet(self) -> bool:
        """Whether this poll is a fleet follower's (``DiLoCo.max_contributions``): the run has
        committed a round, this node closes none now, and it may close one (a learner-only node
        lists every lease, to tell whether any node that may close is live)."""
        return (
            self.run.cfg.max_contributions is not None
            and self.head >= 0
            and self.collector is None
            and self.may_close
            and self.fleet_polls
        )

    def newest_of_head(self) -> RoundRecord | None:
        """The record of the newest committed round (None before the first commit)."""
        return self.newest.get(fragment_of(self.head, self.run.P)) if self.head >= 0 else None
