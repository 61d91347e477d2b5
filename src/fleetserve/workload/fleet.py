"""A fleet workload: many models, power-law popularity, a diurnal rate curve and bursts.

The composed ``fleet`` stack (issue 21, item 6) serves a world the four papers each see
one part of: several models of mixed sizes share a GPU pool, the load follows a daily
curve, and now and then one or a few models spike. :func:`fleet_workload` generates it:

- **models and popularity**: ``models`` in popularity order; model ``i`` gets the share
  ``(i+1)**-zipf / sum_j (j+1)**-zipf`` of the base rate
  (:func:`~fleetserve.workload.synthetic.power_law_rates`, MuxServe's power law);
- **diurnal curve**: a day compressed to ``period_s`` seconds; the fleet's base rate is
  ``rate * D(t)`` with ``D(t) = 1 + a * cos(2 pi (t / period_s - peak_at))`` and
  ``a = (peak_trough - 1) / (peak_trough + 1)``, so its mean over a period is ``rate`` and
  its peak / trough ratio ``peak_trough``. The defaults are the one-harmonic fit of the
  shared Azure conversation trace's hour (:func:`diurnal_fit`, :data:`AZURE_DIURNAL`);
- **bursts**: ``bursts`` windows of ``burst_len_s``; during one the fleet's total rate is
  ``burst_height`` times its base (the shape of the trace's spikes, :func:`burst_shape`,
  :data:`AZURE_BURSTS`), and all the extra goes to ``burst_models`` models drawn
  uniformly, so a spike on an unpopular model multiplies *its* rate many times
  (:attr:`Burst.factor`). Consecutive burst starts are ``burst_gap_s`` apart on average
  (exponential gaps, at least ``burst_len_s``; the first start uniform where the train fits);
- **arrivals**: per model, a unit-rate Gamma renewal process (gap CV ``cv``) in
  operational time mapped through the inverse of the model's cumulative rate -- the time
  change :func:`~fleetserve.workload.bursty.gamma_burst_arrivals` uses for one window,
  here with the exact cumulative of the sinusoid plus every burst window;
- **lengths**: ``"azure-conv"`` resamples the Azure trace's (prompt, output) pairs
  (:func:`~fleetserve.workload.bursty.length_profile`), ``"sharegpt"`` the ShareGPT lengths
  CSV (as :func:`~fleetserve.workload.multi.muxserve_workload`); each model draws its own.
  With ``fit_context`` a pair longer than the model's context window is cut to fit (output
  first to ``max_context - 1``, then the prompt) and flagged ``length_capped``.

Randomness: ``numpy.random.SeedSequence(seed)`` (or seeds drawn once from an injected
``numpy.random.Generator``) is spawned into one child for the burst plan and one per model,
each model's into (arrivals, lengths). So the same seed gives the same workload and a
model's draws do not depend on the other models. Nothing here reads a clock or a global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from numpy.typing import NDArray

from fleetserve.errors import ConfigError
from fleetserve.workload.bursty import length_profile
from fleetserve.workload.multi import _draw_lengths, _model_specs, sharegpt_sampler
from fleetserve.workload.request import Request
from fleetserve.workload.synthetic import LengthSampler, gamma_arrivals, power_law_rates

__all__ = [
    "AZURE_BURSTS",
    "AZURE_DIURNAL",
    "DEFAULT_MODELS",
    "FLEET_DEFAULTS",
    "LENGTH_SOURCES",
    "Burst",
    "BurstShape",
    "DiurnalFit",
    "FleetWorkload",
    "burst_shape",
    "check_fleet_args",
    "diurnal_factor",
    "diurnal_fit",
    "fit_to_context",
    "fleet_workload",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

LENGTH_SOURCES: tuple[str, ...] = ("azure-conv", "sharegpt")
"""Length sources of :func:`fleet_workload`."""

DEFAULT_MODELS: tuple[str, ...] = (
    "llama-3.1-8b",
    "qwen-2.5-14b",
    "llama-2-7b",
    "llama-2-70b",
    "llama-2-13b",
    "opt-6.7b",
    "qwen-2.5-72b",
    "llama-30b",
)
"""Eight catalog models in popularity order: sizes interleaved (7-8B, 13-14B, 30B, 70-72B)
so that a large model is among the popular ones, as in a real fleet."""


# --------------------------------------------------------------------------- trace shapes


@dataclass(frozen=True, slots=True)
class DiurnalFit:
    """A one-harmonic fit ``m * (1 + a cos(2 pi (t/P - peak_at)))`` of a trace's rate.

    Attributes:
        mean_rate: ``m``, req/s.
        amplitude: ``a`` (relative, in ``[0, 1)``).
        peak_trough: ``(1 + a) / (1 - a)``.
        peak_at: where the peak is, as a fraction of the period, in ``[0, 1)``.
        period_s: ``P``: the trace's own length (last timestamp plus one mean gap).
        bin_s: width of the rate bins fitted.
    """

    mean_rate: float
    amplitude: float
    peak_trough: float
    peak_at: float
    period_s: float
    bin_s: float


@dataclass(frozen=True, slots=True)
class BurstShape:
    """The spikes of a trace's rate above its local baseline (:func:`burst_shape`).

    Attributes:
        count: bursts found.
        per_hour: ``count`` per hour of trace.
        height: mean over bursts of (burst rate / baseline rate): the total rate's jump.
        peak: the largest single-bin ratio in any burst.
        duration_s: mean burst duration (a multiple of ``bin_s``).
        gap_s: mean gap between consecutive burst starts (NaN with fewer than 2 bursts).
        bin_s, window_s, threshold: the parameters of the detection.
    """

    count: int
    per_hour: float
    height: float
    peak: float
    duration_s: float
    gap_s: float
    bin_s: float
    window_s: float
    threshold: float


def _span(times: FloatArray) -> tuple[FloatArray, float]:
    t = np.sort(np.asarray(times, dtype=np.float64))
    if len(t) < 2 or t[-1] <= t[0]:
        raise ConfigError("times: need at least 2 arrivals with distinct timestamps")
    t = t - t[0]
    n = len(t)
    return t, float(t[-1]) * n / (n - 1)


def diurnal_fit(times: Sequence[float] | FloatArray, *, bin_s: float = 60.0) -> DiurnalFit:
    """Least-squares fit of one cosine, period = the trace's length, to its binned rate.

    The shared traces cover about one hour, no real day; fitting the hour's rise and fall
    with its own length as the period gives the shape of a "day compressed to an hour".

    Args:
        times: arrival times, seconds (any order).
        bin_s: rate bin width, seconds (> 0); the last bin is the partial remainder.
    """
    t, period = _span(np.asarray(times, dtype=np.float64))
    edges = np.append(np.arange(0.0, period, float(bin_s)), period)
    counts = np.histogram(t, bins=edges)[0]
    width = np.diff(edges)
    mid = edges[:-1] + width / 2
    x = 2 * np.pi * mid / period
    design = np.column_stack([np.ones_like(mid), np.cos(x), np.sin(x)])
    (m, c, s), *_ = np.linalg.lstsq(design, counts / width, rcond=None)
    amp = float(np.hypot(c, s)) / float(m)
    return DiurnalFit(
        mean_rate=float(m),
        amplitude=amp,
        peak_trough=(1 + amp) / (1 - amp),
        peak_at=float(np.arctan2(s, c) / (2 * np.pi)) % 1.0,
        period_s=period,
        bin_s=float(bin_s),
    )


def burst_shape(
    times: Sequence[float] | FloatArray,
    *,
    bin_s: float = 10.0,
    window_s: float = 600.0,
    threshold: float = 1.5,
) -> BurstShape:
    """Spikes of a trace's rate: runs of bins at least ``threshold`` times the local baseline.

    The rate is counted in bins of ``bin_s``; the baseline of a bin is the median rate of
    the bins within ``window_s / 2`` on either side (edges padded), so the slow diurnal rise
    and fall is not counted as a burst. A burst is a maximal run of bins with rate >=
    ``threshold * baseline``. At the Azure trace's 5.5 req/s, a 10 s bin holds ~55 requests,
    so a 1.5x excess is ~3.7 Poisson standard deviations: noise alone would give about one
    false burst in 25 hours.

    Args:
        times: arrival times, seconds (any order).
        bin_s: bin width (> 0).
        window_s: baseline window (>= bin_s).
        threshold: the ratio a bin must reach (> 1).
    """
    t, period = _span(np.asarray(times, dtype=np.float64))
    nb = max(1, int(period // bin_s))
    counts = np.bincount((t // bin_s).astype(np.int64), minlength=nb)[:nb]
    rate = counts / float(bin_s)
    half = max(1, round(window_s / bin_s) // 2)
    base = np.median(sliding_window_view(np.pad(rate, half, mode="edge"), 2 * half + 1), axis=1)
    hot = (rate >= threshold * base) & (base > 0)
    edge = np.diff(np.concatenate(([0], hot.astype(np.int64), [0])))
    starts, ends = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)
    ratios = [rate[a:b] / base[a:b] for a, b in zip(starts, ends, strict=True)]
    gaps = np.diff(starts) * float(bin_s)
    return BurstShape(
        count=len(starts),
        per_hour=len(starts) / period * 3600.0,
        height=float(np.mean([r.mean() for r in ratios])) if ratios else 1.0,
        peak=float(max(r.max() for r in ratios)) if ratios else 1.0,
        duration_s=float(np.mean(ends - starts) * bin_s) if ratios else 0.0,
        gap_s=float(gaps.mean()) if len(gaps) else math.nan,
        bin_s=float(bin_s),
        window_s=float(window_s),
        threshold=float(threshold),
    )


# Computed once from ../shared/data/azure_llm_2023_conv.csv (see docs/fleet.md); the tests
# re-derive them when the file is present.
AZURE_DIURNAL = DiurnalFit(
    mean_rate=5.5052,
    amplitude=0.27664,
    peak_trough=1.7649,
    peak_at=0.50240,
    period_s=3501.9,
    bin_s=60.0,
)
""":func:`diurnal_fit` of the Azure conversation trace (60 s bins): the hour's rate rises
to a peak in its middle; peak / trough 1.76."""

AZURE_BURSTS = BurstShape(
    count=5,
    per_hour=5.14,
    height=1.613,
    peak=1.828,
    duration_s=10.0,
    gap_s=852.5,
    bin_s=10.0,
    window_s=600.0,
    threshold=1.5,
)
""":func:`burst_shape` of the Azure conversation trace (10 s bins, 600 s baseline, 1.5x):
five spikes in the hour, each one bin long, the total rate 1.61x its baseline."""


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True, slots=True)
class _Defaults:
    rate: float = 20.0
    duration_s: float = 3600.0
    period_s: float = 3600.0
    models: tuple[str, ...] = DEFAULT_MODELS
    zipf: float = 1.0
    peak_trough: float = round(AZURE_DIURNAL.peak_trough, 2)
    peak_at: float = round(AZURE_DIURNAL.peak_at, 2)
    bursts: int = 3
    burst_height: float = round(AZURE_BURSTS.height, 2)
    burst_len_s: float = AZURE_BURSTS.duration_s
    burst_gap_s: float = float(round(AZURE_BURSTS.gap_s))
    burst_models: int = 1
    burst_after_s: float = 0.0
    cv: float = 1.09
    lengths: str = "azure-conv"
    fit_context: bool = True


FLEET_DEFAULTS = _Defaults()
"""Default arguments of :func:`fleet_workload` (and of the config's ``fleet`` section).

``cv`` 1.09 is the Azure conversation trace's inter-arrival CV (shared/data/README.md)."""


def _num(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _pos(name: str, value: object) -> float:
    v = _num(name, value)
    if v <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return v


def _int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lo:
        raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def check_fleet_args(
    *,
    rate: object,
    duration_s: object,
    period_s: object,
    models: object,
    zipf: object,
    peak_trough: object,
    peak_at: object,
    bursts: object,
    burst_height: object,
    burst_len_s: object,
    burst_gap_s: object,
    burst_models: object,
    cv: object,
    lengths: object,
    fit_context: object,
    burst_after_s: object = 0.0,
) -> None:
    """Validate :func:`fleet_workload`'s parameters (the config's ``fleet`` section too).

    Raises:
        ConfigError: the first invalid one; the message starts with its name.
    """
    _pos("rate", rate)
    d = _pos("duration_s", duration_s)
    _pos("period_s", period_s)
    if isinstance(models, str) or not isinstance(models, Sequence):
        raise ConfigError(f"models must be a list of catalog model names, got {models!r}")
    specs = _model_specs(models, distinct=True)
    if _num("zipf", zipf) < 0:
        raise ConfigError(f"zipf must be >= 0, got {zipf!r}")
    if _num("peak_trough", peak_trough) < 1:
        raise ConfigError(f"peak_trough must be >= 1 (peak / trough rate), got {peak_trough!r}")
    if not 0 <= _num("peak_at", peak_at) < 1:
        raise ConfigError(f"peak_at must be in [0, 1) (a fraction of period_s), got {peak_at!r}")
    k = _int("bursts", bursts, 0)
    if _num("burst_height", burst_height) < 1:
        raise ConfigError(f"burst_height must be >= 1 (total rate x), got {burst_height!r}")
    ln = _pos("burst_len_s", burst_len_s)
    gap = _pos("burst_gap_s", burst_gap_s)
    if _int("burst_models", burst_models, 1) > len(specs):
        raise ConfigError(
            f"burst_models must be at most the number of models ({len(specs)}), "
            f"got {burst_models!r}"
        )
    after = _num("burst_after_s", burst_after_s)
    if not 0 <= after < d:
        raise ConfigError(f"burst_after_s must be in [0, duration_s={d:g}), got {burst_after_s!r}")
    if k and (k - 1) * max(gap, ln) + ln > d - after:
        raise ConfigError(
            f"burst_gap_s: {k} bursts of {ln:g} s, {max(gap, ln):g} s apart, do not fit in "
            f"duration_s={d:g} after burst_after_s={after:g}; expected (bursts - 1) * "
            "burst_gap_s + burst_len_s <= duration_s - burst_after_s"
        )
    _pos("cv", cv)
    if lengths not in LENGTH_SOURCES:
        raise ConfigError(f"lengths must be one of {', '.join(LENGTH_SOURCES)}, got {lengths!r}")
    if not isinstance(fit_context, bool):
        raise ConfigError(f"fit_context must be true or false, got {fit_context!r}")


# --------------------------------------------------------------------------- result


@dataclass(frozen=True, slots=True)
class Burst:
    """One burst window.

    Attributes:
        start_s: start, seconds from the start of the workload.
        len_s: length, seconds.
        models: the models that take the burst's extra load (equal parts).
        factor: each burst model's rate inside the window / its base rate at that time.
    """

    start_s: float
    len_s: float
    models: tuple[str, ...]
    factor: float


@dataclass(frozen=True)
class FleetWorkload:
    """What :func:`fleet_workload` generated.

    Attributes:
        requests: sorted by arrival (ties by model order), ids ``0..n-1``, ``model`` = the
            catalog name.
        models: the models, in popularity order.
        shares: model -> its share of the base rate (the Zipf weights, summing to 1).
        rate: mean base rate of the fleet over a whole period, req/s (bursts on top).
        period_s: length of the compressed day.
        duration_s: the run's length (arrivals in ``[0, duration_s)``).
        peak_trough: peak / trough ratio of the base rate curve.
        peak_at: where in the period the peak is (fraction).
        curve_t: times of the rate curve's samples (one per ``period_s / 96``, plus the end).
        curve_rate: the fleet's base rate at ``curve_t`` (no bursts), req/s.
        bursts: the burst windows, in time order.
        counts: model -> requests generated.
        expected: model -> expected requests (integral of its rate, bursts included).
        notes: what was generated and how, for the run's notes.
        source: a one-line description for reports.
    """

    requests: list[Request]
    models: tuple[str, ...]
    shares: dict[str, float]
    rate: float
    period_s: float
    duration_s: float
    peak_trough: float
    peak_at: float
    curve_t: tuple[float, ...]
    curve_rate: tuple[float, ...]
    bursts: tuple[Burst, ...]
    counts: dict[str, int]
    expected: dict[str, float]
    notes: tuple[str, ...] = field(default=())
    source: str = ""

    def rate_at(self, t: float) -> float:
        """The fleet's base rate (no bursts) at time ``t``, req/s."""
        return self.rate * float(diurnal_factor(t, self.period_s, self.peak_trough, self.peak_at))


# --------------------------------------------------------------------------- rate curve


def diurnal_factor(
    t: float | FloatArray, period_s: float, peak_trough: float, peak_at: float
) -> FloatArray:
    """``D(t) = 1 + a cos(2 pi (t / period_s - peak_at))``, ``a = (r - 1) / (r + 1)``."""
    a = (peak_trough - 1.0) / (peak_trough + 1.0)
    return np.asarray(
        1.0 + a * np.cos(2 * np.pi * (np.asarray(t, dtype=np.float64) / period_s - peak_at))
    )


def _diurnal_integral(
    t: FloatArray, period_s: float, peak_trough: float, peak_at: float
) -> FloatArray:
    """``int_0^t D(u) du`` (exact)."""
    a = (peak_trough - 1.0) / (peak_trough + 1.0)
    w = 2 * np.pi / period_s
    phase = 2 * np.pi * peak_at
    return np.asarray(t + a / w * (np.sin(w * t - phase) + np.sin(phase)), dtype=np.float64)


# --------------------------------------------------------------------------- generator


def fit_to_context(
    prompts: IntArray, outputs: IntArray, context: int | IntArray
) -> tuple[IntArray, IntArray, NDArray[np.bool_]]:
    """Cut (prompt, output) pairs to a context window of ``context`` tokens (one
    window for all, or one per pair).

    The output first, to ``context - 1``, then the prompt, to ``context - output``,
    so ``prompt + output <= context`` and both stay >= 1.

    Returns:
        ``(prompts, outputs, capped)``: the new lengths and which pairs changed.
    """
    new_out = np.minimum(outputs, context - 1)
    new_prompt = np.minimum(prompts, context - new_out)
    capped = (new_out != outputs) | (new_prompt != prompts)
    return new_prompt, new_out, np.asarray(capped, dtype=bool)


def _root_seed(seed: object, rng: object) -> np.random.SeedSequence:
    if rng is not None:
        if not isinstance(rng, np.random.Generator):
            raise ConfigError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
        return np.random.SeedSequence([int(x) for x in rng.integers(0, 2**63, size=4)])
    return np.random.SeedSequence(_int("seed", seed, 0))


def _plan_bursts(
    k: int, ln: float, gap: float, d: float, n_models: int, per_burst: int, rng: np.random.Generator
) -> list[tuple[float, tuple[int, ...]]]:
    """``k`` non-overlapping windows ``(start, model indices)`` inside ``[0, d)``.

    Gaps between starts are ``ln + Exp(max(gap, ln) - ln)`` (mean ``max(gap, ln)``); if the
    train would not fit, the exponential parts are scaled down to fit. The first start is
    uniform over where the train fits. Models: ``per_burst`` distinct ones, uniformly.
    """
    if k == 0:
        return []
    excess = (
        rng.exponential(max(gap, ln) - ln, size=k - 1) if max(gap, ln) > ln else np.zeros(k - 1)
    )
    slack = d - ln - (k - 1) * ln
    if excess.sum() > slack:
        excess *= slack / excess.sum()
    offsets = np.concatenate(([0.0], np.cumsum(ln + excess)))
    first = float(rng.uniform(0.0, max(0.0, d - ln - float(offsets[-1]))))
    chosen = [
        tuple(sorted(rng.choice(n_models, size=per_burst, replace=False).tolist()))
        for _ in range(k)
    ]
    return [(first + float(o), c) for o, c in zip(offsets, chosen, strict=True)]


def _length_sampler(
    lengths: str, azure_path: str | Path | None, sharegpt: str | Path | None
) -> LengthSampler:
    if lengths == "azure-conv":
        return length_profile("azure-conv", azure_path=azure_path)
    return sharegpt_sampler(sharegpt)


def fleet_workload(
    rate: float = FLEET_DEFAULTS.rate,
    *,
    duration_s: float = FLEET_DEFAULTS.duration_s,
    period_s: float = FLEET_DEFAULTS.period_s,
    models: Sequence[str] = FLEET_DEFAULTS.models,
    zipf: float = FLEET_DEFAULTS.zipf,
    peak_trough: float = FLEET_DEFAULTS.peak_trough,
    peak_at: float = FLEET_DEFAULTS.peak_at,
    bursts: int = FLEET_DEFAULTS.bursts,
    burst_height: float = FLEET_DEFAULTS.burst_height,
    burst_len_s: float = FLEET_DEFAULTS.burst_len_s,
    burst_gap_s: float = FLEET_DEFAULTS.burst_gap_s,
    burst_models: int = FLEET_DEFAULTS.burst_models,
    burst_after_s: float = FLEET_DEFAULTS.burst_after_s,
    cv: float = FLEET_DEFAULTS.cv,
    lengths: str = FLEET_DEFAULTS.lengths,
    fit_context: bool = FLEET_DEFAULTS.fit_context,
    seed: int = 0,
    rng: np.random.Generator | None = None,
    azure_path: str | Path | None = None,
    sharegpt: str | Path | None = None,
    sampler: LengthSampler | None = None,
) -> FleetWorkload:
    """A multi-model fleet workload with Zipf popularity, a diurnal curve and bursts.

    See the module docstring for the model. Model ``m``'s rate at time ``t`` is
    ``rate * share_m * D(t)``, plus ``(burst_height - 1) * rate * D(t) / burst_models``
    inside each burst window that names ``m``.

    Args:
        rate: mean base rate of the whole fleet over a period, req/s (> 0); bursts add to it.
        duration_s: the run's length, seconds (> 0); it may span several periods.
        period_s: the compressed day, seconds (> 0).
        models: distinct catalog model names, most popular first.
        zipf: power-law exponent of the popularity (>= 0; 0 is uniform).
        peak_trough: peak / trough ratio of the diurnal curve (>= 1; 1 is flat).
        peak_at: where the peak is, as a fraction of ``period_s``, in ``[0, 1)``.
        bursts: number of burst windows (>= 0).
        burst_height: the fleet's total rate during a burst / its base (>= 1).
        burst_len_s: length of a burst window (> 0).
        burst_gap_s: mean gap between consecutive burst starts (> 0; at least
            ``burst_len_s`` is kept); the train must fit: ``(bursts - 1) *
            max(burst_gap_s, burst_len_s) + burst_len_s <= duration_s``.
        burst_models: models that share each burst's extra load (1 .. len(models)).
        burst_after_s: no burst starts before this time (``[0, duration_s)``; e.g.
            the placement history a multi-LLM run cuts off the front); the train
            must fit in ``[burst_after_s, duration_s)``.
        cv: inter-arrival CV of each model's Gamma renewal process (> 0; 1 is Poisson).
        lengths: ``"azure-conv"`` or ``"sharegpt"``.
        fit_context: cut requests to each model's ``max_context`` (flagged
            ``length_capped``); False keeps them (the simulator then rejects them).
        seed: random seed (integer >= 0); ignored when ``rng`` is given.
        rng: a generator to draw the workload's seeds from (once, at the start).
        azure_path: the Azure conversation trace (``lengths="azure-conv"``); ``None``: the
            shared data folder.
        sharegpt: the ShareGPT lengths CSV (``lengths="sharegpt"``); ``None``: the shared
            data folder.
        sampler: a length sampler to use instead of ``lengths`` (tests, custom profiles).

    Returns:
        The :class:`FleetWorkload`.

    Raises:
        ConfigError: an invalid argument (the message names it).
        InputError: the length source's file is missing or malformed.
    """
    check_fleet_args(
        rate=rate,
        duration_s=duration_s,
        period_s=period_s,
        models=models,
        zipf=zipf,
        peak_trough=peak_trough,
        peak_at=peak_at,
        bursts=bursts,
        burst_height=burst_height,
        burst_len_s=burst_len_s,
        burst_gap_s=burst_gap_s,
        burst_models=burst_models,
        cv=cv,
        lengths=lengths,
        fit_context=fit_context,
        burst_after_s=burst_after_s,
    )
    specs = _model_specs(models, distinct=True)
    names = tuple(s.name for s in specs)
    n = len(names)
    r, d, p = float(rate), float(duration_s), float(period_s)
    pt, pa, h = float(peak_trough), float(peak_at), float(burst_height)
    shares = power_law_rates(1.0, n, float(zipf))
    if sampler is None:
        sampler = _length_sampler(lengths, azure_path, sharegpt)  # a missing file fails early
        length_source = str(lengths)
    else:
        length_source = f"custom ({type(sampler).__name__})"

    root = _root_seed(seed, rng)
    plan_seq, *model_seqs = root.spawn(1 + n)
    after = float(burst_after_s)
    plan = [
        (after + start, chosen)
        for start, chosen in _plan_bursts(
            int(bursts),
            float(burst_len_s),
            float(burst_gap_s),
            d - after,
            n,
            int(burst_models),
            np.random.default_rng(plan_seq),
        )
    ]
    ln = float(burst_len_s)
    extra = (h - 1.0) * r / int(burst_models)  # per burst model, times D(t)

    # operational-time grid: 1 s or finer (period_s / 3600), plus every burst edge
    step = min(1.0, p / 3600.0)
    n_grid = min(max(2, math.ceil(d / step) + 1), 2_000_001)
    edges = [x for s, _ in plan for x in (s, s + ln)]
    grid = np.unique(np.concatenate((np.linspace(0.0, d, n_grid), np.asarray(edges))))
    big_i = _diurnal_integral(grid, p, pt, pa)

    t_parts, m_parts, p_parts, o_parts, c_parts = [], [], [], [], []
    expected: dict[str, float] = {}
    capped_by: dict[str, int] = {}
    for i, (spec, seq) in enumerate(zip(specs, model_seqs, strict=True)):
        lam = r * shares[i] * big_i
        for s, chosen in plan:
            if i in chosen:
                lo, hi = _diurnal_integral(np.asarray([s, s + ln]), p, pt, pa).tolist()
                lam = lam + extra * (np.clip(big_i, lo, hi) - lo)
        expected[spec.name] = float(lam[-1])
        rng_t, rng_l = (np.random.default_rng(c) for c in seq.spawn(2))
        tau = gamma_arrivals(1.0, float(cv), duration_s=float(lam[-1]), rng=rng_t)
        times = np.interp(tau, lam, grid)
        times = times[times < d]
        prompts, outputs = _draw_lengths(sampler, len(times), rng_l)
        capped = np.zeros(len(times), dtype=bool)
        if fit_context:
            prompts, outputs, capped = fit_to_context(prompts, outputs, int(spec.max_context))
        capped_by[spec.name] = int(capped.sum())
        t_parts.append(times)
        m_parts.append(np.full(len(times), i, dtype=np.int64))
        p_parts.append(prompts)
        o_parts.append(outputs)
        c_parts.append(capped)

    t_all = np.concatenate(t_parts)
    m_all = np.concatenate(m_parts)
    order = np.lexsort((m_all, t_all))
    t_l = t_all[order].tolist()
    m_l = m_all[order].tolist()
    p_l = np.concatenate(p_parts)[order].tolist()
    o_l = np.concatenate(o_parts)[order].tolist()
    c_l = np.concatenate(c_parts)[order].tolist()
    requests = [
        Request(
            id=j,
            model=names[m_l[j]],
            arrival_s=t_l[j],
            prompt_tokens=p_l[j],
            output_tokens=o_l[j],
            length_capped=c_l[j],
        )
        for j in range(len(t_l))
    ]
    counts = {name: int((m_all == i).sum()) for i, name in enumerate(names)}

    burst_list = tuple(
        Burst(
            start_s=s,
            len_s=ln,
            models=tuple(names[i] for i in chosen),
            factor=1.0 + (h - 1.0) / (int(burst_models) * min(shares[i] for i in chosen)),
        )
        for s, chosen in plan
    )
    n_curve = max(2, math.ceil(d / (p / 96.0)) + 1)
    curve_t = np.linspace(0.0, d, n_curve)
    curve_rate = r * diurnal_factor(curve_t, p, pt, pa)
    share_map = dict(zip(names, shares, strict=True))
    a = (pt - 1.0) / (pt + 1.0)
    notes = [
        f"{n} models, Zipf popularity (exponent {float(zipf):g}), most popular first: "
        + ", ".join(f"{m} {s:.3f}" for m, s in share_map.items()),
        f"diurnal curve: a day compressed to {p:g} s, base rate {r:g} req/s on average, "
        f"peak/trough {pt:g} (peak at {pa:g} of the period: {r * (1 + a):.3g} req/s, trough "
        f"{r * (1 - a):.3g} req/s)",
        f"{len(burst_list)} burst(s) of {ln:g} s, total rate x{h:g} during each, extra load "
        f"on {int(burst_models)} model(s): "
        + "; ".join(f"{b.start_s:.1f} s {'+'.join(b.models)} x{b.factor:.3g}" for b in burst_list),
        f"arrivals: per-model Gamma renewal, CV {float(cv):g}, time-changed through the "
        "exact cumulative rate",
        f"lengths: {length_source}, drawn per model"
        + (
            f"; {sum(capped_by.values())} request(s) cut to their model's context window "
            f"({', '.join(f'{m} {c}' for m, c in capped_by.items() if c)})"
            if fit_context and any(capped_by.values())
            else ""
        ),
    ]
    source = (
        f"fleet synthetic: {n} models, {r:g} req/s base, Zipf {float(zipf):g}, diurnal "
        f"{pt:g}x over {p:g} s, {len(burst_list)} bursts x{h:g}, {length_source} lengths"
    )
    return FleetWorkload(
        requests=requests,
        models=names,
        shares=share_map,
        rate=r,
        period_s=p,
        duration_s=d,
        peak_trough=pt,
        peak_at=pa,
        curve_t=tuple(curve_t.tolist()),
        curve_rate=tuple(curve_rate.tolist()),
        bursts=burst_list,
        counts=counts,
        expected=expected,
        notes=tuple(notes),
        source=source,
    )
