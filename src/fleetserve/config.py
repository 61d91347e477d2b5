"""Run configuration: frozen dataclasses loaded from YAML, overridable from the CLI.

A config file mirrors :class:`SimConfig` (sections ``workload``, ``cluster``,
``engine``, ``policy``, plus top-level keys). Unknown keys are rejected with
the key's dotted path; every value is type-checked. ``--set key=value``
(e.g. ``--set cluster.mem_util=0.85``) overrides any field; the value is
parsed as YAML, so ``true``, ``12`` and ``[1, 2]`` work.

Example::

    model: llama-2-7b
    workload: {trace: ../shared/data/azure_llm_2023_conv.csv, format: azure, length_scale: 10}
    cluster: {gpu: a100-40gb, elastic: true}
    policy: {stack: bf}
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from fleetserve.errors import ConfigError, InputError
from fleetserve.spec import get_gpu
from fleetserve.spec.types import GpuSpec
from fleetserve.workload.fleet import FLEET_DEFAULTS, check_fleet_args
from fleetserve.workload.fleet_trace import TRACE_DEFAULTS, check_trace_args

DEFAULT_SLO_SCALES: tuple[float, ...] = (1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)


_SECTION = {
    "MultiConfigSection": "multi.",
    "KunConfigSection": "kunserve.",
    "FleetConfigSection": "fleet.",
    "ServeConfigSection": "serve.",
    "WorkloadConfig": "workload.",
    "ClusterConfig": "cluster.",
    "EngineConfig": "engine.",
    "PolicyConfig": "policy.",
}


def _positive(obj: object, *names: str) -> None:
    prefix = _SECTION.get(type(obj).__name__, "")
    for n in names:
        v = getattr(obj, n)
        if v is not None and v <= 0:
            raise ConfigError(f"{prefix}{n} must be positive, got {v}")


@dataclass(frozen=True)
class WorkloadConfig:
    """Which requests arrive.

    Attributes:
        trace: trace file; None uses the built-in synthetic workload (Azure conv
            statistics) of ``synthetic_duration_s`` seconds.
        format: trace format: azure, mooncake, burstgpt, lengths or jsonl.
        if_missing: what to do when ``trace`` does not exist: ``error``, or
            ``synthetic`` to fall back to the built-in workload (with a note).
        rate: arrival rate (req/s) for ``lengths`` traces, which have no times.
        synthetic_duration_s: length of the built-in synthetic workload.
        start_s, end_s: time window of the trace to keep (seconds from its start).
        rate_scale: arrival rate multiplier (times are divided by it).
        length_scale: prompt and output lengths multiplier (Mell uses 10).
        cap_lengths: cap scaled requests so their KV fits one instance (Mell's model).
        max_requests: keep only the first N requests.
        models: assign requests to these models (weights ``model_weights``);
            None keeps the trace's / the top-level ``model``.
        model_weights: popularity of ``models`` (default: equal).
        keep_models: multi-LLM runs: each request's service is the trace's own
            ``model`` field (e.g. the ``jsonl`` trace ``fleetserve plan``
            writes), which must name a service; False assigns requests to the
            services by ``models`` / ``model_weights``.
    """

    trace: str | None = None
    format: str | None = None
    if_missing: str = "error"
    rate: float | None = None
    synthetic_duration_s: float = 600.0
    start_s: float | None = None
    end_s: float | None = None
    rate_scale: float = 1.0
    length_scale: float = 1.0
    cap_lengths: bool = True
    max_requests: int | None = None
    models: tuple[str, ...] | None = None
    model_weights: tuple[float, ...] | None = None
    keep_models: bool = False

    def __post_init__(self) -> None:
        _positive(self, "rate", "synthetic_duration_s", "rate_scale", "length_scale")
        if self.keep_models and self.models is not None:
            raise ConfigError(
                "workload.keep_models keeps the trace's own services; leave out workload.models"
            )
        _positive(self, "max_requests")
        if self.trace is not None and self.format is None:
            raise ConfigError(
                "workload.trace needs workload.format (azure, mooncake, burstgpt, lengths, jsonl)"
            )
        if self.if_missing not in ("error", "synthetic"):
            raise ConfigError(
                f"workload.if_missing must be 'error' or 'synthetic', got {self.if_missing!r}"
            )
        if self.start_s is not None and self.end_s is not None and self.end_s <= self.start_s:
            raise ConfigError("workload.end_s must be greater than workload.start_s")
        if self.model_weights is not None and (
            self.models is None or len(self.models) != len(self.model_weights)
        ):
            raise ConfigError(
                "workload.model_weights needs one weight per entry of workload.models"
            )


@dataclass(frozen=True)
class ClusterConfig:
    """The GPU pool.

    Attributes:
        gpu: GPU catalog name.
        elastic: activate GPUs when nothing fits, release idle ones (Mell's
            model); False: a fixed pool of ``gpus`` GPUs.
        gpus: fixed pool size (with ``elastic: false``).
        max_gpus: cap of the elastic pool.
        tp: tensor-parallel degree of every instance.
        mem_util: fraction of HBM usable for weights + KV (vLLM's gpu_memory_utilization).
        block_size: tokens per KV block.
        intra_node_bw: GPU-to-GPU bandwidth inside a node, bytes/s per direction,
            instead of the catalog's (e.g. Mell's testbed: PCIe 4.0, ``32e9``);
            None: the catalog's. Read by the single-model simulator (KV
            migrations); other worlds refuse it.
        network_bw: inter-node bandwidth per GPU, bytes/s per direction, instead
            of the catalog's (Mell's testbed: 10 Gbps, ``1.25e9``); None: the
            catalog's.
        activation_s: seconds a GPU an elastic pool activates takes to load
            its instance's weights: its first iteration starts that long after
            the activation (requests dispatched to it wait). 0 (default): at
            once, as Mell's model has it. The runtime measures it (an inactive
            worker holds no weights: ``fleetserve_worker_activation_seconds``
            on ``/metrics``); set it from that measurement. Read by the
            single-model simulator; other worlds refuse it (the multi-LLM
            world loads a group's weights over the host link).
    """

    gpu: str = "a100-40gb"
    elastic: bool = True
    gpus: int | None = None
    max_gpus: int = 100_000
    tp: int = 1
    mem_util: float = 0.9
    block_size: int = 16
    intra_node_bw: float | None = None
    network_bw: float | None = None
    activation_s: float = 0.0

    def __post_init__(self) -> None:
        _positive(
            self, "gpus", "max_gpus", "tp", "mem_util", "block_size", "intra_node_bw", "network_bw"
        )
        if not self.elastic and self.gpus is None:
            raise ConfigError("cluster.gpus is required for a fixed pool (cluster.elastic: false)")
        if self.mem_util > 1:
            raise ConfigError(f"cluster.mem_util must be in (0, 1], got {self.mem_util}")
        if not (math.isfinite(self.activation_s) and self.activation_s >= 0):
            raise ConfigError(f"cluster.activation_s must be >= 0 seconds, got {self.activation_s}")

    @property
    def links_overridden(self) -> bool:
        """Whether ``intra_node_bw`` or ``network_bw`` replaces the catalog's."""
        return self.intra_node_bw is not None or self.network_bw is not None

    def gpu_spec(self) -> GpuSpec:
        """The catalog's ``gpu``, with ``intra_node_bw`` / ``network_bw`` when set.

        Raises:
            ConfigError: an unknown GPU name.
        """
        spec = get_gpu(self.gpu)
        if not self.links_overridden:
            return spec
        return dataclasses.replace(
            spec,
            intra_node_bw=self.intra_node_bw or spec.intra_node_bw,
            network_bw=self.network_bw or spec.network_bw,
        )


@dataclass(frozen=True)
class EngineConfig:
    """Per-instance engine limits (vLLM's names and defaults).

    Attributes:
        max_num_seqs: running batch limit.
        max_batched_tokens: prefill tokens per iteration (a single longer
            prompt still runs, alone).
        watermark: fraction of KV blocks kept free when admitting prefills.
        chunked_prefill: split prompts into chunks that run together with
            decodes (mixed iterations of at most ``max_batched_tokens`` tokens).
        max_model_len: the context window served (vLLM's ``max_model_len``): a
            request whose prompt plus output exceeds it is rejected with a
            reason. None: the model's own ``max_context``. A larger value
            stands for a long-context variant of the same weights (RoPE
            scaling), as the papers' long-request workloads assume.
        prefix_caching: automatic prefix caching (vLLM's): KV blocks of full
            prompt prefix blocks are cached per instance, keyed by the
            trace's block ids (Mooncake ``hash_ids``), shared by the requests
            that hit them (reference-counted) and evicted LRU when the memory
            is needed; a hit is not recomputed. Requests without block ids
            never hit. Single-model simulator only (other worlds refuse it);
            see ``docs/prefix-caching.md``.
    """

    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    watermark: float = 0.01
    chunked_prefill: bool = False
    max_model_len: int | None = None
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        _positive(self, "max_num_seqs", "max_batched_tokens")
        if self.max_model_len is not None:
            _positive(self, "max_model_len")
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"engine.watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class PolicyConfig:
    """Policy choices: a stack, with optional per-family overrides."""

    stack: str = "vllm"
    dispatch: str | None = None
    batching: str | None = None
    migration: str | None = None
    placement: str | None = None
    memory: str | None = None


MECHANISMS: tuple[str, ...] = ("kv", "token", "adaptive")
"""Migration mechanisms: live KV transfer, token re-prefill, Mell's adaptive hybrid."""


@dataclass(frozen=True)
class MigrationConfig:
    """How migrations are carried out, and the scheduling epoch.

    Attributes:
        mechanism: ``kv`` (Llumnix live KV transfer), ``token`` (send token
            ids, re-prefill at the destination) or ``adaptive`` (Mell §V: per
            epoch, a global two-bin packing of pending moves into KV and token
            transfers within the boundaries below). None: the stack's choice.
        epoch_s: scheduling epoch — how often the migration policy plans
            (Mell's Algorithm 1, Llumnix's pairing) and the adaptive mechanism
            packs.
        link_share: Mell's communication boundary — the fraction of each
            link's ``bandwidth x epoch_s`` that migrations may use per epoch.
        compute_share: Mell's computation boundary — the fraction of each
            instance's epoch that re-prefills of migrated requests may take.
        max_stages: live KV transfer: copy stages (while the request keeps
            decoding) before the final stop-and-copy is forced.
        final_blocks: live KV transfer: stop and copy once at most this many
            blocks are left to send.
        copy_contention: a KV copy shares the HBM bandwidth of the GPUs it
            reads and writes with their iterations
            (:func:`fleetserve.sim.contention.beside_copies`); False: copies
            are free for the GPUs' memory (the model before issue 22).
        link_contention: transfers that use a GPU's link port at the same time
            share it: each port carries one transfer at a time, in the order
            they start (:class:`fleetserve.sim.migration.Migrations`); False:
            concurrent transfers each get the whole link (the model before
            session 22).
        wait_for_room_s: a KV move whose destination has no room for its
            first stage waits up to this long (retried at the destination's
            iteration boundaries and at each epoch) before it aborts; 0 (the
            default): it aborts at once and the migration policy re-plans
            (:mod:`fleetserve.sim.migration`).
    """

    mechanism: str | None = None
    epoch_s: float = 0.5
    link_share: float = 0.5
    compute_share: float = 0.1
    max_stages: int = 8
    final_blocks: int = 1
    copy_contention: bool = True
    link_contention: bool = True
    wait_for_room_s: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "epoch_s", "link_share", "compute_share", "max_stages", "final_blocks")
        if not self.wait_for_room_s >= 0:
            raise ConfigError(
                f"migration.wait_for_room_s must be >= 0, got {self.wait_for_room_s!r}"
            )
        if self.mechanism is not None and self.mechanism not in MECHANISMS:
            raise ConfigError(
                f"migration.mechanism must be one of {', '.join(MECHANISMS)}, "
                f"got {self.mechanism!r}"
            )
        for name in ("link_share", "compute_share"):
            if getattr(self, name) > 1:
                raise ConfigError(f"migration.{name} must be in (0, 1]")


