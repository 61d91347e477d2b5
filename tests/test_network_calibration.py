"""The tensor-parallel all-reduce against Vidur's NCCL profiles (issue 22
item 1): the reader keeps intra-node rows, the fit recovers the parameters of
rows the model generated, and the catalog's defaults are the fit of the shared
profiles."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from fleetserve.cli.calibrate import stale_defaults
from fleetserve.costmodel import A100_PARAMS, H100_PARAMS
from fleetserve.costmodel.network import (
    NETWORK_TOPOLOGIES,
    AllReduceRow,
    allreduce_time,
    fit_allreduce,
    load_allreduce,
)
from fleetserve.errors import InputError
from fleetserve.spec import get_gpu
from fleetserve.workload.data import data_candidates

COLS = ["", "time_stats.all_reduce.median", "rank", "num_workers", "size", "devices_per_node"]


def _write(path: Path, eff: float, lat: float, *, bad: bool = False) -> Path:
    gpu = get_gpu("a100-80gb")
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLS)
        i = 0
        for workers in (2, 4, 8, 16):
            for size in [2048 * 4**k for k in range(12)]:
                per_node = min(workers, 8)
                row = AllReduceRow("x", 0, workers, size, 1.0)
                t = float(allreduce_time([row], gpu, eff, lat)[0]) * 1e3
                w.writerow([i, "x" if bad and i == 3 else t, 0, workers, size, per_node])
                i += 1
    return path


def test_the_fit_recovers_the_parameters_of_model_generated_rows(tmp_path: Path) -> None:
    rows = load_allreduce(_write(tmp_path / "all_reduce.csv", 0.55, 25e-6))
    assert {r.workers for r in rows} == {2, 4, 8}  # the 16-GPU rows span two nodes
    fit = fit_allreduce("a100", rows, get_gpu("a100-80gb"))
    assert (fit.eff, fit.latency_s) == pytest.approx((0.55, 25e-6))
    assert fit.errors["all"]["median_abs"] < 1e-9 and fit.held_out > 0
    assert fit.legacy_errors["all"]["median_signed"] < 0  # 0.7 and 20 µs: too fast


def test_bad_allreduce_profiles_are_named_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"b\.csv:5: column 'time_stats\.all_reduce\.median'"):
        load_allreduce(_write(tmp_path / "b.csv", 0.5, 1e-5, bad=True))
    (tmp_path / "c.csv").write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="not a Vidur all-reduce profile"):
        load_allreduce(tmp_path / "c.csv")
    with pytest.raises(InputError, match="cannot read"):
        load_allreduce(tmp_path / "nope.csv")


def test_the_catalog_defaults_are_the_fit_of_the_shared_profiles() -> None:
    roots = [d / "profiles" for d in data_candidates() if (d / "profiles").is_dir()]
    if not roots:
        pytest.skip("the shared profiles are not here")
    fits = []
    for name, topo in NETWORK_TOPOLOGIES.items():
        rows = load_allreduce(roots[0] / "network" / topo / "all_reduce.csv")
        gpu = get_gpu({"a100": "a100-80gb", "h100": "h100-80gb"}[name])
        fits.append(fit_allreduce(name, rows, gpu))
    assert stale_defaults([], [], {"a100": A100_PARAMS, "h100": H100_PARAMS}, fits) == []
    # prefill-sized messages (above 1 MB) within 20 % in median, held out
    assert all(f.errors["> 1 MB"]["median_abs"] < 0.20 for f in fits)
