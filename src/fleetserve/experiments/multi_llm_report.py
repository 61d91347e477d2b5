"""The report of the SeaLLM and MuxServe grids: tables, figures and the paper-vs-measured check.

Everything is read back from the run directories (``OUT/runs/<point>/<stack>/``:
``summary.json`` and ``requests.csv``), so the report can be rebuilt at any
time (``--report-only``) and runs made by separate invocations are merged. A
run whose recorded config differs from the current mode's (e.g. a ``--quick``
run when reporting a full one) is left out with a note. Missing runs show as
``—`` in tables and make a claim ``n/a`` when nothing is left to compare.

Aggregated throughput (MuxServe §5.2: "the sum of requests processed per second
for all LLMs") is computed per service and summed: service ``m`` finished
``n_m`` requests by ``t_m = max(T, its last finish)`` (``T`` the run's arrival
window), so its throughput is ``n_m / t_m`` (its arrival rate when it keeps up,
its capacity when it falls behind). One straggling service thus costs its own
throughput only, not everyone's (the summary's ``throughput_rps`` divides all
requests by the whole run's span, last straggler included; it is reported too).

Files written into ``OUT``::

    table.md            every table + the claims check
    results.csv         one row per run (point, stack)
    results.json        runs, claims, mode, notes
    seallm:   fig6_latency_slo.png (main stacks), fig8_ablation.png,
              fig7_ttft_tpot.png, fig10_slo_scale.png
    muxserve: fig5_throughput_slo.png (main stacks), fig9_scheduling.png,
              slo_scale.png
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from fleetserve.experiments.multi_llm import (
    ABLATION,
    MAIN,
    SLO_SCALE,
    SLO_SCALES,
    VARIANT,
    Experiment,
    Mode,
    run_config,
    run_dir,
)
from fleetserve.experiments.report_common import config_mismatch, md_table, write_csv, write_json
from fleetserve.metrics.plots import save_png

logger = logging.getLogger(__name__)

DASH = "—"
"""Table cell of a missing value."""

Key = tuple[float, str]
"""``(point value, stack label)``."""

Rows = Mapping[Key, Mapping[str, Any]]

CSV_COLUMNS: tuple[str, ...] = (
    "experiment",
    "point",
    "value",
    "stack",
    "requests",
    "finished",
    "rejected",
    "unfinished",
    "normalized_latency",
    "e2e_mean_s",
    "e2e_p99_s",
    "ttft_mean_s",
    "tpot_mean_s",
    "slo_attainment",
    *(f"slo_{s:g}" for s in SLO_SCALES),
    "throughput_rps",
    "throughput_tokens_s",
    "agg_throughput_rps",
    "agg_throughput_tokens_s",
    "searches",
    "search_total_s",
    "search_max_s",
    "replacements",
    "switches",
    "sim_wall_s",
)
"""Columns of ``results.csv``; ``slo_attainment`` is at :data:`SLO_SCALE`."""

YES, PARTLY, NO, NA = "yes", "partly", "no", "n/a"

REL_TOL = 0.01
"""An ablation is worse only with a normalized latency more than 1% above SeaLLM's;
one scheduler beats another only with a throughput more than 1% higher."""
SLO_TOL = 0.005
"""... and an SLO attainment not more than half a point above SeaLLM's."""


# --------------------------------------------------------------------------- collect


def _num(x: Any) -> float | None:
    if x is None:
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def aggregated_throughput(requests_csv: Path, window_s: float) -> tuple[float, float] | None:
    """``(req/s, output tokens/s)`` summed over services (see the module docstring).

    None when the file is missing or has no row.
    """
    if not requests_csv.is_file():
        return None
    done: dict[str, int] = defaultdict(int)
    tokens: dict[str, int] = defaultdict(int)
    until: dict[str, float] = {}
    with requests_csv.open(newline="", encoding="utf-8") as fh:
        for rec in csv.DictReader(fh):
            m = rec["model"]
            until.setdefault(m, window_s)
            if rec["status"] == "finished" and rec["finish_s"]:
                done[m] += 1
                tokens[m] += int(float(rec["generated"] or 0))
                until[m] = max(until[m], float(rec["finish_s"]))
    if not until:
        return None
    return (
        sum(done[m] / until[m] for m in until if until[m] > 0),
        sum(tokens[m] / until[m] for m in until if until[m] > 0),
    )


