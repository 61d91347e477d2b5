"""What no candidate can beat: checks before any search, and pool-size lower bounds.

Checks (:func:`check_feasible`), each a one-line error before any simulation:

* every service's model fits some candidate GPU at an allowed TP degree within
  a node;
* every latency SLO is at least the *idle* P99 of the plan's own requests on
  the fastest candidate: a request's TTFT is at least its prefill alone on an
  idle instance, its TPOT at least its idle decode steps, its end-to-end
  latency at least its idle execution time (the cost model's times; sharing,
  queueing and contention only add to them), so the P99 over the service's
  requests is at least the P99 of those idle times, whatever the fleet;
* an attainment scale is at least 1 (a request cannot beat its idle time).

Pool-size lower bounds (:func:`pool_lower_bound`), valid for every placement:

* **memory**: every service's weights are resident (placement hosts every
  service; an elastic group that released its GPUs still holds them in the
  plan). Dedicated placement needs one instance of every service, each on its
  TP degree; a sharing placement needs at least the total weight bytes over
  one GPU's usable memory, and at least the largest service's smallest group.
* **compute**: with a P99 TTFT SLO, at least 99% of each service's run
  requests get their first token within the SLO of their arrival, so the
  prefill work of the cheapest 99% (their prompt tokens' dense matmuls,
  ``2 x linear parameters`` FLOPs per token: the cost model's
  ``tok_flop_s``, which it never undercuts) is done by the last arrival
  plus the largest TTFT SLO, on GPUs that each do at most their peak FLOP/s.

A candidate's search starts at its lower bound, and a candidate whose lower
bound already costs more than the best point found is skipped
(:mod:`fleetserve.experiments.plan.search`); since no pool below the bound can
meet the SLOs, neither removes a feasible cheaper point.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fleetserve.costmodel import CostModel
from fleetserve.costmodel.roofline import raw_coefficients
from fleetserve.errors import ConfigError
from fleetserve.experiments.plan.spec import PlanSpec
from fleetserve.experiments.plan.traffic import Traffic
from fleetserve.policy.group_placement import dedicated_tp
from fleetserve.spec import get_gpu, get_model
from fleetserve.spec.memory import fits
from fleetserve.spec.types import GpuSpec

__all__ = [
    "IdleFloor",
    "check_feasible",
    "dedicated_tps",
    "nearest_rank",
    "pool_lower_bound",
    "service_tps",
]


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (the ``ceil(q N)``-th smallest; inf allowed)."""
    if not values:
        return math.inf
    v = sorted(values)
    return v[max(0, math.ceil(q * len(v)) - 1)]


@dataclass(frozen=True, slots=True)
class IdleFloor:
    """A service's idle P99s on one GPU type and TP degree, seconds."""

    gpu: str
    tp: int
    ttft_p99_s: float
    tpot_p99_s: float
    e2e_p99_s: float


def _allowed_tps(gpu: GpuSpec, tps: Sequence[int]) -> list[int]:
    return sorted(t for t in tps if t <= gpu.gpus_per_node)


def service_tps(model: str, gpu: GpuSpec, tps: Sequence[int], mem_util: float) -> list[int]:
    """The allowed TP degrees ``model`` fits on with ``gpu`` (within a node)."""
    spec = get_model(model)
    return [t for t in _allowed_tps(gpu, tps) if fits(spec, gpu, t, mem_util)]


def _idle_floors(spec: PlanSpec, traffic: Traffic, name: str, model: str) -> list[IdleFloor]:
    reqs = [r for r in traffic.run if r.model == name]
    if not reqs:
        return []
    p = np.array([r.prompt_tokens for r in reqs], dtype=np.float64)
    o = np.array([r.output_tokens for r in reqs], dtype=np.float64)
    out = []
    cm = CostModel()
    for g in spec.gpus:
        gpu = get_gpu(g.name)
        for tp in service_tps(model, gpu, spec.search.tp, spec.mem_util):
            inst = cm.bind(get_model(model), gpu, tp)
            e2e = inst.ideal_times(p, o)
            prefill = {int(x): inst.prefill_time([int(x)]) for x in np.unique(p)}
            ttft = [prefill[int(x)] for x in p]
            tpot = [
                (e - f) / (k - 1)
                for e, f, k in zip(e2e.tolist(), ttft, o.tolist(), strict=True)
                if k > 1
            ]
            out.append(
                IdleFloor(
                    g.name,
                    tp,
                    nearest_rank(ttft, 0.99),
                    nearest_rank(tpot, 0.99) if tpot else 0.0,
                    nearest_rank(e2e.tolist(), 0.99),
                )
            )
    return out


