"""Discrete-event simulation of a GPU fleet serving LLM requests.

One :class:`Simulator` is one run: its own clock, event queue, RNG, instance
ids and records, so two simulations in one process never interfere.
Arrivals are merged from the (sorted) workload instead of being pushed on the
heap; their place in the event order (after iteration ends, before timers and
samples at equal times) is set by the priorities in :mod:`fleetserve.sim.events`.

What the simulator does, and what the policies decide::

    arrival ──► checks the request can ever fit one instance (else rejected)
            ──► dispatch policy: Dispatch | ActivateGpu | Reject
    iteration end ──► instance completes it, records tokens, plans the next
                      one (its batching policy admits / picks victims)
                  ──► idle instance: memory policy may ReleaseGpu
    sample ──► time series (every ``sample_interval_s``)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fleetserve.cluster.state import ClusterState, blocks_for
from fleetserve.config import SimConfig
from fleetserve.costmodel import CostModel, InstanceCost
from fleetserve.errors import ConfigError
from fleetserve.metrics.records import RequestRecord, RunResult, TimeSeries
from fleetserve.policy import (
    BATCHING,
    DISPATCH,
    MEMORY,
    MIGRATION,
    PLACEMENT,
    ActivateGpu,
    Dispatch,
    Reject,
    ReleaseGpu,
    get_stack,
)
from fleetserve.policy.base import BatchingPolicy
from fleetserve.sim.events import (
    ITER_END,
    P_ARRIVAL,
    P_ITER_END,
    P_SAMPLE,
    SAMPLE,
    Event,
    EventQueue,
)
from fleetserve.sim.instance import Instance, Seq, SimClock
from fleetserve.sim.pool import GpuPool
from fleetserve.spec import ModelSpec, get_gpu, get_model
from fleetserve.spec.memory import kv_capacity_blocks
from fleetserve.workload.request import Request

logger = logging.getLogger(__name__)

ProgressFn = Callable[[float, int, int], None]
"""Called as ``progress(sim_time_s, events, requests_done)``."""


def resolve_policies(config: SimConfig) -> dict[str, str]:
    """The policy name of every family (stack choices, then per-family overrides),
    each checked against its registry.

    Raises:
        UnknownNameError: an unknown stack or policy name (with suggestions).
        ConfigError: a policy the simulator cannot run yet.
    """
    pol = config.policy
    stack = get_stack(pol.stack)
    names = {
        "stack": stack.name,
        "dispatch": pol.dispatch or stack.dispatch,
        "batching": pol.batching or stack.batching,
        "migration": pol.migration or stack.migration,
        "placement": pol.placement or stack.placement,
        "memory": pol.memory or stack.memory or ("elastic" if config.cluster.elastic else "static"),
    }
    for fam, registry in (
        ("dispatch", DISPATCH),
        ("batching", BATCHING),
        ("migration", MIGRATION),
        ("placement", PLACEMENT),
        ("memory", MEMORY),
    ):
        registry.get(names[fam])
    if names["migration"] != "none":
        raise ConfigError(
            f"migration policy {names['migration']!r} is not available in the simulator yet"
        )
    return names


def preflight(config: SimConfig) -> None:
    """Check names and that every configured model fits, before any work is done.

    Raises:
        FleetserveError: the first problem found, as one clear line.
    """
    resolve_policies(config)
    gpu = get_gpu(config.cluster.gpu)
    cl = config.cluster
    for m in {config.model, *(config.workload.models or ())}:
        kv_capacity_blocks(get_model(m), gpu, cl.tp, cl.mem_util, cl.block_size)


class Simulator:
    """Simulates ``requests`` under ``config``.

    Args:
        config: the resolved run configuration.
        requests: the workload, sorted by arrival, ids ``0..n-1``.
        cost: cost model (default: analytic roofline with default efficiencies).
        notes: remarks to carry into the results (e.g. length caps).
        progress: optional callback, called every ``progress_every`` events.
        progress_every: events between progress callbacks.

    Raises:
        ConfigError: when a model does not fit on the configured GPUs, or a
            fixed pool cannot hold the placement — before anything runs.
    """

    def __init__(
        self,
        config: SimConfig,
        requests: Sequence[Request],
        *,
        cost: CostModel | None = None,
        notes: Sequence[str] = (),
        progress: ProgressFn | None = None,
        progress_every: int = 4096,
    ) -> None:
        self.cfg = config
        self.requests = list(requests)
        for i, r in enumerate(self.requests):
            if r.id != i:
                raise ConfigError(f"request ids must be 0..n-1 in order; position {i} has {r.id}")
            if i and r.arrival_s < self.requests[i - 1].arrival_s:
                raise ConfigError(f"requests must be sorted by arrival; request {i} is not")
        self.notes = list(notes)
        self.progress = progress
        self.progress_every = progress_every
        self.clock = SimClock()
        self.rng = np.random.default_rng(config.seed)
        self.events = EventQueue()
        self.cost_model = cost or CostModel()

        cl = config.cluster
        self.gpu = get_gpu(cl.gpu)
        self.policy_names = resolve_policies(config)
        self.dispatcher = DISPATCH.get(self.policy_names["dispatch"])()
        self.batching_cls: type[BatchingPolicy] = BATCHING.get(self.policy_names["batching"])
        self.memory = MEMORY.get(self.policy_names["memory"])()

        # Models, their instances' KV capacity, and the per-request feasibility limit.
        names = sorted({r.model for r in self.requests} or {config.model})
        self.specs: dict[str, ModelSpec] = {m: get_model(m) for m in names}
        self.costs: dict[str, InstanceCost] = {}
        self.blocks: dict[str, int] = {}
        self.max_req_blocks: dict[str, int] = {}
        for m, spec in self.specs.items():
            self.blocks[m] = kv_capacity_blocks(spec, self.gpu, cl.tp, cl.mem_util, cl.block_size)
            wm = int(config.engine.watermark * self.blocks[m])
            self.max_req_blocks[m] = self.blocks[m] - wm
            if self.max_req_blocks[m] < 1:
                raise ConfigError(f"model {m} leaves no KV space on {cl.tp} x {cl.gpu}")
            self.costs[m] = self.cost_model.bind(spec, self.gpu, cl.tp)

        limit = cl.max_gpus if cl.elastic else (cl.gpus or 0)
        self.pool = GpuPool(limit, self.gpu.gpus_per_node)
        self.state = ClusterState(
            gpus_limit=limit, elastic=cl.elastic, model_tp=dict.fromkeys(names, cl.tp)
        )
        self.instances: dict[int, Instance] = {}
        self._next_iid = 0
        self.records = [
            RequestRecord(r.id, r.model, r.arrival_s, r.prompt_tokens, r.output_tokens)
            for r in self.requests
        ]
        self.n_events = 0
        self.n_done = 0
        self.timeseries = TimeSeries(config.sample_interval_s)
        if not cl.elastic:
            self._place_fixed(cl.gpus or 0)

    # ---------------------------------------------------------------- setup
    def _place_fixed(self, n_gpus: int) -> None:
        tp = self.cfg.cluster.tp
        if n_gpus < tp:
            raise ConfigError(f"a fixed pool of {n_gpus} GPUs cannot hold one tp={tp} instance")
        span = (self.requests[-1].arrival_s - self.requests[0].arrival_s) if self.requests else 0
        counts: dict[str, int] = dict.fromkeys(self.specs, 0)
        for r in self.requests:
            counts[r.model] += 1
        rates = {m: c / span if span > 0 else float(c) for m, c in counts.items()}
        placement = PLACEMENT.get(self.policy_names["placement"])()
        for m in placement.place(rates, n_gpus, dict(self.state.model_tp)):
            self._start_instance(m, 0.0)

    def _start_instance(self, model: str, now: float) -> Instance:
        cl = self.cfg.cluster
        eng = self.cfg.engine
        gpus = self.pool.allocate(cl.tp, now)
        inst = Instance(
            self._next_iid,
            model,
            gpus,
            cl.tp,
            self.blocks[model],
            cl.block_size,
            self.costs[model],
            self.batching_cls(),
            self.clock,
            max_num_seqs=eng.max_num_seqs,
            max_batched_tokens=eng.max_batched_tokens,
            watermark=eng.watermark,
            macro_steps=self.cfg.macro_steps,
            chunked_prefill=eng.chunked_prefill,
        )
        self._next_iid += 1
        self.instances[inst.id] = inst
        self.state.add(inst)
        return inst

    # ----------------------------------------------------------------- loop
    def run(self) -> RunResult:
        """Run to completion (or ``max_time_s``) and return the results."""
        wall0 = time.perf_counter()
        reqs = self.requests
        n = len(reqs)
        ev = self.events
        heap = ev.heap  # peeked at only
        clock = self.clock
        max_t = self.cfg.max_time_s if self.cfg.max_time_s is not None else float("inf")
        check = self.cfg.check_integrity
        progress, every = self.progress, self.progress_every
        ai = 0
        ev.push(0.0, P_SAMPLE, SAMPLE, None)
        inf = float("inf")
        end_s = 0.0
        while True:
            ta = reqs[ai].arrival_s if ai < n else inf
            if heap and (heap[0][0] < ta or (heap[0][0] == ta and heap[0][1] < P_ARRIVAL)):
                t = heap[0][0]
                if t > max_t:
                    break
                t, _prio, _seq, kind, payload = ev.pop()
                clock.now = t
                if kind == ITER_END:
                    inst, version = payload
                    if inst.version != version or inst.id not in self.instances:
                        continue  # superseded by a truncation
                    caused = self._on_iteration_end(inst, t)
                else:
                    caused = self._on_sample(t, ai < n)
            elif ai < n:
                if ta > max_t:
                    break
                clock.now = t = ta
                caused = self._on_arrival(reqs[ai], t)
                ai += 1
            else:
                break
            for e in caused:
                ev.push(*e)
            end_s = t
            self.n_events += 1
            if check:
                self.check_integrity(ai)
            if progress is not None and self.n_events % every == 0:
                progress(t, self.n_events, self.n_done)
        if self.cfg.max_time_s is not None and (heap or ai < n):
            end_s = max(end_s, self.cfg.max_time_s)
        clock.now = end_s
        self._sample(end_s)
        if progress is not None:
            progress(end_s, self.n_events, self.n_done)
        return self._result(end_s, time.perf_counter() - wall0)

    # ------------------------------------------------------------- handlers
    def _on_arrival(self, req: Request, now: float) -> list[Event]:
        rec = self.records[req.id]
        need = blocks_for(req.max_kv_tokens, self.cfg.cluster.block_size)
        if need > self.max_req_blocks[req.model]:
            bs = self.cfg.cluster.block_size
            self._reject(
                rec,
                f"needs {req.max_kv_tokens} KV tokens, more than one instance holds "
                f"({self.max_req_blocks[req.model] * bs})",
            )
            return []
        action = self.dispatcher.dispatch(self.state, req, now, self.rng)
        if isinstance(action, Reject):
            self._reject(rec, action.reason)
            return []
        if isinstance(action, ActivateGpu):
            if action.model != req.model or action.request_id != req.id:
                raise RuntimeError(f"dispatch returned {action} for request {req.id}")
            inst = self._start_instance(req.model, now)
        elif isinstance(action, Dispatch):
            inst = self.instances[action.instance_id]
            if inst.model != req.model:
                raise RuntimeError(f"dispatched a {req.model} request to a {inst.model} instance")
        else:  # pragma: no cover - the type admits nothing else
            raise RuntimeError(f"unexpected dispatch action {action!r}")
        rec.instance = inst.id
        end = inst.enqueue(Seq(req, rec), now)
        return [] if end is None else [(end, P_ITER_END, ITER_END, (inst, inst.version))]

    def _reject(self, rec: RequestRecord, reason: str) -> None:
        rec.status = "rejected"
        rec.reason = reason
        self.n_done += 1

    def _on_iteration_end(self, inst: Instance, now: float) -> list[Event]:
        done = inst.complete(now)
        self.n_done += len(done)
        end = inst.schedule(now)
        if end is not None:
            return [(end, P_ITER_END, ITER_END, (inst, inst.version))]
        if inst.idle:
            for action in self.memory.on_idle(self.state, inst, now):
                self._apply_release(action, now)
        return []

    def _apply_release(self, action: ReleaseGpu, now: float) -> None:
        inst = self.instances[action.instance_id]
        if not inst.idle:
            raise RuntimeError(f"memory policy released busy instance {inst.id}")
        del self.instances[inst.id]
        self.state.remove(inst.id)
        self.pool.release(inst.gpus, now)

    def _on_sample(self, now: float, arrivals_left: bool) -> list[Event]:
        self._sample(now)
        if arrivals_left or any(not i.idle for i in self.instances.values()):
            return [(now + self.cfg.sample_interval_s, P_SAMPLE, SAMPLE, None)]
        return []

    def _sample(self, now: float) -> None:
        used = cap = demand = queued = running = 0
        bs = self.cfg.cluster.block_size
        for inst in self.instances.values():
            bb = self.specs[inst.model].kv_bytes_per_token * bs
            u = inst.used_blocks
            used += u * bb
            cap += inst.total_blocks * bb
            demand += (u + inst.reserved_blocks) * bb
            queued += len(inst.waiting)
            running += len(inst.running) + len(inst.prefilling())
        self.timeseries.append(now, self.pool.active, used, cap, demand, queued, running)

    # -------------------------------------------------------------- results
    def _result(self, end_s: float, wall_s: float) -> RunResult:
        for m, c in self.costs.items():
            idx = [r.id for r in self.requests if r.model == m]
            if not idx:
                continue
            p = np.array([self.requests[i].prompt_tokens for i in idx], dtype=np.float64)
            o = np.array([self.requests[i].output_tokens for i in idx], dtype=np.float64)
            for i, t in zip(idx, c.ideal_times(p, o).tolist(), strict=True):
                self.records[i].ideal_s = t
        for inst in self.instances.values():
            for s in inst.running.values():
                s.record.generated = s.generated
        kv_per_gpu: int | None = None
        if len(self.specs) == 1:
            ((m, spec),) = self.specs.items()
            kv_per_gpu = self.blocks[m] * self.cfg.cluster.block_size * spec.kv_bytes_per_token
            kv_per_gpu //= self.cfg.cluster.tp
        cfg: dict[str, Any] = self.cfg.to_dict()
        cfg["policy"] = dict(self.policy_names)  # resolved, and still a valid config
        return RunResult(
            records=self.records,
            timeseries=self.timeseries,
            gpu_intervals=self.pool.close(end_s),
            migrations=[],
            end_s=end_s,
            kv_bytes_per_gpu=kv_per_gpu,
            config=cfg,
            sim_wall_s=wall_s,
            sim_events=self.n_events,
            notes=self.notes,
        )

    # ------------------------------------------------------------ integrity
    def check_integrity(self, arrived: int) -> None:
        """Check every invariant: block accounting of each instance, memory never
        over-committed, and every arrived request in exactly one place."""
        seen: dict[int, str] = {}
        for inst in self.instances.values():
            inst.check_integrity()
            for where, seqs in (
                ("waiting", list(inst.waiting)),
                ("running", list(inst.running.values())),
                ("prefill", inst.prefilling()),
            ):
                for s in seqs:
                    assert s.id not in seen, f"request {s.id} in {seen[s.id]} and {where}"
                    seen[s.id] = where
        for rec in self.records[:arrived]:
            in_flight = rec.id in seen
            terminal = rec.status in ("finished", "rejected")
            assert in_flight != terminal, f"request {rec.id}: in flight={in_flight}, {rec.status}"
        assert (
            self.pool.active
            == self.state.gpus_active
            == sum(len(i.gpus) for i in self.instances.values())
        )
