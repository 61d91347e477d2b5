"""KunServe §5 (Figs. 10, 11, 14-16) as a grid of runs of the KunServe simulator.

Qwen-2.5-14B on 8 x A800-80GB, one GPU per instance and per server, 200 Gbps
between servers (:mod:`fleetserve.sim.kun`). Every run is an ordinary KunServe
simulation (a ``kunserve:`` config with ``generator: bursty``, see
:class:`fleetserve.config.KunConfigSection`)::

    main      profile x rate x stack; Azure-conv arrivals with a 14x burst window
              profiles: burstgpt (in 603 / out 289, Table 2), azure-conv (the shared
                        trace's lengths), agieval-cot (in 237 / out 390, Table 2)
              rates: base rate x (1, 1.5, 2) (--quick: x (1, 1.5)), shorter runs in quick
              stacks: wf, kv-drop, kv-swap, llumnix, pipeline, kunserve
    ablation  burstgpt at every rate: kunserve-blocking, kunserve-norestore,
              kunserve-memgreedy (kunserve itself is the main run)
    gamma     burstgpt, Gamma arrivals (CV 3) with the same burst window, the
              focus rate (x1.5), the six main stacks
    network   burstgpt at the focus rate: kunserve and kunserve-blocking at
              25 / 50 / 100 Gbps (200 Gbps are the main and ablation runs)
    ref       per profile, the base rate without burst (modest load): wf (its
              P50 TTFT / TBT x 5 are the SLOs) and pipeline (unloaded pipeline cost)

KV provisioning (the paper's "2.1x the average requirement", §2.2). Before the
grid, :func:`provision` runs ``wf`` in-process on each profile's base-rate
workload (the x1 main workload, burst included) with all the HBM the weights
leave, measures the time-averaged KV tokens in use over the arrival window,
and sets ``kunserve.kv_tokens = round(2.1 x average / 8)`` (per instance) for
every run of that profile. The probes are cached in ``OUT/provision.json``.

Every run gets the same seed (``--seed``): the stacks of a point see the same
requests, and the rate multiplier only speeds the same arrival pattern up
(``azure-burst`` replays the same stretch of the trace at every rate).

The static pipeline baseline (Llumnix (pipeline)) has 2 stages: the paper
uses "the buddy group size found by our algorithm under one memory
throttling"; finding it per point would serialise the grid, so it is fixed at
2, the size Algorithm 1's first drop gives here (the report lists the size of
every kunserve run's first drop to check it).

Each run writes ``OUT/runs/...`` (a normal result directory); the report
(:mod:`fleetserve.experiments.kunserve_report`) reads them back from disk.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleetserve.config import config_from_dict
from fleetserve.errors import FleetserveError, UnknownNameError
from fleetserve.experiments.runner import RunSpec
from fleetserve.spec import get_gpu, get_model

logger = logging.getLogger(__name__)

MODEL = "qwen-2.5-14b"
GPU = "a800-80gb"
GPUS = 8
TP = 1
NETWORK_GBPS = 200.0
GPUS_PER_NODE = 1
KV_FACTOR = 2.1
"""KV provisioned per instance = this x the measured average demand / instances."""
BURST_FACTOR = 14.0
"""Rate multiplier inside the burst window (BurstGPT's jump, §2.2)."""
GAMMA_CV = 3.0
STATIC_STAGES = 2
"""Stages of the static pipeline baseline (see the module docstring)."""
SLO_FACTOR = 5.0
"""SLO = this x the P50 under modest load (§5.1)."""
NETWORKS: tuple[float, ...] = (25.0, 50.0, 100.0, 200.0)
"""Per-GPU bandwidths of the exchange ablation (Fig. 14), Gbit/s."""
FOCUS = 1.5
"""Rate multiplier of the timeline, the gamma scenario and the network sweep."""
PROVISION_FILE = "provision.json"

MAIN, ABLATION = "main", "ablation"
AZURE, GAMMA = "azure-burst", "gamma"


@dataclass(frozen=True, slots=True)
class Profile:
    """A length profile (Table 2) and its base arrival rate."""

    name: str
    label: str
    kind: str
    base_rate: float


PROFILES: tuple[Profile, ...] = (
    Profile("burstgpt", "BurstGPT", "balanced", 3.0),
    Profile("azure-conv", "AzureConv", "prefill-heavy", 2.0),
    Profile("agieval-cot", "AGIEval-CoT", "decode-heavy", 5.0),
)
"""The three datasets. Base rate: the largest of 2, 3, 4, 5 req/s at which ``wf`` with
all the HBM (no memory throttling) serves the base-rate workload, burst included, with at
most ~5 % of requests over the SLOs, so that at the base rate the TTFT spikes come from
memory throttling, not from compute (the paper's premise; docs/reproduce-kunserve.md has
the probe). The base load without the burst is then served with no queueing at all."""

PROFILE_BY_NAME: dict[str, Profile] = {p.name: p for p in PROFILES}
ABLATION_PROFILE = "burstgpt"


@dataclass(frozen=True, slots=True)
class StackSpec:
    """A column of the tables: a KunServe-simulator stack."""

    label: str
    paper: str
    role: str


STACKS: tuple[StackSpec, ...] = (
    StackSpec("wf", "Llumnix (replication)", MAIN),
    StackSpec("kv-drop", "KV drop (vLLM recompute)", MAIN),
    StackSpec("kv-swap", "KV swap (vLLM)", MAIN),
    StackSpec("llumnix", "Llumnix (w/ migration)", MAIN),
    StackSpec("pipeline", "Llumnix (pipeline)", MAIN),
    StackSpec("kunserve", "KunServe", MAIN),
    StackSpec("kunserve-blocking", "KunServe, blocking KV exchange", ABLATION),
    StackSpec("kunserve-norestore", "KunServe, no live restore", ABLATION),
    StackSpec("kunserve-memgreedy", "KunServe, memory-greedy planner", ABLATION),
)
STACK_BY_LABEL: dict[str, StackSpec] = {s.label: s for s in STACKS}
EXCHANGE_STACKS = ("kunserve", "kunserve-blocking")


def labels(role: str | None = None) -> list[str]:
    """Stack labels (of one role), in display order."""
    return [s.label for s in STACKS if role is None or s.role == role]


@dataclass(frozen=True, slots=True)
class Sizes:
    """Run length and burst window of a mode (before the hidden test scale)."""

    duration_s: float
    burst_start_s: float
    burst_len_s: float


FULL = Sizes(300.0, 90.0, 20.0)
QUICK = Sizes(180.0, 60.0, 20.0)
FULL_MULTS: tuple[float, ...] = (1.0, 1.5, 2.0)
QUICK_MULTS: tuple[float, ...] = (1.0, 1.5)


@dataclass(frozen=True, slots=True)
class Mode:
    """Full or ``--quick``, times a hidden test scale (multiplies every duration)."""

    quick: bool = False
    scale: float = 1.0
    seed: int = 0

    def sizes(self) -> Sizes:
        base = QUICK if self.quick else FULL
        return Sizes(
            base.duration_s * self.scale,
            base.burst_start_s * self.scale,
            base.burst_len_s * self.scale,
        )

    @property
    def mults(self) -> tuple[float, ...]:
        return QUICK_MULTS if self.quick else FULL_MULTS

    @property
    def focus(self) -> float:
        return FOCUS

    @property
    def sample_interval_s(self) -> float:
        return 0.5 * self.scale

    @property
    def name(self) -> str:
        base = "quick" if self.quick else "full"
        return base if self.scale == 1.0 else f"{base} x{self.scale:g}"

    def to_dict(self) -> dict[str, Any]:
        s = self.sizes()
        return {
            "name": self.name,
            "quick": self.quick,
            "scale": self.scale,
            "seed": self.seed,
            "duration_s": s.duration_s,
            "burst_start_s": s.burst_start_s,
            "burst_len_s": s.burst_len_s,
            "burst_factor": BURST_FACTOR,
            "rate_multipliers": list(self.mults),
            "focus_multiplier": self.focus,
        }


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True, slots=True)
class Run:
    """One simulation of the grid (before the KV provisioning is known).

    Attributes:
        kind: ``main`` (main stacks and ablations), ``gamma``, ``net`` (exchange
            sweep below 200 Gbps), ``ref`` (base rate, no burst) or ``probe``
            (the KV provisioning probe: wf, all the HBM, base rate with burst).
        profile: length profile.
        mult: rate multiplier (1 for ``ref``).
        stack: stack label.
        network_gbps: per-GPU network bandwidth.
    """

    kind: str
    profile: str
    mult: float
    stack: str
    network_gbps: float = NETWORK_GBPS

    @property
    def arrival(self) -> str:
        return GAMMA if self.kind == "gamma" else AZURE

    @property
    def burst(self) -> bool:
        return self.kind != "ref"

    @property
    def rate(self) -> float:
        return PROFILE_BY_NAME[self.profile].base_rate * self.mult

    @property
    def point(self) -> str:
        """The run's workload point (folder and key without the stack)."""
        if self.kind in ("ref", "probe"):
            return f"{self.kind}/{self.profile}"
        where = f"{self.profile}/x{self.mult:g}"
        if self.kind == "gamma":
            return f"gamma/{where}"
        if self.kind == "net":
            return f"net-{self.network_gbps:g}gbps/{where}"
        return where

    @property
    def key(self) -> str:
        return f"{self.point}/{self.stack}"

    def out_dir(self, out: Path) -> Path:
        return out / "runs" / self.point / self.stack


