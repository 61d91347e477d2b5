"""The report of the Mell §VIII grid: tables, figures and the paper-vs-measured check.

Everything is read back from the run directories (``OUT/runs/<hw>/<wl>/<stack>/``:
``summary.json`` and ``timeseries.csv``; see :mod:`.mell_figures`), so the report
can be rebuilt at any time (``--report-only``) and runs made by separate
invocations are merged. Missing stacks show as ``—`` in tables and ``n/a`` in
the claims.

Files written into ``OUT``::

    table.md                 all figures as Markdown tables + the claims check
    results.csv              one row per run (hardware, workload, stack)
    results.json             runs, savings, batching, claims, sizes, notes
    fig11_gpus.png           peak GPUs per stack (lower bound dashed)
    fig12_migrations.png     migrations per second per stack
    fig13_batching.png       Mell's migrations with operation batching on / off
    fig14_kv_util.png        mean KV utilization per stack
    fig15_gpus_over_time.png active GPUs over time, Poisson λ=1.1
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetserve.experiments.mell import (
    BASELINES,
    FIG15_WORKLOAD,
    HARDWARE,
    MELL,
    MELL_NOBATCH,
    STACKS,
    WORKLOADS,
    Hardware,
    Mode,
    run_dir,
)
from fleetserve.experiments.mell_figures import (
    Rows,
    batching,
    claims,
    collect,
    lower_bound_range,
    savings,
    value,
)
from fleetserve.experiments.report_common import md_table

logger = logging.getLogger(__name__)

DASH = "—"
"""Table cell of a missing value (stack not run, or no figure)."""

CSV_COLUMNS: tuple[str, ...] = (
    "hardware",
    "model",
    "gpu",
    "workload",
    "stack",
    "requests",
    "finished",
    "rejected",
    "unfinished",
    "capped",
    "gpus_peak",
    "gpus_mean",
    "gpus_lower_bound",
    "peak_over_lower_bound",
    "migrations",
    "migrations_per_s",
    "kv_utilization",
    "preemptions",
    "preempted",
    "tpot_p99_s",
    "ttft_p99_s",
    "mell_saving_pct",
    "batching_reduction_pct",
    "sim_wall_s",
)
"""Columns of ``results.csv``. ``mell_saving_pct``: Mell's GPU saving relative to
this stack's peak (baseline rows); ``batching_reduction_pct``: on the ``mell`` row."""


# --------------------------------------------------------------------------- rendering


def _fmt(v: Any, spec: str) -> str:
    return DASH if v is None else format(v, spec)


def _per_workload(
    rows: Rows,
    hw: Hardware,
    cell: Callable[[Mapping[str, Any] | None], str],
) -> list[list[str]]:
    return [
        [wl.label, *(cell(rows.get((hw.name, wl.name, st.label))) for st in STACKS)]
        for wl in WORKLOADS
    ]


def _pct(r: Mapping[str, Any] | None, field: str) -> str:
    return DASH if r is None or r[field] is None else f"{100 * r[field]:.1f}%"


def _quality_cell(r: Mapping[str, Any] | None) -> str:
    """P99 TPOT and requests preempted at least once."""
    if r is None or r.get("tpot_p99_s") is None:
        return DASH
    return f"{1e3 * r['tpot_p99_s']:.0f} ms, {_fmt(r.get('preempted'), ',')} preempted"


def _peak_cell(r: Mapping[str, Any] | None) -> str:
    if r is None or r["gpus_peak"] is None:
        return DASH
    ratio = r["peak_over_lower_bound"]
    return f"{r['gpus_peak']} ({ratio:.2f}×)" if ratio is not None else str(r["gpus_peak"])