def run_row(exp: Experiment, value: float, stack: str, s: Mapping[str, Any], d: Path) -> dict:
    """The figures of one run from its ``summary.json`` (and ``requests.csv``)."""
    req = s["requests"]
    lat = s["latency_s"]
    slo = {float(k): float(v) for k, v in (s.get("slo_attainment") or {}).items()}
    searches = [float(x) for x in s.get("placement_search_s") or []]
    repl = s.get("replacement") or {}
    window = float(s["config"]["run"]["multi"]["duration_s"])
    agg = aggregated_throughput(d / "requests.csv", window)
    row: dict[str, Any] = {
        "experiment": exp.name,
        "point": exp.point_name(value),
        "value": value,
        "stack": stack,
        "requests": req["total"],
        "finished": req["finished"],
        "rejected": req["rejected"],
        "unfinished": req["unfinished"],
        "normalized_latency": _num(s.get("normalized_latency")),
        "e2e_mean_s": _num(lat["e2e"].get("mean")),
        "e2e_p99_s": _num(lat["e2e"].get("p99")),
        "ttft_mean_s": _num(lat["ttft"].get("mean")),
        "tpot_mean_s": _num(lat["tpot"].get("mean")),
        "slo_attainment": slo.get(SLO_SCALE),
        "slo": slo,
        "throughput_rps": _num(s.get("throughput_rps")),
        "throughput_tokens_s": _num(s.get("throughput_tokens_s")),
        "agg_throughput_rps": None if agg is None else agg[0],
        "agg_throughput_tokens_s": None if agg is None else agg[1],
        "searches": len(searches),
        "search_total_s": sum(searches),
        "search_max_s": max(searches, default=None),
        "replacements": repl.get("replacements"),
        "switches": repl.get("switches"),
        "sim_wall_s": _num((s.get("sim") or {}).get("wall_s")),
    }
    for sc in SLO_SCALES:
        row[f"slo_{sc:g}"] = slo.get(sc)
    return row


def collect(out: Path, exp: Experiment, mode: Mode) -> tuple[dict[Key, dict[str, Any]], list[str]]:
    """Read every run of the grid that exists under ``out`` and matches ``mode``.

    Returns:
        ``(rows by (point, stack), notes)``; notes name runs left out.
    """
    rows: dict[Key, dict[str, Any]] = {}
    notes: list[str] = []
    for v in mode.points(exp):
        for st in exp.stacks:
            d = run_dir(out, exp, v, st)
            path = d / "summary.json"
            rel = d.relative_to(out)
            if not path.is_file():
                if (d / "error.txt").is_file():
                    notes.append(f"{rel} failed; its traceback is in {rel}/error.txt")
                continue
            try:
                s = json.loads(path.read_text(encoding="utf-8"))
                run_cfg = (s.get("config") or {}).get("run", {})
                diff = config_mismatch(run_config(exp, v, st, mode), run_cfg)
                if diff is not None:
                    notes.append(f"left out {rel}: made with other settings ({diff})")
                    continue
                rows[(v, st.label)] = run_row(exp, v, st.label, s, d)
            except (OSError, ValueError, KeyError, TypeError) as e:
                notes.append(f"left out {rel}: unreadable summary.json ({e!r})")
    return rows, notes


# --------------------------------------------------------------------------- claims


def verdict(flags: Sequence[bool]) -> str:
    """``yes`` (every comparison holds), ``partly`` (some), ``no`` (none), ``n/a`` (none made)."""
    if not flags:
        return NA
    if all(flags):
        return YES
    return PARTLY if any(flags) else NO


def _get(rows: Rows, v: float, stack: str, field: str) -> float | None:
    r = rows.get((v, stack))
    return None if r is None else r.get(field)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _present(d: Mapping[str, float | None]) -> dict[str, float]:
    return {k: v for k, v in d.items() if v is not None}


def _x(r: float | None) -> str:
    return DASH if r is None else f"{r:.2f}×"


def _claim(claim: str, paper: str, measured: str, flags: Sequence[bool]) -> dict[str, str]:
    return {"claim": claim, "paper": paper, "measured": measured, "reproduces": verdict(flags)}


def _best_of(
    exp: Experiment,
    rows: Rows,
    points: Sequence[float],
    subject: str,
    others: Sequence[str],
    field: str,
    lower: bool,
    ties: bool = False,
) -> tuple[list[bool], list[str], dict[str, float]]:
    """Per point: is ``subject`` strictly best on ``field`` among ``others`` present
    (or at least as good, with ``ties``: for bounded metrics such as SLO attainment)?

    Returns ``(flags, per-point texts, best ratio vs each other stack)``; the ratio
    is ``other / subject`` for lower-is-better fields and ``subject / other`` else.
    """
    flags: list[bool] = []
    texts: list[str] = []
    best: dict[str, float] = {}
    for v in points:
        me = _get(rows, v, subject, field)
        vals = _present({o: _get(rows, v, o, field) for o in others})
        if me is None or not vals:
            continue
        if ties:
            ok = (
                all(me <= x for x in vals.values())
                if lower
                else all(me >= x for x in vals.values())
            )
        else:
            ok = all(me < x for x in vals.values()) if lower else all(me > x for x in vals.values())
        flags.append(ok)
        rival = min(vals, key=lambda o: vals[o]) if lower else max(vals, key=lambda o: vals[o])
        r = _ratio(vals[rival], me) if lower else _ratio(me, vals[rival])
        texts.append(f"{exp.point_label(v)}: {_x(r)} vs {rival}")
        for o, x in vals.items():
            rr = _ratio(x, me) if lower else _ratio(me, x)
            if rr is not None:
                best[o] = max(best.get(o, -math.inf), rr)
    return flags, texts, best


