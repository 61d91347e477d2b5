"""A one-model sharing group behind the single-model simulator's instance
protocol: the next step of issue 21's "one instance model".

The single-model world (:class:`~fleetserve.sim.simulator.Simulator`) keeps
one :class:`~fleetserve.sim.instance.Instance` per GPU (group) and drives it
with a small protocol: ``enqueue``/``schedule``/``truncate`` return the end of
the iteration in flight (pushed as an ``ITER_END`` event for ``version``),
``complete`` ends it and returns the requests that finished, and the dispatch
policies, the cluster index (:mod:`fleetserve.cluster.index`) and the usage
totals (:mod:`fleetserve.sim.usage`) read lazy "as of now" views between
events. :class:`GroupInstance` speaks that protocol over a one-model
:class:`~fleetserve.sim.group.SharingGroup` (partitioned layout, the group
scheduler of the same name as the batching policy: FCFS or RR):

- **Events.** A one-model group under a temporal scheduler has at most one job
  in flight, so its job token is the instance's ``version``: a job cut short
  (``truncate``) gets a new token and the old event is stale, as an
  instance's truncated segment gets a new version.
- **Views.** A :class:`GroupInstance` is its group's
  :class:`~fleetserve.sim.group.HostView` (the multi-LLM world's dispatch
  view) of its model, read at the clock's time: it counts blocks as an
  instance does (a macro job's blocks allocated ahead of now count as free).
  ``avail_bounds`` bounds it until the next change report: it only falls
  while a macro job runs, down to the job's end.
- **Change reports.** Every protocol call reports the instance to the logs it
  is tracked by (conservative: the group changes at every call).
- **Scheduling.** The group runs its scheduler's one-model case directly
  (admission in queue order, else the batch's decode:
  :meth:`~fleetserve.sim.group.SharingGroup.schedule_one`), as an instance
  runs it.
- **Usage totals.** :meth:`GroupInstance.usage_segment` gives the blocks at
  the end of the job in flight, its end, and the blocks held ahead of any
  time before it, which the totals subtract at their grid times.
- **Activation.** An instance activated during a run waits for its weights
  (``ready_s``): the group is ``loading`` and starts no job until then.

Under FCFS and RR (with or without chunked prefill), the group keeps the running
requests *bound* to a step counter (``SharingGroup(bound=True)``: the
instance's :class:`~fleetserve.sim.batch.BoundBatch`, and the layout keeps the
batch's totals), so a decode job costs what an instance's segment costs:
O(block size + finishes), not O(requests), and a policy reading a running
request's tokens mid-segment sees them as of now, as on an instance. MLFQ and
DB keep the group's *explicit* counts (``kv_saved``,
``gen_saved``, updated at job ends).

- **Moves.** Llumnix's and Mell's migrations (:mod:`fleetserve.sim.migration`)
  use the group's actions ("Moving a request" in :mod:`fleetserve.sim.group`):
  reservations and a detached request's kept blocks are the layout's held
  blocks, a request leaves or joins the bound batch at its boundary, and the
  copies in flight slow the iterations that start beside them. The group
  names this instance as its requests' ``inst``, which the moves read.

- **Prefix caching.** The group's cache ("Prefix caching" in
  :mod:`fleetserve.sim.group`) with the run's counters.

Behind a switch (``Simulator(..., one_model_groups=True)``), for every
single-model stack, migration and prefix caching included (session 28);
``tests/test_group_instance.py`` and ``tests/test_prefix_cache_sim.py``
check that their records, time series, GPU intervals, migrations and cache
counters equal the instance's. The event counts differ a
little (65,646 against 65,555 on the Azure trace of ``make bench``): a
decode iteration that preempts runs as a job of its own in the group, where
the instance's segment goes on past it when no queued prompt could be
admitted. About 1.75x slower than the instance for now (``make bench``,
session 28: 22,403 against 39,177 requests/s; 4-5x before the bound
batches): the rest is the layers a job passes through (the instance
protocol, the group's job registry, the layout's books beside the batch's,
the admission budget, the views), each a few Python calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from fleetserve.errors import ConfigError
from fleetserve.policy.sharing import BATCHING, GroupScheduler, ServiceStats
from fleetserve.sim.group import HostView, SharingGroup
from fleetserve.sim.instance import ChangeReports
from fleetserve.sim.kvlayout import make_layout
from fleetserve.sim.prefix_cache import PrefixStats
from fleetserve.sim.seq import Seq

if TYPE_CHECKING:
    from fleetserve.cluster.state import SeqView
    from fleetserve.costmodel import InstanceCost
    from fleetserve.sim.batch import SimClock
    from fleetserve.spec import ModelSpec

__all__ = ["GroupInstance"]

IDLE, BUSY = 0, 1  # ``phase``: the instance's IDLE, and any job in flight


class GroupInstance(HostView, ChangeReports):
    """One model on one GPU (group) as a one-model sharing group (see the
    module docstring). The arguments are :class:`~fleetserve.sim.instance.Instance`'s,
    with the model's shape (``spec``) and the batching policy by name.

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
        blocks = g.layout.used_bytes(m) // g.layout.bytes_per_token_block(m)
        return blocks, g.macro_end(m), lambda times: g.ahead_blocks_at(m, times)

    def _started(self, evs: list[tuple[float, int]]) -> float | None:
        """The end of the job ``evs`` started (one at most: a temporal one-model
        group runs one job at a time); it becomes the instance's version."""
        if self._logs:
            self._changed()
        if not evs:
            return None
        if len(evs) > 1:  # pragma: no cover - a one-model temporal group
            raise RuntimeError(f"instance {self.id}: {len(evs)} jobs started at once")
        end, token = evs[0]
        self.version = token
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
        if self._logs:  # FCFS, RR: the one-model case (one call less per job)
            self._changed()
        got = g.schedule_one(now)
        if got is None:
            return None
        self.version = got[1]
        return got[0]

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
