"""GPU-pool management (the ``memory`` family): when instances are released."""

from __future__ import annotations

from fleetserve.cluster.state import ClusterState, InstanceView
from fleetserve.policy.actions import ReleaseGpu
from fleetserve.policy.base import MEMORY, MemoryPolicy


@MEMORY.register("elastic")
class ReleaseIdle(MemoryPolicy):
    """Mell's elastic pool: "terminate a GPU if it is idle" — at once.

    Activation happens in dispatch, when nothing fits.
    """

    def on_idle(self, state: ClusterState, inst: InstanceView, now: float) -> list[ReleaseGpu]:
        return [ReleaseGpu(inst.id)]


@MEMORY.register("static")
class Static(MemoryPolicy):
    """A fixed pool: instances are never released."""

    def on_idle(self, state: ClusterState, inst: InstanceView, now: float) -> list[ReleaseGpu]:
        return []


@MEMORY.register("planned")
class Planned(MemoryPolicy):
    """An elastic pool whose migration policy releases GPUs in its plan (Mell
    terminates GPUs that hold no request at the end of each epoch), so
    nothing is released when an instance merely becomes idle."""

    def on_idle(self, state: ClusterState, inst: InstanceView, now: float) -> list[ReleaseGpu]:
        return []
