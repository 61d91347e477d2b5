"""``fleetserve reproduce fleet``: the composed stacks against each paper's own and vLLM.

Issue 21 item 6 composes the four designs for one fleet. This experiment runs every stack
of :data:`STACKS` on two fleet workloads (:data:`SCENARIOS`), both 8 models of mixed sizes
on 16 A100-80GB in the multi-LLM world::

    bursty   configs/fleet.yaml: the synthetic fleet (fleet.generator: fleet), Zipf
             popularity, a day compressed into 15 minutes, two bursts of 4x the fleet's
             rate on one model each
    trace    configs/fleet-trace.yaml: configs/default.yaml's trace (the Azure
             conversation trace, first 20 minutes; the built-in synthetic stand-in when
             the file is absent) with each request given a model by Zipf popularity
             (fleet.generator: trace)

and compares GPU-hours, peak GPUs, P99 TTFT and TPOT and SLO attainment
(:mod:`fleetserve.experiments.fleet_report`). The stacks are data (:class:`FleetStack`):
a label, the catalog stack it runs and config overrides. The catalog's ``fleet`` stack
(the designs composed with KunServe's drop/restore) joins the default list by itself once
:mod:`fleetserve.policy.catalog` has it (:func:`default_stacks`), compared with the stacks
its families combine (:func:`composed_of`).

Every run gets the same seed (``--seed``): all stacks of a scenario replay the same
requests. Runs go to ``OUT/runs/<scenario>/<label>/`` (normal result directories); the
report reads them back from disk, so ``--report-only`` re-renders and a later invocation
with other ``--stacks`` adds to the tables.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetserve.errors import FleetserveError, InputError, UnknownNameError
from fleetserve.experiments.report_common import check_stack_config
from fleetserve.experiments.runner import RunSpec
from fleetserve.policy.catalog import MULTI, STACKS, Stack, stacks_in
from fleetserve.workload.data import data_candidates, find_data_dir

logger = logging.getLogger(__name__)

AZURE_CONV = "azure_llm_2023_conv.csv"
"""The trace of ``configs/default.yaml`` (and of the ``trace`` scenario)."""

SLO_SCALE = 5.0
"""The headline SLO: 5 x the request's execution time on an idle system (SeaLLM §6.1)."""

FLEET_STACK = "fleet"
"""The catalog name of the fully composed stack (picked up when the catalog has it)."""


# --------------------------------------------------------------------------- stacks


@dataclass(frozen=True, slots=True)
class FleetStack:
    """A row of the tables: a catalog stack with config overrides.

    Attributes:
        label: row and folder name.
        stack: the catalog stack it runs (``policy.stack``).
        what: what it stands for, for the report.
        overrides: config overrides, a nested dict merged into the run's config
            (e.g. ``{"policy": {"memory": "elastic"}}``).
        composes: labels of the stacks whose designs it combines; the report
            compares it with each of them and with ``vllm``.
        cost: relative simulation cost (heavy runs start first).
    """

    label: str
    stack: str
    what: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    composes: tuple[str, ...] = ()
    cost: float = 1.0

    @property
    def composed(self) -> bool:
        """Whether it combines several designs."""
        return bool(self.composes)


BASELINE = "vllm"
"""The label every stack is compared with."""

STACKS_BASE: tuple[FleetStack, ...] = (
    FleetStack("vllm", "vllm", "vLLM: dedicated GPUs per model, split by rate (baseline)"),
    FleetStack(
        "vllm-elastic",
        "vllm",
        "Mell's elastic pool under vLLM's dedicated groups (policy.memory=elastic): idle "
        "groups release their GPUs and reload on demand. Mell's own stack packs one "
        "model's KV over an elastic pool (single-model world); in a multi-model world "
        "this is the closest to it",
        overrides={"policy": {"memory": "elastic"}},
    ),
    FleetStack(
        "seallm",
        "seallm",
        "SeaLLM: search placement, DB scheduling, merged KV, adaptive re-placement",
        cost=6.0,
    ),
    FleetStack(
        "muxserve",
        "muxserve",
        "MuxServe: enumeration placement, ADBS, head-wise KV",
        cost=3.0,
    ),
    FleetStack(
        "seallm-mell",
        "seallm-mell",
        "SeaLLM on Mell's elastic pool, re-placements moved by Mell's adaptive migration",
        composes=("seallm", "vllm-elastic"),
        cost=10.0,
    ),
    FleetStack(
        "muxserve-mell",
        "muxserve-mell",
        "MuxServe on Mell's elastic pool",
        composes=("muxserve", "vllm-elastic"),
        cost=3.0,
    ),
)
"""The stacks every build has, in display order."""


def catalog_has_fleet() -> bool:
    """Whether :mod:`fleetserve.policy.catalog` has a ``fleet`` stack."""
    return FLEET_STACK in STACKS


