"""Llumnix-style load balancing by live migration (Mell §VIII's "LB" baseline).

Mell compares against "LB: a scheduling algorithm [that] dispatches incoming
requests to the GPU with the least memory [use] (i.e., worst fit) and achieves
Load-Balancing via request migration by transferring the KV cache between
GPUs, adopted by Llumnix", and describes Llumnix's scheduling as "swapping
with the lowest load and highest load repeatedly" (§III). Dispatch is
``worst_fit`` (:mod:`fleetserve.policy.dispatch`); this module is the
migration half, following Llumnix (Sun et al., OSDI'24) and its public scheduler:

* **Load = freeness** (Llumnix's virtual usage seen from the free side): the
  KV blocks an instance still has free per request it serves,
  ``available_blocks / (num_running + num_waiting)``, and ``inf`` for an
  instance serving nothing. ``available_blocks`` already subtracts the blocks
  the waiting queue's prompts need and the admission watermark, so this is
  Llumnix's ``remaining_steps`` load (free blocks minus all waiting requests'
  blocks, over running plus waiting requests): roughly how many more decode
  steps each request can take before the instance must preempt. Counting
  waiting requests makes a memory-starved instance (a queue that cannot be
  admitted) a source even when few requests run. It can be negative.
* **Pairing.** Every epoch (``interval_s``, ``migration.epoch_s`` from the
  config), per model: sources are the instances whose freeness is below
  ``migrate_out_threshold`` (Llumnix's ``MIGRATE_OUT_THRESHOLD``, 3 blocks per
  request by default), destinations those above it. Sources sorted by
  increasing freeness are paired with destinations sorted by decreasing
  freeness: the least free with the freest, the second with the second, ...
  (ties: lower instance id first). With ``migrate_out_threshold=None`` every
  instance is a candidate on both sides: the instances sorted by freeness are
  paired from both ends (``i``-th lowest with ``i``-th highest), for pairs
  whose source is strictly less free than its destination. Instances of
  different models are never paired.
* **Which request.** Among the source's running requests (holding KV and past
  their (re)prefill: ``decoding``; before session 24 ``kv_tokens > 0 and
  generated > 0``, which also let a request re-prefilling after a preemption
  through, a move the mechanism then refused) that are not
  migrating, the cheapest to move: the fewest KV tokens (ties: lowest request
  id) whose move passes the checks below (Llumnix's short-job-first
  selection). One move per pair per epoch.
* **No overshoot, gap shrinks** (Llumnix's ``0 < diff_after < diff_before``,
  here with ``<=`` so that a move reaching exact balance is allowed). With
  ``b`` the request's ``demand_tokens`` in blocks of each instance,
  ``A`` the available blocks and ``n`` the request count of each side::

      src_after = (A_src + b_src) / (n_src - 1)      (inf when n_src == 1)
      dst_after = (A_dst - b_dst) / (n_dst + 1)
      move iff  src_after <= dst_after
           and  dst_after - src_after < dst_before - src_before
           and  dst_after >= migrate_out_threshold    (when a threshold is set)

  The last line is Llumnix's constraint that a destination is not pushed
  into the source range. A source serving one request never moves it (it
  would become infinitely free). ``src_after`` grows and ``dst_after`` shrinks
  with ``b``, so the scan by increasing size stops at the first request that
  overshoots or pushes the destination below the threshold; it skips those
  too small to shrink the gap (possible only when ``A_src`` is negative).
* **Instances in a migration are skipped**: any of their requests is
  ``migrating``, or a move this policy planned earlier has not started yet
  (its request is still on its source and not migrating: a mechanism may
  postpone moves). Such a planned move is forgotten once its request
  migrates, leaves its source, finishes or an end instance is released.

Moves are ``Migrate(request_id, dst, mode=None)``: the configured mechanism
decides KV or token transfer (the ``llumnix`` stack configures ``kv``, Llumnix's
live migration). The cost per epoch is O(I log I) for I instances, plus a
scan of each paired source's requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from fleetserve.cluster.state import ClusterState, InstanceView, SeqView, blocks_for
from fleetserve.policy.actions import Migrate
from fleetserve.policy.base import MIGRATION, MigrationPolicy

if TYPE_CHECKING:
    from fleetserve.config import SimConfig

DEFAULT_MIGRATE_OUT_THRESHOLD = 3.0
"""Llumnix's default ``MIGRATE_OUT_THRESHOLD``: 3 free blocks per request."""


def freeness(inst: InstanceView) -> float:
    """Free KV blocks per request of ``inst`` (``inf`` when it serves none).

    ``available_blocks / (num_running + num_waiting)``; may be negative when
    the waiting queue needs more blocks than are free.
    """
    n = inst.num_running + inst.num_waiting
    return math.inf if n == 0 else inst.available_blocks / n


