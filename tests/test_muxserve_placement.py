"""MuxServe placement: throughput estimator, Algorithm 2 candidates, Algorithm 1 greedy."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fleetserve.costmodel import DEFAULT_PARAMS
from fleetserve.costmodel.roofline import CostModel
from fleetserve.errors import ConfigError
from fleetserve.policy.muxserve_placement import (
    DEFAULT_SHARE_GRID,
    MuxServeResult,
    estimate_unit_throughput,
    llm_parallel_candidates,
    muxserve_place,
    muxserve_search,
    potential_mesh_groups,
    preferred_candidate,
    unit_fits,
    unit_kv_bytes,
)
from fleetserve.spec import get_gpu, get_model, weight_bytes_per_gpu
from fleetserve.workload.service import Service
from fleetserve.workload.synthetic import power_law_rates

GPU = get_gpu("a100-80gb")
CM = CostModel()
PROMPT, OUTPUT = 161, 338  # ShareGPT means, as in MuxServe


def svc(name: str, model: str, rate: float) -> Service:
    return Service(name, get_model(model), rate, PROMPT, OUTPUT)


# 19 LLMs of MuxServe's synthetic workload, popularity order interleaving the sizes
_MODELS_19 = (
    *("llama-2-7b", "llama-2-7b", "llama-2-13b", "llama-2-7b", "llama-30b", "llama-2-7b"),
    *("llama-65b", "llama-2-7b", "llama-2-13b", "llama-2-7b", "llama-30b", "llama-2-7b"),
    *("llama-2-13b", "llama-2-7b", "llama-2-7b", "llama-2-13b", "llama-2-7b", "llama-2-7b"),
    "llama-2-7b",
)


def services_19(total_rate: float, alpha: float) -> list[Service]:
    rates = power_law_rates(total_rate, len(_MODELS_19), alpha)
    return [
        svc(f"llm{i:02d}", m, r) for i, (m, r) in enumerate(zip(_MODELS_19, rates, strict=True))
    ]


@pytest.fixture(scope="module")
def result_19() -> tuple[list[Service], MuxServeResult]:
    services = services_19(200.0, 0.9)
    return services, muxserve_search(services, 32, GPU, CM)


# ----------------------------------------------------------------------------- estimator


def test_estimator_is_min_of_capacity_and_rate_and_monotone() -> None:
    totals = []
    for rate in (0.5, 2, 5, 10, 15, 20, 30, 60):
        unit = estimate_unit_throughput([svc("a", "llama-2-7b", rate)], 1, GPU, CM)
        (s,) = unit.services
        assert unit.total == s.throughput <= rate
        assert s.throughput == pytest.approx(min(s.batch / s.cycle_s, rate))
        if s.batch < s.max_batch:  # not saturated: the whole demand is served
            assert s.throughput == rate
        totals.append(unit.total)
    assert totals == sorted(totals)  # monotone in the rate ...
    assert totals[0] == 0.5 and totals[-1] < 60  # ... up to saturation
    assert totals[-1] == totals[-2]  # flat once saturated (batch at its maximum)


def test_batch_is_smallest_meeting_rate() -> None:
    unit = estimate_unit_throughput([svc("a", "llama-2-7b", 8.0)], 1, GPU, CM)
    (s,) = unit.services
    assert s.meets_rate and 1 < s.batch < s.max_batch
    inst = CM.bind(get_model("llama-2-7b"), GPU, 1)
    b = s.batch - 1
    t_p = inst.prefill_time([PROMPT] * b)
    t_d = inst.decode_time_scalar(b, b * (PROMPT + OUTPUT / 2), 1.0)
    assert b / (t_p + t_d * OUTPUT) < 8.0


def test_prefills_of_colocated_models_add_up_decodes_overlap() -> None:
    a, b = svc("a", "llama-2-7b", 6.0), svc("b", "llama-2-13b", 2.0)
    unit = estimate_unit_throughput([a, b], 2, GPU, CM, decode_shares={"a": 0.5, "b": 0.5})
    sa, sb = unit.services
    assert unit.prefill_sum_s == pytest.approx(sa.prefill_s + sb.prefill_s)
    for s, o in ((sa, a.mean_output), (sb, b.mean_output)):
        # every member's cycle has both prefills but only its own decode
        assert s.cycle_s == pytest.approx(sa.prefill_s + sb.prefill_s + s.decode_s * o)
        assert s.throughput == pytest.approx(min(s.batch / s.cycle_s, s.rate))
    inst_a = CM.bind(a.spec, GPU, 2)
    assert sa.prefill_s == pytest.approx(inst_a.prefill_time([PROMPT] * sa.batch))
    assert sa.decode_s == pytest.approx(
        inst_a.decode_time_scalar(sa.batch, sa.batch * (PROMPT + OUTPUT / 2), 0.5)
    )
    # sharing costs: a alone on the same mesh has more capacity than co-located
    alone = estimate_unit_throughput([a], 2, GPU, CM).services[0]
    assert alone.capacity > sa.capacity
    assert alone.batch <= sa.batch  # b's prefills lengthen a's cycle: a needs a bigger batch


def test_oversubscribed_decode_shares_are_scaled() -> None:
    a, b = svc("a", "llama-2-7b", 6.0), svc("b", "llama-2-7b", 6.0)
    unit = estimate_unit_throughput([a, b], 1, GPU, CM, decode_shares={"a": 0.9, "b": 0.3})
    assert [s.share for s in unit.services] == pytest.approx([0.75, 0.25])
    # a smaller share never speeds a job up
    slow = estimate_unit_throughput([a], 1, GPU, CM, decode_shares={"a": 0.1}).services[0]
    fast = estimate_unit_throughput([a], 1, GPU, CM, decode_shares={"a": 1.0}).services[0]
    assert slow.capacity <= fast.capacity


def test_kv_quota_follows_demand_and_memory_is_respected() -> None:
    hot, cold = svc("hot", "llama-2-7b", 20.0), svc("cold", "llama-2-7b", 1.0)
    unit = estimate_unit_throughput([hot, cold], 1, GPU, CM)
    s_hot, s_cold = unit.services
    assert s_hot.max_batch > s_cold.max_batch >= 1
    per_req = (PROMPT + OUTPUT) * hot.spec.kv_bytes_per_token
    assert (s_hot.max_batch + s_cold.max_batch) * per_req <= unit.kv_bytes
    assert unit.kv_bytes == unit_kv_bytes([hot.spec, cold.spec], 1, GPU)


def test_zero_rate_service_has_no_batch() -> None:
    unit = estimate_unit_throughput(
        [svc("a", "llama-2-7b", 3.0), svc("idle", "llama-2-7b", 0.0)], 1, GPU, CM
    )
    idle = unit.services[1]
    assert idle.batch == 0 and idle.prefill_s == 0.0 and idle.throughput == 0.0
    assert unit.total == pytest.approx(3.0)


def test_estimator_rejects_units_that_do_not_fit() -> None:
    big = [svc("x", "llama-65b", 1.0), svc("y", "llama-30b", 1.0)]
    assert not unit_fits(big, 2, GPU)
    with pytest.raises(ConfigError, match="do not fit together"):
        estimate_unit_throughput(big, 2, GPU, CM)
    with pytest.raises(ConfigError, match="twice"):
        estimate_unit_throughput([svc("x", "llama-2-7b", 1), svc("x", "llama-2-7b", 1)], 1, GPU, CM)


# ----------------------------------------------------------------------------- Algorithm 2


def test_parallel_candidates() -> None:
    services = [svc("s7", "llama-2-7b", 12.0), svc("s65", "llama-65b", 2.0)]
    cands = llm_parallel_candidates(services, GPU, CM)
    assert [c.tp for c in cands["s7"]] == [1, 2, 4, 8]
    assert [c.tp for c in cands["s65"]] == [2, 4, 8]  # 130 GB of weights: not on one GPU
    for name, cs in cands.items():
        rate = next(s.rate for s in services if s.name == name)
        for c in cs:
            assert c.share in DEFAULT_SHARE_GRID
            if c.meets_rate:
                assert c.throughput == rate
                # the fewest SMs: the next smaller share does not meet the rate
                smaller = [s for s in DEFAULT_SHARE_GRID if s < c.share]
                if smaller:
                    alone = next(s for s in services if s.name == name)
                    est = estimate_unit_throughput(
                        [alone], c.tp, GPU, CM, decode_shares={name: smaller[-1]}
                    )
                    assert est.total < rate
    pick = preferred_candidate(cands["s7"])
    meeting = [c for c in cands["s7"] if c.meets_rate]
    assert pick.meets_rate and pick.sm_gpus == min(c.sm_gpus for c in meeting)


def test_candidates_reject_model_too_large_for_a_node() -> None:
    small_node = dataclasses.replace(get_gpu("a100-40gb"), gpus_per_node=2)
    with pytest.raises(ConfigError, match=r"service 'huge'.*llama-65b.*one node"):
        llm_parallel_candidates([svc("huge", "llama-65b", 1.0)], small_node, CM)
    with pytest.raises(ConfigError, match=r"service 'huge'"):
        muxserve_place(
            [svc("ok", "llama-2-7b", 1.0), svc("huge", "llama-65b", 1.0)], 8, small_node, CM
        )


# ----------------------------------------------------------------------------- mesh groups


def test_potential_mesh_groups_pruning() -> None:
    groups = potential_mesh_groups(32, 8, [1] * 12 + [1] * 4 + [1, 1] + [2])
    assert groups and len(groups) == len(set(groups))
    for g in groups:
        assert sum(g) == 32 and len(g) <= 19 and max(g) >= 2
        assert all(x in (1, 2, 4, 8) for x in g) and list(g) == sorted(g, reverse=True)
    # 16 services on 128 GPUs: one mesh each, a full node each
    assert potential_mesh_groups(128, 8, [1] * 16) == [(8,) * 16]
    # no mesh below the smallest preferred degree
    assert all(min(g) >= 2 for g in potential_mesh_groups(16, 8, [1, 1, 1], [2, 2, 4]))
    # meshes of size <= 2 only for services that fit there: one 7B, three 65B (min tp 2 ... 4)
    for g in potential_mesh_groups(16, 8, [1, 4, 4, 4]):
        assert sum(1 for x in g if x <= 2) <= 1
    # partial last node: meshes never exceed it where they sit
    assert potential_mesh_groups(12, 8, [1, 1]) == [(8, 4)]
    assert potential_mesh_groups(8, 8, [16]) == []
    # the cap keeps the groups closest to the preferred degrees
    capped = potential_mesh_groups(32, 8, [1] * 19, [1] * 19, max_groups=5)
    assert len(capped) == 5 and all(sum(g) == 32 for g in capped)


# ----------------------------------------------------------------------------- Algorithm 1


def _check_layout(result: MuxServeResult, services: list[Service], n_gpus: int) -> None:
    plan = result.plan
    plan.check([s.name for s in services])
    by_name = {s.name: s for s in services}
    placed = [name for g in plan.groups for name in g.services]
    assert sorted(placed) == sorted(by_name)  # each exactly once
    budget = math.floor(GPU.hbm_bytes * 0.9)
    firsts = [g.gpus[0] for g in plan.groups]
    assert firsts == sorted(firsts)
    for g, unit in zip(plan.groups, result.units, strict=True):
        tp = len(g.gpus)
        assert g.tp == tp == unit.tp and tp & (tp - 1) == 0 and tp <= GPU.gpus_per_node
        assert g.gpus == tuple(range(g.gpus[0], g.gpus[0] + tp))  # consecutive ids
        assert g.gpus[0] // 8 == g.gpus[-1] // 8  # never spans nodes
        members = [by_name[n] for n in g.services]
        weights = sum(weight_bytes_per_gpu(s.spec, tp) for s in members)
        one_req = sum((PROMPT + OUTPUT) * s.spec.kv_bytes_per_token for s in members)
        assert weights * tp + one_req <= budget * tp  # weights + minimum KV fit
        assert unit_fits(members, tp, GPU)
        assert [s.name for s in unit.services] == list(g.services)
    assert max(max(g.gpus) for g in plan.groups) < n_gpus
    assert result.total_throughput == pytest.approx(sum(u.total for u in result.units))
    assert result.total_throughput <= result.demand + 1e-9


def test_muxserve_19_llms_on_32_gpus(result_19: tuple[list[Service], MuxServeResult]) -> None:
    services, result = result_19
    _check_layout(result, services, 32)
    assert result.mesh_groups_evaluated > 1 and sum(result.mesh_sizes) == 32
    assert result.total_throughput > 0.95 * result.demand


def test_popular_models_get_more_capacity(
    result_19: tuple[list[Service], MuxServeResult],
) -> None:
    services, result = result_19
    sevens = [s for s in services if s.spec.name == "llama-2-7b"]
    hot = max(sevens, key=lambda s: s.rate)
    cold = min(sevens, key=lambda s: s.rate)
    group = {n: g for g in result.plan.groups for n in g.services}
    gpus_each = {n: len(g.gpus) / len(g.services) for n, g in group.items()}
    assert gpus_each[hot.name] > gpus_each[cold.name]
    assert len(group[hot.name].services) <= 2  # the hottest 7B is (nearly) alone
    # the 65B (large, popular enough) is on a mesh of its own size or more
    big = next(s for s in services if s.spec.name == "llama-65b")
    assert len(group[big.name].gpus) >= 4


def test_small_cluster_isolates_the_hot_model() -> None:
    """On the legacy cost model (single roofline max) the hot model gets a mesh of
    its own. With the calibrated A100 costs (per-kernel latencies that tensor
    parallelism does not shrink) one 8-GPU mesh for all four serves the whole
    demand too (43 req/s either way) and Algorithm 1's enumeration meets it first."""
    services = [svc(f"m{i}", "llama-2-7b", r) for i, r in enumerate([40.0, 1.0, 1.0, 1.0])]
    plan = muxserve_place(services, 8, GPU, CostModel(DEFAULT_PARAMS))
    plan.check([s.name for s in services])
    by = {n: g for g in plan.groups for n in g.services}
    assert by["m0"].services == ("m0",)
    assert by["m1"] is by["m2"] is by["m3"]  # the unpopular ones share a mesh


