"""SeaLLM's adaptive replacement (§4.3, Equation 8) and the diff of two plans.

SeaLLM re-runs its placement search periodically on the requests of the last
interval and switches to the new plan. The interval adapts: before interval
``t`` the simulator estimates the plan's performance ``M_est`` on the history
of the last interval; at its end the real performance ``M_real`` is measured,
and::

    I_{t+1} = (1 - beta) * I_t    if |M_real - M_est| / M_est > beta
              (1 + beta) * I_t    if |M_real - M_est| / M_est < beta

(``beta = 0.1`` in the paper). A large gap means the traffic moved away from
the history: replace sooner. A small one: the traffic is stable, replace less
often.

Choices where the paper leaves details open (documented and tested):

* *The metric M* is the SLO attainment (the paper names SLO attainment and
  normalized performance; one number is needed for Equation 8).
* *Equality* ``|M_real - M_est| / M_est == beta`` (not covered by Equation 8)
  lengthens the interval, as the "<" case does.
* ``M_est == 0`` (the relative gap is undefined): the gap is taken as
  ``|M_real - M_est|`` (absolute), so a run that also reaches 0 lengthens.
* The interval is kept in ``[min_s, max_s]`` (defaults 10 s and 1 hour) so a
  long stretch of misestimates cannot drive it to zero, nor a calm one to
  infinity.

This module is pure policy: the simulator measures ``M_real``, runs the
search and models the cost of a switch (weight loading, moving the ongoing
requests after their current iteration).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.errors import ConfigError
from fleetserve.policy.groups import GroupPlacement, PlacementPlan

__all__ = ["AdaptiveInterval", "PlanDiff", "plan_diff"]


@dataclass(slots=True)
class AdaptiveInterval:
    """Equation 8 of SeaLLM: the next replacement interval.

    Attributes:
        interval_s: the current interval ``I_t`` (starts at ``I_0``).
        beta: the step, in (0, 1) (paper: 0.1).
        min_s, max_s: bounds of the interval.
    """

    interval_s: float
    beta: float = 0.1
    min_s: float = 10.0
    max_s: float = 3600.0

    def __post_init__(self) -> None:
        if not 0.0 < self.beta < 1.0:
            raise ConfigError(f"replacement beta must be in (0, 1), got {self.beta}")
        if not 0.0 < self.min_s <= self.max_s:
            raise ConfigError(
                f"replacement interval bounds need 0 < min_s <= max_s, got {self.min_s}, "
                f"{self.max_s}"
            )
        if not self.min_s <= self.interval_s <= self.max_s:
            raise ConfigError(
                f"initial replacement interval {self.interval_s} s is outside "
                f"[{self.min_s}, {self.max_s}] s"
            )

    @staticmethod
    def gap(m_real: float, m_est: float) -> float:
        """Relative gap ``|M_real - M_est| / M_est`` (absolute when ``M_est == 0``)."""
        d = abs(m_real - m_est)
        return d / m_est if m_est > 0 else d

    def update(self, m_real: float, m_est: float) -> float:
        """Apply Equation 8 and return the new interval ``I_{t+1}``."""
        if self.gap(m_real, m_est) > self.beta:
            nxt = (1.0 - self.beta) * self.interval_s
        else:
            nxt = (1.0 + self.beta) * self.interval_s
        self.interval_s = min(self.max_s, max(self.min_s, nxt))
        return self.interval_s


@dataclass(frozen=True, slots=True)
class PlanDiff:
    """What changes between two plans.

    Attributes:
        kept: groups present, identical (GPUs, TP, services), in both.
        removed: groups of the old plan that stop.
        added: groups of the new plan that start (their weights must load).
    """

    kept: tuple[GroupPlacement, ...]
    removed: tuple[GroupPlacement, ...]
    added: tuple[GroupPlacement, ...]

    @property
    def unchanged(self) -> bool:
        return not self.removed and not self.added


def _key(g: GroupPlacement) -> tuple[tuple[int, ...], int, tuple[str, ...]]:
    return (tuple(sorted(g.gpus)), g.tp, tuple(sorted(g.services)))


def plan_diff(old: PlacementPlan, new: PlacementPlan) -> PlanDiff:
    """Groups kept, removed and added from ``old`` to ``new``.

    A group is *kept* only if the new plan has one on exactly the same GPUs,
    with the same TP degree and the same services: anything else reloads.
    """
    new_keys = {_key(g): g for g in new.groups}
    old_keys = {_key(g): g for g in old.groups}
    kept = tuple(g for g in old.groups if _key(g) in new_keys)
    removed = tuple(g for g in old.groups if _key(g) not in new_keys)
    added = tuple(g for g in new.groups if _key(g) not in old_keys)
    return PlanDiff(kept, removed, added)
