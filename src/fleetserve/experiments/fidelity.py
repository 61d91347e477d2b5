r"""Fidelity: simulate the runtime's emulated cluster and compare with a measured run.

``fleetserve serve`` runs a config's ``serve:`` section as real workers (CPU
engines, one Ray actor per emulated GPU); ``fleetserve bench-serve`` replays a
trace against it and writes a result directory in the simulator's schema.
This module simulates *the same cluster* on *the same requests*, and
tabulates how close the two are (target: mean and P99 TTFT and TPOT within
15 %)::

    config (serve: workers, gpu_memory_mb, models, max_running, ...)
        │                                   profile CSV (fleetserve profile-engine)
        ▼                                               │ calibrate (+ decode attention)
    emulated_sim_config ──► EmulatedSim: SimConfig + emulated GpuSpec + CostModel
        │                                               + the runtime's placement
        ▼
    simulate_emulated ──► result dir (summary.json ...) ──┐
                                                          ├─► fidelity_table ─► markdown
    bench-serve result dir (summary.json, requests.csv) ──┘

How the runtime maps onto the simulator (each choice mirrors the code that
runs; see :mod:`fleetserve.runtime.worker` / ``cluster.py`` / ``controller.py``):

* **GPU.** Every worker is the emulated GPU ``emu-<gpu_memory_mb>mib[...]``
  (:mod:`fleetserve.spec.emulated`): its memory is the engine's arena, so the
  simulated KV capacity is the engine's exactly (pages, layer weights rounded
  to pages, blocks of ``layers x kv_heads`` pages); nominal FLOP/s and
  bandwidth that the calibration corrects; the Ray object store (1 GB/s) as
  the link between workers. ``cluster.mem_util`` is 1 (the arena is the
  budget), ``tp`` 1, ``block_size`` the config's (the runtime's engines use it).
* **Pool and placement.** A fixed pool of ``serve.workers`` GPUs placed as
  the runtime places them (:func:`fleetserve.runtime.plan.plan_workers`,
  torch-free): the ``placement``
  policy with rates from ``workload.model_weights`` (equal when unset), not
  from the trace's request counts as a plain simulation does. One model: every
  worker serves it. An elastic config (``cluster.elastic: true``, one model)
  stays elastic with at most ``serve.workers`` GPUs.
* **Engine.** ``engine.max_num_seqs = serve.max_running``,
  ``engine.max_batched_tokens = serve.max_batch_tokens``, ``watermark = 0``
  (the engine's admission budget keeps no blocks back), and
  ``chunked_prefill = true``: an engine step runs the admitted prompts
  *together with* every running decode in one forward (a mixed iteration),
  which is the simulator's chunked-prefill mode (the engine never splits a
  prompt; with prompts under ``max_batch_tokens`` the simulator does not
  either). Preemption is by recompute, the victim the latest arrival (FCFS),
  in both.
* **Cost model.** Calibrated from the profile CSV
  (:func:`fleetserve.costmodel.calibrate`) against the emulated GPU, on the
  rows within the engines' limits (:func:`operating_rows`), with the
  per-batch decode correction on (``decode_batch_scale``: on one CPU thread
  a small-batch matmul costs almost in proportion to its rows up to 4-5, then
  flattens, which the roofline's lines miss by up to ~40% at batch 2-3) and
  the decode-attention extension on (``decode_attn_eff``): the CPU engine's decode
  attention gathers paged K/V and runs small matmuls, several times slower
  per query-key pair than the fused attention of prompts. Profile rows name
  the GPU ``cpu`` unless ``--gpu-name`` was given; either way the rows of a
  served model are mapped to the emulated GPU (a profile with several GPU
  names must contain one named ``cpu`` or the emulated GPU's name). Without
  a profile the default efficiencies apply (meaningless on a CPU; smoke tests
  only).

The serving path (optional, :mod:`fleetserve.experiments.fidelity_overhead`):
HTTP, controller and Ray latency between a client and the engine, the
engine step's work beyond the profiled forward, and the worker's long-poll
delivering tokens after they are made. On this project's 2-core machine they
add ~12 ms to every request's TTFT, and a tiny model's 2-3 ms engine step
takes ~4 ms per token at the client. :func:`simulate_emulated` adds them
when given a :class:`~fleetserve.experiments.fidelity_overhead.RuntimeOverhead`, which
:func:`fit_overhead` calibrates from probes of the idle server (never from
the replay it is compared with); without one the simulation is the
engine-only one, exactly as before.

The engine inside the server (:func:`in_situ_factors`, :func:`rescale_profile`,
:func:`engine_step_check`): with ``serve.step_log`` the server logs every
engine step's duration and batch. On this project's 2-core machine a step
ran 1.2-1.5x slower inside the server (which shares the cores with Ray, the
HTTP server and the load generator) than the same forward in
``profile-engine`` alone, steadily before, during and after a replay.
``fleetserve fidelity`` therefore rescales the standalone profile by the
measured/predicted time of the steps of the probes (the idle server before
and after the replay, never the replay) before calibrating, and reports the
replay's own ratio as a diagnostic.

Known differences (not modelled): the runtime's admission queue
(``serve.max_queue``, HTTP 429 beyond it); CPU contention between the worker
and the server, the load generator or anything else on the machine beyond
what the probes saw (the in-situ factors come from the idle server) and the
machine's own speed drifting during a run (the same decode step varies by
~20-50% between minutes here); concurrent requests passing the HTTP server and the
controller one after another (the model has no queue in front of the
engine); decode attention padding inside a context bucket (the cost model
sees the batch's total context); the engine reserving pages for one token more than the
prompt at admission, admitting no prompt in a step that preempted, and
never splitting a prompt.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fleetserve.config import ClusterConfig, EngineConfig, SimConfig
from fleetserve.costmodel import (
    Calibration,
    CostModel,
    ProfileRow,
    calibrate,
    load_profile,
    relative_errors,
    write_profile,
)
from fleetserve.errors import ConfigError, FleetserveError, InputError
from fleetserve.experiments.fidelity_overhead import (
    ITERATION_GRID_S,
    LAG_GRID,
    OverheadFit,
    RuntimeOverhead,
    Timeline,
    deliver,
    deliver_records,
    with_iteration_overhead,
)
from fleetserve.experiments.report_common import md_table
from fleetserve.metrics.probes import ProbeRequest
from fleetserve.metrics.records import RunResult
from fleetserve.policy.catalog import SINGLE, world_of
from fleetserve.runtime.plan import plan_workers
from fleetserve.sim.build import Workload, build_workload
from fleetserve.sim.group_instance import IDLE, GroupInstance
from fleetserve.sim.multi_build import history_placement
from fleetserve.sim.simulator import ProgressFn, Simulator, preflight
from fleetserve.spec import GpuSpec, emulated_gpu, get_model
from fleetserve.spec.memory import kv_capacity_blocks
from fleetserve.workload.request import Request

__all__ = [
    "FIDELITY_TOLERANCE_PCT",
    "EmulatedCost",
    "EmulatedSim",
    "emulated_cost",
    "emulated_gpu_for",
    "emulated_sim_config",
    "fidelity_markdown",
    "fidelity_table",
    "fit_overhead",
    "load_measured_requests",
    "mechanism_counts",
    "operating_rows",
    "read_summary",
    "runtime_placement",
    "served_models",
    "simulate_emulated",
    "simulate_probes",
    "summary_value",
]

logger = logging.getLogger(__name__)

FIDELITY_TOLERANCE_PCT = 15.0
"""A metric is within target when ``|simulated - measured| <= 15 %`` of measured."""

PROFILE_GPU_DEFAULT = "cpu"
"""The ``gpu`` column ``fleetserve profile-engine`` writes on the CPU."""


@dataclass(frozen=True, slots=True)
class EmulatedSim:
    """Everything a simulation of the runtime's emulated cluster needs.

    Attributes:
        config: the simulation config (emulated GPU, pool, engine limits).
        gpu: the emulated GPU (``config.cluster.gpu`` names it).
        cost: the cost model, calibrated from the profile when one was given.
        calibration: the fitted parameters (None without a profile).
        placement: the model of each worker's instance, as the runtime places
            them (fixed pool; empty for an elastic pool).
        kv_blocks: KV blocks of one instance of each served model (the
            engine's exact capacity).
        fit_errors: per served model and phase (``prefill``, ``decode``), the
            calibrated model's relative error on the profile rows it was
            fitted to: ``{"mean_abs_pct", "max_abs_pct", "rows"}`` (empty
            without a profile).
        notes: remarks carried into the results.
    """

    config: SimConfig
    gpu: GpuSpec
    cost: CostModel
    calibration: Calibration | None
    placement: tuple[str, ...]
    kv_blocks: Mapping[str, int]
    fit_errors: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


# ------------------------------------------------------------------------- mapping


def emulated_gpu_for(cfg: SimConfig) -> GpuSpec:
    """The emulated GPU of one worker of ``cfg.serve`` (memory, dtype, threads,
    the config's block size).

    Raises:
        ConfigError: the workers do not run on the CPU (only CPU workers are
            emulated GPUs).
    """
    sv = cfg.serve
    if sv.device != "cpu":
        raise ConfigError(
            f"serve.device is {sv.device!r}: the fidelity simulation models CPU workers "
            "(emulated GPUs); simulate a real GPU with its catalog name instead"
        )
    return emulated_gpu(
        sv.gpu_memory_mb,
        dtype=sv.dtype,
        threads=sv.threads_per_worker,
        block_size=cfg.cluster.block_size,
    )


def runtime_placement(cfg: SimConfig, models: Sequence[str]) -> tuple[str, ...]:
    """The model of each worker of a fixed pool, as ``serve`` places them:
    :func:`fleetserve.runtime.plan.plan_workers` (the ``placement`` policy over
    ``serve.workers`` GPUs, tp 1, rates from ``workload.model_weights``, equal
    when unset). Each worker of the runtime hosts one model there."""
    placed = plan_workers(cfg, models, placer=history_placement)
    return tuple(m for hosted in placed for m in hosted)


def served_models(cfg: SimConfig) -> tuple[str, ...]:
    """The served models by the names requests use (each checked to resolve)."""
    names = tuple(cfg.serve.model_names(cfg.model))
    for n in names:
        get_model(n)  # a clear error for an unknown name
    return names


def _profile_rows(
    rows: Sequence[ProfileRow], models: Sequence[str], gpu: GpuSpec, threads: int, path: Path
) -> list[ProfileRow]:
    """The rows of the served models, renamed to the emulated GPU (see module docstring)."""
    mine = [r for r in rows if r.model in models]
    if not mine:
        have = sorted({r.model for r in rows})
        raise InputError(
            f"no profile rows for the served models {list(models)} (the profile has {have}); "
            f"profile them with: fleetserve profile-engine --model M --threads {threads} "
            f"--out {path}",
            file=str(path),
        )
    names = sorted({r.gpu for r in mine})
    if len(names) > 1:
        pick = next((n for n in (gpu.name, PROFILE_GPU_DEFAULT) if n in names), None)
        if pick is None:
            raise InputError(
                f"the profile's rows of the served models name several GPUs {names}; keep one, "
                f"or name it {PROFILE_GPU_DEFAULT!r} or {gpu.name!r}",
                file=str(path),
            )
        mine = [r for r in mine if r.gpu == pick]
    bad_tp = sorted({r.tp for r in mine if r.tp != 1})
    if bad_tp:
        raise InputError(f"rows with tp {bad_tp}: a CPU worker runs tp 1", file=str(path))
    return [replace(r, gpu=gpu.name) for r in mine]


MIN_FIT_ROWS = 6
"""Fewest rows per model :func:`operating_rows` keeps before falling back to all."""


def operating_rows(
    rows: Sequence[ProfileRow], max_running: int, max_batch_tokens: int
) -> tuple[list[ProfileRow], int]:
    """The rows of iterations the runtime's engines can run: at most
    ``max_batch_tokens`` new tokens and ``max_running`` sequences.

    Choice: the roofline is fitted to the operating range of the served
    cluster. A CPU engine's iterations grow superlinearly once activations or
    gathered KV leave the caches (the profiler's default grid reaches 16k-token
    prefills, 4x a default ``serve.max_batch_tokens``); fitting those rows
    would trade accuracy where the cluster runs for accuracy where it never
    does. A model left with fewer than :data:`MIN_FIT_ROWS` rows keeps all of
    its rows.

    Returns:
        The rows kept and how many were left out.
    """
    kept: list[ProfileRow] = []
    for m in sorted({r.model for r in rows}):
        mine = [r for r in rows if r.model == m]
        ok = [r for r in mine if r.tokens <= max_batch_tokens and r.batch_size <= max_running]
        kept += ok if len(ok) >= MIN_FIT_ROWS else mine
    return kept, len(rows) - len(kept)


def runtime_limits(cfg: SimConfig, gpu: GpuSpec) -> tuple[ClusterConfig, EngineConfig]:
    """``cfg``'s cluster and engine as the runtime's workers run them: one
    ``gpu`` per worker (tp 1, the whole arena, a fixed count of
    ``serve.workers``), and the server's batch limits with no watermark."""
    sv = cfg.serve
    cluster = replace(
        cfg.cluster, gpu=gpu.name, tp=1, mem_util=1.0, gpus=sv.workers, max_gpus=sv.workers
    )
    engine = replace(
        cfg.engine,
        max_num_seqs=sv.max_running,
        max_batched_tokens=sv.max_batch_tokens,
        watermark=0.0,
    )
    return cluster, engine


def emulated_sim_config(cfg: SimConfig, profile_csv: Path | None) -> EmulatedSim:
    """Turn a config with a ``serve:`` section into a simulation of that cluster.

    Args:
        cfg: the config ``fleetserve serve`` ran, resolved as it resolves it
            (:func:`fleetserve.cli.serve.load_serve_config`: a fixed pool of
            ``serve.workers`` GPUs unless the file asks for an elastic one);
            its ``serve``, ``policy``, ``migration``, ``cluster`` and
            ``workload`` sections are used.
        profile_csv: a profile of the served models (``fleetserve
            profile-engine --model M --threads T``, T = ``serve.threads_per_worker``),
            or None for the default efficiencies (smoke tests only).

    Returns:
        The :class:`EmulatedSim` (module docstring: what maps to what).

    Raises:
        ConfigError: a multi-LLM or KunServe config, non-CPU workers, a model
            whose layers leave no KV block in ``serve.gpu_memory_mb``, or an
            elastic pool serving several models.
        InputError: a bad profile, or one without rows for the served models.
    """
    if world_of(cfg) != SINGLE:
        raise ConfigError(
            "the fidelity simulation covers the runtime's fixed or elastic pool of "
            "instances; multi-LLM (services, multi.generator) and KunServe configs are not "
            "emulated"
        )
    sv = cfg.serve
    gpu = emulated_gpu_for(cfg)
    models = served_models(cfg)
    notes = [
        f"emulated cluster: {sv.workers} x {gpu.name} ({sv.gpu_memory_mb:g} MiB arena, "
        f"{sv.dtype}, {sv.threads_per_worker} thread(s)) serving {', '.join(models)}"
    ]
    model = cfg.model if cfg.model in models else models[0]
    workload = cfg.workload
    if len(models) > 1 and workload.models is None:
        workload = replace(workload, models=models)
        notes.append(f"requests assigned uniformly to the served models {list(models)}")
    cluster, engine = runtime_limits(cfg, gpu)
    engine = replace(engine, chunked_prefill=True)
    sim_cfg = replace(cfg, model=model, workload=workload, cluster=cluster, engine=engine)
    if cluster.elastic and len(models) > 1:
        raise ConfigError(
            "an elastic runtime pool (cluster.elastic: true) serves one model; "
            f"serve.models has {len(models)}"
        )
    preflight(sim_cfg)
    blocks = {m: kv_capacity_blocks(get_model(m), gpu, 1, 1.0, cluster.block_size) for m in models}
    placement = () if cluster.elastic else runtime_placement(cfg, models)
    emc = emulated_cost(cfg, profile_csv, models, gpu)
    notes += emc.notes
    return EmulatedSim(
        config=sim_cfg,
        gpu=gpu,
        cost=emc.cost,
        calibration=emc.calibration,
        placement=placement,
        kv_blocks=blocks,
        fit_errors=emc.fit_errors,
        notes=tuple(notes),
    )


@dataclass(frozen=True, slots=True)
class EmulatedCost:
    """The cost model of an emulated cluster (:func:`emulated_cost`).

    Attributes:
        cost: the cost model, calibrated from the profile when one was given.
        calibration: the fitted parameters (None without a profile).
        fit_errors: per served model and phase, the calibrated model's
            relative error on its rows (see :class:`EmulatedSim`).
        notes: remarks carried into the results.
    """

    cost: CostModel
    calibration: Calibration | None
    fit_errors: Mapping[str, Mapping[str, Mapping[str, float]]]
    notes: tuple[str, ...]


def emulated_cost(
    cfg: SimConfig, profile_csv: Path | None, models: Sequence[str], gpu: GpuSpec
) -> EmulatedCost:
    """The cost model of ``cfg.serve``'s workers (the emulated ``gpu``) for the
    served ``models``: calibrated from ``profile_csv`` on the rows within the
    engines' limits (:func:`operating_rows`; module docstring), or the
    default efficiencies without a profile.

    Raises:
        InputError: a bad profile, or one without rows for a served model.
    """
    sv = cfg.serve
    calibration = None
    rows: list[ProfileRow] = []
    notes: list[str] = []
    if profile_csv is not None:
        path = Path(profile_csv)
        rows = _profile_rows(load_profile(path), models, gpu, sv.threads_per_worker, path)
        rows, dropped = operating_rows(rows, sv.max_running, sv.max_batch_tokens)
        calibration = calibrate(
            rows, get_model, lambda _: gpu, decode_attention=True, decode_batch_residuals=True
        )
        missing = [m for m in models if calibration.get(get_model(m).name, gpu.name, 1) is None]
        if missing:
            raise InputError(
                f"no profile rows for served model(s) {missing}; profile each served model",
                file=str(path),
            )
        outside = f", {dropped} outside the engines' limits left out" if dropped else ""
        notes.append(f"cost model calibrated from {path} ({len(rows)} rows{outside})")
    else:
        notes.append("no profile: default efficiency parameters (not calibrated)")
    cost = CostModel(calibration=calibration)
    fit_errors = _fit_errors(cost, rows, gpu)
    for m, phases in fit_errors.items():
        notes.append(
            f"calibration fit of {m}: "
            + "; ".join(
                f"{ph} mean |error| {e['mean_abs_pct']:.1f}%, max {e['max_abs_pct']:.1f}%"
                for ph, e in phases.items()
            )
        )
    return EmulatedCost(cost, calibration, fit_errors, tuple(notes))


def _fit_errors(
    cost: CostModel, rows: Sequence[ProfileRow], gpu: GpuSpec
) -> dict[str, dict[str, dict[str, float]]]:
    """Relative errors of the calibrated model on its own rows, per model and phase."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for m in sorted({r.model for r in rows}):
        bound = cost.bind(get_model(m), gpu)
        for phase in ("prefill", "decode"):
            mine = [r for r in rows if r.model == m and r.phase == phase]
            if mine:
                err = np.abs(relative_errors(bound, mine)) * 100
                out.setdefault(m, {})[phase] = {
                    "mean_abs_pct": float(err.mean()),
                    "max_abs_pct": float(err.max()),
                    "rows": len(mine),
                }
    return out


# ------------------------------------------------------------------------ simulate


def placed_simulator(
    config: SimConfig,
    requests: Sequence[Request],
    *,
    placement: Sequence[str],
    timelines: dict[int, Timeline] | None = None,
    **kwargs: Any,
) -> Simulator:
    """The simulator with the fixed pool placed as the runtime places it.

    :class:`Simulator` places a fixed pool by the trace's request rates; the
    runtime's controller by ``workload.model_weights``. This one starts the
    given instances instead (models without requests are left out: the
    simulator knows only the models its requests name).

    With ``timelines`` (a dict it fills) it also records every instance's
    iteration ends (:class:`~fleetserve.experiments.fidelity_overhead.Timeline`),
    for the delivery lag of the overhead model; the config must then run
    without macro steps, so that every iteration is an event.
    """
    observe = None
    if timelines is not None:
        if config.macro_steps:
            raise ValueError("iteration timelines need macro_steps off")
        tls = timelines

        def observe(inst: GroupInstance, now: float) -> None:
            tl = tls.setdefault(inst.id, Timeline([], []))
            tl.add(now, inst.phase != IDLE)

    return Simulator(config, requests, placement=placement, on_iteration_end=observe, **kwargs)


def _run_emulated(
    em: EmulatedSim,
    requests: Sequence[Request],
    overhead: RuntimeOverhead | None,
    *,
    notes: Sequence[str] = (),
    progress: ProgressFn | None = None,
) -> RunResult:
    """Simulate ``requests`` on ``em``'s cluster, with the serving path's
    overhead when one is given and not off (see
    :mod:`fleetserve.experiments.fidelity_overhead`): ``iteration_s`` added to
    every iteration's fixed cost, every request entering the cluster
    ``request_s`` after its arrival (its record keeps the arrival, so its
    latencies include it), its first and last tokens delivered
    ``delivery_iters`` iterations after they are produced. Off (or None):
    exactly the engine-only simulation."""
    if overhead is None or overhead.off:
        sim = placed_simulator(
            em.config,
            requests,
            placement=em.placement,
            cost=em.cost,
            notes=list(notes),
            progress=progress,
        )
        return sim.run()
    config = em.config
    timelines: dict[int, Timeline] | None = None
    if overhead.delivery_iters > 0:
        config = replace(config, macro_steps=False)
        timelines = {}
    shifted = [replace(r, arrival_s=r.arrival_s + overhead.request_s) for r in requests]
    sim = placed_simulator(
        config,
        shifted,
        placement=em.placement,
        timelines=timelines,
        cost=with_iteration_overhead(em.cost, overhead.iteration_s),
        notes=list(notes),
        progress=progress,
    )
    result = sim.run()
    arrival = {r.id: r.arrival_s for r in requests}
    for rec in result.records:
        rec.arrival_s = arrival[rec.id]
    if timelines is not None:
        deliver_records(result.records, timelines, overhead.delivery_iters)
    return result


def mechanism_counts(result: RunResult, initial_gpus: int) -> dict[str, Any]:
    """What a run's mechanisms did beyond ``summary.json``'s standard sections
    (the ``mechanisms`` section of an emulated run; the parity report reads it).

    Args:
        result: the run.
        initial_gpus: GPUs active from the start (a fixed pool's; 0 for an
            elastic pool, whose first GPU is activated by the first arrival).

    Returns:
        ``activations``: GPU activations during the run (activity intervals
        beyond the ``initial_gpus``); ``releases``: intervals that ended
        before the run did (a GPU released, or an instance retired);
        ``migration_stages``: live KV copy stages of the completed
        migrations (the final stop-and-copy not counted);
        ``migration_stall_s``: the requests' total migration stall (KV and
        token moves together: the records do not separate them);
        ``migrations_aborted``: planned migrations that were aborted.
    """
    ivs = result.gpu_intervals
    return {
        "activations": max(0, len(ivs) - initial_gpus),
        "releases": sum(1 for iv in ivs if iv.end_s < result.end_s),
        "migration_stages": sum(m.stages for m in result.migrations if m.mode == "kv"),
        "migration_stall_s": float(sum(r.migration_stall_s for r in result.records)),
        "migrations_aborted": int(result.aborted_migrations),
    }


def load_measured_requests(run_dir: str | Path) -> list[Request]:
    """The requests of a measured run (``bench-serve``'s ``requests.csv``), in
    arrival order with ids ``0..n-1``: the exact workload the server saw
    (arrival = when each request was sent, lengths after the bench's caps).

    Raises:
        InputError: a missing file, column or value.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / "requests.csv"
    need = ("model", "arrival_s", "prompt_tokens", "output_tokens")
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise InputError(
            f"cannot read measured requests: {exc.strerror or exc}", file=str(path)
        ) from None
    with handle:
        reader = csv.DictReader(handle)
        missing = [c for c in need if c not in (reader.fieldnames or ())]
        if missing:
            raise InputError(f"missing column(s) {', '.join(missing)}", file=str(path), line=1)
        raw = []
        for row in reader:
            try:
                raw.append(
                    (
                        float(row["arrival_s"]),
                        row["model"],
                        int(row["prompt_tokens"]),
                        int(row["output_tokens"]),
                    )
                )
            except (TypeError, ValueError) as exc:
                raise InputError(
                    f"bad value ({exc})", file=str(path), line=reader.line_num
                ) from None
    if not raw:
        raise InputError("no requests", file=str(path))
    raw.sort(key=lambda x: x[0])
    t0 = min(0.0, raw[0][0])
    return [
        Request(id=i, model=m, arrival_s=a - t0, prompt_tokens=p, output_tokens=o)
        for i, (a, m, p, o) in enumerate(raw)
    ]


def simulate_emulated(
    cfg: SimConfig,
    profile_csv: Path | None,
    out_dir: Path,
    *,
    requests: Sequence[Request] | None = None,
    base_dir: Path | None = None,
    progress: ProgressFn | None = None,
    overhead: RuntimeOverhead | None = None,
) -> dict[str, Any]:
    """Simulate ``cfg``'s emulated cluster and write the usual result directory.

    Args:
        cfg: the config the runtime ran (see :func:`emulated_sim_config`).
        profile_csv: the engine profile to calibrate from (None: defaults).
        out_dir: result directory (``summary.json``, ``requests.csv``, plots,
            ``report.md``; plus ``calibration.json`` when calibrated).
        requests: the requests to replay, e.g. :func:`load_measured_requests`
            of the measured run (recommended: the very requests the server
            saw); None builds ``cfg.workload`` as ``fleetserve simulate`` does.
        base_dir: where relative trace paths of ``cfg.workload`` start.
        progress: simulator progress callback.
        overhead: the serving path's overhead to add (:func:`fit_overhead`);
            None or all zero: the engine-only simulation, exactly as before.

    Returns:
        The summary (``summary.json``), with a ``fidelity`` section: the
        emulated GPU, the placement, the KV blocks per instance, the
        calibrated parameters (and ``overhead`` when one was given).

    Raises:
        ConfigError: see :func:`emulated_sim_config`; a request for a model the
            cluster does not serve.
    """
    from fleetserve.metrics import summarize, write_run

    em = emulated_sim_config(cfg, profile_csv)
    if requests is None:
        wl = build_workload(em.config, base_dir)
    else:
        wl = Workload(list(requests), "measured requests", [])
    served = set(em.kv_blocks)
    unknown = sorted({r.model for r in wl.requests} - served)
    if unknown:
        raise ConfigError(
            f"requests for model(s) {unknown}, which the emulated cluster does not serve "
            f"(serve.models: {sorted(served)})"
        )
    notes = [*wl.notes, *em.notes]
    if overhead is not None and not overhead.off:
        notes.append(
            f"serving-path overhead modelled: {overhead.request_s * 1e3:.2f} ms per request, "
            f"{overhead.iteration_s * 1e3:.2f} ms per iteration, tokens delivered "
            f"{overhead.delivery_iters:g} iterations after they are made"
        )
    result = _run_emulated(em, wl.requests, overhead, notes=notes, progress=progress)
    result.extra["fidelity"] = {
        "gpu": em.gpu.name,
        "placement": list(em.placement),
        "kv_blocks": dict(em.kv_blocks),
        "calibration_error": {m: dict(v) for m, v in em.fit_errors.items()},
        "calibration": None
        if em.calibration is None
        else {m: p.to_dict() for (m, _, _), p in sorted(em.calibration.entries.items())},
    }
    if overhead is not None:
        result.extra["fidelity"]["overhead"] = overhead.to_dict()
    result.extra["mechanisms"] = mechanism_counts(
        result, 0 if em.config.cluster.elastic else len(em.placement)
    )
    summary = summarize(result, cfg.slo_scales)
    summary["workload"] = {"source": wl.source, "requests": len(wl.requests)}
    out = Path(out_dir)
    write_run(out, result, summary)
    if em.calibration is not None:
        em.calibration.save(out / "calibration.json")
    return summary


# ---------------------------------------------------------------------- overhead fit

PROBE_GROUP_GAP_S = 60.0
"""Simulated time between probe groups (each group ends long before the next)."""


def _probe_requests(probes: Sequence[ProbeRequest]) -> list[Request]:
    """The probes as one workload: group ``g`` starts at ``g * PROBE_GROUP_GAP_S``,
    its requests at their measured send offsets (ids in probe order)."""
    groups = sorted({p.group for p in probes})
    start = {g: i * PROBE_GROUP_GAP_S for i, g in enumerate(groups)}
    reqs = [
        Request(
            id=i,
            model=p.model,
            arrival_s=start[p.group] + p.send_s,
            prompt_tokens=p.prompt_tokens,
            output_tokens=p.output_tokens,
        )
        for i, p in enumerate(probes)
    ]
    return sorted(reqs, key=lambda r: (r.arrival_s, r.id))


def _mean_abs_pct(sim: Sequence[float], meas: Sequence[float]) -> float:
    if not meas:
        return math.nan
    return float(np.mean([abs(s - m) / m * 100 for s, m in zip(sim, meas, strict=True)]))


def simulate_probes(
    cfg: SimConfig,
    profile_csv: Path | None,
    probes: Sequence[ProbeRequest],
    overhead: RuntimeOverhead | None,
) -> list[tuple[float, float | None]]:
    """Simulated ``(ttft_s, tpot_s)`` of each probe (groups laid out apart, as
    :func:`fit_overhead` simulates them), with ``overhead`` (None: engine only)."""
    em = emulated_sim_config(cfg, profile_csv)
    reqs = _probe_requests(probes)
    records = _run_emulated(em, reqs, overhead).records
    out: list[tuple[float, float | None]] = []
    for rec in records:
        if rec.first_token_s is None or rec.finish_s is None:
            out.append((math.inf, None))
            continue
        n = rec.output_tokens
        tpot = (rec.finish_s - rec.first_token_s) / (n - 1) if n > 1 else None
        out.append((rec.first_token_s - rec.arrival_s, tpot))
    return out


def fit_overhead(
    cfg: SimConfig,
    profile_csv: Path | None,
    probes: Sequence[ProbeRequest],
    *,
    iteration_grid: Sequence[float] = ITERATION_GRID_S,
    lag_grid: Sequence[float] = LAG_GRID,
) -> OverheadFit:
    """Calibrate the serving path's overhead from probes of the running server.

    The probes (:mod:`fleetserve.runtime.fidelity_probe`: requests alone and
    bursts of concurrent ones on the idle server) are simulated on the same
    emulated cluster, each group on its own, for every ``iteration_s`` in
    :data:`~fleetserve.experiments.fidelity_overhead.ITERATION_GRID_S` and
    ``delivery_iters`` in :data:`~fleetserve.experiments.fidelity_overhead.LAG_GRID`;
    ``request_s`` is then the median of measured minus simulated TTFT (at
    least 0: a request alone has no queue, so the difference is the fixed
    latency). The pair that minimizes the squared relative errors of the
    probes' TTFT plus those of their TPOT, averaged within each group and
    then over the groups (a burst of 12 weighs as much as one request alone),
    wins.

    ``fleetserve fidelity`` fits the probes sent alone and only checks the
    model on the bursts: a burst's requests pass the HTTP server and the
    controller one after another, a queue the model lacks, so the bursts
    would pull the parameters to stand in for that wait.

    Choice: the parameters are fitted to probes, never to the replay they are
    compared with; the grid keeps the fit transparent (and exact for the
    fixed latency, which only shifts an isolated group). ``iteration_grid``
    and ``lag_grid`` narrow the grids, e.g. to one measured value each
    (``fleetserve fidelity`` with a step log: the measured hand-off between
    steps, :func:`step_handoff_s`, and lag 0), leaving ``request_s`` alone
    to fit.

    Raises:
        InputError: no probe with a finite TTFT, or probes for a model the
            cluster does not serve.
        ConfigError: see :func:`emulated_sim_config`.
    """
    probes = [p for p in probes if math.isfinite(p.ttft_s) and p.ttft_s > 0]
    if not probes:
        raise InputError("no usable overhead probes (every probe lacks a first token)")
    em = emulated_sim_config(cfg, profile_csv)
    unknown = sorted({p.model for p in probes} - set(em.kv_blocks))
    if unknown:
        raise InputError(f"overhead probes of model(s) {unknown}, which the cluster does not serve")
    reqs = _probe_requests(probes)
    meas_ttft = [p.ttft_s for p in probes]
    with_tpot = [i for i, p in enumerate(probes) if p.tpot_s is not None and p.tpot_s > 0]
    meas_tpot = [probes[i].tpot_s or 0.0 for i in with_tpot]
    groups = sorted({p.group for p in probes})
    by_group = [np.array([i for i, p in enumerate(probes) if p.group == g]) for g in groups]
    config = replace(em.config, macro_steps=False)
    best: tuple[float, float, float, float] | None = None  # loss, it, lag, request_s
    engine_only: tuple[float, float] = (math.nan, math.nan)
    its, lags = set(iteration_grid), set(lag_grid)
    if not its or not lags:
        raise ConfigError("fit_overhead: empty iteration or lag grid")
    for it in sorted(its | {0.0}):  # 0 and 0: the engine-only errors
        timelines: dict[int, Timeline] = {}
        sim = placed_simulator(
            config,
            reqs,
            placement=em.placement,
            timelines=timelines,
            cost=with_iteration_overhead(em.cost, it),
        )
        records = sim.run().records  # in request-id order = probe order
        for lag in sorted(lags | {0.0}):
            ttft: list[float] = []
            tpot: list[float | None] = []
            for rec in records:
                tl = timelines.get(rec.instance) if rec.instance is not None else None
                first, fin = rec.first_token_s, rec.finish_s
                if first is None or fin is None:
                    ttft.append(math.inf)
                    tpot.append(None)
                    continue
                if tl is not None:
                    first, fin = deliver(tl, first, lag), max(deliver(tl, fin, lag), first)
                ttft.append(first - rec.arrival_s)
                n = rec.output_tokens
                tpot.append((fin - first) / (n - 1) if n > 1 else None)
            resid = sorted(m - s for m, s in zip(meas_ttft, ttft, strict=True))
            req_s = max(0.0, resid[len(resid) // 2])
            sq = np.zeros(len(probes))
            for i, (s_ttft, m) in enumerate(zip(ttft, meas_ttft, strict=True)):
                sq[i] = ((s_ttft + req_s - m) / m) ** 2
            for i, m in zip(with_tpot, meas_tpot, strict=True):
                sq[i] += (((tpot[i] or 0.0) - m) / m) ** 2
            loss = float(np.mean([sq[idx].mean() for idx in by_group]))
            if not math.isfinite(loss):
                continue
            if it == 0 and lag == 0:
                engine_only = (
                    _mean_abs_pct(ttft, meas_ttft),
                    _mean_abs_pct([tpot[i] or 0.0 for i in with_tpot], meas_tpot),
                )
            if it not in its or lag not in lags:
                continue
            if best is None or loss < best[0] - 1e-15:
                best = (loss, it, lag, req_s)
                fitted = (
                    _mean_abs_pct([s + req_s for s in ttft], meas_ttft),
                    _mean_abs_pct([tpot[i] or 0.0 for i in with_tpot], meas_tpot),
                )
    if best is None:
        raise InputError("the overhead probes could not be simulated (no request finished)")
    _loss, it, lag, req_s = best
    return OverheadFit(
        overhead=RuntimeOverhead(request_s=req_s, iteration_s=it, delivery_iters=lag),
        probes=len(probes),
        ttft_mean_abs_pct=fitted[0],
        tpot_mean_abs_pct=fitted[1],
        engine_only_ttft_mean_abs_pct=engine_only[0],
        engine_only_tpot_mean_abs_pct=engine_only[1],
    )


# --------------------------------------------------------------------------- compare

_TARGET = (
    ("TTFT mean", ("latency_s", "ttft", "mean")),
    ("TTFT P99", ("latency_s", "ttft", "p99")),
    ("TPOT mean", ("latency_s", "tpot", "mean")),
    ("TPOT P99", ("latency_s", "tpot", "p99")),
)
_EXTRA = (
    ("TTFT P50", ("latency_s", "ttft", "p50")),
    ("TPOT P50", ("latency_s", "tpot", "p50")),
    ("E2E mean", ("latency_s", "e2e", "mean")),
    ("E2E P50", ("latency_s", "e2e", "p50")),
    ("E2E P99", ("latency_s", "e2e", "p99")),
    ("throughput (req/s)", ("throughput_rps",)),
    ("throughput (tok/s)", ("throughput_tokens_s",)),
)
_COUNTS = (
    ("requests finished", ("requests", "finished")),
    ("requests rejected", ("requests", "rejected")),
    ("requests unfinished", ("requests", "unfinished")),
)


def summary_value(summary: Mapping[str, Any], path: Sequence[str]) -> float | None:
    """The finite number at ``path`` in a summary, else None."""
    node: Any = summary
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    if isinstance(node, bool) or not isinstance(node, int | float) or not math.isfinite(node):
        return None
    return float(node)


def fidelity_table(
    sim_summary: Mapping[str, Any],
    measured_summary: Mapping[str, Any],
    tolerance_pct: float = FIDELITY_TOLERANCE_PCT,
    *,
    counts: bool = False,
) -> list[dict[str, Any]]:
    """Simulated vs measured, one row per metric.

    Rows: mean and P99 of TTFT and TPOT (``target: True``, the fidelity
    target), then P50s, end-to-end latency and throughput (``target:
    False``, reported only), and with ``counts`` the finished, rejected and
    unfinished requests (``target: False``). Each row: ``metric``, ``key`` (dotted path in
    ``summary.json``), ``simulated``, ``measured``, ``rel_error_pct`` =
    ``100 (simulated - measured) / measured``, ``within`` =
    ``|rel_error_pct| <= tolerance_pct``, ``target``. A metric missing from
    either summary (or a zero measurement) has ``rel_error_pct`` and
    ``within`` None.
    """
    rows = []
    groups = [(True, _TARGET), (False, _EXTRA)] + ([(False, _COUNTS)] if counts else [])
    for target, specs in groups:
        for name, path in specs:
            sim, meas = summary_value(sim_summary, path), summary_value(measured_summary, path)
            err = None if sim is None or meas is None or meas == 0 else 100 * (sim - meas) / meas
            rows.append(
                {
                    "metric": name,
                    "key": ".".join(path),
                    "simulated": sim,
                    "measured": meas,
                    "rel_error_pct": err,
                    "within": None if err is None else abs(err) <= tolerance_pct,
                    "target": target,
                }
            )
    return rows


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}"


def fidelity_markdown(
    rows: Sequence[Mapping[str, Any]],
    title: str = "Fidelity: simulated vs measured",
    tolerance_pct: float = FIDELITY_TOLERANCE_PCT,
) -> str:
    """The rows of :func:`fidelity_table` as a markdown section (target rows
    first, then the extra ones), with a one-line verdict."""
    body = []
    for r in rows:
        err = r["rel_error_pct"]
        within = r["within"]
        body.append(
            [
                r["metric"] + ("" if r["target"] else " (extra)"),
                _num(r["simulated"]),
                _num(r["measured"]),
                "-" if err is None else f"{err:+.1f}%",
                "-" if within is None else ("yes" if within else "no"),
            ]
        )
    targets = [r for r in rows if r["target"]]
    ok = sum(1 for r in targets if r["within"])
    lines = [
        f"## {title}",
        "",
        f"{ok} of {len(targets)} target metrics within {tolerance_pct:g}% "
        "(mean and P99 of TTFT and TPOT; seconds).",
        "",
        *md_table(
            ("metric", "simulated", "measured", "rel. error", f"within {tolerance_pct:g}%"), body
        ),
    ]
    return "\n".join(lines)


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """A result directory's ``summary.json`` (or the file itself).

    Raises:
        InputError: missing or not JSON.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / "summary.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"cannot read summary: {exc.strerror or exc}", file=str(path)) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON: {exc.msg}", file=str(path), line=exc.lineno) from None
    if not isinstance(data, dict):
        raise InputError("expected a JSON object", file=str(path))
    return data


# ------------------------------------------------------------------- engine steps

STEP_WINDOWS = 10
"""Consecutive windows :func:`engine_step_check` splits a step log into (drift)."""


@dataclass(frozen=True, slots=True)
class LoggedStep:
    """One engine step of a ``serve.step_log`` file and the cost model's time for it."""

    worker: int
    start_s: float
    measured_s: float
    predicted_s: float
    mixed: bool  # prompts in it (the simulator's mixed iteration), else decode only
    models: tuple[str, ...] = ()  # the models of its forwards
    more: bool | None = None  # work was left after it (None: an older log)


def _step_line(
    em: EmulatedSim, obj: Any, where: tuple[str, int], bound: dict[str, Any]
) -> LoggedStep:
    """One step-log line as a :class:`LoggedStep`; ``predicted_s`` is NaN when
    a model in it has no cost-model spec. ``bound``: each model's
    :class:`InstanceCost`, filled as models appear (None: unknown)."""
    file, line = where
    try:
        pred = 0.0
        mixed = False
        names: list[str] = []
        for f in obj["forwards"]:
            name = str(f["model"])
            names.append(name)
            if name not in bound:
                try:
                    bound[name] = em.cost.bind(get_model(name), em.gpu)
                except FleetserveError:  # unknown name, unreadable checkpoint config
                    bound[name] = None
            cost = bound[name]
            chunks = [(int(n), int(c)) for n, c in f["chunks"]]
            b, ctx = int(f["decode_batch"]), int(f["decode_ctx"])
            mixed = mixed or bool(chunks)
            if cost is None:
                pred = math.nan
            elif chunks:
                pred += cost.mixed_time(chunks, b, ctx)
            elif b:
                pred += cost.decode_time_scalar(b, float(ctx))
        return LoggedStep(
            int(obj["worker"]),
            float(obj["start_s"]),
            float(obj["duration_s"]),
            pred,
            mixed,
            tuple(sorted(set(names))),
            bool(obj["more"]) if "more" in obj else None,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(
            f"a step-log line needs worker, start_s, duration_s and forwards "
            f"[{{model, chunks, decode_batch, decode_ctx}}]: {type(e).__name__}: {e}",
            file=file,
            line=line,
        ) from None


def read_step_log(em: EmulatedSim, path: str | Path) -> tuple[list[LoggedStep], int]:
    """The steps of a ``serve.step_log`` file with the cost model's time for each.

    Returns:
        Every step (in file order) and how many of them have no prediction
        (``predicted_s`` NaN) because a model in them has no cost-model spec
        (a checkpoint the simulator does not know); their timing still counts
        for :func:`step_handoff_s`.

    Raises:
        InputError: unreadable file, a line that is not JSON or lacks a field.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read the step log: {e.strerror or e}", file=str(p)) from None
    steps: list[LoggedStep] = []
    bound: dict[str, Any] = {}
    for i, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InputError(f"invalid JSON: {e.msg}", file=str(p), line=i) from None
        steps.append(_step_line(em, obj, (str(p), i), bound))
    return steps, sum(1 for s in steps if math.isnan(s.predicted_s))


def _ratio_stats(steps: Sequence[LoggedStep]) -> dict[str, Any]:
    meas = np.array([s.measured_s for s in steps])
    pred = np.array([s.predicted_s for s in steps])
    ok = pred > 0
    r = meas[ok] / pred[ok]
    return {
        "steps": len(steps),
        "measured_s": float(meas.sum()),
        "predicted_s": float(pred.sum()),
        "ratio": float(meas.sum() / pred.sum()) if pred.sum() > 0 else None,
        "median_ratio": float(np.median(r)) if r.size else None,
        "p10_ratio": float(np.percentile(r, 10)) if r.size else None,
        "p90_ratio": float(np.percentile(r, 90)) if r.size else None,
    }


def engine_step_check(
    em: EmulatedSim,
    path: str | Path,
    windows: int = STEP_WINDOWS,
    span: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """How fast the engines really stepped during a run, against the cost model.

    Reads a ``serve.step_log`` and predicts each step's time as the simulator
    would charge it (a step with prompts: :meth:`InstanceCost.mixed_time`, the
    simulator's chunked-prefill iteration; decode only:
    :meth:`InstanceCost.decode_time_scalar`, with the per-batch correction).
    ``ratio`` is total measured over total predicted engine time: above 1 the
    engines ran slower than their profile said. The per-window ratios (the
    run split into ``windows`` equal spans of wall time) show drift. ``span``:
    only steps starting within these Unix times (a replay without the probes
    around it). This is a diagnostic of the cost model's share of a fidelity error; the
    simulation never uses it.

    Returns:
        ``{"all", "decode", "mixed"}`` ratio statistics (:func:`_ratio_stats`),
        ``"windows"`` (``{"t_s", "ratio", "steps"}`` per non-empty window, t
        from the first step) and ``"skipped"``.
    """
    steps, skipped = read_step_log(em, path)
    steps = [s for s in steps if not math.isnan(s.predicted_s)]
    if span is not None:
        steps = [s for s in steps if span[0] <= s.start_s <= span[1]]
    out: dict[str, Any] = {"skipped": skipped, "windows": []}
    if not steps:
        return out
    out["all"] = _ratio_stats(steps)
    for key, sel in (("decode", False), ("mixed", True)):
        mine = [s for s in steps if s.mixed is sel]
        if mine:
            out[key] = _ratio_stats(mine)
    t0 = min(s.start_s for s in steps)
    length = max(s.start_s for s in steps) - t0
    width = length / windows if length > 0 else 1.0
    for k in range(windows):
        lo, hi = t0 + k * width, t0 + (k + 1) * width
        mine = [s for s in steps if lo <= s.start_s < hi or (k == windows - 1 and s.start_s == hi)]
        if mine:
            st = _ratio_stats(mine)
            out["windows"].append(
                {"t_s": (lo + hi) / 2 - t0, "ratio": st["ratio"], "steps": st["steps"]}
            )
    return out


MIN_SITU_STEPS = 20
"""Fewest logged steps of a kind (per model) :func:`in_situ_factors` derives a factor from."""


def in_situ_factors(
    em: EmulatedSim, path: str | Path, exclude: tuple[float, float] | None = None
) -> dict[str, dict[str, Any]]:
    """How much slower (or faster) each served model's engine steps ran in the
    server than its standalone profile says, from a ``serve.step_log``.

    For every model, over the logged steps of that model alone (a step running
    two models' forwards cannot be split between them), ``prefill`` is total
    measured over total predicted time of the steps with prompts and
    ``decode`` that of the decode-only steps (predictions as in
    :func:`engine_step_check`, with ``em``'s calibration). A kind with fewer
    than :data:`MIN_SITU_STEPS` steps gets factor 1. ``exclude``: leave out
    the steps starting within these Unix times (``fleetserve fidelity``
    leaves out its replay: the factors come from the probes of the idle
    server around it, never from the run they are compared with).

    Returns:
        ``{model: {"prefill": f, "decode": f, "prefill_steps": n, "decode_steps": n}}``.
    """
    steps, _ = read_step_log(em, path)
    if exclude is not None:
        steps = [s for s in steps if not exclude[0] <= s.start_s <= exclude[1]]
    out: dict[str, dict[str, Any]] = {}
    for m in em.kv_blocks:
        mine = [s for s in steps if s.models == (m,) and s.predicted_s > 0]
        row: dict[str, Any] = {}
        for kind, mixed in (("prefill", True), ("decode", False)):
            sel = [s for s in mine if s.mixed is mixed]
            pred = sum(s.predicted_s for s in sel)
            ok = len(sel) >= MIN_SITU_STEPS and pred > 0
            row[kind] = sum(s.measured_s for s in sel) / pred if ok else 1.0
            row[f"{kind}_steps"] = len(sel)
        out[m] = row
    return out


def rescale_profile(
    profile_csv: Path, factors: Mapping[str, Mapping[str, Any]], out_csv: Path
) -> Path:
    """``profile_csv`` with each served model's prefill rows multiplied by its
    ``prefill`` factor and its decode rows by its ``decode`` factor
    (:func:`in_situ_factors`): the profile as the engine runs inside the
    server. The calibration then fits these rows exactly as it fits a
    standalone profile's. Rows of other models are copied unchanged.

    A step with prompts also carries the running decodes, so its factor is
    that of mixed iterations; applying it to the pure prefill rows is the
    approximation (the probes' mixed steps are mostly one prompt alone).
    """
    rows = load_profile(profile_csv)
    write_profile(
        out_csv,
        [
            replace(r, time_s=r.time_s * float(factors[r.model][r.phase]))
            if r.model in factors
            else r
            for r in rows
        ],
    )
    return out_csv


def step_handoff_s(
    em: EmulatedSim, path: str | Path, exclude: tuple[float, float] | None = None
) -> tuple[float, int] | None:
    """The mean time a worker's engine waited between two steps while it had
    work (the step ended with ``more`` set): the worker's per-iteration
    hand-off (the engine lock, the polls' reports, the event loop), measured
    rather than fitted. ``exclude``: as in :func:`in_situ_factors`.

    Returns:
        ``(seconds, gaps)``, or None when the log has no such pair of steps
        (or predates the ``more`` field).
    """
    steps, _ = read_step_log(em, path)
    by_worker: dict[int, list[LoggedStep]] = {}
    for s in steps:
        by_worker.setdefault(s.worker, []).append(s)
    gaps: list[float] = []
    for mine in by_worker.values():
        mine.sort(key=lambda s: s.start_s)
        for a, b in itertools.pairwise(mine):
            if a.more and not (exclude is not None and exclude[0] <= a.start_s <= exclude[1]):
                gaps.append(max(0.0, b.start_s - (a.start_s + a.measured_s)))
    return (float(np.mean(gaps)), len(gaps)) if gaps else None
