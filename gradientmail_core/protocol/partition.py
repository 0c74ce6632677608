"""Split the parameters into fragments (SPEC 4.1).

A pure function of the schema, so every node computes the same plan without talking.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from ..config import Balanced, Strided
from .records import TensorSpec

_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def tensor_bytes(spec: TensorSpec) -> int:
    """Bytes of one tensor in its own dtype (what it costs to ship)."""
    return math.prod(spec.shape) * _ITEM_BYTES[spec.dtype]


def plan(schema: Sequence[TensorSpec], fragments: int, partition: Balanced | Strided) -> list[list[str]]:
    """Names of the tensors in each fragment; within a fragment, names keep schema order.

    ``Balanced``: tensors largest first (ties broken by name, so the plan does not depend on the
    schema's order), each to the lightest fragment so far (ties to the one holding fewer tensors,
    then to the lowest index).

    ``Strided``: tensors whose name matches ``block_pattern`` (``re.search``, group 1 the block
    index) are grouped by block; the k-th block in increasing block-index order goes to fragment
    ``k % fragments`` (for blocks numbered 0, 1, 2, ... that is block i to fragment ``i % fragments``;
    dealing by rank keeps 1-based or sparse numbering balanced too). The other tensors are then
    packed like ``Balanced`` onto the lightest fragments.

    Raises ``ValueError`` if a fragment would be empty (``Balanced`` never leaves one empty when
    ``fragments <= len(schema)``; ``Strided`` can, with few blocks).
    """
    assert fragments >= 1, fragments
    if fragments > len(schema):
        raise ValueError(
            f"fragments={fragments} but the model has only {len(schema)} tensors, so a fragment would be "
            f"empty; lower `fragments` to at most {len(schema)}"
        )
    load = [0] * fragments  # bytes per fragment
    count = [0] * fragments  # tensors per fragment
    owner: dict[str, int] = {}
    rest: list[TensorSpec] = list(schema)

    if isinstance(partition, Strided):
        pattern = re.compile(partition.block_pattern)
        blocks: dict[int, list[TensorSpec]] = {}
        rest = []
        for spec in schema:
            block = _block_index(pattern, spec.name)
            if block is None:
                rest.append(spec)
            else:
                blocks.setdefault(block, []).append(spec)
        for k, block in enumerate(sorted(blocks)):
            for spec in blocks[block]:
                owner[spec.name] = k % fragments
                load[k % fragments] += tensor_bytes(spec)
                count[k % fragments] += 1

    for spec in sorted(rest, key=lambda s: (-tensor_bytes(s), s.name)):
        # Ties on bytes go to the fragment with fewer tensors, so zero-size tensors cannot leave a
        # fragment empty; then min() picks the first, i.e. the lowest index.
        lightest = min(range(fragments), key=lambda i: (load[i], count[i]))
        owner[spec.name] = lightest
        load[lightest] += tensor_bytes(spec)
        count[lightest] += 1

    out: list[list[str]] = [[] for _ in range(fragments)]
    for spec in schema:
        out[owner[spec.name]].append(spec.name)
    empty = [i for i, names in enumerate(out) if not names]
    if empty:
        # Only Strided gets here: its blocks may not spread over every fragment.
        raise ValueError(
            f"fragments={fragments} leaves fragment(s) {empty} empty with partition {partition!r}; "
            "lower `fragments` or use gm.Balanced()"
        )
    return out


def _block_index(pattern: re.Pattern[str], name: str) -> int | None:
    match = pattern.search(name)
    if match is None or match.group(1) is None:
        return None
    try:
        return int(match.group(1))
    except ValueError:
        raise ValueError(
            f"Strided(block_pattern={pattern.pattern!r}) captured {match.group(1)!r} from tensor {name!r}; "
            "group 1 must capture the integer block index"
        ) from None
