"""SeaLLM §6 (Figs. 6-8, 10) and MuxServe §5 (Fig. 5, ADBS ablation) as grids of runs.

Both experiments are grids of ordinary multi-LLM simulations (a ``multi:``
config with a workload generator, see :class:`fleetserve.config.MultiConfigSection`)::

    seallm    total rate (req/s) x stack
              32 x A800-80GB; 8 services (LLaMA-2 7B/13B/70B, OPT-6.7B x chat/summarization),
              Gamma arrivals (CV 4) with a rotating hot service
              stacks: vllm, alpaserve, muxserve, seallm (main);
                      seallm-fcfs, seallm-mlfq, seallm-noplace, seallm-norepl (ablations)
    muxserve  power-law alpha x stack, fixed total rate
              32 x A100-80GB; 19 LLaMA models, Poisson arrivals, ShareGPT lengths
              stacks: vllm (spatial), alpaserve (temporal), muxserve (main);
                      muxserve-rr, muxserve-fcfs (ADBS ablation)

Every run gets the same seed (``--seed``, default 0): every stack of a point
sees the same history and run, and the points share their random draws
(common random numbers). The ``seallm`` generator maps one unit-rate Gamma
process per service through the rate, so a higher rate replays the same
bursts faster; the ``muxserve`` generator draws each service's Poisson process
and lengths from the same streams at every alpha. Curves over the axis are
therefore not blurred by a new random workload at every point.

Each run writes ``OUT/runs/<point>/<stack>/`` (a normal result directory);
the report (:mod:`fleetserve.experiments.multi_llm_report`) reads them back
from disk, so a later invocation with other ``--stacks`` into the same folder
adds to the tables.

The rate axis of ``seallm`` is not the paper's (2-50 req/s): our ShareGPT file
has 30x longer prompts than SeaLLM's and the summarization prompts are ~13k
tokens, so 32 GPUs saturate at a few req/s; see ``docs/reproduce-seallm.md``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetserve.errors import FleetserveError, UnknownNameError
from fleetserve.experiments.report_common import check_stack_config
from fleetserve.experiments.runner import RunSpec
from fleetserve.workload.data import find_data_dir

logger = logging.getLogger(__name__)

SHAREGPT = "sharegpt_8k_lengths.csv"
"""ShareGPT prompt/response lengths: the chat lengths of both generators."""

SLO_SCALES: tuple[float, ...] = (1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)
"""SLO scales of every run (SeaLLM Fig. 10's range)."""

SLO_SCALE = 5.0
"""The headline SLO: 5 x the request's execution time (SeaLLM §6.1)."""

MAIN = "main"
ABLATION = "ablation"
VARIANT = "variant"
"""A stack that is not in the paper, shown next to the ablations (e.g. SeaLLM
without the two-services-per-group cap)."""


@dataclass(frozen=True, slots=True)
class StackSpec:
    """A column of the tables: a registered multi-LLM stack and its settings.

    Attributes:
        label: column and folder name.
        paper: the name the paper uses.
        role: :data:`MAIN` (end-to-end comparison), :data:`ABLATION` or :data:`VARIANT`.
        cost: relative simulation cost (heavy runs start first).
        stack: the registered stack it runs (default: ``label``).
        capped: whether the experiment's ``max_services`` applies.
    """

    label: str
    paper: str
    role: str
    cost: float = 1.0
    stack: str | None = None
    capped: bool = True

    @property
    def name(self) -> str:
        """The registered stack name."""
        return self.stack or self.label


@dataclass(frozen=True, slots=True)
class Sizes:
    """Length of every run of a mode (before the hidden test scale)."""

    duration_s: float
    history_s: float
    replacement_interval_s: float
    rotate_s: float | None = None  # the seallm generator's hot-service window (None: 60 s)


@dataclass(frozen=True, slots=True)
class Experiment:
    """One paper's grid.

    Attributes:
        name: ``seallm`` or ``muxserve``.
        title: report title.
        generator: the ``multi.generator`` of its runs.
        gpu, gpus: the pool.
        axis: ``rate`` (total req/s varies) or ``alpha`` (power-law exponent varies).
        axis_label: axis title of the figures.
        points: values of the axis in a full run.
        quick_points: values in a ``--quick`` run.
        stacks: every stack, in display order.
        quick_stacks: labels run by ``--quick`` (all of them by default).
        full, quick: run lengths.
        rate: the fixed total rate (``alpha`` axis).
        max_services: services per group at most in SeaLLM's search (when the
            search accepts it).
        focus: the point of the SLO-scale curve (Fig. 10), when run; else the
            highest point that was.
    """

    name: str
    title: str
    generator: str
    gpu: str
    gpus: int
    axis: str
    axis_label: str
    points: tuple[float, ...]
    quick_points: tuple[float, ...]
    stacks: tuple[StackSpec, ...]
    full: Sizes
    quick: Sizes
    quick_stacks: tuple[str, ...] | None = None
    rate: float = 10.0
    max_services: int | None = None
    focus: float | None = None

    def point_name(self, value: float) -> str:
        """Folder name of a point: ``rate-2`` or ``alpha-1.3``."""
        return f"{self.axis}-{value:g}"

    def point_label(self, value: float) -> str:
        """Human label of a point: ``2 req/s`` or ``α=1.3``."""
        return f"{value:g} req/s" if self.axis == "rate" else f"α={value:g}"

    def labels(self, role: str | None = None) -> list[str]:
        """Stack labels (of one role), in display order."""
        return [s.label for s in self.stacks if role is None or s.role == role]


SEALLM = Experiment(
    name="seallm",
    title="SeaLLM §6 (Figs. 6-8, 10)",
    generator="seallm",
    gpu="a800-80gb",
    gpus=32,
    axis="rate",
    axis_label="total request rate (req/s)",
    # light load to overload for our lengths (the paper's 2-50 req/s would not fit:
    # 32 GPUs saturate at 3-4 req/s here; docs/reproduce-seallm.md)
    points=(0.5, 1.0, 2.0, 3.0, 4.0),
    quick_points=(1.0, 2.0),
    stacks=(
        StackSpec("vllm", "vLLM", MAIN),
        StackSpec("alpaserve", "AlpaServe", MAIN),
        StackSpec("muxserve", "MuxServe", MAIN),
        StackSpec("seallm", "SeaLLM", MAIN, cost=8.0),
        StackSpec("seallm-fcfs", "SeaLLM-F", ABLATION, cost=10.0),
        StackSpec("seallm-mlfq", "SeaLLM-M", ABLATION, cost=12.0),
        StackSpec("seallm-noplace", "SeaLLM-P", ABLATION),
        StackSpec("seallm-norepl", "SeaLLM-A", ABLATION, cost=4.0),
        StackSpec(
            "seallm-nocap",
            "SeaLLM, no 2-services cap",
            VARIANT,
            cost=25.0,
            stack="seallm",
            capped=False,
        ),
    ),
    # the hot service changes once in a run, after the history and most of the run (quick:
    # 30 s, full: 180 s into it): placement sees a history that predicts the run, as the
    # paper's Azure Functions history does, and replacement meets one shift
    # (docs/reproduce-seallm.md, "The workload's history")
    full=Sizes(duration_s=300.0, history_s=60.0, replacement_interval_s=120.0, rotate_s=240.0),
    quick=Sizes(duration_s=120.0, history_s=60.0, replacement_interval_s=60.0, rotate_s=90.0),
    max_services=2,
    focus=3.0,
)
"""SeaLLM's end-to-end comparison and ablations over the total rate."""

MUXSERVE = Experiment(
    name="muxserve",
    title="MuxServe §5 (Fig. 5, ADBS ablation)",
    generator="muxserve",
    gpu="a100-80gb",
    gpus=32,
    axis="alpha",
    axis_label="power-law exponent α",
    points=(0.7, 0.9, 1.3, 1.7, 2.1),
    quick_points=(0.7, 1.3, 2.1),
    stacks=(
        StackSpec("vllm", "Spatial (vLLM)", MAIN),
        StackSpec("alpaserve", "Temporal (AlpaServe)", MAIN, cost=2.0),
        StackSpec("muxserve", "MuxServe (ADBS)", MAIN, cost=3.0),
        StackSpec("muxserve-rr", "MuxServe, round-robin", ABLATION, cost=2.0),
        StackSpec("muxserve-fcfs", "MuxServe, FCFS", ABLATION, cost=2.0),
    ),
    full=Sizes(duration_s=300.0, history_s=60.0, replacement_interval_s=120.0),
    quick=Sizes(duration_s=90.0, history_s=30.0, replacement_interval_s=120.0),
    # loaded: MuxServe just keeps up, the baselines fall behind (at alpha 2.1 the top
    # model gets MuxServe's 20 req/s; docs/reproduce-muxserve.md)
    rate=30.0,
    focus=1.3,
)
"""MuxServe's throughput and SLO attainment over the popularity skew alpha."""

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (SEALLM, MUXSERVE)}
"""The multi-LLM experiments by name."""


