"""``fleetserve fidelity CONFIG.yaml --out DIR``: the simulator against the real runtime.

One command, five steps (progress on stderr), every artefact under ``DIR``::

    1 profile   fleetserve profile-engine per served model  -> profile-before.csv
                (or --profile CSV to reuse one)
    2 serve     fleetserve serve CONFIG on a free port (subprocess, log in
                server.log), wait for /health; every engine step -> steps.jsonl
                (serve.step_log)
    3 probe     overhead probes on the idle server, before   -> overhead_probe.json
                and after the replay (the machine's load may change in between)
      calibrate the trace's next --calibration-requests (60)  -> calibration/
                requests after the replayed ones, served before
                the replay, never compared: the engine's speed
                under load for the in-situ calibration
    4 replay    bench-serve of the trace                     -> measured/,
                                                                replay_span.json
                the server is shut down (also on errors and Ctrl-C)
                profile-engine again, after the server stops  -> profile-after.csv
                (both together: profile.csv; this machine's speed
                drifts by 20-30% within minutes)
    5 simulate  in situ: profile.csv rescaled by the measured/ -> profile-in-situ.csv
                predicted time of the engine steps outside the
                replay (the engine runs slower inside the server
                than alone; not with --standalone-profile), the
                overhead (per iteration: the step log's hand-offs;
                per request: fitted to the probes), then
                the same requests on the emulated cluster:
                with the serving-path overhead                -> simulated/
                engine only (cost model alone)               -> simulated-engine-only/
                the replay's engine steps against the cost model
                (a diagnostic) and the comparison             -> fidelity.md, fidelity.json

The workload: ``workload.trace`` of the config (relative to the config file)
or ``--trace``; without either, the Azure conversation trace of the shared
data folder (:func:`fleetserve.workload.data.find_data_dir`). The config's
``workload`` window, ``max_requests``, ``rate_scale`` and ``length_scale``
apply (flags override them), then the bench caps ``--max-prompt-tokens`` /
``--max-output-tokens`` (the tiny models' context is 4,096 tokens).

The comparison itself (steps 3's fit and 5) is :func:`analyze`, which tests
drive with a measurement they make up.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from fleetserve.config import SimConfig
from fleetserve.errors import FleetserveError, InputError, require_modules

DEFAULT_TRACE = "azure_llm_2023_conv.csv"
"""The trace used when neither the config nor ``--trace`` names one."""

DEFAULT_MAX_REQUESTS = 300
"""Requests replayed when neither the config nor ``--max-requests`` limits them."""


def say(msg: str) -> None:
    """A progress line on stderr."""
    Console(stderr=True, highlight=False).print(msg)


@dataclass(frozen=True, slots=True)
class Replay:
    """The replay's workload settings (bench-serve's flags)."""

    trace: str
    fmt: str | None
    start_s: float | None
    end_s: float | None
    max_requests: int | None
    rate_scale: float
    length_scale: float
    max_prompt_tokens: int | None
    max_output_tokens: int | None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def replay_settings(cfg: SimConfig, config_path: str, args: argparse.Namespace) -> Replay:
    """The replay of ``cfg.workload`` with the flags' overrides (module docstring).

    Raises:
        InputError: no trace given and the shared data folder is missing.
        FleetserveError: a non-positive scale or cap.
    """
    wl = cfg.workload
    if args.trace is not None:
        trace, fmt = str(Path(args.trace).resolve()), args.format
    elif wl.trace is not None:
        p = Path(wl.trace)
        if not p.is_absolute():
            p = Path(config_path).resolve().parent / p
        trace, fmt = str(p), args.format or wl.format
    else:
        from fleetserve.workload.data import find_data_dir

        trace, fmt = str(find_data_dir([DEFAULT_TRACE]) / DEFAULT_TRACE), args.format or "azure"
    max_req = args.max_requests if args.max_requests is not None else wl.max_requests
    rep = Replay(
        trace=trace,
        fmt=fmt,
        start_s=wl.start_s,
        end_s=wl.end_s,
        max_requests=DEFAULT_MAX_REQUESTS if max_req is None else max_req,
        rate_scale=args.rate_scale if args.rate_scale is not None else wl.rate_scale,
        length_scale=args.length_scale if args.length_scale is not None else wl.length_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )
    for flag, v in (
        ("--rate-scale", rep.rate_scale),
        ("--length-scale", rep.length_scale),
        ("--max-requests", rep.max_requests),
        ("--max-prompt-tokens", rep.max_prompt_tokens),
        ("--max-output-tokens", rep.max_output_tokens),
    ):
        if v is not None and not v > 0:
            raise FleetserveError(f"{flag} must be positive, got {v}")
    if not Path(rep.trace).is_file():
        raise InputError("trace not found", file=rep.trace)
    return rep


# ----------------------------------------------------------------------- measure


CALIBRATION_REQUESTS = 60
"""Requests of the held-out calibration load (``--calibration-requests``)."""


def calibration_replay(replay: Replay, n: int) -> Replay | None:
    """The calibration load: the ``n`` requests of the trace that follow the
    replayed ones (same window end, scaling and caps), so the engine's speed
    under load is measured on requests the comparison never sees. None when
    ``n`` is 0 or the trace has nothing after the replay."""
    from fleetserve.runtime.bench_serve import BenchConfig, load_bench_workload

    if n <= 0:
        return None
    raw = BenchConfig(
        url="http://unused",
        trace=replay.trace,
        fmt=replay.fmt,
        start_s=replay.start_s,
        end_s=replay.end_s,
    )
    reqs = load_bench_workload(raw).requests  # window only: trace seconds from its start
    k = replay.max_requests
    if k is None:
        return None
    last = reqs[k - 1].arrival_s if 0 < k <= len(reqs) else math.inf
    # a request tied with the last replayed one is skipped: a window cannot split a tie
    later = [r.arrival_s for r in reqs[k:] if r.arrival_s > last]
    if not later:
        return None
    return replace(replay, start_s=(replay.start_s or 0.0) + later[0], max_requests=n)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fleetserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "fleetserve.cli.main", *args]


STEP_LOG = "steps.jsonl"
"""The served engines' step log in a fidelity directory (``serve.step_log``)."""
REPLAY_SPAN = "replay_span.json"
"""When the replay ran (Unix ``start_s``/``end_s``): its steps in :data:`STEP_LOG`."""

