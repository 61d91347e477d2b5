"""Bursty single-model workloads for the KunServe reproduction (§2.2, §5.1, Table 2).

KunServe serves Qwen-2.5-14B on 8 GPUs under the BurstGPT arrival trace, whose request rate
jumps 14x at about 150 s, with three length profiles (Table 2). BurstGPT is not available
here, so this module builds stand-ins from the generators of
:mod:`fleetserve.workload.synthetic`:

- length profiles (:func:`length_profile`): ``"burstgpt"`` and ``"agieval-cot"`` are
  piecewise log-linear quantile functions through Table 2's P50/P80/P95/P99 with end knots
  solved so that the mean matches Table 2 (:func:`solve_knots`); ``"azure-conv"`` resamples
  the real (prompt, output) pairs of the shared Azure conversation trace;
- arrival processes with a burst window in which the rate is multiplied by ``burst_factor``
  (14 by default, BurstGPT's jump): :func:`azure_burst_arrivals` (the Azure conversation
  trace's own timestamps, time-scaled and time-compressed inside the window) and
  :func:`gamma_burst_arrivals` (a Gamma renewal process, time-changed inside the window);
- :func:`kunserve_workload`, which puts the two together into requests.

Everything is pure numpy; every generator takes an injected ``numpy.random.Generator``.
Invalid arguments raise :class:`~fleetserve.errors.ConfigError` with a one-line message
naming the argument; a missing or malformed trace file raises
:class:`~fleetserve.errors.InputError` naming the file.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from fleetserve.errors import ConfigError, FleetserveError, InputError
from fleetserve.workload.data import DATA_ENV
from fleetserve.workload.request import Request
from fleetserve.workload.synthetic import (
    EmpiricalLengths,
    Knots,
    LengthSampler,
    QuantileLengths,
    gamma_arrivals,
    lengths_from_file,
    quantile_lengths,
)

__all__ = [
    "AGIEVAL_COT_LENGTHS",
    "ARRIVALS",
    "AZURE_CONV_FILE",
    "BURSTGPT_LENGTHS",
    "DATA_DIR_ENV",
    "PROFILES",
    "PROFILE_TABLE",
    "TableRow",
    "azure_burst_arrivals",
    "default_azure_path",
    "gamma_burst_arrivals",
    "knot_mean",
    "kunserve_workload",
    "length_profile",
    "solve_knots",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

PROFILES: tuple[str, ...] = ("burstgpt", "agieval-cot", "azure-conv")
"""Length profiles of :func:`length_profile` (KunServe Table 2's three datasets)."""

ARRIVALS: tuple[str, ...] = ("azure-burst", "gamma")
"""Arrival processes of :func:`kunserve_workload`."""

AZURE_CONV_FILE = "azure_llm_2023_conv.csv"
"""File name of the Azure 2023 conversation trace in the shared data folder."""

DATA_DIR_ENV = "FLEETSERVE_DATA_DIR"
"""Environment variable naming the shared data folder (see :func:`default_azure_path`)."""

_REPO_ROOT = Path(__file__).resolve().parents[3]


class TableRow(NamedTuple):
    """One row of KunServe Table 2: token-length statistics of one side of a dataset."""

    mean: float
    p50: float
    p80: float
    p95: float
    p99: float


PROFILE_TABLE: dict[str, dict[str, TableRow]] = {
    "burstgpt": {
        "input": TableRow(603, 400, 1146, 1804, 2009),
        "output": TableRow(289, 249, 462, 715, 1161),
    },
    "agieval-cot": {
        "input": TableRow(237, 128, 556, 619, 651),
        "output": TableRow(390, 363, 450, 578, 698),
    },
    "azure-conv": {
        "input": TableRow(1013, 998, 1159, 4080, 4096),
        "output": TableRow(247, 202, 411, 451, 585),
    },
}
"""KunServe Table 2 (mean, P50, P80, P95, P99 tokens), by profile and ``"input"``/``"output"``.

For reports. ``"azure-conv"`` is for reference only: that profile resamples the shared trace,
whose own statistics differ (input 1155 / 1020 / 1315 / 4083 / 4142, output
211 / 129 / 400 / 451 / 601; the paper's P99 of 4096 suggests it capped prompts at 4096).
"""

_QUANTILES: tuple[float, ...] = (0.5, 0.8, 0.95, 0.99)


# --------------------------------------------------------------------------- length knots


def knot_mean(knots: Knots) -> float:
    """The mean of the continuous distribution of a :class:`QuantileLengths` side.

    Between knots ``(qa, a)`` and ``(qb, b)`` the quantile function is ``exp`` of a linear
    function of ``q``, whose integral is ``(qb - qa) * (b - a) / ln(b / a)`` (``(qb - qa) * a``
    when ``a == b``). The sampler rounds to integers, which moves the mean by far less than a
    token (rounding to nearest is nearly unbiased).

    Args:
        knots: ``((0, v0), ..., (1, vk))`` with non-decreasing values >= 1.
    """
    total = 0.0
    for (qa, a), (qb, b) in itertools.pairwise(knots):
        fa, fb = float(a), float(b)
        log_mean = fa if fa == fb else (fb - fa) / math.log(fb / fa)
        total += (qb - qa) * log_mean
    return total


def _bisect_int(f: Callable[[int], float], lo: int, hi: int, target: float) -> int:
    """The integer in ``[lo, hi]`` whose ``f`` is closest to ``target`` (``f`` increasing)."""
    a, b = lo, hi
    while b - a > 1:
        mid = (a + b) // 2
        if f(mid) < target:
            a = mid
        else:
            b = mid
    return a if abs(f(a) - target) <= abs(f(b) - target) else b


def solve_knots(row: TableRow) -> Knots:
    """Quantile knots through a Table 2 row, with end knots solved to match its mean.

    The knots are ``(0, v0), (0.5, P50), (0.8, P80), (0.95, P95), (0.99, P99), (1, v1)``,
    so the sampled P50/P80/P95/P99 are the table's. The table gives no minimum or maximum:

    - ``v1`` (the maximum) continues the P95-P99 segment's log-linear slope to ``q = 1``:
      ``v1 = round(P99 * (P99 / P95) ** 0.25)``, so the top 1 % has the same shape as the
      P95-P99 band instead of a hard cap at P99 (``v1 >= P99``);
    - ``v0`` (the minimum) is then the integer in ``[1, P50]`` whose analytic mean
      (:func:`knot_mean`) is closest to the table's mean, by bisection (the mean increases
      with ``v0``).

    If even ``v0 = P50`` gives too low a mean, ``v0 = P50`` and ``v1`` is raised (bisection
    on integers up to ``10**7``) instead; if even ``v0 = 1`` gives too high a mean, ``v0 = 1``
    and ``v1 = P99`` (as close as the constraints allow; the residual remains). Neither
    happens for the two Table 2 profiles used here (see :data:`BURSTGPT_LENGTHS`).

    Args:
        row: the table row (all values > 0, percentiles non-decreasing).

    Returns:
        Six ``(quantile, tokens)`` knots for
        :func:`~fleetserve.workload.synthetic.quantile_lengths`.
    """
    p50, p80, p95, p99 = (round(float(v)) for v in row[1:])
    if not (1 <= p50 <= p80 <= p95 <= p99) or not (math.isfinite(row.mean) and row.mean > 0):
        raise ConfigError(f"table row needs mean > 0 and 1 <= P50 <= ... <= P99, got {row}")
    mid: Knots = tuple(zip(_QUANTILES, (p50, p80, p95, p99), strict=True))

    def mean_of(v0: int, v1: int) -> float:
        return knot_mean(((0.0, v0), *mid, (1.0, v1)))

    v1 = round(p99 * (p99 / p95) ** 0.25)
    target = float(row.mean)
    if mean_of(p50, v1) < target:
        v0 = p50
        v1 = _bisect_int(lambda v: mean_of(p50, v), v1, 10**7, target)
    elif mean_of(1, v1) > target:
        v0, v1 = 1, p99
    else:
        v0 = _bisect_int(lambda v: mean_of(v, v1), 1, p50, target)
    return ((0.0, v0), *mid, (1.0, v1))


# Computed once with solve_knots(PROFILE_TABLE[...][...]); tests re-derive them.
_BURSTGPT_PROMPT: Knots = (
    (0.0, 37), (0.5, 400), (0.8, 1146), (0.95, 1804), (0.99, 2009), (1.0, 2064),
)  # fmt: skip
_BURSTGPT_OUTPUT: Knots = (
    (0.0, 26), (0.5, 249), (0.8, 462), (0.95, 715), (0.99, 1161), (1.0, 1311),
)  # fmt: skip
_AGIEVAL_PROMPT: Knots = (
    (0.0, 21), (0.5, 128), (0.8, 556), (0.95, 619), (0.99, 651), (1.0, 659),
)  # fmt: skip
_AGIEVAL_OUTPUT: Knots = (
    (0.0, 278), (0.5, 363), (0.8, 450), (0.95, 578), (0.99, 698), (1.0, 732),
)  # fmt: skip

BURSTGPT_LENGTHS: QuantileLengths = quantile_lengths(_BURSTGPT_PROMPT, _BURSTGPT_OUTPUT)
"""BurstGPT lengths (Table 2): knots from :func:`solve_knots`, prompt and output independent.

Prompt knots 37 / 400 / 1146 / 1804 / 2009 / 2064, output 26 / 249 / 462 / 715 / 1161 /
1311 at q = 0 / 0.5 / 0.8 / 0.95 / 0.99 / 1; analytic means 602.95 and 288.77 (Table 2: 603
and 289). Sampled (200k, seed 0): input 601 / 397 / 1138 / 1802 / 2010, output
290 / 249 / 464 / 721 / 1165 (mean / P50 / P80 / P95 / P99). Table 2 gives only the
marginals, so prompt and output are drawn independently.
"""

AGIEVAL_COT_LENGTHS: QuantileLengths = quantile_lengths(_AGIEVAL_PROMPT, _AGIEVAL_OUTPUT)
"""AGIEval-CoT lengths (Table 2): knots from :func:`solve_knots`, prompt and output independent.

Prompt knots 21 / 128 / 556 / 619 / 651 / 659, output 278 / 363 / 450 / 578 / 698 / 732 at
q = 0 / 0.5 / 0.8 / 0.95 / 0.99 / 1; analytic means 237.01 and 390.08 (Table 2: 237 and 390).
Sampled (200k, seed 0): input 236 / 127 / 551 / 619 / 651, output 390 / 363 / 451 / 580 / 699.
"""


# --------------------------------------------------------------------------- shared trace


def default_azure_path() -> Path:
    """Where the Azure 2023 conversation trace is looked for when no path is given.

    The shared data folder is, first match wins: ``$FLEETSERVE_DATA_DIR`` when set;
    ``$FLEETSERVE_DATA`` when set (the variable :mod:`fleetserve.workload.data` reads);
    otherwise ``<repo>/../shared/data`` where ``<repo>`` is found from this file's location
    (``Path(__file__).resolve().parents[3]``). The file need not exist; the loaders raise
    :class:`~fleetserve.errors.InputError` naming the path when it does not.

    Returns:
        ``<data dir>/azure_llm_2023_conv.csv``.
    """
    for var in (DATA_DIR_ENV, DATA_ENV):
        env = os.environ.get(var)
        if env:
            return Path(env) / AZURE_CONV_FILE
    return _REPO_ROOT.parent / "shared" / "data" / AZURE_CONV_FILE


def _azure_file(azure_path: str | Path | None) -> Path:
    if azure_path is not None and not isinstance(azure_path, str | Path):
        raise ConfigError(f"azure_path must be a path or None, got {azure_path!r}")
    path = default_azure_path() if azure_path is None else Path(azure_path)
    if not path.is_file():
        raise InputError(
            f"Azure conversation trace not found (columns TIMESTAMP,ContextTokens,"
            f"GeneratedTokens; see shared/data/README.md, or set {DATA_DIR_ENV} to the folder "
            f"holding {AZURE_CONV_FILE})",
            file=str(path),
        )
    return path


@functools.lru_cache(maxsize=4)
def _azure_lengths_cached(path: str, mtime_ns: int, size: int) -> EmpiricalLengths:
    del mtime_ns, size  # part of the cache key only: a changed file is read again
    return lengths_from_file(path, "azure")


@functools.lru_cache(maxsize=4)
def _azure_times_cached(path: str, mtime_ns: int, size: int) -> FloatArray:
    del mtime_ns, size
    from fleetserve.workload.loaders import load_trace

    trace = load_trace(path, "azure")
    times = np.array([r.arrival_s for r in trace.requests], dtype=np.float64)
    times.setflags(write=False)  # shared by every caller through the cache
    return times


def _azure_lengths(azure_path: str | Path | None) -> EmpiricalLengths:
    path = _azure_file(azure_path)
    st = path.stat()
    return _azure_lengths_cached(str(path), st.st_mtime_ns, st.st_size)


def _azure_times(azure_path: str | Path | None) -> FloatArray:
    path = _azure_file(azure_path)
    st = path.stat()
    return _azure_times_cached(str(path), st.st_mtime_ns, st.st_size)


def length_profile(name: str, *, azure_path: str | Path | None = None) -> LengthSampler:
    """The length sampler of one KunServe Table 2 dataset.

    - ``"burstgpt"``: :data:`BURSTGPT_LENGTHS` (balanced; synthesized from Table 2);
    - ``"agieval-cot"``: :data:`AGIEVAL_COT_LENGTHS` (decode-heavy; synthesized);
    - ``"azure-conv"``: the real (prompt, output) pairs of the Azure 2023 conversation trace,
      resampled with replacement (:func:`~fleetserve.workload.synthetic.lengths_from_file`
      with format ``"azure"``), so their correlation survives. Prompts are not capped at
      4096 as the paper's appear to be (2.1 % of the trace's prompts exceed 4096 tokens;
      Qwen-2.5-14B's context is far longer).

    Args:
        name: one of :data:`PROFILES`.
        azure_path: the Azure trace (``"azure-conv"`` only); ``None`` uses
            :func:`default_azure_path`.

    Raises:
        ConfigError: unknown profile name (the message lists the known ones).
        InputError: the Azure trace is missing (the message names the path) or malformed.
    """
    if name == "burstgpt":
        return BURSTGPT_LENGTHS
    if name == "agieval-cot":
        return AGIEVAL_COT_LENGTHS
    if name == "azure-conv":
        return _azure_lengths(azure_path)
    raise ConfigError(f"profile: unknown length profile {name!r}; known: {', '.join(PROFILES)}")


# --------------------------------------------------------------------------- validation


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _positive(name: str, value: object) -> float:
    v = _finite(name, value)
    if v <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def _window(start: object, length: object, duration: float) -> tuple[float, float]:
    """A validated burst window ``[start, start + length)`` inside ``[0, duration)``."""
    s = _finite("burst_start_s", start)
    ln = _positive("burst_len_s", length)
    if not 0.0 <= s < duration:
        raise ConfigError(f"burst_start_s must be in [0, duration_s={duration:g}), got {start!r}")
    if s + ln > duration:
        raise ConfigError(
            f"burst_len_s: the burst window [{s:g}, {s + ln:g}) ends after duration_s="
            f"{duration:g}; expected burst_start_s + burst_len_s <= duration_s"
        )
    return s, ln


def _check_rng(rng: object) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise ConfigError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    return rng


def _cumulative(
    k: float, duration: float, start: float, length: float, factor: float
) -> tuple[FloatArray, FloatArray]:
    """Break points ``(t, Lambda(t))`` of the piecewise-linear operational time.

    ``Lambda`` has slope ``k`` outside the window and ``k * factor`` inside it; zero-length
    pieces (window at 0 or ending at ``duration``) repeat a point with equal values on both
    axes, which ``np.interp`` handles.
    """
    t = np.array([0.0, start, start + length, duration], dtype=np.float64)
    lam = np.array(
        [0.0, k * start, k * (start + factor * length), k * (duration + (factor - 1) * length)],
        dtype=np.float64,
    )
    return t, lam


# --------------------------------------------------------------------------- arrivals


def azure_burst_arrivals(
    rate: float,
    duration_s: float,
    *,
    burst_start_s: float,
    burst_len_s: float,
    burst_factor: float = 14.0,
    azure_path: str | Path | None = None,
    offset_s: float | None = 0.0,
    rng: np.random.Generator,
) -> FloatArray:
    """The Azure conversation trace's arrivals, rescaled, with a burst window.

    The trace's timestamps (relative to its first request) are replayed from ``offset_s``
    seconds into the trace, through an operational-time map: a run second outside the burst
    window consumes ``k = rate / trace_rate`` trace seconds, one inside
    ``[burst_start_s, burst_start_s + burst_len_s)`` consumes ``k * burst_factor``. So the
    base rate is ``rate`` on average, the window's rate is ``burst_factor`` times that (14 by
    default, BurstGPT's jump at ~150 s), and both keep the trace's own burstiness (gap CV
    1.09, rate swings of about +-20 % over minutes) rather than a smooth process's.

    ``trace_rate`` is the whole trace's average: ``n`` requests over the period ``P =
    t_last * n / (n - 1)`` (the last timestamp plus one mean gap), 19,366 / 3,501.9 s =
    5.53 req/s for the shared file. The rates above are therefore long-run averages; a
    short run sees the local rate of the part of the trace it replays.

    Wrap-around: when the run needs more than the rest of the trace (e.g. 20 req/s for
    1,400 s with a 14x window needs far more than one hour of trace), the trace is repeated
    with period ``P`` (the copy's first request one mean gap after the last), so any rate and
    duration work; long runs therefore repeat the trace's pattern.

    Args:
        rate: base average arrival rate, req/s (> 0).
        duration_s: keep arrivals in ``[0, duration_s)`` (> 0).
        burst_start_s: start of the burst window, in ``[0, duration_s)``.
        burst_len_s: length of the window (> 0; must end by ``duration_s``).
        burst_factor: rate multiplier inside the window (> 0; 1 is no burst).
        azure_path: the Azure trace; ``None`` uses :func:`default_azure_path`.
        offset_s: where in the trace to start, seconds in ``[0, P)``; ``None`` draws it
            uniformly from ``rng`` (a different slice of the trace per seed).
        rng: random generator, used only when ``offset_s`` is ``None`` (the replay itself is
            deterministic).

    Returns:
        Sorted ``float64`` arrival times in ``[0, duration_s)``; with ``offset_s`` landing on
        a request the first is at 0.0 (with the default 0.0 it always is).

    Raises:
        ConfigError: an invalid argument (the message names it).
        InputError: the trace is missing (the message names the path) or malformed.
    """
    r = _positive("rate", rate)
    d = _positive("duration_s", duration_s)
    start, length = _window(burst_start_s, burst_len_s, d)
    f = _positive("burst_factor", burst_factor)
    gen = _check_rng(rng)
    if offset_s is not None:
        _finite("offset_s", offset_s)
    trace = _azure_times(azure_path)
    n = len(trace)
    span = float(trace[-1]) if n else 0.0
    if n < 2 or span <= 0:
        raise InputError(
            f"need at least 2 requests with distinct timestamps to replay, got {n}",
            file=str(azure_path if azure_path is not None else default_azure_path()),
        )
    period = span * n / (n - 1)
    if offset_s is None:
        offset = float(gen.uniform(0.0, period))
    else:
        offset = float(offset_s)
        if not 0.0 <= offset < period:
            raise ConfigError(
                f"offset_s must be in [0, {period:g}) (the trace's length in seconds), "
                f"got {offset_s!r}"
            )
    k = r / (n / period)
    t_break, lam = _cumulative(k, d, start, length, f)
    end = offset + float(lam[-1])
    copies = np.arange(int(end // period) + 1, dtype=np.float64)
    tau = (trace[None, :] + period * copies[:, None]).ravel()
    tau = tau[np.searchsorted(tau, offset, side="left") : np.searchsorted(tau, end, side="left")]
    times = np.interp(tau - offset, lam, t_break)
    return np.asarray(times[times < d], dtype=np.float64)


def gamma_burst_arrivals(
    rate: float,
    duration_s: float,
    *,
    cv: float = 3.0,
    rng: np.random.Generator,
    burst_start_s: float | None = None,
    burst_len_s: float | None = None,
    burst_factor: float = 14.0,
) -> FloatArray:
    """Gamma renewal arrivals with gap CV ``cv``, optionally with a burst window.

    Without a window this is :func:`~fleetserve.workload.synthetic.gamma_arrivals` at
    ``rate``. With one, a unit-rate Gamma renewal process (gap CV ``cv``) is drawn in
    operational time over ``[0, Lambda(duration_s))`` and mapped back through the inverse of
    ``Lambda``, whose slope is ``rate`` outside the window and ``rate * burst_factor`` inside:
    within each piece it is a Gamma process at that piece's rate with the same CV. Any
    ``cv > 0`` is accepted (1 is Poisson); the KunServe stand-in uses ``cv >= 3`` for
    BurstGPT-like burstiness.

    Args:
        rate: base arrival rate, req/s (> 0).
        duration_s: keep arrivals in ``[0, duration_s)`` (> 0).
        cv: coefficient of variation of the inter-arrival gaps (> 0).
        rng: random generator.
        burst_start_s: start of the burst window in ``[0, duration_s)``, or ``None`` (no
            window; then ``burst_len_s`` must be ``None`` too).
        burst_len_s: length of the window (> 0; must end by ``duration_s``), or ``None``.
        burst_factor: rate multiplier inside the window (> 0).

    Returns:
        Sorted ``float64`` arrival times in ``[0, duration_s)`` (the first after one gap).

    Raises:
        ConfigError: an invalid argument (the message names it).
    """
    r = _positive("rate", rate)
    d = _positive("duration_s", duration_s)
    c = _positive("cv", cv)
    f = _positive("burst_factor", burst_factor)
    gen = _check_rng(rng)
    if (burst_start_s is None) != (burst_len_s is None):
        raise ConfigError(
            "burst_start_s and burst_len_s must be given together (or both None for no burst)"
        )
    if burst_start_s is None:
        start, length = 0.0, 0.0
    else:
        start, length = _window(burst_start_s, burst_len_s, d)
    t_break, lam = _cumulative(r, d, start, length, f)
    tau = gamma_arrivals(1.0, c, duration_s=float(lam[-1]), rng=gen)
    times = np.interp(tau, lam, t_break)
    return np.asarray(times[times < d], dtype=np.float64)


# --------------------------------------------------------------------------- workload


def kunserve_workload(
    profile: str,
    arrival: str,
    rate: float,
    duration_s: float,
    *,
    burst_start_s: float,
    burst_len_s: float,
    burst_factor: float = 14.0,
    cv: float = 3.0,
    model: str = "qwen-2.5-14b",
    seed: int = 0,
    azure_path: str | Path | None = None,
    offset_s: float | None = 0.0,
) -> list[Request]:
    """A KunServe-style bursty workload: one model, one length profile, a burst window.

    Arrivals: ``"azure-burst"`` (:func:`azure_burst_arrivals`, the real Azure conversation
    timestamps, the default stand-in for BurstGPT) or ``"gamma"``
    (:func:`gamma_burst_arrivals` with gap CV ``cv``); both at base rate ``rate`` with the
    rate times ``burst_factor`` in ``[burst_start_s, burst_start_s + burst_len_s)``
    (``burst_factor=1`` for no burst). Lengths: :func:`length_profile` ``(profile)``.

    Randomness: ``numpy.random.SeedSequence(seed).spawn(2)`` gives two generators, one for
    the arrivals and one for the lengths, so the same seed always gives the same workload and
    changing the profile does not change the arrival times (nor the arrival process the
    lengths). ``"azure-burst"`` with a fixed ``offset_s`` uses no randomness for arrivals.
    Lengths are drawn in one call for all requests.

    Args:
        profile: one of :data:`PROFILES`.
        arrival: one of :data:`ARRIVALS`.
        rate: base arrival rate, req/s (> 0).
        duration_s: length of the run, seconds (> 0).
        burst_start_s: start of the burst window, in ``[0, duration_s)``.
        burst_len_s: length of the window (> 0; must end by ``duration_s``).
        burst_factor: rate multiplier inside the window (> 0; 14 as BurstGPT's jump).
        cv: inter-arrival CV of ``"gamma"`` (> 0; validated but unused by ``"azure-burst"``).
        model: catalog model name of every request (stored in its canonical spelling).
        seed: random seed (integer >= 0).
        azure_path: the Azure trace, for ``"azure-burst"`` and ``"azure-conv"``; ``None``
            uses :func:`default_azure_path`.
        offset_s: start offset into the Azure trace (``"azure-burst"`` only; ``None`` draws
            it from the arrival generator).

    Returns:
        Requests in arrival order, ids ``0..n-1``, arrivals in ``[0, duration_s)``.

    Raises:
        ConfigError: an invalid argument (the message names it).
        InputError: a needed Azure trace is missing (the message names the path) or
            malformed.
    """
    if profile not in PROFILES:
        raise ConfigError(
            f"profile: unknown length profile {profile!r}; known: {', '.join(PROFILES)}"
        )
    if arrival not in ARRIVALS:
        raise ConfigError(
            f"arrival: unknown arrival process {arrival!r}; known: {', '.join(ARRIVALS)}"
        )
    r = _positive("rate", rate)
    d = _positive("duration_s", duration_s)
    _window(burst_start_s, burst_len_s, d)
    _positive("burst_factor", burst_factor)
    _positive("cv", cv)
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(f"model must be a catalog model name, got {model!r}")
    from fleetserve.spec import get_model

    try:
        model_name = get_model(model).name
    except FleetserveError as e:
        raise ConfigError(f"model: {e}") from e
    if offset_s is not None:
        _finite("offset_s", offset_s)
    sampler = length_profile(profile, azure_path=azure_path)  # fail on a missing file early

    arrivals_seq, lengths_seq = np.random.SeedSequence(int(seed)).spawn(2)
    rng_t = np.random.default_rng(arrivals_seq)
    rng_l = np.random.default_rng(lengths_seq)
    if arrival == "azure-burst":
        times = azure_burst_arrivals(
            r,
            d,
            burst_start_s=burst_start_s,
            burst_len_s=burst_len_s,
            burst_factor=burst_factor,
            azure_path=azure_path,
            offset_s=offset_s,
            rng=rng_t,
        )
    else:
        times = gamma_burst_arrivals(
            r,
            d,
            cv=cv,
            rng=rng_t,
            burst_start_s=burst_start_s,
            burst_len_s=burst_len_s,
            burst_factor=burst_factor,
        )
    prompts, outputs = sampler(len(times), rng_l)
    t_list = times.tolist()
    p_list = np.asarray(prompts, dtype=np.int64).tolist()
    o_list = np.asarray(outputs, dtype=np.int64).tolist()
    return [
        Request(
            id=i,
            model=model_name,
            arrival_s=t_list[i],
            prompt_tokens=p_list[i],
            output_tokens=o_list[i],
        )
        for i in range(len(t_list))
    ]
