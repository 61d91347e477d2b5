"""Policy families: abstract base classes and their registries.

Every policy is pure: it reads the state it is given, and ``now`` and a seeded
``numpy.random.Generator`` are passed in. It never reads a clock, sleeps,
touches tensors or calls Ray, so the simulator and the runtime can share it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from fleetserve.cluster.state import ClusterState, InstanceView, SeqView
from fleetserve.policy.actions import DispatchAction, ReleaseGpu
from fleetserve.policy.registry import Registry
from fleetserve.workload.request import Request

if TYPE_CHECKING:
    from fleetserve.config import SimConfig


class Policy(ABC):  # noqa: B024 - shared constructor, no abstract method of its own
    """What every policy family shares: no parameters unless a subclass takes
    them, and construction from a run's config."""

    def __init__(self, **params: Any) -> None:
        if params:
            raise TypeError(f"{type(self).__name__} takes no parameters, got {sorted(params)}")

    @classmethod
    def from_config(cls, config: SimConfig) -> Self:
        """An instance with the parameters ``config`` sets for it (default: none)."""
        return cls()


class DispatchPolicy(Policy):
    """Chooses the instance for each arriving request (or activates one, or rejects)."""

    @abstractmethod
    def dispatch(
        self, state: ClusterState, req: Request, now: float, rng: np.random.Generator
    ) -> DispatchAction:
        """Decide where ``req`` goes."""


class AdmissionBudget(ABC):
    """Mechanism-side check/commit pair for admitting waiting requests to a batch.

    The backend implements it from its memory and batch limits; a batching
    policy calls ``fits`` and then ``take`` for each request it wants to admit.
    """

    @abstractmethod
    def fits(self, seq: SeqView) -> bool:
        """Whether ``seq`` can join the next batch given what was taken so far."""

    @abstractmethod
    def take(self, seq: SeqView) -> None:
        """Commit ``seq`` to the next batch (call only after ``fits`` said yes)."""


class BatchingPolicy(ABC):
    """What a one-model instance (the single-model and KunServe simulators,
    the runtime's engine) asks its batching policy: whom to admit from the
    waiting queue and whom to preempt when the KV cache runs out. The
    policies themselves are the catalog's group schedulers
    (:data:`fleetserve.policy.sharing.BATCHING`), run through
    :class:`fleetserve.policy.batching.OneModel`.

    Attributes:
        macro_step_safe: True when the policy's decisions depend only on the
            queue order and on free memory (which only shrinks while a fixed
            batch decodes), so the backend may advance several decode
            iterations in one step. Policies whose priorities change with time
            or with iterations (MLFQ, DB) must leave it False.
    """

    macro_step_safe: bool = False

    @abstractmethod
    def admit(
        self, inst: InstanceView, waiting: Sequence[SeqView], budget: AdmissionBudget
    ) -> list[SeqView]:
        """Requests from ``waiting`` (queue order) to prefill in the next iteration."""

    @abstractmethod
    def victim(self, inst: InstanceView, running: Sequence[SeqView]) -> SeqView:
        """The running request to preempt (recompute) when memory runs out."""


class MemoryPolicy(Policy):
    """GPU-pool and memory management: here, when to release idle instances."""

    @abstractmethod
    def on_idle(self, state: ClusterState, inst: InstanceView, now: float) -> list[ReleaseGpu]:
        """Called when ``inst`` has just become idle (no running or waiting request)."""


class PlacementPolicy(Policy):
    """Initial placement of models on a fixed GPU pool."""

    @abstractmethod
    def place(self, rates: dict[str, float], n_gpus: int, tp: dict[str, int]) -> list[str]:
        """Models of the instances to start, one entry per instance.

        Args:
            rates: request rate of each model (req/s) in the workload.
            n_gpus: GPUs in the pool.
            tp: tensor-parallel degree of each model's instances.
        """


class MigrationPolicy(Policy):
    """Periodic re-planning of where running requests live (Llumnix, Mell).

    The backend calls :meth:`plan` every ``interval_s`` seconds of its clock
    (one scheduling *epoch*) and applies the returned actions in order:
    ``ActivateGpu`` (with a ``ref``), ``Dispatch`` (of requests a dispatch
    policy deferred), ``Migrate`` and ``ReleaseGpu``. Moves are handed to the
    migration mechanism, which decides KV or token transfer (unless the
    action fixes it) and may postpone a move to a later epoch.

    Attributes:
        interval_s: epoch length in seconds; None: :meth:`plan` is never called.
    """

    interval_s: float | None = None

    @abstractmethod
    def plan(self, state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        """Actions to apply now (see the class docstring)."""

    def attach(self, dispatcher: DispatchPolicy) -> None:
        """Called once with the run's dispatch policy (Mell shares its packer)."""

    def bind(self, ref: int, instance_id: int) -> None:
        """The instance started for ``ActivateGpu(ref=ref)`` got ``instance_id``."""

    def on_finish(self, request_id: int, instance_id: int, now: float) -> None:
        """Request ``request_id`` finished on ``instance_id`` (Mell's Depart)."""

    def on_release(self, instance_id: int, now: float) -> None:
        """Instance ``instance_id`` was released by the backend."""

    def on_move_aborted(self, request_id: int) -> None:
        """A planned move of ``request_id`` was aborted or dropped (the request
        stays where it was; see :mod:`fleetserve.sim.migration`)."""

    def report(self) -> dict[str, Any] | None:
        """What the policy did over the run, for ``summary.json`` (None: nothing)."""
        return None


DISPATCH: Registry[DispatchPolicy] = Registry("dispatch")
MEMORY: Registry[MemoryPolicy] = Registry("memory")
PLACEMENT: Registry[PlacementPolicy] = Registry("placement")
MIGRATION: Registry[MigrationPolicy] = Registry("migration")
