"""``fleetserve plan``'s procedure: checks, search, robustness, headroom.

1. The traffic is drawn (seed ``spec.seed``) and the plan is checked
   (:func:`~fleetserve.experiments.plan.bounds.check_feasible`): a plan no
   candidate can meet fails here, in one line, before any simulation.
2. Combos: every candidate stack on every candidate GPU; for ``dedicated``
   placement (``vllm``) one combo per allowed TP degree that changes some
   service's degree, for placements that choose degrees themselves one combo
   (they choose among the allowed ones); for one-model stacks (``mell``,
   ``llumnix``, ``kunserve``: a plan with one service) one combo per allowed
   degree the model fits on, its pool growing one instance at a time. Each
   gets its pool lower bound.
3. Search: one branch-and-bound-with-bisection per stack
   (:mod:`~fleetserve.experiments.plan.search`). The baseline stack
   (``search.baseline``, ``vllm``: fast to simulate) goes first, alone; then
   every other stack, side by side over ``jobs`` processes, with its pool
   sizes capped at ``search.cost_cap`` times the baseline's cheapest cost (a
   stack's cheapest point is then reported only when it is under the cap).
   The search stops when done or when the time budget is spent.
4. The cheapest feasible point over every stack is *chosen*; it is
   re-simulated with other seeds (and, for trace traffic, later windows of
   the trace) and its *headroom* is found: the largest multiplier of every
   service's rate (up to ``headroom_max``, by bisection) at which it still
   meets every SLO.
5. When the chosen point misses an SLO on another seed, up to
   ``search.robust_tries`` alternatives (the chosen combo with one or two
   more GPUs, the other stacks' cheapest points; cheapest first) are tried on
   every seed, and the first that meets every SLO on all is reported as the
   cheapest robust alternative.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fleetserve.errors import ConfigError
from fleetserve.experiments.plan.bounds import (
    IdleFloor,
    check_feasible,
    dedicated_tps,
    pool_lower_bound,
)
from fleetserve.experiments.plan.evaluate import (
    EvalTask,
    Outcome,
    evaluate,
    plan_world,
    traffic_for,
)
from fleetserve.experiments.plan.search import (
    Combo,
    Point,
    Search,
    StackSearch,
    brute_force_search,
    drive,
    point_key,
    stack_search,
)
from fleetserve.experiments.plan.spec import PlanSpec
from fleetserve.experiments.plan.traffic import Traffic
from fleetserve.policy.catalog import MULTI, get_stack
from fleetserve.spec import get_gpu
from fleetserve.spec.prices import gpu_price

__all__ = ["PlanListener", "PlanResult", "build_combos", "run_plan"]


class PlanListener(Protocol):
    """Receives the plan's progress (in the calling process)."""

    def phase(self, name: str) -> None:
        """A new phase began (``search``, ``robustness``, ``headroom``)."""

    def evaluated(self, outcome: Outcome, best: Point | None, done: int) -> None:
        """A point was simulated; ``best`` is the cheapest feasible one so far."""


@dataclass
class PlanResult:
    """Everything the plan found (the report writes it out).

    Attributes:
        spec, base_dir: the input.
        traffic: the traffic of seed ``spec.seed`` (the search's).
        floors: idle P99s per service (the feasibility check's).
        combos: every combo, by stack.
        unplaceable: (stack, gpu, reason) for GPU types a stack cannot use.
        searches: each stack's search (None: cut by the budget).
        outcomes: every simulated point of the search.
        cut: stacks whose search the budget cut.
        chosen: the cheapest feasible point (None: none found).
        robustness: the chosen point on other seeds / windows.
        headroom: the largest rate multiplier that still meets every SLO
            (``headroom_max`` when even that does; None: no chosen point).
        headroom_runs: the headroom search's outcomes.
        headroom_breaks: the smallest multiplier tried that broke an SLO
            (None: none did).
        search_wall_s, wall_s: wall time of the search and of everything.
        cost_cap_per_hour: the cap on the non-baseline stacks' cost (None: none).
        robust_choice: when the chosen point fails on another seed, the
            cheapest alternative that meets every SLO on every seed (None:
            the chosen is robust, or no alternative tried was).
        alternatives: the alternatives tried, with their robustness runs.
    """

    spec: PlanSpec
    base_dir: Path
    traffic: Traffic
    floors: dict[str, list[IdleFloor]]
    combos: dict[str, list[Combo]]
    unplaceable: list[tuple[str, str, str]]
    searches: dict[str, StackSearch | None]
    outcomes: dict[Point, Outcome]
    cut: list[str]
    chosen: Point | None
    robustness: list[Outcome] = field(default_factory=list)
    headroom: float | None = None
    headroom_runs: list[Outcome] = field(default_factory=list)
    search_wall_s: float = 0.0
    wall_s: float = 0.0
    cost_cap_per_hour: float | None = None
    robust_choice: Point | None = None
    headroom_breaks: float | None = None
    alternatives: list[tuple[Point, list[Outcome]]] = field(default_factory=list)

    @property
    def chosen_outcome(self) -> Outcome | None:
        """The chosen point's outcome on the search's traffic."""
        return None if self.chosen is None else self.outcomes[self.chosen]