def probe_runs() -> list[Run]:
    """The provisioning probes (one per profile), as runs the report reads back."""
    return [Run("probe", p.name, 1.0, "wf") for p in PROFILES]


def select_stacks(names: Sequence[str] | None) -> list[StackSpec]:
    """The stacks called ``names`` (default: all), in display order.

    Raises:
        UnknownNameError: a name that is not a stack of the experiment.
        FleetserveError: an empty or repeated selection.
    """
    if names is None:
        return list(STACKS)
    if not names:
        raise FleetserveError("--stacks needs at least one stack name")
    if len(set(names)) != len(names):
        raise FleetserveError(f"--stacks lists a stack twice: {','.join(names)}")
    for n in names:
        if n not in STACK_BY_LABEL:
            raise UnknownNameError("kunserve stack", n, STACK_BY_LABEL)
    return [s for s in STACKS if s.label in names]


def grid_runs(mode: Mode, stacks: Sequence[StackSpec] | None = None) -> list[Run]:
    """Every run of the grid for ``stacks`` (default: all), in report order."""
    chosen = {s.label for s in (STACKS if stacks is None else stacks)}
    main = [s for s in labels(MAIN) if s in chosen]
    abl = [s for s in labels(ABLATION) if s in chosen]
    runs: list[Run] = []
    for p in PROFILES:
        for m in mode.mults:
            runs += [Run("main", p.name, m, s) for s in main]
            if p.name == ABLATION_PROFILE:
                runs += [Run("main", p.name, m, s) for s in abl]
    runs += [Run("gamma", ABLATION_PROFILE, mode.focus, s) for s in main]
    for g in NETWORKS:
        if g != NETWORK_GBPS:
            runs += [
                Run("net", ABLATION_PROFILE, mode.focus, s, g)
                for s in EXCHANGE_STACKS
                if s in chosen
            ]
    for p in PROFILES:
        runs.append(Run("ref", p.name, 1.0, "wf"))  # the SLO baseline, always
        if "pipeline" in chosen:
            runs.append(Run("ref", p.name, 1.0, "pipeline"))
    return runs


