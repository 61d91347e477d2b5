"""SeaLLM's DB priority and a brute-force check of its Theorem 1.

SeaLLM (§4.2) serves first the request with the smallest ``O_r = T'_r · L̂_r``
(remaining execution time × its service's execution time on an idle system;
Algorithm 2 uses the remaining *budget* ``Q_r`` for ``T'_r``). Theorem 1 claims
this minimizes the normalized latency ``Σ_r (C_r − a_r) / L̂_r`` when requests can
be preempted at any time and all requests of a service take the same time, i.e.
it solves ``1|r_j,pmtn|Σ w_j C_j`` with ``w_j = 1/p_j`` (``B|r_j,pmtn|…`` with
batch ``B``). :func:`db_priority` is that key; the rest of the module is a model
small enough to check the claim against an exhaustive optimum.

Model
-----
Integer time slots. A :class:`Job` has a release ``a`` and a size ``p`` (= its
service's ``L̂``; one size per service). In each slot each of ``machines``
machines advances one released, unfinished job by one unit; a job advances at
most one unit per slot (one iteration per batch step). :func:`db_schedule` runs
the ``machines`` smallest ``remaining × size`` (ties: release, then index).
:func:`optimal_schedule` searches every slot schedule (memoized DP over
``(t, remaining vector)``, exact fractions). On one machine, integer slots lose
nothing (preemption at release dates suffices); on two, OPT is over slot
schedules, but DB's own decisions fall on integer event times anyway, so every
counterexample below also holds in continuous time.

What we found
-------------
``gap`` is DB − OPT of the mean normalized latency, exact.

(a) All requests released at time 0: DB is optimal. One machine: it is Smith's
    rule (``p_j / w_j = p_j²``, so shortest service first; preemption cannot
    help), and all 125 multisets of ≤ 5 jobs with sizes ≤ 4 agree with the
    brute force. Two and three machines: no counterexample in all 576 multisets
    of ≤ 7 jobs with sizes ≤ 5 (≤ 4 for 7 jobs). Not proven for ≥ 2 machines.

(b) One machine, arbitrary releases: DB is **not** optimal in general.

    * Smallest tie-free counterexample within sizes ≤ 4, releases ≤ 6 —
      jobs ``(a, p)`` = A (0, 4), B (2, 3), C (5, 2)::

          slot  0 1 2 3 4 5 6 7 8
          DB    A A A A B C C B B   t=2: O_A = 2·4 = 8 < O_B = 9; t=5: O_C = 4 < O_B = 6
          OPT   A A B B B C C A A   B finishes before C arrives; C delays A instead

      DB = 13/9, OPT = 17/12, gap = 1/36 (DB/OPT = 52/51, +2.0 %).
    * Least total work (7): (0, 4), (3, 2), (5, 1): DB = 4/3, OPT = 5/4,
      gap = 1/12; it needs a tie (O = 4 for both A and B at t=3, release order
      keeps A) — the other tie rule is optimal. Least work with no tie (8):
      (0, 5), (4, 2), (5, 1): DB = 41/30, OPT = 4/3, gap = 1/30.
    * No 2-job counterexample (all 106 with sizes ≤ 4, releases ≤ 6). Of the
      1,460 3-job instances with sizes ≤ 4, releases ≤ 6 exactly two fail:
      (0, 4), (2, 3), (5, 2) and (0, 4), (3, 2), (5, 1). All 75 failing 3-job
      instances with sizes ≤ 8, releases ≤ 10 use three distinct sizes; the
      largest ratio there is 100/93 (+7.5 %, (0, 8), (6, 4), (10, 3), tie-
      dependent), 18/17 (+5.9 %, (0, 6), (3, 4), (6, 2)) without ties. Random
      3–6-job instances with sizes ≤ 8 reached 188/179 (+5.0 %, tie-free).
      Every triple of sizes in 1..6 except {1, 5, 6} has a counterexample with
      ≤ 4 jobs and releases ≤ 8.
    * Why the proof fails: the exchange argument (Eq. 10) assumes the swapped
      jobs j, k run back to back and nothing else changes. A later arrival C
      preempts whichever of them is still unfinished, so the swap decides which
      weight (1/3 for B, 1/4 for A) absorbs C's delay. DB's local choice is right
      for the pair and wrong for the triple.
    * Not a preemption-granularity or tie artefact: DB's running set changes
      only at releases and completions (the running jobs' keys only fall), so a
      check every iteration = a check at arrival events; and the counterexamples
      above marked tie-free fail under every tie rule (:func:`db_tiebreak_range`).

    Where Theorem 1 does hold (one machine):

    * One service (equal sizes): DB is SRPT, optimal for ``1|r_j,pmtn|Σ C_j``
      (Schrage 1968); confirmed.
    * At most two services — the setting of the paper's own proof ("shares at
      most two services for each sharing group"): no counterexample. Checked
      exhaustively on all 53,310 two-size instances with 3–5 jobs, sizes
      pairs from 1..6, releases ≤ 7 (≤ 5 for 5 jobs), all 3-job ones with sizes
      ≤ 8, releases ≤ 10, and 40,632 random ones with 5–9 jobs, sizes ≤ 9,
      releases ≤ 15; every tie rule gives the same value. Not proven. The reason
      it is plausible: with sizes p < q, a p-job's key (≤ p²) is never beaten by
      an arrival's (≥ p²) and a q-job arrival's key q² beats no q-job, so the only
      preemptions are of q-jobs by p-jobs; a job DB prefers to a partly run one
      is never itself preempted later, which is the failure pattern above.

(c) Two machines (batch B = 2; a request advances one unit per slot; services
    may share a batch, which Algorithm 2 forbids): with releases DB fails even
    with **one** service. Smallest one-service case (no ≤ 4-job one with sizes
    ≤ 5, releases ≤ 8): (0, 2) ×3, (3, 2) ×2: DB = 13/10, OPT = 6/5, gap = 1/10
    — DB finishes the two started jobs together and then runs the third alone
    while a machine idles; OPT staggers them. With two services, 3 jobs suffice:
    (0, 3), (1, 2), (2, 2): DB = 7/6, OPT = 10/9, gap = 1/18. Among sizes ≤ 4,
    releases ≤ 4: 19 of 724 3-job and 146 of 4,979 4-job instances fail. All
    released at 0: optimal, see (a).

So Theorem 1 holds on one machine for simultaneous arrivals and for one service
(both classical results), and for two services (exhaustive evidence, no proof);
with batch ≥ 2 it holds for simultaneous arrivals (evidence only). It fails for
three or more services on one machine, and for batch ≥ 2 with arrivals over time
even with one service. The tests in ``tests/test_db_theorem.py`` assert exactly this.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

logger = logging.getLogger(__name__)

_INFEASIBLE = 1 << 62  # DP cost of a state that cannot finish by the horizon

__all__ = [
    "Counterexample",
    "Job",
    "OptimalSchedule",
    "db_gap",
    "db_priority",
    "db_schedule",
    "db_slots",
    "db_tiebreak_range",
    "enumerate_instances",
    "find_counterexample",
    "normalized_latency",
    "optimal_normalized_latency",
    "optimal_schedule",
]


def db_priority(budget_left_s: float, l_hat_s: float) -> float:
    """SeaLLM's DB priority ``O_r = Q_r · L̂_s`` (smaller is served first).

    Args:
        budget_left_s: ``Q_r``, the request's remaining execution-time budget
            (seconds). With identical execution times within a service (Theorem 1's
            assumption (2)) this is the request's true remaining execution time.
        l_hat_s: ``L̂_s``, the profiled execution time of the request's service on
            an idle system (seconds).

    Returns:
        The priority key; the scheduler serves the smallest key first.
    """
    return budget_left_s * l_hat_s


# ---------------------------------------------------------------------------
# Discrete model: unit time slots, integer releases and sizes.
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """One request of the discrete model.

    Attributes:
        release: arrival slot ``a_r`` (the job may run from slot ``release`` on).
        size: execution time ``L̂`` of the job's service, in slots; jobs of one
            service share a size, so a size *is* a service here.
    """

    release: int
    size: int

    def __post_init__(self) -> None:
        if self.release < 0:
            raise ValueError(f"Job.release must be >= 0, got {self.release}")
        if self.size < 1:
            raise ValueError(f"Job.size must be >= 1, got {self.size}")


def _check_machines(machines: int) -> None:
    if machines < 1:
        raise ValueError(f"machines must be >= 1, got {machines}")


def db_slots(jobs: Sequence[Job], machines: int = 1) -> list[tuple[int, ...]]:
    """Simulate DB scheduling slot by slot; return the jobs run in each slot.

    In every slot ``[t, t+1)`` each of ``machines`` identical machines runs one
    released, unfinished job; the jobs chosen are those with the smallest
    ``db_priority(remaining, size)``, ties broken by release, then by index. A job
    runs on at most one machine per slot (a request advances one iteration per
    batch step). DB never idles a machine while a job is waiting.

    Args:
        jobs: the instance.
        machines: number of identical machines (SeaLLM's batch size ``B``).

    Returns:
        Entry ``t`` holds the indices (ascending) of the jobs run in slot ``t``;
        the list ends with the slot in which the last job finishes.
    """
    _check_machines(machines)
    remaining = [j.size for j in jobs]
    left = sum(remaining)
    slots: list[tuple[int, ...]] = []
    t = 0
    while left:
        ready = [i for i, j in enumerate(jobs) if j.release <= t and remaining[i] > 0]
        ready.sort(key=lambda i: (db_priority(remaining[i], jobs[i].size), jobs[i].release, i))
        run = tuple(sorted(ready[:machines]))
        for i in run:
            remaining[i] -= 1
        left -= len(run)
        slots.append(run)
        t += 1
    return slots


def db_schedule(jobs: Sequence[Job], machines: int = 1) -> list[int]:
    """Completion time ``C_j`` of each job (input order) under DB scheduling.

    A job whose last unit runs in slot ``t`` completes at ``t + 1``; see
    :func:`db_slots` for the rule.
    """
    completion = [0] * len(jobs)
    for t, run in enumerate(db_slots(jobs, machines)):
        for i in run:
            completion[i] = t + 1
    return completion


def _normalized_latency_exact(jobs: Sequence[Job], completions: Sequence[int]) -> Fraction:
    if len(jobs) != len(completions):
        raise ValueError(f"{len(jobs)} jobs but {len(completions)} completion times")
    if not jobs:
        raise ValueError("normalized latency of an empty instance is undefined")
    total = sum(
        (Fraction(c - j.release, j.size) for j, c in zip(jobs, completions, strict=True)),
        Fraction(0),
    )
    return total / len(jobs)


def normalized_latency(jobs: Sequence[Job], completions: Sequence[int]) -> float:
    """Mean over jobs of ``(C_j - a_j) / size_j`` (SeaLLM's normalized latency)."""
    return float(_normalized_latency_exact(jobs, completions))


@dataclass(frozen=True, slots=True)
class OptimalSchedule:
    """An exact optimum of the discrete model.

    Attributes:
        value: the minimum normalized latency, as an exact fraction.
        completions: completion time per job of one optimal schedule.
    """

    value: Fraction
    completions: tuple[int, ...]


def optimal_schedule(
    jobs: Sequence[Job], machines: int = 1, *, allow_idle: bool = True
) -> OptimalSchedule:
    """Minimum normalized latency over *all* preemptive unit-slot schedules.

    Memoized DP over ``(t, remaining-work vector)``: in each slot any set of at
    most ``machines`` released, unfinished jobs runs one unit each (idling a
    machine is allowed unless ``allow_idle`` is False). Finishing a job ``j`` in slot ``t`` costs
    ``(t + 1) / size_j``; the constant ``Σ a_j / size_j`` is subtracted at the
    end. The horizon is ``max release + total work``: any schedule can be made
    non-idling without delaying a completion, and a non-idling one is done by
    then. Exponential; meant for ≤ 5 jobs with sizes ≤ 4 and releases ≤ 6.

    Args:
        jobs: the instance.
        machines: number of identical machines.
        allow_idle: search all schedules, including those that leave a machine
            idle while a released job waits (the default). ``False`` searches
            only non-idling schedules: the same optimum (moving a waiting job's
            next unit into an idle slot delays no completion), found ~30x faster.

    Returns:
        The exact optimum and the completion times of one schedule attaining it.
    """
    _check_machines(machines)
    if not jobs:
        raise ValueError("normalized latency of an empty instance is undefined")
    n = len(jobs)
    releases = tuple(j.release for j in jobs)
    # Integer weights: scale 1/size_j by the lcm of the sizes, so the DP is exact.
    scale = math.lcm(*(j.size for j in jobs))
    weights = tuple(scale // j.size for j in jobs)
    horizon = max(releases) + sum(j.size for j in jobs)
    done = (0,) * n
    memo: dict[tuple[int, tuple[int, ...]], tuple[int, tuple[int, ...]]] = {}

    def best(t: int, rem: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """Min of Σ C_j·weight_j over unfinished jobs, and one argmin's completions."""
        if rem == done:
            return 0, done
        key = (t, rem)
        hit = memo.get(key)
        if hit is not None:
            return hit
        result: tuple[int, tuple[int, ...]] = (_INFEASIBLE, done)
        if t < horizon:
            ready = [i for i in range(n) if rem[i] > 0 and releases[i] <= t]
            k_max = min(machines, len(ready))
            for k in range(k_max, -1, -1) if allow_idle else (k_max,):
                for chosen in itertools.combinations(ready, k):
                    nxt = list(rem)
                    cost = 0
                    for i in chosen:
                        nxt[i] -= 1
                        if nxt[i] == 0:
                            cost += weights[i] * (t + 1)
                    sub_cost, sub_c = best(t + 1, tuple(nxt))
                    if cost + sub_cost < result[0]:
                        comp = list(sub_c)
                        for i in chosen:
                            if nxt[i] == 0:
                                comp[i] = t + 1
                        result = (cost + sub_cost, tuple(comp))
        memo[key] = result
        return result

    total, completions = best(0, tuple(j.size for j in jobs))
    offset = sum(w * r for w, r in zip(weights, releases, strict=True))
    return OptimalSchedule(value=Fraction(total - offset, scale * n), completions=completions)


def optimal_normalized_latency(
    jobs: Sequence[Job], machines: int = 1, *, allow_idle: bool = True
) -> float:
    """Minimum normalized latency over all preemptive unit-slot schedules.

    See :func:`optimal_schedule` (which also returns the exact fraction and an
    optimal schedule).
    """
    return float(optimal_schedule(jobs, machines, allow_idle=allow_idle).value)


def db_tiebreak_range(jobs: Sequence[Job], machines: int = 1) -> tuple[Fraction, Fraction]:
    """Best and worst normalized latency over every way DB may break ties.

    :func:`db_schedule` breaks equal priorities by release, then index; the paper
    leaves ties open. This explores every schedule that serves, in each slot, the
    ``machines`` smallest priorities under *some* tie-break. If even the best of
    them is worse than the optimum, DB is suboptimal whatever its tie rule.

    Returns:
        ``(best, worst)`` exact normalized latencies.
    """
    _check_machines(machines)
    if not jobs:
        raise ValueError("normalized latency of an empty instance is undefined")
    n = len(jobs)
    scale = math.lcm(*(j.size for j in jobs))
    weights = tuple(scale // j.size for j in jobs)
    done = (0,) * n
    memo: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}

    def span(t: int, rem: tuple[int, ...]) -> tuple[int, int]:
        if rem == done:
            return 0, 0
        hit = memo.get((t, rem))
        if hit is not None:
            return hit
        ready = [i for i in range(n) if rem[i] > 0 and jobs[i].release <= t]
        prio = {i: rem[i] * jobs[i].size for i in ready}
        k = min(machines, len(ready))
        lo, hi = _INFEASIBLE, -1
        if k == 0:
            lo, hi = span(t + 1, rem)
        else:
            cut = sorted(prio.values())[k - 1]
            must = [i for i in ready if prio[i] < cut]
            tied = [i for i in ready if prio[i] == cut]
            for extra in itertools.combinations(tied, k - len(must)):
                nxt = list(rem)
                cost = 0
                for i in (*must, *extra):
                    nxt[i] -= 1
                    if nxt[i] == 0:
                        cost += weights[i] * (t + 1)
                sub_lo, sub_hi = span(t + 1, tuple(nxt))
                lo, hi = min(lo, cost + sub_lo), max(hi, cost + sub_hi)
        memo[(t, rem)] = (lo, hi)
        return lo, hi

    lo, hi = span(0, tuple(j.size for j in jobs))
    offset = sum(w * j.release for w, j in zip(weights, jobs, strict=True))
    return Fraction(lo - offset, scale * n), Fraction(hi - offset, scale * n)


@dataclass(frozen=True, slots=True)
class Counterexample:
    """An instance on which DB is not optimal.

    Attributes:
        jobs: the instance.
        machines: number of machines.
        db_value: DB's normalized latency (exact).
        db_completions: DB's completion times.
        optimum: the optimal normalized latency and one optimal schedule.
    """

    jobs: tuple[Job, ...]
    machines: int
    db_value: Fraction
    db_completions: tuple[int, ...]
    optimum: OptimalSchedule

    @property
    def gap(self) -> Fraction:
        """Absolute gap ``DB − OPT`` of the mean normalized latency."""
        return self.db_value - self.optimum.value

    @property
    def ratio(self) -> Fraction:
        """Relative gap ``DB / OPT``."""
        return self.db_value / self.optimum.value


def db_gap(
    jobs: Sequence[Job], machines: int = 1, *, allow_idle: bool = True
) -> Counterexample | None:
    """Compare DB with the exact optimum (:func:`optimal_schedule`) on one instance.

    Returns:
        A :class:`Counterexample` if DB is strictly worse than optimal, else None.
    """
    db_c = db_schedule(jobs, machines)
    db_value = _normalized_latency_exact(jobs, db_c)
    opt = optimal_schedule(jobs, machines, allow_idle=allow_idle)
    if db_value < opt.value:  # pragma: no cover - would mean the DP is wrong
        raise AssertionError(f"DB beats the exhaustive optimum on {jobs!r}")
    if db_value == opt.value:
        return None
    return Counterexample(tuple(jobs), machines, db_value, tuple(db_c), opt)


def enumerate_instances(
    n_jobs: int, sizes: Iterable[int], max_release: int
) -> Iterable[tuple[Job, ...]]:
    """All instances of ``n_jobs`` jobs, up to job order, earliest release 0.

    Jobs are drawn from ``{(r, s) : 0 <= r <= max_release, s in sizes}`` as a
    multiset (job order only matters for DB's last tie-break, which only splits
    identical jobs). Instances whose earliest release is not 0 are shifts of
    others and are skipped.
    """
    kinds = [Job(r, s) for r in range(max_release + 1) for s in sorted(set(sizes))]
    for combo in itertools.combinations_with_replacement(kinds, n_jobs):
        if min(j.release for j in combo) == 0:
            yield combo


def find_counterexample(
    instances: Iterable[Sequence[Job]], machines: int = 1, *, allow_idle: bool = True
) -> Counterexample | None:
    """First instance of ``instances`` on which DB is not optimal, or None."""
    for jobs in instances:
        found = db_gap(jobs, machines, allow_idle=allow_idle)
        if found is not None:
            return found
    return None
