"""The report of ``fleetserve reproduce fleet``: tables, findings and figures.

Everything is read back from the run directories (``OUT/runs/<scenario>/<label>/``:
``summary.json`` and ``timeseries.csv``), so the report can be rebuilt at any time
(``--report-only``) and runs made by separate invocations are merged. A run whose recorded
config differs from the current mode's (e.g. a ``--quick`` run when reporting a full one)
is left out with a note.

Per scenario and stack: GPU-hours (each GPU's active time), peak and mean active GPUs,
P99 TTFT and TPOT, SLO attainment at 5x, and each of them relative to ``vllm``. The
findings compare every composed stack with ``vllm`` and with each stack it composes,
metric by metric (:func:`findings`): a win, a loss, or no difference (within
:data:`REL_TOL`, :data:`SLO_TOL`), each with the numbers of the two runs and, for a loss
or a tie, what the runs' summaries show about it (a component that loses too, group
wakes, re-placements, KunServe drops, GPUs that were never released, a longer run).

Files written into ``OUT``::

    report.md                     the tables, the findings, the figures, notes
    report.json                   runs, findings, mode, notes (the console table too)
    results.csv                   one row per run (scenario, stack)
    fleet_cost_latency.png        GPU-hours vs P99 TTFT, one point per stack
    fleet_active_gpus.png         active GPUs over time, a line per stack
    fleet_slo.png                 SLO attainment at 2x and 5x, bars
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from fleetserve.errors import UnknownNameError
from fleetserve.experiments.fleet import (
    BASELINE,
    GPU,
    GPUS,
    KEEPALIVE_S,
    SCENARIOS,
    SLO_SCALE,
    FleetStack,
    Mode,
    Scenario,
    default_stacks,
    run_config,
    run_dir,
    stack_spec,
)
from fleetserve.experiments.report_common import config_mismatch, md_table, write_csv, write_json
from fleetserve.metrics.plots import save_png

logger = logging.getLogger(__name__)

DASH = "—"
"""Table cell of a missing value."""

REL_TOL = 0.02
"""Two values within 2% of each other are no difference (GPU-hours, latencies)."""
SLO_TOL = 0.005
"""Two SLO attainments within half a point are no difference."""

Key = tuple[str, str]
"""``(scenario, stack label)``."""

CSV_COLUMNS: tuple[str, ...] = (
    "scenario",
    "stack",
    "catalog_stack",
    "requests",
    "finished",
    "rejected",
    "unfinished",
    "gpu_hours",
    "gpus_peak",
    "gpus_mean",
    "ttft_p99_s",
    "tpot_p99_s",
    "e2e_p99_s",
    "ttft_mean_s",
    "slo_attainment",
    "gpu_hours_vs_vllm",
    "ttft_p99_vs_vllm",
    "tpot_p99_vs_vllm",
    "slo_vs_vllm_points",
    "wakes",
    "sleeps",
    "groups",
    "replacements",
    "drops",
    "migrations",
    "sim_wall_s",
)
"""Columns of ``results.csv``; ``slo_attainment`` is at :data:`SLO_SCALE`."""


@dataclass(frozen=True, slots=True)
class Metric:
    """A compared metric: row field, name, whether lower is better, cell format."""

    field: str
    name: str
    lower_better: bool
    fmt: Callable[[float], str]


def _sec(x: float) -> str:
    return f"{x:.3g} s" if x < 10 else f"{x:.1f} s"


METRICS: tuple[Metric, ...] = (
    Metric("gpu_hours", "GPU-hours", True, lambda x: f"{x:.2f}"),
    Metric("gpus_peak", "peak GPUs", True, lambda x: f"{x:.0f}"),
    Metric("ttft_p99_s", "P99 TTFT", True, _sec),
    Metric("tpot_p99_s", "P99 TPOT", True, lambda x: f"{1000 * x:.1f} ms"),
    Metric(
        "slo_attainment", f"SLO attainment at {SLO_SCALE:g}x", False, lambda x: f"{100 * x:.1f}%"
    ),
)
"""What the findings compare, in order."""

WIN, LOSS, TIE = "win", "loss", "tie"


# --------------------------------------------------------------------------- collect


def _num(x: Any) -> float | None:
    if x is None:
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def run_row(sc: str, label: str, s: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one run, from its ``summary.json``."""
    req = s["requests"]
    lat = s["latency_s"]
    gpus = s["gpus"]
    slo = {float(k): float(v) for k, v in (s.get("slo_attainment") or {}).items()}
    elastic = s.get("elastic") or {}
    repl = s.get("replacement") or {}
    run_cfg = (s.get("config") or {}).get("run") or {}
    return {
        "scenario": sc,
        "stack": label,
        "catalog_stack": (run_cfg.get("policy") or {}).get("stack"),
        "requests": req["total"],
        "finished": req["finished"],
        "rejected": req["rejected"],
        "unfinished": req["unfinished"],
        "gpu_hours": _num(gpus.get("gpu_hours")),
        "gpus_peak": _num(gpus.get("peak")),
        "gpus_mean": _num(gpus.get("mean")),
        "ttft_p99_s": _num(lat["ttft"].get("p99")),
        "tpot_p99_s": _num(lat["tpot"].get("p99")),
        "e2e_p99_s": _num(lat["e2e"].get("p99")),
        "ttft_mean_s": _num(lat["ttft"].get("mean")),
        "slo_attainment": slo.get(SLO_SCALE),
        "slo": slo,
        "wakes": elastic.get("wakes"),
        "sleeps": elastic.get("sleeps"),
        "groups": sum(1 for g in s.get("groups") or () if not g.get("start_s")),
        "replacements": repl.get("replacements"),
        "drops": (s.get("kunserve") or {}).get("drops"),
        "migrations": (s.get("migrations") or {}).get("count"),
        "sim_wall_s": _num((s.get("sim") or {}).get("wall_s")),
        "workload": (s.get("workload") or {}).get("source"),
        "notes": list(s.get("notes") or []),
    }