def _best_text(flags: Sequence[bool], texts: Sequence[str], best: Mapping[str, float]) -> str:
    if not flags:
        return "not measured (a stack was not run)"
    up = ", ".join(f"{_x(r)} vs {o}" for o, r in best.items())
    return (
        f"best at {sum(flags)}/{len(flags)} points (advantage over the strongest rival: "
        + "; ".join(texts)
        + f"); up to {up}"
    )


def seallm_claims(exp: Experiment, rows: Rows, points: Sequence[float]) -> list[dict[str, str]]:
    """The SeaLLM §6 claims, each checked on ``rows``."""
    base = [s for s in exp.labels(MAIN) if s != "seallm"]
    out = []
    for field, lower, claim, paper in (
        (
            "normalized_latency",
            True,
            "SeaLLM has the lowest normalized latency (Fig. 6a)",
            "up to 10.38× / 9.52× / 13.60× lower than vLLM / AlpaServe / MuxServe, 2-50 req/s",
        ),
        (
            "e2e_p99_s",
            True,
            "SeaLLM has the lowest P99 latency (Fig. 6b)",
            "up to 12.13× / 5.80× / 18.69× lower than vLLM / AlpaServe / MuxServe",
        ),
        (
            "slo_attainment",
            False,
            f"SeaLLM has the highest SLO attainment at {SLO_SCALE:g}× (Fig. 6c)",
            "up to 1.82× / 3.64× / 2.11× higher than vLLM / AlpaServe / MuxServe",
        ),
        (
            "ttft_mean_s",
            True,
            "SeaLLM has the lowest mean TTFT (Fig. 7a)",
            "first token up to 51.98× faster than the baselines",
        ),
    ):
        flags, texts, best = _best_of(
            exp, rows, points, "seallm", base, field, lower, ties=field == "slo_attainment"
        )
        out.append(_claim(claim, paper, _best_text(flags, texts, best), flags))
    for st in exp.stacks:
        if st.role != VARIANT:
            continue
        for field, lower, what in (
            ("normalized_latency", True, "the lowest normalized latency"),
            ("slo_attainment", False, f"the highest SLO attainment at {SLO_SCALE:g}×"),
        ):
            flags, texts, best = _best_of(
                exp, rows, points, st.label, base, field, lower, ties=not lower
            )
            out.append(
                _claim(
                    f"{st.paper} ({st.label}, not in the paper) has {what}",
                    "Fig. 6's claim, checked on the variant",
                    _best_text(flags, texts, best),
                    flags,
                )
            )

    flags = []
    texts = []
    for v in points:
        nl = _get(rows, v, "seallm", "normalized_latency")
        slo = _get(rows, v, "seallm", "slo_attainment")
        if nl is None or slo is None:
            continue
        flags.append(nl < 3.0 and slo > 0.9)
        texts.append(f"{exp.point_label(v)}: {nl:.2f} / {100 * slo:.0f}%")
    out.append(
        _claim(
            "SeaLLM's normalized latency stays < 3 and its SLO attainment > 90%",
            "at every rate (§6.2)",
            (f"holds at {sum(flags)}/{len(flags)} rates (NL / SLO: " + "; ".join(texts) + ")")
            if flags
            else "not measured",
            flags,
        )
    )

    flags = []
    texts = []
    for v in points:
        me = _get(rows, v, "seallm", "tpot_mean_s")
        al = _get(rows, v, "alpaserve", "tpot_mean_s")
        if me is None or al is None:
            continue
        flags.append(me < al)
        texts.append(f"{exp.point_label(v)}: {1000 * me:.0f} vs {1000 * al:.0f} ms")
    out.append(
        _claim(
            "SeaLLM's mean TPOT is below AlpaServe's (Fig. 7b)",
            "always faster than temporal sharing",
            (f"lower at {sum(flags)}/{len(flags)} rates (" + "; ".join(texts) + ")")
            if flags
            else "not measured",
            flags,
        )
    )

    flags = []
    texts = []
    main = exp.labels(MAIN)
    for v in points:
        vals = _present({s: _get(rows, v, s, "ttft_mean_s") for s in main})
        if "muxserve" not in vals or len(vals) < 2:
            continue
        worst = max(vals, key=lambda s: vals[s])
        flags.append(worst == "muxserve")
        texts.append(f"{exp.point_label(v)}: worst {worst} ({vals[worst]:.2f} s)")
    out.append(
        _claim(
            "MuxServe's mean TTFT is the worst (Fig. 7a)",
            "RR prefill scheduling and a fixed SM share prolong the prefill",
            (f"worst at {sum(flags)}/{len(flags)} rates (" + "; ".join(texts) + ")")
            if flags
            else "not measured",
            flags,
        )
    )

    if exp.focus is not None:
        focus = _focus(exp, rows, points)
        flags = []
        texts = []
        if focus is not None:
            for sc in SLO_SCALES:
                me = (rows.get((focus, "seallm")) or {}).get("slo", {}).get(sc)
                vals = _present(
                    {
                        s: (rows.get((focus, s)) or {}).get("slo", {}).get(sc)
                        for s in base
                        if (focus, s) in rows
                    }
                )
                if me is None or not vals:
                    continue
                flags.append(all(me >= x for x in vals.values()))
                rival = max(vals, key=lambda s: vals[s])
                texts.append(f"{sc:g}×: {100 * me:.0f}% vs {100 * vals[rival]:.0f}% ({rival})")
        out.append(
            _claim(
                "SeaLLM has the highest SLO attainment at every SLO scale (Fig. 10)",
                "always better than the baselines",
                (
                    f"at {DASH if focus is None else exp.point_label(focus)}, at least as high "
                    f"at {sum(flags)}/{len(flags)} scales (" + "; ".join(texts) + ")"
                )
                if flags
                else "not measured",
                flags,
            )
        )

    papers = {
        "seallm-fcfs": "up to 4.17× higher normalized latency, 1.37× lower SLO attainment",
        "seallm-mlfq": "up to 4.17× higher normalized latency, 1.37× lower SLO attainment",
        "seallm-noplace": "no sharing: degrades to vLLM",
        "seallm-norepl": "up to 2.44× higher normalized latency, 1.33× lower SLO attainment",
    }
    for st in exp.stacks:
        if st.role != ABLATION:
            continue
        flags = []
        texts = []
        worst_nl: float | None = None
        for v in points:
            me_nl = _get(rows, v, "seallm", "normalized_latency")
            me_slo = _get(rows, v, "seallm", "slo_attainment")
            nl = _get(rows, v, st.label, "normalized_latency")
            slo = _get(rows, v, st.label, "slo_attainment")
            if me_nl is None or me_slo is None or nl is None or slo is None:
                continue
            # worse: clearly higher normalized latency, SLO attainment not clearly higher
            flags.append(nl > me_nl * (1 + REL_TOL) and slo <= me_slo + SLO_TOL)
            r = _ratio(nl, me_nl)
            if r is not None:
                worst_nl = r if worst_nl is None else max(worst_nl, r)
            texts.append(
                f"{exp.point_label(v)}: NL {_x(r)}, SLO {100 * slo:.1f}% vs {100 * me_slo:.1f}%"
            )
        out.append(
            _claim(
                f"{st.paper} ({st.label}) is worse than SeaLLM (Fig. 8)",
                papers.get(st.label, "worse than SeaLLM"),
                (
                    f"worse at {sum(flags)}/{len(flags)} rates, NL up to {_x(worst_nl)} "
                    "SeaLLM's (ablation vs SeaLLM: " + "; ".join(texts) + ")"
                )
                if flags
                else "not measured (a stack was not run)",
                flags,
            )
        )

    searchers = {
        st.label
        for st in exp.stacks
        if st.role in (MAIN, ABLATION)
        and st.label.startswith("seallm")
        and st.label != "seallm-noplace"
    }
    searches = [
        r["search_max_s"]
        for r in rows.values()
        if r["stack"] in searchers and r["search_max_s"] is not None
    ]
    out.append(
        _claim(
            "SeaLLM's placement search takes under a minute (§6.4)",
            "< 60 s with up to 8 parallel processes",
            f"longest search {max(searches):.1f} s over {len(searches)} runs "
            "(one process per run: the grid already uses every core)"
            if searches
            else "not measured",
            [max(searches) < 60.0] if searches else [],
        )
    )
    return out


