"""fleetserve.metrics: per-request records → summary.json, CSVs, plots and reports.

Both backends hand a :class:`RunResult` to :func:`summarize`; :func:`write_run`
writes a run directory and :func:`write_comparison` the cross-stack files.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fleetserve.metrics.records import (
    GpuInterval,
    MigrationRecord,
    RequestRecord,
    RunResult,
    Status,
    TimeSeries,
)
from fleetserve.metrics.summary import DEFAULT_SLO_SCALES, MetricsInvariantError, summarize

if TYPE_CHECKING:
    from fleetserve.metrics.compare import write_comparison
    from fleetserve.metrics.io import read_summary, write_run
    from fleetserve.metrics.plots import (
        plot_compare_bars,
        plot_compare_latency,
        plot_compare_timeseries,
        plot_latency_cdf,
        plot_timeseries,
    )
    from fleetserve.metrics.report import (
        comparison_markdown,
        comparison_rows,
        comparison_table,
        render_report,
    )

# Plotting, file writing and reports pull in matplotlib and rich (~0.5 s); they are
# imported on first use so that importing the records (the simulator does) stays cheap.
_LAZY: dict[str, str] = {
    "write_comparison": "compare",
    "read_summary": "io",
    "write_run": "io",
    "plot_compare_bars": "plots",
    "plot_compare_latency": "plots",
    "plot_compare_timeseries": "plots",
    "plot_latency_cdf": "plots",
    "plot_timeseries": "plots",
    "comparison_markdown": "report",
    "comparison_rows": "report",
    "comparison_table": "report",
    "render_report": "report",
}


def __getattr__(name: str) -> Any:
    """Import the plotting/IO/report API on first access (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_SLO_SCALES",
    "GpuInterval",
    "MetricsInvariantError",
    "MigrationRecord",
    "RequestRecord",
    "RunResult",
    "Status",
    "TimeSeries",
    "comparison_markdown",
    "comparison_rows",
    "comparison_table",
    "plot_compare_bars",
    "plot_compare_latency",
    "plot_compare_timeseries",
    "plot_latency_cdf",
    "plot_timeseries",
    "read_summary",
    "render_report",
    "summarize",
    "write_comparison",
    "write_run",
]
