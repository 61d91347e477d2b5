"""KunServe drop policy (fleetserve.policy.kunserve): buddy groups, trigger, re-balance."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fleetserve.errors import ConfigError
from fleetserve.policy.actions import ActivateSpare, DropLayers, Restore
from fleetserve.policy.kunserve import (
    BuddyPlan,
    DemandMonitor,
    ExecutorLoad,
    ExecutorSnapshot,
    KunServePolicy,
    check_one_copy,
    freed_bytes,
    layers_held,
    max_batch,
    memory_greedy,
    plan_drop,
    rebalance,
    rebalance_may_move,
    should_restore,
    singletons,
    split_layers,
    throughput_greedy,
)

GiB = 2**30
P = 28 * GiB  # one replica's layer parameters (e.g. a 14B model in fp16)
FAST = settings(max_examples=150, deadline=None)


@st.composite
def partitions(draw: st.DrawFn, max_n: int = 64) -> list[list[int]]:
    """A random partition of instance ids 0..n-1 into groups."""
    n = draw(st.integers(1, max_n))
    ids = draw(st.permutations(range(n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    return [list(ids[a:b]) for a, b in itertools.pairwise(bounds)]


def instance_count(groups: list[list[int]]) -> int:
    return sum(len(g) for g in groups)


param_bytes = st.integers(0, 64 * GiB)
req_bytes = st.integers(0, 4096 * GiB)


# ---------------------------------------------------------------- split_layers


def test_split_layers_examples() -> None:
    assert split_layers(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_layers(80, 1) == [(0, 80)]
    assert split_layers(5, 5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert split_layers(7, 2) == [(0, 4), (4, 7)]


@FAST
@given(st.integers(1, 200), st.data())
def test_split_layers_cover_contiguous_balanced(num_layers: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, num_layers))
    ranges = split_layers(num_layers, k)
    assert len(ranges) == k
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert hi == lo
    sizes = [hi - lo for lo, hi in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier stages get the extra layers


@pytest.mark.parametrize(("layers", "k"), [(0, 1), (4, 0), (4, 5), (-1, 1), (4, 1.5)])
def test_split_layers_rejects(layers: int, k: int) -> None:
    with pytest.raises(ConfigError):
        split_layers(layers, k)


# ---------------------------------------------------------------- paper example


def test_paper_example_eight_instances() -> None:
    start = singletons(range(8))
    four = throughput_greedy(start, P, 4 * P)
    assert four.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert four.freed_bytes == 4 * P and four.met
    assert four.strategy == "throughput-greedy"
    eight = throughput_greedy(start, P, 7 * P)
    assert eight.groups == (tuple(range(8)),)
    assert eight.freed_bytes == 7 * P and eight.met
    assert eight.freed_bytes / four.freed_bytes == pytest.approx(1.75)
    assert freed_bytes(four.groups, P) == 4 * P
    assert freed_bytes(eight.groups, P) == 7 * P


def test_paper_example_unmet_and_zero_requirement() -> None:
    start = singletons(range(8))
    assert throughput_greedy(start, P, 0).groups == start
    unmet = throughput_greedy(start, P, 8 * P)
    assert not unmet.met and unmet.sizes == (8,)
    # R just above 4P needs a fifth merge: the smallest two groups then are 2 and 2.
    five = throughput_greedy(start, P, 4 * P + 1)
    assert sorted(five.sizes) == [2, 2, 4] and five.freed_bytes == 5 * P


def test_memory_greedy_grows_one_group() -> None:
    start = singletons(range(8))
    plan = memory_greedy(start, P, 2 * P, 3 * P)
    assert plan.groups == ((0, 1, 2, 3), (4,), (5,), (6,), (7,))
    assert plan.freed_bytes == 3 * P and plan.met and plan.strategy == "memory-greedy"
    # The KV region above R sets the target; R above the region sets it instead.
    assert memory_greedy(start, P, 5 * P, 1 * P).freed_bytes == 5 * P
    assert memory_greedy(start, P, 0, 0).groups == start
    unmet = memory_greedy(start, P, 9 * P, 0)
    assert not unmet.met and unmet.sizes == (8,)


def test_second_throttle_merges_current_groups() -> None:
    current = [[0, 1], [2, 3], [4], [5], [6], [7]]
    assert freed_bytes(current, P) == 2 * P
    plan = throughput_greedy(current, P, 3 * P)
    assert plan.groups == ((0, 1), (2, 3), (4, 5), (6,), (7,))
    assert plan.merges_from(current) == [(4, 5)]
    plan = throughput_greedy(current, P, 4 * P)
    assert plan.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    # The next merge joins the two smallest (ties: lowest smallest id): (0,1) and (2,3).
    plan = throughput_greedy(current, P, 5 * P)
    assert plan.groups == ((0, 1, 2, 3), (4, 5), (6, 7))
    assert plan.merges_from(current) == [(0, 1, 2, 3), (4, 5), (6, 7)]


def test_max_group_size_caps_pipelines() -> None:
    start = singletons(range(8))
    plan = throughput_greedy(start, P, 7 * P, max_group_size=4)
    assert plan.sizes == (4, 4) and not plan.met and plan.freed_bytes == 6 * P
    plan = memory_greedy(start, P, 0, 7 * P, max_group_size=3)
    assert plan.groups == ((0, 1, 2), (3, 4, 5), (6, 7))
    with pytest.raises(ConfigError, match="max_group_size"):
        throughput_greedy([[0, 1, 2]], P, P, max_group_size=2)


# ---------------------------------------------------------------- plan helpers


def test_plan_accessors() -> None:
    plan = throughput_greedy(singletons([3, 9, 4, 1, 7]), P, 2 * P)
    assert plan.groups == ((1, 3), (4, 7), (9,))
    assert plan.sizes == (2, 2, 1) and plan.max_size == 2
    assert plan.instances == (1, 3, 4, 7, 9)
    assert plan.group_of(7) == (4, 7) and plan.group_of(9) == (9,)
    with pytest.raises(ConfigError, match="no group"):
        plan.group_of(2)
    assert plan.assignment(5) == {1: (0, 3), 3: (3, 5), 4: (0, 3), 7: (3, 5), 9: (0, 5)}
    assert layers_held(plan, 5) == {1: 3, 3: 2, 4: 3, 7: 2, 9: 5}
    check_one_copy(plan, 5)
    assert plan.merges_from([[1], [3], [4], [9], [7]]) == [(1, 3), (4, 7)]
    assert plan.merges_from([[3, 1], [4, 7], [9]]) == []
    assert plan.merges_from([]) == [(1, 3), (4, 7), (9,)]


def test_check_one_copy_rejects_too_deep_group() -> None:
    plan = throughput_greedy(singletons(range(4)), P, 3 * P)
    check_one_copy(plan, 4)
    with pytest.raises(AssertionError, match="stages"):
        check_one_copy(plan, 3)
    with pytest.raises(ConfigError):
        plan.assignment(3)


@pytest.mark.parametrize(
    ("groups", "p", "r", "match"),
    [
        ([[0], [1]], -1, 0, "param_bytes"),
        ([[0], [1]], 1, -5, "required_bytes"),
        ([[0], [1]], 1.5, 0, "integer number of bytes"),
        ([], 1, 0, "no groups"),
        ([[0], []], 1, 0, "empty"),
        ([[0, 1], [1]], 1, 0, "more than once"),
        ([[0, "a"]], 1, 0, "integer"),
    ],
)
def test_strategies_reject_bad_arguments(
    groups: list[list[int]], p: int, r: int, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        throughput_greedy(groups, p, r)
    with pytest.raises(ConfigError, match=match):
        memory_greedy(groups, p, r, 0)


def test_plan_drop_dispatch_and_errors() -> None:
    start = singletons(range(8))
    assert plan_drop("throughput", start, P, 4 * P, 6 * P) == throughput_greedy(start, P, 4 * P)
    assert plan_drop("memory", start, P, 4 * P, 6 * P) == memory_greedy(start, P, 4 * P, 6 * P)
    assert plan_drop("Memory-Greedy", start, P, 0, P).strategy == "memory-greedy"
    with pytest.raises(ConfigError, match="unknown KunServe drop strategy"):
        plan_drop("optimal", start, P, 0, 0)
    with pytest.raises(ConfigError, match="kv_region_bytes"):
        plan_drop("throughput", start, P, 0, -1)
    with pytest.raises(ConfigError, match="param_bytes"):
        freed_bytes(start, -1)


def test_buddy_plan_validates() -> None:
    with pytest.raises(ConfigError, match="stage order"):
        BuddyPlan(((1, 0),), P, 0, True, "x")
    with pytest.raises(ConfigError, match="met"):
        BuddyPlan(((0, 1),), P, 2 * P, True, "x")
    with pytest.raises(ConfigError, match="more than once"):
        BuddyPlan(((0, 1), (1,)), P, 0, True, "x")


# ---------------------------------------------------------------- plan properties


@FAST
@given(partitions(), param_bytes, req_bytes, req_bytes, st.integers(1, 128), st.booleans())
def test_one_copy_invariant_for_every_plan(
    groups: list[list[int]], p: int, r: int, kv: int, num_layers: int, memory: bool
) -> None:
    cap = max(num_layers, max(len(g) for g in groups))
    strategy = "memory" if memory else "throughput"
    plan = plan_drop(strategy, groups, p, r, kv, max_group_size=cap)
    assert plan.instances == tuple(range(instance_count(groups)))
    assert plan.max_size <= cap
    assert plan.freed_bytes == freed_bytes(plan.groups, p)
    assert plan.met == (plan.freed_bytes >= r)
    target = max(r, kv) if memory else r
    if plan.freed_bytes < target and len(plan.groups) > 1:  # stopped by the cap only
        smallest = sorted(plan.sizes)
        assert smallest[0] + smallest[1] > cap
    if cap == num_layers:
        check_one_copy(plan, num_layers)
        held = layers_held(plan, num_layers)
        for group in plan.groups:
            assert sum(held[iid] for iid in group) == num_layers


@FAST
@given(partitions(), param_bytes, req_bytes)
def test_throughput_greedy_minimal_and_met_iff(groups: list[list[int]], p: int, r: int) -> None:
    plan = throughput_greedy(groups, p, r)
    n = instance_count(groups)
    assert plan.met == (plan.freed_bytes >= r)
    assert plan.freed_bytes == (n - len(plan.groups)) * p
    if not plan.met:
        assert plan.sizes == (n,)
    merges = len(groups) - len(plan.groups)
    if merges > 0:  # one merge fewer would not meet R
        assert plan.freed_bytes - p < r


@FAST
@given(st.integers(1, 64), param_bytes, req_bytes)
def test_throughput_greedy_from_singletons_balanced(n: int, p: int, r: int) -> None:
    plan = throughput_greedy(singletons(range(n)), p, r)
    assert max(plan.sizes) <= 2 * min(plan.sizes)


@FAST
@given(partitions(), param_bytes, req_bytes, req_bytes)
def test_memory_greedy_frees_at_least_throughput(
    groups: list[list[int]], p: int, r: int, kv: int
) -> None:
    mem = memory_greedy(groups, p, r, kv)
    thr = throughput_greedy(groups, p, r)
    assert mem.freed_bytes >= thr.freed_bytes
    assert mem.met == thr.met  # both stop only at R (or beyond) or at one group
    target = max(r, kv)
    assert mem.freed_bytes >= target or mem.sizes == (instance_count(groups),)
    merges = len(groups) - len(mem.groups)
    if merges > 0:
        assert mem.freed_bytes - p < target


@FAST
@given(st.integers(1, 64), st.integers(1, 64), param_bytes, req_bytes, req_bytes)
def test_memory_greedy_frees_at_least_throughput_capped_from_singletons(
    n: int, cap: int, p: int, r: int, kv: int
) -> None:
    start = singletons(range(n))
    mem = memory_greedy(start, p, r, kv, max_group_size=cap)
    thr = throughput_greedy(start, p, r, max_group_size=cap)
    assert mem.freed_bytes >= thr.freed_bytes


@FAST
@given(partitions(), param_bytes, req_bytes, req_bytes, st.integers(0, 8), st.booleans())
def test_existing_groups_never_split(
    groups: list[list[int]], p: int, r: int, kv: int, slack: int, memory: bool
) -> None:
    cap = max(len(g) for g in groups) + slack
    for max_size in (None, cap):
        if memory:
            plan = memory_greedy(groups, p, r, kv, max_group_size=max_size)
        else:
            plan = throughput_greedy(groups, p, r, max_group_size=max_size)
        for group in groups:
            assert set(group) <= set(plan.group_of(group[0]))
        new = plan.merges_from(groups)
        originals = {frozenset(g) for g in groups}
        for merged in plan.groups:
            if merged in new:  # a union of at least two original groups
                assert sum(1 for g in originals if g <= set(merged)) >= 2
            else:
                assert frozenset(merged) in originals


# ---------------------------------------------------------------- monitor


@FAST
@given(
    st.floats(-1e9, 1e9),
    st.floats(-1e9, 1e9),
    st.floats(0.01, 0.3),
    st.integers(2, 30),
)
def test_monitor_slope_of_linear_inputs(d_rate: float, c_rate: float, dt: float, n: int) -> None:
    mon = DemandMonitor(window_s=1.0)
    d0, c0 = 1e11, 1e11
    for i in range(n):
        t = 100.0 + i * dt
        mon.observe(7, t, d0 + d_rate * i * dt, c0 + c_rate * i * dt)
    got_d, got_c = mon.rates(7)
    assert got_d == pytest.approx(d_rate, rel=1e-6, abs=1e-2)
    assert got_c == pytest.approx(c_rate, rel=1e-6, abs=1e-2)
    last = n - 1
    pd, pc = mon.predict(7, 0.5)
    assert pd == pytest.approx(d0 + d_rate * (last * dt + 0.5), rel=1e-9, abs=10.0)
    assert pc == pytest.approx(c0 + c_rate * (last * dt + 0.5), rel=1e-9, abs=10.0)


def test_monitor_window_eviction_keeps_two_latest() -> None:
    mon = DemandMonitor(window_s=1.0)
    for i in range(11):
        mon.observe(1, i * 0.25, 100.0 * i, 1000.0)
    times = [s[0] for s in mon.samples(1)]
    assert times == [1.5, 1.75, 2.0, 2.25, 2.5]  # a sample at exactly now - window is kept
    # A slow sampler: samples 10 s apart still give a rate from the two latest.
    slow = DemandMonitor(window_s=1.0)
    for i in range(4):
        slow.observe(2, 10.0 * i, 50.0 * i, 0.0)
    assert [s[0] for s in slow.samples(2)] == [20.0, 30.0]
    assert slow.rates(2) == pytest.approx((5.0, 0.0))


def test_monitor_forgets_old_slope() -> None:
    mon = DemandMonitor(window_s=1.0)
    for i in range(10):  # falling demand
        mon.observe(0, 0.1 * i, 1000.0 - 100.0 * i, 2000.0)
    for i in range(1, 21):  # then rising for 2 s
        mon.observe(0, 0.9 + 0.1 * i, 100.0 + 50.0 * i, 2000.0)
    assert mon.rates(0)[0] == pytest.approx(500.0)


def test_monitor_throttled_cases() -> None:
    mon = DemandMonitor()
    mon.observe(0, 0.0, 50.0, 100.0)
    assert not mon.throttled(0) and mon.required_bytes(0) == 0.0
    assert mon.predict(0) == (50.0, 100.0)  # one sample: rates are 0
    mon.observe(0, 0.5, 80.0, 100.0)  # +60/s: predicted 140 > 100 in 1 s
    assert mon.throttled(0)
    assert mon.required_bytes(0) == pytest.approx(40.0)
    assert not mon.throttled(0, horizon_s=0.25)  # 95 <= 100
    assert mon.required_bytes(0, horizon_s=0.25) == 0.0
    # Already over capacity but falling: throttled now, current shortfall counts.
    mon.observe(1, 0.0, 300.0, 100.0)
    mon.observe(1, 1.0, 200.0, 100.0)
    assert mon.throttled(1) and mon.required_bytes(1) == pytest.approx(100.0)
    # Capacity shrinking (-60/s) under a flat demand: 50 > 70 - 60 in 1 s.
    mon.observe(2, 0.0, 50.0, 100.0)
    mon.observe(2, 0.5, 50.0, 70.0)
    assert mon.throttled(2) and mon.required_bytes(2) == pytest.approx(40.0)
    # Equal times: no rate.
    mon.observe(3, 1.0, 10.0, 100.0)
    mon.observe(3, 1.0, 90.0, 100.0)
    assert mon.rates(3) == (0.0, 0.0) and not mon.throttled(3)
    mon.forget(0)
    mon.forget(42)  # unknown: no-op
    with pytest.raises(ConfigError, match="no samples"):
        mon.predict(0)


def test_monitor_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        DemandMonitor(window_s=0.0)
    with pytest.raises(ConfigError):
        DemandMonitor(horizon_s=-1.0)
    mon = DemandMonitor()
    mon.observe(0, 5.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="before"):
        mon.observe(0, 4.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="demand_bytes"):
        mon.observe(0, 6.0, -1.0, 1.0)
    with pytest.raises(ConfigError, match="finite"):
        mon.observe(0, math.nan, 1.0, 1.0)


def test_should_restore() -> None:
    assert should_restore(40.0, 100.0, 0.5)
    assert should_restore(50.0, 100.0, 0.5)
    assert not should_restore(51.0, 100.0, 0.5)
    assert should_restore(100.0, 100.0, 1.0)
    assert should_restore(30.0, 100.0)  # default threshold 0.5
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="threshold"):
            should_restore(1.0, 1.0, bad)
    with pytest.raises(ConfigError):
        should_restore(-1.0, 1.0, 0.5)


# ---------------------------------------------------------------- max_batch


@FAST
@given(
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=300),
    st.floats(1.0, 5.0),
)
def test_max_batch_matches_brute_force(steps: list[float], slowdown: float) -> None:
    times = [1e-3 + s for s in _cumsum(steps)]  # non-decreasing decode times
    calls: list[int] = []

    def decode_time(b: int) -> float:
        calls.append(b)
        return times[b - 1]

    limit = len(times)
    want = max(b for b in range(1, limit + 1) if times[b - 1] <= slowdown * times[0])
    assert max_batch(decode_time, limit, slowdown) == want
    assert len(calls) <= 2 + math.ceil(math.log2(limit + 1))


def _cumsum(xs: list[float]) -> list[float]:
    out, total = [], 0.0
    for x in xs:
        total += x
        out.append(total)
    return out


def test_max_batch_examples_and_errors() -> None:
    assert max_batch(lambda b: 10.0 + b, 100) == 12  # 10 + b <= 2 * 11
    assert max_batch(lambda b: 10.0 + b, 5) == 5
    assert max_batch(lambda b: 1.0, 64, 1.0) == 64
    with pytest.raises(ConfigError, match="slowdown"):
        max_batch(lambda b: 1.0, 8, 0.5)
    with pytest.raises(ConfigError, match="limit"):
        max_batch(lambda b: 1.0, 0)
    with pytest.raises(ConfigError, match="decode_time"):
        max_batch(lambda b: math.inf, 4)


# ---------------------------------------------------------------- rebalance


@FAST
@given(
    st.lists(
        st.tuples(
            st.integers(0, 12),  # running
            st.lists(st.integers(0, 5000), max_size=10),  # waiting requests' tokens
            st.integers(1, 12),  # max batch
            st.integers(0, 20000),  # free tokens
        ),
        max_size=6,
    )
)
def test_rebalance_moves_nothing_when_the_counts_say_so(
    execs: list[tuple[int, list[int], int, int]],
) -> None:
    """The backend's fast path: when no executor is overflowed while another is
    spare (counts only), the full rebalance moves nothing."""
    ids = itertools.count()
    loads = [
        ExecutorLoad(k, running, tuple(next(ids) for _ in toks), batch, free, tuple(toks))
        for k, (running, toks, batch, free) in enumerate(execs)
    ]
    counts = [(ld.running, len(ld.waiting), ld.max_batch) for ld in loads]
    moves = rebalance(loads)
    if not rebalance_may_move(counts):
        assert moves == []
    if moves:
        assert rebalance_may_move(counts)


def test_rebalance_example() -> None:
    loads = [
        ExecutorLoad(0, running=4, waiting=(10, 11, 12), max_batch=5, free_tokens=0,
                     waiting_tokens=(100, 200, 300)),
        ExecutorLoad(1, running=1, waiting=(), max_batch=4, free_tokens=1000,
                     waiting_tokens=()),
        ExecutorLoad(2, running=0, waiting=(20,), max_batch=4, free_tokens=2500,
                     waiting_tokens=(50,)),
        ExecutorLoad(3, running=6, waiting=(30,), max_batch=4, free_tokens=900,
                     waiting_tokens=(400,)),
    ]  # fmt: skip
    # Overflow: 0 keeps 10 (one slot), moves 11, 12; 3 is over its batch, moves 30.
    # Spare: 1 (3 slots, 1000 tokens), 2 (3 slots, 2500 tokens). 11: tie on slots -> key 1;
    # 12: key 2 has more slots left; 30: tie again (2 and 2) -> key 1.
    assert rebalance(loads) == [(11, 0, 1), (12, 0, 2), (30, 3, 1)]
    # With too few tokens on key 2, 12 goes to key 1 and 30 no longer fits anywhere.
    loads[1] = ExecutorLoad(1, 1, (), 4, 600, ())
    loads[2] = ExecutorLoad(2, 0, (20,), 4, 250, (50,))
    assert rebalance(loads) == [(11, 0, 1), (12, 0, 1)]


def test_rebalance_unplaceable_stays_and_errors() -> None:
    full = ExecutorLoad(0, 2, (1, 2), 2, 0, (5, 5))
    small = ExecutorLoad(1, 0, (), 2, 4, ())
    assert rebalance([full, small]) == []
    assert rebalance([]) == []
    with pytest.raises(ConfigError, match="twice in the loads"):
        rebalance([small, small])
    with pytest.raises(ConfigError, match="more than one executor"):
        rebalance([full, ExecutorLoad(1, 0, (2,), 2, 4, (1,))])
    with pytest.raises(ConfigError, match="waiting_tokens"):
        ExecutorLoad(0, 0, (1, 2), 2, 0, (5,))
    with pytest.raises(ConfigError, match="max_batch"):
        ExecutorLoad(0, 0, (), 0, 0, ())
    with pytest.raises(ConfigError, match="free_tokens"):
        ExecutorLoad(0, 0, (), 1, -1, ())


@st.composite
def executor_loads(draw: st.DrawFn) -> list[ExecutorLoad]:
    n = draw(st.integers(0, 12))
    keys = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n, unique=True))
    next_rid = 0
    loads = []
    for key in keys:
        queued = draw(st.integers(0, 10))
        rids = tuple(range(next_rid, next_rid + queued))
        next_rid += queued
        tokens = tuple(draw(st.lists(st.integers(0, 500), min_size=queued, max_size=queued)))
        loads.append(
            ExecutorLoad(
                key,
                running=draw(st.integers(0, 12)),
                waiting=rids,
                max_batch=draw(st.integers(1, 12)),
                free_tokens=draw(st.integers(0, 3000)),
                waiting_tokens=tokens,
            )
        )
    return loads


@FAST
@given(executor_loads())
def test_rebalance_properties(loads: list[ExecutorLoad]) -> None:
    moves = rebalance(loads)
    by_key = {load.key: load for load in loads}
    overflow: dict[int, tuple[int, int]] = {}  # rid -> (from key, tokens)
    for load in loads:
        for rid, tok in zip(
            load.waiting[load.slots :], load.waiting_tokens[load.slots :], strict=True
        ):
            overflow[rid] = (load.key, tok)
    moved = [rid for rid, _, _ in moves]
    assert len(moved) == len(set(moved))
    slots_used: Counter[int] = Counter()
    tokens_used: Counter[int] = Counter()
    for rid, src, dst in moves:
        assert rid in overflow and overflow[rid][0] == src  # only overflow, from its executor
        assert src != dst
        slots_used[dst] += 1
        tokens_used[dst] += overflow[rid][1]
    slots_left: dict[int, int] = {}
    tokens_left: dict[int, int] = {}
    for load in loads:
        spare = load.max_batch - load.running - len(load.waiting)
        if slots_used[load.key]:
            assert spare >= slots_used[load.key]
            assert load.free_tokens >= tokens_used[load.key]
        if spare > 0:
            slots_left[load.key] = spare - slots_used[load.key]
            tokens_left[load.key] = load.free_tokens - tokens_used[load.key]
    # Conservation: applying the moves keeps every request exactly once.
    queues = {load.key: list(load.waiting) for load in loads}
    for rid, src, dst in moves:
        queues[src].remove(rid)
        queues[dst].append(rid)
    after = sorted(rid for q in queues.values() for rid in q)
    assert after == sorted(rid for load in loads for rid in load.waiting)
    # Greedy completeness: an unmoved overflow request fits on no spare executor at the end.
    for rid, (_, tok) in overflow.items():
        if rid not in moved:
            assert all(slots_left[k] <= 0 or tokens_left[k] < tok for k in slots_left)
    assert set(by_key) == {load.key for load in loads}


# ---------------------------------------------------------------- policy object

LAYERS = 48
KVB = 196_608  # KV bytes of one token in every layer (Qwen-2.5-14B, bf16)
REPLICA_KV = 2_000 * KVB  # each instance's KV region as a replica: 2,000 tokens


def _policy(**kw: object) -> KunServePolicy:
    args: dict[str, object] = {
        "model": "m",
        "num_layers": LAYERS,
        "param_bytes": P,
        "kv_bytes_per_token": KVB,
        "restore_min_s": 5.0,
    }
    args.update(kw)
    return KunServePolicy(**args)  # type: ignore[arg-type]


def _view(
    key: int,
    members: tuple[int, ...],
    used: int,
    *,
    cap: int | None = None,
    queued: int = 0,
    held: tuple[tuple[int, int], ...] | None = None,
    accepting: bool = True,
    stable: bool = True,
) -> ExecutorSnapshot:
    """An executor of ``members`` holding ``used`` KV tokens (default layout:
    an even split, capacity growing by the dropped layers)."""
    held = held if held is not None else tuple(split_layers(LAYERS, len(members)))
    if cap is None:
        cap = 2_000 * LAYERS // max(hi - lo for lo, hi in held)
    return ExecutorSnapshot(
        key=key,
        members=members,
        held_layers=held,
        replica_kv_bytes=(REPLICA_KV,) * len(members),
        kv_used_tokens=used,
        kv_head_tokens=min(queued, 300),
        kv_queued_tokens=queued,
        kv_capacity_tokens=cap,
        accepting=accepting,
        stable=stable,
    )


def _check_drop(action: DropLayers, by_key: dict[int, ExecutorSnapshot]) -> None:
    """A DropLayers keeps one complete copy: its stages tile the layers, each
    member keeps a non-empty part of what it holds and drops the rest."""
    assert action.num_layers == LAYERS and action.model == "m"
    members = sorted(m for k in action.sources for m in by_key[k].members)
    assert sorted(action.members) == members
    assert len(action.members) == len(action.keep) == len(action.drop) >= 2
    held = {m: r for k in action.sources for m, r in zip(*_pairs(by_key[k]), strict=True)}
    count = [0] * LAYERS
    for m, (lo, hi), dropped in zip(action.members, action.keep, action.drop, strict=True):
        assert held[m][0] <= lo < hi <= held[m][1]
        for layer in range(lo, hi):
            count[layer] += 1
        kept = set(range(lo, hi))
        gone = {layer for a, b in dropped for layer in range(a, b)}
        assert kept.isdisjoint(gone)
        assert kept | gone == set(range(*held[m]))
    assert count == [1] * LAYERS
    assert all(by_key[k].stable for k in action.sources)


def _pairs(v: ExecutorSnapshot) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    return v.members, v.held_layers


def _grow(
    pol: KunServePolicy, views: list[ExecutorSnapshot], t0: float, rates: dict[int, float]
) -> list[ExecutorSnapshot]:
    """Observe ``views`` at ``t0 - 1``, ``t0 - 0.5`` and ``t0``, each key's
    KV in use growing at ``rates[key]`` tokens/s to its value at ``t0`` (from 0 at least)."""
    for dt in (1.0, 0.5, 0.0):
        now = t0 - dt
        pol.observe(
            now,
            [
                dataclasses.replace(
                    v, kv_used_tokens=max(0, round(v.kv_used_tokens - rates[v.key] * dt))
                )
                for v in views
            ],
        )
    return views


def test_policy_drops_when_growth_will_exceed_capacity_within_the_horizon() -> None:
    views = [_view(0, (0,), 1_700), _view(1, (1,), 400)]
    # 1,700 tokens growing 400/s: 2,100 > 2,000 one second ahead
    pol = _policy()
    _grow(pol, views, 10.0, {0: 400.0, 1: 0.0})
    (drop,) = pol.plan(10.0, views)
    assert isinstance(drop, DropLayers)
    assert drop.sources == (0, 1) and drop.members == (0, 1)
    assert drop.keep == ((0, 24), (24, 48)) and drop.drop == (((24, 48),), ((0, 24),))
    _check_drop(drop, {v.key: v for v in views})
    # growing 200/s: 1,900 <= 2,000 one second ahead; no drop ...
    pol = _policy()
    _grow(pol, views, 10.0, {0: 200.0, 1: 0.0})
    assert pol.plan(10.0, views) == []
    # ... but a 2-second look-ahead sees 2,100
    pol = _policy(horizon_s=2.0)
    _grow(pol, views, 10.0, {0: 200.0, 1: 0.0})
    assert [type(a) for a in pol.plan(10.0, views)] == [DropLayers]


def test_policy_requirement_covers_the_queue_and_merges_further() -> None:
    # a flat but deep queue: 5,000 tokens beyond capacity on each of 0..3 needs
    # more than one merge per pair; Algorithm 1 merges the smallest groups
    views = [_view(k, (k,), 1_900, queued=5_000) for k in range(4)]
    pol = _policy(param_bytes=4_000 * KVB)
    _grow(pol, views, 1.0, dict.fromkeys(range(4), 0.0))
    actions = pol.plan(1.0, views)
    assert [a.members for a in actions if isinstance(a, DropLayers)] == [(0, 1, 2, 3)]
    # a second throttle on two existing pairs keeps sub-ranges of what they hold
    pairs = [_view(0, (0, 1), 3_900, queued=2_000), _view(2, (2, 3), 3_900, queued=2_000)]
    pol = _policy()
    _grow(pol, pairs, 1.0, {0: 0.0, 2: 0.0})
    (drop,) = pol.plan(1.0, pairs)
    assert isinstance(drop, DropLayers)
    assert drop.members == (0, 2, 1, 3)
    assert drop.keep == ((0, 12), (12, 24), (24, 36), (36, 48))
    _check_drop(drop, {v.key: v for v in pairs})


def test_policy_falls_back_to_a_spare_and_skips_busy_executors() -> None:
    alone = [_view(0, (0,), 1_900, queued=3_000)]
    pol = _policy()
    _grow(pol, alone, 1.0, {0: 0.0})
    (spare,) = pol.plan(1.0, alone)
    assert spare == ActivateSpare("m", 2_900 * KVB)
    # told that no spare can start, a lone executor has nothing to plan
    assert pol.plan_drops(1.0, alone, spare=False) == []
    assert pol.plan_drops(1.0, alone) == [spare]
    # an unstable executor (KV still crossing) is not merged; not-accepting is not flagged
    views = [_view(0, (0,), 1_900, queued=3_000), _view(1, (1,), 100, stable=False)]
    pol = _policy()
    _grow(pol, views, 1.0, {0: 0.0, 1: 0.0})
    assert pol.plan(1.0, views) == []
    views = [_view(0, (0,), 1_900, queued=3_000, accepting=False), _view(1, (1,), 100)]
    pol = _policy()
    _grow(pol, views, 1.0, {0: 0.0, 1: 0.0})
    assert pol.plan(1.0, views) == []
    with pytest.raises(ConfigError, match="observe"):
        _policy().plan(1.0, views)


def test_policy_restores_only_after_the_low_demand_time() -> None:
    pol = _policy(restore_min_s=5.0)
    low = _view(7, (3, 4), 200)  # 200 <= 0.5 x 4,000 tokens as replicas
    high = dataclasses.replace(low, kv_used_tokens=2_500)
    got: dict[float, list[Restore]] = {}
    for tick in range(0, 121):
        now = tick / 10
        view = high if 3.0 <= now < 3.5 else low
        pol.observe(now, [view])
        # (the jump also flags the lone group: ActivateSpare, not looked at here)
        got[now] = [a for a in pol.plan(now, [view]) if isinstance(a, Restore)]
    restores = [t for t, acts in got.items() if acts]
    # low from 0 s, broken at 3-3.4 s, low again from 3.5 s: restored at 8.5 s
    assert restores[0] == pytest.approx(8.5)
    (first,) = got[restores[0]]
    assert first == Restore(
        executor=7, model="m", members=(3, 4), reload=(((24, 48),), ((0, 24),)), source="host"
    )
    # an unstable group keeps its timer; a replica is never restored
    pol = _policy(restore_min_s=1.0, restore_from="peer")
    pol.observe(0.0, [low])
    assert pol.plan(0.0, [low]) == [] and pol.low_since(7) == 0.0
    busy = dataclasses.replace(low, stable=False)
    pol.observe(0.5, [busy])
    assert pol.plan(0.5, [busy]) == [] and pol.low_since(7) == 0.0
    pol.observe(1.0, [low])
    (restore,) = pol.plan(1.0, [low])
    assert isinstance(restore, Restore) and restore.source == "peer"
    replica = _view(8, (5,), 0)
    pol.observe(30.0, [replica])
    assert pol.plan(30.0, [replica]) == [] and pol.low_since(8) is None
    pol.forget(7)
    assert pol.low_since(7) is None


def test_policy_never_drops_and_restores_one_executor() -> None:
    # the memory-greedy planner merges the small replicas into the biggest
    # group, which has been low long enough to be restored
    group = _view(0, (0, 1), 100)
    views = [group, _view(2, (2,), 1_990, queued=1_000), _view(3, (3,), 1_990)]
    pol = _policy(strategy="memory", restore_min_s=0.0)
    _grow(pol, views, 1.0, dict.fromkeys((0, 2, 3), 0.0))
    assert pol.decide_restore(1.0, group) is not None  # on its own, it would restore
    actions = pol.plan(1.0, views)
    (drop,) = [a for a in actions if isinstance(a, DropLayers)]
    assert 0 in drop.sources
    assert not any(isinstance(a, Restore) for a in actions)


@st.composite
def executor_views(draw: st.DrawFn) -> list[ExecutorSnapshot]:
    """Executors of earlier drops: groups holding an even split, some stable."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=8))
    views = []
    nxt = 0
    for key, k in enumerate(sizes):
        members = tuple(range(nxt, nxt + k))
        nxt += k
        views.append(
            _view(
                key,
                members,
                draw(st.integers(0, 6_000)),
                queued=draw(st.sampled_from([0, 0, 500, 4_000])),
                accepting=draw(st.booleans()) or k == 1,
                stable=draw(st.integers(0, 4)) > 0,
            )
        )
    return views


