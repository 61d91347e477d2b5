"""The single-model simulator's instance: one model on one GPU (group), as a
one-model sharing group (issue 21's "one instance model", session 29).

The single-model world (:class:`~fleetserve.sim.simulator.Simulator`) keeps
one :class:`GroupInstance` per GPU (group): a one-model
:class:`~fleetserve.sim.group.SharingGroup` (partitioned layout, the group
scheduler of the same name as the batching policy), the multi-LLM world's
instance type, behind a small protocol: ``enqueue``/``schedule``/``truncate``
return the end of the job in flight (pushed as an ``ITER_END`` event for
``version``), ``complete`` ends it and returns the requests that finished,
and the dispatch policies, the cluster index (:mod:`fleetserve.cluster.index`)
and the usage totals (:mod:`fleetserve.sim.usage`) read lazy "as of now"
views between events. It replaced the single-model ``Instance`` class (until
session 28), whose records, time series, moves, cache counters and, under
FCFS, events it reproduced exactly (tested by hypothesis and checked on every
fingerprinted run, ``benchmarks/fingerprints/session29.json.gz``).

Token bookkeeping of one request (``p`` prompt tokens, ``g`` generated)::

    waiting (fresh or preempted): no KV; a prefill processes p + g tokens,
                                  leaves p + g tokens of KV and emits token g+1
    running:                      KV holds p + g - 1 tokens (the newest token
                                  is not cached yet); a decode step caches it
                                  and emits the next one
    finishes                      when g == output_tokens

- **Events.** A one-model group under a temporal scheduler has at most one job
  in flight, so its job token is the instance's ``version``: a job cut short
  (``truncate``) gets a new token and the old event is stale.
- **Scheduling.** Under FCFS and RR the group keeps its running requests bound
  to a step counter (:class:`~fleetserve.sim.batch.BoundBatch`) and runs its
  scheduler's one-model case directly
  (:meth:`~fleetserve.sim.group.SharingGroup.schedule_one`): admission in
  queue order while prompts fit (vLLM's), else the batch decodes. A decode
  segment runs as one job up to the first finish or block shortage
  ("macro-steps", :mod:`fleetserve.sim.batch`; bit for bit an
  iteration-by-iteration run), past a queue whose head does not fit and past
  a preemption when no queued prompt could be admitted later in it (the
  free blocks only shrink until a request finishes). An arrival cuts the
  segment at its iteration in flight (``truncate``). MLFQ and DB keep the
  group's explicit counts (``kv_saved``, ``gen_saved``, updated at job ends).
- **Views.** A :class:`GroupInstance` is its group's
  :class:`~fleetserve.sim.group.HostView` of its model, read at the clock's
  time: as of now, ``k`` iterations of the segment in flight are complete and
  iteration ``k`` is in flight; a running request's KV counts the token
  iteration ``k`` is caching (its block is allocated when the iteration
  starts), so policies read what an iteration-by-iteration run shows at the
  same instant, and a segment's blocks allocated ahead of now count as free.
  ``avail_bounds`` bounds the available blocks until the next change report:
  they only fall while a segment runs, down to its end.
- **Change reports** (for :mod:`fleetserve.cluster.index` and
  :mod:`fleetserve.sim.usage`). Every protocol call reports the instance to
  the logs it is tracked by (:class:`ChangeReports`), so an index re-reads
  only instances that changed.
- **Usage totals.** :meth:`GroupInstance.usage_segment` gives the blocks at
  the end of the job in flight, its end, and the blocks held ahead of any
  time before it, which the totals subtract at their grid times.
- **Activation.** An instance activated during a run waits for its weights
  (``ready_s``): the group is ``loading`` and starts no job until then.
- **Moves.** Llumnix's and Mell's migrations (:mod:`fleetserve.sim.migration`)
  use the group's actions ("Moving a request" in :mod:`fleetserve.sim.group`).
  Every change of the batch, queue or memory happens at an iteration
  boundary (``detach``, ``attach``: between ``complete`` and ``schedule``) or
  mid-segment followed by a truncation (``reserve``, ``unreserve``,
  ``release_held``, ``remove_waiting``, ``enqueue``), so the next boundary
  re-plans exactly where an iteration-by-iteration run would. Reserved and
  kept blocks are the layout's held blocks; the copies in flight slow the
  iterations that start beside them.
- **Prefix caching.** The group's cache ("Prefix caching" in
  :mod:`fleetserve.sim.group`) with the run's counters: a request's blocks
  are its private ones plus the cache entries it references, each entry
  counted once; unreferenced entries are evictable and count as free.
- **Chunked prefill** (FCFS, RR): while a prompt is being prefilled, every
  iteration is mixed (the batch decodes one token beside prompt chunks that
  fill the token budget); a prompt's blocks are allocated in full when it is
  admitted.

Speed (``make bench``, ``benchmarks/sim_speed.py``): see
docs/architecture.md, "Session 29".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from fleetserve.errors import ConfigError
from fleetserve.policy.sharing import BATCHING, GroupScheduler, ServiceStats
from fleetserve.sim.group import HostView, SharingGroup
from fleetserve.sim.kvlayout import make_layout
from fleetserve.sim.prefix_cache import PrefixStats
from fleetserve.sim.seq import Seq

if TYPE_CHECKING:
    from fleetserve.cluster.state import SeqView
    from fleetserve.costmodel import InstanceCost
    from fleetserve.sim.batch import SimClock
    from fleetserve.spec import ModelSpec

__all__ = ["GroupInstance"]

IDLE, BUSY = 0, 1  # ``phase``: no job in flight, and one


class ChangeReports:
    """Change reports of an instance (module docstring): the logs it is
    tracked by (``_logs``, set by the instance) get ``log[id] = instance``
    on every change of its blocks, queue or batch."""

    id: int
    _logs: list[dict[int, Any]]

    def track(self, log: dict[int, Any]) -> None:
        """Write ``log[self.id] = self`` on every change of blocks, queue or batch."""
        self._logs.append(log)

    def untrack(self, log: dict[int, Any]) -> None:
        """Stop reporting to ``log``."""
        self._logs = [g for g in self._logs if g is not log]

    def _changed(self) -> None:
        for log in self._logs:
            log[self.id] = self


class GroupInstance(HostView, ChangeReports):
    """One model on one GPU (group) as a one-model sharing group (see the
    module docstring).

    Args:
        iid: instance id.
        model: model name.
        spec: the model's shape.
        gpus: GPU ids it occupies.
        tp: tensor-parallel degree.
        total_blocks: KV blocks of the instance.
        block_size: tokens per block.
        cost: cost model bound to (model, GPU, tp).
        batching: the batching policy (a group scheduler) by name.
        clock: the simulation clock (for the lazy "as of now" views).
        stats: the model's statistics (schedulers without a one-model case:
            MLFQ, DB).
        max_num_seqs: running batch limit.
        max_batched_tokens: prefill token budget per iteration.
        watermark: fraction of blocks kept free at admission (vLLM's 1%).
        macro_steps: advance fixed decode batches several iterations at once.
        chunked_prefill: split prompts into chunks run together with decodes.
        prefix_caching: share the KV of cached prompt prefixes.
        prefix_stats: the run's prefix-cache counters (None: its own).

    Its views are its group's :class:`~fleetserve.sim.group.HostView` for its
    model, read at the simulation clock's time (``_now``); its fixed facts
    (``id``, ``gpus``, ``tp``, ``block_size``, ``total_blocks``) are plain
    attributes, set once (the class attributes below stand in for the view's
    properties, so that they can be)."""

    id: int = -1
    gpus: tuple[int, ...] = ()
    tp: int = 1
    block_size: int = 1
    total_blocks: int = 0

    def __init__(
        self,
        iid: int,
        model: str,
        spec: ModelSpec,
        gpus: tuple[int, ...],
        tp: int,
        total_blocks: int,
        block_size: int,
        cost: InstanceCost,
        batching: str,
        clock: SimClock,
        *,
        stats: ServiceStats | None = None,
        max_num_seqs: int,
        max_batched_tokens: int,
        watermark: float,
        macro_steps: bool,
        chunked_prefill: bool = False,
        prefix_caching: bool = False,
        prefix_stats: PrefixStats | None = None,
    ) -> None:
        sched: GroupScheduler = BATCHING.get(batching)()
        if sched.spatial:
            raise ConfigError(
                f"batching {batching!r} runs jobs at once (spatial sharing): a one-model "
                "instance runs one job at a time"
            )
        if not sched.one_model and stats is None:
            raise ConfigError(f"batching {batching!r} needs the statistics of {model!r}")
        kv = total_blocks * block_size * spec.kv_bytes_per_token
        layout = make_layout("partitioned", kv, {model: spec}, block_size)
        if layout.max_tokens(model) != total_blocks * block_size:  # pragma: no cover
            raise RuntimeError(f"{model}: the group's layout does not hold {total_blocks} blocks")
        sched.setup({model: stats} if stats is not None else {}, kv)
        self.group = SharingGroup(
            iid,
            gpus,
            tp,
            {model: cost},
            layout,
            sched,
            max_num_seqs=max_num_seqs,
            max_batched_tokens=max_batched_tokens,
            macro_steps=macro_steps,
            watermark=watermark,
            chunked_prefill=chunked_prefill,
            # the running requests bound to a step counter, as the instance's
            # (FCFS and RR; MLFQ and DB keep explicit counts)
            bound=sched.one_model,
            clock=clock,
            prefix_caching=prefix_caching,
            prefix_stats=prefix_stats,
        )
        self._bind(self.group, model)  # the view of its model
        # fixed facts the dispatch view reads at every arrival (available_blocks)
        self._batch = self.group._bound.get(model)
        self._wm_blocks = self.group.watermark_tokens[model] // block_size
        self.group.host = self  # its requests' ``inst`` (sim/migration.py reads it)
        self.id = iid
        self.gpus = gpus
        self.tp = tp
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.cost = cost
        self.clock = clock
        self._ready_s = 0.0
        self.version = -1  # the token of the job in flight (its ITER_END's version)
        self.mig_refs = 0  # migrations in flight that touch it (sim/migration.py counts)
        # preempted while moving out (the group's list: sim/migration.py empties it)
        self.preempted_migrating: list[Seq] = self.group.preempted_migrating
        self._logs: list[dict[int, Any]] = []

    # ---------------------------------------------------------- activation
    @property
    def ready_s(self) -> float:
        """Loading its weights until then (``cluster.activation_s``)."""
        return self._ready_s

    @ready_s.setter
    def ready_s(self, t: float) -> None:
        self._ready_s = t
        if t > self.clock.now:
            self.group.state = "loading"

    # ------------------------------------------------------------------ view
    @property
    def _now(self) -> float:  # type: ignore[override]
        """The views' time: the simulation clock's."""
        return self.clock.now

    @property
    def available_blocks(self) -> int:
        """:attr:`HostView.available_blocks` of its own partition (the same
        number: :meth:`check_integrity` compares them), with the facts fixed
        at its start read once (dispatch reads it at every arrival)."""
        g = self.group
        m = self.model
        b = self._batch
        now = self.clock.now
        ahead = b.ahead(now) if b is not None else g.ahead_blocks(m, now)
        return g.layout.free_token_blocks(m) + ahead - g.queued_blocks[m] - self._wm_blocks

    @property
    def phase(self) -> int:
        return BUSY if self.group.jobs else IDLE

    @property
    def idle(self) -> bool:
        """Nothing queued, prefilling or running, and no move touches it."""
        return self.group.idle and not self.mig_refs

    # the moves' counts, kept by the group (sim/migration.py reads and checks them)
    @property
    def mig_in(self) -> int:
        return self.group.mig_in[self.model]

    @property
    def mig_out(self) -> int:
        return self.group.mig_out[self.model]

    @property
    def copy_load(self) -> float:
        return self.group.copy_load

    @property
    def waiting(self) -> Any:
        return self.group.waiting[self.model]

    @property
    def running(self) -> dict[int, Seq]:
        return self.group.running[self.model]

    def prefilling(self) -> list[Seq]:
        """Requests admitted whose prefill has not completed."""
        return self.group.prefilling(self.model)

    @property
    def num_prefilling(self) -> int:
        """``len(prefilling())``."""
        return self.group.num_prefilling(self.model)

    def seqs(self) -> list[SeqView]:
        """Running, prefilling and waiting requests (as an instance's)."""
        return [*self.running.values(), *self.prefilling(), *self.waiting]

    def usage_segment(self) -> tuple[int, float | None, Callable[[np.ndarray], np.ndarray]]:
        """For the usage totals: ``(blocks, end, ahead)``: the blocks held when
        the job in flight ends (the layout's now), that end (None: no macro
        job), and ``ahead(times)``, the blocks held ahead of each time before it."""
        g = self.group
        m = self.model
        b = self._batch
        if b is None:  # explicit counts (MLFQ, DB): the group's macro jobs
            blocks = g.layout.used_bytes(m) // g.layout.bytes_per_token_block(m)
            return blocks, g.macro_end(m), lambda times: g.ahead_blocks_at(m, times)
        # a bound batch: its segment in flight is the one macro job (its
        # partition's used blocks are what is not free of it)
        blocks = self.total_blocks - g.layout.free_token_blocks(m)
        end = float(b.ends[b.n - 1]) if b.n > 1 else None  # (one iteration: none ahead)
        return blocks, end, b.ahead_at

    def _started(self, evs: list[tuple[float, int]]) -> float | None:
        """The end of the job ``evs`` started (one at most: a temporal one-model
        group runs one job at a time); it becomes the instance's version."""
        if len(evs) > 1:  # pragma: no cover - a one-model temporal group
            raise RuntimeError(f"instance {self.id}: {len(evs)} jobs started at once")
        return self._began(evs[0] if evs else None)

    def _began(self, got: tuple[float, int] | None) -> float | None:
        """A change report, and the end of the job ``got`` started, if any
        (its token becomes the instance's version)."""
        if self._logs:
            self._changed()
        if got is None:
            return None
        end, self.version = got
        return end

    # -------------------------------------------------------------- actions
    def enqueue(self, seq: Seq, now: float, *, head: bool = False) -> float | None:
        """Queue a request; the end of a job it started or cut short, if any."""
        return self._started(self.group.enqueue(seq, now, head=head))

    def truncate(self, now: float) -> float | None:
        return self._started(self.group.truncate(now))

    def schedule(self, now: float) -> float | None:
        """Start the next job (none while loading); its end, if any."""
        g = self.group
        if g.state == "loading" and now >= self._ready_s:
            g.state = "live"
        if g._one is None:  # MLFQ, DB: the scheduler's jobs
            return self._started(g.schedule(now))
        return self._began(g.schedule_one(now))  # FCFS, RR: the one-model case

    # ------------------------------------------------------------- migration
    # The instance's actions for sim/migration.py, on the group ("Moving a
    # request" in sim/group.py). A change of memory or of the iterations'
    # speed cuts the macro job in flight at its iteration in flight, so the
    # next boundary re-plans, as on an instance.
    def add_copy_load(self, delta: float, now: float) -> float | None:
        """A KV copy through these GPUs started (``delta`` > 0) or ended."""
        self.group.add_copy_load(delta)
        return self.truncate(now)

    def can_reserve(self, blocks: int) -> bool:
        """Whether ``blocks`` can be reserved now: free as of now (the
        iteration in flight's growth counted) less the admission watermark."""
        wm = self.group.watermark_tokens[self.model] // self.block_size
        return self.total_blocks - self.used_blocks - wm >= blocks

    def reserve(self, blocks: int, now: float) -> float | None:
        """Reserve ``blocks`` for an incoming KV copy (after :meth:`can_reserve`)."""
        end = self.truncate(now)  # the blocks held ahead of the iteration in flight go back
        self.group.reserve(self.model, blocks)
        return end

    def unreserve(self, blocks: int, now: float) -> float | None:
        """Free the reservation of an aborted incoming copy (memory grows: re-plan)."""
        self.group.unreserve(self.model, blocks)
        return self.truncate(now)

    def release_held(self, blocks: int, now: float, seq: Seq | None = None) -> float | None:
        """Free the blocks a detached request kept for its final copy."""
        self.group.release_held(self.model, blocks, seq)
        return self.truncate(now)

    def remove_waiting(self, seq: Seq, now: float) -> float | None:
        """Take a queued request out (it moves elsewhere)."""
        self.group.remove_waiting(seq)
        return self.truncate(now)

    def detach(self, seq: Seq, *, keep_blocks: bool) -> int:
        """Take running ``seq`` out at a boundary; the KV tokens it held."""
        kv = self.group.detach(seq, keep_blocks=keep_blocks)
        self._changed()
        return kv

    def attach(self, seq: Seq, kv: int, blocks: int) -> None:
        """Add ``seq`` with its copied KV to the running batch at a boundary."""
        self.group.attach(seq, kv, blocks, self.clock.now)
        self._changed()

    def complete(self, now: float) -> list[Seq]:
        """End the job in flight (its ``ITER_END`` for ``version``)."""
        done = self.group.complete(self.version, now)
        if self._logs:
            self._changed()
        return done

    def check_integrity(self) -> None:
        self.group.check_integrity()
        view = HostView(self.group, self.model, self.clock.now)
        if view.available_blocks != self.available_blocks:
            raise AssertionError(
                f"instance {self.id}: available blocks {self.available_blocks}, "
                f"its group's view {view.available_blocks}"
            )
