"""Mell §VIII (Figs. 11-15): GPUs, migrations and KV utilization of five stacks.

The grid, as data::

    hardware (2)  x  workload (4)                        x  stack (5)
    13B/A100-40GB    Poisson λ = 0.5, 0.8, 1.1 (ShareGPT)    bf, wf, llumnix,
    7B/RTX 4090      Azure conv (its own arrivals)           mell, mell-nobatch

Every request's prompt and output are ×10 (Mell's long-context setting) and
capped so its KV fits one instance (Mell's S ≤ C). The pool is elastic: a GPU
is switched on when no active one can take a request and off when idle.
Arrivals are kept for a window of :data:`FULL_WINDOW_S` seconds
(:data:`QUICK_WINDOW_S` with ``--quick``); the runs then drain.

Each run writes ``OUT/runs/<hardware>/<workload>/<stack>/``; the report
(:mod:`fleetserve.experiments.mell_report`) reads them back from disk, so a
later invocation with other ``--stacks`` into the same folder adds to the table.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetserve.config import config_from_dict
from fleetserve.errors import FleetserveError, UnknownNameError
from fleetserve.experiments.runner import RunSpec
from fleetserve.sim.simulator import preflight
from fleetserve.spec import get_model
from fleetserve.workload.data import find_data_dir

logger = logging.getLogger(__name__)

SHAREGPT = "sharegpt_8k_lengths.csv"
"""ShareGPT prompt/response lengths (no timestamps): the Poisson workloads."""

AZURE_CONV = "azure_llm_2023_conv.csv"
"""Azure LLM inference trace, conversation service (about one hour)."""

LENGTH_SCALE = 10.0
"""Mell scales every conversation ×10 to mimic long-context models."""

FULL_WINDOW_S = 3600.0
"""Arrival window of a full run: one hour (the whole Azure conv trace)."""

QUICK_WINDOW_S = 600.0
"""Arrival window of a ``--quick`` run: the first ten minutes."""


@dataclass(frozen=True, slots=True)
class Hardware:
    """A model on a GPU type (one panel of Mell's figures)."""

    name: str
    model: str
    gpu: str
    label: str


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """An arrival process over a length source.

    Attributes:
        name: folder name and key.
        label: human-readable name.
        trace: file name in the shared data folder.
        format: trace format.
        rate: Poisson rate (req/s) for ``lengths`` traces; None keeps the trace's times.
        approx_rate: expected arrivals per second (for cost estimates and docs).
    """

    name: str
    label: str
    trace: str
    format: str
    rate: float | None
    approx_rate: float


@dataclass(frozen=True, slots=True)
class StackSpec:
    """A column of the figures: a registered stack plus config overrides.

    Attributes:
        label: column and folder name (``mell-nobatch``).
        stack: the registered stack it runs (``mell``).
        paper: the name the paper uses.
        overrides: config sections merged into the run's config.
        cost: relative simulation cost (for scheduling heavy runs first).
    """

    label: str
    stack: str
    paper: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    cost: float = 1.0


HARDWARE: tuple[Hardware, ...] = (
    Hardware("llama-2-13b_a100-40gb", "llama-2-13b", "a100-40gb", "LLaMA-2-13B on A100-40GB"),
    Hardware("llama-2-7b_rtx4090-24gb", "llama-2-7b", "rtx4090-24gb", "LLaMA-2-7B on RTX 4090"),
)

WORKLOADS: tuple[WorkloadSpec, ...] = (
    WorkloadSpec("poisson-0.5", "Poisson λ=0.5", SHAREGPT, "lengths", 0.5, 0.5),
    WorkloadSpec("poisson-0.8", "Poisson λ=0.8", SHAREGPT, "lengths", 0.8, 0.8),
    WorkloadSpec("poisson-1.1", "Poisson λ=1.1", SHAREGPT, "lengths", 1.1, 1.1),
    WorkloadSpec("azure-conv", "Azure conv", AZURE_CONV, "azure", None, 5.5),
)

STACKS: tuple[StackSpec, ...] = (
    StackSpec("bf", "bf", "BF"),
    StackSpec("wf", "wf", "WF"),
    StackSpec("llumnix", "llumnix", "LB", cost=3.0),
    StackSpec("mell", "mell", "MELL", cost=4.0),
    StackSpec("mell-nobatch", "mell", "MELL w/o batching", {"mell": {"batching": False}}, 4.0),
)
"""Default stacks, in display order."""

BASELINES: tuple[str, ...] = ("bf", "wf", "llumnix")
"""Stacks Mell's GPU saving is measured against."""

MELL = "mell"
MELL_NOBATCH = "mell-nobatch"
FIG15_WORKLOAD = "poisson-1.1"
"""Workload of Fig. 15 (GPUs over time): the highest Poisson rate."""


@dataclass(frozen=True, slots=True)
class Mode:
    """Size of the runs: full or ``--quick``, times a hidden test scale."""

    quick: bool = False
    scale: float = 1.0
    seed: int = 0

    @property
    def window_s(self) -> float:
        """Arrival window of every workload, seconds."""
        return (QUICK_WINDOW_S if self.quick else FULL_WINDOW_S) * self.scale

    @property
    def name(self) -> str:
        """``full`` or ``quick`` (with the scale when it is not 1)."""
        base = "quick" if self.quick else "full"
        return base if self.scale == 1.0 else f"{base} x{self.scale:g}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description (for ``results.json``)."""
        return {
            "name": self.name,
            "quick": self.quick,
            "scale": self.scale,
            "seed": self.seed,
            "window_s": self.window_s,
        }


def select_stacks(names: Sequence[str] | None) -> list[StackSpec]:
    """The stacks called ``names`` (all of :data:`STACKS` when None), in the given order.

    Raises:
        UnknownNameError: a name that is not one of :data:`STACKS`.
        FleetserveError: an empty or repeated selection.
    """
    if names is None:
        return list(STACKS)
    by_label = {s.label: s for s in STACKS}
    if not names:
        raise FleetserveError("--stacks needs at least one stack name")
    if len(set(names)) != len(names):
        raise FleetserveError(f"--stacks lists a stack twice: {','.join(names)}")
    out = []
    for n in names:
        if n not in by_label:
            raise UnknownNameError("stack", n, by_label)
        out.append(by_label[n])
    return out


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def run_config(
    hw: Hardware, wl: WorkloadSpec, st: StackSpec, mode: Mode, data_dir: Path
) -> dict[str, Any]:
    """The plain config dict of one run.

    Every stack of a (hardware, workload) pair gets the same seed, hence the
    same arrivals; workloads get ``mode.seed + their index``.
    """
    workload: dict[str, Any] = {
        "trace": str(data_dir / wl.trace),
        "format": wl.format,
        "end_s": mode.window_s,
        "length_scale": LENGTH_SCALE,
        "cap_lengths": True,
    }
    if wl.rate is not None:
        workload["rate"] = wl.rate
    base = {
        "model": hw.model,
        "seed": mode.seed + WORKLOADS.index(wl),
        "workload": workload,
        "cluster": {"gpu": hw.gpu, "elastic": True},
        "policy": {"stack": st.stack},
        # Mell's x10 lengths stand for long-context models: the served context
        # window is scaled with them (otherwise most requests exceed it)
        "engine": {"max_model_len": int(LENGTH_SCALE * get_model(hw.model).max_context)},
    }
    return _merge(base, st.overrides)


def run_dir(out: Path, hw: Hardware, wl: WorkloadSpec, st: StackSpec) -> Path:
    """``OUT/runs/<hardware>/<workload>/<stack>``."""
    return out / "runs" / hw.name / wl.name / st.label


def check_stacks(stacks: Sequence[StackSpec], mode: Mode, data_dir: Path) -> None:
    """Validate every run's config (stack registered, models fit) before anything runs.

    Raises:
        FleetserveError: the first problem, as one line.
    """
    for st in stacks:
        for hw in HARDWARE:
            try:
                preflight(config_from_dict(run_config(hw, WORKLOADS[0], st, mode, data_dir)))
            except UnknownNameError as e:
                if e.kind != "stack":
                    raise
                raise FleetserveError(
                    f"experiment stack {st.label!r} cannot run in this build: {e} "
                    "(choose others with --stacks)"
                ) from None


def grid_specs(out: Path, stacks: Sequence[StackSpec], mode: Mode, data_dir: Path) -> list[RunSpec]:
    """One :class:`RunSpec` per (hardware, workload, stack)."""
    specs = []
    for hw in HARDWARE:
        for wl in WORKLOADS:
            for st in stacks:
                specs.append(
                    RunSpec(
                        key=f"{hw.name}/{wl.name}/{st.label}",
                        out_dir=run_dir(out, hw, wl, st),
                        config=run_config(hw, wl, st, mode, data_dir),
                        weight=wl.approx_rate * mode.window_s * st.cost,
                    )
                )
    return specs


def plan_mell(out: Path, mode: Mode, stacks: Sequence[str] | None = None) -> list[RunSpec]:
    """Validate a Mell grid and return its runs (nothing is simulated yet).

    Args:
        out: output folder (runs go to ``out/runs/...``).
        mode: run sizes and seed.
        stacks: stack labels (default: all of :data:`STACKS`).

    Raises:
        FleetserveError: unknown stack, missing shared data, a config that cannot run.
    """
    selected = select_stacks(stacks)
    data_dir = find_data_dir([SHAREGPT, AZURE_CONV])
    check_stacks(selected, mode, data_dir)
    specs = grid_specs(out, selected, mode, data_dir)
    logger.info("mell grid: %d runs from %s (%s)", len(specs), data_dir, mode.name)
    return specs
