"""Rate-curve arrivals (fleetserve.workload.curve)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.errors import ConfigError
from fleetserve.workload.curve import CurveBurst, curve_arrivals, curve_mean_rate, curve_rate


def _count_ok(n: int, expected: float) -> bool:
    return abs(n - expected) <= 5 * math.sqrt(expected) + 1


def test_constant_rate_gives_poisson_counts() -> None:
    a = curve_arrivals([(0.0, 2.0)], 2000.0, rng=np.random.default_rng(0))
    assert _count_ok(len(a), 4000)
    gaps = np.diff(a)
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # cv 1: exponential gaps


def test_ramp_follows_the_integral() -> None:
    pts = [(0.0, 0.0), (1000.0, 4.0)]
    assert curve_mean_rate(pts, 1000.0) == pytest.approx(2.0)
    a = curve_arrivals(pts, 1000.0, rng=np.random.default_rng(1))
    counts = np.histogram(a, bins=4, range=(0, 1000))[0]
    for c, exp in zip(counts, (125, 375, 625, 875), strict=True):
        assert _count_ok(int(c), exp)


def test_burst_multiplies_its_window_only() -> None:
    b = [CurveBurst(200.0, 100.0, 5.0)]
    assert curve_mean_rate([(0.0, 1.0)], 1000.0, b) == pytest.approx(1.4)
    a = curve_arrivals([(0.0, 1.0)], 1000.0, bursts=b, rng=np.random.default_rng(2))
    inside = int(((a >= 200) & (a < 300)).sum())
    assert _count_ok(inside, 500)
    assert _count_ok(len(a) - inside, 900)
    assert curve_rate([(0.0, 1.0)], np.array([250.0, 350.0]), b).tolist() == [5.0, 1.0]


def test_zero_rate_pieces_get_no_arrival() -> None:
    pts = [(0.0, 1.0), (100.0, 0.0), (200.0, 0.0), (300.0, 1.0)]
    a = curve_arrivals(pts, 400.0, rng=np.random.default_rng(3))
    assert not ((a > 100.0) & (a < 200.0)).any()


@settings(max_examples=60, deadline=None)
@given(
    rates=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=5),
    duration=st.floats(1.0, 500.0),
    cv=st.floats(0.0, 3.0),
    seed=st.integers(0, 2**16),
)
def test_arrivals_are_sorted_in_range_and_seeded(
    rates: list[float], duration: float, cv: float, seed: int
) -> None:
    if not any(r > 0 for r in rates):
        rates = [*rates[:-1], 1.0]
    pts = [(i * duration / len(rates), r) for i, r in enumerate(rates)]
    a = curve_arrivals(pts, duration, cv=cv, rng=np.random.default_rng(seed))
    b = curve_arrivals(pts, duration, cv=cv, rng=np.random.default_rng(seed))
    assert np.array_equal(a, b)
    assert np.all(np.diff(a) >= 0)
    assert len(a) == 0 or (a[0] >= 0 and a[-1] < duration)


@pytest.mark.parametrize(
    "points",
    [[], [(0.0, 1.0), (0.0, 2.0)], [(0.0, -1.0)], [(0.0, 0.0), (10.0, 0.0)]],
)
def test_bad_curves_are_refused(points: list[tuple[float, float]]) -> None:
    with pytest.raises(ConfigError):
        curve_arrivals(points, 10.0, rng=np.random.default_rng(0))


def test_bad_burst_is_refused() -> None:
    with pytest.raises(ConfigError, match="burst"):
        CurveBurst(10.0, 0.0, 2.0)
