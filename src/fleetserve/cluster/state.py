"""The cluster state policies read — the same view for the simulator and the runtime.

A backend owns the real objects (the simulator's instance models, the runtime's
worker reports) and exposes them through these read-only protocols. Nothing
here knows about the event heap or virtual time: a view answers "as of now".

Block accounting of one instance (``block_size`` tokens per block)::

    total_blocks = free_blocks + used_blocks
                   └────────┬─────────┘
    available_blocks = free_blocks - reserved_blocks - watermark   (may be negative)
    reserved_blocks  = blocks the waiting queue needs for its prompts
    watermark        = blocks the engine keeps free when admitting (vLLM: 1%)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetserve.cluster.index import ModelIndex


class SeqView(Protocol):
    """A request as a batching policy sees it on one instance."""

    @property
    def id(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def arrival_s(self) -> float: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def generated(self) -> int: ...
    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the request holds now (0 while it waits)."""
        ...

    @property
    def demand_tokens(self) -> int:
        """KV tokens it holds, or needs once (re)admitted: ``max(kv_tokens,
        prompt + generated)`` — Mell's request size ``S_i``."""
        ...

    @property
    def migrating(self) -> bool:
        """Whether a migration of this request is in flight."""
        ...

    @property
    def decoding(self) -> bool:
        """Whether it holds KV and is past its (re)prefill, so it decodes
        (a request re-prefilling after a preemption holds KV and has generated
        tokens, but is not decoding yet)."""
        ...


