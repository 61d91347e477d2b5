"""KunServe's parameter drop and restore among a multi-LLM world's sharing groups.

The memory-pressure family (``pressure: kunserve``) of a multi-LLM stack, as
the ``fleet`` stack composes it with SeaLLM's placement and Mell's elastic
pool. The *decisions* are :class:`~fleetserve.policy.kunserve.KunServePolicy`'s,
unchanged: its monitor, Algorithm 1 and the restore rule. This module only
shows it the groups and applies the actions it returns.

Buddies. KunServe merges *replicas of one model* into a pipeline. In a
multi-LLM world the replicas are the sharing groups with the same signature:
the same tensor degree and the same set of hosted services (SeaLLM places a
popular model on several such groups; dedicated placement gives each hot
model several). Each signature has its own policy. Its "layers" are a common
grid of ``L = min`` layers over the hosted models: a stage holding the grid
range ``[a, b)`` holds layers ``[a L_m / L, b L_m / L)`` of model ``m``
(floors; every stage gets at least one layer of every model, and the stages
tile each model exactly). KV amounts are shown to the policy in bytes
(``kv_bytes_per_token = 1``), since the services' tokens differ in size;
the droppable parameters are every hosted model's layer weights.

Drop (:class:`~fleetserve.policy.actions.DropLayers`). The source groups
stop starting jobs (a macro job is cut after its iteration in flight) but
still take requests; once none has a job in flight they become one
pipelined group: GPUs in stage order, each service's job times from
:class:`~fleetserve.costmodel.pipeline.StagedCost` (a decode round; under a
temporal scheduler prefills run as lanes beside it, see
:mod:`fleetserve.sim.group`), and
one KV pool of ``sum_i K_i + dropped weight bytes`` (``K_i`` = member
``i``'s KV as a replica). The pool is one layout, so the KV of a token is
assumed spread over the stages in proportion to their layers (it is, up to
the rounding of the grid). Queues are merged in arrival order; running
requests keep their KV. The members' moved KV (the part of each running
request's KV whose layers another stage now owns) crosses the links, one
copy per member in parallel, and the group serves once every copy is in:
KunServe's *blocking* exchange. The live exchange with remote attention
(:mod:`fleetserve.sim.kun`) is not modelled in this world; a stack asking for
it is refused (:func:`check_burst`).

Restore (:class:`~fleetserve.policy.actions.Restore`). The group stops taking
requests (its queue is dispatched again), finishes its jobs in flight and
retires like a group a re-placement removes: its running requests move
(with the stack's migration mechanism) to a host of their service, the
members' replicas first, which are back as new groups loading their dropped
layers (host PCIe, or a peer's network link with ``restore_from: peer``)
from the drain on. A re-placement first cancels merges in progress and
restores every pipeline this way, so the plan's groups are replicas again.

Spare (:class:`~fleetserve.policy.actions.ActivateSpare`). On an elastic pool
an asleep replica of the signature is woken (none while one is waking);
otherwise the action is counted as unmet.

Pipelined groups do not sleep on an elastic pool (the restore rule dissolves
them when their load is low). KunServe's batch cap and queue rebalancing
among executors are not applied here: the stack's dispatch policy places
every request. ``extra["kunserve"]`` reports every pipeline and the counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetserve.costmodel.pipeline import PipelineCost, StagedCost
from fleetserve.costmodel.transfer import (
    host_link,
    intra_node_link,
    network_link,
    transfer_time,
)
from fleetserve.errors import ConfigError
from fleetserve.policy.actions import ActivateSpare, DropLayers, Restore
from fleetserve.policy.kunserve import ExecutorSnapshot, KunServePolicy
from fleetserve.policy.pressure import KunSettings
from fleetserve.sim.events import GROUP_READY

if TYPE_CHECKING:
    from fleetserve.sim.group import JobCost, SharingGroup
    from fleetserve.sim.multi import MultiSimulator
    from fleetserve.sim.seq import Seq

Signature = tuple[int, tuple[str, ...]]
"""``(tensor degree, hosted services)``: groups with one signature are buddies."""

MULTI_PRESSURES = ("queue", "kunserve")
"""The memory-pressure reactions a multi-LLM world runs."""


def check_burst(settings: KunSettings) -> None:
    """Refuse what a multi-LLM world does not model (a clear error, not a
    silent substitute).

    Raises:
        ConfigError: a pressure other than ``queue``/``kunserve``, a static
            pipeline, the live exchange, or live restore turned off.
    """
    if settings.pressure not in MULTI_PRESSURES:
        raise ConfigError(
            f"pressure {settings.pressure!r} runs in the kunserve world only; a multi-LLM "
            f"world runs {' or '.join(MULTI_PRESSURES)}"
        )
    if settings.static_stages != 1:
        raise ConfigError("static pipeline stages run in the kunserve world only")
    if settings.pressure == "kunserve" and settings.exchange != "blocking":
        raise ConfigError(
            f"exchange {settings.exchange!r}: a multi-LLM world exchanges KV blocking "
            "(set kunserve.exchange: blocking; the live exchange runs in the kunserve world)"
        )
    if settings.pressure == "kunserve" and not settings.live_restore:
        raise ConfigError(
            "live_restore false: a multi-LLM world restores by moving the group's running "
            "requests to the reloaded replicas (set kunserve.live_restore: true)"
        )


def signature(g: SharingGroup) -> Signature:
    """The buddy signature of a group."""
    return (g.tp, tuple(g.models))


@dataclass(slots=True)
class _Pipeline:
    """One buddy group and its history."""

    group: SharingGroup
    members: tuple[SharingGroup, ...]  # the replica groups merged, stage order
    held: tuple[tuple[int, int], ...]  # grid range each member holds
    record: dict[str, Any]


@dataclass(slots=True)
class _Merge:
    """Sources waiting for their jobs in flight to end."""

    action: DropLayers
    sig: Signature
    sources: list[SharingGroup]
    since: float


@dataclass(slots=True)
class _Counts:
    ticks: int = 0
    drops: int = 0
    restores: int = 0
    cancelled: int = 0
    spares_woken: int = 0
    spares_unmet: int = 0
    recomputed: int = 0
    pipelines: list[dict[str, Any]] = field(default_factory=list)


class BurstControl:
    """KunServe's drop/restore on a :class:`~fleetserve.sim.multi.MultiSimulator`
    (see the module docstring). The simulator calls :meth:`tick` every
    ``monitor_interval_s``, :meth:`drained` when a merging group's last job
    ends, and :meth:`before_switch` before a re-placement."""

    def __init__(self, sim: MultiSimulator, settings: KunSettings) -> None:
        check_burst(settings)
        self.sim = sim
        self.settings = settings
        self.policies: dict[Signature, KunServePolicy] = {}
        self.pipes: dict[int, _Pipeline] = {}  # pipelined group id -> its bookkeeping
        self.merging: dict[int, _Merge] = {}  # source group id -> its merge
        self.counts = _Counts()

    # ------------------------------------------------------------ geometry
    def _grid(self, sig: Signature) -> int:
        return min(self.sim.services[s].spec.num_layers for s in sig[1])

    def _layers(self, model: str, grid: int, rng: tuple[int, int]) -> int:
        n = self.sim.services[model].spec.num_layers
        return rng[1] * n // grid - rng[0] * n // grid

    def _dropped_bytes(self, g: SharingGroup, grid: int, held: tuple[int, int]) -> int:
        """Layer weight bytes (all TP shards) a member holding grid range
        ``held`` does not hold."""
        out = 0
        for m in g.models:
            spec = self.sim.services[m].spec
            out += (spec.num_layers - self._layers(m, grid, held)) * spec.weight_bytes_per_layer
        return out

    def _policy(self, sig: Signature) -> KunServePolicy:
        pol = self.policies.get(sig)
        if pol is None:
            specs = [self.sim.services[s].spec for s in sig[1]]
            pol = self.settings.policy_for(
                "+".join(sig[1]),
                self._grid(sig),
                sum(s.num_layers * s.weight_bytes_per_layer for s in specs),
                1,
            )
            self.policies[sig] = pol
        return pol

    # --------------------------------------------------------------- views
    def _view(self, g: SharingGroup, grid: int) -> ExecutorSnapshot:
        services = self.sim.services
        head = queued = 0
        for m in g.models:
            kvb = services[m].spec.kv_bytes_per_token
            q = g.waiting[m]
            if q:
                head += (q[0].prompt_tokens + q[0].generated) * kvb
            queued += sum(s.prompt_tokens + s.generated for s in q) * kvb
        pipe = self.pipes.get(g.id)
        if pipe is None:
            members: tuple[int, ...] = (g.id,)
            held: tuple[tuple[int, int], ...] = ((0, grid),)
            replica_kv: tuple[int, ...] = (g.layout.capacity_bytes,)
        else:
            members = tuple(x.id for x in pipe.members)
            held = pipe.held
            replica_kv = tuple(x.layout.capacity_bytes for x in pipe.members)
        live = g.state == "live"
        return ExecutorSnapshot(
            key=g.id,
            members=members,
            held_layers=held,
            replica_kv_bytes=replica_kv,
            kv_used_tokens=g.layout.used_bytes(),
            kv_head_tokens=head,
            kv_queued_tokens=queued,
            kv_capacity_tokens=g.layout.capacity_bytes,
            accepting=live,
            stable=live and g.id not in self.merging,
        )

    def _executors(self) -> dict[Signature, list[SharingGroup]]:
        out: dict[Signature, list[SharingGroup]] = {}
        for g in self.sim.groups:
            if g.state in ("live", "loading", "merging"):
                out.setdefault(signature(g), []).append(g)
        return out

    # ---------------------------------------------------------------- tick
    @property
    def busy(self) -> bool:
        """A merge is waiting for its sources' jobs."""
        return bool(self.merging)

    def tick(self, now: float) -> None:
        """One monitor interval: observe every executor, apply the decisions."""
        self.counts.ticks += 1
        for sig, execs in sorted(self._executors().items()):
            grid = self._grid(sig)
            pol = self._policy(sig)
            views = [self._view(g, grid) for g in execs]
            pol.observe(now, views)
            for action in pol.plan(now, views):
                if isinstance(action, DropLayers):
                    self._start_merge(action, sig, now)
                elif isinstance(action, Restore):
                    self._dissolve(self.sim._group_by_id[action.executor], now, "restore")
                elif isinstance(action, ActivateSpare):
                    self._spare(sig, now)

    def _spare(self, sig: Signature, now: float) -> None:
        same = [g for g in self.sim.groups if signature(g) == sig and g.id not in self.pipes]
        if any(g.state == "loading" for g in same):
            return  # one is already starting
        asleep = [g for g in same if g.state == "asleep"]
        if not asleep:
            self.counts.spares_unmet += 1
            return
        self.sim._wake(asleep[0], now)
        self.counts.spares_woken += 1

    # ---------------------------------------------------------------- drop
    def _start_merge(self, action: DropLayers, sig: Signature, now: float) -> None:
        sim = self.sim
        sources = [sim._group_by_id[k] for k in action.sources]
        merge = _Merge(action, sig, sources, now)
        for g in sources:
            g.state = "merging"  # stays a host: its queue joins the group
            self.merging[g.id] = merge
            sim._push(g, g.truncate(now))
        self._try_merge(merge, now)

    def drained(self, g: SharingGroup, now: float) -> None:
        """A merging group's last job in flight ended."""
        merge = self.merging.get(g.id)
        if merge is not None:
            self._try_merge(merge, now)

    def _member(self, iid: int) -> SharingGroup:
        return self.sim._group_by_id[iid]

    def _try_merge(self, merge: _Merge, now: float) -> None:
        if any(g.jobs for g in merge.sources):
            return
        sim = self.sim
        a = merge.action
        sig = merge.sig
        grid = self._grid(sig)
        members = [self._member(i) for i in a.members]
        # where each member's KV is now: the grid range it held before the merge
        held_before: dict[int, tuple[int, int]] = {}
        kv_on: dict[int, float] = {}  # member id -> KV bytes of running requests it holds
        waiting: list[Seq] = []
        running: list[Seq] = []
        for src in merge.sources:
            pipe = self.pipes.pop(src.id, None)
            srcs = pipe.members if pipe is not None else (src,)
            ranges = pipe.held if pipe is not None else ((0, grid),)
            run = src.take_running()
            total = sum(s.kv_tokens * sim.services[s.model].spec.kv_bytes_per_token for s in run)
            for mem, rng in zip(srcs, ranges, strict=True):
                held_before[mem.id] = rng
                kv_on[mem.id] = total * (rng[1] - rng[0]) / grid
            waiting += src.take_waiting()
            running += run
            for m in src.models:
                sim.hosts[m].remove(src)
            if pipe is not None:
                pipe.record["end_s"] = now
                pipe.record["ended_by"] = "merged into a larger group"
                src.state = "stopped"
            else:
                src.state = "merged"
            sim._stopped[src.id] = now  # its life as a group ends here
            sim._release(src, now)
            del self.merging[src.id]
            self._policy(sig).forget(src.id)
        # the exchange: each member sends the KV of layers it no longer keeps
        gpu = sim.gpu
        node = gpu.gpus_per_node
        one_node = len({g.gpus[0] // node for g in members}) == 1
        link = intra_node_link(gpu) if one_node else network_link(gpu)
        moved = 0.0
        exchange_s = 0.0
        for mem, keep in zip(members, a.keep, strict=True):
            rng = held_before[mem.id]
            gone = kv_on[mem.id] * (1.0 - (keep[1] - keep[0]) / (rng[1] - rng[0]))
            moved += gone
            exchange_s = max(exchange_s, transfer_time(gone / mem.tp, link) if gone else 0.0)
        # the pipelined group
        tp = members[0].tp
        names = list(members[0].models)
        capacity = sum(x.layout.capacity_bytes for x in members) + sum(
            self._dropped_bytes(x, grid, keep) for x, keep in zip(members, a.keep, strict=True)
        )
        costs: dict[str, JobCost] = {}
        for m in names:
            base = sim.cost_model.bind(sim.services[m].spec, gpu, tp)
            stages = [self._layers(m, grid, keep) for keep in a.keep]
            costs[m] = StagedCost(PipelineCost(base, stages, link))
        gpus = tuple(x for mem in members for x in mem.gpus)
        pipe_g = sim._add_group(gpus, tp, names, capacity, costs=costs, macro_steps=False)
        sim._started[pipe_g.id] = now
        sim._active_since[pipe_g.id] = now
        pipe_g.state = "loading"
        ready = now + exchange_s
        sim._ready_at[pipe_g.id] = ready
        sim._out.append((ready, GROUP_READY, pipe_g))
        sim._host(pipe_g)
        for seq in sorted(running, key=lambda s: (s.arrival_s, s.id)):
            seq.record.instance = pipe_g.id
            if not pipe_g.adopt(seq, now):  # cannot happen with a larger pool; kept safe
                self.counts.recomputed += 1
                seq.kv_saved = 0
                seq.record.preemptions += 1
                pipe_g.enqueue(seq, now, head=True)
        for seq in sorted(waiting, key=lambda s: (s.arrival_s, s.id)):
            seq.record.instance = pipe_g.id
            pipe_g.enqueue(seq, now)
        record: dict[str, Any] = {
            "id": pipe_g.id,
            "services": names,
            "tp": tp,
            "members": [x.id for x in members],
            "gpus": list(gpus),
            "stages": [list(k) for k in a.keep],
            "grid_layers": grid,
            "decided_s": merge.since,
            "start_s": now,
            "exchange_s": exchange_s,
            "exchange_bytes": int(moved),
            "kv_bytes": capacity,
            "kv_bytes_as_replicas": sum(x.layout.capacity_bytes for x in members),
            "requests_running": len(running),
            "requests_queued": len(waiting),
            "end_s": None,
            "ended_by": None,
        }
        self.counts.pipelines.append(record)
        self.counts.drops += 1
        self.pipes[pipe_g.id] = _Pipeline(pipe_g, tuple(members), tuple(a.keep), record)

    # ------------------------------------------------------------- restore
    def _dissolve(self, g: SharingGroup, now: float, reason: str) -> None:
        """Retire pipelined group ``g``; its members come back as replicas
        loading their dropped layers (see the module docstring)."""
        sim = self.sim
        pipe = self.pipes.pop(g.id)
        grid = self._grid(signature(g))
        g.state = "retiring"
        for m in g.models:
            sim.hosts[m].remove(g)
        sim._push(g, g.truncate(now))
        drain = max([now] + [sim._job_end.get((g.id, t), now) for t in g.jobs])
        link = network_link(sim.gpu) if self.settings.restore_from == "peer" else host_link(sim.gpu)
        for mem, held in zip(pipe.members, pipe.held, strict=True):
            reload = self._dropped_bytes(mem, grid, held) / mem.tp
            new = sim._add_group(mem.gpus, mem.tp, list(mem.models), mem.layout.capacity_bytes)
            sim._started[new.id] = now
            sim._active_since[new.id] = now
            new.state = "loading"
            ready = drain + transfer_time(reload, link)
            sim._ready_at[new.id] = ready
            sim._out.append((ready, GROUP_READY, new))
            sim._host(new)
            sim._replace_in_plan(mem, new)
        pipe.record["end_s"] = now
        pipe.record["ended_by"] = reason
        self.counts.restores += reason == "restore"
        self._policy(signature(g)).forget(g.id)
        for seq in g.take_waiting():
            sim._dispatch(seq, now)
        if not g.jobs:
            sim._retire(g, now)

    def before_switch(self, now: float) -> None:
        """A re-placement is about to retire and add groups: cancel merges in
        progress and restore every pipeline (the plan knows replicas only)."""
        sim = self.sim
        for merge in {id(m): m for m in self.merging.values()}.values():
            for g in merge.sources:
                g.state = "live"
                del self.merging[g.id]
                sim._push(g, g.schedule(now))
            self.counts.cancelled += 1
        for gid in sorted(self.pipes):
            self._dissolve(sim._group_by_id[gid], now, "re-placement")

    def is_pipeline(self, g: SharingGroup) -> bool:
        """Whether ``g`` is a pipelined group (it does not sleep)."""
        return g.id in self.pipes

    # -------------------------------------------------------------- result
    def summary(self) -> dict[str, Any]:
        """``extra["kunserve"]`` of the run."""
        c = self.counts
        st = self.settings
        return {
            "pressure": st.pressure,
            "exchange": st.exchange,
            "strategy": st.strategy,
            "monitor_interval_s": st.monitor_interval_s,
            "restore_threshold": st.restore_threshold,
            "restore_min_s": st.restore_min_s,
            "restore_from": st.restore_from,
            "monitor_ticks": c.ticks,
            "drops": c.drops,
            "restores": c.restores,
            "merges_cancelled": c.cancelled,
            "spares_woken": c.spares_woken,
            "spares_unmet": c.spares_unmet,
            "recomputed_at_merge": c.recomputed,
            "signatures": len(self.policies),
            "pipelines": c.pipelines,
        }


__all__ = ["MULTI_PRESSURES", "BurstControl", "check_burst", "signature"]
