"""The time series' cluster totals, kept per change instead of summed per sample.

Every ``sample_interval_s`` the simulator records the KV bytes used, the
capacity, the demand (used plus the waiting prompts' blocks), the queued and
the running requests of the whole cluster. Summing them over every instance
per sample costs the number of instances each time, busy or not.
:class:`UsageTotals` keeps the sums instead: an instance that reports a
change (:meth:`~fleetserve.sim.group_instance.ChangeReports.track`) is re-read at the next
sample, so a sample costs the instances that changed since the previous one.

The one quantity that moves without a change report is the KV in use of an
instance decoding a macro-step segment: its blocks grow iteration by
iteration as virtual time passes. Samples come on a grid (the simulator takes
the next one ``sample_interval_s`` after the last: ``t_{j+1} = t_j +
interval`` in floating point, which this module repeats exactly), so when an
instance is re-read its growth is known at every later grid time the segment
spans; it is added to a per-grid-time table (``used`` counts the blocks at the
segment's end; each grid time before the end gets the difference, which is
zero or negative). A change report before a grid time takes the instance's
entries back and writes new ones. The result is what a scan of the lazy
``used_blocks`` views gives at that time, bit for bit (integers).

A sample that is not on the grid (the last one, at the end of the run), and any
sample while the cluster has fewer than :data:`TOTALS_FROM` instances, returns
None: the caller scans (cheaper for a few instances); the totals are rebuilt
at the next grid sample when the cluster is large again.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fleetserve.sim.group_instance import GroupInstance


TOTALS_FROM = 16
"""Instances from which samples use the kept totals (below half of it they
scan again)."""

_COMPACT = 4096
"""Grid times consumed before the table drops them."""


class _Snap:
    """What the totals hold of one instance (bytes are blocks x bytes per block)."""

    __slots__ = ("cap", "delta", "queued", "reserved", "running", "start", "used")

    def __init__(self) -> None:
        self.used = 0  # bytes in use at the end of the segment in flight (or now)
        self.reserved = 0
        self.cap = 0
        self.queued = 0
        self.running = 0
        self.start = 0  # grid index of delta[0]
        self.delta: np.ndarray | None = None  # growth minus segment-end use, per grid time


class UsageTotals:
    """Cluster totals for the simulator's time series (see the module docstring).

    Args:
        interval: the sampling period (``sample_interval_s``).
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.members: dict[int, tuple[GroupInstance, int]] = {}  # id -> (instance, bytes per block)
        self.active = False
        self.log: dict[int, GroupInstance] = {}
        self.snaps: dict[int, _Snap] = {}
        self.next_t: float | None = None  # when the next grid sample is due
        self.used = self.reserved = self.cap = self.queued = self.running = 0
        self.g0 = 0  # grid index of times[0]
        self.cur = 0  # grid index of the next sample
        self.times: list[float] = []
        self.delta = np.zeros(0, dtype=np.int64)  # summed growth deltas, per grid index - g0

    # ------------------------------------------------------------ members
    def add(self, inst: GroupInstance, bytes_per_block: int) -> None:
        """A newly active instance."""
        self.members[inst.id] = (inst, bytes_per_block)
        if self.active:
            inst.track(self.log)
            self._snap(inst, bytes_per_block)

    def remove(self, instance_id: int) -> None:
        """A released instance."""
        inst, _ = self.members.pop(instance_id)
        if self.active:
            inst.untrack(self.log)
            self.log.pop(instance_id, None)
            self._unsnap(instance_id)

    # ------------------------------------------------------------- sample
    def totals(self, now: float) -> tuple[int, int, int, int, int] | None:
        """``(kv_used_bytes, kv_capacity_bytes, kv_demand_bytes, queued, running)``
        of the instances at the sample at ``now`` (called after every event of
        that instant), or None: scan them instead."""
        expected, self.next_t = self.next_t, now + self.interval
        n = len(self.members)
        if self.active and (now != expected or n < TOTALS_FROM // 2):
            self._deactivate()
        if not self.active:
            if n < TOTALS_FROM:
                return None
            self._activate(now)
        elif self.log:
            for inst in self.log.values():
                self._unsnap(inst.id)
                self._snap(inst, self.members[inst.id][1])
            self.log.clear()
        j = self.cur - self.g0
        used = self.used + int(self.delta[j])
        self.cur += 1
        self._cover(j + 1)  # the next sample's grid time: now + interval
        if j >= _COMPACT:
            del self.times[: j + 1]
            self.delta = self.delta[j + 1 :].copy()
            self.g0 = self.cur
        return used, self.cap, used + self.reserved, self.queued, self.running

    def _activate(self, now: float) -> None:
        self.active = True
        self.g0 = self.cur = 0
        self.times = [now]
        self.delta = np.zeros(1, dtype=np.int64)
        for inst, bb in self.members.values():
            inst.track(self.log)
            self._snap(inst, bb)

    def _deactivate(self) -> None:
        self.active = False
        for inst, _ in self.members.values():
            inst.untrack(self.log)
        self.log.clear()
        self.snaps.clear()
        self.used = self.reserved = self.cap = self.queued = self.running = 0

    # ------------------------------------------------------------ records
    def _cover(self, j: int) -> None:
        """Extend the grid (and the delta table) to relative index ``j``."""
        times = self.times
        iv = self.interval
        while len(times) <= j:
            times.append(times[-1] + iv)
        n = self.delta.shape[0]
        if n < len(times):
            grow = np.zeros(max(len(times), 2 * n), dtype=np.int64)
            grow[:n] = self.delta
            self.delta = grow

    def _grid_until(self, t: float) -> int:
        """Grid index of the first grid time ``>= t`` from the next sample on
        (the grid extended as needed)."""
        times = self.times
        iv = self.interval
        while times[-1] < t:
            times.append(times[-1] + iv)
        self._cover(len(times) - 1)
        return self.g0 + bisect_left(times, t, self.cur - self.g0)

    def _snap(self, inst: GroupInstance, bb: int) -> None:
        """An instance's snapshot: the blocks at the end of its job in flight,
        less those held ahead of each grid time before it."""
        s = _Snap()
        used, end, ahead = inst.usage_segment()
        if end is not None:
            stop = self._grid_until(end)
            if stop > self.cur:
                a, b = self.cur - self.g0, stop - self.g0
                d = -ahead(np.array(self.times[a:b])) * bb
                self.delta[a:b] += d
                s.start, s.delta = self.cur, d
        s.running = inst.num_running + inst.num_prefilling
        s.used = used * bb
        s.reserved = inst.reserved_blocks * bb
        s.cap = inst.total_blocks * bb
        s.queued = len(inst.waiting)
        self.snaps[inst.id] = s
        self.used += s.used
        self.reserved += s.reserved
        self.cap += s.cap
        self.queued += s.queued
        self.running += s.running

    def _unsnap(self, instance_id: int) -> None:
        s = self.snaps.pop(instance_id)
        self.used -= s.used
        self.reserved -= s.reserved
        self.cap -= s.cap
        self.queued -= s.queued
        self.running -= s.running
        d = s.delta
        if d is not None:
            skip = self.cur - s.start  # grid times already sampled
            if skip < d.shape[0]:
                a = max(s.start, self.cur) - self.g0
                self.delta[a : a + d.shape[0] - max(skip, 0)] -= d[max(skip, 0) :]
