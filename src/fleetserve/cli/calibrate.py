"""``fleetserve calibrate --vidur DIR``: the cost model against measured GPU kernels.

Reads Vidur's MLP kernel profiles (``compute/<gpu>/<model>/mlp.csv``), prints
for each GPU the roofline's error on the layer matmuls with the legacy
efficiencies and with the ones fitted on the training rows (errors on the
held-out rows, per token class), the element-wise operators' fit, and the
attention kernels' fit (:mod:`fleetserve.costmodel.attention`: the published
H100 figures, and a Vidur ``attention.csv`` given with ``--attention``); it
says where a fit differs from the catalog's defaults
(:data:`~fleetserve.costmodel.params.GPU_PARAMS`), and writes it all as JSON
with ``--out`` (:mod:`fleetserve.costmodel.vidur`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetserve.costmodel.attention import (
    H100_PUBLISHED,
    AttnFit,
    fit_attention,
    load_vidur_attention,
)
from fleetserve.costmodel.network import (
    NETWORK_TOPOLOGIES,
    AllReduceFit,
    fit_allreduce,
    load_allreduce,
)
from fleetserve.costmodel.params import DEFAULT_PARAMS, EfficiencyParams, gpu_defaults
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
    error: the roofline's ``max`` with the legacy efficiencies (0.65, 0.8),
    with fitted ones, and the smooth knee fitted (the catalog's default)."""
    t = Table(title="Layer matmuls vs Vidur's measured kernels: median / P90 |error|, held out")
    for col in ("GPU", "tokens", "rows", "max, legacy", "max, fitted", "knee, fitted"):
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


Errors = dict[str, dict[str, float]]


def legacy_vs_fit_table(
    title: str, class_label: str, fits: list[tuple[str, Errors, Errors]]
) -> Table:
    """Per GPU (``fits``: name, legacy errors, fitted errors) and class, the
    held-out rows' median / P90 absolute and median signed error."""
    t = Table(title=title)
    for col in ("GPU", class_label, "rows", "legacy", "legacy signed", "fitted", "fitted signed"):
        t.add_column(col, justify="left" if col in ("GPU", class_label) else "right")
    for gpu, legacy, fitted in fits:
        for name, d in fitted.items():
            d0 = legacy[name]
            t.add_row(
                gpu,
                name,
                f"{int(d['n'])}",
                _cell(d0),
                f"{100 * d0['median_signed']:+.1f}%",
                _cell(d),
                f"{100 * d['median_signed']:+.1f}%",
            )
    return t


def attention_table(fits: list[AttnFit]) -> Table:
    """Per GPU and kernel class: the legacy model and the fit (held out)."""
    return legacy_vs_fit_table(
        "Attention kernels vs measured: median / P90 |error|, held out",
        "class",
        [(f.gpu, f.default_errors, f.errors) for f in fits],
    )


def allreduce_table(fits: list[AllReduceFit]) -> Table:
    """Per GPU and message size class: the legacy model and the fit (held out)."""
    return legacy_vs_fit_table(
        "Tensor-parallel all-reduce vs measured (NCCL): median / P90 |error|, held out",
        "size",
        [(f.gpu, f.legacy_errors, f.errors) for f in fits],
    )


