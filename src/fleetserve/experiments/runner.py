"""Run a grid of independent simulations, in parallel, each into its own result folder.

A :class:`RunSpec` is everything one run needs as plain data (a config dict
for :func:`~fleetserve.config.config_from_dict` and an output folder), so it
can be sent to a worker process. :func:`run_grid` runs the specs with up to
``jobs`` worker processes (``spawn`` start method: no state is inherited from
the parent, so a run gives the same result in a worker as in-process) and
reports starts, progress and completions to a :class:`GridListener`.

:func:`simulate_and_write` is the one place that turns a config and its
workload into a result directory; ``fleetserve simulate`` and ``compare`` use
it too.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fleetserve.config import SimConfig, config_from_dict
from fleetserve.errors import FleetserveError
from fleetserve.metrics.records import RunResult
from fleetserve.policy.catalog import KUNSERVE, MULTI, check_world
from fleetserve.sim.build import Workload, build_workload
from fleetserve.sim.simulator import ProgressFn, Simulator

logger = logging.getLogger(__name__)

PROGRESS_EVERY = 2048
"""Simulator events between progress callbacks of a grid run."""

_TICK_S = 0.25
"""Least wall time between two progress messages of one run."""


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One simulation of a grid.

    Attributes:
        key: unique name of the run (``hw/workload/stack``), shown in progress.
        out_dir: the run's result directory (``summary.json`` etc.).
        config: plain config dict for :func:`~fleetserve.config.config_from_dict`;
            trace paths must be absolute.
        weight: relative cost estimate; heavier runs start first.
    """

    key: str
    out_dir: Path
    config: dict[str, Any]
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """What a run reports back (its figures are in ``out_dir``).

    Attributes:
        error: None when the run wrote its results; else the exception's last
            line (the traceback is in ``out_dir/error.txt``).
    """

    key: str
    out_dir: Path
    requests: int
    wall_s: float
    notes: tuple[str, ...]
    error: str | None = None


class GridListener(Protocol):
    """Receives the progress of a grid (called in the parent process only)."""

    def started(self, key: str, horizon_s: float, n_requests: int) -> None:
        """Run ``key`` began: arrivals span ``horizon_s`` simulated seconds."""

    def advanced(self, key: str, sim_time_s: float, done: int) -> None:
        """Run ``key`` reached ``sim_time_s`` with ``done`` requests completed."""

    def finished(self, outcome: RunOutcome) -> None:
        """Run ``outcome.key`` wrote its result directory."""


Message = tuple[str, str, float, int]
"""Worker → parent progress message: ``(kind, key, value, count)``; kind is
``start`` (value = horizon, count = requests) or ``tick`` (value = simulated
time, count = requests done)."""


def simulate_and_write(
    cfg: SimConfig, wl: Workload, out: Path, progress: ProgressFn | None = None
) -> tuple[dict[str, Any], RunResult]:
    """Simulate ``wl`` under ``cfg``, summarize it and write the run directory.

    Args:
        cfg: the resolved run configuration.
        wl: its workload (from :func:`~fleetserve.sim.build.build_workload`).
        out: result directory (created if missing).
        progress: optional simulator progress callback.

    Returns:
        ``(summary, result)``; the summary carries a ``workload`` entry
        (source and request count) on top of :func:`~fleetserve.metrics.summarize`.
    """
    from fleetserve.metrics import summarize, write_run

    world = check_world(cfg)
    if world == MULTI:
        from fleetserve.sim.multi_build import multi_settings
        from fleetserve.sim.multi_run import run_multi_stack

        assert wl.services is not None and wl.history is not None
        result = run_multi_stack(
            cfg.policy.stack,
            wl.services,
            wl.history,
            wl.requests,
            multi_settings(cfg),
            progress=progress,
        )
        result.notes.extend(wl.notes)
        result.config["run"] = cfg.to_dict()
    elif world == KUNSERVE:
        from fleetserve.sim.kun_run import run_kun

        result = run_kun(cfg, wl.requests, wl.notes, progress, PROGRESS_EVERY)
    else:
        sim = Simulator(
            cfg, wl.requests, notes=wl.notes, progress=progress, progress_every=PROGRESS_EVERY
        )
        result = sim.run()
    summary = summarize(result, cfg.slo_scales)
    summary["workload"] = {"source": wl.source, "requests": len(wl.requests)}
    write_run(out, result, summary)
    return summary, result


