"""Typed actions a policy returns and a backend (simulator or runtime) applies.

Policies never mutate state: they read a :class:`~fleetserve.cluster.state.ClusterState`
and return these frozen records. Later families add their own action types here
(``Migrate``, ``DropLayers``, ``Restore``, ...) together with the backend code
that applies them.
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


DispatchAction = Dispatch | Reject | ActivateGpu | Defer
Action = Dispatch | Reject | ActivateGpu | ReleaseGpu | Defer | Migrate
