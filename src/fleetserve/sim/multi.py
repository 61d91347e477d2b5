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

Every group of ``len(gpus) // tp`` replicas runs as its own
:class:`~fleetserve.sim.group.SharingGroup`. Each request's ``ideal_s`` (the
denominator of normalized latency and SLO scales) is its execution time alone
on the smallest power-of-two number of GPUs its model fits on, so it does not
depend on the placement under test.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetserve.costmodel import CostModel, InstanceCost
from fleetserve.errors import ConfigError
from fleetserve.metrics.records import GpuInterval, RequestRecord, RunResult, TimeSeries
from fleetserve.policy.groups import PlacementPlan, Service
from fleetserve.policy.sharing import GROUP_BATCHING, GroupScheduler, ServiceStats
from fleetserve.sim.events import P_ARRIVAL, P_ITER_END, P_SAMPLE, EventQueue
from fleetserve.sim.group import GSeq, SharingGroup
from fleetserve.sim.kvlayout import make_layout
from fleetserve.spec import get_gpu
from fleetserve.spec.memory import group_kv_bytes, min_tp
from fleetserve.spec.types import GpuSpec
from fleetserve.workload.request import Request

logger = logging.getLogger(__name__)

_JOB_END, _SAMPLE = 0, 1
ProgressFn = Callable[[float, int, int], None]