def workload_config(
    profile: str, rate: float, mode: Mode, *, arrival: str = AZURE, burst: bool = True
) -> dict[str, Any]:
    """The ``kunserve`` section's workload keys of a run."""
    s = mode.sizes()
    return {
        "generator": "bursty",
        "profile": profile,
        "arrival": arrival,
        "rate": rate,
        "duration_s": s.duration_s,
        "burst_start_s": s.burst_start_s,
        "burst_len_s": s.burst_len_s,
        "burst_factor": BURST_FACTOR if burst else 1.0,
        "cv": GAMMA_CV,
    }


def _base_config(stack: str, kun: dict[str, Any], mode: Mode) -> dict[str, Any]:
    return {
        "model": MODEL,
        "seed": mode.seed,
        "sample_interval_s": mode.sample_interval_s,
        "cluster": {"gpu": GPU, "gpus": GPUS, "tp": TP, "elastic": False},
        "policy": {"stack": stack},
        "kunserve": kun,
    }


def run_config(run: Run, mode: Mode, kv_tokens: int) -> dict[str, Any]:
    """The plain config dict of ``run`` with ``kv_tokens`` per instance."""
    kun = workload_config(run.profile, run.rate, mode, arrival=run.arrival, burst=run.burst)
    kun.update(
        kv_tokens=int(kv_tokens),
        network_gbps=float(run.network_gbps),
        gpus_per_node=GPUS_PER_NODE,
    )
    if run.stack == "pipeline":
        kun["static_stages"] = STATIC_STAGES
    return _base_config(run.stack, kun, mode)


