"""Whether a snapshot's delta enters a round (SPEC 3.6), over facts the engine already fetched.

Two judgements: ``judge`` checks each snapshot on its own (record, payload, values), in the order
its reasons are listed; ``outlier_mask`` then compares the accepted contributions of a round with
one another (a rejection with reason ``outlier``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from .fused import Delta, fragment_norm

PayloadStatus = Literal["ok", "missing", "corrupt", "schema"]


def judge(
    snapshot_steps: int,
    schema_digest_ok: bool,
    base_version: int,
    current_version: int,
    payload: Mapping[str, np.ndarray] | None,
    payload_status: PayloadStatus,
    *,
    expected_shapes: Mapping[str, Sequence[int]] | None = None,
) -> str | None:
    """``None`` if the snapshot is accepted, else the first failing reason, checked in this order:

    - ``zero_steps``: ``snapshot_steps <= 0`` (its weight would divide by zero);
    - ``schema``: its schema digest is not the run's (``schema_digest_ok`` is False);
    - ``stale``: ``base_version != current_version`` (a delta against another version of the fragment);
    - ``missing``: ``payload_status == "missing"`` (no payload at the ref's key);
    - ``corrupt``: ``payload_status == "corrupt"`` (bytes do not hash to the ref, or do not decode);
    - ``schema``: ``payload_status == "schema"`` (an intact payload whose tensor names, shapes or
      dtypes are not the fragment's delta layout), or, given ``expected_shapes``, the payload's
      tensor names or shapes differ from them;
    - ``nonfinite``: any value is NaN or infinite.

    The cheap record checks come first so a stale snapshot's payload never needs fetching: the
    engine may pass ``payload=None`` with any status once an earlier check fails.
    """
    if snapshot_steps <= 0:
        return "zero_steps"
    if not schema_digest_ok:
        return "schema"
    if base_version != current_version:
        return "stale"
    if payload_status == "missing":
        return "missing"
    if payload_status == "corrupt":
        return "corrupt"
    if payload_status == "schema":
        return "schema"
    assert payload_status == "ok" and payload is not None, payload_status
    if expected_shapes is not None:
        if set(payload) != set(expected_shapes):
            return "schema"
        if any(tuple(np.shape(payload[k])) != tuple(expected_shapes[k]) for k in expected_shapes):
            return "schema"
    if not all(np.isfinite(a).all() for a in payload.values()):
        return "nonfinite"
    return None


def outlier_mask(deltas: Sequence[Delta], *, factor: float) -> list[bool]:
    """``True`` for each contribution whose whole-fragment norm exceeds ``factor`` times the median
    norm of the *other* contributions (a rejection with reason ``outlier``).

    Leave-one-out: an oversized contribution cannot raise the bar it is measured against, and with
    two contributions only the much larger one can be flagged (never both, as ``factor > 1``). A
    single contribution has no peers and is never flagged. A non-finite norm is always an outlier.
    A zero median (all peers did not move) flags any non-zero contribution: that is the rule, and a
    round of zero deltas is suspicious anyway.
    """
    return outlier_mask_of_norms([fragment_norm(d) for d in deltas], factor=factor)


def outlier_mask_of_norms(norms: Sequence[float], *, factor: float) -> list[bool]:
    """``outlier_mask`` of contributions given by their whole-fragment norms (``fused.norm_of`` of
    the squared norms computed when they were judged: a closer merging chunk by chunk holds no
    whole delta)."""
    if not factor > 1.0:
        raise ValueError(f"outlier factor={factor!r}: expected a number > 1 (at most 1 could reject everyone)")
    norms = list(norms)
    mask: list[bool] = []
    for i, n in enumerate(norms):
        others = norms[:i] + norms[i + 1 :]
        if not math.isfinite(n):
            mask.append(True)
        elif not others:
            mask.append(False)
        else:
            mask.append(n > factor * float(np.median(others)))
    return mask
