"""Batching on a one-model instance: the one-model case of a sharing group.

Every batching policy of the catalog is a group scheduler
(:data:`fleetserve.policy.sharing.BATCHING`: FCFS, RR, MLFQ, DB, ADBS). A
one-model instance (the single-model and KunServe simulators, the runtime's
engine) runs those whose one-model case needs no per-service statistics
(:attr:`~fleetserve.policy.sharing.GroupScheduler.one_model`: FCFS and RR)
through :class:`OneModel`:

* admission: the queue in order while prompts fit (vLLM admission,
  :func:`~fleetserve.policy.sharing.admit_in_order`, the same function every
  group scheduler admits with); the instance prefills what was admitted and
  otherwise runs a decode step, which is these schedulers' one-model case;
* the victim when memory runs out: the scheduler's own
  (:meth:`~fleetserve.policy.sharing.GroupScheduler.victim`: the request that
  arrived last, as vLLM preempts).

MLFQ, DB and ADBS need per-service statistics (execution-time estimates,
quotas). The multi-LLM world computes them, and so does the single-model
simulator, which runs MLFQ and DB on one-model sharing groups
(:mod:`fleetserve.sim.group_instance`; ADBS runs jobs at once, which a
one-model instance does not). The KunServe world and the runtime's one-model
workers do not; asking them for these policies gets a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from fleetserve.cluster.state import InstanceView, SeqView
from fleetserve.errors import ConfigError
from fleetserve.policy.base import AdmissionBudget, BatchingPolicy
from fleetserve.policy.sharing import BATCHING, GroupScheduler, GroupSeq, GroupState, admit_in_order


class OneModel(BatchingPolicy):
    """A catalog batching policy on a one-model instance (see the module docstring)."""

    __slots__ = ("macro_step_safe", "scheduler")

    def __init__(self, scheduler: GroupScheduler) -> None:
        if not scheduler.one_model:
            raise ValueError(f"{type(scheduler).__name__} has no one-model case")
        self.scheduler = scheduler
        self.macro_step_safe = scheduler.macro_step_safe

    def admit(
        self, inst: InstanceView, waiting: Sequence[SeqView], budget: AdmissionBudget
    ) -> list[SeqView]:
        return admit_in_order(waiting, budget)

    def victim(self, inst: InstanceView, running: Sequence[SeqView]) -> SeqView:
        state = cast(GroupState, None)  # the one-model victims read no group state
        got = self.scheduler.victim(state, inst.model, cast(Sequence[GroupSeq], running))
        return cast(SeqView, got)


def one_model_batching() -> list[str]:
    """Names of the batching policies a one-model instance can run."""
    return [n for n in BATCHING.names() if BATCHING.get(n).one_model]


def instance_batching(name: str, **params: Any) -> OneModel:
    """The catalog's batching policy ``name`` for one one-model instance.

    Raises:
        UnknownNameError: not a batching policy (with suggestions).
        ConfigError: one that needs per-service statistics.
    """
    cls = BATCHING.get(name)
    if not cls.one_model:
        raise ConfigError(
            f"batching {name!r} needs per-service statistics, which a one-model "
            f"instance here does not have; it runs {', '.join(one_model_batching())} (the "
            "single-model simulator runs mlfq and db on one-model sharing groups, the "
            "multi-LLM world every batching policy)"
        )
    return OneModel(cls(**params))


def engine_batching(name: str, n_models: int, **params: Any) -> BatchingPolicy | GroupScheduler:
    """The catalog's batching policy ``name`` as a runtime engine hosting
    ``n_models`` models runs it.

    A one-model engine runs FCFS and RR through :class:`OneModel` (continuous
    batching: each step admits in queue order and decodes every running
    request, their one-model case). A sharing group (several models), or a
    scheduler without a one-model case (MLFQ, DB, ADBS), runs the group
    scheduler itself, job by job, as the simulated sharing group does
    (:mod:`fleetserve.runtime.engine.group`).

    Raises:
        UnknownNameError: not a batching policy (with suggestions).
    """
    cls = BATCHING.get(name)
    if n_models == 1 and cls.one_model:
        return OneModel(cls(**params))
    return cls(**params)