PROFILE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Batch sizes ``fleetserve fidelity`` profiles (up to ``serve.max_running``): dense
at the small batches where a CPU engine's decode step departs most from the
roofline, so the calibration's per-batch decode correction sees them."""


def profile_models(cfg: SimConfig, out: Path, stem: str = "profile") -> Path:
    """``fleetserve profile-engine`` for every served model (one subprocess
    each, ``serve.threads_per_worker`` threads, the served dtype and block
    size, :data:`PROFILE_BATCHES` up to ``serve.max_running``, no prefill point
    larger than ``serve.max_batch_tokens``: the engine never runs one), merged
    into ``out/<stem>.csv``.

    Raises:
        FleetserveError: a profile run failed (its output's last line).
    """
    sv = cfg.serve
    parts: list[Path] = []
    for m in sv.model_names(cfg.model):
        part = out / f"{stem}-{Path(str(m)).name}.csv"
        say(f"[bold]profile[/] {m} ({sv.threads_per_worker} thread(s)) -> {part}")
        cmd = _fleetserve(
            "profile-engine",
            "--model",
            str(m),
            "--threads",
            str(sv.threads_per_worker),
            "--dtype",
            sv.dtype,
            "--block-size",
            str(cfg.cluster.block_size),
            "--max-prefill-tokens",
            str(sv.max_batch_tokens),
            "--batch-sizes",
            ",".join(str(b) for b in PROFILE_BATCHES if b <= sv.max_running) or "1",
            "--no-progress",
            "--out",
            str(part),
        )
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise FleetserveError(f"profile-engine {m} failed: {tail[0]}")
        parts.append(part)
    return merge_profiles(parts, out / f"{stem}.csv")


def merge_profiles(parts: Sequence[Path], merged: Path) -> Path:
    """Concatenate profile CSVs (same header) into ``merged``: the calibration
    then fits every point as measured in each of them."""
    header: list[str] | None = None
    rows: list[list[str]] = []
    for part in parts:
        with part.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader)
            rows += list(reader)
    with merged.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header or [])
        w.writerows(rows)
    return merged


