"""A follower that checks commits before it applies them (``Session(verify=fraction)``).

Of the commits a node follows, it recomputes a share, drawn at random per node, on its background
thread, before its learner sees them (``verify.RoundVerifier``). A verified commit's parameters
are the recomputed ones (nothing more is downloaded for them). A commit that is not the merge of
its recorded inputs is reported (``ForgedCommit``) and not applied, and neither is any later
commit of the same closer (``CommitRefused``): the node keeps following the tape, and its learner
keeps the parameters of the last commit it applied for those fragments. A round that cannot be
verified (an input gone) is reported (``RoundUnverifiable``) and applied, as without
verification. What this does to liveness: ``docs/security.md``, "Verifying commits".
"""

from __future__ import annotations

import numpy as np

from .. import events as ev
from ..protocol.records import RoundRecord
from .state import NodeState
from .verify import UNVERIFIABLE, VERIFIED


class Verifying(NodeState):
    def _screen(self, rec: RoundRecord) -> tuple[str | None, dict[str, np.ndarray] | None]:
        """Whether to apply ``rec``: ``(why not, None)``, or ``(None, its parameters when this
        node verified them, else None)``."""
        if rec.closer == self.me:
            return None, None
        forged = self.distrusted.get(rec.closer)
        if forged is not None:
            return f"{rec.closer} committed round {forged}, which is not the merge of its inputs", None
        if self.verifier is None or self.verify_rng.random() >= self.opts.verify:
            return None, None
        check = self.verifier.check(rec, theta=self.thetas.get(rec.fragment))
        if check.status == VERIFIED:
            self.emit(ev.RoundVerified(self.me, rec.round, rec.fragment, rec.closer))
            return None, check.theta
        if check.status == UNVERIFIABLE:
            self.emit(ev.RoundUnverifiable(self.me, rec.round, rec.fragment, rec.closer, check.reason))
            return None, None
        self.distrusted[rec.closer] = rec.round
        self.emit(ev.ForgedCommit(self.me, rec.round, rec.fragment, rec.closer, check.reason, check.evidence))
        return f"not the merge of its recorded inputs: {check.reason}", None
