r"""Tensor-parallel all-reduce against measurements: Vidur's collective profiles.

``../shared/data/profiles/network/<topology>/all_reduce.csv`` (Vidur, MIT; the
folder's README) times NCCL all-reduces of 2 KB to 64 MB (``size``: bytes, fp16
elements x 2) among ``num_workers`` GPUs, ``devices_per_node`` of them per node.
The cost model prices one all-reduce of ``M`` bytes on a ``tp``-GPU group as a
ring (:mod:`fleetserve.costmodel.roofline`)::

    t = allreduce_latency_s + M 2 (tp - 1) / tp / (I allreduce_eff)

``I`` the GPU's intra-node link bandwidth (the catalog's NVLink figure). This
module reads the format, keeps the intra-node rows (``devices_per_node ==
num_workers``: a tensor-parallel group never spans nodes) of the DGX topologies
(``a100_dgx``, ``h100_dgx``: NVSwitch, every GPU pair at full NVLink), and fits
``allreduce_eff`` and ``allreduce_latency_s`` per GPU minimising the squared
relative error, the two size classes (up to 1 MB: a decode's activations;
larger: a prefill's) weighing the same; every fifth size of the grid is held out
and the errors are reported on those rows.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetserve.costmodel.vidur import class_error_stats, csv_number, equal_class_weights
from fleetserve.errors import InputError
from fleetserve.spec.types import GpuSpec

__all__ = [
    "NETWORK_TOPOLOGIES",
    "AllReduceFit",
    "AllReduceRow",
    "allreduce_time",
    "fit_allreduce",
    "load_allreduce",
]

NETWORK_TOPOLOGIES = {"a100": "a100_dgx", "h100": "h100_dgx"}
"""The Vidur topology folder whose all-reduces stand for each GPU's tensor-parallel group."""

_SMALL = 1 << 20  # size classes: up to 1 MB (decode-sized), larger (prefill-sized)
_CLASSES = ("<= 1 MB", "> 1 MB")


@dataclass(frozen=True, slots=True)
class AllReduceRow:
    """One measured all-reduce: ``workers`` GPUs on one node, ``size`` bytes."""

    file: str
    line: int
    workers: int
    size: int
    time_s: float

    @property
    def size_class(self) -> str:
        return "<= 1 MB" if self.size <= _SMALL else "> 1 MB"


def load_allreduce(path: str | Path) -> list[AllReduceRow]:
    """The intra-node rows of one Vidur ``all_reduce.csv``.

    Raises:
        InputError: a missing file or column, or a bad value (file, line, column).
    """
    p = Path(path)
    try:
        fh = p.open(newline="")
    except OSError as e:
        raise InputError(f"{p}: cannot read the all-reduce profile ({e.strerror or e})") from None
    need = ("time_stats.all_reduce.median", "num_workers", "size", "devices_per_node")
    out: list[AllReduceRow] = []
    with fh:
        reader = csv.DictReader(fh)
        missing = [c for c in need if c not in (reader.fieldnames or ())]
        if missing:
            raise InputError(
                f"{p}:1: not a Vidur all-reduce profile: columns {', '.join(missing)} missing"
            )
        for i, raw in enumerate(reader, start=2):
            vals = {col: csv_number(raw, col, str(p), i) for col in need}
            zero = [col for col in need if vals[col] == 0]
            if zero:
                raise InputError(f"{p}:{i}: column {zero[0]!r}: expected a number > 0, got 0")
            workers = int(vals["num_workers"])
            if int(vals["devices_per_node"]) != workers or workers < 2:
                continue  # spans nodes (or one GPU): not a tensor-parallel group
            out.append(
                AllReduceRow(
                    str(p),
                    i,
                    workers,
                    int(vals["size"]),
                    vals["time_stats.all_reduce.median"] / 1e3,
                )
            )
    if not out:
        raise InputError(f"{p}: no intra-node all-reduce rows (devices_per_node == num_workers)")
    return out


def allreduce_time(
    rows: Sequence[AllReduceRow], gpu: GpuSpec, eff: float, latency_s: float
) -> np.ndarray:
    """The cost model's time of each row's all-reduce, seconds."""
    m = np.array([r.size for r in rows], dtype=np.float64)
    k = np.array([r.workers for r in rows], dtype=np.float64)
    out: np.ndarray = latency_s + m * 2.0 * (k - 1.0) / k / (gpu.intra_node_bw * eff)
    return out


@dataclass(frozen=True, slots=True)
class AllReduceFit:
    """The fitted all-reduce parameters of one GPU and the held-out errors
    (``predicted / measured - 1``; ``legacy_errors``: at the legacy defaults,
    efficiency 0.7 and 20 µs)."""

    gpu: str
    rows: int
    held_out: int
    eff: float
    latency_s: float
    errors: dict[str, dict[str, float]]
    legacy_errors: dict[str, dict[str, float]]


def fit_allreduce(name: str, rows: Sequence[AllReduceRow], gpu: GpuSpec) -> AllReduceFit:
    """Fit ``allreduce_eff`` and ``allreduce_latency_s`` on the training rows.

    Raises:
        InputError: too few sizes to hold some out.
    """
    rows = list(rows)
    grid = sorted({r.size for r in rows})
    held_sizes = {s for i, s in enumerate(grid) if i % 5 == 2}
    held = np.array([r.size in held_sizes for r in rows])
    train = [r for r, h in zip(rows, held, strict=True) if not h]
    test = [r for r, h in zip(rows, held, strict=True) if h]
    if not train or not test:
        raise InputError(f"{name}: too few all-reduce sizes to hold some out")
    y = np.array([r.time_s for r in train])
    w = equal_class_weights([r.size_class for r in train])
    best = (math.inf, 0.7, 20e-6)
    for eff in np.linspace(0.2, 1.0, 161):
        lats = np.arange(0.0, 101e-6, 1e-6)
        pred = allreduce_time(train, gpu, float(eff), 0.0)[None, :] + lats[:, None]
        err = pred / y[None, :] - 1.0
        loss = (err * err) @ w
        k = int(np.argmin(loss))
        if loss[k] < best[0]:
            best = (float(loss[k]), float(eff), float(lats[k]))
    _, eff, lat = best
    y_test = np.array([r.time_s for r in test])
    c_test = [r.size_class for r in test]
    fitted = allreduce_time(test, gpu, eff, lat)
    legacy = allreduce_time(test, gpu, 0.7, 20e-6)
    return AllReduceFit(
        gpu=name,
        rows=len(rows),
        held_out=len(test),
        eff=round(eff, 3),
        latency_s=lat,
        errors=class_error_stats(fitted / y_test - 1.0, c_test, _CLASSES),
        legacy_errors=class_error_stats(legacy / y_test - 1.0, c_test, _CLASSES),
    )
