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
    """Activate ``tp`` idle GPUs, start an instance of ``model`` on them, and
    dispatch ``request_id`` to it (the elastic pool's "nothing fits" path)."""

    model: str
    tp: int
    request_id: int


@dataclass(frozen=True, slots=True)
class ReleaseGpu:
    """Stop instance ``instance_id`` and return its GPUs to the idle pool.

    Only valid for an instance with no running or waiting request.
    """

    instance_id: int


DispatchAction = Dispatch | Reject | ActivateGpu
Action = Dispatch | Reject | ActivateGpu | ReleaseGpu
