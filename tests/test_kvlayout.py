"""Unified KV-cache layouts of a sharing group: head-wise, merged, partitioned."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.errors import ConfigError, UnknownNameError
from fleetserve.sim.kvlayout import (
    LAYOUTS,
    HeadwiseLayout,
    KVLayout,
    LayoutStats,
    MergedLayout,
    PartitionedLayout,
    PoolFull,
    make_layout,
)
from fleetserve.spec import get_model
from fleetserve.spec.types import ModelSpec

L7 = get_model("llama-2-7b")
L13 = get_model("llama-2-13b")
L70 = get_model("llama-2-70b")
OPT = get_model("opt-6.7b")
QWEN = get_model("qwen-2.5-14b")

TB7 = 16 * L7.kv_bytes_per_token  # 8,388,608
TB13 = 16 * L13.kv_bytes_per_token  # 13,107,200
TBQ = 16 * QWEN.kv_bytes_per_token  # 3,145,728
TB70 = 16 * L70.kv_bytes_per_token  # 5,242,880

GROUPS: dict[str, dict[str, ModelSpec]] = {
    "7b+13b": {"l7": L7, "l13": L13},
    "7b+13b+qwen": {"l7": L7, "l13": L13, "qwen": QWEN},
    "opt+70b+13b": {"opt": OPT, "l70": L70, "l13": L13},
    "7b+7b+qwen": {"a": L7, "b": L7, "qwen": QWEN},
}


def _snapshot(layout: KVLayout, rids: range) -> tuple[object, ...]:
    per_rid = tuple(
        (r, layout.model_of(r), layout.tokens_of(r), layout.table_entries(r))
        for r in rids
        if layout.holds(r)
    )
    per_model = tuple(
        (m, layout.used_bytes(m), layout.free_bytes_for(m), layout.token_blocks(m))
        for m in layout.models
    )
    extra: tuple[object, ...] = ()
    if isinstance(layout, MergedLayout):
        extra = tuple(layout.slots_of(r) for r in rids if layout.holds(r))
    return (layout.stats(), per_rid, per_model, extra)


# --- property tests -----------------------------------------------------------

_op = st.one_of(
    st.tuples(
        st.just("grow"),
        st.integers(0, 7),
        st.integers(0, 2),
        st.integers(0, 600),
    ),
    st.tuples(st.just("free"), st.integers(0, 7), st.just(0), st.just(0)),
)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("group", sorted(GROUPS))
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(_op, max_size=40), tail=st.integers(0, 9_999))
def test_random_streams_keep_books(
    layout_name: str, group: str, ops: list[tuple[str, int, int, int]], tail: int
) -> None:
    models = GROUPS[group]
    names = list(models)
    capacity = 12 * TB13 + tail  # ~12 token-blocks of the largest model, odd remainder
    layout = make_layout(layout_name, capacity, models)
    layout.check_integrity()
    expect: dict[int, tuple[str, int]] = {}
    rids = range(8)
    for kind, rid, mi, tokens in ops:
        if kind == "free":
            if rid in expect:
                used_before = layout.used_bytes()
                freed = layout.free(rid)
                assert used_before - layout.used_bytes() == freed
                del expect[rid]
            else:
                with pytest.raises(KeyError):
                    layout.free(rid)
        else:
            model = expect[rid][0] if rid in expect else names[mi % len(names)]
            ok = layout.can_grow(rid, model, tokens)
            before = _snapshot(layout, rids)
            adds = layout.grow_bytes(rid, model, tokens)
            used_m = layout.used_bytes(model)
            try:
                layout.grow(rid, model, tokens)
            except PoolFull:
                assert not ok
                assert _snapshot(layout, rids) == before  # a failed grow changes nothing
            else:
                assert ok
                assert layout.used_bytes(model) - used_m == adds  # grow_bytes is exact
                held = expect[rid][1] if rid in expect else 0
                expect[rid] = (model, max(held, tokens))
        layout.check_integrity()
        assert layout.used_bytes() <= layout.capacity_bytes
        for r in rids:
            assert layout.holds(r) == (r in expect)
            if r in expect:
                assert layout.tokens_of(r) == expect[r][1]
        assert layout.valid_bytes() == sum(
            t * models[m].kv_bytes_per_token for m, t in expect.values()
        )
    for rid in list(expect):
        layout.free(rid)
    layout.check_integrity()
    s = layout.stats()
    assert s.used_bytes == 0 and s.valid_bytes == 0 and s.requests == 0
    assert s.table_entries == 0 and s.internal_frag == 0.0
    assert s.free_bytes + s.unusable_bytes == capacity
    if isinstance(layout, PartitionedLayout):
        for m in models:
            assert layout.free_bytes_for(m) == layout.partition_blocks(m) * 16 * (
                models[m].kv_bytes_per_token
            )
    else:
        assert s.stranded_bytes == 0
        assert s.unusable_bytes < (
            layout.unit_bytes if isinstance(layout, HeadwiseLayout) else TB13
        )


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@settings(max_examples=40, deadline=None)
@given(
    held=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 300)), min_size=1, max_size=14),
    cuts=st.lists(st.integers(0, 120), min_size=14, max_size=14),
    frees=st.sets(st.integers(0, 13), max_size=5),
)
def test_stats_as_of_fewer_tokens_equal_a_shrink_and_change_nothing(
    layout_name: str, held: list[tuple[int, int]], cuts: list[int], frees: set[int]
) -> None:
    """A sample as of an earlier point of a segment allocated ahead: the same
    stats as shrinking those requests, without changing the layout (the merged
    layout computes it; a shrink and a grow back could move its slots)."""
    models = {"l7": L7, "l13": L13, "qwen": QWEN}
    names = list(models)

    def build() -> KVLayout:
        lay = make_layout(layout_name, 9 * TB13 + 77, models)
        for rid, (m, t) in enumerate(held):
            if lay.can_grow(rid, names[m], t):
                lay.grow(rid, names[m], t)
        for rid in frees:  # partly used blocks of every age
            if lay.holds(rid):
                lay.free(rid)
        return lay

    peek, real = build(), build()
    rids = range(len(held))
    cut = {r: max(0, peek.tokens_of(r) - cuts[r]) for r in rids if peek.holds(r)}
    before = _snapshot(peek, rids)
    got = peek.stats_as_of(cut)
    assert _snapshot(peek, rids) == before
    for r, t in cut.items():
        real.shrink(r, t)
    assert got == real.stats()


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@settings(max_examples=30, deadline=None)
@given(tokens=st.lists(st.integers(1, 400), min_size=1, max_size=30))
def test_fill_until_full_never_overcommits(layout_name: str, tokens: list[int]) -> None:
    """Greedy admission of new requests: grow succeeds exactly when can_grow says so."""
    models = {"l7": L7, "l13": L13, "qwen": QWEN}
    names = list(models)
    layout = make_layout(layout_name, 6 * TB13 + 123, models)
    for rid, t in enumerate(tokens):
        model = names[rid % 3]
        if layout.can_grow(rid, model, t):
            layout.grow(rid, model, t)
        else:
            with pytest.raises(PoolFull):
                layout.grow(rid, model, t)
            assert not layout.holds(rid)
        layout.check_integrity()
        assert layout.used_bytes() <= layout.capacity_bytes


_MIXED = {"l7": L7, "l13": L13, "qwen": QWEN}


def _held(layout_name: str, held: list[tuple[int, int]]) -> KVLayout:
    """A pool of 5 llama-2-13b token-blocks (+77 bytes) of ``_MIXED``'s
    services, holding request ``rid`` of service ``held[rid][0]`` with
    ``held[rid][1]`` tokens where it fits."""
    names = list(_MIXED)
    lay = make_layout(layout_name, 5 * TB13 + 77, _MIXED)
    for rid, (m, t) in enumerate(held):
        if lay.can_grow(rid, names[m], t):
            lay.grow(rid, names[m], t)
    return lay


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@settings(max_examples=30, deadline=None)
@given(
    held=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 300)), min_size=2, max_size=12),
    more=st.integers(0, 200),
    model_ix=st.integers(0, 2),
)
def test_grow_all_is_the_grows_one_after_another(
    layout_name: str, held: list[tuple[int, int]], more: int, model_ix: int
) -> None:
    """One commit of several grows of one model (the simulated group's macro
    job) equals the grows in order: the same books when they fit, nothing
    changed (PoolFull) when they do not, and ``can_add_blocks(grow_needs)``
    says which beforehand (a layout's fit is additive in one model's blocks)."""
    model = list(_MIXED)[model_ix]
    one, bulk = _held(layout_name, held), _held(layout_name, held)
    rids = [r for r in range(len(held)) if one.holds(r) and one.model_of(r) == model]
    want = [one.tokens_of(r) + more + r % 3 for r in rids]
    fits_one = True
    for r, t in zip(rids, want, strict=True):
        if not one.can_grow(r, model, t):
            fits_one = False
            break
        one.grow(r, model, t)
    predicted = bulk.can_add_blocks(model, bulk.grow_needs(model, rids, np.array(want)))
    assert predicted == fits_one
    before = _snapshot(bulk, range(len(held)))
    if fits_one:
        bulk.grow_all(model, rids, want)
        assert _snapshot(bulk, range(len(held))) == _snapshot(one, range(len(held)))
    else:
        with pytest.raises(PoolFull):
            bulk.grow_all(model, rids, want)
        assert _snapshot(bulk, range(len(held))) == before
    bulk.check_integrity()


def _books(layout: KVLayout) -> tuple[object, ...]:
    """The per-model books (what a bound batch must keep equal)."""
    per_model = tuple(
        (
            m,
            layout.used_bytes(m),
            layout.free_bytes_for(m),
            layout.token_blocks(m),
            layout.valid_bytes(m),
            layout.holders(m),
            layout.free_token_blocks(m),
        )
        for m in layout.models
    )
    return (layout.stats(), per_model)


@pytest.mark.parametrize("layout_name", ["headwise", "partitioned"])
@settings(max_examples=30, deadline=None)
@given(
    held=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 300)), min_size=1, max_size=12),
    steps=st.lists(st.integers(1, 40), max_size=6),
    leave=st.lists(st.integers(0, 11), max_size=4),
)
def test_a_bound_batch_keeps_the_books_of_its_requests(
    layout_name: str, held: list[tuple[int, int]], steps: list[int], leave: list[int]
) -> None:
    """A service's bound batch (``bind``, ``bulk_change``: a sharing group's
    running requests that decode together) keeps the same books as its
    requests held one by one: after binding, after each decode segment of
    ``n`` tokens per request (its new blocks and tokens as one change, as
    ``BoundBatch.growth`` counts them), and after requests leave. A segment
    that does not fit raises PoolFull and changes nothing."""
    bs = 16
    one, bound = _held(layout_name, held), _held(layout_name, held)
    model = list(_MIXED)[held[0][0]]
    rids = [r for r in range(len(held)) if one.holds(r) and one.model_of(r) == model]
    tokens = {r: one.tokens_of(r) for r in rids}
    for r in rids:
        bound.bind(r)
    assert _books(bound) == _books(one)
    blocks = sum(-(-t // bs) for t in tokens.values())
    assert bound.bulk(model) == (len(rids), sum(tokens.values()), blocks)
    for n in steps:
        want = {r: t + n for r, t in tokens.items()}
        add = sum(-(-want[r] // bs) + (-tokens[r] // bs) for r in rids)
        fits = all(one.can_grow(r, model, want[r]) for r in rids)
        fits = fits and bound.can_add_blocks(model, add)
        before = _books(bound)
        if not fits:
            if add > 0:
                with pytest.raises(PoolFull):
                    bound.bulk_change(model, 0, n * len(rids), add)
            assert _books(bound) == before
            continue
        for r in rids:
            one.grow(r, model, want[r])
        bound.bulk_change(model, 0, n * len(rids), add)
        tokens = want
        assert _books(bound) == _books(one)
        bound.check_integrity()
    for i in leave:
        if not rids:
            break
        r = rids.pop(i % len(rids))
        one.free(r)
        t = tokens.pop(r)
        bound.bulk_change(model, -1, -t, (-t) // bs)
        assert _books(bound) == _books(one)
    bound.check_integrity()
    with pytest.raises(ValueError, match="bound batch"):
        bound.bulk_change(model, -(len(rids) + 1), 0, 0)


@pytest.mark.parametrize("layout_name", ["partitioned", "headwise"])
def test_held_blocks_count_as_used_and_never_overcommit(layout_name: str) -> None:
    """Blocks held by no request (a KV move's reservation, or a detached
    request's blocks a copy still reads) are used memory of their service:
    they leave exactly that much room, are checked by the books, and go back
    whole."""
    lay = make_layout(layout_name, 12 * TB13, {"l7": L7, "l13": L13})
    free = lay.free_token_blocks("l7")
    lay.grow(0, "l7", 40)  # 3 blocks
    lay.hold("l7", free - 5)
    assert lay.held("l7") == free - 5 and lay.token_blocks("l7") == free - 2
    assert lay.free_token_blocks("l7") == 2
    lay.check_integrity()
    with pytest.raises(PoolFull):
        lay.hold("l7", 3)
    assert not lay.can_grow(1, "l7", 3 * 16)
    with pytest.raises(ValueError, match="give back"):
        lay.unhold("l7", free)
    with pytest.raises(ValueError, match="cannot hold"):
        lay.hold("l7", -1)
    lay.unhold("l7", free - 5)
    assert lay.held("l7") == 0 and lay.free_token_blocks("l7") == free - 3
    lay.check_integrity()
    merged = make_layout("merged", 5 * TB13, {"l7": L7, "l13": L13})
    with pytest.raises(NotImplementedError, match="names every slot"):
        merged.hold("l7", 1)


def test_the_merged_layout_has_no_bound_batch() -> None:
    lay = make_layout("merged", 5 * TB13, {"l7": L7, "l13": L13})
    lay.grow(0, "l7", 20)
    with pytest.raises(NotImplementedError, match="names every slot"):
        lay.bind(0)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("model", [L7, L13, L70, OPT, QWEN], ids=lambda m: m.name)
def test_max_tokens_and_units_needed_agree_with_grow(layout_name: str, model: ModelSpec) -> None:
    models = {"x": model, "big": L13, "gqa": QWEN}
    layout = make_layout(layout_name, 10 * TB13 + 7, models)
    top = layout.max_tokens("x")
    assert top % 16 == 0 and top > 0
    assert layout.can_grow(0, "x", top)
    assert not layout.can_grow(0, "x", top + 1)
    layout.grow(0, "x", top)
    assert layout.units_needed("x", top) > 0
    assert layout.units_needed("x", 0) == 0
    with pytest.raises(PoolFull):
        layout.grow(0, "x", top + 1)
    assert layout.tokens_of(0) == top
    layout.check_integrity()


# --- worked examples ----------------------------------------------------------


def test_headwise_units_and_table_entries_llama_2_7b() -> None:
    layout = HeadwiseLayout(3000 * 8192, {"l7": L7})
    assert layout.unit_bytes == 2 * 16 * 128 * 2 == 8192
    assert layout.num_units == 3000
    assert layout.units_per_token_block("l7") == 32 * 32 == 1024
    assert layout.bytes_per_token_block("l7") == 1024 * 8192 == TB7
    assert layout.units_needed("l7", 17) == 2048
    assert layout.max_tokens("l7") == 2 * 16  # 3000 units hold two whole token-blocks
    with pytest.raises(ConfigError, match="1024 units of 8192 bytes"):
        HeadwiseLayout(1000 * 8192, {"l7": L7})


def test_headwise_llama_2_7b_worked_numbers() -> None:
    capacity = 4 * 1024 * 8192 + 100  # four 7B token-blocks and a 100-byte tail
    layout = HeadwiseLayout(capacity, {"l7": L7})
    assert layout.num_units == 4096
    assert layout.unusable_bytes() == 100
    assert layout.max_tokens("l7") == 64
    layout.grow(1, "l7", 17)  # 2 token-blocks
    assert layout.token_blocks("l7") == 2
    assert layout.used_units == 2048
    assert layout.table_entries(1) == 2 * 1024
    assert layout.used_bytes() == 2 * TB7
    assert layout.valid_bytes() == 17 * L7.kv_bytes_per_token
    layout.grow(1, "l7", 20)  # same blocks: no new units
    assert layout.used_units == 2048
    layout.grow(1, "l7", 5)  # shrink request: no-op
    assert layout.tokens_of(1) == 20
    s = layout.stats()
    assert s.internal_frag == pytest.approx(1 - 20 / 32)
    assert s.stranded_bytes == 0
    assert layout.free(1) == 2 * TB7
    assert layout.free_bytes() == capacity - 100


def test_headwise_pads_a_smaller_head_dim() -> None:
    small = dataclasses.replace(L7, name="small-hd64", head_dim=64, hidden_size=2048)
    layout = HeadwiseLayout(64 * TB7, {"l7": L7, "small": small})
    assert layout.unit_bytes == 8192  # set by head_dim 128
    assert layout.units_per_token_block("small") == 1024
    layout.grow(0, "small", 16)  # one full token-block: only padding is waste
    assert layout.used_bytes("small") == 1024 * 8192
    assert layout.valid_bytes("small") == 16 * small.kv_bytes_per_token == 1024 * 4096
    assert layout.stats().internal_frag == pytest.approx(0.5)


def test_merged_k_for_7b_13b_pair() -> None:
    layout = MergedLayout(10 * TB13, {"l7": L7, "l13": L13})
    assert TB13 > TB7
    assert layout.physical_block_bytes == TB13 == 13_107_200
    assert layout.slots_per_block("l13") == 1
    assert layout.slots_per_block("l7") == TB13 // TB7 == 1
    assert layout.slack_bytes("l7") == TB13 - TB7 == 4_718_592
    assert layout.slack_bytes("l13") == 0
    assert layout.num_physical_blocks == 10
    layout.grow(0, "l7", 32)
    assert layout.table_entries(0) == 2
    assert layout.units_needed("l7", 32) == 2
    assert layout.used_bytes("l7") == 2 * TB13


def test_merged_packs_qwen_blocks_with_second_index() -> None:
    layout = MergedLayout(3 * TB13, {"l13": L13, "qwen": QWEN, "l70": L70})
    assert layout.slots_per_block("qwen") == 4  # 13,107,200 // 3,145,728
    assert layout.slack_bytes("qwen") == TB13 - 4 * TBQ == 524_288
    assert layout.slots_per_block("l70") == 2
    assert layout.max_tokens("qwen") == 3 * 4 * 16
    layout.grow(7, "qwen", 16)
    layout.grow(9, "qwen", 48)
    layout.grow(7, "qwen", 32)
    assert layout.slots_of(7) == ((0, 0), (1, 0))  # block 0 filled up by request 9
    assert layout.slots_of(9) == ((0, 1), (0, 2), (0, 3))
    assert layout.physical_blocks("qwen") == 2
    assert layout.free_slots("qwen") == 3
    assert layout.table_entries_total() == 5
    # qwen's free slots are usable only by qwen: stranded for the others
    assert layout.free_bytes_for("qwen") == TB13 + 3 * TBQ
    assert layout.free_bytes_for("l13") == TB13
    assert layout.stats().stranded_bytes == 3 * TBQ
    # freeing 9 leaves block 0 partly used (request 7): nothing returns to the pool
    assert layout.free(9) == 0
    assert layout.used_bytes() == 2 * TB13
    layout.grow(11, "qwen", 16)  # a free slot of the oldest partly used block (1)
    assert layout.slots_of(11) == ((1, 1),)
    layout.check_integrity()
    assert layout.free(7) == TB13  # block 0 empties; block 1 still holds request 11
    assert layout.free(11) == TB13
    assert layout.used_bytes() == 0 and layout.free_bytes() == 3 * TB13
    layout.check_integrity()


def test_merged_block_goes_back_to_pool_and_serves_another_model() -> None:
    layout = MergedLayout(TB13, {"l13": L13, "qwen": QWEN})
    layout.grow(1, "qwen", 16)
    assert not layout.can_grow(2, "l13", 16)  # the only physical block is owned by qwen
    assert layout.free(1) == TB13
    assert layout.can_grow(2, "l13", 16)
    layout.grow(2, "l13", 16)
    assert layout.slots_of(2) == ((0, 0),)


def test_partitioned_cannot_use_another_partition() -> None:
    capacity = 10 * (TB7 + TB13)
    layout = PartitionedLayout(capacity, {"l7": L7, "l13": L13})
    # default shares: proportional to KV bytes per token -> equal token capacity
    assert layout.partition_bytes("l7") == 10 * TB7
    assert layout.partition_bytes("l13") == 10 * TB13
    assert layout.max_tokens("l7") == layout.max_tokens("l13") == 160
    assert layout.shares["l7"] == pytest.approx(TB7 / (TB7 + TB13))
    layout.grow(0, "l7", 160)
    assert layout.free_bytes() == 10 * TB13 > 0
    assert not layout.can_grow(1, "l7", 1)
    with pytest.raises(PoolFull):
        layout.grow(1, "l7", 1)
    assert layout.free_bytes_for("l7") == 0
    assert layout.free_bytes_for("l13") == 10 * TB13
    assert layout.stats().stranded_bytes == 10 * TB13
    assert layout.table_entries(0) == 10
    layout.check_integrity()


def test_partitioned_explicit_shares() -> None:
    layout = PartitionedLayout(100 * TB13, {"l7": L7, "l13": L13}, shares={"l7": 0.3, "l13": 0.7})
    assert layout.partition_bytes("l7") == int(100 * TB13 * 0.3)
    assert layout.partition_blocks("l13") == 70
    assert layout.unusable_bytes() == 100 * TB13 - 70 * TB13 - layout.partition_blocks("l7") * TB7
    rounding = PartitionedLayout(
        10**9 + 7, {"a": L7, "b": L7, "c": QWEN}, shares={"a": 0.1, "b": 0.2, "c": 0.7}
    )
    rounding.check_integrity()


def test_headwise_gives_all_memory_partitioned_strands() -> None:
    """7B+13B, capacity 10 blocks of each: the 7B service alone wants all the memory."""
    models = {"l7": L7, "l13": L13}
    capacity = 10 * (TB7 + TB13)
    head = HeadwiseLayout(capacity, models)
    part = PartitionedLayout(capacity, models)
    merged = MergedLayout(capacity, models)
    assert head.max_tokens("l7") == capacity // TB7 * 16 == 400
    assert part.max_tokens("l7") == 160
    assert merged.max_tokens("l7") == capacity // TB13 * 16 == 256
    for layout in (head, part, merged):
        layout.grow(0, "l7", 160)
    assert head.can_grow(1, "l7", 160) and merged.can_grow(1, "l7", 16)
    assert not part.can_grow(1, "l7", 16)
    assert head.stats().stranded_bytes == 0
    assert part.stats().stranded_bytes == 10 * TB13
    assert merged.stats().stranded_bytes == 0


def test_merged_fragments_more_than_headwise_for_mixed_models() -> None:
    """Scenario: 7B + 13B share a pool; one 7B request of 64 tokens (4 full token-blocks).

    Head-wise: same head_dim, no padding, full blocks -> 0 fragmentation.
    Merged: each 7B block sits in a 13B-sized physical block (k=1), so
    (TB13 - TB7) / TB13 = 36% of used memory is slack.
    """
    models = {"l7": L7, "l13": L13}
    capacity = 20 * TB13
    head = HeadwiseLayout(capacity, models)
    merged = MergedLayout(capacity, models)
    for layout in (head, merged):
        layout.grow(0, "l7", 64)
    assert head.stats().internal_frag == 0.0
    assert merged.stats().internal_frag == pytest.approx((TB13 - TB7) / TB13)
    assert merged.stats().internal_frag > head.stats().internal_frag
    # and the block table is 1024x smaller
    assert head.table_entries(0) == 1024 * merged.table_entries(0)


# --- interface details ----------------------------------------------------------


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_request_semantics(layout_name: str) -> None:
    layout = make_layout(layout_name, 20 * TB13, {"l7": L7, "l13": L13})
    assert layout.name == layout_name
    layout.grow(5, "l7", 0)  # registers with no blocks
    assert layout.holds(5) and layout.tokens_of(5) == 0 and layout.table_entries(5) == 0
    with pytest.raises(ValueError, match="belongs to service"):
        layout.grow(5, "l13", 16)
    with pytest.raises(ValueError, match="belongs to service"):
        layout.can_grow(5, "l13", 16)
    with pytest.raises(ValueError, match="tokens"):
        layout.grow(6, "l7", -1)
    with pytest.raises(KeyError, match="unknown service"):
        layout.grow(6, "nope", 1)
    with pytest.raises(KeyError):
        layout.free(6)
    with pytest.raises(KeyError):
        layout.tokens_of(6)
    layout.grow(5, "l7", 30)
    assert layout.token_blocks("l7") == 2 and layout.token_blocks("l13") == 0
    assert layout.free(5) > 0
    assert not layout.holds(5)
    stats = layout.stats()
    assert isinstance(stats, LayoutStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.used_bytes = 1  # type: ignore[misc]


def test_services_may_share_a_spec() -> None:
    layout = MergedLayout(4 * TB7, {"a": L7, "b": L7})
    layout.grow(0, "a", 16)
    layout.grow(1, "b", 16)
    assert layout.physical_blocks("a") == layout.physical_blocks("b") == 1


def test_make_layout_errors() -> None:
    models = {"l7": L7}
    with pytest.raises(UnknownNameError, match="KV layout"):
        make_layout("split", 10 * TB7, models)
    with pytest.raises(ConfigError, match="shares apply only"):
        make_layout("merged", 10 * TB7, models, shares={"l7": 1.0})
    assert isinstance(make_layout("Partitioned", 10 * TB7, models), PartitionedLayout)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": -5}, "capacity_bytes"),
        ({"models": {}}, "at least one model"),
        ({"block_size": 0}, "block_size"),
        ({"capacity_bytes": TB7 - 1}, "cannot hold one 16-token block"),
        ({"models": {"l7": "llama-2-7b"}}, "ModelSpec"),
    ],
)
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_constructor_errors(layout_name: str, kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"capacity_bytes": 10 * TB13, "models": {"l7": L7}}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        LAYOUTS[layout_name](**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shares", "match"),
    [
        ({"l7": 0.6, "l13": 0.6}, "sum to"),
        ({"l7": 0.5, "zz": 0.5}, "unknown service"),
        ({"l7": 0.5}, "miss service"),
        ({"l7": 0.0, "l13": 0.5}, r"in \(0, 1\]"),
        ({"l7": 0.5, "l13": float("nan")}, "must be a number"),
        ({"l7": 0.001, "l13": 0.5}, "cannot hold"),
    ],
)
def test_partition_share_errors(shares: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PartitionedLayout(100 * TB13, {"l7": L7, "l13": L13}, shares=shares)


def test_check_integrity_catches_corruption() -> None:
    layout = MergedLayout(4 * TB13, {"l13": L13, "qwen": QWEN})
    layout.grow(0, "qwen", 40)
    layout.check_integrity()
    layout._free_slots["qwen"] += 1  # corrupt the books
    with pytest.raises(AssertionError, match="free-slot count"):
        layout.check_integrity()
    head = HeadwiseLayout(4 * TB13, {"l13": L13})
    head.grow(0, "l13", 16)
    head._used_units += 1
    with pytest.raises(AssertionError):
        head.check_integrity()


@pytest.mark.parametrize("layout_name", ["headwise", "merged", "partitioned"])
def test_shrink_gives_back_the_tail_blocks_exactly(layout_name: str) -> None:
    models = {"a": get_model("llama-2-7b"), "b": get_model("qwen-2.5-14b")}
    grown = make_layout(layout_name, 8 << 30, models)
    fresh = make_layout(layout_name, 8 << 30, models)
    for rid, m in ((1, "a"), (2, "b"), (3, "b")):
        grown.grow(rid, m, 300)
        fresh.grow(rid, m, 300 if rid != 2 else 37)
    before = grown.used_bytes()
    dropped = grown.shrink(2, 37)  # 19 token-blocks -> 3
    assert before - grown.used_bytes() == dropped
    assert grown.tokens_of(2) == 37
    g, f = grown.stats(), fresh.stats()
    assert (g.valid_bytes, g.table_entries) == (f.valid_bytes, f.table_entries)
    if layout_name != "merged":  # merged: freed slots may sit in shared physical blocks
        assert g == f
    assert grown.shrink(2, 100) == 0 and grown.tokens_of(2) == 37  # never grows
    grown.check_integrity()
    for rid in (1, 2, 3):
        grown.free(rid)
    assert grown.used_bytes() == 0
    grown.check_integrity()
    with pytest.raises(ValueError):
        fresh.shrink(1, -1)


# --- merged: the bulk paths equal the one-slot-at-a-time algorithm ------------


class _OneSlotMerged:
    """The merged layout's slot assignment one token-block at a time (the
    algorithm of the module docstring, written plainly): a new block takes
    the first free slot (last of its free list) of the model's oldest partly
    used physical block, else a physical block from the pool (last returned
    first, then never used ones); a request's last blocks are given back in
    table order."""

    def __init__(self, layout: MergedLayout) -> None:
        self.bs = layout.block_size
        self.k = {m: layout.slots_per_block(m) for m in layout.models}
        self.recycled: list[int] = []
        self.fresh = 0
        self.free: dict[int, list[int]] = {}
        self.partial: dict[str, dict[int, None]] = {m: {} for m in layout.models}
        self.table: dict[int, list[tuple[int, int]]] = {}
        self.model: dict[int, str] = {}

    def grow(self, rid: int, model: str, tokens: int) -> None:
        self.model.setdefault(rid, model)
        table = self.table.setdefault(rid, [])
        k = self.k[model]
        for _ in range(-(-tokens // self.bs) - len(table)):
            partial = self.partial[model]
            if partial:
                pid = next(iter(partial))
            else:
                pid = self.recycled.pop() if self.recycled else self.fresh
                self.fresh += pid == self.fresh
                self.free[pid] = list(range(k - 1, -1, -1))
                partial[pid] = None
            table.append((pid, self.free[pid].pop()))
            if not self.free[pid]:
                del partial[pid]

    def shrink(self, rid: int, tokens: int) -> None:
        table = self.table[rid]
        k = self.k[self.model[rid]]
        keep = -(-tokens // self.bs)
        tail = table[keep:]
        del table[keep:]
        for pid, slot in tail:
            self.free[pid].append(slot)
            if len(self.free[pid]) == k:
                del self.free[pid]
                self.partial[self.model[rid]].pop(pid, None)
                self.recycled.append(pid)
            elif len(self.free[pid]) == 1:
                self.partial[self.model[rid]][pid] = None

    def free_rid(self, rid: int) -> None:
        self.shrink(rid, 0)
        del self.table[rid], self.model[rid]


_mop = st.tuples(
    st.sampled_from(["grow", "shrink", "free"]),
    st.integers(0, 7),
    st.integers(0, 2),
    st.integers(0, 900),
)


@pytest.mark.parametrize("group", sorted(GROUPS))
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(_mop, max_size=60), block_size=st.sampled_from([1, 16]))
def test_merged_bulk_allocation_equals_one_slot_at_a_time(
    group: str, ops: list[tuple[str, int, int, int]], block_size: int
) -> None:
    """Block tables (physical id, second index) of the merged layout's bulk
    grow/shrink (whole runs of slots, k_m = 1 blocks without free lists)
    equal assigning one token-block at a time; its one-pass stats equal the
    generic formulas."""
    models = GROUPS[group]
    names = list(models)
    layout = MergedLayout(24 * TB13 * 16 // block_size + 12345, models, block_size)
    ref = _OneSlotMerged(layout)
    for kind, rid, mi, tokens in ops:
        if kind == "grow":
            model = ref.model.get(rid, names[mi % len(names)])
            if layout.can_grow(rid, model, tokens):
                layout.grow(rid, model, tokens)
                ref.grow(rid, model, tokens)
        elif rid in ref.table:
            if kind == "free":
                layout.free(rid)
                ref.free_rid(rid)
            else:
                tokens = min(tokens, layout.tokens_of(rid))
                layout.shrink(rid, tokens)
                ref.shrink(rid, tokens)
        for r, table in ref.table.items():
            assert layout.slots_of(r) == tuple(table)
        assert layout.stats() == KVLayout.stats(layout)
        layout.check_integrity()