# --------------------------------------------------------------------------- provisioning


@dataclass(frozen=True, slots=True)
class Provision:
    """The KV provisioning of one profile (from a ``wf`` probe with all the HBM).

    Attributes:
        avg_tokens: time-averaged KV tokens in use over the arrival window, cluster-wide.
        peak_tokens: the largest sample.
        kv_tokens: KV provisioned per instance (``round(2.1 x avg / instances)``).
        probe: the probe's config dict (the cache key).
        probe_wall_s: wall time of the probe.
    """

    profile: str
    base_rate: float
    avg_tokens: float
    peak_tokens: float
    kv_tokens: int
    probe: dict[str, Any]
    probe_wall_s: float

    @property
    def kv_gb_per_gpu(self) -> float:
        return self.kv_tokens * get_model(MODEL).kv_bytes_per_token / TP / 1e9

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(derived_numbers(self.kv_tokens))
        return d


def derived_numbers(kv_tokens: int) -> dict[str, float]:
    """Memory facts of a provisioning: KV and parameter GB per GPU and their ratio,
    next to the paper's setup (all the HBM at mem_util 0.9 for KV)."""
    spec = get_model(MODEL)
    gpu = get_gpu(GPU)
    kv_gb = kv_tokens * spec.kv_bytes_per_token / TP / 1e9
    param_gb = spec.weight_bytes / TP / 1e9
    full_kv_gb = gpu.hbm_bytes * 0.9 / 1e9 - param_gb
    return {
        "kv_gb_per_gpu": kv_gb,
        "param_gb_per_gpu": param_gb,
        "param_to_kv": param_gb / kv_gb if kv_gb > 0 else math.inf,
        "full_hbm_kv_gb_per_gpu": full_kv_gb,
        "full_hbm_param_to_kv": param_gb / full_kv_gb,
    }


def probe_config(profile: Profile, mode: Mode) -> dict[str, Any]:
    """The probe: ``wf`` on the base-rate workload (burst included), all the HBM."""
    kun = workload_config(profile.name, profile.base_rate, mode)
    kun.update(network_gbps=NETWORK_GBPS, gpus_per_node=GPUS_PER_NODE)
    return _base_config("wf", kun, mode)