def _gain_trend(
    exp: Experiment, rows: Rows, points: Sequence[float], base: str, field: str
) -> tuple[list[bool], str]:
    gains = []
    for v in points:
        r = _ratio(_get(rows, v, "muxserve", field), _get(rows, v, base, field))
        if r is not None:
            gains.append((v, r))
    flags = [b[1] > a[1] for a, b in itertools.pairwise(gains)]
    text = (
        "gain " + " → ".join(f"{_x(r)} ({exp.point_label(v)})" for v, r in gains)
        if gains
        else "not measured"
    )
    if len(gains) >= 2:
        text += f"; rises at {sum(flags)}/{len(flags)} steps"
    return flags, text


def muxserve_claims(exp: Experiment, rows: Rows, points: Sequence[float]) -> list[dict[str, str]]:
    """The MuxServe §5 claims, each checked on ``rows``."""
    out = []
    base = [s for s in exp.labels(MAIN) if s != "muxserve"]
    flags, texts, best = _best_of(
        exp, rows, points, "muxserve", base, "agg_throughput_rps", lower=False
    )
    out.append(
        _claim(
            "MuxServe has the highest aggregated throughput (Fig. 5)",
            "higher than spatial and temporal at every α, up to 1.8×",
            _best_text(flags, texts, best),
            flags,
        )
    )
    for b, name in (("vllm", "spatial partitioning (vLLM)"), ("alpaserve", "temporal (AlpaServe)")):
        flags, text = _gain_trend(exp, rows, points, b, "agg_throughput_rps")
        out.append(
            _claim(
                f"MuxServe's throughput gain over {name} grows with α (Fig. 5)",
                "improvement more significant for larger α (more skewed popularity)",
                text,
                flags,
            )
        )
    flags, texts, best = _best_of(
        exp, rows, points, "muxserve", base, "slo_attainment", False, ties=True
    )
    out.append(
        _claim(
            f"MuxServe has the highest SLO attainment at {SLO_SCALE:g}× (Fig. 5)",
            "up to 2.9× more requests within 99% SLO attainment",
            _best_text(flags, texts, best),
            flags,
        )
    )
    for hi, lo, claim, paper in (
        (
            "muxserve",
            "muxserve-rr",
            "ADBS has higher throughput than round-robin (Fig. 9)",
            "6.2 vs 4.1 req/s (3 LLMs), 6.6 vs 4.9 req/s (2 LLMs)",
        ),
        (
            "muxserve-rr",
            "muxserve-fcfs",
            "round-robin has higher throughput than FCFS (Fig. 9)",
            "4.1 vs 3.8 req/s (3 LLMs), 4.9 vs 3.2 req/s (2 LLMs)",
        ),
    ):
        flags = []
        texts = []
        for v in points:
            t_hi = _get(rows, v, hi, "agg_throughput_rps")
            t_lo = _get(rows, v, lo, "agg_throughput_rps")
            if t_hi is None or t_lo is None:
                continue
            flags.append(t_hi > t_lo * (1 + REL_TOL))
            texts.append(f"{exp.point_label(v)}: {t_hi:.2f} vs {t_lo:.2f}")
        out.append(
            _claim(
                claim,
                paper,
                (
                    f"higher by more than {100 * REL_TOL:g}% at {sum(flags)}/{len(flags)} α "
                    "(req/s: " + "; ".join(texts) + ")"
                )
                if flags
                else "not measured (a stack was not run)",
                flags,
            )
        )
    return out


