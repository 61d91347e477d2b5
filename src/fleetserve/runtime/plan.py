"""Which models each runtime worker hosts (torch-free, so the simulator's
fidelity runs can place the emulated cluster exactly as ``serve`` does).

Two kinds of placement reach the runtime:

* **One model per worker** (single-model stacks: ``vllm``, ``bf``, ``wf``,
  ``ll``, ``llumnix``, ``mell``): the ``placement`` policy of the stack
  (``dedicated``) splits the workers over the served models.
* **Sharing groups** (multi-LLM stacks: ``muxserve``, ``alpaserve``,
  ``seallm`` and their ablations: the multi-LLM stacks of
  :data:`~fleetserve.policy.catalog.STACKS`): the stack's group
  placement (MuxServe's greedy, SeaLLM's search, or ``dedicated``) returns a
  :class:`~fleetserve.policy.groups.PlacementPlan` whose groups may put
  several models on one GPU; each such worker's engine holds all of them in
  its one paged arena (weights of every member, one KV pool they share — the
  group's KV memory of the simulator, :func:`fleetserve.spec.memory.group_kv_bytes`).

How a sharing placement is run here, where the simulator and the papers
leave the runtime's side open (:func:`sharing_placement`):

* **Inputs, as the simulator's.** The services are the served models (one
  service per ``serve.models`` entry, named as requests name it); a
  ``services:`` list may be given instead, with the same names and models.
  Their rates and mean lengths are measured, as ``fleetserve simulate`` does
  for a ``services:`` config (:func:`fleetserve.sim.multi_build.build_multi`),
  on the first ``multi.history_s`` seconds of the config's ``workload``
  (a trace, or the built-in synthetic workload; ``workload.models`` /
  ``model_weights`` assign its requests to the services, uniformly when
  unset). That history is all the placement sees; unlike a simulation the
  workload need not last past it. ``multi.generator`` workloads are of
  catalog models the runtime cannot load: refused.
* **GPU.** Every worker is the emulated GPU of its arena
  (``emu-<serve.gpu_memory_mb>mib``, :mod:`fleetserve.spec.emulated`) at
  ``mem_util`` 1 — the arena is the budget — so a group fits exactly when the
  engine can hold its members' weights and KV; on ``cuda`` workers the arena
  is the same budget and the emulated GPU's nominal speeds only rank the
  candidates. The pool is ``serve.workers`` such GPUs, engine limits
  ``serve.max_running`` / ``serve.max_batch_tokens``.
* **One GPU per group replica.** The runtime runs one engine per worker and
  neither tensor nor pipeline parallelism across workers, so the placement
  is told that a node holds one GPU: it then only considers tensor degree 1.
  A group of several GPUs is data-parallel replicas of its member set (as
  the simulator runs it): one worker per GPU, each hosting the whole set. A
  plan with a group of ``tp > 1`` (impossible with that GPU, but checked) is
  a :class:`~fleetserve.errors.ConfigError`. GPUs the plan leaves unused
  start no worker (the simulator leaves them idle too).
* **The simulator's placement, injected.** The placement itself is the
  simulator's (:func:`fleetserve.sim.multi_build.history_placement`: SeaLLM's
  search simulates its candidates), and the runtime and the simulator are
  sibling layers: the caller (``fleetserve serve``, the fidelity experiment)
  passes it in as a :data:`SharingPlacer`.
* **Re-placed as the simulator does.** SeaLLM's adaptive replacement runs
  at runtime (:mod:`fleetserve.runtime.replace`): every interval the
  controller measures the SLO attainment, adapts the interval (Equation 8),
  asks the injected :class:`SharingReplanner` (the simulator's search on the
  last interval's requests) for a plan, and switches live workers to it
  (models loaded and unloaded, their requests moved).
* **Scheduling.** A worker hosting several models runs the stack's group
  scheduler (``batching``: FCFS, RR, MLFQ, DB, or ADBS with its token-block
  quotas) in its engine, job by job as the simulated group does
  (:func:`fleetserve.policy.batching.engine_batching`,
  :mod:`fleetserve.runtime.engine.group`), over one arena whose pages are
  one KV head wide (a head-wise unified cache). The schedulers that read
  per-service statistics get the placer's: L̂_s, σ_s and seconds per prompt
  token from the cost model on the placement GPU over the history, and the
  history's rates (:func:`fleetserve.sim.multi.service_stats`, what a
  simulation of the same services computes). Jobs then run for measured
  times, so on an uncalibrated emulated GPU the statistics and the
  durations differ by the cost model's error on this CPU (the fidelity
  experiment measures it). The controller's families for a multi-LLM stack are those
  of stack ``ll`` (:func:`runtime_policy_config`): dispatch ``least_loaded``
  — among the workers hosting a request's model, the one with the fewest of
  that model's requests, the multi-LLM simulator's own rule — no migration,
  a static pool; ``policy.dispatch`` / ``batching`` / ``migration`` override
  them as for any stack.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from fleetserve.config import PolicyConfig, ServiceConfig, SimConfig
from fleetserve.errors import ConfigError
from fleetserve.policy.base import PLACEMENT
from fleetserve.policy.catalog import (
    MULTI,
    SINGLE,
    STACKS,
    Stack,
    kun_only,
    resolve_policies,
    stack_for,
    with_family_overrides,
)
from fleetserve.policy.groups import PlacementPlan
from fleetserve.policy.sharing import BATCHING, ServiceStats
from fleetserve.spec.emulated import emulated_gpu
from fleetserve.spec.types import GpuSpec
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

__all__ = [
    "ReplannerFactory",
    "SharingPlacement",
    "SharingPlacer",
    "SharingReplanner",
    "placed_workers",
    "plan_workers",
    "runtime_policy_config",
    "runtime_policy_names",
    "sharing_placement",
    "sharing_stack",
]

logger = logging.getLogger(__name__)

SharingPlacer = Callable[
    [Stack, SimConfig, GpuSpec],
    tuple[Mapping[str, Service], PlacementPlan, float | None, Mapping[str, ServiceStats]],
]
"""``placer(stack, config, gpu) -> (services, plan, estimate, statistics)``: the
stack's placement of a multi-LLM ``config``'s services on its history, on
``gpu``, and the statistics its group scheduler reads
(:func:`fleetserve.sim.multi_build.history_placement`; see the module docstring)."""


class SharingReplanner(Protocol):
    """SeaLLM's re-placement search, as the runtime asks it
    (:class:`fleetserve.sim.multi_build.RuntimeReplanner` is the simulator's;
    the caller injects it as it injects the :data:`SharingPlacer`)."""

    def place(
        self, window: Sequence[Request], window_s: float
    ) -> tuple[PlacementPlan, float | None, Mapping[str, ServiceStats]]:
        """A new plan from the requests of the last ``window_s`` seconds, its
        estimated SLO attainment and the group schedulers' statistics."""
        ...

    def ideal_s(self, model: str, prompt_tokens: int, output_tokens: int) -> float:
        """A request's execution time alone (the base of its SLO)."""
        ...


