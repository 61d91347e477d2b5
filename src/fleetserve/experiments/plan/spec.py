"""The input of ``fleetserve plan``: services with traffic and SLOs, GPU options, search.

A plan file (YAML; ``configs/plan-example.yaml`` is a commented example)::

    duration_s: 600        # simulated traffic per candidate (after the history)
    history_s: 60          # traffic before it that placement sees
    seed: 0
    services:
      - name: chat
        model: llama-3.1-8b
        traffic: {rate: 2.0, lengths: azure-conv}          # or curve / trace
        slo: {ttft_p99_s: 2.0, tpot_p99_s: 0.1}
    gpus:
      - {name: a100-80gb}                                  # catalog price
      - {name: h100-80gb, price_per_hour: 2.49}            # your price
    search: {tp: [1, 2, 4, 8], max_gpus: 64, jobs: 2}

Every key is checked (unknown keys rejected, types checked) and errors name the
file and the field's dotted path.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetserve.config import apply_override, build_dataclass, load_config
from fleetserve.errors import ConfigError
from fleetserve.policy.catalog import MULTI, get_stack, stacks_in
from fleetserve.workload.loaders import FORMATS

__all__ = [
    "DEFAULT_STACKS",
    "LENGTH_PROFILES",
    "ONE_MODEL_STACKS",
    "BurstSpec",
    "GpuOption",
    "PlanService",
    "PlanSpec",
    "SearchSpec",
    "SloSpec",
    "TrafficSpec",
    "load_plan",
]

DEFAULT_STACKS: tuple[str, ...] = (
    "vllm",
    "alpaserve",
    "muxserve",
    "seallm",
    "muxserve-mell",
    "seallm-mell",
    "fleet",
)
"""The stacks a plan compares by default: every multi-LLM system of the catalog
and the composed ones (the catalog's ablations, e.g. ``seallm-fcfs``, are left
out: they are research variants, not deployment choices; name them in
``search.stacks`` to include them)."""

ONE_MODEL_STACKS: tuple[str, ...] = ("llumnix", "mell", "kunserve")
"""Stacks added by default when a plan has one service: Llumnix and Mell (the
single-model simulator: one model's instances, KV migration; Mell on an elastic
pool capped at the candidate's size) and KunServe (replicas dropping layers
under bursts). They serve one model, so a plan with several services cannot
use them."""

LENGTH_PROFILES: tuple[str, ...] = ("azure-conv", "sharegpt", "burstgpt", "agieval-cot")
"""Built-in request-length distributions of synthetic traffic
(:func:`fleetserve.experiments.plan.traffic.length_sampler`)."""

TRACE_FORMATS: tuple[str, ...] = tuple(f for f in FORMATS if f != "lengths")
"""Trace formats a service's traffic may replay (``lengths`` has no arrival times)."""


def _finite_positive(where: str, v: float | None) -> None:
    if v is not None and not (math.isfinite(v) and v > 0):
        raise ConfigError(f"{where} must be a finite number > 0, got {v}")


@dataclass(frozen=True)
class BurstSpec:
    """A window whose rate is ``factor`` times the curve's."""

    start_s: float
    len_s: float
    factor: float

    def __post_init__(self) -> None:
        if self.start_s < 0 or self.len_s <= 0 or self.factor <= 0:
            raise ConfigError(
                "traffic.bursts: each burst needs start_s >= 0, len_s > 0, factor > 0, got "
                f"{self.start_s}, {self.len_s}, {self.factor}"
            )