@dataclass(frozen=True)
class MellConfig:
    """Mell's online scheduler (stack ``mell``).

    Attributes:
        batching: request-operation batching (Departs, then Updates, then
            Allocates per epoch, redundant moves removed); False runs each
            operation's moves as they come.
        w_requests: weight of a GPU's request count in its priority (fewer is better).
        w_free: weight of a GPU's free KV fraction in its priority (more is better).
        w_distance: weight of being on the same node, in GPU-to-GPU priority.
        strict_update: run ``Update`` only where Fig. 10 and Algorithm 1 do (a
            class change, or an L-request overflowing its GPU); a T/S/M request
            that grows within its class past its GPU's capacity then moves
            nothing, and the instance preempts (recomputes) as vLLM does. False
            (the default) also repairs such overflows by moving smaller requests
            out (this implementation's extension; ``fleetserve.policy.mell``).
        headroom_blocks: blocks the packer adds to every request's size (capped
            at ``C``), so that a GPU it packs full still has room for its
            requests' growth until the next epochs' moves are done (an
            extension, not in the paper; 0, the default, is Mell as published).
    """

    batching: bool = True
    w_requests: float = 1.0
    w_free: float = 1.0
    w_distance: float = 1.0
    strict_update: bool = False
    headroom_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("w_requests", "w_free", "w_distance"):
            if getattr(self, name) < 0:
                raise ConfigError(f"mell.{name} must be >= 0")
        if self.headroom_blocks < 0:
            raise ConfigError(f"mell.headroom_blocks must be >= 0, got {self.headroom_blocks}")