ReplannerFactory = Callable[["SharingPlacement", int], SharingReplanner]
"""``factory(placement, n_workers)``: the replanner of a served sharing
placement over ``n_workers`` workers."""

RUNTIME_SHARING_BASE_STACK = "ll"
"""The single-model stack whose dispatch, batching, migration and memory the
controller runs under a multi-LLM stack (see the module docstring)."""


def sharing_stack(config: SimConfig) -> Stack | None:
    """The multi-LLM stack the runtime places sharing groups for, or None.

    A config is a sharing config when it is a multi-LLM config
    (``services:`` given) or when ``policy.stack`` is a multi-LLM stack that
    is not also a single-model one (``vllm`` names both; as a single-model
    stack its ``dedicated`` placement gives the same one-model workers).

    Raises:
        ConfigError: a sharing config on an elastic pool, or with
            ``multi.generator``.
        UnknownNameError: ``services:`` given with a stack that is not a
            multi-LLM stack.
    """
    name = config.policy.stack
    known = STACKS.get(name)
    if not config.is_multi and (known is None or known.runs_in(SINGLE) or not known.runs_in(MULTI)):
        return None
    stack = stack_for(name, MULTI)
    if config.multi.generator is not None:
        raise ConfigError(
            f"multi.generator {config.multi.generator!r} makes services of catalog models "
            "the runtime cannot load; serve the engine's models (serve.models) instead"
        )
    if config.cluster.elastic:
        raise ConfigError(
            f"stack {stack.name!r} places sharing groups on a fixed pool: leave "
            "cluster.elastic unset (serve.workers GPUs) or use a single-model stack"
        )
    pol = config.policy
    return with_family_overrides(stack, batching=pol.batching, placement=pol.placement)


