"""Policies: pure decision code shared by the simulator and the runtime.

Importing this package registers every built-in policy.
"""

from fleetserve.policy import batching, dispatch, llumnix, mechanism, memory, migration, placement
from fleetserve.policy.actions import (
    Action,
    ActivateGpu,
    Defer,
    Dispatch,
    Migrate,
    Reject,
    ReleaseGpu,
)
from fleetserve.policy.base import (
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
from fleetserve.policy.catalog import STACKS, Stack, get_stack, resolve_policies
from fleetserve.policy.mechanism import MECHANISM, MechanismContext, MigrationMechanism, PendingMove
from fleetserve.policy.mell import scheduler as mell_scheduler
from fleetserve.policy.pressure import KunSettings
from fleetserve.policy.sharing import BATCHING

__all__ = [
    "BATCHING",
    "DISPATCH",
    "MECHANISM",
    "MEMORY",
    "MIGRATION",
    "PLACEMENT",
    "STACKS",
    "Action",
    "ActivateGpu",
    "AdmissionBudget",
    "BatchingPolicy",
    "Defer",
    "Dispatch",
    "DispatchPolicy",
    "KunSettings",
    "MechanismContext",
    "MemoryPolicy",
    "Migrate",
    "MigrationMechanism",
    "MigrationPolicy",
    "PendingMove",
    "PlacementPolicy",
    "Reject",
    "ReleaseGpu",
    "Stack",
    "batching",
    "dispatch",
    "get_stack",
    "llumnix",
    "mechanism",
    "mell_scheduler",
    "memory",
    "migration",
    "placement",
    "resolve_policies",
]
