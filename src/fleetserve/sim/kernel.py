"""The simulation kernel: the one event loop of every simulator.

A simulator (a *model* of a cluster) gives the kernel its handlers, one per
event kind it uses (:mod:`fleetserve.sim.events` declares every kind and its
priority), and an arrival handler. The kernel owns the heap of
``(time, priority, seq, kind, payload)``, merges the sorted arrivals into it,
stops at the horizon, runs the integrity checks after every event when asked
to, and reports progress. It is the only place events are popped::

    arrivals (sorted)      heap of caused events
          |                      |
          +------ earliest ------+      ties: priority, then seq
                     |
               handler(payload, now) -> caused events (or None: stale)
                     |
          push caused, count, check, progress

Handlers return the events they cause as ``(time, kind, payload)``; a handler
that finds its event superseded (an iteration end after a truncation, a
transfer of an older channel version) returns ``None``, and the event is not
counted.

Garbage collection. A run allocates a few objects per event (heap entries,
lists of caused events, requests' states) and frees them by reference
counting: the simulators make no reference cycles while they run (a run of
the Azure trace with the collector off left 0 unreachable objects). The
cyclic collector would still walk the young objects every 700 allocations and
the whole heap (the trace, the records) now and then: 5-12% of the single-model
world's time (``benchmarks/sim_speed.py``, measured with ``gc.callbacks``). So
the loop runs with automatic collection off, collects the young generations
itself every :data:`GC_EVERY` events (a bound on what a model that did make
cycles could leave behind), and restores the collector's state when it
returns or raises. The switch is the interpreter's, so while a simulation
runs, other threads' cyclic garbage also waits (until its end, or the next
of those collections); a run that starts with the collector off leaves it off.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from fleetserve.sim.events import P_ARRIVAL, PRIORITY, Event
from fleetserve.workload.request import Request

Handler = Callable[[Any, float], "list[Event] | None"]
"""``handler(payload, now)``: the events it causes, or None for a stale event."""
ProgressFn = Callable[[float, int, int], None]
"""``progress(now, events, requests_done)``."""
GC_EVERY = 1 << 18
"""Events between the loop's own collections of the young generations."""


class Clock(Protocol):
    """The simulation's current time, set by the kernel before each event."""

    now: float


class SimModel(Protocol):
    """What a simulator gives the kernel."""

    n_done: int
    """Requests in a terminal state (for progress)."""

    def on_arrival(self, req: Request, now: float) -> list[Event]:
        """A request arrives; the events it causes."""
        ...

    def check_integrity(self, arrived: int) -> None:
        """Raise AssertionError when the model's state is inconsistent."""
        ...


class Kernel:
    """The heap, the horizon, and the loop.

    Args:
        requests: the workload, sorted by arrival time.
        handlers: one handler per event kind the model uses.
        max_time_s: the horizon (None: run until nothing is left).
        check: run the model's integrity checks after every event.
        progress: called every ``progress_every`` events, and once at the end.
        progress_every: events between progress calls.
        clock: set to each event's time before its handler runs.

    Attributes:
        arrived: requests that have arrived so far.
        n_events: events handled (stale ones not counted).
    """

    __slots__ = (
        "_handlers",
        "_heap",
        "_seq",
        "arrived",
        "check",
        "clock",
        "max_time_s",
        "n_events",
        "progress",
        "progress_every",
        "requests",
    )

    def __init__(
        self,
        requests: Sequence[Request],
        handlers: dict[int, Handler],
        *,
        max_time_s: float | None = None,
        check: bool = False,
        progress: ProgressFn | None = None,
        progress_every: int = 4096,
        clock: Clock | None = None,
    ) -> None:
        self.requests = requests
        self._handlers: list[Handler | None] = [None] * len(PRIORITY)
        for kind, h in handlers.items():
            self._handlers[kind] = h
        self.max_time_s = max_time_s
        self.check = check
        self.progress = progress
        self.progress_every = progress_every
        self.clock = clock
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self.arrived = 0
        self.n_events = 0

    @property
    def arrivals_left(self) -> bool:
        """Whether some request has yet to arrive."""
        return self.arrived < len(self.requests)

    @property
    def pending(self) -> int:
        """Events in the heap."""
        return len(self._heap)

    def next_time(self) -> float:
        """The time of the next event in the heap or the next arrival,
        whichever is sooner (``inf``: neither)."""
        t = self._heap[0][0] if self._heap else float("inf")
        if self.arrived < len(self.requests):
            t = min(t, self.requests[self.arrived].arrival_s)
        return t

    def push(self, events: Sequence[Event]) -> None:
        """Add events (in order: they get increasing sequence numbers)."""
        heap, seq = self._heap, self._seq
        for t, kind, payload in events:
            seq += 1
            heapq.heappush(heap, (t, PRIORITY[kind], seq, kind, payload))
        self._seq = seq

    def run(self, model: SimModel) -> float:
        """Run until nothing is left or the horizon; the simulated end time.

        The end time is the last event's time, or the horizon when work was
        left beyond it. Automatic garbage collection is off meanwhile (see the
        module docstring).
        """
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._loop(model)
        finally:
            if enabled:
                gc.enable()

    def _loop(self, model: SimModel) -> float:
        reqs = self.requests
        n = len(reqs)
        heap = self._heap
        handlers = self._handlers
        clock = self.clock
        max_t = self.max_time_s if self.max_time_s is not None else float("inf")
        check, progress, every = self.check, self.progress, self.progress_every
        on_arrival = model.on_arrival
        heappop = heapq.heappop
        inf = float("inf")
        end_s = 0.0
        ai = self.arrived
        ta = reqs[ai].arrival_s if ai < n else inf  # the next arrival's time
        while True:
            if heap and (heap[0][0] < ta or (heap[0][0] == ta and heap[0][1] < P_ARRIVAL)):
                t = heap[0][0]
                if t > max_t:
                    break
                t, _prio, _seq, kind, payload = heappop(heap)
                if clock is not None:
                    clock.now = t
                h = handlers[kind]
                if h is None:
                    raise RuntimeError(f"no handler for event kind {kind}")
                caused = h(payload, t)
                if caused is None:
                    continue  # superseded
            elif ai < n:
                if ta > max_t:
                    break
                t = ta
                if clock is not None:
                    clock.now = t
                caused = on_arrival(reqs[ai], t)
                ai += 1
                self.arrived = ai
                ta = reqs[ai].arrival_s if ai < n else inf
            else:
                break
            if caused:
                self.push(caused)
            end_s = t
            self.n_events += 1
            if check:
                model.check_integrity(ai)
            if not self.n_events % GC_EVERY:
                gc.collect(1)
            if progress is not None and self.n_events % every == 0:
                progress(t, self.n_events, model.n_done)
        if self.max_time_s is not None and (heap or self.arrived < n):
            end_s = max(end_s, self.max_time_s)
        if clock is not None:
            clock.now = end_s
        return end_s