def _add_ratios(rows: dict[Key, dict[str, Any]]) -> None:
    for (sc, _label), r in rows.items():
        base = rows.get((sc, BASELINE))
        b = base or {}
        r["gpu_hours_vs_vllm"] = _ratio(r["gpu_hours"], b.get("gpu_hours"))
        r["ttft_p99_vs_vllm"] = _ratio(r["ttft_p99_s"], b.get("ttft_p99_s"))
        r["tpot_p99_vs_vllm"] = _ratio(r["tpot_p99_s"], b.get("tpot_p99_s"))
        slo, bslo = r["slo_attainment"], b.get("slo_attainment")
        r["slo_vs_vllm_points"] = None if slo is None or bslo is None else 100 * (slo - bslo)


def _same_trace(key: str, want: Any, have: Any) -> tuple[Any, Any]:
    """Runs made with the trace found in another folder (another working directory, or
    ``$FLEETSERVE_DATA``) still match: ``fleet.trace`` is compared by file name."""
    if key == "fleet.trace" and isinstance(want, str) and isinstance(have, str):
        return Path(want).name, Path(have).name
    return want, have


def collect(out: Path, mode: Mode) -> tuple[dict[Key, dict[str, Any]], list[FleetStack], list[str]]:
    """Read every run under ``out/runs`` that matches ``mode``.

    Returns:
        ``(rows by (scenario, label), the stacks found in display order, notes)``;
        notes name runs left out.
    """
    rows: dict[Key, dict[str, Any]] = {}
    notes: list[str] = []
    found: dict[str, FleetStack] = {}
    for sc in SCENARIOS:
        folder = out / "runs" / sc.name
        if not folder.is_dir():
            continue
        for d in sorted(p for p in folder.iterdir() if p.is_dir()):
            rel = d.relative_to(out)
            try:
                st = stack_spec(d.name)
            except UnknownNameError:
                notes.append(f"left out {rel}: not a stack of this experiment")
                continue
            path = d / "summary.json"
            if not path.is_file():
                if (d / "error.txt").is_file():
                    notes.append(f"{rel} failed; its traceback is in {rel}/error.txt")
                continue
            try:
                s = json.loads(path.read_text(encoding="utf-8"))
                run_cfg = (s.get("config") or {}).get("run", {})
                diff = config_mismatch(run_config(sc, st, mode), run_cfg, _same_trace)
                if diff is not None:
                    notes.append(f"left out {rel}: made with other settings ({diff})")
                    continue
                rows[(sc.name, st.label)] = run_row(sc.name, st.label, s)
                found[st.label] = st
            except (OSError, ValueError, KeyError, TypeError) as e:
                notes.append(f"left out {rel}: unreadable summary.json ({e!r})")
    _add_ratios(rows)
    order = [s.label for s in default_stacks()]
    stacks = sorted(
        found.values(),
        key=lambda s: (order.index(s.label) if s.label in order else len(order), s.label),
    )
    return rows, stacks, notes


