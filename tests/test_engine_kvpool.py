"""KVPool: head-wise pages, check/commit, weight regions, integrity (hypothesis)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fleetserve.runtime.engine.kvpool import KVPool, PoolFull  # noqa: E402

BS = 4


def make_pool(pages: int = 64) -> KVPool:
    pool = KVPool(pages * 2 * BS * 8 * 4, BS, head_dim_max=8)
    pool.add_model("a", num_layers=3, kv_heads=2, head_dim=8)
    pool.add_model("b", num_layers=2, kv_heads=1, head_dim=4)
    return pool


def test_pages_per_token_block_and_views() -> None:
    pool = make_pool()
    assert pool.num_pages == 64
    assert pool.pages_per_token_block("a") == 6
    assert pool.kv("a").shape == (64, 2, BS, 8)
    assert pool.kv("b").shape == (64, 2, BS, 4)
    pool.open(1, "a")
    pool.grow(1, 5)  # 2 token-blocks x 3 layers x 2 heads
    assert pool.num_free == 64 - 12
    assert pool.table(1).shape == (2, 3, 2)
    pool.check_integrity()
    assert pool.free(1) == 12 and pool.num_free == 64


def test_grow_is_check_commit() -> None:
    pool = make_pool(10)
    pool.open(1, "a")
    assert not pool.can_grow(1, 2 * BS)  # needs 12 pages
    with pytest.raises(PoolFull):
        pool.grow(1, 2 * BS)
    assert pool.num_free == 10 and pool.token_blocks(1) == 0
    pool.check_integrity()


def test_layers_subset_and_drop() -> None:
    pool = make_pool()
    pool.open(1, "a", layers=range(1, 3))
    pool.grow(1, BS)
    t = pool.table(1)
    assert (t[:, 0] == -1).all() and (t[:, 1:] >= 0).all()
    assert pool.drop_layers(1, [2]) == 2
    assert pool.layers(1) == (1,)
    pool.check_integrity()


def test_weights_evacuate_kv_and_keep_data() -> None:
    pool = make_pool(16)
    kv = pool.kv("a")
    pool.open(1, "a")
    pool.grow(1, BS)  # 6 pages, lowest ids 0..5
    for p in pool.table(1).flatten().tolist():
        kv[p].fill_(float(p) + 0.5)
    before = {i: float(kv[p, 0, 0, 0]) for i, p in enumerate(pool.table(1).flatten().tolist())}
    # a region of 10 pages can only fit by moving some KV pages
    flat = pool.alloc_weights("w", 10 * pool.page_elems)
    flat.fill_(-1.0)
    pool.check_integrity()
    after = {i: float(kv[p, 0, 0, 0]) for i, p in enumerate(pool.table(1).flatten().tolist())}
    assert before == after
    assert pool.num_free == 0
    assert pool.free_weights("w") == 10
    pool.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5), st.integers(1, 30)), max_size=60))
def test_random_operations_keep_integrity(ops: list[tuple[int, int, int]]) -> None:
    pool = make_pool(48)
    reservations = []
    weights: list[str] = []
    next_id = 0
    next_key = 0
    for op, who, n in ops:
        live = sorted(r for r in range(next_id) if pool.has(r))
        if op == 0:
            pool.open(next_id, "ab"[who % 2], None if who < 3 else range(who % 2, 2))
            next_id += 1
        elif op == 1 and live:
            rid = live[who % len(live)]
            want = pool.capacity_tokens(rid) + n
            if pool.can_grow(rid, want):
                pool.grow(rid, want)
            else:
                free = pool.num_free
                with pytest.raises(PoolFull):
                    pool.grow(rid, want)
                assert pool.num_free == free
        elif op == 2 and live:
            pool.free(live[who % len(live)])
        elif op == 3 and live:
            rid = live[who % len(live)]
            pool.truncate(rid, max(0, pool.capacity_tokens(rid) - n))
        elif op == 4:
            if pool.can_reserve(n % 10):
                reservations.append(pool.reserve(n % 10))
        elif op == 5 and reservations:
            res = reservations.pop(who % len(reservations))
            if who % 2:
                pool.release(res)
            else:
                ntok = BS * (len(res.pages) // 6)
                if ntok:
                    pool.adopt(res, next_id, "a", range(3), ntok)
                    next_id += 1
                else:
                    pool.release(res)
        elif op == 6:
            numel = n * pool.page_elems // 3
            key = f"w{next_key}"
            next_key += 1
            if pool.can_alloc_weights(numel):
                try:
                    pool.alloc_weights(key, numel)
                    weights.append(key)
                except PoolFull:
                    pass  # free pages exist but no window avoids other weights
        elif op == 7 and weights:
            pool.free_weights(weights.pop(who % len(weights)))
        pool.check_integrity()
        u = pool.usage()
        assert u["free"] + u["kv"] + u["weights"] + u["reserved"] == u["pages"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=50))
def test_every_take_hands_out_the_lowest_free_pages(ops: list[tuple[bool, int]]) -> None:
    """Small takes pop the heap, large ones (n >= pages / 256) scan the owner
    array: both give the lowest free pages, and the heap stays consistent."""
    pool = KVPool(1024 * 2 * BS * 8 * 4, BS, head_dim_max=8)
    pool.add_model("a", num_layers=3, kv_heads=2, head_dim=8)
    assert pool.num_pages == 1024  # threshold: 4 pages
    held = []
    for take, n in ops:
        if take and pool.can_reserve(n):
            free = sorted(set(range(pool.num_pages)) - {p for r in held for p in r.pages})
            res = pool.reserve(n)
            assert res.pages == free[:n]
            held.append(res)
        elif held:
            pool.release(held.pop(n % len(held)))
        pool.check_integrity()
