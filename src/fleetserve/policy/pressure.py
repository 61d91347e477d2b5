"""The memory-pressure (burst) family: what a deployment of replicas does when
its KV memory runs short, and KunServe's knobs.

:class:`KunSettings` is one stack's choice of this family (its ``burst``
field in :data:`~fleetserve.policy.catalog.STACKS`): the KunServe simulator
(:mod:`fleetserve.sim.kun`) applies it, and :meth:`KunSettings.policy` builds
the pure :class:`~fleetserve.policy.kunserve.KunServePolicy` that makes
KunServe's drop/restore decisions from it (in the simulator and in the
runtime's controller, :mod:`fleetserve.runtime.kun_control`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fleetserve.errors import ConfigError
from fleetserve.policy.kunserve import KunServePolicy

if TYPE_CHECKING:
    from fleetserve.spec import ModelSpec

__all__ = ["PRESSURES", "KunSettings"]

PRESSURES = ("queue", "kv-drop", "kv-swap", "llumnix", "kunserve")


@dataclass(frozen=True, slots=True)
class KunSettings:
    """How a replicated deployment reacts to memory throttling.

    Attributes:
        pressure: ``queue`` (vLLM: new requests wait until memory frees),
            ``kv-drop`` (drop running requests' KV, newest first, to admit the
            head of the queue; they are recomputed later), ``kv-swap`` (swap
            running requests' KV to host memory one at a time over PCIe, as
            vLLM's default swap space does), ``llumnix`` (live KV migration
            from loaded to spare instances) or ``kunserve`` (drop replicated
            layers into buddy groups).
        static_stages: group size formed at start and never changed (the
            static pipeline baseline, ``Llumnix (pipeline)``); 1 = replicas.
        exchange: ``live`` (victims keep decoding with remote attention while
            their KV crosses) or ``blocking`` (they stall until it has).
        live_restore: move pipelined requests back to full instances with
            live KV migration when parameters are restored; without it a
            restored group keeps pipelining until its requests finish.
        strategy: buddy-group planner, ``throughput`` (Algorithm 1) or ``memory``.
        horizon_s: the trigger's look-ahead (the paper: one second).
        window_s: samples the monitor fits the growth rates to.
        monitor_interval_s: how often the monitor samples and decides.
        restore_threshold: restore a group when its KV demand is at most this
            share of the KV capacity its members have as full replicas.
        restore_min_s: a group restores once its demand has stayed below the
            threshold this long (hysteresis: a drop answers a predicted
            shortage, so the demand right after it may still be low, and a
            dip in a burst should not undo it).
        restore_from: ``host`` (PCIe from the host copy) or ``peer`` (network).
        max_batch_slowdown: the dispatcher's maximum batch per instance is the
            largest batch whose decode iteration is at most this many times
            the batch-1 iteration (from the cost model).
        swap_max_out: ``kv-swap``: requests an instance may have swapped out
            at once (vLLM swaps "a small number of requests, default 1").
    """

    pressure: str = "queue"
    static_stages: int = 1
    exchange: str = "live"
    live_restore: bool = True
    strategy: str = "throughput"
    horizon_s: float = 1.0
    window_s: float = 1.0
    monitor_interval_s: float = 0.1
    restore_threshold: float = 0.5
    restore_min_s: float = 20.0
    restore_from: str = "host"
    max_batch_slowdown: float = 2.0
    swap_max_out: int = 1

    def __post_init__(self) -> None:
        if self.pressure not in PRESSURES:
            raise ConfigError(
                f"kunserve.pressure must be one of {PRESSURES}, got {self.pressure!r}"
            )
        if self.exchange not in ("live", "blocking"):
            raise ConfigError(f"kunserve.exchange must be live or blocking, got {self.exchange!r}")
        if self.strategy not in ("throughput", "memory"):
            raise ConfigError(
                f"kunserve.strategy must be throughput or memory, got {self.strategy!r}"
            )
        if self.restore_from not in ("host", "peer"):
            raise ConfigError(
                f"kunserve.restore_from must be host or peer, got {self.restore_from!r}"
            )
        if isinstance(self.static_stages, bool) or self.static_stages < 1:
            raise ConfigError(f"kunserve.static_stages must be >= 1, got {self.static_stages!r}")
        for name in ("horizon_s", "window_s", "monitor_interval_s", "max_batch_slowdown"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and v > 0):
                raise ConfigError(f"kunserve.{name} must be a number > 0, got {v!r}")
        if isinstance(self.swap_max_out, bool) or self.swap_max_out < 1:
            raise ConfigError(f"kunserve.swap_max_out must be >= 1, got {self.swap_max_out!r}")
        if self.max_batch_slowdown < 1:
            raise ConfigError("kunserve.max_batch_slowdown must be >= 1")
        if not 0 < self.restore_threshold <= 1:
            raise ConfigError(
                f"kunserve.restore_threshold must be in (0, 1], got {self.restore_threshold!r}"
            )
        v = self.restore_min_s
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise ConfigError(f"kunserve.restore_min_s must be a number >= 0, got {v!r}")

    def with_overrides(self, **kw: Any) -> KunSettings:
        """A copy with some fields replaced (validated)."""
        return replace(self, **kw)

    def policy(self, model: ModelSpec) -> KunServePolicy:
        """KunServe's decision policy for replicas of ``model`` under these settings.

        The policy's knobs are ``strategy``, ``horizon_s``, ``window_s``,
        ``restore_threshold``, ``restore_min_s`` and ``restore_from``; the rest
        (exchange mode, live restore, batch limits, the baselines' pressure)
        is mechanism the simulator applies. ``P`` is every layer's weights
        (the non-layer weights are never dropped).
        """
        return self.policy_for(
            model.name,
            model.num_layers,
            model.num_layers * model.weight_bytes_per_layer,
            model.kv_bytes_per_token,
        )

    def policy_for(
        self, model: str, num_layers: int, param_bytes: int, kv_bytes_per_token: int
    ) -> KunServePolicy:
        """:meth:`policy` for a model given by its sizes (the runtime's engines
        measure theirs: layers rounded to arena pages)."""
        return KunServePolicy(
            model=model,
            num_layers=num_layers,
            param_bytes=param_bytes,
            kv_bytes_per_token=kv_bytes_per_token,
            strategy=self.strategy,
            horizon_s=self.horizon_s,
            window_s=self.window_s,
            restore_threshold=self.restore_threshold,
            restore_min_s=self.restore_min_s,
            restore_from=self.restore_from,
        )
