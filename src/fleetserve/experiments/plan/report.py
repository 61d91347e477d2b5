"""Write a plan's results: ``plan.json``, ``report.md``, ``frontier.png``, and a replay.

Files in the output folder:

* ``plan.json``: the input, the chosen point with its cost per hour and per
  million tokens and the margin to every SLO, each stack's cheapest feasible
  point, every simulated point (figures per service), the pruned combos, the
  Pareto frontier, robustness, headroom, timings and the replay command;
* ``report.md``: the same as tables;
* ``frontier.png``: cost per hour against the worst service's P99 TTFT of
  every simulated point, feasible ones filled, the frontier drawn;
* ``traffic.jsonl`` and ``chosen.yaml``: the search's requests and the chosen
  point as a ``fleetserve simulate`` config (a one-model stack's config reads
  ``traffic-run.jsonl``, the run without the history), so that
  ``fleetserve simulate DIR/chosen.yaml --out DIR/replay`` replays it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fleetserve.experiments.plan.evaluate import (
    Outcome,
    one_model_requests,
    plan_world,
    sim_config,
)
from fleetserve.experiments.plan.run import PlanResult
from fleetserve.experiments.plan.search import Point, point_key
from fleetserve.experiments.plan.traffic import write_jsonl
from fleetserve.policy.catalog import MULTI

__all__ = ["frontier", "plan_summary", "write_plan"]


def _num(x: float | None) -> float | None:
    """JSON-safe: inf and nan become None."""
    if x is None or not math.isfinite(x):
        return None
    return float(x)


def _point(p: Point) -> dict[str, Any]:
    return {
        "stack": p.stack,
        "gpu": p.gpu,
        "tp_min": p.tp,
        "tp_exact": plan_world(p.stack) != MULTI,
        "gpus": p.n_gpus,
        "price_per_gpu_hour": p.price,
        "cost_per_hour": round(p.cost_per_hour, 6),
    }


def _outcome(o: Outcome) -> dict[str, Any]:
    return {
        **_point(o.point),
        "meets_slos": o.meets,
        "error": o.error,
        "seed": o.seed,
        "rate_factor": o.rate_factor,
        "window": o.window,
        "gpu_hours_used": _num(o.gpu_hours_used),
        "sim_wall_s": round(o.sim_wall_s, 3),
        "services": {
            name: {
                "requests": s.requests,
                "lost": s.lost,
                "ttft_p99_s": _num(s.ttft_p99_s),
                "tpot_p99_s": _num(s.tpot_p99_s),
                "e2e_p99_s": _num(s.e2e_p99_s),
                "attainment": s.attainment,
                "margins": {k: _num(v) for k, v in s.margins.items()},
            }
            for name, s in o.services.items()
        },
    }


def frontier(outcomes: list[Outcome]) -> list[Outcome]:
    """The points meeting every SLO that no other such point beats on both cost
    per hour and the worst service's P99 TTFT, cheapest first: what more money
    buys in latency."""
    pts = sorted(
        (o for o in outcomes if o.meets and math.isfinite(o.worst_ttft_p99_s)),
        key=lambda o: (o.point.cost_per_hour, o.worst_ttft_p99_s, point_key(o.point)),
    )
    out: list[Outcome] = []
    for o in pts:
        if not out or o.worst_ttft_p99_s < out[-1].worst_ttft_p99_s:
            out.append(o)
    return out


def _tokens_per_hour(result: PlanResult) -> tuple[float, float]:
    run = result.traffic.run
    dur = result.spec.duration_s
    out_tok = sum(r.output_tokens for r in run)
    all_tok = out_tok + sum(r.prompt_tokens for r in run)
    return all_tok / dur * 3600.0, out_tok / dur * 3600.0


def replay_command(out: Path) -> str:
    """The command that replays the chosen point."""
    return f"fleetserve simulate {out / 'chosen.yaml'} --out {out / 'replay'}"


def plan_summary(result: PlanResult, out: Path) -> dict[str, Any]:
    """Everything of ``plan.json`` (module docstring)."""
    spec = result.spec
    tok_all, tok_out = _tokens_per_hour(result)
    chosen = result.chosen_outcome
    per_stack: dict[str, Any] = {}
    for name, search in result.searches.items():
        if not result.combos.get(name):
            per_stack[name] = {
                "status": "cannot host every service on any candidate GPU at the allowed TP "
                "degrees",
                "evaluated": 0,
            }
        elif search is None:
            per_stack[name] = {"status": "cut by the time budget"}
        elif search.best is None:
            cap = result.cost_cap_per_hour
            status = f"no feasible point up to {spec.search.max_gpus} GPUs"
            if cap is not None and name != spec.search.baseline:
                status += (
                    f" and ${cap:.2f}/h ({spec.search.cost_cap:g}x the baseline "
                    f"{spec.search.baseline}'s cheapest)"
                )
            per_stack[name] = {"status": status, "evaluated": len(search.evaluated)}
        else:
            per_stack[name] = {
                "status": "feasible",
                "cheapest": _outcome(result.outcomes[search.best]),
                "evaluated": len(search.evaluated),
            }
    doc: dict[str, Any] = {
        "input": dataclasses.asdict(spec),
        "chosen": None,
        "per_stack": per_stack,
        "frontier": [_outcome(o) for o in frontier(list(result.outcomes.values()))],
        "evaluated": [_outcome(o) for o in result.outcomes.values()],
        "pruned": [
            {"stack": c.stack, "gpu": c.gpu, "tp_min": c.tp, "lower_bound": c.lower_bound, "why": w}
            for s in result.searches.values()
            if s is not None
            for c, w in s.pruned
        ]
        + [{"stack": st, "gpu": g, "why": w} for st, g, w in result.unplaceable],
        "lower_bounds": [
            {"stack": c.stack, "gpu": c.gpu, "tp_min": c.tp, "gpus": c.lower_bound}
            for cs in result.combos.values()
            for c in cs
        ],
        "idle_p99": {
            name: [dataclasses.asdict(f) for f in fl] for name, fl in result.floors.items()
        },
        "cut_by_budget": result.cut,
        "traffic": {
            "requests_history": len(result.traffic.history),
            "requests_run": len(result.traffic.run),
            "services": {
                n: {"rate": s.rate, "mean_prompt": s.mean_prompt, "mean_output": s.mean_output}
                for n, s in result.traffic.services.items()
            },
            "tokens_per_hour": tok_all,
            "output_tokens_per_hour": tok_out,
            "notes": list(result.traffic.notes),
        },
        "timing": {
            "search_wall_s": round(result.search_wall_s, 2),
            "wall_s": round(result.wall_s, 2),
            "simulations": len(result.outcomes)
            + len(result.robustness)
            + len(result.headroom_runs)
            + sum(len(runs) for _, runs in result.alternatives),
        },
        "brute_force": spec.search.brute_force,
        "cost_cap_per_hour": result.cost_cap_per_hour,
    }
    if chosen is not None:
        p = chosen.point
        doc["chosen"] = {
            **_outcome(chosen),
            "cost_per_million_tokens": p.cost_per_hour / tok_all * 1e6,
            "cost_per_million_output_tokens": p.cost_per_hour / tok_out * 1e6,
            "tp_sizes": [t for t in sorted(spec.search.tp) if t >= p.tp],
            "robustness": [_outcome(o) for o in result.robustness],
            "robust": all(o.meets for o in result.robustness),
            "headroom": result.headroom,
            "headroom_breaks_at": result.headroom_breaks,
            "headroom_max": spec.search.headroom_max,
            "headroom_runs": [_outcome(o) for o in result.headroom_runs],
            "replay": replay_command(out),
            "alternatives_tried": [
                {**_point(p), "robustness": [_outcome(o) for o in runs]}
                for p, runs in result.alternatives
            ],
            "robust_alternative": None
            if result.robust_choice is None
            else _outcome(result.outcomes[result.robust_choice]),
        }
    return doc


def _tp(p: dict[str, Any]) -> str:
    """``TP 2`` (every instance of a one-model stack) or ``TP >= 2`` (a placement's choice)."""
    return f"TP {p['tp_min']}" if p["tp_exact"] else f"TP >= {p['tp_min']}"


def _fmt_s(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "lost"
    return f"{x:.3g}"


def _markdown(doc: dict[str, Any], result: PlanResult) -> str:
    spec = result.spec
    lines = ["# fleetserve plan", ""]
    ch = doc["chosen"]
    if ch is None:
        lines += [
            f"**No candidate met every SLO** within {spec.search.max_gpus} GPUs"
            + (f" (budget cut: {', '.join(result.cut)})" if result.cut else "")
            + ". Raise `search.max_gpus`, relax the SLOs, or add GPU types.",
            "",
        ]
    else:
        lines += [
            f"**Cheapest fleet meeting every SLO: {ch['gpus']} x {ch['gpu']} with stack "
            f"`{ch['stack']}`** ({_tp(ch)}): **${ch['cost_per_hour']:.2f} per hour**, "
            f"${ch['cost_per_million_tokens']:.3f} per million tokens "
            f"(${ch['cost_per_million_output_tokens']:.2f} per million output tokens).",
            "",
            "| service | SLO | target | achieved | margin |",
            "|---|---|---|---|---|",
        ]
        for svc in spec.services:
            s = ch["services"][svc.name]
            for key, m in s["margins"].items():
                target = (
                    getattr(svc.slo, key)
                    if key != "attainment"
                    else f">= {svc.slo.attainment_min:g} at x{svc.slo.attainment_scale:g}"
                )
                got = s["attainment"] if key == "attainment" else s[key]
                lines.append(
                    f"| {svc.name} | {key} | {target} | {_fmt_s(got)} | "
                    f"{'-' if m is None else f'{m:.2f}x'} |"
                )
        rob = ch["robustness"]
        verdict = "still meets" if ch["robust"] else "does NOT meet"
        lines += [
            "",
            f"**Robustness**: re-simulated with seeds {list(spec.search.robustness_seeds)}: "
            f"{verdict} every SLO "
            f"({sum(r['meets_slos'] for r in rob)} of {len(rob)} runs).",
            "",
        ]
        alt = ch["robust_alternative"]
        if not ch["robust"]:
            tried = len(ch["alternatives_tried"])
            lines += [
                (
                    f"**Cheapest robust alternative**: {alt['gpus']} x {alt['gpu']} with "
                    f"`{alt['stack']}` ({_tp(alt)}), ${alt['cost_per_hour']:.2f} per "
                    "hour: meets every SLO on every seed."
                    if alt is not None
                    else f"No robust alternative among the {tried} tried "
                    f"(`search.robust_tries`): provision above the chosen point."
                ),
                "",
            ]
        lines += [
            f"**Headroom**: meets every SLO with every service's rate x{ch['headroom']:g}"
            + (
                " (the most tried, `search.headroom_max`)"
                if ch["headroom_breaks_at"] is None
                else f"; x{ch['headroom_breaks_at']:g} breaks one (bisection)"
            )
            + ".",
            "",
            f"Replay: `{ch['replay']}`",
            "",
        ]
    lines += ["## Cheapest feasible point per stack", "", "| stack | fleet | $/h | simulated |"]
    lines.append("|---|---|---|---|")
    for name, st in doc["per_stack"].items():
        if st["status"] == "feasible":
            c = st["cheapest"]
            lines.append(
                f"| {name} | {c['gpus']} x {c['gpu']} ({_tp(c)}) | "
                f"{c['cost_per_hour']:.2f} | {st['evaluated']} points |"
            )
        else:
            lines.append(f"| {name} | {st['status']} | - | {st.get('evaluated', '-')} |")
    lines += [
        "",
        "## Pareto frontier of the points meeting every SLO",
        "",
        "Cost against the worst service's P99 TTFT, among the simulated points:",
        "",
        "| fleet | stack | $/h | worst P99 TTFT (s) |",
        "|---|---|---|---|",
    ]
    for f in doc["frontier"]:
        worst = max(
            (s["ttft_p99_s"] for s in f["services"].values() if s["ttft_p99_s"] is not None),
            default=None,
        )
        lines.append(
            f"| {f['gpus']} x {f['gpu']} ({_tp(f)}) | {f['stack']} | "
            f"{f['cost_per_hour']:.2f} | {_fmt_s(worst)} |"
        )
    t = doc["timing"]
    lines += [
        "",
        "![frontier](frontier.png)",
        "",
        f"{t['simulations']} simulations; search {t['search_wall_s']:.0f} s, "
        f"all {t['wall_s']:.0f} s"
        + (" (brute force: every pool size)" if doc["brute_force"] else "")
        + ".",
    ]
    if doc["traffic"]["notes"]:
        lines += ["", "Notes:", *[f"- {n}" for n in doc["traffic"]["notes"]]]
    return "\n".join(lines) + "\n"


def _plot(result: PlanResult, path: Path) -> None:
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    stacks = list(result.searches)
    for i, name in enumerate(stacks):
        pts = [
            o
            for o in result.outcomes.values()
            if o.point.stack == name and o.error is None and math.isfinite(o.worst_ttft_p99_s)
        ]
        if not pts:
            continue
        color = f"C{i % 10}"
        ok = [o for o in pts if o.meets]
        bad = [o for o in pts if not o.meets]
        if ok:
            ax.scatter(
                [o.point.cost_per_hour for o in ok],
                [o.worst_ttft_p99_s for o in ok],
                color=color,
                label=name,
            )
        if bad:
            ax.scatter(
                [o.point.cost_per_hour for o in bad],
                [o.worst_ttft_p99_s for o in bad],
                facecolors="none",
                edgecolors=color,
                label=None if ok else name,
            )
    fr = frontier(list(result.outcomes.values()))
    if fr:
        ax.step(
            [o.point.cost_per_hour for o in fr],
            [o.worst_ttft_p99_s for o in fr],
            where="post",
            color="black",
            linewidth=1,
            label="frontier",
        )
    if result.chosen is not None:
        o = result.outcomes[result.chosen]
        ax.scatter(
            [o.point.cost_per_hour],
            [o.worst_ttft_p99_s],
            marker="*",
            s=250,
            color="gold",
            edgecolors="black",
            zorder=5,
            label="chosen",
        )
    ax.set_yscale("log")
    ax.set_xlabel("fleet cost, USD per hour")
    ax.set_ylabel("worst service's P99 TTFT, s")
    ax.set_title("Simulated candidates (filled: every SLO met)")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_plan(result: PlanResult, out: Path) -> dict[str, Any]:
    """Write every output file (module docstring) into ``out``; the ``plan.json`` dict."""
    out.mkdir(parents=True, exist_ok=True)
    doc = plan_summary(result, out)
    (out / "plan.json").write_text(json.dumps(doc, indent=2, allow_nan=False), encoding="utf-8")
    (out / "report.md").write_text(_markdown(doc, result), encoding="utf-8")
    _plot(result, out / "frontier.png")
    write_jsonl(result.traffic.stream, out / "traffic.jsonl")
    if result.chosen is not None:
        trace = "traffic.jsonl"
        if plan_world(result.chosen.stack) != MULTI:  # a one-model simulator: the run only
            trace = "traffic-run.jsonl"
            write_jsonl(one_model_requests(result.spec, result.traffic), out / trace)
        cfg = sim_config(result.spec, result.chosen, trace, result.spec.seed)
        head = f"# The plan's chosen point; replay with:\n#   {replay_command(out)}\n"
        (out / "chosen.yaml").write_text(head + yaml.safe_dump(cfg, sort_keys=False))
    return doc