def runtime_gaps(stack: Stack, threads: int = 1, spatial_shares: bool = False) -> list[str]:
    """What the runtime does not run of multi-LLM ``stack`` (the simulator
    does) with ``threads`` CPU threads a worker (``serve.threads_per_worker``)
    and ``serve.spatial_shares``, one line each; logged as a warning when the
    stack is served, so a difference between the two clocks is never silent.
    Runtime parity is issue 24's work."""
    out = []
    if BATCHING.get(stack.batching).spatial and not spatial_shares:
        out.append(
            f"spatial sharing ({stack.batching!r}): serve.spatial_shares is off (the "
            "default), so a worker's jobs run one at a time"
        )
    elif BATCHING.get(stack.batching).spatial and threads < 2:
        out.append(
            f"spatial sharing ({stack.batching!r}): with one thread a worker, its jobs run "
            "one at a time (set serve.threads_per_worker: 2 or more to run them at once)"
        )
    if stack.memory == "elastic":
        out.append("elastic groups: every worker keeps its weights loaded")
    if stack.mechanism != "kv":
        out.append(f"migration mechanism {stack.mechanism!r}: nothing is re-placed to migrate")
    if stack.pressure != "queue":
        out.append(f"pressure {stack.pressure!r} among groups: workers queue under pressure")
    return out


def runtime_policy_config(config: SimConfig) -> SimConfig:
    """The config the controller resolves its policy families from.

    A single-model stack: ``config`` itself. A multi-LLM stack: its
    ``policy`` section with stack :data:`RUNTIME_SHARING_BASE_STACK` (per-family
    overrides kept), ``services`` dropped (module docstring)."""
    if sharing_stack(config) is None:
        return config
    pol = config.policy
    return replace(
        config,
        services=None,
        policy=PolicyConfig(
            stack=RUNTIME_SHARING_BASE_STACK,
            dispatch=pol.dispatch,
            batching=pol.batching,
            migration=pol.migration,
            memory=pol.memory,
        ),
    )


def runtime_policy_names(config: SimConfig) -> dict[str, str]:
    """The policy of every family the runtime runs (``/v1/cluster``):
    :func:`~fleetserve.policy.catalog.resolve_policies` of
    :func:`runtime_policy_config`, with ``stack``, ``placement`` and
    ``batching`` (unless overridden) the multi-LLM stack's own for a sharing
    config. A KunServe stack: the
    ``vllm`` stack's families (per-family overrides kept), ``stack`` its
    own name and ``pressure: kunserve`` (its memory decisions come from
    :class:`~fleetserve.policy.kunserve.KunServePolicy`, see
    :mod:`fleetserve.runtime.kun_control`)."""
    if kun_only(config.policy.stack):
        base = replace(config, policy=replace(config.policy, stack="vllm"))
        return {**resolve_policies(base), "stack": config.policy.stack, "pressure": "kunserve"}
    names = resolve_policies(runtime_policy_config(config))
    stack = sharing_stack(config)
    if stack is not None:
        names["stack"] = stack.name
        names["placement"] = stack.placement  # overrides applied (sharing_stack)
        names["batching"] = stack.batching  # the group scheduler
    return names


