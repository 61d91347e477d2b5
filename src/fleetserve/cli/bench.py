"""``fleetserve bench-serve``: replay a trace against an OpenAI-compatible server.

Only argument parsing and terminal output live here; the load generator is
:mod:`fleetserve.runtime.bench_serve` (no torch). Like every command, bad input
raises :class:`~fleetserve.errors.FleetserveError`, which ``fleetserve``'s
``main()`` prints as one ``error: ...`` line with exit status 2.

There is no ``--time-scale``: compressing the trace's inter-arrival times by X is
exactly ``--rate-scale X`` (the simulator's flag, kept so both commands read alike).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from fleetserve.errors import FleetserveError, require_modules

if TYPE_CHECKING:
    from fleetserve.runtime.bench_serve import BenchConfig, ProgressFn

API_KEY_ENV = "FLEETSERVE_API_KEY"
"""Environment variable read when ``--api-key`` is not given."""


def _csv(text: str, flag: str, kind: type[int] | type[float]) -> tuple[Any, ...]:
    """``"1,2"`` -> ``(1, 2)`` of ``kind``; a clear error for anything else."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        values = tuple(kind(t) for t in items)
    except ValueError:
        values = ()
    if not values:
        what = "integers" if kind is int else "numbers"
        raise FleetserveError(f"{flag} expects comma-separated {what}, e.g. 16,128; got {text!r}")
    return values


def parse_token_range(text: str) -> tuple[int, int]:
    """``"0..255"`` (inclusive) -> ``(0, 255)``."""
    lo, sep, hi = text.partition("..")
    try:
        if not sep:
            raise ValueError
        bounds = (int(lo), int(hi))
    except ValueError:
        raise FleetserveError(
            f"--token-range expects LOW..HIGH (inclusive integers), e.g. 0..255; got {text!r}"
        ) from None
    return bounds


def add_bench_serve_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``bench-serve`` subcommand to ``fleetserve``'s subparsers.

    Returns:
        The subcommand's parser (its ``func`` default is :func:`cmd_bench_serve`).
    """
    p = sub.add_parser(
        "bench-serve",
        help="replay a trace against an OpenAI-compatible server and measure it",
        description="Replay a trace open-loop against an OpenAI-compatible server "
        "(POST /v1/completions, streamed) and write summary.json in the simulator's schema.",
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", required=True, help="trace file")
    p.add_argument("--format", help="trace format: azure, mooncake, burstgpt, lengths, jsonl")
    p.add_argument("--rate", type=float, help="arrival rate for 'lengths' traces (req/s)")
    p.add_argument("--start-s", type=float, help="keep arrivals from this time (s) on")
    p.add_argument("--end-s", type=float, help="keep arrivals before this time (s)")
    p.add_argument("--max-requests", type=int, help="keep the first N requests")
    p.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="multiply the arrival rate: arrival times are divided by X (this is also the "
        "time scale: 10 replays a 10-minute trace in one minute)",
    )
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt/output lengths")
    p.add_argument("--max-prompt-tokens", type=int, help="cap prompt lengths (tiny models)")
    p.add_argument("--max-output-tokens", type=int, help="cap output lengths")
    p.add_argument(
        "--model",
        help="served model name(s), comma-separated (default: the trace's names if the "
        "server serves them, else the server's first model from GET /v1/models)",
    )
    p.add_argument("--model-weights", help="comma-separated popularity of the --model names")
    p.add_argument(
        "--token-range",
        default="0..255",
        help="inclusive range of the random prompt token ids (default 0..255)",
    )
    p.add_argument(
        "--ideal",
        choices=("probe", "none"),
        default="probe",
        help="ideal_s for normalized latency and SLO attainment: 'probe' fits "
        "a + b*prompt + c*output to sequential requests on the idle server before the "
        "replay (default); 'none' reports neither",
    )
    p.add_argument("--probe-prompts", default="16,128", help="probe prompt lengths")
    p.add_argument("--probe-outputs", default="8,32", help="probe output lengths")
    p.add_argument("--probe-repeats", type=int, default=2, help="probes per length pair")
    p.add_argument(
        "--timeout", type=float, default=300.0, help="per-request limit in s (default 300)"
    )
    p.add_argument("--api-key", help=f"bearer API key (default: ${API_KEY_ENV})")
    p.add_argument(
        "--concurrency-limit",
        type=int,
        help="most requests in flight (default: none, a pure open loop)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and model choice")
    p.add_argument("--out", required=True, help="result directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench_serve)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`~fleetserve.runtime.bench_serve.BenchConfig` of parsed flags."""
    from fleetserve.runtime.bench_serve import BenchConfig

    models = None
    if args.model is not None:
        models = tuple(m.strip() for m in args.model.split(",") if m.strip())
        if not models:
            raise FleetserveError(f"--model expects model names, got {args.model!r}")
    weights = None
    if args.model_weights is not None:
        weights = tuple(float(w) for w in _csv(args.model_weights, "--model-weights", float))
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return BenchConfig(
        url=args.url,
        trace=args.trace,
        fmt=args.format,
        rate=args.rate,
        start_s=args.start_s,
        end_s=args.end_s,
        max_requests=args.max_requests,
        rate_scale=args.rate_scale,
        length_scale=args.length_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        models=models,
        model_weights=weights,
        token_range=parse_token_range(args.token_range),
        ideal=args.ideal,
        probe_prompt_tokens=_csv(args.probe_prompts, "--probe-prompts", int),
        probe_output_tokens=_csv(args.probe_outputs, "--probe-outputs", int),
        probe_repeats=args.probe_repeats,
        timeout_s=args.timeout,
        api_key=api_key,
        concurrency_limit=args.concurrency_limit,
        seed=args.seed,
    )