class InstanceView(Protocol):
    """One serving instance (a model on a GPU or a tensor-parallel GPU group)."""

    @property
    def id(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def gpus(self) -> tuple[int, ...]: ...
    @property
    def tp(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def total_blocks(self) -> int: ...
    @property
    def used_blocks(self) -> int: ...
    @property
    def free_blocks(self) -> int: ...
    @property
    def reserved_blocks(self) -> int: ...
    @property
    def available_blocks(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def decode_steps(self) -> int:
        """Decode iterations completed as of now (monotone; a running request's
        KV grows by one token per step)."""
        ...

    @property
    def idle(self) -> bool:
        """No request queued, prefilling, running or migrating in or out."""
        ...

    def seqs(self) -> list[SeqView]:
        """Requests on this instance: running, prefilling and waiting (not
        those whose state is already moving out)."""
        ...


class TrackedView(InstanceView, Protocol):
    """An instance that reports its changes, so a :class:`ClusterState` can index it
    (:mod:`fleetserve.cluster.index`); the simulator's instances are such views."""

    def avail_bounds(self) -> tuple[int, int]:
        """``(lo, hi)``: ``hi`` is ``available_blocks`` now; until the view next
        reports a change, ``available_blocks`` stays in ``[lo, hi]`` and never
        increases (as virtual time passes, a decode segment only grows)."""
        ...

    def track(self, log: dict[int, Any]) -> None:
        """From now on, write ``log[self.id] = self`` on every change of its
        blocks, queue or batch (``available_blocks``, ``num_running``,
        ``num_waiting``, or the bounds)."""
        ...

    def untrack(self, log: dict[int, Any]) -> None:
        """Stop reporting to ``log``."""
        ...


INDEX_FROM = 16
"""Instances of a model from which :meth:`ClusterState.index_of` keeps an index
(below ``INDEX_FROM // 2`` it drops it again): a scan of a few instances is
cheaper than keeping an index up to date."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` tokens: ceil(tokens / block_size)."""
    return -(-tokens // block_size)


@dataclass(slots=True)
class ClusterState:
    """What policies observe.

    Attributes:
        instances: active instances by id (insertion order = activation order).
        by_model: active instance ids per model, in activation order.
        gpus_active: GPUs currently active.
        gpus_limit: GPUs the pool may use at most (fixed pool size or the
            elastic pool's cap).
        elastic: whether the pool may activate and release GPUs.
        pool_fixed: whether ``gpus_limit`` is hardware that no setting raises
            (the runtime's workers) rather than a planning cap (the simulator's
            ``cluster.max_gpus``): a policy whose plan exceeds a fixed pool
            must make do without the GPUs instead of failing.
        model_tp: tensor-parallel degree of each model's instances.
        gpus_per_node: GPUs per node; GPU ``g`` is on node ``g // gpus_per_node``.
        request_blocks: per model, the KV blocks of one instance that requests
            may fill (total blocks minus the admission watermark): the largest
            request an instance holds, and Mell's per-GPU capacity ``C``.
        block_size: tokens per KV block.

    Indexes. When every instance added is a :class:`TrackedView` (the
    simulator's are), :meth:`index_of` keeps a :class:`ModelIndex` of each model
    with at least :data:`INDEX_FROM` instances, which the dispatch policies use
    instead of a scan (same decisions, cost sub-linear in instances).
    """

    instances: dict[int, InstanceView] = field(default_factory=dict)
    by_model: dict[str, list[int]] = field(default_factory=dict)
    gpus_active: int = 0
    gpus_limit: int = 0
    elastic: bool = False
    pool_fixed: bool = False
    model_tp: dict[str, int] = field(default_factory=dict)
    gpus_per_node: int = 8
    request_blocks: dict[str, int] = field(default_factory=dict)
    block_size: int = 16
    _index: dict[str, ModelIndex] = field(default_factory=dict, repr=False, compare=False)
    _log: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)
    _untracked: int = field(default=0, repr=False, compare=False)

    def instances_of(self, model: str) -> list[InstanceView]:
        """Active instances serving ``model``, in activation order."""
        inst = self.instances
        return [inst[i] for i in self.by_model.get(model, ())]

    def add(self, view: InstanceView) -> None:
        """Register a newly active instance."""
        self.instances[view.id] = view
        self.by_model.setdefault(view.model, []).append(view.id)
        self.gpus_active += len(view.gpus)
        if getattr(view, "track", None) is None:
            self._untracked += 1
            self._drop_indexes()
            return
        idx = self._index.get(view.model)
        if idx is not None:
            view.track(self._log)  # type: ignore[attr-defined]
            idx.add(view)  # type: ignore[arg-type]

    def remove(self, instance_id: int) -> InstanceView:
        """Unregister an instance that was released."""
        view = self.instances.pop(instance_id)
        ids = self.by_model[view.model]
        if ids[-1] == instance_id:
            ids.pop()
        else:
            ids.remove(instance_id)
        self.gpus_active -= len(view.gpus)
        if getattr(view, "track", None) is None:
            self._untracked -= 1
            return view
        idx = self._index.get(view.model)
        if idx is not None:
            self._log.pop(instance_id, None)
            view.untrack(self._log)  # type: ignore[attr-defined]
            idx.remove(instance_id)
            if len(idx) < INDEX_FROM // 2:
                self._drop_index(view.model)
        return view

    def index_of(self, model: str) -> ModelIndex | None:
        """The up-to-date index of ``model``'s instances, or None when they are
        few (or cannot report changes): then scan :meth:`instances_of`."""
        idx = self._index.get(model)
        if idx is None:
            ids = self.by_model.get(model)
            if ids is None or len(ids) < INDEX_FROM or self._untracked:
                return None
            views: list[TrackedView] = [self.instances[i] for i in ids]  # type: ignore[misc]
            for v in views:
                v.track(self._log)
            idx = self._index[model] = ModelIndex(views)
        elif self._log:
            self._refresh()
        return idx if idx.uniform else None

    def _refresh(self) -> None:
        """Re-read every indexed instance that reported a change."""
        index = self._index
        for v in self._log.values():
            index[v.model].refresh(v)
        self._log.clear()

    def _drop_index(self, model: str) -> None:
        idx = self._index.pop(model)
        for e in idx.entries.values():
            self._log.pop(e.id, None)
            e.view.untrack(self._log)

    def _drop_indexes(self) -> None:
        for m in list(self._index):
            self._drop_index(m)

    def check_index(self) -> None:
        """Raise AssertionError if an index disagrees with its instances (testing)."""
        if self._log:
            self._refresh()
        for m, idx in self._index.items():
            assert sorted(idx.entries) == sorted(self.by_model.get(m, ())), m
            assert [e.id for e in sorted(idx.entries.values(), key=lambda e: e.pos)] == (
                self.by_model[m]
            ), m
            idx.check()

    def can_activate(self, tp: int) -> bool:
        """Whether ``tp`` more GPUs may be activated."""
        return self.elastic and self.gpus_active + tp <= self.gpus_limit


def most_available(views: Iterable[InstanceView]) -> InstanceView | None:
    """The instance with the most available blocks (ties: first), or None if empty."""
    best: InstanceView | None = None
    best_avail = 0
    for v in views:
        a = v.available_blocks
        if best is None or a > best_avail:
            best, best_avail = v, a
    return best
