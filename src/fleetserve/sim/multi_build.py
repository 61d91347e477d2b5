"""From a multi-LLM :class:`~fleetserve.config.SimConfig` to services, history and run.

Three sources:

* ``multi.generator`` (``seallm`` or ``muxserve``): the synthetic workloads of
  :mod:`fleetserve.workload.multi` (history before the run, services measured
  on the history).
* ``fleet.generator`` (``fleet`` or ``trace``): the fleet workloads of
  :mod:`fleetserve.workload.fleet` and :mod:`fleetserve.workload.fleet_trace`,
  one service per model, split like a ``services`` list's (below).
* a ``services`` list with the ``workload`` section (a trace, or the built-in
  synthetic workload): requests are assigned to the service names
  (``workload.models``/``model_weights``; uniformly when not given). The
  first ``multi.history_s`` seconds of the resulting requests are the
  history that placement sees; the rest, shifted to start at 0, is the run.
  Service rates and mean lengths are measured on the history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from fleetserve.config import SimConfig
from fleetserve.costmodel import CostModel
from fleetserve.errors import ConfigError
from fleetserve.policy.catalog import MULTI, Stack, stack_for, with_family_overrides
from fleetserve.policy.groups import PlacementPlan
from fleetserve.policy.sharing import ServiceStats
from fleetserve.sim.multi import ReplacementConfig, service_stats
from fleetserve.sim.multi_run import MultiRunSettings, place_for_stack, services_from_window
from fleetserve.spec import get_gpu, get_model
from fleetserve.spec.memory import min_tp
from fleetserve.spec.types import GpuSpec
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

__all__ = [
    "MultiInput",
    "build_multi",
    "history_placement",
    "multi_preflight",
    "multi_settings",
    "split_history",
]


class MultiInput:
    """Services, the history placement sees, and the run's requests."""

    def __init__(
        self,
        services: dict[str, Service],
        history: list[Request],
        requests: list[Request],
        source: str,
        notes: list[str],
    ) -> None:
        self.services = services
        self.history = history
        self.requests = requests
        self.source = source
        self.notes = notes


def multi_settings(cfg: SimConfig) -> MultiRunSettings:
    """The :class:`MultiRunSettings` of a multi-LLM config."""
    m, cl, en = cfg.multi, cfg.cluster, cfg.engine
    assert cl.gpus is not None
    params = {} if m.max_services is None else {"max_services": m.max_services}
    return MultiRunSettings(
        gpu=cl.gpu,
        n_gpus=cl.gpus,
        mem_util=cl.mem_util,
        block_size=cl.block_size,
        max_num_seqs=en.max_num_seqs,
        max_batched_tokens=en.max_batched_tokens,
        slo_scale=m.slo_scale,
        replacement=ReplacementConfig(
            initial_interval_s=m.replacement_interval_s,
            beta=m.replacement_beta,
            min_interval_s=m.min_interval_s,
            max_interval_s=m.max_interval_s,
            slo_scale=m.slo_scale,
        ),
        processes=m.processes,
        search_params=params,
        sample_interval_s=cfg.sample_interval_s,
        max_time_s=cfg.max_time_s,
        check_integrity=cfg.check_integrity,
        max_model_len=en.max_model_len,
        dispatch=cfg.policy.dispatch,
        mechanism=cfg.migration.mechanism,
        memory=cfg.policy.memory,
        keepalive_s=m.keepalive_s,
        contention=m.contention,
        watermark=en.watermark,
        chunked_prefill=en.chunked_prefill,
        epoch_s=cfg.migration.epoch_s,
        link_share=cfg.migration.link_share,
        compute_share=cfg.migration.compute_share,
        burst_overrides=cfg.kunserve.overrides(),
        tp_sizes=m.tp_sizes,
        batching=cfg.policy.batching,
        placement=cfg.policy.placement,
    )


def multi_preflight(cfg: SimConfig) -> None:
    """Names and fits of a multi-LLM config, before any work.

    Raises:
        FleetserveError: an unknown stack, GPU or model, or a model that does
            not fit a node of the pool's GPUs.
    """
    stack = stack_for(cfg.policy.stack, MULTI)
    pol = cfg.policy
    with_family_overrides(stack, batching=pol.batching, placement=pol.placement)
    gpu = get_gpu(cfg.cluster.gpu)
    for s in cfg.services or ():
        spec = get_model(s.model)
        tp = min_tp(spec, gpu, cfg.cluster.mem_util, gpu.gpus_per_node)
        assert cfg.cluster.gpus is not None
        if tp > cfg.cluster.gpus:
            raise ConfigError(
                f"service {s.name!r}: {s.model} needs {tp} x {gpu.name}, the pool has "
                f"{cfg.cluster.gpus}"
            )


