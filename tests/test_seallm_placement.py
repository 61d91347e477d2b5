"""SeaLLM's two-stage placement (group partition, UI-driven allocation) and the
simulation-based plan evaluator."""

from __future__ import annotations

import numpy as np
import pytest

from fleetserve.errors import ConfigError
from fleetserve.policy.groups import GroupPlacement, PlacementPlan, Service
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
    assert place_services("muxserve", services, 8, GPU).n_gpus == 8
