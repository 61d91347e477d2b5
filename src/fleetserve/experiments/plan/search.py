"""The plan's search, as pure logic: which point to simulate next.

A *combo* is a stack on a GPU type with a TP choice; its *points* are its pool
sizes (multiples of its ``step``: a world of equal instances grows by one
instance at a time). Each stack is searched on its own (so every stack gets its cheapest
feasible point for the report), by a generator that yields the next
:class:`Point` to simulate and receives whether it met every SLO:

1. The stack's combos are visited cheapest lower bound first.
2. **Pruning** (branch and bound): a combo whose lower bound
   (:mod:`~fleetserve.experiments.plan.bounds`) already costs more than the
   best point found is skipped, and a combo's pool sizes are only tried up to
   the best cost. Since nothing below a lower bound can be feasible, pruning
   never removes a feasible cheaper point (``tests/test_plan.py`` checks this
   with hypothesis against brute force).
3. **Bisection** on the pool size: from the lower bound, sizes double until
   one is feasible (or the cap is reached), then bisection finds the smallest
   feasible size between the last infeasible and the first feasible one. This
   assumes feasibility is monotone in the pool size (more GPUs of the same
   kind never break an SLO), which placement heuristics do not guarantee;
   ``search.brute_force`` simulates every size instead, to check it.

Ties in cost go to the smaller pool, then the GPU's and TP's order in the
input: :func:`point_key`. Everything here is deterministic; the driver
(:func:`drive`) runs the stacks' generators side by side over an executor and
memoizes outcomes, so the same inputs give the same answer for any number of
processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = [
    "Combo",
    "Point",
    "StackSearch",
    "brute_force_search",
    "drive",
    "point_key",
    "stack_search",
]


@dataclass(frozen=True, slots=True)
class Combo:
    """A stack on a GPU type with a TP choice, and its pool-size range.

    Attributes:
        stack: stack name.
        gpu: GPU catalog name.
        tp: the smallest TP degree its groups may use.
        price: USD per GPU-hour.
        lower_bound: fewest GPUs that could meet the SLOs.
        max_gpus: the largest pool considered.
        order: position of (gpu, tp) in the input, for ties.
        step: pool sizes are multiples of it (a world of equal TP instances:
            ``tp``; a multi-LLM pool: 1).
    """

    stack: str
    gpu: str
    tp: int
    price: float
    lower_bound: int
    max_gpus: int
    order: int = 0
    step: int = 1

    def point(self, units: int) -> Point:
        """The combo with ``units * step`` GPUs."""
        return Point(self.stack, self.gpu, self.tp, units * self.step, self.price, self.order)

    @property
    def units(self) -> tuple[int, int]:
        """The smallest and largest pool size, in ``step`` units."""
        return -(-self.lower_bound // self.step), self.max_gpus // self.step


@dataclass(frozen=True, slots=True)
class Point:
    """One candidate fleet: a combo with a pool size."""

    stack: str
    gpu: str
    tp: int
    n_gpus: int
    price: float
    order: int = 0

    @property
    def cost_per_hour(self) -> float:
        """USD per hour of the pool."""
        return self.n_gpus * self.price


def point_key(p: Point) -> tuple[float, int, int]:
    """Order of preference among feasible points: cheaper, fewer GPUs, input order."""
    return (p.cost_per_hour, p.n_gpus, p.order)


@dataclass
class StackSearch:
    """What one stack's search found.

    Attributes:
        best: its cheapest feasible point (None: none within the range).
        evaluated: every point simulated, with its verdict, in order.
        pruned: combos skipped, with the reason.
    """

    best: Point | None = None
    evaluated: list[tuple[Point, bool]] = field(default_factory=list)
    pruned: list[tuple[Combo, str]] = field(default_factory=list)


Search = Generator[Point, bool, StackSearch]


def _better(p: Point, best: Point | None) -> bool:
    return best is None or point_key(p) < point_key(best)


def stack_search(combos: Sequence[Combo]) -> Search:
    """Branch and bound with bisection over one stack's combos (module docstring).

    Yields points to simulate; send back whether each met every SLO. Returns
    the :class:`StackSearch` (``StopIteration.value``).
    """
    out = StackSearch()
    for c in sorted(combos, key=lambda c: (c.lower_bound * c.price, c.order)):
        lo, cap = c.units
        if lo > cap:
            out.pruned.append((c, f"lower bound {c.lower_bound} > max_gpus {c.max_gpus}"))
            continue
        if out.best is not None:
            if point_key(c.point(lo)) >= point_key(out.best):
                out.pruned.append(
                    (c, f"lower bound {c.lower_bound} GPUs costs no less than the best")
                )
                continue
            while cap > lo and point_key(c.point(cap)) >= point_key(out.best):
                cap -= 1
        bad = lo - 1
        good: int | None = None
        n = lo
        while True:  # doubling
            ok = yield c.point(n)
            out.evaluated.append((c.point(n), ok))
            if ok:
                good = n
                break
            bad = n
            if n >= cap:
                break
            n = min(cap, max(n + 1, 2 * n))
        if good is None:
            continue
        while good - bad > 1:  # bisection
            mid = (bad + good) // 2
            ok = yield c.point(mid)
            out.evaluated.append((c.point(mid), ok))
            if ok:
                good = mid
            else:
                bad = mid
        if _better(c.point(good), out.best):
            out.best = c.point(good)
    return out


def brute_force_search(combos: Sequence[Combo]) -> Search:
    """Every pool size of every combo, from its lower bound to ``max_gpus``."""
    out = StackSearch()
    for c in sorted(combos, key=lambda c: c.order):
        lo, hi = c.units
        for n in range(lo, hi + 1):
            ok = yield c.point(n)
            out.evaluated.append((c.point(n), ok))
            if ok and _better(c.point(n), out.best):
                out.best = c.point(n)
    return out


R = TypeVar("R")


@dataclass
class Driven(Generic[R]):
    """What :func:`drive` returns: each search's result (None: cut by the
    budget), and every outcome by point."""

    results: dict[str, StackSearch | None]
    outcomes: dict[Point, R]
    cut: list[str]


def drive(
    searches: Mapping[str, Search],
    submit: Callable[[Point], Future[R]],
    feasible: Callable[[R], bool],
    *,
    on_outcome: Callable[[Point, R], None] | None = None,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    known: Mapping[Point, R] | None = None,
) -> Driven[R]:
    """Run the searches side by side: each has at most one point in flight.

    Args:
        searches: generators by name (e.g. :func:`stack_search` per stack).
        submit: start simulating a point (an executor's ``submit``, or a
            completed future for a synchronous run).
        feasible: whether an outcome meets every SLO.
        on_outcome: called with every new outcome (progress).
        deadline: ``clock()`` value after which no new point starts; the
            searches still running are listed in ``cut``.
        clock: the clock ``deadline`` refers to.
        known: outcomes already simulated (answered without simulating again).
    """
    results: dict[str, StackSearch | None] = {}
    outcomes: dict[Point, R] = dict(known or {})
    pending: dict[Future[R], tuple[str, Point]] = {}
    waiting: dict[Point, list[str]] = {}
    cut: list[str] = []

    def advance(name: str, value: bool | None) -> None:
        gen = searches[name]
        while True:
            try:
                p = next(gen) if value is None else gen.send(value)
            except StopIteration as stop:
                results[name] = stop.value
                return
            if p in outcomes:  # memoized: answer at once
                value = feasible(outcomes[p])
                continue
            if deadline is not None and clock() > deadline:
                gen.close()
                results[name] = None
                cut.append(name)
                return
            if p in waiting:
                waiting[p].append(name)
            else:
                waiting[p] = [name]
                pending[submit(p)] = (name, p)
            return

    for name in searches:
        advance(name, None)
    while pending:
        done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
        for fut in sorted(done, key=lambda f: pending[f][0]):
            _, p = pending.pop(fut)
            outcomes[p] = fut.result()
            if on_outcome is not None:
                on_outcome(p, outcomes[p])
            for name in waiting.pop(p):
                advance(name, feasible(outcomes[p]))
    return Driven(results, outcomes, cut)
