"""A running batch whose requests decode together: bound token counts.

A single-model instance (a one-model sharing group,
:class:`~fleetserve.sim.group_instance.GroupInstance`), a sharing group's
service under FCFS or RR, and a KunServe executor
(:class:`~fleetserve.sim.kun.Executor`) decode every running request at each
iteration. So a request's counts follow one step counter: it holds ``base +
steps`` tokens of KV (``base`` fixed when it joined), and it finishes at a
step known when it joins. A decode iteration moves the counter, not every
request (:class:`~fleetserve.sim.seq.Seq`, "bound"), and finishes come out of
a heap keyed by step (:class:`~fleetserve.sim.finish.FinishQueue`). This is
what keeps the single-model world at tens of thousands of requests per
wall-second.

Macro-steps. While a batch only decodes, its composition cannot change
before the next finish, the next block shortage, or the next external event
(an arrival dispatched here). Those iterations are computed in one go:
iteration ``j`` reads ``ctx_j = sum_i (kv_i + j + 1)`` tokens and its end time
is the running sum of the iteration times, added in order
(:meth:`~fleetserve.costmodel.InstanceCost.decode_ends`), so the times equal
those of an iteration-by-iteration run bit for bit. An arrival mid-segment
truncates the segment at the end of the iteration in flight.

Block growth without a loop over requests. A request holding ``kv`` tokens
needs a new block in decode iteration ``j`` iff ``(kv + j) % bs == 0``, i.e.
at ``j = r, r + bs, r + 2bs, ...`` with ``r = (-kv) % bs``. With ``C[s]`` the
number of running requests with ``r <= s``, the blocks added up to and
including iteration ``j = m*bs + s`` are::

    D(j) = m * B + C[s]            (B = batch size)

    r:    0   1   2  ...  s  ...  bs-1
    cnt:  2   0   1       3        1      C[s] = cnt[0] + ... + cnt[s]

so the shortage iteration (first ``j`` with ``D(j) > free``) takes O(bs).

:class:`BoundBatch` is that batch, one implementation for all. With a block
size it keeps the histogram of the requests' ``base`` modulo the block size
(:meth:`BoundBatch.growth`).

The batch also keeps the decode segment in flight (the iterations its holder
started as one job: their end times and the blocks each opens), so it answers
the "as of now" counts a bound request reads (:attr:`BoundBatch.decode_steps`,
:meth:`BoundBatch.kv_steps`) and the blocks held as of now
(:meth:`BoundBatch.grown`): as of ``now``, ``k`` iterations of the segment
are complete (``bisect_right(ends, now)``) and iteration ``k`` is in flight.
"""

from __future__ import annotations

import sys
from bisect import bisect_right
from collections.abc import Iterator
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np

from fleetserve.sim.finish import FinishQueue
from fleetserve.sim.seq import RUNNING, Seq

if TYPE_CHECKING:
    from fleetserve.costmodel import Ends


