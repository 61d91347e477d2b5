"""Discrete-event simulation of multi-LLM sharing groups (SeaLLM, MuxServe).

One :class:`MultiSimulator` runs a workload of several services on a fixed
pool of GPUs split into sharing groups by a
:class:`~fleetserve.policy.groups.PlacementPlan`::

    arrival ──► rejected if no group hosting its service could ever hold it
            ──► the hosting group (replica) with the fewest outstanding
                requests of that service; its scheduler may start jobs
    job end ──► the group records tokens and finishes requests; its
                scheduler starts the next jobs
    sample  ──► time series (KV use, queue) and KV-layout statistics
    replace ──► (SeaLLM's adaptive replacement, optional) measure the last
                interval's SLO attainment, adapt the interval (Equation 8),
                search a new plan on the last interval's requests and switch

Replacement (with ``replacement`` and a ``replanner``). At a replacement the
replanner returns a plan and its estimated SLO attainment on the history;
groups identical in both plans keep running untouched. A removed group stops
scheduling: its queued requests are dispatched again at once, its jobs in
flight end after their current iteration (a macro job is cut there), then its
running requests migrate with their KV to a host of their service in the new
plan (one at a time per source group, over NVLink inside a node or the network
between nodes; KV bytes split over the smaller TP degree). An added group loads
its weights from host memory over PCIe (SeaLLM's node worker pulls them to the
host in the background beforehand) once the groups on its GPUs have drained;
until then it only queues requests. A migrated request arrives when both its
KV transfer and its destination's weight load are done; if its KV no longer
fits there it is recomputed (queued at the head, as a preemption). ``M_real``
of an interval is the SLO attainment of the requests whose deadline
(``arrival + slo_scale × ideal_s``) falls in it (an interval without any
deadline leaves the interval length unchanged). No replacement is scheduled
after the last arrival.

Memory pressure (``MultiConfig.burst``): by default the group scheduler
preempts (the newest request is recomputed later); with ``pressure:
kunserve`` KunServe's policy merges buddy groups (same TP degree and services)
into pipelined groups under a burst and restores them when the load falls
(:mod:`fleetserve.sim.multi_burst`; the ``fleet`` stack).

Every group of ``len(gpus) // tp`` replicas runs as its own
:class:`~fleetserve.sim.group.SharingGroup`. Each request's ``ideal_s`` (the
denominator of normalized latency and SLO scales) is its execution time alone
on the smallest power-of-two number of GPUs its model fits on, so it does not
depend on the placement under test.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetserve.cluster.state import ClusterState
from fleetserve.costmodel import CostModel
from fleetserve.costmodel.transfer import host_link, intra_node_link, network_link, transfer_time
from fleetserve.errors import ConfigError
from fleetserve.metrics.records import (
    GpuInterval,
    MigrationRecord,
    RequestRecord,
    RunResult,
    TimeSeries,
)
from fleetserve.policy.actions import Dispatch
from fleetserve.policy.base import DISPATCH
from fleetserve.policy.batching import one_model_batching
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.policy.mechanism import MECHANISM, MechanismContext, PendingMove
from fleetserve.policy.pressure import KunSettings
from fleetserve.policy.replacement import AdaptiveInterval, plan_diff
from fleetserve.policy.sharing import BATCHING, GroupScheduler, ServiceStats
from fleetserve.sim.admission import context_note, context_reason
from fleetserve.sim.batch import SimClock
from fleetserve.sim.events import (
    EPOCH,
    GROUP_READY,
    IDLE_CHECK,
    ITER_END,
    KV_ARRIVED,
    REPLACE,
    SAMPLE,
    TRANSFER,
    Event,
)
from fleetserve.sim.group import HostView, JobCost, SharingGroup
from fleetserve.sim.kernel import Kernel, ProgressFn
from fleetserve.sim.kvlayout import make_layout
from fleetserve.sim.migration import TOKEN_ID_BYTES
from fleetserve.sim.multi_burst import BurstControl, check_burst
from fleetserve.sim.seq import Seq
from fleetserve.spec import get_gpu
from fleetserve.spec.memory import group_kv_bytes, min_tp
from fleetserve.spec.types import GpuSpec
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

logger = logging.getLogger(__name__)

Replanner = Callable[[Sequence[Request], float, float], tuple[PlacementPlan, float]]
"""``replanner(history, window_s, now) -> (plan, estimated SLO attainment)``:
a new plan from the requests that arrived in the last ``window_s`` seconds."""


@dataclass(frozen=True, slots=True)
class ReplacementConfig:
    """SeaLLM's adaptive replacement (§4.3) in a simulation.

    Attributes:
        initial_interval_s: ``I_0``, the first interval (a cluster manager's choice).
        beta: Equation 8's step (paper: 0.1).
        min_interval_s, max_interval_s: bounds of the adapted interval.
        slo_scale: the SLO of ``M_real`` (paper: 5 × execution time).
    """

    initial_interval_s: float = 120.0
    beta: float = 0.1
    min_interval_s: float = 10.0
    max_interval_s: float = 3600.0
    slo_scale: float = 5.0

    def __post_init__(self) -> None:
        if self.slo_scale <= 0:
            raise ConfigError(f"replacement slo_scale must be > 0, got {self.slo_scale}")
        AdaptiveInterval(  # the same checks as the policy
            self.initial_interval_s, self.beta, self.min_interval_s, self.max_interval_s
        )


def _gkey(g: GroupPlacement) -> tuple[tuple[int, ...], int, tuple[str, ...]]:
    return (tuple(sorted(g.gpus)), g.tp, tuple(sorted(g.services)))


@dataclass(frozen=True, slots=True)
class MultiConfig:
    """How a multi-LLM simulation runs (placement given separately).

    Attributes:
        gpu: GPU catalog name.
        n_gpus: GPUs in the pool.
        scheduler: group scheduler name (``fcfs``, ``rr``, ``mlfq``, ``db``, ``adbs``).
        dispatch: dispatch policy among a service's hosts (registry name).
        mechanism: how a re-placement moves running requests (``kv``,
            ``token``, ``adaptive``: Mell §V); ``epoch_s``, ``link_share``
            and ``compute_share`` give the adaptive mechanism's boundaries
            (``migration.*`` of the run's config).
        memory: ``static`` (every group holds its GPUs the whole run) or
            ``elastic``: a group idle for ``keepalive_s`` releases its GPUs
            (its weights are dropped) and wakes, reloading them from host
            memory, when a request of its services finds no live or waking host.
        burst: the memory-pressure family (None or ``queue``: the group
            scheduler preempts; ``kunserve``: KunServe's drop/restore among
            buddy groups, :mod:`fleetserve.sim.multi_burst`).
        scheduler_params: keyword arguments of the scheduler.
        layout: KV layout (``headwise``, ``merged``, ``partitioned``).
        block_size: tokens per KV block.
        mem_util: share of each GPU's memory the engines may use.
        max_num_seqs: running requests per service and group at most.
        max_batched_tokens: prompt tokens per prefill job.
        sample_interval_s: time-series sampling period.
        max_time_s: stop at this simulated time (None: run to completion).
        check_integrity: check every group after every event (tests).
        max_model_len: the context window served (None: each model's own
            ``max_context``); longer requests are rejected.
        macro_steps: advance lone decode batches several iterations at once
            (same results; see ``SharingGroup._macro_steps``).
        contention: jobs a spatial scheduler (ADBS) runs at once share the
            GPUs' memory bandwidth (:mod:`fleetserve.sim.contention`); False:
            each job streams memory at full bandwidth (before issue 22).
        chunked_prefill: prompts in chunks beside the decodes of their
            service (``engine.chunked_prefill``; FCFS and RR groups, see
            :class:`~fleetserve.sim.group.SharingGroup`).
        watermark: vLLM's admission watermark (``engine.watermark``; see
            :class:`~fleetserve.sim.group.SharingGroup`). Before session 25
            this world had none.
    """

    gpu: str = "a100-80gb"
    n_gpus: int = 8
    scheduler: str = "fcfs"
    dispatch: str = "fewest_requests"
    mechanism: str = "kv"
    memory: str = "static"
    keepalive_s: float = 30.0
    epoch_s: float = 0.5
    link_share: float = 0.5
    compute_share: float = 0.1
    burst: KunSettings | None = None
    scheduler_params: Mapping[str, Any] = field(default_factory=dict)
    layout: str = "headwise"
    block_size: int = 16
    mem_util: float = 0.9
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    sample_interval_s: float = 1.0
    max_time_s: float | None = None
    check_integrity: bool = False
    max_model_len: int | None = None
    macro_steps: bool = True
    contention: bool = True
    watermark: float = 0.01
    chunked_prefill: bool = False

    def __post_init__(self) -> None:
        if self.n_gpus < 1 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ConfigError("n_gpus, block_size and max_num_seqs must be >= 1")
        if self.chunked_prefill:
            one_model = BATCHING.get(self.scheduler).one_model
            if not one_model:
                raise ConfigError(
                    f"engine.chunked_prefill with batching {self.scheduler!r}: chunked "
                    "prefill is modelled for the temporal schedulers with a one-model case "
                    f"({', '.join(one_model_batching())}); {self.scheduler} runs whole "
                    "prefill jobs"
                )
            if self.burst is not None and self.burst.pressure == "kunserve":
                raise ConfigError(
                    "engine.chunked_prefill with KunServe's drop (pressure: kunserve): "
                    "pipelined groups prefill in lanes, not in chunks"
                )
        if not 0 < self.mem_util <= 1:
            raise ConfigError(f"mem_util must be in (0, 1], got {self.mem_util}")
        if self.sample_interval_s <= 0:
            raise ConfigError("sample_interval_s must be > 0")
        if self.memory not in ("static", "elastic"):
            raise ConfigError(
                f"memory {self.memory!r}: a multi-LLM run holds its groups' GPUs "
                "(static) or releases idle groups (elastic)"
            )
        if self.keepalive_s < 0:
            raise ConfigError(f"keepalive_s must be >= 0, got {self.keepalive_s}")
        if self.burst is not None:
            check_burst(self.burst)


def service_stats(
    services: Mapping[str, Service],
    requests: Sequence[Request],
    gpu: GpuSpec,
    cost_model: CostModel,
) -> tuple[dict[str, ServiceStats], np.ndarray]:
    """Per-service statistics a scheduler may know (SeaLLM's profiled L̂_s and
    σ_s) and every request's ideal execution time.

    The ideal time of a request is its execution alone on the smallest
    power-of-two TP degree its model fits on (``prefill + decode steps``, the
    cost model's ``ideal_times``). L̂_s and σ_s are the mean and standard
    deviation of those times over the service's requests in the workload
    (the "historical request information" SeaLLM profiles).
    """
    ideal = np.zeros(len(requests))
    by: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        by.setdefault(r.model, []).append(i)
    stats: dict[str, ServiceStats] = {}
    for name, svc in services.items():
        tp = min_tp(svc.spec, gpu, max_tp=gpu.gpus_per_node)
        cost = cost_model.bind(svc.spec, gpu, tp)
        idx = by.get(name, [])
        if idx:
            p = np.array([requests[i].prompt_tokens for i in idx], dtype=np.float64)
            o = np.array([requests[i].output_tokens for i in idx], dtype=np.float64)
            t = cost.ideal_times(p, o)
            ideal[idx] = t
            mean, std = float(t.mean()), float(t.std())
        else:
            t1 = cost.ideal_times(np.array([svc.mean_prompt]), np.array([svc.mean_output]))
            mean, std = float(t1[0]), 0.0
        per_tok = cost.prefill_time([int(max(1, svc.mean_prompt))]) / max(1.0, svc.mean_prompt)
        stats[name] = ServiceStats(
            rate=svc.rate,
            exec_mean_s=mean,
            exec_std_s=std,
            kv_bytes_per_token=svc.spec.kv_bytes_per_token,
            prefill_s_per_token=per_tok,
        )
    return stats, ideal


class MultiSimulator:
    """Simulates ``requests`` on the groups of ``plan``.

    Args:
        config: run settings.
        services: every service, by name (``Request.model`` holds the name).
        plan: the placement (checked against ``services`` and the pool).
        requests: sorted by arrival, ids ``0..n-1``.
        cost_model: iteration times (default roofline).
        stats: per-service statistics for the schedulers (default: profiled
            from ``requests`` by :func:`service_stats`).
        progress: called as ``progress(sim_time, events, done)`` now and then.
        replacement: adaptive replacement settings (None: the plan is fixed).
        replanner: the placement search run at each replacement (required
            with ``replacement``).
        initial_estimate: the estimated SLO attainment of ``plan`` (``M_est``
            of the first interval; None: the first interval only adapts
            nothing and starts the estimates).

    Raises:
        ConfigError: a group's weights leave no KV memory, a request names an
            unknown service, or the plan does not fit the pool.
    """

    def __init__(
        self,
        config: MultiConfig,
        services: Mapping[str, Service],
        plan: PlacementPlan,
        requests: Sequence[Request],
        *,
        cost_model: CostModel | None = None,
        stats: Mapping[str, ServiceStats] | None = None,
        progress: ProgressFn | None = None,
        replacement: ReplacementConfig | None = None,
        replanner: Replanner | None = None,
        initial_estimate: float | None = None,
    ) -> None:
        self.cfg = config
        self.clock = SimClock()  # the kernel's time, for the groups' bound batches
        self.services = dict(services)
        self.requests = list(requests)
        for i, r in enumerate(self.requests):
            if r.id != i:
                raise ConfigError(f"request ids must be 0..n-1 in order; position {i} has {r.id}")
            if r.model not in self.services:
                raise ConfigError(f"request {r.id} names unknown service {r.model!r}")
            if i and r.arrival_s < self.requests[i - 1].arrival_s:
                raise ConfigError(f"requests must be sorted by arrival; request {i} is not")
        if plan.n_gpus != config.n_gpus:
            raise ConfigError(f"the plan is for {plan.n_gpus} GPUs, the pool has {config.n_gpus}")
        plan.check(self.services)
        self.plan = plan
        self.initial_plan = plan
        self.gpu = get_gpu(config.gpu)
        self.cost_model = cost_model or CostModel()
        computed, self.ideal = service_stats(
            self.services, self.requests, self.gpu, self.cost_model
        )
        self.stats = dict(stats) if stats is not None else computed
        BATCHING.get(config.scheduler)  # a clear error for unknown names
        self.dispatcher = DISPATCH.get(config.dispatch)()
        self.mechanism = MECHANISM.get(config.mechanism)()
        # the dispatch policies are deterministic; the generator is their
        # interface's, seeded for any that would draw from it
        self.rng = np.random.default_rng(0)
        self._group_by_id: dict[int, SharingGroup] = {}
        self.progress = progress
        self.records = [
            RequestRecord(r.id, r.model, r.arrival_s, r.prompt_tokens, r.output_tokens)
            for r in self.requests
        ]
        self.groups: list[SharingGroup] = []  # every group ever (any state)
        self.hosts: dict[str, list[SharingGroup]] = {s: [] for s in self.services}
        self._by_key: dict[tuple[tuple[int, ...], int, tuple[str, ...]], list[SharingGroup]] = {}
        self._key_of: dict[int, tuple[tuple[int, ...], int, tuple[str, ...]]] = {}
        self._started: dict[int, float] = {}
        self._stopped: dict[int, float] = {}
        self._ready_at: dict[int, float] = {}
        # elastic memory: when each group became idle, the periods its GPUs were
        # active (closed ones), and since when the active groups are
        self._idle_since: dict[int, float] = {}
        self._active_since: dict[int, float] = {}
        self._periods: list[tuple[tuple[int, ...], float, float]] = []
        self._wakes = 0
        self._sleeps = 0
        for gp in plan.groups:
            for g in self._build(gp):
                self._host(g)
        if (replacement is None) != (replanner is None):
            raise ConfigError("replacement needs both its settings and a replanner")
        self.repl = replacement
        self.replanner = replanner
        self._interval = (
            AdaptiveInterval(
                replacement.initial_interval_s,
                replacement.beta,
                replacement.min_interval_s,
                replacement.max_interval_s,
            )
            if replacement is not None
            else None
        )
        self._m_est = initial_estimate
        self._last_replace = 0.0
        self.replacements: list[dict[str, Any]] = []
        self.migrations: list[MigrationRecord] = []
        self._job_end: dict[tuple[int, int], float] = {}
        self._in_transit: dict[int, Seq] = {}
        self.recomputed_after_move = 0
        self.n_done = 0
        self.timeseries = TimeSeries(config.sample_interval_s)
        self._out: list[Event] = []  # events caused by the handler running now
        burst = config.burst
        kun = burst is not None and burst.pressure == "kunserve"
        self.burst = BurstControl(self, burst) if burst is not None and kun else None
        self.kernel = Kernel(
            self.requests,
            {
                ITER_END: self._ev_job_end,
                REPLACE: self._ev_replace,
                GROUP_READY: self._ev_ready,
                KV_ARRIVED: self._ev_migrated,
                SAMPLE: self._ev_sample,
                IDLE_CHECK: self._ev_idle_check,
                EPOCH: self._ev_monitor,
                TRANSFER: self._ev_link,
            },
            max_time_s=config.max_time_s,
            check=config.check_integrity,
            progress=progress,
            clock=self.clock,
        )
        self._frag: list[float] = []
        self._stranded: list[float] = []
        self._entries: list[int] = []

    def _build(self, gp: GroupPlacement, now: float = 0.0) -> list[SharingGroup]:
        """The replicas of ``gp`` (live; not yet hosts)."""
        svcs = [self.services[s] for s in gp.services]
        kv = group_kv_bytes([s.spec for s in svcs], gp.tp, self.gpu, self.cfg.mem_util)
        if kv <= 0:
            raise ConfigError(
                f"group on GPUs {list(gp.gpus)} (tp {gp.tp}): the weights of "
                f"{', '.join(gp.services)} leave no KV memory on {self.gpu.name}"
            )
        out = []
        for k in range(len(gp.gpus) // gp.tp):
            gpus = tuple(gp.gpus[k * gp.tp : (k + 1) * gp.tp])
            g = self._add_group(gpus, gp.tp, gp.services, kv)
            self._started[g.id] = now
            self._active_since[g.id] = now
            self._key_of[g.id] = _gkey(gp)
            out.append(g)
        self._by_key[_gkey(gp)] = out
        return out

    def _replace_in_plan(self, old: SharingGroup, new: SharingGroup) -> None:
        """``new`` stands for replica ``old`` of its placement group from now on."""
        key = self._key_of.get(old.id)
        if key is None or key not in self._by_key:
            return
        reps = self._by_key[key]
        reps[reps.index(old)] = new
        self._key_of[new.id] = key

    def _host(self, g: SharingGroup) -> None:
        for s in g.models:
            self.hosts[s].append(g)

    def _add_group(
        self,
        gpus: tuple[int, ...],
        tp: int,
        names: Sequence[str],
        kv: int,
        *,
        costs: Mapping[str, JobCost] | None = None,
        macro_steps: bool | None = None,
    ) -> SharingGroup:
        """A new group (any state; not a host yet). ``costs``: job times of
        each service (default: a replica's); ``macro_steps``: the config's."""
        cfg = self.cfg
        specs = {s: self.services[s].spec for s in names}
        layout = make_layout(cfg.layout, kv, specs, cfg.block_size)
        sched: GroupScheduler = BATCHING.get(cfg.scheduler)(**dict(cfg.scheduler_params))
        sched.setup({s: self.stats[s] for s in names}, kv)
        if costs is None:
            costs = {s: self.cost_model.bind(specs[s], self.gpu, tp) for s in names}
        g = SharingGroup(
            len(self.groups),
            gpus,
            tp,
            costs,
            layout,
            sched,
            max_num_seqs=cfg.max_num_seqs,
            max_batched_tokens=cfg.max_batched_tokens,
            macro_steps=cfg.macro_steps if macro_steps is None else macro_steps,
            contention=cfg.contention,
            watermark=cfg.watermark,
            chunked_prefill=cfg.chunked_prefill,
            # the running requests bound to a step counter where the group's
            # scheduler, layout and shape allow it (SharingGroup's ``bound``)
            bound=sched.one_model and not sched.spatial and layout.counts_only,
            clock=self.clock,
        )
        self.groups.append(g)
        self._group_by_id[g.id] = g
        return g

    # ----------------------------------------------------------------- loop
    def run(self) -> RunResult:
        """Run to completion (or ``max_time_s``) and return the results."""
        wall0 = time.perf_counter()
        k = self.kernel
        k.push(self._caused())  # anything set up before the run
        k.push([(0.0, SAMPLE, None)])
        if self.cfg.memory == "elastic":
            for g in self.groups:
                self._idle_since[g.id] = 0.0
                k.push([(self.cfg.keepalive_s, IDLE_CHECK, (g, 0.0))])
        self._last_arrival = self.requests[-1].arrival_s if self.requests else 0.0
        if self._interval is not None and self._interval.interval_s < self._last_arrival:
            k.push([(self._interval.interval_s, REPLACE, None)])
        if self.burst is not None:
            k.push([(self.burst.settings.monitor_interval_s, EPOCH, None)])
        end_s = k.run(self)
        self._sample(end_s)
        if self.progress is not None:
            self.progress(end_s, k.n_events, self.n_done)
        return self._result(end_s, time.perf_counter() - wall0)

    @property
    def n_events(self) -> int:
        """Events handled so far."""
        return self.kernel.n_events

    # ---------------------------------------------------------------- events
    # Handlers collect the events they cause in ``_out`` (helpers deep in a
    # handler add to it) and return them to the kernel.
    def _caused(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _ev_job_end(self, payload: tuple[SharingGroup, int], now: float) -> list[Event] | None:
        g, token = payload
        if g.stale(token):  # re-timed (memory contention): its new end is pending
            self._job_end.pop((g.id, token), None)
            return None
        self._on_job_end(g, token, now)
        return self._caused()

    def _ev_replace(self, payload: None, now: float) -> list[Event]:
        self._on_replace(now, self.kernel.arrived)
        return self._caused()

    def _ev_ready(self, payload: SharingGroup, now: float) -> list[Event]:
        self._on_ready(payload, now)
        return self._caused()

    def _ev_migrated(self, payload: tuple[SharingGroup, Seq, str], now: float) -> list[Event]:
        dst, moved, mode = payload
        self._on_migrated(dst, moved, mode, now)
        return self._caused()

    def _ev_link(self, payload: Any, now: float) -> list[Event]:
        """A transfer on a link ends (a live KV exchange's; sim/multi_burst.py)."""
        assert self.burst is not None
        self.burst.on_link(payload, now)
        return self._caused()

    def _ev_sample(self, payload: None, now: float) -> list[Event]:
        self._sample(now)
        if self._poke(now) or self.kernel.arrivals_left or any(g.jobs for g in self.groups):
            self._out.append((now + self.cfg.sample_interval_s, SAMPLE, None))
        # else: nothing runs, nothing arrives and nothing could start: requests
        # still queued stay unfinished (counted as such)
        return self._caused()

    def _ev_monitor(self, payload: None, now: float) -> list[Event] | None:
        """KunServe's monitor interval (pressure ``kunserve``). Once nothing
        runs, moves, loads or arrives, no decision could change anything: the
        ticks stop (and the last one does not extend the run)."""
        assert self.burst is not None
        if not (
            self.kernel.arrivals_left
            or self.burst.busy
            or self._in_transit
            or any(g.jobs or g.state == "loading" for g in self.groups)
        ):
            return None
        self.burst.tick(now)
        self._out.append((now + self.burst.settings.monitor_interval_s, EPOCH, None))
        return self._caused()

    def _push(self, g: SharingGroup, started: list[tuple[float, int]]) -> None:
        for end, token in started:
            self._job_end[(g.id, token)] = end
            self._out.append((end, ITER_END, (g, token)))

    def on_arrival(self, req: Request, now: float) -> list[Event]:
        """A request arrives: queued at a host of its service (or rejected)."""
        too_long = context_reason(req, self.services[req.model].spec, self.cfg.max_model_len)
        if too_long is not None:
            rec = self.records[req.id]
            rec.status = "rejected"
            rec.reason = too_long
            self.n_done += 1
            return []
        self._dispatch(Seq(req, self.records[req.id]), now)
        return self._caused()

    def _dispatch(self, seq: Seq, now: float, *, head: bool = False) -> None:
        """Queue ``seq`` (no KV) at the host of its service the dispatch policy
        picks among the live hosts (the loading ones when none is live);
        reject it if no host could ever hold it."""
        rec = seq.record
        need = seq.prompt_tokens + seq.output_tokens
        m = seq.model
        hosts = [g for g in self.hosts[m] if g.max_request_tokens(m) >= need]
        if not hosts:
            rec.status = "rejected"
            rec.reason = f"needs {need} KV tokens, more than any group hosting {m} can hold"
            self.n_done += 1
            return
        live = [g for g in hosts if g.state == "live"]
        waking = [g for g in hosts if g.state == "loading"]
        state = ClusterState(block_size=self.cfg.block_size)
        for h in live or waking or hosts:
            state.add(HostView(h, m, now))
        action = self.dispatcher.dispatch(state, self.requests[seq.id], now, self.rng)
        if not isinstance(action, Dispatch):
            raise RuntimeError(f"dispatch among the hosts of {m} returned {action!r}")
        g = self._group_by_id[action.instance_id]
        if g.state == "asleep":
            self._wake(g, now)
        rec.instance = g.id
        self._push(g, g.enqueue(seq, now, head=head))

    def _poke(self, now: float) -> bool:
        """Let idle groups with queued requests try again (a scheduler's state
        may change with time, e.g. ADBS quotas); whether any job started."""
        started = False
        for g in self.groups:
            if g.state == "live" and not g.jobs and any(g.waiting.values()):
                got = g.schedule(now)
                self._push(g, got)
                started = started or bool(got)
        return started

    def _on_job_end(self, g: SharingGroup, token: int, now: float) -> None:
        self._job_end.pop((g.id, token), None)
        done = g.complete(token, now)
        self.n_done += len(done)
        self._push(g, g.schedule(now))
        if g.state == "retiring" and not g.jobs:
            self._retire(g, now)
        elif g.state == "merging" and not g.jobs:
            assert self.burst is not None
            self.burst.drained(g, now)
        elif self.cfg.memory == "elastic" and g.state == "live" and g.idle and not g.incoming:
            self._idle_since[g.id] = now
            self._out.append((now + self.cfg.keepalive_s, IDLE_CHECK, (g, now)))

    # ---------------------------------------------------------- replacement
    def _attainment(self, t0: float, t1: float, arrived: int) -> float | None:
        """SLO attainment of the requests whose deadline is in ``(t0, t1]``."""
        assert self.repl is not None
        met = total = 0
        for rec, ideal in zip(self.records[:arrived], self.ideal.tolist(), strict=False):
            dl = rec.arrival_s + self.repl.slo_scale * ideal
            if t0 < dl <= t1:
                total += 1
                met += rec.finish_s is not None and rec.finish_s <= dl
        return met / total if total else None

    def _on_replace(self, now: float, arrived: int) -> None:
        assert self._interval is not None and self.replanner is not None
        window = self._interval.interval_s
        m_real = self._attainment(self._last_replace, now, arrived)
        m_est = self._m_est
        if m_real is not None and m_est is not None:
            nxt = self._interval.update(m_real, m_est)
        else:
            nxt = window
        lo = now - window
        history = [r for r in self.requests[:arrived] if r.arrival_s > lo]
        entry: dict[str, Any] = {
            "time_s": now,
            "interval_s": window,
            "next_interval_s": nxt,
            "m_real": m_real,
            "m_est": m_est,
            "history_requests": len(history),
        }
        if history:
            plan, est = self.replanner(history, window, now)
            diff = plan_diff(self.plan, plan)
            entry.update(
                groups_kept=len(diff.kept),
                groups_removed=len(diff.removed),
                groups_added=len(diff.added),
                m_est_next=est,
            )
            if not diff.unchanged:
                if self.burst is not None:
                    self.burst.before_switch(now)
                entry.update(self._switch(plan, diff.removed, diff.added, now))
            self._m_est = est
        self.replacements.append(entry)
        self._last_replace = now
        if now + nxt < self._last_arrival:
            self._out.append((now + nxt, REPLACE, None))

    def _switch(
        self,
        plan: PlacementPlan,
        removed: Sequence[GroupPlacement],
        added: Sequence[GroupPlacement],
        now: float,
    ) -> dict[str, Any]:
        """Retire the groups of ``removed``, start loading those of ``added``."""
        plan.check(self.services)
        retiring: list[SharingGroup] = []
        for gp in removed:
            for g in self._by_key.pop(_gkey(gp)):
                g.state = "retiring"
                for m in g.models:
                    self.hosts[m].remove(g)
                self._push(g, g.truncate(now))  # stop after the iteration in flight
                retiring.append(g)
        drain = {
            g.id: max([now] + [self._job_end.get((g.id, t), now) for t in g.jobs]) for g in retiring
        }
        load_s = 0.0
        for gp in added:
            w = sum(self.services[s].spec.weight_bytes for s in gp.services) / gp.tp
            t_load = transfer_time(w, host_link(self.gpu))
            load_s = max(load_s, t_load)
            gpus = set(gp.gpus)
            free_at = max([now] + [drain[g.id] for g in retiring if gpus & set(g.gpus)])
            for g in self._build(gp, now):
                g.state = "loading"
                self._ready_at[g.id] = free_at + t_load
                self._host(g)
                self._out.append((free_at + t_load, GROUP_READY, g))
        self.plan = plan
        requeued = 0
        for g in retiring:
            for seq in g.take_waiting():
                requeued += 1
                self._dispatch(seq, now)
            if not g.jobs:
                self._retire(g, now)
        return {
            "drain_s": max(drain.values(), default=now) - now,
            "load_s": load_s,
            "requeued": requeued,
        }

    def _retire(self, g: SharingGroup, now: float) -> None:
        """A retiring group with no job in flight: move its running requests to
        hosts of the new plan; the group stops.

        Each request goes to the host of its service with the fewest requests
        (counting those on their way). The migration mechanism then picks each
        move's mode: ``kv`` copies the request's KV (the copies leave one after
        another over the source's link), ``token`` sends its token ids and the
        destination re-prefills them (Mell §V's two bins; ``adaptive`` packs
        the moves into one epoch's link and compute boundaries). A move the
        mechanism would postpone to a later epoch cannot wait here (its source
        stops), so it goes as a KV copy, the world's move before it read the
        mechanism family: an implementer's choice.
        """
        g.state = "stopped"
        self._stopped[g.id] = now
        self._release(g, now)
        for seq in g.take_waiting():  # partly prefilled prompts: prefilled again elsewhere
            self._dispatch(seq, now)
        plan: list[tuple[Seq, SharingGroup, PendingMove]] = []
        for seq in g.take_running():
            m = seq.model
            dst = min(
                self.hosts[m],
                key=lambda h: (h.outstanding(m) + h.incoming, h.state != "live", h.id),
            )
            if dst.state == "asleep":
                self._wake(dst, now)
            dst.incoming += 1
            nbytes = seq.kv_tokens * self.services[m].spec.kv_bytes_per_token
            move = PendingMove(
                seq.id, g.id, dst.id, tuple(g.gpus), tuple(dst.gpus), nbytes, seq.kv_tokens
            )
            plan.append((seq, dst, move))
        modes = {
            mv.request_id: mode
            for mv, mode in self.mechanism.assign([p[2] for p in plan], self._mech_context())
        }
        clock = now
        node = self.gpu.gpus_per_node
        for seq, dst, move in plan:
            mode = modes.get(seq.id, "kv")
            link = (
                intra_node_link(self.gpu)
                if g.gpus[0] // node == dst.gpus[0] // node
                else network_link(self.gpu)
            )
            nbytes = move.kv_bytes if mode == "kv" else TOKEN_ID_BYTES * move.tokens
            clock += transfer_time(nbytes / min(g.tp, dst.tp), link)
            arrive = max(clock, self._ready_at.get(dst.id, now))
            self._in_transit[seq.id] = seq
            seq.record.migrations += 1
            self.migrations.append(MigrationRecord(now, seq.id, g.id, dst.id, mode, int(nbytes)))
            self._out.append((arrive, KV_ARRIVED, (dst, seq, mode)))

    # ---------------------------------------------------------- elastic memory
    def _ev_idle_check(self, payload: tuple[SharingGroup, float], now: float) -> list[Event] | None:
        g, since = payload
        if self._idle_since.get(g.id) != since:
            return None  # it got work (and perhaps went idle again) since
        if g.state != "live" or not g.idle or g.incoming:
            return None
        if self.burst is not None and self.burst.is_pipeline(g):
            return None  # a pipelined group is restored, not put to sleep
        if not self.kernel.arrivals_left and all(
            h.idle and not h.incoming for h in self.groups if h.state != "stopped"
        ):
            return None  # the run is over: its end is the last request's, not this check's
        self._sleep(g, now)
        return self._caused()

    def _sleep(self, g: SharingGroup, now: float) -> None:
        """An idle live group releases its GPUs (its weights are dropped); it
        stays a host of its services, to be woken by :meth:`_wake`."""
        del self._idle_since[g.id]
        g.state = "asleep"
        self._sleeps += 1
        self._release(g, now)

    def _wake(self, g: SharingGroup, now: float) -> None:
        """An asleep group takes its GPUs back and reloads its weights from host
        memory (as a re-placement loads a new group); it serves when they are in."""
        w = sum(self.services[s].spec.weight_bytes for s in g.models) / g.tp
        ready = now + transfer_time(w, host_link(self.gpu))
        g.state = "loading"
        self._ready_at[g.id] = ready
        self._active_since[g.id] = now
        self._wakes += 1
        self._out.append((ready, GROUP_READY, g))

    def _release(self, g: SharingGroup, now: float) -> None:
        """Close the group's active period (if it has one)."""
        since = self._active_since.pop(g.id, None)
        if since is not None:
            self._periods.append((tuple(g.gpus), since, now))

    def _gpus_active(self) -> int:
        """GPUs in use now: the plan's (static), or those of the groups that
        hold their GPUs (elastic: live, waking or retiring)."""
        if self.cfg.memory == "static":
            return self.plan.gpus_used
        by_id = self._group_by_id
        return len({gpu for gid in self._active_since for gpu in by_id[gid].gpus})

    def _gpu_intervals(self, end_s: float) -> list[GpuInterval]:
        """When each GPU was active. Static: every GPU of the final plan for the
        whole run. Elastic: the union, per GPU, of its groups' active periods
        (an old group retiring and a new one loading on the same GPU overlap)."""
        if self.cfg.memory == "static":
            return [GpuInterval(gpu, 0.0, end_s) for gp in self.plan.groups for gpu in gp.gpus]
        periods = list(self._periods)
        for gid, since in self._active_since.items():
            periods.append((tuple(self._group_by_id[gid].gpus), since, end_s))
        per_gpu: dict[int, list[tuple[float, float]]] = {}
        for gpus, t0, t1 in periods:
            for gpu in gpus:
                per_gpu.setdefault(gpu, []).append((t0, t1))
        out: list[GpuInterval] = []
        for gpu in sorted(per_gpu):
            spans = sorted(per_gpu[gpu])
            cur0, cur1 = spans[0]
            for t0, t1 in spans[1:]:
                if t0 <= cur1:
                    cur1 = max(cur1, t1)
                else:
                    out.append(GpuInterval(gpu, cur0, cur1))
                    cur0, cur1 = t0, t1
            out.append(GpuInterval(gpu, cur0, cur1))
        return out

    def _busy_fraction(self, g: SharingGroup, end_s: float) -> float | None:
        """Share of the group's life (start to stop, or to the run's end) with
        a job in flight; None for a group that never lived."""
        life = (self._stopped.get(g.id, end_s)) - self._started.get(g.id, 0.0)
        return g.busy_s / life if life > 0 else None

    def _mech_context(self) -> MechanismContext:
        """One epoch's boundaries (Mell §V) for the moves of a re-placement:
        bytes per link and re-prefill tokens per destination group."""
        c = self.cfg
        per: dict[int, int] = {}
        for h in self.groups:
            if h.state in ("live", "loading"):
                budget = c.compute_share * c.epoch_s
                per[h.id] = min(h.costs[m].re_prefill_tokens(budget) for m in h.models)
        return MechanismContext(
            gpus_per_node=self.gpu.gpus_per_node,
            intra_node_bytes=int(c.link_share * c.epoch_s * self.gpu.intra_node_bw),
            inter_node_bytes=int(c.link_share * c.epoch_s * self.gpu.network_bw),
            compute_tokens=per,
        )

    def _on_ready(self, g: SharingGroup, now: float) -> None:
        if g.state != "loading":
            return  # retired again before its weights arrived
        g.state = "live"
        self._push(g, g.schedule(now))
        if self.cfg.memory == "elastic" and g.idle and not g.incoming and not g.jobs:
            self._idle_since[g.id] = now
            self._out.append((now + self.cfg.keepalive_s, IDLE_CHECK, (g, now)))

    def _on_migrated(self, g: SharingGroup, seq: Seq, mode: str, now: float) -> None:
        del self._in_transit[seq.id]
        g.incoming -= 1
        if mode == "token":
            # token ids arrived: the destination re-prefills them (a migration
            # by recomputation, not a preemption)
            seq.kv_saved = 0
            if g.state == "live":
                seq.record.instance = g.id
                self._push(g, g.enqueue(seq, now, head=True))
            else:
                self._dispatch(seq, now, head=True)
            return
        if g.state == "live" and g.adopt(seq, now):
            seq.record.instance = g.id
            self._push(g, g.truncate(now) + g.schedule(now))
            return
        # no room for its KV (or its destination went away): recompute it
        self.recomputed_after_move += 1
        seq.kv_saved = 0
        seq.record.preemptions += 1
        self._dispatch(seq, now, head=True)

    def _sample(self, now: float) -> None:
        used = cap = demand = queued = running = 0
        frag_num = frag_den = 0.0
        stranded = 0
        entries = 0
        for g in self.groups:
            if g.state == "merged":
                continue  # its memory is its pipelined group's now
            st = g.layout_stats(now)  # as of now: a macro job's blocks ahead not counted
            used += st.used_bytes
            cap += st.capacity_bytes
            q = sum(len(w) for w in g.waiting.values())
            queued += q
            running += sum(len(r) for r in g.running.values())
            demand += st.used_bytes + sum(
                (s.prompt_tokens + s.generated) * self.services[s.model].spec.kv_bytes_per_token
                for w in g.waiting.values()
                for s in w
            )
            frag_num += st.internal_frag * st.used_bytes
            frag_den += st.used_bytes
            stranded += st.stranded_bytes
            entries += st.table_entries
        self.timeseries.append(now, self._gpus_active(), used, cap, demand, queued, running)
        if frag_den > 0:
            self._frag.append(frag_num / frag_den)
        self._stranded.append(float(stranded))
        self._entries.append(entries)

    # -------------------------------------------------------------- results
    def _result(self, end_s: float, wall_s: float) -> RunResult:
        for rec, t in zip(self.records, self.ideal.tolist(), strict=True):
            rec.ideal_s = t
        for g in self.groups:
            for m in g.models:
                for s in (*g.waiting[m], *g.running[m].values()):
                    s.record.generated = s.generated
        intervals = self._gpu_intervals(end_s)
        cfg: dict[str, Any] = {
            "multi": {
                "gpu": self.cfg.gpu,
                "n_gpus": self.cfg.n_gpus,
                "scheduler": self.cfg.scheduler,
                "scheduler_params": dict(self.cfg.scheduler_params),
                "layout": self.cfg.layout,
                "block_size": self.cfg.block_size,
                "mem_util": self.cfg.mem_util,
                "max_num_seqs": self.cfg.max_num_seqs,
                "max_batched_tokens": self.cfg.max_batched_tokens,
            },
            "services": {
                s.name: {"model": s.spec.name, "rate": s.rate} for s in self.services.values()
            },
            "placement": {
                "note": self.initial_plan.note,
                "groups": [
                    {"gpus": list(gp.gpus), "tp": gp.tp, "services": list(gp.services)}
                    for gp in self.initial_plan.groups
                ],
            },
        }
        extra = {
            "kv_layout": {
                "layout": self.cfg.layout,
                "internal_fragmentation_mean": float(np.mean(self._frag)) if self._frag else None,
                "stranded_bytes_mean": float(np.mean(self._stranded)) if self._stranded else None,
                "block_table_entries_mean": float(np.mean(self._entries))
                if self._entries
                else None,
                "block_table_entries_peak": int(max(self._entries)) if self._entries else None,
            },
            "groups": [
                {
                    "id": g.id,
                    "gpus": list(g.gpus),
                    "tp": g.tp,
                    "services": list(g.models),
                    "busy_fraction": self._busy_fraction(g, end_s),
                    "preemptions": g.preemptions,
                    "start_s": self._started.get(g.id, 0.0),
                    "stop_s": self._stopped.get(g.id),
                }
                for g in self.groups
            ],
        }
        if self.cfg.memory == "elastic":
            extra["elastic"] = {
                "keepalive_s": self.cfg.keepalive_s,
                "wakes": self._wakes,
                "sleeps": self._sleeps,
            }
        if self.burst is not None:
            extra["kunserve"] = self.burst.summary()
        if self._interval is not None:
            assert self.repl is not None
            extra["replacement"] = {
                "initial_interval_s": self.repl.initial_interval_s,
                "beta": self.repl.beta,
                "replacements": len(self.replacements),
                "switches": sum(1 for e in self.replacements if "load_s" in e),
                "migrated_requests": len(self.migrations),
                "recomputed_after_move": self.recomputed_after_move,
                "events": self.replacements,
            }
        return RunResult(
            records=self.records,
            timeseries=self.timeseries,
            gpu_intervals=intervals,
            migrations=self.migrations,
            end_s=end_s,
            kv_bytes_per_gpu=None,
            config=cfg,
            sim_wall_s=wall_s,
            sim_events=self.n_events,
            notes=[n for n in (context_note(self.records),) if n is not None],
            extra=extra,
        )

    # ------------------------------------------------------------ integrity
    def check_integrity(self, arrived: int) -> None:
        """Every group's accounting; every arrived request in exactly one place
        or in a terminal state."""
        seen: set[int] = set()
        for g in self.groups:
            g.check_integrity()
            ids = g.request_ids()
            for i in ids:
                assert i not in seen, f"request {i} in two places"
                seen.add(i)
            if g.state in ("stopped", "merged"):
                assert not ids and g.layout.stats().used_bytes == 0, f"group {g.id} not empty"
        for i in self._in_transit:
            assert i not in seen, f"request {i} in transit and in a group"
            seen.add(i)
        for rec in self.records[:arrived]:
            terminal = rec.status in ("finished", "rejected")
            assert (rec.id in seen) != terminal, f"request {rec.id}: {rec.status}"
