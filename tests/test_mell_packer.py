"""Mell's online scheduler (the packer): Fig. 10 operations, Theorem 1's
properties, Theorem 3's migration bound, constraint (2), and the 4/3 ratio."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.policy.mell.packer import EMPTY, L, M, MellPacker, S, T, X, size_class

C = 96


def test_size_classes_follow_the_paper_boundaries() -> None:
    # L (C/2, C], M (C/3, C/2], S (C/4, C/3], T (C/8, C/4], tiny <= C/8
    assert [size_class(s, 96) for s in (96, 49, 48, 33, 32, 25, 24, 13, 12, 1)] == [
        L,
        L,
        M,
        M,
        S,
        S,
        T,
        T,
        X,
        X,
    ]


def test_l_request_opens_a_gpu_and_pulls_a_fitting_m() -> None:
    p = MellPacker(C)
    p.allocate(0, 40)  # M on GPU 0
    p.allocate(1, 40)  # second M joins GPU 0 (the latest M-GPU)
    assert p.where[0] is p.where[1]
    first = p.where[0].id
    res = p.allocate(2, 55)  # L: new GPU, pulls one M (55 + 40 <= 96)
    assert p.where[2].id != first
    assert res.item_moves == 1
    assert len(p.where[2].by[M]) == 1
    assert {p.where[0].id, p.where[1].id} == {first, p.where[2].id}


def test_tiny_and_t_requests_prefer_l_gpus_with_room() -> None:
    p = MellPacker(C)
    p.allocate(0, 60)  # L
    p.allocate(1, 20)  # T -> the L-GPU has room
    p.allocate(2, 5)  # tiny -> also there
    assert p.where[1] is p.where[0] is p.where[2]
    assert p.where[0].used == 85


def test_s_gpus_hold_three_and_m_gpus_two() -> None:
    p = MellPacker(C)
    for rid in range(3):
        p.allocate(rid, 30)  # S
    assert len({id(p.where[r]) for r in range(3)}) == 1
    p.allocate(3, 30)
    assert p.where[3] is not p.where[0]
    for rid in (10, 11):
        p.allocate(rid, 40)
    assert p.where[10] is p.where[11]


def test_depart_refills_a_non_latest_s_gpu_from_the_latest() -> None:
    p = MellPacker(C)
    for rid in range(5):
        p.allocate(rid, 30)  # GPU a: 0,1,2 ; GPU b: 3,4
    a = p.where[0]
    res = p.depart(1)
    assert res.item_moves == 1
    assert len(a.by[S]) == 3  # an S came over from the latest S-GPU
    assert p.violations() == []


def test_m_left_by_a_departed_l_goes_to_the_l_gpu_it_fits() -> None:
    # An L departs from the most recent GPU, leaving its M (40) behind; an
    # older M-GPU with one M must not refill from it while a lonely L-GPU
    # (L 50, not the most recent L-GPU) has room for it (property 4).
    p = MellPacker(C)
    for rid, s in ((0, 45), (1, 50), (2, 90), (3, 91), (4, 48), (5, 40), (6, 55)):
        p.allocate(rid, s)
    lonely = p.where[1]
    p.depart(0)  # GPU of L 50 loses its M; nothing in an S/M-GPU fits it
    assert not lonely.by[M] and p.violations() == []
    res = p.depart(6)
    assert p.where[5] is lonely and res.item_moves == 1
    assert p.violations() == []


def test_update_within_a_gpu_and_class_change() -> None:
    p = MellPacker(C)
    p.allocate(0, 60)
    p.allocate(1, 5)
    assert p.update(1, 12).moves == []  # still tiny
    assert p.update(1, 20).moves == []  # tiny -> T stays on its GPU
    assert p.cls[1] == T
    res = p.update(1, 30)  # T -> S: depart and re-allocate (60 + 30 fits: same GPU)
    assert p.cls[1] == S and res.moves == []


def test_l_growth_overflow_reallocates_the_others() -> None:
    p = MellPacker(C)
    p.allocate(0, 55)
    p.allocate(1, 40)  # M joins the L-GPU (55 + 40 <= 96)
    assert p.where[1] is p.where[0]
    res = p.update(0, 70)  # 70 + 40 > 96: the M leaves
    assert p.where[1] is not p.where[0]
    assert [(m.rid, m.dst) for m in res.moves] == [(1, p.where[1].id)]
    assert all(b.used <= C for b in p.bins.values())


def test_empty_gpus_are_released_and_sizes_validated() -> None:
    p = MellPacker(C)
    p.allocate(0, 10)
    p.depart(0)
    assert p.bins == {}
    with pytest.raises(ValueError):
        p.allocate(1, C + 1)
    with pytest.raises(ValueError):
        p.allocate(1, 0)
    with pytest.raises(ValueError):
        MellPacker(4)


# --------------------------------------------------------------- property tests
OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "alloc", "depart", "grow", "grow"]),
        st.integers(0, 10**6),
        st.integers(1, C),
        st.booleans(),
    ),
    min_size=1,
    max_size=120,
)


def _stream(p: MellPacker, ops: list[tuple[str, int, int, bool]], after_op) -> None:  # type: ignore[no-untyped-def]
    """Run an arbitrary arrival / growth / departure stream through ``p``,
    calling ``after_op(kind, result)`` after every operation. Sizes in
    ``ops`` are for ``C``; they are scaled to ``p.C``."""
    live: list[int] = []
    nid = 0
    cap = p.C
    for kind, pick, size, small in ops:
        size = max(1, size * cap // C)
        if kind == "alloc" or not live:
            s = max(1, size // 6) if small else size
            res = p.allocate(nid, s)
            live.append(nid)
            nid += 1
        elif kind == "depart":
            rid = live.pop(pick % len(live))
            res = p.depart(rid)
        else:
            rid = live[pick % len(live)]
            grow = max(1, size // 4) if small else max(1, size // 2)
            res = p.update(rid, min(cap, p.size[rid] + grow))
        after_op(kind, res)
    assert set(p.where) == set(live)


def _theorem_checks(p: MellPacker, res) -> None:  # type: ignore[no-untyped-def]
    """After one operation: bookkeeping, constraint (2), Theorem 1 with four
    exceptions, and Theorem 3's ten item moves."""
    p.check()
    assert all(b.used <= p.C for b in p.bins.values())
    _no_violations(p)
    assert res.item_moves <= 10, res


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_memory_constraint_and_bookkeeping_after_every_operation(ops) -> None:  # type: ignore[no-untyped-def]
    """Constraint (2) at every instant, indexes consistent, and the reported
    moves are exactly what happened (replaying them gives the allocation)."""
    p = MellPacker(C)
    shadow: dict[int, int] = {}

    def after(kind: str, res) -> None:  # type: ignore[no-untyped-def]
        p.check()
        assert all(b.used <= C for b in p.bins.values())
        assert all(b.cat != EMPTY for b in p.bins.values())
        for mv in res.moves:
            if mv.src is None:
                assert mv.rid not in shadow
            else:
                assert shadow[mv.rid] == mv.src
            shadow[mv.rid] = mv.dst
        for rid in [r for r in shadow if r not in p.where]:
            del shadow[rid]  # departed
        assert shadow == {r: b.id for r, b in p.where.items()}

    _stream(p, ops, after)


