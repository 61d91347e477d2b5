"""Run one multi-LLM stack end to end: place on a history, then simulate.

:func:`run_multi_stack` is what ``fleetserve simulate``/``compare`` (with a
``services:`` config) and ``fleetserve reproduce seallm|muxserve`` call:

1. **Placement** from the *history* (requests before the run; the run's own
   requests are never looked at): ``dedicated`` splits the pool by the
   services' rates, ``muxserve`` runs MuxServe's greedy on their rates and
   mean lengths, ``seallm`` searches, evaluating candidates by simulating
   them on the history with the stack's scheduler and KV layout.
2. **Simulation** of the run on that plan (:class:`~fleetserve.sim.multi.MultiSimulator`).
   A stack with replacement re-runs the SeaLLM search at every replacement
   on the requests of the last interval (service rates and mean lengths
   measured on that window) and adapts the interval (Equation 8).

The wall time of every placement search is reported in ``RunResult.extra``
(``placement_search_s``); in simulated time a search costs nothing, as in
SeaLLM, which runs it ahead of the replacement moment.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fleetserve.costmodel import CostModel
from fleetserve.errors import ConfigError
from fleetserve.metrics.records import RunResult
from fleetserve.policy.catalog import MULTI, Stack, stack_for, with_family_overrides
from fleetserve.policy.group_placement import place_services
from fleetserve.policy.groups import PlacementPlan
from fleetserve.policy.pressure import KunSettings
from fleetserve.sim.evaluate import PlanEvaluator
from fleetserve.sim.multi import MultiConfig, MultiSimulator, ProgressFn, ReplacementConfig
from fleetserve.spec import get_gpu
from fleetserve.spec.types import GpuSpec
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

__all__ = ["MultiRunSettings", "place_for_stack", "run_multi_stack", "services_from_window"]


@dataclass(frozen=True, slots=True)
class MultiRunSettings:
    """Everything of a multi-LLM run besides the stack and the requests.

    Attributes:
        gpu: GPU catalog name.
        n_gpus: GPUs in the pool.
        mem_util: share of each GPU's memory the engines may use.
        block_size: tokens per KV block.
        max_num_seqs: running requests per service and group at most.
        max_batched_tokens: prompt tokens per prefill job.
        slo_scale: SLO of the placement search and of ``M_real`` (SeaLLM: 5).
        replacement: the adaptive replacement settings (stacks with replacement).
        processes: parallel placement searches (None: one per TP size, at
            most the CPUs).
        search_params: extra keyword arguments of ``seallm_place``.
        sample_interval_s: time-series sampling period.
        max_time_s: stop the run there (None: to completion).
        check_integrity: check every invariant after every event (tests).
        max_model_len: the context window served (None: each model's own).
        dispatch: the dispatch policy among a service's hosts (None: the stack's).
        mechanism: how a re-placement moves running requests (None: the stack's).
        memory: ``static`` or ``elastic`` groups (None: the stack's, else static).
        keepalive_s: idle time before an elastic group releases its GPUs.
        contention: concurrent jobs share memory bandwidth (``multi.contention``).
        watermark: the admission watermark (``engine.watermark``).
        chunked_prefill: prompts in chunks beside their service's decodes
            (``engine.chunked_prefill``; FCFS and RR groups).
        epoch_s, link_share, compute_share: the adaptive mechanism's epoch and
            boundaries (``migration.*``).
        burst_overrides: ``kunserve.*`` overrides of the stack's memory-pressure
            settings (:func:`burst_settings`).
        tp_sizes: the tensor-parallel sizes placement may give a group (None:
            each placement's own choice: ``dedicated`` the least a model fits
            on, ``muxserve`` and ``seallm`` every power of two up to a node).
        batching, placement: overrides of the stack's group scheduler and
            placement (``policy.batching``, ``policy.placement``; None: the
            stack's; :meth:`resolve`).
    """

    gpu: str = "a800-80gb"
    n_gpus: int = 32
    mem_util: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    slo_scale: float = 5.0
    replacement: ReplacementConfig = field(default_factory=ReplacementConfig)
    processes: int | None = None
    search_params: Mapping[str, Any] = field(default_factory=dict)
    sample_interval_s: float = 1.0
    max_time_s: float | None = None
    check_integrity: bool = False
    max_model_len: int | None = None
    dispatch: str | None = None
    mechanism: str | None = None
    memory: str | None = None
    keepalive_s: float = 30.0
    contention: bool = True
    watermark: float = 0.01
    chunked_prefill: bool = False
    epoch_s: float = 0.5
    link_share: float = 0.5
    compute_share: float = 0.1
    burst_overrides: Mapping[str, Any] = field(default_factory=dict)
    tp_sizes: tuple[int, ...] | None = None
    batching: str | None = None
    placement: str | None = None

    def resolve(self, stack: Stack) -> Stack:
        """``stack`` with the config's overrides of its group scheduler and
        placement (:func:`~fleetserve.policy.catalog.with_family_overrides`).

        Raises:
            UnknownNameError: an unknown scheduler or placement (with suggestions).
        """
        return with_family_overrides(stack, batching=self.batching, placement=self.placement)

    def burst(self, stack: Stack) -> KunSettings | None:
        """The stack's memory-pressure settings for this run."""
        return burst_settings(stack, self.burst_overrides)

    def multi_config(self, stack: Stack) -> MultiConfig:
        """The simulator's config for ``stack`` (its group scheduler and KV layout)."""
        return MultiConfig(
            gpu=self.gpu,
            n_gpus=self.n_gpus,
            scheduler=stack.batching,
            dispatch=self.dispatch or stack.dispatch,
            mechanism=self.mechanism or stack.mechanism,
            memory=self.memory or stack.memory or "static",
            keepalive_s=self.keepalive_s,
            contention=self.contention,
            watermark=self.watermark,
            chunked_prefill=self.chunked_prefill,
            epoch_s=self.epoch_s,
            link_share=self.link_share,
            compute_share=self.compute_share,
            burst=self.burst(stack),
            layout=stack.layout,
            block_size=self.block_size,
            mem_util=self.mem_util,
            max_num_seqs=self.max_num_seqs,
            max_batched_tokens=self.max_batched_tokens,
            sample_interval_s=self.sample_interval_s,
            max_time_s=self.max_time_s,
            check_integrity=self.check_integrity,
            max_model_len=self.max_model_len,
        )


def burst_settings(stack: Stack, overrides: Mapping[str, Any]) -> KunSettings | None:
    """The stack's memory-pressure settings with the config's ``kunserve.*``
    overrides (None: the group scheduler preempts, nothing to override).

    Raises:
        ConfigError: overrides for a stack without KunServe's pressure (they
            would be ignored).
    """
    if stack.pressure == "queue":
        if overrides:
            raise ConfigError(
                f"kunserve.{sorted(overrides)[0]}: stack {stack.name!r} has no KunServe "
                "drop/restore in the multi-LLM world (its pressure is queue); e.g. the "
                "fleet stack has"
            )
        return None
    return stack.burst.with_overrides(**dict(overrides))


def services_from_window(
    base: Mapping[str, Service], window: Sequence[Request], window_s: float
) -> dict[str, Service]:
    """Services with rates and mean lengths measured on ``window`` (what
    SeaLLM's service monitor reports for the last interval).

    A service without a request in the window keeps its previous mean lengths
    and gets half a request per window as its rate (it must still be placed,
    SeaLLM's constraint (3), and a zero rate would make it invisible).
    """
    by: dict[str, list[Request]] = {s: [] for s in base}
    for r in window:
        by[r.model].append(r)
    out = {}
    for name, svc in base.items():
        rs = by[name]
        if rs:
            out[name] = replace(
                svc,
                rate=len(rs) / window_s,
                mean_prompt=sum(r.prompt_tokens for r in rs) / len(rs),
                mean_output=sum(r.output_tokens for r in rs) / len(rs),
            )
        else:
            out[name] = replace(svc, rate=0.5 / window_s)
    return out


def place_for_stack(
    stack: Stack,
    services: Mapping[str, Service],
    history: Sequence[Request],
    settings: MultiRunSettings,
    cost_model: CostModel | None = None,
    gpu_spec: GpuSpec | None = None,
) -> tuple[PlacementPlan, float | None]:
    """The stack's placement on ``history``; ``(plan, estimated SLO attainment)``
    (the estimate only for ``seallm``, which simulates its candidates).

    ``gpu_spec`` overrides the GPU the placement sees (default: the catalog's
    ``settings.gpu``); the runtime passes its emulated GPU with one GPU per
    node, so that no group spans GPUs (:mod:`fleetserve.runtime.plan`). A
    ``seallm`` evaluator still simulates on ``settings.gpu``.
    """
    gpu = gpu_spec if gpu_spec is not None else get_gpu(settings.gpu)
    svcs = list(services.values())
    cm = cost_model or CostModel()
    ev = None
    params: dict[str, Any] = {}
    if stack.placement == "seallm":
        if not history:
            raise ConfigError(
                f"stack {stack.name!r} searches its placement on a history of requests; "
                "the history is empty"
            )
        # SeaLLM's estimator simulates its own design: the candidates without
        # KunServe's drop/restore (a composed stack's pressure is not SeaLLM's)
        ev = PlanEvaluator(
            replace(settings.multi_config(stack), burst=None),
            services,
            history,
            slo_scale=settings.slo_scale,
            cost_model=cm,
        )
        params = {"processes": settings.processes, **dict(settings.search_params)}
    return place_services(
        stack.placement,
        svcs,
        settings.n_gpus,
        gpu,
        cost_model=cm,
        mem_util=settings.mem_util,
        evaluate=ev,
        tp_sizes=settings.tp_sizes,
        **params,
    )


def run_multi_stack(
    stack_name: str,
    services: Mapping[str, Service],
    history: Sequence[Request],
    requests: Sequence[Request],
    settings: MultiRunSettings,
    *,
    cost_model: CostModel | None = None,
    progress: ProgressFn | None = None,
    on_search: Callable[[float], None] | None = None,
    placed: tuple[PlacementPlan, float | None] | None = None,
    gpu_spec: GpuSpec | None = None,
) -> RunResult:
    """Place ``services`` for stack ``stack_name`` on ``history``, then simulate ``requests``.

    Args:
        stack_name: a multi-LLM stack of :data:`~fleetserve.policy.catalog.STACKS`.
        services: the services (rates and mean lengths as known from the history).
        history: requests before the run (placement input; any ids).
        requests: the run, sorted, ids ``0..n-1``, ``model`` = service name.
        settings: pool and engine settings.
        cost_model: iteration times (default roofline).
        progress: simulator progress callback.
        on_search: called with the wall time of every placement search.
        placed: the initial plan and its estimated SLO attainment, made
            elsewhere (the runtime's, for the parity report): no initial
            search then (``history`` unused); re-placements still search.
        gpu_spec: the GPU every placement search sees (see
            :func:`place_for_stack`; default the catalog's ``settings.gpu``).

    Returns:
        The run's result; ``extra`` adds ``stack`` and ``placement_search_s``.
    """
    stack = settings.resolve(stack_for(stack_name, MULTI))
    cm = cost_model or CostModel()
    searches: list[float] = []

    def timed(svcs: Mapping[str, Service], hist: Sequence[Request]) -> tuple[PlacementPlan, Any]:
        t0 = time.perf_counter()
        out = place_for_stack(stack, svcs, hist, settings, cm, gpu_spec)
        searches.append(time.perf_counter() - t0)
        if on_search is not None:
            on_search(searches[-1])
        return out

    plan, est = placed if placed is not None else timed(services, history)
    replanner = None
    if stack.replacement:

        def replanner(
            window: Sequence[Request], window_s: float, now: float
        ) -> tuple[PlacementPlan, float]:
            svcs = services_from_window(services, window, window_s)
            new, m = timed(svcs, window)
            assert m is not None
            return new, float(m)

    sim = MultiSimulator(
        settings.multi_config(stack),
        services,
        plan,
        requests,
        cost_model=cm,
        progress=progress,
        replacement=settings.replacement if stack.replacement else None,
        replanner=replanner,
        initial_estimate=est,
    )
    res = sim.run()
    res.extra["stack"] = {
        "name": stack.name,
        "description": stack.description,
        "placement": stack.placement,
        "scheduler": stack.batching,
        "layout": stack.layout,
        "replacement": stack.replacement,
    }
    res.extra["placement_search_s"] = searches
    return res
