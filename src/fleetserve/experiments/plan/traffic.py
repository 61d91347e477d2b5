"""A plan's traffic: every service's requests, merged, split into history and run.

Each service draws from its own generator, seeded by ``(seed, service index)``,
so adding a service or changing one's rate leaves the others' requests as they
were. ``rate_factor`` multiplies every service's rate (the headroom search):
synthetic traffic is redrawn at the scaled rate, a trace is replayed faster.
``window`` picks another stretch of a trace (the robustness check): window
``k`` starts ``k`` times the traffic's span later in the trace.

Requests longer than the model's context window are cut to it (output first,
then prompt, :func:`~fleetserve.workload.fleet.fit_to_context`) and counted in
a note: the serving engine would reject them, and a plan should size the fleet
for the requests it can serve.

The merged stream starts at 0.0 (its first arrival); the history is its first
``history_s`` seconds, the run the rest (:func:`~fleetserve.sim.multi_build.split_history`,
the function ``fleetserve simulate`` uses on the ``jsonl`` trace the plan
writes, so a replay sees the very same requests).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from fleetserve.errors import ConfigError, FleetserveError, InputError
from fleetserve.experiments.plan.spec import PlanService, PlanSpec, TrafficSpec
from fleetserve.sim.multi_build import split_history
from fleetserve.sim.multi_run import services_from_window
from fleetserve.spec import get_model
from fleetserve.workload.bursty import length_profile
from fleetserve.workload.curve import CurveBurst, curve_arrivals
from fleetserve.workload.fleet import fit_to_context
from fleetserve.workload.loaders import load_trace
from fleetserve.workload.multi import sharegpt_sampler
from fleetserve.workload.request import Request, with_lengths
from fleetserve.workload.service import Service
from fleetserve.workload.synthetic import AZURE_CONV_LENGTHS, LengthSampler, fixed_lengths
from fleetserve.workload.transforms import scale_lengths, select_and_scale

__all__ = ["Traffic", "build_traffic", "length_sampler", "write_jsonl"]


@dataclass(frozen=True)
class Traffic:
    """The requests a candidate is simulated on.

    Attributes:
        stream: every request, sorted, the first at 0.0, ``model`` = service name.
        services: the services, rates and mean lengths measured on the history.
        history: the first ``history_s`` seconds (what placement sees).
        run: the rest, starting at 0.
        notes: what was done to the requests (cuts to context windows, ...).
    """

    stream: tuple[Request, ...]
    services: dict[str, Service]
    history: tuple[Request, ...]
    run: tuple[Request, ...]
    notes: tuple[str, ...]


def length_sampler(traffic: TrafficSpec) -> LengthSampler:
    """The length distribution of synthetic traffic.

    ``azure-conv``: the Azure 2023 conversation trace's measured quantiles
    (:data:`~fleetserve.workload.synthetic.AZURE_CONV_LENGTHS`, built in);
    ``sharegpt``: ShareGPT's lengths (the shared data file); ``burstgpt`` and
    ``agieval-cot``: KunServe's Table 2 profiles; or fixed lengths.
    """
    if traffic.prompt_tokens is not None and traffic.output_tokens is not None:
        return fixed_lengths(traffic.prompt_tokens, traffic.output_tokens)
    if traffic.lengths == "azure-conv":
        return AZURE_CONV_LENGTHS
    if traffic.lengths == "sharegpt":
        return sharegpt_sampler(None)
    return length_profile(traffic.lengths)


def _synthetic(
    svc: PlanService, span_s: float, rate_factor: float, rng: np.random.Generator
) -> list[Request]:
    t = svc.traffic
    points = [(0.0, t.rate)] if t.rate is not None else list(t.curve or ())
    points = [(x, r * rate_factor) for x, r in points]
    bursts = [CurveBurst(b.start_s, b.len_s, b.factor) for b in t.bursts]
    times = curve_arrivals(points, span_s, bursts=bursts, cv=t.cv, rng=rng)
    prompts, outputs = length_sampler(t)(len(times), rng)
    return [
        Request(
            id=i, model=svc.name, arrival_s=float(a), prompt_tokens=int(p), output_tokens=int(o)
        )
        for i, (a, p, o) in enumerate(zip(times.tolist(), prompts, outputs, strict=True))
    ]


def _from_trace(
    svc: PlanService, base_dir: Path, span_s: float, rate_factor: float, window: int
) -> list[Request]:
    t = svc.traffic
    assert t.trace is not None and t.format is not None
    path = Path(t.trace)
    if not path.is_absolute():
        path = base_dir / path
    if not path.is_file():
        raise InputError("trace file not found", file=str(path))
    loaded = load_trace(path, t.format, model=svc.name)
    scale = t.rate_scale * rate_factor
    start = t.start_s + window * span_s * t.rate_scale
    reqs = select_and_scale(loaded.requests, start, start + span_s * scale, None, scale)
    if t.length_scale != 1.0:
        reqs, _ = scale_lengths(reqs, t.length_scale, None)
    if not reqs:
        raise ConfigError(
            f"service {svc.name!r}: trace {path} has no request in [{start:g}, "
            f"{start + span_s * scale:g}) s (window {window})"
        )
    return [replace(r, model=svc.name) for r in reqs]


def _fit(svc: PlanService, reqs: list[Request], notes: list[str]) -> list[Request]:
    context = get_model(svc.model).max_context
    p = np.array([r.prompt_tokens for r in reqs], dtype=np.int64)
    o = np.array([r.output_tokens for r in reqs], dtype=np.int64)
    p2, o2, cut = fit_to_context(p, o, context)
    n = int(cut.sum())
    if n:
        notes.append(
            f"service {svc.name}: {n} of {len(reqs)} requests cut to {svc.model}'s context "
            f"window of {context} tokens"
        )
        reqs = [
            with_lengths(r, int(a), int(b))
            for r, a, b in zip(reqs, p2.tolist(), o2.tolist(), strict=True)
        ]
    return reqs


def build_traffic(
    spec: PlanSpec, base_dir: Path, *, seed: int, rate_factor: float = 1.0, window: int = 0
) -> Traffic:
    """Every service's requests for one simulation (module docstring).

    Args:
        spec: the plan.
        base_dir: folder relative trace paths are resolved against.
        seed: traffic seed.
        rate_factor: multiplier of every service's rate (> 0).
        window: which stretch of trace traffic (0: from ``start_s``).

    Raises:
        ConfigError: empty traffic, or no request in the history.
        InputError: a missing or malformed trace.
    """
    if not rate_factor > 0:
        raise ConfigError(f"rate_factor must be > 0, got {rate_factor}")
    span = spec.history_s + spec.duration_s
    notes: list[str] = []
    tagged: list[tuple[float, int, Request]] = []
    for i, svc in enumerate(spec.services):
        try:
            get_model(svc.model)
        except FleetserveError as e:
            raise ConfigError(f"service {svc.name!r}: {e}") from None
        rng = np.random.default_rng([seed, i])
        if svc.traffic.trace is not None:
            reqs = _from_trace(svc, base_dir, span, rate_factor, window)
        else:
            reqs = _synthetic(svc, span, rate_factor, rng)
        reqs = _fit(svc, reqs, notes)
        tagged += [(r.arrival_s, i, r) for r in reqs]
    if not tagged:
        raise ConfigError("the plan's traffic has no request")
    tagged.sort(key=lambda x: (x[0], x[1]))
    t0 = tagged[0][0]
    stream = tuple(replace(r, id=k, arrival_s=a - t0) for k, (a, _, r) in enumerate(tagged))
    hist, run = split_history(stream, spec.history_s)
    silent = [s.name for s in spec.services if not any(r.model == s.name for r in run)]
    if silent and run:
        raise ConfigError(
            f"service {silent[0]!r} has no request in the simulated traffic (the "
            f"{spec.duration_s:g} s after the history): raise its rate or duration_s"
        )
    if not hist or not run:
        raise ConfigError(
            f"the plan's traffic has {len(hist)} requests in the history ({spec.history_s:g} s) "
            f"and {len(run)} after it: both must have some (raise the rates or the durations)"
        )
    # a service silent in the history keeps the mean lengths of its whole traffic
    base = {}
    for s in spec.services:
        own = [r for r in stream if r.model == s.name] or list(stream)
        mean_p = sum(r.prompt_tokens for r in own) / len(own)
        mean_o = sum(r.output_tokens for r in own) / len(own)
        base[s.name] = Service(s.name, get_model(s.model), 0.0, mean_p, mean_o)
    services = services_from_window(base, hist, spec.history_s)
    return Traffic(stream, services, tuple(hist), tuple(run), tuple(notes))


def write_jsonl(requests: Sequence[Request], path: Path) -> None:
    """Write ``requests`` as a ``jsonl`` trace (e.g. the whole stream, the
    service in ``model``)."""
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(
                json.dumps(
                    {
                        "arrival_s": r.arrival_s,
                        "prompt_tokens": r.prompt_tokens,
                        "output_tokens": r.output_tokens,
                        "model": r.model,
                    }
                )
                + "\n"
            )