def check_feasible(spec: PlanSpec, traffic: Traffic) -> dict[str, list[IdleFloor]]:
    """Refuse a plan no candidate can meet (module docstring); the idle floors
    of every service, by service name.

    Raises:
        ConfigError: a model that fits no candidate GPU, or an SLO below the
            idle latency of the fastest candidate (one line, naming both).
    """
    floors: dict[str, list[IdleFloor]] = {}
    tps = ", ".join(str(t) for t in spec.search.tp)
    for svc in spec.services:
        model = get_model(svc.model)
        if not any(
            service_tps(svc.model, get_gpu(g.name), spec.search.tp, spec.mem_util)
            for g in spec.gpus
        ):
            gpus = ", ".join(g.name for g in spec.gpus)
            raise ConfigError(
                f"service {svc.name!r}: {svc.model} ({model.weight_bytes / 1e9:.0f} GB of "
                f"weights) fits no candidate GPU ({gpus}) at an allowed TP degree ({tps}) "
                f"within a node at mem_util {spec.mem_util:g}"
            )
        fl = _idle_floors(spec, traffic, svc.name, svc.model)
        floors[svc.name] = fl
        slo = svc.slo
        if slo.attainment_scale is not None and slo.attainment_scale < 1:
            raise ConfigError(
                f"service {svc.name!r}: slo.attainment_scale {slo.attainment_scale:g} < 1 "
                "can never be met (a request cannot beat its idle execution time)"
            )
        for key, label in (
            ("ttft_p99_s", "TTFT"),
            ("tpot_p99_s", "TPOT"),
            ("e2e_p99_s", "end-to-end latency"),
        ):
            target = getattr(slo, key)
            if target is None or not fl:
                continue
            best = min(fl, key=operator.attrgetter(key))
            floor = getattr(best, key)
            if target < floor:
                raise ConfigError(
                    f"service {svc.name!r}: slo.{key} = {target:g} s is below the idle P99 "
                    f"{label} of its requests on the fastest candidate ({best.gpu}, TP "
                    f"{best.tp}): {floor:.4g} s; no fleet can meet it"
                )
    return floors


def dedicated_tps(spec: PlanSpec, gpu_name: str, least: int) -> tuple[int, ...] | None:
    """Each service's TP degree under dedicated placement with the allowed degrees
    at or above ``least`` (:func:`~fleetserve.policy.group_placement.dedicated_tp`);
    None when some service fits no such degree on this GPU."""
    gpu = get_gpu(gpu_name)
    try:
        return tuple(
            dedicated_tp(get_model(s.model), gpu, spec.mem_util, spec.tp_from(least))
            for s in spec.services
        )
    except ConfigError:
        return None


def pool_lower_bound(
    spec: PlanSpec, traffic: Traffic, gpu_name: str, placement: str, min_tp_size: int
) -> int | None:
    """The fewest GPUs of ``gpu_name`` a stack with ``placement`` could meet the
    SLOs with (module docstring); None when some service fits no allowed degree
    at or above ``min_tp_size`` on this GPU."""
    gpu = get_gpu(gpu_name)
    per_service = dedicated_tps(spec, gpu_name, min_tp_size)
    if per_service is None:
        return None
    weights = sum(get_model(svc.model).weight_bytes for svc in spec.services)
    budget = math.floor(gpu.hbm_bytes * spec.mem_util)
    if placement == "dedicated":
        memory = sum(per_service)
    else:
        memory = max(max(per_service), math.ceil(weights / budget))
    return max(memory, _compute_bound(spec, traffic, gpu))


def _compute_bound(spec: PlanSpec, traffic: Traffic, gpu: GpuSpec) -> int:
    slos = [s.slo.ttft_p99_s for s in spec.services if s.slo.ttft_p99_s is not None]
    if not slos or not traffic.run:
        return 1
    work = 0.0  # GPU-seconds at peak
    for svc in spec.services:
        if svc.slo.ttft_p99_s is None:
            continue
        prompts = sorted(r.prompt_tokens for r in traffic.run if r.model == svc.name)
        keep = math.ceil(0.99 * len(prompts))
        per_token = raw_coefficients(get_model(svc.model), gpu, 1).tok_flop_s
        work += per_token * float(sum(prompts[:keep]))
    horizon = traffic.run[-1].arrival_s + max(slos)
    return max(1, math.ceil(work / horizon))