def claims(exp: Experiment, rows: Rows, points: Sequence[float]) -> list[dict[str, str]]:
    """The experiment's claims, checked on ``rows``."""
    if exp.name == "seallm":
        return seallm_claims(exp, rows, points)
    return muxserve_claims(exp, rows, points)


# --------------------------------------------------------------------------- tables

Metric = tuple[str, str, Callable[[float], str]]
"""``(row field, title, formatter)``."""


def _f(spec: str, mul: float = 1.0) -> Callable[[float], str]:
    return lambda x: format(x * mul, spec)


METRICS: dict[str, tuple[Metric, ...]] = {
    "seallm": (
        ("normalized_latency", "Normalized latency (Fig. 6a; lower is better)", _f(".2f")),
        ("e2e_p99_s", "P99 end-to-end latency, s (Fig. 6b)", _f(".1f")),
        ("slo_attainment", f"SLO attainment at {SLO_SCALE:g}×, % (Fig. 6c)", _f(".1f", 100)),
        ("ttft_mean_s", "Mean TTFT, s (Fig. 7a)", _f(".2f")),
        ("tpot_mean_s", "Mean TPOT, ms (Fig. 7b)", _f(".1f", 1000)),
        ("throughput_rps", "Throughput, req/s (finished / run span)", _f(".2f")),
        ("replacements", "Replacements (plan switches)", _f(".0f")),
        ("search_total_s", "Placement search wall time, s (all searches of the run)", _f(".1f")),
    ),
    "muxserve": (
        ("agg_throughput_rps", "Aggregated throughput, req/s (Fig. 5)", _f(".2f")),
        ("agg_throughput_tokens_s", "Aggregated throughput, output tokens/s", _f(",.0f")),
        ("slo_attainment", f"SLO attainment at {SLO_SCALE:g}×, % (Fig. 5)", _f(".1f", 100)),
        ("normalized_latency", "Normalized latency", _f(".2f")),
        ("e2e_p99_s", "P99 end-to-end latency, s", _f(".1f")),
        ("ttft_mean_s", "Mean TTFT, s", _f(".2f")),
        ("throughput_rps", "Throughput, req/s (finished / whole run span)", _f(".2f")),
    ),
}
"""The tables of each experiment (rows: points; columns: stacks)."""


def _cell(rows: Rows, v: float, stack: str, field: str, fmt: Callable[[float], str]) -> str:
    x = _get(rows, v, stack, field)
    return DASH if x is None else fmt(x)


def headline(exp: Experiment, rows: Rows, points: Sequence[float]) -> dict[str, Any]:
    """The terminal table: one row per (point, stack) with the key metrics, as strings."""
    if exp.name == "seallm":
        cols: tuple[Metric, ...] = (
            ("normalized_latency", "NL", _f(".2f")),
            ("e2e_p99_s", "P99 s", _f(".1f")),
            ("slo_attainment", f"SLO {SLO_SCALE:g}× %", _f(".1f", 100)),
            ("ttft_mean_s", "TTFT s", _f(".2f")),
            ("tpot_mean_s", "TPOT ms", _f(".1f", 1000)),
            ("throughput_rps", "thr/s", _f(".2f")),
            ("replacements", "repl.", _f(".0f")),
            ("search_total_s", "search s", _f(".1f")),
        )
        title = (
            "SeaLLM Figs. 6-8 (fleetserve simulator); NL = normalized latency, "
            "thr = finished req/s; — = not run"
        )
    else:
        cols = (
            ("agg_throughput_rps", "agg. req/s", _f(".2f")),
            ("agg_throughput_tokens_s", "agg. tok/s", _f(",.0f")),
            ("slo_attainment", f"SLO {SLO_SCALE:g}× %", _f(".1f", 100)),
            ("normalized_latency", "NL", _f(".2f")),
            ("e2e_p99_s", "P99 s", _f(".1f")),
            ("ttft_mean_s", "TTFT s", _f(".2f")),
        )
        title = (
            f"MuxServe Fig. 5 / ADBS ablation at {exp.rate:g} req/s total; "
            "NL = normalized latency; — = not run"
        )
    body = []
    for v in points:
        for st in exp.stacks:
            if (v, st.label) not in rows:
                continue
            body.append(
                [
                    f"{v:g}",
                    st.label,
                    *(_cell(rows, v, st.label, f, fm) for f, _, fm in cols),
                ]
            )
    return {
        "title": title,
        "columns": ["req/s" if exp.axis == "rate" else "α", "stack", *(c[1] for c in cols)],
        "rows": body,
    }