def split_history(reqs: Sequence[Request], history_s: float) -> tuple[list[Request], list[Request]]:
    """``reqs`` (sorted) split into the history (arrivals within ``history_s`` of
    the first) and the run (the rest, times shifted so the run starts at 0),
    both renumbered from 0."""
    t0 = reqs[0].arrival_s if reqs else 0.0
    hist = [r for r in reqs if r.arrival_s - t0 < history_s]
    run = [r for r in reqs if r.arrival_s - t0 >= history_s]
    hist = [replace(r, id=i, arrival_s=r.arrival_s - t0) for i, r in enumerate(hist)]
    start = t0 + history_s
    run = [replace(r, id=i, arrival_s=r.arrival_s - start) for i, r in enumerate(run)]
    return hist, run


def _history_and_run(
    source: str, reqs: list[Request], history_s: float, *, require_run: bool
) -> tuple[list[Request], list[Request]]:
    """``reqs`` split at ``history_s`` (both parts renumbered from 0), checked."""
    hist, run = split_history(reqs, history_s)
    if not hist:
        raise ConfigError(
            f"no request arrives in the first multi.history_s = {history_s:g} s of "
            f"{source}: placement has no history"
        )
    if not run and require_run:
        raise ConfigError(
            f"every request of {source} arrives within multi.history_s = "
            f"{history_s:g} s: nothing left to run"
        )
    return hist, run


def _fleet_input(cfg: SimConfig, base_dir: Path | None, *, require_run: bool) -> MultiInput:
    """The fleet workload (``fleet.generator``) as services, history and run:
    one service per model; placement sees the first ``multi.history_s``
    seconds, with each service's rate and mean lengths measured there.
    ``fleet.generator: trace`` resolves a relative ``fleet.trace`` against
    ``base_dir`` (the config file's folder; None: the working directory)."""
    from fleetserve.workload.fleet import FleetWorkload, fleet_workload
    from fleetserve.workload.fleet_trace import TraceFleetWorkload, trace_fleet_workload

    kwargs = cfg.fleet.generator_kwargs()
    wl: FleetWorkload | TraceFleetWorkload
    if cfg.fleet.generator == "trace":
        trace = Path(kwargs.pop("trace"))
        if not trace.is_absolute() and base_dir is not None:
            trace = (base_dir / trace).resolve()
        wl = trace_fleet_workload(trace, kwargs.pop("format"), **kwargs, seed=cfg.seed)
    else:
        wl = fleet_workload(**kwargs, seed=cfg.seed)
    hist, run = _history_and_run(
        wl.source, list(wl.requests), cfg.multi.history_s, require_run=require_run
    )
    mean_p = sum(r.prompt_tokens for r in hist) / len(hist)
    mean_o = sum(r.output_tokens for r in hist) / len(hist)
    base = {n: Service(n, get_model(n), 0.0, mean_p, mean_o) for n in wl.models}
    services = services_from_window(base, hist, cfg.multi.history_s)
    notes = [
        *wl.notes,
        f"placement history: the first {cfg.multi.history_s:g} s ({len(hist)} requests); "
        f"the run is the rest ({len(run)} requests)",
    ]
    return MultiInput(services, hist, run, wl.source, notes)


def build_multi(
    cfg: SimConfig, base_dir: Path | None = None, *, require_run: bool = True
) -> MultiInput:
    """The services, history and run of a multi-LLM config.

    ``require_run=False`` accepts a workload that ends within the history (the
    run is then empty): the runtime (:mod:`fleetserve.runtime.plan`) only
    needs the history its placement sees.

    Raises:
        InputError: a missing or bad trace or data file.
        ConfigError: an empty history, or an empty run (with ``require_run``).
    """
    m = cfg.multi
    if cfg.fleet.generator is not None:
        return _fleet_input(cfg, base_dir, require_run=require_run)
    if m.generator is not None:
        from fleetserve.workload.multi import muxserve_workload, seallm_workload

        if m.generator == "seallm":
            wl = seallm_workload(
                m.rate,
                duration_s=m.duration_s,
                history_s=m.history_s,
                seed=cfg.seed,
                cv=m.cv,
                rotate_s=m.rotate_s,
                burst_share=m.burst_share,
            )
        else:
            wl = muxserve_workload(
                m.rate, m.alpha, duration_s=m.duration_s, history_s=m.history_s, seed=cfg.seed
            )
        if not wl.requests:
            raise ConfigError(f"the {m.generator} workload has no request in its run")
        return MultiInput(
            dict(wl.services), list(wl.history), list(wl.requests), wl.source, list(wl.notes)
        )

    from fleetserve.config import config_from_dict
    from fleetserve.sim.build import build_workload

    assert cfg.services is not None
    names = tuple(s.name for s in cfg.services)
    wl_cfg = cfg.workload
    notes: list[str] = []
    if wl_cfg.keep_models:
        notes.append("each request's service is the trace's model field")
    elif wl_cfg.models is None:
        notes.append(f"requests assigned uniformly to the {len(names)} services")
        wl_cfg = replace(wl_cfg, models=names)
    elif set(wl_cfg.models) - set(names):
        raise ConfigError(
            f"workload.models names {sorted(set(wl_cfg.models) - set(names))}, "
            f"which are not services ({', '.join(names)})"
        )
    # the single-model workload builder (trace, window, scaling, assignment);
    # its model checks use the first service's model
    plain = config_from_dict(
        {
            "model": cfg.services[0].model,
            "seed": cfg.seed,
            "workload": {k: v for k, v in cfg.to_dict()["workload"].items() if v is not None}
            | ({} if wl_cfg.keep_models else {"models": list(wl_cfg.models or ())})
            | {"cap_lengths": False},
        }
    )
    built = build_workload(plain, base_dir)
    if wl_cfg.keep_models:
        unknown = sorted({r.model for r in built.requests} - set(names))
        if unknown:
            raise ConfigError(
                f"workload.keep_models: {built.source} names {unknown[:5]}, which are not "
                f"services ({', '.join(names)})"
            )
    hist, run = _history_and_run(built.source, built.requests, m.history_s, require_run=require_run)
    mean_p = sum(r.prompt_tokens for r in hist) / len(hist)
    mean_o = sum(r.output_tokens for r in hist) / len(hist)
    base = {s.name: Service(s.name, get_model(s.model), 0.0, mean_p, mean_o) for s in cfg.services}
    services = services_from_window(base, hist, m.history_s)
    notes.append(
        f"placement history: the first {m.history_s:g} s ({len(hist)} requests); "
        f"the run: the remaining {len(run)} requests"
    )
    return MultiInput(services, hist, run, built.source, built.notes + notes)


