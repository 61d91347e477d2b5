"""Brute-force check of SeaLLM's Theorem 1 (DB scheduling minimizes normalized latency).

See the module docstring of ``fleetserve.policy.db_theory`` for the findings. In
short: DB is optimal when all requests arrive together, and on one machine when
there are at most two services; it is *not* optimal on one machine with three
services and release times, nor with batch size 2 and release times (even with
a single service). The regression tests at the bottom pin the counterexamples.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.policy.db_theory import (
    Job,
    db_gap,
    db_priority,
    db_schedule,
    db_slots,
    db_tiebreak_range,
    enumerate_instances,
    normalized_latency,
    optimal_normalized_latency,
    optimal_schedule,
)

# Bounds of the brute force: ≤ 5 jobs, sizes ≤ 4, releases ≤ 6.
MAX_JOBS = 5
MAX_SIZE = 4
MAX_RELEASE = 6
TOL = 1e-9


def _settings(n: int) -> settings:
    return settings(deadline=None, max_examples=n, derandomize=True)


def _jobs(
    releases: st.SearchStrategy[int], sizes: st.SearchStrategy[int], max_jobs: int = MAX_JOBS
) -> st.SearchStrategy[list[Job]]:
    return st.lists(st.builds(Job, releases, sizes), min_size=1, max_size=max_jobs)


ANY_RELEASE = st.integers(0, MAX_RELEASE)
ANY_SIZE = st.integers(1, MAX_SIZE)
any_jobs = _jobs(ANY_RELEASE, ANY_SIZE)
released_at_zero = _jobs(st.just(0), ANY_SIZE)


@st.composite
def one_service(draw: st.DrawFn) -> list[Job]:
    """All jobs of one service: equal sizes, arbitrary releases."""
    size = draw(ANY_SIZE)
    return draw(_jobs(ANY_RELEASE, st.just(size)))


@st.composite
def two_services(draw: st.DrawFn) -> list[Job]:
    """Jobs of (at most) two services, arbitrary releases."""
    sizes = draw(st.lists(ANY_SIZE, min_size=2, max_size=2, unique=True))
    return draw(_jobs(ANY_RELEASE, st.sampled_from(sizes)))


def _db_value(jobs: list[Job], machines: int = 1) -> float:
    return normalized_latency(jobs, db_schedule(jobs, machines))


# --------------------------------------------------------------------------- model


def test_db_priority_is_budget_times_service_time() -> None:
    assert db_priority(2.0, 3.0) == 6.0
    assert db_priority(0.0, 5.0) == 0.0
    # A short service's fresh request beats a long service's fresh request ...
    assert db_priority(1.0, 1.0) < db_priority(4.0, 4.0)
    # ... but not a long request that is nearly done.
    assert db_priority(0.1, 4.0) < db_priority(1.0, 1.0)


def test_job_validation() -> None:
    with pytest.raises(ValueError, match="size"):
        Job(0, 0)
    with pytest.raises(ValueError, match="release"):
        Job(-1, 1)
    with pytest.raises(ValueError, match="machines"):
        db_schedule([Job(0, 1)], machines=0)


def test_db_slots_example() -> None:
    # Figure-2-like: a long request is running when two short ones arrive.
    jobs = [Job(0, 4), Job(1, 1), Job(1, 1)]
    assert db_slots(jobs) == [(0,), (1,), (2,), (0,), (0,), (0,)]
    assert db_schedule(jobs) == [6, 2, 3]
    assert normalized_latency(jobs, [6, 2, 3]) == pytest.approx((6 / 4 + 1 + 2) / 3)


@given(jobs=any_jobs, machines=st.integers(1, 2))
@_settings(150)
def test_db_schedule_is_feasible(jobs: list[Job], machines: int) -> None:
    slots = db_slots(jobs, machines)
    done = [0] * len(jobs)
    for t, run in enumerate(slots):
        assert len(run) <= machines
        ready = [i for i, j in enumerate(jobs) if j.release <= t and done[i] < j.size]
        assert len(run) == min(machines, len(ready)), "DB never idles with work waiting"
        for i in run:
            assert jobs[i].release <= t
            done[i] += 1
    assert done == [j.size for j in jobs]
    for j, c in zip(jobs, db_schedule(jobs, machines), strict=True):
        assert c >= j.release + j.size


@given(jobs=any_jobs, machines=st.integers(1, 2))
@_settings(150)
def test_db_reorders_only_at_releases_and_completions(jobs: list[Job], machines: int) -> None:
    """A preemption check at every slot = a check at release/completion events only.

    The running jobs' priorities only fall and the waiting ones' stay put, so the
    set DB runs changes only when a job arrives or finishes.
    """
    slots = db_slots(jobs, machines)
    completions = db_schedule(jobs, machines)
    for t in range(1, len(slots)):
        event = any(j.release == t for j in jobs) or t in completions
        if not event:
            assert slots[t] == slots[t - 1]


@given(jobs=any_jobs, machines=st.integers(1, 2))
@_settings(120)
def test_optimum_is_a_lower_bound_and_attained(jobs: list[Job], machines: int) -> None:
    opt = optimal_schedule(jobs, machines, allow_idle=False)
    assert normalized_latency(jobs, opt.completions) == pytest.approx(float(opt.value), abs=TOL)
    assert _db_value(jobs, machines) >= float(opt.value) - TOL


@given(jobs=_jobs(st.integers(0, 4), st.integers(1, 3), max_jobs=4), machines=st.integers(1, 2))
@_settings(40)
def test_idling_never_helps(jobs: list[Job], machines: int) -> None:
    """The full search (idle slots allowed) and the non-idling search agree."""
    assert optimal_schedule(jobs, machines).value == (
        optimal_schedule(jobs, machines, allow_idle=False).value
    )


# --------------------------------------------------------------- where DB is optimal


@given(jobs=released_at_zero)
@_settings(150)
def test_db_optimal_all_released_at_zero_one_machine(jobs: list[Job]) -> None:
    """Smith's rule case 1|pmtn|Σ w_j C_j with w_j = 1/p_j (DB = shortest size first)."""
    assert _db_value(jobs) == pytest.approx(
        optimal_normalized_latency(jobs, allow_idle=False), abs=TOL
    )


