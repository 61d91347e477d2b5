"""Initial placement of models on a fixed pool (the ``placement`` family)."""

from __future__ import annotations

from fleetserve.errors import ConfigError
from fleetserve.policy.base import PLACEMENT, PlacementPolicy


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
        count = dict.fromkeys(models, 1)
        left = n_gpus - need
        while True:
            cands = [m for m in models if tp[m] <= left]
            if not cands:
                break
            m = max(cands, key=lambda m: (rates[m] / count[m], -models.index(m)))
            count[m] += 1
            left -= tp[m]
        return [m for m in models for _ in range(count[m])]