def _sizes_lines(rows: Rows, mode: Mode) -> list[str]:
    header = ["workload", "arrivals", "window", *(f"requests, {hw.label}" for hw in HARDWARE)]
    body = []
    for wl in WORKLOADS:
        arrivals = (
            f"Poisson {wl.rate:g} req/s, ShareGPT lengths"
            if wl.rate is not None
            else "trace timestamps (≈5.5 req/s)"
        )
        cells = []
        for hw in HARDWARE:
            r = next((rows[k] for k in rows if k[0] == hw.name and k[1] == wl.name), None)
            if r is None:
                cells.append(DASH)
            elif r["capped"] is not None:
                cells.append(f"{r['requests']:,} ({r['capped']:,} capped)")
            else:
                cells.append(f"{r['requests']:,}")
        body.append([wl.label, arrivals, f"first {mode.window_s:g} s", *cells])
    return md_table(header, body)


def render_markdown(
    rows: Rows,
    saved: Sequence[Mapping[str, Any]],
    batched: Sequence[Mapping[str, Any]],
    claimed: Sequence[Mapping[str, str]],
    mode: Mode,
    notes: Sequence[str],
    header: Mapping[str, Any],
    figures: Sequence[Path],
) -> str:
    """``table.md``: sizes, one section per hardware (Figs. 11-14) and the claims check."""
    stack_names = [st.label for st in STACKS]
    wall = header.get("wall_s")
    lines = [
        "# Mell §VIII reproduction (fleetserve simulator)",
        "",
        f"Mode **{mode.name}**: arrivals in the first {mode.window_s:g} s of each workload "
        f"(then the runs drain), lengths ×10 capped to one instance's KV capacity, elastic "
        f"pool, seed {mode.seed} (+ workload index). "
        f"{header['runs']} runs in this report"
        + (f"; simulated in {wall:.1f} s wall with {header['jobs']} jobs." if wall else "."),
        "",
        "Stacks: " + ", ".join(f"`{s.label}` ({s.paper})" for s in STACKS) + f". {DASH} = not run.",
        "",
        *_sizes_lines(rows, mode),
    ]
    for hw in HARDWARE:
        lines += [f"## {hw.label}", "", "### Peak GPUs (Fig. 11)", ""]
        lines.append(
            "Peak active GPUs; in brackets the ratio to the run's `gpus.lower_bound`. "
            "Lower bound column: smallest and largest bound among the runs."
        )
        lines.append("")
        body = _per_workload(rows, hw, _peak_cell)
        for row, wl in zip(body, WORKLOADS, strict=True):
            lb = lower_bound_range(rows, hw.name, wl.name)
            row.append(
                DASH if lb is None else (f"{lb[0]}" if lb[0] == lb[1] else f"{lb[0]}–{lb[1]}")
            )
        lines += md_table(["workload", *stack_names, "lower bound"], body)

        lines += [
            "### Mell's GPU saving vs each baseline (Fig. 11)",
            "",
            "(baseline peak − mell peak) / baseline peak; positive: Mell needs fewer GPUs.",
            "",
        ]
        body = []
        for wl in WORKLOADS:
            cells = [
                _fmt(s["saving_pct"], "+.1f") + ("%" if s["saving_pct"] is not None else "")
                for s in saved
                if s["hardware"] == hw.name and s["workload"] == wl.name
            ]
            body.append([wl.label, *cells])
        lines += md_table(["workload", *(f"vs {b}" for b in BASELINES)], body)

        lines += ["### Migrations per second (Fig. 12)", ""]
        lines += md_table(
            ["workload", *stack_names],
            _per_workload(
                rows, hw, lambda r: DASH if r is None else _fmt(r["migrations_per_s"], ".4f")
            ),
        )

        lines += [
            "### Operation batching: Mell's migrations (Fig. 13)",
            "",
            "Migrations of `mell` (on) and `mell-nobatch` (off); reduction = (off − on) / off.",
            "",
        ]
        body = [
            [
                wl.label,
                _fmt(b["migrations_batching"], ","),
                _fmt(b["migrations_no_batching"], ","),
                _fmt(b["reduction_pct"], ".1f") + ("%" if b["reduction_pct"] is not None else ""),
            ]
            for wl in WORKLOADS
            for b in batched
            if b["hardware"] == hw.name and b["workload"] == wl.name
        ]
        lines += md_table(["workload", "batching on", "batching off", "reduction"], body)

        lines += ["### Mean KV utilization (Fig. 14)", ""]
        lines += md_table(
            ["workload", *stack_names],
            _per_workload(rows, hw, lambda r: _pct(r, "kv_utilization")),
        )

        lines += [
            "### Service quality behind the GPU counts",
            "",
            "P99 TPOT (ms) and requests preempted (recomputed) at least once: a stack that "
            "admits until memory runs out and then preempts pays in latency, not in GPUs.",
            "",
        ]
        lines += md_table(["workload", *stack_names], _per_workload(rows, hw, _quality_cell))

    lines += ["## What the paper reports vs what we measured", ""]
    lines += md_table(
        ["claim", "paper", "measured", "reproduces?"],
        [[c["claim"], c["paper"], c["measured"], c["reproduces"]] for c in claimed],
    )
    lines.append(
        'Savings are in % of the baseline\'s peak GPUs; "reproduces" checks the direction '
        "of each comparison (yes: all, partly: some, no: none, n/a: a stack was not run)."
    )
    lines += ["", "## Figures", "", *(f"![{p.stem}]({p.name})" for p in figures), ""]
    problems = [
        f"{r['hardware']}/{r['workload']}/{r['stack']}: {r['rejected']} rejected, "
        f"{r['unfinished']} unfinished"
        for r in rows.values()
        if r["rejected"] or r["unfinished"]
    ]
    if notes or problems:
        lines += ["## Notes", "", *(f"- {n}" for n in [*notes, *problems]), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots


def _read_gpu_series(path: Path) -> tuple[list[float], list[float]]:
    t: list[float] = []
    y: list[float] = []
    with path.open(newline="", encoding="utf-8") as fh:
        for rec in csv.DictReader(fh):
            t.append(float(rec["t"]))
            y.append(float(rec["active_gpus"]))
    return t, y


def write_figures(
    out: Path,
    rows: Rows,
    batched: Sequence[Mapping[str, Any]],
) -> list[Path]:
    """The five PNGs (Figs. 11-15) into ``out``."""
    from fleetserve.metrics.plots import plot_grouped_bars, plot_line_panels

    order = [st.label for st in STACKS]
    wl_label = {wl.name: wl.label for wl in WORKLOADS}

    def panels(field: str) -> dict[str, dict[str, dict[str, float | None]]]:
        return {
            hw.label: {
                wl.label: {st: value(rows, (hw.name, wl.name, st), field) for st in order}
                for wl in WORKLOADS
            }
            for hw in HARDWARE
        }

    lbs: dict[str, dict[str, float | None]] = {}
    for hw in HARDWARE:
        lbs[hw.label] = {}
        for wl in WORKLOADS:
            lb = lower_bound_range(rows, hw.name, wl.name)
            lbs[hw.label][wl.label] = None if lb is None else float(lb[0])
    files = [
        plot_grouped_bars(
            panels("gpus_peak"),
            out / "fig11_gpus.png",
            title="Peak active GPUs (Mell Fig. 11); dashed: lower bound",
            ylabel="GPUs",
            series=order,
            value_fmt=".0f",
            markers=lbs,
        ),
        plot_grouped_bars(
            panels("migrations_per_s"),
            out / "fig12_migrations.png",
            title="Migrations per second (Mell Fig. 12)",
            ylabel="migrations / s",
            series=order,
            value_fmt=".3g",
        ),
    ]
    bat: dict[str, dict[str, dict[str, float | None]]] = {}
    for hw in HARDWARE:
        bat[hw.label] = {}
        for b in batched:
            if b["hardware"] != hw.name:
                continue
            red = b["reduction_pct"]
            label = wl_label[b["workload"]] + ("" if red is None else f"\n{-red:+.0f}% migrations")
            bat[hw.label][label] = {
                MELL: b["migrations_batching"],
                MELL_NOBATCH: b["migrations_no_batching"],
            }
    files.append(
        plot_grouped_bars(
            bat,
            out / "fig13_batching.png",
            title="Mell's migrations with request-operation batching on / off (Mell Fig. 13)",
            ylabel="migrations",
            series=order,
            value_fmt=",.0f",
        )
    )
    files.append(
        plot_grouped_bars(
            panels("kv_utilization"),
            out / "fig14_kv_util.png",
            title="Mean KV utilization of active GPUs (Mell Fig. 14)",
            ylabel="%",
            series=order,
            value_fmt=".0f",
            scale=100.0,
        )
    )
    fig15_wl = next(wl for wl in WORKLOADS if wl.name == FIG15_WORKLOAD)
    lines: dict[str, dict[str, tuple[Sequence[float], Sequence[float]]]] = {}
    for hw in HARDWARE:
        lines[hw.label] = {}
        for st in STACKS:
            if (hw.name, fig15_wl.name, st.label) not in rows:
                continue
            ts = run_dir(out, hw, fig15_wl, st) / "timeseries.csv"
            if ts.is_file():
                lines[hw.label][st.label] = _read_gpu_series(ts)
    files.append(
        plot_line_panels(
            lines,
            out / "fig15_gpus_over_time.png",
            title=f"Active GPUs over time, {fig15_wl.label} (Mell Fig. 15)",
            ylabel="active GPUs",
            series=order,
        )
    )
    return files


# --------------------------------------------------------------------------- write


def _csv_rows(
    rows: Rows,
    saved: Sequence[Mapping[str, Any]],
    batched: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    save_of = {(s["hardware"], s["workload"], s["baseline"]): s["saving_pct"] for s in saved}
    red_of = {(b["hardware"], b["workload"]): b["reduction_pct"] for b in batched}
    out = []
    for hw in HARDWARE:
        for wl in WORKLOADS:
            for st in STACKS:
                r = rows.get((hw.name, wl.name, st.label))
                if r is None:
                    continue
                row = {k: r.get(k) for k in CSV_COLUMNS}
                row["mell_saving_pct"] = save_of.get((hw.name, wl.name, st.label))
                row["batching_reduction_pct"] = (
                    red_of.get((hw.name, wl.name)) if st.label == MELL else None
                )
                out.append(row)
    return out


def write_report(
    out: Path, mode: Mode, *, wall_s: float | None, jobs: int
) -> tuple[list[Path], dict[str, Any]]:
    """Collect the runs under ``out`` and write ``table.md``, ``results.*`` and the figures.

    Args:
        out: the experiment folder (holding ``runs/``).
        mode: the mode the runs must match.
        wall_s: wall time of the simulations (None when only re-rendering).
        jobs: worker processes used.

    Returns:
        ``(files written, results.json content)``.
    """
    out.mkdir(parents=True, exist_ok=True)
    rows, notes = collect(out, mode)
    saved = savings(rows)
    batched = batching(rows)
    claimed = claims(rows, saved, batched)
    figures = write_figures(out, rows, batched)
    flat = _csv_rows(rows, saved, batched)

    csv_path = out / "results.csv"
    with csv_path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(CSV_COLUMNS))
        w.writeheader()
        for row in flat:
            w.writerow({k: "" if v is None else v for k, v in row.items()})

    header = {"runs": len(rows), "wall_s": wall_s, "jobs": jobs}
    report: dict[str, Any] = {
        "experiment": "mell",
        "mode": mode.to_dict(),
        "wall_s": wall_s,
        "jobs": jobs,
        "hardware": [
            {"name": h.name, "model": h.model, "gpu": h.gpu, "label": h.label} for h in HARDWARE
        ],
        "workloads": [
            {
                "name": w.name,
                "label": w.label,
                "trace": w.trace,
                "format": w.format,
                "rate": w.rate,
                "window_s": mode.window_s,
            }
            for w in WORKLOADS
        ],
        "stacks": [{"label": s.label, "stack": s.stack, "paper": s.paper} for s in STACKS],
        "runs": flat,
        "savings": saved,
        "batching": batched,
        "claims": claimed,
        "notes": notes,
    }
    json_path = out / "results.json"
    json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")

    md_path = out / "table.md"
    md_path.write_text(
        render_markdown(rows, saved, batched, claimed, mode, notes, header, figures),
        encoding="utf-8",
    )
    logger.info("wrote the Mell report (%d runs) to %s", len(rows), out)
    return [md_path, csv_path, json_path, *figures], report
