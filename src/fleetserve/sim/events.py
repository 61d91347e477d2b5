"""The event heap: ``(time, priority, seq, kind, payload)`` with a per-simulation counter.

Event order is defined here and only here. At equal times, lower priority
values run first: iteration ends before arrivals (an arrival at the instant
an iteration ends sees the batch that starts then), periodic timers next,
time-series samples last (they see the state after everything at that
instant).
"""

from __future__ import annotations

import heapq
from typing import Any

P_ITER_END = 0
P_ARRIVAL = 1
P_TIMER = 2
P_SAMPLE = 3

# event kinds
ITER_END = 0
SAMPLE = 1

Event = tuple[float, int, int, Any]  # (time, priority, kind, payload) as handlers return them


class EventQueue:
    """Min-heap of events; ``seq`` breaks ties in insertion order."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0

    def push(self, time: float, priority: int, kind: int, payload: Any) -> None:
        """Add an event."""
        self._seq += 1
        heapq.heappush(self._heap, (time, priority, self._seq, kind, payload))

    def pop(self) -> tuple[float, int, int, int, Any]:
        """Remove and return the earliest event."""
        return heapq.heappop(self._heap)

    def peek_key(self) -> tuple[float, int] | None:
        """``(time, priority)`` of the earliest event, or None when empty."""
        if not self._heap:
            return None
        top = self._heap[0]
        return top[0], top[1]

    def __len__(self) -> int:
        return len(self._heap)
