"""Sharing groups and placement plans: the vocabulary of multi-LLM placement.

A *service* (SeaLLM's "LLM service", :class:`~fleetserve.workload.service.Service`)
is one model with its own traffic; two services may use the same catalog model
(each holds its own weights). A *sharing group* (SeaLLM) or *LLM unit*
(MuxServe) is a set of services placed on the same GPUs with one
tensor-parallel degree: every service's weights are resident on every GPU of
the group (split ``tp`` ways) and their KV caches share the memory left over.
A *placement plan* is a set of disjoint groups covering every service (a
service may appear in several groups: replicas).

Requests name their service in ``Request.model``.

These are plain frozen records; the policies that produce them (``dedicated``,
``alpaserve``, ``muxserve``, ``seallm`` placement) and the simulator that runs
them are elsewhere. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleetserve.errors import ConfigError

__all__ = ["GroupPlacement", "PlacementPlan"]


@dataclass(frozen=True, slots=True)
class GroupPlacement:
    """One sharing group: ``services`` on GPUs ``gpus`` with tensor parallelism ``tp``.

    ``len(gpus)`` is a multiple of ``tp``: ``len(gpus) // tp`` data-parallel
    replicas of the same co-located set (MuxServe's meshes use one; SeaLLM's
    groups use one); the simulator runs each replica as its own group.
    """

    gpus: tuple[int, ...]
    tp: int
    services: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.tp < 1 or not self.gpus or len(self.gpus) % self.tp:
            raise ConfigError(f"group on GPUs {list(self.gpus)}: tp {self.tp} does not divide them")
        if len(set(self.gpus)) != len(self.gpus):
            raise ConfigError(f"group on GPUs {list(self.gpus)}: a GPU appears twice")
        if not self.services or len(set(self.services)) != len(self.services):
            raise ConfigError(f"group on GPUs {list(self.gpus)}: services {self.services}")


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """Disjoint sharing groups on a pool of ``n_gpus`` GPUs.

    Attributes:
        groups: the groups.
        n_gpus: GPUs in the pool (some may be unused).
        note: how the plan was found (for reports).
    """

    groups: tuple[GroupPlacement, ...]
    n_gpus: int
    note: str = ""

    def check(self, services: Sequence[str] | Mapping[str, object]) -> None:
        """Raise ConfigError unless the groups are disjoint, inside the pool and
        place every one of ``services`` at least once (and nothing else)."""
        seen: dict[int, int] = {}
        for i, g in enumerate(self.groups):
            for gpu in g.gpus:
                if not 0 <= gpu < self.n_gpus:
                    raise ConfigError(
                        f"group {i} uses GPU {gpu}, outside the pool of {self.n_gpus}"
                    )
                if gpu in seen:
                    raise ConfigError(f"GPU {gpu} is in groups {seen[gpu]} and {i}")
                seen[gpu] = i
        placed = {s for g in self.groups for s in g.services}
        want = set(services)
        if placed - want:
            raise ConfigError(f"the plan places unknown services {sorted(placed - want)}")
        if want - placed:
            raise ConfigError(f"the plan leaves services unplaced: {sorted(want - placed)}")

    @property
    def gpus_used(self) -> int:
        return sum(len(g.gpus) for g in self.groups)
