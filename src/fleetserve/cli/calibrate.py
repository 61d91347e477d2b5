"""``fleetserve calibrate --vidur DIR``: the cost model against measured GPU kernels.

Reads Vidur's MLP kernel profiles (``compute/<gpu>/<model>/mlp.csv``), prints
for each GPU the roofline's error on the layer matmuls with the default
efficiencies and with the ones fitted on the training rows (errors on the
held-out rows, per token class), and writes it all as JSON with ``--out``
(:mod:`fleetserve.costmodel.vidur`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetserve.costmodel.params import DEFAULT_PARAMS
from fleetserve.costmodel.vidur import (
    VIDUR_GPUS,
    VidurFit,
    fit_efficiencies,
    load_all,
    profile_files,
)
from fleetserve.errors import FleetserveError
from fleetserve.spec import get_gpu
from fleetserve.workload.data import data_candidates


def _cell(d: dict[str, float]) -> str:
    return f"{100 * d['median_abs']:.1f}% / {100 * d['p90_abs']:.0f}%"


def fit_table(fits: list[VidurFit]) -> Table:
    """Per GPU and token class, the held-out rows' median / P90 absolute
    error: the roofline's ``max`` with the default efficiencies, with fitted
    ones, and the smooth knee fitted."""
    t = Table(title="Layer matmuls vs Vidur's measured kernels: median / P90 |error|, held out")
    for col in ("GPU", "tokens", "rows", "max, defaults", "max, fitted", "knee, fitted"):
        t.add_column(col, justify="left" if col in ("GPU", "tokens") else "right")
    for f in fits:
        for name, d in f.default_errors.items():
            t.add_row(
                f.gpu,
                name.replace(" tokens", ""),
                f"{int(d['n'])}",
                _cell(d),
                _cell(f.fitted_errors[name]),
                _cell(f.knee_errors[name]),
            )
    return t


def _shared_profiles() -> Path:
    """The shared data folder's ``profiles/`` (the first candidate holding one)."""
    candidates = data_candidates()
    for d in candidates:
        if (d / "profiles").is_dir():
            return d / "profiles"
    raise FleetserveError(
        f"no profiles/ folder in {', '.join(str(d) for d in candidates)}; pass --vidur DIR "
        "or set FLEETSERVE_DATA"
    )


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    """``fleetserve calibrate``."""
    root = Path(args.vidur) if args.vidur is not None else _shared_profiles()
    files = profile_files(root)
    unknown = sorted(set(files) - set(VIDUR_GPUS))
    if unknown:
        raise FleetserveError(
            f"{root}: profiles of GPU {', '.join(unknown)}: not one of "
            f"{', '.join(sorted(VIDUR_GPUS))} (Vidur's names this command maps to the catalog)"
        )
    default = (DEFAULT_PARAMS.compute_eff, DEFAULT_PARAMS.mem_eff)
    fits = []
    for name, paths in files.items():
        rows = load_all(paths)
        fits.append(fit_efficiencies(name, rows, get_gpu(VIDUR_GPUS[name]), default))
    console.print(fit_table(fits))
    for f in fits:
        console.print(
            f"{f.gpu} (as {f.catalog_gpu}): fitted compute_eff {f.compute_eff:.3f}, "
            f"mem_eff {f.mem_eff:.3f}, "
            f"{f.kernel_latency_s * 1e6:.2f} µs per matmul kernel (defaults "
            f"{default[0]:g}, {default[1]:g}, none per kernel); {f.rows} rows, "
            f"{f.held_out} held out; element-wise operators {100 * f.others_share:.0f}% of a "
            "layer's measured time (median, not in the roofline)",
            highlight=False,
        )
        console.print(
            f"{f.gpu} smooth knee (c^q + m^q)^(1/q): q {f.knee:g}, compute_eff "
            f"{f.knee_compute_eff:.3f}, mem_eff {f.knee_mem_eff:.3f}, "
            f"{f.knee_latency_s * 1e6:.2f} µs per matmul kernel",
            highlight=False,
        )
    console.print(
        "the fit is reported, not applied: the catalog's defaults change with the re-run "
        "of every experiment (docs/calibration.md)",
        highlight=False,
    )
    if args.out is not None:
        out: dict[str, Any] = {
            "source": str(root),
            "files": {k: [str(p) for p in v] for k, v in files.items()},
            "defaults": {"compute_eff": default[0], "mem_eff": default[1]},
            "fits": [dataclasses.asdict(f) for f in fits],
        }
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"written: {path}", highlight=False)
    return 0


def add_calibrate_parser(sub: Any) -> None:
    """The ``calibrate`` subcommand."""
    p = sub.add_parser(
        "calibrate",
        help="check and fit the cost model against measured GPU kernels (Vidur's profiles)",
        description="Compare the roofline cost model with Vidur's measured MLP kernel "
        "profiles, fit its compute and memory efficiencies and a per-kernel latency on "
        "training rows, and report the errors on held-out rows per token class.",
    )
    p.add_argument(
        "--vidur",
        help="profiles folder with compute/<gpu>/<model>/mlp.csv (default: the shared "
        "data folder's profiles/)",
    )
    p.add_argument("--out", help="write the fits and errors as JSON here")
    p.set_defaults(func=cmd_calibrate)
