"""Policies: pure decision code shared by the simulator and the runtime.

Importing this package registers every built-in policy.
"""

from fleetserve.policy import batching, dispatch, memory, migration, placement
from fleetserve.policy.actions import Action, ActivateGpu, Dispatch, Reject, ReleaseGpu
from fleetserve.policy.base import (
    BATCHING,
    DISPATCH,
    MEMORY,
    MIGRATION,
    PLACEMENT,
    AdmissionBudget,
    BatchingPolicy,
    DispatchPolicy,
    MemoryPolicy,
    MigrationPolicy,
    PlacementPolicy,
)
from fleetserve.policy.stacks import STACKS, Stack, get_stack

__all__ = [
    "BATCHING",
    "DISPATCH",
    "MEMORY",
    "MIGRATION",
    "PLACEMENT",
    "STACKS",
    "Action",
    "ActivateGpu",
    "AdmissionBudget",
    "BatchingPolicy",
    "Dispatch",
    "DispatchPolicy",
    "MemoryPolicy",
    "MigrationPolicy",
    "PlacementPolicy",
    "Reject",
    "ReleaseGpu",
    "Stack",
    "batching",
    "dispatch",
    "get_stack",
    "memory",
    "migration",
    "placement",
]
