from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gradientmail_core.config import Balanced, Strided  # noqa: E402
from gradientmail_core.protocol.partition import plan, tensor_bytes  # noqa: E402
from gradientmail_core.protocol.records import TensorSpec  # noqa: E402


def T(name: str, dtype: str, *shape: int) -> TensorSpec:
    return TensorSpec(name=name, dtype=dtype, shape=list(shape))


def test_tensor_bytes_follow_the_dtype() -> None:
    assert tensor_bytes(T("a", "F32", 2, 3)) == 24
    assert tensor_bytes(T("a", "F16", 2, 3)) == 12
    assert tensor_bytes(T("a", "BF16", 5)) == 10
    assert tensor_bytes(T("a", "F32")) == 4  # a scalar is one element


def test_balanced_puts_largest_first_on_the_lightest_fragment() -> None:
    # Bytes: a 40, b 20, c 20, d 12, e 4. Largest first (b before c by name):
    # a->0 (40|0), b->1 (40|20), c->1 (40|40), d->0 on the tie (52|40), e->1 (52|44).
    schema = [T("a", "F32", 10), T("b", "F32", 5), T("c", "F16", 10), T("d", "F32", 3), T("e", "BF16", 2)]
    assert plan(schema, 2, Balanced()) == [["a", "d"], ["b", "c", "e"]]


def test_names_keep_schema_order_within_a_fragment() -> None:
    schema = [T("e", "BF16", 2), T("d", "F32", 3), T("c", "F16", 10), T("b", "F32", 5), T("a", "F32", 10)]
    assert plan(schema, 2, Balanced()) == [["d", "a"], ["e", "c", "b"]]


def test_balanced_ties_go_to_the_lowest_fragment_in_name_order() -> None:
    schema = [T("z", "F32", 4), T("x", "F32", 4), T("y", "F32", 4)]
    assert plan(schema, 3, Balanced()) == [["x"], ["y"], ["z"]]


def test_balanced_spreads_zero_size_tensors_so_no_fragment_is_empty() -> None:
    schema = [T("a", "F32", 0), T("b", "F32", 0, 3), T("c", "F32", 1)]
    assert plan(schema, 3, Balanced()) == [["c"], ["a"], ["b"]]


def test_more_fragments_than_tensors_says_to_lower_fragments() -> None:
    with pytest.raises(ValueError, match="lower `fragments`"):
        plan([T("a", "F32", 4), T("b", "F32", 4)], 3, Balanced())


def _transformer() -> list[TensorSpec]:
    schema = [T("embed", "F32", 100)]
    for i in range(3):
        schema += [T(f"layers.{i}.w", "F32", 4, 4), T(f"layers.{i}.b", "F32", 4)]
    return [*schema, T("head", "F32", 8)]


def test_strided_deals_blocks_round_robin_then_packs_the_rest() -> None:
    # Blocks of 80 bytes: 0 and 2 -> fragment 0 (160), 1 -> fragment 1 (80);
    # then embed (400) -> fragment 1 (480), head (32) -> fragment 0 (192).
    assert plan(_transformer(), 2, Strided()) == [
        ["layers.0.w", "layers.0.b", "layers.2.w", "layers.2.b", "head"],
        ["embed", "layers.1.w", "layers.1.b"],
    ]


def test_strided_orders_blocks_by_number_not_by_text() -> None:
    schema = [T("h.10.w", "F32", 1), T("h.2.w", "F32", 1), T("h.1.w", "F32", 1)]
    assert plan(schema, 2, Strided()) == [["h.10.w", "h.1.w"], ["h.2.w"]]


def test_strided_with_a_custom_pattern() -> None:
    schema = [T("blk3_w", "F32", 1), T("blk4_w", "F32", 1), T("out", "F32", 1)]
    assert plan(schema, 3, Strided(block_pattern=r"blk(\d+)_")) == [["blk3_w"], ["blk4_w"], ["out"]]


def test_strided_that_would_leave_a_fragment_empty_is_refused() -> None:
    # 5 tensors but only 2 blocks and 1 other tensor for 4 fragments.
    schema = [T("l.0.w", "F32", 1), T("l.0.b", "F32", 1), T("l.1.w", "F32", 1), T("l.1.b", "F32", 1), T("x", "F32", 1)]
    with pytest.raises(ValueError, match="lower `fragments`"):
        plan(schema, 4, Strided())


def test_strided_pattern_capturing_a_non_integer_is_explained() -> None:
    with pytest.raises(ValueError, match="integer block index"):
        plan([T("l.a.w", "F32", 1)], 1, Strided(block_pattern=r"\.(\w)\."))


_specs = st.lists(
    st.tuples(
        st.sampled_from(["F32", "F16", "BF16"]),
        st.lists(st.integers(0, 6), max_size=3),
        st.sampled_from(["blocks.{}.w", "blocks.{}.b", "misc{}"]),
        st.integers(0, 12),
    ),
    min_size=1,
    max_size=30,
)


@given(_specs, st.integers(1, 6), st.booleans(), st.randoms(use_true_random=False))
def test_every_plan_covers_each_tensor_once_and_is_deterministic(
    raw: list[tuple[str, list[int], str, int]], fragments: int, strided: bool, rnd: object
) -> None:
    schema: list[TensorSpec] = []
    seen: set[str] = set()
    for dtype, shape, template, i in raw:
        name = template.format(i)
        if name not in seen:
            seen.add(name)
            schema.append(T(name, dtype, *shape))
    partition = Strided() if strided else Balanced()
    try:
        out = plan(schema, fragments, partition)
    except ValueError:
        # Balanced only refuses more fragments than tensors; Strided may also leave one empty.
        assert fragments > len(schema) or strided
        return
    assert len(out) == fragments and all(out)
    assert sorted(n for f in out for n in f) == sorted(seen)
    order = {s.name: i for i, s in enumerate(schema)}
    assert all([order[n] for n in f] == sorted(order[n] for n in f) for f in out)
    assert plan(schema, fragments, partition) == out
    # Ties break by name and blocks go in number order, so the schema's order only decides the
    # order of names inside each fragment.
    shuffled = list(schema)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert [set(f) for f in plan(shuffled, fragments, partition)] == [set(f) for f in out]