def history_placement(
    stack: Stack, cfg: SimConfig, gpu: GpuSpec
) -> tuple[dict[str, Service], PlacementPlan, float | None, dict[str, ServiceStats]]:
    """The stack's placement of a multi-LLM config's services on its history.

    :func:`build_multi` (the run may be empty) then :func:`place_for_stack` on
    ``gpu``; ``(services, plan, estimated SLO attainment, statistics)``, the
    statistics being what the stack's group scheduler reads
    (:func:`~fleetserve.sim.multi.service_stats` over the history on ``gpu``,
    as a simulation of the same services computes them). This is the
    :data:`~fleetserve.runtime.plan.SharingPlacer` the CLI hands the runtime
    (SeaLLM's search evaluates its candidates with this simulator).
    """
    inp = build_multi(cfg, require_run=False)
    settings = multi_settings(cfg)
    plan, est = place_for_stack(
        settings.resolve(stack), inp.services, inp.history, settings, None, gpu
    )
    stats, _ = service_stats(inp.services, inp.history, gpu, CostModel())
    return inp.services, plan, est, stats


class RuntimeReplanner:
    """SeaLLM's re-placement search for the runtime
    (:class:`~fleetserve.runtime.plan.SharingReplanner`): what the simulator's
    replanner runs at a replacement (:func:`services_from_window` then
    :func:`place_for_stack` on the window), on the emulated GPU the runtime's
    first placement saw, for a pool of ``n_gpus`` workers; and each request's
    ideal execution time (the cost model's, as :func:`service_stats` gives the
    simulator's ``M_real`` deadlines).

    Args:
        stack: the multi-LLM stack (``replacement`` set).
        config: the placement's config (:attr:`SharingPlacement.config`).
        gpu: the placement's GPU.
        services: the services of the first placement (their specs; rates
            and lengths are measured anew on each window).
        n_gpus: the workers running (a plan uses at most these).
    """

    def __init__(
        self,
        stack: Stack,
        config: SimConfig,
        gpu: GpuSpec,
        services: Mapping[str, Service],
        n_gpus: int,
    ) -> None:
        self.stack = stack
        self.services = dict(services)
        self.gpu = gpu
        self.cost_model = CostModel()
        settings = multi_settings(config)
        self.settings = replace(settings, n_gpus=n_gpus)
        self._bound = {
            name: self.cost_model.bind(
                svc.spec, gpu, min_tp(svc.spec, gpu, max_tp=gpu.gpus_per_node)
            )
            for name, svc in self.services.items()
        }

    def place(
        self, window: Sequence[Request], window_s: float
    ) -> tuple[PlacementPlan, float | None, dict[str, ServiceStats]]:
        """A plan for the services as ``window`` (the last ``window_s``
        seconds of requests) shows them, its estimated SLO attainment, and the
        statistics the group schedulers read from now on."""
        svcs = services_from_window(self.services, window, window_s)
        plan, est = place_for_stack(
            self.stack, svcs, window, self.settings, self.cost_model, self.gpu
        )
        stats, _ = service_stats(svcs, window, self.gpu, self.cost_model)
        return plan, est, stats

    def ideal_s(self, model: str, prompt_tokens: int, output_tokens: int) -> float:
        """The request's execution time alone (its SLO is ``slo_scale`` times it)."""
        t = self._bound[model].ideal_times(
            np.array([float(prompt_tokens)]), np.array([float(max(1, output_tokens))])
        )
        return float(t[0])
