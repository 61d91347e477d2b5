r"""KunServe at runtime: the controller's side of buddy groups.

The decisions are :class:`~fleetserve.policy.kunserve.KunServePolicy`'s, the
same object the KunServe simulator asks (built from the stack's
:class:`~fleetserve.policy.pressure.KunSettings` and the config's
``kunserve:`` overrides, with ``P`` and the KV bytes per token measured on
the workers' engines). Every ``monitor_interval_s`` the controller shows it
one :class:`KunExec` per executor — a replica worker, or a buddy group of
workers — and applies what it returns:

* :class:`~fleetserve.policy.actions.DropLayers` → :meth:`KunRuntime.merge`:
  the sources stop taking requests; each member worker hands over its
  requests (:meth:`~fleetserve.runtime.worker.WorkerCore.evacuate`), drops
  the layers outside its range (``fleetserve_layer_drops_total``), and stage
  0 runs the group as a pipeline whose activations cross between the actors
  (:mod:`fleetserve.runtime.buddy`). The running requests' KV of the other
  ranges crosses to the stages that keep them: with ``exchange: live`` (the
  ``kunserve`` stack's default) while they decode, their attention for those
  layers running meanwhile on the worker that holds the KV (remote
  attention); with ``exchange: blocking`` before the group runs (through the
  object store).
* :class:`~fleetserve.policy.actions.Restore` → the group stops taking
  requests and its members reload their dropped layers from the host copy
  as pages free up (``fleetserve_layer_restores_total``). Once every member
  holds every layer:

  - with ``live_restore`` (the ``kunserve`` stack's default) and as soon as
    each running request fits a member (largest KV first, to the member
    with the most room, as the simulator splits), the group stops at a step
    boundary and each request moves to a member, which gathers its KV from
    every stage and decodes on (a queued request is recomputed there); the
    members are replicas again. The requests stall while their KV crosses
    (one stop-and-copy each; the simulator copies it live);
  - without it (``kunserve-norestore``), the group pipelines on until its
    last request has finished, then splits.
* :class:`~fleetserve.policy.actions.ActivateSpare` → the runtime has no
  spare pool (every worker serves from the start), so it is counted
  (``fleetserve_kun_actions_total{action="activate_spare"}``) and ignored.

**A group losing a member** (its actor dies): the survivors leave the group,
reload every dropped layer from the host copy (their KV pages are all free
once the group's tables are gone), and become replicas; the group's
requests are dispatched again and re-prefill from the controller's record
of their tokens, as any request of a dead worker does. The policy then sees
the new executors and re-plans from them at its next interval (it may merge
the survivors again). The same recovery runs when a merge itself fails.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fleetserve.errors import ConfigError
from fleetserve.policy.actions import ActivateSpare, DropLayers, Restore
from fleetserve.policy.catalog import KUNSERVE, check_world, kun_only, stack_for
from fleetserve.policy.kunserve import KunServePolicy
from fleetserve.policy.pressure import KunSettings
from fleetserve.runtime.buddy import StageRole
from fleetserve.runtime.views import LiveInstance, Pending
from fleetserve.runtime.worker import WorkerSnap

if TYPE_CHECKING:
    from fleetserve.config import SimConfig
    from fleetserve.runtime.controller import Controller

logger = logging.getLogger(__name__)

SERVING, MERGING, RESTORING, RECOVERING = "serving", "merging", "restoring", "recovering"


def kun_settings(config: SimConfig) -> KunSettings | None:
    """The KunServe settings of a runtime config (None: not a KunServe stack).

    Raises:
        ConfigError: a KunServe-comparison stack whose memory mechanism the
            runtime does not have (``kv-drop``, ``kv-swap``, static
            ``pipeline``; use ``kunserve`` (or its ablations) or a main
            stack), or one without a fixed pool (``cluster.gpus``).
    """
    if not kun_only(config.policy.stack):
        return None
    check_world(config)
    settings = stack_for(config.policy.stack, KUNSERVE).burst.with_overrides(
        **config.kunserve.overrides()
    )
    if settings.pressure != "kunserve" or settings.static_stages != 1:
        raise ConfigError(
            f"policy.stack: {config.policy.stack!r} is a KunServe-simulator baseline; the "
            "runtime serves the 'kunserve' stacks (kunserve, kunserve-blocking, "
            "kunserve-norestore, kunserve-memgreedy) and the main stacks"
        )
    return settings


class GroupInstance(LiveInstance):
    """A buddy group as the dispatch policy sees it: one instance (id: its
    leader's), with the leader's requests and the KV room of its tightest stage.

    A token-block of the group takes ``n_j x kv_heads`` pages on stage ``j``
    (its ``n_j`` layers), so its capacity is the minimum over the stages of
    pages over that.
    """

    __slots__ = ("stages",)

    def __init__(
        self,
        iid: int,
        model: str,
        stages: list[tuple[WorkerSnap, int]],
        pending: list[Pending],
        moving: frozenset[int],
    ) -> None:
        leader = stages[0][0]
        super().__init__(iid, leader.worker_id, model, leader, pending, moving)
        self.stages = stages

    def _stage_blocks(self, pages_of: Any) -> int:
        out = []
        for snap, n_layers in self.stages:
            per_layer = snap.pages_per_block[self.model] // snap.num_layers[self.model]
            out.append(pages_of(snap) // max(1, per_layer * n_layers))
        return min(out)

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(s.worker_id for s, _ in self.stages)

    @property
    def total_blocks(self) -> int:
        return self._stage_blocks(lambda s: s.total_blocks)

    @property
    def free_blocks(self) -> int:
        return self._stage_blocks(lambda s: s.free_blocks)


@dataclass
class KunExec:
    """One executor (implements :class:`~fleetserve.policy.kunserve.KunExecutorView`).

    ``members`` are instance ids in stage order (one: a replica); ``keep``
    each member's layer range; the KV figures come from :attr:`view`, the
    dispatch view the controller builds from the latest snapshots.
    """

    key: int
    members: tuple[int, ...]
    keep: tuple[tuple[int, int], ...]
    replica_kv_bytes: tuple[int, ...]
    phase: str = SERVING
    view: LiveInstance | None = None
    dead: set[int] = field(default_factory=set)

    @property
    def held_layers(self) -> tuple[tuple[int, int], ...]:
        return self.keep

    @property
    def is_group(self) -> bool:
        return len(self.members) > 1

    def _seqs(self) -> list[Any]:
        return self.view.seqs() if self.view is not None else []

    @property
    def kv_used_tokens(self) -> int:
        return sum(s.kv_tokens for s in self._seqs())

    def _queued(self) -> list[Any]:
        q = [s for s in self._seqs() if s.kv_tokens == 0 and not s.migrating]
        return sorted(q, key=lambda s: (s.arrival_s, s.id))

    @property
    def kv_head_tokens(self) -> int:
        q = self._queued()
        return q[0].demand_tokens + 1 if q else 0

    @property
    def kv_queued_tokens(self) -> int:
        return sum(s.demand_tokens + 1 for s in self._queued())

    @property
    def kv_capacity_tokens(self) -> int:
        v = self.view
        return v.total_blocks * v.block_size if v is not None else 0

    @property
    def accepting(self) -> bool:
        return self.phase == SERVING

    @property
    def stable(self) -> bool:
        return self.phase == SERVING


class KunRuntime:
    """Applies :class:`KunServePolicy`'s actions to the controller's workers
    (see the module docstring). One model, every worker a replica at start."""

    def __init__(self, ctl: Controller, settings: KunSettings) -> None:
        models = sorted(ctl.models)
        if len(models) != 1:
            raise ConfigError(
                f"a KunServe runtime serves one replicated model; serve.models has {len(models)}"
            )
        self.ctl = ctl
        self.model = model = models[0]
        self.settings = settings
        self.interval_s = settings.monitor_interval_s
        snaps = {wid: w.snap for wid, w in ctl.workers.items()}
        first = next(iter(snaps.values()))
        self.num_layers = first.num_layers[model]
        param_bytes = self.num_layers * first.layer_bytes[model]
        kv_per_token = first.pages_per_block[model] * first.page_bytes // first.block_size
        self.policy: KunServePolicy = settings.policy_for(
            model, self.num_layers, param_bytes, kv_per_token
        )
        self._keys = itertools.count()
        self.execs: dict[int, KunExec] = {}
        self.iid_of: dict[int, int] = {}  # worker id -> its instance id
        self.wid_of: dict[int, int] = {}
        self.replica_kv: dict[int, int] = {}  # instance id -> KV bytes as a replica
        for wid, w in sorted(ctl.workers.items()):
            iid = w.instances[model]
            self.iid_of[wid], self.wid_of[iid] = iid, wid
            snap = snaps[wid]
            if snap.layers_held[model] != tuple(range(self.num_layers)):
                raise ConfigError(f"worker {wid} does not hold every layer of {model} at start")
            self.replica_kv[iid] = snap.total_blocks * snap.page_bytes
            self._add_replica(iid)
        self.log: list[dict[str, Any]] = []
        self._restoring: dict[int, asyncio.Task[Any]] = {}  # group key -> its restore step
        self._reborn: set[int] = set()  # dead group members respawned before the group split

    # ------------------------------------------------------------ executors
    def _add_replica(self, iid: int) -> KunExec:
        e = KunExec(next(self._keys), (iid,), ((0, self.num_layers),), (self.replica_kv[iid],))
        self.execs[e.key] = e
        return e

    def exec_of(self, iid: int) -> KunExec | None:
        for e in self.execs.values():
            if iid in e.members:
                return e
        return None

    def views(self) -> list[tuple[KunExec, LiveInstance]]:
        """Each executor with a live leader, and its dispatch view (built now)."""
        ctl = self.ctl
        moving = frozenset(t.id for t in ctl.requests.values() if t.moving)
        out = []
        for e in self.execs.values():
            lead_w = ctl.workers[self.wid_of[e.members[0]]]
            if not lead_w.alive or e.dead:
                e.view = None
                continue
            pending = [p for p in lead_w.pending.values() if p.model == self.model]
            if e.is_group:
                stages = [
                    (ctl.workers[self.wid_of[m]].snap, b - a)
                    for m, (a, b) in zip(e.members, e.keep, strict=True)
                ]
                view: LiveInstance = GroupInstance(
                    e.members[0], self.model, stages, pending, moving
                )
            else:
                view = LiveInstance(
                    e.members[0], lead_w.spec.worker_id, self.model, lead_w.snap, pending, moving
                )
            e.view = view
            out.append((e, view))
        return out

    # ---------------------------------------------------------------- ticks
    def tick(self, now: float) -> None:
        """One monitor interval: sample, plan, start what the policy decided."""
        live = [e for e, _v in self.views()]
        self.policy.observe(now, live)
        for act in self.policy.plan(now, live):
            self.ctl.metrics.kun_actions.labels(type(act).__name__).inc()
            if isinstance(act, DropLayers):
                srcs = [self.execs[k] for k in act.sources]
                for e in srcs:
                    e.phase = MERGING
                self._spawn(self.merge(act, srcs))
            elif isinstance(act, Restore):
                e = self.execs[act.executor]
                e.phase = RESTORING
                self._log("restore", e.members, now)
            elif isinstance(act, ActivateSpare):
                logger.info(
                    "KunServe asks for a spare instance (%d bytes short); the runtime has none",
                    act.shortfall_bytes,
                )
        for e in list(self.execs.values()):
            step = self._restoring.get(e.key)
            if e.phase == RESTORING and (step is None or step.done()):
                self._restoring[e.key] = self._spawn(self.restore_step(e))
            broken = self.ctl.workers[self.wid_of[e.members[0]]].snap.group_broken
            if e.is_group and broken and e.phase in (SERVING, RESTORING):
                logger.warning("buddy group %s stopped (%s): recovering", e.members, broken)
                e.phase = RECOVERING
                self._spawn(self.recover(e))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        return self.ctl._spawn(coro)

    def _log(self, what: str, members: tuple[int, ...], now: float, **kw: Any) -> None:
        self.log.append({"t": round(now, 3), "event": what, "members": list(members), **kw})

    def _handle(self, iid: int) -> Any:
        return self.ctl.workers[self.wid_of[iid]].handle

    # ---------------------------------------------------------------- merge
    async def merge(self, act: DropLayers, srcs: list[KunExec]) -> None:
        """Apply a :class:`DropLayers` (see the module docstring)."""
        ctl, model = self.ctl, self.model
        key = next(self._keys)
        stages = tuple(
            (self.wid_of[m], (a, b)) for m, (a, b) in zip(act.members, act.keep, strict=True)
        )
        roles = [StageRole(key, model, i, stages) for i in range(len(stages))]
        handles = [self._handle(m) for m in act.members]
        group = KunExec(
            key,
            tuple(act.members),
            tuple(act.keep),
            tuple(self.replica_kv[m] for m in act.members),
            phase=MERGING,
        )
        for e in srcs:
            self.execs.pop(e.key, None)
            self.policy.forget(e.key)
        self.execs[key] = group
        live = self.settings.exchange == "live"
        t0 = time.perf_counter()
        try:
            handed = await asyncio.gather(
                *(h.evacuate.remote(model, r, live) for h, r in zip(handles, roles, strict=True))
            )
            dropped = await asyncio.gather(
                *(h.become_stage.remote(r) for h, r in zip(handles, roles, strict=True))
            )
            ctl.metrics.drops.inc(sum(dropped))
            if live:
                await asyncio.gather(*(h.set_peers.remote(handles) for h in handles))
            items: list[tuple[Any, int, list[int], int | None]] = []
            exchanged = recomputed = remote = 0
            for i, got in enumerate(handed):
                for state, chunks, own_blocks in got:
                    if live:  # its KV stays on its origin, every layer of it
                        origin = i if state.n_cached > 0 else None
                        blocks = [own_blocks if j == i else 0 for j in range(len(stages))]
                        items.append((state, state.n_cached, blocks, origin))
                        remote += origin is not None
                        continue
                    n_cached, blocks = 0, [0] * len(stages)
                    if chunks:
                        blocks[i] = own_blocks
                        n_cached = state.n_cached
                        for j, chunk in chunks.items():
                            b = await handles[j].stage_import.remote(state.id, n_cached, chunk)
                            if b is None:
                                n_cached = 0
                                break
                            blocks[j] = b
                        if n_cached == 0:
                            await asyncio.gather(
                                *(h.stage_free.remote([state.id]) for h in handles)
                            )
                            blocks = [0] * len(stages)
                            recomputed += 1
                        else:
                            exchanged += 1
                    items.append((state, n_cached, blocks, None))
            pages = await asyncio.gather(*(h.stage_pages.remote() for h in handles))
            await handles[0].lead.remote(
                roles[0], handles, [p[0] for p in pages], [p[1] for p in pages]
            )
            await handles[0].adopt.remote(items)
            stall = time.perf_counter() - t0  # the sources' requests stood still this long
        except Exception as e:
            if not ctl._is_actor_death(e):
                logger.exception("KunServe merge of %s failed", act.members)
            self._spawn(self.recover(group))
            return
        leader_iid = act.members[0]
        leader_w = ctl.workers[self.wid_of[leader_iid]]
        for state, _n, _b, _o in items:
            t = ctl.requests.get(state.id)
            if t is None:
                continue
            if t.instance is not None:
                ctl.workers[ctl.inst_of[t.instance][0]].pending.pop(t.id, None)
            ctl._catch_up(t, state)
            if t.done:
                await ctl._call_quietly(handles[0].abort.remote(t.id))
                continue
            t.instance = leader_iid
            leader_w.pending[t.id] = Pending(
                t.id, t.model, t.arrival, len(t.prompt_ids), t.params.max_tokens, len(t.output_ids)
            )
        if group.dead or group.phase == RECOVERING:  # a member died as the merge ended
            self._spawn(self.recover(group))
            return
        await self._refresh(group.members)
        group.phase = SERVING
        ctl.metrics.kun_exchanged.labels("kv").inc(exchanged)
        ctl.metrics.kun_exchanged.labels("recomputed").inc(recomputed)
        ctl.metrics.kun_exchanged.labels("remote").inc(remote)
        ctl.metrics.kun_exchange_stall.observe(stall)
        self._log(
            "drop",
            group.members,
            ctl.now(),
            keep=[list(r) for r in group.keep],
            layers_dropped=sum(dropped),
            requests=len(items),
            kv_exchanged=exchanged,
            recomputed=recomputed,
            remote_attention=remote,
            stall_s=round(stall, 4),
        )

    # -------------------------------------------------------------- restore
    async def restore_step(self, e: KunExec) -> None:
        """Reload what fits of a restoring group's layers; split it when done."""
        ctl = self.ctl
        handles = [self._handle(m) for m in e.members]
        try:
            got = await asyncio.gather(*(h.restore_layers.remote(self.model) for h in handles))
            ctl.metrics.restores.inc(sum(n for n, _left in got))
            if any(left for _n, left in got):
                return
            moved: dict[str, int] = {}
            if self.settings.live_restore:
                await self._refresh(e.members)
                if not self._fits(e):
                    return  # not every request fits a member yet: pipeline on, try later
                moved = await self._hand_over(e, handles)
            elif not await handles[0].group_idle.remote():
                return
            left_over = await asyncio.gather(*(h.leave_group.remote() for h in handles))
            await self._refresh(e.members)
        except Exception as err:
            if not ctl._is_actor_death(err):
                logger.exception("KunServe restore of %s failed", e.members)
            return  # the dead worker's poll loop starts the recovery
        self._split(e)
        self._log("restored", e.members, ctl.now(), **moved)
        for states in left_over:  # finished in between: normally none
            for st in states:
                t = ctl.requests.get(st.id)
                if t is not None and not t.done:
                    ctl._resume(t)

    def _room(self, e: KunExec) -> dict[int, int]:
        """Free KV pages of each member (its latest snapshot)."""
        return {m: self.ctl.workers[self.wid_of[m]].snap.free_blocks for m in e.members}

    def _place(
        self, e: KunExec, room: dict[int, int], sizes: list[tuple[int, int]]
    ) -> dict[int, int] | None:
        """Live restore's placement (the simulator's ``_try_split``): each
        request, largest KV first, to the member with the most room left;
        ``sizes`` are ``(request id, KV tokens)``. None when one does not
        fit (a request needs its KV and one more token in every layer; a
        member first frees its own stage's share of the request)."""
        ctl = self.ctl
        snap = ctl.workers[self.wid_of[e.members[0]]].snap
        bs = snap.block_size
        per_layer = snap.pages_per_block[self.model] // self.num_layers
        left = dict(room)
        out: dict[int, int] = {}
        for rid, kv in sorted(sizes, key=lambda x: (-x[1], x[0])):
            tb = -(-(kv + 1) // bs)
            m = max(e.members, key=lambda m: (left[m], -m))
            i = e.members.index(m)
            a, b = e.keep[i]
            need = tb * per_layer * (self.num_layers - (b - a))
            if need > left[m]:
                return None
            left[m] -= need
            out[rid] = m
        return out

    def _fits(self, e: KunExec) -> bool:
        """Whether every running request of the group fits a member now."""
        seqs = self.ctl.workers[self.wid_of[e.members[0]]].snap.seqs
        sizes = [(s.id, s.kv_tokens) for s in seqs if s.model == self.model and s.kv_tokens]
        return self._place(e, self._room(e), sizes) is not None

    async def _hand_over(self, e: KunExec, handles: list[Any]) -> dict[str, int]:
        """Live restore: stop the group at a step boundary and move each of
        its requests to a member, which gathers the request's KV from every
        stage and runs it on its full layers (a queued request, or one that
        no longer fits, is recomputed there with its sampler state). The
        requests stall while their KV crosses: a stop-and-copy per request,
        not the multi-stage copy of a migration."""
        ctl = self.ctl
        states = await handles[0].group_handover.remote()
        room = self._room(e)
        running = [st for st in states if st.n_cached > 0]
        place = self._place(e, room, [(st.id, st.n_cached) for st in running]) or {}
        kv = recomputed = 0
        for st in states:
            t = ctl.requests.get(st.id)
            m = place.get(st.id)
            if m is None:  # queued, or the room changed since the check
                m = max(e.members, key=lambda x: (room[x], -x))
            w = ctl.workers[self.wid_of[m]]
            if t is not None:
                ctl._catch_up(t, st)
                t.moving, t.move_dst = "import", w.spec.worker_id
            ok = False
            if st.n_cached > 0 and st.id in place:
                got = await asyncio.gather(
                    *(h.stage_export.remote(st.id, st.n_cached) for h in handles)
                )
                chunks = [c for c in got if c is not None]
                whole = [c for c in chunks if len(c.layers) == self.num_layers]
                if whole:  # a live exchange's victim: its origin holds every layer
                    chunks = whole[:1]  # (a copy in flight elsewhere is dropped with the rest)
                ok = bool(await w.handle.restore_import.remote(st, chunks))
                others = [h for x, h in zip(e.members, handles, strict=True) if x != m]
                await asyncio.gather(*(h.stage_free.remote([st.id]) for h in others))
            else:
                await w.handle.import_request.remote(replace(st, n_cached=0), None)
            kv += ok
            recomputed += not ok and st.n_cached > 0
            if t is None:
                continue
            t.moving = t.move_dst = None
            early, t.early_end = t.early_end, None
            if t.done:  # the client left meanwhile
                await ctl._call_quietly(w.handle.abort.remote(t.id))
                continue
            if t.instance is not None:
                ctl.workers[ctl.inst_of[t.instance][0]].pending.pop(t.id, None)
            t.instance = m
            w.pending[t.id] = Pending(
                t.id, t.model, t.arrival, len(t.prompt_ids), t.params.max_tokens, len(t.output_ids)
            )
            if early is not None:  # it finished on the member before the answer
                ctl._end(t, early, ctl.now())
        return {"requests": len(states), "kv_moved": kv, "recomputed": recomputed}

    async def _refresh(self, members: Any) -> None:
        """Fresh snapshots of ``members``: the new executors' first monitor
        samples must see their new capacity, not the one before the change
        (a stale sample followed by a fresh one reads as a capacity cliff)."""
        ctl = self.ctl
        for m in members:
            w = ctl.workers[self.wid_of[m]]
            try:
                w.snap = await w.handle.snapshot.remote()
            except Exception as err:
                if not ctl._is_actor_death(err):
                    raise

    def _split(self, e: KunExec) -> None:
        self._restoring.pop(e.key, None)
        self.execs.pop(e.key, None)
        self.policy.forget(e.key)
        for m in e.members:
            if (m not in e.dead or m in self._reborn) and self.ctl.workers[self.wid_of[m]].alive:
                self._add_replica(m)
            self._reborn.discard(m)

    def on_worker_back(self, wid: int) -> None:
        """A dead worker was respawned (full layers, empty KV): a replica
        again, now or, while its old group still recovers, when it splits."""
        iid = self.iid_of[wid]
        if self.exec_of(iid) is None:
            self._add_replica(iid)
        else:
            self._reborn.add(iid)

    # ------------------------------------------------------------- failures
    def on_worker_dead(self, wid: int) -> bool:
        """A worker died; True when it was in a group (whose recovery starts
        here, and whose requests are resumed by it, not by the caller)."""
        iid = self.iid_of[wid]
        e = self.exec_of(iid)
        if e is None:
            return False
        if not e.is_group and e.phase != MERGING:
            self.execs.pop(e.key, None)
            self.policy.forget(e.key)
            return False
        e.dead.add(iid)
        if e.phase != RECOVERING and e.phase != MERGING:
            e.phase = RECOVERING
            self._spawn(self.recover(e))
        elif e.phase == MERGING:
            e.phase = RECOVERING  # merge() sees the failure and calls recover()
        return True

    async def recover(self, e: KunExec) -> None:
        """Dissolve a group that lost a member (see the module docstring)."""
        ctl = self.ctl
        e.phase = RECOVERING
        alive = [m for m in e.members if m not in e.dead and ctl.workers[self.wid_of[m]].alive]
        restored = 0
        for m in alive:
            h = self._handle(m)
            try:
                await h.leave_group.remote()
                n, left = await h.restore_layers.remote(self.model)
                restored += n
                if left:
                    logger.error("worker %d: %d layers could not be restored", self.wid_of[m], left)
            except Exception as err:
                if not ctl._is_actor_death(err):
                    logger.exception("recovery of worker %d failed", self.wid_of[m])
                e.dead.add(m)
        ctl.metrics.restores.inc(restored)
        await self._refresh([m for m in alive if m not in e.dead])
        self._split(e)
        self._log("recovered", e.members, ctl.now(), dead=sorted(e.dead), layers_restored=restored)
        members = set(e.members)
        for t in list(ctl.requests.values()):
            if not t.done and t.instance is not None and t.instance in members:
                ctl._resume(t)

    # --------------------------------------------------------------- report
    def cluster_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "settings": {
                "strategy": self.settings.strategy,
                "monitor_interval_s": self.interval_s,
                "restore_min_s": self.settings.restore_min_s,
                "restore_threshold": self.settings.restore_threshold,
            },
            "executors": [
                {
                    "key": e.key,
                    "phase": e.phase,
                    "workers": [self.wid_of[m] for m in e.members],
                    "layers": [list(r) for r in e.keep],
                }
                for e in sorted(self.execs.values(), key=lambda x: x.key)
            ],
            "events": self.log[-50:],
        }
