"""PNG plots of one run and overlays of several runs.

Figures are built with :class:`matplotlib.figure.Figure` directly and saved
through the Agg renderer, so this module never imports :mod:`matplotlib.pyplot`,
never changes the global backend and leaves no open figures behind. Long series
are reduced to at most :data:`MAX_POINTS` points before plotting (the active-GPU
step keeps per-chunk maxima so that peaks stay visible).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fleetserve.metrics.records import RequestRecord, RunResult
from fleetserve.metrics.summary import gpu_step, kv_utilization_series

logger = logging.getLogger(__name__)

MAX_POINTS = 2000
"""Most points drawn per line."""

_DPI = 100


# --------------------------------------------------------------------------- helpers


def _time_unit(span_s: float) -> tuple[str, float]:
    """Readable unit for a time axis: ``(label, divisor)``."""
    if span_s > 3 * 3600:
        return "h", 3600.0
    if span_s > 1200:
        return "min", 60.0
    return "s", 1.0


def save_png(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=_DPI, format="png")
    fig.clear()
    return path


def _downsample(
    t: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS, how: str = "stride"
) -> tuple[np.ndarray, np.ndarray]:
    """Reduce ``(t, y)`` to at most ``max_points`` points.

    Args:
        how: ``"stride"`` keeps every k-th point (plus the last); ``"max"`` keeps
            the first time and the maximum value of each chunk of k points.
    """
    n = len(t)
    if n <= max_points:
        return t, y
    k = math.ceil(n / max_points)
    idx = np.arange(0, n, k)
    if how == "max":
        return t[idx], np.maximum.reduceat(y, idx)
    if idx[-1] != n - 1:
        idx = np.append(idx[:-1], n - 1)
    return t[idx], y[idx]


def _cdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Empirical CDF points ``(sorted values, fraction ≤ value)``, at most MAX_POINTS."""
    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)
    y = np.arange(1, n + 1, dtype=float) / max(n, 1)
    if n > MAX_POINTS:
        idx = np.unique(np.linspace(0, n - 1, MAX_POINTS).round().astype(int))
        x, y = x[idx], y[idx]
    return x, y