def time_average(t: Sequence[float], y: Sequence[float], until: float) -> float:
    """Time-weighted mean of the samples ``(t, y)`` over ``[t[0], until]``
    (trapezoids; samples after ``until`` are dropped, the curve is cut at ``until``)."""
    ta = np.asarray(t, dtype=float)
    ya = np.asarray(y, dtype=float)
    if len(ta) == 0:
        return 0.0
    keep = ta <= until
    ta, ya = ta[keep], ya[keep]
    if len(ta) == 0:
        return 0.0
    if ta[-1] < until:  # hold the last sample's value to the end of the window
        ta = np.append(ta, until)
        ya = np.append(ya, ya[-1])
    span = ta[-1] - ta[0]
    if span <= 0:
        return float(ya.mean())
    area = float(np.sum((ya[1:] + ya[:-1]) * np.diff(ta)) / 2.0)
    return area / span


def provision_from_samples(
    t: Sequence[float], kv_used_bytes: Sequence[float], until: float
) -> tuple[float, float, int]:
    """``(average tokens, peak tokens, kv_tokens per instance)`` from a probe's
    KV samples (bytes, cluster-wide)."""
    per_token = get_model(MODEL).kv_bytes_per_token
    tokens = [b / per_token for b in kv_used_bytes]
    avg = time_average(t, tokens, until)
    peak = max(tokens, default=0.0)
    instances = GPUS // TP
    return avg, peak, max(1, round(KV_FACTOR * avg / instances))


def measure_provision(profile: Profile, mode: Mode, out: Path | None = None) -> Provision:
    """Run the probe of ``profile`` in this process and derive its provisioning.

    With ``out``, the probe is also written as a run directory
    (``OUT/runs/probe/<profile>/wf``): the report shows it as the no-throttling
    reference.
    """
    from fleetserve.experiments.runner import simulate_and_write
    from fleetserve.sim.build import build_workload
    from fleetserve.sim.kun_run import run_kun

    t0 = time.perf_counter()
    cfg_d = probe_config(profile, mode)
    cfg = config_from_dict(cfg_d)
    wl = build_workload(cfg)
    if out is None:
        result = run_kun(cfg, wl.requests, wl.notes)
    else:
        d = Run("probe", profile.name, 1.0, "wf").out_dir(out)
        for name in ("summary.json", "error.txt"):
            (d / name).unlink(missing_ok=True)
        _, result = simulate_and_write(cfg, wl, d)
    ts = result.timeseries
    avg, peak, kv = provision_from_samples(ts.t, ts.kv_used_bytes, mode.sizes().duration_s)
    return Provision(
        profile.name,
        profile.base_rate,
        avg,
        peak,
        kv,
        cfg_d,
        time.perf_counter() - t0,
    )


def _read_cache(out: Path) -> list[dict[str, Any]]:
    """The probes cached in ``OUT/provision.json`` (any mode, any seed)."""
    path = out / PROVISION_FILE
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        logger.warning("%s is unreadable; probing again", path)
        return []
    entries = data.get("probes", []) if isinstance(data, dict) else []
    return [e for e in entries if isinstance(e, dict)]