def get_experiment(name: str) -> Experiment:
    """The multi-LLM experiment called ``name``.

    Raises:
        UnknownNameError: not one of :data:`EXPERIMENTS`.
    """
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise UnknownNameError("multi-LLM experiment", name, EXPERIMENTS) from None


@dataclass(frozen=True, slots=True)
class Mode:
    """Size of the runs: full or ``--quick``, times a hidden test scale.

    ``scale`` multiplies every duration (run, history, replacement interval);
    tests use it for seconds-long runs.
    """

    quick: bool = False
    scale: float = 1.0
    seed: int = 0

    def sizes(self, exp: Experiment) -> Sizes:
        """The run lengths of ``exp`` in this mode."""
        base = exp.quick if self.quick else exp.full
        return Sizes(
            base.duration_s * self.scale,
            base.history_s * self.scale,
            base.replacement_interval_s * self.scale,
            None if base.rotate_s is None else base.rotate_s * self.scale,
        )

    def points(self, exp: Experiment) -> tuple[float, ...]:
        """The axis values of ``exp`` in this mode."""
        return exp.quick_points if self.quick else exp.points

    @property
    def name(self) -> str:
        """``full`` or ``quick`` (with the scale when it is not 1)."""
        base = "quick" if self.quick else "full"
        return base if self.scale == 1.0 else f"{base} x{self.scale:g}"

    def to_dict(self, exp: Experiment) -> dict[str, Any]:
        """JSON-able description (for ``results.json``)."""
        s = self.sizes(exp)
        return {
            "name": self.name,
            "quick": self.quick,
            "scale": self.scale,
            "seed": self.seed,
            "duration_s": s.duration_s,
            "history_s": s.history_s,
            "replacement_interval_s": s.replacement_interval_s,
            "rotate_s": s.rotate_s,
            "points": list(self.points(exp)),
        }


