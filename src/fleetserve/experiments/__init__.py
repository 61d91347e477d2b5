"""fleetserve.experiments: each paper's headline comparison, as data plus a report.

``fleetserve reproduce NAME`` runs one of :data:`EXPERIMENTS`. An experiment is
a grid of ordinary simulations (each writes a normal result directory through
:func:`~fleetserve.experiments.runner.simulate_and_write`), run in parallel by
:func:`~fleetserve.experiments.runner.run_grid`, followed by a report that
reads the run directories back and writes tables, figures and a
paper-vs-measured check.

=========  ==========================================================
name       what
=========  ==========================================================
``mell``   Mell §VIII, Figs. 11-15 (:mod:`fleetserve.experiments.mell`)
=========  ==========================================================
"""

from __future__ import annotations

from fleetserve.errors import UnknownNameError

EXPERIMENTS: dict[str, str] = {
    "mell": "Mell §VIII: GPUs, migrations, batching and KV utilization of bf/wf/llumnix/mell",
}
"""Experiment name → one-line description."""


def check_experiment(name: str) -> str:
    """``name`` when it is a known experiment.

    Raises:
        UnknownNameError: an unknown name (with suggestions).
    """
    if name not in EXPERIMENTS:
        raise UnknownNameError("experiment", name, EXPERIMENTS)
    return name


__all__ = ["EXPERIMENTS", "check_experiment"]
