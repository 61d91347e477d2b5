"""The event heap: ``(time, priority, seq, kind, payload)`` with a per-simulation counter.

Event order is defined here and only here. At equal times, lower priority
values run first:

1. iteration ends (an instance's state at an instant is the one after every
   iteration ending then; the lazy "as of now" views count such an iteration
   as complete, so both agree);
2. migration transfers ending (a stage, a final KV copy or token ids
   arriving): they see the instances after their iteration ends, as the
   lazy views do, and an arrival at the same instant sees their effect;
3. arrivals (an arrival at the instant an iteration ends sees the batch that
   starts then);
4. migration epochs: the migration policy's plan sees every arrival of its
   instant (Mell allocates the requests that arrived up to the epoch
   boundary) and every iteration end and transfer;
5. time-series samples last (they see the state after everything at that
   instant, a plan included).

Handlers return the events they cause as ``(time, priority, kind, payload)``;
the loop pushes them.
"""

from __future__ import annotations

import heapq
from typing import Any

P_ITER_END = 0
P_TRANSFER = 1
P_ARRIVAL = 2
P_EPOCH = 3
P_SAMPLE = 4

# event kinds
ITER_END = 0
SAMPLE = 1
TRANSFER = 2
EPOCH = 3

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