def build_combos(
    spec: PlanSpec, traffic: Traffic
) -> tuple[dict[str, list[Combo]], list[tuple[str, str, str]]]:
    """Every stack's combos with lower bounds, and the GPU types a stack cannot use."""
    combos: dict[str, list[Combo]] = {}
    unplaceable: list[tuple[str, str, str]] = []
    tps = sorted(spec.search.tp)
    for name in spec.stack_names:
        stack = get_stack(name)
        combos[name] = []
        one_model = plan_world(name) != MULTI
        for gi, g in enumerate(spec.gpus):
            price = gpu_price(g.name, g.price_per_hour)
            if one_model:  # instances of exactly t GPUs each, t at least the model's least
                least = dedicated_tps(spec, g.name, 1)  # (the one service's degree,)
                node = get_gpu(g.name).gpus_per_node
                choices = [(ti, t) for ti, t in enumerate(tps) if least and least[0] <= t <= node]
            elif stack.placement == "dedicated":
                seen: set[tuple[int, ...]] = set()
                choices = []
                for ti, t in enumerate(tps):
                    assign = dedicated_tps(spec, g.name, t)
                    if assign is not None and assign not in seen:
                        seen.add(assign)
                        choices.append((ti, t))
            else:
                choices = [(0, tps[0])]
            if not choices:
                unplaceable.append((name, g.name, "a service fits no allowed TP degree"))
            for ti, t in choices:
                lb = pool_lower_bound(spec, traffic, g.name, stack.placement, t)
                if lb is None:
                    unplaceable.append((name, g.name, "a service fits no allowed TP degree"))
                    continue
                step = t if one_model else 1
                combos[name].append(
                    Combo(
                        name,
                        g.name,
                        t,
                        price,
                        -(-lb // step) * step,
                        spec.search.max_gpus,
                        gi * 100 + ti,
                        step,
                    )
                )
    return combos, unplaceable


def _capped(combos: list[Combo], cap: float | None) -> list[Combo]:
    """The combos with their pool sizes capped at ``cap`` USD per hour."""
    if cap is None:
        return combos
    return [
        dataclasses.replace(c, max_gpus=min(c.max_gpus, math.floor(cap / c.price + 1e-9)))
        for c in combos
    ]


class _Inline(Executor):
    """An executor that runs each call at once, in this process (``jobs == 1``)."""

    def submit(self, fn: Callable[..., Outcome], /, *args: object, **kwargs: object) -> Future:  # type: ignore[override]
        fut: Future[Outcome] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as e:  # delivered through the future, as a process pool does
            fut.set_exception(e)
        return fut


def _executor(jobs: int) -> Executor:
    if jobs <= 1:
        return _Inline()
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


def run_plan(
    spec: PlanSpec,
    base_dir: Path,
    *,
    listener: PlanListener | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> PlanResult:
    """Run the whole plan (module docstring).

    Raises:
        ConfigError: an infeasible plan (before any simulation).
        InputError: a missing or malformed trace.
    """
    t_start = clock()
    traffic = traffic_for(spec, base_dir, spec.seed)
    floors = check_feasible(spec, traffic)
    combos, unplaceable = build_combos(spec, traffic)
    if not any(combos.values()):
        raise ConfigError("no candidate stack can place every service on any candidate GPU")
    s = spec.search
    make: Callable[[list[Combo]], Search] = brute_force_search if s.brute_force else stack_search
    best: list[Point | None] = [None]
    done = [0]

    def on_outcome(p: Point, o: Outcome) -> None:
        done[0] += 1
        if o.meets and (best[0] is None or point_key(p) < point_key(best[0])):
            best[0] = p
        if listener is not None:
            listener.evaluated(o, best[0], done[0])

    names = list(combos)
    phases = [names]
    if s.baseline is not None and not s.brute_force and len(names) > 1:
        phases = [[s.baseline], [n for n in names if n != s.baseline]]
    results: dict[str, StackSearch | None] = {}
    outcomes: dict[Point, Outcome] = {}
    cut: list[str] = []
    cap: float | None = None
    with _executor(s.jobs) as ex:

        def submit(p: Point, seed: int = spec.seed, factor: float = 1.0, window: int = 0) -> Future:
            return ex.submit(evaluate, EvalTask(spec, base_dir, p, seed, factor, window))

        if listener is not None:
            listener.phase("search")
        for i, phase in enumerate(phases):
            driven = drive(
                {n: make(_capped(combos[n], cap)) for n in phase},
                submit,
                lambda o: o.meets,
                on_outcome=on_outcome,
                deadline=t_start + s.budget_s,
                clock=clock,
                known=outcomes,
            )
            results.update(driven.results)
            outcomes.update(driven.outcomes)
            cut += driven.cut
            base = results.get(phase[0]) if i == 0 and len(phases) > 1 else None
            if base is not None and base.best is not None:
                cap = s.cost_cap * base.best.cost_per_hour
        search_wall = clock() - t_start
        found = [r.best for r in results.values() if r is not None and r.best is not None]
        # equal cost and size: the larger tightest SLO margin, then the stack's name
        chosen = (
            min(found, key=lambda p: (point_key(p), -outcomes[p].min_margin, p.stack))
            if found
            else None
        )
        result = PlanResult(
            spec,
            base_dir,
            traffic,
            floors,
            combos,
            unplaceable,
            {n: results.get(n) for n in names},
            outcomes,
            cut,
            chosen,
            search_wall_s=search_wall,
            cost_cap_per_hour=cap,
        )
        if chosen is not None:
            _robustness_and_headroom(result, submit, listener)
    result.wall_s = clock() - t_start
    return result


def _robustness_and_headroom(
    result: PlanResult, submit: Callable[..., Future], listener: PlanListener | None
) -> None:
    spec, chosen = result.spec, result.chosen
    assert chosen is not None
    s = spec.search
    if listener is not None:
        listener.phase("robustness")
    futures = _robustness_runs(result, chosen, submit)
    if listener is not None:
        listener.phase("headroom")
    lo, hi = 1.0, s.headroom_max
    runs: list[Outcome] = []
    if s.headroom_steps > 0 and hi > lo:
        top = submit(chosen, spec.seed, hi).result()
        runs.append(top)
        if top.meets:
            lo = hi
        else:
            for _ in range(s.headroom_steps - 1):
                mid = round((lo + hi) / 2, 6)
                o = submit(chosen, spec.seed, mid).result()
                runs.append(o)
                if o.meets:
                    lo = mid
                else:
                    hi = mid
    result.headroom = lo
    result.headroom_breaks = hi if hi > lo else None
    result.headroom_runs = runs
    result.robustness = _collect(chosen, futures)
    if all(o.meets for o in result.robustness):
        return
    if listener is not None:
        listener.phase("robust alternative")
    for cand in _alternatives(result, chosen)[: s.robust_tries]:
        first = result.outcomes.get(cand)
        if first is None:
            first = submit(cand).result()
            result.outcomes[cand] = first
        if not first.meets:
            continue
        outs = _collect(cand, _robustness_runs(result, cand, submit))
        result.alternatives.append((cand, outs))
        if all(o.meets for o in outs):
            result.robust_choice = cand
            return


def _robustness_runs(result: PlanResult, p: Point, submit: Callable[..., Future]) -> list[Future]:
    traced = any(svc.traffic.trace is not None for svc in result.spec.services)
    return [
        submit(p, seed, 1.0, k + 1 if traced else 0)
        for k, seed in enumerate(result.spec.search.robustness_seeds)
    ]


def _collect(p: Point, futures: list[Future]) -> list[Outcome]:
    out = []
    for f in futures:
        try:
            out.append(f.result())
        except ConfigError as e:  # a trace window past the trace's end
            out.append(Outcome(p, error=str(e)))
    return out


def _alternatives(result: PlanResult, chosen: Point) -> list[Point]:
    """Points to try, cheapest first, when the chosen one is not robust: the
    chosen combo with 1 or 2 more GPUs, and every other stack's cheapest."""
    cands = [
        dataclasses.replace(chosen, n_gpus=chosen.n_gpus + k)
        for k in (1, 2)
        if chosen.n_gpus + k <= result.spec.search.max_gpus
    ]
    cands += [
        s.best
        for s in result.searches.values()
        if s is not None and s.best is not None and s.best != chosen
    ]
    uniq = {(c.stack, c.gpu, c.tp, c.n_gpus): c for c in cands}
    return sorted(uniq.values(), key=lambda p: (point_key(p), p.stack))
