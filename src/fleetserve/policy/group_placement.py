"""Placement of services into sharing groups (the multi-LLM ``placement`` family).

Every placement returns a :class:`~fleetserve.policy.groups.PlacementPlan`:

* ``dedicated`` (vLLM): no sharing. Each service gets instances of its own on
  the smallest power-of-two TP degree it fits, one first, then the remaining
  GPUs one instance at a time to the service with the highest rate per
  instance (the pool split by rate). Instances never span nodes.
* ``muxserve``: MuxServe's enumeration-based greedy (Algorithms 1-2,
  :mod:`fleetserve.policy.muxserve_placement`). AlpaServe's stack uses it too
  (the issue's ``alpaserve`` = MuxServe's placement with temporal FCFS).
* ``seallm``: SeaLLM's two-stage search evaluated by simulation
  (:mod:`fleetserve.policy.seallm_placement`); it needs an evaluator.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from fleetserve.costmodel import CostModel
from fleetserve.errors import ConfigError, UnknownNameError
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.policy.muxserve_placement import muxserve_place
from fleetserve.policy.placement import dedicated_counts
from fleetserve.policy.seallm_placement import Evaluator, seallm_place
from fleetserve.spec.memory import min_tp
from fleetserve.spec.types import GpuSpec, ModelSpec
from fleetserve.workload.service import Service

__all__ = ["GROUP_PLACEMENTS", "dedicated_place", "dedicated_tp", "place_services"]


def _alloc(sizes: Sequence[int], n_gpus: int, per_node: int) -> list[tuple[int, ...]] | None:
    """Node-aligned consecutive GPU ids for instances of ``sizes`` (largest
    first, first fit); None if they do not fit."""
    free = [min(per_node, n_gpus - s) for s in range(0, n_gpus, per_node)]
    used = [0] * len(free)
    out: list[tuple[int, ...] | None] = [None] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        z = sizes[i]
        for n, cap in enumerate(free):
            if cap - used[n] >= z:
                start = n * per_node + used[n]
                out[i] = tuple(range(start, start + z))
                used[n] += z
                break
        else:
            return None
    return [g for g in out if g is not None]


def dedicated_tp(
    model: ModelSpec,
    gpu: GpuSpec,
    mem_util: float = 0.9,
    tp_sizes: Collection[int] | None = None,
    *,
    name: str | None = None,
) -> int:
    """The TP degree dedicated placement gives ``model``: the smallest allowed
    size (``tp_sizes``; None: any power of two) at or above the least it fits on
    (:func:`~fleetserve.spec.memory.min_tp`), within a node.

    Raises:
        ConfigError: the model fits no node of ``gpu``, or no allowed size
            (``name``, the service's, goes in the message).
    """
    least = min_tp(model, gpu, mem_util, gpu.gpus_per_node)
    if tp_sizes is None:
        return least
    fits = [t for t in sorted(tp_sizes) if least <= t <= gpu.gpus_per_node]
    if not fits:
        who = f"service {name!r}: " if name is not None else ""
        raise ConfigError(
            f"{who}{model.name} needs at least {least} x {gpu.name}; "
            f"no allowed tensor-parallel size ({', '.join(map(str, sorted(tp_sizes)))}) "
            f"is between {least} and a node ({gpu.gpus_per_node} GPUs)"
        )
    return fits[0]


def dedicated_place(
    services: Sequence[Service],
    n_gpus: int,
    gpu: GpuSpec,
    mem_util: float = 0.9,
    tp_sizes: Collection[int] | None = None,
) -> PlacementPlan:
    """vLLM's spatial partition (see the module docstring).

    Args:
        services: the services.
        n_gpus: GPUs in the pool.
        gpu: the GPU type.
        mem_util: share of each GPU's memory the engines may use.
        tp_sizes: the tensor-parallel sizes allowed; each service runs on the
            smallest allowed size at or above the least it fits on (None: that
            least size, :func:`~fleetserve.spec.memory.min_tp`).

    Raises:
        ConfigError: one instance of every service does not fit the pool, or a
            service fits no allowed size.
    """
    tps = {s.name: dedicated_tp(s.spec, gpu, mem_util, tp_sizes, name=s.name) for s in services}
    names = sorted(tps)

    def layout(count: Mapping[str, int]) -> list[tuple[int, ...]] | None:
        return _alloc([tps[m] for m in names for _ in range(count[m])], n_gpus, gpu.gpus_per_node)

    if layout(dict.fromkeys(names, 1)) is None:
        need = sum(tps.values())
        raise ConfigError(
            f"placement 'dedicated' needs {need} GPUs for one instance of each of "
            f"{len(names)} services (node-aligned); the pool has {n_gpus}"
        )
    count = dedicated_counts({s.name: s.rate for s in services}, lambda c: layout(c) is not None)
    order = [m for m in names for _ in range(count[m])]
    sizes = [tps[m] for m in order]
    gpus = _alloc(sizes, n_gpus, gpu.gpus_per_node)
    assert gpus is not None
    groups = [GroupPlacement(g, z, (m,)) for g, z, m in zip(gpus, sizes, order, strict=True)]
    return PlacementPlan(
        tuple(groups),
        n_gpus,
        "dedicated: " + ", ".join(f"{m} x{count[m]} (tp {tps[m]})" for m in names),
    )


GROUP_PLACEMENTS = ("dedicated", "muxserve", "seallm")


def place_services(
    name: str,
    services: Sequence[Service],
    n_gpus: int,
    gpu: GpuSpec,
    *,
    cost_model: CostModel | None = None,
    mem_util: float = 0.9,
    evaluate: Evaluator | None = None,
    tp_sizes: Sequence[int] | None = None,
    **params: Any,
) -> tuple[PlacementPlan, float | None]:
    """Run placement ``name`` (one of :data:`GROUP_PLACEMENTS`): the one
    dispatch over the multi-LLM placements (the simulator's runs, the
    planner and the runtime all place through it).

    Returns:
        The plan and, for ``seallm`` (which simulates its candidates through
        ``evaluate``), its estimated SLO attainment (None otherwise).

    Raises:
        UnknownNameError: an unknown placement.
        ConfigError: the services do not fit, or ``seallm`` without an evaluator.
    """
    if name == "dedicated":
        return dedicated_place(services, n_gpus, gpu, mem_util, tp_sizes), None
    if name == "muxserve":
        cm = cost_model or CostModel()
        return muxserve_place(services, n_gpus, gpu, cm, mem_util, tp_sizes=tp_sizes), None
    if name == "seallm":
        if evaluate is None:
            raise ConfigError(
                "placement 'seallm' evaluates candidates by simulation: give an evaluator"
            )
        plan, cands = seallm_place(
            services, n_gpus, gpu, evaluate, mem_util=mem_util, tp_sizes=tp_sizes, **params
        )
        return plan, next(c.slo_attainment for c in cands if c.plan == plan)
    raise UnknownNameError("placement", name, GROUP_PLACEMENTS)
