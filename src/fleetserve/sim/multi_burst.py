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
copy per member in parallel. ``exchange: blocking``: the group serves once
every copy is in. ``exchange: live`` (KunServe's, since session 30): the
group serves at once; each member sends its victims' moved KV victim by
victim (arrival order) on its link, in the gaps between the pipeline's
activation transfers (the link's share is re-set at every decode round from
the round's time, as the KunServe world does), and while a victim's KV is
still on a member, its attention for those layers runs there: each decode
round of its service pays, per member still sending, the queries and new
K/V out and the attention outputs back per layer (the KunServe world's
remote attention, :meth:`BurstControl._round_cost`); the KV that attention
reads is read on the sending member's stage, not on the stage that owns the
layers now (the round's busiest stage moves accordingly,
:meth:`BurstControl._moved_kv`; since session 32). Simplifications, against
:mod:`fleetserve.sim.kun`: the pool is one layout (where the KV is does not
change what fits), and a group that merges again or dissolves while
exchanging stops its exchange (the next layout counts the KV where the last
plan put it). A victim that leaves the batch (finished,
preempted) before its KV is sent voids its copy, as in the KunServe world:
one not started is cancelled, one in flight runs to its end unused
(``copies_void`` and ``bytes_void`` in the pipeline's record).

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

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from fleetserve.costmodel.pipeline import PipelineCost, StagedCost
from fleetserve.costmodel.transfer import (
    Link,
    host_link,
    intra_node_link,
    network_link,
    transfer_time,
)
from fleetserve.errors import ConfigError
from fleetserve.policy.actions import ActivateSpare, DropLayers, Restore
from fleetserve.policy.kunserve import ExecutorSnapshot, KunServePolicy
from fleetserve.policy.pressure import KunSettings
from fleetserve.sim.events import GROUP_READY, TRANSFER
from fleetserve.sim.kun_parts import Channel, Transfer, activation_gap_share, remote_attention_s
from fleetserve.sim.seq import RUNNING

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
            pipeline, or live restore turned off.
    """
    if settings.pressure not in MULTI_PRESSURES:
        raise ConfigError(
            f"pressure {settings.pressure!r} runs in the kunserve world only; a multi-LLM "
            f"world runs {' or '.join(MULTI_PRESSURES)}"
        )
    if settings.static_stages != 1:
        raise ConfigError("static pipeline stages run in the kunserve world only")
    if settings.pressure == "kunserve" and not settings.live_restore:
        raise ConfigError(
            "live_restore false: a multi-LLM world restores by moving the group's running "
            "requests to the reloaded replicas (set kunserve.live_restore: true)"
        )


def _running_on(s: Seq, g: SharingGroup) -> bool:
    """Whether ``s`` still decodes on ``g`` (its KV there)."""
    return s.state == RUNNING and s.inst is g


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


@dataclass(slots=True, eq=False)
class _LiveExchange:
    """A pipelined group's live KV exchange in flight (module docstring):
    per member, the victims whose moved KV it still sends (each one transfer
    on its link, in arrival order) and, per service, the layers each of its
    victims' attention still runs there (remote attention)."""

    group: SharingGroup
    link: Link
    start_s: float
    record: dict[str, Any]
    # member id -> its channel, and its victims' transfers still in flight
    sending: dict[int, tuple[Channel, dict[int, Transfer]]] = field(default_factory=dict)
    victims: dict[int, Seq] = field(default_factory=dict)  # request id -> victim
    # member id -> (its stage, service -> [(stage that now owns some of the
    # model layers whose KV it sends, how many)]): the layers whose attention
    # runs remotely until the KV is sent, and where its reads move from
    moves: dict[int, tuple[int, dict[str, list[tuple[int, int]]]]] = field(default_factory=dict)


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
        self.live: dict[int, _LiveExchange] = {}  # pipelined group id -> its live exchange
        # (a member's first GPU, the link) -> the channel it sends KV on
        self.channels: dict[tuple[int, Link], Channel] = {}

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
        victims_on: dict[int, list[Seq]] = {}  # member id -> the requests whose KV it holds
        for src in merge.sources:
            self._end_live(src.id, now)  # (its moves are taken as done: held_before)
            pipe = self.pipes.pop(src.id, None)
            srcs = pipe.members if pipe is not None else (src,)
            ranges = pipe.held if pipe is not None else ((0, grid),)
            run = src.take_running()
            total = sum(s.kv_tokens * sim.services[s.model].spec.kv_bytes_per_token for s in run)
            for mem, rng in zip(srcs, ranges, strict=True):
                held_before[mem.id] = rng
                kv_on[mem.id] = total * (rng[1] - rng[0]) / grid
                victims_on[mem.id] = run
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
        live = self.settings.exchange == "live"
        ready = now if live else now + exchange_s  # live: it serves while the KV moves
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
        if live:
            record["exchange_s"] = None  # until its last transfer ends
            record["remote_rounds"] = 0  # decode rounds that paid remote attention
            record["copies_void"] = 0  # victims that left before their KV was sent
            record["bytes_void"] = 0  # of those copies, the bytes never sent (not started)
            self._start_live(pipe_g, members, a.keep, held_before, victims_on, grid, link, record)

    # -------------------------------------------------------- live exchange
    def _start_live(
        self,
        g: SharingGroup,
        members: list[SharingGroup],
        keep: Sequence[tuple[int, int]],
        held_before: dict[int, tuple[int, int]],
        victims_on: dict[int, list[Seq]],
        grid: int,
        link: Link,
        record: dict[str, Any],
    ) -> None:
        """The live exchange of pipelined group ``g`` (module docstring): each
        member sends, victim by victim in arrival order, the KV of the layers
        it no longer keeps; until a victim's KV has left a member, its
        attention for those layers runs there (:meth:`_round_cost`)."""
        sim = self.sim
        now = sim.clock.now
        ex = _LiveExchange(g, link, now, record)
        for i, (mem, kp) in enumerate(zip(members, keep, strict=True)):
            rng = held_before[mem.id]
            frac = ((rng[1] - rng[0]) - (kp[1] - kp[0])) / grid  # of each victim's KV
            owners = []  # the parts of the layers it sent away, each in the stage keeping it now
            for lo, hi in ((rng[0], min(rng[1], kp[0])), (max(rng[0], kp[1]), rng[1])):
                for j, kj in enumerate(keep):
                    a, b = max(lo, kj[0]), min(hi, kj[1])
                    if j != i and a < b:
                        owners.append((j, (a, b)))
            moves = {
                m: [(j, n) for j, ov in owners if (n := self._layers(m, grid, ov))]
                for m in g.models
            }
            ch = self._channel(mem, link)
            trs: dict[int, Transfer] = {}
            for s in sorted(victims_on.get(mem.id, ()), key=lambda x: (x.arrival_s, x.id)):
                if s.inst is not g or s.state != RUNNING or frac <= 0:
                    continue  # recomputed instead (not adopted)
                kvb = sim.services[s.model].spec.kv_bytes_per_token
                nbytes = s.kv_tokens * kvb * frac / mem.tp
                tr = Transfer(
                    "kv-exchange", nbytes, partial(self._sent, ex, mem.id, s.id), live=True
                )
                trs[s.id] = tr
                ex.victims[s.id] = s
                ch.queue.append(tr)
            if trs:
                ex.sending[mem.id] = (ch, trs)
                ex.moves[mem.id] = (i, moves)
                self._push_link(ch, ch.try_start(now))
        if not ex.sending:
            record["exchange_s"] = 0.0
            return
        self.live[g.id] = ex
        g.round_cost = partial(self._round_cost, ex)

    def _channel(self, mem: SharingGroup, link: Link) -> Channel:
        """The ``link`` a member's GPUs send KV on (one transfer at a time)."""
        key = (mem.gpus[0], link)
        ch = self.channels.get(key)
        if ch is None:
            ch = self.channels[key] = Channel(f"gpu{mem.gpus[0]}", link)
        return ch

    def _push_link(self, ch: Channel, end: float | None) -> None:
        if end is not None:
            self.sim._out.append((end, TRANSFER, (ch, ch.version)))

    def on_link(self, payload: tuple[Channel, int], now: float) -> None:
        """A transfer on a member's link ended (a ``TRANSFER`` event)."""
        ch, version = payload
        if ch.version != version:
            return  # re-timed: a later event ends it
        tr = ch.finish()
        if not tr.cancelled:
            tr.on_done(now)
        self._push_link(ch, ch.try_start(now))

    def _sent(self, ex: _LiveExchange, mid: int, rid: int, now: float) -> None:
        """Victim ``rid``'s KV has left member ``mid``."""
        got = ex.sending.get(mid)
        if got is None or self.live.get(ex.group.id) is not ex:
            return
        trs = got[1]
        trs.pop(rid, None)
        self._sent_all(ex, mid, trs, now)

    def _sent_all(self, ex: _LiveExchange, mid: int, trs: dict[int, Transfer], now: float) -> None:
        """Member ``mid`` has nothing left to send once ``trs`` is empty; the
        exchange ends when no member has."""
        if not trs:
            del ex.sending[mid]
            del ex.moves[mid]
        if not ex.sending:
            ex.record["exchange_s"] = now - ex.start_s
            ex.group.round_cost = None
            del self.live[ex.group.id]

    def _end_live(self, gid: int, now: float) -> None:
        """Group ``gid`` merges again or dissolves: its exchange stops (the
        transfers not started are cancelled; the next layout's exchange counts
        the KV where the last plan put it)."""
        ex = self.live.pop(gid, None)
        if ex is None:
            return
        for _, trs in ex.sending.values():
            for tr in trs.values():
                tr.cancelled = True
        ex.group.round_cost = None
        ex.record["exchange_cut_s"] = now - ex.start_s

    def _round_cost(self, ex: _LiveExchange, m: str, batch: int, ctx: int) -> tuple[float, float]:
        """A decode round of service ``m`` on a group exchanging live: the
        pipeline's round plus the remote attention of its victims whose KV
        a member still sends (per such member, per layer: the queries and new
        K/V out, the attention outputs back, as the KunServe world's
        executors); the links carry the KV in the gaps between activations."""
        g = ex.group
        pl = cast("StagedCost", g.costs[m]).pipeline
        spec = self.sim.services[m].spec
        now = self.sim.clock.now
        self._void_departed(ex, now)
        if self.live.get(g.id) is not ex:  # nothing left to send: a plain round
            return pl.decode_round(batch, float(ctx))
        extra = 0.0
        for mid, (_, trs) in ex.sending.items():
            n = sum(k for _, k in ex.moves[mid][1].get(m, ()))
            if not n:
                continue
            count = sum(1 for rid in trs if ex.victims[rid].model == m)
            if count:
                extra += remote_attention_s(spec, count, n, ex.link)
        if extra:
            ex.record["remote_rounds"] += 1
        t, busy = pl.decode_round(batch, ctx, extra, moved_kv=self._moved_kv(ex, m, pl.k))
        share = activation_gap_share(t, pl.hop_time(batch), extra)
        for ch, _ in ex.sending.values():
            self._push_link(ch, ch.set_share(share, now))
        return t, busy

    def _moved_kv(self, ex: _LiveExchange, m: str, stages: int) -> list[float] | None:
        """Per stage (of ``stages``), the KV of service ``m`` (tokens of the
        whole model) its GPUs read for remote attention, less what the stages
        that own those layers now do not read (the KunServe world's rule,
        :meth:`~fleetserve.sim.kun.KunSimulator._moved_kv`): while a member
        still sends a victim's KV, the victim's attention for those layers
        runs there, on its current KV. None when nothing moves."""
        tl = [0] * stages
        touched = False
        for mid, (_, trs) in ex.sending.items():
            kv = sum(ex.victims[rid].kv_tokens for rid in trs if ex.victims[rid].model == m)
            if not kv:
                continue
            i, moves = ex.moves[mid]
            for j, n in moves.get(m, ()):
                tl[i] += n * kv
                tl[j] -= n * kv
                touched = True
        if not touched:
            return None
        layers = self.sim.services[m].spec.num_layers
        return [x / layers for x in tl]

    def _void_departed(self, ex: _LiveExchange, now: float) -> None:
        """Victims that left the group's running batch (finished, preempted,
        moved away) since the last round: their KV is freed, so what a member
        had still to send of it is void. A copy not started is cancelled; one
        in flight runs to its end, its arrival ignored (as the KunServe
        world's executors do, :meth:`~fleetserve.sim.kun.KunSimulator._forget`).
        Every decode round asks first, so no round pays a departed victim's
        remote attention and no link carries its KV after it left."""
        g = ex.group
        for mid, (ch, trs) in list(ex.sending.items()):
            gone = [rid for rid in trs if not _running_on(ex.victims[rid], g)]
            for rid in gone:
                tr = trs.pop(rid)
                tr.cancelled = True
                ex.record["copies_void"] += 1
                if ch.cur is not tr:  # (one in flight runs to its end)
                    ex.record["bytes_void"] += int(tr.nbytes)
            if gone:
                self._sent_all(ex, mid, trs, now)

    # ------------------------------------------------------------- restore
    def _dissolve(self, g: SharingGroup, now: float, reason: str) -> None:
        """Retire pipelined group ``g``; its members come back as replicas
        loading their dropped layers (see the module docstring)."""
        sim = self.sim
        pipe = self.pipes.pop(g.id)
        grid = self._grid(signature(g))
        self._end_live(g.id, now)
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