class ServerProcess:
    """``fleetserve serve`` as a subprocess on a free port; a context manager
    that always stops it (SIGINT, then SIGTERM, then SIGKILL).

    Args:
        config: the config file.
        overrides: ``--set`` overrides.
        log: file receiving the server's output.
        startup_timeout_s: how long to wait for ``/health``.
    """

    def __init__(
        self, config: str, overrides: Sequence[str], log: Path, startup_timeout_s: float = 180.0
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = _fleetserve("serve", config, "--port", str(self.port))
        for s in overrides:
            self.cmd += ["--set", s]
        self.log = log
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        import httpx

        env = dict(os.environ)
        env.pop("FLEETSERVE_API_KEY", None)  # the probes and the replay send none
        with self.log.open("wb") as logf:
            self.proc = subprocess.Popen(
                self.cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise FleetserveError(
                        f"the server exited with status {self.proc.returncode} before it was "
                        f"up: {self._log_tail()} (log: {self.log})"
                    )
                try:
                    if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise FleetserveError(
                        f"the server was not up after {self.startup_timeout_s:g} s "
                        f"(log: {self.log})"
                    )
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _log_tail(self) -> str:
        try:
            lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return "(no log)"
        return lines[-1].strip() if lines else "(empty log)"

    def stop(self) -> None:
        """Stop the server (idempotent)."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 30.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def measure(
    cfg: SimConfig,
    args: argparse.Namespace,
    replay: Replay,
    out: Path,
    calibration: Replay | None = None,
) -> list[Any]:
    """Steps 2-4: start the server, probe it, run the calibration load (when
    given: ``out/calibration``), replay the trace, probe again, stop it.

    Returns:
        The overhead probes (:class:`~fleetserve.metrics.probes.ProbeRequest`);
        the replay is in ``out/measured``.
    """
    served = list(cfg.serve.model_names(cfg.model))
    steps = out / STEP_LOG
    steps.unlink(missing_ok=True)  # the server appends
    overrides = [*args.set, f"serve.step_log={steps.resolve()}"]
    with serving(cfg, args.config, overrides, out, args.startup_timeout) as srv:
        return _measure(cfg, srv, replay, out, served, calibration)


@contextlib.contextmanager
def serving(
    cfg: SimConfig, config: str, overrides: Sequence[str], out: Path, startup_timeout_s: float
) -> Iterator[ServerProcess]:
    """``fleetserve serve config`` (with ``overrides``; ``cfg`` is that config
    loaded) up for the block, its log in ``out/server.log``; with
    ``serve.pin_cores``, this process keeps off the engines' cores meanwhile
    (once the server runs: a server started from a pinned process would see
    too few cores)."""
    from fleetserve.runtime.cluster import core_plan

    cores = core_plan(cfg)
    pin = _affinity(cores.server) if cores is not None else contextlib.nullcontext()
    say(f"[bold]serve[/] {config} (log: {out / 'server.log'})")
    with ServerProcess(config, overrides, out / "server.log", startup_timeout_s) as srv, pin:
        yield srv


@contextlib.contextmanager
def _affinity(cpus: Sequence[int]) -> Iterator[None]:
    """This thread on ``cpus`` for the block (restored after)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def bench_config(
    cfg: SimConfig, url: str, replay: Replay, served: list[str], ideal: str = "probe"
) -> Any:
    """bench-serve's settings for ``replay`` against ``url`` (``ideal``: its
    idle probes for normalized latency, or ``none``)."""
    from fleetserve.runtime.bench_serve import BenchConfig

    return BenchConfig(
        url=url,
        trace=replay.trace,
        fmt=replay.fmt,
        start_s=replay.start_s,
        end_s=replay.end_s,
        max_requests=replay.max_requests,
        rate_scale=replay.rate_scale,
        length_scale=replay.length_scale,
        max_prompt_tokens=replay.max_prompt_tokens,
        max_output_tokens=replay.max_output_tokens,
        models=tuple(served) if len(served) > 1 else None,
        model_weights=cfg.workload.model_weights if len(served) > 1 else None,
        seed=cfg.seed,
        ideal=ideal,
    )


def _measure(
    cfg: SimConfig,
    srv: ServerProcess,
    replay: Replay,
    out: Path,
    served: list[str],
    calibration: Replay | None,
) -> list[Any]:
    """:func:`measure` once the server is up."""
    from fleetserve.runtime.bench_serve import run_bench, write_bench
    from fleetserve.runtime.fidelity_probe import ProbePlan, run_probe

    say(f"server up at {srv.url}; [bold]probe[/] the serving path's overhead")
    model = _first_served_name(srv.url, served)
    cap_p = replay.max_prompt_tokens or 256
    plan = ProbePlan(
        model=model,
        prompts=tuple(sorted({min(p, cap_p) for p in (16, 64, 256)})),
        burst_prompt=min(64, cap_p),
        seed=cfg.seed,
    )
    probes = run_probe(srv.url, plan)
    if calibration is not None:
        say(
            f"{len(probes)} probes; [bold]calibration load[/]: the {calibration.max_requests} "
            f"requests after the replay's (trace from {calibration.start_s:.0f} s)"
        )
        cal = run_bench(bench_config(cfg, srv.url, calibration, served), bench_progress())
        write_bench(out / "calibration", cal)
    replay_scraped(cfg, srv.url, replay, out, served)
    # the probes again after the replay, so they see the machine of the whole run
    say("[bold]probe[/] again after the replay")
    n0 = 1 + max(p.group for p in probes)
    probes += [replace(p, group=p.group + n0) for p in run_probe(srv.url, plan)]
    (out / "overhead_probe.json").write_text(
        json.dumps({"plan": _plan_dict(plan), "probes": [p.to_dict() for p in probes]}, indent=1)
    )
    return probes


METRICS_BEFORE = "metrics-before.prom"
METRICS_AFTER = "metrics-after.prom"
"""The server's ``/metrics`` just before and just after the replay."""


def scrape_metrics(url: str) -> str:
    """The server's ``GET /metrics`` page.

    Raises:
        FleetserveError: the server did not answer with one.
    """
    import httpx

    try:
        got = httpx.get(url + "/metrics", timeout=30.0)
    except httpx.HTTPError as exc:
        raise FleetserveError(f"{url}/metrics: {exc}") from None
    if got.status_code != 200:
        raise FleetserveError(f"{url}/metrics answered {got.status_code}")
    return got.text


def replay_scraped(
    cfg: SimConfig, url: str, replay: Replay, out: Path, served: list[str], ideal: str = "probe"
) -> Any:
    """bench-serve of ``replay`` against ``url`` between two ``/metrics``
    scrapes: ``out/measured``, :data:`REPLAY_SPAN`, :data:`METRICS_BEFORE`
    and :data:`METRICS_AFTER` (:func:`replay_metrics` reads their delta).

    Returns:
        The bench run (:class:`~fleetserve.runtime.bench_serve.BenchResult`).
    """
    from fleetserve.runtime.bench_serve import run_bench, write_bench

    say(f"[bold]replay[/] {replay.trace}")
    (out / METRICS_BEFORE).write_text(scrape_metrics(url))
    t_start = time.time()
    bench = run_bench(bench_config(cfg, url, replay, served, ideal), bench_progress())
    span = {"start_s": t_start, "end_s": time.time()}
    (out / METRICS_AFTER).write_text(scrape_metrics(url))
    (out / REPLAY_SPAN).write_text(json.dumps(span) + "\n")
    write_bench(out / "measured", bench)
    r = bench.summary["requests"]
    say(
        f"replayed {r['total']} requests ({r['finished']} finished, {r['rejected']} "
        f"rejected, {r['unfinished']} unfinished)"
    )
    return bench


def replay_metrics(out: Path) -> Any:
    """The delta of the server's counters over the replay
    (:class:`~fleetserve.experiments.parity.MetricsSnapshot`), None when
    ``out`` has no scrapes (a directory of an older fidelity run)."""
    from fleetserve.experiments.parity import metrics_delta, parse_metrics

    before, after = out / METRICS_BEFORE, out / METRICS_AFTER
    if not (before.is_file() and after.is_file()):
        return None
    return metrics_delta(parse_metrics(before.read_text()), parse_metrics(after.read_text()))


def _first_served_name(url: str, served: Sequence[str]) -> str:
    """The name the server serves the first model under (``/v1/models``)."""
    import httpx

    data = httpx.get(url + "/v1/models", timeout=10.0).json()
    names = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
    for n in served:
        if n in names:
            return n
    if not names:
        raise FleetserveError(f"{url}/v1/models lists no model")
    return str(names[0])


def _plan_dict(plan: Any) -> dict[str, Any]:
    return {k: getattr(plan, k) for k in plan.__slots__}


def bench_progress() -> Callable[[str, int, int, str], None]:
    last = {"t": 0.0}

    def cb(phase: str, done: int, total: int, info: str) -> None:
        now = time.monotonic()
        if done == total or now - last["t"] > 5.0:
            last["t"] = now
            say(f"  {phase}: {done}/{total} {info}")

    return cb


# ----------------------------------------------------------------------- analyze


def analyze(
    cfg: SimConfig,
    profile_csv: Path | None,
    probes: Sequence[Any],
    out: Path,
    *,
    command: str = "",
    replay: Replay | None = None,
    in_situ: bool = True,
) -> dict[str, Any]:
    """Step 5: fit the overhead to the probes, simulate ``out/measured``'s
    requests with and without it, write ``fidelity.md`` and ``fidelity.json``.

    With ``in_situ`` (and a step log), the calibration uses the profile
    rescaled to the speed the engine ran at inside the server during the
    probes (:func:`_in_situ_profile`).

    Returns:
        The ``fidelity.json`` content.
    """
    from fleetserve.experiments.fidelity import (
        FIDELITY_TOLERANCE_PCT,
        emulated_sim_config,
        fidelity_markdown,
        fidelity_table,
        fit_overhead,
        load_measured_requests,
        read_summary,
        simulate_emulated,
    )
    from fleetserve.experiments.parity import activation_line, with_measured_activation

    measured_dir = out / "measured"
    measured = read_summary(measured_dir)
    reqs = load_measured_requests(measured_dir)
    # an elastic pool's activated instances wait as long as the runtime's workers took
    cfg, activation = with_measured_activation(cfg, replay_metrics(out))
    if cfg.cluster.elastic:
        say(activation_line(activation))
    situ = _in_situ_profile(cfg, profile_csv, out) if in_situ else None
    if situ is not None:
        profile_csv = Path(situ["profile"])
    size = Counter(p.group for p in probes)
    alone = [p for p in probes if size[p.group] == 1]
    # the calibrated simulation's view of the step log (None without one)
    em = (
        emulated_sim_config(cfg, profile_csv)
        if profile_csv is not None and (out / STEP_LOG).is_file()
        else None
    )
    handoff = _measured_handoff(em, out) if situ is not None else None
    if handoff is not None:
        say(
            f"[bold]fit[/] the per-request overhead to {len(alone)} probes sent alone (per "
            f"iteration: the measured hand-off, {handoff[0] * 1e3:.2f} ms over {handoff[1]} "
            "steps; delivery lag 0)"
        )
        fit = fit_overhead(cfg, profile_csv, alone, iteration_grid=(handoff[0],), lag_grid=(0.0,))
    else:
        say(f"[bold]fit[/] the overhead model to {len(alone)} probes sent alone")
        fit = fit_overhead(cfg, profile_csv, alone)
    bursts = [p for p in probes if size[p.group] > 1]
    burst_check = _burst_check(cfg, profile_csv, bursts, fit.overhead) if bursts else None
    ov = fit.overhead
    say(
        f"  request {ov.request_s * 1e3:.2f} ms, iteration {ov.iteration_s * 1e3:.2f} ms, "
        f"delivery {ov.delivery_iters:g} iterations (probe TTFT error "
        f"{fit.ttft_mean_abs_pct:.1f}%, TPOT {fit.tpot_mean_abs_pct:.1f}%)"
    )
    say(f"[bold]simulate[/] {len(reqs)} measured requests")
    sim = simulate_emulated(cfg, profile_csv, out / "simulated", requests=reqs, overhead=ov)
    eng = simulate_emulated(cfg, profile_csv, out / "simulated-engine-only", requests=reqs)
    rows = fidelity_table(sim, measured)
    rows_eng = fidelity_table(eng, measured)
    targets = [r for r in rows if r["target"]]
    ok = sum(1 for r in targets if r["within"])
    steps = _step_check(em, out)
    report = {
        "command": command,
        "tolerance_pct": FIDELITY_TOLERANCE_PCT,
        "target_within": ok,
        "target_total": len(targets),
        "replay": replay.to_dict() if replay is not None else None,
        "overhead": fit.to_dict(),
        "bursts": burst_check,
        "in_situ": situ,
        "activation": activation,
        "handoff": {"seconds": handoff[0], "gaps": handoff[1]} if handoff else None,
        "engine_steps": steps,
        "rows": rows,
        "rows_engine_only": rows_eng,
        "calibration_error": (sim.get("fidelity") or {}).get("calibration_error"),
        "dirs": {
            "measured": str(measured_dir),
            "simulated": str(out / "simulated"),
            "simulated_engine_only": str(out / "simulated-engine-only"),
        },
    }
    (out / "fidelity.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "fidelity.md").write_text(_markdown(report, fidelity_markdown))
    return report


def _replay_span(out: Path) -> tuple[float, float] | None:
    """The replay's Unix start and end (:data:`REPLAY_SPAN`), None if not recorded."""
    path = out / REPLAY_SPAN
    if not path.is_file():
        return None
    try:
        sp = json.loads(path.read_text(encoding="utf-8"))
        return float(sp["start_s"]), float(sp["end_s"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise InputError("expected {start_s, end_s} (Unix seconds)", file=str(path)) from None


def _in_situ_profile(cfg: SimConfig, profile_csv: Path | None, out: Path) -> dict[str, Any] | None:
    """The standalone profile rescaled to the engine's speed inside the server.

    A worker's engine shares the machine with the server, Ray and the load
    generator, and on this project's 2-core machine its steps ran 1.2-1.5x
    slower in the server than in ``profile-engine`` alone, steadily before,
    during and after a replay (with ``serve.pin_cores`` about as fast as
    alone on the idle server, but ~1.15x slower under the replay's load). The
    factors (:func:`~fleetserve.experiments.fidelity.in_situ_factors`) come
    from the step log's steps *outside* the replay: the probes before and
    after it and the calibration load (the trace's requests after the
    replayed ones, :func:`calibration_replay`), never the replay; the
    profile rows are multiplied by them (``profile-in-situ.csv``) and the
    calibration fits those. None without a profile, a step log or the
    replay's span (``--analyze-only`` on an older directory).
    """
    from fleetserve.experiments.fidelity import (
        emulated_sim_config,
        in_situ_factors,
        rescale_profile,
    )

    log = out / STEP_LOG
    span = _replay_span(out)
    if profile_csv is None or span is None or not log.is_file():
        return None
    em = emulated_sim_config(cfg, profile_csv)
    factors = in_situ_factors(em, log, exclude=span)
    scaled = rescale_profile(profile_csv, factors, out / "profile-in-situ.csv")
    for m, f in factors.items():
        say(
            f"[bold]in situ[/] {m}: prefill x{f['prefill']:.2f} ({f['prefill_steps']} steps), "
            f"decode x{f['decode']:.2f} ({f['decode_steps']} steps) against the profile"
        )
    return {"factors": factors, "profile": str(scaled), "standalone_profile": str(profile_csv)}


def _measured_handoff(em: Any, out: Path) -> tuple[float, int] | None:
    """The engine's measured hand-off between steps outside the replay
    (:func:`~fleetserve.experiments.fidelity.step_handoff_s`), None without one.

    Choice: with a step log, the overhead model's per-iteration cost is this
    measurement and its delivery lag 0 (the worker's engine thread hands each
    step's tokens to the waiting poll as the step ends); only the fixed
    per-request latency is fitted to the probes. Fitting all three on the
    probes left them poorly identified once the engine's own time was
    calibrated in situ (one run's fit: a lag of half a step and a request
    latency of 0 ms, where the traced per-request path takes ~12 ms)."""
    from fleetserve.experiments.fidelity import step_handoff_s

    if em is None:
        return None
    return step_handoff_s(em, out / STEP_LOG, exclude=_replay_span(out))


def _step_check(em: Any, out: Path) -> dict[str, Any] | None:
    """The engines' speed during the replay against the cost model ``em``
    (:func:`~fleetserve.experiments.fidelity.engine_step_check` on the server's
    step log, the replay's span only); None without a step log."""
    from fleetserve.experiments.fidelity import engine_step_check

    if em is None:
        return None
    log = out / STEP_LOG
    return {
        "replay": engine_step_check(em, log, span=_replay_span(out)),
        "run": engine_step_check(em, log),
    }


def _burst_check(
    cfg: SimConfig, profile_csv: Path | None, bursts: Sequence[Any], overhead: Any
) -> dict[str, Any]:
    """How the fitted model does on the burst probes (not fitted to them): mean
    |relative error| of their TTFT and TPOT, with the overhead and without."""
    from fleetserve.experiments.fidelity import simulate_probes

    out: dict[str, Any] = {"probes": len(bursts)}
    for key, ov in (("fitted", overhead), ("engine_only", None)):
        sim = simulate_probes(cfg, profile_csv, bursts, ov)
        ttft = [abs(s[0] - p.ttft_s) / p.ttft_s * 100 for s, p in zip(sim, bursts, strict=True)]
        tpot = [
            abs(s[1] - p.tpot_s) / p.tpot_s * 100
            for s, p in zip(sim, bursts, strict=True)
            if s[1] is not None and p.tpot_s
        ]
        out[key] = {
            "ttft_mean_abs_pct": sum(ttft) / len(ttft),
            "tpot_mean_abs_pct": sum(tpot) / len(tpot) if tpot else None,
        }
    return out


def _steps_lines(steps: dict[str, Any] | None) -> list[str]:
    """The engine-step paragraph of ``fidelity.md`` (empty without a step log)."""
    rp = (steps or {}).get("replay") or {}
    if "all" not in rp:
        return []
    a = rp["all"]

    def part(key: str, label: str) -> str:
        st = rp.get(key)
        return f"{label} x{st['ratio']:.2f} ({st['steps']} steps)" if st else f"no {label}"

    wins = ", ".join(f"{w['ratio']:.2f}" for w in rp["windows"] if w["ratio"] is not None)
    return [
        f"Engine steps during the replay (the server's step log, {a['steps']} steps): "
        f"measured over cost-model time x{a['ratio']:.2f} (median step "
        f"x{a['median_ratio']:.2f}, P10-P90 x{a['p10_ratio']:.2f}-{a['p90_ratio']:.2f}); "
        f"{part('decode', 'decode only')}, {part('mixed', 'with prompts')}; by tenth of the "
        f"replay: {wins}. Above 1 the engine ran slower than the calibrated cost model said: "
        "that share of the error is the engine's speed, not the simulated scheduling (a "
        "diagnostic; the simulation does not use it).",
        "",
    ]


def _markdown(report: dict[str, Any], table: Callable[..., str]) -> str:
    from fleetserve.experiments.parity import activation_line

    ov = report["overhead"]
    o = ov["overhead"]
    lines = ["# Fidelity: the simulator vs the running server", ""]
    if report["command"]:
        lines += ["```", report["command"], "```", ""]
    if report["replay"]:
        rp = report["replay"]
        lines += [
            f"Replay: {rp['max_requests']} requests of `{rp['trace']}`, "
            f"rate x{rp['rate_scale']:g}, "
            f"lengths x{rp['length_scale']:g}, caps prompt {rp['max_prompt_tokens']} / output "
            f"{rp['max_output_tokens']} tokens.",
            "",
        ]
    ho = report.get("handoff")
    how = (
        f"{o['request_s'] * 1e3:.2f} ms per request fitted to {ov['probes']} probes of the "
        f"idle server (never to the replay); {o['iteration_s'] * 1e3:.2f} ms per engine "
        f"iteration measured (the engine's wait between steps while it had work, "
        f"{ho['gaps']} steps outside the replay); tokens delivered as they are made"
        if ho
        else f"fitted to {ov['probes']} probes of the idle server (never to the replay): "
        f"{o['request_s'] * 1e3:.2f} ms per request, {o['iteration_s'] * 1e3:.2f} ms per "
        f"engine iteration, tokens delivered {o['delivery_iters']:g} iterations after they "
        "are made"
    )
    lines += [
        table(report["rows"], "Simulated (cost model + serving-path overhead) vs measured"),
        "",
        f"Serving-path overhead, {how}. On the probes: TTFT "
        f"error {ov['ttft_mean_abs_pct']:.1f}% (engine only "
        f"{ov['engine_only_ttft_mean_abs_pct']:.1f}%), TPOT {ov['tpot_mean_abs_pct']:.1f}% "
        f"(engine only {ov['engine_only_tpot_mean_abs_pct']:.1f}%).",
        "",
    ]
    b = report.get("bursts")
    if b:
        f, e = b["fitted"], b["engine_only"]
        lines += [
            f"Check on the {b['probes']} burst probes (4 and 12 requests sent at once; not "
            f"fitted: concurrent requests pass the HTTP server and the controller one after "
            f"another, a queue the model lacks): TTFT error {f['ttft_mean_abs_pct']:.1f}% "
            f"(engine only {e['ttft_mean_abs_pct']:.1f}%), TPOT {f['tpot_mean_abs_pct']:.1f}% "
            f"(engine only {e['tpot_mean_abs_pct']:.1f}%).",
            "",
        ]
    situ = report.get("in_situ")
    if situ:
        parts = [
            f"{m} prefill x{f['prefill']:.2f} ({f['prefill_steps']} steps), decode "
            f"x{f['decode']:.2f} ({f['decode_steps']} steps)"
            for m, f in situ["factors"].items()
        ]
        lines += [
            "Calibrated from the standalone profile rescaled to the engine's speed inside "
            "the server, measured on its steps outside the replay (the probes before and "
            "after it and the calibration load of the trace's next requests; never the "
            "replay): " + "; ".join(parts) + " (`profile-in-situ.csv`; "
            "`--standalone-profile` leaves this out).",
            "",
        ]
    act = report.get("activation")
    if act is not None and act["source"] != "fixed pool":
        lines += [activation_line(act), ""]
    lines += _steps_lines(report.get("engine_steps"))
    lines += [
        table(report["rows_engine_only"], "Engine only (calibrated cost model alone) vs measured"),
        "",
    ]
    cal = report.get("calibration_error") or {}
    for m, phases in cal.items():
        parts = [
            f"{ph} mean |error| {e['mean_abs_pct']:.1f}% (max {e['max_abs_pct']:.1f}%)"
            for ph, e in phases.items()
        ]
        lines.append(f"Cost-model fit of {m} to its profile: " + "; ".join(parts) + ".")
    lines += [
        "",
        "Not modelled: the load generator and the server sharing the CPU cores with the "
        "workers; the admission queue's 429s; see fleetserve.experiments.fidelity. "
        "Tokens are timed as they reach the client (per-token usage chunks), text or not.",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def cmd_fidelity(args: argparse.Namespace, console: Console) -> int:
    """Run ``fleetserve fidelity`` (module docstring)."""
    from fleetserve.cli.serve import load_serve_config
    from fleetserve.experiments.fidelity import emulated_sim_config

    if not Path(args.config).is_file():
        raise InputError("config file not found", file=args.config)
    cfg = load_serve_config(args.config, args.set)
    emulated_sim_config(cfg, None)  # a config the simulation cannot emulate fails here
    profile: Path | None = None
    if args.profile is not None:
        profile = Path(args.profile)
        if not profile.is_file():
            raise InputError("profile not found", file=str(profile))
        emulated_sim_config(cfg, profile)  # the profile is checked before anything runs
    replay = replay_settings(cfg, args.config, args)
    if args.calibration_requests < 0:
        raise FleetserveError(
            f"--calibration-requests must be >= 0, got {args.calibration_requests}"
        )
    out = Path(args.out)
    if args.analyze_only:
        raw = json.loads((out / "overhead_probe.json").read_text())
        from fleetserve.metrics.probes import ProbeRequest

        probes: list[Any] = [ProbeRequest.from_dict(p) for p in raw["probes"]]
        if profile is None and (out / "profile.csv").is_file():
            profile = out / "profile.csv"
    else:
        require_modules("fidelity", "runtime", "torch", "ray", "fastapi", "uvicorn", "httpx")
        out.mkdir(parents=True, exist_ok=True)
        own_profile = profile is None
        if own_profile:
            before = profile_models(cfg, out, "profile-before")
        cal = calibration_replay(replay, args.calibration_requests)
        probes = measure(cfg, args, replay, out, cal)
        if own_profile:
            # profiled again after the replay, like the probes: this machine's speed
            # drifts by 20-30% within minutes, and the calibration should see the
            # machine of the whole run, not of the minutes before it
            after = profile_models(cfg, out, "profile-after")
            profile = merge_profiles([before, after], out / "profile.csv")
    command = "fleetserve " + " ".join(sys.argv[1:]) if sys.argv else ""
    report = analyze(
        cfg,
        profile,
        probes,
        out,
        command=command,
        replay=replay,
        in_situ=not args.standalone_profile,
    )
    from fleetserve.experiments.fidelity import fidelity_markdown

    console.print(fidelity_markdown(report["rows"]), highlight=False, markup=False)
    console.print(
        f"{report['target_within']} of {report['target_total']} target metrics within "
        f"{report['tolerance_pct']:g}%; results in {out} (fidelity.md, fidelity.json, "
        "measured/, simulated/, simulated-engine-only/)",
        highlight=False,
    )
    return 0


def add_fidelity_parser(sub: Any) -> None:
    """The ``fidelity`` subcommand."""
    p = sub.add_parser(
        "fidelity",
        help="profile, serve, replay and simulate one config; compare simulated and measured",
        description="Profile the engine, serve CONFIG, probe and replay a trace against it, "
        "simulate the same requests on the emulated cluster and write the comparison.",
    )
    p.add_argument("config", help="YAML config with a serve: section (CPU workers)")
    p.add_argument("--out", required=True, help="result directory")
    p.add_argument("--profile", help="reuse this engine profile CSV (skip profile-engine)")
    p.add_argument(
        "--standalone-profile",
        action="store_true",
        help="calibrate from the profile as measured, not rescaled to the engine's speed "
        "inside the server (measured on the steps of the probes and the calibration load)",
    )
    p.add_argument(
        "--calibration-requests",
        type=int,
        default=CALIBRATION_REQUESTS,
        metavar="N",
        help="before the replay, serve the N requests of the trace that follow it (never "
        "compared) to measure the engine's speed under load for the in-situ calibration "
        f"(default {CALIBRATION_REQUESTS}; 0: probes only)",
    )
    add_replay_flags(p)
    p.add_argument(
        "--analyze-only",
        action="store_true",
        help="redo only the fit, the simulations and the table from OUT's measurements",
    )
    p.set_defaults(func=cmd_fidelity)


def add_replay_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the replay (:func:`replay_settings`), the server's startup
    and config overrides, shared by ``fidelity`` and ``parity``."""
    p.add_argument("--trace", help="trace file (default: the config's, else the Azure conv trace)")
    p.add_argument("--format", help="trace format (default: the config's, or detected)")
    p.add_argument(
        "--max-requests", type=int, help=f"default: the config's, else {DEFAULT_MAX_REQUESTS}"
    )
    p.add_argument("--rate-scale", type=float, help="default: the config's workload.rate_scale")
    p.add_argument("--length-scale", type=float, help="default: the config's workload.length_scale")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=512, help="cap prompt lengths (default 512)"
    )
    p.add_argument(
        "--max-output-tokens", type=int, default=128, help="cap output lengths (default 128)"
    )
    p.add_argument(
        "--startup-timeout", type=float, default=180.0, help="seconds to wait for the server"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