def search_takes_max_services() -> bool:
    """Whether this build's SeaLLM search accepts ``max_services``."""
    from fleetserve.policy.seallm_placement import seallm_place

    return "max_services" in inspect.signature(seallm_place).parameters


def select_stacks(exp: Experiment, names: Sequence[str] | None, mode: Mode) -> list[StackSpec]:
    """The stacks called ``names`` (default: the mode's), in display order.

    Raises:
        UnknownNameError: a name that is not a stack of ``exp``.
        FleetserveError: an empty or repeated selection.
    """
    by_label = {s.label: s for s in exp.stacks}
    if names is None:
        if mode.quick and exp.quick_stacks is not None:
            return [by_label[n] for n in exp.quick_stacks]
        return list(exp.stacks)
    if not names:
        raise FleetserveError("--stacks needs at least one stack name")
    if len(set(names)) != len(names):
        raise FleetserveError(f"--stacks lists a stack twice: {','.join(names)}")
    for n in names:
        if n not in by_label:
            raise UnknownNameError(f"{exp.name} stack", n, by_label)
    return [s for s in exp.stacks if s.label in names]


SERVED_CONTEXT = 131072
"""The context window the multi-LLM runs serve (``engine.max_model_len``).

SeaLLM runs LongBench inputs (mean 13,187 tokens) and both papers run ShareGPT
conversations on LLaMA-2 (4,096) and OPT (2,048) models, so their evaluations
assume long-context variants of these weights; the runs serve a 128k window
(LLaMA-3.1's) so that the workload's lengths, not the models' native windows,
decide. A longer request is still rejected, with a reason."""


