"""What a node knows between polls: the options, the tape as followed so far, the round being
closed, the leases seen. Each concern of the node (``following``, ``closing``, ``election``,
``gc``, ``publishing``) is a mixin over this state; ``node.Node`` puts them together."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import events as ev
from ..clock import Clock
from ..protocol import keys
from ..protocol.lease import LeaseWriter, Liveness
from ..protocol.records import Claim, RoundRecord, Snapshot
from ..protocol.run import RunInfo
from ..protocol.schedule import fragment_of
from ..protocol.store import RunStore
from .bridge import Bridge
from .collector import Collector
from .merger import FragmentMerger
from .verify import RoundVerifier

_COMPRESSION = {"off": "", "none": "", "": "", "zstd": "zstd"}  # user-facing name -> payload suffix


@dataclass(frozen=True)
class NodeOptions:
    poll_interval: float = 1.0
    lease_timeout: float = 120.0
    round_timeout: float = 60.0  # floor of the follower's no-record timeout
    compression: str = ""
    lease_every: float | None = None  # lease renewal interval; None: lease_timeout / 4
    verify: float = 0.0  # share of the commits it follows that a node recomputes first (verifying.py)

    def __post_init__(self) -> None:
        if not self.poll_interval > 0 or not self.lease_timeout > self.poll_interval:
            raise ValueError(f"need 0 < poll_interval ({self.poll_interval}) < lease_timeout ({self.lease_timeout})")
        if self.lease_every is not None and not 0 < self.lease_every < self.lease_timeout:
            raise ValueError(f"need 0 < lease_every ({self.lease_every}) < lease_timeout ({self.lease_timeout})")
        if isinstance(self.verify, bool) or not isinstance(self.verify, int | float) or not 0.0 <= self.verify <= 1.0:
            raise ValueError(f"verify={self.verify!r}: expected a fraction of rounds in [0, 1] (0: verify none)")

    @classmethod
    def from_user(
        cls,
        *,
        poll_interval: float,
        lease_timeout: float,
        lease_every: float | None,
        round_timeout: float | None,
        compression: str,
        verify: float = 0.0,
    ) -> NodeOptions:
        """The options as ``gm.Session`` and ``gm.Syncer`` take them: compression by its user-facing
        name (``"off"``/``"zstd"``), ``round_timeout`` None for ``max(30, 10 x poll_interval)``."""
        if compression not in _COMPRESSION:
            raise ValueError(f"compression={compression!r}: expected 'off' or 'zstd'")
        return cls(
            poll_interval=poll_interval,
            lease_timeout=lease_timeout,
            lease_every=lease_every,
            round_timeout=round_timeout if round_timeout is not None else max(30.0, 10 * poll_interval),
            compression=_COMPRESSION[compression],
            verify=verify,
        )

    @property
    def lease_interval(self) -> float:
        return self.lease_timeout / 4 if self.lease_every is None else self.lease_every

    @property
    def lease_list_interval(self) -> float:
        return min(self.lease_timeout / 4, 5 * self.poll_interval)


@dataclass
class NodeStats:
    committed: int = 0
    takeovers: int = 0
    superseded: int = 0
    published: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


@dataclass
class Follow:
    """A follower's watch over the open round: who claimed it, and since when it waits."""

    round: int
    opened_at: float
    claim: Claim | None = None
    claim_seen_at: float = 0.0
    claims_listed_at: float = float("-inf")
    timer_from: float | None = None


