"""Rich progress bar for long simulations: simulated time and events/s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from fleetserve.sim.simulator import ProgressFn


class SimProgress:
    """Progress callback for :class:`~fleetserve.sim.simulator.Simulator`.

    The bar tracks simulated time against the last arrival (the run's tail
    after it shows as 100%), with events/s and requests done.
    """

    def __init__(self, progress: Progress, task: TaskID, horizon_s: float, n_requests: int) -> None:
        self.progress = progress
        self.task = task
        self.horizon = max(horizon_s, 1e-9)
        self.n = n_requests
        self.t0 = time.perf_counter()

    def __call__(self, sim_time_s: float, events: int, done: int) -> None:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        self.progress.update(
            self.task,
            completed=min(sim_time_s, self.horizon),
            info=f"t={sim_time_s:,.0f}s  {events / wall:,.0f} ev/s  {done:,}/{self.n:,} done",
        )


@contextmanager
def sim_progress(
    console: Console, label: str, horizon_s: float, n_requests: int
) -> Iterator[ProgressFn]:
    """Context manager yielding a progress callback that drives a rich bar."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(label, total=max(horizon_s, 1e-9), info="")
        yield SimProgress(progress, task, horizon_s, n_requests)