def render_markdown(
    exp: Experiment,
    rows: Rows,
    claimed: Sequence[Mapping[str, str]],
    mode: Mode,
    notes: Sequence[str],
    header: Mapping[str, Any],
    figures: Sequence[Path],
) -> str:
    """``table.md``: setup, one table per metric, SLO curve, the claims check."""
    points = mode.points(exp)
    sizes = mode.sizes(exp)
    wall = header.get("wall_s")
    labels = exp.labels()
    setup = (
        f"{exp.gpus} × {exp.gpu}, `{exp.generator}` workload generator, "
        + (
            f"total rate {', '.join(f'{p:g}' for p in points)} req/s"
            if exp.axis == "rate"
            else f"total rate {exp.rate:g} req/s, α = {', '.join(f'{p:g}' for p in points)}"
        )
        + f"; {sizes.duration_s:g} s run after a {sizes.history_s:g} s placement history"
        + (
            f", replacement interval I₀ = {sizes.replacement_interval_s:g} s"
            if exp.name == "seallm"
            else ""
        )
        + (
            f", hot service rotating every {sizes.rotate_s:g} s from the history's start"
            if sizes.rotate_s is not None
            else ""
        )
        + f"; seed {mode.seed} (every run)."
    )
    lines = [
        f"# {exp.title} reproduction (fleetserve simulator)",
        "",
        f"Mode **{mode.name}**: {setup} {header['runs']} runs in this report"
        + (f"; simulated in {wall:.1f} s wall with {header['jobs']} jobs." if wall else "."),
        "",
        "Stacks: "
        + ", ".join(f"`{s.label}` ({s.paper})" for s in exp.stacks)
        + f". {DASH} = not run.",
        "",
    ]
    for field, title, fmt in METRICS[exp.name]:
        lines += [f"## {title}", ""]
        body = [
            [exp.point_label(v), *(_cell(rows, v, s, field, fmt) for s in labels)] for v in points
        ]
        lines += md_table([exp.axis, *labels], body)
    focus = _focus(exp, rows, points)
    if focus is not None:
        fig = " (Fig. 10)" if exp.name == "seallm" else ""
        lines += [f"## SLO attainment (%) vs SLO scale at {exp.point_label(focus)}{fig}", ""]
        body = []
        for sc in SLO_SCALES:
            cells = []
            for s in labels:
                x = (rows.get((focus, s)) or {}).get("slo", {}).get(sc)
                cells.append(DASH if x is None else f"{100 * x:.1f}")
            body.append([f"{sc:g}×", *cells])
        lines += md_table(["SLO scale", *labels], body)
    lines += ["## Requests per point", ""]
    body = []
    for v in points:
        r = next((rows[(v, s)] for s in labels if (v, s) in rows), None)
        body.append([exp.point_label(v), DASH if r is None else f"{r['requests']:,}"])
    lines += md_table([exp.axis, "requests in the run"], body)

    lines += ["## What the paper reports vs what we measured", ""]
    lines += md_table(
        ["claim", "paper", "measured", "reproduces?"],
        [[c["claim"], c["paper"], c["measured"], c["reproduces"]] for c in claimed],
    )
    lines.append(
        '"reproduces": yes = the comparison holds at every point, partly = at some, '
        "no = at none, n/a = a stack was not run."
    )
    lines += ["", "## Figures", "", *(f"![{p.stem}]({p.name})" for p in figures), ""]
    problems = [
        f"{exp.point_name(r['value'])}/{r['stack']}: {r['rejected']} rejected, "
        f"{r['unfinished']} unfinished"
        for r in rows.values()
        if r["rejected"] or r["unfinished"]
    ]
    if notes or problems:
        lines += ["## Notes", "", *(f"- {n}" for n in [*notes, *problems]), ""]
    return "\n".join(lines)


def _focus(exp: Experiment, rows: Rows, points: Sequence[float]) -> float | None:
    have = [v for v in points if any((v, s) in rows for s in exp.labels())]
    if not have:
        return None
    return exp.focus if exp.focus in have else have[-1]


# --------------------------------------------------------------------------- figures


