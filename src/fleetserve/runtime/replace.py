"""SeaLLM's adaptive replacement on live workers: the mechanism, no decisions.

A multi-LLM stack with ``replacement`` (``seallm``) places its services once
at start (:mod:`fleetserve.runtime.plan`) and, as the simulator does
(:class:`fleetserve.sim.multi.MultiSimulator`), again every interval:

1. **Measure.** At the end of interval ``I_t`` the controller's requests give
   ``M_real``, the SLO attainment of the requests whose deadline (arrival +
   ``multi.slo_scale`` x their ideal execution time, the cost model's on the
   placement's GPU, as the simulator's deadlines) fell in the interval: met
   when they finished by it. A request still running counts with its
   ``max_tokens`` as its length.
2. **Adapt.** Equation 8 (:class:`~fleetserve.policy.replacement.AdaptiveInterval`,
   the policy's) turns ``|M_real - M_est| / M_est`` into ``I_{t+1}``.
3. **Search.** The injected :class:`~fleetserve.runtime.plan.SharingReplanner`
   (the simulator's search) places the services as the requests of the last
   interval show them, on the running workers, and estimates the plan.
4. **Switch** (:meth:`Replacer.switch`), when a worker's set of models
   changes. The new plan's GPUs are matched to workers so that as few models
   as possible move (a GPU whose set a worker already hosts goes to it, then
   to the worker with the largest overlap: the search numbers GPUs freely).
   Then, on every worker, concurrently:

   - a model it gains is loaded at once when its weights fit the arena
     beside what it holds, else once the models it loses are gone; its
     instance serves from then on (requests of a model with no serving
     instance wait at the controller: they are not refused);
   - a model it loses stops taking requests; its requests move to another
     instance of the model by token migration (the destination re-prefills
     them, exact continuation) when one serves, else they finish where they
     are; once none is left the model is unloaded, its pages become KV.

   A switch runs in the background while the workers serve; an interval that
   ends during a switch plans nothing (the next one does).

Choices where the paper leaves the runtime open, taken here as a careful
implementer would: the worker matching above; token migration for the moved
requests (the simulator's move before the mechanism family: its ``kv``
copies need the destination's weights, which are loading in the same
switch); a search that runs in a thread, so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fleetserve.policy.replacement import AdaptiveInterval
from fleetserve.policy.sharing import ServiceStats
from fleetserve.workload.request import Request

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from fleetserve.runtime.controller import Controller, Tracked
    from fleetserve.runtime.plan import SharingPlacement, SharingReplanner

__all__ = ["Replacer", "match_workers"]

logger = logging.getLogger(__name__)


def match_workers(
    current: Sequence[frozenset[str]], slots: Sequence[frozenset[str]]
) -> list[frozenset[str]]:
    """The new plan's per-GPU service sets ``slots`` given to the workers
    whose sets are ``current`` (one slot each; a worker without a slot hosts
    nothing): identical sets first, then the largest overlap (ties: the
    lowest worker id). Returns each worker's new set."""
    n = len(current)
    if len(slots) > n:
        raise ValueError(f"the plan uses {len(slots)} GPUs; {n} workers run")
    out: list[frozenset[str] | None] = [None] * n
    left = list(range(len(slots)))
    for i in list(left):  # identical sets keep their worker
        w = next((w for w in range(n) if out[w] is None and current[w] == slots[i]), None)
        if w is not None:
            out[w] = slots[i]
            left.remove(i)
    for i in left:
        w = max(
            (w for w in range(n) if out[w] is None),
            key=lambda w: (len(current[w] & slots[i]), -w),
        )
        out[w] = slots[i]
    return [x if x is not None else frozenset() for x in out]


