"""The memory-pressure (burst) family: what a deployment of replicas does when
its KV memory runs short, and KunServe's knobs.

:class:`KunSettings` is one stack's choice of this family (its ``burst``
field in :data:`~fleetserve.policy.catalog.STACKS`): the KunServe simulator
(:mod:`fleetserve.sim.kun`) applies it, and :meth:`KunSettings.policy` builds
the pure :class:`~fleetserve.policy.kunserve.KunServePolicy` that makes
KunServe's drop/restore decisions from it (in the simulator and in the
runtime's controller, :mod:`fleetserve.runtime.kun_control`).

:class:`PressureReaction` is the rest of the family's decisions, the
baselines' (vLLM's recompute, ``kv-drop``, ``kv-swap``): what an executor does
when the queue's head does not fit, when the next decode token does not fit,
and when a swapped-out request comes back. It is pure (no clock, no
randomness): a backend shows it a :class:`PressureView` and applies the
:data:`~fleetserve.policy.actions.PressureAction` it returns; the victim is
the batching policy's (passed in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fleetserve.cluster.state import SeqView
from fleetserve.errors import ConfigError
from fleetserve.policy.actions import DropKV, Preempt, SwapIn, SwapOut
from fleetserve.policy.kunserve import KunServePolicy

if TYPE_CHECKING:
    from fleetserve.spec import ModelSpec

__all__ = ["PRESSURES", "KunSettings", "PressureReaction", "PressureView"]

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


Victim = Callable[[list[SeqView]], SeqView]
"""The batching policy's victim among candidates (the newest, for FCFS)."""


@dataclass(frozen=True, slots=True)
class PressureView:
    """One executor as :class:`PressureReaction` reads it (KV in tokens).

    Attributes:
        room_tokens: KV tokens free above the admission watermark.
        head_tokens: what the head of the queue needs (0: empty queue).
        running: the running requests, in the executor's order.
        swapped: requests swapped out to host memory, oldest first (ids).
        swapped_tokens: the KV tokens of each, same order.
        swap_out_busy: a swap-out is in flight.
        swap_in_busy: a swap-in is in flight.
    """

    room_tokens: int
    head_tokens: int
    running: Sequence[SeqView]
    swapped: tuple[int, ...] = ()
    swapped_tokens: tuple[int, ...] = ()
    swap_out_busy: bool = False
    swap_in_busy: bool = False


class PressureReaction:
    """The baselines' reactions to a KV shortage (module docstring).

    ``queue``, ``llumnix`` and ``kunserve`` preempt (recompute) when a decode
    token does not fit, and leave a blocked queue head waiting (Llumnix and
    KunServe act on memory in their own periodic decisions). ``kv-drop``
    frees running requests' KV until the head fits, each request at most
    once (one dropped again and again would never finish; real systems bound
    this too: an implementer's choice). ``kv-swap`` swaps a victim out instead
    of recomputing it, one swap-out at a time and at most ``swap_max_out``
    requests out (or on their way in or out) per executor, and swaps the
    oldest back in when its KV fits and the queue's head does not.

    Args:
        settings: the stack's memory-pressure settings.
    """

    def __init__(self, settings: KunSettings) -> None:
        self.settings = settings
        self._dropped: set[int] = set()

    @property
    def dropped_ids(self) -> frozenset[int]:
        """Requests whose KV ``kv-drop`` has dropped (each at most once)."""
        return frozenset(self._dropped)

    def may_swap_out(self, view: PressureView) -> bool:
        """``kv-swap``: one swap-out at a time, at most ``swap_max_out`` out."""
        out = len(view.swapped) + view.swap_out_busy + view.swap_in_busy
        return not view.swap_out_busy and out < self.settings.swap_max_out

    def head_blocked(self, view: PressureView, victim: Victim) -> DropKV | SwapOut | None:
        """The queue's head has a batch slot but not the memory, and requests
        are running: one step of the reaction (None: the head waits). A
        backend applies the action and asks again while it gets ``DropKV``."""
        pressure = self.settings.pressure
        if pressure == "kv-drop":
            if view.room_tokens >= view.head_tokens:
                return None
            cands = [s for s in view.running if s.id not in self._dropped]
            if not cands:
                return None
            v = victim(cands)
            self._dropped.add(v.id)
            return DropKV(v.id)
        if pressure == "kv-swap" and self.may_swap_out(view):
            return SwapOut(victim(list(view.running)).id)
        return None

    def decode_short(self, view: PressureView, victim: Victim) -> Preempt | SwapOut | None:
        """The next decode token of every running request does not fit: free
        a victim (None: wait for the swap-out in flight to free memory)."""
        v = victim(list(view.running))
        if self.settings.pressure == "kv-swap":
            if self.may_swap_out(view):
                return SwapOut(v.id)
            if view.swap_out_busy:
                return None
        return Preempt(v.id)

    def swap_in(self, view: PressureView) -> SwapIn | None:
        """``kv-swap``, before a decode iteration: bring the oldest swapped-out
        request back when its KV fits and the queue's head does not (a head
        that fits is admitted first: swapping exists to admit it)."""
        if self.settings.pressure != "kv-swap" or view.swap_in_busy or not view.swapped:
            return None
        if view.head_tokens and view.head_tokens <= view.room_tokens:
            return None
        if view.swapped_tokens[0] > view.room_tokens:
            return None
        return SwapIn(view.swapped[0])
