"""``fleetserve parity CONFIG.yaml --out DIR``: each mechanism on the runtime and in the simulator.

For each stack (default: the config's ``policy.stack``; ``--stacks a,b``
runs the config under each), one after the other, progress on stderr::

    1 check     every stack's config as serve loads it (the same errors),
                and that the simulator can emulate it, before anything runs
    2 serve     fleetserve serve CONFIG --set policy.stack=S on a free port
                (subprocess, log in DIR/S/server.log)
    3 replay    /metrics, bench-serve of the trace (no idle probes: they
                would count), /metrics again      -> DIR/S/measured/,
                                                     metrics-before.prom,
                                                     metrics-after.prom
                the server is shut down (also on errors and Ctrl-C)
    4 simulate  the measured requests on the same emulated cluster, in the
                stack's world (fleetserve.experiments.parity_sim); an
                elastic pool's cluster.activation_s is the runtime's mean
                activation time over the replay   -> DIR/S/simulated/
    5 report    mechanism by mechanism: the /metrics delta against the
                simulated summary; latency measured vs simulated
                                                  -> DIR/parity.md, parity.json

``--analyze-only`` skips steps 2 and 3: it redoes the simulations and the
report from ``DIR``'s measurements (after a change to the simulator or to
the report).

The replay takes the same flags as ``fleetserve fidelity`` (the config's
workload, else the Azure conversation trace; ``--max-requests`` bounds it).
Without ``--profile`` the simulator runs on the uncalibrated emulated GPU
(its latencies then say little; its mechanism counts still depend on them).
The rows and what each side counts: :mod:`fleetserve.experiments.parity`,
``docs/parity-report.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetserve.cli.fidelity import (
    add_replay_flags,
    replay_metrics,
    replay_scraped,
    replay_settings,
    say,
    serving,
)
from fleetserve.config import SimConfig, load_config
from fleetserve.errors import ConfigError, FleetserveError, InputError, require_modules

PARITY_JSON = "parity.json"
PARITY_MD = "parity.md"


def _stack_configs(args: argparse.Namespace) -> list[tuple[str, SimConfig]]:
    """Each stack's config, checked as ``serve`` checks it (names, placement,
    KunServe mechanisms) and as the simulation will need it.

    Raises:
        FleetserveError: the first problem, naming the stack.
    """
    from fleetserve.cli.serve import load_serve_config
    from fleetserve.experiments.parity_sim import preflight_runtime_sim
    from fleetserve.runtime import cluster
    from fleetserve.runtime.kun_control import kun_settings
    from fleetserve.sim.multi_build import history_placement

    if not Path(args.config).is_file():
        raise InputError("config file not found", file=args.config)
    if "serve" not in load_config(args.config):
        raise InputError(
            "no serve: section; the parity report serves the config (e.g. configs/serve-tiny.yaml)",
            file=args.config,
        )
    base = load_serve_config(args.config, args.set)
    names = (
        [base.policy.stack]
        if args.stacks is None
        else [s.strip() for s in args.stacks.split(",") if s.strip()]
    )
    if not names:
        raise FleetserveError("--stacks names no stack")
    if len(set(names)) != len(names):
        raise FleetserveError(f"--stacks names a stack twice: {args.stacks}")
    out = []
    for name in names:
        try:
            cfg = load_serve_config(args.config, [*args.set, f"policy.stack={name}"])
            cluster.worker_specs(cfg, cluster.served_models(cfg), placer=history_placement)
            kun_settings(cfg)
            preflight_runtime_sim(cfg)
        except FleetserveError as exc:
            raise FleetserveError(f"stack {name!r} with {args.config}: {exc}") from None
        out.append((name, cfg))
    return out


def _check_profile(args: argparse.Namespace, stacks: list[tuple[str, SimConfig]]) -> Path | None:
    from fleetserve.experiments.fidelity import emulated_cost, emulated_gpu_for, served_models

    if args.profile is None:
        return None
    profile = Path(args.profile)
    if not profile.is_file():
        raise InputError("profile not found", file=str(profile))
    for _, cfg in stacks:  # the profile is checked before anything runs
        emulated_cost(cfg, profile, served_models(cfg), emulated_gpu_for(cfg))
    return profile


def _run_stack(
    args: argparse.Namespace,
    name: str,
    cfg: SimConfig,
    replay: Any,
    profile: Path | None,
    out: Path,
) -> dict[str, Any]:
    """Steps 2-5 for one stack; its record in ``parity.json``."""
    from fleetserve.experiments.fidelity import (
        fidelity_table,
        load_measured_requests,
        read_summary,
    )
    from fleetserve.experiments.parity import (
        activation_line,
        mechanism_rows,
        with_measured_activation,
    )
    from fleetserve.experiments.parity_sim import parity_context, simulate_runtime

    out.mkdir(parents=True, exist_ok=True)
    served = list(cfg.serve.model_names(cfg.model))
    overrides = [*args.set, f"policy.stack={name}"]
    if not args.analyze_only:
        with serving(cfg, args.config, overrides, out, args.startup_timeout) as srv:
            replay_scraped(cfg, srv.url, replay, out, served, ideal="none")
    delta = replay_metrics(out)
    if delta is None:
        raise InputError(
            "no /metrics scrapes (metrics-before.prom, metrics-after.prom)", file=str(out)
        )
    sim_cfg, activation = with_measured_activation(cfg, delta)
    measured = read_summary(out / "measured")
    r = measured["requests"]
    reqs = load_measured_requests(out / "measured")
    ctx = parity_context(cfg)
    say(f"[bold]simulate[/] {len(reqs)} measured requests ({ctx.world} world)")
    error = None
    try:
        sim = simulate_runtime(sim_cfg, profile, out / "simulated", reqs)
    except FleetserveError as exc:  # the report says so; the other stacks still run
        error = str(exc)
        say(f"[bold red]the simulation failed:[/] {error}")
        sim = {"requests": {}, "mechanisms": {}}
    calibrated = (
        f"calibrated from {profile}"
        if profile is not None
        else "uncalibrated emulated GPU (no --profile: its latencies say little)"
    )
    about = [
        f"runtime: `fleetserve serve {args.config} --set policy.stack={name}`"
        + "".join(f" --set {s}" for s in args.set)
        + f"; {r['total']} requests replayed ({r['finished']} finished)",
        f"simulator: {ctx.world} world, {calibrated}",
        activation_line(activation),
    ]
    if error is not None:
        about.append(f"the simulation failed: {error}")
    return {
        "stack": name,
        "world": ctx.world,
        "about": about,
        "activation": activation,
        "calibration": str(profile) if profile is not None else None,
        "simulation_error": error,
        "rows": mechanism_rows(delta, sim, ctx),
        "latency": fidelity_table(sim, measured, counts=True),
        "dirs": {"measured": str(out / "measured"), "simulated": str(out / "simulated")},
    }


def _write_report(out: Path, report: dict[str, Any]) -> None:
    from fleetserve.experiments.fidelity import fidelity_markdown
    from fleetserve.experiments.parity import parity_markdown, summary_markdown

    (out / PARITY_JSON).write_text(json.dumps(report, indent=1, default=str) + "\n")
    rp = report["replay"]
    lines = [
        "# Parity: each mechanism on the runtime and in the simulator",
        "",
        "```",
        report["command"],
        *([] if report["analyzed"] is None else [report["analyzed"]]),
        "```",
        "",
        f"Replay: up to {rp['max_requests']} requests of `{rp['trace']}`, rate "
        f"x{rp['rate_scale']:g}, lengths x{rp['length_scale']:g}, caps prompt "
        f"{rp['max_prompt_tokens']} / output {rp['max_output_tokens']} tokens. Runtime "
        "column: the server's /metrics after the replay minus before it; simulator column: "
        "the same requests simulated on the same emulated cluster (`simulated/summary.json`).",
        "",
        summary_markdown(report["stacks"]),
    ]
    for st in report["stacks"]:
        title = f"Latency and requests of {st['stack']}: simulated vs measured"
        lines.append(parity_markdown(st, fidelity_markdown(st["latency"], title)))
    (out / PARITY_MD).write_text("\n".join(lines))


def _print_stack(console: Console, st: dict[str, Any]) -> None:
    from fleetserve.experiments.parity import footnoted

    body, notes = footnoted(st["rows"])
    t = Table(title=f"{st['stack']} ({st['world']} world): runtime vs simulator")
    t.add_column("mechanism")
    t.add_column("runtime (/metrics delta)", justify="right")
    t.add_column("simulator", justify="right")
    for row in body:
        t.add_row(*row)
    console.print(t)
    for i, n in enumerate(notes, 1):
        console.print(f"  [{i}] {n}", highlight=False, markup=False)


def cmd_parity(args: argparse.Namespace, console: Console) -> int:
    """Run ``fleetserve parity`` (module docstring)."""
    require_modules("parity", "runtime", "torch", "ray", "fastapi", "uvicorn", "httpx")
    require_modules("parity", "runtime", "prometheus_client")
    stacks = _stack_configs(args)
    profile = _check_profile(args, stacks)
    replay = replay_settings(stacks[0][1], args.config, args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file")
    if args.analyze_only and not out.is_dir():
        raise InputError("no such result directory (--analyze-only)", file=str(out))
    out.mkdir(parents=True, exist_ok=True)
    command = "fleetserve " + " ".join(sys.argv[1:]) if sys.argv else ""
    analyzed = None
    if args.analyze_only and (out / PARITY_JSON).is_file():  # the measuring command stays
        analyzed, command = command, json.loads((out / PARITY_JSON).read_text())["command"]
    report: dict[str, Any] = {
        "command": command,
        "analyzed": analyzed,
        "config": args.config,
        "replay": replay.to_dict(),
        "calibration": str(profile) if profile is not None else None,
        "stacks": [],
    }
    for i, (name, cfg) in enumerate(stacks, 1):
        say(f"[bold]stack {name}[/] ({i} of {len(stacks)})")
        report["stacks"].append(_run_stack(args, name, cfg, replay, profile, out / name))
        _write_report(out, report)  # after every stack: a later failure keeps these
    from fleetserve.experiments.parity import summary_rows

    for st in report["stacks"]:
        _print_stack(console, st)
    header, body = summary_rows(report["stacks"])
    # one column per stack: a console is narrower than the markdown table
    t = Table(title="Parity over stacks: runtime / simulator (latency: measured / simulated)")
    t.add_column("")
    for row in body:
        t.add_column(row[0], justify="right")
    for i, h in enumerate(header[1:], 1):
        t.add_row(h, *(row[i] for row in body))
    console.print(t)
    failed = [st["stack"] for st in report["stacks"] if st["simulation_error"]]
    console.print(
        f"results in {out} ({PARITY_MD}, {PARITY_JSON}, one folder per stack)"
        + (f"; the simulation failed for {', '.join(failed)}" if failed else ""),
        highlight=False,
    )
    return 1 if failed else 0


def add_parity_parser(sub: Any) -> None:
    """The ``parity`` subcommand."""
    p = sub.add_parser(
        "parity",
        help="serve, replay and simulate each stack; each mechanism's counts side by side",
        description="For each stack: serve CONFIG, replay a bounded trace between two /metrics "
        "scrapes, simulate the same requests on the emulated cluster, and tabulate each "
        "mechanism's counts (migrations, preemptions, activations, KunServe drops and "
        "restores, prefix hits) and the latencies side by side.",
    )
    p.add_argument("config", help="YAML config with a serve: section (CPU workers)")
    p.add_argument("--out", required=True, help="result directory")
    p.add_argument(
        "--stacks",
        help="comma-separated stacks to run the config under (default: its policy.stack)",
    )
    p.add_argument(
        "--profile",
        help="engine profile CSV (fleetserve profile-engine) to calibrate the simulation "
        "(default: the uncalibrated emulated GPU)",
    )
    add_replay_flags(p)
    p.add_argument(
        "--analyze-only",
        action="store_true",
        help="serve nothing: redo the simulations and the report from OUT's measurements",
    )
    p.set_defaults(func=cmd_parity)
