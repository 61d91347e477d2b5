"""The figures of the Mell §VIII grid, computed from its run directories.

:func:`collect` reads every ``OUT/runs/<hw>/<workload>/<stack>/summary.json``
that exists and was made with the current mode's settings (a run whose recorded
config differs, e.g. a ``--quick`` run when reporting a full one, is left out
with a note), so runs made by separate invocations merge into one report.
From those rows: Mell's GPU saving vs each baseline (Fig. 11), the effect of
request-operation batching (Fig. 13), the lower-bound range, and the check of
each claim of the paper. A missing stack gives None (and ``n/a`` in claims).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
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
    StackSpec,
    WorkloadSpec,
    run_config,
    run_dir,
)
from fleetserve.experiments.report_common import config_mismatch

Key = tuple[str, str, str]
"""``(hardware, workload, stack)``."""

Rows = Mapping[Key, Mapping[str, Any]]
"""Run figures by key (see :func:`collect`)."""

_CAPPED = re.compile(r"(\d+) of (\d+) requests capped")


# --------------------------------------------------------------------------- collect


def _trace_name(key: str, want: Any, have: Any) -> tuple[Any, Any]:
    if key == "workload.trace":  # runs may live under another checkout
        return Path(str(want)).name, Path(str(have)).name if have else None
    return want, have


def _num(x: Any) -> float | None:
    return None if x is None else float(x)


def _run_row(hw: Hardware, wl: WorkloadSpec, st: StackSpec, s: Mapping[str, Any]) -> dict:
    req = s["requests"]
    gpus = s["gpus"]
    lat = s.get("latency_s") or {}  # optional: a minimal summary (the tests') has none
    peak = gpus.get("peak")
    lb = gpus.get("lower_bound")
    capped = None
    for note in s.get("notes", []):
        m = _CAPPED.search(str(note))
        if m:
            capped = int(m.group(1))
    return {
        "hardware": hw.name,
        "model": hw.model,
        "gpu": hw.gpu,
        "workload": wl.name,
        "stack": st.label,
        "requests": req["total"],
        "finished": req["finished"],
        "rejected": req["rejected"],
        "unfinished": req["unfinished"],
        "capped": capped,
        "gpus_peak": peak,
        "gpus_mean": _num(gpus.get("mean")),
        "gpus_lower_bound": lb,
        "peak_over_lower_bound": (peak / lb) if peak is not None and lb else None,
        "migrations": s["migrations"]["count"],
        "migrations_per_s": _num(s["migrations"].get("per_s")),
        "kv_utilization": _num(s["kv_utilization"].get("mean")),
        "preemptions": req.get("preemptions"),
        "preempted": req.get("preempted"),
        "tpot_p99_s": _num(lat.get("tpot", {}).get("p99")),
        "ttft_p99_s": _num(lat.get("ttft", {}).get("p99")),
        "sim_wall_s": _num((s.get("sim") or {}).get("wall_s")),
    }


def collect(out: Path, mode: Mode) -> tuple[dict[Key, dict[str, Any]], list[str]]:
    """Read every run of the grid that exists under ``out`` and matches ``mode``.

    Returns:
        ``(rows by (hardware, workload, stack), notes)``; notes name runs left
        out (config from another mode) or unreadable.
    """
    rows: dict[Key, dict[str, Any]] = {}
    notes: list[str] = []
    for hw in HARDWARE:
        for wl in WORKLOADS:
            for st in STACKS:
                d = run_dir(out, hw, wl, st)
                path = d / "summary.json"
                rel = d.relative_to(out)
                if not path.is_file():
                    if (d / "error.txt").is_file():
                        notes.append(f"{rel} failed; its traceback is in {rel}/error.txt")
                    continue
                try:
                    s = json.loads(path.read_text(encoding="utf-8"))
                    expected = run_config(hw, wl, st, mode, Path("."))
                    diff = config_mismatch(expected, s.get("config", {}), _trace_name)
                    if diff is not None:
                        notes.append(f"left out {rel}: made with other settings ({diff})")
                        continue
                    rows[(hw.name, wl.name, st.label)] = _run_row(hw, wl, st, s)
                except (OSError, ValueError, KeyError, TypeError) as e:
                    notes.append(f"left out {rel}: unreadable summary.json ({e})")
    return rows, notes


# --------------------------------------------------------------------------- figures


def value(rows: Rows, key: Key, field: str) -> Any:
    """``rows[key][field]``, None when that run is missing."""
    row = rows.get(key)
    return None if row is None else row.get(field)


def savings(rows: Rows) -> list[dict[str, Any]]:
    """Mell's peak-GPU saving vs each baseline, in % of the baseline's peak."""
    out = []
    for hw in HARDWARE:
        for wl in WORKLOADS:
            mell = value(rows, (hw.name, wl.name, MELL), "gpus_peak")
            for base in BASELINES:
                bp = value(rows, (hw.name, wl.name, base), "gpus_peak")
                pct = 100.0 * (bp - mell) / bp if mell is not None and bp else None
                out.append(
                    {
                        "hardware": hw.name,
                        "workload": wl.name,
                        "baseline": base,
                        "baseline_peak": bp,
                        "mell_peak": mell,
                        "saving_pct": pct,
                    }
                )
    return out


def batching(rows: Rows) -> list[dict[str, Any]]:
    """Mell's migrations with operation batching on vs off, and the reduction in %."""
    out = []
    for hw in HARDWARE:
        for wl in WORKLOADS:
            on = value(rows, (hw.name, wl.name, MELL), "migrations")
            off = value(rows, (hw.name, wl.name, MELL_NOBATCH), "migrations")
            pct = 100.0 * (off - on) / off if on is not None and off else None
            out.append(
                {
                    "hardware": hw.name,
                    "workload": wl.name,
                    "migrations_batching": on,
                    "migrations_no_batching": off,
                    "reduction_pct": pct,
                }
            )
    return out


