"""Simulate one candidate fleet and judge it against every service's SLOs.

A point runs exactly as ``fleetserve simulate`` runs the config
:func:`sim_config` writes for it (same settings, same requests), so the plan's
replay command reproduces its figures. Multi-LLM stacks run in the multi-LLM
simulator (placement on the history, then the run); the one-model stacks of a
one-service plan in theirs: ``mell``, ``llumnix`` in the single-model
simulator (Mell on an elastic pool capped at the point's size: its scheduler
activates and releases GPUs), ``kunserve`` in KunServe's, on the run's
requests (:func:`one_model_requests`).

Judging. Per service, P99s are nearest-rank quantiles over *all* its run
requests, a rejected or unfinished one counting as an infinite latency (so
more than 1% of them lost fails any P99 SLO); TPOT over the requests with at
least two output tokens. A service without a request in a run (possible on a
robustness seed; the search's own traffic refuses it) has nothing to miss. The
attainment is the share of requests finished
within ``attainment_scale`` times their idle execution time. A stack that
cannot run on the pool (a placement without room for its groups, Mell's packer
needing more GPUs than the cap) is an infeasible point, with the message.

Runs stop at ``max_time_s = 2 x (history + duration) + 60`` s of simulated
time: requests still in flight then count as missed (an overloaded fleet's
queue would otherwise take long to drain, for a verdict already known).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fleetserve.config import config_from_dict
from fleetserve.errors import FleetserveError, InputError
from fleetserve.experiments.plan.bounds import nearest_rank
from fleetserve.experiments.plan.search import Point
from fleetserve.experiments.plan.spec import PlanSpec
from fleetserve.experiments.plan.traffic import Traffic, build_traffic
from fleetserve.metrics.records import RequestRecord
from fleetserve.metrics.summary import slo_attainment, slo_key
from fleetserve.policy.catalog import KUNSERVE, MULTI, SINGLE, get_stack
from fleetserve.sim.kun_run import run_kun
from fleetserve.sim.multi_build import multi_settings
from fleetserve.sim.multi_run import run_multi_stack
from fleetserve.sim.simulator import Simulator
from fleetserve.workload.request import Request

__all__ = [
    "EvalTask",
    "Outcome",
    "ServiceResult",
    "evaluate",
    "one_model_requests",
    "plan_world",
    "sim_config",
    "tp_sizes",
    "traffic_for",
]


@dataclass(frozen=True, slots=True)
class ServiceResult:
    """One service's figures at a point (seconds; inf: more than 1% lost).

    Attributes:
        requests: run requests of the service.
        lost: rejected or unfinished ones.
        ttft_p99_s, tpot_p99_s, e2e_p99_s: nearest-rank P99s.
        attainment: share within ``attainment_scale`` (None: no such SLO).
        margins: per SLO given, ``target / achieved`` (>= 1: met; for the
            attainment ``achieved / required``).
    """

    requests: int
    lost: int
    ttft_p99_s: float
    tpot_p99_s: float
    e2e_p99_s: float
    attainment: float | None
    margins: dict[str, float]

    @property
    def meets(self) -> bool:
        """Every SLO of the service holds."""
        return all(m >= 1.0 for m in self.margins.values())


@dataclass(frozen=True, slots=True)
class Outcome:
    """A simulated point.

    Attributes:
        point: the candidate.
        services: per-service results (empty when the placement failed).
        error: why the point could not run (a placement that does not fit).
        gpu_hours_used: active GPU-hours (elastic stacks release idle GPUs).
        sim_wall_s: wall time of the placement and simulation.
        seed, rate_factor, window: the traffic it ran on.
    """

    point: Point
    services: dict[str, ServiceResult] = field(default_factory=dict)
    error: str | None = None
    gpu_hours_used: float | None = None
    sim_wall_s: float = 0.0
    seed: int = 0
    rate_factor: float = 1.0
    window: int = 0

    @property
    def meets(self) -> bool:
        """Every service meets every SLO."""
        return self.error is None and all(s.meets for s in self.services.values())

    @property
    def worst_ttft_p99_s(self) -> float:
        """The largest per-service P99 TTFT (inf when a point failed)."""
        vals = [s.ttft_p99_s for s in self.services.values()]
        return max(vals) if vals and self.error is None else math.inf

    @property
    def min_margin(self) -> float:
        """The tightest SLO margin over every service (0 when it failed)."""
        vals = [m for s in self.services.values() for m in s.margins.values()]
        return min(vals) if vals and self.error is None else 0.0


@dataclass(frozen=True, slots=True)
class EvalTask:
    """Everything a worker process needs to simulate one point."""

    spec: PlanSpec
    base_dir: Path
    point: Point
    seed: int
    rate_factor: float = 1.0
    window: int = 0


def tp_sizes(spec: PlanSpec, point: Point) -> list[int]:
    """The TP degrees the point's placement may use: the allowed ones at or above
    the point's (``dedicated`` takes the smallest that fits each service)."""
    return spec.tp_from(point.tp)


def max_time_s(spec: PlanSpec) -> float:
    """Simulated time after which a run stops (module docstring)."""
    return 2.0 * (spec.history_s + spec.duration_s) + 60.0


def plan_world(stack: str) -> str:
    """The simulator a plan runs ``stack`` in: the multi-LLM one when the stack
    runs there, else its own (single-model, or KunServe's)."""
    worlds = get_stack(stack).worlds
    if MULTI in worlds:
        return MULTI
    return KUNSERVE if worlds == (KUNSERVE,) else SINGLE


