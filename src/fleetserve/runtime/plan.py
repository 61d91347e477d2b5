"""Which models each runtime worker hosts (torch-free, so the simulator's
fidelity runs can place the emulated cluster exactly as ``serve`` does)."""

from __future__ import annotations

from collections.abc import Sequence

from fleetserve.config import SimConfig
from fleetserve.errors import ConfigError
from fleetserve.policy.base import PLACEMENT
from fleetserve.sim.simulator import resolve_policies


def plan_workers(config: SimConfig, models: Sequence[str]) -> list[tuple[str, ...]]:
    """The models each worker hosts, from the ``placement`` policy.

    A fixed pool (``cluster.elastic: false``, the default for ``serve``) asks
    the placement policy for one instance per worker, with the models' rates
    from ``workload.model_weights`` (equal when unset). An elastic pool
    (Mell) loads its single model on every worker; workers become active
    when a policy activates them.
    """
    n = config.serve.workers
    if config.cluster.elastic:
        if len(models) != 1:
            raise ConfigError(
                "an elastic runtime pool (cluster.elastic: true) serves one model; "
                f"serve.models has {len(models)}"
            )
        return [tuple(models)] * n
    wl = config.workload
    rates = dict.fromkeys(models, 1.0)
    if wl.models is not None and wl.model_weights is not None:
        for m, wgt in zip(wl.models, wl.model_weights, strict=True):
            if m in rates:
                rates[m] = float(wgt)
    names = resolve_policies(config)
    placed = (
        PLACEMENT.get(names["placement"])
        .from_config(config)
        .place(rates, n, dict.fromkeys(models, 1))
    )
    if len(placed) > n:
        raise ConfigError(f"placement gave {len(placed)} instances for {n} workers")
    return [(m,) for m in placed]