@dataclass(frozen=True)
class ServiceConfig:
    """One LLM service of a multi-LLM run: a name (what requests name) and a model."""

    name: str
    model: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("services: every service needs a non-empty name")


MULTI_GENERATORS: tuple[str, ...] = ("seallm", "muxserve")


@dataclass(frozen=True)
class MultiConfigSection:
    """Multi-LLM runs (SeaLLM, MuxServe stacks): workload and placement settings.

    A run is multi-LLM when ``services`` is given or ``multi.generator`` is set;
    its stack then names a multi-LLM stack (``vllm``, ``alpaserve``,
    ``muxserve``, ``seallm`` and ablations) and the pool is fixed
    (``cluster.gpus``).

    Attributes:
        generator: ``seallm`` (8 services from 4 models × chat/summarization,
            bursty Gamma arrivals rotating across services) or ``muxserve``
            (19 LLaMA models, power-law rates, Poisson); None: the ``services``
            list with the ``workload`` trace (requests assigned to the service
            names by ``workload.models``, uniformly when not given).
        rate: total req/s of a generator.
        alpha: power-law exponent of the ``muxserve`` generator.
        duration_s: a generator's run length.
        history_s: seconds of requests before the run that placement sees
            (with a trace: its first ``history_s`` seconds, the run is the rest).
        cv: inter-arrival CV of the ``seallm`` generator.
        rotate_s: burst window of the ``seallm`` generator.
        burst_share: share of the total rate the hot service gets (``seallm``).
        replacement_interval_s: SeaLLM's initial replacement interval I_0.
        replacement_beta: Equation 8's beta.
        min_interval_s, max_interval_s: bounds of the adapted interval.
        slo_scale: SLO (× execution time) of SeaLLM's search and ``M_real``.
        processes: parallel placement searches (None: one per TP size).
        max_services: services per group at most in SeaLLM's search
            (None: no limit; SeaLLM's evaluation used 2).
        keepalive_s: with elastic memory (``policy.memory: elastic`` or a
            stack that has it), how long a sharing group stays idle before it
            releases its GPUs (its weights are reloaded from host memory when
            it is needed again). Mell releases an idle GPU at once; a group's
            weights take seconds to reload, so it waits, as serverless
            platforms keep an instance warm: an implementer's choice.
        contention: jobs a spatial scheduler (MuxServe's ADBS) runs at once
            share the GPUs' memory bandwidth (:mod:`fleetserve.sim.contention`);
            false gives each the full bandwidth (the model before issue 22).
        tp_sizes: the tensor-parallel sizes placement may give a group, powers
            of two (None: each placement's own: ``dedicated`` the least a model
            fits on, ``muxserve`` and ``seallm`` every power of two up to a node).
    """

    generator: str | None = None
    rate: float = 10.0
    alpha: float = 1.3
    duration_s: float = 600.0
    history_s: float = 60.0
    cv: float = 4.0
    rotate_s: float = 60.0
    burst_share: float = 0.5
    replacement_interval_s: float = 120.0
    replacement_beta: float = 0.1
    min_interval_s: float = 10.0
    max_interval_s: float = 3600.0
    slo_scale: float = 5.0
    processes: int | None = None
    max_services: int | None = None
    keepalive_s: float = 30.0
    contention: bool = True
    tp_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.tp_sizes is not None and (
            not self.tp_sizes or any(t < 1 or t & (t - 1) for t in self.tp_sizes)
        ):
            raise ConfigError(
                f"multi.tp_sizes must be a non-empty list of powers of two, got {self.tp_sizes}"
            )
        if not isinstance(self.contention, bool):
            raise ConfigError(f"multi.contention must be true or false, got {self.contention!r}")
        if self.keepalive_s < 0:
            raise ConfigError(f"multi.keepalive_s must be >= 0, got {self.keepalive_s}")
        for name in (
            "rate",
            "duration_s",
            "history_s",
            "rotate_s",
            "replacement_interval_s",
            "min_interval_s",
            "max_interval_s",
            "slo_scale",
            "processes",
            "max_services",
        ):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"multi.{name} must be positive, got {v}")
        if self.generator is not None and self.generator not in MULTI_GENERATORS:
            raise ConfigError(
                f"multi.generator must be one of {', '.join(MULTI_GENERATORS)}, "
                f"got {self.generator!r}"
            )
        if not 0 < self.replacement_beta < 1:
            raise ConfigError(
                f"multi.replacement_beta must be in (0, 1), got {self.replacement_beta}"
            )