def _from_cache(entries: Sequence[dict[str, Any]], want: dict[str, Any]) -> Provision | None:
    for entry in entries:
        if entry.get("probe") != want:
            continue
        try:
            return Provision(
                str(entry["profile"]),
                float(entry["base_rate"]),
                float(entry["avg_tokens"]),
                float(entry["peak_tokens"]),
                int(entry["kv_tokens"]),
                dict(entry["probe"]),
                float(entry["probe_wall_s"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
    return None


def _write_cache(out: Path, fresh: Sequence[Provision]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    keep = [e for e in _read_cache(out) if all(e.get("probe") != p.probe for p in fresh)]
    data = {"kv_factor": KV_FACTOR, "probes": [*keep, *(p.to_dict() for p in fresh)]}
    (out / PROVISION_FILE).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def provision(out: Path, mode: Mode, *, probe: bool = True) -> dict[str, Provision]:
    """The KV provisioning of every profile, from ``OUT/provision.json`` when it holds
    a probe made with the same settings, else measured now (and cached).

    Args:
        out: the experiment folder.
        mode: run sizes and seed (the probe's workload depends on them).
        probe: False (``--report-only``): never simulate; a profile without a
            matching cached probe is left out.
    """
    cached = _read_cache(out)
    got: dict[str, Provision] = {}
    fresh: list[Provision] = []
    for p in PROFILES:
        hit = _from_cache(cached, probe_config(p, mode))
        if hit is None and probe:
            hit = measure_provision(p, mode, out)
            fresh.append(hit)
            logger.info(
                "%s: average KV %.0f tokens -> %d tokens per instance",
                p.name,
                hit.avg_tokens,
                hit.kv_tokens,
            )
        if hit is not None:
            got[p.name] = hit
    if fresh:
        _write_cache(out, fresh)
    return got


# --------------------------------------------------------------------------- plan


def _weight(run: Run, mode: Mode) -> float:
    cost = {"kv-drop": 1.5, "kv-swap": 1.5, "llumnix": 1.5, "pipeline": 0.6}.get(run.stack, 1.0)
    return run.rate * mode.sizes().duration_s * cost * (1.0 if run.burst else 0.5)


def grid_specs(
    out: Path, mode: Mode, stacks: Sequence[StackSpec], provisions: dict[str, Provision]
) -> list[RunSpec]:
    """One :class:`RunSpec` per run of :func:`grid_runs`."""
    return [
        RunSpec(
            key=r.key,
            out_dir=r.out_dir(out),
            config=run_config(r, mode, provisions[r.profile].kv_tokens),
            weight=_weight(r, mode),
        )
        for r in grid_runs(mode, stacks)
    ]


def check_stacks(mode: Mode, stacks: Sequence[StackSpec]) -> None:
    """Validate one config per stack (with a placeholder KV size) before anything runs.

    Raises:
        FleetserveError: the first problem, as one line.
    """
    from fleetserve.experiments.report_common import check_stack_config

    for st in stacks:
        run = Run("main", ABLATION_PROFILE, mode.mults[0], st.label)
        check_stack_config(st.label, run_config(run, mode, 1000))


def check_data() -> None:
    """Fail early, with one line, when the shared Azure conversation trace is missing."""
    from fleetserve.workload.bursty import default_azure_path, length_profile

    length_profile("azure-conv", azure_path=default_azure_path())


def plan(
    out: Path, mode: Mode, stacks: Sequence[str] | None = None
) -> tuple[list[RunSpec], dict[str, Provision]]:
    """Validate the grid, provision the KV (probes, cached) and return the runs.

    Raises:
        FleetserveError: unknown stack, missing shared data, a config that cannot run.
    """
    selected = select_stacks(stacks)
    check_data()
    check_stacks(mode, selected)
    provisions = provision(out, mode)
    specs = grid_specs(out, mode, selected, provisions)
    logger.info("kunserve grid: %d runs (%s)", len(specs), mode.name)
    return specs, provisions


__all__ = [
    "ABLATION",
    "ABLATION_PROFILE",
    "BURST_FACTOR",
    "FOCUS",
    "GAMMA_CV",
    "GPU",
    "GPUS",
    "KV_FACTOR",
    "MAIN",
    "MODEL",
    "NETWORKS",
    "NETWORK_GBPS",
    "PROFILES",
    "PROFILE_BY_NAME",
    "PROVISION_FILE",
    "SLO_FACTOR",
    "STACKS",
    "STATIC_STAGES",
    "Mode",
    "Profile",
    "Provision",
    "Run",
    "Sizes",
    "StackSpec",
    "check_stacks",
    "derived_numbers",
    "grid_runs",
    "grid_specs",
    "labels",
    "measure_provision",
    "plan",
    "probe_config",
    "probe_runs",
    "provision",
    "provision_from_samples",
    "run_config",
    "select_stacks",
    "time_average",
    "workload_config",
]
