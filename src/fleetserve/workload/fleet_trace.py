"""A real trace split over a fleet of models: ``fleet.generator: trace``.

The synthetic fleet (:mod:`fleetserve.workload.fleet`) shapes its own arrivals; this
generator replays a recorded one instead -- by default the Azure conversation trace that
``configs/default.yaml`` replays on one model -- and spreads it over several models:

- **arrivals and lengths**: the trace's own (:func:`~fleetserve.workload.loaders.load_trace`),
  the arrivals in ``[0, end_s)`` (``None``: the whole trace). With ``if_missing:
  synthetic`` a missing file is replaced by the built-in workload with the Azure
  conversation trace's statistics
  (:func:`~fleetserve.workload.synthetic.default_workload`, ``end_s`` seconds long, or
  :data:`SYNTHETIC_DURATION_S` without ``end_s``), as ``configs/default.yaml`` does;
- **models**: each request is given one model, drawn independently in arrival order with
  the Zipf popularity ``(i+1)**-zipf / sum_j (j+1)**-zipf`` of ``models`` (most popular
  first; :func:`~fleetserve.workload.synthetic.power_law_rates`, the same shares as the
  synthetic fleet), so the fleet's total rate and burstiness are the trace's;
- **lengths**: multiplied by ``length_scale``
  (:func:`~fleetserve.workload.transforms.scale_lengths`; 1 keeps the trace's), then, with
  ``fit_context``, a request longer than its model's context window is cut to fit (output
  first to ``max_context - 1``, then the prompt; :func:`~fleetserve.workload.fleet.fit_to_context`)
  and flagged ``length_capped``; without it the request is kept and the simulator rejects
  it with a reason.

Randomness: ``numpy.random.SeedSequence(seed)`` (or seeds drawn once from an injected
``numpy.random.Generator``) is spawned into one child for the model draws and one for the
synthetic fallback. The same seed and trace give the same workload; nothing here reads a
clock or a global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fleetserve.errors import ConfigError, InputError
from fleetserve.workload.fleet import DEFAULT_MODELS, _root_seed, fit_to_context
from fleetserve.workload.loaders import FORMATS, load_trace
from fleetserve.workload.multi import _model_specs
from fleetserve.workload.request import Request, with_lengths
from fleetserve.workload.synthetic import default_workload, power_law_rates
from fleetserve.workload.transforms import assign_models, scale_lengths, time_window

__all__ = [
    "IF_MISSING",
    "SYNTHETIC_DURATION_S",
    "TRACE_DEFAULTS",
    "TRACE_FORMATS",
    "TraceFleetWorkload",
    "check_trace_args",
    "trace_fleet_workload",
]

TRACE_FORMATS: tuple[str, ...] = tuple(f for f in FORMATS if f != "lengths")
"""Trace formats the generator replays: those with timestamps (``lengths`` has none)."""

IF_MISSING: tuple[str, ...] = ("error", "synthetic")
"""What to do when the trace file does not exist."""

SYNTHETIC_DURATION_S = 3600.0
"""Length of the synthetic stand-in when ``end_s`` is not given (the trace's hour)."""


@dataclass(frozen=True, slots=True)
class _TraceDefaults:
    trace: str | None = None
    format: str | None = None
    if_missing: str = "error"
    end_s: float | None = None
    length_scale: float = 1.0


TRACE_DEFAULTS = _TraceDefaults()
"""Defaults of the trace-only fields of :func:`trace_fleet_workload` (and of the config's
``fleet`` section)."""


def _num(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_trace_args(
    *,
    trace: object,
    format: object,
    if_missing: object,
    end_s: object,
    length_scale: object,
    models: object,
    zipf: object,
    fit_context: object,
) -> None:
    """Validate :func:`trace_fleet_workload`'s parameters (the config's ``fleet`` section too).

    Raises:
        ConfigError: the first invalid one; the message starts with its name.
    """
    if not isinstance(trace, str | Path) or not str(trace).strip():
        raise ConfigError(
            f"trace must be the path of a trace file (e.g. "
            f"../shared/data/azure_llm_2023_conv.csv), got {trace!r}"
        )
    if format not in TRACE_FORMATS:
        raise ConfigError(
            f"format must be one of {', '.join(TRACE_FORMATS)} (a trace with timestamps), "
            f"got {format!r}"
        )
    if if_missing not in IF_MISSING:
        raise ConfigError(f"if_missing must be one of {', '.join(IF_MISSING)}, got {if_missing!r}")
    if end_s is not None and _num("end_s", end_s) <= 0:
        raise ConfigError(f"end_s must be > 0 (seconds from the trace's start), got {end_s!r}")
    if _num("length_scale", length_scale) <= 0:
        raise ConfigError(f"length_scale must be > 0, got {length_scale!r}")
    if isinstance(models, str) or not isinstance(models, Sequence):
        raise ConfigError(f"models must be a list of catalog model names, got {models!r}")
    _model_specs(models, distinct=True)
    if _num("zipf", zipf) < 0:
        raise ConfigError(f"zipf must be >= 0, got {zipf!r}")
    if not isinstance(fit_context, bool):
        raise ConfigError(f"fit_context must be true or false, got {fit_context!r}")


@dataclass(frozen=True)
class TraceFleetWorkload:
    """What :func:`trace_fleet_workload` made.

    Attributes:
        requests: sorted by arrival, ids ``0..n-1``, ``model`` = the catalog name.
        models: the models, in popularity order.
        shares: model -> its probability of being drawn (the Zipf weights, summing to 1).
        counts: model -> requests assigned.
        capped: model -> requests cut to its context window.
        length_scale: the length multiplier applied.
        synthetic: whether the built-in stand-in replaced a missing trace.
        notes: what was done, for the run's notes.
        source: a one-line description for reports.
    """

    requests: list[Request]
    models: tuple[str, ...]
    shares: dict[str, float]
    counts: dict[str, int]
    capped: dict[str, int]
    length_scale: float
    synthetic: bool
    notes: tuple[str, ...] = field(default=())
    source: str = ""


def trace_fleet_workload(
    trace: str | Path,
    format: str,
    *,
    models: Sequence[str] = DEFAULT_MODELS,
    zipf: float = 1.0,
    length_scale: float = TRACE_DEFAULTS.length_scale,
    end_s: float | None = TRACE_DEFAULTS.end_s,
    fit_context: bool = True,
    if_missing: str = TRACE_DEFAULTS.if_missing,
    seed: int = 0,
    rng: np.random.Generator | None = None,
) -> TraceFleetWorkload:
    """A recorded trace spread over several models by Zipf popularity.

    See the module docstring for the model.

    Args:
        trace: the trace file (relative paths: the working directory).
        format: its format, one of :data:`TRACE_FORMATS`.
        models: distinct catalog model names, most popular first.
        zipf: power-law exponent of the popularity (>= 0; 0 is uniform).
        length_scale: prompt and output lengths multiplier (> 0).
        end_s: keep the arrivals in ``[0, end_s)`` (None: all).
        fit_context: cut requests to their model's ``max_context`` (flagged
            ``length_capped``); False keeps them (the simulator then rejects them).
        if_missing: ``error`` or ``synthetic`` (the built-in stand-in, with a note).
        seed: random seed (integer >= 0); ignored when ``rng`` is given.
        rng: a generator to draw the workload's seeds from (once, at the start).

    Returns:
        The :class:`TraceFleetWorkload`.

    Raises:
        ConfigError: an invalid argument (the message names it), or no request in the window.
        InputError: the trace is missing (with ``if_missing: error``) or malformed.
    """
    check_trace_args(
        trace=trace,
        format=format,
        if_missing=if_missing,
        end_s=end_s,
        length_scale=length_scale,
        models=models,
        zipf=zipf,
        fit_context=fit_context,
    )
    specs = _model_specs(models, distinct=True)
    names = tuple(s.name for s in specs)
    shares = power_law_rates(1.0, len(names), float(zipf))
    assign_seq, synth_seq = _root_seed(seed, rng).spawn(2)

    path = Path(trace)
    notes: list[str] = []
    synthetic = not path.exists()
    if synthetic:
        if if_missing == "error":
            raise InputError("trace file not found (fleet.trace)", file=str(path))
        dur = float(end_s) if end_s is not None else SYNTHETIC_DURATION_S
        reqs = default_workload(np.random.default_rng(synth_seq), dur, model=names[0])
        source = f"built-in synthetic workload (Azure conv statistics, {dur:g} s)"
        notes.append(f"trace {path} not found; using the {source} instead")
    else:
        loaded = load_trace(path, format, model=names[0], seed=seed)
        reqs = list(loaded.requests)
        source = f"{path} ({loaded.fmt})"
        skipped = loaded.skipped_note()
        if skipped is not None:
            notes.append(skipped)
    n_all = len(reqs)
    if end_s is not None:
        reqs = time_window(reqs, 0.0, float(end_s))
        notes.append(f"trace window [0, {float(end_s):g}) s: {len(reqs)} of {n_all} requests")
    if not reqs:
        raise ConfigError(f"end_s: no request of {source} arrives before end_s={end_s!r}")

    reqs = assign_models(reqs, list(names), shares, np.random.default_rng(assign_seq))
    scale = float(length_scale)
    if scale != 1.0:
        reqs, _ = scale_lengths(reqs, scale)
    capped = dict.fromkeys(names, 0)
    if fit_context:
        ctx = {s.name: int(s.max_context) for s in specs}
        prompts = np.asarray([r.prompt_tokens for r in reqs], dtype=np.int64)
        outputs = np.asarray([r.output_tokens for r in reqs], dtype=np.int64)
        limit = np.asarray([ctx[r.model] for r in reqs], dtype=np.int64)
        new_p, new_o, cut = fit_to_context(prompts, outputs, limit)
        out: list[Request] = []
        for r, p, o, c in zip(reqs, new_p.tolist(), new_o.tolist(), cut.tolist(), strict=True):
            if c:
                capped[r.model] += 1
                r = with_lengths(r, p, o, length_capped=True)
            out.append(r)
        reqs = out
    counts = dict.fromkeys(names, 0)
    for r in reqs:
        counts[r.model] += 1

    share_map = dict(zip(names, shares, strict=True))
    notes += [
        f"{len(names)} models, each request drawn by Zipf popularity (exponent {float(zipf):g}),"
        " most popular first: "
        + ", ".join(f"{m} {share_map[m]:.3f} ({counts[m]} req)" for m in names),
        f"lengths: the trace's, x{scale:g}"
        + (
            f"; {sum(capped.values())} request(s) cut to their model's context window "
            f"({', '.join(f'{m} {c}' for m, c in capped.items() if c)})"
            if any(capped.values())
            else ""
        ),
    ]
    span = f", first {float(end_s):g} s" if end_s is not None else ""
    desc = f"fleet trace: {source}{span}, {len(names)} models by Zipf {float(zipf):g}"
    if scale != 1.0:
        desc += f", lengths x{scale:g}"
    return TraceFleetWorkload(
        requests=reqs,
        models=names,
        shares=share_map,
        counts=counts,
        capped=capped,
        length_scale=scale,
        synthetic=synthetic,
        notes=tuple(notes),
        source=desc,
    )