def composed_of(stack: Stack) -> tuple[str, ...]:
    """The labels of :data:`STACKS_BASE` a catalog stack combines, read from its
    families: the paper's own stack of its placement (``seallm`` or ``muxserve``) and,
    on Mell's elastic pool, that stack's ``-mell`` composition and ``vllm-elastic``."""
    labels = {s.label for s in STACKS_BASE}
    own = stack.placement if stack.placement in labels else None
    elastic = stack.memory == "elastic"
    out = []
    if own is not None and elastic and f"{own}-mell" in labels and stack.name != f"{own}-mell":
        out.append(f"{own}-mell")
    if own is not None:
        out.append(own)
    if elastic:
        out.append("vllm-elastic")
    return tuple(out)


def default_stacks() -> tuple[FleetStack, ...]:
    """:data:`STACKS_BASE`, plus the catalog's ``fleet`` stack when it has one
    (described as the catalog does, compared with the stacks it combines:
    :func:`composed_of`)."""
    if not catalog_has_fleet():
        return STACKS_BASE
    fleet = STACKS[FLEET_STACK]
    entry = FleetStack(
        FLEET_STACK, FLEET_STACK, fleet.description, composes=composed_of(fleet), cost=10.0
    )
    return (*STACKS_BASE, entry)


def stack_spec(label: str) -> FleetStack:
    """The stack called ``label``: one of :func:`default_stacks`, or any catalog stack of
    the multi-LLM world (run as is, under its own name).

    Raises:
        UnknownNameError: neither.
    """
    for st in default_stacks():
        if st.label == label:
            return st
    multi = stacks_in(MULTI)
    if label in multi:
        return FleetStack(label, label, multi[label].description)
    known = [s.label for s in default_stacks()] + [n for n in multi if n != BASELINE]
    note = "the catalog has no 'fleet' stack yet" if label == FLEET_STACK else "any multi-LLM stack"
    raise UnknownNameError("fleet stack", label, dict.fromkeys(known), note)


def select_stacks(names: Sequence[str] | None) -> list[FleetStack]:
    """The stacks called ``names`` (default: :func:`default_stacks`), in the given order.

    Raises:
        UnknownNameError: an unknown label.
        FleetserveError: an empty or repeated selection.
    """
    if names is None:
        return list(default_stacks())
    if not names:
        raise FleetserveError("--stacks needs at least one stack name")
    if len(set(names)) != len(names):
        raise FleetserveError(f"--stacks lists a stack twice: {','.join(names)}")
    return [stack_spec(n) for n in names]


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload of the comparison.

    Attributes:
        name: ``bursty`` or ``trace`` (folder name).
        title: a line for the report.
        config_file: the config file it reproduces (``configs/...``).
        cost: relative simulation cost per stack.
    """

    name: str
    title: str
    config_file: str
    cost: float = 1.0


BURSTY = Scenario(
    "bursty",
    "synthetic fleet: Zipf popularity, diurnal curve, two 4x bursts on one model",
    "configs/fleet.yaml",
)
TRACE = Scenario(
    "trace",
    "configs/default.yaml's Azure conversation trace split over the 8 models by Zipf",
    "configs/fleet-trace.yaml",
    cost=4.0,
)
SCENARIOS: tuple[Scenario, ...] = (BURSTY, TRACE)
"""Both workloads, in display order."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """Run lengths of a mode.

    Attributes:
        duration_s: the bursty run's length (= its compressed day).
        burst_gap_s: mean gap between its two burst starts.
        burst_len_s: length of each burst.
        end_s: the trace window ``[0, end_s)``.
        history_s: what placement sees before the run (both).
    """

    duration_s: float
    burst_gap_s: float
    burst_len_s: float
    end_s: float
    history_s: float


FULL = Sizes(duration_s=900.0, burst_gap_s=300.0, burst_len_s=10.0, end_s=1200.0, history_s=60.0)
"""``configs/fleet.yaml`` and ``configs/fleet-trace.yaml`` as written."""

QUICK = Sizes(duration_s=300.0, burst_gap_s=100.0, burst_len_s=10.0, end_s=240.0, history_s=60.0)
"""``--quick``: 5 minutes of the bursty fleet, the trace's first 4 minutes (one SeaLLM
re-placement instead of two: each costs a placement search of tens of seconds here, and
the quick mode must stay under 2 minutes on 2 cores with the ``fleet`` stack too)."""


@dataclass(frozen=True, slots=True)
class Mode:
    """Full or ``--quick``, times a hidden test scale (every length x ``scale``)."""

    quick: bool = False
    scale: float = 1.0
    seed: int = 0

    def sizes(self) -> Sizes:
        """The run lengths of this mode."""
        b = QUICK if self.quick else FULL
        k = self.scale
        return Sizes(
            b.duration_s * k, b.burst_gap_s * k, b.burst_len_s * k, b.end_s * k, b.history_s * k
        )

    @property
    def name(self) -> str:
        """``full`` or ``quick`` (with the scale when it is not 1)."""
        base = "quick" if self.quick else "full"
        return base if self.scale == 1.0 else f"{base} x{self.scale:g}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description (for ``report.json``)."""
        s = self.sizes()
        return {
            "name": self.name,
            "quick": self.quick,
            "scale": self.scale,
            "seed": self.seed,
            "bursty_duration_s": s.duration_s,
            "trace_end_s": s.end_s,
            "history_s": s.history_s,
        }