@dataclass(frozen=True, slots=True)
class SharingPlacement:
    """A sharing placement and what it was computed from.

    Attributes:
        stack: the multi-LLM stack.
        plan: the placement policy's plan (GPU ids are worker slots).
        services: the services placed (rates and mean lengths of the history).
        gpu: the GPU the placement saw (emulated, one per node).
        estimate: SeaLLM's estimated SLO attainment of the plan (None otherwise).
        workers: the services each started worker hosts, by ascending GPU id
            (GPUs the plan leaves unused are left out).
        stats: what the group scheduler reads of each service.
        config: the multi-LLM simulator's config of the same cluster that the
            placement ran on (services, emulated GPU, pool, engine limits).
    """

    stack: Stack
    plan: PlacementPlan
    services: Mapping[str, Service]
    gpu: GpuSpec
    estimate: float | None
    workers: tuple[tuple[str, ...], ...]
    stats: Mapping[str, ServiceStats]
    config: SimConfig


def placement_gpu(config: SimConfig) -> GpuSpec:
    """One worker as the GPU a sharing placement sees: its arena as an emulated
    GPU, with one GPU per node (so no group spans workers)."""
    sv = config.serve
    gpu = emulated_gpu(
        sv.gpu_memory_mb,
        dtype=sv.dtype,
        threads=sv.threads_per_worker,
        block_size=config.cluster.block_size,
    )
    return replace(gpu, gpus_per_node=1)


def _placement_config(
    config: SimConfig, models: Sequence[str], sources: Mapping[str, str]
) -> SimConfig:
    """``config`` as the multi-LLM simulator's config of the same cluster."""
    sv, cl = config.serve, config.cluster
    if config.services is not None:
        given = {s.name: s.model for s in config.services}
        if set(given) != set(models):
            raise ConfigError(
                f"services {sorted(given)} must be the served models {sorted(models)} "
                "(one service per entry of serve.models, named as requests name it)"
            )
        for name, model in given.items():
            if model not in (name, sources.get(name, name)):
                raise ConfigError(
                    f"service {name!r} names model {model!r}, but the runtime serves "
                    f"{sources.get(name, name)!r} under that name"
                )
    services = tuple(ServiceConfig(m, sources.get(m, m)) for m in models)
    gpu = placement_gpu(config)
    return replace(
        config,
        services=services,
        cluster=replace(cl, gpu=gpu.name, gpus=sv.workers, elastic=False, mem_util=1.0, tp=1),
        engine=replace(
            config.engine, max_num_seqs=sv.max_running, max_batched_tokens=sv.max_batch_tokens
        ),
    )


def sharing_placement(
    config: SimConfig,
    models: Sequence[str],
    sources: Mapping[str, str] | None = None,
    *,
    placer: SharingPlacer | None = None,
) -> SharingPlacement:
    """Run the multi-LLM stack's placement for the runtime (module docstring).

    Args:
        config: a sharing config (:func:`sharing_stack` is not None).
        models: the served model names (what requests name).
        sources: each served name's engine model (built-in name or checkpoint
            folder) when it differs from the name.
        placer: the simulator's placement (:data:`SharingPlacer`); required.

    Raises:
        ConfigError: not a sharing config, no ``placer``, the services do not
            fit, a bad ``services:`` list or workload, or a group spanning GPUs.
    """
    stack = sharing_stack(config)
    if stack is None:
        raise ConfigError(f"stack {config.policy.stack!r} does not place sharing groups")
    if not models:
        raise ConfigError("no model to place")
    if placer is None:
        raise ConfigError(
            f"stack {stack.name!r} places sharing groups with the simulator's placement; "
            "pass placer=fleetserve.sim.multi_build.history_placement"
        )
    for gap in runtime_gaps(stack, config.serve.threads_per_worker, config.serve.spatial_shares):
        logger.warning("stack %s at runtime: not run: %s", stack.name, gap)
    pcfg = _placement_config(config, models, dict(sources or {}))
    gpu = placement_gpu(config)
    services, plan, est, stats = placer(stack, pcfg, gpu)
    slots: dict[int, tuple[str, ...]] = {}
    for g in plan.groups:
        if g.tp != 1:
            raise ConfigError(
                f"placement {stack.placement!r} put {', '.join(g.services)} on a tensor-parallel "
                f"group of {g.tp} GPUs; the runtime runs one engine per worker (tp 1)"
            )
        for gid in g.gpus:
            slots[gid] = tuple(g.services)
    workers = tuple(slots[gid] for gid in sorted(slots))
    if len(workers) < config.serve.workers:
        logger.info(
            "placement %s uses %d of %d workers",
            stack.placement,
            len(workers),
            config.serve.workers,
        )
    return SharingPlacement(stack, plan, services, gpu, est, workers, dict(stats), pcfg)