@dataclass(frozen=True)
class TrafficSpec:
    """One service's traffic: exactly one of ``rate``, ``curve`` or ``trace``.

    Attributes:
        rate: a constant rate, req/s.
        curve: ``[[t, rate], ...]`` knots of a rate curve (linear between
            knots, held before the first and after the last), t in seconds
            from the start of the history.
        bursts: windows multiplying the rate (``rate`` or ``curve``).
        cv: coefficient of variation of the gaps (1: Poisson).
        lengths: request lengths of synthetic traffic, one of
            :data:`LENGTH_PROFILES`, unless ``prompt_tokens`` and
            ``output_tokens`` fix them.
        prompt_tokens, output_tokens: fixed lengths instead of a profile.
        trace: a trace file (relative to the plan file); its arrivals from
            ``start_s`` on, ``history_s + duration_s`` seconds of them, are
            the traffic.
        format: the trace's format (azure, mooncake, burstgpt, jsonl).
        start_s: where in the trace the traffic starts, seconds.
        rate_scale: arrival-rate multiplier of the trace.
        length_scale: length multiplier of the trace.
    """

    rate: float | None = None
    curve: tuple[tuple[float, float], ...] | None = None
    bursts: tuple[BurstSpec, ...] = ()
    cv: float = 1.0
    lengths: str = "azure-conv"
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    trace: str | None = None
    format: str | None = None
    start_s: float = 0.0
    rate_scale: float = 1.0
    length_scale: float = 1.0

    def __post_init__(self) -> None:
        given = [k for k in ("rate", "curve", "trace") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(
                "traffic: give exactly one of rate, curve or trace"
                + (f" (got {', '.join(given)})" if given else "")
            )
        _finite_positive("traffic.rate", self.rate)
        _finite_positive("traffic.rate_scale", self.rate_scale)
        _finite_positive("traffic.length_scale", self.length_scale)
        if self.curve is not None:
            if any(len(p) != 2 for p in self.curve) or not self.curve:
                raise ConfigError("traffic.curve: a list of [t, rate] pairs")
            ts = [p[0] for p in self.curve]
            if any(b <= a for a, b in itertools.pairwise(ts)):
                raise ConfigError(f"traffic.curve: times must increase strictly, got {ts}")
            if any(p[1] < 0 for p in self.curve) or not any(p[1] > 0 for p in self.curve):
                raise ConfigError("traffic.curve: rates must be >= 0, one of them > 0")
        if not (math.isfinite(self.cv) and self.cv >= 0):
            raise ConfigError(f"traffic.cv must be >= 0, got {self.cv}")
        fixed = (self.prompt_tokens, self.output_tokens)
        if (fixed[0] is None) != (fixed[1] is None):
            raise ConfigError("traffic: give both prompt_tokens and output_tokens, or neither")
        if fixed[0] is not None and (fixed[0] < 1 or (fixed[1] or 0) < 1):
            raise ConfigError("traffic.prompt_tokens and output_tokens must be >= 1")
        if self.lengths not in LENGTH_PROFILES:
            raise ConfigError(
                f"traffic.lengths must be one of {', '.join(LENGTH_PROFILES)}, got {self.lengths!r}"
            )
        if self.trace is not None:
            if self.format not in TRACE_FORMATS:
                raise ConfigError(
                    f"traffic.format: a trace needs its format, one of {', '.join(TRACE_FORMATS)}"
                    f" (got {self.format!r})"
                )
            if self.bursts or self.cv != 1.0 or fixed[0] is not None:
                raise ConfigError(
                    "traffic: bursts, cv and fixed lengths apply to rate or curve traffic, "
                    "not to a trace (use rate_scale / length_scale)"
                )
            if self.start_s < 0:
                raise ConfigError(f"traffic.start_s must be >= 0, got {self.start_s}")
        elif self.format is not None or self.start_s != 0 or self.rate_scale != 1.0:
            raise ConfigError("traffic: format, start_s and rate_scale apply to a trace only")


@dataclass(frozen=True)
class SloSpec:
    """A service's objectives; every one given must hold (at least one).

    Attributes:
        ttft_p99_s: P99 time to first token, seconds.
        tpot_p99_s: P99 time per output token (a request's mean decode step).
        e2e_p99_s: P99 end-to-end latency.
        attainment_scale: SeaLLM's SLO scale k: a request meets it when its
            latency is at most k times its execution time on an idle instance.
        attainment_min: the share of requests that must meet ``attainment_scale``.

    A request that is rejected or does not finish counts as missing every
    objective (an infinite latency).
    """

    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    e2e_p99_s: float | None = None
    attainment_scale: float | None = None
    attainment_min: float = 0.9

    def __post_init__(self) -> None:
        names = ("ttft_p99_s", "tpot_p99_s", "e2e_p99_s", "attainment_scale")
        for n in names:
            _finite_positive(f"slo.{n}", getattr(self, n))
        if all(getattr(self, n) is None for n in names):
            raise ConfigError(f"slo: give at least one of {', '.join(names)}")
        if not 0 < self.attainment_min <= 1:
            raise ConfigError(f"slo.attainment_min must be in (0, 1], got {self.attainment_min}")


@dataclass(frozen=True)
class PlanService:
    """One service: a name (what its requests are tagged with), a model, traffic, SLOs."""

    name: str
    model: str
    traffic: TrafficSpec
    slo: SloSpec

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("services: every service needs a non-empty name")


@dataclass(frozen=True)
class GpuOption:
    """A candidate GPU type; ``price_per_hour`` (USD per GPU-hour) overrides the
    catalog's default (:mod:`fleetserve.spec.prices`)."""

    name: str
    price_per_hour: float | None = None


@dataclass(frozen=True)
class SearchSpec:
    """How the search runs.

    Attributes:
        stacks: candidate stacks of the catalog: multi-LLM stacks, and with a
            single service also single-model and KunServe stacks; None:
            :data:`DEFAULT_STACKS` (with one service, :data:`ONE_MODEL_STACKS`
            too).
        tp: allowed tensor-parallel degrees. Each is a candidate of the
            ``dedicated`` placement (every service on the smallest allowed
            degree at or above the least it fits on, and at or above the
            candidate's); placements that choose degrees themselves
            (``muxserve``, ``seallm``) choose among these.
        max_gpus: the largest pool considered.
        jobs: simulations run at once (processes).
        budget_s: wall-time budget of the search; when it runs out, no new
            simulation starts and the report says which searches were cut.
        brute_force: simulate every pool size from the lower bound to
            ``max_gpus`` of every candidate, without bisection or pruning (to
            check the search on small inputs).
        robustness_seeds: seeds the chosen point is re-simulated with.
        headroom_max: the largest traffic multiplier the headroom search tries.
        headroom_steps: bisection steps of the headroom search.
        processes: placement-search processes per simulation (SeaLLM); 1
            keeps the search within ``jobs`` processes.
        baseline: a stack searched first, alone (None: none); every other
            stack's pool sizes are then capped at ``cost_cap`` times the
            baseline's cheapest cost, so that no time goes into fleets far
            dearer than one already known to work.
        cost_cap: see ``baseline`` (>= 1).
        robust_tries: alternatives tried when the chosen point misses an SLO
            on another seed (0: none).
    """

    stacks: tuple[str, ...] | None = None
    tp: tuple[int, ...] = (1, 2, 4, 8)
    max_gpus: int = 64
    jobs: int = 2
    budget_s: float = 1800.0
    brute_force: bool = False
    robustness_seeds: tuple[int, ...] = (1, 2)
    headroom_max: float = 4.0
    headroom_steps: int = 5
    processes: int = 1
    baseline: str | None = "vllm"
    cost_cap: float = 2.0
    robust_tries: int = 4

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cost_cap) and self.cost_cap >= 1):
            raise ConfigError(f"search.cost_cap must be >= 1, got {self.cost_cap}")
        if not self.tp or any(t < 1 or t & (t - 1) for t in self.tp):
            raise ConfigError(f"search.tp must be a list of powers of two, got {list(self.tp)}")
        if self.robust_tries < 0:
            raise ConfigError(f"search.robust_tries must be >= 0, got {self.robust_tries}")
        for n in ("max_gpus", "jobs", "processes"):
            if getattr(self, n) < 1:
                raise ConfigError(f"search.{n} must be >= 1, got {getattr(self, n)}")
        _finite_positive("search.budget_s", self.budget_s)
        if not (math.isfinite(self.headroom_max) and self.headroom_max >= 1):
            raise ConfigError(f"search.headroom_max must be >= 1, got {self.headroom_max}")
        if self.headroom_steps < 0:
            raise ConfigError(f"search.headroom_steps must be >= 0, got {self.headroom_steps}")
        if self.stacks is not None and not self.stacks:
            raise ConfigError("search.stacks: name at least one stack (or leave it out)")