def trace_path() -> Path:
    """The Azure conversation trace in the shared data folder; when no folder holds it,
    the first place searched (the run then uses the synthetic stand-in, with a note)."""
    try:
        return find_data_dir([AZURE_CONV]) / AZURE_CONV
    except InputError:
        return (data_candidates()[0] / AZURE_CONV).absolute()


GPU = "a100-80gb"
GPUS = 16
KEEPALIVE_S = 10.0


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def workload_config(sc: Scenario, mode: Mode) -> dict[str, Any]:
    """The plain config dict of scenario ``sc`` (no stack): the config file's settings at
    the mode's lengths."""
    s = mode.sizes()
    if sc.name == BURSTY.name:
        fleet: dict[str, Any] = {
            "generator": "fleet",
            "rate": 2.0,
            "duration_s": s.duration_s,
            "period_s": s.duration_s,
            "bursts": 2,
            "burst_gap_s": s.burst_gap_s,
            "burst_len_s": s.burst_len_s,
            "burst_height": 4.0,
            "burst_after_s": s.history_s,  # the bursts fall in the run, not its history
        }
    else:
        fleet = {
            "generator": "trace",
            "trace": str(trace_path()),
            "format": "azure",
            "if_missing": "synthetic",
            "end_s": s.end_s,
            "length_scale": 1.0,
            "zipf": 1.0,
        }
    return {
        "seed": mode.seed,
        "cluster": {"gpu": GPU, "gpus": GPUS},
        "fleet": fleet,
        "multi": {
            "history_s": s.history_s,
            "keepalive_s": KEEPALIVE_S,
            "processes": 1,  # the grid runs one simulation per core already
        },
        "slo_scales": [1.5, 2.0, 3.0, SLO_SCALE, 10.0, 20.0, 50.0],
    }


def run_config(sc: Scenario, st: FleetStack, mode: Mode) -> dict[str, Any]:
    """The plain config dict of one run."""
    cfg = _merge(workload_config(sc, mode), {"policy": {"stack": st.stack}})
    return _merge(cfg, st.overrides)


def run_dir(out: Path, sc: Scenario | str, st: FleetStack | str) -> Path:
    """``OUT/runs/<scenario>/<label>``."""
    name = sc if isinstance(sc, str) else sc.name
    label = st if isinstance(st, str) else st.label
    return out / "runs" / name / label


def grid_specs(out: Path, stacks: Sequence[FleetStack], mode: Mode) -> list[RunSpec]:
    """One :class:`RunSpec` per (scenario, stack)."""
    return [
        RunSpec(
            key=f"{sc.name}/{st.label}",
            out_dir=run_dir(out, sc, st),
            config=run_config(sc, st, mode),
            weight=sc.cost * st.cost,
        )
        for sc in SCENARIOS
        for st in stacks
    ]


def plan(
    out: Path, mode: Mode, stacks: Sequence[str] | None = None
) -> tuple[list[RunSpec], list[str]]:
    """Validate the grid and return its runs (nothing is simulated yet) and notes.

    With the default selection, a catalog ``fleet`` stack that cannot run on these
    configs (e.g. it needs another world) is left out with a note; named with
    ``--stacks`` it is an error like any other.

    Raises:
        FleetserveError: an unknown stack, or a config that cannot run.
    """
    selected = select_stacks(stacks)
    notes: list[str] = []
    kept = []
    for st in selected:
        try:
            for sc in SCENARIOS:
                check_stack_config(st.label, run_config(sc, st, mode))
        except FleetserveError as e:
            if stacks is not None or st.label != FLEET_STACK:
                raise
            notes.append(f"the catalog's {FLEET_STACK!r} stack was left out: {e}")
            continue
        kept.append(st)
    specs = grid_specs(out, kept, mode)
    logger.info("fleet grid: %d runs (%s)", len(specs), mode.name)
    return specs, notes


__all__ = [
    "BASELINE",
    "BURSTY",
    "FLEET_STACK",
    "FULL",
    "QUICK",
    "SCENARIOS",
    "SLO_SCALE",
    "STACKS_BASE",
    "TRACE",
    "FleetStack",
    "Mode",
    "Scenario",
    "Sizes",
    "catalog_has_fleet",
    "composed_of",
    "default_stacks",
    "grid_specs",
    "plan",
    "run_config",
    "run_dir",
    "select_stacks",
    "stack_spec",
    "trace_path",
    "workload_config",
]
