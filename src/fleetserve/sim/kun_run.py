"""Running the KunServe simulator from a :class:`~fleetserve.config.SimConfig`.

``fleetserve simulate``/``compare`` call :func:`run_kun` when the config is a
KunServe run (:func:`~fleetserve.policy.catalog.world_of`): the stack's
:class:`~fleetserve.policy.pressure.KunSettings` with the ``kunserve`` section's
overrides, ``cluster.gpus // cluster.tp`` instances of ``model``, and the
workload of ``kunserve.generator`` or of ``workload`` (one model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fleetserve.errors import ConfigError
from fleetserve.policy.base import DISPATCH
from fleetserve.policy.batching import instance_batching
from fleetserve.policy.catalog import KUNSERVE, stack_for
from fleetserve.policy.pressure import KunSettings
from fleetserve.sim.kun import KunSimulator, ProgressFn
from fleetserve.spec import get_gpu, get_model
from fleetserve.workload.request import Request

if TYPE_CHECKING:
    from fleetserve.config import SimConfig
    from fleetserve.costmodel import CostModel
    from fleetserve.metrics.records import RunResult
    from fleetserve.spec import GpuSpec

__all__ = ["build_kun_requests", "kun_preflight", "kun_settings", "run_kun"]


def kun_settings(cfg: SimConfig) -> KunSettings:
    """The stack's settings with the config's ``kunserve`` overrides (validated)."""
    return stack_for(cfg.policy.stack, KUNSERVE).burst.with_overrides(**cfg.kunserve.overrides())


def kun_dispatch(cfg: SimConfig) -> str:
    """The dispatch policy among KunServe's candidate executors: the config's
    ``policy.dispatch``, else the stack's (checked against the registry)."""
    name = cfg.policy.dispatch or stack_for(cfg.policy.stack, KUNSERVE).dispatch
    DISPATCH.get(name)  # a clear error for an unknown name
    return name


def kun_batching(cfg: SimConfig) -> str:
    """The executors' batching policy: the config's ``policy.batching``, else
    the stack's (checked against the registry)."""
    name = cfg.policy.batching or stack_for(cfg.policy.stack, KUNSERVE).batching
    instance_batching(name)  # a clear error for an unknown or multi-LLM-only name
    return name


def _instances(cfg: SimConfig) -> int:
    gpus = cfg.cluster.gpus
    tp = cfg.cluster.tp
    if gpus is None:
        raise ConfigError("a KunServe run needs a fixed pool: set cluster.gpus (or --gpus N)")
    if gpus % tp:
        raise ConfigError(f"cluster.gpus={gpus} is not a multiple of cluster.tp={tp}")
    return gpus // tp


def _simulator(
    cfg: SimConfig,
    requests: Sequence[Request],
    notes: Sequence[str] = (),
    progress: ProgressFn | None = None,
    progress_every: int = 4096,
    cost: CostModel | None = None,
    gpu: GpuSpec | None = None,
) -> KunSimulator:
    kc = cfg.kunserve
    return KunSimulator(
        requests,
        model=get_model(cfg.model).name,
        gpu=gpu if gpu is not None else get_gpu(cfg.cluster.gpu).name,
        instances=_instances(cfg),
        tp=cfg.cluster.tp,
        spare_instances=kc.spare_instances,
        settings=kun_settings(cfg),
        stack=cfg.policy.stack,
        dispatch=kun_dispatch(cfg),
        batching=kun_batching(cfg),
        mem_util=cfg.cluster.mem_util,
        kv_tokens=kc.kv_tokens,
        network_gbps=kc.network_gbps,
        gpus_per_node=kc.gpus_per_node,
        remote_reads=kc.remote_reads,
        alternate=kc.alternate,
        cost=cost,
        seed=cfg.seed,
        max_num_seqs=cfg.engine.max_num_seqs,
        max_batched_tokens=cfg.engine.max_batched_tokens,
        watermark=cfg.engine.watermark,
        sample_interval_s=cfg.sample_interval_s,
        check_integrity=cfg.check_integrity,
        max_time_s=cfg.max_time_s,
        max_model_len=cfg.engine.max_model_len,
        config=cfg.to_dict(),
        notes=notes,
        progress=progress,
        progress_every=progress_every,
    )


def kun_preflight(cfg: SimConfig) -> None:
    """Check the stack, the overrides and that the deployment fits, before any work.

    Raises:
        FleetserveError: the first problem found, as one clear line.
    """
    if cfg.workload.models is not None and len(set(cfg.workload.models)) > 1:
        raise ConfigError(
            f"stack {cfg.policy.stack!r} serves one replicated model; workload.models "
            f"names {len(set(cfg.workload.models))}"
        )
    _simulator(cfg, [])


def build_kun_requests(cfg: SimConfig) -> tuple[list[Request], str]:
    """The ``kunserve.generator`` workload and its description."""
    from fleetserve.workload.bursty import kunserve_workload

    kc = cfg.kunserve
    reqs = kunserve_workload(
        kc.profile,
        kc.arrival,
        kc.rate,
        kc.duration_s,
        burst_start_s=kc.burst_start_s,
        burst_len_s=kc.burst_len_s,
        burst_factor=kc.burst_factor,
        cv=kc.cv,
        model=cfg.model,
        seed=cfg.seed,
    )
    source = (
        f"KunServe bursty workload: {kc.profile} lengths, {kc.arrival} arrivals at "
        f"{kc.rate:g} req/s for {kc.duration_s:g} s, x{kc.burst_factor:g} from "
        f"{kc.burst_start_s:g} s for {kc.burst_len_s:g} s"
    )
    return reqs, source


def run_kun(
    cfg: SimConfig,
    requests: Sequence[Request],
    notes: Sequence[str] = (),
    progress: ProgressFn | None = None,
    progress_every: int = 4096,
    cost: CostModel | None = None,
    gpu: GpuSpec | None = None,
) -> RunResult:
    """Simulate ``requests`` (one model, ids ``0..n-1`` in arrival order) under
    ``cfg``, iteration times from ``cost`` (default: the roofline), on ``gpu``
    (default: the catalog's ``cluster.gpu``)."""
    models = {r.model for r in requests}
    if len(models) > 1:
        raise ConfigError(
            f"stack {cfg.policy.stack!r} serves one replicated model; the workload has "
            f"{len(models)}: {', '.join(sorted(models))}"
        )
    if models and get_model(cfg.model).name not in models:
        (only,) = models
        raise ConfigError(f"the workload is for {only}, the config's model is {cfg.model}")
    return _simulator(cfg, requests, notes, progress, progress_every, cost, gpu).run()