class SimClock:
    """The simulation's current time, shared by one simulation's objects only."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0


class BoundBatch:
    """The running requests of one holder, bound to its step counter.

    Args:
        block_size: tokens per KV block, to count the blocks a decode segment
            adds (:meth:`growth`); None: the holder counts KV in tokens.
        clock: the simulation clock, for the counts as of now while a decode
            segment is in flight (None: the holder runs no segments).
    """

    __slots__ = (
        "_B",
        "_C",
        "_bs",
        "_finishing",
        "_hist",
        "block_size",
        "clock",
        "ends",
        "n",
        "running",
        "steps",
        "sum_base",
    )

    def __init__(self, block_size: int | None = None, clock: SimClock | None = None) -> None:
        self.running: dict[int, Seq] = {}
        self.steps = 0  # decode iterations completed (at the last segment's end)
        self.sum_base = 0  # sum of the running requests' ``base``
        self.block_size = block_size
        self.clock = clock
        self._hist = [0] * block_size if block_size else []
        self._bs = block_size or 1
        self._finishing = FinishQueue()
        # the decode segment in flight: its iterations' end times, how many
        # (0: none), and the batch size and growth by residue at its start
        self.ends: Ends = []
        self.n = 0
        self._B = 0
        self._C: list[int] = []

    # --------------------------------------------------------- the segment
    def begin(self, ends: Ends, n: int, C: list[int]) -> None:
        """A decode segment of ``n`` iterations starts (ending at ``ends``;
        ``C`` from :meth:`growth`; the running requests decode in each)."""
        self.ends = ends
        self.n = n
        self._B = len(self.running)
        self._C = C

    def cut(self, n: int) -> None:
        """The segment in flight ends after its first ``n`` iterations."""
        self.n = n

    def end(self) -> int:
        """The segment in flight completed: the step counter moves by its
        iterations (returned); the finished requests are then :meth:`due`."""
        n = self.n
        self.steps += n
        self.n = 0
        return n

    def completed(self, now: float) -> int:
        """Iterations of the segment in flight completed by ``now`` (at most ``n``)."""
        k = bisect_right(self.ends, now)
        return k if k < self.n else self.n

    def grown(self, j: int) -> int:
        """Blocks the segment's iterations ``0..j`` open (``j < n``)."""
        bs = self._bs
        return (j // bs) * self._B + self._C[j % bs]

    def ahead(self, now: float) -> int:
        """Blocks the segment in flight opens after its iteration in flight
        as of ``now`` (allocated ahead: 0 for a segment of one iteration or
        none)."""
        n = self.n
        if n <= 1:
            return 0
        steps = bisect_right(self.ends, now) + 1
        if steps >= n:
            return 0
        bs = self._bs
        C = self._C
        j = n - 1
        done = steps - 1
        return (j // bs - done // bs) * self._B + C[j % bs] - C[done % bs]

    def ahead_at(self, times: np.ndarray) -> np.ndarray:
        """:meth:`ahead` at each of ``times`` (one array operation each)."""
        n = self.n
        if n <= 1:
            return np.zeros(len(times), dtype=np.int64)
        steps = np.minimum(np.searchsorted(self.ends, times, side="right") + 1, n)
        return self.grown(n - 1) - self.grown_at(steps - 1)

    def grown_at(self, j: np.ndarray) -> np.ndarray:
        """:meth:`grown` of each iteration index of ``j`` (each ``< n``)."""
        bs = self._bs
        return (j // bs) * self._B + np.asarray(self._C, dtype=np.int64)[j % bs]

    @property
    def decode_steps(self) -> int:
        """Decode iterations completed as of now (the segment's included)."""
        if not self.n:
            return self.steps
        assert self.clock is not None
        k = bisect_right(self.ends, self.clock.now)
        return self.steps + (k if k < self.n else self.n)

    def kv_steps(self) -> int:
        """``steps`` a running request's KV reflects as of now: the completed
        iterations plus the one in flight (its token's block is allocated)."""
        if not self.n:
            return self.steps
        assert self.clock is not None
        k = bisect_right(self.ends, self.clock.now)
        return self.steps + (k + 1 if k < self.n else self.n)

    def __len__(self) -> int:
        return len(self.running)

    @property
    def tokens(self) -> int:
        """KV tokens the running requests hold after ``steps`` iterations."""
        return self.sum_base + len(self.running) * self.steps

    def run(self, s: Seq, kv: int) -> None:
        """``s`` joins holding ``kv`` tokens of KV, so it has generated
        ``kv - prompt + 1`` tokens (its last token's KV is written by its
        next iteration); it finishes at the step that generates its last."""
        base = kv - self.steps
        s.base = base
        s.batch = self
        s.bound = True
        s.state = RUNNING
        s.finish_step = self.steps + (s.output_tokens - (kv - s.prompt_tokens + 1))
        self.running[s.id] = s
        self.sum_base += base
        if self._hist:
            self._hist[base % len(self._hist)] += 1
        self._finishing.add(s.finish_step, s.id)

    def unrun(self, s: Seq) -> int:
        """Take running ``s`` out, its counts saved (``gen_saved``; the caller
        sets ``kv_saved`` and its state); returns the KV tokens it held."""
        del self.running[s.id]
        kv = s.base + self.steps
        self.sum_base -= s.base
        if self._hist:
            self._hist[s.base % len(self._hist)] -= 1
        s.bound = False
        s.gen_saved = kv - s.prompt_tokens + 1
        return kv

    def earliest_finish(self) -> int:
        """The earliest step at which a running request finishes."""
        return self._finishing.earliest(self.running)

    def due(self) -> Iterator[tuple[Seq, int]]:
        """Take out (:meth:`unrun`) the requests that have finished by
        ``steps``, in order; yields each (it has generated all its tokens)
        with the KV tokens it held."""
        for s in self._finishing.due(self.steps, self.running):
            yield s, self.unrun(s)

    def growth(self, free: int) -> tuple[list[int], int]:
        """``(C, n)`` for a decode segment starting now with ``free`` blocks free.

        ``C[r]`` counts the new blocks the iterations ``0..r`` open (one per
        request whose token lands on a block's first slot), so iteration ``j``
        has opened ``(j // bs) * len(self) + C[j % bs]`` blocks in all. ``n``
        is the first iteration that finds no block free (0: the next one)."""
        hist = self._hist
        bs = len(hist)
        B = len(self.running)
        if not B:  # nothing decodes: nothing grows
            return [0] * bs, sys.maxsize
        # iteration r opens a block for the requests whose base is -(steps + r)
        # modulo bs: the histogram read backwards from -steps, cumulated
        s0 = -self.steps % bs
        C = list(accumulate(hist[s0::-1] + hist[:s0:-1]))
        # an iteration j = q bs + r opens q B + C[r] blocks. Some r of the
        # first bs iterations already runs short: the first such r (C grows).
        r = bisect_right(C, free)
        if r < bs:
            return C, r
        # Else iteration q bs + r runs short for q = (free - C[r]) // B + 1,
        # which is q0 + 1 or q0 (C[r] - C[0] <= B, with q0 that of r = 0):
        # the first r whose q drops (C[r] > free - q0 B), else r = 0.
        q0 = (free - C[0]) // B
        r = bisect_right(C, free - q0 * B)
        return C, q0 * bs + r if r < bs else (q0 + 1) * bs

    def opening(self) -> int:
        """Running requests whose next token opens a new block (the first
        iteration's growth)."""
        hist = self._hist
        return hist[-self.steps % len(hist)] if self.running else 0

    def check(self) -> None:
        """The sums and the histogram agree with the running requests."""
        assert self.sum_base == sum(s.base for s in self.running.values())
        if self._hist:
            assert sum(self._hist) == len(self.running)
            bs = len(self._hist)
            for r in range(bs):
                n = sum(1 for s in self.running.values() if s.base % bs == r)
                assert self._hist[r] == n, (r, self._hist[r], n)
        for s in self.running.values():
            assert s.bound and s.state == RUNNING, s.id
