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
    RowCheck,
    VidurFit,
    check_rows,
    fit_efficiencies,
    load_all,
    profile_files,
    summarize_checks,
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


def _profiles(args: argparse.Namespace) -> tuple[Path, dict[str, list[Path]]]:
    root = Path(args.vidur) if args.vidur is not None else _shared_profiles()
    files = profile_files(root)
    unknown = sorted(set(files) - set(VIDUR_GPUS))
    if unknown:
        raise FleetserveError(
            f"{root}: profiles of GPU {', '.join(unknown)}: not one of "
            f"{', '.join(sorted(VIDUR_GPUS))} (Vidur's names this command maps to the catalog)"
        )
    return root, files


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    """``fleetserve calibrate``."""
    root, files = _profiles(args)
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


ROW_COLUMNS = (
    "gpu",
    "model",
    "tp",
    "tokens",
    "token_class",
    "held_out",
    "measured_s",
    "default_s",
    "fitted_s",
    "default_error",
    "fitted_error",
)


def _short_model(name: str) -> str:
    """``Meta-Llama-3-70B`` -> ``Llama-3-70B``, ``Llama-2-7b-hf`` -> ``Llama-2-7b``."""
    return name.removeprefix("Meta-").removesuffix("-hf")


def validate_table(summary: list[dict[str, Any]]) -> Table:
    """Per GPU, model and token class: measured vs predicted layer matmuls
    (medians; errors ``predicted / measured - 1``)."""
    t = Table(title="A layer's matmuls: cost model vs measured (Vidur), every row")
    for col in ("GPU", "model", "tokens", "rows", "meas. ms", "pred. ms", "error", "|err| cal."):
        t.add_column(
            col,
            justify="left" if col in ("GPU", "model", "tokens") else "right",
            no_wrap=col == "model",
            min_width=11 if col == "model" else None,
        )
    for d in summary:
        t.add_row(
            str(d["gpu"]),
            _short_model(str(d["model"])),
            str(d["tokens"]),
            f"{d['rows']}",
            f"{1e3 * float(d['measured_median_s']):.3f}",
            f"{1e3 * float(d['default_median_s']):.3f}",
            f"{100 * float(d['default_median_signed']):+.1f}%",
            f"{100 * float(d['fitted_median_abs']):.1f}%",
        )
    t.caption = (
        "medians per group; pred. and error (pred. / meas. - 1): the catalog's defaults, "
        "what the simulator uses; cal.: the smooth-knee calibration"
    )
    return t


def _plot_checks(checks: list[RowCheck], path: Path) -> Path:
    """Predicted vs measured, log-log, one panel per GPU: defaults and calibrated."""
    from matplotlib.figure import Figure

    from fleetserve.metrics.plots import save_png

    gpus = sorted({c.gpu for c in checks})
    fig = Figure(figsize=(5.5 * len(gpus), 5.0), layout="constrained")
    axes = fig.subplots(1, len(gpus), squeeze=False)[0]
    for ax, g in zip(axes, gpus, strict=True):
        cs = [c for c in checks if c.gpu == g]
        meas = [1e3 * c.measured_s for c in cs]
        ax.scatter(meas, [1e3 * c.default_s for c in cs], s=4, alpha=0.4, label="defaults")
        ax.scatter(meas, [1e3 * c.fitted_s for c in cs], s=4, alpha=0.4, label="calibrated")
        lo, hi = min(meas), max(meas)
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="predicted = measured")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured, ms (Vidur)")
        ax.set_ylabel("predicted, ms (roofline)")
        ax.set_title(f"{g}: a layer's four matmuls, {len(cs)} rows")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper left", markerscale=3)
    return save_png(fig, path)


def cmd_validate(args: argparse.Namespace, console: Console) -> int:
    """``fleetserve validate``: every profile row, predicted vs measured."""
    root, files = _profiles(args)
    default = (DEFAULT_PARAMS.compute_eff, DEFAULT_PARAMS.mem_eff)
    checks: list[RowCheck] = []
    for name, paths in files.items():
        rows = load_all(paths)
        gpu = get_gpu(VIDUR_GPUS[name])
        fit = fit_efficiencies(name, rows, gpu, default)
        checks.extend(check_rows(name, rows, gpu, default, fit))
    summary = summarize_checks(checks)
    console.print(validate_table(summary))
    console.print(
        f"{len(checks):,} rows from {root}; 'defaults' is the catalog's roofline "
        f"(compute_eff {default[0]:g}, mem_eff {default[1]:g}), what the simulator uses; "
        "'calibrated' is the smooth-knee fit of `fleetserve calibrate` (every row here, "
        "held-out or not; held-out errors: `fleetserve calibrate`). Attention kernels are "
        "not in these profiles.",
        highlight=False,
    )
    if args.out is not None:
        from fleetserve.experiments.report_common import write_csv

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows_out = [
            {
                **dataclasses.asdict(c),
                "default_error": c.default_error,
                "fitted_error": c.fitted_error,
            }
            for c in checks
        ]
        write_csv(out / "rows.csv", rows_out, ROW_COLUMNS)
        (out / "summary.json").write_text(
            json.dumps({"source": str(root), "groups": summary}, indent=2) + "\n"
        )
        _plot_checks(checks, out / "validate.png")
        console.print(f"written: {out}/rows.csv, summary.json, validate.png", highlight=False)
    return 0


def _add_vidur_arg(p: Any) -> None:
    p.add_argument(
        "--vidur",
        help="profiles folder with compute/<gpu>/<model>/mlp.csv (default: the shared "
        "data folder's profiles/)",
    )


def add_validate_parser(sub: Any) -> None:
    """The ``validate`` subcommand."""
    p = sub.add_parser(
        "validate",
        help="every measured kernel row (Vidur's profiles) against the cost model",
        description="Print, per GPU, model and token class, the cost model's predicted "
        "time of a layer's matmuls against the measured one for every row of Vidur's "
        "profiles, with the catalog's defaults and calibrated; write every row as CSV, a "
        "summary and a predicted-vs-measured plot with --out.",
    )
    _add_vidur_arg(p)
    p.add_argument("--out", help="write rows.csv, summary.json and validate.png in this folder")
    p.set_defaults(func=cmd_validate)


def add_calibrate_parser(sub: Any) -> None:
    """The ``calibrate`` subcommand."""
    p = sub.add_parser(
        "calibrate",
        help="check and fit the cost model against measured GPU kernels (Vidur's profiles)",
        description="Compare the roofline cost model with Vidur's measured MLP kernel "
        "profiles, fit its compute and memory efficiencies and a per-kernel latency on "
        "training rows, and report the errors on held-out rows per token class.",
    )
    _add_vidur_arg(p)
    p.add_argument("--out", help="write the fits and errors as JSON here")
    p.set_defaults(func=cmd_calibrate)
