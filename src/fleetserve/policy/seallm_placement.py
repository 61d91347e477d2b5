"""SeaLLM's two-stage placement search (§4.1, Algorithm 1 in Appendix A.1).

Stage 1, group partition: for every tensor-parallel size ``p`` (a power of
two no larger than a node), the pool is cut into equal groups of ``p`` GPUs
(node-aligned). While the services cannot all be placed at once (checked by
first-fit: largest need first, each into the smallest group that can take it
next to those already there), two adjacent groups of the smallest size
(within a node) are merged into one twice as large.

Stage 2, service allocation (the greedy loop of Algorithm 1)::

    P = {}                                   # groups without services
    loop:
        UI_s = #SLO misses of s + alpha * L_N^s       (simulate P on history R)
        for b in groups by rate, lowest first:
            for s in services by UI, highest first:
                if b can take s: add s to b; next loop
        nothing added: stop
    M_est = simulate(P); keep the best P over all p:
            highest SLO attainment, then lowest normalized latency

A service not placed yet serves none of its requests: all are SLO misses.
A service may end up in several groups (replicas); the loop stops when no
group can take any further service (memory). The search over ``p`` runs in
parallel processes (SeaLLM runs its placement search in parallel).

Choices where the paper leaves details open (documented and tested):

* *A group's rate* (the "lowest request rate" order) is the sum over its
  services of the service's rate divided by the number of groups hosting it
  (the traffic the group expects); ties: group order.
* *Can allocate* ("checks if the GPU memory is enough ... with profiled memory
  usage"): with the service added, the group's KV memory (after every member's
  weights) must hold ``min_kv_requests`` requests of mean length of every
  member, and a service is never twice in one group.
* *Services per group*: ``max_services`` (default None: no limit) caps how
  many services one group may host. SeaLLM's evaluation (§6.1) shares "at
  most two LLM services per local engine because of the GPU memory
  limitation": ``max_services=2`` is that setting. With a cap, a TP size
  whose groups cannot host every service within it has no candidate.
* Constraint (3) of SeaLLM's problem (every service placed) is kept by a
  look-ahead the paper does not spell out: an allocation is skipped when it
  would leave some unplaced service no room at all (checked by first-fit),
  and at equal UI an unplaced service goes before a replica.
* The evaluator is injected (:data:`Evaluator`): the simulator provides one
  (:class:`fleetserve.sim.evaluate.PlanEvaluator`), so this module stays free
  of the simulator and of any clock.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from fleetserve.errors import ConfigError
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.spec.memory import group_kv_bytes
from fleetserve.spec.types import GpuSpec
from fleetserve.workload.service import Service

__all__ = [
    "Candidate",
    "Evaluator",
    "ServiceOutcome",
    "can_allocate",
    "group_partition",
    "seallm_allocate",
    "seallm_place",
]


@dataclass(frozen=True, slots=True)
class ServiceOutcome:
    """How a service fared in a simulated placement.

    Attributes:
        requests: its requests in the history.
        finished: those that finished in the simulation.
        slo_misses: those not finished within the SLO (unplaced: all).
        norm_latency: mean normalized latency of its finished requests (None:
            none finished).
    """

    requests: int
    finished: int
    slo_misses: int
    norm_latency: float | None


Evaluator = Callable[[PlacementPlan], Mapping[str, ServiceOutcome]]
"""Simulates a (possibly partial) plan on the history; outcome per service."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """The allocation found for one TP size, with its estimated performance."""

    tp: int
    plan: PlacementPlan
    slo_attainment: float
    norm_latency: float | None
    evaluations: int
    counters: Mapping[str, float] | None = field(default=None, compare=False)
    """The evaluator's counters over this TP size's search (what its
    ``counters()`` reports, e.g. simulations run and their seconds; None when
    it has none). Diagnostics only: not part of the result."""


def _check_max_services(max_services: int | None) -> None:
    if max_services is not None and (isinstance(max_services, bool) or max_services < 1):
        raise ConfigError(f"max_services must be None or >= 1, got {max_services!r}")


def can_allocate(
    members: Sequence[Service],
    svc: Service,
    tp: int,
    gpu: GpuSpec,
    mem_util: float,
    min_kv_requests: int,
    max_services: int | None = None,
) -> bool:
    """Whether a group of ``tp`` GPUs holding ``members`` can also take ``svc``
    (at most ``max_services`` services per group; None: no limit)."""
    if max_services is not None and len(members) >= max_services:
        return False
    if any(m.name == svc.name for m in members):
        return False
    svcs = [*members, svc]
    kv = group_kv_bytes([s.spec for s in svcs], tp, gpu, mem_util)
    need = sum(
        min_kv_requests * (s.mean_prompt + s.mean_output) * s.spec.kv_bytes_per_token for s in svcs
    )
    return kv > 0 and kv >= need


def group_partition(
    n_gpus: int,
    gpus_per_node: int,
    tp: int,
    services: Sequence[Service],
    gpu: GpuSpec,
    mem_util: float,
    min_kv_requests: int,
    max_services: int | None = None,
) -> list[tuple[int, ...]]:
    """Stage 1: equal groups of ``tp`` GPUs, merged pairwise until every
    service can be placed at once (node-aligned; a group never spans nodes),
    with at most ``max_services`` services per group (None: no limit).

    Raises:
        ConfigError: some service fits no group even after merging up to a
            node, or the groups cannot host every service (``max_services``).
    """
    _check_max_services(max_services)
    groups: list[tuple[int, ...]] = []
    for start in range(0, n_gpus, gpus_per_node):
        node = list(range(start, min(start + gpus_per_node, n_gpus)))
        groups += [tuple(node[i : i + tp]) for i in range(0, len(node) - tp + 1, tp)]

    sizes = [1 << k for k in range(gpus_per_node.bit_length())]

    def need(s: Service) -> int:
        """Smallest group size that can host ``s`` alone (0: none)."""
        return next((z for z in sizes if can_allocate([], s, z, gpu, mem_util, min_kv_requests)), 0)

    big_first = sorted(services, key=lambda s: (-need(s), -s.spec.weight_bytes, s.name))

    def placeable() -> bool:
        # all services placed at once: first-fit, largest need first, each into
        # the smallest group that can take it next to those already there
        members: list[list[Service]] = [[] for _ in groups]
        order = sorted(range(len(groups)), key=lambda i: (len(groups[i]), i))
        for svc in big_first:
            for i in order:
                if can_allocate(
                    members[i], svc, len(groups[i]), gpu, mem_util, min_kv_requests, max_services
                ):
                    members[i].append(svc)
                    break
            else:
                return False
        return True

    def fits_somewhere(s: Service) -> bool:
        return any(can_allocate([], s, len(g), gpu, mem_util, min_kv_requests) for g in groups)

    while not placeable():
        size = min(len(g) for g in groups)
        merged = False
        for i in range(len(groups) - 1):
            a, b = groups[i], groups[i + 1]
            same_node = a[0] // gpus_per_node == b[-1] // gpus_per_node
            if len(a) == size and len(b) == size and same_node and 2 * size <= gpus_per_node:
                groups[i : i + 2] = [a + b]
                merged = True
                break
        if not merged:
            worst = next((s for s in services if not fits_somewhere(s)), None)
            if worst is None and max_services is not None:
                raise ConfigError(
                    f"{len(services)} services cannot all be placed at once on "
                    f"{n_gpus} x {gpu.name} with groups of {tp} and at most "
                    f"{max_services} services per group"
                )
            if worst is not None:
                raise ConfigError(
                    f"service {worst.name} ({worst.spec.name}) fits no group of up to "
                    f"{gpus_per_node} x {gpu.name} at mem_util {mem_util}"
                )
            raise ConfigError(
                f"{len(services)} services cannot each get a group of their own on "
                f"{n_gpus} x {gpu.name} with groups of {tp}"
            )
    return groups


def _plan(
    groups: Sequence[tuple[int, ...]], members: Sequence[list[str]], n_gpus: int, note: str
) -> PlacementPlan:
    return PlacementPlan(
        tuple(
            GroupPlacement(g, len(g), tuple(m)) for g, m in zip(groups, members, strict=True) if m
        ),
        n_gpus,
        note,
    )


def _attainment(out: Mapping[str, ServiceOutcome]) -> tuple[float, float | None]:
    total = sum(o.requests for o in out.values())
    miss = sum(o.slo_misses for o in out.values())
    att = 1.0 - miss / total if total else 1.0
    w = sum(o.finished for o in out.values() if o.norm_latency is not None)
    nl = (
        sum(o.norm_latency * o.finished for o in out.values() if o.norm_latency is not None) / w
        if w
        else None
    )
    return att, nl


def _first_fit(
    groups: Sequence[tuple[int, ...]],
    members: Sequence[list[str]],
    todo: Sequence[Service],
    by_name: Mapping[str, Service],
    gpu: GpuSpec,
    mem_util: float,
    min_kv: int,
    max_services: int | None = None,
) -> bool:
    """Whether ``todo`` can still all be placed next to ``members`` (first-fit,
    largest weights first, smallest group first)."""
    mem = [[by_name[n] for n in m] for m in members]
    order = sorted(range(len(groups)), key=lambda i: (len(groups[i]), i))
    for svc in sorted(todo, key=lambda s: (-s.spec.weight_bytes, s.name)):
        for i in order:
            if can_allocate(mem[i], svc, len(groups[i]), gpu, mem_util, min_kv, max_services):
                mem[i].append(svc)
                break
        else:
            return False
    return True


def seallm_allocate(
    groups: Sequence[tuple[int, ...]],
    services: Sequence[Service],
    n_gpus: int,
    gpu: GpuSpec,
    evaluate: Evaluator,
    *,
    alpha: float = 1e-4,
    mem_util: float = 0.9,
    min_kv_requests: int = 8,
    max_services: int | None = None,
) -> tuple[PlacementPlan, int]:
    """Stage 2 on one partition: the greedy loop; returns (plan, evaluations).

    ``max_services``: services per group at most (None: no limit).
    """
    _check_max_services(max_services)
    by_name = {s.name: s for s in services}
    members: list[list[str]] = [[] for _ in groups]
    evaluations = 0
    while True:
        out = evaluate(_plan(groups, members, n_gpus, ""))
        evaluations += 1
        ui = {
            s: o.slo_misses + alpha * (o.norm_latency if o.norm_latency is not None else 0.0)
            for s, o in out.items()
        }
        hosts: dict[str, int] = {}
        for names in members:
            for name in names:
                hosts[name] = hosts.get(name, 0) + 1
        rates = [sum(by_name[n].rate / hosts[n] for n in names) for names in members]
        order = sorted(range(len(groups)), key=lambda i: (rates[i], i))
        # highest UI first; at equal UI a service not placed yet goes first
        by_ui = sorted(services, key=lambda x: (-ui.get(x.name, 0.0), x.name in hosts, x.name))
        added = False
        for i in order:
            ms = [by_name[n] for n in members[i]]
            for svc in by_ui:
                if not can_allocate(
                    ms, svc, len(groups[i]), gpu, mem_util, min_kv_requests, max_services
                ):
                    continue
                members[i].append(svc.name)
                unplaced = [x for x in services if x.name not in hosts and x.name != svc.name]
                if _first_fit(
                    groups, members, unplaced, by_name, gpu, mem_util, min_kv_requests, max_services
                ):
                    added = True
                    break
                members[i].pop()  # it would leave some service no room at all
            if added:
                break
        if not added:
            break
    return _plan(groups, members, n_gpus, ""), evaluations


def _counters(evaluate: Evaluator) -> dict[str, float] | None:
    get = getattr(evaluate, "counters", None)
    return dict(get()) if callable(get) else None


def _search_one(
    args: tuple[int, Sequence[Service], int, GpuSpec, Evaluator, float, float, int, int | None],
) -> Candidate | None:
    tp, services, n_gpus, gpu, evaluate, alpha, mem_util, min_kv, max_services = args
    try:
        groups = group_partition(
            n_gpus, gpu.gpus_per_node, tp, services, gpu, mem_util, min_kv, max_services
        )
    except ConfigError:
        return None
    before = _counters(evaluate)
    plan, n = seallm_allocate(
        groups,
        services,
        n_gpus,
        gpu,
        evaluate,
        alpha=alpha,
        mem_util=mem_util,
        min_kv_requests=min_kv,
        max_services=max_services,
    )
    placed = {s for g in plan.groups for s in g.services}
    if placed != {s.name for s in services}:
        return None  # some service found no room in this partition
    att, nl = _attainment(evaluate(plan))
    after = _counters(evaluate)
    diag = None
    if before is not None and after is not None:
        diag = {k: v - before.get(k, 0.0) for k, v in after.items()}
    note = f"seallm: tp {tp}, {len(plan.groups)} groups, SLO {att:.3f}, evaluations {n + 1}"
    return Candidate(tp, PlacementPlan(plan.groups, n_gpus, note), att, nl, n + 1, diag)


def seallm_place(
    services: Sequence[Service],
    n_gpus: int,
    gpu: GpuSpec,
    evaluate: Evaluator,
    *,
    alpha: float = 1e-4,
    mem_util: float = 0.9,
    min_kv_requests: int = 8,
    max_services: int | None = None,
    processes: int | None = None,
    tp_sizes: Collection[int] | None = None,
) -> tuple[PlacementPlan, list[Candidate]]:
    """SeaLLM's placement: the best allocation over all TP sizes.

    Args:
        services: the services (rates and mean lengths from the history).
        n_gpus: GPUs in the pool.
        gpu: GPU type (``gpus_per_node`` bounds the TP size).
        evaluate: simulates a plan on the history (must be picklable when
            ``processes`` > 1).
        alpha: weight of normalized latency in the unserved index (1e-4).
        mem_util: share of each GPU's memory the engines may use.
        min_kv_requests: KV room a group must keep per member (see module docstring).
        max_services: services one group may host at most (None: no limit, the
            default). SeaLLM's evaluation setting is 2 (§6.1: "at most two LLM
            services per local engine because of the GPU memory limitation").
        processes: parallel searches (default: one per TP size, at most the
            CPUs); the larger TP sizes, whose groups share among more services
            and take longer to simulate, start first.
        tp_sizes: the TP sizes searched (None: every power of two up to a
            node, SeaLLM's own enumeration); sizes the pool cannot hold are
            skipped.

    Returns:
        The best plan and every TP size's candidate.

    Raises:
        ConfigError: no TP size places every service.
    """
    if not services:
        raise ConfigError("no services to place")
    _check_max_services(max_services)
    sizes = []
    p = 1
    while p <= min(gpu.gpus_per_node, n_gpus):
        if tp_sizes is None or p in tp_sizes:
            sizes.append(p)
        p *= 2
    jobs = [
        (tp, list(services), n_gpus, gpu, evaluate, alpha, mem_util, min_kv_requests, max_services)
        for tp in sizes
    ]
    procs = processes if processes is not None else min(len(jobs), os.cpu_count() or 1)
    if procs > 1 and len(jobs) > 1:
        # longest first (largest TP) so that the last job to finish is a short one
        with ProcessPoolExecutor(max_workers=min(procs, len(jobs))) as ex:
            found = list(ex.map(_search_one, jobs[::-1]))[::-1]
    else:
        found = [_search_one(j) for j in jobs]
    cands = [c for c in found if c is not None]
    if not cands:
        raise ConfigError(
            f"SeaLLM placement: no tensor-parallel size places all {len(services)} services "
            f"on {n_gpus} x {gpu.name}"
        )
    best = max(
        cands,
        key=lambda c: (
            round(c.slo_attainment, 12),
            -(c.norm_latency if c.norm_latency is not None else math.inf),
            -c.tp,
        ),
    )
    return best.plan, cands