@dataclass(frozen=True)
class PlanSpec:
    """A whole plan.

    Attributes:
        services: the services (distinct names).
        gpus: candidate GPU types.
        duration_s: simulated traffic per candidate, after the history.
        history_s: traffic before the run that placement sees (SeaLLM and
            MuxServe place on measured rates; vLLM splits GPUs by them).
        seed: seed of the traffic (and of everything random).
        mem_util: share of each GPU's memory the engines may use.
        max_num_seqs: running requests per instance at most (vLLM's).
        search: how the search runs.
    """

    services: tuple[PlanService, ...]
    gpus: tuple[GpuOption, ...]
    duration_s: float = 600.0
    history_s: float = 60.0
    seed: int = 0
    mem_util: float = 0.9
    max_num_seqs: int = 256
    search: SearchSpec = field(default_factory=SearchSpec)

    def __post_init__(self) -> None:
        if not self.services:
            raise ConfigError("services: give at least one service")
        names = [s.name for s in self.services]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"services: duplicate service names {dup}")
        if not self.gpus:
            raise ConfigError("gpus: give at least one candidate GPU type")
        gnames = [g.name for g in self.gpus]
        if len(set(gnames)) != len(gnames):
            raise ConfigError(f"gpus: a GPU type is listed twice in {gnames}")
        _finite_positive("duration_s", self.duration_s)
        _finite_positive("history_s", self.history_s)
        if not 0 < self.mem_util <= 1:
            raise ConfigError(f"mem_util must be in (0, 1], got {self.mem_util}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        for name in self.stack_names:
            stack = get_stack(name)
            if MULTI not in stack.worlds and len(self.services) > 1:
                raise ConfigError(
                    f"search.stacks: {name!r} serves one model (it runs in the "
                    f"{' and '.join(stack.worlds)} simulator); this plan has "
                    f"{len(self.services)} services. Multi-LLM stacks: "
                    f"{', '.join(stacks_in(MULTI))}"
                )
        b = self.search.baseline
        if b is not None and b not in self.stack_names:
            raise ConfigError(
                f"search.baseline {b!r} is not among the candidate stacks "
                f"({', '.join(self.stack_names)}); name one of them or null"
            )

    def tp_from(self, least: int) -> list[int]:
        """The allowed TP degrees at or above ``least`` (a candidate's TP choice)."""
        return [t for t in sorted(self.search.tp) if t >= least]

    @property
    def stack_names(self) -> tuple[str, ...]:
        """The candidate stacks (the search's, or the defaults for this plan)."""
        if self.search.stacks is not None:
            return self.search.stacks
        if len(self.services) == 1:
            return DEFAULT_STACKS + ONE_MODEL_STACKS
        return DEFAULT_STACKS


def load_plan(path: str | Path, overrides: tuple[str, ...] = ()) -> tuple[PlanSpec, Path]:
    """Read and check a plan file; ``(spec, the file's folder)``.

    Args:
        path: the YAML file.
        overrides: ``key.path=value`` assignments applied first (``--set``).

    Raises:
        InputError / ConfigError: a missing or malformed file, or a bad field
            (the message names the file and the field).
    """
    data: dict[str, Any] = load_config(path)
    for a in overrides:
        apply_override(data, a)
    for key in ("services", "gpus"):
        if key not in data:
            raise ConfigError(f"{path}: missing key {key!r}")
    services = data["services"]
    for i, raw in enumerate(services if isinstance(services, list) else []):
        if isinstance(raw, dict):  # a service's own checks, named by its position
            try:
                build_dataclass(PlanService, raw, f"services[{i}]", str(path))
            except ConfigError as e:
                detail = str(e).removeprefix(f"{path}: ")
                raise ConfigError(f"{path}: services[{i}]: {detail}") from None
    spec = build_dataclass(PlanSpec, data, "", str(path))
    return spec, Path(path).resolve().parent
