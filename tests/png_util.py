"""Test helper: build figures without rendering them.

Rendering a PNG (matplotlib's layout and drawing in ``savefig``) is most of the
time of a test that writes run folders or reports only to check other files.
These helpers keep every figure being built (the plotting code runs on the
run's data) and write an empty file where the PNG would be; tests that check
PNGs, and the runs they render, do not use them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

import fleetserve.metrics.io as mio
import fleetserve.metrics.plots as plots
from fleetserve.experiments import fleet_report, kunserve_report, multi_llm_report

_SAVE_PNG = plots.save_png
# Modules that import ``save_png`` by name, imported here before any patch: a
# first import while patched would keep the empty writer for the session.
_BY_NAME = (fleet_report, kunserve_report, multi_llm_report)


def empty_png(fig: Figure, path: str | Path) -> Path:
    """:func:`fleetserve.metrics.plots.save_png` without the rendering."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    fig.clear()
    return path


def skip_rendering(mp: pytest.MonkeyPatch) -> None:
    """Every ``save_png`` (each run's plots, comparisons, every experiment's
    figures) writes an empty file instead."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "save_png", None) is _SAVE_PNG:
            mp.setattr(mod, "save_png", empty_png)


def _built_not_rendered(plot: Callable[..., Path]) -> Callable[..., Path]:
    def build(*args: Any, **kwargs: Any) -> Path:
        with pytest.MonkeyPatch.context() as mp:
            skip_rendering(mp)
            return plot(*args, **kwargs)

    return build


def skip_run_rendering(mp: pytest.MonkeyPatch) -> None:
    """Only each run folder's plots (``write_run``: time series, latency CDF)
    are built but not rendered; the experiments' figures are rendered."""
    mp.setattr(mio, "plot_timeseries", _built_not_rendered(plots.plot_timeseries))
    mp.setattr(mio, "plot_latency_cdf", _built_not_rendered(plots.plot_latency_cdf))
