"""From a :class:`~fleetserve.config.SimConfig` to the requests a run replays.

Order of transforms: time window → max_requests → rate scaling → model
assignment → length scaling (with the cap). The cap applies only when
lengths are scaled (``length_scale != 1``) and ``cap_lengths`` is on: a
scaled request whose KV would not fit one instance is shrunk proportionally
to fit (Mell's model assumes every request fits on one GPU). With several
models the cap is the smallest instance capacity among them. Every cap and
every skipped trace row is reported in the run's notes. A trace's prefix
blocks (Mooncake ``hash_ids``, for ``engine.prefix_caching``) follow the
lengths: scaled with them, cut with a capped prompt
(:func:`~fleetserve.workload.request.with_lengths`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fleetserve.config import SimConfig
from fleetserve.errors import ConfigError, InputError
from fleetserve.spec import get_model
from fleetserve.spec.memory import kv_capacity_blocks
from fleetserve.workload import (
    Request,
    assign_models,
    default_workload,
    load_trace,
    scale_lengths,
    select_and_scale,
)
from fleetserve.workload.service import Service

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Workload:
    """The requests of a run and what was done to them."""

    requests: list[Request]
    source: str
    notes: list[str] = field(default_factory=list)
    services: dict[str, Service] | None = None
    """Multi-LLM runs: the services (``Request.model`` names one)."""
    history: list[Request] | None = None
    """Multi-LLM runs: the requests before the run that placement sees."""


def request_cap_tokens(cfg: SimConfig, model: str) -> int:
    """Largest KV (tokens) one request may need: an instance's blocks minus the
    admission watermark, in tokens — the simulator rejects anything larger."""
    cl = cfg.cluster
    spec, gpu = get_model(model), cl.gpu_spec()
    blocks = kv_capacity_blocks(spec, gpu, cl.tp, cl.mem_util, cl.block_size)
    return (blocks - int(cfg.engine.watermark * blocks)) * cl.block_size


def _resolve(trace: str, base_dir: Path | None) -> Path:
    path = Path(trace)
    if not path.is_absolute() and base_dir is not None:
        return base_dir / path
    return path


def build_workload(cfg: SimConfig, base_dir: Path | None = None) -> Workload:
    """Load or synthesize the workload of ``cfg`` and apply its transforms.

    Args:
        cfg: the run configuration.
        base_dir: directory relative trace paths are resolved against (the
            config file's directory); None uses the working directory.

    Raises:
        InputError: the trace is missing (unless ``if_missing: synthetic``) or bad.
        ConfigError: the workload is empty after its transforms.
    """
    if cfg.is_multi:
        from fleetserve.sim.multi_build import build_multi

        mi = build_multi(cfg, base_dir)
        for n in mi.notes:
            logger.info(n)
        return Workload(mi.requests, mi.source, mi.notes, mi.services, mi.history)
    if cfg.kunserve.generator is not None:
        from fleetserve.sim.kun_run import build_kun_requests

        kreqs, ksource = build_kun_requests(cfg)
        if not kreqs:
            raise ConfigError(f"the workload from {ksource} is empty")
        return Workload(kreqs, ksource, [f"workload: {ksource}"])
    wl = cfg.workload
    rng = np.random.default_rng(cfg.seed)
    notes: list[str] = []
    path = _resolve(wl.trace, base_dir) if wl.trace is not None else None
    if path is not None and not path.exists():
        if wl.if_missing == "error":
            raise InputError("trace file not found", file=str(path))
        notes.append(f"trace {path} not found; using the built-in synthetic workload instead")
        path = None
    if path is not None:
        loaded = load_trace(path, wl.format, model=cfg.model, rate=wl.rate, seed=cfg.seed)
        reqs = list(loaded.requests)
        source = f"{path} ({loaded.fmt})"
        skipped = loaded.skipped_note()
        if skipped is not None:
            notes.append(skipped)
    else:
        reqs = default_workload(rng, wl.synthetic_duration_s, model=cfg.model)
        dur = wl.synthetic_duration_s
        source = f"built-in synthetic workload (Azure conv statistics, {dur:g} s)"
        notes.append(f"workload: {source}")
    reqs = select_and_scale(reqs, wl.start_s, wl.end_s, wl.max_requests, wl.rate_scale)
    if wl.models is not None:
        reqs = assign_models(reqs, list(wl.models), wl.model_weights, rng)
    if wl.length_scale != 1.0:
        cap = None
        if wl.cap_lengths:
            cap = min(request_cap_tokens(cfg, m) for m in {r.model for r in reqs} or {cfg.model})
        reqs, n_capped = scale_lengths(reqs, wl.length_scale, cap)
        msg = f"lengths scaled x{wl.length_scale:g}"
        if cap is not None:
            msg += (
                f"; {n_capped} of {len(reqs)} requests capped to {cap} KV tokens so each fits "
                "one instance (Mell's model assumes it; set workload.cap_lengths: false to "
                "reject them instead)"
            )
        notes.append(msg)
    if not reqs:
        raise ConfigError(f"the workload from {source} is empty after its transforms")
    for n in notes:
        logger.info(n)
    return Workload(reqs, source, notes)