def stale_defaults(
    mlp: list[VidurFit],
    attn: list[AttnFit],
    catalog: dict[str, EfficiencyParams],
    allreduce: list[AllReduceFit] | None = None,
) -> list[str]:
    """Where a fit differs from the catalog's defaults by more than rounding:
    one line per parameter (empty: the catalog holds these fits)."""
    out = []

    def check(gpu: str, name: str, fitted: float, have: float, tol: float) -> None:
        if abs(fitted - have) > tol:
            out.append(f"{gpu}: {name} fitted {fitted:.4g}, catalog default {have:.4g}")

    for f in mlp:
        p = catalog[f.gpu]
        check(f.gpu, "matmul_knee", f.knee, p.matmul_knee or 0.0, 1e-9)
        check(f.gpu, "compute_eff", f.knee_compute_eff, p.compute_eff, 0.005)
        check(f.gpu, "mem_eff", f.knee_mem_eff, p.mem_eff, 0.005)
        check(f.gpu, "kernel_latency_s", f.knee_latency_s, p.kernel_latency_s, 0.5e-6)
        check(f.gpu, "elementwise_latency_s", f.elem_latency_s, p.elementwise_latency_s, 0.5e-6)
        check(f.gpu, "elementwise_rep", f.elem_rep, p.elementwise_rep, 0.05)
        check(f.gpu, "elementwise_shard", f.elem_shard, p.elementwise_shard, 0.05)
    for a in attn:
        p = catalog[a.gpu]
        check(a.gpu, "attn_eff", a.attn_eff, p.attn_eff, 0.005)
        check(a.gpu, "kv_mem_eff", a.kv_mem_eff, p.kv_memory_eff, 0.005)
        check(a.gpu, "attn_latency_s", a.latency_s, p.attn_latency_s, 0.5e-6)
        check(a.gpu, "attn_causal_factor", a.causal_factor, p.attn_causal_factor, 1e-6)
        check(a.gpu, "attn_query_waste", a.query_waste, p.attn_query_waste, 1e-6)
    for r in allreduce or []:
        p = catalog[r.gpu]
        check(r.gpu, "allreduce_eff", r.eff, p.allreduce_eff, 0.005)
        check(r.gpu, "allreduce_latency_s", r.latency_s, p.allreduce_latency_s, 0.5e-6)
    return out


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
            f"{f.kernel_latency_s * 1e6:.2f} µs per matmul kernel (legacy "
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
            f"{f.gpu} element-wise operators: {f.elem_latency_s * 1e6:.1f} µs per layer + "
            f"{f.elem_rep:.2f} (replicated) + {f.elem_shard:.2f} / tp (sharded) hidden states "
            f"of traffic per token and layer; a layer (matmuls + element-wise), held out: "
            f"{_cell((f.layer_errors or {})['all'])}",
            highlight=False,
        )
    attn_fits = [fit_attention("h100", list(H100_PUBLISHED), get_gpu("h100-80gb"))]
    if args.attention is not None:
        gpu = get_gpu(VIDUR_GPUS[args.attention_gpu])
        attn_rows = load_vidur_attention(args.attention)
        attn_fits.insert(0, fit_attention(args.attention_gpu, attn_rows, gpu))
    console.print(attention_table(attn_fits))
    if args.attention is None:
        console.print(
            "the A100's attention defaults come from Vidur's attention.csv, not shipped: "
            "pass --attention FILE to check them (docs/calibration.md says where to get it)",
            highlight=False,
        )
    for a in attn_fits:
        console.print(
            f"{a.gpu} attention: attn_eff {a.attn_eff:.3f}, kv_mem_eff {a.kv_mem_eff:.3f}, "
            f"{a.latency_s * 1e6:.1f} µs per kernel, causal factor {a.causal_factor:g}, "
            f"{a.query_waste:g} pairs of waste per query; {a.rows} rows, {a.held_out} held out",
            highlight=False,
        )
    ar_fits = []
    for name, topo in NETWORK_TOPOLOGIES.items():
        path = root / "network" / topo / "all_reduce.csv"
        if path.is_file():
            ar_fits.append(fit_allreduce(name, load_allreduce(path), get_gpu(VIDUR_GPUS[name])))
    if ar_fits:
        console.print(allreduce_table(ar_fits))
        for r in ar_fits:
            console.print(
                f"{r.gpu} all-reduce: allreduce_eff {r.eff:.3f}, {r.latency_s * 1e6:.0f} µs per "
                f"collective; {r.rows} intra-node rows, {r.held_out} held out",
                highlight=False,
            )
    catalog = {name: gpu_defaults(VIDUR_GPUS[name]) for name in VIDUR_GPUS}
    stale = stale_defaults(fits, attn_fits, catalog, ar_fits)
    if stale:
        console.print(
            "[bold]the catalog's defaults (fleetserve.costmodel.params.GPU_PARAMS) differ "
            "from these fits:[/]\n  " + "\n  ".join(stale),
            highlight=False,
        )
    else:
        console.print(
            "the catalog's defaults (fleetserve.costmodel.params.GPU_PARAMS) are these fits",
            highlight=False,
        )
    if args.out is not None:
        out: dict[str, Any] = {
            "source": str(root),
            "files": {k: [str(p) for p in v] for k, v in files.items()},
            "defaults": {"compute_eff": default[0], "mem_eff": default[1]},
            "fits": [dataclasses.asdict(f) for f in fits],
            "attention": [dataclasses.asdict(a) for a in attn_fits],
            "allreduce": [dataclasses.asdict(r) for r in ar_fits],
            "stale_defaults": stale,
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
    "legacy_s",
    "catalog_s",
    "legacy_error",
    "catalog_error",
)


