r"""The serving path's overhead, as the fidelity simulation models it.

The calibrated cost model prices what the profiler times: one engine forward
plus an argmax. A request served over HTTP pays more, and the emulated-cluster
simulation (:mod:`fleetserve.experiments.fidelity`) adds it with three
parameters, :class:`RuntimeOverhead`::

    client ──HTTP, controller, Ray submit──► engine          request_s (fixed)
    engine: every iteration  forward + argmax                 (cost model)
                           + bookkeeping, sampling, detok,
                             the actor's asyncio loop         iteration_s (fixed)
    engine token ──poll reply, controller, SSE──► client      delivery_iters

Where each comes from (measured on this project's 2-core machine, one
tiny-llama-a worker; see ``fleetserve fidelity``'s report for the numbers):

* **request_s.** The POST, the controller's dispatch and the Ray ``submit``
  call until the request is in the engine's queue, plus the fixed part of
  the way back (the driver's side of the poll reply, the controller, SSE and
  the client's parser). Traced on an idle tiny-llama-a server here: ~4 ms
  from the client's send to the HTTP handler, ~1 ms in the controller, ~2.5 ms
  for the Ray ``submit``, then after the step ~1 ms to the poll's reply,
  ~1.3 ms to the controller, ~0.7 ms to the SSE chunk and ~1 ms to the
  client: ~12 ms in all.
* **iteration_s.** A worker's ``Engine.step`` costs more than the profiled
  forward (~1 ms more at batch 1 here: scheduling, per-request sampling,
  incremental detokenization, token callbacks), the actor hands the engine
  thread each step and each poll's report (~1.4 ms between steps here), and
  the serving worker's steps ran 10-20% slower than the profiler's during
  the probes here (another process, minutes later; the cause is not pinned
  down). Added to the calibrated ``overhead_s`` of every iteration.
* **delivery_iters.** A token reaches the controller when the worker's
  long-poll returns with it. The worker runs its engine on a thread of its
  own, so a poll waits ready during the step and returns as the step ends
  (lag ~0); with the step on the actor's event loop, as before, a poll came
  back only every few engine steps (~6 at batch 1, 8 and 24 alike), so the
  lag is counted in *iterations of the token's instance*, not seconds; when
  the instance goes idle, the poll returns at once. :func:`deliver` applies
  it to a simulated iteration timeline; the fit decides it.

All three are calibrated by :func:`fit_overhead` from probes of the running
server (:mod:`fleetserve.runtime.fidelity_probe`: requests alone, and bursts
of concurrent requests, on the otherwise idle server, before the replay),
never from the replay they are compared with. ``RuntimeOverhead()`` (all
zero) is *off*: the simulation is then exactly the engine-only one.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from fleetserve.costmodel import Calibration, CostModel
from fleetserve.errors import ConfigError
from fleetserve.metrics.records import RequestRecord

__all__ = [
    "ITERATION_GRID_S",
    "LAG_GRID",
    "OverheadFit",
    "RuntimeOverhead",
    "Timeline",
    "deliver",
    "deliver_records",
    "with_iteration_overhead",
]


@dataclass(frozen=True, slots=True)
class RuntimeOverhead:
    """The serving path's overhead (module docstring); all zero = off.

    Attributes:
        request_s: fixed latency added to every request (arrival → engine,
            plus the fixed part of the way back to the client).
        iteration_s: fixed time added to every engine iteration.
        delivery_iters: a token reaches the client this many iterations of
            its instance after it is produced (fractional: interpolated
            between iteration ends), or when the instance goes idle if that
            comes first.
    """

    request_s: float = 0.0
    iteration_s: float = 0.0
    delivery_iters: float = 0.0

    def __post_init__(self) -> None:
        for name in ("request_s", "iteration_s", "delivery_iters"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"RuntimeOverhead.{name} must be a number >= 0, got {v!r}")

    @property
    def off(self) -> bool:
        """True when every parameter is zero (the engine-only simulation)."""
        return self.request_s == 0 and self.iteration_s == 0 and self.delivery_iters == 0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RuntimeOverhead:
        """From :meth:`to_dict` output (missing keys: 0).

        Raises:
            ConfigError: an unknown key or a bad value.
        """
        known = {"request_s", "iteration_s", "delivery_iters"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown RuntimeOverhead key(s) {unknown}; expected {sorted(known)}")
        try:
            return cls(**{k: float(v) for k, v in data.items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"RuntimeOverhead: {exc}") from None


def with_iteration_overhead(cost: CostModel, iteration_s: float) -> CostModel:
    """``cost`` with ``iteration_s`` added to the fixed overhead of every
    calibrated entry (the default parameters are left alone: without a
    profile the fidelity simulation is a smoke test anyway).

    Returns ``cost`` itself when ``iteration_s`` is 0.
    """
    cal = cost.calibration
    if iteration_s == 0 or cal is None:
        return cost
    entries = {k: replace(p, overhead_s=p.overhead_s + iteration_s) for k, p in cal.entries.items()}
    return CostModel(calibration=Calibration(entries))


# --------------------------------------------------------------------- delivery


@dataclass(slots=True)
class Timeline:
    """One instance's iteration ends, in order, and whether it ran another
    iteration right after each (False: it went idle)."""

    ends: list[float]
    busy_after: list[bool]

    def add(self, t: float, busy: bool) -> None:
        self.ends.append(t)
        self.busy_after.append(busy)


def deliver(tl: Timeline, t: float, lag_iters: float) -> float:
    """When a token the instance produced at iteration end ``t`` reaches the client.

    ``lag_iters`` iterations later: the end of iteration ``j + lag`` when
    ``t`` is the end of iteration ``j`` (a fractional part interpolates
    linearly into the next iteration); at the end of the last iteration
    before the instance goes idle, if that comes first (the worker's poll
    answers at once when it stops stepping)::

        ends   t_j ──── t_j+1 ──── t_j+2 ──── t_j+3 (idle after)
        lag 1.5          └──── ▲ (t_j+1 + 0.5·(t_j+2 - t_j+1))
        lag 5                                 ▲ (idle first)

    A ``t`` that is not an iteration end of ``tl`` is delivered at ``t``.
    """
    if lag_iters <= 0:
        return t
    ends = tl.ends
    j = bisect.bisect_left(ends, t)
    if j >= len(ends) or ends[j] != t:
        return t
    whole = int(lag_iters)
    frac = lag_iters - whole
    for _ in range(whole):
        if not tl.busy_after[j] or j + 1 >= len(ends):
            return ends[j]
        j += 1
    if frac > 0 and tl.busy_after[j] and j + 1 < len(ends):
        return ends[j] + frac * (ends[j + 1] - ends[j])
    return ends[j]


def deliver_records(
    records: Sequence[RequestRecord], timelines: Mapping[int, Timeline], lag_iters: float
) -> None:
    """Move every record's first-token and finish times to when the client
    sees them (:func:`deliver` on the record's instance), in place.

    A migrated request's first token is looked up on its last instance's
    timeline (the simulator keeps only that one); when it is not there the
    time is left as it is.
    """
    if lag_iters <= 0:
        return
    for rec in records:
        tl = timelines.get(rec.instance) if rec.instance is not None else None
        if tl is None:
            continue
        if rec.first_token_s is not None:
            rec.first_token_s = deliver(tl, rec.first_token_s, lag_iters)
        if rec.finish_s is not None:
            rec.finish_s = max(deliver(tl, rec.finish_s, lag_iters), rec.first_token_s or 0.0)


# -------------------------------------------------------------------------- fit


ITERATION_GRID_S: tuple[float, ...] = tuple(i * 2e-4 for i in range(41))
"""``iteration_s`` candidates of :func:`fleetserve.experiments.fidelity.fit_overhead`:
0-8 ms in steps of 0.2 ms."""

LAG_GRID: tuple[float, ...] = tuple(i * 0.5 for i in range(33))
"""``delivery_iters`` candidates: 0-16 iterations in halves."""


@dataclass(frozen=True, slots=True)
class OverheadFit:
    """The fitted overhead and how well it reproduces the probes.

    Attributes:
        overhead: the fitted parameters.
        probes: how many probe requests it was fitted to.
        ttft_mean_abs_pct, tpot_mean_abs_pct: mean |relative error| of the
            simulated probes' TTFT and TPOT with the fitted parameters.
        engine_only_ttft_mean_abs_pct, engine_only_tpot_mean_abs_pct: the
            same with the overhead off.
    """

    overhead: RuntimeOverhead
    probes: int
    ttft_mean_abs_pct: float
    tpot_mean_abs_pct: float
    engine_only_ttft_mean_abs_pct: float
    engine_only_tpot_mean_abs_pct: float

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["overhead"] = self.overhead.to_dict()
        return out