@FAST
@given(
    executor_views(),
    st.sampled_from(["throughput", "memory"]),
    st.lists(st.floats(-3_000, 3_000), min_size=8, max_size=8),
    st.integers(0, 2**32 - 1),
)
def test_policy_actions_keep_one_copy_and_never_overlap(
    views: list[ExecutorSnapshot], strategy: str, rates: list[float], seed: int
) -> None:
    by_key = {v.key: v for v in views}
    ticks = [0.0, 0.2, 0.4]

    def run(seed: int) -> list[object]:
        pol = _policy(strategy=strategy, restore_min_s=0.2)
        out = []
        for now in ticks:
            pol.observe(now, views)
            out.append(pol.plan(now, views, np.random.default_rng(seed)))
        _grow(pol, views, 1.5, {v.key: rates[v.key] for v in views})
        out.append(pol.plan(1.5, views, np.random.default_rng(seed)))
        return out

    runs = run(seed)
    assert runs == run(seed)  # deterministic for a seed ...
    assert runs == run(seed + 1)  # ... and no decision draws from it
    kinds = {type(a).__name__ for actions in runs for a in actions}
    event(f"actions: {', '.join(sorted(kinds)) or 'none'}")
    for actions in runs:
        assert isinstance(actions, list)
        seen: set[int] = set()
        spares = 0
        for a in actions:
            if isinstance(a, DropLayers):
                _check_drop(a, by_key)
                assert seen.isdisjoint(a.sources)
                seen.update(a.sources)
            elif isinstance(a, Restore):
                v = by_key[a.executor]
                assert len(v.members) > 1 and v.stable
                assert a.executor not in seen
                seen.add(a.executor)
                for (lo, hi), reload in zip(v.held_layers, a.reload, strict=True):
                    back = {layer for x, y in reload for layer in range(x, y)}
                    assert back == set(range(LAYERS)) - set(range(lo, hi))
            else:
                assert isinstance(a, ActivateSpare) and a.shortfall_bytes > 0
                assert actions.index(a) == 0
                spares += 1
        assert spares <= 1


