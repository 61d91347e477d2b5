"""Typed actions a policy returns and a backend (simulator or runtime) applies.

Policies never mutate state: they read a :class:`~fleetserve.cluster.state.ClusterState`
and return these frozen records. Later families add their own action types here
(``Migrate``, ``DropLayers``, ``Restore``, ...) together with the backend code
that applies them.

Layer ranges are half-open ``(lo, hi)`` pairs of layer indices ``lo..hi-1``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Queue request ``request_id`` on instance ``instance_id``."""

    request_id: int
    instance_id: int


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse request ``request_id``; it ends in state ``rejected`` with ``reason``."""

    request_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class ActivateGpu:
    """Activate ``tp`` idle GPUs and start an instance of ``model`` on them.

    From a dispatch policy, ``request_id`` is dispatched to the new instance
    (the elastic pool's "nothing fits" path). In a migration policy's plan,
    ``request_id`` may be None and ``ref`` (a negative number, unique within
    the plan) names the new instance: later actions of the same plan may use
    ``ref`` wherever they take an instance id, and the backend then calls
    ``MigrationPolicy.bind(ref, instance_id)`` with the real id.
    """

    model: str
    tp: int
    request_id: int | None = None
    ref: int | None = None


@dataclass(frozen=True, slots=True)
class ReleaseGpu:
    """Stop instance ``instance_id`` and return its GPUs to the idle pool.

    Only valid for an instance with no running or waiting request.
    """

    instance_id: int


@dataclass(frozen=True, slots=True)
class Defer:
    """Hold request ``request_id`` at the controller; a later plan of the
    migration policy dispatches it (Mell allocates arrivals once per epoch)."""

    request_id: int


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move request ``request_id`` (wherever it is now) to instance ``dst``.

    ``dst`` is an instance id, or the ``ref`` of an :class:`ActivateGpu`
    earlier in the same plan. ``mode`` is ``"kv"`` (live KV transfer),
    ``"token"`` (send token ids, re-prefill at the destination) or None: the
    configured migration mechanism decides (and may defer the move to a later
    epoch). Moves of one request are executed in the order they were planned.
    """

    request_id: int
    dst: int
    mode: str | None = None


@dataclass(frozen=True, slots=True)
class DropLayers:
    """Merge executors ``sources`` into one buddy group of ``model`` (KunServe §4.1).

    The group runs as a ``len(members)``-stage pipeline; ``members`` lists its
    instance ids in stage order and ``keep[i]`` is the half-open layer range
    member ``i`` keeps (the ranges tile ``0..num_layers``: one complete copy
    of the parameters per group). ``drop[i]`` lists the ranges member ``i``
    frees now (what it held outside ``keep[i]``; empty when it keeps all it
    held). A backend applies the plan once every source executor has reached
    an iteration boundary, moving the running requests' KV cache to the
    stages that now own their layers (§4.2, live KV exchange)::

        members  a           b           c
        keep     [0, 16)     [16, 32)    [32, 48)      48 layers, 3 stages
        drop     [16, 48)    [0, 16),    [0, 32)
                             [32, 48)
    """

    model: str
    num_layers: int
    sources: tuple[int, ...]
    members: tuple[int, ...]
    keep: tuple[tuple[int, int], ...]
    drop: tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True, slots=True)
class Restore:
    """Dissolve buddy group ``executor`` back into full replicas (KunServe §4.2).

    Each member ``members[i]`` reloads the layer ranges ``reload[i]`` (what
    it dropped) from ``source``: ``"host"`` (its host-memory copy over PCIe)
    or ``"peer"`` (another instance over the network). The group stops
    taking new requests while it reloads; a backend with live restore then
    splits it and moves its running requests' KV to the new replicas.
    """

    executor: int
    model: str
    members: tuple[int, ...]
    reload: tuple[tuple[tuple[int, int], ...], ...]
    source: str


@dataclass(frozen=True, slots=True)
class ActivateSpare:
    """Start one more replica of ``model`` (KunServe's §4.3 autoscaling fallback).

    Returned when dropping parameters cannot free the ``shortfall_bytes`` the
    monitor asks for. The backend starts a spare instance (weights loaded from
    host memory) if it has one idle and none is already starting; otherwise
    it ignores the action (the policy asks again while the shortage lasts).
    """

    model: str
    shortfall_bytes: int


@dataclass(frozen=True, slots=True)
class Preempt:
    """Free running request ``request_id``'s KV; it is recomputed later, from
    the head of its queue (vLLM's recompute preemption)."""

    request_id: int


@dataclass(frozen=True, slots=True)
class DropKV:
    """Free running request ``request_id``'s KV to admit the queue's head; it
    goes to the tail of the queue and is recomputed (KunServe's ``kv-drop``
    baseline)."""

    request_id: int


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Copy running request ``request_id``'s KV to host memory and free it on
    the GPU (vLLM's swap preemption, KunServe's ``kv-swap`` baseline)."""

    request_id: int


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Copy swapped-out request ``request_id``'s KV back; it runs again once
    the copy is in."""

    request_id: int


PressureAction = Preempt | DropKV | SwapOut | SwapIn
DispatchAction = Dispatch | Reject | ActivateGpu | Defer
KunAction = DropLayers | Restore | ActivateSpare
Action = (
    Dispatch
    | Reject
    | ActivateGpu
    | ReleaseGpu
    | Defer
    | Migrate
    | DropLayers
    | Restore
    | ActivateSpare
    | Preempt
    | DropKV
    | SwapOut
    | SwapIn
)
