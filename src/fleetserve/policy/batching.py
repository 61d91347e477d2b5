"""Per-instance batch schedulers (the ``batching`` family).

Only vLLM's FCFS lives here for now; round-robin, skip-join MLFQ, SeaLLM DB
and MuxServe ADBS join in the multi-LLM issue.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetserve.cluster.state import InstanceView, SeqView
from fleetserve.policy.base import BATCHING, AdmissionBudget, BatchingPolicy


@BATCHING.register("fcfs")
class Fcfs(BatchingPolicy):
    """vLLM's first-come-first-served scheduler.

    Admission walks the waiting queue in order and stops at the first request
    that does not fit (no skipping, so a large prompt at the head blocks those
    behind it, as in vLLM). Preempted requests re-enter at the queue's head
    (the backend puts them there). The victim is the running request that
    arrived last (vLLM preempts the lowest-priority, i.e. latest, sequence).
    Decisions depend only on queue order and free memory, so the backend may
    advance a fixed decode batch several iterations at once.
    """

    macro_step_safe = True

    def admit(
        self, inst: InstanceView, waiting: Sequence[SeqView], budget: AdmissionBudget
    ) -> list[SeqView]:
        out: list[SeqView] = []
        for seq in waiting:
            if not budget.fits(seq):
                break
            budget.take(seq)
            out.append(seq)
        return out

    def victim(self, inst: InstanceView, running: Sequence[SeqView]) -> SeqView:
        return max(running, key=lambda s: (s.arrival_s, s.id))
