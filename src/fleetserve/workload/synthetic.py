"""Synthetic workloads: arrival processes, length samplers and multi-model mixes.

Every generator takes an injected ``numpy.random.Generator``; nothing here touches a global
RNG, so the same seed always gives the same workload.

Arrival processes return a sorted ``float64`` array of arrival times in seconds, starting
after the first inter-arrival gap (not at 0). Give ``n`` (that many arrivals), ``duration_s``
(every arrival in ``[0, duration_s)``) or both (the first ``n`` within ``duration_s``).

Length samplers are small frozen objects called as ``sampler(n, rng)`` that return two
``int64`` arrays ``(prompt_tokens, output_tokens)``, every value >= 1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from fleetserve.errors import ConfigError
from fleetserve.workload.request import Request

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]


# --------------------------------------------------------------------------- arrivals


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _renewal(
    gaps: Callable[[int], FloatArray], rate: float, n: int | None, duration_s: float | None
) -> FloatArray:
    """Arrival times of a renewal process whose gaps are drawn by ``gaps(k)``."""
    if n is None and duration_s is None:
        raise ConfigError("give the number of arrivals n, a duration_s, or both")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ConfigError(f"n must be an integer >= 0, got {n!r}")
    if duration_s is not None:
        _positive("duration_s", duration_s)
    if n is not None:
        times = np.cumsum(gaps(n))
        return times[times < duration_s] if duration_s is not None else times
    assert duration_s is not None
    expected = duration_s * rate
    chunk = int(expected + 6.0 * math.sqrt(expected) + 16)
    parts = [np.cumsum(gaps(chunk))]
    while parts[-1][-1] < duration_s:
        parts.append(parts[-1][-1] + np.cumsum(gaps(chunk)))
    times = np.concatenate(parts)
    return times[times < duration_s]


def poisson_arrivals(
    rate: float,
    *,
    n: int | None = None,
    duration_s: float | None = None,
    rng: np.random.Generator,
) -> FloatArray:
    """Poisson arrivals: exponential gaps with mean ``1/rate``.

    Args:
        rate: mean arrival rate, req/s (> 0).
        n: number of arrivals.
        duration_s: keep arrivals before this time.
        rng: random generator.

    Returns:
        Sorted arrival times in seconds.
    """
    r = _positive("rate", rate)
    return _renewal(lambda k: rng.exponential(1.0 / r, size=k), r, n, duration_s)


def gamma_arrivals(
    rate: float,
    cv: float,
    *,
    n: int | None = None,
    duration_s: float | None = None,
    rng: np.random.Generator,
) -> FloatArray:
    """Gamma renewal arrivals with a chosen burstiness.

    Gaps are Gamma(shape ``1/cv**2``, scale ``cv**2/rate``): mean ``1/rate`` and coefficient
    of variation ``cv``. ``cv == 1`` is Poisson, ``cv > 1`` burstier, ``cv == 0`` evenly
    spaced.

    Args:
        rate: mean arrival rate, req/s (> 0).
        cv: coefficient of variation of the inter-arrival gaps (>= 0).
        n: number of arrivals.
        duration_s: keep arrivals before this time.
        rng: random generator.

    Returns:
        Sorted arrival times in seconds.
    """
    r = _positive("rate", rate)
    if not (isinstance(cv, int | float) and math.isfinite(cv) and cv >= 0):
        raise ConfigError(f"cv must be a finite number >= 0, got {cv!r}")
    if cv * cv == 0:  # cv 0, or so small that its square underflows: evenly spaced
        return _renewal(lambda k: np.full(k, 1.0 / r), r, n, duration_s)
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (r * shape)
    return _renewal(lambda k: rng.gamma(shape, scale, size=k), r, n, duration_s)


def power_law_rates(total_rate: float, n_models: int, alpha: float) -> list[float]:
    """Per-model rates with power-law popularity, as in MuxServe.

    ``rate_i = total_rate * (i+1)**-alpha / sum_j (j+1)**-alpha`` for ``i = 0..n_models-1``;
    ``alpha = 0`` is uniform, larger alpha concentrates load on the first models.

    Args:
        total_rate: sum of all rates, req/s (> 0).
        n_models: number of models (>= 1).
        alpha: power-law exponent (>= 0).

    Returns:
        ``n_models`` rates summing to ``total_rate``, non-increasing.
    """
    _positive("total_rate", total_rate)
    if isinstance(n_models, bool) or not isinstance(n_models, int) or n_models < 1:
        raise ConfigError(f"n_models must be an integer >= 1, got {n_models!r}")
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha >= 0):
        raise ConfigError(f"alpha must be a finite number >= 0, got {alpha!r}")
    weights = [(i + 1) ** -float(alpha) for i in range(n_models)]
    s = sum(weights)
    return [total_rate * w / s for w in weights]


# --------------------------------------------------------------------------- lengths


class LengthSampler(Protocol):
    """Draws ``n`` (prompt_tokens, output_tokens) pairs, every value >= 1."""

    def __call__(self, n: int, rng: np.random.Generator) -> tuple[IntArray, IntArray]: ...


@dataclass(frozen=True, slots=True)
class FixedLengths:
    """Every request has the same lengths."""

    prompt_tokens: int
    output_tokens: int

    def __call__(self, n: int, rng: np.random.Generator) -> tuple[IntArray, IntArray]:
        return (
            np.full(n, self.prompt_tokens, dtype=np.int64),
            np.full(n, self.output_tokens, dtype=np.int64),
        )


def fixed_lengths(prompt_tokens: int, output_tokens: int) -> FixedLengths:
    """A sampler returning the same lengths for every request (both >= 1)."""
    for name, v in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    return FixedLengths(prompt_tokens, output_tokens)


def _round_clip(x: FloatArray, hi: int | None) -> IntArray:
    out = np.rint(x).astype(np.int64)
    return np.clip(out, 1, hi if hi is not None else np.iinfo(np.int64).max)


@dataclass(frozen=True, slots=True)
class LognormalLengths:
    """Independent lognormal prompt and output lengths (``exp(N(mu, sigma^2))``).

    Values are rounded to integers and clipped to ``[1, *_max]``.
    """

    prompt_mu: float
    prompt_sigma: float
    output_mu: float
    output_sigma: float
    prompt_max: int | None = None
    output_max: int | None = None

    def __call__(self, n: int, rng: np.random.Generator) -> tuple[IntArray, IntArray]:
        p = rng.lognormal(self.prompt_mu, self.prompt_sigma, size=n)
        o = rng.lognormal(self.output_mu, self.output_sigma, size=n)
        return _round_clip(p, self.prompt_max), _round_clip(o, self.output_max)


def _lognormal_params(name: str, mean: float, p50: float) -> tuple[float, float]:
    _positive(f"{name}_mean", mean)
    _positive(f"{name}_p50", p50)
    if mean < p50:
        raise ConfigError(f"a lognormal has mean >= median: {name}_mean {mean} < {name}_p50 {p50}")
    return math.log(p50), math.sqrt(2.0 * math.log(mean / p50))


def lognormal_lengths(
    prompt_mean: float,
    prompt_p50: float,
    output_mean: float,
    output_p50: float,
    *,
    prompt_max: int | None = None,
    output_max: int | None = None,
) -> LognormalLengths:
    """Lognormal lengths parametrized by mean and median.

    For each of prompt and output: ``mu = ln(p50)`` and ``sigma = sqrt(2 ln(mean/p50))``,
    since a lognormal's median is ``e^mu`` and its mean ``e^(mu + sigma^2/2)``. The mean
    must be >= the median. ``*_max`` clips the tail (lowering the mean slightly).

    Args:
        prompt_mean: mean prompt length.
        prompt_p50: median prompt length.
        output_mean: mean output length.
        output_p50: median output length.
        prompt_max: optional largest prompt length.
        output_max: optional largest output length.
    """
    pm, ps = _lognormal_params("prompt", prompt_mean, prompt_p50)
    om, os_ = _lognormal_params("output", output_mean, output_p50)
    for name, v in (("prompt_max", prompt_max), ("output_max", output_max)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{name} must be an integer >= 1 or None, got {v!r}")
    return LognormalLengths(pm, ps, om, os_, prompt_max, output_max)


Knots = tuple[tuple[float, int], ...]


@dataclass(frozen=True, slots=True)
class QuantileLengths:
    """Lengths drawn from a piecewise log-linear quantile function.

    Each of ``prompt_knots``/``output_knots`` is ``((q0, v0), ..., (qk, vk))`` with
    ``q0 = 0 < ... < qk = 1`` and non-decreasing ``v``: a uniform ``u`` maps to
    ``exp(interp(u, q, log v))``, rounded. The sample's ``q``-quantile is ``v`` at each knot,
    so a handful of measured quantiles reproduces a multi-modal trace that no lognormal fits.
    """

    prompt_knots: Knots
    output_knots: Knots

    def __call__(self, n: int, rng: np.random.Generator) -> tuple[IntArray, IntArray]:
        out = []
        for knots in (self.prompt_knots, self.output_knots):
            q = np.array([k[0] for k in knots], dtype=np.float64)
            logv = np.log(np.array([k[1] for k in knots], dtype=np.float64))
            u = rng.random(n)
            out.append(_round_clip(np.exp(np.interp(u, q, logv)), None))
        return out[0], out[1]


def quantile_lengths(
    prompt_knots: Sequence[tuple[float, int]], output_knots: Sequence[tuple[float, int]]
) -> QuantileLengths:
    """A :class:`QuantileLengths` sampler from ``(quantile, tokens)`` knots (validated)."""
    checked = []
    for name, knots in (("prompt_knots", prompt_knots), ("output_knots", output_knots)):
        ks = tuple((float(q), int(v)) for q, v in knots)
        qs = [q for q, _ in ks]
        vs = [v for _, v in ks]
        if len(ks) < 2 or qs[0] != 0.0 or qs[-1] != 1.0:
            raise ConfigError(f"{name}: need >= 2 knots from quantile 0 to quantile 1")
        if any(b <= a for a, b in itertools.pairwise(qs)):
            raise ConfigError(f"{name}: quantiles must be strictly increasing, got {qs}")
        if vs[0] < 1 or any(b < a for a, b in itertools.pairwise(vs)):
            raise ConfigError(f"{name}: token values must be >= 1 and non-decreasing, got {vs}")
        checked.append(ks)
    return QuantileLengths(checked[0], checked[1])


@dataclass(frozen=True, slots=True, eq=False)
class EmpiricalLengths:
    """Resamples (prompt, output) pairs, with replacement, from a loaded trace."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    source: str

    def __call__(self, n: int, rng: np.random.Generator) -> tuple[IntArray, IntArray]:
        idx = rng.integers(0, len(self.prompt), size=n)
        return (
            np.asarray(self.prompt, dtype=np.int64)[idx],
            np.asarray(self.output, dtype=np.int64)[idx],
        )