def _short_model(name: str) -> str:
    """``Meta-Llama-3-70B`` -> ``Llama-3-70B``, ``Llama-2-7b-hf`` -> ``Llama-2-7b``."""
    return name.removeprefix("Meta-").removesuffix("-hf")


def validate_table(summary: list[dict[str, Any]]) -> Table:
    """Per GPU, model and token class: measured vs predicted layer matmuls
    (medians; errors ``predicted / measured - 1``)."""
    t = Table(title="A layer's matmuls: cost model vs measured (Vidur), every row")
    for col in ("GPU", "model", "tokens", "rows", "meas. ms", "pred. ms", "error", "legacy"):
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
            f"{1e3 * float(d['catalog_median_s']):.3f}",
            f"{100 * float(d['catalog_median_signed']):+.1f}%",
            f"{100 * float(d['legacy_median_signed']):+.1f}%",
        )
    t.caption = (
        "medians per group; pred. and error (pred. / meas. - 1): the catalog's defaults "
        "(the per-operation form fitted to these profiles), what the simulator uses; "
        "legacy: the single roofline max at compute 0.65 / memory 0.8, used before"
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
        ax.scatter(meas, [1e3 * c.legacy_s for c in cs], s=4, alpha=0.4, label="legacy max")
        ax.scatter(meas, [1e3 * c.catalog_s for c in cs], s=4, alpha=0.4, label="catalog")
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
        checks.extend(check_rows(name, rows, gpu, default, gpu_defaults(gpu.name)))
    summary = summarize_checks(checks)
    console.print(validate_table(summary))
    console.print(
        f"{len(checks):,} rows from {root}; 'pred.' is the catalog's per-operation default "
        "(GPU_PARAMS: the smooth knee fitted to these profiles), what the simulator uses; "
        f"'legacy' the single roofline max (compute_eff {default[0]:g}, mem_eff "
        f"{default[1]:g}) it used before. Every row here, held-out or not (held-out "
        "errors: `fleetserve calibrate`). Attention kernels are not in these profiles "
        "(`fleetserve calibrate` fits them).",
        highlight=False,
    )
    if args.out is not None:
        from fleetserve.experiments.report_common import write_csv

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows_out = [
            {
                **dataclasses.asdict(c),
                "legacy_error": c.legacy_error,
                "catalog_error": c.catalog_error,
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
        "training rows, and report the errors on held-out rows per token class; fit the "
        "attention kernels to measured ones (published H100 figures, a Vidur "
        "attention.csv with --attention); say where the catalog's defaults differ.",
    )
    _add_vidur_arg(p)
    p.add_argument(
        "--attention",
        help="a Vidur attention.csv (e.g. microsoft/vidur e2d00e9 "
        "data/profiling/a100/attention.csv) to fit the attention kernels of "
        "--attention-gpu on; the published H100 figures are always fitted",
    )
    p.add_argument(
        "--attention-gpu",
        default="a100",
        choices=sorted(VIDUR_GPUS),
        help="the GPU the --attention file was measured on (default a100)",
    )
    p.add_argument("--out", help="write the fits and errors as JSON here")
    p.set_defaults(func=cmd_calibrate)
