"""What a run (simulated or real) hands to metrics: per-request records and series.

Both backends fill a :class:`RunResult`; :mod:`fleetserve.metrics.summary`
turns it into ``summary.json`` and the other result files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["finished", "rejected", "unfinished"]


@dataclass(slots=True)
class RequestRecord:
    """Outcome of one request. Exactly one status per request.

    Attributes:
        id, model, arrival_s, prompt_tokens, output_tokens: from the workload.
        status: ``finished``, ``rejected`` (never admitted, see ``reason``) or
            ``unfinished`` (still in flight when the run ended).
        reason: why it was rejected (None otherwise).
        first_token_s: absolute time the first output token was produced.
        finish_s: absolute time the last token was produced.
        generated: output tokens produced (== output_tokens when finished).
        ideal_s: execution time of this request alone on an idle instance
            (prefill + all decode steps, from the cost model); the
            denominator of normalized latency and of SLO scales.
        instance: instance that finished it (last one, after migrations).
        preemptions: times it was preempted (recompute).
        migrations: times it was migrated (completed moves).
        migration_stall_s: time its decoding stood still because of
            migrations, summed: a KV move's detach → attach at the
            destination; a token move's detach → its next token (queueing
            and re-prefill at the destination included).
        aborted_migrations: moves of it that were planned or started but
            aborted (see ``fleetserve.sim.migration``).
        cached_tokens: prompt tokens its first prefill found in the prefix
            cache and did not compute (vLLM's ``num_cached_tokens``; 0 without
            prefix caching).
    """

    id: int
    model: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    status: Status = "unfinished"
    reason: str | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    generated: int = 0
    ideal_s: float = 0.0
    instance: int | None = None
    preemptions: int = 0
    migrations: int = 0
    migration_stall_s: float = 0.0
    aborted_migrations: int = 0
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, or None if no token was produced."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency of a finished request."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean decode-step time (TBT), None for requests with fewer than two tokens."""
        if self.finish_s is None or self.first_token_s is None or self.generated < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.generated - 1)


@dataclass(frozen=True, slots=True)
class MigrationRecord:
    """One completed migration of a request's state between instances.

    Attributes:
        time_s: when it completed (the request joined the destination).
        request_id, src, dst: the request and the two instances.
        mode: ``kv`` or ``token``.
        bytes: bytes sent, all stages (all tensor-parallel shards together).
        stages: live KV copy stages before the stop-and-copy (0 for token moves).
    """

    time_s: float
    request_id: int
    src: int
    dst: int
    mode: str  # "kv" | "token" | ...
    bytes: int
    stages: int = 0


@dataclass(slots=True)
class TimeSeries:
    """Cluster state sampled every ``interval_s`` of run time.

    Columns are parallel lists of equal length. ``kv_demand_bytes`` counts the
    KV of every admitted request plus the prompts of queued ones (for
    ``gpus.lower_bound``); ``kv_capacity_bytes`` is the KV capacity of active
    GPUs only.
    """

    interval_s: float
    t: list[float] = field(default_factory=list)
    active_gpus: list[int] = field(default_factory=list)
    kv_used_bytes: list[int] = field(default_factory=list)
    kv_capacity_bytes: list[int] = field(default_factory=list)
    kv_demand_bytes: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)

    def append(
        self,
        t: float,
        active_gpus: int,
        kv_used_bytes: int,
        kv_capacity_bytes: int,
        kv_demand_bytes: int,
        queued: int,
        running: int,
    ) -> None:
        """Add one sample."""
        self.t.append(t)
        self.active_gpus.append(active_gpus)
        self.kv_used_bytes.append(kv_used_bytes)
        self.kv_capacity_bytes.append(kv_capacity_bytes)
        self.kv_demand_bytes.append(kv_demand_bytes)
        self.queued.append(queued)
        self.running.append(running)


@dataclass(frozen=True, slots=True)
class GpuInterval:
    """A GPU was active from ``start_s`` to ``end_s`` (run end if never released)."""

    gpu: int
    start_s: float
    end_s: float


@dataclass(slots=True)
class RunResult:
    """Everything a run produced; input to :func:`fleetserve.metrics.summary.summarize`.

    Attributes:
        records: one per workload request, in request-id order.
        timeseries: sampled cluster state.
        gpu_intervals: activity intervals of every GPU ever active.
        migrations: completed migrations.
        end_s: run time at which the run ended.
        kv_bytes_per_gpu: KV capacity of one GPU for single-model runs (None
            when models differ), used for ``gpus.lower_bound``.
        instance_kv_tokens: KV capacity of one instance in tokens where every
            instance has the same and a request's KV never spans instances
            (the single-model world; None elsewhere), used for
            ``gpus.lower_bound_large``.
        config: the resolved configuration (plain JSON-able dict).
        sim_wall_s: wall-clock seconds the simulation took (sim only).
        sim_events: events processed (sim only).
        notes: human-readable remarks to surface in the report (e.g. length caps).
        aborted_migrations: migrations planned or started but aborted (not in
            ``migrations``).
        extra: backend-specific sections added to ``summary.json`` as they are
            (e.g. ``kv_layout`` and ``groups`` of a multi-LLM run).
    """

    records: list[RequestRecord]
    timeseries: TimeSeries
    gpu_intervals: list[GpuInterval]
    migrations: list[MigrationRecord]
    end_s: float
    kv_bytes_per_gpu: int | None
    config: dict[str, Any]
    sim_wall_s: float | None = None
    sim_events: int | None = None
    notes: list[str] = field(default_factory=list)
    aborted_migrations: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    instance_kv_tokens: int | None = None