def lower_bound_range(rows: Rows, hw: str, wl: str) -> tuple[int, int] | None:
    """Smallest and largest ``gpus.lower_bound`` among the stacks' runs of (hw, wl)."""
    lbs = [
        r["gpus_lower_bound"]
        for (h, w, _), r in rows.items()
        if h == hw and w == wl and r["gpus_lower_bound"] is not None
    ]
    return (min(lbs), max(lbs)) if lbs else None


# --------------------------------------------------------------------------- claims


def _verdict(checks: Sequence[bool]) -> str:
    if not checks:
        return "n/a"
    k = sum(checks)
    if k == len(checks):
        return "yes"
    return f"partly ({k} of {len(checks)})" if k else "no"


def _pct_range(vals: Sequence[float]) -> str:
    """``"lo% to hi% (n cases)"``; one value alone; ``n/a`` when empty."""
    if not vals:
        return "n/a"
    lo, hi = min(vals), max(vals)
    if len(vals) == 1:
        return f"{lo:.1f}%"
    return f"{lo:.1f}% to {hi:.1f}% ({len(vals)} cases)"


def claims(
    rows: Rows,
    saved: Sequence[Mapping[str, Any]],
    batched: Sequence[Mapping[str, Any]],
) -> list[dict[str, str]]:
    """The paper's claims, each with the measured figure and whether its direction holds.

    ``reproduces`` is ``yes`` (every comparison goes the paper's way),
    ``partly (k of n)``, ``no``, or ``n/a`` (a needed stack was not run).
    """
    out: list[dict[str, str]] = []

    def add(claim: str, paper: str, measured: str, checks: Sequence[bool]) -> None:
        verdict = _verdict(checks)
        out.append(
            {
                "claim": claim,
                "paper": paper,
                "measured": measured if checks else "n/a",
                "reproduces": verdict,
            }
        )

    def saving_vals(bases: Sequence[str]) -> list[float]:
        return [
            s["saving_pct"] for s in saved if s["baseline"] in bases and s["saving_pct"] is not None
        ]

    vals = saving_vals(BASELINES)
    add(
        "Mell needs fewer GPUs than the baselines (BF, WF, LB)",
        "9% to 31% fewer (abstract, §IX)",
        f"Mell's saving {_pct_range(vals)}",
        [v > 0 for v in vals],
    )
    vals = saving_vals(("llumnix",))
    add(
        "Mell needs fewer GPUs than LB (Llumnix)",
        "up to 15% fewer (§VIII-C)",
        f"saving vs LB {_pct_range(vals)}",
        [v > 0 for v in vals],
    )
    vals = saving_vals(("bf", "wf"))
    add(
        "Mell needs fewer GPUs than BF and WF",
        "over 20% fewer (§VIII-C)",
        f"saving vs BF/WF {_pct_range(vals)}",
        [v > 0 for v in vals],
    )

    grows: list[bool] = []
    grow_txt: list[str] = []
    low, high = WORKLOADS[0].name, FIG15_WORKLOAD
    for hw in HARDWARE:
        ends = []
        for wl_name in (low, high):
            v = [
                s["saving_pct"]
                for s in saved
                if s["hardware"] == hw.name
                and s["workload"] == wl_name
                and s["saving_pct"] is not None
            ]
            ends.append(sum(v) / len(v) if v else None)
        if ends[0] is not None and ends[1] is not None:
            grows.append(ends[1] > ends[0])
            grow_txt.append(f"{hw.label}: {ends[0]:.1f}% → {ends[1]:.1f}%")
    add(
        "Mell's advantage grows with the arrival rate",
        "saving grows from λ=0.5 to λ=1.1 (§VIII-C)",
        "mean saving over baselines, " + "; ".join(grow_txt),
        grows,
    )

    ratios: list[float] = []
    less: list[bool] = []
    for hw in HARDWARE:
        for wl in WORKLOADS:
            m = value(rows, (hw.name, wl.name, MELL), "migrations_per_s")
            lb = value(rows, (hw.name, wl.name, "llumnix"), "migrations_per_s")
            if m is None or lb is None:
                continue
            less.append(m < lb)
            if lb > 0:
                ratios.append(m / lb)
    ratio_txt = f"; Mell/LB rate {min(ratios):.2f} to {max(ratios):.2f}" if ratios else ""
    if ratios and min(ratios) == max(ratios):
        ratio_txt = f"; Mell/LB rate {ratios[0]:.2f}"
    add(
        "Mell migrates less often than LB",
        "lower migration frequency in every workload (Fig. 12)",
        f"Mell below LB in {sum(less)} of {len(less)} workloads{ratio_txt}",
        less,
    )

    poisson = {wl.name for wl in WORKLOADS if wl.rate is not None}
    parts = []
    vals = []
    for kind, names in (("Poisson", poisson), ("Azure", {wl.name for wl in WORKLOADS} - poisson)):
        v = [
            b["reduction_pct"]
            for b in batched
            if b["workload"] in names and b["reduction_pct"] is not None
        ]
        if v:
            parts.append(f"{kind}: up to {max(v):.1f}% (lowest {min(v):.1f}%, {len(v)} cases)")
        vals += v
    add(
        "Operation batching cuts Mell's migrations",
        "up to 30% (Poisson) and 25% (Azure) fewer (Fig. 13)",
        "; ".join(parts),
        [v > 0 for v in vals],
    )

    highest: list[bool] = []
    for hw in HARDWARE:
        for wl in WORKLOADS:
            m = value(rows, (hw.name, wl.name, MELL), "kv_utilization")
            others = [value(rows, (hw.name, wl.name, b), "kv_utilization") for b in BASELINES]
            present = [o for o in others if o is not None]
            if m is not None and present:
                highest.append(m >= max(present))
    add(
        "Mell has the highest mean KV utilization",
        "highest in every workload (Fig. 14)",
        f"highest in {sum(highest)} of {len(highest)} workloads",
        highest,
    )

    utils = [
        r["kv_utilization"]
        for (_, _, st), r in rows.items()
        if st == MELL and r["kv_utilization"] is not None
    ]
    add(
        "Mell's mean KV utilization is at least 88%",
        "lowest average 88% (Fig. 14)",
        f"lowest {100 * min(utils):.1f}%, highest {100 * max(utils):.1f}%" if utils else "n/a",
        [u >= 0.88 for u in utils],
    )
    return out
