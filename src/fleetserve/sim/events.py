"""The event heap: ``(time, priority, seq, kind, payload)`` with a per-simulation counter.

Event order is defined here and only here. At equal times, lower priority
values run first: iteration ends before arrivals (an arrival at the instant
an iteration ends sees the batch that starts then), time-series samples
last (they see the state after everything at that instant). Handlers return
the events they cause as ``(time, priority, kind, payload)``; the loop pushes
them.
"""

from __future__ import annotations

import heapq
from typing import Any

P_ITER_END = 0
P_ARRIVAL = 1
P_SAMPLE = 2

# event kinds
ITER_END = 0
SAMPLE = 1

Event = tuple[float, int, int, Any]
"""``(time, priority, kind, payload)``, as handlers return them."""


class EventQueue:
    """Min-heap of events; ``seq`` breaks ties in insertion order.

    Attributes:
        heap: the heap list; callers may peek at ``heap[0]`` but change it only
            through :meth:`push` and :meth:`pop`.
    """

    __slots__ = ("_seq", "heap")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0

    def push(self, time: float, priority: int, kind: int, payload: Any) -> None:
        """Add an event."""
        self._seq += 1
        heapq.heappush(self.heap, (time, priority, self._seq, kind, payload))

    def pop(self) -> tuple[float, int, int, int, Any]:
        """Remove and return the earliest event."""
        return heapq.heappop(self.heap)

    def __len__(self) -> int:
        return len(self.heap)
