"""The invariants the simulation checks itself, beyond what the ``Auditor`` checks at the store:

- as the run goes: a learner aligns only with committed parameters (``_check_aligned``), and a
  live learner's lease is judged lost only once it has really gone stale on the observer's own
  clock (``_check_lease_judgement``, against the store's history of lease keys);
- at the end (``_check_end``): every round committed, and every surviving node holds parameters
  bit-identical to the newest committed ones, at the newest version of every fragment.

A violation is recorded in ``violations``; one found mid-run also stops it (``_Abort``).
"""

from __future__ import annotations

import numpy as np

from gradientmail_core import events as ev
from gradientmail_core.protocol import keys

from .state import SimNode, SimState, _Abort


class Checks(SimState):
    # ---- as the run goes ----------------------------------------------------------------

    def _check_aligned(self, sn: SimNode, e: ev.Aligned) -> None:
        """A learner aligns only with committed parameters: bit-identical to the theta of the
        round record it names."""
        rec = self.auditor.tape.get(e.round)
        run = self.auditor.run
        if rec is None or run is None or sn.learner is None:
            self.violations.append(f"at {self.T:.2f} s {sn.name} aligned with round {e.round}, which never committed")
            raise _Abort("aligned with an uncommitted round")
        theta = self.auditor.theta_of(rec)
        mine = sn.learner.anchors.get(e.fragment, {})
        if (
            theta is None
            or rec.fragment != e.fragment
            or rec.version != e.version
            or any(n not in mine or not np.array_equal(mine[n], v) for n, v in theta.items())
        ):
            self.violations.append(
                f"at {self.T:.2f} s {sn.name} aligned fragment {e.fragment} with parameters that differ from "
                f"round {e.round}'s committed ones"
            )
            raise _Abort("aligned with parameters nobody committed")

    def _lease_changed(self, learner: str) -> None:
        """Record when the learner's newest lease key (what observers judge by) changes."""
        listed = self.store.list(keys.lease_prefix(learner))
        newest = listed[-1] if listed else None
        history = self.lease_writes.setdefault(learner, [])
        if history and history[-1][1] == newest:
            return
        clocks = {(o.name, o.incarnation): o.clock.now() for o in self.nodes.values() if o.clock is not None}
        history.append((self.auditor.seq, newest, clocks))
        del history[:-32]

    def _check_lease_judgement(self, observer: SimNode, learner: str) -> None:
        """A live learner's lease may be judged lost only if, at the observer's last complete
        listing, it was gone, or its newest key had been the newest for lease_timeout on the
        observer's own clock (ground truth from the store's history, not from the engine's
        bookkeeping)."""
        target = self.nodes.get(learner)
        if observer.clock is None or observer.node is None or target is None or target.state != "up":
            return  # only a live learner can be wrongly judged lost
        # The observer's newest complete listing of leases/ (a paginated one that failed midway
        # does not count): made during this tick if its listed_at moved since the last tick.
        stored = self.lease_listed.get(observer.name)
        la = observer.node.state.liveness.listed_at
        listed = self.auditor.lease_listing.get(observer.name, 0) if stored is None or stored[0] != la else stored[1]
        history = [h for h in self.lease_writes.get(learner, []) if h[0] < listed]
        if not history or history[-1][1] is None:
            return  # gone when it listed
        newest = history[-1][1]
        i = len(history) - 1
        while i > 0 and history[i - 1][1] == newest:
            i -= 1
        me = (observer.name, observer.incarnation)
        since = max(history[i][2].get(me, float("-inf")), self.clock_started[observer.name])
        elapsed = observer.clock.now() - since
        if elapsed < self.draw.options.lease_timeout:
            self.violations.append(
                f"at {self.T:.2f} s {observer.name} judged {learner}'s lease lost, but {newest} became its newest "
                f"lease only {elapsed:.3f} s before, on {observer.name}'s clock (lease_timeout "
                f"{self.draw.options.lease_timeout})"
            )
            raise _Abort("a live lease was judged lost")

    def _note_lease_listing(self, sn: SimNode) -> None:
        """Remember when (in store operations) the node's liveness view last listed leases/
        completely: its listed_at moved during this tick, so its last listing completed."""
        if sn.node is not None:
            la = sn.node.state.liveness.listed_at
            if self.lease_listed.get(sn.name, (None, 0))[0] != la:
                self.lease_listed[sn.name] = (la, self.auditor.lease_listing.get(sn.name, 0))

    # ---- the end ------------------------------------------------------------------------

    def _newest_params(self, initial: bool = False) -> dict[str, np.ndarray]:
        run = self.auditor.run
        assert run is not None
        newest = {} if initial else self.auditor.newest()
        out: dict[str, np.ndarray] = {}
        for f in range(run.P):
            rec = newest.get(f)
            theta = (
                self.auditor._payload(run.manifest.init[f], run.shapes[f])
                if rec is None
                else self.auditor.theta_of(rec)
            )
            assert theta is not None, f"the newest parameters of fragment {f} were never captured"
            out.update(theta)
        return out

    def _loss(self, params: dict[str, np.ndarray]) -> float:
        return float(sum(((params[n].astype(np.float64) - self.target[n]) ** 2).sum() for n in self.draw.shapes))

    def _check_end(self) -> None:
        survivors = [sn for sn in self.nodes.values() if sn.state == "up"]
        if not survivors:
            self.violations.append("no node survived")
            return
        if self.auditor.head + 1 < self.config.rounds:
            self.violations.append(f"only {self.auditor.head + 1} of {self.config.rounds} rounds committed")
        newest = self._newest_params()
        versions = {rec.fragment: rec.version for rec in self.auditor.newest().values()}
        for sn in survivors:
            assert sn.learner is not None and sn.params is not None
            sn.learner.drain()
            sn.learner.write_newest()
            for n in self.draw.shapes:
                if not np.array_equal(sn.params[n], newest[n]):
                    self.violations.append(f"{sn.name} ends with {n} different from the newest commit")
                    break
            for f, v in versions.items():
                if sn.learner.versions.get(f) != v:
                    self.violations.append(
                        f"{sn.name} holds version {sn.learner.versions.get(f)} of fragment {f}, the newest is {v}"
                    )
        self.stats["survivors"] = len(survivors)
