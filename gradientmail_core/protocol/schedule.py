"""The round schedule (SPEC 3.4): which fragment each round syncs, and at which global step.

Round r targets fragment ``r % P`` at nominal global step
``floor(r/P)*H + floor(((r % P) + 1)*H/P)``. Every round commits exactly once and in order, so a
fragment's version is the number of its rounds already committed.
"""

from __future__ import annotations

import hashlib


def fragment_of(r: int, P: int) -> int:
    """The fragment round ``r`` syncs."""
    assert r >= 0 and P >= 1, (r, P)
    return r % P


def slot(r: int, P: int) -> tuple[int, int]:
    """``(fragment, version)``: the fragment round ``r`` syncs and the version it commits; a round
    record is consistent with the schedule exactly when its ``(fragment, version)`` is this."""
    return fragment_of(r, P), version_after(r, P)


def nominal_step(r: int, H: int, P: int) -> int:
    """Global step at which round ``r`` is due; floor division makes ``nominal_step(-1) == 0``."""
    assert r >= -1 and 1 <= P <= H, (r, H, P)
    return (r // P) * H + ((r % P) + 1) * H // P


def gap(r: int, H: int, P: int) -> int:
    """Local steps for round ``r`` since round ``r - 1``: ``floor(H/P)`` or ``ceil(H/P)``, any P of
    them summing to H."""
    return nominal_step(r, H, P) - nominal_step(r - 1, H, P)


def version_before(r: int, P: int) -> int:
    """The fragment version a round-``r`` delta is relative to (its ``base_version``)."""
    assert r >= 0 and P >= 1, (r, P)
    return r // P


def version_after(r: int, P: int) -> int:
    """The fragment version round ``r`` commits."""
    return version_before(r, P) + 1


def round_of(f: int, v: int, P: int) -> int:
    """The round that committed version ``v >= 1`` of fragment ``f`` (the inverse of ``slot``)."""
    assert 0 <= f < P and v >= 1, (f, v, P)
    return (v - 1) * P + f


def is_checkpoint(version: int, *, final: bool, every: int) -> bool:
    """Does the commit of ``version`` write the full parameters and outer state? Every ``every``-th
    version (0, the initial parameters, is the first) and a final round (the end of a run must not
    hang on a chain of changes)."""
    return version % every == 0 or final


def draw(run_id: str, r: int, learner: str) -> int:
    """Learner ``learner``'s place in round ``r``'s draw (``DiLoCo.max_contributions``): a 64-bit
    number from a hash of the run, the round and the id, the same on every node, independent of a
    learner's speed, hardware or data, and new every round. The round merges the reported
    contributions with the lowest numbers; ties (never, in practice) go to the lower id."""
    h = hashlib.sha256(f"gradientmail/draw\0{run_id}\0{r}\0{learner}".encode()).digest()
    return int.from_bytes(h[:8], "big")