def lengths_from_file(path: str | Path, fmt: str = "lengths") -> EmpiricalLengths:
    """A sampler resampling the (prompt, output) pairs of a trace file.

    Pairs are kept together, so the prompt/output correlation of the trace survives.

    Args:
        path: the file, by default a lengths CSV (``num_prefill_tokens,num_decode_tokens``).
        fmt: any format :func:`~fleetserve.workload.loaders.load_trace` reads.

    Raises:
        InputError: the file is malformed.
    """
    from fleetserve.workload.loaders import load_trace  # loaders imports nothing from here

    trace = load_trace(path, fmt, rate=1.0 if fmt == "lengths" else None)
    return EmpiricalLengths(
        prompt=tuple(r.prompt_tokens for r in trace.requests),
        output=tuple(r.output_tokens for r in trace.requests),
        source=str(path),
    )


# --------------------------------------------------------------------------- workloads


def synthesize(
    models: Sequence[str],
    rates: Sequence[float],
    lengths: LengthSampler | Sequence[LengthSampler],
    *,
    rng: np.random.Generator,
    duration_s: float | None = None,
    n: int | None = None,
    cv: float = 1.0,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> list[Request]:
    """A multi-model workload: one independent arrival process per model, merged.

    Model ``i`` gets Gamma arrivals (Poisson when ``cv == 1``) at ``rates[i]`` and lengths from
    ``lengths`` (one sampler for all, or one per model). Draw order is fixed (model by model:
    arrivals, then lengths), so a seed always gives the same workload.

    Args:
        models: catalog model names.
        rates: req/s per model, e.g. from :func:`power_law_rates`.
        lengths: a sampler, or one per model.
        rng: random generator.
        duration_s: keep arrivals in ``[0, duration_s)``.
        n: keep the first ``n`` arrivals overall.
        cv: inter-arrival coefficient of variation of every model's process.
        slo_ttft_s: optional TTFT objective for every request.
        slo_tpot_s: optional TPOT objective for every request.

    Returns:
        Requests in arrival order (ties by model order), ids ``0..n-1``.
    """
    if not models:
        raise ConfigError("synthesize needs at least one model")
    if len(rates) != len(models):
        raise ConfigError(f"got {len(models)} models but {len(rates)} rates")
    if isinstance(lengths, Sequence):
        samplers = list(lengths)
        if len(samplers) != len(models):
            raise ConfigError(f"got {len(models)} models but {len(samplers)} length samplers")
    else:
        samplers = [lengths] * len(models)
    for name, v in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
        if v is not None:
            _positive(name, v)

    times: list[FloatArray] = []
    which: list[IntArray] = []
    prompts: list[IntArray] = []
    outputs: list[IntArray] = []
    for i, (rate, sampler) in enumerate(zip(rates, samplers, strict=True)):
        t = gamma_arrivals(rate, cv, n=n, duration_s=duration_s, rng=rng)
        p, o = sampler(len(t), rng)
        times.append(t)
        which.append(np.full(len(t), i, dtype=np.int64))
        prompts.append(np.asarray(p, dtype=np.int64))
        outputs.append(np.asarray(o, dtype=np.int64))
    t_all = np.concatenate(times)
    m_all = np.concatenate(which)
    order = np.lexsort((m_all, t_all))
    if n is not None:
        order = order[:n]
    p_all = np.concatenate(prompts)[order].tolist()
    o_all = np.concatenate(outputs)[order].tolist()
    m_sel = m_all[order].tolist()
    t_sel = t_all[order].tolist()
    return [
        Request(
            id=i,
            model=models[m_sel[i]],
            arrival_s=t_sel[i],
            prompt_tokens=p_all[i],
            output_tokens=o_all[i],
            slo_ttft_s=slo_ttft_s,
            slo_tpot_s=slo_tpot_s,
        )
        for i in range(len(t_sel))
    ]


AZURE_CONV_RATE = 5.53
"""Mean arrival rate of the Azure 2023 conversation trace, req/s."""
AZURE_CONV_CV = 1.09
"""Inter-arrival coefficient of variation of the Azure 2023 conversation trace."""
AZURE_CONV_LENGTHS = QuantileLengths(
    prompt_knots=(
        (0.0, 2), (0.01, 29), (0.05, 181), (0.10, 207), (0.25, 396), (0.50, 1020),
        (0.75, 1189), (0.90, 2735), (0.95, 4083), (0.99, 4142), (0.999, 6212), (1.0, 14050),
    ),
    output_knots=(
        (0.0, 7), (0.01, 16), (0.05, 41), (0.10, 54), (0.25, 85), (0.50, 129),
        (0.75, 395), (0.90, 424), (0.95, 451), (0.99, 601), (0.999, 954), (1.0, 1000),
    ),
)  # fmt: skip
"""Quantile knots measured on the Azure 2023 conversation trace (see :func:`default_workload`)."""


def default_workload(
    rng: np.random.Generator, duration_s: float = 600.0, *, model: str = "llama-2-7b"
) -> list[Request]:
    """A built-in single-model workload shaped like the Azure 2023 conversation trace.

    Arrivals: Gamma renewal process at 5.53 req/s with inter-arrival CV 1.09 (the trace's
    measured rate and CV).

    Lengths: the trace's lengths are multi-modal (prompts cluster near 200, 1,000 and 4,100
    tokens; outputs near 100 and 400), so a lognormal fits badly: matching mean and median
    (input sigma 0.50, output sigma 0.99) gives input p99 3,250 instead of 4,142 and output
    p99 1,300 instead of 601. Instead prompt and output are drawn independently (their
    log-correlation in the trace is 0.09) from a piecewise log-linear quantile function
    through the trace's measured quantiles 0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9 and 100
    (:data:`AZURE_CONV_LENGTHS`).

    Resulting statistics (1 hour, measured with :func:`~fleetserve.workload.trace_stats`)::

                    trace                  seed 0                 seeds 1-3
        rate        5.53 req/s             5.53 req/s             5.47-5.58 req/s
        CV          1.09                   1.07                   1.08-1.09
        input       1155 / 1020 / 4142     1163 / 1004 / 4254     mean 1154-1169, p99 4152-4409
        output       211 /  129 /  601      210 /  129 /  599     mean 210-214, p99 599-610

    (token rows are mean / p50 / p99.)

    Args:
        rng: random generator.
        duration_s: length of the workload in seconds (default 600 s, about 3,300 requests).
        model: catalog model name of every request.
    """
    return synthesize(
        [model],
        [AZURE_CONV_RATE],
        AZURE_CONV_LENGTHS,
        rng=rng,
        duration_s=duration_s,
        cv=AZURE_CONV_CV,
    )