def one_model_requests(spec: PlanSpec, traffic: Traffic) -> list[Request]:
    """The run of a one-service plan for a one-model simulator: the catalog
    model in ``model``, the first arrival at 0.0 (as a ``jsonl`` replay reads it)."""
    (svc,) = spec.services
    t0 = traffic.run[0].arrival_s
    return [replace(r, model=svc.model, arrival_s=r.arrival_s - t0) for r in traffic.run]


def sim_config(spec: PlanSpec, point: Point, trace: str, seed: int) -> dict[str, Any]:
    """The ``fleetserve simulate`` config of a point, on the ``jsonl`` ``trace``
    (the whole stream for a multi-LLM stack, :func:`one_model_requests` else)."""
    if plan_world(point.stack) != MULTI:
        (svc,) = spec.services
        elastic = get_stack(point.stack).memory == "planned"  # Mell: an elastic pool
        pool = (
            {"elastic": True, "max_gpus": point.n_gpus}
            if elastic
            else {
                "elastic": False,
                "gpus": point.n_gpus,
            }
        )
        return {
            "model": svc.model,
            "seed": seed,
            "max_time_s": max_time_s(spec),
            "cluster": {"gpu": point.gpu, "tp": point.tp, "mem_util": spec.mem_util, **pool},
            "engine": {"max_num_seqs": spec.max_num_seqs},
            "policy": {"stack": point.stack},
            "workload": {"trace": trace, "format": "jsonl"},
        }
    return {
        "seed": seed,
        "max_time_s": max_time_s(spec),
        "cluster": {
            "gpu": point.gpu,
            "gpus": point.n_gpus,
            "elastic": False,
            "mem_util": spec.mem_util,
        },
        "engine": {"max_num_seqs": spec.max_num_seqs},
        "policy": {"stack": point.stack},
        "services": [{"name": s.name, "model": s.model} for s in spec.services],
        "workload": {"trace": trace, "format": "jsonl", "keep_models": True},
        "multi": {
            "history_s": spec.history_s,
            "tp_sizes": tp_sizes(spec, point),
            "processes": spec.search.processes,
        },
    }


@functools.lru_cache(maxsize=8)
def traffic_for(
    spec: PlanSpec, base_dir: Path, seed: int, rate_factor: float = 1.0, window: int = 0
) -> Traffic:
    """:func:`~fleetserve.experiments.plan.traffic.build_traffic`, memoized per
    process (every point of a search simulates the same traffic)."""
    return build_traffic(spec, base_dir, seed=seed, rate_factor=rate_factor, window=window)


def _p99(values: list[float]) -> float:
    return nearest_rank(values, 0.99)


def judge(
    spec: PlanSpec, records: list[RequestRecord], *, by_model: bool = False
) -> dict[str, ServiceResult]:
    """Per-service figures and margins of a run's records (module docstring);
    ``by_model``: the records name the catalog model (a one-model simulator)."""
    out = {}
    for svc in spec.services:
        tag = svc.model if by_model else svc.name
        recs = [r for r in records if r.model == tag]
        if not recs:  # no request of this service in the run: nothing to miss
            out[svc.name] = ServiceResult(0, 0, 0.0, 0.0, 0.0, None, {})
            continue
        ttft, tpot, e2e = [], [], []
        lost = 0
        for r in recs:
            done = r.status == "finished" and r.finish_s is not None
            lost += not done
            ttft.append(r.ttft_s if done and r.ttft_s is not None else math.inf)
            e2e.append(r.e2e_s if done and r.e2e_s is not None else math.inf)
            if r.output_tokens >= 2:
                tp = r.tpot_s if done else None
                tpot.append(tp if tp is not None else math.inf)
        res = {"ttft_p99_s": _p99(ttft), "tpot_p99_s": _p99(tpot), "e2e_p99_s": _p99(e2e)}
        slo = svc.slo
        margins: dict[str, float] = {}
        for key, val in res.items():
            target = getattr(slo, key)
            if target is not None:
                margins[key] = target / val if val > 0 else math.inf
        att = None
        if slo.attainment_scale is not None:
            att = slo_attainment(recs, [slo.attainment_scale])[slo_key(slo.attainment_scale)]
            att = 0.0 if att is None else att
            margins["attainment"] = att / slo.attainment_min
        out[svc.name] = ServiceResult(
            len(recs), lost, res["ttft_p99_s"], res["tpot_p99_s"], res["e2e_p99_s"], att, margins
        )
    return out


def evaluate(task: EvalTask) -> Outcome:
    """Place and simulate ``task.point`` on the plan's traffic, and judge it."""
    t0 = time.perf_counter()
    spec, p = task.spec, task.point
    traffic = traffic_for(spec, task.base_dir, task.seed, task.rate_factor, task.window)
    cfg = config_from_dict(sim_config(spec, p, "traffic.jsonl", task.seed))
    common = {"seed": task.seed, "rate_factor": task.rate_factor, "window": task.window}
    world = plan_world(p.stack)
    try:
        if world == MULTI:
            result = run_multi_stack(
                get_stack(p.stack).name,
                traffic.services,
                list(traffic.history),
                list(traffic.run),
                multi_settings(cfg),
            )
        elif world == KUNSERVE:
            result = run_kun(cfg, one_model_requests(spec, traffic))
        else:
            result = Simulator(cfg, one_model_requests(spec, traffic)).run()
    except InputError:
        raise
    except FleetserveError as e:  # the stack cannot run on this pool (placement, Mell's cap)
        return Outcome(p, error=str(e), sim_wall_s=time.perf_counter() - t0, **common)  # type: ignore[arg-type]
    used = sum(g.end_s - g.start_s for g in result.gpu_intervals) / 3600.0
    return Outcome(
        p,
        judge(spec, result.records, by_model=world != MULTI),
        gpu_hours_used=used,
        sim_wall_s=time.perf_counter() - t0,
        **common,  # type: ignore[arg-type]
    )