@dataclass(frozen=True, slots=True)
class MultiConfig:
    """How a multi-LLM simulation runs (placement given separately).

    Attributes:
        gpu: GPU catalog name.
        n_gpus: GPUs in the pool.
        scheduler: group scheduler name (``fcfs``, ``rr``, ``mlfq``, ``db``, ``adbs``).
        scheduler_params: keyword arguments of the scheduler.
        layout: KV layout (``headwise``, ``merged``, ``partitioned``).
        block_size: tokens per KV block.
        mem_util: share of each GPU's memory the engines may use.
        max_num_seqs: running requests per service and group at most.
        max_batched_tokens: prompt tokens per prefill job.
        sample_interval_s: time-series sampling period.
        max_time_s: stop at this simulated time (None: run to completion).
        check_integrity: check every group after every event (tests).
        macro_steps: advance lone decode batches several iterations at once
            (same results; see ``SharingGroup._macro_steps``).
    """

    gpu: str = "a100-80gb"
    n_gpus: int = 8
    scheduler: str = "fcfs"
    scheduler_params: Mapping[str, Any] = field(default_factory=dict)
    layout: str = "headwise"
    block_size: int = 16
    mem_util: float = 0.9
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    sample_interval_s: float = 1.0
    max_time_s: float | None = None
    check_integrity: bool = False
    macro_steps: bool = True

    def __post_init__(self) -> None:
        if self.n_gpus < 1 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ConfigError("n_gpus, block_size and max_num_seqs must be >= 1")
        if not 0 < self.mem_util <= 1:
            raise ConfigError(f"mem_util must be in (0, 1], got {self.mem_util}")
        if self.sample_interval_s <= 0:
            raise ConfigError("sample_interval_s must be > 0")


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
    ) -> None:
        self.cfg = config
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
        self.gpu = get_gpu(config.gpu)
        self.cost_model = cost_model or CostModel()
        computed, self.ideal = service_stats(
            self.services, self.requests, self.gpu, self.cost_model
        )
        self.stats = dict(stats) if stats is not None else computed
        GROUP_BATCHING.get(config.scheduler)  # a clear error for unknown names
        self.progress = progress
        self.events = EventQueue()
        self.records = [
            RequestRecord(r.id, r.model, r.arrival_s, r.prompt_tokens, r.output_tokens)
            for r in self.requests
        ]
        self.groups: list[SharingGroup] = []
        self.hosts: dict[str, list[SharingGroup]] = {s: [] for s in self.services}
        for gp in plan.groups:
            svcs = [self.services[s] for s in gp.services]
            kv = group_kv_bytes([s.spec for s in svcs], gp.tp, self.gpu, config.mem_util)
            if kv <= 0:
                raise ConfigError(
                    f"group on GPUs {list(gp.gpus)} (tp {gp.tp}): the weights of "
                    f"{', '.join(gp.services)} leave no KV memory on {self.gpu.name}"
                )
            for k in range(len(gp.gpus) // gp.tp):
                gpus = tuple(gp.gpus[k * gp.tp : (k + 1) * gp.tp])
                self._add_group(gpus, gp.tp, gp.services, kv)
        self.n_events = 0
        self.n_done = 0
        self.timeseries = TimeSeries(config.sample_interval_s)
        self._frag: list[float] = []
        self._stranded: list[float] = []
        self._entries: list[int] = []

    def _add_group(self, gpus: tuple[int, ...], tp: int, names: Sequence[str], kv: int) -> None:
        cfg = self.cfg
        specs = {s: self.services[s].spec for s in names}
        layout = make_layout(cfg.layout, kv, specs, cfg.block_size)
        sched: GroupScheduler = GROUP_BATCHING.get(cfg.scheduler)(**dict(cfg.scheduler_params))
        sched.setup({s: self.stats[s] for s in names}, kv)
        costs: dict[str, InstanceCost] = {
            s: self.cost_model.bind(specs[s], self.gpu, tp) for s in names
        }
        g = SharingGroup(
            len(self.groups),
            gpus,
            tp,
            costs,
            layout,
            sched,
            max_num_seqs=cfg.max_num_seqs,
            max_batched_tokens=cfg.max_batched_tokens,
            macro_steps=cfg.macro_steps,
        )
        self.groups.append(g)
        for s in names:
            self.hosts[s].append(g)

    # ----------------------------------------------------------------- loop
    def run(self) -> RunResult:
        """Run to completion (or ``max_time_s``) and return the results."""
        wall0 = time.perf_counter()
        reqs = self.requests
        n = len(reqs)
        ev = self.events
        heap = ev.heap
        max_t = self.cfg.max_time_s if self.cfg.max_time_s is not None else math.inf
        ai = 0
        end_s = 0.0
        ev.push(0.0, P_SAMPLE, _SAMPLE, None)
        while True:
            ta = reqs[ai].arrival_s if ai < n else math.inf
            if heap and (heap[0][0] < ta or (heap[0][0] == ta and heap[0][1] < P_ARRIVAL)):
                if heap[0][0] > max_t:
                    break
                t, _p, _s, kind, payload = ev.pop()
                if kind == _JOB_END:
                    g, token = payload
                    self._on_job_end(g, token, t)
                else:
                    self._sample(t)
                    if self._poke(t) or ai < n or any(g.jobs for g in self.groups):
                        ev.push(t + self.cfg.sample_interval_s, P_SAMPLE, _SAMPLE, None)
                    # else: nothing runs, nothing arrives and nothing could start:
                    # requests still queued stay unfinished (counted as such)
            elif ai < n:
                if ta > max_t:
                    break
                t = ta
                self._on_arrival(reqs[ai], t)
                ai += 1
            else:
                break
            end_s = t
            self.n_events += 1
            if self.cfg.check_integrity:
                self.check_integrity(ai)
            if self.progress is not None and self.n_events % 4096 == 0:
                self.progress(t, self.n_events, self.n_done)
        if self.cfg.max_time_s is not None and (heap or ai < n):
            end_s = max(end_s, self.cfg.max_time_s)
        self._sample(end_s)
        if self.progress is not None:
            self.progress(end_s, self.n_events, self.n_done)
        return self._result(end_s, time.perf_counter() - wall0)

    def _push(self, g: SharingGroup, started: list[tuple[float, int]]) -> None:
        for end, token in started:
            self.events.push(end, P_ITER_END, _JOB_END, (g, token))

    def _on_arrival(self, req: Request, now: float) -> None:
        rec = self.records[req.id]
        need = req.prompt_tokens + req.output_tokens
        hosts = [g for g in self.hosts[req.model] if g.layout.max_tokens(req.model) >= need]
        if not hosts:
            rec.status = "rejected"
            rec.reason = f"needs {need} KV tokens, more than any group hosting {req.model} can hold"
            self.n_done += 1
            return
        g = min(hosts, key=lambda h: (h.outstanding(req.model), h.id))
        seq = GSeq(req, rec)
        rec.instance = g.id
        self._push(g, g.enqueue(seq, now))

    def _poke(self, now: float) -> bool:
        """Let idle groups with queued requests try again (a scheduler's state
        may change with time, e.g. ADBS quotas); whether any job started."""
        started = False
        for g in self.groups:
            if not g.jobs and any(g.waiting.values()):
                got = g.schedule(now)
                self._push(g, got)
                started = started or bool(got)
        return started

    def _on_job_end(self, g: SharingGroup, token: int, now: float) -> None:
        done = g.complete(token, now)
        self.n_done += len(done)
        self._push(g, g.schedule(now))

    def _sample(self, now: float) -> None:
        used = cap = demand = queued = running = 0
        frag_num = frag_den = 0.0
        stranded = 0
        entries = 0
        for g in self.groups:
            st = g.layout.stats()
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
        self.timeseries.append(now, self.plan.gpus_used, used, cap, demand, queued, running)
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
        intervals = [GpuInterval(gpu, 0.0, end_s) for gp in self.plan.groups for gpu in gp.gpus]
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
                "note": self.plan.note,
                "groups": [
                    {"gpus": list(gp.gpus), "tp": gp.tp, "services": list(gp.services)}
                    for gp in self.plan.groups
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
                    "busy_fraction": (g.busy_s / end_s) if end_s > 0 else None,
                    "preemptions": g.preemptions,
                }
                for g in self.groups
            ],
        }
        return RunResult(
            records=self.records,
            timeseries=self.timeseries,
            gpu_intervals=intervals,
            migrations=[],
            end_s=end_s,
            kv_bytes_per_gpu=None,
            config=cfg,
            sim_wall_s=wall_s,
            sim_events=self.n_events,
            extra=extra,
        )

    # ------------------------------------------------------------ integrity
    def check_integrity(self, arrived: int) -> None:
        """Every group's accounting; every arrived request in exactly one place
        or in a terminal state."""
        seen: set[int] = set()
        for g in self.groups:
            g.check_integrity()
            ids = [s.id for m in g.models for s in (*g.waiting[m], *g.running[m].values())]
            ids += [s.id for job, ss, _, _ in g.jobs.values() if job.phase == "prefill" for s in ss]
            for i in ids:
                assert i not in seen, f"request {i} in two places"
                seen.add(i)
        for rec in self.records[:arrived]:
            terminal = rec.status in ("finished", "rejected")
            assert (rec.id in seen) != terminal, f"request {rec.id}: {rec.status}"