def test_policy_rejects_bad_parameters() -> None:
    with pytest.raises(ConfigError, match="strategy"):
        _policy(strategy="fast")
    with pytest.raises(ConfigError, match="restore_threshold"):
        _policy(restore_threshold=0.0)
    with pytest.raises(ConfigError, match="restore_min_s"):
        _policy(restore_min_s=-1.0)
    with pytest.raises(ConfigError, match="restore_from"):
        _policy(restore_from="disk")
    with pytest.raises(ConfigError, match="num_layers"):
        _policy(num_layers=0)
    with pytest.raises(ConfigError, match="window_s"):
        _policy(window_s=0.0)
    with pytest.raises(ConfigError, match="members"):
        ExecutorSnapshot(0, (0, 1), ((0, 48),), (1,), 0, 0, 0, 0)


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 10**6)), max_size=15),
    n=st.integers(1, 40),
    dt=st.sampled_from([0.1, 0.05, 0.3, 1.0]),
    window=st.sampled_from([0.25, 1.0, 2.0]),
    demand=st.integers(0, 10**6),
    capacity=st.integers(0, 10**6),
)
def test_observe_each_keeps_the_samples_of_one_observe_per_time(
    before: list[tuple[int, int]],
    n: int,
    dt: float,
    window: float,
    demand: int,
    capacity: int,
) -> None:
    """:meth:`DemandMonitor.observe_each` (the ticks a quiet world skips)
    leaves the samples and rates of one :meth:`observe` per time."""
    a, b = DemandMonitor(window_s=window), DemandMonitor(window_s=window)
    t = 0.0
    for step, d in before:
        t += step * 0.05
        for m in (a, b):
            m.observe(0, t, float(d), 5e5)
    times = []
    for _ in range(n):
        t += dt
        times.append(t)
    a.observe_each(0, times, float(demand), float(capacity))
    for x in times:
        b.observe(0, x, float(demand), float(capacity))
    assert a.samples(0) == b.samples(0)
    assert a.rates(0) == b.rates(0)
    assert a.throttled(0) == b.throttled(0)
