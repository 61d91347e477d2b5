"""Readable reports: a Markdown page per run and comparison tables across stacks."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

logger = logging.getLogger(__name__)

PREFERRED_SLO_SCALE = "5"
"""SLO scale shown in comparison rows when the summaries have it (else the middle one)."""

COLUMNS: tuple[tuple[str, str], ...] = (
    ("stack", "stack"),
    ("gpus_peak", "GPUs peak"),
    ("gpus_mean", "GPUs mean"),
    ("gpu_hours", "GPU·h"),
    ("gpus_lower_bound", "GPUs LB"),
    ("finished", "finished"),
    ("rejected", "rejected"),
    ("unfinished", "unfinished"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("tpot_p50_s", "TPOT p50 s"),
    ("tpot_p99_s", "TPOT p99 s"),
    ("e2e_p99_s", "e2e p99 s"),
    ("normalized_latency", "norm. lat."),
    ("slo_scale", "SLO scale"),
    ("slo_attainment", "SLO att."),
    ("kv_util_mean", "KV util"),
    ("migrations", "migrations"),
    ("sim_wall_s", "sim wall s"),
)
"""Comparison row keys, in order, with their column headers."""


def _get(d: Mapping[str, Any], *keys: str) -> Any:
    cur: Any = d
    for k in keys:
        if not isinstance(cur, Mapping) or k not in cur:
            return None
        cur = cur[k]
    return cur


def fmt(value: Any, key: str = "") -> str:
    """Format one value for a table cell (``n/a`` for None; shares as percent)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if key == "slo_scale" and isinstance(value, int | float):
        return f"{value:g}×"
    if isinstance(value, float):
        if key in ("slo_attainment", "kv_util_mean"):
            return f"{100.0 * value:.1f}%"
        if value != 0 and abs(value) < 0.01:
            return f"{value:.2e}"
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def human_bytes(n: Any) -> str:
    """``1536 -> "1.5 KiB"``; ``n/a`` for None."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _slo_scale(summaries: Sequence[Mapping[str, Any]]) -> str | None:
    keys: set[str] = set()
    for s in summaries:
        keys.update((_get(s, "slo_attainment") or {}).keys())
    if not keys:
        return None
    if PREFERRED_SLO_SCALE in keys:
        return PREFERRED_SLO_SCALE
    ordered = sorted(keys, key=float)
    return ordered[len(ordered) // 2]


def comparison_rows(named_summaries: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per stack with the headline figures (keys as in :data:`COLUMNS`).

    The SLO attainment column uses scale ``5`` when present, otherwise the middle
    of the reported scales; the scale is in ``slo_scale``.

    Args:
        named_summaries: ``{stack name: summary dict}``, in display order.

    Returns:
        Rows of plain JSON-able values (None where a figure is missing).
    """
    scale = _slo_scale(list(named_summaries.values()))
    rows: list[dict[str, Any]] = []
    for name, s in named_summaries.items():
        rows.append(
            {
                "stack": name,
                "gpus_peak": _get(s, "gpus", "peak"),
                "gpus_mean": _get(s, "gpus", "mean"),
                "gpu_hours": _get(s, "gpus", "gpu_hours"),
                "gpus_lower_bound": _get(s, "gpus", "lower_bound"),
                "finished": _get(s, "requests", "finished"),
                "rejected": _get(s, "requests", "rejected"),
                "unfinished": _get(s, "requests", "unfinished"),
                "ttft_p50_s": _get(s, "latency_s", "ttft", "p50"),
                "ttft_p99_s": _get(s, "latency_s", "ttft", "p99"),
                "tpot_p50_s": _get(s, "latency_s", "tpot", "p50"),
                "tpot_p99_s": _get(s, "latency_s", "tpot", "p99"),
                "e2e_p99_s": _get(s, "latency_s", "e2e", "p99"),
                "normalized_latency": _get(s, "normalized_latency"),
                "slo_scale": None if scale is None else float(scale),
                "slo_attainment": None if scale is None else _get(s, "slo_attainment", scale),
                "kv_util_mean": _get(s, "kv_utilization", "mean"),
                "migrations": _get(s, "migrations", "count"),
                "sim_wall_s": _get(s, "sim", "wall_s"),
            }
        )
    return rows