_PLAIN = FuncFormatter(lambda y, _pos: f"{y:g}")
"""Tick labels of log axes as plain numbers (``20``, not ``2×10¹``)."""


def plot_xy_panels(
    panels: Mapping[str, Mapping[str, Sequence[tuple[float, float | None]]]],
    path: Path,
    *,
    title: str,
    xlabel: str,
    series: Sequence[str],
    ylabels: Mapping[str, str],
    log_y: Sequence[str] = (),
    log_x: bool = False,
) -> Path:
    """Lines with markers, one panel per key of ``panels`` side by side.

    ``panels[panel][series] = [(x, y), ...]``; a None ``y`` is skipped. Colours
    follow the place of a series in ``series``.
    """
    n = max(len(panels), 1)
    fig = Figure(figsize=(5.0 * n, 4.4), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (ptitle, lines) in zip(axes, panels.items(), strict=False):
        for name in series:
            pts = [(x, y) for x, y in lines.get(name, ()) if y is not None]
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", label=name, color=f"C{list(series).index(name) % 10}")
        ax.set_title(ptitle)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabels.get(ptitle, ""))
        ax.grid(True, alpha=0.3)
        if ptitle in log_y and ax.get_lines():
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(_PLAIN)
            ax.yaxis.set_minor_formatter(_PLAIN)
        if log_x:
            ax.set_xscale("log")
        xs_all = sorted({x for pts in lines.values() for x, _ in pts})
        if xs_all and len(xs_all) <= 12:
            ax.set_xticks(xs_all, [f"{x:g}" for x in xs_all])
            ax.xaxis.set_minor_formatter(NullFormatter())
        if not ax.get_lines():
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(handles), 6))
    return save_png(fig, path)


def _lines(
    exp: Experiment,
    rows: Rows,
    points: Sequence[float],
    stacks: Sequence[str],
    field: str,
    mul: float = 1.0,
) -> dict[str, list[tuple[float, float | None]]]:
    out: dict[str, list[tuple[float, float | None]]] = {}
    for s in stacks:
        pts = []
        for v in points:
            x = _get(rows, v, s, field)
            pts.append((v, None if x is None else x * mul))
        out[s] = pts
    return out


def _slo_curve(
    rows: Rows, focus: float, stacks: Sequence[str]
) -> dict[str, list[tuple[float, float | None]]]:
    out: dict[str, list[tuple[float, float | None]]] = {}
    for s in stacks:
        slo = (rows.get((focus, s)) or {}).get("slo", {})
        out[s] = [(sc, None if slo.get(sc) is None else 100 * slo[sc]) for sc in SLO_SCALES]
    return out


def write_figures(out: Path, exp: Experiment, rows: Rows, points: Sequence[float]) -> list[Path]:
    """The PNGs of the experiment (see the module docstring)."""
    from fleetserve.metrics.plots import plot_grouped_bars

    every = exp.labels()
    main = exp.labels(MAIN)
    subject = "seallm" if exp.name == "seallm" else "muxserve"
    ablation = [subject, *exp.labels(ABLATION), *exp.labels(VARIANT)]
    files: list[Path] = []
    focus = _focus(exp, rows, points)
    if exp.name == "seallm":
        metrics = (
            ("normalized latency", "normalized_latency", 1.0, "× execution time"),
            ("P99 latency", "e2e_p99_s", 1.0, "s"),
            (f"SLO attainment at {SLO_SCALE:g}×", "slo_attainment", 100.0, "%"),
        )
        ylabels = {t: u for t, _, _, u in metrics}
        for fname, stacks, what in (
            ("fig6_latency_slo.png", main, "SeaLLM vs baselines (Fig. 6)"),
            ("fig8_ablation.png", ablation, "SeaLLM design choices (Fig. 8)"),
        ):
            panels = {t: _lines(exp, rows, points, stacks, f, m) for t, f, m, _ in metrics}
            files.append(
                plot_xy_panels(
                    panels,
                    out / fname,
                    title=what,
                    xlabel=exp.axis_label,
                    series=every,
                    ylabels=ylabels,
                    log_y=("normalized latency", "P99 latency"),
                )
            )
        bars: dict[str, dict[str, dict[str, float | None]]] = {
            "mean TTFT (s)": {},
            "mean TPOT (ms)": {},
        }
        for v in points:
            bars["mean TTFT (s)"][exp.point_label(v)] = {
                s: _get(rows, v, s, "ttft_mean_s") for s in main
            }
            bars["mean TPOT (ms)"][exp.point_label(v)] = {
                s: (None if (x := _get(rows, v, s, "tpot_mean_s")) is None else 1000 * x)
                for s in main
            }
        files.append(
            plot_grouped_bars(
                bars,
                out / "fig7_ttft_tpot.png",
                title="Mean TTFT and TPOT (SeaLLM Fig. 7)",
                ylabel="",
                series=every,
                value_fmt=".3g",
            )
        )
        curve_name = "fig10_slo_scale.png"
        curve_title = "SLO attainment vs SLO scale (SeaLLM Fig. 10)"
    else:
        metrics = (
            ("aggregated throughput", "agg_throughput_rps", 1.0, "req/s"),
            ("output token throughput", "agg_throughput_tokens_s", 1.0, "tokens/s"),
            (f"SLO attainment at {SLO_SCALE:g}×", "slo_attainment", 100.0, "%"),
        )
        ylabels = {t: u for t, _, _, u in metrics}
        panels = {t: _lines(exp, rows, points, main, f, m) for t, f, m, _ in metrics}
        files.append(
            plot_xy_panels(
                panels,
                out / "fig5_throughput_slo.png",
                title=f"MuxServe vs spatial / temporal sharing at {exp.rate:g} req/s (Fig. 5)",
                xlabel=exp.axis_label,
                series=every,
                ylabels=ylabels,
            )
        )
        bars = {"aggregated throughput (req/s)": {}, f"SLO attainment at {SLO_SCALE:g}× (%)": {}}
        for v in points:
            bars["aggregated throughput (req/s)"][exp.point_label(v)] = {
                s: _get(rows, v, s, "agg_throughput_rps") for s in ablation
            }
            bars[f"SLO attainment at {SLO_SCALE:g}× (%)"][exp.point_label(v)] = {
                s: (None if (x := _get(rows, v, s, "slo_attainment")) is None else 100 * x)
                for s in ablation
            }
        files.append(
            plot_grouped_bars(
                bars,
                out / "fig9_scheduling.png",
                title="ADBS vs round-robin vs FCFS on MuxServe's placement (MuxServe Fig. 9)",
                ylabel="",
                series=every,
                value_fmt=".3g",
            )
        )
        curve_name = "slo_scale.png"
        curve_title = "SLO attainment vs SLO scale"
    label = DASH if focus is None else exp.point_label(focus)
    files.append(
        plot_xy_panels(
            {f"{label}": {} if focus is None else _slo_curve(rows, focus, every)},
            out / curve_name,
            title=curve_title,
            xlabel="SLO scale (× execution time)",
            series=every,
            ylabels={label: "SLO attainment (%)"},
            log_x=True,
        )
    )
    return files


