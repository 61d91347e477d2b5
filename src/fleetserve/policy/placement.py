"""Initial placement of models on a fixed pool (the ``placement`` family)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fleetserve.errors import ConfigError
from fleetserve.policy.base import PLACEMENT, PlacementPolicy


def dedicated_counts(
    rates: Mapping[str, float], fits: Callable[[Mapping[str, int]], bool]
) -> dict[str, int]:
    """vLLM's spatial partition by rate, the one rule of both worlds' ``dedicated``
    placement: every model starts with one instance; then, while one more fits
    (``fits(counts)``), the model with the highest rate per instance gets it
    (ties: the model name first), and when it does not fit, the next one tries.
    The caller checks that one instance of each fits."""
    names = sorted(rates)
    count = dict.fromkeys(names, 1)
    while True:
        for m in sorted(names, key=lambda m: (-rates[m] / count[m], m)):
            count[m] += 1
            if fits(count):
                break
            count[m] -= 1
        else:
            return count


@PLACEMENT.register("dedicated")
class Dedicated(PlacementPolicy):
    """vLLM-style spatial partitioning: each model on its own GPUs, split by rate.

    Every model gets one instance first; the remaining GPUs go one instance at
    a time to the model with the highest rate per instance (ties: model name),
    which splits the pool in proportion to the rates as closely as whole
    instances allow.
    """

    def place(self, rates: dict[str, float], n_gpus: int, tp: dict[str, int]) -> list[str]:
        models = sorted(rates)
        need = sum(tp[m] for m in models)
        if need > n_gpus:
            raise ConfigError(
                f"placement 'dedicated' needs at least {need} GPUs for one instance of each of "
                f"{len(models)} models, the pool has {n_gpus}"
            )
        count = dedicated_counts(rates, lambda c: sum(tp[m] * n for m, n in c.items()) <= n_gpus)
        return [m for m in models for _ in range(count[m])]
