"""Cluster state shared by the simulator and the runtime."""

from fleetserve.cluster.state import (
    ClusterState,
    InstanceView,
    SeqView,
    blocks_for,
    most_available,
)

__all__ = ["ClusterState", "InstanceView", "SeqView", "blocks_for", "most_available"]
