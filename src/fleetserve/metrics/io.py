"""Write a run's result directory and read summaries back.

A run directory holds::

    summary.json        the summary dict (indent 2, sorted keys, strict JSON)
    requests.csv        one row per request: RequestRecord fields + derived latencies
    timeseries.csv      sampled cluster state (+ kv_utilization per sample)
    migrations.csv      one row per completed migration
    timeseries.png      active GPUs, KV utilization, queued/running over time
    latency_cdf.png     TTFT, TPOT and end-to-end CDFs
    report.md           readable report linking the above
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetserve.metrics.plots import plot_latency_cdf, plot_timeseries
from fleetserve.metrics.records import MigrationRecord, RequestRecord, RunResult
from fleetserve.metrics.report import render_report
from fleetserve.metrics.summary import kv_utilization_series

logger = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"

REQUEST_COLUMNS: tuple[str, ...] = (
    *(f.name for f in dataclasses.fields(RequestRecord)),
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "normalized",
)
"""Columns of ``requests.csv``."""

TIMESERIES_COLUMNS: tuple[str, ...] = (
    "t",
    "active_gpus",
    "kv_used_bytes",
    "kv_capacity_bytes",
    "kv_demand_bytes",
    "queued",
    "running",
    "kv_utilization",
)
"""Columns of ``timeseries.csv``."""

MIGRATION_COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(MigrationRecord))
"""Columns of ``migrations.csv``."""


def dumps_summary(summary: Mapping[str, Any]) -> str:
    """Strict JSON text of a summary (indent 2, sorted keys, NaN rejected)."""
    return json.dumps(summary, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _cell(v: Any) -> Any:
    return "" if v is None else v


def _write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for row in rows:
            w.writerow([_cell(v) for v in row])
    return path


def _request_row(r: RequestRecord) -> list[Any]:
    base = [getattr(r, name) for name in REQUEST_COLUMNS[:-4]]
    e2e = r.e2e_s if r.status == "finished" else None
    normalized = e2e / r.ideal_s if e2e is not None and r.ideal_s > 0 else None
    return [*base, r.ttft_s, r.tpot_s, e2e, normalized]


def write_requests_csv(path: str | Path, records: Iterable[RequestRecord]) -> Path:
    """Write ``requests.csv``: every RequestRecord field plus ttft_s, tpot_s, e2e_s, normalized.

    Missing values are empty cells; ``e2e_s`` and ``normalized`` are only
    filled for finished requests.
    """
    return _write_csv(Path(path), REQUEST_COLUMNS, (_request_row(r) for r in records))


def write_timeseries_csv(path: str | Path, result: RunResult) -> Path:
    """Write ``timeseries.csv`` (one row per sample, ``kv_utilization`` empty at zero capacity)."""
    ts = result.timeseries
    rows = zip(
        ts.t,
        ts.active_gpus,
        ts.kv_used_bytes,
        ts.kv_capacity_bytes,
        ts.kv_demand_bytes,
        ts.queued,
        ts.running,
        kv_utilization_series(ts),
        strict=True,
    )
    return _write_csv(Path(path), TIMESERIES_COLUMNS, rows)


def write_migrations_csv(path: str | Path, migrations: Iterable[MigrationRecord]) -> Path:
    """Write ``migrations.csv`` (one row per migration)."""
    return _write_csv(
        Path(path),
        MIGRATION_COLUMNS,
        ([getattr(m, name) for name in MIGRATION_COLUMNS] for m in migrations),
    )


def write_run(out_dir: str | Path, result: RunResult, summary: Mapping[str, Any]) -> list[Path]:
    """Write a run's result directory (created if missing).

    Args:
        out_dir: the run directory.
        result: what the run produced.
        summary: ``summarize(result)``.

    Returns:
        The paths written, ``summary.json`` first and ``report.md`` last.

    Raises:
        ValueError: the summary holds NaN or infinities (not strict JSON).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / SUMMARY_FILE
    summary_path.write_text(dumps_summary(summary), encoding="utf-8")
    files = [
        summary_path,
        write_requests_csv(out / "requests.csv", result.records),
        write_timeseries_csv(out / "timeseries.csv", result),
        write_migrations_csv(out / "migrations.csv", result.migrations),
        plot_timeseries(result, out / "timeseries.png"),
        plot_latency_cdf(result.records, out / "latency_cdf.png"),
    ]
    report_path = out / "report.md"
    report_path.write_text(render_report(summary, files), encoding="utf-8")
    files.append(report_path)
    logger.info("wrote %d result files to %s", len(files), out)
    return files


def read_summary(path: str | Path) -> dict[str, Any]:
    """Read ``summary.json`` from a file path or a run directory.

    Raises:
        FileNotFoundError: no summary at ``path``.
        ValueError: the file is not a JSON object.
    """
    p = Path(path)
    if p.is_dir():
        p = p / SUMMARY_FILE
    data = json.loads(p.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object, got {type(data).__name__}")
    return data
