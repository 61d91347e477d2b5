"""SeaLLM's two-stage placement (group partition, UI-driven allocation) and the
simulation-based plan evaluator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.errors import ConfigError
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.policy.seallm_placement import (
    ServiceOutcome,
    can_allocate,
    group_partition,
    seallm_allocate,
    seallm_place,
)
from fleetserve.sim.evaluate import PlanEvaluator
from fleetserve.sim.multi import MultiConfig
from fleetserve.spec import get_gpu, get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

GPU = get_gpu("a800-80gb")


def svc(name: str, model: str, rate: float = 1.0) -> Service:
    return Service(name, get_model(model), rate, 512, 128)


def history(rates: dict[str, float], seconds: float, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for name, rate in rates.items():
        t = 0.0
        while True:
            t += rng.exponential(1 / rate)
            if t >= seconds:
                break
            out.append((t, name, int(rng.integers(64, 1024)), int(rng.integers(8, 256))))
    out.sort()
    return [Request(i, m, a, p, o) for i, (a, m, p, o) in enumerate(out)]


def test_group_partition_merges_until_every_service_fits() -> None:
    small = [svc("a", "llama-2-7b"), svc("b", "llama-2-13b")]
    assert [len(g) for g in group_partition(8, 8, 1, small, GPU, 0.9, 8)] == [1] * 8
    big = [*small, svc("c", "llama-2-70b")]  # needs >= 2 GPUs
    groups = group_partition(8, 8, 1, big, GPU, 0.9, 8)
    assert sorted(len(g) for g in groups)[-1] >= 2
    assert sorted(x for g in groups for x in g) == list(range(8))  # a partition
    for g in groups:  # node-aligned, consecutive
        assert list(g) == list(range(g[0], g[0] + len(g)))
    with pytest.raises(ConfigError, match="fits no group"):
        group_partition(1, 1, 1, big, GPU, 0.9, 8)


def test_can_allocate_checks_memory_and_duplicates() -> None:
    a, b = svc("a", "llama-2-7b"), svc("b", "llama-2-13b")
    assert can_allocate([a], b, 1, GPU, 0.9, 8)
    assert not can_allocate([a], a, 1, GPU, 0.9, 8)
    assert not can_allocate([a, b], svc("c", "llama-2-70b"), 1, GPU, 0.9, 8)


def test_allocation_serves_the_most_unserved_service_first() -> None:
    services = [svc("a", "llama-2-7b", 1.0), svc("b", "llama-2-7b", 5.0)]
    calls: list[PlacementPlan] = []

    def evaluate(plan: PlacementPlan) -> dict[str, ServiceOutcome]:
        calls.append(plan)
        placed = {s for g in plan.groups for s in g.services}
        n = {"a": 10, "b": 50}
        return {s: ServiceOutcome(n[s], 0, 0 if s in placed else n[s], None) for s in n}

    plan, evals = seallm_allocate([(0,), (1,)], services, 2, GPU, evaluate)
    # first allocation: b (50 unserved) to the first empty group; then a
    first = calls[1].groups
    assert first == (GroupPlacement((0,), 1, ("b",)),)
    assert {s for g in plan.groups for s in g.services} == {"a", "b"}
    assert evals == len(calls)
    plan.check(["a", "b"])


def test_evaluator_counts_unplaced_services_as_misses_and_caches_components() -> None:
    services = {"a": svc("a", "llama-2-7b", 2.0), "b": svc("b", "llama-2-13b", 1.0)}
    reqs = history({"a": 2.0, "b": 1.0}, 20.0)
    ev = PlanEvaluator(MultiConfig(gpu="a800-80gb", n_gpus=2, scheduler="db"), services, reqs)
    only_a = PlacementPlan((GroupPlacement((0,), 1, ("a",)),), 2)
    out = ev(only_a)
    nb = sum(1 for r in reqs if r.model == "b")
    assert out["b"].slo_misses == nb and out["b"].finished == 0
    assert out["a"].finished == sum(1 for r in reqs if r.model == "a")
    both = PlacementPlan((GroupPlacement((0,), 1, ("a",)), GroupPlacement((1,), 1, ("b",))), 2)
    ev(both)
    assert ev.simulations == 2  # group (0, a) came from the cache
    assert ev(both) == ev(both) and ev.simulations == 2


def test_seallm_place_finds_a_plan_for_every_service() -> None:
    services = {
        "a": svc("a", "llama-2-7b", 2.0),
        "b": svc("b", "llama-2-13b", 1.0),
        "c": svc("c", "opt-6.7b", 0.5),
    }
    reqs = history({"a": 2.0, "b": 1.0, "c": 0.5}, 20.0)
    ev = PlanEvaluator(MultiConfig(gpu="a800-80gb", n_gpus=4, scheduler="db"), services, reqs)
    plan, cands = seallm_place(list(services.values()), 4, GPU, ev, processes=1)
    plan.check(services)
    assert {c.tp for c in cands} <= {1, 2, 4}
    best = max(c.slo_attainment for c in cands)
    assert any(c.plan == plan and c.slo_attainment == best for c in cands)


def test_dedicated_splits_the_pool_by_rate_without_sharing() -> None:
    from fleetserve.policy.group_placement import dedicated_place, place_services

    services = [
        svc("a", "llama-2-7b", 6.0),
        svc("b", "llama-2-7b", 2.0),
        svc("c", "llama-2-70b", 1.0),
    ]
    plan = dedicated_place(services, 8, GPU)
    plan.check(["a", "b", "c"])
    assert all(len(g.services) == 1 for g in plan.groups)
    count = {s: sum(1 for g in plan.groups if g.services == (s,)) for s in "abc"}
    assert count["a"] > count["b"] >= 1 and count["c"] == 1
    assert plan.gpus_used == 8
    for g in plan.groups:  # node-aligned, tp from the model
        assert g.gpus[0] // 8 == g.gpus[-1] // 8
        assert g.tp == (2 if g.services == ("c",) else 1)
    with pytest.raises(ConfigError, match="dedicated"):
        dedicated_place(services, 2, GPU)
    with pytest.raises(Exception, match="placement"):
        place_services("nope", services, 8, GPU)
    plan, est = place_services("muxserve", services, 8, GPU)
    assert plan.n_gpus == 8 and est is None  # only SeaLLM's search estimates
    assert place_services("dedicated", services, 8, GPU) == (
        dedicated_place(services, 8, GPU),
        None,
    )


def test_max_services_caps_every_group() -> None:
    """SeaLLM's evaluation setting (§6.1): at most two services per engine."""
    a, b, c = svc("a", "llama-2-7b"), svc("b", "llama-2-7b"), svc("c", "opt-6.7b")
    assert can_allocate([a], b, 1, GPU, 0.9, 8, max_services=2)
    assert not can_allocate([a, b], c, 8, GPU, 0.9, 8, max_services=2)
    assert can_allocate([a, b], c, 8, GPU, 0.9, 8)  # no limit: memory allows it
    # one group of 8 GPUs cannot host three services two at a time
    with pytest.raises(ConfigError, match="at most 2 services per group"):
        group_partition(8, 8, 8, [a, b, c], GPU, 0.9, 8, max_services=2)
    assert group_partition(8, 8, 8, [a, b, c], GPU, 0.9, 8) == [tuple(range(8))]
    assert len(group_partition(8, 8, 4, [a, b, c], GPU, 0.9, 8, max_services=2)) == 2
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="max_services"):
            seallm_allocate([(0,)], [a], 1, GPU, lambda p: {}, max_services=bad)

    services = {
        "a": svc("a", "llama-2-7b", 3.0),
        "b": svc("b", "llama-2-7b", 2.0),
        "c": svc("c", "opt-6.7b", 1.0),
        "d": svc("d", "llama-2-13b", 0.5),
    }
    reqs = history({"a": 3.0, "b": 2.0, "c": 1.0, "d": 0.5}, 10.0)
    cfg = MultiConfig(gpu="a800-80gb", n_gpus=4, scheduler="db", layout="merged")
    free, free_cands = seallm_place(
        list(services.values()), 4, GPU, PlanEvaluator(cfg, services, reqs), processes=1
    )
    assert max(len(g.services) for g in free.groups) > 2  # without the cap groups share more
    plan, cands = seallm_place(
        list(services.values()),
        4,
        GPU,
        PlanEvaluator(cfg, services, reqs),
        processes=1,
        max_services=2,
    )
    plan.check(services)
    for c in cands:
        assert all(len(g.services) <= 2 for g in c.plan.groups)
    assert {c.tp for c in cands} <= {1, 2}  # 1 group of 4 cannot host 4 services 2 at a time
    # None is no limit: the same search as without the argument
    same, same_cands = seallm_place(
        list(services.values()),
        4,
        GPU,
        PlanEvaluator(cfg, services, reqs),
        processes=1,
        max_services=None,
    )
    assert same == free and same_cands == free_cands
    with pytest.raises(ConfigError, match="max_services"):
        seallm_place(list(services.values()), 4, GPU, lambda p: {}, max_services=0)