def plan_workers(
    config: SimConfig,
    models: Sequence[str],
    sources: Mapping[str, str] | None = None,
    *,
    placer: SharingPlacer | None = None,
) -> list[tuple[str, ...]]:
    """The models each worker hosts (:func:`placed_workers` without the statistics)."""
    return placed_workers(config, models, sources, placer=placer)[0]


def placed_workers(
    config: SimConfig,
    models: Sequence[str],
    sources: Mapping[str, str] | None = None,
    *,
    placer: SharingPlacer | None = None,
) -> tuple[list[tuple[str, ...]], Mapping[str, ServiceStats]]:
    """The models each worker hosts, from the placement policy, and the
    statistics of each service a group scheduler reads (a sharing placement's;
    none otherwise).

    A sharing config (a multi-LLM stack, :func:`sharing_stack`): the stack's
    group placement (:func:`sharing_placement`); a worker may host several
    models. Otherwise, a fixed pool (``cluster.elastic: false``, the default
    for ``serve``) asks the ``placement`` policy for one single-model
    instance per worker, with the models' rates from ``workload.model_weights``
    (equal when unset). An elastic pool (Mell) loads its single model on
    every worker; workers become active when a policy activates them.

    Args:
        config: the runtime config.
        models: the served model names.
        sources: served name -> engine model (sharing placements only; see
            :func:`sharing_placement`).
        placer: the simulator's placement (sharing placements only; required
            there, see :func:`sharing_placement`).
    """
    n = config.serve.workers
    if config.cluster.tp != 1:  # never silently ignored (issue 24)
        raise ConfigError(
            f"cluster.tp is {config.cluster.tp}: the runtime runs one engine per worker "
            "(tensor parallelism is modelled by the simulator only); set cluster.tp: 1 to serve"
        )
    if config.cluster.links_overridden:
        raise ConfigError(
            "cluster.intra_node_bw / cluster.network_bw: the runtime moves data through its "
            "real links (the object store); these overrides are for the simulator only"
        )
    if kun_only(config.policy.stack):
        # KunServe: replicas of one model on every worker (buddy groups form at runtime)
        if len(models) != 1:
            raise ConfigError(
                f"policy.stack {config.policy.stack!r} serves one replicated model; "
                f"serve.models has {len(models)}"
            )
        return [tuple(models)] * n, {}
    if sharing_stack(config) is not None:
        sharing = sharing_placement(config, models, sources, placer=placer)
        return list(sharing.workers), sharing.stats
    if config.cluster.elastic:
        if len(models) != 1:
            raise ConfigError(
                "an elastic runtime pool (cluster.elastic: true) serves one model; "
                f"serve.models has {len(models)}"
            )
        return [tuple(models)] * n, {}
    wl = config.workload
    rates = dict.fromkeys(models, 1.0)
    if wl.models is not None and wl.model_weights is not None:
        for m, wgt in zip(wl.models, wl.model_weights, strict=True):
            if m in rates:
                rates[m] = float(wgt)
    names = resolve_policies(config)
    placed = (
        PLACEMENT.get(names["placement"])
        .from_config(config)
        .place(rates, n, dict.fromkeys(models, 1))
    )
    if len(placed) > n:
        raise ConfigError(f"placement gave {len(placed)} instances for {n} workers")
    return [(m,) for m in placed], {}
