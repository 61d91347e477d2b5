"""Stacks: named bundles of policy choices that reproduce one system.

Any family can still be overridden on its own (``--dispatch``, ``--batching``,
...). ``memory`` left as None resolves from the pool: ``elastic`` on an
elastic pool, ``static`` on a fixed one.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.errors import UnknownNameError


@dataclass(frozen=True, slots=True)
class Stack:
    """One system's policy choices (registry names per family)."""

    name: str
    description: str
    dispatch: str
    batching: str = "fcfs"
    migration: str = "none"
    placement: str = "dedicated"
    memory: str | None = None
    mechanism: str = "kv"


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack("vllm", "vLLM instances behind a round-robin load balancer", "round_robin"),
        Stack("bf", "Best-Fit dispatch on free KV memory, no migration (Mell §VIII)", "best_fit"),
        Stack("wf", "Worst-Fit dispatch on free KV memory, no migration (Mell §VIII)", "worst_fit"),
        Stack("ll", "least-loaded dispatch (fewest requests), no migration", "least_loaded"),
        Stack(
            "llumnix",
            "Worst-Fit dispatch + Llumnix load balancing by live KV migration (Mell's LB)",
            "worst_fit",
            migration="llumnix",
            mechanism="kv",
        ),
        Stack(
            "mell",
            "Mell: epoch-batched Fig. 10 packing with adaptive KV/token migration (Mell §V-VI)",
            "mell",
            migration="mell",
            memory="planned",
            mechanism="adaptive",
        ),
    )
}


def get_stack(name: str) -> Stack:
    """The stack called ``name``; a clear error suggesting close names."""
    try:
        return STACKS[name]
    except KeyError:
        from fleetserve.sim.kun_parts import KUN_STACKS

        raise UnknownNameError("stack", name, sorted({*STACKS, *KUN_STACKS})) from None