@given(jobs=released_at_zero)
@_settings(150)
def test_db_optimal_all_released_at_zero_two_machines(jobs: list[Job]) -> None:
    assert _db_value(jobs, 2) == pytest.approx(
        optimal_normalized_latency(jobs, 2, allow_idle=False), abs=TOL
    )


@given(jobs=one_service())
@_settings(300)
def test_db_optimal_one_service_one_machine(jobs: list[Job]) -> None:
    """Equal sizes: DB is SRPT, optimal for 1|r_j,pmtn|Σ C_j (Schrage 1968)."""
    assert _db_value(jobs) == pytest.approx(
        optimal_normalized_latency(jobs, allow_idle=False), abs=TOL
    )


@given(jobs=two_services())
@_settings(600)
def test_db_optimal_two_services_one_machine(jobs: list[Job]) -> None:
    """The paper's proof setting (≤ 2 services per sharing group): no counterexample.

    Checked exhaustively up to 5 jobs (see the module docstring), not proven.
    """
    assert _db_value(jobs) == pytest.approx(
        optimal_normalized_latency(jobs, allow_idle=False), abs=TOL
    )
    # ... whatever the tie rule.
    best, worst = db_tiebreak_range(jobs)
    assert best == worst


def test_db_optimal_up_to_two_jobs_exhaustive() -> None:
    for n in (1, 2):
        for jobs in enumerate_instances(n, range(1, MAX_SIZE + 1), MAX_RELEASE):
            assert db_gap(jobs, allow_idle=False) is None, jobs