def _md_table(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    return "\n".join(lines)


def comparison_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table of comparison rows (columns as in :data:`COLUMNS`)."""
    headers = [h for _, h in COLUMNS]
    body = [[fmt(r.get(k), k) for k, _ in COLUMNS] for r in rows]
    return _md_table(headers, body) + "\n"


COMPACT_COLUMNS: tuple[str, ...] = (
    "stack",
    "gpus_peak",
    "gpus_mean",
    "gpus_lower_bound",
    "rejected",
    "ttft_p99_s",
    "tpot_p99_s",
    "e2e_p99_s",
    "normalized_latency",
    "kv_util_mean",
)
"""The columns that fit an 80-column terminal; the files hold all of them."""


def _short(value: Any, key: str) -> str:
    """Like :func:`fmt`, with 3 significant digits so the terminal table stays narrow."""
    if isinstance(value, float) and key in ("slo_attainment", "kv_util_mean"):
        return f"{100.0 * value:.0f}%"
    if isinstance(value, float) and key != "slo_scale":
        return f"{value:.3g}"
    return fmt(value, key)


def comparison_table(
    rows: Sequence[Mapping[str, Any]], title: str, columns: Sequence[str] = COMPACT_COLUMNS
) -> Table:
    """A :class:`rich.table.Table` of comparison rows for the CLI.

    Headers break onto two lines at their first space, numbers keep 3
    significant digits and there are no vertical rules, so the default
    columns fit an 80-column terminal.

    Args:
        rows: from :func:`comparison_rows`.
        title: table title.
        columns: row keys to show (default: the compact set).
    """
    headers = dict(COLUMNS)
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    for k in columns:
        head = headers[k].replace(" ", "\n", 1)
        table.add_column(head, justify="left" if k == "stack" else "right", no_wrap=True)
    for r in rows:
        table.add_row(*[_short(r.get(k), k) for k in columns])
    return table


def render_report(summary: Mapping[str, Any], files: Sequence[str | Path]) -> str:
    """A short Markdown report of one run.

    Args:
        summary: the run's summary dict (see :func:`fleetserve.metrics.summary.summarize`).
        files: files of the run directory; PNGs are embedded, others linked
            (by file name, relative to the report).

    Returns:
        Markdown text.
    """
    cfg = summary.get("config") or {}
    req = summary.get("requests") or {}
    out: list[str] = ["# fleetserve run report", ""]

    # Keys may sit at the top level or in one section (policy.stack, cluster.gpu, ...).
    flat: dict[str, Any] = {}
    if isinstance(cfg, Mapping):
        for section in ("policy", "cluster", "workload"):
            sub = cfg.get(section)
            if isinstance(sub, Mapping):
                flat.update(sub)
        flat.update(cfg)
    what = []
    for key in ("stack", "backend", "model", "gpu", "gpus", "elastic", "trace", "seed"):
        if key in flat and flat[key] is not None and not isinstance(flat[key], Mapping | list):
            what.append(f"{key} `{flat[key]}`")
    if what:
        out += ["**What ran:** " + ", ".join(what), ""]

    out += ["## Key figures", ""]
    lat = summary.get("latency_s") or {}
    figures: list[tuple[str, str]] = [
        (
            "requests",
            f"{req.get('total', 0)} total: {req.get('finished', 0)} finished, "
            f"{req.get('rejected', 0)} rejected, {req.get('unfinished', 0)} unfinished",
        ),
        (
            "GPUs peak / mean",
            f"{fmt(_get(summary, 'gpus', 'peak'))} / {fmt(_get(summary, 'gpus', 'mean'))}",
        ),
        ("GPU hours", fmt(_get(summary, "gpus", "gpu_hours"))),
    ]
    if _get(summary, "gpus", "lower_bound") is not None:
        figures.append(("GPU lower bound (KV demand)", fmt(_get(summary, "gpus", "lower_bound"))))
    for kind, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end")):
        st = lat.get(kind) or {}
        figures.append(
            (
                f"{label} mean / p50 / p90 / p99 (s)",
                " / ".join(fmt(st.get(p)) for p in ("mean", "p50", "p90", "p99")),
            )
        )
    figures += [
        ("normalized latency", fmt(summary.get("normalized_latency"))),
        (
            "throughput (req/s, output tok/s)",
            f"{fmt(summary.get('throughput_rps'))}, {fmt(summary.get('throughput_tokens_s'))}",
        ),
        ("KV utilization (mean)", fmt(_get(summary, "kv_utilization", "mean"), "kv_util_mean")),
        (
            "migrations",
            f"{fmt(_get(summary, 'migrations', 'count'))} "
            f"({fmt(_get(summary, 'migrations', 'per_s'))}/s, "
            f"{human_bytes(_get(summary, 'migrations', 'bytes'))})",
        ),
    ]
    if "sim" in summary:
        figures.append(
            (
                "simulation",
                f"{fmt(_get(summary, 'sim', 'wall_s'))} s wall, "
                f"{fmt(_get(summary, 'sim', 'events'))} events",
            )
        )
    out += [_md_table(["metric", "value"], figures), ""]

    slo = summary.get("slo_attainment") or {}
    if slo:
        out += ["## SLO attainment", "", "Share of all requests with e2e ≤ scale × ideal time.", ""]
        out += [
            _md_table(
                ["scale", *[f"{k}×" for k in slo]],
                [["share", *[fmt(v, "slo_attainment") for v in slo.values()]]],
            ),
            "",
        ]

    by_mode = _get(summary, "migrations", "by_mode") or {}
    if any(d.get("count") for d in by_mode.values()):
        out += ["## Migrations by mode", ""]
        out += [
            _md_table(
                ["mode", "count", "bytes"],
                [[m, fmt(d.get("count")), human_bytes(d.get("bytes"))] for m, d in by_mode.items()],
            ),
            "",
        ]

    reasons = req.get("rejected_reasons") or {}
    if reasons:
        out += ["## Rejected requests", ""]
        out += [_md_table(["reason", "count"], [[r, str(c)] for r, c in reasons.items()]), ""]

    services = summary.get("services") or {}
    if len(services) > 1:
        out += ["## Per model", ""]
        body = []
        for model, s in services.items():
            r = s.get("requests") or {}
            body.append(
                [
                    model,
                    fmt(r.get("total")),
                    fmt(r.get("finished")),
                    fmt(r.get("rejected")),
                    fmt(_get(s, "latency_s", "e2e", "mean")),
                    fmt(_get(s, "latency_s", "e2e", "p99")),
                    fmt(s.get("normalized_latency")),
                ]
            )
        out += [
            _md_table(
                ["model", "total", "finished", "rejected", "e2e mean s", "e2e p99 s", "norm. lat."],
                body,
            ),
            "",
        ]

    notes = summary.get("notes") or []
    if notes:
        out += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]

    paths = [Path(f) for f in files]
    pngs = [p for p in paths if p.suffix == ".png"]
    others = [p for p in paths if p.suffix != ".png" and p.name != "report.md"]
    if pngs:
        out += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    if others:
        out += ["## Files", ""] + [f"- [{p.name}]({p.name})" for p in others] + [""]
    return "\n".join(out)
