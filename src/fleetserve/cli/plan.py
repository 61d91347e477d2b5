"""``fleetserve plan PLAN.yaml --out DIR``: the cheapest fleet that meets the SLOs.

The procedure is :mod:`fleetserve.experiments.plan`; this module reads the
flags, shows a progress bar (points simulated, the best so far) and prints
the answer.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from fleetserve.experiments.plan.evaluate import Outcome
from fleetserve.experiments.plan.report import write_plan
from fleetserve.experiments.plan.run import run_plan
from fleetserve.experiments.plan.search import Point
from fleetserve.experiments.plan.spec import load_plan

__all__ = ["add_plan_parser", "cmd_plan"]


class _Bar:
    """A rich spinner line: phase, points simulated, the best feasible so far."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task = progress.add_task("search", info="starting")
        self.name = "search"

    def phase(self, name: str) -> None:
        self.name = name
        self.progress.update(self.task, description=name)

    def evaluated(self, outcome: Outcome, best: Point | None, done: int) -> None:
        p = outcome.point
        last = f"{p.stack} {p.n_gpus}x{p.gpu}: {'meets' if outcome.meets else 'misses'}"
        top = (
            "none yet"
            if best is None
            else f"{best.n_gpus}x{best.gpu} {best.stack} ${best.cost_per_hour:.2f}/h"
        )
        self.progress.update(self.task, info=f"{done} simulated · best {top} · last {last}")


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    """Run ``fleetserve plan``."""
    spec, base = load_plan(args.plan, tuple(args.set or ()))
    changes: dict[str, Any] = {}
    if args.jobs is not None:
        changes["jobs"] = args.jobs
    if args.brute_force:
        changes["brute_force"] = True
    if args.budget is not None:
        changes["budget_s"] = args.budget
    if changes:
        spec = dataclasses.replace(spec, search=dataclasses.replace(spec.search, **changes))
    out = Path(args.out)
    if args.no_progress:
        result = run_plan(spec, base)
    else:
        columns = (
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console, transient=False) as progress:
            result = run_plan(spec, base, listener=_Bar(progress))
    doc = write_plan(result, out)
    table = Table(title="cheapest feasible point per stack")
    for col in ("stack", "fleet", "$/h", "points"):
        table.add_column(col)
    for name, st in doc["per_stack"].items():
        if st["status"] == "feasible":
            c = st["cheapest"]
            table.add_row(
                name, f"{c['gpus']} x {c['gpu']}", f"{c['cost_per_hour']:.2f}", str(st["evaluated"])
            )
        else:
            table.add_row(name, st["status"], "-", str(st.get("evaluated", "-")))
    console.print(table)
    ch = doc["chosen"]
    if ch is None:
        console.print("[bold red]no candidate meets every SLO[/] (see report.md)")
    else:
        breaks = ch["headroom_breaks_at"]
        console.print(
            f"[bold]chosen:[/] {ch['gpus']} x {ch['gpu']}, stack {ch['stack']}, "
            f"${ch['cost_per_hour']:.2f}/h, ${ch['cost_per_million_tokens']:.3f} per M tokens; "
            f"robust on other seeds: {'yes' if ch['robust'] else 'NO'}; "
            f"headroom x{ch['headroom']:g}"
            + ("" if breaks is None else f" (x{breaks:g} breaks an SLO)")
        )
        alt = ch["robust_alternative"]
        if not ch["robust"] and alt is not None:
            console.print(
                f"[bold]cheapest robust alternative:[/] {alt['gpus']} x {alt['gpu']}, stack "
                f"{alt['stack']}, ${alt['cost_per_hour']:.2f}/h"
            )
        console.print(f"replay: {ch['replay']}")
    t = doc["timing"]
    console.print(
        f"{t['simulations']} simulations in {t['wall_s']:.0f} s; results in {out} "
        "(report.md, plan.json, frontier.png, chosen.yaml, traffic.jsonl)"
    )
    return 0


def add_plan_parser(sub: Any) -> None:
    """The ``plan`` subcommand."""
    p = sub.add_parser(
        "plan",
        help="the cheapest fleet (GPU type, count, TP, stack) that meets every SLO",
        description="Search GPU type x pool size x TP x stack for the cheapest fleet that "
        "meets every service's SLOs on the plan's traffic (docs/plan.md).",
    )
    p.add_argument("plan", help="the plan file (YAML; configs/plan-example.yaml)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--jobs", type=int, help="simulations at once (default: search.jobs)")
    p.add_argument(
        "--brute-force",
        action="store_true",
        help="simulate every pool size of every candidate (no bisection, no pruning)",
    )
    p.add_argument("--budget", type=float, help="search time budget, seconds (search.budget_s)")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a plan field (repeatable)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_plan)
