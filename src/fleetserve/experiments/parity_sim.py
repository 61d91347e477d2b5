"""The simulator's side of the parity report: the runtime's cluster, in any world.

:func:`simulate_runtime` simulates the requests a server saw (bench-serve's
``requests.csv``) on the emulated cluster of its config, in the world its
stack runs in (:func:`parity_world`)::

    world     stacks                        simulator, on the emulated cluster
    single    vllm, llumnix, bf, wf, ll,    simulate_emulated (the fidelity simulation:
              mell                          the runtime's placement, the engines' limits)
    kunserve  kunserve and its ablations    KunSimulator: serve.workers replicas, each
                                            with the engine's KV capacity
    sharing   seallm, muxserve, alpaserve   MultiSimulator on the plan the server placed
              and their ablations           (sharing_placement), the stack's scheduler,
                                            KV layout and re-placement

Every result directory is the usual one (``summary.json`` ...), and its
summary has a ``mechanisms`` section
(:func:`~fleetserve.experiments.fidelity.mechanism_counts`: activations,
releases, live copy stages, stall, aborted migrations), which the standard
sections leave out.

Choices where the runtime and a simulator differ (each said in the run's
notes):

* **KunServe memory.** The engine keeps the embedding, final norm and LM
  head outside its arena; the KunServe simulator counts every weight in the
  GPU's memory. Its emulated GPU therefore gets those bytes on top of the
  arena (``hbm_bytes``), and every replica is provisioned with the engine's
  exact KV capacity (``kunserve.kv_tokens``, unless the config sets it), so
  layer drops free the same share of memory on both sides. The runtime has
  no spare instances: the simulation has none either.
* **Sharing placement.** The plan is the runtime's (the stack's placement on
  the config's history, one GPU per group), not one searched again on the
  replayed requests; re-placements (SeaLLM) are simulated as the stack
  defines them (the search on each interval's requests).
* The stack's mechanisms are simulated as the catalog defines them: a
  ``kunserve`` stack's live KV exchange and live restore, a ``llumnix``
  stack's multi-stage live migration, where the runtime may run simpler
  versions (``docs/runtime-parity.md``); the parity report shows both counts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fleetserve.config import SimConfig
from fleetserve.errors import ConfigError
from fleetserve.experiments.fidelity import (
    emulated_cost,
    emulated_gpu_for,
    emulated_sim_config,
    mechanism_counts,
    runtime_limits,
    served_models,
    simulate_emulated,
)
from fleetserve.metrics.records import RunResult
from fleetserve.policy.catalog import kun_only
from fleetserve.runtime.plan import sharing_placement, sharing_stack
from fleetserve.sim.kun_run import run_kun
from fleetserve.sim.multi_build import history_placement, multi_settings
from fleetserve.sim.multi_run import run_multi_stack
from fleetserve.spec import GpuSpec, get_model
from fleetserve.spec.memory import kv_capacity_blocks
from fleetserve.workload.request import Request

__all__ = [
    "PARITY_WORLDS",
    "ParityContext",
    "parity_context",
    "parity_world",
    "preflight_runtime_sim",
    "simulate_runtime",
]

logger = logging.getLogger(__name__)

SINGLE_W, KUN_W, SHARING_W = "single", "kunserve", "sharing"
PARITY_WORLDS = (SINGLE_W, KUN_W, SHARING_W)
"""The worlds :func:`simulate_runtime` simulates (module docstring)."""


def parity_world(cfg: SimConfig) -> str:
    """The world ``cfg``'s stack runs in at runtime (module docstring).

    Raises:
        ConfigError: a sharing stack on an elastic pool (the runtime refuses it).
    """
    if kun_only(cfg.policy.stack):
        return KUN_W
    if sharing_stack(cfg) is not None:
        return SHARING_W
    return SINGLE_W


@dataclass(frozen=True, slots=True)
class ParityContext:
    """What decides which mechanisms each side of the parity report has.

    Attributes:
        world: :func:`parity_world`.
        elastic: an elastic pool (``cluster.elastic``).
        prefix_caching: ``engine.prefix_caching``.
        replacement: a sharing stack with SeaLLM's adaptive re-placement.
    """

    world: str
    elastic: bool
    prefix_caching: bool
    replacement: bool


def parity_context(cfg: SimConfig) -> ParityContext:
    """The :class:`ParityContext` of a runtime config."""
    sharing = sharing_stack(cfg)
    return ParityContext(
        world=parity_world(cfg),
        elastic=cfg.cluster.elastic,
        prefix_caching=cfg.engine.prefix_caching,
        replacement=sharing is not None and sharing.replacement,
    )


def preflight_runtime_sim(cfg: SimConfig) -> str:
    """Check that :func:`simulate_runtime` can simulate ``cfg``, before anything
    runs; returns its world.

    Raises:
        FleetserveError: the first problem found (non-CPU workers, an unknown
            model, a config the single-model simulation cannot emulate, a
            KunServe stack serving several models).
    """
    world = parity_world(cfg)
    emulated_gpu_for(cfg)  # CPU workers only
    models = served_models(cfg)
    if world == SINGLE_W:
        emulated_sim_config(cfg, None)
    elif world == KUN_W and len(models) != 1:
        raise ConfigError(
            f"stack {cfg.policy.stack!r} serves one replicated model; serve.models has "
            f"{len(models)}"
        )
    return world


def simulate_runtime(
    cfg: SimConfig,
    profile_csv: Path | None,
    out_dir: Path,
    requests: Sequence[Request],
) -> dict[str, Any]:
    """Simulate ``requests`` on ``cfg``'s emulated cluster in its world and
    write the result directory ``out_dir``.

    Args:
        cfg: the config the server ran (``cluster.activation_s`` as measured,
            for an elastic pool).
        profile_csv: the engine profile to calibrate from (None: the
            uncalibrated emulated GPU).
        out_dir: result directory.
        requests: the measured requests
            (:func:`~fleetserve.experiments.fidelity.load_measured_requests`).

    Returns:
        The summary (``summary.json``), with its ``mechanisms`` section and
        ``parity_world``.

    Raises:
        FleetserveError: the config cannot be simulated, or the simulation
            failed (for example Mell's pool cap).
    """
    world = parity_world(cfg)
    if world == SINGLE_W:
        summary = simulate_emulated(cfg, profile_csv, out_dir, requests=requests)
    else:
        run = _run_kun if world == KUN_W else _run_sharing
        result = run(cfg, profile_csv, requests)
        summary = _write(cfg, result, out_dir)
    summary["parity_world"] = world
    return summary


def _write(cfg: SimConfig, result: RunResult, out_dir: Path) -> dict[str, Any]:
    from fleetserve.metrics import summarize, write_run

    summary = summarize(result, cfg.slo_scales)
    write_run(out_dir, result, summary)
    return summary


def _kun_gpu(cfg: SimConfig, model: str) -> tuple[GpuSpec, int, list[str]]:
    """The emulated GPU as the KunServe simulator must see it, the engine's KV
    capacity in tokens, and the notes (module docstring)."""
    gpu = emulated_gpu_for(cfg)
    spec = get_model(model)
    bs = cfg.cluster.block_size
    tokens = kv_capacity_blocks(spec, gpu, 1, 1.0, bs) * bs
    outside = spec.weight_bytes - spec.num_layers * spec.weight_bytes_per_layer
    kun_gpu = replace(gpu, hbm_bytes=gpu.hbm_bytes + outside)
    notes = [
        f"KunServe on the emulated cluster: {cfg.serve.workers} replicas of {model} on "
        f"{gpu.name}, {tokens} KV tokens each (the engine's capacity); the "
        f"{outside / 2**20:.2f} MiB of weights the engine keeps outside its arena added to "
        "the GPU's memory"
    ]
    return kun_gpu, tokens, notes


def _run_kun(cfg: SimConfig, profile_csv: Path | None, requests: Sequence[Request]) -> RunResult:
    sv = cfg.serve
    (model,) = served_models(cfg)
    gpu, tokens, notes = _kun_gpu(cfg, model)
    emc = emulated_cost(cfg, profile_csv, [model], emulated_gpu_for(cfg))
    kc = cfg.kunserve
    if kc.spare_instances:
        notes.append(
            f"kunserve.spare_instances = {kc.spare_instances} left out: the runtime has no "
            "spare instances"
        )
    cluster, engine = runtime_limits(cfg, gpu)
    sim_cfg = replace(
        cfg,
        model=model,
        cluster=cluster,
        engine=engine,
        kunserve=replace(
            kc, kv_tokens=kc.kv_tokens if kc.kv_tokens is not None else tokens, spare_instances=0
        ),
    )
    result = run_kun(sim_cfg, requests, [*notes, *emc.notes], cost=emc.cost, gpu=gpu)
    result.extra["mechanisms"] = mechanism_counts(result, sv.workers)
    return result


def _run_sharing(
    cfg: SimConfig, profile_csv: Path | None, requests: Sequence[Request]
) -> RunResult:
    models = served_models(cfg)
    placed = sharing_placement(cfg, models, placer=history_placement)
    unknown = sorted({r.model for r in requests} - set(placed.services))
    if unknown:
        raise ConfigError(f"requests for model(s) {unknown}, which the placement does not serve")
    emc = emulated_cost(cfg, profile_csv, models, emulated_gpu_for(cfg))
    settings = multi_settings(placed.config)
    result = run_multi_stack(
        placed.stack.name,
        placed.services,
        [],
        list(requests),
        settings,
        cost_model=emc.cost,
        placed=(placed.plan, placed.estimate),
        gpu_spec=placed.gpu,
    )
    groups = ", ".join(
        f"{'+'.join(g.services)} on GPU(s) {list(g.gpus)}" for g in placed.plan.groups
    )
    result.notes += [f"the runtime's placement ({placed.stack.placement}): {groups}", *emc.notes]
    result.extra["mechanisms"] = mechanism_counts(
        result, sum(len(g.gpus) for g in placed.plan.groups)
    )
    return result