def test_parallel_search_equals_serial_and_reports_evaluator_counters() -> None:
    services = {
        "a": svc("a", "llama-2-7b", 2.0),
        "b": svc("b", "llama-2-13b", 1.0),
        "c": svc("c", "opt-6.7b", 0.5),
    }
    reqs = history({"a": 2.0, "b": 1.0, "c": 0.5}, 10.0)
    cfg = MultiConfig(gpu="a800-80gb", n_gpus=4, scheduler="db", layout="merged")
    serial = seallm_place(
        list(services.values()), 4, GPU, PlanEvaluator(cfg, services, reqs), processes=1
    )
    parallel = seallm_place(
        list(services.values()), 4, GPU, PlanEvaluator(cfg, services, reqs), processes=2
    )
    assert parallel == serial  # the same plan and candidates, in TP order
    assert [c.tp for c in serial[1]] == sorted(c.tp for c in serial[1])
    for c in serial[1]:
        k = c.counters
        assert k is not None
        assert k["evaluations"] == c.evaluations
        assert 0 < k["simulations"] <= k["lookups"]
        assert k["sim_s"] > 0 and k["sim_requests"] > 0
    # an evaluator without counters: none reported
    ev = PlanEvaluator(cfg, services, reqs)
    _, cands = seallm_place(list(services.values()), 4, GPU, lambda p: ev(p), processes=1)
    assert all(c.counters is None for c in cands)


