"""A sharing group as the simulator models it: several services, one GPU group.

Every hosted service's weights are resident; their requests' KV caches share
one pool (a :class:`~fleetserve.sim.kvlayout.KVLayout`: head-wise, merged or
static partitions). The group's scheduler
(:class:`~fleetserve.policy.sharing.GroupScheduler`) starts *jobs*: one
iteration of one service in one phase on a share of the compute units. Jobs
run until their own end time; a temporal scheduler is consulted only when no
job is in flight (one job at a time, the whole group), a spatial-temporal one
(ADBS) whenever a job ends or a request arrives.

Token bookkeeping per request (``p`` prompt tokens, ``g`` generated)::

    waiting   no KV; a prefill job processes p + g tokens, allocates them and
              emits token g + 1
    running   holds KV; "ready" when in no job
    decode    grows the KV by one token (the newest, not cached yet) and emits
              the next token
    finishes  when g == output_tokens: its KV is freed at once

After a prefill the KV holds ``p + g`` tokens and ``g + 1`` are generated, so
a running request always holds ``prompt + generated - 1`` tokens of KV.

Memory: a prompt is admitted only if the layout can hold it and it keeps the
service within the scheduler's ``kv_limit`` (ADBS quotas); before a decode
step, every request of the job grows by one token, and when that does not
fit (pool or quota) the scheduler names a victim of that service, which is
preempted (KV freed, back to the head of the queue, recomputed later). The
layout never over-commits (its check/commit pairs), and
:meth:`SharingGroup.check_integrity` checks that every request is in exactly
one place.

Chunked prefill (``chunked_prefill``, FCFS and RR: the single-model
instance's mixed iterations, so that a one-model group is that instance,
``tests/test_one_model_worlds.py``). A job of a service with a prompt to start
or to continue is one *mixed* iteration: every running request of that
service decodes, then its partly prefilled prompts' next chunks, then the
prompts the job admitted, within ``max_batched_tokens`` (a prompt needs one
token of that budget to start; its KV is taken in full at admission, and the
admission keeps free the blocks the iteration's decodes take, so an iteration
that admits never preempts). A partly prefilled prompt holds its KV, is in no
queue and counts as *ready* for the scheduler; it runs when its last chunk
has run. Admission also keeps vLLM's watermark (``watermark``) free.

Pipelined groups (KunServe's drop, :mod:`fleetserve.sim.multi_burst`) under a
temporal scheduler run *prefill lanes* beside their decode round, as vLLM's
pipeline-parallel engine does with its virtual engines (and as the KunServe
world, :mod:`fleetserve.sim.kun`, models it): at a decode round's boundary
(no decode job in flight) the scheduler is asked as usual, but a prefill job
it starts is one micro-batch crossing the stages
(:meth:`~fleetserve.costmodel.pipeline.StagedCost.prefill_lane`) and does not
hold the group: it is asked again, for more prefill lanes (up to one per
stage) and then the decode round. Lanes run on across rounds; a request
they prefill joins the decode batch at the next round's boundary. The jobs
in flight divide the stages' time (:class:`~fleetserve.sim.contention.BandwidthSharing`,
weighted: each lane one, the decode round the stages not prefilling,
:func:`~fleetserve.sim.contention.decode_weight`), re-timed after every
change at one instant (the starts and ends a call handles, once at its
report: a job whose speed comes back to what it was keeps its end).
Before session 23 such a group prefilled as a round of its own (a decode
waited for it), as a replica does. With bound running batches (FCFS,
RR, a count-only layout; since session 30) a round is its batch's segment of
one iteration, and a prompt whose lane ends during a round joins the batch at
the round's end, as the KunServe world's executors run it; the records equal
the explicit counts' (``tests/test_bound_groups.py``).

Moving a request (the single-model world's live KV migration: Llumnix, Mell;
:mod:`fleetserve.sim.migration` drives it, as it drives an instance). The
group offers the instance's actions: :meth:`SharingGroup.reserve` token-blocks
for a copy coming in, :meth:`SharingGroup.detach` a running request at its
batch's boundary (its blocks kept while the final copy reads them,
:meth:`SharingGroup.release_held` after), :meth:`SharingGroup.attach` a copied
request into the running batch, :meth:`SharingGroup.remove_waiting` for a
queued one that moves as token ids. Reserved and kept blocks are the layout's
held blocks (:meth:`~fleetserve.sim.kvlayout.KVLayout.hold`), so the pool
never over-commits. A copy streaming through the group's GPUs slows its
iterations (``copy_load``,
:func:`~fleetserve.sim.contention.beside_copies`) from the next one that
starts. Bound batches only (FCFS, RR: a request leaves or joins at a
boundary of its batch), a count-only layout, and a replica (not a pipeline).

KunServe's executors (:mod:`fleetserve.sim.kun`; since session 30). The
KunServe world's replicas and pipelines are one-service groups with bound
batches, one iteration per job, and a staged KV layout over their members
(:class:`~fleetserve.sim.staged_layout.StagedLayout`, whose capacity changes
as members drop or reload layers: :meth:`SharingGroup.refresh_limits`). What
they add, each off by default:

* ``alternate``: in the one-model case, after a prefill job a decode of the
  running requests comes next when there are any;
* ``pressure`` (:class:`~fleetserve.policy.pressure.PressureReaction`): when a
  decode does not fit, the reaction's step (preempt or swap out its victim,
  or wait for a swap-out in flight); when the queue's head has a batch slot
  but not the memory, its steps (``kv-drop`` drops running requests' KV to
  the queue's tail, ``kv-swap`` swaps one out); before a decode, a swap-in.
  A swap is the world's copy (``on_swap``); the request is *stalled* (its KV
  held, counted in the batch slots) until :meth:`SharingGroup.swapped_out`,
  then in host memory until a swap-in brings it back;
* requests that arrive with their KV (a Llumnix move, a swap-in, a blocking
  exchange's victim once its pieces are in: :meth:`SharingGroup.arrive`,
  :meth:`SharingGroup.unstall`) join the batch at its next boundary, their KV
  reserved until then; a merge's or split's requests whose KV is resident
  join at once (:meth:`SharingGroup.adopt_resident`, not checked against the
  free blocks: the staged layout's corrections say where the KV is);
* ``admitting`` False: the group admits nothing (a restored group drains);
* ``round_cost``: the world's time of a decode round (remote attention of
  the KV exchange), ``on_evicted``: the world's books of a request whose KV
  a preemption or a drop freed (its KV pieces, its move).

Prefix caching (``prefix_caching``; :mod:`fleetserve.sim.prefix_cache`, the
single-model instance's model of vLLM's automatic prefix caching, one cache
per service). A request's KV is then its private blocks (the layout holds
``kv - shared * block_size`` tokens for it, exactly ``blocks(kv) - shared``
blocks) plus the cache entries it references; each referenced entry is held
once, as the layout's held blocks (:meth:`~fleetserve.sim.kvlayout.KVLayout.hold`),
and entries nobody references are evictable: free for the layout, evicted
(least recently released first) where the instance evicts them: after
admissions, a reservation and a decode segment's growth, and with chunked
prefill before the scheduler admits (the next mixed iteration's decodes'
blocks kept). The admission budget looks each prompt up once per round; a
prompt needs its blocks less the hits already referenced, and only its
uncached tokens count against the token budget (``prefilled`` starts past the
hits). A prefill publishes its full prompt blocks (after each chunk with
chunked prefill): they move from the request's private blocks to the held
ones. A request detached for a KV move keeps its references until its final
copy is done. Bound batches only, as moves.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import numpy.typing as npt

from fleetserve.errors import ConfigError
from fleetserve.policy.actions import DropKV, SwapOut
from fleetserve.policy.pressure import PressureReaction, PressureView
from fleetserve.policy.sharing import (
    DECODE,
    PREFILL,
    GroupScheduler,
    GroupSeq,
    Job,
    admit_in_order,
)
from fleetserve.sim.batch import BoundBatch
from fleetserve.sim.contention import BandwidthSharing, beside_copies, decode_weight
from fleetserve.sim.kvlayout import HeadwiseLayout
from fleetserve.sim.prefix_cache import PrefixCache, PrefixStats
from fleetserve.sim.seq import DONE, HOST, PREFILLING, RUNNING, STALLED, TRANSIT, WAITING, Seq

if TYPE_CHECKING:
    from fleetserve.costmodel import Ends, InstanceCost
    from fleetserve.costmodel.pipeline import StagedCost
    from fleetserve.sim.batch import SimClock
    from fleetserve.sim.kvlayout import KVLayout, LayoutStats
    from fleetserve.sim.prefix_cache import Entry

_EPS = 1e-9
_MACRO_MAX = 512  # iterations per macro job at most


class JobCost(Protocol):
    """Job times of one service on a group: a replica's
    :class:`~fleetserve.costmodel.InstanceCost`, or a pipeline's
    :class:`~fleetserve.costmodel.pipeline.StagedCost` after KunServe dropped
    layers."""

    def prefill_time(self, prompt_lens: Sequence[int], share: float = 1.0) -> float: ...

    def decode_time_scalar(self, batch: int, ctx_total: float, share: float = 1.0) -> float: ...

    def decode_time(
        self, batch: int, ctx_total: npt.NDArray[np.number[Any]]
    ) -> npt.NDArray[np.float64]: ...

    def re_prefill_tokens(self, budget_s: float) -> int: ...

    def prefill_memory_s(self, prompt_lens: Sequence[int]) -> float: ...

    def decode_memory_s(self, batch: int, ctx_total: float) -> float: ...


def _floats(ends: Ends) -> list[float]:
    """A segment's end times as a list (what a policy reads)."""
    return ends if isinstance(ends, list) else ends.tolist()


