"""Discrete-event simulation of a GPU fleet serving LLM requests.

One :class:`Simulator` is one run: its own clock, kernel
(:mod:`fleetserve.sim.kernel`, the event loop), RNG, instance ids and
records, so two simulations in one process never interfere. Its handlers
return the events they cause; the event order is set by the priorities in
:mod:`fleetserve.sim.events`.

What the simulator does, and what the policies decide::

    arrival ──► checks the request can ever fit one instance (else rejected)
            ──► dispatch policy: Dispatch | ActivateGpu | Reject | Defer (held)
    iteration end ──► instance completes it, records tokens; migrations
                      detach / attach requests at this boundary; it plans the
                      next one (its batching policy admits / picks victims)
                  ──► idle instance: memory policy may ReleaseGpu
    epoch ──► migration policy's plan (every ``interval_s``, only when the
              policy has one): ActivateGpu(ref) | Dispatch (held requests) |
              Reject | Migrate | ReleaseGpu, applied in order; then the
              mechanism picks which pending moves start (sim.migration)
    migration transfer end ──► next stage / detached copy done / tokens arrive
    sample ──► time series (every ``sample_interval_s``)

Every request is in exactly one place: an instance's waiting queue, prefill or
running batch; held at the controller (deferred by dispatch); detached from
its source (a KV move's final copy); or in transit (a token move).
``check_integrity`` checks it after every event when asked.
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
from fleetserve.metrics.summary import prefix_cache_stats
from fleetserve.policy import (
    DISPATCH,
    MECHANISM,
    MEMORY,
    MIGRATION,
    PLACEMENT,
    ActivateGpu,
    Defer,
    Dispatch,
    MechanismContext,
    Migrate,
    Reject,
    ReleaseGpu,
)
from fleetserve.policy.catalog import KUNSERVE, MULTI, check_world, resolve_policies
from fleetserve.policy.mechanism import MODES
from fleetserve.policy.sharing import BATCHING, ServiceStats
from fleetserve.sim.admission import context_note, context_reason
from fleetserve.sim.batch import SimClock
from fleetserve.sim.events import EPOCH, GROUP_READY, ITER_END, SAMPLE, TRANSFER, Event
from fleetserve.sim.group_instance import IDLE, GroupInstance
from fleetserve.sim.kernel import Kernel, ProgressFn
from fleetserve.sim.migration import Migrations
from fleetserve.sim.multi import service_stats
from fleetserve.sim.pool import GpuPool
from fleetserve.sim.prefix_cache import PrefixStats
from fleetserve.sim.seq import Seq
from fleetserve.sim.usage import UsageTotals
from fleetserve.spec import ModelSpec, get_model
from fleetserve.spec.memory import kv_capacity_blocks
from fleetserve.workload.request import Request, check_run_order
from fleetserve.workload.service import Service

logger = logging.getLogger(__name__)


def preflight(config: SimConfig) -> None:
    """Check names and that every configured model fits, before any work is done.

    Raises:
        FleetserveError: the first problem found, as one clear line.
    """
    world = check_world(config)
    if world == MULTI:
        from fleetserve.sim.multi_build import multi_preflight

        multi_preflight(config)
        return
    if world == KUNSERVE:
        from fleetserve.sim.kun_run import kun_preflight

        kun_preflight(config)
        return
    resolve_policies(config, groups=True)
    gpu = config.cluster.gpu_spec()
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
        placement: on a fixed pool, the instances to start (one model name
            per instance, in order) instead of the placement policy's; names
            no request uses are skipped (the runtime places by configured
            weights, see :mod:`fleetserve.experiments.fidelity`).
        on_iteration_end: called as ``on_iteration_end(instance, now)`` after
            each iteration end is handled (an observer: it must not change
            the simulation).

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
        placement: Sequence[str] | None = None,
        on_iteration_end: Callable[[GroupInstance, float], None] | None = None,
    ) -> None:
        self.cfg = config
        self._placement = tuple(placement) if placement is not None else None
        self._observe_iteration = on_iteration_end
        self.requests = list(requests)
        check_run_order(self.requests)
        self.notes = list(notes)
        self.progress = progress
        self.progress_every = progress_every
        self.clock = SimClock()
        self.rng = np.random.default_rng(config.seed)
        self.cost_model = cost or CostModel()

        cl = config.cluster
        self.gpu = cl.gpu_spec()
        self.policy_names = pn = resolve_policies(config, groups=True)
        self.dispatcher = DISPATCH.get(pn["dispatch"]).from_config(config)
        self.batching_name = pn["batching"]
        self.memory = MEMORY.get(pn["memory"]).from_config(config)
        self.migration = MIGRATION.get(pn["migration"]).from_config(config)
        self.migration.attach(self.dispatcher)
        # a temporal batching policy without a one-model case (MLFQ, DB) runs on
        # one-model sharing groups, with the statistics its scheduler reads
        needs_groups = not BATCHING.get(pn["batching"]).one_model
        if needs_groups:  # their requests keep explicit counts: no bound batch
            why = [
                w
                for w, bad in (
                    (
                        f"migration policy {pn['migration']!r} (a request moves at its "
                        "batch's boundary: batching fcfs or rr)",
                        pn["migration"] != "none",
                    ),
                    (
                        "engine.prefix_caching (cached blocks are shared within a batch "
                        "bound to its steps: batching fcfs or rr)",
                        config.engine.prefix_caching,
                    ),
                    ("engine.chunked_prefill", config.engine.chunked_prefill),
                )
                if bad
            ]
            if why:
                raise ConfigError(
                    f"batching {pn['batching']!r} runs on one-model sharing groups, "
                    f"which do not model {', '.join(why)} yet"
                )

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
        self.group_stats = self._service_stats() if needs_groups else {}
        if needs_groups:
            self.notes.append(
                f"batching {pn['batching']!r} ran on one-model sharing groups, its "
                "per-model statistics (mean and spread of a request's execution time) "
                "profiled from this run's own requests, as SeaLLM profiles history"
            )

        limit = cl.max_gpus if cl.elastic else (cl.gpus or 0)
        self.pool = GpuPool(limit, self.gpu.gpus_per_node)
        self.state = ClusterState(
            gpus_limit=limit,
            elastic=cl.elastic,
            model_tp=dict.fromkeys(names, cl.tp),
            gpus_per_node=self.gpu.gpus_per_node,
            request_blocks=dict(self.max_req_blocks),
            block_size=cl.block_size,
        )
        self.instances: dict[int, GroupInstance] = {}
        self._next_iid = 0
        self.records = [
            RequestRecord(r.id, r.model, r.arrival_s, r.prompt_tokens, r.output_tokens)
            for r in self.requests
        ]
        # Every arrived request's Seq, by id (None before arrival or when rejected).
        self.seqs: list[Seq | None] = [None] * len(self.requests)
        self.held: dict[int, Seq] = {}  # deferred by dispatch, waiting for a plan
        self.mig = Migrations(
            config.migration,
            self.gpu,
            self.gpu.gpus_per_node,
            MECHANISM.get(pn["mechanism"])(),
            cl.block_size,
        )
        self.mig.on_abort = self.migration.on_move_aborted
        self._compute_tokens: dict[str, int] = {}
        # the prefix caches' counters (engine.prefix_caching), all instances together
        self.prefix_stats = PrefixStats() if config.engine.prefix_caching else None
        self._epoch = 0
        self.n_done = 0
        self._loading: list[Event] = []  # ready events of instances activated
        self.timeseries = TimeSeries(config.sample_interval_s)
        self.kernel = Kernel(
            self.requests,
            {
                ITER_END: self._ev_iter_end,
                GROUP_READY: self._ev_ready,
                TRANSFER: self._ev_transfer,
                EPOCH: self._ev_epoch,
                SAMPLE: self._ev_sample,
            },
            max_time_s=config.max_time_s,
            check=config.check_integrity,
            progress=progress,
            progress_every=progress_every,
            clock=self.clock,
        )
        if not cl.elastic:
            self._place_fixed(cl.gpus or 0)

    # ---------------------------------------------------------------- setup
    def _place_fixed(self, n_gpus: int) -> None:
        if self._placement is not None:
            for m in self._placement:
                if m in self.specs:
                    self._start_instance(m, 0.0)
            return
        tp = self.cfg.cluster.tp
        if n_gpus < tp:
            raise ConfigError(f"a fixed pool of {n_gpus} GPUs cannot hold one tp={tp} instance")
        span = (self.requests[-1].arrival_s - self.requests[0].arrival_s) if self.requests else 0
        counts: dict[str, int] = dict.fromkeys(self.specs, 0)
        for r in self.requests:
            counts[r.model] += 1
        rates = {m: c / span if span > 0 else float(c) for m, c in counts.items()}
        placement = PLACEMENT.get(self.policy_names["placement"]).from_config(self.cfg)
        for m in placement.place(rates, n_gpus, dict(self.state.model_tp)):
            self._start_instance(m, 0.0)

    def _start_instance(self, model: str, now: float, *, load: bool = False) -> GroupInstance:
        """A new instance of ``model`` on GPUs from the pool; ``load``: an
        activation during the run, which loads its weights first
        (``cluster.activation_s``; the instances a run starts with are loaded)."""
        cl = self.cfg.cluster
        eng = self.cfg.engine
        gpus = self.pool.allocate(cl.tp, now)
        inst = GroupInstance(
            self._next_iid,
            model,
            self.specs[model],
            gpus,
            cl.tp,
            self.blocks[model],
            cl.block_size,
            self.costs[model],
            self.batching_name,
            self.clock,
            stats=self.group_stats.get(model),
            max_num_seqs=eng.max_num_seqs,
            max_batched_tokens=eng.max_batched_tokens,
            watermark=eng.watermark,
            macro_steps=self.cfg.macro_steps,
            chunked_prefill=eng.chunked_prefill,
            prefix_caching=eng.prefix_caching,
            prefix_stats=self.prefix_stats,
        )
        self._next_iid += 1
        if load and cl.activation_s > 0:
            inst.ready_s = now + cl.activation_s
            self._loading.append((inst.ready_s, GROUP_READY, inst))
        self.instances[inst.id] = inst
        self.state.add(inst)
        usage: UsageTotals | None = getattr(self, "_usage", None)
        if usage is None:  # the totals _sample reads, made with the first instance
            usage = self._usage = UsageTotals(self.cfg.sample_interval_s)
        usage.add(inst, self.specs[model].kv_bytes_per_token * cl.block_size)
        return inst

    def _service_stats(self) -> dict[str, ServiceStats]:
        """Each model's statistics for a group scheduler (SeaLLM's profiled
        L̂_s and σ_s, MLFQ's prefill estimate), profiled from the workload as
        the multi-LLM world profiles them (:func:`~fleetserve.sim.multi.service_stats`)."""
        reqs = self.requests
        span = (reqs[-1].arrival_s - reqs[0].arrival_s) if reqs else 0.0
        services = {}
        for m, spec in self.specs.items():
            rs = [r for r in reqs if r.model == m]
            n = len(rs)
            services[m] = Service(
                m,
                spec,
                n / span if span > 0 else float(n),
                max(1.0, sum(r.prompt_tokens for r in rs) / n) if n else 1.0,
                max(1.0, sum(r.output_tokens for r in rs) / n) if n else 1.0,
            )
        return service_stats(services, reqs, self.gpu, self.cost_model)[0]

    # ----------------------------------------------------------------- loop
    def run(self) -> RunResult:
        """Run to completion (or ``max_time_s``) and return the results."""
        wall0 = time.perf_counter()
        k = self.kernel
        k.push([(0.0, SAMPLE, None)])
        if self.migration.interval_s is not None:
            k.push([(0.0, EPOCH, None)])
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
    def _ev_iter_end(self, payload: tuple[GroupInstance, int], now: float) -> list[Event] | None:
        inst, version = payload
        if inst.version != version or inst.id not in self.instances:
            return None  # superseded by a truncation
        return self._on_iteration_end(inst, now)

    def _ev_ready(self, inst: GroupInstance, now: float) -> list[Event]:
        """An activated instance's weights are in: its first iteration starts."""
        if self.instances.get(inst.id) is not inst:
            return []
        # as at an iteration boundary: moves waiting for one detach or attach
        caused = self.mig.at_boundary(inst, now) if inst.mig_refs else []
        caused += self._schedule(inst, now)
        if self.mig.touched:
            caused += self._settle(now, inst)
        return caused

    def _loaded(self) -> list[Event]:
        """The ready events of the instances activated since the last call."""
        out, self._loading = self._loading, []
        return out

    def _ev_transfer(self, payload: Any, now: float) -> list[Event]:
        caused = self.mig.on_event(payload, now)
        caused += self._settle(now)
        return caused

    def _ev_epoch(self, payload: None, now: float) -> list[Event]:
        return self._on_epoch(now, self.kernel.arrivals_left)

    def _ev_sample(self, payload: None, now: float) -> list[Event]:
        return self._on_sample(now, self.kernel.arrivals_left)

    # ------------------------------------------------------------- handlers
    def on_arrival(self, req: Request, now: float) -> list[Event]:
        """A request arrives: feasibility check, then the dispatch policy."""
        rec = self.records[req.id]
        too_long = context_reason(req, self.specs[req.model], self.cfg.engine.max_model_len)
        if too_long is not None:
            self._reject(rec, too_long)
            return []
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
        dispatched = isinstance(action, Dispatch)  # the common case first
        if not dispatched and isinstance(action, Reject):
            self._reject(rec, action.reason)
            return []
        if action.request_id != req.id:
            raise RuntimeError(f"dispatch returned {action} for request {req.id}")
        seq = Seq(req, rec)
        self.seqs[req.id] = seq
        if isinstance(action, Dispatch):
            inst = self.instances[action.instance_id]
        elif isinstance(action, Defer):
            if self.migration.interval_s is None:
                raise RuntimeError(
                    f"dispatch deferred request {req.id}, but migration policy "
                    f"{self.policy_names['migration']!r} never plans, so it would wait forever"
                )
            self.held[req.id] = seq
            return []
        elif isinstance(action, ActivateGpu):
            if action.model != req.model:
                raise RuntimeError(f"dispatch returned {action} for request {req.id}")
            inst = self._start_instance(req.model, now, load=True)
        else:  # pragma: no cover - the type admits nothing else
            raise RuntimeError(f"unexpected dispatch action {action!r}")
        if self._loading:
            return self._loaded() + self._enqueue(seq, inst, now)
        return self._enqueue(seq, inst, now)

    def _enqueue(self, seq: Seq, inst: GroupInstance, now: float) -> list[Event]:
        if inst.model != seq.model:
            raise RuntimeError(f"dispatched a {seq.model} request to a {inst.model} instance")
        seq.record.instance = inst.id
        end = inst.enqueue(seq, now)
        return [] if end is None else [(end, ITER_END, (inst, inst.version))]

    def _reject(self, rec: RequestRecord, reason: str) -> None:
        rec.status = "rejected"
        rec.reason = reason
        self.n_done += 1

    def _on_iteration_end(self, inst: GroupInstance, now: float) -> list[Event]:
        done = inst.complete(now)
        if done:
            self.n_done += len(done)
            on_finish = self.migration.on_finish
            for s in done:
                on_finish(s.id, inst.id, now)
        caused = self.mig.at_boundary(inst, now) if inst.mig_refs else []
        caused += self._schedule(inst, now)
        if self.mig.touched:
            caused += self._settle(now, inst)
        if self._observe_iteration is not None:
            self._observe_iteration(inst, now)
        return caused

    def _schedule(self, inst: GroupInstance, now: float) -> list[Event]:
        """Plan ``inst``'s next iteration at a boundary (or while it sits idle);
        abort moves of requests it preempted; consult the memory policy when
        it is idle."""
        end = inst.schedule(now)
        caused = self.mig.after_schedule(inst, now) if inst.preempted_migrating else []
        if end is not None:
            caused.append((end, ITER_END, (inst, inst.version)))
        elif inst.idle:
            for action in self.memory.on_idle(self.state, inst, now):
                self._apply_release(action, now)
        return caused

    def _settle(self, now: float, exclude: GroupInstance | None = None) -> list[Event]:
        """Re-plan instances a migration changed while they sat idle (phase IDLE):
        memory freed may admit their queue, a request attached starts decoding,
        and one left idle is offered to the memory policy. ``exclude`` is the
        instance whose boundary the caller is handling itself."""
        caused: list[Event] = []
        mig = self.mig
        while mig.touched:
            touched, mig.touched = mig.touched, []
            seen: set[int] = set()
            for inst in touched:
                if inst is exclude or inst.id in seen or self.instances.get(inst.id) is not inst:
                    continue
                seen.add(inst.id)
                if inst.phase == IDLE:
                    caused += self._schedule(inst, now)
        return caused

    def _apply_release(self, action: ReleaseGpu, now: float) -> None:
        inst = self.instances.get(action.instance_id)
        if inst is None:
            raise RuntimeError(f"release of unknown instance {action.instance_id}")
        if not inst.idle:
            raise RuntimeError(f"released busy instance {inst.id}")
        del self.instances[inst.id]
        self.state.remove(inst.id)
        self._usage.remove(inst.id)
        self.pool.release(inst.gpus, now)
        self.migration.on_release(inst.id, now)

    # ------------------------------------------------------------ migration
    def _on_epoch(self, now: float, arrivals_left: bool) -> list[Event]:
        """Apply the migration policy's plan, then start the pending moves the
        mechanism picks; schedule the next epoch while anything is left to do."""
        caused: list[Event] = []
        refs: dict[int, int] = {}
        if self.mig.cfg.wait_for_room_s > 0:  # moves waiting for room: start, or give up
            caused += self.mig.retry_waiting(now)
        for action in self.migration.plan(self.state, now, self.rng):
            caused += self._apply_plan_action(action, refs, now)
        if self._loading:
            caused += self._loaded()
        if self.mig.pending:
            ctx = self._mech_context()
            caused += self.mig.start_pending(self.seqs, self.instances, ctx, now)
        caused += self._settle(now)
        interval = self.migration.interval_s
        assert interval is not None
        if self._work_left(arrivals_left):
            self._epoch += 1
            caused.append((self._epoch * interval, EPOCH, None))
        return caused

    def _apply_plan_action(self, action: Any, refs: dict[int, int], now: float) -> list[Event]:
        def inst_of(iid: int) -> GroupInstance:
            iid = refs.get(iid, iid)
            inst = self.instances.get(iid)
            if inst is None:
                raise RuntimeError(f"plan action {action} names unknown instance {iid}")
            return inst

        def held(rid: int) -> Seq:
            seq = self.held.pop(rid, None)
            if seq is None:
                raise RuntimeError(f"plan action {action}: request {rid} is not held")
            return seq

        if isinstance(action, ActivateGpu):
            if action.tp != self.cfg.cluster.tp or action.model not in self.specs:
                raise RuntimeError(f"plan activates an instance this run cannot hold: {action}")
            inst = self._start_instance(action.model, now, load=True)
            if action.ref is not None:
                if action.ref in refs:
                    raise RuntimeError(f"plan reuses ref {action.ref}")
                refs[action.ref] = inst.id
                self.migration.bind(action.ref, inst.id)
            if action.request_id is not None:
                return self._enqueue(held(action.request_id), inst, now)
        elif isinstance(action, Dispatch):
            dst = inst_of(action.instance_id)
            return self._enqueue(held(action.request_id), dst, now)
        elif isinstance(action, Reject):
            held(action.request_id)
            self._reject(self.records[action.request_id], action.reason)
        elif isinstance(action, Migrate):
            rid = action.request_id
            seq = self.seqs[rid] if 0 <= rid < len(self.seqs) else None
            if seq is None or seq.record.status != "unfinished":
                raise RuntimeError(f"plan migrates request {rid}, which is not in flight")
            if action.mode is not None and action.mode not in MODES:
                raise RuntimeError(f"plan gives unknown migration mode in {action}")
            dst = inst_of(action.dst)
            if dst.model != seq.model:
                raise RuntimeError(f"plan moves a {seq.model} request to a {dst.model} instance")
            self.mig.plan_move(seq, dst, action.mode)
        elif isinstance(action, ReleaseGpu):
            self._apply_release(ReleaseGpu(inst_of(action.instance_id).id), now)
        else:
            raise RuntimeError(f"unexpected action in a migration plan: {action!r}")
        return []

    def _mech_context(self) -> MechanismContext:
        """The epoch's boundaries (Mell §V): bytes per link, re-prefill tokens per instance."""
        mc = self.cfg.migration
        per = {iid: self._compute_tokens_of(inst.model) for iid, inst in self.instances.items()}
        return MechanismContext(
            gpus_per_node=self.gpu.gpus_per_node,
            intra_node_bytes=int(mc.link_share * mc.epoch_s * self.gpu.intra_node_bw),
            inter_node_bytes=int(mc.link_share * mc.epoch_s * self.gpu.network_bw),
            compute_tokens=per,
            default_compute_tokens=self._compute_tokens_of(self.cfg.model)
            if self.cfg.model in self.costs
            else min((self._compute_tokens_of(m) for m in self.costs), default=0),
        )

    def _compute_tokens_of(self, model: str) -> int:
        """Largest ``n`` with ``re_prefill_time(n) <= compute_share * epoch_s``
        (binary search; re-prefill time grows with ``n``), cached per model."""
        got = self._compute_tokens.get(model)
        if got is not None:
            return got
        mc = self.cfg.migration
        got = self.costs[model].re_prefill_tokens(mc.compute_share * mc.epoch_s)
        self._compute_tokens[model] = got
        return got

    def _work_left(self, arrivals_left: bool) -> bool:
        """Whether anything can still happen: arrivals, held requests, pending
        moves or a busy instance."""
        return (
            arrivals_left
            or bool(self.held)
            or bool(self.mig.pending)
            or any(not i.idle for i in self.instances.values())
        )

    def _on_sample(self, now: float, arrivals_left: bool) -> list[Event]:
        self._sample(now)
        if self._work_left(arrivals_left):
            return [(now + self.cfg.sample_interval_s, SAMPLE, None)]
        return []

    def _sample(self, now: float) -> None:
        """Record the time series at ``now``: from the kept totals of a large
        cluster (sim/usage.py: cost per instance changed, not per instance), or
        a scan of a small one (the same numbers)."""
        usage: UsageTotals | None = getattr(self, "_usage", None)
        got = usage.totals(now) if usage is not None else None
        if got is not None:
            used, cap, demand, queued, running = got
        else:
            used = cap = demand = queued = running = 0
            bs = self.cfg.cluster.block_size
            bbs = {m: s.kv_bytes_per_token * bs for m, s in self.specs.items()}
            for inst in self.instances.values():
                bb = bbs[inst.model]
                u = inst.used_blocks
                used += u * bb
                cap += inst.total_blocks * bb
                demand += (u + inst.reserved_blocks) * bb
                queued += inst.num_waiting
                running += inst.num_running + inst.num_prefilling
        queued += len(self.held) + len(self.mig.transit)
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
        for s in self.seqs:
            if s is not None and s.record.status == "unfinished":
                s.record.generated = s.generated
        kv_per_gpu: int | None = None
        instance_kv: int | None = None
        if len(self.specs) == 1:
            ((m, spec),) = self.specs.items()
            instance_kv = self.blocks[m] * self.cfg.cluster.block_size
            kv_per_gpu = instance_kv * spec.kv_bytes_per_token // self.cfg.cluster.tp
        cfg: dict[str, Any] = self.cfg.to_dict()
        # resolved, and still a valid config
        cfg["policy"] = {k: v for k, v in self.policy_names.items() if k != "mechanism"}
        cfg["migration"]["mechanism"] = self.policy_names["mechanism"]
        notes = list(self.notes)
        note = context_note(self.records)
        if note is not None:
            notes.append(note)
        if self.mig.aborted:
            notes.append(f"{self.mig.aborted} planned migrations were aborted")
        extra: dict[str, Any] = {}
        report = self.migration.report()
        if report is not None:  # under the policy's name (Mell's operation counts)
            extra[self.policy_names["migration"]] = report
        if self.mig.abort_reasons:
            extra["migration_aborts"] = dict(sorted(self.mig.abort_reasons.items()))
        if self.prefix_stats is not None:
            extra["prefix_cache"] = {
                **prefix_cache_stats(self.records),
                **self.prefix_stats.as_dict(),
            }
        return RunResult(
            records=self.records,
            timeseries=self.timeseries,
            gpu_intervals=self.pool.close(end_s),
            migrations=self.mig.records,
            end_s=end_s,
            kv_bytes_per_gpu=kv_per_gpu,
            instance_kv_tokens=instance_kv,
            config=cfg,
            sim_wall_s=wall_s,
            sim_events=self.n_events,
            notes=notes,
            aborted_migrations=self.mig.aborted,
            extra=extra,
        )

    # ------------------------------------------------------------ integrity
    def check_integrity(self, arrived: int) -> None:
        """Check every invariant: block accounting of each instance (migration
        reservations and held blocks included), memory never over-committed,
        migration references consistent, and every arrived request in exactly
        one place (an instance's queue, prefill or batch; held at the
        controller; detached from its source; in transit)."""
        seen: dict[int, str] = {}

        def place(rid: int, where: str) -> None:
            assert rid not in seen, f"request {rid} in {seen[rid]} and {where}"
            seen[rid] = where

        for inst in self.instances.values():
            inst.check_integrity()
            for where, seqs in (
                ("waiting", list(inst.waiting)),
                ("running", list(inst.running.values())),
                ("prefill", inst.prefilling()),
            ):
                for s in seqs:
                    place(s.id, f"{where} on {inst.id}")
        for rid, where in self.mig.places():
            place(rid, where)
        for rid, s in self.held.items():
            assert s.inst is None and s.mig is None
            place(rid, "held")
        self.mig.check_integrity(self.instances)
        for rec in self.records[:arrived]:
            in_flight = rec.id in seen
            terminal = rec.status in ("finished", "rejected")
            assert in_flight != terminal, f"request {rec.id}: in flight={in_flight}, {rec.status}"
        assert (
            self.pool.active
            == self.state.gpus_active
            == sum(len(i.gpus) for i in self.instances.values())
        )