@settings(max_examples=2500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_theorem1_properties_and_at_most_ten_migrations_per_operation(ops) -> None:  # type: ignore[no-untyped-def]
    """Theorem 1, checked after every operation on every GPU except the most
    recently activated GPU of each category (the constant: 4); and Theorem 3:
    an operation causes at most 10 migrations (a multi-item of tiny requests
    moving together counts as one). Both on each of the 2500 streams (running
    the streams, not the checks, is what takes the time)."""
    p = MellPacker(C)

    def after(kind: str, res) -> None:  # type: ignore[no-untyped-def]
        _no_violations(p)
        assert res.item_moves <= 10, (kind, res)

    _stream(p, ops, after)


def _no_violations(p: MellPacker) -> None:
    v = p.violations()
    assert not v, v


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([64, 97, 780]), OPS)
def test_theorems_hold_at_other_capacities(cap: int, ops) -> None:  # type: ignore[no-untyped-def]
    """The same checks at capacities with other divisibility (C/8, C/3, ...)."""
    p = MellPacker(cap)
    _stream(p, ops, lambda kind, res: _theorem_checks(p, res))


def _random_stream(seed: int, cap: int, steps: int = 400) -> None:
    """A long random stream (40 % arrivals, 30 % of them of any size, else
    up to C/6; 20 % departures; 40 % growth by up to C/4), checked after
    every operation."""
    rng = random.Random(seed)
    p = MellPacker(cap)
    live: dict[int, int] = {}
    nid = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.4 or not live:
            s = rng.randint(1, cap) if rng.random() < 0.3 else rng.randint(1, cap // 6)
            res = p.allocate(nid, s)
            live[nid] = s
            nid += 1
        elif op < 0.6:
            rid = rng.choice(sorted(live))
            res = p.depart(rid)
            del live[rid]
        else:
            rid = rng.choice(sorted(live))
            live[rid] = min(cap, live[rid] + rng.randint(1, cap // 4))
            res = p.update(rid, live[rid])
        _theorem_checks(p, res)


@pytest.mark.parametrize("seed", [281, 536, 1582, 1646, 1708, 1760])
def test_streams_that_broke_the_properties_or_the_move_bound(seed: int) -> None:
    """Regression: random streams at C = 96 that once had an operation with
    11-13 item moves (a T-unit bouncing between GPUs as S/M-requests moved,
    a whole L-GPU re-allocated for a tiny request's growth) or a property-4
    violation (an M left by a departed L refilled an M-GPU instead of going
    to the L-GPU it fits)."""
    _random_stream(seed, C)


def _opt_bins(sizes: list[int], cap: int) -> int:
    """Optimal bin packing by exhaustive search (small instances only)."""
    items = sorted(sizes, reverse=True)

    @functools.cache
    def solve(i: int, loads: tuple[int, ...]) -> int:
        if i == len(items):
            return len(loads)
        best = 10**9
        seen = set()
        for k, load in enumerate(loads):
            if load + items[i] <= cap and load not in seen:
                seen.add(load)
                nl = tuple(sorted((*loads[:k], load + items[i], *loads[k + 1 :])))
                best = min(best, solve(i + 1, nl))
        best = min(best, solve(i + 1, tuple(sorted((*loads, items[i])))))
        return best

    return solve(0, ())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS.map(lambda ops: ops[:40]))
def test_gpus_within_four_thirds_of_optimal_plus_constant(ops) -> None:  # type: ignore[no-untyped-def]
    """Theorem 2 with Theorem 1's exceptions: GPUs <= 4/3 OPT + 4, where OPT
    is the optimal packing of the current sizes (brute force, <= 10 requests)."""
    p = MellPacker(C)

    def after(kind: str, res) -> None:  # type: ignore[no-untyped-def]
        sizes = list(p.size.values())
        if 0 < len(sizes) <= 10:
            opt = _opt_bins(sizes, C)
            assert len(p.bins) <= 4 * opt / 3 + 4, (len(p.bins), opt, sizes)

    _stream(p, ops, after)


def test_needs_update_on_class_change_or_overflow_only() -> None:
    p = MellPacker(96)
    p.allocate(0, 60)  # L, a new GPU
    p.allocate(1, 20)  # T, onto that L-GPU (it has room)
    assert p.where[1] is p.where[0]
    assert not p.needs_update(1, 24)  # still T, 84 <= 96
    assert p.needs_update(1, 25)  # 4 * 25 > 96: becomes S
    assert not p.needs_update(0, 76)  # still L, 96 <= 96
    assert p.needs_update(0, 77)  # still L, but 97 > 96 overflows
