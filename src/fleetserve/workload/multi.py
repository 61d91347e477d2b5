"""Multi-service (multi-LLM) workloads for the SeaLLM and MuxServe reproductions.

Both papers evaluate many LLM *services* sharing a GPU pool. This module builds their
synthetic workloads from the generators of :mod:`fleetserve.workload.synthetic`:

- :func:`seallm_workload` (SeaLLM §6.1): one service per (model, profile), ``chat``
  (ShareGPT lengths) and ``summarization`` (LongBench-like lengths, synthesized), bursty
  arrivals with a rotating hot service.
- :func:`muxserve_workload` (MuxServe §5.1): 19 LLaMA models (:func:`muxserve_models`),
  power-law popularity, Poisson arrivals, ShareGPT lengths.

Each returns a :class:`MultiWorkload`: the *run* requests, the *history* that precedes them
(what a placement policy may look at) and the :class:`~fleetserve.workload.service.Service`
records estimated from that history only. ``Request.model`` holds the service name.

History and run come from one process: arrivals are drawn over ``[0, history_s +
duration_s)``; those before ``history_s`` are the history, the rest, shifted by
``-history_s``, are the run. Both lists are sorted by arrival (ties by service order) and
numbered ``0..n-1``.

Randomness: ``numpy.random.SeedSequence(seed)`` is spawned into one child per service (in
service order), and each child into two generators: one draws the service's arrivals, the
other its lengths, in fixed blocks of :data:`LENGTH_BLOCK` requests. So the same seed always
gives the same workload, a service's random draws do not depend on the other services,
and the history does not depend on ``duration_s`` (a longer run only appends requests).
Nothing here imports torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from fleetserve.errors import ConfigError, FleetserveError, InputError
from fleetserve.spec import get_model
from fleetserve.spec.types import ModelSpec
from fleetserve.workload.data import find_data_dir
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service
from fleetserve.workload.synthetic import (
    EmpiricalLengths,
    LengthSampler,
    gamma_arrivals,
    lengths_from_file,
    lognormal_lengths,
    poisson_arrivals,
    power_law_rates,
)

__all__ = [
    "LENGTH_BLOCK",
    "LONGBENCH_OUTPUT_MEAN",
    "LONGBENCH_OUTPUT_P50",
    "LONGBENCH_PROMPT_MEAN",
    "LONGBENCH_PROMPT_P50",
    "PROFILES",
    "SHAREGPT_FILE",
    "MultiWorkload",
    "muxserve_models",
    "muxserve_workload",
    "seallm_workload",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

PROFILES: tuple[str, ...] = ("chat", "summarization")
"""Request profiles of :func:`seallm_workload`."""

SHAREGPT_FILE = "sharegpt_8k_lengths.csv"
"""File name of the ShareGPT lengths CSV in the shared data folder."""

LONGBENCH_PROMPT_MEAN = 13186.8
"""Mean input tokens of SeaLLM's LongBench summarization requests (SeaLLM Table 1)."""
LONGBENCH_OUTPUT_MEAN = 21.1
"""Mean output tokens of SeaLLM's LongBench summarization requests (SeaLLM Table 1)."""
LONGBENCH_PROMPT_P50 = 11000.0
"""Median input tokens chosen for the synthesized LongBench lengths (not in the paper)."""
LONGBENCH_OUTPUT_P50 = 16.0
"""Median output tokens chosen for the synthesized LongBench lengths (not in the paper)."""

LENGTH_BLOCK = 1024
"""Lengths are drawn this many requests at a time, so a longer workload extends a shorter."""

_SEALLM_SHAREGPT = (73.0, 426.9)  # SeaLLM Table 1: ShareGPT mean input / output tokens
_MUXSERVE_SHAREGPT = (161.0, 338.0)  # MuxServe §5.1: ShareGPT mean prompt / output tokens

_MUXSERVE_BUCKETS: tuple[tuple[str, int], ...] = (
    ("llama-2-7b", 12),
    ("llama-2-13b", 4),
    ("llama-30b", 2),
    ("llama-65b", 1),
)


