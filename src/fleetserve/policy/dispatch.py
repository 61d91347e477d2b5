"""Request dispatch: round-robin, least-loaded, fewest requests, Best- and Worst-Fit (Mell §VIII).

Every policy here follows one rule for what happens when no active instance
of the request's model has room for its prompt (``available_blocks`` at least
the prompt's blocks): activate a new GPU (group) when the pool may grow
(Mell's elastic model: "activate a new GPU if no GPU can handle an incoming
request"), otherwise pick among all instances with the policy's own
criterion, and the request waits in that instance's queue. A model with no
instance at all on a full pool is rejected with a reason.

Cost. On a cluster that keeps indexes (:meth:`ClusterState.index_of`: the
simulator's, from :data:`~fleetserve.cluster.state.INDEX_FROM` instances of a
model) each policy asks the model's :class:`~fleetserve.cluster.index.ModelIndex`,
which reads a few instances instead of all; otherwise it scans
:meth:`ClusterState.instances_of`. Both give the same decision, ties included
(tests/test_dispatch_index.py checks it against the scans below).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fleetserve.cluster.state import ClusterState, InstanceView, blocks_for, most_available
from fleetserve.policy.actions import ActivateGpu, Dispatch, DispatchAction, Reject
from fleetserve.policy.base import DISPATCH, DispatchPolicy
from fleetserve.workload.request import Request


def _fits(view: InstanceView, req: Request) -> bool:
    return view.available_blocks >= blocks_for(req.prompt_tokens, view.block_size)


def _no_room(
    state: ClusterState, req: Request, fallback: Callable[[], InstanceView | None]
) -> DispatchAction:
    """No instance has room: a new GPU if the pool may grow, else ``fallback()``'s
    queue (computed only then), else a rejection."""
    tp = state.model_tp.get(req.model, 1)
    if state.can_activate(tp):
        return ActivateGpu(req.model, tp, req.id)
    view = fallback()
    if view is None:
        return Reject(req.id, f"no instance of {req.model} and the GPU pool is full")
    return Dispatch(req.id, view.id)


@DISPATCH.register("round_robin")
class RoundRobin(DispatchPolicy):
    """Cycle over the model's instances (vLLM behind a round-robin load balancer).

    The cycle skips instances without room for the prompt; when none has room,
    the next instance in the cycle takes it (or a new GPU, on an elastic pool).
    """

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._cursor: dict[str, int] = {}

    def dispatch(
        self, state: ClusterState, req: Request, now: float, rng: np.random.Generator
    ) -> DispatchAction:
        idx = state.index_of(req.model)
        if idx is not None:
            n = len(idx)
            start = self._cursor.get(req.model, 0) % n
            got = idx.first_fit(blocks_for(req.prompt_tokens, idx.block_size), start)
            if got is not None:
                self._cursor[req.model] = start + (got[1] - start) % n + 1
                return Dispatch(req.id, got[0].id)
            action = _no_room(state, req, lambda: idx.nth(start))
            if isinstance(action, Dispatch):
                self._cursor[req.model] = start + 1
            return action
        views = state.instances_of(req.model)
        n = len(views)
        start = self._cursor.get(req.model, 0) % n if n else 0
        for k in range(n):
            v = views[(start + k) % n]
            if _fits(v, req):
                self._cursor[req.model] = start + k + 1
                return Dispatch(req.id, v.id)
        action = _no_room(state, req, lambda: views[start] if n else None)
        if isinstance(action, Dispatch):
            self._cursor[req.model] = start + 1
        return action


@DISPATCH.register("least_loaded")
class LeastLoaded(DispatchPolicy):
    """Fewest requests (running + waiting) among instances with room; ties: lowest id."""

    def dispatch(
        self, state: ClusterState, req: Request, now: float, rng: np.random.Generator
    ) -> DispatchAction:
        idx = state.index_of(req.model)
        if idx is not None:
            got = idx.least_loaded(blocks_for(req.prompt_tokens, idx.block_size))
            if got is not None:
                return Dispatch(req.id, got.id)
            return _no_room(state, req, idx.least_loaded_any)
        views = state.instances_of(req.model)
        fitting = [v for v in views if _fits(v, req)]
        if fitting:
            return Dispatch(req.id, _least_loaded(fitting).id)
        return _no_room(state, req, lambda: _least_loaded(views) if views else None)


@DISPATCH.register("fewest_requests")
class FewestRequests(DispatchPolicy):
    """Fewest requests (running + waiting) whatever the free memory; ties:
    lowest id. A least-connections load balancer: unlike ``least_loaded`` it
    does not prefer instances with room for the prompt (the request waits in
    the chosen queue). The multi-LLM stacks dispatch this way among the
    groups hosting a service (as SeaLLM's and MuxServe's simulators do)."""

    def dispatch(
        self, state: ClusterState, req: Request, now: float, rng: np.random.Generator
    ) -> DispatchAction:
        views = state.instances_of(req.model)
        if views:
            return Dispatch(req.id, _least_loaded(views).id)
        return _no_room(state, req, lambda: None)


def _least_loaded(views: Sequence[InstanceView]) -> InstanceView:
    return min(views, key=lambda v: (v.num_running + v.num_waiting, v.id))


@DISPATCH.register("best_fit")
class BestFit(DispatchPolicy):
    """Mell's BF: the instance with the least but sufficient available KV memory.

    "Sufficient" means room for the prompt's KV blocks now (the request's KV
    grows later; growth past the GPU is handled by the instance's preemption).
    Ties go to the earliest-activated instance.
    """

    def dispatch(
        self, state: ClusterState, req: Request, now: float, rng: np.random.Generator
    ) -> DispatchAction:
        idx = state.index_of(req.model)
        if idx is not None:
            got = idx.best_fit(blocks_for(req.prompt_tokens, idx.block_size))
            if got is not None:
                return Dispatch(req.id, got.id)
            return _no_room(state, req, idx.most_available)
        views = state.instances_of(req.model)
        best: InstanceView | None = None
        best_avail = 0
        for v in views:
            avail = v.available_blocks
            if avail >= blocks_for(req.prompt_tokens, v.block_size) and (
                best is None or avail < best_avail
            ):
                best, best_avail = v, avail
        if best is not None:
            return Dispatch(req.id, best.id)
        return _no_room(state, req, lambda: most_available(views))


@DISPATCH.register("worst_fit")
class WorstFit(DispatchPolicy):
    """Mell's WF (and Llumnix's dispatch): the instance with the most available KV memory."""

    def dispatch(
        self, state: ClusterState, req: Request, now: float, rng: np.random.Generator
    ) -> DispatchAction:
        idx = state.index_of(req.model)
        best = (
            idx.most_available()
            if idx is not None
            else most_available(state.instances_of(req.model))
        )
        if best is not None and _fits(best, req):
            return Dispatch(req.id, best.id)
        return _no_room(state, req, lambda: best)