class NodeState:
    def __init__(
        self,
        store: RunStore,
        clock: Clock,
        run: RunInfo,
        *,
        learner: str,
        nonce: str,
        emit: Callable[[ev.Event], None],
        options: NodeOptions,
        bridge: Bridge | None = None,
        rng: random.Random | None = None,
        role: str = "both",
    ) -> None:
        self.store, self.clock, self.run, self.me, self.nonce = store, clock, run, learner, nonce
        self.emit, self.opts = emit, options
        self.bridge = bridge or Bridge()
        self.rng = rng or random.Random(0)
        # "both": trains and may close rounds; "learner": trains, never claims or takes over;
        # "syncer": closes rounds, trains nothing (no commit is handed to a training thread).
        self.role = keys.validate_role(role)
        self.lease = LeaseWriter(store, clock, learner, nonce, options.lease_interval, role=self.role)
        self.liveness = Liveness(clock, options.lease_timeout, learner, role=self.role)
        # A learner-only node that sees no live node that may close rounds: the round it waits in.
        self.closer_gone: int | None = None
        self.head = -1
        self.newest: dict[int, RoundRecord] = {}
        # Each fragment's newest committed (version, parameters); parameters None where they were
        # lent to the training thread (``lends``): read from the store again if this node needs them.
        self.thetas: dict[int, tuple[int, dict[str, np.ndarray] | None]] = {}
        # The closer: a one-process one, or a sharded node's ranks (``Bridge.closer``). It holds the
        # outer state of the fragments this node closed, and the spool of the rounds it closes.
        self.closer: FragmentMerger = self.bridge.closer or FragmentMerger.one_process(run, store)
        self.spool = self.closer.spool
        self.collector: Collector | None = None
        self.follow: Follow | None = None
        self.snapshot_keys: dict[int, set[str]] = {}
        # This node's snapshots of rounds not yet committed whose chunks it kept in the spool as it
        # uploaded them (``publishing``): its own contribution is judged from them when it closes
        # the round, instead of being read back from the store.
        self.own_snapshots: dict[int, Snapshot] = {}
        self.rounds_seen = 0
        self.contributed = -1  # the newest round this node wrote a snapshot for
        # Who this node has seen (``View.sightings``): learner -> number of the newest listing.
        self.listing = 0
        self.sightings: dict[str, int] = {}
        self.stats = NodeStats()
        self._last_sync: float | None = None
        self.stuck: str | None = None
        self.lent = False  # the parameters read at join went to the training thread (``lends``)
        # ``verify``: the commits this node recomputes before it applies them, on a closer of the
        # verifier's own, and the closers whose commits it no longer applies (``verifying.py``).
        self.verifier = RoundVerifier(store, run, keep=options.verify >= 1.0) if options.verify > 0 else None
        # (drawn only when verifying: the node's draws are otherwise what they were)
        self.verify_rng = random.Random(self.rng.getrandbits(64) if self.verifier is not None else 0)
        self.distrusted: dict[str, int] = {}  # closer -> the round of its commit found forged

    def _list_leases(self) -> None:
        self.liveness.observe(self.store.keys(keys.LEASES))
        self.listing += 1
        for learner in self.liveness.live():
            self.sightings[learner] = self.listing

    def lends(self) -> bool:
        """Whether a commit's parameters go to the training thread without this node keeping them
        (``CommitNotice.lent``): its learner turns anchors into deltas in place (``Bridge.lend``),
        no commit is rebuilt from the previous parameters (``commit_dtype=None``: no change
        payloads), and this node closes nothing now (no outer state to share them with). A follower
        then holds one copy of the model, the learner's anchors; elected, it reads them back."""
        return (
            self.bridge.lend
            and self.verifier is None  # (a verified commit's parameters are the verifier's state)
            and self.run.cfg.commit_dtype is None
            and self.collector is None
            and not self.closer.holds_any()
        )

    def polls_fleet(self) -> bool:
        """Whether this poll is a fleet follower's (``DiLoCo.max_contributions``): the run has
        committed a round, this node closes none now, and it may close one (a learner-only node
        lists every lease, to tell whether any node that may close is live)."""
        return (
            self.run.cfg.max_contributions is not None
            and self.head >= 0
            and self.collector is None
            and self.may_close
            and self.bridge.follow is None
        )

    @property
    def may_close(self) -> bool:
        """May this node claim and close rounds (roles "both" and "syncer")?"""
        return self.role in keys.CLOSER_ROLES

    def newest_of_head(self) -> RoundRecord | None:
        """The record of the newest committed round (None before the first commit)."""
        return self.newest.get(fragment_of(self.head, self.run.P)) if self.head >= 0 else None
