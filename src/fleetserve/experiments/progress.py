"""Rich progress display of a simulation grid (a :class:`~.runner.GridListener`).

One overall bar counts finished runs; every run in flight has its own bar of
simulated time against its last arrival. A finished run prints one line with
its wall time (or its error).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from fleetserve.experiments.runner import RunOutcome


class GridProgress:
    """Drives a :class:`rich.progress.Progress` from grid events.

    Args:
        progress: the (started) progress display.
        total_runs: how many runs the grid has.
    """

    def __init__(self, progress: Progress, total_runs: int) -> None:
        self.progress = progress
        self.total = total_runs
        self.overall = progress.add_task("all runs", total=max(total_runs, 1), info="")
        self.tasks: dict[str, tuple[TaskID, int]] = {}
        self.t0 = time.perf_counter()

    def started(self, key: str, horizon_s: float, n_requests: int) -> None:
        """Add a bar for run ``key``."""
        task = self.progress.add_task(f"  {key}", total=max(horizon_s, 1e-9), info="")
        self.tasks[key] = (task, n_requests)

    def advanced(self, key: str, sim_time_s: float, done: int) -> None:
        """Move run ``key``'s bar to ``sim_time_s``."""
        if key not in self.tasks:
            return
        task, n = self.tasks[key]
        self.progress.update(
            task,
            completed=sim_time_s,
            info=f"t={sim_time_s:,.0f}s  {done:,}/{n:,} done",
        )

    def finished(self, outcome: RunOutcome) -> None:
        """Drop run ``outcome.key``'s bar, print a line and advance the overall bar."""
        entry = self.tasks.pop(outcome.key, None)
        if entry is not None:
            self.progress.remove_task(entry[0])
        self.progress.advance(self.overall)
        n_done = int(self.progress.tasks[self.overall].completed)
        self.progress.update(self.overall, info=f"{n_done}/{self.total}")
        if outcome.error is not None:
            self.progress.console.print(
                f"[bold red]failed[/] {outcome.key}: {outcome.error} "
                f"(traceback in {outcome.out_dir / 'error.txt'})",
                highlight=False,
            )
            return
        self.progress.console.print(
            f"[green]done[/] {outcome.key}: {outcome.requests:,} requests "
            f"in {outcome.wall_s:.1f} s",
            highlight=False,
        )


@contextmanager
def grid_progress(console: Console, total_runs: int) -> Iterator[GridProgress]:
    """Context manager yielding a :class:`GridProgress` on ``console``."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        yield GridProgress(progress, total_runs)