def run_config(exp: Experiment, value: float, st: StackSpec, mode: Mode) -> dict[str, Any]:
    """The plain config dict of one run (point ``value`` of the axis, stack ``st``)."""
    s = mode.sizes(exp)
    multi: dict[str, Any] = {
        "generator": exp.generator,
        "rate": value if exp.axis == "rate" else exp.rate,
        "duration_s": s.duration_s,
        "history_s": s.history_s,
        "replacement_interval_s": s.replacement_interval_s,
        "processes": 1,  # the grid runs one simulation per core already
    }
    if exp.axis == "alpha":
        multi["alpha"] = value
    if s.rotate_s is not None:
        multi["rotate_s"] = s.rotate_s
    if s.replacement_interval_s < 10.0:  # the default lower bound of the interval
        multi["min_interval_s"] = s.replacement_interval_s / 2
    if exp.max_services is not None and st.capped and search_takes_max_services():
        multi["max_services"] = exp.max_services
    return {
        "seed": mode.seed,
        "multi": multi,
        "cluster": {"gpu": exp.gpu, "elastic": False, "gpus": exp.gpus},
        "policy": {"stack": st.name},
        "engine": {"max_model_len": SERVED_CONTEXT},
        "slo_scales": list(SLO_SCALES),
    }


def run_dir(out: Path, exp: Experiment, value: float, st: StackSpec | str) -> Path:
    """``OUT/runs/<point>/<stack>``."""
    label = st if isinstance(st, str) else st.label
    return out / "runs" / exp.point_name(value) / label


def check_stacks(exp: Experiment, stacks: Sequence[StackSpec], mode: Mode) -> None:
    """Validate every stack's config before anything runs.

    Raises:
        FleetserveError: the first problem, as one line.
    """
    for st in stacks:
        check_stack_config(st.label, run_config(exp, mode.points(exp)[0], st, mode))


def _weight(exp: Experiment, value: float, st: StackSpec, mode: Mode) -> float:
    rate = value if exp.axis == "rate" else exp.rate
    return rate * mode.sizes(exp).duration_s * st.cost


def grid_specs(
    out: Path, exp: Experiment, stacks: Sequence[StackSpec], mode: Mode
) -> list[RunSpec]:
    """One :class:`RunSpec` per (point, stack)."""
    return [
        RunSpec(
            key=f"{exp.point_name(v)}/{st.label}",
            out_dir=run_dir(out, exp, v, st),
            config=run_config(exp, v, st, mode),
            weight=_weight(exp, v, st, mode),
        )
        for v in mode.points(exp)
        for st in stacks
    ]


def plan(
    name: str, out: Path, mode: Mode, stacks: Sequence[str] | None = None
) -> tuple[Experiment, list[RunSpec]]:
    """Validate a multi-LLM grid and return its runs (nothing is simulated yet).

    Args:
        name: ``seallm`` or ``muxserve``.
        out: output folder (runs go to ``out/runs/...``).
        mode: run sizes and seed.
        stacks: stack labels (default: the mode's).

    Raises:
        FleetserveError: unknown experiment or stack, missing shared data, a
            config that cannot run.
    """
    exp = get_experiment(name)
    selected = select_stacks(exp, stacks, mode)
    find_data_dir([SHAREGPT])  # the generators read it; fail here with a clear line
    check_stacks(exp, selected, mode)
    specs = grid_specs(out, exp, selected, mode)
    logger.info("%s grid: %d runs (%s)", exp.name, len(specs), mode.name)
    return exp, specs


__all__ = [
    "ABLATION",
    "EXPERIMENTS",
    "MAIN",
    "MUXSERVE",
    "SEALLM",
    "SLO_SCALE",
    "SLO_SCALES",
    "VARIANT",
    "Experiment",
    "Mode",
    "Sizes",
    "StackSpec",
    "get_experiment",
    "grid_specs",
    "plan",
    "run_config",
    "run_dir",
    "search_takes_max_services",
    "select_stacks",
]
