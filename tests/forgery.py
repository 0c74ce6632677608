"""A closer that forges: for the rounds it is told, it commits parameters that are not the merge of
its recorded contributions, and a record consistent with them.

``forge(closer, when)`` adds ``eps`` to every element of the new fp32 master the merge and outer
step made (``passes.merge_and_step``), before the merger casts the parameters and writes the
payloads: the theta, outer state, change, ``theta_digest`` and ``outer_digest`` all describe the
perturbed commit, and the participants and weights are the honest ones. Only that closer's commits
of rounds where ``when(round)`` forge; any other closer in the process (a verifier's) is untouched.
Used in-process (tests/test_verify.py) and by node processes (tests/verify_node.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gradientmail_core.syncer import merger as merger_mod

_FORGING: list[float] = []  # the perturbation of the commit being made, while a forging closer commits
_honest = merger_mod.merge_and_step


def _merge_and_step(*args: Any, **kwargs: Any) -> Any:
    master, momentum, cosine = _honest(*args, **kwargs)
    if _FORGING:
        for v in master.values():
            v += np.float32(_FORGING[-1])  # (in place: the arrays the payloads are written from)
    return master, momentum, cosine


def forge(merger: merger_mod.FragmentMerger, when: Callable[[int], bool], eps: float = 1e-3) -> None:
    """Make ``merger`` (a closer's) forge its commits of the rounds ``when`` names."""
    merger_mod.merge_and_step = _merge_and_step  # type: ignore[assignment]
    honest_commit = merger.commit

    def commit(op: Any, put: Any) -> Any:
        if not when(op.round):
            return honest_commit(op, put)
        _FORGING.append(eps)
        try:
            return honest_commit(op, put)
        finally:
            _FORGING.pop()

    merger.commit = commit  # type: ignore[method-assign]