KUN_GENERATORS: tuple[str, ...] = ("bursty",)


@dataclass(frozen=True)
class KunConfigSection:
    """KunServe runs: one replicated model under memory throttling.

    A run uses the KunServe simulator (:mod:`fleetserve.sim.kun`) when its
    stack is one only that simulator has (``kunserve`` and its ablations,
    ``kv-drop``, ``kv-swap``, ``pipeline``) or when ``kunserve.generator`` is
    set (then ``vllm`` and ``llumnix`` run in that simulator too): the
    stack catalog decides (:func:`fleetserve.policy.catalog.world_of`). The
    pool is fixed: ``cluster.gpus`` GPUs, ``cluster.tp`` per instance.

    Attributes:
        generator: ``bursty``: the KunServe experiment's workload
            (:func:`fleetserve.workload.bursty.kunserve_workload`) instead of
            ``workload.trace``.
        profile, arrival, rate, duration_s, burst_start_s, burst_len_s,
            burst_factor, cv: the generator's arguments (length profile
            ``burstgpt``/``agieval-cot``/``azure-conv``, arrivals
            ``azure-burst``/``gamma``).
        kv_tokens: KV memory provisioned per instance, in tokens (None: all
            HBM the weights leave at ``cluster.mem_util``).
        spare_instances: instances beyond ``cluster.gpus // cluster.tp``
            that start off; KunServe's fallback activates one (weights from
            host memory) when dropping layers cannot free enough.
        network_gbps: per-GPU network bandwidth (None: the GPU's).
        gpus_per_node: GPUs per server (None: the GPU's); KunServe's testbed
            has one GPU per server.
        remote_reads: remote attention during a live exchange or restore
            reads the victims' KV on the GPU that still holds it, which then
            does that work instead of the layers' owner
            (:mod:`fleetserve.costmodel.pipeline`); False: every layer's
            attention is priced as if local (the model before session 23).
        alternate: after a prefill iteration a replica decodes once before
            it admits more, while requests run (the KunServe world's choice
            for every stack, :mod:`fleetserve.sim.kun`); False: vLLM v0's
            prefill-first order, as the single-model world.
        exchange, live_restore, strategy, static_stages, horizon_s, window_s,
            monitor_interval_s, restore_threshold, restore_min_s,
            restore_from, max_batch_slowdown, swap_max_out: override the
            stack's :class:`~fleetserve.policy.pressure.KunSettings` (None: keep).
    """

    generator: str | None = None
    profile: str = "burstgpt"
    arrival: str = "azure-burst"
    rate: float = 5.0
    duration_s: float = 300.0
    burst_start_s: float = 90.0
    burst_len_s: float = 20.0
    burst_factor: float = 14.0
    cv: float = 3.0
    kv_tokens: int | None = None
    spare_instances: int = 0
    network_gbps: float | None = None
    gpus_per_node: int | None = None
    remote_reads: bool = True
    alternate: bool = True
    exchange: str | None = None
    live_restore: bool | None = None
    strategy: str | None = None
    static_stages: int | None = None
    horizon_s: float | None = None
    window_s: float | None = None
    monitor_interval_s: float | None = None
    restore_threshold: float | None = None
    restore_min_s: float | None = None
    restore_from: str | None = None
    max_batch_slowdown: float | None = None
    swap_max_out: int | None = None

    def __post_init__(self) -> None:
        _positive(self, "rate", "duration_s", "burst_len_s", "burst_factor", "cv")
        _positive(self, "kv_tokens", "network_gbps", "gpus_per_node")
        if self.generator is not None and self.generator not in KUN_GENERATORS:
            raise ConfigError(
                f"kunserve.generator must be one of {', '.join(KUN_GENERATORS)}, "
                f"got {self.generator!r}"
            )
        if self.spare_instances < 0:
            raise ConfigError(f"kunserve.spare_instances must be >= 0, got {self.spare_instances}")
        if self.burst_start_s < 0:
            raise ConfigError(f"kunserve.burst_start_s must be >= 0, got {self.burst_start_s}")

    def overrides(self) -> dict[str, Any]:
        """The settings this section overrides (fields not None)."""
        names = (
            "exchange",
            "live_restore",
            "strategy",
            "static_stages",
            "horizon_s",
            "window_s",
            "monitor_interval_s",
            "restore_threshold",
            "restore_min_s",
            "restore_from",
            "max_batch_slowdown",
            "swap_max_out",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


FLEET_GENERATORS: tuple[str, ...] = ("fleet", "trace")

_FLEET_SHARED: tuple[str, ...] = ("models", "zipf", "fit_context")
"""Fields of the ``fleet`` section both generators read."""
_FLEET_TRACE_ONLY: tuple[str, ...] = ("trace", "format", "if_missing", "end_s", "length_scale")
"""Fields only ``fleet.generator: trace`` reads."""


@dataclass(frozen=True)
class FleetConfigSection:
    """The fleet workload: many models, Zipf popularity; synthetic or from a trace.

    ``fleet.generator: fleet`` selects
    :func:`fleetserve.workload.fleet.fleet_workload` (a diurnal curve and bursts),
    ``fleet.generator: trace`` selects
    :func:`fleetserve.workload.fleet_trace.trace_fleet_workload` (a recorded trace,
    each request given a model by Zipf popularity); both are seeded by the
    top-level ``seed`` and replace ``workload`` and ``services``. Every other
    field is the generator's argument of the same name; the defaults are
    :data:`fleetserve.workload.fleet.FLEET_DEFAULTS` (the diurnal and burst
    shapes fitted to the shared Azure conversation trace, see docs/fleet.md) and
    :data:`fleetserve.workload.fleet_trace.TRACE_DEFAULTS`. A field of the
    other generator must be left out (it would be ignored).

    Attributes:
        generator: ``fleet``, ``trace``, or None (not used).
        rate: mean base rate of the whole fleet over a period, req/s (fleet).
        duration_s: the run's length (fleet).
        period_s: the compressed day (fleet).
        models: distinct catalog models, most popular first (both).
        zipf: power-law popularity exponent (>= 0) (both).
        peak_trough: peak / trough ratio of the diurnal curve (>= 1) (fleet).
        peak_at: where the peak is, a fraction of ``period_s`` in [0, 1) (fleet).
        bursts: number of burst windows (>= 0) (fleet).
        burst_height: the fleet's total rate during a burst / its base (>= 1) (fleet).
        burst_len_s: length of a burst window (fleet).
        burst_gap_s: mean gap between consecutive burst starts (fleet).
        burst_models: models sharing each burst's extra load (fleet).
        burst_after_s: no burst starts before this time (fleet; e.g. the
            placement history, ``multi.history_s``).
        cv: inter-arrival CV of each model's arrivals (> 0) (fleet).
        lengths: ``azure-conv`` or ``sharegpt`` (fleet).
        fit_context: cut requests to each model's context window (both).
        trace: the trace file; relative paths are resolved against the config
            file's folder (trace).
        format: its format: azure, mooncake, burstgpt or jsonl (trace).
        if_missing: ``error``, or ``synthetic``: the built-in workload with the
            Azure conversation statistics when the file is absent (trace).
        end_s: keep the trace's arrivals in ``[0, end_s)``; None: all (trace).
        length_scale: prompt and output lengths multiplier (trace).
    """

    generator: str | None = None
    rate: float = FLEET_DEFAULTS.rate
    duration_s: float = FLEET_DEFAULTS.duration_s
    period_s: float = FLEET_DEFAULTS.period_s
    models: tuple[str, ...] = FLEET_DEFAULTS.models
    zipf: float = FLEET_DEFAULTS.zipf
    peak_trough: float = FLEET_DEFAULTS.peak_trough
    peak_at: float = FLEET_DEFAULTS.peak_at
    bursts: int = FLEET_DEFAULTS.bursts
    burst_height: float = FLEET_DEFAULTS.burst_height
    burst_len_s: float = FLEET_DEFAULTS.burst_len_s
    burst_gap_s: float = FLEET_DEFAULTS.burst_gap_s
    burst_models: int = FLEET_DEFAULTS.burst_models
    burst_after_s: float = FLEET_DEFAULTS.burst_after_s
    cv: float = FLEET_DEFAULTS.cv
    lengths: str = FLEET_DEFAULTS.lengths
    fit_context: bool = FLEET_DEFAULTS.fit_context
    trace: str | None = TRACE_DEFAULTS.trace
    format: str | None = TRACE_DEFAULTS.format
    if_missing: str = TRACE_DEFAULTS.if_missing
    end_s: float | None = TRACE_DEFAULTS.end_s
    length_scale: float = TRACE_DEFAULTS.length_scale

    def __post_init__(self) -> None:
        if self.generator is not None and self.generator not in FLEET_GENERATORS:
            raise ConfigError(
                f"fleet.generator must be one of {', '.join(FLEET_GENERATORS)}, "
                f"got {self.generator!r}"
            )
        trace = self.generator == "trace"
        for f in dataclasses.fields(self):
            if f.name == "generator" or f.name in _FLEET_SHARED:
                continue
            if (f.name in _FLEET_TRACE_ONLY) == trace:
                continue
            if getattr(self, f.name) != f.default:
                used_by = "trace" if f.name in _FLEET_TRACE_ONLY else "fleet"
                raise ConfigError(
                    f"fleet.{f.name} applies only to fleet.generator: {used_by} "
                    f"(here {self.generator or 'not set'}); leave it out"
                )
        try:
            if trace:
                check_trace_args(**self.generator_kwargs())
            else:
                check_fleet_args(**self._kwargs(fleet=True))
        except ConfigError as e:
            raise ConfigError(f"fleet.{e}") from None

    def _kwargs(self, *, fleet: bool) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "generator"
            and (f.name in _FLEET_SHARED or (f.name in _FLEET_TRACE_ONLY) != fleet)
        }

    def generator_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the selected generator:
        :func:`~fleetserve.workload.fleet.fleet_workload` (``fleet`` or not set) or
        :func:`~fleetserve.workload.fleet_trace.trace_fleet_workload` (``trace``)."""
        return self._kwargs(fleet=self.generator != "trace")


SERVE_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ServeConfigSection:
    """The runtime cluster ``fleetserve serve`` starts (and ``fidelity`` simulates).

    One Ray actor per (emulated) GPU owns an engine whose arena — weights plus
    KV — is that GPU's memory budget. Which models each worker hosts comes from
    the ``placement`` policy (default ``dedicated``: workers are split over the
    models in proportion to their request rates, at least one each). A
    multi-LLM stack (``policy.stack: seallm``, ``muxserve``, ...) places
    sharing groups instead: a worker may host several models in its arena
    (:mod:`fleetserve.runtime.plan`).

    Attributes:
        workers: GPUs (worker actors) to start.
        gpu_memory_mb: each worker's memory budget in MiB (its arena).
        models: engine models to serve: built-in names (``tiny-llama-a``,
            ``tiny-llama-b``) or checkpoint folders (``config.json`` +
            safetensors); None: the top-level ``model``.
        device: ``cpu`` (emulated GPUs) or ``cuda`` / ``cuda:N``.
        dtype: weights and KV element type.
        threads_per_worker: torch CPU threads of each worker.
        cuda_graphs: on a CUDA device, a step in which every request of a
            model decodes one token is the replay of a captured CUDA graph
            (the engine's ``decode_graphs``; docs/gpu.md); false: every step
            eager. No effect on the CPU.
        spatial_shares: a worker hosting several models under a spatial
            scheduler (MuxServe's ADBS) runs the jobs of one scheduling point
            at once, each on its share of the worker's threads (needs 2 or
            more); false (default): one after another on all threads, which
            measured faster on a 2-core CPU (docs/runtime-parity.md).
        max_queue: the admission queue: most requests waiting for their first
            token, cluster-wide; one more gets 429 with ``Retry-After``.
        max_running: batch limit of each worker's engine.
        max_batch_tokens: tokens per engine iteration.
        tick_s: how often the controller observes the cluster and runs the
            periodic policies (migration epochs run every
            ``migration.epoch_s``).
        max_body_bytes: request bodies larger than this get 413 (enforced
            while the body is read, chunked uploads included).
        max_tokens_default: ``max_tokens`` when a request does not say; None
            (default): the rest of the model's context window, as vLLM.
        max_stop_chars: most characters of all of a request's ``stop``
            strings together (more: 400).
        max_stop_strings: most ``stop`` strings (and ``stop_token_ids``) of
            a request (more: 400).
        header_timeout_s: a connection must send a request's complete
            headers within this many seconds of its first byte (or of the
            connection opening); else 408 and the connection is closed.
        body_timeout_s: a request's whole body must arrive within this many
            seconds of its headers; else 408.
        max_connections: open HTTP connections at most; one more is
            answered 503 and closed at once.
        drain_timeout_s: on SIGTERM or SIGINT the server stops admitting
            (503 with ``Retry-After``), lets the requests in flight finish for
            up to this many seconds, ends the rest with an error, and exits 0.
        restart_workers: respawn a worker actor that died (a new actor with
            the same spec, once its requests were resumed elsewhere).
        step_log: a JSON-lines file to append every engine step of every
            worker to, one line per step (start, duration, the batch: prompt
            chunks, decode batch and context, and whether work was left);
            ``fleetserve fidelity`` compares it with the calibrated cost
            model. None: no log.
        hop_trace: measure every streamed token's hops of the serving path
            (``fleetserve_hop_seconds{token="next"}``; a request's first token
            is always measured; :mod:`fleetserve.runtime.hops`).
        hop_log: a JSON-lines file to append each measured token's hops to
            (turns ``hop_trace`` on); ``benchmarks/serve_hops.py`` reads it.
            None: no log.
        pin_cores: CPU workers of a local ``serve``: each worker's engine
            runs on ``threads_per_worker`` cores of its own, and the server,
            Ray and everything else ``serve`` starts on the remaining ones
            (Linux CPU affinity), as an engine on a GPU does not share the
            cores the server runs on. Needs ``workers x threads_per_worker``
            cores plus at least one.
    """

    workers: int = 2
    gpu_memory_mb: float = 64.0
    models: tuple[str, ...] | None = None
    device: str = "cpu"
    dtype: str = "float32"
    threads_per_worker: int = 1
    cuda_graphs: bool = True
    spatial_shares: bool = False
    max_queue: int = 64
    max_running: int = 64
    max_batch_tokens: int = 4096
    tick_s: float = 0.02
    max_body_bytes: int = 1_000_000
    max_tokens_default: int | None = None
    step_log: str | None = None
    hop_trace: bool = False
    hop_log: str | None = None
    pin_cores: bool = False
    max_stop_chars: int = 16_384
    max_stop_strings: int = 16
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    drain_timeout_s: float = 30.0
    restart_workers: bool = True

    def __post_init__(self) -> None:
        _positive(self, "workers", "gpu_memory_mb", "threads_per_worker", "max_queue")
        _positive(self, "max_running", "max_batch_tokens", "tick_s", "max_body_bytes")
        _positive(self, "max_tokens_default", "max_stop_chars", "max_stop_strings")
        _positive(self, "header_timeout_s", "body_timeout_s", "max_connections")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"serve.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.dtype not in SERVE_DTYPES:
            raise ConfigError(
                f"serve.dtype must be one of {', '.join(SERVE_DTYPES)}, got {self.dtype!r}"
            )
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"serve.device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.models is not None and not self.models:
            raise ConfigError("serve.models: give at least one model (or leave it out)")

    def model_names(self, default: str) -> tuple[str, ...]:
        """The engine models served (``default``: the config's top-level ``model``)."""
        return self.models if self.models is not None else (default,)


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulation needs; ``summary.json`` stores it resolved.

    Attributes:
        model: model of the requests (catalog name or HF config path) unless
            the workload assigns models.
        seed: seed of the run's ``numpy.random.Generator``.
        sample_interval_s: time-series sampling period.
        max_time_s: stop at this time (requests still in flight are unfinished).
        macro_steps: advance fixed decode batches several iterations at once
            (exactly equal results; False runs iteration by iteration).
        check_integrity: check every invariant after every event (slow; tests).
        slo_scales: SLO scales for ``slo_attainment``.
    """

    model: str = "llama-2-7b"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    mell: MellConfig = field(default_factory=MellConfig)
    services: tuple[ServiceConfig, ...] | None = None
    multi: MultiConfigSection = field(default_factory=MultiConfigSection)
    kunserve: KunConfigSection = field(default_factory=KunConfigSection)
    fleet: FleetConfigSection = field(default_factory=FleetConfigSection)
    serve: ServeConfigSection = field(default_factory=ServeConfigSection)
    seed: int = 0
    sample_interval_s: float = 1.0
    max_time_s: float | None = None
    macro_steps: bool = True
    check_integrity: bool = False
    slo_scales: tuple[float, ...] = DEFAULT_SLO_SCALES

    def __post_init__(self) -> None:
        _positive(self, "sample_interval_s", "max_time_s")
        if not self.slo_scales or any(s <= 0 for s in self.slo_scales):
            raise ConfigError("slo_scales must be a non-empty list of positive numbers")
        if self.services is not None:
            names = [s.name for s in self.services]
            if not names:
                raise ConfigError("services: give at least one service (or leave it out)")
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ConfigError(f"services: duplicate service names {dup}")
            if self.multi.generator is not None:
                raise ConfigError(
                    f"multi.generator {self.multi.generator!r} makes its own services; "
                    "leave out the services list"
                )
        if self.fleet.generator is not None and self.services is not None:
            raise ConfigError(
                "fleet.generator makes its own services (one per model); leave out the "
                "services list"
            )
        if self.is_multi and self.cluster.gpus is None:
            raise ConfigError(
                "a multi-LLM run (services, multi.generator or fleet.generator) needs a fixed "
                "pool: set cluster.gpus"
            )
        if self.is_multi and self.kunserve.generator is not None:
            raise ConfigError("kunserve.generator cannot be combined with a multi-LLM run")
        if self.fleet.generator is not None and (
            self.multi.generator is not None or self.kunserve.generator is not None
        ):
            raise ConfigError(
                "fleet.generator makes its own workload; it cannot be combined with "
                "multi.generator or kunserve.generator"
            )
        if self.fleet.generator is not None and self.workload != WorkloadConfig():
            changed = [
                f"workload.{f.name}"
                for f in dataclasses.fields(WorkloadConfig)
                if getattr(self.workload, f.name) != f.default
            ]
            raise ConfigError(
                f"{', '.join(changed)}: fleet.generator makes its own workload and would "
                "ignore the workload section (a trace goes under fleet.trace with "
                "fleet.generator: trace); leave it out"
            )

    @property
    def is_multi(self) -> bool:
        """Whether this is a multi-LLM run (the sharing-group simulator): services
        given, or a multi-model generator (``multi.generator``, ``fleet.generator``)."""
        return (
            self.services is not None
            or self.multi.generator is not None
            or self.fleet.generator is not None
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (for ``summary.json``)."""
        return _to_plain(dataclasses.asdict(self))


def _to_plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _to_plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_to_plain(x) for x in v]
    return v


T = TypeVar("T")


def _coerce(value: Any, tp: Any, where: str, src: str | None) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where, src)
            except InputError as e:
                errors.append(e.detail)
        raise InputError(errors[0] if errors else "invalid value", file=src, field=where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise InputError(f"expected a mapping, got {value!r}", file=src, field=where)
        return _build(tp, value, where, src)  # type: ignore[arg-type]
    if origin is tuple:
        (elem, *_rest) = typing.get_args(tp)
        if isinstance(value, str):
            value = [x.strip() for x in value.split(",") if x.strip()]
        if not isinstance(value, list | tuple):
            raise InputError(f"expected a list, got {value!r}", file=src, field=where)
        return tuple(_coerce(x, elem, f"{where}[{i}]", src) for i, x in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise InputError(f"expected true or false, got {value!r}", file=src, field=where)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise InputError(f"expected an integer, got {value!r}", file=src, field=where)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise InputError(f"expected a number, got {value!r}", file=src, field=where)
    if tp is str:
        if isinstance(value, str | Path):
            return str(value)
        raise InputError(f"expected a string, got {value!r}", file=src, field=where)
    raise TypeError(f"unsupported config type {tp!r}")  # pragma: no cover


def _build(cls: type[T], data: dict[str, Any], prefix: str, src: str | None) -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise InputError(
                f"unknown key (expected one of: {', '.join(sorted(names))})", file=src, field=where
            )
        kwargs[key] = _coerce(value, hints[key], where, src)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{src}: {e}" if src else str(e)) from None


def build_dataclass(
    cls: type[T], data: dict[str, Any], prefix: str = "", src: str | None = None
) -> T:
    """Build a frozen config dataclass ``cls`` from a plain dict, as a config file is:
    unknown keys rejected and every value type-checked, errors naming ``src`` and
    the field's dotted path (under ``prefix``)."""
    return _build(cls, data, prefix, src)


def config_from_dict(data: dict[str, Any], src: str | None = None) -> SimConfig:
    """Build a validated :class:`SimConfig` from a plain dict."""
    return _build(SimConfig, data, "", src)


def load_config(path: str | Path | None) -> dict[str, Any]:
    """Read a YAML config file into a dict (not yet validated); {} for None."""
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise InputError("config file not found", file=str(p))
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(e, "problem", e)
        raise InputError(f"invalid YAML: {problem}", file=str(p), line=line) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError("expected a mapping at the top level", file=str(p))
    return data


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``key.path=value`` override to a config dict in place."""
    if "=" not in assignment:
        raise InputError(f"--set expects key=value, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise InputError(f"--set {key}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value
