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
  decode-attention extension on (``decode_attn_eff``): the CPU engine's decode
  attention gathers paged K/V and runs small matmuls, several times slower
  per query-key pair than the fused attention of prompts. Profile rows name
  the GPU ``cpu`` unless ``--gpu-name`` was given; either way the rows of a
  served model are mapped to the emulated GPU (a profile with several GPU
  names must contain one named ``cpu`` or the emulated GPU's name). Without
  a profile the default efficiencies apply (meaningless on a CPU; smoke tests
  only).

Known differences (not modelled): the runtime's admission queue
(``serve.max_queue``, HTTP 429 beyond it); HTTP, controller and Ray latency
between a client and the engine (on this project's 2-core machine, with the
server and the load generator sharing the cores with the worker, it added
~75 ms to the mean TTFT and ~2 ms to the mean TPOT of a one-worker run that
the simulation, and an in-process replay of the same requests on one
``Engine``, put at ~28 ms and ~3 ms); the engine's per-request sampling and
detokenization (~20 µs per request per step; the profile times forward +
argmax only); decode attention padding inside a context bucket (the cost
model sees the batch's total context); the engine reserving pages for one
token more than the prompt at admission, admitting no prompt in a step that
preempted, and never splitting a prompt.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fleetserve.config import SimConfig
from fleetserve.costmodel import (
    Calibration,
    CostModel,
    ProfileRow,
    calibrate,
    load_profile,
    relative_errors,
)
from fleetserve.errors import ConfigError, InputError
from fleetserve.experiments.report_common import md_table
from fleetserve.metrics.records import RunResult
from fleetserve.runtime.plan import plan_workers
from fleetserve.sim.build import Workload, build_workload
from fleetserve.sim.simulator import ProgressFn, Simulator, preflight
from fleetserve.spec import GpuSpec, emulated_gpu, get_model
from fleetserve.spec.memory import kv_capacity_blocks
from fleetserve.workload.request import Request

__all__ = [
    "FIDELITY_TOLERANCE_PCT",
    "EmulatedSim",
    "emulated_gpu_for",
    "emulated_sim_config",
    "fidelity_markdown",
    "fidelity_table",
    "load_measured_requests",
    "operating_rows",
    "read_summary",
    "runtime_placement",
    "simulate_emulated",
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
    return tuple(m for hosted in plan_workers(cfg, models) for m in hosted)


def _served_models(cfg: SimConfig) -> tuple[str, ...]:
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
    if cfg.is_multi or cfg.is_kun:
        raise ConfigError(
            "the fidelity simulation covers the runtime's fixed or elastic pool of "
            "instances; multi-LLM (services, multi.generator) and KunServe configs are not "
            "emulated"
        )
    sv = cfg.serve
    gpu = emulated_gpu_for(cfg)
    models = _served_models(cfg)
    notes = [
        f"emulated cluster: {sv.workers} x {gpu.name} ({sv.gpu_memory_mb:g} MiB arena, "
        f"{sv.dtype}, {sv.threads_per_worker} thread(s)) serving {', '.join(models)}"
    ]
    model = cfg.model if cfg.model in models else models[0]
    workload = cfg.workload
    if len(models) > 1 and workload.models is None:
        workload = replace(workload, models=models)
        notes.append(f"requests assigned uniformly to the served models {list(models)}")
    cluster = replace(
        cfg.cluster, gpu=gpu.name, tp=1, mem_util=1.0, gpus=sv.workers, max_gpus=sv.workers
    )
    engine = replace(
        cfg.engine,
        max_num_seqs=sv.max_running,
        max_batched_tokens=sv.max_batch_tokens,
        watermark=0.0,
        chunked_prefill=True,
    )
    sim_cfg = replace(cfg, model=model, workload=workload, cluster=cluster, engine=engine)
    if cluster.elastic and len(models) > 1:
        raise ConfigError(
            "an elastic runtime pool (cluster.elastic: true) serves one model; "
            f"serve.models has {len(models)}"
        )
    preflight(sim_cfg)
    blocks = {m: kv_capacity_blocks(get_model(m), gpu, 1, 1.0, cluster.block_size) for m in models}
    placement = () if cluster.elastic else runtime_placement(cfg, models)
    calibration = None
    rows: list[ProfileRow] = []
    if profile_csv is not None:
        path = Path(profile_csv)
        rows = _profile_rows(load_profile(path), models, gpu, sv.threads_per_worker, path)
        rows, dropped = operating_rows(rows, sv.max_running, sv.max_batch_tokens)
        calibration = calibrate(rows, get_model, lambda _: gpu, decode_attention=True)
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
    return EmulatedSim(
        config=sim_cfg,
        gpu=gpu,
        cost=cost,
        calibration=calibration,
        placement=placement,
        kv_blocks=blocks,
        fit_errors=fit_errors,
        notes=tuple(notes),
    )


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


class _PlacedSimulator(Simulator):
    """The simulator with the fixed pool placed as the runtime places it.

    :class:`Simulator` places a fixed pool by the trace's request rates; the
    runtime's controller by ``workload.model_weights``. This subclass starts
    the given instances instead (models without requests are left out: the
    simulator knows only the models its requests name).
    """

    def __init__(
        self,
        config: SimConfig,
        requests: Sequence[Request],
        *,
        placement: Sequence[str],
        **kwargs: Any,
    ) -> None:
        self._runtime_placement = tuple(placement)
        super().__init__(config, requests, **kwargs)

    def _place_fixed(self, n_gpus: int) -> None:
        for m in self._runtime_placement:
            if m in self.specs:
                self._start_instance(m, 0.0)


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

    Returns:
        The summary (``summary.json``), with a ``fidelity`` section: the
        emulated GPU, the placement, the KV blocks per instance and the
        calibrated parameters.

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
    sim = _PlacedSimulator(
        em.config,
        wl.requests,
        placement=em.placement,
        cost=em.cost,
        notes=[*wl.notes, *em.notes],
        progress=progress,
    )
    result: RunResult = sim.run()
    result.extra["fidelity"] = {
        "gpu": em.gpu.name,
        "placement": list(em.placement),
        "kv_blocks": dict(em.kv_blocks),
        "calibration_error": {m: dict(v) for m, v in em.fit_errors.items()},
        "calibration": None
        if em.calibration is None
        else {m: p.to_dict() for (m, _, _), p in sorted(em.calibration.entries.items())},
    }
    summary = summarize(result, cfg.slo_scales)
    summary["workload"] = {"source": wl.source, "requests": len(wl.requests)}
    out = Path(out_dir)
    write_run(out, result, summary)
    if em.calibration is not None:
        em.calibration.save(out / "calibration.json")
    return summary


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


def _get(summary: Mapping[str, Any], path: tuple[str, ...]) -> float | None:
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
) -> list[dict[str, Any]]:
    """Simulated vs measured, one row per metric.

    Rows: mean and P99 of TTFT and TPOT (``target: True``, the fidelity
    target), then P50s, end-to-end latency and throughput (``target:
    False``, reported only). Each row: ``metric``, ``key`` (dotted path in
    ``summary.json``), ``simulated``, ``measured``, ``rel_error_pct`` =
    ``100 (simulated - measured) / measured``, ``within`` =
    ``|rel_error_pct| <= tolerance_pct``, ``target``. A metric missing from
    either summary (or a zero measurement) has ``rel_error_pct`` and
    ``within`` None.
    """
    rows = []
    for target, specs in ((True, _TARGET), (False, _EXTRA)):
        for name, path in specs:
            sim, meas = _get(sim_summary, path), _get(measured_summary, path)
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
