"""``gm.Barrier``: processes wait for each other through the mailbox, by name.

    barrier = gm.Barrier(mailbox=mailbox, learner_id="learner-0")
    arrived = barrier.wait("eval", parties=3, timeout=600)   # before evaluating the same model

Each use of a name is a *generation*: ``barriers/{name}/{generation}/``. A party arrives with a
create-once key ``barriers/{name}/{g}/{learner}.json`` in the oldest generation that has no outcome
yet, and polls. The first party to see every party arrived writes the outcome
``barriers/{name}/{g}.json`` (create-once: released, with who arrived); a party whose own timeout
runs out first writes it as timed out, naming who had not arrived. Whichever write lands is the
outcome for every party, so all are released by the same event of the store (the creation of one
key, an instant of its own clock, not of any party's), or all time out together: never some
released and some not. No clock of one machine is compared with another's; each party's timeout
runs on its own injected clock.

A generation with an outcome is never used again, so the same name works at every epoch of a run
and across runs of a script: the next ``wait`` opens the next generation. ``parties`` is a count
(any that many learners) or the learner ids expected (then the timeout error names the missing).
Arrivals of generations two behind the newest outcome are deleted by the party that releases;
the outcomes stay, one small key per use of the name.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from .clock import Clock, SystemClock
from .errors import BarrierTimeout
from .mailbox import Mailbox
from .mailbox.create import CreateOutcome, create_once
from .protocol import keys
from .protocol.records import FORMAT, decode, encode, learner_field, nonneg


@dataclass(frozen=True, kw_only=True)
class Arrival:
    format: int = FORMAT
    learner: str = learner_field()


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """A generation's outcome: ``released`` (who arrived, when the barrier opened) or timed out
    (``missing``: whom the party that gave up, ``by``, was still waiting for)."""

    format: int = FORMAT
    generation: int = nonneg()
    released: bool
    arrived: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    by: str = learner_field()


class Barrier:
    def __init__(
        self,
        *,
        mailbox: Mailbox,
        learner_id: str,
        poll_interval: float = 1.0,
        clock: Clock | None = None,
    ) -> None:
        keys.validate_learner_id(learner_id)
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, int | float) or not poll_interval > 0:
            raise ValueError(f"Barrier(poll_interval={poll_interval!r}): expected seconds > 0, e.g. 1.0")
        self.mailbox, self.me = mailbox, learner_id
        self.poll_interval = float(poll_interval)
        self.clock = clock if clock is not None else SystemClock()

    def wait(self, name: str, *, parties: int | Collection[str], timeout: float | None) -> frozenset[str]:
        """Arrive at barrier ``name`` and block until ``parties`` have arrived; returns who arrived
        (the same set for every party released). ``parties``: a count, or the learner ids expected
        (this one among them). ``timeout``: seconds on this party's clock, or None to wait for as
        long as it takes. Raises ``BarrierTimeout`` naming who had not arrived."""
        keys.validate_barrier_name(name)
        expected = self._expected(parties)
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ValueError(f"Barrier.wait(timeout={timeout!r}): expected seconds > 0, or None to wait forever")
        start = self.clock.now()
        g = self._open_generation(name)
        self._arrive(name, g)
        while True:
            outcome = self._outcome(name, g)
            if outcome is None:
                arrived = self._arrivals(name, g)
                if self._complete(arrived, parties, expected):
                    outcome = self._decide(name, g, released=True, arrived=arrived, missing=[])
                elif timeout is not None and self.clock.now() - start >= timeout:
                    missing = self._missing(arrived, parties, expected)
                    outcome = self._decide(name, g, released=False, arrived=arrived, missing=missing)
            if outcome is not None:
                if outcome.released and self.me not in outcome.arrived:
                    # Opened for others before this party's arrival counted (more learners than a
                    # count of parties): it waits at the next generation.
                    g += 1
                    self._arrive(name, g)
                    continue
                if not outcome.released:
                    raise BarrierTimeout(self._timeout_message(name, g, outcome, parties, timeout))
                return frozenset(outcome.arrived)
            self.clock.sleep(self.poll_interval)

    # ---- the steps ------------------------------------------------------------------------

    def _expected(self, parties: int | Collection[str]) -> frozenset[str] | None:
        if isinstance(parties, int) and not isinstance(parties, bool):
            if parties < 1:
                raise ValueError(f"Barrier.wait(parties={parties!r}): expected a count >= 1 or the learner ids")
            return None
        if isinstance(parties, str) or not isinstance(parties, Collection):
            raise ValueError(
                f"Barrier.wait(parties={parties!r}): expected a count, or a collection of learner ids such as "
                "['learner-0', 'learner-1']"
            )
        expected = frozenset(keys.validate_learner_id(p) for p in parties)
        if self.me not in expected:
            raise ValueError(
                f"Barrier.wait(parties={sorted(expected)}): this party, {self.me!r}, is not among them; "
                "list every learner that waits, this one included"
            )
        return expected

    def _open_generation(self, name: str) -> int:
        """The oldest generation of ``name`` without an outcome: one past the newest outcome."""
        decided = [
            p[1]
            for k in self.mailbox.list(keys.barrier_prefix(name))
            if (p := keys.parse_barrier_key(k)) is not None and p[2] is None
        ]
        return max(decided) + 1 if decided else 0

    def _arrive(self, name: str, g: int) -> None:
        # (Already there with other bytes: this learner's arrival from an earlier process that died
        # waiting. It counts for this one: the same learner is at the barrier.)
        create_once(self.mailbox, keys.barrier_arrival_key(name, g, self.me), encode(Arrival(learner=self.me)))

    def _arrivals(self, name: str, g: int) -> list[str]:
        return sorted(
            p[2]
            for k in self.mailbox.list(keys.barrier_arrivals_prefix(name, g))
            if (p := keys.parse_barrier_key(k)) is not None and p[2] is not None
        )

    def _outcome(self, name: str, g: int) -> Outcome | None:
        key = keys.barrier_outcome_key(name, g)
        data = self.mailbox.get(key)
        return None if data is None else decode(data, Outcome, key=key)

    @staticmethod
    def _complete(arrived: list[str], parties: int | Collection[str], expected: frozenset[str] | None) -> bool:
        if expected is None:
            assert isinstance(parties, int)
            return len(arrived) >= parties
        return expected <= set(arrived)

    def _missing(
        self, arrived: list[str], parties: int | Collection[str], expected: frozenset[str] | None
    ) -> list[str]:
        if expected is not None:
            return sorted(expected - set(arrived))
        # A count names nobody; the learners holding a lease of the run that have not arrived are
        # the likely ones (a barrier beside no run has none).
        holding = {p[0] for k in self.mailbox.list(keys.LEASES) if (p := keys.parse_lease_key(k)) is not None}
        return sorted(holding - set(arrived))

    def _decide(self, name: str, g: int, *, released: bool, arrived: list[str], missing: list[str]) -> Outcome:
        """Write generation ``g``'s outcome, or read the one another party wrote first."""
        key = keys.barrier_outcome_key(name, g)
        mine = Outcome(generation=g, released=released, arrived=arrived, missing=missing, by=self.me)
        result, existing = create_once(self.mailbox, key, encode(mine))
        if result is CreateOutcome.TAKEN:
            return decode(existing, Outcome, key=key)
        if released and g >= 2:
            # Nobody reads the arrivals of a generation with an outcome; two behind, nobody is
            # still deciding it either.
            old = self.mailbox.list(keys.barrier_arrivals_prefix(name, g - 2))
            if old:
                self.mailbox.delete(old)
        return mine

    def _timeout_message(
        self, name: str, g: int, outcome: Outcome, parties: int | Collection[str], timeout: float | None
    ) -> str:
        # (``timeout`` is None only when another party gave up: this one would have waited on.)
        want = f"{parties} parties" if isinstance(parties, int) else f"parties {', '.join(sorted(parties))}"
        arrived = ", ".join(outcome.arrived) or "none"
        if outcome.missing:
            missing = f"not arrived: {', '.join(outcome.missing)}"
        else:
            missing = f"{len(outcome.arrived)} of {parties} arrived; no other learner holds a lease of the run"
        mine = outcome.by == self.me and timeout is not None
        who = f"this party gave up after {timeout:g} s" if mine else f"{outcome.by} gave up"
        return (
            f"barrier {name!r} (generation {g}, {keys.barrier_outcome_key(name, g)}) timed out: {who} waiting for "
            f"{want}; {missing} (arrived: {arrived}). Start the missing ones, or wait for fewer parties; the next "
            "wait on this name opens a new generation"
        )


__all__ = ["Arrival", "Barrier", "Outcome"]