def muxserve_models() -> list[str]:
    """The 19 catalog model names of MuxServe's synthetic workload (§5.1).

    MuxServe serves 12 LLaMA models of 4B-8B parameters, 4 of 8B-21B, 2 of 21B-41B and 1 of
    41B-70B; its artifact uses huggyllama ``llama-7b``, ``llama-13b``, ``llama-30b`` and
    ``llama-65b`` (LLaMA-1). The catalog has ``llama-30b`` and ``llama-65b`` but no LLaMA-1
    7B/13B, so ``llama-2-7b`` and ``llama-2-13b`` stand in: their layer shapes (and so
    weights and KV bytes) are identical; only ``max_context`` differs (4096 instead of
    2048), which the simulator does not enforce.

    Returns:
        12 x ``llama-2-7b``, 4 x ``llama-2-13b``, 2 x ``llama-30b``, 1 x ``llama-65b``, in
        that order (the order :func:`muxserve_workload` hands out rates).
    """
    return [name for name, count in _MUXSERVE_BUCKETS for _ in range(count)]


@dataclass(frozen=True)
class MultiWorkload:
    """A synthesized multi-service workload.

    Attributes:
        services: service name -> :class:`Service`, estimated from ``history`` only: rate =
            history requests / ``history_s``, mean lengths = the history's means. A service
            with no history request gets rate ``1/history_s`` and its profile's mean
            lengths (and a line in ``notes``).
        history: the ``history_s`` seconds before the run; arrivals in ``[0, history_s)``,
            sorted, ids ``0..n-1``.
        requests: the run; arrivals in ``[0, duration_s)``, sorted, ids ``0..n-1``.
        notes: human-readable notes on what was synthesized and how.
        source: a short description for reports.
    """

    services: dict[str, Service]
    history: list[Request]
    requests: list[Request]
    notes: tuple[str, ...]
    source: str


# --------------------------------------------------------------------------- validation


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_positive(name: str, value: object) -> float:
    v = _finite(name, value)
    if v <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return v


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
    return int(seed)


def _model_specs(models: Sequence[str], *, distinct: bool) -> list[ModelSpec]:
    if isinstance(models, str) or not models:
        raise ConfigError(f"models must be a non-empty sequence of model names, got {models!r}")
    specs = []
    for m in models:
        if not isinstance(m, str) or not m.strip():
            raise ConfigError(f"models: {m!r} is not a model name")
        try:
            specs.append(get_model(m))
        except FleetserveError as e:
            raise ConfigError(f"models: {e}") from e
    names = [s.name for s in specs]
    if distinct and len(set(names)) != len(names):
        raise ConfigError(f"models must not repeat a model, got {list(models)}")
    return specs


# --------------------------------------------------------------------------- lengths


@functools.lru_cache(maxsize=4)
def _load_lengths(path: str, mtime_ns: int, size: int) -> EmpiricalLengths:
    del mtime_ns, size  # part of the cache key only: a changed file is read again
    return lengths_from_file(path, "lengths")


def sharegpt_sampler(sharegpt: str | Path | None) -> EmpiricalLengths:
    """The ShareGPT lengths sampler, from ``sharegpt`` or the shared data folder."""
    if sharegpt is None:
        path = find_data_dir([SHAREGPT_FILE]) / SHAREGPT_FILE
    else:
        path = Path(sharegpt)
        if not path.is_file():
            raise InputError(
                "ShareGPT lengths CSV not found (expected columns "
                "num_prefill_tokens,num_decode_tokens)",
                file=str(path),
            )
    st = path.stat()
    return _load_lengths(str(path), st.st_mtime_ns, st.st_size)


def _summarization_sampler() -> LengthSampler:
    return lognormal_lengths(
        LONGBENCH_PROMPT_MEAN, LONGBENCH_PROMPT_P50, LONGBENCH_OUTPUT_MEAN, LONGBENCH_OUTPUT_P50
    )


