"""``fleetserve stacks [--json]``: the stack catalog, one row per stack.

Each stack's choice of every policy family and the worlds (simulators) that
run it, from :data:`~fleetserve.policy.catalog.STACKS`; below the table, what
each world's simulator does for the families it does not read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetserve.policy.catalog import FAMILIES, STACKS, WORLDS, Stack
from fleetserve.policy.pressure import KunSettings

_DEFAULT_BURST = KunSettings()


def burst_changes(stack: Stack) -> dict[str, Any]:
    """The stack's KunServe settings that differ from the defaults, ``pressure`` left out."""
    return {
        f.name: getattr(stack.burst, f.name)
        for f in dataclasses.fields(KunSettings)
        if f.name != "pressure" and getattr(stack.burst, f.name) != getattr(_DEFAULT_BURST, f.name)
    }


def stack_record(stack: Stack) -> dict[str, Any]:
    """One stack as plain JSON: name, description, worlds, every family, the settings."""
    return {
        "name": stack.name,
        "description": stack.description,
        "worlds": list(stack.worlds),
        **stack.families(),
        "burst": dataclasses.asdict(stack.burst),
    }


def catalog_record() -> dict[str, Any]:
    """The whole catalog as plain JSON (``fleetserve stacks --json``)."""
    return {
        "families": list(FAMILIES),
        "worlds": [
            {
                "name": w.name,
                "label": w.label,
                "simulator": w.simulator,
                "selected_by": w.selected_by,
                "reads": list(w.reads),
                "fixed": dict(w.fixed),
            }
            for w in WORLDS.values()
        ],
        "stacks": [stack_record(s) for s in STACKS.values()],
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def catalog_table() -> Table:
    """Every stack with its worlds and families, as a rich table."""
    t = Table(title=f"Stack catalog ({len(STACKS)} stacks)")
    t.add_column("stack", no_wrap=True)
    t.add_column("worlds")
    for fam in FAMILIES:
        t.add_column(fam)
    for s in STACKS.values():
        fams = {**s.families(), "pressure": _pressure(s)}
        t.add_row(s.name, " ".join(s.worlds), *(_cell(fams[f]) for f in FAMILIES))
    return t


def descriptions_table() -> Table:
    """What each stack is, one line each."""
    t = Table(title="Stacks")
    t.add_column("stack", no_wrap=True)
    t.add_column("description")
    for s in STACKS.values():
        t.add_row(s.name, s.description)
    return t


def _pressure(stack: Stack) -> str:
    """The pressure family with the stack's non-default KunServe settings."""
    changes = burst_changes(stack)
    text = stack.pressure
    if changes:
        text += " (" + ", ".join(f"{k}={v}" for k, v in changes.items()) + ")"
    return text


def compact_table() -> Table:
    """The catalog for a narrow console: the families of a stack in one cell."""
    t = Table(title=f"Stack catalog ({len(STACKS)} stacks; a wider console shows a column each)")
    t.add_column("stack", no_wrap=True)
    t.add_column("worlds")
    t.add_column("families")
    for s in STACKS.values():
        fams = {**s.families(), "pressure": _pressure(s)}
        t.add_row(s.name, " ".join(s.worlds), ", ".join(f"{f}={_cell(fams[f])}" for f in FAMILIES))
    return t


def cmd_stacks(args: argparse.Namespace, console: Console) -> int:
    if args.json:
        print(json.dumps(catalog_record(), indent=2))
        return 0
    table = catalog_table()
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    if natural <= console.width:
        console.print(table)
        console.print(descriptions_table())
    else:  # a column per family would wrap into noise
        console.print(compact_table())
        console.print(descriptions_table())
    for w in WORLDS.values():
        fixed = "; ".join(f"{k}: {v}" for k, v in w.fixed.items())
        console.print(
            f"[bold]{w.name}[/] ({w.simulator}; {w.selected_by}) reads "
            f"{', '.join(w.reads)}; fixed by its simulator: {fixed}",
            highlight=False,
        )
    console.print("memory '-': from the pool (elastic on an elastic pool, static on a fixed one)")
    return 0


def add_stacks_parser(sub: Any) -> None:
    """The ``stacks`` subcommand."""
    p = sub.add_parser(
        "stacks",
        help="list every stack: its policy families and the simulators (worlds) that run it",
        description="List the stack catalog: each stack's placement, dispatch, batching, KV "
        "layout, migration, mechanism, memory, replacement and memory-pressure choices, and "
        "the worlds (single-model, multi-LLM, kunserve) whose simulator runs it.",
    )
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=cmd_stacks)
