r"""Memory-bandwidth contention between jobs running at once on one GPU group.

MuxServe's spatial sharing runs jobs of several models at once, each on a
share of the compute units (SMs). The roofline cost model divides a job's
compute term by its share, but the GPUs' memory bandwidth is not partitioned
by SMs: concurrent jobs also *share* it. This module is how a sharing group
(:class:`~fleetserve.sim.group.SharingGroup`) accounts for that.

Model (fluid, piecewise constant between job starts and ends). Job ``j``
alone on its compute share would take ``T_j`` (the cost model's time: fixed
terms + ``max(compute / share, memory)``) and move ``M_j`` seconds' worth of
HBM traffic (its memory term at full bandwidth), so alone it uses the
fraction ``u_j = M_j / T_j`` of the bandwidth on average. While the jobs in
flight ask for more than the whole bandwidth (``sum u_j > 1``), the bandwidth
is divided max-min fairly (:func:`bandwidth_shares`: water-filling, every job
gets at most what it asks), and a job that gets ``b_j < u_j`` progresses at
``b_j / u_j`` of its alone speed. Each start or end of a job re-times the
others.

Limiting cases (tested): a job alone takes exactly ``T_j`` (today's time);
``k`` equal memory-bound jobs (``u ~ 1``) started together each get ``1/k``
of the bandwidth and take ``k u T`` (about ``k`` times as long: the memory
traffic of all ``k`` goes through one memory system); a compute-bound
prefill (small ``u``) beside a decode barely slows it. Simplifications: a
job's bandwidth use is spread evenly over its duration (its fixed launch and
collective terms included), and compute is not contended beyond the shares
(the scheduler keeps the shares' sum at most 1).

KV copies beside iterations (:func:`beside_copies`). A migration's KV copy
reads the source GPUs' HBM and writes the destination's at its link's rate
while both keep running iterations (Llumnix's live stages, Mell's moves).
The single-model simulator (:mod:`fleetserve.sim.migration`) keeps, per
instance, the HBM fraction its copies in flight ask for, and an iteration
planned while copies run is stretched by the same max-min division
(limiting cases tested: no copy = the cost model's time; a memory-bound
decode beside a copy at fraction ``c`` takes ``1 / (1 - c)`` as long; a
compute-bound one is unchanged). A change of the copies re-plans the decode
segment at the iteration in flight (that iteration keeps its time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "WAITING_WEIGHT",
    "BandwidthSharing",
    "bandwidth_shares",
    "beside_copies",
    "decode_weight",
]

WAITING_WEIGHT = 1e-3
"""A pipeline's decode round's weight while every virtual engine prefills."""


def decode_weight(stages: int, lanes: int) -> float:
    """The weight of a ``stages``-stage pipeline's decode round in the division
    of its stages' time (:class:`BandwidthSharing`, weighted) while ``lanes``
    prefill micro-batches run beside it, each weighing one: the virtual
    engines not prefilling (vLLM's pipeline-parallel engine runs one
    micro-batch per virtual engine); with every engine prefilling the
    decodes wait (:data:`WAITING_WEIGHT`, vLLM's prefill-first engines)."""
    return max(float(stages - lanes), WAITING_WEIGHT)


def beside_copies(times: Any, memory_s: Any, copy_load: float) -> Any:
    """Times of iterations that run while KV copies stream through the same
    GPUs' memory (a migration's stages beside the decoding it serves).

    An iteration alone takes ``times`` and moves ``memory_s`` seconds' worth
    of HBM traffic (at full bandwidth), so it asks for ``u = memory_s / times``
    of the bandwidth; the copies in flight ask for ``copy_load`` (each: its
    link's bandwidth over the GPU's HBM bandwidth, read on the source, written
    on the destination). Max-min division between the two (the copies lumped
    as one job): when ``u + copy_load <= 1`` nothing changes; otherwise the
    iteration gets ``b = max(1 - copy_load, min(u, 1/2))`` and takes
    ``times * u / b``. The copies are link-bound and get their demand while it
    is at most half the bandwidth (every catalog GPU: NVLink or network over
    HBM is at most 0.19), so their transfer times are not stretched.
    Elementwise over arrays; ``copy_load`` 0 returns ``times`` unchanged.
    """
    if copy_load <= 0.0:
        return times
    u = memory_s / times
    b = np.maximum(1.0 - copy_load, np.minimum(u, 0.5))
    return np.where(u + copy_load <= 1.0, times, times * u / b)


_EPS = 1e-12
_MIN_SPEED = 1e-6  # a job given (almost) nothing crawls until the next re-timing


def bandwidth_shares(
    demands: Sequence[float], capacity: float = 1.0, weights: Sequence[float] | None = None
) -> list[float]:
    """Max-min fair division of ``capacity`` among ``demands`` (water-filling).

    Every job gets at most its demand; when the demands exceed the capacity,
    the smallest are met in full and the rest split what is left equally --
    or, with ``weights``, in proportion to their weights (weighted max-min:
    a job whose demand per unit of weight is smallest is met first).

    Raises:
        ValueError: a negative demand or capacity, or a weight that is not > 0.
    """
    if capacity < 0 or any(d < 0 for d in demands):
        raise ValueError(f"demands and capacity must be >= 0, got {list(demands)}, {capacity}")
    if weights is not None and (len(weights) != len(demands) or any(not w > 0 for w in weights)):
        raise ValueError(f"weights must be > 0, one per demand, got {list(weights)}")
    return _fill(demands, capacity, weights)


def _fill(
    demands: Sequence[float], capacity: float, weights: Sequence[float] | None
) -> list[float]:
    """:func:`bandwidth_shares` of checked arguments (:meth:`BandwidthSharing.retime`'s)."""
    if sum(demands) <= capacity:
        return [float(d) for d in demands]
    if weights is not None:
        out_w = [0.0] * len(demands)
        left = capacity
        total = float(sum(weights))
        ratio = [d / w for d, w in zip(demands, weights, strict=True)]
        for i in sorted(range(len(demands)), key=ratio.__getitem__):  # (stable: ties by index)
            w = weights[i]
            d = float(demands[i])
            level = left * w / total
            got = level if level < d else d  # min(d, level)
            out_w[i] = got
            left -= got
            total -= w
        return out_w
    out = [0.0] * len(demands)
    left = capacity
    order = sorted(range(len(demands)), key=lambda i: demands[i])
    for n, i in enumerate(order):
        level = left / (len(order) - n)
        got = min(float(demands[i]), level)
        out[i] = got
        left -= got
    return out


@dataclass(slots=True)
class _Job:
    remaining: float  # seconds of work left at its alone speed
    use: float  # u_j, average bandwidth fraction alone
    slow: float  # its speed now, as a fraction of its alone speed
    since: float  # when ``remaining`` was last brought up to date
    end: float  # the end time it was last given
    weight: float = 1.0  # its weight in the (weighted) max-min division


class BandwidthSharing:
    """The jobs in flight on one group and their progress (module docstring).

    Keys are the group's job tokens. :meth:`retime` brings every job's
    progress up to ``now``, recomputes the shares, and returns the jobs whose
    end time changed. A job whose speed does not change keeps its end time
    exactly (so a job that is never slowed ends exactly ``T_j`` after its
    start, as without contention).
    """

    def __init__(self) -> None:
        self._jobs: dict[int, _Job] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def tokens(self) -> set[int]:
        """The tokens of the jobs in flight."""
        return set(self._jobs)

    def add(
        self, token: int, now: float, alone_s: float, memory_s: float, weight: float = 1.0
    ) -> None:
        """A job starts: ``alone_s`` its time alone, ``memory_s`` its HBM traffic
        (or, for a pipeline's stages, its busiest stage's busy time), ``weight``
        its weight in the division (1: plain max-min)."""
        use = min(1.0, memory_s / alone_s) if alone_s > 0 else 0.0
        self._jobs[token] = _Job(alone_s, use, 1.0, now, now + alone_s, weight)

    def set_weight(self, token: int, weight: float) -> None:
        """Change job ``token``'s weight (takes effect at the next :meth:`retime`)."""
        self._jobs[token].weight = weight

    def remove(self, token: int) -> None:
        """A job ended (or was cancelled)."""
        self._jobs.pop(token, None)

    def rekey(self, old: int, new: int) -> None:
        """The group gave job ``old`` a new token."""
        self._jobs[new] = self._jobs.pop(old)

    def end_of(self, token: int) -> float:
        """The end time job ``token`` was last given."""
        return self._jobs[token].end

    def slowdown(self, token: int) -> float:
        """Job ``token``'s speed now as a fraction of its speed alone."""
        return self._jobs[token].slow

    def retime(self, now: float) -> dict[int, float]:
        """Progress to ``now``, new shares; ``{token: new end}`` of the jobs
        whose speed (hence end time) changed."""
        jobs = self._jobs
        vals = list(jobs.values())
        uses = [j.use for j in vals]
        if sum(uses) <= 1.0 and all(j.slow == 1.0 for j in vals):
            # nobody is slowed, nor will be: progress only, nothing re-timed
            for j in vals:
                j.remaining = max(0.0, j.remaining - (now - j.since))
                j.since = now
            return {}
        weights = [j.weight for j in vals]
        got = _fill(uses, 1.0, None if all(w == 1.0 for w in weights) else weights)
        out: dict[int, float] = {}
        for k, j, b in zip(jobs, vals, got, strict=True):
            use = j.use
            old = j.slow
            j.remaining = rem = max(0.0, j.remaining - (now - j.since) * old)
            j.since = now
            slow = 1.0 if use <= _EPS or b >= use - _EPS else max(b / use, _MIN_SPEED)
            if slow != old:
                j.slow = slow
                j.end = end = now + rem / slow
                out[k] = end
        return out