def freeness_after(inst: InstanceView, delta_blocks: int, delta_requests: int) -> float:
    """Freeness of ``inst`` once ``delta_blocks`` are freed (negative: taken)
    and ``delta_requests`` requests join (negative: leave)."""
    n = inst.num_running + inst.num_waiting + delta_requests
    return math.inf if n <= 0 else (inst.available_blocks + delta_blocks) / n


def _running(seq: SeqView) -> bool:
    return seq.decoding and not seq.migrating


@MIGRATION.register("llumnix")
class Llumnix(MigrationPolicy):
    """Pair the least and most free instances of each model; move one request per pair.

    See the module docstring for the rules.

    Args:
        interval_s: epoch length (seconds between plans).
        migrate_out_threshold: freeness (blocks per request) below which an
            instance is a source and above which it is a destination; None
            pairs all instances from both ends of the freeness order.
    """

    def __init__(
        self,
        interval_s: float | None = 0.5,
        migrate_out_threshold: float | None = DEFAULT_MIGRATE_OUT_THRESHOLD,
        **params: Any,
    ) -> None:
        super().__init__(**params)
        self.interval_s = interval_s
        self.migrate_out_threshold = migrate_out_threshold
        # request id -> (src, dst) of moves planned but not seen starting yet.
        self._planned: dict[int, tuple[int, int]] = {}

    @classmethod
    def from_config(cls, config: SimConfig) -> Self:
        """Epoch from ``migration.epoch_s``; Llumnix's default threshold."""
        return cls(interval_s=config.migration.epoch_s)

    def plan(self, state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        busy = self._busy_instances(state)
        actions: list[Any] = []
        for model in sorted(state.by_model):
            views = [v for v in state.instances_of(model) if v.id not in busy]
            for src, dst in self._pairs(views):
                seq = self._choose(src, dst)
                if seq is not None:
                    actions.append(Migrate(seq.id, dst.id))
                    self._planned[seq.id] = (src.id, dst.id)
        return actions

    def on_finish(self, request_id: int, instance_id: int, now: float) -> None:
        self._planned.pop(request_id, None)

    def on_release(self, instance_id: int, now: float) -> None:
        for rid, (src, dst) in list(self._planned.items()):
            if instance_id in (src, dst):
                del self._planned[rid]

    # ------------------------------------------------------------------ helpers

    def _busy_instances(self, state: ClusterState) -> set[int]:
        """Instances with a request migrating, or an end of a planned move not started."""
        busy: set[int] = set()
        waiting_on: dict[int, set[int]] = {}
        for rid, (src, _dst) in self._planned.items():
            waiting_on.setdefault(src, set()).add(rid)
        still: set[int] = set()
        for inst in state.instances.values():
            planned_here = waiting_on.get(inst.id, set())
            for s in inst.seqs():
                if s.migrating:
                    busy.add(inst.id)
                elif s.id in planned_here:
                    still.add(s.id)
        for rid in list(self._planned):
            if rid in still:
                src, dst = self._planned[rid]
                busy.update((src, dst))
            else:
                del self._planned[rid]
        return busy

    def _pairs(self, views: Sequence[InstanceView]) -> list[tuple[InstanceView, InstanceView]]:
        """(source, destination) pairs, least free source with freest destination first."""
        free = {v.id: freeness(v) for v in views}
        asc = sorted(views, key=lambda v: (free[v.id], v.id))
        t = self.migrate_out_threshold
        if t is None:
            half = len(asc) // 2
            srcs = asc[:half]
            dsts = sorted(asc[len(asc) - half :], key=lambda v: (-free[v.id], v.id))
        else:
            srcs = [v for v in asc if free[v.id] < t]
            dsts = sorted((v for v in views if free[v.id] > t), key=lambda v: (-free[v.id], v.id))
        return [(s, d) for s, d in zip(srcs, dsts, strict=False) if free[s.id] < free[d.id]]

    def _choose(self, src: InstanceView, dst: InstanceView) -> SeqView | None:
        """The cheapest running request of ``src`` whose move to ``dst`` passes the checks."""
        before = freeness(dst) - freeness(src)
        t = self.migrate_out_threshold
        for seq in sorted(
            (s for s in src.seqs() if _running(s)), key=lambda s: (s.kv_tokens, s.id)
        ):
            src_after = freeness_after(src, blocks_for(seq.demand_tokens, src.block_size), -1)
            dst_after = freeness_after(dst, -blocks_for(seq.demand_tokens, dst.block_size), 1)
            if src_after > dst_after or (t is not None and dst_after < t):
                return None  # bigger requests overshoot (or sink the destination) more
            if dst_after - src_after < before:
                return seq
        return None
