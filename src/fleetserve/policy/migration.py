"""Migration policies (the ``migration`` family). Mell and Llumnix join in the Mell issue."""

from __future__ import annotations

from typing import Any

import numpy as np

from fleetserve.cluster.state import ClusterState
from fleetserve.policy.base import MIGRATION, MigrationPolicy


@MIGRATION.register("none")
class NoMigration(MigrationPolicy):
    """Requests stay where they were dispatched (vLLM, BF, WF)."""

    interval_s = None

    def plan(self, state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        return []
