"""Placement evaluation by simulation (SeaLLM's estimator of a candidate plan).

:class:`PlanEvaluator` simulates a (possibly partial) placement plan on a
history of requests and reports, per service, its requests, SLO misses and
normalized latency (:class:`~fleetserve.policy.seallm_placement.ServiceOutcome`).

Groups only interact through services they share (dispatch picks among a
service's groups), so the plan is split into *components*: groups linked by
a common service. Each component is simulated on its own services' requests,
and results are cached by the component's exact composition, so a search that
changes one group re-simulates only that group's component. A service that
no group hosts serves none of its requests: every one is an SLO miss.

Each component simulation stops at ``horizon_factor`` times the history's
span past its start; requests still unfinished then are misses.

:meth:`PlanEvaluator.counters` reports the work done so far (component
lookups, simulations run, their wall time): the placement search copies them
into each candidate (diagnostics only; results never depend on them).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from heapq import merge

from fleetserve.costmodel import CostModel
from fleetserve.metrics.records import RequestRecord
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.policy.seallm_placement import ServiceOutcome
from fleetserve.sim.multi import MultiConfig, MultiSimulator
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

__all__ = ["PlanEvaluator"]

_Key = tuple[tuple[tuple[int, ...], int, tuple[str, ...]], ...]


class PlanEvaluator:
    """Simulates plans on ``requests`` (picklable: safe for a process pool).

    Args:
        config: the run settings (``n_gpus`` and ``max_time_s`` are set per
            component).
        services: every service by name.
        requests: the history, sorted by arrival (any ids).
        slo_scale: SLO = ``slo_scale`` × the request's execution time (SeaLLM: 5).
        horizon_factor: a component's simulation stops at this many times the
            history's span.
        cost_model: iteration times.
    """

    def __init__(
        self,
        config: MultiConfig,
        services: Mapping[str, Service],
        requests: Sequence[Request],
        *,
        slo_scale: float = 5.0,
        horizon_factor: float = 2.0,
        cost_model: CostModel | None = None,
    ) -> None:
        self.cfg = config
        self.services = dict(services)
        self.requests = list(requests)
        self.slo_scale = slo_scale
        self.cost_model = cost_model or CostModel()
        self.by_service: dict[str, list[Request]] = {s: [] for s in self.services}
        for r in self.requests:
            self.by_service[r.model].append(r)
        if self.requests:
            span = self.requests[-1].arrival_s - self.requests[0].arrival_s
            self.t0 = self.requests[0].arrival_s
            self.horizon = max(1.0, horizon_factor * span)
        else:
            self.t0, self.horizon = 0.0, 1.0
        self._cache: dict[_Key, dict[str, ServiceOutcome]] = {}
        # each service's requests by (arrival, id): a component's history merges them
        self._ordered = {
            s: sorted(rs, key=lambda r: (r.arrival_s, r.id)) for s, rs in self.by_service.items()
        }
        self.evaluations = 0  # plans evaluated
        self.simulations = 0  # components simulated (cache misses)
        self.lookups = 0  # components looked up (hits + misses)
        self.sim_seconds = 0.0  # wall time of the simulations
        self.sim_requests = 0  # requests simulated, over all simulations

    def counters(self) -> dict[str, float]:
        """Work so far (totals): ``evaluations`` (plans), ``lookups``
        (components), ``simulations`` (cache misses), ``sim_s`` (their wall
        time) and ``sim_requests`` (requests they simulated)."""
        return {
            "evaluations": self.evaluations,
            "lookups": self.lookups,
            "simulations": self.simulations,
            "sim_s": self.sim_seconds,
            "sim_requests": self.sim_requests,
        }

    def __call__(self, plan: PlacementPlan) -> dict[str, ServiceOutcome]:
        self.evaluations += 1
        out: dict[str, ServiceOutcome] = {}
        for comp in self._components(plan.groups):
            out.update(self._component(comp))
        for s, reqs in self.by_service.items():
            if s not in out:
                out[s] = ServiceOutcome(len(reqs), 0, len(reqs), None)
        return out

    @staticmethod
    def _components(groups: Sequence[GroupPlacement]) -> list[list[GroupPlacement]]:
        parent = list(range(len(groups)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        first: dict[str, int] = {}
        for i, g in enumerate(groups):
            for s in g.services:
                j = first.setdefault(s, i)
                parent[find(i)] = find(j)
        comps: dict[int, list[GroupPlacement]] = {}
        for i, g in enumerate(groups):
            comps.setdefault(find(i), []).append(g)
        return list(comps.values())

    def _component(self, groups: list[GroupPlacement]) -> dict[str, ServiceOutcome]:
        key: _Key = tuple(sorted((g.gpus, g.tp, tuple(sorted(g.services))) for g in groups))
        self.lookups += 1
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        names = sorted({s for g in groups for s in g.services})
        # renumber GPUs (the simulation only needs them distinct)
        n = 0
        local = []
        for g in groups:
            local.append(GroupPlacement(tuple(range(n, n + len(g.gpus))), g.tp, g.services))
            n += len(g.gpus)
        # the services' requests by (arrival, id), as sorting them all would
        # (merge keeps the order of its inputs on ties, as a stable sort does)
        reqs = [
            replace(r, id=i)
            for i, r in enumerate(
                merge(*(self._ordered[s] for s in names), key=lambda r: (r.arrival_s, r.id))
            )
        ]
        cfg = replace(self.cfg, n_gpus=n, max_time_s=self.t0 + self.horizon, check_integrity=False)
        svcs = {s: self.services[s] for s in names}
        sim = MultiSimulator(
            cfg, svcs, PlacementPlan(tuple(local), n), reqs, cost_model=self.cost_model
        )
        t0 = time.perf_counter()
        res = sim.run()
        dt = time.perf_counter() - t0
        self.simulations += 1
        self.sim_seconds += dt
        self.sim_requests += len(reqs)
        by_model: dict[str, list[RequestRecord]] = {s: [] for s in names}
        for rec in res.records:
            by_model[rec.model].append(rec)
        out: dict[str, ServiceOutcome] = {}
        for s in names:
            recs = by_model[s]
            fin = [r for r in recs if r.status == "finished" and r.finish_s is not None]
            ok = sum(
                1
                for r in fin
                if r.finish_s is not None and r.finish_s - r.arrival_s <= self.slo_scale * r.ideal_s
            )
            nl = [
                (r.finish_s - r.arrival_s) / r.ideal_s for r in fin if r.finish_s and r.ideal_s > 0
            ]
            out[s] = ServiceOutcome(
                len(recs), len(fin), len(recs) - ok, sum(nl) / len(nl) if nl else None
            )
        self._cache[key] = out
        return out