class _GroupBudget:
    """Admission of prompts into one prefill job: memory (layout and quota),
    running-batch room, and the token budget (a lone prompt may exceed it)."""

    __slots__ = ("free", "group", "hits", "model", "reserve", "seqs_left", "taken", "tokens_left")

    def __init__(self, group: SharingGroup) -> None:
        self.group = group
        self.free = 0  # token-blocks free less the reserve (:class:`_FreeBudget`)
        self.model: str | None = None
        self.seqs_left = 0
        self.tokens_left = 0
        self.taken = 0
        self.reserve = 0  # tokens kept free: the watermark (+ the decodes' growth, chunked)
        # prefix caching: each prompt's cache hits, looked up once per round
        self.hits: dict[int, tuple[list[Entry], int]] = {}

    def _need(self, seq: Seq, cache: PrefixCache) -> tuple[int, int]:
        """Prefix caching: ``(tokens hit, tokens of KV the pool must give)``:
        the prompt less the hits some request references already (taken
        earlier in this round included; an evictable hit comes out of the
        free blocks)."""
        got = self.hits.get(seq.id)
        if got is None:
            got = self.hits[seq.id] = cache.lookup(seq, seq.prompt_tokens + seq.gen_saved)
        hits, hit = got
        held = sum(e.blocks for e in hits if e.refs)
        return hit, seq.prompt_tokens + seq.gen_saved - held * cache.bs

    def fits(self, s: GroupSeq) -> bool:
        seq: Seq = s  # type: ignore[assignment]  # the scheduler got it from this group
        g = self.group
        m = seq.model
        if self.model is None:
            self._open(m)
        elif m != self.model:
            return False  # one service per job
        n = seq.prompt_tokens + seq.gen_saved
        if seq.in_job or self.seqs_left <= 0:
            return False
        hit = 0
        cache = g.pcache.get(m) if g.pcache else None
        if cache is not None:
            hit, n = self._need(seq, cache)  # n: the KV tokens the pool gives
        if g.chunked:  # a prompt needs one token of the budget to start
            if self.tokens_left <= 0:
                return False
        elif self.taken and seq.prompt_tokens + seq.gen_saved - hit > self.tokens_left:
            return False
        return self._room(seq, n)

    def _open(self, m: str) -> None:
        """The round's limits, at its first prompt (of service ``m``)."""
        g = self.group
        self.seqs_left = g.max_num_seqs - g.num_running(m) if g.admitting else 0
        self.reserve = g.admission_reserve(m)
        if g.chunked:  # the mixed iteration's decodes and partial prompts come first
            self.tokens_left = g.max_batched_tokens - g.mixed_reserved_tokens(m)

    def _room(self, seq: Seq, n: int) -> bool:
        """Whether the pool (and quota) can give ``seq`` ``n`` tokens of KV now."""
        return self.group.can_admit(seq, n, self.reserve)

    def take(self, s: GroupSeq) -> None:
        seq: Seq = s  # type: ignore[assignment]
        g = self.group
        n = seq.prompt_tokens + seq.gen_saved
        if self.model is None:
            self.model = seq.model
            if not g.chunked:
                self.tokens_left = g.max_batched_tokens
        cache = g.pcache.get(seq.model) if g.pcache else None
        if cache is None:
            g.layout.grow(seq.id, seq.model, n)
            seq.prefilled = 0
        else:
            self._need(seq, cache)
            hits, hit = self.hits[seq.id]
            g._admit_cached(seq, n, hits, hit)
        seq.kv_saved = n
        seq.state = PREFILLING
        seq.in_job = True  # leaves the queue when its prefill job starts
        g._taken[seq.id] = seq
        self.seqs_left -= 1
        self.tokens_left -= n - seq.prefilled
        self.taken += 1
        self.free -= -(-n // g._bs)


class _FreeBudget(_GroupBudget):
    """:class:`_GroupBudget` of a one-service group with a count-only layout,
    no KV quotas and no prefix cache (a one-model instance's case): a prompt
    fits when its blocks and the reserve fit the service's free token-blocks,
    counted once per round and taken down by each admission, as an
    instance's budget counts its free blocks. Exactly the layout's answer: a
    count-only layout's fit is linear in one service's token-blocks
    (:meth:`~fleetserve.sim.kvlayout.KVLayout.free_token_blocks`), the
    reserve is whole blocks, and a queued request holds no KV (checked: one
    that did is an error)."""

    def _open(self, m: str) -> None:
        super()._open(m)
        g = self.group
        self.free = g.layout.free_token_blocks(m) - self.reserve // g._bs

    def _room(self, seq: Seq, n: int) -> bool:
        g = self.group
        if g.layout.holds(seq.id):  # pragma: no cover - an invariant
            raise RuntimeError(f"group {g.id}: queued request {seq.id} holds KV")
        return -(-n // g._bs) <= self.free


class SharingGroup:
    """Services sharing one GPU group (see the module docstring).

    Args:
        gid: group id.
        gpus: its GPU ids.
        tp: tensor-parallel degree.
        costs: cost model of each hosted service bound to (model, GPU, tp).
        layout: the group's KV pool.
        scheduler: its scheduler (``setup`` already called).
        max_num_seqs: running requests per service at most.
        max_batched_tokens: prompt tokens per prefill job.
        macro_steps: advance a lone decode batch several iterations at once
            (temporal schedulers; see :meth:`_macro_ends`).
        contention: jobs running at once (a spatial scheduler's) share the
            GPUs' memory bandwidth (:mod:`fleetserve.sim.contention`): each
            start or end of a job re-times the others.
        chunked_prefill: split prompts into chunks run with the service's
            decodes (``engine.chunked_prefill``; the single-model instance's
            mixed iterations, see the module docstring). Temporal one-model
            schedulers only (FCFS, RR); not in a pipelined group.
        watermark: vLLM's admission watermark (``engine.watermark``): a
            prompt is admitted only if its service could still take
            ``watermark`` of its token-blocks in an empty pool afterwards
            (with one service and the partitioned layout, exactly the
            single-model instance's ``watermark`` of its blocks).
        bound: keep each service's running requests *bound* to a step
            counter (:class:`~fleetserve.sim.batch.BoundBatch`, as the
            single-model instance does) instead of counting each request's
            tokens at every job: a decode job then costs O(block size +
            finishes), not O(requests). Needs a scheduler whose decode job
            takes every running request of its service (the one-model
            schedulers, FCFS and RR), one job at a time (temporal; a
            pipelined group's decode round beside its prefill lanes), a
            count-only KV layout and ``clock`` (the counts as of now). The records are the explicit
            path's (``tests/test_group_instance.py``).
        clock: the simulation clock (for ``bound``).
        prefix_caching: share the KV of cached prompt prefixes within each
            service (:mod:`fleetserve.sim.prefix_cache`, vLLM's automatic
            prefix caching, as the single-model instance models it; see
            "Prefix caching" in the module docstring). Needs ``bound``.
        prefix_stats: the run's prefix-cache counters (None: the group's own).
        alternate: in the one-model case, a decode of the running requests
            follows each prefill job while there are any (the KunServe
            world's ``kunserve.alternate``; module docstring, "KunServe's
            executors").
        pressure: the memory-pressure reactions (preempt, ``kv-drop``,
            ``kv-swap``) when a decode or the queue's head does not fit;
            None: the scheduler's victim is preempted. Needs ``bound``; the
            swaps need the world's ``on_swap`` hook.
    """

    def __init__(
        self,
        gid: int,
        gpus: tuple[int, ...],
        tp: int,
        costs: Mapping[str, JobCost],
        layout: KVLayout,
        scheduler: GroupScheduler,
        *,
        max_num_seqs: int = 256,
        max_batched_tokens: int = 8192,
        macro_steps: bool = True,
        contention: bool = False,
        watermark: float = 0.0,
        chunked_prefill: bool = False,
        bound: bool = False,
        clock: SimClock | None = None,
        prefix_caching: bool = False,
        prefix_stats: PrefixStats | None = None,
        alternate: bool = False,
        pressure: PressureReaction | None = None,
    ) -> None:
        self.id = gid
        self.gpus = gpus
        self.tp = tp
        self.costs = dict(costs)
        self.layout = layout
        self.scheduler = scheduler
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self._models = tuple(sorted(costs))
        self._bs = bs = layout.block_size
        self._watermark = watermark
        self.watermark_tokens: dict[str, int] = {}
        self.refresh_limits()
        self.waiting: dict[str, deque[Seq]] = {m: deque() for m in self._models}
        # blocks the queued prompts of each service need (the instance's
        # ``reserved_blocks``, which dispatch policies read as not available)
        self.queued_blocks: dict[str, int] = dict.fromkeys(self._models, 0)
        self.running: dict[str, dict[int, Seq]] = {m: {} for m in self._models}
        self.jobs: dict[int, tuple[Job, list[Seq], float, float]] = {}  # token -> job
        self._busy: dict[tuple[str, str], int] = {}  # (model, phase) -> jobs in flight
        self._phase_jobs = {PREFILL: 0, DECODE: 0}  # phase -> jobs in flight (all models)
        self._next_token = 0
        self._taken: dict[int, Seq] = {}  # admitted by the budget, job not started yet
        # requests in each service's prefill jobs in flight (mixed iterations not counted)
        self._n_prefill: dict[str, int] = dict.fromkeys(self._models, 0)
        # a pipelined group under a temporal scheduler: prefill lanes (module docstring)
        self.stages = max((getattr(c, "stages", 1) for c in self.costs.values()), default=1)
        self.lanes = self.stages > 1 and not scheduler.spatial
        self.macro = macro_steps and not scheduler.spatial and not self.lanes
        self.chunked = chunked_prefill
        if chunked_prefill and (scheduler.spatial or not scheduler.one_model or self.lanes):
            raise ConfigError(
                f"engine.chunked_prefill with scheduler {type(scheduler).__name__}"
                + (" in a pipelined group" if self.lanes else "")
                + ": chunked prefill is modelled for temporal schedulers with a one-model "
                "case (fcfs, rr), as the single-model instance runs it"
            )
        # admitted prompts partly prefilled (chunked prefill): KV held in full
        self.partial: dict[str, list[Seq]] = {m: [] for m in self._models}
        self._chunks: dict[int, list[tuple[Seq, int]]] = {}  # token -> a mixed job's chunks
        spatial_bw = contention and scheduler.spatial
        self._bw = BandwidthSharing() if spatial_bw or self.lanes else None
        self._superseded: set[int] = set()  # job tokens re-timed under new ones
        self._retimed_now = False  # a pipeline's jobs were re-timed since their last change
        self._state = _StateView(self)  # what the scheduler reads
        self._hooks = scheduler.observes_jobs  # its job-end hooks do something
        # one service whose scheduler keeps every decode iteration offered
        self._keeps_lone = len(self._models) == 1 and scheduler.keeps_lone_batch
        # its KV quotas (ADBS's); the base scheduler's limit is infinite
        self._quotas = type(scheduler).kv_limit is not GroupScheduler.kv_limit
        self._on_arrival = type(scheduler).on_arrival is not GroupScheduler.on_arrival
        self._on_finish = type(scheduler).on_finish is not GroupScheduler.on_finish
        self._ends: dict[int, Ends] = {}  # token -> iteration ends of a macro job
        self.held_share = 0.0
        self.preemptions = 0
        self.busy_s = 0.0  # time with at least one job in flight
        self._busy_since: float | None = None
        # lifecycle: "live" serves; "loading" waits for its weights (or, a
        # pipelined group, for its KV exchange); "retiring" finishes its jobs
        # in flight, then hands its requests over; "stopped" is empty and gone;
        # elastic memory: "asleep" holds no GPU; KunServe's drop
        # (sim/multi_burst.py): "merging" takes requests but starts no job until
        # it joins a pipelined group, then it is "merged" (empty)
        self.state = "live"
        self.incoming = 0  # migrated requests on their way here
        # what a hosted request's ``inst`` names: the group, or the instance
        # it serves behind (sim/group_instance.py)
        self.host: Any = self
        # KV migrations of single requests (the single-model world's Llumnix
        # and Mell moves; see "Moving a request"): token-blocks reserved for
        # KV being copied in, and held by requests that left while a copy
        # still reads them (both in the layout's held blocks), the HBM share
        # the copies through these GPUs ask for, and the requests preempted
        # while moving out (their moves abort)
        self.mig_in: dict[str, int] = dict.fromkeys(self._models, 0)
        self.mig_out: dict[str, int] = dict.fromkeys(self._models, 0)
        self.copy_load = 0.0
        self.preempted_migrating: list[Seq] = []
        # bound running batches (``bound``): service -> its batch; ``running``
        # holds the batch's requests and those joining it at its next boundary
        # (adopted while its segment ran: explicit counts until then)
        self._bound: dict[str, BoundBatch] = {}
        self._joining: dict[str, list[Seq]] = {}
        if bound:
            why = [
                w
                for w, bad in (
                    (
                        "a scheduler whose decode job takes every running request (fcfs, rr)",
                        not scheduler.one_model or scheduler.spatial,
                    ),
                    ("a count-only KV layout (partitioned, headwise)", not layout.counts_only),
                    ("the simulation clock", clock is None),
                )
                if bad
            ]
            if why:
                raise ConfigError(f"group {gid}: bound running batches need " + "; ".join(why))
            for m in self._models:
                self._bound[m] = BoundBatch(bs, clock)
                self._joining[m] = []
        # KunServe's world (sim/kun.py) runs its executors as one-service groups:
        # what they add (module docstring, "KunServe's executors")
        self.alternate = alternate
        self._after_prefill = False  # the last job started was a prefill
        self.pressure = pressure
        self.admitting = True  # False: admit nothing (a restored group draining)
        # requests whose KV is held here that do not run: a swap-out in flight,
        # a blocking exchange's victim waiting for its pieces
        self.stalled: dict[str, dict[int, Seq]] = {m: {} for m in self._models}
        self.swapped: dict[str, deque[Seq]] = {m: deque() for m in self._models}
        self.swap_out_busy = False
        self.swap_in_busy = False
        # requests whose KV is in (reserved, ``mig_in``): they join the running
        # batch at its next boundary
        self.pending: dict[str, list[Seq]] = {m: [] for m in self._models}
        # the world's hooks: a decode round's (time, busiest stage's busy time)
        # of ``batch`` requests reading ``ctx`` tokens; a request whose KV a
        # preemption or a drop freed; a swap to start (True: out, False: in)
        self.round_cost: Callable[[str, int, int], tuple[float, float]] | None = None
        self.on_evicted: Callable[[Seq], None] | None = None
        self.on_swap: Callable[[Seq, bool], None] | None = None
        if pressure is not None and not bound:
            raise ConfigError(f"group {gid}: memory-pressure reactions need bound running batches")
        reacting = pressure is not None and pressure.settings.pressure in ("kv-drop", "kv-swap")
        if pressure is not None and self.lanes and reacting:
            raise ConfigError(
                f"group {gid}: pressure {pressure.settings.pressure!r} reacts on replicas, "
                "not in a pipelined group"
            )
        # one service under a scheduler with a one-model case, bound: that case
        # (:meth:`schedule_one`); its decode job takes the whole batch
        self._one: str | None = None
        self._decode_job = Job(self._models[0], DECODE, (), 1.0)
        if bound and len(self._models) == 1 and self._bw is None:
            self._one = self._models[0]
        # a pipeline hosting one such service: its one-model case (:meth:`_schedule_lanes`)
        self._one_lanes: str | None = None
        if bound and len(self._models) == 1 and self.lanes and scheduler.one_model:
            self._one_lanes = self._models[0]
        # the one-service admission budget (the linear one without quotas or a cache)
        self._budget: type[_GroupBudget] = _GroupBudget
        one = self._one is not None or self._one_lanes is not None
        if one and not prefix_caching and not self._quotas and layout.counts_only:
            self._budget = _FreeBudget
        # prefix caching: each service's cache; the requests detached for a KV
        # move's final copy that still reference entries (the copy reads them)
        self.pcache: dict[str, PrefixCache] = {}
        self._holding: dict[int, Seq] = {}
        if prefix_caching:
            if not bound:
                raise ConfigError(
                    f"group {gid}: prefix caching needs bound running batches "
                    "(batching fcfs or rr, a count-only KV layout)"
                )
            stats = prefix_stats or PrefixStats()
            self.pcache = {m: PrefixCache(bs, stats) for m in self._models}

    def refresh_limits(self) -> None:
        """Recompute what derives from the layout's capacity (the admission
        watermark's tokens): at the start, and after a layout whose capacity
        changes (:attr:`~fleetserve.sim.kvlayout.KVLayout.capacity_changes`)
        changed it."""
        bs = self._bs
        wm, lay = self._watermark, self.layout
        for m in self._models:
            self.watermark_tokens[m] = int(wm * (lay.max_tokens(m) // bs)) * bs

    # ------------------------------------------------------------ GroupState
    @property
    def models(self) -> Sequence[str]:
        return self._models

    @property
    def free_share(self) -> float:
        return max(0.0, 1.0 - self.held_share)

    @property
    def jobs_in_flight(self) -> int:
        return len(self.jobs)

    def ready(self, model: str) -> Sequence[Seq]:
        """Running requests in no job; with chunked prefill, then the partly
        prefilled prompts (their next chunk runs in the model's next job)."""
        run = self.running[model]
        b = self._bound.get(model)
        if b is not None:  # a bound batch decodes as a whole: in a job while its segment runs
            out = list(self._joining[model]) if b.n else list(run.values())
        elif (model, DECODE) not in self._busy:  # prefilling requests are not in ``running``
            out = list(run.values())
        else:
            out = [s for s in run.values() if not s.in_job]
        part = self.partial[model]
        if part:
            out += [s for s in part if not s.in_job]
        return out

    def busy(self, model: str, phase: str) -> bool:
        return (model, phase) in self._busy

    def kv_used(self, model: str) -> int:
        return self.layout.used_bytes(model)

    def prefill_in_flight(self) -> bool:
        return any(j.phase == PREFILL for j, _, _, _ in self.jobs.values())

    @property
    def idle(self) -> bool:
        return (
            not self.jobs
            and not any(self.waiting.values())
            and not any(self.running.values())
            and not any(self.partial.values())
            and not any(self.stalled.values())
            and not any(self.pending.values())
            and not any(self.swapped.values())
        )

    def outstanding(self, model: str) -> int:
        """Requests of ``model`` here (queued, partly prefilled or running)."""
        return len(self.waiting[model]) + len(self.running[model]) + len(self.partial[model])

    def num_running(self, model: str) -> int:
        """Requests of ``model`` that take a batch slot (``max_num_seqs``):
        running (joining included), partly prefilled, stalled, and in a
        pipeline the prompts its prefill lanes carry (vLLM counts a
        sequence from its admission)."""
        n = len(self.running[model]) + len(self.partial[model]) + len(self.stalled[model])
        if self.lanes:
            n += self._n_prefill[model]
        return n

    def ahead_blocks(self, model: str, now: float) -> int:
        """Token-blocks ``model``'s macro decode jobs hold ahead of ``now``: a
        macro job allocates its whole segment's KV when it starts, while the
        views count, as of now, the blocks of the iterations done and the one
        in flight (as vLLM holds them). Dispatch views count them as free
        (:class:`HostView`)."""
        b = self._bound.get(model)
        if b is not None:  # a bound batch's segment of k > 1 iterations: its growth ahead
            return b.ahead(now)
        if not self._ends:
            return 0
        return int(self.ahead_blocks_at(model, np.array([now]))[0])

    def ahead_blocks_at(self, model: str, times: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
        """:meth:`ahead_blocks` at each of ``times``: as of a time, a macro
        job's requests hold the tokens of the iterations done and the one in
        flight."""
        bs = self._bs
        out = np.zeros(len(times), dtype=np.int64)
        b = self._bound.get(model)
        for token, ends in self._ends.items():
            job, seqs, _, _ = self.jobs[token]
            if job.model != model:
                continue
            k = len(ends)
            steps = np.minimum(np.searchsorted(ends, times, side="right") + 1, k)
            if b is not None:  # the batch's growth by iteration
                out += b.grown(k - 1) - b.grown_at(steps - 1)
                continue
            # the job counted its first token at its start
            kv0 = np.fromiter((s.kv_saved - 1 for s in seqs), np.int64, len(seqs))
            held = -(-(kv0[None, :] + steps[:, None]) // bs)
            out += int((-(-(kv0 + k) // bs)).sum()) - held.sum(axis=1)
        return out

    def macro_end(self, model: str) -> float | None:
        """When ``model``'s macro decode job in flight ends (None: none)."""
        ends = [float(e[-1]) for t, e in self._ends.items() if self.jobs[t][0].model == model]
        return max(ends) if ends else None

    def layout_stats(self, now: float) -> LayoutStats:
        """The layout's accounting as of ``now``: a macro decode job's requests
        count the tokens of the iterations done and the one in flight, as a
        step-by-step run holds them (the job allocated its whole segment when
        it started). The samples of the multi-LLM world then do not depend on
        how long its macro jobs are (:meth:`KVLayout.stats_as_of
        <fleetserve.sim.kvlayout.KVLayout.stats_as_of>`; nothing changes)."""
        now_tokens: dict[int, int] = {}
        bulk: dict[str, tuple[int, int]] = {}
        for token, ends in self._ends.items():
            k = len(ends)
            j = bisect_right(ends, now)
            steps = j + 1 if j + 1 < k else k
            if steps < k:
                job, seqs, _, _ = self.jobs[token]
                b = self._bound.get(job.model)
                if b is not None:  # the batch's tokens and blocks of the iterations ahead
                    bulk[job.model] = (len(b) * (k - steps), b.grown(k - 1) - b.grown(steps - 1))
                else:  # kv_saved counts the job's first token (its start)
                    now_tokens.update((s.id, s.kv_saved - 1 + steps) for s in seqs)
        if now_tokens or bulk:
            return self.layout.stats_as_of(now_tokens, bulk)
        return self.layout.stats()

    def prefilling(self, model: str) -> list[Seq]:
        """Requests of ``model`` admitted whose prefill has not completed:
        partly prefilled (chunked prefill), or in a prefill job."""
        out = list(self.partial[model])
        for seqs in self._prefill_jobs(model):
            out += seqs
        return out

    def _prefill_jobs(self, model: str) -> Iterator[list[Seq]]:
        """The requests of each of ``model``'s prefill jobs in flight (not
        mixed iterations, whose chunks' prompts are in ``partial``)."""
        if (model, PREFILL) not in self._busy:
            return
        for token, (job, seqs, _, _) in self.jobs.items():
            if job.model == model and job.phase == PREFILL and token not in self._chunks:
                yield seqs

    def num_prefilling(self, model: str) -> int:
        """``len(prefilling(model))``, without the list (the time series
        count them at every sample)."""
        return len(self.partial[model]) + self._n_prefill[model]

    def request_ids(self) -> list[int]:
        """Every request here, once: queued, prefilling and running."""
        return [
            s.id
            for m in self._models
            for s in (*self.waiting[m], *self.prefilling(m), *self.running[m].values())
        ]

    def mixed_reserved_tokens(self, model: str) -> int:
        """Chunked prefill: the token budget a mixed iteration of ``model``
        spends before admitting (one per running request's decode, then the
        partly prefilled prompts' next chunks)."""
        return len(self.running[model]) + sum(
            s.prompt_tokens + s.gen_saved - s.prefilled for s in self.partial[model]
        )

    # --------------------------------------------------------------- memory
    def max_request_tokens(self, model: str) -> int:
        """The most tokens one request of ``model`` may ever need here (an
        empty pool, less the admission watermark)."""
        return self.layout.max_tokens(model) - self.watermark_tokens[model]

    def admission_reserve(self, model: str) -> int:
        """Tokens (whole blocks) a prompt of ``model`` must leave free: the
        watermark's, and with chunked prefill the blocks the service's running
        requests take in the same mixed iteration (so an iteration that
        admits never preempts, and one that preempts admits nothing, as vLLM
        schedules). Fixed while one job's prompts are admitted."""
        reserve = self.watermark_tokens[model]
        if self.chunked:
            bs = self._bs
            b = self._bound.get(model)
            if b is None:
                run: Iterable[Seq] = self.running[model].values()
            else:  # the batch's next-block openers, and those joining it
                reserve += bs * b.opening()
                run = self._joining[model]
            reserve += bs * sum(1 for x in run if x.kv_saved % bs == 0)
        return reserve

    def can_admit(self, seq: Seq, tokens: int, reserve: int) -> bool:
        """Whether a prompt of ``tokens`` tokens may be admitted now:
        :meth:`can_hold`, with ``reserve`` tokens (:meth:`admission_reserve`)
        still free after it."""
        if reserve:
            if not self.layout.can_grow(seq.id, seq.model, tokens + reserve):
                return False
            if not self._quotas:  # then ``tokens`` fit too
                return True
        return self.can_hold(seq, tokens)

    def can_hold(self, seq: Seq, tokens: int) -> bool:
        """Whether ``seq`` can hold ``tokens`` tokens now (pool and quota)."""
        lay = self.layout
        if not lay.can_grow(seq.id, seq.model, tokens):
            return False
        m = seq.model
        if not self._quotas or self.scheduler.kv_limit(m) == math.inf:
            return True
        extra = lay.grow_bytes(seq.id, m, tokens)
        used = lay.used_bytes(m)
        others = lay.holders(m) - lay.holds(seq.id)  # the service's other requests with KV
        return self.scheduler.kv_allows(m, used, extra, others)

    # -------------------------------------------------------------- actions
    def enqueue(
        self, seq: Seq, now: float, *, head: bool = False, start: bool = True
    ) -> list[tuple[float, int]]:
        """Queue an arriving request; returns ``(end time, token)`` of started
        jobs (none without ``start``: the caller schedules later)."""
        seq.inst = self.host
        seq.state = WAITING
        self.queued_blocks[seq.model] += -(-seq.prefill_tokens // self._bs)
        if head:
            self.waiting[seq.model].appendleft(seq)
        else:
            self.waiting[seq.model].append(seq)
            if self._on_arrival:
                self.scheduler.on_arrival(seq, now)
        if not start:
            return []
        if self.jobs and self._one is not None:  # busy: the next boundary decides
            return self.truncate(now)
        return self.truncate(now) + self.schedule(now)

    def schedule(self, now: float) -> list[tuple[float, int]]:
        """Ask the scheduler for jobs and start them; ``(end, token)`` of each."""
        if self._one is not None:  # one service, one job at a time
            got = self.schedule_one(now)
            return [] if got is None else [got]
        sched = self.scheduler
        if self.state != "live" or (not sched.spatial and self.jobs and not self.lanes):
            return self._retimed(now, [])
        if self.lanes and self._decoding():  # lanes start at a decode round's boundary
            return self._retimed(now, [])
        if self.pcache and self.chunked:
            self._fit_before_admission()
        for m, pend in self.pending.items():  # at the batch's boundary: arrived KV joins
            if pend and not self._bound[m].n:
                self._attach_pending(m, now)
        started: list[tuple[float, int]] = []
        if self._one_lanes is not None:  # one service, a one-model scheduler
            started = self._schedule_lanes(self._one_lanes, now)
            if self.jobs and self._busy_since is None:
                self._busy_since = now
            return self._retimed(now, started)
        while True:
            jobs = sched.schedule(self._state, _GroupBudget(self), now)
            ran = False
            for job in jobs:
                got = self._start(job, now)
                if got is not None:
                    started.append(got)
                    ran = True
            if self._taken:
                raise RuntimeError(
                    f"group {self.id}: the scheduler admitted requests {sorted(self._taken)} "
                    "but started no prefill job for them"
                )
            # a decode job whose requests were all preempted started nothing:
            # ask again (each such round preempts a request, so this ends)
            # a pipeline's lane does not hold the group: ask again until the decode round
            if not jobs or (ran and (not self.lanes or self._decoding())):
                break
        if self.jobs and self._busy_since is None:
            self._busy_since = now
        return self._retimed(now, started)

    def schedule_one(self, now: float) -> tuple[float, int] | None:
        """:meth:`schedule` of a group hosting one service whose scheduler has
        a one-model case (FCFS, RR: :attr:`GroupScheduler.one_model`), with
        its running requests bound: that case, as a one-model
        instance runs it (:class:`~fleetserve.policy.batching.OneModel`); the
        ``(end, token)`` of the job it started, if any. The queue is
        admitted in order while prompts fit (the prefill job, or with chunked
        prefill the mixed iteration, of what was admitted), else the batch
        decodes (a mixed iteration when prompts are partly prefilled).
        ``tests/test_batching_one_model.py`` checks that this is what the
        scheduler's :meth:`~GroupScheduler.schedule` decides."""
        m = self._one
        if m is None:
            raise RuntimeError(f"group {self.id}: no one-model case (several services, or unbound)")
        if self.jobs or self.state != "live":
            return None
        if self.pcache and self.chunked:
            self._fit_before_admission()
        b = self._bound[m]
        if self.pending[m]:  # at the batch's boundary: the requests whose KV is in join
            self._attach_pending(m, now)
        while True:
            q = self.waiting[m]
            got = None
            if q and self.admitting and not (self.alternate and self._after_prefill and b.running):
                admitted = admit_in_order(q, self._budget(self))
                if (
                    not admitted
                    and self.pressure is not None
                    and b.running
                    and self._head_blocked(m)
                    and self._react_blocked(m)
                ):
                    admitted = admit_in_order(q, self._budget(self))
                if admitted:
                    self._after_prefill = True
                    job = Job(m, PREFILL, tuple([s.id for s in admitted]), 1.0)
                    if self.chunked:
                        got = self._start_mixed(job, now)
                    else:
                        self._take_head(m, admitted)
                        end = now + self._prefill_time(m, admitted, 1.0)
                        got = (end, self._register(job, admitted, now, 1.0))
                    if self._taken:  # pragma: no cover - every one admitted is taken
                        raise RuntimeError(f"group {self.id}: admitted requests not started")
                    if got is None:  # pragma: no cover - a prefill job always starts
                        raise RuntimeError(f"group {self.id}: a prefill job did not start")
            if got is None:
                self._after_prefill = False
                if self.swapped[m]:
                    self._swap_in(m)
                if self.chunked and self.partial[m]:
                    got = self._start_mixed(Job(m, DECODE, (), 1.0), now)
                elif b.running or self._joining[m]:
                    got = self._start_bound(self._decode_job, b, now)
                else:
                    return None
            if got is not None:
                if self._busy_since is None:
                    self._busy_since = now
                return got
            if self.pressure is not None:  # the reactions chose to wait (KunServe's executors)
                return None
            # every running request was preempted: the queue again (a round
            # preempts a request each time, so this ends)

    def _schedule_lanes(self, m: str, now: float) -> list[tuple[float, int]]:
        """:meth:`schedule` of a pipelined group hosting one service, bound,
        under a scheduler with a one-model case (FCFS, RR), at a decode
        round's boundary: that case, as :meth:`schedule_one` is a replica's.
        Prefill lanes of the prompts admitted in queue order, one lane per
        stage at most, then the decode round of the running requests; what
        the scheduler's :meth:`~GroupScheduler.schedule`, asked again after
        each lane, decides (``tests/test_bound_groups.py`` drives both)."""
        started: list[tuple[float, int]] = []
        q = self.waiting[m]
        while q and self.lanes_in_flight() < self.stages:
            if not self.admitting or self.num_running(m) >= self.max_num_seqs:
                break  # no batch slot: the budget would admit nothing (_GroupBudget.fits)
            admitted = admit_in_order(q, self._budget(self))
            if not admitted:
                break
            got = self._start_lane(Job(m, PREFILL, tuple([s.id for s in admitted]), 1.0), now)
            if got is None or self._taken:  # pragma: no cover - a lane always starts
                raise RuntimeError(f"group {self.id}: a prefill lane did not start")
            started.append(got)
        b = self._bound[m]
        if b.running or self._joining[m]:
            got = self._start_lane(self._decode_job, now)
            if got is not None:
                started.append(got)
        return started

    def _retimed(self, now: float, started: list[tuple[float, int]]) -> list[tuple[float, int]]:
        """``started`` with the jobs that memory-bandwidth contention re-timed:
        a new job's end as re-timed, and each other job whose end moved under
        a new token (the old one is superseded: :meth:`stale`)."""
        bw = self._bw
        if bw is None:
            return started
        if not bw or self._retimed_now:  # (a pipeline re-timed since its last change)
            return started
        if self.lanes:
            self._reweigh()
            self._retimed_now = True  # (a spatial group re-times at every call)
        moved = bw.retime(now)
        if not moved:
            return started
        new = {tok for _, tok in started}
        out = [(moved.get(tok, end), tok) for end, tok in started]
        if self._bound:  # a bound decode round's end moved: the batch's as-of-now counts
            for tok, end in moved.items():
                job = self.jobs[tok][0]
                b = self._bound.get(job.model) if job.phase == DECODE else None
                if b is not None and b.n:
                    b.ends = [end]
        for tok, end in moved.items():
            if tok in new:
                continue
            fresh = self._next_token
            self._next_token += 1
            self.jobs[fresh] = self.jobs.pop(tok)
            bw.rekey(tok, fresh)
            self._superseded.add(tok)
            out.append((end, fresh))
        return out

    def stale(self, token: int) -> bool:
        """Whether job end ``token`` was superseded by a re-timed one (then
        forgotten: each token ends once)."""
        if token in self._superseded:
            self._superseded.discard(token)
            return True
        return False

    def _decoding(self) -> bool:
        """Whether a decode job is in flight."""
        return self._phase_jobs[DECODE] > 0

    def lanes_in_flight(self) -> int:
        """Prefill jobs in flight (a pipelined group's lanes)."""
        return self._phase_jobs[PREFILL]

    def _reweigh(self) -> None:
        """A pipelined group's decode round: its weight for the lanes now in flight."""
        assert self._bw is not None
        if not self._phase_jobs[DECODE]:
            return
        w = decode_weight(self.stages, self.lanes_in_flight())
        for token, (job, _, _, _) in self.jobs.items():
            if job.phase == DECODE:
                self._bw.set_weight(token, w)
                return  # (one decode round at most: check_integrity)

    def _start(self, job: Job, now: float) -> tuple[float, int] | None:
        m = job.model
        if (m, job.phase) in self._busy and not (self.lanes and job.phase == PREFILL):
            raise RuntimeError(f"group {self.id}: a {job.phase} job of {m} is already running")
        if self.lanes:
            return self._start_lane(job, now)
        share = job.share
        if not 0.0 < share <= self.free_share + _EPS:
            raise RuntimeError(
                f"group {self.id}: job {job.phase} of {m} asks share {share:.3f}, "
                f"{self.free_share:.3f} free"
            )
        share = min(share, 1.0)
        if self.chunked and (job.phase == PREFILL or self.partial[m]):
            return self._start_mixed(job, now)
        if job.phase == PREFILL:
            seqs = self._take_prefill(job)
            cost = self._prefill_time(m, seqs, share)
            traffic = 0.0
            if self._bw is not None:
                traffic = self.costs[m].prefill_memory_s([s.prefill_tokens for s in seqs])
        else:
            bb = self._bound.get(m)
            if bb is not None:
                return self._start_bound(job, bb, now)
            seqs = self._decode_seqs(job)
            macro = self.macro and not (self.chunked and any(self.partial.values()))
            ends = self._macro_ends(m, seqs, now) if macro else None
            if ends is not None:
                for s in seqs:
                    s.kv_saved += 1  # as a single step: the first token's KV
                token = self._register(Job(m, DECODE, job.seqs, 1.0), seqs, now, 1.0)
                self._ends[token] = ends
                return (float(ends[-1]), token)
            seqs = self._grow_decode(m, seqs)
            if not seqs:
                return None
            ctx = sum(s.kv_saved for s in seqs)
            cost = self.costs[m].decode_time_scalar(len(seqs), float(ctx), share)
            traffic = 0.0
            if self._bw is not None:
                traffic = self.costs[m].decode_memory_s(len(seqs), float(ctx))
        token = self._register(
            Job(m, job.phase, tuple(x.id for x in seqs), share), seqs, now, share
        )
        if self._bw is not None:
            self._bw.add(token, now, cost, traffic)
            self._retimed_now = False
        return (now + cost, token)

    def _prefill_time(self, m: str, seqs: list[Seq], share: float) -> float:
        """How long a prefill job of ``seqs`` (admitted, out of the queue)
        takes on ``share`` of the group: with prefix caching, each prompt's
        hits are not computed (a chunk over cached tokens); beside KV copies,
        slower (:attr:`copy_load`)."""
        lens = [s.prompt_tokens + s.gen_saved for s in seqs]
        cache = self.pcache.get(m) if self.pcache else None
        if cache is not None:  # the admissions' KV evicts cached entries
            cache.fit(self.layout.free_token_blocks(m))
            if any(s.prefilled for s in seqs):  # the hits are not computed
                work = [(n - s.prefilled, s.prefilled) for s, n in zip(seqs, lens, strict=True)]
                ic: InstanceCost = self.costs[m]  # type: ignore[assignment]  # a replica's
                t = ic.mixed_time(work, 0, 0, share)
                if self.copy_load:
                    t = float(beside_copies(t, ic.mixed_memory_s(work, 0, 0), self.copy_load))
                return t
        t = self.costs[m].prefill_time(lens, share)
        if self.copy_load:
            t = float(beside_copies(t, self.costs[m].prefill_memory_s(lens), self.copy_load))
        return t

    def _start_mixed(self, job: Job, now: float) -> tuple[float, int] | None:
        """Chunked prefill: one mixed iteration of the job's service, as the
        single-model instance runs it. Every running request of the service
        decodes (victims preempted first while their next tokens do not fit;
        the admission reserved those blocks, so a job that admitted preempts
        nothing), then the partly prefilled prompts' next chunks, then the
        prompts the job admitted, within ``max_batched_tokens`` (a prompt's
        KV was taken in full at admission)."""
        m = job.model
        admitted = self._take_prefill(job) if job.phase == PREFILL else []
        b = self._bound.get(m)
        if b is not None:
            return self._start_mixed_bound(job, b, admitted, now)
        decodes = self._grow_decode(m, [s for s in self.running[m].values() if not s.in_job])
        chunks = self._mixed_chunks(m, admitted, self.max_batched_tokens - len(decodes))
        if not chunks:
            if not decodes:
                return None
            ctx = sum(s.kv_saved for s in decodes)
            cost = self.costs[m].decode_time_scalar(len(decodes), float(ctx))
            job = Job(m, DECODE, tuple(x.id for x in decodes), 1.0)
            token = self._register(job, decodes, now, 1.0)
            return (now + cost, token)
        ctx = sum(s.kv_saved for s in decodes)
        work = [(n, s.prefilled) for s, n in chunks]
        # a chunked group is never pipelined (refused in __init__): a replica's cost
        cost = cast("InstanceCost", self.costs[m]).mixed_time(work, len(decodes), ctx)
        seqs = decodes + [s for s, _ in chunks]
        token = self._register(
            Job(m, PREFILL, tuple(x.id for x in seqs), 1.0), seqs, now, 1.0, mixed=True
        )
        self._chunks[token] = chunks
        return (now + cost, token)

    def _mixed_chunks(self, m: str, admitted: list[Seq], left: int) -> list[tuple[Seq, int]]:
        """A mixed iteration's prompt chunks within ``left`` tokens: the partly
        prefilled prompts' next chunks, then the admitted prompts' first."""
        chunks: list[tuple[Seq, int]] = []
        for s in self.partial[m]:
            if left <= 0:
                break
            n = min(s.prompt_tokens + s.gen_saved - s.prefilled, left)
            chunks.append((s, n))
            left -= n
        for s in admitted:  # ``prefilled``: its cache hits (0 without prefix caching)
            self.partial[m].append(s)
            n = min(s.prompt_tokens + s.gen_saved - s.prefilled, left)
            if n <= 0:
                raise RuntimeError(f"group {self.id}: request {s.id} admitted past the budget")
            chunks.append((s, n))
            left -= n
        return chunks

    def _start_mixed_bound(
        self, job: Job, b: BoundBatch, admitted: list[Seq], now: float
    ) -> tuple[float, int] | None:
        """:meth:`_start_mixed` for a bound batch: the batch decodes one step
        (victims preempted first while it does not fit, as
        :meth:`_start_bound`), then the chunks."""
        m = job.model
        C, n_fit = self._bound_boundary(m, b)
        C, n_fit = self._preempt_to_fit(m, b, C, n_fit)
        cache = self.pcache.get(m)
        if cache is not None:  # the admissions' KV and the decodes' blocks evict entries
            cache.fit(self.layout.free_token_blocks(m) - C[0])
        B = len(b)
        chunks = self._mixed_chunks(m, admitted, self.max_batched_tokens - B)
        if not chunks and not B:
            return None
        ctx = b.tokens + B
        cost = cast("InstanceCost", self.costs[m])
        work = [(n, s.prefilled) for s, n in chunks]
        t = cost.mixed_time(work, B, ctx) if chunks else cost.decode_time_scalar(B, float(ctx))
        if self.copy_load:
            mem = cost.mixed_memory_s(work, B, ctx) if chunks else cost.decode_memory_s(B, ctx)
            t = float(beside_copies(t, mem, self.copy_load))
        end = now + t
        if B:
            b.begin([end], 1, C)
            self.layout.bulk_change(m, 0, B, b.grown(0))
        if not chunks:
            token = self._register(Job(m, DECODE, tuple(b.running), 1.0), [], now, 1.0)
            return (end, token)
        seqs = [s for s, _ in chunks]
        ids = (*b.running, *(x.id for x in seqs))
        token = self._register(Job(m, PREFILL, ids, 1.0), seqs, now, 1.0, mixed=True)
        self._chunks[token] = chunks
        return (end, token)

    def _bound_boundary(self, m: str, b: BoundBatch) -> tuple[list[int], int]:
        """At a boundary of ``m``'s bound batch: the requests adopted during
        its last segment join it; its growth against the free token-blocks."""
        joining = self._joining[m]
        if joining:
            for s in joining:
                self.layout.bind(s.id)
                b.run(s, s.kv_saved)
            joining.clear()
        return b.growth(self.layout.free_token_blocks(m))

    def _preempt_to_fit(
        self, m: str, b: BoundBatch, C: list[int], n_fit: int
    ) -> tuple[list[int], int]:
        """While the next iteration of ``m``'s bound batch does not fit
        (``n_fit`` 0), preempt the scheduler's victim among it (as
        :meth:`_grow_decode`); the growth then (an empty batch fits). With
        memory-pressure reactions (:attr:`pressure`), their step each time:
        preempt or swap out the victim, or wait (``n_fit`` -1: no decode
        now, a swap-out in flight frees memory)."""
        while n_fit == 0:
            cands = list(b.running.values())
            if self.pressure is not None:
                action = self.pressure.decode_short(self._pview(m), self._victim_of(m))
                if action is None:
                    return C, -1
                s = b.running[action.request_id]
                if isinstance(action, SwapOut):
                    self._swap_out(s)
                else:
                    self._preempt(s)
            else:
                victim = self.scheduler.victim(self._state, m, cands)
                if victim not in cands:
                    raise RuntimeError(f"group {self.id}: victim {victim.id} is not preemptible")
                self._preempt(cast("Seq", victim))
            C, n_fit = b.growth(self.layout.free_token_blocks(m))
        return C, n_fit

    def _start_lane(self, job: Job, now: float) -> tuple[float, int] | None:
        """A pipelined group's job (module docstring): a prefill lane, or the
        decode round; the stages' time is divided among the jobs in flight
        (they hold no compute share)."""
        assert self._bw is not None
        m = job.model
        cost = cast("StagedCost", self.costs[m])
        if job.phase == PREFILL:
            if self.lanes_in_flight() >= self.stages:
                raise RuntimeError(f"group {self.id}: every stage already has a prefill lane")
            seqs = self._take_prefill(job)
            alone, busy = cost.prefill_lane([s.prompt_tokens + s.gen_saved for s in seqs])
            weight = 1.0
        else:
            b = self._bound.get(m)
            if b is not None:
                return self._start_bound_round(job, b, cost, now)
            seqs = self._grow_decode(m, self._decode_seqs(job))
            if not seqs:
                return None
            ctx = sum(s.kv_saved for s in seqs)
            if self.round_cost is not None:  # the world's (KunServe: remote attention)
                alone, busy = self.round_cost(m, len(seqs), ctx)
            else:
                alone, busy = cost.decode_round(len(seqs), float(ctx))
            weight = decode_weight(self.stages, self.lanes_in_flight())
        token = self._register(Job(m, job.phase, tuple(x.id for x in seqs), 1.0), seqs, now, 0.0)
        self._bw.add(token, now, alone, busy, weight)
        self._retimed_now = False
        return (now + alone, token)

    def _start_bound_round(
        self, job: Job, b: BoundBatch, cost: StagedCost, now: float
    ) -> tuple[float, int] | None:
        """A pipelined group's decode round of a bound batch: one iteration
        (victims preempted while it does not fit, as :meth:`_start_bound`),
        beside the prefill lanes in flight."""
        assert self._bw is not None
        m = job.model
        C, n_fit = self._bound_boundary(m, b)
        if job is not self._decode_job and len(job.seqs) != len(b):
            raise RuntimeError(
                f"group {self.id}: a decode job of {m} names {len(job.seqs)} of its "
                f"{len(b)} running requests; a bound batch decodes as a whole"
            )
        if n_fit == 0:
            C, n_fit = self._preempt_to_fit(m, b, C, n_fit)
            if n_fit < 0 or not b.running:
                return None
        B = len(b)
        if self.round_cost is not None:  # the world's (KunServe: remote attention)
            alone, busy = self.round_cost(m, B, b.tokens + B)
        else:
            alone, busy = cost.decode_round(B, float(b.tokens + B))
        end, token = self._begin_bound(job, b, [now + alone], C, now, share=0.0)
        self._bw.add(token, now, alone, busy, decode_weight(self.stages, self.lanes_in_flight()))
        self._retimed_now = False
        return (end, token)

    def _take_prefill(self, job: Job) -> list[Seq]:
        """A prefill job's requests (admitted through the budget), out of the queue."""
        seqs = self._admitted(job)
        bs = self._bs
        self.queued_blocks[job.model] -= sum(-(-s.prefill_tokens // bs) for s in seqs)
        q = self.waiting[job.model]
        n = len(seqs)
        if n == len(q):
            q.clear()
        elif all(q[i] is s for i, s in enumerate(seqs)):  # the head, in order (FCFS, RR)
            for _ in range(n):
                q.popleft()
        else:  # in place: the deque is the group's own, never rebound
            ids = set(job.seqs)
            keep = [s for s in q if s.id not in ids]
            q.clear()
            q.extend(keep)
        return seqs

    def _take_head(self, m: str, admitted: list[Seq]) -> None:
        """:meth:`_take_prefill` of prompts admitted in queue order (a
        one-model case: the head of ``m``'s queue)."""
        taken = self._taken
        q = self.waiting[m]
        bs = self._bs
        blocks = 0
        for s in admitted:
            if taken.pop(s.id, None) is not s or q.popleft() is not s:
                raise RuntimeError(f"group {self.id}: request {s.id} was not admitted at the head")
            blocks += -(-s.prefill_tokens // bs)
        self.queued_blocks[m] -= blocks

    def _decode_seqs(self, job: Job) -> list[Seq]:
        """A decode job's running requests (none of them may be in a job)."""
        run = self.running[job.model]
        seqs = [run[i] for i in job.seqs]
        if any(s.in_job for s in seqs):
            raise RuntimeError(f"group {self.id}: a request of the decode job is busy")
        return seqs

    def _register(
        self, job: Job, seqs: list[Seq], now: float, share: float, *, mixed: bool = False
    ) -> int:
        for s in seqs:
            s.in_job = True
        if job.phase == PREFILL and not mixed:
            self._n_prefill[job.model] += len(seqs)
        token = self._next_token
        self._next_token += 1
        self.jobs[token] = (job, seqs, now, share)
        key = (job.model, job.phase)
        self._busy[key] = self._busy.get(key, 0) + 1
        self._phase_jobs[job.phase] += 1
        self.held_share += share
        return token

    def _start_bound(self, job: Job, b: BoundBatch, now: float) -> tuple[float, int] | None:
        """A decode job of a bound batch: the explicit path's decision
        (:meth:`_macro_ends`, else one iteration that preempts victims while
        it does not fit, :meth:`_grow_decode`) from the batch's counts. The
        iterations that fit are the batch's growth
        (:meth:`~fleetserve.sim.batch.BoundBatch.growth`) within the free
        token-blocks; the layout takes the segment's tokens and blocks as one
        change of the batch's totals.

        As an instance's decode segment, a bound batch's runs up to its first
        finish or block shortage (no cap on its length: its ends are one
        sum), also after preempting when no queued prompt of the group could
        be admitted at a later boundary of it (:meth:`_may_admit`: the free
        blocks only shrink until a request finishes). Either way each
        iteration is the one a step-by-step run makes; only the number of
        events differs."""
        m = job.model
        if self._joining[m]:
            C, n_fit = self._bound_boundary(m, b)
        else:
            C, n_fit = b.growth(self.layout.free_token_blocks(m))
        if job is not self._decode_job and len(job.seqs) != len(b):
            raise RuntimeError(
                f"group {self.id}: a decode job of {m} names {len(job.seqs)} of its "
                f"{len(b)} running requests; a bound batch decodes as a whole"
            )
        macro = self.macro and not (self.chunked and any(self.partial.values()))
        if macro and n_fit > 1:
            got = self._bound_segment(job, b, C, n_fit, now)
            if got is not None:
                return got
        if n_fit == 0:
            C, n_fit = self._preempt_to_fit(m, b, C, n_fit)
            if n_fit < 0 or not b.running:
                return None
            if macro and n_fit > 1 and not self._may_admit():
                got = self._bound_segment(job, b, C, n_fit, now)
                if got is not None:
                    return got
        B = len(b.running)
        if self.round_cost is not None:  # the world's (KunServe: remote attention)
            return self._begin_bound(job, b, [now + self.round_cost(m, B, b.tokens + B)[0]], C, now)
        cost: InstanceCost = self.costs[m]  # type: ignore[assignment]  # a replica's
        t1 = cost.decode_time_scalar(B, float(b.tokens + B), job.share)
        if self.copy_load:
            mem = cost.decode_memory_s(B, float(b.tokens + B))
            t1 = float(beside_copies(t1, mem, self.copy_load))
        return self._begin_bound(job, b, [now + t1], C, now)

    def _bound_segment(
        self, job: Job, b: BoundBatch, C: list[int], n_fit: int, now: float
    ) -> tuple[float, int] | None:
        """A bound batch's decode segment of more than one iteration (up to
        its first finish and the ``n_fit`` iterations that fit, as long as
        the scheduler keeps choosing it), or None (one iteration, then)."""
        m = job.model
        k = min(b.earliest_finish() - b.steps, n_fit)
        if k <= 1:
            return None
        cost: InstanceCost = self.costs[m]  # type: ignore[assignment]  # a replica's
        B = len(b.running)
        if self.copy_load:
            ctxs = b.tokens + B * np.arange(1, k + 1, dtype=np.float64)
            t = beside_copies(
                cost.decode_time(B, ctxs), cost.decode_memory(B, ctxs), self.copy_load
            )
            ends: Ends = np.cumsum(np.concatenate(([now], t)))[1:]
        else:
            ends = cost.decode_ends(B, b.tokens, k, now)
        if not self._keeps_lone:  # (FCFS, RR with one service keep them all)
            k = self.scheduler.stable_iterations(
                self._state, m, b.running.values(), _floats(ends), now
            )
            if k <= 1:
                return None
        return self._begin_bound(job, b, ends[:k], C, now)

    def _may_admit(self) -> bool:
        """Whether a queued prompt of any service could be admitted at a
        later boundary of a decode segment starting now (conservative: its
        blocks fit the service's free token-blocks above the watermark; with
        prefix caching, any queued prompt, since hits may need fewer). The
        rule of the single-model ``Instance`` this group replaced (session 29)."""
        lay = self.layout
        bs = self._bs
        for m, q in self.waiting.items():
            if not q:
                continue
            if self.pcache:
                return True
            room = lay.free_token_blocks(m) - self.watermark_tokens[m] // bs
            if any(-(-s.prefill_tokens // bs) <= room for s in q):
                return True
        return False

    def _begin_bound(
        self, job: Job, b: BoundBatch, ends: Ends, C: list[int], now: float, share: float = 1.0
    ) -> tuple[float, int]:
        """Start a bound batch's decode segment of ``len(ends)`` iterations:
        its KV allocated ahead (as a macro job's), one job holding ``share``
        of the group (a temporal job the whole group; a pipeline's round
        none, its stages' time is divided by weight)."""
        k = len(ends)
        m = job.model
        b.begin(ends, k, C)
        self.layout.bulk_change(m, 0, len(b.running) * k, b.grown(k - 1))
        if job.share != 1.0:  # a job of the whole batch (its share is the group's)
            job = Job(m, DECODE, job.seqs, 1.0)
        # :meth:`_register`, inlined (no request is marked: the batch runs)
        token = self._next_token
        self._next_token = token + 1
        self.jobs[token] = (job, [], now, share)
        key = (m, DECODE)
        self._busy[key] = self._busy.get(key, 0) + 1
        self._phase_jobs[DECODE] += 1
        self.held_share += share
        if k > 1:
            self._ends[token] = ends
        return (float(ends[-1]), token)

    def _unbind(self, s: Seq, *, keep_refs: bool = False) -> int:
        """Take running ``s`` out of its bound batch, its KV freed (its cache
        references too, unless ``keep_refs``); its tokens."""
        b = self._bound[s.model]
        kv = b.unrun(s)
        del self.running[s.model][s.id]
        bs = self._bs
        sh = s.shared
        self.layout.bulk_change(s.model, -1, sh * bs - kv, (-kv) // bs + sh)
        if s.refs is not None and not keep_refs:
            self._release_refs(s)
        return kv

    def _macro_ends(self, model: str, seqs: list[Seq], now: float) -> Ends | None:
        """End times of the decode iterations this batch may run as one job
        (None: step by step).

        Up to the first finish (at most ``_MACRO_MAX`` iterations), as long as
        the scheduler's decision provably stays this same batch
        (:meth:`~fleetserve.policy.sharing.GroupScheduler.stable_iterations`:
        e.g. no queued request and no other service running), and if the KV
        for all of them can be allocated now (each request grows to its
        tokens at the segment's end; when an arrival cuts the segment short,
        the blocks of the iterations cut off are given back). The
        scheduler still sees every iteration (``on_job_end`` per iteration),
        and the iteration ends are the running sum of the same iteration times
        as step by step, so results equal a step-by-step run. When the KV of
        all of them does not fit, the job runs the iterations that do
        (:meth:`_iterations_that_fit`), as an instance's decode segment ends
        at its first block shortage.
        """
        k = min(min(s.output_tokens - s.gen_saved for s in seqs), _MACRO_MAX)
        if k <= 1:
            return None
        b = len(seqs)
        base = sum(s.kv_saved for s in seqs)
        ctxs = base + b * np.arange(1, k + 1, dtype=np.float64)
        times = self.costs[model].decode_time(b, ctxs)
        ends = np.cumsum(np.concatenate(([now], times)))[1:]
        k = self.scheduler.stable_iterations(self._state, model, seqs, ends.tolist(), now)
        if k <= 1:
            return None
        k = self._iterations_that_fit(model, seqs, k)
        if k <= 1:
            return None
        self.layout.grow_all(model, [s.id for s in seqs], [s.kv_saved + k for s in seqs])
        return ends[:k]

    def _iterations_that_fit(self, model: str, seqs: list[Seq], k: int) -> int:
        """The most iterations, at most ``k``, for which every request of
        ``seqs`` can hold its KV at once (each one more token per iteration;
        0 or 1: step by step). The iteration after them is the first a
        step-by-step run would find short of memory, where it preempts; the
        instance ends its decode segment at the same iteration.

        Without a quota (``kv_limit`` infinite) the KV the iterations need is
        one sum over the requests (the layout's fit is additive); with one,
        each probe grows the requests in order through :meth:`can_hold` and
        undoes it. Bisection on the count either way."""
        lay = self.layout
        if self.scheduler.kv_limit(model) == math.inf:
            ids = [s.id for s in seqs]
            kv = np.fromiter((s.kv_saved for s in seqs), np.int64, len(seqs))

            def fits(n: int) -> bool:
                return lay.can_add_blocks(model, lay.grow_needs(model, ids, kv + n))

        else:

            def fits(n: int) -> bool:
                grown = 0
                ok = True
                for s in seqs:
                    if not self.can_hold(s, s.kv_saved + n):
                        ok = False
                        break
                    lay.grow(s.id, s.model, s.kv_saved + n)
                    grown += 1
                for x in seqs[:grown]:
                    lay.shrink(x.id, x.kv_saved)
                return ok

        if fits(k):
            return k
        lo, hi = 1, k  # fits(hi) is false
        if not fits(lo):
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def truncate(self, now: float) -> list[tuple[float, int]]:
        """End a macro job after its iteration in flight (a request arrived:
        the scheduler decides again at the next iteration boundary); the new
        ``(end, token)`` to push, if it got shorter."""
        if not self._ends:
            return []
        out = []
        for token, ends in list(self._ends.items()):
            j = bisect_right(ends, now)  # iterations completed
            if j + 1 < len(ends):
                del self._ends[token]
                entry = self.jobs.pop(token)
                new = self._next_token
                self._next_token += 1
                self.jobs[new] = entry
                self._ends[new] = ends[: j + 1]
                out.append((float(ends[j]), new))
                # give back the KV allocated ahead for the iterations cut off:
                # the blocks are then exactly those of a step-by-step run
                b = self._bound.get(entry[0].model)
                if b is not None:
                    k = len(ends)
                    give = b.grown(k - 1) - b.grown(j)
                    self.layout.bulk_change(entry[0].model, 0, -len(b) * (k - j - 1), -give)
                    b.cut(j + 1)
                    continue
                for s in entry[1]:
                    self.layout.shrink(s.id, s.kv_saved + j)
        return out

    def _admitted(self, job: Job) -> list[Seq]:
        """The requests of a prefill job: taken through the budget (KV allocated)."""
        out = []
        for rid in job.seqs:
            s = self._taken.pop(rid, None)
            if s is None:
                raise RuntimeError(f"group {self.id}: prefill of request {rid} not admitted")
            out.append(s)
        return out

    def _grow_decode(self, model: str, seqs: list[Seq]) -> list[Seq]:
        """Grow each request of a decode job by one token, preempting victims
        of ``model`` when that does not fit; the requests left in the job."""
        lay = self.layout
        job = list(seqs)
        i = 0
        while i < len(job):
            s = job[i]
            want = s.kv_saved + 1
            if self.can_hold(s, want):
                lay.grow(s.id, s.model, want)
                s.kv_saved = want
                i += 1
                continue
            cands = [x for x in self.running[model].values() if not x.in_job]
            victim = self.scheduler.victim(self._state, model, cands)
            if victim not in cands:
                raise RuntimeError(f"group {self.id}: victim {victim.id} is not preemptible")
            self._preempt(victim)
            if victim in job:
                k = job.index(victim)
                job.pop(k)
                if k < i:
                    i -= 1
        return job

    def _evict(self, s: Seq) -> None:
        """Free running ``s``'s KV (it will be recomputed); the caller queues it."""
        if s.bound:
            self._unbind(s)
        else:
            self.layout.free(s.id)
            del self.running[s.model][s.id]
        s.kv_saved = 0
        s.state = WAITING
        s.record.preemptions += 1
        self.preemptions += 1
        if self.on_evicted is not None:  # the world keeps the request's other state
            self.on_evicted(s)
        elif s.mig is not None:  # its move aborts (sim/migration.py)
            self.preempted_migrating.append(s)

    def _preempt(self, s: Seq) -> None:
        """Recompute-preempt ``s``: its KV freed, back to the head of its queue."""
        self._evict(s)
        self.queued_blocks[s.model] += -(-s.prefill_tokens // self._bs)
        self.waiting[s.model].appendleft(s)

    # ------------------------------------------- memory-pressure reactions
    def _victim_of(self, m: str) -> Callable[[list[Any]], Any]:
        """The scheduler's victim among candidates of service ``m``."""
        return lambda among: self.scheduler.victim(self._state, m, among)

    def _pview(self, m: str) -> PressureView:
        """Service ``m`` as the pressure reaction reads it (KV in tokens)."""
        q = self.waiting[m]
        sw = self.swapped[m]
        return PressureView(
            room_tokens=self.layout.free_token_blocks(m) * self._bs - self.watermark_tokens[m],
            head_tokens=q[0].prefill_tokens if q else 0,
            running=list(self._bound[m].running.values()),
            swapped=tuple(x.id for x in sw),
            swapped_tokens=tuple(x.kv_saved for x in sw),
            swap_out_busy=self.swap_out_busy,
            swap_in_busy=self.swap_in_busy,
        )

    def _head_blocked(self, m: str) -> bool:
        """The head of ``m``'s queue has a batch slot but not the memory."""
        bs = self._bs
        slots = self.max_num_seqs - self.num_running(m)
        room = self.layout.free_token_blocks(m) - self.watermark_tokens[m] // bs
        return slots > 0 and -(-self.waiting[m][0].prefill_tokens // bs) > room

    def _react_blocked(self, m: str) -> bool:
        """The queue's head does not fit: the reaction's steps
        (:meth:`~fleetserve.policy.pressure.PressureReaction.head_blocked`);
        whether KV was dropped. Requests whose KV was dropped go to the
        tail of the queue, newest last."""
        assert self.pressure is not None
        dropped: list[Seq] = []
        run = self.running[m]
        while True:
            action = self.pressure.head_blocked(self._pview(m), self._victim_of(m))
            if action is None:
                break
            s = run[action.request_id]
            if isinstance(action, DropKV):
                self._evict(s)
                dropped.append(s)
                continue
            self._swap_out(s)
            break
        bs = self._bs
        for s in reversed(dropped):
            self.queued_blocks[m] += -(-s.prefill_tokens // bs)
            self.waiting[m].append(s)
        return bool(dropped)

    def _swap_out(self, s: Seq) -> None:
        """Swap running ``s`` out to host memory: its KV stays held (stalled)
        until the world's copy ends (:meth:`swapped_out`)."""
        m = s.model
        kv = self._unbind(s)
        s.kv_saved = kv
        self.layout.hold(m, -(-kv // self._bs), check=False)  # the blocks just freed
        s.state = STALLED
        self.stalled[m][s.id] = s
        self.swap_out_busy = True
        s.record.preemptions += 1
        if self.on_swap is None:
            raise RuntimeError(f"group {self.id}: a swap-out needs the world's on_swap hook")
        self.on_swap(s, True)

    def swapped_out(self, s: Seq) -> None:
        """``s``'s swap-out copy ended: its KV leaves the pool; it waits in host memory."""
        m = s.model
        del self.stalled[m][s.id]
        self.layout.unhold(m, -(-s.kv_saved // self._bs))
        s.state = HOST
        self.swapped[m].append(s)
        self.swap_out_busy = False

    def _swap_in(self, m: str) -> None:
        """Before a decode: the reaction may bring the oldest swapped-out
        request back (its KV reserved now, copied in by the world)."""
        if self.pressure is None:
            return
        action = self.pressure.swap_in(self._pview(m))
        if action is None:
            return
        s = self.swapped[m].popleft()
        if s.id != action.request_id:
            raise RuntimeError(f"group {self.id}: swap-in of {action.request_id}, oldest is {s.id}")
        self.reserve(m, -(-s.kv_saved // self._bs))
        s.state = TRANSIT
        self.swap_in_busy = True
        if self.on_swap is None:
            raise RuntimeError(f"group {self.id}: a swap-in needs the world's on_swap hook")
        self.on_swap(s, False)

    def swapped_in(self, s: Seq) -> None:
        """``s``'s swap-in copy ended: it joins the batch at its next boundary."""
        self.swap_in_busy = False
        self.pending[s.model].append(s)

    def arrive(self, s: Seq) -> None:
        """``s``'s KV, reserved here (:meth:`reserve`), has been copied in: it
        joins the running batch at its next boundary."""
        self.pending[s.model].append(s)

    def stall(self, s: Seq, kv: int) -> None:
        """``s`` holds ``kv`` tokens of KV here (resident, not checked) but
        does not run yet (a blocking exchange's victim waiting for its
        pieces); :meth:`unstall` when it may."""
        m = s.model
        self.layout.hold(m, -(-kv // self._bs), check=False)
        s.state = STALLED
        s.inst = self.host
        s.kv_saved = kv
        self.stalled[m][s.id] = s

    def unstall(self, s: Seq) -> None:
        """Stalled ``s`` may run: it joins the batch at its next boundary
        (its held blocks count as a reservation until then)."""
        m = s.model
        del self.stalled[m][s.id]
        self.mig_in[m] += -(-s.kv_saved // self._bs)
        s.state = TRANSIT
        self.pending[m].append(s)

    def _attach_pending(self, m: str, now: float) -> None:
        """At a boundary of ``m``'s batch: the pending requests join it."""
        bs = self._bs
        for s in self.pending[m]:
            self.attach(s, s.kv_saved, -(-s.kv_saved // bs), now)
        self.pending[m].clear()

    def settle(self, now: float) -> None:
        """At a boundary of every batch (no decode in flight): the pending
        requests and those joining bind to their batch (a group about to
        hand its requests over, KunServe's merge)."""
        for m, b in self._bound.items():
            if b.n:
                raise RuntimeError(f"group {self.id}: a segment of {m!r} is in flight")
            if self.pending[m]:
                self._attach_pending(m, now)
            if self._joining[m]:
                self._bound_boundary(m, b)

    def adopt_resident(self, s: Seq, kv: int) -> None:
        """``s`` runs here from now on with ``kv`` tokens of KV that is already
        resident (KunServe's merge and split: the corrections of the staged
        layout say where it is), not checked against the free blocks; at its
        batch's boundary."""
        m = s.model
        b = self._moving(m)
        if b.n:
            raise RuntimeError(f"group {self.id}: a segment of {m!r} is in flight")
        self.layout.bulk_change(m, 1, kv, -(-kv // self._bs), check=False)
        s.inst = self.host
        b.run(s, kv)
        self.running[m][s.id] = s

    def complete(self, token: int, now: float) -> list[Seq]:
        """End job ``token`` at ``now``; returns the requests that finished
        (none for a token superseded by :meth:`truncate`)."""
        entry = self.jobs.pop(token, None)
        if entry is None:
            return []
        job, seqs, start, share = entry
        if job.phase == PREFILL and not (self._chunks and token in self._chunks):
            self._n_prefill[job.model] -= len(seqs)
        ends = self._ends.pop(token, None) if self._ends else None
        b = self._bound.get(job.model)
        if ends is not None and len(ends) > 1 and b is None:  # a macro job: all but its last
            k = len(ends)
            done_ends = _floats(ends[:-1])
            self.scheduler.on_job_ends(job, seqs, done_ends, start)
            prev = done_ends[-1]
            for s in seqs:
                s.gen_saved += k - 1
                s.kv_saved += k - 1
            start = prev
        key = (job.model, job.phase)
        busy = self._busy
        left = busy[key] - 1
        if left:
            busy[key] = left
        else:
            del busy[key]
        self._phase_jobs[job.phase] -= 1
        if self._bw is not None:
            self._bw.remove(token)
            self._retimed_now = False
        held = self.held_share - share
        self.held_share = held if held > 0.0 else 0.0
        if not self.jobs and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None
        if self._chunks:
            chunks = self._chunks.pop(token, None)
            if chunks is not None:
                return self._mixed_done(job, seqs, chunks, start, now)
        done: list[Seq] = []
        if b is not None:
            if job.phase == DECODE and not self._hooks:  # (FCFS, RR: the common case)
                self._bound_step_done(b, job.model, now, done)
                return done
            return self._bound_done(job, b, seqs, ends, start, now)
        live: list[Seq] = []
        for s in seqs:
            s.in_job = False
            if job.phase == PREFILL:
                self._now_running(s, now)
            self._emitted(s, now, done, live)
        self.scheduler.on_job_end(job, live, now - start, now)
        return done

    def _bound_done(
        self,
        job: Job,
        b: BoundBatch,
        seqs: list[Seq],
        ends: Ends | None,
        start: float,
        now: float,
    ) -> list[Seq]:
        """A job of a service with a bound batch ended. A decode segment moves
        the batch's step counter and its finished requests leave; a prefill's
        requests join the batch (or finish at their first token)."""
        done: list[Seq] = []
        if job.phase == DECODE:
            hooks = self._hooks  # (FCFS, RR: no per-job lists to build)
            if ends is not None and len(ends) > 1 and hooks:  # all but its last iteration
                self.scheduler.on_job_ends(job, list(b.running.values()), _floats(ends[:-1]), start)
                start = float(ends[-2])
            self._bound_step_done(b, job.model, now, done)
            if hooks:
                self.scheduler.on_job_end(job, list(b.running.values()), now - start, now)
            return done
        live: list[Seq] = []
        for s in seqs:
            s.in_job = False
            self._prefilled_bound(s, b, now, done, live)
        if self._hooks:
            self.scheduler.on_job_end(job, live, now - start, now)
        return done

    def _bound_step_done(self, b: BoundBatch, m: str, now: float, done: list[Seq]) -> None:
        """``m``'s bound batch ended its segment at ``now``: its step counter
        moves, and the requests that generated their last token leave."""
        b.end()
        bs = self._bs
        if self.pcache:  # the segment's growth evicts cached entries
            self.pcache[m].fit(self.layout.free_token_blocks(m))
        run = self.running[m]
        n = tokens = blocks = 0
        for s, kv in b.due():
            n += 1
            sh = s.shared
            tokens += kv - sh * bs
            blocks += -(-kv // bs) - sh
            del run[s.id]
            s.kv_saved = 0
            if s.refs is not None:  # its references, in finishing order (the LRU's)
                self._release_refs(s)
            self._finished(s, now)
            done.append(s)
        if n:  # their KV leaves the batch's totals at once
            self.layout.bulk_change(m, -n, -tokens, -blocks)

    def _prefilled_bound(
        self, s: Seq, b: BoundBatch, now: float, done: list[Seq], live: list[Seq]
    ) -> None:
        """``s``'s (re)prefill ended at ``now`` with its first token: it joins
        the bound batch, or finishes when that token was its last."""
        self._first_token(s, now)
        if s.refs is not None:  # its full prompt blocks become cache entries
            self._publish(s, s.kv_saved)
        if s.gen_saved + 1 >= s.output_tokens:
            s.gen_saved += 1
            self.layout.free(s.id)
            if s.refs is not None:
                self._release_refs(s)
            s.kv_saved = 0
            self._finished(s, now)
            done.append(s)
            return
        self.running[s.model][s.id] = s
        live.append(s)
        if b.n:  # a pipeline's lane ended during the decode round: it joins at its end
            s.state = RUNNING
            self._joining[s.model].append(s)
            return
        self.layout.bind(s.id)
        b.run(s, s.kv_saved)

    def _mixed_done(
        self, job: Job, seqs: list[Seq], chunks: list[tuple[Seq, int]], start: float, now: float
    ) -> list[Seq]:
        """A mixed iteration ended: the decodes emit a token each, the chunks
        are cached; a prompt whose last chunk ran emits its first token and
        runs (or finishes)."""
        m = job.model
        chunked = {id(s): n for s, n in chunks}
        part = self.partial[m]
        done: list[Seq] = []
        live: list[Seq] = []
        b = self._bound.get(m)
        if b is not None:  # the batch's step (if it decoded), then the chunks
            if b.n:
                self._bound_step_done(b, m, now, done)
            for s, k in chunks:
                s.in_job = False
                s.prefilled += k
                if s.refs is not None:  # the blocks its chunks computed become entries
                    self._publish(s, s.prefilled)
                if s.prefilled < s.prompt_tokens + s.gen_saved:
                    live.append(s)
                    continue
                part.remove(s)
                self._prefilled_bound(s, b, now, done, live)
            self.scheduler.on_job_end(job, [*live, *b.running.values()], now - start, now)
            return done
        for s in seqs:
            s.in_job = False
            n = chunked.get(id(s))
            if n is not None:
                s.prefilled += n
                if s.prefilled < s.prompt_tokens + s.gen_saved:
                    live.append(s)
                    continue
                part.remove(s)
                self._now_running(s, now)
            self._emitted(s, now, done, live)
        self.scheduler.on_job_end(job, live, now - start, now)
        return done

    def _now_running(self, s: Seq, now: float) -> None:
        """``s``'s (re)prefill ended at ``now``: it runs (first token recorded)."""
        self.running[s.model][s.id] = s
        s.state = RUNNING
        self._first_token(s, now)

    @staticmethod
    def _first_token(s: Seq, now: float) -> None:
        """``s``'s (re)prefill emitted a token at ``now``: its first, or the
        end of the stall of a move that sent its token ids (sim/migration.py)."""
        rec = s.record
        if rec.first_token_s is None:
            rec.first_token_s = now
        if s.stall_from is not None:
            rec.migration_stall_s += now - s.stall_from
            s.stall_from = None

    def _emitted(self, s: Seq, now: float, done: list[Seq], live: list[Seq]) -> None:
        """``s`` emitted a token at ``now``: into ``done`` (finished) or ``live``."""
        s.gen_saved += 1
        if s.gen_saved >= s.output_tokens:
            self._finish(s, now)
            done.append(s)
        else:
            live.append(s)

    def _finish(self, s: Seq, now: float) -> None:
        self.layout.free(s.id)
        del self.running[s.model][s.id]
        self._finished(s, now)

    def _finished(self, s: Seq, now: float) -> None:
        """``s`` (out of the group's sets, its KV freed) finished at ``now``."""
        s.state = DONE
        rec = s.record
        rec.status = "finished"
        rec.finish_s = now
        rec.generated = s.gen_saved
        rec.instance = self.id
        if self._on_finish:
            self.scheduler.on_finish(s)

    # ------------------------------------------------------------- handover
    def take_waiting(self) -> list[Seq]:
        """Remove and return every queued request (they hold no KV), and the
        partly prefilled prompts in no job (their KV freed: they prefill
        again wherever they go)."""
        out = [s for m in self._models for s in self.waiting[m]]
        for m in self._models:
            self.waiting[m].clear()
            self.queued_blocks[m] = 0
            keep = []
            for s in self.partial[m]:
                if s.in_job:
                    keep.append(s)
                    continue
                self.layout.free(s.id)
                if s.refs is not None:
                    self._release_refs(s)
                s.kv_saved = 0
                s.prefilled = 0
                out.append(s)
            self.partial[m] = keep
        for s in out:
            s.inst = None
        return out

    def take_running(self) -> list[Seq]:
        """Remove every running request (no job may be in flight), freeing its
        KV; ``kv_tokens`` keeps the token count its KV held (what a migration
        moves)."""
        if self.jobs:
            raise RuntimeError(f"group {self.id}: cannot hand over requests with jobs in flight")
        out = [s for m in self._models for s in self.running[m].values()]
        for s in out:
            if s.bound:
                s.kv_saved = self._unbind(s)
            else:  # explicit, or joining a bound batch
                self.layout.free(s.id)
                del self.running[s.model][s.id]
            s.inst = None
            s.state = TRANSIT
        for j in self._joining.values():
            j.clear()
        return out

    def adopt(self, seq: Seq, now: float) -> bool:
        """Take a migrated request with its KV (``seq.kv_tokens`` tokens) into
        the running set; False (nothing changed) when it does not fit. The
        scheduler sees it as a new arrival (its per-request state, e.g. DB's
        budget, starts afresh here)."""
        if seq.kv_saved <= 0 or not self.can_hold(seq, seq.kv_saved):
            return False
        self.layout.grow(seq.id, seq.model, seq.kv_saved)
        seq.inst = self.host
        self.running[seq.model][seq.id] = seq
        b = self._bound.get(seq.model)
        if b is not None and not b.n:
            self.layout.bind(seq.id)
            b.run(seq, seq.kv_saved)
        else:  # explicit; a bound batch's segment runs: it joins at the next boundary
            seq.state = RUNNING
            if b is not None:
                self._joining[seq.model].append(seq)
        self.scheduler.on_arrival(seq, now)
        return True

    # ------------------------------------------------------- moving a request
    def _moving(self, model: str) -> BoundBatch:
        """``model``'s bound batch, which a request moves out of and into
        (module docstring, "Moving a request")."""
        b = self._bound.get(model)
        if b is None:
            raise RuntimeError(
                f"group {self.id}: moving a request of {model!r} needs its bound batch "
                "(SharingGroup(bound=True))"
            )
        return b

    def add_copy_load(self, delta: float) -> None:
        """A KV copy through these GPUs started (``delta`` > 0) or ended: the
        iterations started from now on share the HBM with the copies in flight
        (:func:`~fleetserve.sim.contention.beside_copies`). The caller cuts
        the macro job in flight (:meth:`truncate`) so the next one re-plans."""
        if not self._bound:
            raise RuntimeError(
                f"group {self.id}: KV copies run beside bound batches only (module docstring)"
            )
        self.copy_load += delta
        if self.copy_load < 1e-12:
            self.copy_load = 0.0

    def reserve(self, model: str, blocks: int) -> None:
        """Hold ``blocks`` token-blocks of ``model`` for KV being copied in
        (after :meth:`truncate`: a macro job's blocks ahead are given back
        first). Raises :class:`~fleetserve.sim.kvlayout.PoolFull` when they
        do not fit."""
        self._moving(model)
        self.layout.hold(model, blocks)
        self.mig_in[model] += blocks
        cache = self.pcache.get(model)
        if cache is not None:  # the reservation evicts cached entries
            cache.fit(self.layout.free_token_blocks(model))

    def unreserve(self, model: str, blocks: int) -> None:
        """Give back a reservation of a copy that was aborted."""
        self.layout.unhold(model, blocks)
        self.mig_in[model] -= blocks

    def release_held(self, model: str, blocks: int, seq: Seq | None = None) -> None:
        """Free the ``blocks`` (private) a detached request ``seq`` kept while
        its final copy read them (:meth:`detach`), and its cache references."""
        self.layout.unhold(model, blocks)
        self.mig_out[model] -= blocks
        if seq is not None and self._holding.pop(seq.id, None) is seq:
            self._release_refs(seq)

    def remove_waiting(self, seq: Seq) -> None:
        """Take queued ``seq`` out (it moves elsewhere as token ids)."""
        self.waiting[seq.model].remove(seq)
        self.queued_blocks[seq.model] -= -(-seq.prefill_tokens // self._bs)
        seq.inst = None
        seq.state = TRANSIT

    def detach(self, seq: Seq, *, keep_blocks: bool) -> int:
        """Take running ``seq`` out of its bound batch at the batch's boundary
        (no segment in flight), its generated count saved as a preemption
        saves it. With ``keep_blocks`` its blocks stay held (``mig_out``)
        until :meth:`release_held`, else they are freed. Returns the KV
        tokens it held."""
        m = seq.model
        b = self._moving(m)
        if b.n or not seq.bound or b.running.get(seq.id) is not seq:
            raise RuntimeError(
                f"group {self.id}: request {seq.id} is not in {m!r}'s batch at a boundary"
            )
        kv = self._unbind(seq, keep_refs=keep_blocks)
        seq.state = TRANSIT
        seq.kv_saved = kv if keep_blocks else 0
        if keep_blocks:  # its private blocks held; its cache references kept
            blocks = -(-kv // self._bs) - seq.shared
            self.layout.hold(m, blocks)  # the blocks just freed: they fit
            self.mig_out[m] += blocks
            if seq.refs:
                self._holding[seq.id] = seq
            else:
                seq.refs = None
        return kv

    def attach(self, seq: Seq, kv: int, blocks: int, now: float) -> None:
        """Add ``seq``, holding ``kv`` tokens of KV copied into ``blocks``
        reserved token-blocks, to its service's running batch at the batch's
        boundary: it decodes from the next iteration on, as a request whose
        prefill just ended. The scheduler sees it as an arrival (as
        :meth:`adopt`)."""
        m = seq.model
        b = self._moving(m)
        if b.n or blocks != -(-kv // self._bs) or blocks > self.mig_in[m]:
            raise RuntimeError(
                f"group {self.id}: cannot attach request {seq.id} ({kv} tokens in "
                f"{blocks} blocks; {self.mig_in[m]} reserved; segment in flight: {bool(b.n)})"
            )
        if seq.refs is not None or seq.shared:  # pragma: no cover - copied KV is private
            raise RuntimeError(f"group {self.id}: request {seq.id} arrives with cache references")
        self.unreserve(m, blocks)
        # into the blocks just given back (resident: in a staged layout a
        # correction may have taken the room meanwhile)
        self.layout.bulk_change(m, 1, kv, blocks, check=False)
        seq.inst = self.host
        b.run(seq, kv)
        self.running[m][seq.id] = seq
        self.scheduler.on_arrival(seq, now)

    # -------------------------------------------------------- prefix caching
    def _admit_cached(self, s: Seq, n: int, hits: list[Entry], hit: int) -> None:
        """Allocate ``s``'s (re)prefill of ``n`` tokens with prefix caching:
        the hits (:meth:`PrefixCache.lookup`, ``hit`` tokens) become its
        references, held once by the layout (an evictable one taken back),
        the rest its private blocks; ``prefilled`` starts past the hits."""
        m = s.model
        if s.hashes is None:
            self.layout.grow(s.id, m, n)
            s.prefilled = 0
            return
        cache = self.pcache[m]
        revived = cache.acquire(hits)
        if revived:
            self.layout.hold(m, revived)
        s.refs = list(hits)
        s.shared = hit // self._bs
        s.pub = len(hits)
        self.layout.grow(s.id, m, n - s.shared * self._bs)
        s.prefilled = hit
        if s.gen_saved == 0:  # its first prefill
            s.record.cached_tokens = hit
        else:
            cache.stats.recompute_hit_tokens += hit

    def _publish(self, s: Seq, computed: int) -> None:
        """The full prompt blocks of ``s`` its prefill computed (its first
        ``computed`` tokens) become cache entries it references: those blocks
        move from its private ones to the layout's held ones."""
        before = s.shared
        self.pcache[s.model].publish(s, computed)
        moved = s.shared - before
        if moved:
            self.layout.shrink(s.id, s.kv_saved - s.shared * self._bs)
            self.layout.hold(s.model, moved)

    def _release_refs(self, s: Seq) -> None:
        """Drop the cache references of ``s``: the entries nobody references
        any more become evictable (free)."""
        refs = s.refs
        assert refs is not None
        freed = self.pcache[s.model].release(refs)
        if freed:
            self.layout.unhold(s.model, freed)
        s.refs = None
        s.shared = 0

    def _fit_before_admission(self) -> None:
        """Chunked prefill: before the scheduler admits, each cache keeps its
        evictable entries within the blocks free after its service's decodes
        of the next mixed iteration (the instance evicts there too). Skipped
        when those decodes do not fit: the mixed iteration preempts first
        and admits nothing, and evicts then (:meth:`_start_mixed_bound`)."""
        for m, cache in self.pcache.items():
            if not (self.waiting[m] or self.partial[m]):
                continue
            b = self._bound[m]
            bs = self._bs
            opening = b.opening() + sum(1 for x in self._joining[m] if x.kv_saved % bs == 0)
            free = self.layout.free_token_blocks(m) - opening
            if free >= 0:
                cache.fit(free)

    # ------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Every request in exactly one place; KV held exactly by running ones."""
        lay = self.layout
        lay.check_integrity()
        seen: set[int] = set()
        for m in self._models:
            for s in self.waiting[m]:
                assert s.id not in seen and not s.in_job and s.kv_saved == 0, s.id
                assert s.state == WAITING and s.inst is self.host, s.id
                assert not lay.holds(s.id), s.id
                assert s.refs is None and s.shared == 0, s.id
                seen.add(s.id)
            b = self._bound.get(m)
            for rid, s in self.running[m].items():
                assert rid == s.id and s.id not in seen and s.state == RUNNING, s.id
                if b is not None and s.bound:  # in the batch's totals
                    assert b.running.get(rid) is s and s.batch is b and s.inst is self.host, s.id
                    assert not lay.holds(s.id), s.id
                elif b is not None:  # adopted while the segment ran: joins at its end
                    assert s in self._joining[m] and lay.tokens_of(s.id) == s.kv_saved, s.id
                else:  # a macro job allocates its segment's KV ahead: held >= cached
                    assert lay.holds(s.id) and lay.tokens_of(s.id) >= s.kv_saved, s.id
                seen.add(s.id)
            if b is not None:
                b.check()
                assert all(self.running[m].get(r) is x for r, x in b.running.items()), m
                assert len(self.running[m]) == len(b) + len(self._joining[m]), m
                bs = lay.block_size
                n = b.n
                assert not n or any(j.model == m for j, _, _, _ in self.jobs.values()), m
                want_blocks = sum(-(-(s.base + b.steps) // bs) for s in b.running.values())
                if n:
                    want_blocks += b.grown(n - 1)
                shared = sum(s.shared for s in b.running.values())  # cache entries' blocks
                got = lay.bulk(m)
                bulk = (len(b), b.tokens + len(b) * n - shared * bs, want_blocks - shared)
                assert got == bulk, (m, got, bulk)
            for s in self.stalled[m].values():  # KV held, not running (swap-out, exchange)
                assert s.id not in seen and s.state == STALLED and s.inst is self.host, s.id
                assert not lay.holds(s.id) and s.kv_saved > 0, s.id
                seen.add(s.id)
            for s in self.pending[m]:  # KV in (reserved): joins at the next boundary
                assert s.id not in seen and s.state == TRANSIT and s.inst is self.host, s.id
                seen.add(s.id)
            for s in self.swapped[m]:  # in host memory: no KV here
                assert s.id not in seen and s.state == HOST and s.inst is self.host, s.id
                seen.add(s.id)
            for s in self.partial[m]:  # admitted, partly prefilled: KV held in full
                assert s.id not in seen and s.state == PREFILLING and s.inst is self.host, s.id
                assert s.kv_saved == s.prompt_tokens + s.gen_saved, s.id
                assert lay.tokens_of(s.id) == s.kv_saved - s.shared * lay.block_size, s.id
                assert 0 <= s.prefilled < s.kv_saved, s.id
                seen.add(s.id)
        for token, (job, ss, _, _) in self.jobs.items():
            mixed = token in self._chunks
            for s in ss:
                assert s.in_job, s.id
                if mixed:
                    assert s.id in seen, s.id  # running or partial
                elif job.phase == PREFILL:  # admitted: KV held, not yet running
                    assert s.id not in seen and lay.holds(s.id) and s.state == PREFILLING, s.id
                    seen.add(s.id)
                else:
                    assert self.running[s.model].get(s.id) is s, s.id
        assert not self._taken
        for m in self._models:
            n_pre = sum(map(len, self._prefill_jobs(m)))
            assert self._n_prefill[m] == n_pre, (m, self._n_prefill[m], n_pre)
        bs = lay.block_size
        for m in self._models:  # the layout's held blocks: the moves' and the cache's
            assert self.mig_in[m] >= 0 and self.mig_out[m] >= 0, m
            referenced = 0
            cache = self.pcache.get(m)
            if cache is not None:  # references, entries, eviction (prefix_cache.check)
                holding = [x for x in self._holding.values() if x.model == m]
                for x in holding:
                    assert x.refs and x.state == TRANSIT and x.mig is not None, x.id
                holders = [*self.running[m].values(), *self.prefilling(m), *holding]
                b = self._bound[m]
                ahead = b.grown(b.n - 1) if b.n else 0  # allocated ahead of the boundary
                referenced = cache.check(holders, lay.free_token_blocks(m) + ahead)
            else:
                for x in (*self.running[m].values(), *self.prefilling(m)):
                    assert x.refs is None and x.shared == 0, x.id
            stalled = sum(-(-x.kv_saved // bs) for x in self.stalled[m].values())
            want_held = self.mig_in[m] + self.mig_out[m] + referenced + stalled
            assert lay.held(m) == want_held, (m, lay.held(m), want_held)
        if not self.pcache:
            assert not self._holding
        bs = lay.block_size
        for m in self._models:
            want = sum(-(-s.prefill_tokens // bs) for s in self.waiting[m])
            assert self.queued_blocks[m] == want, (m, self.queued_blocks[m], want)
        assert self.held_share <= 1.0 + 1e-6, self.held_share
        for ph, n in self._phase_jobs.items():  # the kept counts are the jobs' own
            assert n == sum(j.phase == ph for j, _, _, _ in self.jobs.values()), (ph, n)
        if self.lanes:  # a pipeline: a lane per stage at most, one decode round
            assert self.lanes_in_flight() <= self.stages, self.lanes_in_flight()
            assert self._phase_jobs[DECODE] <= 1
        if self._bw is not None:
            assert self._bw.tokens() == set(self.jobs), (self._bw.tokens(), set(self.jobs))
            for token, (job, _, _, _) in self.jobs.items():
                b = self._bound.get(job.model) if job.phase == DECODE else None
                if b is not None and b.n:  # a bound round's as-of-now counts read its end
                    assert b.ends[-1] == self._bw.end_of(token), (token, b.ends, job)
        for m in self._models:
            # within the quota, or one request alone past it (GroupScheduler.kv_allows)
            limit = self.scheduler.kv_limit(m)
            over = lay.used_bytes(m) > limit + 1e-6
            assert not over or lay.holders(m) == 1, (m, lay.used_bytes(m), limit)


class HostView:
    """A sharing group as one service's instance, for the dispatch policies
    (implements :class:`~fleetserve.cluster.state.InstanceView`): the
    service's requests and the KV memory the group's layout could give it::

        group 3 hosting a, b          view (3, "a")
        +------------------------+    num_running/waiting: a's only
        | a's KV | b's KV | free |    available_blocks: free bytes a could
        +------------------------+    use (its quota under ADBS) / a's block

    A view is made when a request is dispatched and read at once, or kept
    and moved to each read's time (:meth:`at`). A one-model group's instance
    (:class:`~fleetserve.sim.group_instance.GroupInstance`) is this view of
    its group, read at the simulation clock's time.
    """

    __slots__ = ("_g", "_kind", "_now", "model")

    def __init__(self, group: SharingGroup, model: str, now: float = 0.0) -> None:
        self._bind(group, model)
        self._now = now

    def _bind(self, group: SharingGroup, model: str) -> None:
        self._g = group
        self.model = model
        lay = group.layout
        # 0: its own partition; 1: head-wise units any service can use; 2: merged
        self._kind = 1 if isinstance(lay, HeadwiseLayout) else 0 if lay.counts_only else 2

    def at(self, now: float) -> HostView:
        """This view as of ``now``."""
        self._now = now
        return self

    @property
    def id(self) -> int:
        return self._g.id

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(self._g.gpus)

    @property
    def tp(self) -> int:
        return self._g.tp

    @property
    def block_size(self) -> int:
        return self._g.layout.block_size

    @property
    def total_blocks(self) -> int:
        return self._g.layout.max_tokens(self.model) // self.block_size

    @property
    def used_blocks(self) -> int:
        """As of now (a macro job's blocks ahead not counted, as an instance)."""
        if self._kind == 0:  # its own partition: what is not free of it
            return self.total_blocks - self.free_blocks
        lay = self._g.layout
        ahead = self._g.ahead_blocks(self.model, self._now)
        return lay.used_bytes(self.model) // lay.bytes_per_token_block(self.model) - ahead

    @property
    def free_blocks(self) -> int:
        """As of now: macro jobs' blocks ahead count as free, as an instance
        counts them (the service's own; in a head-wise pool, every service's,
        whose units any service can use)."""
        g = self._g
        lay = g.layout
        kind = self._kind
        if kind == 0:  # its own partition
            b = g._bound.get(self.model)  # a bound batch's blocks ahead (ahead_blocks, inlined)
            ahead = b.ahead(self._now) if b is not None else g.ahead_blocks(self.model, self._now)
            return lay.free_token_blocks(self.model) + ahead
        per = lay.bytes_per_token_block(self.model)
        if kind == 1:
            ahead = sum(
                g.ahead_blocks(m, self._now) * lay.bytes_per_token_block(m) for m in g.models
            )
            return (lay.free_bytes_for(self.model) + ahead) // per
        return lay.free_bytes_for(self.model) // per + g.ahead_blocks(self.model, self._now)

    @property
    def reserved_blocks(self) -> int:
        return self._g.queued_blocks[self.model]

    @property
    def available_blocks(self) -> int:
        """Free blocks less the queued prompts' and the admission watermark's,
        as an instance counts them (since session 25: before, the free ones)."""
        g = self._g
        m = self.model
        return self.free_blocks - g.queued_blocks[m] - g.watermark_tokens[m] // g._bs

    def avail_bounds(self) -> tuple[int, int]:
        """``(lo, hi)``: ``hi`` is :attr:`available_blocks` now, ``lo`` when the
        service's macro job in flight ends (its blocks ahead then held); an
        instance's ``avail_bounds`` (the cluster index reads it)."""
        g = self._g
        m = self.model
        ahead = g.ahead_blocks(m, self._now)
        held = g.queued_blocks[m] + g.watermark_tokens[m] // g._bs
        if self._kind == 0:  # its own partition: free now = free at the end + ahead
            lo = g.layout.free_token_blocks(m) - held
            return lo, lo + ahead
        hi = self.free_blocks - held
        return hi - ahead, hi

    @property
    def num_running(self) -> int:
        return len(self._g.running[self.model])

    @property
    def num_waiting(self) -> int:
        return len(self._g.waiting[self.model])

    @property
    def decode_steps(self) -> int:
        """Decode iterations the service's bound batch completed as of now
        (0 without one: explicit counts)."""
        b = self._g._bound.get(self.model)
        return b.decode_steps if b is not None else 0

    @property
    def idle(self) -> bool:
        return self._g.idle

    def seqs(self) -> list[Any]:
        g = self._g
        return [*g.running[self.model].values(), *g.waiting[self.model]]


class _StateView:
    """The :class:`~fleetserve.policy.sharing.GroupState` a scheduler reads."""

    __slots__ = ("_g",)

    def __init__(self, g: SharingGroup) -> None:
        self._g = g

    @property
    def models(self) -> Sequence[str]:
        return self._g._models

    @property
    def free_share(self) -> float:
        return self._g.free_share

    @property
    def jobs_in_flight(self) -> int:
        return self._g.jobs_in_flight

    def waiting(self, model: str) -> Sequence[Seq]:
        g = self._g
        if g.lanes and g.lanes_in_flight() >= g.stages:  # every stage has a lane
            return ()
        return g.waiting[model]

    def ready(self, model: str) -> Sequence[Seq]:
        return self._g.ready(model)

    def busy(self, model: str, phase: str) -> bool:
        return self._g.busy(model, phase)

    def kv_used(self, model: str) -> int:
        return self._g.kv_used(model)

    def prefill_in_flight(self) -> bool:
        return self._g.prefill_in_flight()