@contextmanager
def _progress(console: Console, show: bool) -> Iterator[ProgressFn | None]:
    """A ``progress(phase, done, total, info)`` callback driving one rich bar per phase."""
    if not show:
        yield None
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} {task.fields[info]}"),
        TimeElapsedColumn(),
    )
    # Started on the first update, so an error before the probe prints no empty bar.
    bar = Progress(*columns, console=console, transient=False)
    tasks: dict[str, TaskID] = {}

    def update(phase: str, done: int, total: int, info: str) -> None:
        if not tasks:
            bar.start()
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=max(total, 1), info="")
        bar.update(tasks[phase], completed=done, total=max(total, 1), info=info)

    try:
        yield update
    finally:
        if tasks:
            bar.stop()


def _get(d: Mapping[str, Any], *keys: str) -> Any:
    cur: Any = d
    for k in keys:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(k)
    return cur


def result_table(summary: Mapping[str, Any], title: str) -> Table:
    """The short table printed after a run."""
    from fleetserve.metrics.report import fmt

    t = Table(title=title, show_header=False)
    r = summary["requests"]
    t.add_row(
        "requests",
        f"{r['total']} total, {r['finished']} finished, "
        f"{r['rejected']} rejected, {r['unfinished']} unfinished",
    )
    for label, key in (("rejected", "rejected_reasons"), ("unfinished", "unfinished_reasons")):
        reasons = _get(summary, "bench", key) or {}
        top = sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
        if top:
            t.add_row(f"{label} because", "; ".join(f"{n} x {why}" for why, n in top))
    for k in ("ttft", "tpot", "e2e"):
        st = _get(summary, "latency_s", k) or {}
        t.add_row(
            f"{k.upper()} (s)",
            f"p50 {fmt(st.get('p50'))}  p99 {fmt(st.get('p99'))}  mean {fmt(st.get('mean'))}",
        )
    t.add_row("normalized latency", fmt(summary.get("normalized_latency")))
    slo = summary.get("slo_attainment") or {}
    if slo:
        t.add_row(
            "SLO attainment",
            "  ".join(f"{k}x {fmt(v, 'slo_attainment')}" for k, v in slo.items()),
        )
    t.add_row(
        "throughput",
        f"{fmt(summary.get('throughput_rps'))} req/s, "
        f"{fmt(summary.get('throughput_tokens_s'))} output tok/s",
    )
    b = summary.get("bench") or {}
    t.add_row(
        "concurrency",
        f"peak {b.get('concurrency_peak')} in flight"
        + (f" (limit {b['concurrency_limit']})" if b.get("concurrency_limit") else ""),
    )
    for model, fit in (b.get("ideal_model") or {}).items():
        t.add_row(
            f"ideal_s {model}",
            f"{fit['a_s']:.3g} s + {fit['b_s_per_prompt_token']:.3g} s/prompt tok + "
            f"{fit['c_s_per_output_token']:.3g} s/output tok",
        )
    t.add_row(
        "wall",
        f"{fmt(b.get('replay_wall_s'))} s replay, {fmt(b.get('wall_s'))} s in all",
    )
    return t


def cmd_bench_serve(args: argparse.Namespace, console: Console) -> int:
    """Run ``fleetserve bench-serve``; 0 when the replay ran (whatever its outcome)."""
    require_modules("bench-serve", "runtime", "httpx")
    from fleetserve.runtime.bench_serve import run_bench, write_bench

    cfg = config_from_args(args)
    with _progress(console, not args.no_progress) as cb:
        bench = run_bench(cfg, cb)
    out = Path(args.out)
    write_bench(out, bench)
    for note in bench.summary.get("notes") or []:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    console.print(result_table(bench.summary, f"bench-serve {cfg.url} — {args.trace}"))
    console.print(f"results in [bold]{out}[/] (summary.json, requests.csv, latency_cdf.png)")
    return 0