# --------------------------------------------------------------------------- write


def write_report(
    out: Path, exp: Experiment, mode: Mode, *, wall_s: float | None, jobs: int
) -> tuple[list[Path], dict[str, Any]]:
    """Collect the runs under ``out`` and write ``table.md``, ``results.*`` and the figures.

    Args:
        out: the experiment folder (holding ``runs/``).
        exp: the experiment.
        mode: the mode the runs must match.
        wall_s: wall time of the simulations (None when only re-rendering).
        jobs: worker processes used.

    Returns:
        ``(files written, results.json content)``.
    """
    from fleetserve.experiments.multi_llm import search_takes_max_services

    out.mkdir(parents=True, exist_ok=True)
    points = mode.points(exp)
    rows, notes = collect(out, exp, mode)
    if exp.max_services is not None and not search_takes_max_services():
        notes.append(
            f"SeaLLM's 'at most {exp.max_services} services per engine' is not applied: "
            "this build's SeaLLM search has no max_services parameter"
        )
    claimed = claims(exp, rows, points)
    figures = write_figures(out, exp, rows, points)
    flat = [rows[(v, s.label)] for v in points for s in exp.stacks if (v, s.label) in rows]

    csv_path = write_csv(out / "results.csv", flat, CSV_COLUMNS)

    json_runs = [
        {**{k: r.get(k) for k in CSV_COLUMNS}, "slo": {f"{k:g}": x for k, x in r["slo"].items()}}
        for r in flat
    ]
    sizes = mode.sizes(exp)
    report: dict[str, Any] = {
        "experiment": exp.name,
        "title": exp.title,
        "mode": mode.to_dict(exp),
        "wall_s": wall_s,
        "jobs": jobs,
        "setup": {
            "generator": exp.generator,
            "gpu": exp.gpu,
            "gpus": exp.gpus,
            "axis": exp.axis,
            "rate": exp.rate if exp.axis == "alpha" else None,
            "duration_s": sizes.duration_s,
            "history_s": sizes.history_s,
            "slo_scale": SLO_SCALE,
        },
        "stacks": [{"label": s.label, "paper": s.paper, "role": s.role} for s in exp.stacks],
        "runs": json_runs,
        "table": headline(exp, rows, points),
        "claims": claimed,
        "notes": notes,
    }
    json_path = write_json(out / "results.json", report)
    md_path = out / "table.md"
    header = {"runs": len(rows), "wall_s": wall_s, "jobs": jobs}
    md_path.write_text(
        render_markdown(exp, rows, claimed, mode, notes, header, figures), encoding="utf-8"
    )
    logger.info("wrote the %s report (%d runs) to %s", exp.name, len(rows), out)
    return [md_path, csv_path, json_path, *figures], report


__all__ = [
    "CSV_COLUMNS",
    "METRICS",
    "aggregated_throughput",
    "claims",
    "collect",
    "headline",
    "muxserve_claims",
    "plot_xy_panels",
    "render_markdown",
    "run_row",
    "seallm_claims",
    "verdict",
    "write_figures",
    "write_report",
]