def test_evaluator_history_of_a_component_is_sorted_by_arrival_then_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests arriving at the same time with ids out of order: a component
    simulates its services' requests by (arrival, id), renumbered."""
    import fleetserve.sim.evaluate as evaluate

    services = {"a": svc("a", "llama-2-7b"), "b": svc("b", "llama-2-7b")}
    raw = [(1.0, 7, "b"), (1.0, 3, "a"), (0.5, 9, "a"), (1.0, 1, "b"), (2.0, 0, "a")]
    reqs = [Request(i, m, t, 100, 10) for t, i, m in raw]
    seen: list[list[tuple[float, str, int]]] = []
    real = evaluate.MultiSimulator

    def spy(cfg, svcs, plan, rs, **kw):  # type: ignore[no-untyped-def]
        seen.append([(r.arrival_s, r.model, r.id) for r in rs])
        return real(cfg, svcs, plan, rs, **kw)

    monkeypatch.setattr(evaluate, "MultiSimulator", spy)
    ev = PlanEvaluator(MultiConfig(gpu="a800-80gb", n_gpus=1, scheduler="db"), services, reqs)
    ev(PlacementPlan((GroupPlacement((0,), 1, ("a", "b")),), 1))
    order = sorted(reqs, key=lambda r: (r.arrival_s, r.id))
    assert seen == [[(r.arrival_s, r.model, i) for i, r in enumerate(order)]]
    assert ev.counters()["simulations"] == 1 and ev.counters()["sim_requests"] == 5


@settings(max_examples=50, deadline=None)
@given(
    rates=st.lists(st.floats(0.01, 20.0, allow_nan=False), min_size=1, max_size=4),
    n_gpus=st.integers(4, 8),
)
def test_dedicated_is_one_rule_in_both_worlds(rates: list[float], n_gpus: int) -> None:
    """The single-model world's ``dedicated`` placement and the multi-LLM
    world's give every model the same number of instances (tp 1 models on
    one node: no alignment constraint), through one rule (``dedicated_counts``)."""
    from fleetserve.policy.base import PLACEMENT
    from fleetserve.policy.group_placement import dedicated_place

    names = [f"m{i}" for i in range(len(rates))]
    single = PLACEMENT.get("dedicated")().place(
        dict(zip(names, rates, strict=True)), n_gpus, dict.fromkeys(names, 1)
    )
    services = [svc(n, "llama-2-7b", r) for n, r in zip(names, rates, strict=True)]
    plan = dedicated_place(services, n_gpus, GPU)
    multi = [g.services[0] for g in plan.groups]
    assert sorted(single) == sorted(multi)
