"""The round schedule (SPEC 3.4): which fragment each round syncs, and at which global step.

Round r targets fragment ``r % P`` at nominal global step
``floor(r/P)*H + floor(((r % P) + 1)*H/P)``. Every round commits exactly once and in order, so a
fragment's version is the number of its rounds already committed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Sequence


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


def draw_order(run_id: str, r: int, learners: Iterable[str]) -> list[str]:
    """``learners`` in round ``r``'s draw order: ascending ``draw``, ties to the lower id."""
    return sorted(learners, key=lambda lr: (draw(run_id, r, lr), lr))


def draw_problem(order: Sequence[str], cap: int, counted: Collection[str], refused: Collection[str]) -> str | None:
    """Why a capped round's judged contributions are not what its draw takes; None if they are.

    ``order``: the roster in draw order (``draw_order``); ``counted``: the contributions accepted
    (merged, or accepted and then rejected as outliers); ``refused``: those rejected when judged.
    The draw takes the shortest prefix of ``order`` that holds ``cap`` counted ones (all of
    ``order`` when it holds fewer): every learner of that prefix is counted or refused (a refused
    one is replaced by the next), and none after it, nor any outside the roster, is either.
    """
    taken, end = 0, len(order)
    for i, lr in enumerate(order):
        if taken >= cap:
            end = i
            break
        if lr in counted:
            taken += 1
        elif lr not in refused:
            return (
                f"{lr}, place {i + 1} of {len(order)} in the draw over the roster, was neither merged nor "
                f"rejected while {taken} of max_contributions={cap} were accepted"
            )
    reach = set(order[:end])
    for lr in sorted({*counted, *refused} - reach):
        what = "merged" if lr in counted else "rejected"
        if lr not in order:
            return f"{lr} was {what} but is not in the roster the draw was taken over"
        return (
            f"{lr}, place {order.index(lr) + 1} of {len(order)} in the draw over the roster, was {what} past "
            f"the {cap} accepted before it (max_contributions={cap})"
        )
    return None