def test_deterministic_and_order_independent() -> None:
    services = services_19(150.0, 1.3)
    a = muxserve_place(services, 32, GPU, CM)
    b = muxserve_place(list(reversed(services)), 32, GPU, CM)
    assert a == b


@pytest.mark.parametrize("n_gpus", [64, 128])
def test_sixteen_llms_on_larger_pools(n_gpus: int) -> None:
    services = services_19(160.0, 0.9)[:16]
    result = muxserve_search(services, n_gpus, GPU, CM)
    _check_layout(result, services, n_gpus)
    assert result.total_throughput == pytest.approx(result.demand)


def test_partial_node_and_idle_service() -> None:
    services = [
        svc("a", "llama-2-7b", 10.0),
        svc("b", "llama-2-13b", 3.0),
        svc("c", "llama-30b", 1.0),
        svc("idle", "llama-2-7b", 0.0),
    ]
    result = muxserve_search(services, 12, GPU, CM)
    _check_layout(result, services, 12)


def test_too_many_models_raise_config_error_naming_one() -> None:
    services = [svc(f"x{i}", "llama-65b", 1.0) for i in range(5)]
    with pytest.raises(ConfigError, match=r"service 'x\d' \(llama-65b\) fits on no mesh"):
        muxserve_place(services, 8, GPU, CM)
    with pytest.raises(ConfigError, match="at least one service"):
        muxserve_place([], 8, GPU, CM)
    with pytest.raises(ConfigError, match="n_gpus"):
        muxserve_place([svc("a", "llama-2-7b", 1.0)], 0, GPU, CM)
