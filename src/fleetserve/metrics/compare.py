"""Write the comparison of several stacks run on the same workload.

Each stack's own run directory is written by the caller (:func:`write_run`);
this writes the cross-stack files into ``out_dir``::

    comparison.md                 Markdown table + links to the overlay plots
    comparison.csv                one row per stack (columns: report.COLUMNS)
    comparison.json               {"stacks": [...], "rows": [...]}
    compare_timeseries.png        active GPUs / KV util / queued, one line per stack
    compare_latency.png           TTFT / TPOT / e2e CDFs, one line per stack
    compare_bars.png              peak GPUs, normalized latency, P99 e2e, KV util
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleetserve.metrics.plots import (
    plot_compare_bars,
    plot_compare_latency,
    plot_compare_timeseries,
)
from fleetserve.metrics.records import RunResult
from fleetserve.metrics.report import COLUMNS, comparison_markdown, comparison_rows

logger = logging.getLogger(__name__)


def write_comparison(
    out_dir: str | Path, named: Mapping[str, tuple[dict[str, Any], RunResult]]
) -> list[Path]:
    """Write comparison files and overlay plots for several stacks.

    Args:
        out_dir: folder to write into (created if missing).
        named: ``{stack name: (summary, result)}``, in display order.

    Returns:
        The paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = {name: s for name, (s, _) in named.items()}
    results = {name: r for name, (_, r) in named.items()}
    rows = comparison_rows(summaries)

    csv_path = out / "comparison.csv"
    with csv_path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow([k for k, _ in COLUMNS])
        for row in rows:
            w.writerow(["" if row.get(k) is None else row[k] for k, _ in COLUMNS])

    json_path = out / "comparison.json"
    json_path.write_text(
        json.dumps({"stacks": list(named), "rows": rows}, indent=2, allow_nan=False) + "\n",
        encoding="utf-8",
    )

    plots = [
        plot_compare_timeseries(results, out / "compare_timeseries.png"),
        plot_compare_latency(results, out / "compare_latency.png"),
        plot_compare_bars(summaries, out / "compare_bars.png"),
    ]

    md_path = out / "comparison.md"
    lines = [
        "# fleetserve stack comparison",
        "",
        f"Stacks: {', '.join(f'`{n}`' for n in named)} (same workload).",
        "",
        comparison_markdown(rows),
        "Latencies over finished requests; SLO attainment over all requests "
        "(rejected and unfinished count as misses); KV util is a time-average.",
        "",
        "## Plots",
        "",
        *[f"![{p.stem}]({p.name})" for p in plots],
        "",
    ]
    md_path.write_text("\n".join(lines), encoding="utf-8")
    files = [md_path, csv_path, json_path, *plots]
    logger.info("wrote comparison of %d stacks to %s", len(named), out)
    return files