# ------------------------------------------------------------ where DB is not optimal


def test_three_job_counterexamples_exhaustive() -> None:
    """Every 3-job, one-machine instance (sizes ≤ 4, releases ≤ 6) where DB loses.

    Exactly two, each with three distinct services; both are pinned below.
    """
    found = {
        tuple((j.release, j.size) for j in jobs)
        for jobs in enumerate_instances(3, range(1, MAX_SIZE + 1), MAX_RELEASE)
        if db_gap(jobs, allow_idle=False) is not None
    }
    assert found == {((0, 4), (3, 2), (5, 1)), ((0, 4), (2, 3), (5, 2))}


# (jobs as (release, size), machines, DB value, optimum, DB's best over tie rules)
PINNED = [
    pytest.param(
        ((0, 4), (2, 3), (5, 2)),
        1,
        Fraction(13, 9),
        Fraction(17, 12),
        Fraction(13, 9),
        id="one-machine-three-services-smallest-tie-free",
    ),
    pytest.param(
        ((0, 5), (4, 2), (5, 1)),
        1,
        Fraction(41, 30),
        Fraction(4, 3),
        Fraction(41, 30),
        id="one-machine-three-services-least-work-tie-free",
    ),
    pytest.param(
        ((0, 4), (3, 2), (5, 1)),
        1,
        Fraction(4, 3),
        Fraction(5, 4),
        Fraction(5, 4),
        id="one-machine-three-services-least-work-tie-dependent",
    ),
    pytest.param(
        ((0, 3), (1, 2), (2, 2)),
        2,
        Fraction(7, 6),
        Fraction(10, 9),
        Fraction(7, 6),
        id="batch2-two-services",
    ),
    pytest.param(
        ((0, 2), (0, 2), (0, 2), (3, 2), (3, 2)),
        2,
        Fraction(13, 10),
        Fraction(6, 5),
        Fraction(13, 10),
        id="batch2-one-service",
    ),
]


@pytest.mark.parametrize(("spec", "machines", "db_value", "optimum", "db_best"), PINNED)
def test_pinned_counterexample(
    spec: tuple[tuple[int, int], ...],
    machines: int,
    db_value: Fraction,
    optimum: Fraction,
    db_best: Fraction,
) -> None:
    jobs = [Job(r, s) for r, s in spec]
    ce = db_gap(jobs, machines)  # full search, idle slots allowed
    assert ce is not None
    assert ce.db_value == db_value
    assert ce.optimum.value == optimum
    assert ce.gap == db_value - optimum > 0
    assert db_tiebreak_range(jobs, machines)[0] == db_best


def test_smallest_counterexample_schedules() -> None:
    """The smallest tie-free one-machine counterexample, slot by slot.

    ::

        slot   0 1 2 3 4 5 6 7 8     A=(a 0, size 4)  B=(a 2, size 3)  C=(a 5, size 2)
        DB     A A A A B C C B B     at t=2: O_A = 2·4 = 8 < O_B = 3·3 = 9, A goes on;
                                     at t=5: O_C = 4 < O_B = 2·3 = 6, C preempts B.
        OPT    A A B B B C C A A     B done before C arrives; C delays A (weight 1/4)
                                     instead of B (weight 1/3).

    DB = (4/4 + 7/3 + 2/2)/3 = 13/9; OPT = (9/4 + 3/3 + 2/2)/3 = 17/12; gap 1/36.
    """
    jobs = [Job(0, 4), Job(2, 3), Job(5, 2)]
    assert db_slots(jobs) == [(0,), (0,), (0,), (0,), (1,), (2,), (2,), (1,), (1,)]
    assert db_schedule(jobs) == [4, 9, 7]
    opt = optimal_schedule(jobs)
    assert opt.completions == (9, 5, 7)
    assert opt.value == Fraction(17, 12)