def _draw_lengths(
    sampler: LengthSampler, n: int, rng: np.random.Generator
) -> tuple[IntArray, IntArray]:
    """``n`` length pairs, drawn in blocks of :data:`LENGTH_BLOCK` (prefix-stable in ``n``)."""
    blocks = [sampler(LENGTH_BLOCK, rng) for _ in range(max(1, -(-n // LENGTH_BLOCK)))]
    prompts = np.concatenate([b[0] for b in blocks])[:n].astype(np.int64)
    outputs = np.concatenate([b[1] for b in blocks])[:n].astype(np.int64)
    return prompts, outputs


def _rngs(seed: int, n: int) -> list[tuple[np.random.Generator, np.random.Generator]]:
    """(arrivals, lengths) generators of each of ``n`` services."""
    out = []
    for child in np.random.SeedSequence(seed).spawn(n):
        arrivals, lengths = child.spawn(2)
        out.append((np.random.default_rng(arrivals), np.random.default_rng(lengths)))
    return out


def _mean(values: Sequence[int]) -> float:
    return float(np.mean(np.asarray(values, dtype=np.float64)))


# --------------------------------------------------------------------------- arrivals


def _rotating_gamma_arrivals(
    window_rates: FloatArray, window_s: float, end_s: float, cv: float, rng: np.random.Generator
) -> FloatArray:
    """A Gamma renewal process with a piecewise-constant rate, by time change.

    Window ``k`` covers ``[k*window_s, (k+1)*window_s)`` (the last one ends at ``end_s``)
    and has rate ``window_rates[k]``. A unit-rate Gamma renewal process (gap CV ``cv``) is
    drawn in operational time ``tau`` over ``[0, Lambda(end_s))`` and mapped to real time
    through the inverse of the cumulative rate ``Lambda(t)``; inside a window this is a
    Gamma renewal process at the window's rate with the same CV.
    """
    n_win = len(window_rates)
    bounds = np.minimum(np.arange(n_win + 1, dtype=np.float64) * window_s, end_s)
    cum = np.concatenate(([0.0], np.cumsum(np.diff(bounds) * window_rates)))
    total = float(cum[-1])
    if total <= 0.0:
        return np.empty(0, dtype=np.float64)
    tau = gamma_arrivals(1.0, cv, duration_s=total, rng=rng)
    k = np.clip(np.searchsorted(cum, tau, side="right") - 1, 0, n_win - 1)
    # tau < total, so side="right" never lands on a zero-rate window (no division by 0)
    t = bounds[k] + (tau - cum[k]) / window_rates[k]
    return t[t < end_s]


# --------------------------------------------------------------------------- assembly


@dataclass(frozen=True, slots=True)
class _Stream:
    """One service's draws over the whole span (history + run)."""

    name: str
    spec: ModelSpec
    times: FloatArray
    prompts: IntArray
    outputs: IntArray
    fallback_prompt: float
    fallback_output: float


def _requests(streams: Sequence[_Stream], lo: float, hi: float) -> list[Request]:
    """Requests of every stream with ``lo <= t < hi``, shifted by ``-lo``, ids 0..n-1."""
    t_parts, s_parts, p_parts, o_parts = [], [], [], []
    for i, s in enumerate(streams):
        keep = (s.times >= lo) & (s.times < hi)
        t_parts.append(s.times[keep] - lo)
        s_parts.append(np.full(int(keep.sum()), i, dtype=np.int64))
        p_parts.append(s.prompts[keep])
        o_parts.append(s.outputs[keep])
    t_all = np.concatenate(t_parts)
    s_all = np.concatenate(s_parts)
    order = np.lexsort((s_all, t_all))
    t_sel = t_all[order].tolist()
    s_sel = s_all[order].tolist()
    p_sel = np.concatenate(p_parts)[order].tolist()
    o_sel = np.concatenate(o_parts)[order].tolist()
    return [
        Request(
            id=i,
            model=streams[s_sel[i]].name,
            arrival_s=max(0.0, t_sel[i]),
            prompt_tokens=p_sel[i],
            output_tokens=o_sel[i],
        )
        for i in range(len(t_sel))
    ]


def _assemble(
    streams: Sequence[_Stream],
    history_s: float,
    duration_s: float,
    notes: list[str],
    source: str,
) -> MultiWorkload:
    history = _requests(streams, 0.0, history_s)
    run = _requests(streams, history_s, history_s + duration_s)
    by_service: dict[str, list[Request]] = {s.name: [] for s in streams}
    for r in history:
        by_service[r.model].append(r)
    services: dict[str, Service] = {}
    empty: list[str] = []
    for s in streams:
        seen = by_service[s.name]
        if seen:
            services[s.name] = Service(
                name=s.name,
                spec=s.spec,
                rate=len(seen) / history_s,
                mean_prompt=_mean([r.prompt_tokens for r in seen]),
                mean_output=_mean([r.output_tokens for r in seen]),
            )
        else:
            empty.append(s.name)
            services[s.name] = Service(
                name=s.name,
                spec=s.spec,
                rate=1.0 / history_s,
                mean_prompt=s.fallback_prompt,
                mean_output=s.fallback_output,
            )
    if empty:
        notes.append(
            f"{len(empty)} service(s) had no request in the {history_s:g} s history "
            f"({', '.join(empty)}): their Service rate is 1/history_s = {1.0 / history_s:.3g} "
            "req/s and their lengths the profile means"
        )
    return MultiWorkload(
        services=services, history=history, requests=run, notes=tuple(notes), source=source
    )


def _check_common(total_rate: object, duration_s: object, history_s: object) -> float:
    rate = _check_positive("total_rate", total_rate)
    _check_positive("duration_s", duration_s)
    _check_positive("history_s", history_s)
    return rate


# --------------------------------------------------------------------------- SeaLLM


def seallm_workload(
    total_rate: float,
    *,
    duration_s: float,
    history_s: float,
    seed: int = 0,
    models: Sequence[str] = ("llama-2-7b", "llama-2-13b", "llama-2-70b", "opt-6.7b"),
    profiles: Sequence[str] = PROFILES,
    cv: float = 4.0,
    rotate_s: float = 60.0,
    burst_share: float = 0.5,
    sharegpt: str | Path | None = None,
) -> MultiWorkload:
    """SeaLLM's multi-service workload (§6.1), synthesized.

    Services: one per (model, profile), named ``"<model>/<profile>"`` (e.g.
    ``"llama-2-70b/summarization"``), in the order models x profiles (8 by default). SeaLLM
    itself clusters the requests by length with K-means and gives each cluster a random
    LLM; one service per (model, profile) keeps the two length profiles apart on every
    model, which is what the clustering is for.

    Lengths:

    - ``chat``: ShareGPT (prompt, output) pairs resampled with replacement from the lengths
      CSV (``sharegpt``, or ``sharegpt_8k_lengths.csv`` in the shared data folder, see
      :mod:`fleetserve.workload.data`). That file (sarathi-serve's, LLaMA-2 tokenizer,
      whole conversations) has far longer prompts than SeaLLM's ShareGPT (Table 1: mean
      input 73.0, output 426.9); the note in the result gives both.
    - ``summarization``: LongBench is not available here, so lengths are lognormal with
      SeaLLM Table 1's means (input 13,186.8, output 21.1) and chosen medians (input 11,000,
      output 16; sigma 0.60 and 0.74), rounded, every value >= 1. Long inputs are not
      clipped to the model's ``max_context`` (4096 on LLaMA-2, 2048 on OPT): SeaLLM ran
      these lengths on LLaMA-2, and the simulator does not enforce the limit, so they are
      kept as is.

    Arrivals: SeaLLM replays the Azure Functions trace, which is not available here.
    Instead every service gets a Gamma renewal process with gap CV ``cv`` and a rotating
    burst: time (from the start of the history) is cut into windows of ``rotate_s``; in
    window ``k`` service ``k mod n`` is hot and receives ``burst_share * total_rate``, the
    other ``n - 1`` share the rest equally. So the total rate is ``total_rate`` at all times
    and each service's long-run mean rate is ``total_rate / n`` (exactly, over any ``n``
    consecutive windows). ``burst_share = 1/n`` is no burst at all. With one service it
    receives ``total_rate`` throughout. Each service's piecewise-rate process is a
    unit-rate Gamma process mapped through the inverse of its cumulative rate function
    (a time change), so inside a window it is a Gamma process at that window's rate.

    Args:
        total_rate: total arrival rate of all services, req/s (> 0).
        duration_s: length of the run, seconds (> 0).
        history_s: length of the history before the run, seconds (> 0).
        seed: random seed (integer >= 0).
        models: distinct catalog model names.
        profiles: distinct profiles, each in :data:`PROFILES`.
        cv: inter-arrival coefficient of variation (>= 0; 1 is Poisson within a window).
        rotate_s: length of a burst window, seconds (> 0).
        burst_share: share of ``total_rate`` the hot service gets, in ``[0, 1)``.
        sharegpt: the ShareGPT lengths CSV (``num_prefill_tokens,num_decode_tokens``);
            ``None`` looks it up in the shared data folder (only needed for ``chat``).

    Returns:
        The :class:`MultiWorkload`.

    Raises:
        ConfigError: an invalid argument (the message names it).
        InputError: the ShareGPT file is missing or malformed.
    """
    rate = _check_common(total_rate, duration_s, history_s)
    seed = _check_seed(seed)
    cv_ = _finite("cv", cv)
    if cv_ < 0:
        raise ConfigError(f"cv must be >= 0, got {cv!r}")
    window = _check_positive("rotate_s", rotate_s)
    share = _finite("burst_share", burst_share)
    if not 0.0 <= share < 1.0:
        raise ConfigError(f"burst_share must be in [0, 1), got {burst_share!r}")
    if isinstance(profiles, str) or not profiles:
        raise ConfigError(f"profiles must be a non-empty sequence of {list(PROFILES)}")
    for p in profiles:
        if p not in PROFILES:
            raise ConfigError(f"profiles: unknown profile {p!r}; known: {', '.join(PROFILES)}")
    if len(set(profiles)) != len(profiles):
        raise ConfigError(f"profiles must not repeat a profile, got {list(profiles)}")
    specs = _model_specs(models, distinct=True)

    notes: list[str] = []
    samplers: dict[str, LengthSampler] = {}
    means: dict[str, tuple[float, float]] = {}
    if "chat" in profiles:
        chat = sharegpt_sampler(sharegpt)
        samplers["chat"] = chat
        means["chat"] = (_mean(chat.prompt), _mean(chat.output))
        notes.append(
            f"chat lengths resampled from ShareGPT {chat.source} ({len(chat.prompt)} pairs, "
            f"mean input {means['chat'][0]:.1f}, output {means['chat'][1]:.1f}; SeaLLM "
            f"Table 1 ShareGPT: {_SEALLM_SHAREGPT[0]}/{_SEALLM_SHAREGPT[1]})"
        )
    if "summarization" in profiles:
        samplers["summarization"] = _summarization_sampler()
        means["summarization"] = (LONGBENCH_PROMPT_MEAN, LONGBENCH_OUTPUT_MEAN)
        notes.append(
            "LongBench lengths synthesized: lognormal, input mean "
            f"{LONGBENCH_PROMPT_MEAN:g} p50 {LONGBENCH_PROMPT_P50:g}, output mean "
            f"{LONGBENCH_OUTPUT_MEAN:g} p50 {LONGBENCH_OUTPUT_P50:g} (SeaLLM Table 1 means; "
            "medians chosen), not clipped to max_context"
        )

    names = [(spec, p) for spec in specs for p in profiles]
    n = len(names)
    span = float(history_s) + float(duration_s)
    n_win = max(1, math.ceil(span / window))
    hot_of_window = np.arange(n_win) % n
    if n == 1:
        hot_rate, cold_rate = rate, rate
    else:
        hot_rate, cold_rate = share * rate, (1.0 - share) * rate / (n - 1)
    notes.append(
        "Azure Functions trace not available: per-service Gamma arrivals with CV "
        f"{cv_:g} and a rotating burst (every {window:g} s window, counted from the start "
        f"of the history, one service gets {share:g} of {rate:g} req/s, in service order)"
    )
    notes.append(
        "SeaLLM forms services by K-means clustering of request lengths, each cluster "
        "given a random LLM; here one service per (model, profile)"
    )

    streams = []
    for i, ((spec, p), (rng_t, rng_l)) in enumerate(zip(names, _rngs(seed, n), strict=True)):
        window_rates = np.where(hot_of_window == i, hot_rate, cold_rate).astype(np.float64)
        times = _rotating_gamma_arrivals(window_rates, window, span, cv_, rng_t)
        prompts, outputs = _draw_lengths(samplers[p], len(times), rng_l)
        streams.append(
            _Stream(f"{spec.name}/{p}", spec, times, prompts, outputs, means[p][0], means[p][1])
        )
    source = (
        f"SeaLLM §6.1 synthetic: {n} services ({len(models)} models x "
        f"{'/'.join(profiles)}), {rate:g} req/s, Gamma CV {cv_:g}, burst {share:g} "
        f"rotating every {window:g} s, seed {seed}"
    )
    return _assemble(streams, float(history_s), float(duration_s), notes, source)


# --------------------------------------------------------------------------- MuxServe


def muxserve_workload(
    total_rate: float,
    alpha: float,
    *,
    duration_s: float,
    history_s: float,
    seed: int = 0,
    models: Sequence[str] = tuple(muxserve_models()),
    sharegpt: str | Path | None = None,
) -> MultiWorkload:
    """MuxServe's synthetic multi-LLM workload (§5.1).

    Services: one per entry of ``models`` (default :func:`muxserve_models`: 12 x 7B,
    4 x 13B, 2 x 30B, 1 x 65B), named ``"m<ii>-<model>"`` (``"m00-llama-2-7b"`` ...
    ``"m18-llama-65b"``, two digits, in ``models`` order).

    Rates: ``power_law_rates(total_rate, len(models), alpha)``, i.e. rate ``i`` is
    proportional to ``(i+1)**-alpha``, handed out in ``models`` order: the first model gets
    the highest rate. The paper only says rates follow a power law with exponent alpha;
    MuxServe's artifact (``benchmark/end_to_end/bench_end_to_end_muxserve.py``,
    ``assign_rates``) hands the non-increasing rates out in catalog order 7B, 13B, 30B,
    65B, so the small models are the popular ones and the 65B model the least popular;
    the default order reproduces that. (The paper sets the largest rate, e.g. 20 req/s,
    and scales it; to do the same pass ``total_rate = max_rate / w0`` where ``w0`` is
    ``power_law_rates(1, n, alpha)[0]``.)

    Arrivals: an independent Poisson process per service. Lengths: ShareGPT (prompt,
    output) pairs resampled with replacement from the lengths CSV (the note gives its means
    next to MuxServe's 161/338).

    Args:
        total_rate: sum of all services' rates, req/s (> 0).
        alpha: power-law exponent (>= 0; 0 is uniform).
        duration_s: length of the run, seconds (> 0).
        history_s: length of the history before the run, seconds (> 0).
        seed: random seed (integer >= 0).
        models: catalog model names, one service each (repeats allowed).
        sharegpt: the ShareGPT lengths CSV; ``None`` looks it up in the shared data folder.

    Returns:
        The :class:`MultiWorkload`.

    Raises:
        ConfigError: an invalid argument (the message names it).
        InputError: the ShareGPT file is missing or malformed.
    """
    rate = _check_common(total_rate, duration_s, history_s)
    seed = _check_seed(seed)
    a = _finite("alpha", alpha)
    if a < 0:
        raise ConfigError(f"alpha must be >= 0, got {alpha!r}")
    specs = _model_specs(models, distinct=False)
    rates = power_law_rates(rate, len(specs), a)
    chat = sharegpt_sampler(sharegpt)
    mean_p, mean_o = _mean(chat.prompt), _mean(chat.output)
    width = max(2, len(str(len(specs) - 1)))

    notes = [
        f"power-law rates (alpha {a:g}) in model order, highest first: "
        + ", ".join(f"{r:.3g}" for r in rates)
        + " req/s (MuxServe artifact order: 7B, 13B, 30B, 65B)",
        f"lengths resampled from ShareGPT {chat.source} ({len(chat.prompt)} pairs, mean "
        f"input {mean_p:.1f}, output {mean_o:.1f}; MuxServe's ShareGPT: "
        f"{_MUXSERVE_SHAREGPT[0]:g}/{_MUXSERVE_SHAREGPT[1]:g})",
    ]
    if any(s.name in ("llama-2-7b", "llama-2-13b") for s in specs):
        notes.append(
            "MuxServe's LLaMA-1 7B/13B are not in the catalog: llama-2-7b/13b stand in "
            "(same shapes; max_context 4096 instead of 2048)"
        )

    span = float(history_s) + float(duration_s)
    streams = []
    rngs = _rngs(seed, len(specs))
    for i, (spec, r, (rng_t, rng_l)) in enumerate(zip(specs, rates, rngs, strict=True)):
        times = poisson_arrivals(r, duration_s=span, rng=rng_t)
        prompts, outputs = _draw_lengths(chat, len(times), rng_l)
        name = f"m{i:0{width}d}-{spec.name}"
        streams.append(_Stream(name, spec, times, prompts, outputs, mean_p, mean_o))
    source = (
        f"MuxServe §5.1 synthetic: {len(specs)} LLMs, {rate:g} req/s total, power-law "
        f"alpha {a:g}, Poisson, ShareGPT lengths, seed {seed}"
    )
    return _assemble(streams, float(history_s), float(duration_s), notes, source)
