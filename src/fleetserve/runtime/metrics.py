"""Prometheus metrics of the runtime (``GET /metrics``).

One registry per controller (two servers in one process do not share
counters). Names follow Prometheus conventions (``_total`` counters, base
units: seconds, bytes).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# TTFT and TPOT buckets: tiny CPU models decode in milliseconds, real ones
# take tens of ms per token and seconds to the first token under load.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# Serving-path hops (runtime.hops): from tens of microseconds (a thread
# hand-off) to seconds (a prefill under load).
_HOP_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    10,
)


class RuntimeMetrics:
    """The counters, gauges and histograms the controller and server update."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "fleetserve_requests_total",
            "Requests by final outcome: finished, aborted (client went away), "
            "rejected (429/503 at admission), failed (no worker could serve it)",
            ["model", "outcome"],
            registry=r,
        )
        self.http = Counter(
            "fleetserve_http_responses_total",
            "HTTP responses by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "fleetserve_generated_tokens_total", "Tokens streamed to clients", ["model"], registry=r
        )
        self.prompt_tokens = Counter(
            "fleetserve_prompt_tokens_total", "Prompt tokens admitted", ["model"], registry=r
        )
        self.ttft = Histogram(
            "fleetserve_ttft_seconds",
            "Time to first token (arrival at the server to the first token at the controller)",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "fleetserve_tpot_seconds",
            "Time per output token after the first (a request's mean)",
            ["model"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "fleetserve_e2e_seconds",
            "End-to-end latency of finished requests",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.hops = Histogram(
            "fleetserve_hop_seconds",
            "Time of each hop of the serving path (fleetserve.runtime.hops): a request's "
            "first token (token=first) and, with serve.hop_trace, the others (token=next)",
            ["hop", "token"],
            buckets=_HOP_BUCKETS,
            registry=r,
        )
        self.queue = Gauge(
            "fleetserve_queue_length",
            "Admitted requests still waiting for their first token (the admission queue)",
            registry=r,
        )
        self.in_flight = Gauge(
            "fleetserve_requests_in_flight", "Admitted requests not yet finished", registry=r
        )
        self.kv_util = Gauge(
            "fleetserve_kv_utilization",
            "KV pages in use / pages the weights leave for KV, per worker",
            ["worker"],
            registry=r,
        )
        self.kv_bytes = Gauge(
            "fleetserve_kv_bytes_used", "KV bytes in use per worker", ["worker"], registry=r
        )
        self.arena_bytes = Gauge(
            "fleetserve_arena_bytes",
            "Each worker's memory budget (weights + KV arena)",
            ["worker"],
            registry=r,
        )
        self.weight_bytes = Gauge(
            "fleetserve_weight_bytes", "Weight bytes held per worker", ["worker"], registry=r
        )
        self.worker_running = Gauge(
            "fleetserve_worker_running", "Requests in the batch per worker", ["worker"], registry=r
        )
        self.worker_waiting = Gauge(
            "fleetserve_worker_waiting", "Requests queued per worker", ["worker"], registry=r
        )
        self.workers_alive = Gauge("fleetserve_workers_alive", "Live worker actors", registry=r)
        self.migrations = Counter(
            "fleetserve_migrations_total",
            "Request migrations between workers by mode (kv, token) and outcome",
            ["mode", "outcome"],
            registry=r,
        )
        self.migration_bytes = Counter(
            "fleetserve_migration_bytes_total", "KV bytes moved by migrations", registry=r
        )
        self.migration_stages = Counter(
            "fleetserve_migration_stages_total",
            "Live KV migrations: copy stages run while the request kept decoding "
            "(the final stop-and-copy not counted)",
            registry=r,
        )
        self.migration_stall = Histogram(
            "fleetserve_migration_stall_seconds",
            "Live KV migrations: how long the request was paused (the stop-and-copy)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.replacements = Counter(
            "fleetserve_replacements_total",
            "SeaLLM adaptive replacement: re-placement searches by outcome "
            "(unchanged: the plan kept every model where it was; switched)",
            ["outcome"],
            registry=r,
        )
        self.model_loads = Histogram(
            "fleetserve_model_load_seconds",
            "SeaLLM re-placement: time a worker took to load a model it gains",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.preemptions = Counter(
            "fleetserve_preemptions_total",
            "Requests the workers' engines preempted (their KV freed, recomputed later)",
            registry=r,
        )
        self.group_jobs = Counter(
            "fleetserve_group_jobs_total",
            "Jobs of the workers' group schedulers (several models on one worker), by how "
            "they ran: alone (one after another, on all threads) or at_once (a spatial "
            "scheduler's jobs of one scheduling point, each on its share of the threads)",
            ["mode"],
            registry=r,
        )
        self.drops = Counter(
            "fleetserve_layer_drops_total",
            "KunServe: layers dropped from replicas to free memory for KV",
            registry=r,
        )
        self.restores = Counter(
            "fleetserve_layer_restores_total",
            "KunServe: layers restored to dropped replicas",
            registry=r,
        )
        self.kun_exchanged = Counter(
            "fleetserve_kun_exchanged_requests_total",
            "KunServe: running requests of merged workers, by how they joined the group "
            "(kv: their KV exchanged to the stages; recomputed: it did not fit a stage; "
            "remote: a live exchange's victim, its KV left on its origin, which runs "
            "the other stages' attention for it)",
            ["how"],
            registry=r,
        )
        self.kun_flips = Counter(
            "fleetserve_kun_exchange_flips_total",
            "KunServe: live-exchange victims whose KV finished crossing to the other "
            "stages (from then on their attention runs locally on every stage)",
            registry=r,
        )
        self.kun_exchange_stall = Histogram(
            "fleetserve_kun_exchange_stall_seconds",
            "KunServe: how long a merge's blocking KV exchange stopped the sources' requests",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.kun_actions = Counter(
            "fleetserve_kun_actions_total",
            "KunServe policy decisions, by action (DropLayers, Restore, ActivateSpare)",
            ["action"],
            registry=r,
        )
        self.activations = Histogram(
            "fleetserve_worker_activation_seconds",
            "Elastic pool: time an activated worker took to load its weights and arena "
            "(an inactive one holds neither; cluster.activation_s in the simulator)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.sleeps = Counter(
            "fleetserve_worker_sleeps_total",
            "Elastic pool: released workers that gave their weights and arena back",
            registry=r,
        )
        self.prefix_tokens = Counter(
            "fleetserve_prefix_cache_tokens_total",
            "Prefix caching (engine.prefix_caching): prompt tokens admitted (kind=prompt) "
            "and of them read from cached blocks (kind=hit)",
            ["kind"],
            registry=r,
        )
        self.worker_failures = Counter(
            "fleetserve_worker_failures_total", "Worker actors found dead", registry=r
        )
        self.worker_restarts = Counter(
            "fleetserve_worker_restarts_total",
            "Dead worker actors respawned, by outcome (done, failed attempt)",
            ["outcome"],
            registry=r,
        )
        self.resumed = Counter(
            "fleetserve_resumed_requests_total",
            "Requests re-prefilled on another worker after their worker failed",
            registry=r,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