def _no_data(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _gpu_line(result: RunResult) -> tuple[np.ndarray, np.ndarray]:
    """Active-GPU step from the intervals (samples when there are none), up to ``end_s``."""
    times, counts = gpu_step(result.gpu_intervals)
    if times:
        t = np.asarray(times, dtype=float)
        y = np.asarray(counts, dtype=float)
        if result.end_s > t[-1]:
            t = np.append(t, result.end_s)
            y = np.append(y, y[-1])
        return _downsample(t, y, how="max")
    ts = result.timeseries
    return _downsample(
        np.asarray(ts.t, dtype=float), np.asarray(ts.active_gpus, dtype=float), how="max"
    )


def _kv_line(result: RunResult) -> tuple[np.ndarray, np.ndarray]:
    ts = result.timeseries
    util = [np.nan if u is None else 100.0 * u for u in kv_utilization_series(ts)]
    return _downsample(np.asarray(ts.t, dtype=float), np.asarray(util, dtype=float))


def _finished_latencies(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"TTFT": [], "TPOT": [], "end-to-end": []}
    for r in records:
        if r.status != "finished":
            continue
        for key, v in (("TTFT", r.ttft_s), ("TPOT", r.tpot_s), ("end-to-end", r.e2e_s)):
            if v is not None:
                out[key].append(v)
    return out


def _span(results: Sequence[RunResult]) -> float:
    ends = [r.end_s for r in results]
    ends += [r.timeseries.t[-1] for r in results if r.timeseries.t]
    return max(ends, default=0.0)


# --------------------------------------------------------------------------- one run


def plot_timeseries(result: RunResult, path: str | Path) -> Path:
    """Three stacked panels over run time: active GPUs, KV utilization %, queued/running.

    Args:
        result: the run.
        path: PNG file to write (parent folders are created).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    unit, div = _time_unit(_span([result]))
    fig = Figure(figsize=(9, 7.5), layout="constrained")
    ax_gpu, ax_kv, ax_q = fig.subplots(3, 1, sharex=True)
    fig.suptitle("Cluster state over time")

    t, y = _gpu_line(result)
    if len(t):
        ax_gpu.step(t / div, y, where="post", color="C0")
    else:
        _no_data(ax_gpu)
    ax_gpu.set_ylabel("active GPUs")
    ax_gpu.set_ylim(bottom=0)
    ax_gpu.yaxis.set_major_locator(MaxNLocator(integer=True))

    ts = result.timeseries
    t, y = _kv_line(result)
    if len(t):
        ax_kv.plot(t / div, y, color="C1")
        ax_kv.set_ylim(0, 105)
    else:
        _no_data(ax_kv)
    ax_kv.set_ylabel("KV utilization (%)")

    if ts.t:
        tq = np.asarray(ts.t, dtype=float)
        for col, label, color in ((ts.queued, "queued", "C3"), (ts.running, "running", "C2")):
            tt, yy = _downsample(tq, np.asarray(col, dtype=float))
            ax_q.plot(tt / div, yy, label=label, color=color)
        ax_q.legend(loc="upper right")
        ax_q.set_ylim(bottom=0)
    else:
        _no_data(ax_q)
    ax_q.set_ylabel("requests")
    ax_q.set_xlabel(f"time ({unit})")
    for ax in (ax_gpu, ax_kv, ax_q):
        ax.grid(True, alpha=0.3)
    return save_png(fig, path)


def _cdf_panels(fig: Figure, named_records: Mapping[str, Sequence[RequestRecord]]) -> None:
    axes = fig.subplots(1, 3)
    per_run = {name: _finished_latencies(recs) for name, recs in named_records.items()}
    for ax, kind in zip(axes, ("TTFT", "TPOT", "end-to-end"), strict=True):
        drawn = False
        for i, (name, lat) in enumerate(per_run.items()):
            if lat[kind]:
                x, y = _cdf(lat[kind])
                ax.step(x, y, where="post", label=name, color=f"C{i % 10}")
                drawn = True
        if not drawn:
            _no_data(ax)
        ax.set_title(kind)
        ax.set_xlabel(f"{kind} (s)")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if drawn and len(per_run) > 1:
            ax.legend(loc="lower right", fontsize="small")
    axes[0].set_ylabel("fraction of finished requests")


def plot_latency_cdf(records: Sequence[RequestRecord], path: str | Path) -> Path:
    """CDFs of TTFT, TPOT and end-to-end latency over finished requests.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    fig = Figure(figsize=(12, 4), layout="constrained")
    fig.suptitle("Latency CDFs (finished requests)")
    _cdf_panels(fig, {"run": records})
    return save_png(fig, path)


# --------------------------------------------------------------------------- overlays


def plot_compare_timeseries(named_results: Mapping[str, RunResult], path: str | Path) -> Path:
    """Overlay of several runs: active GPUs, KV utilization % and queued requests over time.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    unit, div = _time_unit(_span(list(named_results.values())))
    fig = Figure(figsize=(9, 7.5), layout="constrained")
    ax_gpu, ax_kv, ax_q = fig.subplots(3, 1, sharex=True)
    fig.suptitle("Cluster state over time, by stack")
    for i, (name, res) in enumerate(named_results.items()):
        color = f"C{i % 10}"
        t, y = _gpu_line(res)
        if len(t):
            ax_gpu.step(t / div, y, where="post", label=name, color=color)
        t, y = _kv_line(res)
        if len(t):
            ax_kv.plot(t / div, y, label=name, color=color)
        ts = res.timeseries
        if ts.t:
            tt, yy = _downsample(np.asarray(ts.t, dtype=float), np.asarray(ts.queued, dtype=float))
            ax_q.plot(tt / div, yy, label=name, color=color)
    ax_gpu.set_ylabel("active GPUs")
    ax_gpu.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_kv.set_ylabel("KV utilization (%)")
    ax_q.set_ylabel("queued requests")
    ax_q.set_xlabel(f"time ({unit})")
    for ax in (ax_gpu, ax_kv, ax_q):
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(loc="upper right", fontsize="small")
            ax.set_ylim(bottom=0)
        else:
            _no_data(ax)
    return save_png(fig, path)


def plot_compare_latency(named: Mapping[str, RunResult], path: str | Path) -> Path:
    """Overlaid TTFT, TPOT and end-to-end CDFs of several runs (finished requests).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    fig = Figure(figsize=(12, 4), layout="constrained")
    fig.suptitle("Latency CDFs by stack (finished requests)")
    _cdf_panels(fig, {name: res.records for name, res in named.items()})
    return save_png(fig, path)


def _get(summary: Mapping[str, Any], *keys: str) -> float | None:
    cur: Any = summary
    for k in keys:
        if not isinstance(cur, Mapping) or k not in cur:
            return None
        cur = cur[k]
    return None if cur is None else float(cur)


def plot_compare_bars(named_summaries: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """Bar charts per stack: peak GPUs, normalized latency, P99 e2e latency, mean KV util.

    Missing values (``None``) are drawn as an empty bar labelled ``n/a``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    panels: list[tuple[str, str, tuple[str, ...], float]] = [
        ("Peak active GPUs", "GPUs", ("gpus", "peak"), 1.0),
        ("Normalized latency", "e2e / ideal", ("normalized_latency",), 1.0),
        ("P99 end-to-end latency", "seconds", ("latency_s", "e2e", "p99"), 1.0),
        ("Mean KV utilization", "%", ("kv_utilization", "mean"), 100.0),
    ]
    names = list(named_summaries)
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    fig.suptitle("Stack comparison")
    axes = fig.subplots(1, 4)
    x = np.arange(len(names))
    for ax, (title, ylabel, keys, mul) in zip(axes, panels, strict=True):
        vals = [_get(named_summaries[n], *keys) for n in names]
        heights = [0.0 if v is None else v * mul for v in vals]
        bars = ax.bar(x, heights, color=[f"C{i % 10}" for i in range(len(names))])
        labels = ["n/a" if v is None else f"{h:.3g}" for v, h in zip(vals, heights, strict=True)]
        ax.bar_label(bars, labels=labels, fontsize="small")
        if keys == ("gpus", "peak"):
            lbs = [_get(named_summaries[n], "gpus", "lower_bound") for n in names]
            if any(lb is not None for lb in lbs):
                ax.scatter(
                    [xi for xi, lb in zip(x, lbs, strict=True) if lb is not None],
                    [lb for lb in lbs if lb is not None],
                    marker="_",
                    s=400,
                    color="black",
                    label="lower bound",
                    zorder=3,
                )
                ax.legend(loc="lower right", fontsize="small")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xticks(x, names, rotation=30 if len(names) > 3 else 0)
        ax.margins(y=0.15)
        ax.grid(True, axis="y", alpha=0.3)
        if not names:
            _no_data(ax)
    return save_png(fig, path)


# --------------------------------------------------------------------------- experiment grids


def _series_order(
    panels: Mapping[str, Mapping[str, Mapping[str, Any]]], series: Sequence[str] | None
) -> list[str]:
    """``series`` (when given) else every series name in first-seen order."""
    if series is not None:
        return list(series)
    seen: dict[str, None] = {}
    for groups in panels.values():
        for values in groups.values():
            seen.update(dict.fromkeys(values))
    return list(seen)


def plot_grouped_bars(
    panels: Mapping[str, Mapping[str, Mapping[str, float | None]]],
    path: str | Path,
    *,
    title: str,
    ylabel: str,
    series: Sequence[str] | None = None,
    value_fmt: str = ".3g",
    scale: float = 1.0,
    markers: Mapping[str, Mapping[str, float | None]] | None = None,
    marker_label: str = "lower bound",
) -> Path:
    """Grouped bar charts, one panel per key of ``panels`` side by side.

    ``panels[panel][group][series]`` is a bar's value; groups are the x ticks,
    series the bars within a group (one colour per series, the same in every
    panel). A series whose values are all missing (None or absent) is not drawn
    and not in the legend, but keeps its colour slot, so colours stay the same
    between figures drawn with the same ``series`` order.

    Args:
        panels: values by panel, group and series.
        path: PNG file to write (parent folders are created).
        title: figure title.
        ylabel: y-axis label of every panel.
        series: series order (and colours); default: first-seen order.
        value_fmt: format spec of the value printed above each bar.
        scale: multiplier applied to every value (e.g. 100 for percent).
        markers: optional ``markers[panel][group]`` value drawn as a dashed
            black line across the group (e.g. a lower bound).
        marker_label: legend label of the markers.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    order = _series_order(panels, series)
    drawn = [
        s
        for s in order
        if any(vals.get(s) is not None for groups in panels.values() for vals in groups.values())
    ]
    n_groups = max((len(g) for g in panels.values()), default=1)
    width_in = min(8.0, max(5.0, 1.0 + n_groups * (0.3 * max(len(drawn), 1) + 0.4)))
    fig = Figure(figsize=(width_in * max(len(panels), 1), 4.8), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)[0]
    bar_w = 0.8 / max(len(drawn), 1)
    for ax, (ptitle, groups) in zip(axes, panels.items(), strict=False):
        names = list(groups)
        x = np.arange(len(names), dtype=float)
        for j, s in enumerate(drawn):
            vals = [groups[g].get(s) for g in names]
            xs = x - 0.4 + bar_w * (j + 0.5)
            heights = [0.0 if v is None else v * scale for v in vals]
            bars = ax.bar(
                xs, heights, bar_w, label=s, color=f"C{order.index(s) % 10}", edgecolor="white"
            )
            labels = ["" if v is None else format(v * scale, value_fmt) for v in vals]
            ax.bar_label(bars, labels=labels, fontsize="x-small", padding=1)
        if markers is not None:
            first = True
            for xi, g in zip(x, names, strict=True):
                m = markers.get(ptitle, {}).get(g)
                if m is None:
                    continue
                ax.hlines(
                    m * scale,
                    xi - 0.45,
                    xi + 0.45,
                    colors="black",
                    linestyles="--",
                    label=marker_label if first else None,
                    zorder=3,
                )
                first = False
        ax.set_title(ptitle)
        ax.set_ylabel(ylabel)
        ax.set_xticks(x, names)
        ax.margins(y=0.15)
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        if not drawn or not names:
            _no_data(ax)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=len(handles))
    return save_png(fig, path)


def plot_line_panels(
    panels: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
    path: str | Path,
    *,
    title: str,
    ylabel: str,
    series: Sequence[str] | None = None,
    step: bool = True,
    integer: bool = True,
) -> Path:
    """Lines over time, one panel per key of ``panels`` (stacked vertically).

    ``panels[panel][series] = (times_s, values)``; each series keeps one colour
    in every panel (by its place in ``series``). Long series are reduced to
    :data:`MAX_POINTS` points, keeping per-chunk maxima so peaks stay visible.

    Args:
        panels: ``(times, values)`` by panel and series.
        path: PNG file to write (parent folders are created).
        title: figure title.
        ylabel: y-axis label of every panel.
        series: series order (and colours); default: first-seen order.
        step: draw steps (``where="post"``) instead of straight segments.
        integer: integer ticks on the y axis.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    order = (
        list(series)
        if series is not None
        else list(dict.fromkeys(s for lines in panels.values() for s in lines))
    )
    span = max(
        (float(t[-1]) for lines in panels.values() for t, _ in lines.values() if len(t)),
        default=0.0,
    )
    unit, div = _time_unit(span)
    n = max(len(panels), 1)
    fig = Figure(figsize=(10, 3.2 * n + 0.6), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    for ax, (ptitle, lines) in zip(axes, panels.items(), strict=False):
        for name, (t, y) in lines.items():
            if not len(t):
                continue
            tt, yy = _downsample(np.asarray(t, dtype=float), np.asarray(y, dtype=float), how="max")
            color = f"C{order.index(name) % 10}" if name in order else None
            if step:
                ax.step(tt / div, yy, where="post", label=name, color=color)
            else:
                ax.plot(tt / div, yy, label=name, color=color)
        ax.set_title(ptitle)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if integer:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_lines():
            ax.legend(loc="upper right", fontsize="small")
            ax.set_ylim(bottom=0)
        else:
            _no_data(ax)
    axes[-1].set_xlabel(f"time ({unit})")
    return save_png(fig, path)