# --------------------------------------------------------------------------- findings


def compare(metric: Metric, value: float, base: float) -> tuple[str, str]:
    """``(verdict, change)`` of ``value`` against ``base`` for ``metric``."""
    if metric.field == "slo_attainment":
        diff = value - base
        change = f"{100 * diff:+.1f} points"
        if abs(diff) <= SLO_TOL:
            return TIE, change
        return (WIN if diff > 0 else LOSS), change
    if metric.field == "gpus_peak":
        change = f"{value - base:+.0f}"
        if value == base:
            return TIE, change
        return (WIN if value < base else LOSS), change
    rel = (value - base) / base if base else (math.inf if value > base else 0.0)
    change = f"{100 * rel:+.0f}%" if math.isfinite(rel) else "n/a"
    if abs(value - base) <= REL_TOL * max(abs(base), abs(value)):
        return TIE, change
    better = value < base if metric.lower_better else value > base
    return (WIN if better else LOSS), change


def _span_h(r: Mapping[str, Any]) -> float | None:
    gh, mean = r.get("gpu_hours"), r.get("gpus_mean")
    return gh / mean if gh is not None and mean else None


def evidence(
    metric: Metric,
    verdict: str,
    r: Mapping[str, Any],
    b: Mapping[str, Any],
    parts: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """What the runs' summaries show about a loss or a tie of ``r`` against ``b``.

    ``parts`` are the runs of the stacks ``r`` composes (by label): a loss one of them
    shows against ``b`` too is reported as inherited from it.
    """
    if verdict == WIN:
        return []
    out: list[str] = []
    latency = metric.field in ("ttft_p99_s", "tpot_p99_s", "slo_attainment")
    if verdict == LOSS:
        for label, pr in (parts or {}).items():
            pv, bv = pr.get(metric.field), b.get(metric.field)
            if label == b["stack"] or pv is None or bv is None:
                continue
            if compare(metric, float(pv), float(bv))[0] == LOSS:
                out.append(f"`{label}` alone loses too ({metric.fmt(float(pv))})")
        if latency and r.get("wakes"):
            out.append(
                f"{r['wakes']} group wake(s): their requests waited for the group's weights "
                "to reload"
            )
        if latency and r.get("drops"):
            out.append(
                f"{r['drops']} KunServe parameter drop(s): groups merged into a pipeline "
                "when its memory-pressure trigger fired"
            )
        if latency and (r.get("replacements") or 0) > (b.get("replacements") or 0):
            out.append(
                f"{r['replacements']} re-placement(s) vs {b.get('replacements') or 0} "
                f"({r.get('migrations') or 0} requests moved)"
            )
    if verdict == TIE and r.get("drops") == 0 and b.get("drops") is None:
        out.append("KunServe's drop/restore never acted (0 drops: its trigger never fired)")
    if not latency:
        if r.get("sleeps") == 0:
            out.append(
                f"no group was idle for {KEEPALIVE_S:g} s, so the elastic pool never released a GPU"
            )
        elif verdict == LOSS and r.get("sleeps") is not None:
            text = f"{r['sleeps']} group release(s) vs {b.get('sleeps') or 0}"
            if not r.get("replacements") and not b.get("replacements"):
                text += f" from {r.get('groups')} sharing group(s) vs {b.get('groups')}"
            out.append(f"{text}; mean active GPUs {r['gpus_mean']:.1f} vs {b['gpus_mean']:.1f}")
    if metric.field == "gpu_hours" and verdict == LOSS:
        sr, sb = _span_h(r), _span_h(b)
        if sr is not None and sb is not None and sr > sb * (1 + REL_TOL):
            out.append(
                f"the run lasted longer ({3600 * sr:,.0f} s vs {3600 * sb:,.0f} s until the "
                "last request finished)"
            )
    lost = (r.get("rejected") or 0) + (r.get("unfinished") or 0)
    if lost and verdict == LOSS:
        out.append(f"{r.get('rejected') or 0} rejected, {r.get('unfinished') or 0} unfinished")
    return out


def findings(rows: Mapping[Key, Mapping[str, Any]], stacks: Sequence[FleetStack]) -> list[dict]:
    """Every composed stack against ``vllm`` and each stack it composes, metric by metric,
    in every scenario where both ran."""
    out: list[dict[str, Any]] = []
    for sc in SCENARIOS:
        for st in stacks:
            if not st.composed or (sc.name, st.label) not in rows:
                continue
            r = rows[(sc.name, st.label)]
            parts = {c: rows[(sc.name, c)] for c in st.composes if (sc.name, c) in rows}
            for base in dict.fromkeys((BASELINE, *st.composes)):
                b = rows.get((sc.name, base))
                if b is None:
                    continue
                for m in METRICS:
                    v, bv = r.get(m.field), b.get(m.field)
                    if v is None or bv is None:
                        continue
                    verdict, change = compare(m, float(v), float(bv))
                    out.append(
                        {
                            "scenario": sc.name,
                            "stack": st.label,
                            "baseline": base,
                            "metric": m.name,
                            "field": m.field,
                            "value": v,
                            "baseline_value": bv,
                            "change": change,
                            "verdict": verdict,
                            "evidence": evidence(m, verdict, r, b, parts),
                        }
                    )
    return out


def _finding_line(f: Mapping[str, Any]) -> str:
    m = next(x for x in METRICS if x.field == f["field"])
    line = (
        f"**{f['stack']}** vs `{f['baseline']}` ({f['scenario']}): {m.name} "
        f"{m.fmt(f['value'])} vs {m.fmt(f['baseline_value'])} ({f['change']})"
    )
    if f["evidence"]:
        line += " — " + "; ".join(f["evidence"])
    return line


# --------------------------------------------------------------------------- tables


def _fmt(x: Any, spec: str, mul: float = 1.0) -> str:
    return DASH if x is None else format(x * mul, spec)


def _x(r: float | None) -> str:
    return DASH if r is None else f"{r:.2f}x"


def headline(rows: Mapping[Key, Mapping[str, Any]], stacks: Sequence[FleetStack]) -> dict:
    """The console table: one row per (scenario, stack), as strings."""
    body = []
    for sc in SCENARIOS:
        for st in stacks:
            r = rows.get((sc.name, st.label))
            if r is None:
                continue
            body.append(
                [
                    sc.name,
                    st.label,
                    _fmt(r["gpu_hours"], ".2f"),
                    _x(r["gpu_hours_vs_vllm"]),
                    _fmt(r["gpus_peak"], ".0f"),
                    _fmt(r["ttft_p99_s"], ".3g"),
                    _x(r["ttft_p99_vs_vllm"]),
                    _fmt(r["tpot_p99_s"], ".1f", 1000),
                    _x(r["tpot_p99_vs_vllm"]),
                    _fmt(r["slo_attainment"], ".1f", 100),
                    _fmt(r["wakes"], ".0f"),
                ]
            )
    return {
        "title": f"Fleet: {GPUS} x {GPU}, 8 models (fleetserve simulator); x = relative to "
        f"vllm; — = not run / n/a",
        "columns": [
            "scenario",
            "stack",
            "GPU-h",
            "x",
            "peak GPUs",
            "P99 TTFT s",
            "x",
            "P99 TPOT ms",
            "x",
            f"SLO {SLO_SCALE:g}x %",
            "wakes",
        ],
        "rows": body,
    }


def _scenario_table(
    sc: Scenario, rows: Mapping[Key, Mapping[str, Any]], stacks: Sequence[FleetStack]
) -> list[str]:
    header = [
        "stack",
        "GPU-hours",
        "x vllm",
        "peak GPUs",
        "mean GPUs",
        "P99 TTFT s",
        "x vllm",
        "P99 TPOT ms",
        "x vllm",
        f"SLO {SLO_SCALE:g}x %",
        "vs vllm (points)",
        "wakes",
        "re-placements",
        "KunServe drops",
        "rejected / unfinished",
    ]
    body = []
    for st in stacks:
        r = rows.get((sc.name, st.label))
        if r is None:
            continue
        body.append(
            [
                f"`{st.label}`",
                _fmt(r["gpu_hours"], ".2f"),
                _x(r["gpu_hours_vs_vllm"]),
                _fmt(r["gpus_peak"], ".0f"),
                _fmt(r["gpus_mean"], ".1f"),
                _fmt(r["ttft_p99_s"], ".3g"),
                _x(r["ttft_p99_vs_vllm"]),
                _fmt(r["tpot_p99_s"], ".1f", 1000),
                _x(r["tpot_p99_vs_vllm"]),
                _fmt(r["slo_attainment"], ".1f", 100),
                _fmt(r["slo_vs_vllm_points"], "+.1f"),
                _fmt(r["wakes"], ".0f"),
                _fmt(r["replacements"], ".0f"),
                _fmt(r["drops"], ".0f"),
                f"{r['rejected']} / {r['unfinished']}",
            ]
        )
    return md_table(header, body)


def _overrides(st: FleetStack) -> str:
    from fleetserve.experiments.report_common import config_leaves

    leaves = config_leaves(st.overrides)
    return ", ".join(f"`{k}={v}`" for k, v in leaves.items()) or DASH


def render_markdown(
    rows: Mapping[Key, Mapping[str, Any]],
    stacks: Sequence[FleetStack],
    found: Sequence[Mapping[str, Any]],
    mode: Mode,
    notes: Sequence[str],
    header: Mapping[str, Any],
    figures: Sequence[Path],
) -> str:
    """``report.md``."""
    s = mode.sizes()
    wall = header.get("wall_s")
    lines = [
        "# Fleet: the composed stacks vs each paper's own and vLLM (fleetserve simulator)",
        "",
        f"Mode **{mode.name}**: {GPUS} × {GPU}, 8 models (7B-72B), multi-LLM world; "
        f"placement sees the first {s.history_s:g} s, elastic groups release their GPUs "
        f"after {KEEPALIVE_S:g} s idle; seed {mode.seed} (every run). {header['runs']} runs "
        "in this report"
        + (f"; simulated in {wall:.1f} s wall with {header['jobs']} jobs." if wall else "."),
        "",
        "| scenario | workload | reproduces |",
        "|---|---|---|",
    ]
    for sc in SCENARIOS:
        what = (
            f"{sc.title}; {s.duration_s:g} s"
            if sc.name == "bursty"
            else f"{sc.title}; arrivals in [0, {s.end_s:g}) s"
        )
        lines.append(f"| `{sc.name}` | {what} | `{sc.config_file}` |")
    lines += ["", "Stacks:", ""]
    lines += md_table(
        ["label", "catalog stack", "overrides", "composes", "what"],
        [
            [
                f"`{st.label}`",
                f"`{st.stack}`",
                _overrides(st),
                ", ".join(f"`{c}`" for c in st.composes) or DASH,
                st.what,
            ]
            for st in stacks
        ],
    )
    for sc in SCENARIOS:
        lines += [f"## `{sc.name}`: {sc.title}", ""]
        first = next(
            (rows[(sc.name, st.label)] for st in stacks if (sc.name, st.label) in rows), None
        )
        if first is None:
            lines += ["No run.", ""]
            continue
        lines += [f"Workload: {first['workload']}; {first['requests']:,} requests in the run.", ""]
        lines += _scenario_table(sc, rows, stacks)
    lines += [
        "GPU-hours count each GPU's active time until the last request finished; peak GPUs "
        "is the most active at once (Mell's count); P99 over every request of the run; "
        f"SLO attainment: the share of requests whose latency is at most {SLO_SCALE:g}× "
        "their execution time on an idle system.",
        "",
        "## Where the composition wins and where it does not",
        "",
        "Every composed stack against `vllm` and against each stack it composes "
        f"(no difference: within {100 * REL_TOL:g}%, or {100 * SLO_TOL:g} SLO points), "
        "computed from the tables above.",
        "",
    ]
    for title, verdict in (("Wins", WIN), ("Losses", LOSS), ("No difference", TIE)):
        items = [f for f in found if f["verdict"] == verdict]
        lines += [f"### {title} ({len(items)})", ""]
        lines += [f"- {_finding_line(f)}" for f in items] or ["- none"]
        lines.append("")
    lines += ["## Figures", "", *(f"![{p.stem}]({p.name})" for p in figures), ""]
    wl_notes = []
    for sc in SCENARIOS:
        first = next(
            (rows[(sc.name, st.label)] for st in stacks if (sc.name, st.label) in rows), None
        )
        if first is not None:
            wl_notes += [f"{sc.name}: {n}" for n in first["notes"]]
    if wl_notes:
        lines += ["## Workloads", "", *(f"- {n}" for n in wl_notes), ""]
    if notes:
        lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- figures


def _color(stacks: Sequence[FleetStack], label: str) -> str:
    return f"C{[s.label for s in stacks].index(label) % 10}"


def plot_cost_latency(
    rows: Mapping[Key, Mapping[str, Any]], stacks: Sequence[FleetStack], path: Path
) -> Path:
    """GPU-hours vs P99 TTFT, one panel per scenario, one labelled point per stack."""
    fig = Figure(figsize=(5.2 * len(SCENARIOS), 4.6), layout="constrained")
    fig.suptitle("GPU-hours vs P99 TTFT (lower left is better)")
    axes = fig.subplots(1, len(SCENARIOS), squeeze=False)[0]
    for ax, sc in zip(axes, SCENARIOS, strict=True):
        ys = []
        for st in stacks:
            r = rows.get((sc.name, st.label))
            if r is None or r["gpu_hours"] is None or r["ttft_p99_s"] is None:
                continue
            x, y = r["gpu_hours"], r["ttft_p99_s"]
            ys.append(y)
            ax.scatter([x], [y], color=_color(stacks, st.label), s=40, zorder=3)
            ax.annotate(st.label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_title(sc.name)
        ax.set_xlabel("GPU-hours")
        ax.set_ylabel("P99 TTFT (s)")
        ax.grid(True, alpha=0.3)
        if ys and min(ys) > 0 and max(ys) / min(ys) > 20:
            ax.set_yscale("log")
        if not ys:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    return save_png(fig, path)


def read_active_gpus(path: Path) -> tuple[list[float], list[float]] | None:
    """``(t, active GPUs)`` from a run's ``timeseries.csv``; None without one."""
    if not path.is_file():
        return None
    ts: list[float] = []
    gs: list[float] = []
    with path.open(newline="", encoding="utf-8") as fh:
        for rec in csv.DictReader(fh):
            if rec.get("t") in (None, "") or rec.get("active_gpus") in (None, ""):
                continue
            ts.append(float(rec["t"]))
            gs.append(float(rec["active_gpus"]))
    return (ts, gs) if ts else None


def plot_active_gpus(
    out: Path, rows: Mapping[Key, Mapping[str, Any]], stacks: Sequence[FleetStack], path: Path
) -> Path:
    """Active GPUs over time (each run's ``timeseries.csv``), one panel per scenario."""
    fig = Figure(figsize=(6.0 * len(SCENARIOS), 4.4), layout="constrained")
    fig.suptitle("Active GPUs over the run")
    axes = fig.subplots(1, len(SCENARIOS), squeeze=False)[0]
    styles = ("-", "--", "-.", ":")
    for ax, sc in zip(axes, SCENARIOS, strict=True):
        drawn = 0
        for i, st in enumerate(stacks):
            if (sc.name, st.label) not in rows:
                continue
            series = read_active_gpus(run_dir(out, sc, st) / "timeseries.csv")
            if series is None:
                continue
            t, g = series
            ax.step(
                t,
                g,
                where="post",
                label=st.label,
                color=_color(stacks, st.label),
                linestyle=styles[i % len(styles)],
                linewidth=1.2,
            )
            drawn += 1
        ax.set_title(sc.name)
        ax.set_xlabel("time in the run (s)")
        ax.set_ylabel("active GPUs")
        ax.set_ylim(bottom=0, top=GPUS + 1)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=8, loc="lower right")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    return save_png(fig, path)


SLO_BARS: tuple[float, ...] = (2.0, SLO_SCALE)
"""The SLO scales of the bar figure."""


def plot_slo_bars(
    rows: Mapping[Key, Mapping[str, Any]], stacks: Sequence[FleetStack], path: Path
) -> Path:
    """SLO attainment bars: one panel per scale of :data:`SLO_BARS`, a group per scenario,
    a bar per stack (value printed above it)."""
    n = len(stacks)
    width = 0.8 / max(n, 1)
    fig = Figure(figsize=(5.0 * len(SLO_BARS) + 1.6, 4.4), layout="constrained")
    fig.suptitle("SLO attainment (share of requests within k x their idle execution time)")
    axes = fig.subplots(1, len(SLO_BARS), squeeze=False)[0]
    for ax, scale in zip(axes, SLO_BARS, strict=True):
        for i, st in enumerate(stacks):
            xs, ys = [], []
            for j, sc in enumerate(SCENARIOS):
                r = rows.get((sc.name, st.label))
                v = None if r is None else r["slo"].get(scale)
                if v is not None:
                    xs.append(j - 0.4 + width * (i + 0.5))
                    ys.append(100 * v)
            if not xs:
                continue
            bars = ax.bar(
                xs, ys, width=width * 0.95, color=_color(stacks, st.label), label=st.label
            )
            ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
        ax.set_xticks(range(len(SCENARIOS)), [sc.name for sc in SCENARIOS])
        ax.set_ylim(0, 108)
        ax.set_ylabel("%")
        ax.set_title(f"at {scale:g}×")
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right center", fontsize=8)
    return save_png(fig, path)


def write_figures(
    out: Path, rows: Mapping[Key, Mapping[str, Any]], stacks: Sequence[FleetStack]
) -> list[Path]:
    """The three PNGs (see the module docstring)."""
    return [
        plot_cost_latency(rows, stacks, out / "fleet_cost_latency.png"),
        plot_active_gpus(out, rows, stacks, out / "fleet_active_gpus.png"),
        plot_slo_bars(rows, stacks, out / "fleet_slo.png"),
    ]


# --------------------------------------------------------------------------- write


def write_report(
    out: Path,
    mode: Mode,
    *,
    wall_s: float | None,
    jobs: int,
    extra_notes: Sequence[str] = (),
) -> tuple[list[Path], dict[str, Any]]:
    """Collect the runs under ``out`` and write ``report.md``, ``report.json``,
    ``results.csv`` and the figures.

    Args:
        out: the experiment folder (holding ``runs/``).
        mode: the mode the runs must match.
        wall_s: wall time of the simulations (None when only re-rendering).
        jobs: worker processes used.
        extra_notes: notes of the planning step (e.g. a stack left out).

    Returns:
        ``(files written, report.json content)``.
    """
    out.mkdir(parents=True, exist_ok=True)
    rows, stacks, notes = collect(out, mode)
    notes = [*extra_notes, *notes]
    problems = [
        f"{r['scenario']}/{r['stack']}: {r['rejected']} rejected, {r['unfinished']} unfinished"
        for r in rows.values()
        if r["rejected"] or r["unfinished"]
    ]
    notes += problems
    found = findings(rows, stacks)
    figures = write_figures(out, rows, stacks)
    flat = [
        rows[(sc.name, s.label)] for sc in SCENARIOS for s in stacks if (sc.name, s.label) in rows
    ]

    csv_path = write_csv(out / "results.csv", flat, CSV_COLUMNS)

    runs = [
        {
            **{k: r.get(k) for k in CSV_COLUMNS},
            "slo": {f"{k:g}": x for k, x in r["slo"].items()},
            "workload": r["workload"],
        }
        for r in flat
    ]
    s = mode.sizes()
    report: dict[str, Any] = {
        "experiment": "fleet",
        "mode": mode.to_dict(),
        "wall_s": wall_s,
        "jobs": jobs,
        "setup": {
            "gpu": GPU,
            "gpus": GPUS,
            "keepalive_s": KEEPALIVE_S,
            "history_s": s.history_s,
            "slo_scale": SLO_SCALE,
        },
        "scenarios": [
            {"name": sc.name, "title": sc.title, "config_file": sc.config_file} for sc in SCENARIOS
        ],
        "stacks": [
            {
                "label": st.label,
                "stack": st.stack,
                "overrides": dict(st.overrides),
                "composes": list(st.composes),
                "what": st.what,
            }
            for st in stacks
        ],
        "runs": runs,
        "table": headline(rows, stacks),
        "findings": found,
        "notes": notes,
    }
    json_path = write_json(out / "report.json", report)
    md_path = out / "report.md"
    header = {"runs": len(rows), "wall_s": wall_s, "jobs": jobs}
    md_path.write_text(
        render_markdown(rows, stacks, found, mode, notes, header, figures), encoding="utf-8"
    )
    logger.info("wrote the fleet report (%d runs) to %s", len(rows), out)
    return [md_path, json_path, csv_path, *figures], report


__all__ = [
    "CSV_COLUMNS",
    "METRICS",
    "REL_TOL",
    "SLO_TOL",
    "collect",
    "compare",
    "evidence",
    "findings",
    "headline",
    "read_active_gpus",
    "render_markdown",
    "run_row",
    "write_figures",
    "write_report",
]
