"""Arrivals that follow a rate curve with bursts: what a capacity plan is asked about.

A service's traffic is often known as a curve ("1 req/s at night, 4 at the
afternoon peak, a 5x burst when the newsletter goes out") rather than as a
trace. :func:`curve_arrivals` draws arrivals whose rate follows such a curve:

* ``points``: ``(t, rate)`` knots; the rate is linear between knots and held
  at the first / last knot's value before / after them. One knot is a
  constant rate.
* ``bursts``: windows ``[start_s, start_s + len_s)`` in which the curve is
  multiplied by ``factor`` (overlapping windows multiply).
* ``cv``: burstiness at the small scale, the coefficient of variation of the
  gaps in *operational time* (1: a non-homogeneous Poisson process).

Method (time change). With the cumulative rate ``Lambda(t) = int_0^t r``,
a unit-rate renewal process ``u_1 < u_2 < ...`` (Gamma gaps of mean 1 and CV
``cv``) mapped through ``Lambda^-1`` has rate ``r(t)``. ``Lambda`` is
piecewise quadratic between break points (the knots and the burst edges),
so ``Lambda^-1`` is solved exactly per piece::

    rate  r(t) = a + b x                     x = t - t_k in the piece
    Lambda(t)  = L_k + a x + b x^2 / 2
    x(u)       = 2 d / (a + sqrt(a^2 + 2 b d)),   d = u - L_k   (stable for b -> 0)

Pieces of zero rate are skipped (no arrival falls in them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fleetserve.errors import ConfigError
from fleetserve.workload.synthetic import FloatArray, gamma_arrivals

__all__ = ["CurveBurst", "curve_arrivals", "curve_mean_rate", "curve_rate"]


@dataclass(frozen=True, slots=True)
class CurveBurst:
    """A window ``[start_s, start_s + len_s)`` whose rate is ``factor`` times the curve's."""

    start_s: float
    len_s: float
    factor: float

    def __post_init__(self) -> None:
        for name in ("start_s", "len_s", "factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ConfigError(f"burst {name} must be a finite number, got {v!r}")
        if self.start_s < 0 or self.len_s <= 0 or self.factor <= 0:
            raise ConfigError(
                f"a burst needs start_s >= 0, len_s > 0 and factor > 0, got {self.start_s}, "
                f"{self.len_s}, {self.factor}"
            )


def _check_points(points: Sequence[tuple[float, float]]) -> tuple[FloatArray, FloatArray]:
    if not points:
        raise ConfigError("a rate curve needs at least one (t, rate) point")
    t = np.array([float(p[0]) for p in points], dtype=np.float64)
    r = np.array([float(p[1]) for p in points], dtype=np.float64)
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(r))):
        raise ConfigError("rate curve points must be finite numbers")
    if np.any(r < 0):
        raise ConfigError(f"rate curve rates must be >= 0, got {r.tolist()}")
    if np.any(np.diff(t) <= 0):
        raise ConfigError(f"rate curve times must increase strictly, got {t.tolist()}")
    if not np.any(r > 0):
        raise ConfigError("a rate curve needs a positive rate somewhere")
    return t, r


def curve_rate(
    points: Sequence[tuple[float, float]], t: FloatArray, bursts: Sequence[CurveBurst] = ()
) -> FloatArray:
    """The curve's rate at times ``t`` (bursts included), req/s."""
    kt, kr = _check_points(points)
    out = np.interp(np.asarray(t, dtype=np.float64), kt, kr)
    for b in bursts:
        inside = (t >= b.start_s) & (t < b.start_s + b.len_s)
        out = np.where(inside, out * b.factor, out)
    return np.asarray(out, dtype=np.float64)


def _pieces(
    points: Sequence[tuple[float, float]], duration_s: float, bursts: Sequence[CurveBurst]
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Break points ``t_k``, and per piece its start rate ``a_k`` and slope ``b_k``."""
    kt, _ = _check_points(points)
    edges = [0.0, duration_s, *kt.tolist()]
    for w in bursts:
        edges += [w.start_s, w.start_s + w.len_s]
    t = np.unique(np.clip(np.array(edges, dtype=np.float64), 0.0, duration_s))
    mid = (t[:-1] + t[1:]) / 2
    start = curve_rate(points, t[:-1], ())
    end = curve_rate(points, t[1:], ())
    factor = curve_rate([(0.0, 1.0)], mid, bursts)  # the bursts' product per piece
    width = np.diff(t)
    a = start * factor
    b = (end - start) * factor / width
    return t, a, b


def curve_mean_rate(
    points: Sequence[tuple[float, float]], duration_s: float, bursts: Sequence[CurveBurst] = ()
) -> float:
    """Expected arrivals per second over ``[0, duration_s)``."""
    if not duration_s > 0:
        raise ConfigError(f"duration_s must be > 0, got {duration_s!r}")
    t, a, b = _pieces(points, duration_s, bursts)
    w = np.diff(t)
    return float(np.sum(a * w + b * w * w / 2)) / duration_s


def curve_arrivals(
    points: Sequence[tuple[float, float]],
    duration_s: float,
    *,
    bursts: Sequence[CurveBurst] = (),
    cv: float = 1.0,
    rng: np.random.Generator,
) -> FloatArray:
    """Arrival times in ``[0, duration_s)`` whose rate follows the curve (module doc).

    Args:
        points: ``(t, rate)`` knots, times strictly increasing, rates >= 0.
        duration_s: keep arrivals before this time (> 0).
        bursts: windows that multiply the rate.
        cv: coefficient of variation of the gaps in operational time (>= 0).
        rng: random generator (the only source of randomness).

    Returns:
        Sorted arrival times, seconds.

    Raises:
        ConfigError: a bad argument (named).
    """
    if not (isinstance(duration_s, int | float) and math.isfinite(duration_s) and duration_s > 0):
        raise ConfigError(f"duration_s must be a finite number > 0, got {duration_s!r}")
    t, a, b = _pieces(points, float(duration_s), bursts)
    w = np.diff(t)
    lam = np.concatenate([[0.0], np.cumsum(a * w + b * w * w / 2)])
    total = float(lam[-1])
    if total <= 0:
        return np.zeros(0, dtype=np.float64)
    u = gamma_arrivals(1.0, cv, duration_s=total, rng=rng)
    k = np.searchsorted(lam, u, side="right") - 1
    k = np.clip(k, 0, len(w) - 1)
    d = u - lam[k]
    ak, bk = a[k], b[k]
    root = np.sqrt(np.maximum(ak * ak + 2.0 * bk * d, 0.0))
    denom = ak + root
    x = np.where(denom > 0, 2.0 * d / np.where(denom > 0, denom, 1.0), 0.0)
    times = np.minimum(t[k] + np.minimum(x, w[k]), np.nextafter(duration_s, 0.0))
    return np.asarray(np.sort(times), dtype=np.float64)
