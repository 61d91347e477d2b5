"""The ``fleetserve`` command line.

Errors caused by input (bad traces, unknown names, configs that cannot fit)
print one line and exit with status 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetserve import __version__
from fleetserve.config import SimConfig, apply_override, config_from_dict, load_config
from fleetserve.errors import FleetserveError, require_modules
from fleetserve.sim.build import Workload, build_workload
from fleetserve.sim.simulator import preflight

logger = logging.getLogger(__name__)


def _add_sim_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="trace file (relative to the working directory)")
    p.add_argument("--format", help="trace format: azure, mooncake, burstgpt, lengths, jsonl")
    p.add_argument("--rate", type=float, help="arrival rate for 'lengths' traces (req/s)")
    p.add_argument("--model", help="model catalog name or HuggingFace config.json path")
    p.add_argument("--gpu", help="GPU catalog name, e.g. a100-40gb")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--gpus", type=int, help="fixed pool of N GPUs")
    pool.add_argument("--elastic", action="store_true", help="elastic GPU pool (Mell's model)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree of each instance")
    for fam in ("dispatch", "migration", "batching", "placement", "memory"):
        p.add_argument(f"--{fam}", help=f"{fam} policy (overrides the stack's)")
    p.add_argument("--length-scale", type=float, help="multiply prompt/output lengths (Mell: 10)")
    p.add_argument("--rate-scale", type=float, help="multiply the arrival rate")
    p.add_argument("--max-requests", type=int, help="keep the first N requests")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    p.add_argument("--out", required=True, help="result directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _config_dict(args: argparse.Namespace) -> tuple[dict[str, Any], Path | None]:
    data = load_config(args.config)
    base = Path(args.config).resolve().parent if args.config else None
    wl = data.setdefault("workload", {})
    cl = data.setdefault("cluster", {})
    pol = data.setdefault("policy", {})
    if args.trace is not None:
        wl["trace"] = str(Path(args.trace).resolve())
        wl.pop("format", None)
    if args.format is not None:
        wl["format"] = args.format
    for flag, key in (
        ("rate", "rate"),
        ("length_scale", "length_scale"),
        ("rate_scale", "rate_scale"),
        ("max_requests", "max_requests"),
    ):
        if getattr(args, flag) is not None:
            wl[key] = getattr(args, flag)
    if args.model is not None:
        data["model"] = args.model
    if args.gpu is not None:
        cl["gpu"] = args.gpu
    if args.tp is not None:
        cl["tp"] = args.tp
    if args.gpus is not None:
        cl["gpus"] = args.gpus
        cl["elastic"] = False
    if args.elastic:
        cl["elastic"] = True
    for fam in ("stack", "dispatch", "migration", "batching", "placement", "memory"):
        v = getattr(args, fam, None)
        if v is not None:
            pol[fam] = v
    if args.seed is not None:
        data["seed"] = args.seed
    for s in args.set:
        apply_override(data, s)
    if args.trace is not None and args.format is None and "format" not in wl:
        from fleetserve.workload import detect_format

        wl["format"] = detect_format(args.trace)
    return data, base


def _run_one(
    console: Console, cfg: SimConfig, wl: Workload, out: Path, label: str, show: bool
) -> tuple[dict[str, Any], Any]:
    from fleetserve.experiments.runner import simulate_and_write

    from .progress import sim_progress

    horizon = wl.requests[-1].arrival_s if wl.requests else 0.0
    if show:
        with sim_progress(console, label, horizon, len(wl.requests)) as cb:
            return simulate_and_write(cfg, wl, out, cb)
    return simulate_and_write(cfg, wl, out)


def _summary_table(summary: dict[str, Any], title: str) -> Table:
    t = Table(title=title, show_header=False)
    r = summary["requests"]
    g = summary["gpus"]
    lat = summary["latency_s"]

    def f(x: Any, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    t.add_row(
        "requests",
        f"{r['total']} total, {r['finished']} finished, "
        f"{r['rejected']} rejected, {r['unfinished']} unfinished",
    )
    lb = g.get("lower_bound")
    t.add_row(
        "GPUs",
        f"peak {g['peak']}, mean {f(g['mean'], '.2f')}, "
        f"{f(g['gpu_hours'], '.2f')} GPU-h" + (f", lower bound {lb}" if lb else ""),
    )
    for k in ("ttft", "tpot", "e2e"):
        t.add_row(
            f"{k.upper()} (s)",
            f"p50 {f(lat[k]['p50'])}  p99 {f(lat[k]['p99'])}  mean {f(lat[k]['mean'])}",
        )
    t.add_row("normalized latency", f(summary["normalized_latency"]))
    t.add_row("KV utilization", f(summary["kv_utilization"]["mean"], ".1%"))
    t.add_row(
        "throughput",
        f"{f(summary['throughput_rps'], '.2f')} req/s, "
        f"{f(summary['throughput_tokens_s'], ',.0f')} tok/s",
    )
    sim = summary.get("sim") or {}
    if sim:
        t.add_row("simulation", f"{sim['events']:,} events in {sim['wall_s']:.2f} s wall")
    return t


def cmd_simulate(args: argparse.Namespace, console: Console) -> int:
    data, base = _config_dict(args)
    cfg = config_from_dict(data, args.config)
    preflight(cfg)
    wl = build_workload(cfg, base)
    for n in wl.notes:
        console.print(f"[yellow]note:[/] {n}")
    out = Path(args.out)
    summary, _ = _run_one(console, cfg, wl, out, cfg.policy.stack, not args.no_progress)
    console.print(_summary_table(summary, f"{cfg.policy.stack} — {wl.source}"))
    console.print(f"results in [bold]{out}[/] (summary.json, requests.csv, plots, report.md)")
    return 0


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    from fleetserve.metrics import comparison_rows, comparison_table, write_comparison

    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    if not stacks:
        raise FleetserveError("--stacks needs at least one stack name")
    data, base = _config_dict(args)
    cfgs = []
    for s in stacks:
        d = {**data, "policy": {**data.get("policy", {}), "stack": s}}
        cfgs.append(config_from_dict(d, args.config))
        preflight(cfgs[-1])  # every stack is checked before anything runs
    wl = build_workload(cfgs[0], base)
    for n in wl.notes:
        console.print(f"[yellow]note:[/] {n}")
    out = Path(args.out)
    named = {}
    for s, cfg in zip(stacks, cfgs, strict=True):
        named[s] = _run_one(console, cfg, wl, out / s, s, not args.no_progress)
    write_comparison(out, named)
    rows = comparison_rows({s: v[0] for s, v in named.items()})
    console.print(comparison_table(rows, f"{', '.join(stacks)} — {wl.source}"))
    console.print(f"results in [bold]{out}[/] (comparison.md, plots; one folder per stack)")
    return 0


def cmd_trace_inspect(args: argparse.Namespace, console: Console) -> int:
    from fleetserve.workload import load_trace, stats_table, trace_stats

    loaded = load_trace(args.file, args.format, rate=args.rate)
    stats = trace_stats(list(loaded.requests))
    console.print(stats_table(stats, f"{args.file} ({loaded.fmt})"))
    if loaded.skipped:
        console.print(
            f"[yellow]skipped {len(loaded.skipped)} rows[/], first: "
            f"line {loaded.skipped[0].line}: {loaded.skipped[0].reason}"
        )
    return 0


def _default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


def _reproduce_table(report: dict[str, Any]) -> Table:
    """Peak GPUs per hardware, workload and stack, from ``results.json`` content."""
    stacks = [s["label"] for s in report["stacks"]]
    peak = {(r["hardware"], r["workload"], r["stack"]): r["gpus_peak"] for r in report["runs"]}
    t = Table(title="Peak GPUs (Mell Fig. 11); — = not run")
    t.add_column("hardware")
    t.add_column("workload")
    for s in stacks:
        t.add_column(s, justify="right")
    for hw in report["hardware"]:
        for wl in report["workloads"]:
            cells = [peak.get((hw["name"], wl["name"], s)) for s in stacks]
            t.add_row(hw["label"], wl["label"], *("—" if c is None else str(c) for c in cells))
    return t


def _claims_table(report: dict[str, Any]) -> Table:
    t = Table(title="What the paper reports vs what we measured")
    for col in ("claim", "paper", "measured", "reproduces?"):
        t.add_column(col)
    for c in report["claims"]:
        t.add_row(c["claim"], c["paper"], c["measured"], c["reproduces"])
    return t


def _rows_table(spec: dict[str, Any]) -> Table:
    """A rich table from ``{"title", "columns", "rows"}`` (a multi-LLM report's ``table``)."""
    t = Table(title=spec["title"])
    for i, col in enumerate(spec["columns"]):
        t.add_column(col, justify="left" if i < 2 else "right", no_wrap=i < 2)
    for row in spec["rows"]:
        t.add_row(*row)
    return t


def _fleet_tables(spec: dict[str, Any]) -> list[Table]:
    """``reproduce fleet``'s table as one narrow table per scenario (the
    ratios to vllm are left to report.md, so it fits an 80-column terminal)."""
    cols = list(spec["columns"])
    keep = [i for i, c in enumerate(cols) if c not in ("scenario", "x")]
    out: list[Table] = []
    by: dict[str, list[list[str]]] = {}
    for row in spec["rows"]:
        by.setdefault(row[0], []).append(row)
    for scenario, rows in by.items():
        t = Table(title=f"{scenario}: {spec['title']}".replace("; x = relative to vllm", ""))
        for n, i in enumerate(keep):
            t.add_column(cols[i], justify="left" if n == 0 else "right", no_wrap=n == 0)
        for row in rows:
            t.add_row(*(row[i] for i in keep))
        out.append(t)
    return out


def _overridden(specs: list[Any], overrides: Sequence[str] | None) -> list[Any]:
    """The grid's runs with ``--set`` overrides applied to every config, each
    checked before anything runs (a key no run's simulator reads is an error)."""
    if not overrides:
        return specs
    import copy
    import dataclasses

    from fleetserve.policy.catalog import check_world

    out = []
    for spec in specs:
        cfg = copy.deepcopy(spec.config)
        for a in overrides:
            apply_override(cfg, a)
        try:
            check_world(config_from_dict(cfg))
        except FleetserveError as e:
            raise FleetserveError(f"--set on run {spec.key}: {e}") from None
        out.append(dataclasses.replace(spec, config=cfg))
    return out


def _run_specs(
    console: Console,
    specs: list[Any],
    jobs: int,
    show: bool,
    overrides: Sequence[str] | None = None,
    out: Path | None = None,
) -> tuple[float, list[Any]]:
    """Run a grid with progress bars (``--set`` overrides applied to every run);
    ``(wall seconds, failed outcomes)``."""
    from fleetserve.experiments.progress import grid_progress
    from fleetserve.experiments.runner import run_grid

    specs = _overridden(specs, overrides)
    if overrides and out is not None:  # checked: record them in the output folder
        out.mkdir(parents=True, exist_ok=True)
        (out / "overrides.txt").write_text("\n".join(overrides) + "\n", encoding="utf-8")
    t0 = time.perf_counter()
    if show:
        with grid_progress(console, len(specs)) as listener:
            outcomes = run_grid(specs, jobs, listener)
    else:
        outcomes = run_grid(specs, jobs)
    return time.perf_counter() - t0, [o for o in outcomes if o.error is not None]


def _report_failures(failed: Sequence[Any]) -> int:
    if not failed:
        return 0
    err = Console(stderr=True)
    for o in failed:
        err.print(
            f"[bold red]failed:[/] {o.key}: {o.error} (see {o.out_dir / 'error.txt'})",
            highlight=False,
            soft_wrap=True,
        )
    return 1


def _reproduce_multi(
    args: argparse.Namespace,
    console: Console,
    jobs: int,
    stacks: list[str] | None,
    out: Path,
) -> int:
    """``fleetserve reproduce seallm|muxserve``."""
    from fleetserve.experiments.multi_llm import Mode, get_experiment, plan
    from fleetserve.experiments.multi_llm_report import write_report

    exp = get_experiment(args.experiment)
    mode = Mode(quick=args.quick, scale=args.scale, seed=args.seed)
    wall: float | None = None
    failed: list[Any] = []
    if args.report_only:
        _require_runs(out)
    else:
        exp, specs = plan(exp.name, out, mode, stacks)
        sizes = mode.sizes(exp)
        console.print(
            f"{exp.name} ({mode.name}): {len(specs)} runs, {sizes.duration_s:g} s each after "
            f"a {sizes.history_s:g} s history, {jobs} jobs",
            highlight=False,
        )
        wall, failed = _run_specs(console, specs, jobs, not args.no_progress, args.set, out)
    files, report = write_report(out, exp, mode, wall_s=wall, jobs=jobs)
    _print_grid_report(console, exp.name, report, files, wall, out)
    return _report_failures(failed)


def _print_grid_report(
    console: Console,
    name: str,
    report: dict[str, Any],
    files: Sequence[Path],
    wall: float | None,
    out: Path,
) -> None:
    """The per-run table, the claims check, notes and where the files are."""
    console.print(_rows_table(report["table"]))
    console.print(_claims_table(report))
    _print_notes_and_files(console, name, report, files, wall, out)


def _print_notes_and_files(
    console: Console,
    name: str,
    report: dict[str, Any],
    files: Sequence[Path],
    wall: float | None,
    out: Path,
) -> None:
    """A reproduction's notes, its wall time and where its files are."""
    for note in report["notes"]:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    took = f" in {wall:.1f} s" if wall is not None else ""
    console.print(
        f"{name} {report['mode']['name']} run{took}; results in [bold]{out}[/] "
        f"({', '.join(p.name for p in files)}; runs/ holds every run)"
    )


def _require_runs(out: Path) -> None:
    """``--report-only`` needs the runs of an earlier invocation."""
    if not (out / "runs").is_dir():
        raise FleetserveError(f"{out}: no runs/ folder to report on (run without --report-only)")


# --- reproduce kunserve (begin) ---------------------------------------------------------
def _reproduce_kunserve(
    args: argparse.Namespace,
    console: Console,
    jobs: int,
    stacks: list[str] | None,
    out: Path,
) -> int:
    """``fleetserve reproduce kunserve``."""
    from fleetserve.experiments.kunserve import Mode, plan, provision
    from fleetserve.experiments.kunserve_report import write_report

    mode = Mode(quick=args.quick, scale=args.scale, seed=args.seed)
    wall: float | None = None
    failed: list[Any] = []
    if args.report_only:
        _require_runs(out)
        provisions = provision(out, mode, probe=False)
    else:
        t0 = time.perf_counter()
        specs, provisions = plan(out, mode, stacks)
        probe_s = time.perf_counter() - t0
        sizes = mode.sizes()
        kv = ", ".join(f"{p.profile} {p.kv_tokens:,}" for p in provisions.values())
        console.print(
            f"kunserve ({mode.name}): KV tokens per instance (provisioned in {probe_s:.1f} s): "
            f"{kv}; {len(specs)} runs, {sizes.duration_s:g} s of arrivals each, {jobs} jobs",
            highlight=False,
        )
        wall, failed = _run_specs(console, specs, jobs, not args.no_progress, args.set, out)
        wall += probe_s
    files, report = write_report(out, mode, provisions, wall_s=wall, jobs=jobs)
    _print_grid_report(console, "kunserve", report, files, wall, out)
    return _report_failures(failed)


# --- reproduce kunserve (end) -----------------------------------------------------------


def _reproduce_fleet(
    args: argparse.Namespace,
    console: Console,
    jobs: int,
    stacks: list[str] | None,
    out: Path,
) -> int:
    """``fleetserve reproduce fleet``."""
    from fleetserve.experiments.fleet import Mode, plan
    from fleetserve.experiments.fleet_report import write_report

    mode = Mode(quick=args.quick, scale=args.scale, seed=args.seed)
    wall: float | None = None
    failed: list[Any] = []
    notes: list[str] = []
    if args.report_only:
        _require_runs(out)
    else:
        specs, notes = plan(out, mode, stacks)
        sizes = mode.sizes()
        console.print(
            f"fleet ({mode.name}): {len(specs)} runs (bursty {sizes.duration_s:g} s, trace "
            f"[0, {sizes.end_s:g}) s, each after a {sizes.history_s:g} s placement history), "
            f"{jobs} jobs",
            highlight=False,
        )
        wall, failed = _run_specs(console, specs, jobs, not args.no_progress, args.set, out)
    files, report = write_report(out, mode, wall_s=wall, jobs=jobs, extra_notes=notes)
    for t in _fleet_tables(report["table"]):
        console.print(t)
    found = report["findings"]
    tally = {v: sum(f["verdict"] == v for f in found) for v in ("win", "loss", "tie")}
    console.print(
        f"composed stacks vs vllm and the stacks they compose: {tally['win']} wins, "
        f"{tally['loss']} losses, {tally['tie']} no difference (ratios in report.md)",
        highlight=False,
    )
    for verdict, tag in (("win", "[green]wins:[/]"), ("loss", "[yellow]loses:[/]")):
        grouped: dict[tuple[str, str, str], list[str]] = {}
        for f in found:
            if f["verdict"] == verdict:
                key = (f["scenario"], f["stack"], f["baseline"])
                grouped.setdefault(key, []).append(f"{f['metric']} {f['change']}")
        for (scenario, stack, baseline), what in grouped.items():
            console.print(
                f"{tag} {scenario}: {stack} vs {baseline}: {', '.join(what)}", highlight=False
            )
    _print_notes_and_files(console, "fleet", report, files, wall, out)
    return _report_failures(failed)


def cmd_reproduce(args: argparse.Namespace, console: Console) -> int:
    from fleetserve.experiments import check_experiment

    check_experiment(args.experiment)
    if not args.scale > 0:
        raise FleetserveError(f"--scale must be positive, got {args.scale}")
    jobs = args.jobs if args.jobs is not None else _default_jobs()
    if jobs < 1:
        raise FleetserveError(f"--jobs must be at least 1, got {jobs}")
    stacks = None
    if args.stacks is not None:
        stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    out = Path(args.out)
    if args.set and not args.report_only:
        console.print(
            f"[yellow]note:[/] every run with --set {' '.join(args.set)} (not the paper's "
            "setup unless it says so; each run's summary.json has its config)",
            highlight=False,
        )
    if args.experiment == "kunserve":
        return _reproduce_kunserve(args, console, jobs, stacks, out)
    if args.experiment == "fleet":
        return _reproduce_fleet(args, console, jobs, stacks, out)
    if args.experiment != "mell":
        return _reproduce_multi(args, console, jobs, stacks, out)

    from fleetserve.experiments.mell import Mode, plan_mell
    from fleetserve.experiments.mell_report import write_report

    mode = Mode(quick=args.quick, scale=args.scale, seed=args.seed)
    wall: float | None = None
    failed: list[Any] = []
    if args.report_only:
        _require_runs(out)
    else:
        specs = plan_mell(out, mode, stacks)
        console.print(
            f"mell ({mode.name}): {len(specs)} runs, arrivals in the first "
            f"{mode.window_s:g} s of each workload, {jobs} jobs"
        )
        wall, failed = _run_specs(console, specs, jobs, not args.no_progress, args.set, out)
    files, report = write_report(out, mode, wall_s=wall, jobs=jobs)
    console.print(_reproduce_table(report))
    console.print(_claims_table(report))
    for note in report["notes"]:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    took = f" in {wall:.1f} s" if wall is not None else ""
    console.print(
        f"{report['mode']['name']} run{took}; results in [bold]{out}[/] "
        f"({', '.join(p.name for p in files)}; runs/ holds every run)"
    )
    return _report_failures(failed)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; a clear error for anything else."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        values = tuple(int(t) for t in items)
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise FleetserveError(
            f"{flag} expects comma-separated integers >= 1, e.g. 1,2,4; got {text!r}"
        )
    return values


@contextmanager
def _points_progress(
    console: Console, label: str, total: int, show: bool
) -> Iterator[Callable[[int, int, str], None] | None]:
    """A rich bar over ``total`` points, as a ``progress(done, total, label)`` callback."""
    if not show:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} {task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(label, total=max(total, 1), info="")

        def advance(done: int, n: int, what: str) -> None:
            bar.update(task, completed=done, total=n, info=what)

        yield advance


def cmd_profile_engine(args: argparse.Namespace, console: Console) -> int:
    require_modules("profile-engine", "engine", "torch")
    from fleetserve.runtime.engine import profiler

    device = args.device.strip().lower()
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise FleetserveError(f"--device expects cpu, cuda or cuda:N; got {args.device!r}")
    dtype = profiler.DTYPES.get(args.dtype.strip().lower())
    if dtype is None:
        raise FleetserveError(
            f"--dtype expects one of {', '.join(profiler.DTYPES)}; got {args.dtype!r}"
        )
    base = profiler.QUICK_GRID if args.quick else profiler.DEFAULT_GRID
    for flag, value, least in (("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0)):
        if value is not None and value < least:
            raise FleetserveError(f"{flag} must be >= {least}, got {value}")
    grid = profiler.ProfileGrid(
        batch_sizes=base.batch_sizes
        if args.batch_sizes is None
        else _int_list(args.batch_sizes, "--batch-sizes"),
        context_lengths=base.context_lengths
        if args.context_lengths is None
        else _int_list(args.context_lengths, "--context-lengths"),
        prompt_lengths=base.prompt_lengths
        if args.prompt_lengths is None
        else _int_list(args.prompt_lengths, "--prompt-lengths"),
        repeats=base.repeats if args.repeats is None else args.repeats,
        warmup=base.warmup if args.warmup is None else args.warmup,
        max_prefill_tokens=args.max_prefill_tokens,
    )
    arena = None
    if args.arena_gib is not None:
        if not args.arena_gib > 0:
            raise FleetserveError(f"--arena-gib must be positive, got {args.arena_gib}")
        arena = int(args.arena_gib * 2**30)
    if args.block_size < 1:
        raise FleetserveError(f"--block-size must be >= 1, got {args.block_size}")
    gpu_name = args.gpu_name
    if gpu_name is not None:
        gpu_name = gpu_name.strip().lower()
        if not gpu_name or "," in gpu_name:
            raise FleetserveError("--gpu-name must be a non-empty name without commas")
        from fleetserve.spec import GPUS

        if gpu_name not in GPUS:
            console.print(
                f"[yellow]note:[/] {gpu_name!r} is not a catalog GPU; calibrate() with "
                "fleetserve.spec.get_gpu will not resolve it",
                highlight=False,
            )
    if args.threads is not None:
        if args.threads < 1:
            raise FleetserveError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out)
    t0 = time.perf_counter()
    engine = profiler.build_engine(
        args.model,
        grid,
        device=device,
        dtype=dtype,
        arena_bytes=arena,
        block_size=args.block_size,
    )
    label = f"profile {next(iter(engine.models))}"
    with _points_progress(console, label, grid.points, not args.no_progress) as cb:
        result = profiler.profile_engine(
            engine, grid, gpu_name=gpu_name, seed=args.seed, progress=cb
        )
    profiler.save_profile(out, result)
    peak = profiler.throughput_summary(result.rows)
    rates = ", ".join(f"peak {phase} {rate:,.0f} tok/s" for phase, rate in peak.items())
    n_pre = sum(r.phase == "prefill" for r in result.rows)
    skipped = f", {len(result.skipped)} skipped" if result.skipped else ""
    console.print(
        f"{len(result.rows)} rows ({n_pre} prefill, {len(result.rows) - n_pre} decode{skipped}) "
        f"in {time.perf_counter() - t0:.1f} s; {rates}; gpu={result.rows[0].gpu}; "
        f"profile in [bold]{out}[/]",
        highlight=False,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="fleetserve", description="Serve many LLMs on a GPU fleet: simulate and compare."
    )
    parser.add_argument("--version", action="version", version=f"fleetserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="simulate one stack on a workload")
    sim.add_argument("config", nargs="?", help="YAML config (optional)")
    sim.add_argument(
        "--stack",
        help="policy stack: vllm, bf, wf, ll, llumnix, mell; with services, multi.generator "
        "or fleet.generator in the config (multi-LLM): vllm, alpaserve, muxserve, seallm, "
        "seallm-fcfs, seallm-mlfq, seallm-noplace, seallm-norepl, seallm-adaptive, "
        "muxserve-fcfs, muxserve-rr; KunServe: kunserve, kv-drop, kv-swap, pipeline, ... "
        "(all, with the worlds each runs in: fleetserve stacks)",
    )
    _add_sim_flags(sim)
    sim.set_defaults(func=cmd_simulate)

    cmp_ = sub.add_parser("compare", help="several stacks on the same workload")
    cmp_.add_argument("config", nargs="?", help="YAML config")
    cmp_.add_argument("--stacks", required=True, help="comma-separated stacks, e.g. bf,wf,vllm")
    _add_sim_flags(cmp_)
    cmp_.set_defaults(func=cmd_compare)

    rep = sub.add_parser("reproduce", help="re-run a paper's headline experiment")
    rep.add_argument(
        "experiment", help="experiment name: mell, seallm, muxserve, kunserve or fleet"
    )
    rep.add_argument(
        "--quick",
        action="store_true",
        help="reduced run (mell: 10-minute windows; seallm/muxserve/kunserve: fewer points "
        "and shorter runs; fleet: 5-minute workloads; each under 2 minutes on 2 cores)",
    )
    rep.add_argument("--out", required=True, help="output folder")
    rep.add_argument("--jobs", type=int, help="parallel simulations (default: CPU count)")
    rep.add_argument(
        "--stacks",
        help="comma-separated subset, e.g. bf,wf (default: every stack of the experiment; "
        "mell: bf,wf,llumnix,mell,mell-nobatch; seallm: vllm,alpaserve,muxserve,seallm,"
        "seallm-fcfs,seallm-mlfq,seallm-noplace,seallm-norepl; muxserve: vllm,alpaserve,"
        "muxserve,muxserve-rr,muxserve-fcfs; kunserve: wf,kv-drop,kv-swap,llumnix,pipeline,"
        "kunserve,kunserve-blocking,kunserve-norestore,kunserve-memgreedy; fleet: vllm,"
        "vllm-elastic,seallm,muxserve,seallm-mell,muxserve-mell (+ fleet once the catalog "
        "has it; any multi-LLM stack may be named))",
    )
    rep.add_argument("--seed", type=int, default=0, help="base random seed (default 0)")
    rep.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the tables (table.md; fleet: report.md), results and figures from "
        "OUT/runs without simulating (give --quick if the runs were quick)",
    )
    rep.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config field of every run (repeatable), e.g. "
        "cluster.intra_node_bw=32000000000; written to OUT/overrides.txt",
    )
    rep.add_argument("--no-progress", action="store_true", help="no progress bars")
    # Test-only: multiply the arrival windows / run lengths (e.g. 0.02 for a seconds-long
    # smoke run).
    rep.add_argument("--scale", type=float, default=1.0, help=argparse.SUPPRESS)
    rep.set_defaults(func=cmd_reproduce)

    prof = sub.add_parser(
        "profile-engine",
        help="measure the engine's prefill/decode iteration times (cost-model profile CSV)",
    )
    prof.add_argument("--model", required=True, help="built-in engine model or checkpoint folder")
    prof.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    prof.add_argument("--dtype", default="float32", help="float32 (default), float16 or bfloat16")
    prof.add_argument("--batch-sizes", help="comma-separated batch sizes (default 1,2,4,8,16,32)")
    prof.add_argument(
        "--context-lengths",
        help="decode context per sequence, incl. the new token (default 64,256,1024)",
    )
    prof.add_argument("--prompt-lengths", help="prefill prompt lengths (default 32,128,512)")
    prof.add_argument("--repeats", type=int, help="timed iterations per point (default 5)")
    prof.add_argument("--warmup", type=int, help="untimed iterations per point (default 1)")
    prof.add_argument(
        "--max-prefill-tokens",
        type=int,
        help="leave out prefill points of more tokens (batch x prompt) than this, e.g. the "
        "served engine's max_batch_tokens (default: no cap)",
    )
    prof.add_argument(
        "--gpu-name",
        help="the CSV's gpu column; a GPU catalog name to calibrate from it "
        "(default: detected on CUDA, 'cpu' on the CPU)",
    )
    prof.add_argument(
        "--arena-gib",
        type=float,
        help="engine arena (weights + KV) in GiB (default: enough for the grid, "
        "capped by free memory)",
    )
    prof.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    prof.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    prof.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens")
    prof.add_argument(
        "--quick",
        action="store_true",
        help="tiny grid (batch 1,2; context 16,40; prompt 8,24; 2 repeats); flags override it",
    )
    prof.add_argument("--no-progress", action="store_true", help="no progress bar")
    prof.add_argument("--out", required=True, help="profile CSV to write")
    prof.set_defaults(func=cmd_profile_engine)

    from fleetserve.cli.bench import add_bench_serve_parser
    from fleetserve.cli.calibrate import add_calibrate_parser, add_validate_parser
    from fleetserve.cli.fidelity import add_fidelity_parser
    from fleetserve.cli.parity import add_parity_parser
    from fleetserve.cli.plan import add_plan_parser
    from fleetserve.cli.serve import add_serve_parser
    from fleetserve.cli.stacks import add_stacks_parser
    from fleetserve.cli.tokenizer import add_tokenizer_parser

    add_serve_parser(sub)
    add_bench_serve_parser(sub)
    add_fidelity_parser(sub)
    add_parity_parser(sub)
    add_tokenizer_parser(sub)
    add_stacks_parser(sub)
    add_calibrate_parser(sub)
    add_validate_parser(sub)
    add_plan_parser(sub)

    trace = sub.add_parser("trace", help="trace utilities")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
    insp = tsub.add_parser("inspect", help="rows, span, rate, inter-arrival CV, lengths")
    insp.add_argument("file")
    insp.add_argument("--format", help="trace format (detected when omitted)")
    insp.add_argument("--rate", type=float, help="arrival rate for 'lengths' files")
    insp.set_defaults(func=cmd_trace_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fleetserve`` executable."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    console = Console()
    err = Console(stderr=True)
    try:
        return int(args.func(args, console))
    except FleetserveError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