class Replacer:
    """The controller's side of SeaLLM's adaptive replacement (module docstring).

    Args:
        ctl: the controller (its workers host ``placement.workers``).
        placement: the placement made at start.
        planner: the re-placement search.
        sources: each served name's engine model (built-in name or folder).
    """

    def __init__(
        self,
        ctl: Controller,
        placement: SharingPlacement,
        planner: SharingReplanner,
        sources: Mapping[str, str],
    ) -> None:
        m = ctl.cfg.multi
        self.ctl = ctl
        self.planner = planner
        self.sources = dict(sources)
        self.interval = AdaptiveInterval(
            m.replacement_interval_s, m.replacement_beta, m.min_interval_s, m.max_interval_s
        )
        self.slo_scale = m.slo_scale
        self.stats: dict[str, ServiceStats] = dict(placement.stats)
        self.m_est = placement.estimate
        self.last = 0.0
        self.next_at = self.interval.interval_s
        self.seen: list[Tracked] = []  # requests since the oldest window still needed
        self.switching: asyncio.Task[Any] | None = None
        self.searching = False
        self.log: list[dict[str, Any]] = []
        self.switches = 0

    # ------------------------------------------------------------- measure
    def on_request(self, t: Tracked) -> None:
        self.seen.append(t)

    def _length(self, t: Tracked) -> int:
        return len(t.output_ids) if t.done else max(len(t.output_ids), t.params.max_tokens)

    def _deadline(self, t: Tracked) -> float:
        ideal = self.planner.ideal_s(t.model, len(t.prompt_ids), self._length(t))
        return t.arrival + self.slo_scale * ideal

    def attainment(self, t0: float, t1: float) -> float | None:
        """``M_real``: the share of requests with their deadline in
        ``(t0, t1]`` that finished by it (None: no such request)."""
        met = total = 0
        for t in self.seen:
            dl = self._deadline(t)
            if t0 < dl <= t1:
                total += 1
                ok = t.done and t.finish_reason in ("stop", "length")
                met += ok and t.t_done is not None and t.t_done <= dl
        return met / total if total else None

    def window(self, now: float, window_s: float) -> list[Request]:
        """The requests that arrived in the last ``window_s`` seconds."""
        lo = now - window_s
        out = []
        for i, t in enumerate(x for x in self.seen if x.arrival > lo):
            out.append(Request(i, t.model, t.arrival, len(t.prompt_ids), max(1, self._length(t))))
        return out

    # --------------------------------------------------------------- ticks
    def tick(self, now: float) -> None:
        """Called on the controller's ticks: at an interval's end, measure,
        adapt, and search (in a thread); its plan is then switched to."""
        if now < self.next_at or self.searching:
            return
        if self.switching is not None and not self.switching.done():
            self.next_at = now + self.interval.interval_s  # a switch is still on
            return
        window_s = self.interval.interval_s
        m_real = self.attainment(self.last, now)
        if m_real is not None and self.m_est is not None:
            nxt = self.interval.update(m_real, self.m_est)
        else:
            nxt = window_s
        hist = self.window(now, window_s)
        entry: dict[str, Any] = {
            "time_s": round(now, 3),
            "interval_s": window_s,
            "next_interval_s": nxt,
            "m_real": m_real,
            "m_est": self.m_est,
            "history_requests": len(hist),
        }
        self.last = now
        self.next_at = now + nxt
        # kept: what the next interval measures (deadlines after now) or
        # still runs; the next window's arrivals are all after now
        self.seen = [t for t in self.seen if not t.done or self._deadline(t) > now]
        self.log.append(entry)
        if hist:
            self.searching = True
            self.ctl._spawn(self._search(hist, window_s, entry))

    async def _search(self, hist: list[Request], window_s: float, entry: dict[str, Any]) -> None:
        try:
            plan, est, stats = await asyncio.to_thread(self.planner.place, hist, window_s)
        except Exception:
            logger.exception("SeaLLM re-placement search failed; the placement stays")
            return
        finally:
            self.searching = False
        slots: dict[int, frozenset[str]] = {}
        for g in plan.groups:
            for gid in g.gpus:
                slots[gid] = frozenset(g.services)
        ctl = self.ctl
        wids = sorted(ctl.workers)
        current = [frozenset(ctl.workers[w].instances) for w in wids]
        try:
            new = match_workers(current, [slots[g] for g in sorted(slots)])
        except ValueError as e:
            logger.warning("SeaLLM re-placement skipped: %s", e)
            return
        self.m_est = est
        entry["m_est_next"] = est
        moves = sum(len(a ^ b) for a, b in zip(current, new, strict=True))
        entry["models_moved"] = moves
        ctl.metrics.replacements.labels("switched" if moves else "unchanged").inc()
        self.stats.update(stats)
        if moves:
            target = {w: tuple(sorted(s)) for w, s in zip(wids, new, strict=True)}
            entry["plan"] = {str(w): list(s) for w, s in target.items()}
            self.switching = ctl._spawn(self.switch(target))

    # -------------------------------------------------------------- switch
    def _services(self, models: Sequence[str]) -> tuple[tuple[str, ServiceStats], ...]:
        return tuple((m, self.stats[m]) for m in models if m in self.stats)

    async def switch(self, target: Mapping[int, Sequence[str]]) -> None:
        """Bring every worker to its models in ``target`` (module docstring)."""
        ctl = self.ctl
        self.switches += 1
        await asyncio.gather(
            *(self._switch_worker(w, tuple(target.get(w, ()))) for w in sorted(ctl.workers))
        )
        ctl._redispatch_deferred()
        logger.info("SeaLLM re-placement done: %s", dict(target))

    async def _switch_worker(self, wid: int, models: tuple[str, ...]) -> None:
        ctl = self.ctl
        w = ctl.workers[wid]
        gone = [m for m in w.instances if m not in models]
        new = [m for m in models if m not in w.instances]
        if not gone and not new:
            return
        svc = tuple(self.stats.items())  # the engine's scheduler reads those it hosts
        later = []
        for m in new:  # what fits beside the models still held, now
            if not await self._load(wid, m, svc):
                later.append(m)
        for m in gone:
            await self._retire(wid, m, svc)
        for m in later:
            if not await self._load(wid, m, svc):
                logger.error("worker %d: %s does not fit even alone; not hosted", wid, m)
        w.spec = replace(
            w.spec,
            models=tuple(self.sources[m] for m in w.instances),
            served=tuple(w.instances),
            services=self._services(tuple(w.instances)),
        )

    async def _load(self, wid: int, model: str, svc: Any) -> bool:
        """Load ``model`` on worker ``wid`` and serve it there; False when its
        weights do not fit the arena now."""
        ctl = self.ctl
        w = ctl.workers[wid]
        try:
            took = float(await w.handle.load_model.remote(self.sources[model], svc))
        except Exception as e:
            if ctl._is_actor_death(e):
                return True  # nothing to wait for: its restart loads its spec's models
            raise
        if took < 0:
            return False
        iid = ctl.add_instance(wid, model)
        ctl.metrics.model_loads.observe(took)
        logger.info("worker %d: %s loaded in %.3f s (instance %d)", wid, model, took, iid)
        ctl._redispatch_deferred()
        return True

    async def _retire(self, wid: int, model: str, svc: Any) -> None:
        """Stop serving ``model`` on ``wid``: move or finish its requests, unload it."""
        ctl = self.ctl
        w = ctl.workers[wid]
        iid = w.instances[model]
        ctl.active.discard(iid)  # no new request goes there
        while True:
            if not w.alive:
                return
            mine = [
                t
                for t in ctl.requests.values()
                if not t.done and t.instance == iid and not t.moving
            ]
            others = [
                i
                for i in ctl.active
                if i != iid and ctl.inst_of[i][1] == model and ctl.workers[ctl.inst_of[i][0]].alive
            ]
            if others:
                for t in mine:
                    dst = min(others, key=lambda i: ctl.load_of(i))
                    t.moving = "export"
                    await ctl._move(t, iid, dst, "token")
            busy = any(not t.done and t.instance == iid for t in ctl.requests.values()) or any(
                p.model == model for p in w.pending.values()
            )
            if not busy:
                try:
                    freed = await w.handle.unload_model.remote(model, svc)
                except Exception as e:
                    if ctl._is_actor_death(e):
                        return
                    raise
                if freed >= 0:  # else a request of it is still on the worker
                    ctl.remove_instance(iid)
                    return
            await asyncio.sleep(ctl.serve.tick_s)

    # -------------------------------------------------------------- report
    def cluster_json(self) -> dict[str, Any]:
        return {
            "interval_s": self.interval.interval_s,
            "next_at_s": round(self.next_at, 3),
            "m_est": self.m_est,
            "switches": self.switches,
            "switching": self.switching is not None and not self.switching.done(),
            "events": self.log[-20:],
        }
