"""Running requests by the decode step at which they finish.

A bound batch (:class:`fleetserve.sim.batch.BoundBatch`: the running requests
of a single-model instance or a KunServe executor) decodes one step at a time
and knows, when a request joins, the step at which it will finish. This queue
returns them in ``(finish step, request id)`` order. A request that leaves the
batch early (preempted, migrated, evicted) or joins again with another
finish step leaves a stale entry behind; entries are checked against the
batch when they are reached and stale ones are skipped (lazy deletion).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from typing import Protocol, TypeVar


class _Running(Protocol):
    finish_step: int


S = TypeVar("S", bound=_Running)


class FinishQueue:
    """Lazy-deletion min-heap of ``(finish_step, request_id)``."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []

    def add(self, step: int, rid: int) -> None:
        """Request ``rid`` joined the batch and finishes at decode step ``step``."""
        heapq.heappush(self._heap, (step, rid))

    def earliest(self, running: Mapping[int, _Running]) -> int:
        """The earliest finish step of a request in ``running`` (stale entries
        before it are dropped).

        Raises:
            IndexError: no request of ``running`` is in the queue.
        """
        heap = self._heap
        while True:
            step, rid = heap[0]
            s = running.get(rid)
            if s is not None and s.finish_step == step:
                return step
            heapq.heappop(heap)

    def due(self, steps: int, running: Mapping[int, S]) -> Iterator[S]:
        """Take out and yield the requests of ``running`` that finish by step
        ``steps``, in order.

        Each entry is checked against ``running`` when it is reached, so the
        caller may take each yielded request out of ``running`` (or change the
        batch) before the next one is looked at.
        """
        heap = self._heap
        while heap and heap[0][0] <= steps:
            step, rid = heapq.heappop(heap)
            s = running.get(rid)
            if s is not None and s.finish_step == step:
                yield s
