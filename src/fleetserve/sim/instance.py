"""A vLLM-like serving instance, as the simulator models it.

Continuous batching with a paged KV cache (``block_size`` tokens per block):
each iteration either prefills requests admitted from the waiting queue
(prefill-only iterations, vLLM's default) or decodes one token for every
running request. When the next decode iteration needs more blocks than are
free, the batching policy picks a victim, whose KV is freed and which goes
back to the head of the queue to be recomputed (preemption by recompute).

Token bookkeeping of one request (``p`` prompt tokens, ``g`` generated)::

    waiting (fresh or preempted): no KV; a prefill processes p + g tokens,
                                  leaves p + g tokens of KV and emits token g+1
    running:                      KV holds p + g - 1 tokens (the newest token
                                  is not cached yet); a decode step caches it
                                  and emits the next one
    finishes                      when g == output_tokens

Macro-steps. While a batch only decodes, its composition cannot change
before the next finish, the next block shortage, or the next external event
(an arrival dispatched here). Those iterations are computed in one go with
numpy: iteration ``j`` reads ``ctx_j = Σ_i (kv_i + j + 1)`` tokens and its
end time is the running sum of the iteration times (``np.cumsum`` adds in
order, so the times equal those of an iteration-by-iteration run bit for
bit). An arrival mid-segment truncates the segment at the end of the
iteration in flight. Requests do not store their KV size while running:
``kv_i = base_i + steps``, where ``steps`` counts decode iterations done.

Block growth without a loop over requests. A request holding ``kv`` tokens
needs a new block in decode iteration ``j`` iff ``(kv + j) % bs == 0``, i.e.
at ``j = r, r + bs, r + 2bs, ...`` with ``r = (-kv) % bs``. With ``C[s]`` the
number of running requests with ``r <= s``, the blocks added up to and
including iteration ``j = m*bs + s`` are::

    D(j) = m * B + C[s]            (B = batch size)

    r:    0   1   2  ...  s  ...  bs-1
    cnt:  2   0   1       3        1      C[s] = cnt[0] + ... + cnt[s]

so the shortage iteration (first ``j`` with ``D(j) > free``) takes O(bs).

Chunked prefill (``chunked_prefill=True``, Sarathi-Serve / vLLM's option).
While any prompt is being prefilled, every iteration is *mixed*: all running
requests decode one token and prompt chunks fill the rest of the token budget
(``max_batched_tokens - batch``), partly prefilled prompts first, then newly
admitted ones. A prompt's blocks are allocated in full when it is admitted
(vLLM v0 allocates per chunk; allocating up front keeps admission a single
check and never preempts a half-prefilled prompt). Mixed iterations run one
at a time; pure decode stretches in between are still macro-stepped.

"As of now" views. Policies read an instance between its iteration ends, so
the view members are lazy: ``k = searchsorted(ends, now, "right")``
iterations of the segment in flight are complete, iteration ``k`` is in
flight. ``decode_steps = steps + k``; a running request's ``kv_tokens =
base + steps + k + 1`` counts the token iteration ``k`` is caching (its block
is allocated when the iteration starts, as ``used_blocks`` counts it), and
``generated = base + steps + k - prompt + 1``. These equal what an
iteration-by-iteration run shows at the same instant, so policies decide
the same with or without macro-steps.

Change reports (for :mod:`fleetserve.cluster.index` and
:mod:`fleetserve.sim.usage`). Every method that changes the blocks, queue or
batch writes the instance into the logs it is tracked by (:meth:`Instance.track`),
so an index re-reads only instances that changed. Between two reports the lazy
view moves only forward through the segment in flight, which
:meth:`Instance.avail_bounds` bounds.

Migration support (driven by :mod:`fleetserve.sim.migration`). Every change
of an instance's batch, queue or memory happens either at an iteration
boundary (``detach``, ``attach``: between :meth:`Instance.complete` and
:meth:`Instance.schedule`) or mid-segment followed by :meth:`Instance.truncate`
(``reserve``, ``unreserve``, ``release_held``, ``remove_waiting``,
``enqueue``), which ends the segment at the iteration in flight, so the next
boundary re-plans exactly where an iteration-by-iteration run would.
Blocks of migrations are part of ``used``::

    used = Σ blocks of running and prefilling requests
         + mig_in    (blocks reserved on a destination for KV being copied in)
         + mig_out   (blocks a source still holds for a detached request whose
                      final copy is in flight)

Prefix caching (``prefix_caching=True``; :mod:`fleetserve.sim.prefix_cache`).
A request's blocks are then its private ones (``blocks_for(kv) -
seq.shared``) plus the cache entries it references (``seq.refs``), and each
referenced entry counts once in ``used``; entries nobody references are
evictable and count as free. A (re)prefill looks up its prompt's leading
blocks when admitted: the hits join its references and only the rest of the
prompt is computed (the cost model sees a chunk of ``n - hit`` new tokens over
``hit`` cached ones); its full prompt blocks are published when the prefill
computed them (at its end; after each chunk with chunked prefill). Requests
admitted in one iteration do not share blocks with each other (none is
computed yet). A request detached for a KV migration keeps its references
until its final copy is done (the copy reads them; ``mig_out`` holds its
private blocks only); the destination holds the copied KV as private blocks,
not cached ones. The waiting queue's reservation (``reserved_blocks``) still
counts whole prompts (an upper bound). With prefix caching off, every request
has ``refs = None`` and ``shared = 0``: the accounting above is the plain one,
operation for operation.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fleetserve.cluster.state import blocks_for
from fleetserve.policy.base import AdmissionBudget, BatchingPolicy
from fleetserve.sim.batch import BoundBatch, SimClock
from fleetserve.sim.contention import beside_copies
from fleetserve.sim.prefix_cache import PrefixCache, PrefixStats
from fleetserve.sim.seq import DONE, PREFILLING, RUNNING, TRANSIT, WAITING, Seq

if TYPE_CHECKING:
    from fleetserve.cluster.state import SeqView
    from fleetserve.costmodel import Ends, InstanceCost
    from fleetserve.sim.prefix_cache import Entry

IDLE, PREFILL, DECODE, MIXED = 0, 1, 2, 3


class _Budget(AdmissionBudget):
    """Mechanism limits of one prefill iteration: free blocks above the watermark,
    batch-size room and the token budget (a lone prompt may exceed the latter,
    so a long prompt is never stuck)."""

    __slots__ = ("bs", "chunked", "free", "seqs", "taken", "tokens_left")

    def __init__(self, free: int, seqs: int, tokens: int, bs: int, chunked: bool = False) -> None:
        self.free = free
        self.seqs = seqs
        self.tokens_left = tokens
        self.bs = bs
        self.chunked = chunked  # a prompt needs only one token of budget to start
        self.taken = 0

    def fits(self, seq: Seq) -> bool:  # type: ignore[override]
        n = seq.prompt_tokens + seq.gen_saved
        if self.seqs <= 0 or -(-n // self.bs) > self.free:
            return False
        if self.chunked:
            return self.tokens_left > 0
        return self.taken == 0 or n <= self.tokens_left

    def take(self, seq: Seq) -> None:  # type: ignore[override]
        n = seq.prompt_tokens + seq.gen_saved
        self.free -= -(-n // self.bs)
        self.seqs -= 1
        self.tokens_left -= n
        self.taken += 1


class _CachedBudget(_Budget):
    """:class:`_Budget` with prefix caching: a request needs the blocks of its
    prompt minus the cached blocks it hits that are referenced already (by a
    running request, or by one taken before it in this round; the hits of
    evictable entries come out of the free blocks), and only its uncached
    tokens count against the token budget. Lookups are kept for the admission."""

    __slots__ = ("cache", "hits", "revived")

    def __init__(
        self, free: int, seqs: int, tokens: int, bs: int, chunked: bool, cache: PrefixCache
    ) -> None:
        super().__init__(free, seqs, tokens, bs, chunked)
        self.cache = cache
        self.hits: dict[int, tuple[list[Entry], int]] = {}
        self.revived: set[tuple[int, int, int]] = set()  # evictable entries taken this round

    def _need(self, seq: Seq) -> tuple[int, int, int]:
        """``(tokens to prefill, tokens hit, blocks needed)``."""
        n = seq.prompt_tokens + seq.gen_saved
        got = self.hits.get(seq.id)
        if got is None:
            got = self.hits[seq.id] = self.cache.lookup(seq, n)
        hits, hit = got
        held = sum(e.blocks for e in hits if e.refs or e.key in self.revived)
        return n, hit, -(-n // self.bs) - held

    def fits(self, seq: Seq) -> bool:  # type: ignore[override]
        n, hit, need = self._need(seq)
        if self.seqs <= 0 or need > self.free:
            return False
        if self.chunked:
            return self.tokens_left > 0
        return self.taken == 0 or n - hit <= self.tokens_left

    def take(self, seq: Seq) -> None:  # type: ignore[override]
        n, hit, need = self._need(seq)
        self.free -= need
        self.seqs -= 1
        self.tokens_left -= n - hit
        self.taken += 1
        for e in self.hits[seq.id][0]:
            if not e.refs:
                self.revived.add(e.key)


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


class Instance(ChangeReports):
    """One model on one GPU (group): queue, running batch, KV blocks, timing.

    Args:
        iid: instance id.
        model: model name.
        gpus: GPU ids it occupies.
        tp: tensor-parallel degree.
        total_blocks: KV blocks of the instance.
        block_size: tokens per block.
        cost: cost model bound to (model, GPU, tp).
        policy: the batching policy.
        clock: the simulation clock (for the lazy "as of now" view).
        max_num_seqs: running batch limit.
        max_batched_tokens: prefill token budget per iteration.
        watermark: fraction of blocks kept free at admission (vLLM's 1%).
        macro_steps: advance fixed decode batches several iterations at once.
        chunked_prefill: split prompts into chunks run together with decodes.
        prefix_caching: share the KV of cached prompt prefixes (module docstring).
        prefix_stats: the run's prefix-cache counters (with ``prefix_caching``;
            None: the instance keeps its own).
    """

    def __init__(
        self,
        iid: int,
        model: str,
        gpus: tuple[int, ...],
        tp: int,
        total_blocks: int,
        block_size: int,
        cost: InstanceCost,
        policy: BatchingPolicy,
        clock: SimClock,
        *,
        max_num_seqs: int,
        max_batched_tokens: int,
        watermark: float,
        macro_steps: bool,
        chunked_prefill: bool = False,
        prefix_caching: bool = False,
        prefix_stats: PrefixStats | None = None,
    ) -> None:
        self.id = iid
        self.model = model
        self.gpus = gpus
        self.tp = tp
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.cost = cost
        self.policy = policy
        self.clock = clock
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.watermark_blocks = int(watermark * total_blocks)
        self.macro = macro_steps and policy.macro_step_safe
        self.chunked = chunked_prefill
        self._prefilling: list[Seq] = []  # admitted, partly prefilled (chunked mode)
        self._chunks: list[tuple[Seq, int]] = []  # prefill chunks of the mixed iteration
        self.waiting: deque[Seq] = deque()
        self.reserved_blocks = 0
        # the running requests, bound to its step counter (sim/batch.py); the
        # dict is the batch's own, never rebound
        self.batch = BoundBatch(block_size, clock)
        self.running: dict[int, Seq] = self.batch.running
        self.used = 0  # allocated blocks at the last boundary (excl. in-segment growth)
        self.phase = IDLE
        self.ready_s = 0.0  # loading its weights until then (cluster.activation_s)
        self.version = 0
        self._prefill: list[Seq] = []
        self._mixed_preempted = False  # the last mixed plan preempted and ran no chunk
        self.mig_in = 0  # blocks reserved for incoming KV copies (part of ``used``)
        self.mig_out = 0  # blocks held for detached outgoing requests (part of ``used``)
        self.mig_refs = 0  # migrations in flight that touch this instance
        # HBM fraction the KV copies in flight through this instance ask for
        # (fleetserve.sim.contention.beside_copies); 0 when none
        self.copy_load = 0.0
        self.preempted_migrating: list[Seq] = []  # preempted while migrating out
        self._logs: list[dict[int, Any]] = []  # change logs it reports to (see track)
        self.pcache: PrefixCache | None = None
        if prefix_caching:
            self.pcache = PrefixCache(block_size, prefix_stats or PrefixStats())
        # detached for a KV move's final copy while referencing cache entries
        self._holding: dict[int, Seq] = {}

    # ------------------------------------------------------------------ view
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def used_blocks(self) -> int:
        """Blocks allocated as of ``clock.now`` (including the iteration in flight)."""
        if self.phase < DECODE:
            return self.used
        b = self.batch
        return self.used + b.grown(min(b.completed(self.clock.now), b.n - 1))

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    @property
    def available_blocks(self) -> int:
        """Blocks a new prompt could still get: free, minus the waiting queue's
        prompts, minus the admission watermark."""
        return self.total_blocks - self.used_blocks - self.reserved_blocks - self.watermark_blocks

    @property
    def idle(self) -> bool:
        """Nothing queued, prefilling or running, and no migration touches it."""
        return self.phase == IDLE and not self.waiting and not self.running and not self.mig_refs

    @property
    def steps(self) -> int:
        """Decode iterations completed at the last boundary."""
        return self.batch.steps

    @property
    def decode_steps(self) -> int:
        """Decode iterations completed as of ``clock.now`` (in-flight segment included)."""
        return self.batch.decode_steps

    def kv_steps(self) -> int:
        """``steps`` a running request's KV reflects as of ``clock.now``: the
        completed decode iterations plus the one in flight (its token's block is
        already allocated, as :attr:`used_blocks` counts it)."""
        return self.batch.kv_steps()

    def prefilling(self) -> list[Seq]:
        """Requests admitted whose prefill has not completed yet."""
        return self._prefill + self._prefilling

    @property
    def num_prefilling(self) -> int:
        """``len(prefilling())``."""
        return len(self._prefill) + len(self._prefilling)

    def seqs(self) -> list[SeqView]:
        """Running, prefilling and waiting requests (not those detached or in transit)."""
        return [*self.running.values(), *self._prefill, *self._prefilling, *self.waiting]

    # ------------------------------------------------------ change reports
    def avail_bounds(self) -> tuple[int, int]:
        """``(lo, hi)``: ``hi`` is :attr:`available_blocks` now, ``lo`` its value
        at the end of the decode segment in flight. Until the next change report
        it stays in ``[lo, hi]`` and never increases (the segment only grows)."""
        a = self.total_blocks - self.used - self.reserved_blocks - self.watermark_blocks
        if self.phase < DECODE:
            return a, a
        b = self.batch
        n1 = b.n - 1
        return a - b.grown(n1), a - b.grown(min(b.completed(self.clock.now), n1))

    # -------------------------------------------------------------- actions
    def enqueue(self, seq: Seq, now: float, *, head: bool = False) -> float | None:
        """Queue a request (at the head: a preempted or migrated-in one).

        Returns the time of a new iteration-end event, if any.
        """
        seq.inst = self
        seq.state = WAITING
        if head:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.reserved_blocks += blocks_for(seq.prefill_tokens, self.block_size)
        if self._logs:
            self._changed()
        if self.phase == IDLE:
            return self.schedule(now)
        # The batch may change at the end of the iteration in flight.
        return self.truncate(now)

    def truncate(self, now: float) -> float | None:
        """End the decode segment in flight after its iteration in flight, so the
        next boundary re-plans (after a change of queue, memory or batch).

        Returns the new end time when the segment got shorter (the caller pushes
        an iteration-end event for the new ``version``), else None.
        """
        if self.phase == DECODE:
            b = self.batch
            k = bisect_right(b.ends, now)
            if k + 1 < b.n:
                b.cut(k + 1)
                self.version += 1
                if self._logs:
                    self._changed()
                return float(b.ends[k])
        return None

    # ------------------------------------------------------------- migration
    def add_copy_load(self, delta: float, now: float) -> float | None:
        """A KV copy through this instance started (``delta`` > 0) or ended:
        iterations planned from now on share the HBM with it
        (:func:`~fleetserve.sim.contention.beside_copies`); the decode segment
        in flight is truncated at its iteration in flight so the next boundary
        re-plans. Returns a new iteration-end time, if any."""
        self.copy_load += delta
        if self.copy_load < 1e-12:
            self.copy_load = 0.0
        return self.truncate(now)

    def can_reserve(self, blocks: int) -> bool:
        """Whether ``blocks`` can be reserved for an incoming copy now without
        over-committing: free blocks as of now (the in-flight iteration's growth
        counted, as :attr:`used_blocks` does) minus the admission watermark."""
        return self.total_blocks - self.used_blocks - self.watermark_blocks >= blocks

    def reserve(self, blocks: int, now: float) -> float | None:
        """Reserve ``blocks`` for an incoming KV copy (after :meth:`can_reserve`).

        The segment in flight was planned with the memory free at its start, so
        it is truncated at the iteration in flight (whose growth ``can_reserve``
        counted). Returns a new iteration-end time, if any.
        """
        self.used += blocks
        self.mig_in += blocks
        if self.pcache is not None:
            self.pcache.fit(self.total_blocks - self.used_blocks)
        if self._logs:
            self._changed()
        return self.truncate(now)

    def unreserve(self, blocks: int, now: float) -> float | None:
        """Free a reservation of an aborted incoming copy (memory grows: re-plan)."""
        self.used -= blocks
        self.mig_in -= blocks
        if self._logs:
            self._changed()
        return self.truncate(now)

    def release_held(self, blocks: int, now: float, seq: Seq | None = None) -> float | None:
        """Free the blocks of a detached request ``seq`` once its final copy is
        done (``blocks``: its private ones), and its cache references."""
        self.used -= blocks
        self.mig_out -= blocks
        if self._holding and seq is not None and self._holding.pop(seq.id, None) is seq:
            self._free_shared(seq)
        if self._logs:
            self._changed()
        return self.truncate(now)

    def remove_waiting(self, seq: Seq, now: float) -> float | None:
        """Take a waiting request out of the queue (it moves elsewhere)."""
        self.waiting.remove(seq)
        self.reserved_blocks -= blocks_for(seq.prefill_tokens, self.block_size)
        seq.inst = None
        seq.state = TRANSIT
        if self._logs:
            self._changed()
        return self.truncate(now)

    def detach(self, seq: Seq, *, keep_blocks: bool) -> int:
        """Take running ``seq`` out of the batch at an iteration boundary.

        Its generated count is saved (as a preemption does). With
        ``keep_blocks`` its blocks stay allocated as ``mig_out`` (a KV copy is
        still reading them; its cache references stay until
        :meth:`release_held`, ``mig_out`` counts its private blocks), else
        they are freed.

        Returns:
            The KV tokens it held.
        """
        assert self.phase == IDLE and seq.bound and self.running.get(seq.id) is seq
        bs = self.block_size
        kv = self.batch.unrun(seq)
        seq.state = TRANSIT
        seq.kv_saved = kv if keep_blocks else 0
        if keep_blocks:
            self.mig_out += blocks_for(kv, bs) - seq.shared
            if seq.refs:
                self._holding[seq.id] = seq
            else:
                seq.refs = None
        elif seq.refs is None:
            self.used -= blocks_for(kv, bs)
        else:
            self._free(seq, kv)
        if self._logs:
            self._changed()
        return kv

    def attach(self, seq: Seq, kv: int, blocks: int) -> None:
        """Add ``seq`` holding ``kv`` tokens of KV copied into ``blocks`` reserved
        blocks to the running batch, at an iteration boundary. It decodes from
        the next iteration on, like a request whose prefill just completed."""
        assert self.phase == IDLE and blocks == blocks_for(kv, self.block_size) <= self.mig_in
        assert seq.refs is None and seq.shared == 0  # migrated KV is private here
        self.mig_in -= blocks
        seq.inst = self
        self.batch.run(seq, kv)
        if self._logs:
            self._changed()

    def schedule(self, now: float) -> float | None:
        """Start the next iteration at ``now``; its end time, or None when idle
        (or still loading its weights: the simulator schedules it when ready)."""
        if now < self.ready_s:
            return None
        if self._logs:
            self._changed()
        while True:
            preempted = False
            if self.chunked and (self.waiting or self._prefilling):
                end = self._start_mixed(now)
                if end is not None:
                    return end
                preempted = self._mixed_preempted
            elif self.waiting and self.pcache is not None:
                cached = _CachedBudget(
                    self.total_blocks - self.used - self.watermark_blocks,
                    self.max_num_seqs - len(self.running),
                    self.max_batched_tokens,
                    self.block_size,
                    False,
                    self.pcache,
                )
                admitted = self.policy.admit(self, self.waiting, cached)
                if admitted:
                    return self._start_prefill_cached(admitted, now, cached.hits)  # type: ignore[arg-type]
            elif self.waiting:
                budget = _Budget(
                    self.total_blocks - self.used - self.watermark_blocks,
                    self.max_num_seqs - len(self.running),
                    self.max_batched_tokens,
                    self.block_size,
                )
                admitted = self.policy.admit(self, self.waiting, budget)
                if admitted:
                    return self._start_prefill(admitted, now)  # type: ignore[arg-type]
            if not self.running:
                self.phase = IDLE
                return None
            end = self._start_decode(now, preempted)
            if end is not None:
                return end

    def _start_prefill(self, admitted: Sequence[Seq], now: float) -> float:
        bs = self.block_size
        self._remove_waiting(admitted)
        lens = []
        for s in admitted:
            n = s.prompt_tokens + s.gen_saved
            self.used += blocks_for(n, bs)
            s.state = PREFILLING
            s.kv_saved = n
            lens.append(n)
        self._prefill = list(admitted)
        self.phase = PREFILL
        self.version += 1
        t = self.cost.prefill_time(lens)
        if self.copy_load:
            t = float(beside_copies(t, self.cost.prefill_memory_s(lens), self.copy_load))
        return now + t

    def _start_prefill_cached(
        self, admitted: Sequence[Seq], now: float, hits: dict[int, tuple[list[Entry], int]]
    ) -> float:
        """:meth:`_start_prefill` with prefix caching: each prompt computes only
        its uncached tokens, on top of the cached ones."""
        assert self.pcache is not None
        self._remove_waiting(admitted)
        lens = []
        work = []
        any_hit = False
        for s in admitted:
            n = s.prompt_tokens + s.gen_saved
            hit = self._admit_cached(s, n, hits)
            s.state = PREFILLING
            s.kv_saved = n
            lens.append(n)
            work.append((n - hit, hit))
            any_hit = any_hit or hit > 0
        self.pcache.fit(self.total_blocks - self.used)
        self._prefill = list(admitted)
        self.phase = PREFILL
        self.version += 1
        if not any_hit:  # the very computation of the plain path
            t = self.cost.prefill_time(lens)
            if self.copy_load:
                t = float(beside_copies(t, self.cost.prefill_memory_s(lens), self.copy_load))
            return now + t
        t = self.cost.mixed_time(work, 0, 0)
        if self.copy_load:
            t = float(beside_copies(t, self.cost.mixed_memory_s(work, 0, 0), self.copy_load))
        return now + t

    def _admit_cached(
        self, s: Seq, n: int, hits: dict[int, tuple[list[Entry], int]] | None = None
    ) -> int:
        """Allocate ``s``'s (re)prefill of ``n`` tokens with prefix caching: its
        hits (looked up by the admission budget, or now) become references,
        the rest private blocks. Returns the tokens hit."""
        cache = self.pcache
        assert cache is not None and s.refs is None and s.shared == 0
        bs = self.block_size
        if s.hashes is None:
            self.used += blocks_for(n, bs)
            return 0
        got = hits.get(s.id) if hits is not None else None
        entries, hit = got if got is not None else cache.lookup(s, n)
        revived = cache.acquire(entries)
        s.refs = list(entries)
        s.shared = hit // bs
        s.pub = len(entries)
        self.used += blocks_for(n, bs) - s.shared + revived
        if s.gen_saved == 0:  # its first prefill
            s.record.cached_tokens = hit
        else:
            cache.stats.recompute_hit_tokens += hit
        return hit

    def _free(self, s: Seq, kv: int) -> None:
        """Free the blocks of ``s`` holding ``kv`` tokens with cache references:
        its private blocks, then its references (:meth:`_free_shared`)."""
        self.used -= blocks_for(kv, self.block_size) - s.shared
        self._free_shared(s)

    def _free_shared(self, s: Seq) -> None:
        """Drop the cache references of ``s``; entries nobody references any
        more leave ``used`` (they are evictable: free)."""
        refs = s.refs
        assert refs is not None and self.pcache is not None
        self.used -= self.pcache.release(refs)
        s.refs = None
        s.shared = 0

    def _growth(self) -> tuple[list[int], int]:
        """``C`` (new blocks by residue, see the module docstring) and the first
        decode iteration that would run out of blocks."""
        return self.batch.growth(self.total_blocks - self.used)

    def _start_mixed(self, now: float) -> float | None:
        """Plan one chunked-prefill iteration; None when no prompt chunk can run."""
        bs = self.block_size
        C = [0] * bs
        preempted = False
        while self.running:
            C, n_exh = self._growth()
            if n_exh > 0:
                break
            self._preempt(self.policy.victim(self, list(self.running.values())))  # type: ignore[arg-type]
            preempted = True
        if not self.running:
            C = [0] * bs
            preempted = False  # nothing decodes: this iteration is the next one
        # no admission in an iteration that preempted (vLLM's scheduler, and
        # the runtime engine's step): a victim is not re-admitted at once
        admit = not preempted
        self._mixed_preempted = preempted
        B = len(self.running)
        cache = self.pcache
        if cache is not None:  # the decodes' blocks first, as vLLM allocates them
            cache.fit(self.total_blocks - self.used - C[0])
        left = self.max_batched_tokens - B
        chunks: list[tuple[Seq, int]] = []
        for s in self._prefilling:
            if left <= 0:
                break
            n = min(s.prompt_tokens + s.gen_saved - s.prefilled, left)
            chunks.append((s, n))
            left -= n
        if admit and self.waiting and left > 0 and cache is not None:
            cached = _CachedBudget(
                self.total_blocks - self.used - C[0] - self.watermark_blocks,
                self.max_num_seqs - B - len(self._prefilling),
                left,
                bs,
                True,
                cache,
            )
            admitted_c: list[Seq] = self.policy.admit(self, self.waiting, cached)  # type: ignore[assignment]
            self._remove_waiting(admitted_c)
            for s in admitted_c:
                total = s.prompt_tokens + s.gen_saved
                s.prefilled = self._admit_cached(s, total, cached.hits)
                s.state = PREFILLING
                s.kv_saved = total
                self._prefilling.append(s)
                n = min(total - s.prefilled, left)
                chunks.append((s, n))
                left -= n
            cache.fit(self.total_blocks - self.used - C[0])
        elif admit and self.waiting and left > 0:
            budget = _Budget(
                self.total_blocks - self.used - C[0] - self.watermark_blocks,
                self.max_num_seqs - B - len(self._prefilling),
                left,
                bs,
                chunked=True,
            )
            admitted: list[Seq] = self.policy.admit(self, self.waiting, budget)  # type: ignore[assignment]
            self._remove_waiting(admitted)
            for s in admitted:
                total = s.prompt_tokens + s.gen_saved
                self.used += blocks_for(total, bs)
                s.prefilled = 0
                s.state = PREFILLING
                s.kv_saved = total
                self._prefilling.append(s)
                n = min(total, left)
                chunks.append((s, n))
                left -= n
        if not chunks:
            return None
        ctx = self.batch.tokens + B
        work = [(n, s.prefilled) for s, n in chunks]
        t_mixed = self.cost.mixed_time(work, B, ctx)
        if self.copy_load:
            mem = self.cost.mixed_memory_s(work, B, ctx)
            t_mixed = float(beside_copies(t_mixed, mem, self.copy_load))
        end = now + t_mixed
        self._chunks = chunks
        self.batch.begin([end], 1, C)
        self.phase = MIXED
        self.version += 1
        return end

    def _remove_waiting(self, admitted: Sequence[Seq]) -> None:
        ids = {s.id for s in admitted}
        if len(ids) == len(self.waiting):
            self.waiting.clear()
        elif ids:
            self.waiting = deque(s for s in self.waiting if s.id not in ids)
        for s in admitted:
            self.reserved_blocks -= blocks_for(s.prompt_tokens + s.gen_saved, self.block_size)

    def _start_decode(self, now: float, preempted: bool = False) -> float | None:
        """Plan a decode segment. While the next iteration's blocks do not fit,
        the batching policy's victims are preempted, and the others decode in
        this same iteration (vLLM's scheduler: the running requests are
        scheduled after preempting as many as needed; a preempted request
        waits at the head of the queue for a later boundary). ``preempted``:
        the mixed plan at this boundary already preempted. Returns None when
        every running request was preempted."""
        C, n_exh = self._growth()
        while n_exh == 0:
            self._preempt(self.policy.victim(self, list(self.running.values())))  # type: ignore[arg-type]
            preempted = True
            if not self.running:
                return None
            C, n_exh = self._growth()
        B = len(self.running)
        n = min(self.batch.earliest_finish() - self.batch.steps, n_exh)
        if not self.macro or (preempted and self._may_admit()):
            n = 1  # the next boundary may admit a request (a victim) again
        ctx0 = self.batch.tokens
        if self.copy_load:
            ctx = ctx0 + B * np.arange(1, n + 1, dtype=np.float64)
            t = self.cost.decode_time(B, ctx)
            t = beside_copies(t, self.cost.decode_memory(B, ctx), self.copy_load)
            ends: Ends = np.cumsum(np.concatenate(([now], t)))[1:]
        else:
            ends = self.cost.decode_ends(B, ctx0, n, now)
        self.batch.begin(ends, n, C)
        self.phase = DECODE
        self.version += 1
        return float(ends[-1])

    def _may_admit(self) -> bool:
        """Whether a queued request could be admitted at the next boundary.
        Until a request finishes, the free blocks only shrink, so when no
        queued prompt fits them now, none fits anywhere in a decode segment
        (a conservative test: with prefix caching a hit may need fewer)."""
        if self.pcache is not None:
            return bool(self.waiting)
        room = self.total_blocks - self.used - self.watermark_blocks
        bs = self.block_size
        return any(blocks_for(s.prefill_tokens, bs) <= room for s in self.waiting)

    def _preempt(self, seq: Seq) -> None:
        bs = self.block_size
        kv = self.batch.unrun(seq)
        seq.state = WAITING
        seq.kv_saved = 0
        if seq.refs is None:
            self.used -= blocks_for(kv, bs)
        else:
            self._free(seq, kv)
        self.waiting.appendleft(seq)
        self.reserved_blocks += blocks_for(seq.prefill_tokens, bs)
        seq.record.preemptions += 1
        if seq.mig is not None:
            self.preempted_migrating.append(seq)

    def complete(self, now: float) -> list[Seq]:
        """Finish the current iteration (segment) at ``now``; the requests that finished.

        Records first-token and finish times on the requests' records.
        """
        bs = self.block_size
        done: list[Seq] = []
        if self._logs:
            self._changed()
        if self.phase == PREFILL:
            for s in self._prefill:
                self._prefilled(s, now, done)
            self._prefill = []
        elif self.phase >= DECODE:
            self.used += self.batch.grown(self.batch.n - 1)
            if self.pcache is not None:  # the segment's growth evicted these
                self.pcache.fit(self.total_blocks - self.used)
            self.batch.end()
            for s, kv in self.batch.due():
                s.state = DONE
                s.kv_saved = 0
                if s.refs is None:
                    self.used -= blocks_for(kv, bs)
                else:
                    self._free(s, kv)
                done.append(s)
            if self.phase == MIXED:
                for s, n in self._chunks:
                    s.prefilled += n
                    if s.refs is not None:
                        self.pcache.publish(s, s.prefilled)  # type: ignore[union-attr]
                    if s.prefilled == s.prompt_tokens + s.gen_saved:
                        self._prefilling.remove(s)
                        self._prefilled(s, now, done)
                self._chunks = []
        self.phase = IDLE
        for s in done:
            s.record.finish_s = now
            s.record.generated = s.output_tokens
            s.record.status = "finished"
        return done

    def _prefilled(self, s: Seq, now: float, done: list[Seq]) -> None:
        """A (re)prefill of ``s`` completed at ``now``: first token, then run or finish."""
        kv = s.prompt_tokens + s.gen_saved
        gen = s.gen_saved + 1
        rec = s.record
        if rec.first_token_s is None:
            rec.first_token_s = now
        if s.stall_from is not None:  # a token migration's stall ends with this token
            rec.migration_stall_s += now - s.stall_from
            s.stall_from = None
        if s.refs is not None:
            self.pcache.publish(s, kv)  # type: ignore[union-attr]
        if gen >= s.output_tokens:
            if s.refs is None:
                self.used -= blocks_for(kv, self.block_size)
            else:
                self._free(s, kv)
            s.gen_saved = gen
            s.state = DONE
            s.kv_saved = 0
            done.append(s)
            return
        self.batch.run(s, kv)

    # ------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Raise AssertionError if the block accounting or request sets are inconsistent."""
        bs = self.block_size
        kv_blocks = sum(
            blocks_for(s.base + self.steps, bs) - s.shared for s in self.running.values()
        )
        pre_blocks = sum(blocks_for(s.prefill_tokens, bs) - s.shared for s in self._prefill)
        if self.phase == PREFILL:
            kv_blocks += pre_blocks
        kv_blocks += sum(blocks_for(s.prefill_tokens, bs) - s.shared for s in self._prefilling)
        if self.pcache is not None:  # references, entries, eviction (prefix_cache.check)
            holders = [*self.running.values(), *self.prefilling(), *self._holding.values()]
            kv_blocks += self.pcache.check(holders, self.total_blocks - self.used)
            for s in self._holding.values():
                assert s.refs and s.state == TRANSIT and s.mig is not None, s.id
        else:
            assert not self._holding
            for s in (*self.running.values(), *self.prefilling()):
                assert s.refs is None and s.shared == 0, s.id
        assert self.mig_in >= 0 and self.mig_out >= 0 and self.mig_refs >= 0
        assert self.used == kv_blocks + self.mig_in + self.mig_out, (self.id, self.used, kv_blocks)
        assert 0 <= self.used_blocks <= self.total_blocks, (self.id, self.used_blocks)
        if self.phase >= DECODE:  # the growth planned for the whole segment fits
            assert self.used + self.batch.grown(self.batch.n - 1) <= self.total_blocks, self.id
        assert self.reserved_blocks == sum(
            blocks_for(s.prefill_tokens, bs) for s in self.waiting
        ), self.id
        self.batch.check()
        ids_w = {s.id for s in self.waiting}
        ids_r = set(self.running)
        ids_p = {s.id for s in self._prefill} | {s.id for s in self._prefilling}
        assert len(ids_w) == len(self.waiting)
        assert not (ids_w & ids_r) and not (ids_w & ids_p) and not (ids_r & ids_p)
        for s in self.running.values():
            assert s.bound and s.state == RUNNING and s.inst is self
            assert s.base + self.steps <= s.prompt_tokens + s.output_tokens - 1
            assert s.demand_tokens == max(s.kv_tokens, s.prompt_tokens + s.generated), s.id
        for s in self.prefilling():
            assert s.state == PREFILLING and s.inst is self and not s.bound
            assert s.kv_saved == s.prefill_tokens, s.id
        for s in self.waiting:
            assert s.inst is self and s.state == WAITING and not s.bound and s.mig is None
            assert s.kv_saved == 0, s.id
            assert s.refs is None and s.shared == 0, s.id
        if self.phase == IDLE:
            assert not self.preempted_migrating