def _throttled(send: Callable[[Message], None], key: str) -> ProgressFn:
    last = [0.0]

    def tick(sim_time_s: float, events: int, done: int) -> None:
        now = time.perf_counter()
        if now - last[0] >= _TICK_S:
            last[0] = now
            send(("tick", key, sim_time_s, done))

    return tick


def execute_run(spec: RunSpec, send: Callable[[Message], None] | None = None) -> RunOutcome:
    """Build the config and workload of ``spec``, simulate it and write its results.

    Args:
        spec: the run.
        send: optional sink for progress messages (see :data:`Message`).

    Raises:
        FleetserveError: bad config or workload, prefixed with the run's key.
    """
    t0 = time.perf_counter()
    for name in ("summary.json", "error.txt"):  # nothing from a previous run may remain
        (spec.out_dir / name).unlink(missing_ok=True)
    try:
        cfg = config_from_dict(spec.config)
        wl = build_workload(cfg)
    except FleetserveError as e:
        raise FleetserveError(f"{spec.key}: {e}") from None
    progress = None
    if send is not None:
        horizon = wl.requests[-1].arrival_s if wl.requests else 0.0
        send(("start", spec.key, horizon, len(wl.requests)))
        progress = _throttled(send, spec.key)
    simulate_and_write(cfg, wl, spec.out_dir, progress)
    return RunOutcome(
        spec.key, spec.out_dir, len(wl.requests), time.perf_counter() - t0, tuple(wl.notes)
    )


def guarded_run(spec: RunSpec, send: Callable[[Message], None] | None = None) -> RunOutcome:
    """:func:`execute_run`, turning a failure into an outcome with ``error`` set.

    One failing run (a bad input or a bug in a policy) does not stop the grid:
    its traceback goes to ``out_dir/error.txt`` and the other runs go on.
    """
    t0 = time.perf_counter()
    try:
        return execute_run(spec, send)
    except Exception as e:
        spec.out_dir.mkdir(parents=True, exist_ok=True)
        (spec.out_dir / "error.txt").write_text(traceback.format_exc(), encoding="utf-8")
        logger.error("run %s failed: %s", spec.key, e)
        last = str(e).strip().splitlines()[-1:] or [""]
        msg = f"{type(e).__name__}: {last[0]}"
        return RunOutcome(spec.key, spec.out_dir, 0, time.perf_counter() - t0, (), msg)


def _execute_in_worker(spec: RunSpec, messages: Any) -> RunOutcome:
    """Worker entry point: progress goes to the manager queue ``messages``."""
    return guarded_run(spec, messages.put)


def _dispatch(listener: GridListener | None, msg: Message) -> None:
    if listener is None:
        return
    kind, key, value, count = msg
    if kind == "start":
        listener.started(key, value, count)
    else:
        listener.advanced(key, value, count)


def run_grid(
    specs: Sequence[RunSpec], jobs: int, listener: GridListener | None = None
) -> list[RunOutcome]:
    """Run every spec, heaviest first, with up to ``jobs`` worker processes.

    Args:
        specs: the runs (keys must be unique).
        jobs: worker processes; 1 runs everything in this process.
        listener: optional progress receiver.

    Returns:
        The outcomes, in the order of ``specs``; a failed run has ``error`` set.
    """
    if jobs < 1:
        raise FleetserveError(f"--jobs must be at least 1, got {jobs}")
    keys = [s.key for s in specs]
    if len(set(keys)) != len(keys):
        raise ValueError("run keys must be unique")
    order = sorted(specs, key=lambda s: -s.weight)
    outcomes: dict[str, RunOutcome] = {}
    if jobs == 1 or len(specs) <= 1:
        for spec in order:
            out = guarded_run(spec, lambda m: _dispatch(listener, m))
            outcomes[spec.key] = out
            if listener is not None:
                listener.finished(out)
        return [outcomes[k] for k in keys]

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        messages = manager.Queue()
        with ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=ctx) as pool:
            pending: set[Future[RunOutcome]] = {
                pool.submit(_execute_in_worker, spec, messages) for spec in order
            }
            try:
                while pending:
                    done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                    _drain(messages, listener)
                    for fut in done:
                        out = fut.result()
                        outcomes[out.key] = out
                        if listener is not None:
                            listener.finished(out)
            except BaseException:
                for fut in pending:
                    fut.cancel()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    logger.info("grid of %d runs done with %d workers", len(specs), jobs)
    return [outcomes[k] for k in keys]


def _drain(messages: Any, listener: GridListener | None) -> None:
    while True:
        try:
            msg = messages.get_nowait()
        except queue.Empty:
            return
        _dispatch(listener, msg)
