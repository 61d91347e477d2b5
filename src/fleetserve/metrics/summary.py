"""Turn a :class:`RunResult` into the ``summary.json`` dict (see DESIGN.md, "Contracts").

Definitions used here (each one chosen so that the numbers stay comparable
between the simulator and the runtime):

* **Run span** — from the first request arrival to ``result.end_s`` (from
  ``0.0`` when there are no records). ``throughput_rps``,
  ``throughput_tokens_s``, ``gpus.mean`` and ``migrations.per_s`` are divided by
  it; they are ``None`` when the span is not positive.
* **Latency** (``latency_s``) — over *finished* requests only. TTFT counts the
  finished requests that have a first token, TPOT (= TBT, the mean decode-step
  time) the finished requests that generated at least two tokens. Percentiles
  use :func:`numpy.percentile` with its default ``linear`` method. An empty set
  gives ``None`` for mean and percentiles (never NaN).
* **Preemptions** (``requests.preemptions``, ``requests.preempted``) — the
  recompute preemptions of every request (finished or not) and how many
  requests were preempted at least once: the service quality a stack pays
  when it admits until memory runs out.
* **Normalized latency** (SeaLLM) — mean over finished requests with
  ``ideal_s > 0`` of ``e2e_s / ideal_s``.
* **SLO attainment** at scale ``k`` (SeaLLM) — share of *all* requests that
  finished with ``e2e_s <= k * ideal_s`` (relative tolerance ``1e-9`` against
  float noise). Rejected and unfinished requests count as misses; a finished
  request with ``ideal_s <= 0`` can only meet an SLO with zero latency.
  Keyed by ``f"{k:g}"`` (``"1.5"``, ``"2"``, ...).
* **GPUs** (Mell) — ``peak`` is the maximum number of simultaneously active
  GPUs, exact from ``gpu_intervals`` by a sweep over the interval endpoints
  (a release and an activation at the same instant do not overlap;
  zero-length intervals are ignored). ``mean`` is the time-average of the
  active-GPU count over the run span, ``gpu_hours`` the total GPU-time of all
  intervals. Lower bounds on the GPUs the requests in the system needed
  (queued ones included, as if all were served at once), each the maximum
  over samples: ``lower_bound_kv``, ``ceil(kv_demand_bytes /
  kv_bytes_per_gpu)`` (KV counted as if it could be split between GPUs), None
  when the run has no single KV capacity per GPU (``result.kv_bytes_per_gpu``
  unset: several models); ``lower_bound_large``, the classical bin-packing
  bound on large items: requests in flight whose prompt alone is more than
  half an instance's KV capacity (two of them cannot share an instance), times
  the GPUs of an instance (:func:`large_request_counts`; None unless
  ``result.instance_kv_tokens`` is set: the single-model world); and
  ``lower_bound``, the maximum over samples of the larger of the two at that
  sample.
* **Prefix cache** (``prefix_cache``, only in runs with prefix caching on,
  :func:`prefix_cache_stats`) — over the requests whose first prefill ran
  (they have a first token): ``requests``, ``requests_hit`` (a first prefill
  found at least one block cached), ``prompt_tokens``, ``hit_tokens`` (their
  ``cached_tokens``, not computed), ``hit_rate = hit_tokens / prompt_tokens``
  and ``request_hit_rate = requests_hit / requests``; a backend may add its own
  counters (the simulator: re-prefill hits, blocks published and evicted).
* **KV utilization** — mean over time-series samples (taken every
  ``interval_s``, so the mean is a time-average) of ``kv_used / kv_capacity``
  of active GPUs; samples with zero capacity are excluded.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fleetserve.metrics.records import GpuInterval, RequestRecord, RunResult, TimeSeries
from fleetserve.policy.mechanism import MODES

logger = logging.getLogger(__name__)

DEFAULT_SLO_SCALES: tuple[float, ...] = (1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)
"""SLO scales (multiples of a request's idle-system execution time) reported by default."""

STATUSES: tuple[str, ...] = ("finished", "rejected", "unfinished")
"""The only valid values of :attr:`RequestRecord.status`."""

PERCENTILES: tuple[int, ...] = (50, 90, 99)
"""Percentiles reported for every latency kind (``p50``, ``p90``, ``p99``)."""

_SLO_RTOL = 1e-9


class MetricsInvariantError(ValueError):
    """The records of a run violate an invariant (bad status, missing timestamps, ...)."""


# --------------------------------------------------------------------------- helpers


def slo_key(scale: float) -> str:
    """Key of an SLO scale in ``slo_attainment`` (``1.5 -> "1.5"``, ``2.0 -> "2"``)."""
    return f"{float(scale):g}"


def _finite(x: float | None) -> float | None:
    """``float(x)`` or ``None`` when ``x`` is None, NaN or infinite."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 (numpy ``linear`` method) of ``values``; all None when empty.

    Args:
        values: latencies in seconds.

    Returns:
        ``{"mean", "p50", "p90", "p99"}``.
    """
    keys = ["mean"] + [f"p{p}" for p in PERCENTILES]
    if len(values) == 0:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {"mean": _finite(float(arr.mean()))}
    pct = np.percentile(arr, PERCENTILES)
    for p, v in zip(PERCENTILES, pct, strict=True):
        out[f"p{p}"] = _finite(float(v))
    return out


def validate_records(records: Iterable[RequestRecord]) -> None:
    """Check the per-record invariants summary relies on.

    Raises:
        MetricsInvariantError: a status outside :data:`STATUSES`, or a finished
            request without ``finish_s``.
    """
    for r in records:
        if r.status not in STATUSES:
            raise MetricsInvariantError(
                f"request {r.id}: status {r.status!r} is not one of {', '.join(STATUSES)}"
            )
        if r.status == "finished" and r.finish_s is None:
            raise MetricsInvariantError(f"request {r.id}: status 'finished' but finish_s is None")


def count_statuses(records: Sequence[RequestRecord]) -> dict[str, int]:
    """``{"total", "finished", "rejected", "unfinished"}`` counts; checks they add up.

    Raises:
        MetricsInvariantError: a record has an invalid status (then the counts
            would not add up to ``total``).
    """
    validate_records(records)
    c: Counter[str] = Counter(r.status for r in records)
    out = {"total": len(records), **{s: c.get(s, 0) for s in STATUSES}}
    if out["finished"] + out["rejected"] + out["unfinished"] != out["total"]:
        raise MetricsInvariantError(
            f"finished + rejected + unfinished != total ({out})"
        )  # pragma: no cover - validate_records makes this unreachable
    return out


def _meets_slo(r: RequestRecord, scale: float) -> bool:
    if r.status != "finished" or r.finish_s is None:
        return False
    e2e = r.finish_s - r.arrival_s
    return e2e <= scale * r.ideal_s * (1.0 + _SLO_RTOL)


def slo_attainment(
    records: Sequence[RequestRecord], scales: Sequence[float] = DEFAULT_SLO_SCALES
) -> dict[str, float | None]:
    """Share of all ``records`` that finished within ``scale × ideal_s``, per scale.

    Rejected and unfinished requests count as misses. ``None`` per scale when
    there are no records.
    """
    n = len(records)
    out: dict[str, float | None] = {}
    for k in sorted(float(s) for s in scales):
        out[slo_key(k)] = None if n == 0 else sum(_meets_slo(r, k) for r in records) / n
    return out


def normalized_latency(records: Sequence[RequestRecord]) -> float | None:
    """SeaLLM normalized latency: mean of ``e2e / ideal_s`` over finished requests.

    Finished requests with ``ideal_s <= 0`` are left out (logged); ``None`` when
    nothing is left.
    """
    ratios: list[float] = []
    skipped = 0
    for r in records:
        if r.status != "finished" or r.finish_s is None:
            continue
        if r.ideal_s <= 0:
            skipped += 1
            continue
        ratios.append((r.finish_s - r.arrival_s) / r.ideal_s)
    if skipped:
        logger.warning(
            "normalized latency: %d finished request(s) without ideal_s skipped", skipped
        )
    return _finite(float(np.mean(ratios))) if ratios else None


def run_span(result: RunResult) -> tuple[float, float]:
    """``(start_s, end_s)`` of the run span: first arrival (0 without records) to ``end_s``."""
    start = min((r.arrival_s for r in result.records), default=0.0)
    return float(start), float(result.end_s)


def gpu_step(intervals: Sequence[GpuInterval]) -> tuple[list[float], list[int]]:
    """Active-GPU count as a step function from activity intervals (sweep line).

    Events at the same instant are merged; a release at ``t`` is applied before
    an activation at ``t``. Zero-length (or negative) intervals are ignored.

    Returns:
        ``(times, counts)``: the count is ``counts[i]`` on ``[times[i], times[i+1])``
        and ``counts[-1]`` (0) after the last time. Empty lists without intervals.
    """
    deltas: dict[float, int] = {}
    for iv in intervals:
        if iv.end_s <= iv.start_s:
            continue
        deltas[iv.start_s] = deltas.get(iv.start_s, 0) + 1
        deltas[iv.end_s] = deltas.get(iv.end_s, 0) - 1
    times: list[float] = []
    counts: list[int] = []
    level = 0
    for t in sorted(deltas):
        level += deltas[t]
        times.append(float(t))
        counts.append(level)
    return times, counts


def gpu_stats(
    intervals: Sequence[GpuInterval], start_s: float, end_s: float
) -> dict[str, float | int | None]:
    """``peak``, ``mean`` (over ``[start_s, end_s]``) and ``gpu_hours`` of the intervals."""
    _, counts = gpu_step(intervals)
    peak = max(counts, default=0)
    gpu_seconds = sum(max(0.0, iv.end_s - iv.start_s) for iv in intervals)
    span = end_s - start_s
    mean: float | None = None
    if span > 0:
        in_span = sum(max(0.0, min(iv.end_s, end_s) - max(iv.start_s, start_s)) for iv in intervals)
        mean = _finite(in_span / span)
    return {"peak": int(peak), "mean": mean, "gpu_hours": _finite(gpu_seconds / 3600.0)}


def _check_timeseries(ts: TimeSeries) -> None:
    n = len(ts.t)
    cols = {
        "active_gpus": ts.active_gpus,
        "kv_used_bytes": ts.kv_used_bytes,
        "kv_capacity_bytes": ts.kv_capacity_bytes,
        "kv_demand_bytes": ts.kv_demand_bytes,
        "queued": ts.queued,
        "running": ts.running,
    }
    for name, col in cols.items():
        if len(col) != n:
            raise MetricsInvariantError(
                f"timeseries column {name!r} has {len(col)} samples, 't' has {n}"
            )


def kv_utilization_series(ts: TimeSeries) -> list[float | None]:
    """Per-sample ``kv_used / kv_capacity`` (None where capacity is zero)."""
    return [
        (u / c) if c > 0 else None
        for u, c in zip(ts.kv_used_bytes, ts.kv_capacity_bytes, strict=True)
    ]


def kv_utilization_mean(ts: TimeSeries) -> float | None:
    """Time-average KV utilization of active GPUs over samples with capacity > 0."""
    vals = [u for u in kv_utilization_series(ts) if u is not None]
    return _finite(float(np.mean(vals))) if vals else None


def kv_demand_gpus(ts: TimeSeries, kv_bytes_per_gpu: int) -> list[int] | None:
    """Per sample, ``ceil(kv_demand_bytes / kv_bytes_per_gpu)``; None when the
    capacity is not positive."""
    if kv_bytes_per_gpu <= 0:
        logger.warning("kv_bytes_per_gpu=%d is not positive; no GPU lower bound", kv_bytes_per_gpu)
        return None
    # Integer ceil division: exact for byte counts of any size.
    return [-(-int(d) // kv_bytes_per_gpu) for d in ts.kv_demand_bytes]


def large_request_counts(
    records: Sequence[RequestRecord], times: Sequence[float], instance_kv_tokens: int
) -> list[int]:
    """Per sample time, the requests in flight whose prompt alone is more than
    half of ``instance_kv_tokens``: arrived (``arrival_s <= t``) and not
    finished (``finish_s > t``; never, for a request unfinished at the end).
    No two of them fit one instance, so each needs an instance of its own.

    Rejected requests are left out, and only the prompt counts (not the tokens
    generated by then): both can only lower the count, so it stays a lower
    bound."""
    half = instance_kv_tokens / 2
    arrive: list[float] = []
    leave: list[float] = []
    for r in records:
        if r.status == "rejected" or r.prompt_tokens <= half:
            continue
        arrive.append(r.arrival_s)
        if r.finish_s is not None:
            leave.append(r.finish_s)
    if not arrive:
        return [0] * len(times)
    t = np.asarray(times, dtype=np.float64)
    came = np.searchsorted(np.sort(np.asarray(arrive)), t, side="right")
    left = np.searchsorted(np.sort(np.asarray(leave)), t, side="right")
    return [int(x) for x in came - left]


def _lower_bounds(result: RunResult) -> dict[str, int | None]:
    """``lower_bound``, ``lower_bound_kv`` and ``lower_bound_large`` (module docstring)."""
    ts = result.timeseries
    kv = None if result.kv_bytes_per_gpu is None else kv_demand_gpus(ts, result.kv_bytes_per_gpu)
    large = None
    if result.instance_kv_tokens is not None and result.instance_kv_tokens > 0:
        tp = int(result.config.get("cluster", {}).get("tp", 1))
        counts = large_request_counts(result.records, ts.t, result.instance_kv_tokens)
        large = [c * tp for c in counts]
    both = [x for x in (kv, large) if x]
    return {
        "lower_bound": max(max(col) for col in zip(*both, strict=True)) if both else None,
        "lower_bound_kv": max(kv) if kv else None,
        "lower_bound_large": max(large) if large else None,
    }


def migration_stats(result: RunResult, span: float) -> dict[str, Any]:
    """``count``, ``per_s``, ``bytes`` and ``by_mode: {mode: {count, bytes}}``
    (every mode listed, zeros included)."""
    by_mode = {mode: {"count": 0, "bytes": 0} for mode in MODES}
    for m in result.migrations:
        d = by_mode.setdefault(m.mode, {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += int(m.bytes)
    count = len(result.migrations)
    return {
        "count": count,
        "per_s": _finite(count / span) if span > 0 else None,
        "bytes": int(sum(int(m.bytes) for m in result.migrations)),
        "by_mode": dict(sorted(by_mode.items())),
    }


def _finished_latencies(
    records: Sequence[RequestRecord],
) -> tuple[list[float], list[float], list[float]]:
    ttft: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    for r in records:
        if r.status != "finished":
            continue
        if (v := r.ttft_s) is not None:
            ttft.append(v)
        if (v := r.tpot_s) is not None:
            tpot.append(v)
        if (v := r.e2e_s) is not None:
            e2e.append(v)
    return ttft, tpot, e2e


def _service_summary(records: Sequence[RequestRecord], scales: Sequence[float]) -> dict[str, Any]:
    _, _, e2e = _finished_latencies(records)
    stats = latency_stats(e2e)
    return {
        "requests": count_statuses(records),
        "latency_s": {"e2e": {"mean": stats["mean"], "p99": stats["p99"]}},
        "normalized_latency": normalized_latency(records),
        "slo_attainment": slo_attainment(records, scales),
    }


# --------------------------------------------------------------------------- summarize


def prefix_cache_stats(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """The ``prefix_cache`` section's per-request part (see the module docstring)."""
    n = hit_n = prompt = hit = 0
    for r in records:
        if r.first_token_s is None:
            continue
        n += 1
        prompt += r.prompt_tokens
        hit += r.cached_tokens
        hit_n += r.cached_tokens > 0
    return {
        "requests": n,
        "requests_hit": hit_n,
        "prompt_tokens": prompt,
        "hit_tokens": hit,
        "hit_rate": hit / prompt if prompt else None,
        "request_hit_rate": hit_n / n if n else None,
    }


def summarize(result: RunResult, slo_scales: Sequence[float] = DEFAULT_SLO_SCALES) -> dict:
    """Build the ``summary.json`` dict of a run (schema in DESIGN.md, definitions above).

    Args:
        result: what the run produced.
        slo_scales: SLO scales to report in ``slo_attainment``.

    Returns:
        A JSON-able dict without NaN or infinities
        (``json.dumps(..., allow_nan=False)`` succeeds).

    Raises:
        MetricsInvariantError: a record has a status other than finished,
            rejected or unfinished, a finished record has no ``finish_s``, or
            the time-series columns differ in length.
    """
    records = result.records
    counts = count_statuses(records)
    _check_timeseries(result.timeseries)
    reasons = Counter(
        r.reason if r.reason is not None else "unspecified"
        for r in records
        if r.status == "rejected"
    )
    start_s, end_s = run_span(result)
    span = end_s - start_s
    finished = [r for r in records if r.status == "finished"]
    ttft, tpot, e2e = _finished_latencies(records)
    out_tokens = sum(r.output_tokens for r in finished)

    gpus: dict[str, Any] = dict(gpu_stats(result.gpu_intervals, start_s, end_s))
    gpus.update(_lower_bounds(result))

    by_model: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_model.setdefault(r.model, []).append(r)

    summary: dict[str, Any] = {
        "requests": {
            **counts,
            "rejected_reasons": dict(sorted(reasons.items())),
            # service quality behind the GPU counts: recompute preemptions
            "preemptions": sum(r.preemptions for r in records),
            "preempted": sum(1 for r in records if r.preemptions),
        },
        "latency_s": {
            "ttft": latency_stats(ttft),
            "tpot": latency_stats(tpot),
            "e2e": latency_stats(e2e),
        },
        "normalized_latency": normalized_latency(records),
        "slo_attainment": slo_attainment(records, slo_scales),
        "throughput_rps": _finite(len(finished) / span) if span > 0 else None,
        "throughput_tokens_s": _finite(out_tokens / span) if span > 0 else None,
        "gpus": gpus,
        "kv_utilization": {"mean": kv_utilization_mean(result.timeseries)},
        "migrations": migration_stats(result, span),
        "config": copy.deepcopy(result.config),
        "notes": list(result.notes),
        "services": {
            model: _service_summary(recs, slo_scales) for model, recs in sorted(by_model.items())
        },
    }
    for key, value in result.extra.items():
        if key in summary:
            raise MetricsInvariantError(
                f"extra summary section {key!r} clashes with a standard one"
            )
        summary[key] = copy.deepcopy(value)
    if result.sim_wall_s is not None:
        summary["sim"] = {
            "wall_s": _finite(result.sim_wall_s),
            "events": None if result.sim_events is None else int(result.sim_events),
        }
    logger.debug(
        "summarized %d requests (%d finished) over %.3f s", counts["total"], len(finished), span
    )
    return summary
