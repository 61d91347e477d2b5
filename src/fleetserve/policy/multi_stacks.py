"""Multi-LLM stacks: placement × group scheduler × KV layout × replacement.

These are the systems compared in SeaLLM's and MuxServe's evaluations, built
from the policy families of this package (a stack only names choices):

=================  ===========  =========  ===========  ===========
stack              placement    scheduler  KV layout    replacement
=================  ===========  =========  ===========  ===========
``vllm``           dedicated    fcfs       partitioned  no
``alpaserve``      muxserve     fcfs       merged       no
``muxserve``       muxserve     adbs       headwise     no
``seallm``         seallm       db         merged       adaptive
``seallm-fcfs``    seallm       fcfs       merged       adaptive
``seallm-mlfq``    seallm       mlfq       merged       adaptive
``seallm-noplace`` dedicated    db         merged       no
``seallm-norepl``  seallm       db         merged       no
``muxserve-fcfs``  muxserve     fcfs       headwise     no
``muxserve-rr``    muxserve     rr         headwise     no
=================  ===========  =========  ===========  ===========

``alpaserve`` is MuxServe's placement with temporal FCFS, on SeaLLM's unified
(merged) KV cache as SeaLLM's evaluation implements it. ``seallm-noplace``
(SeaLLM-P) shares nothing, so it is vLLM's dedicated split with SeaLLM's
scheduler; without a placement algorithm there is nothing to re-run, so it
has no replacement either. ``muxserve-fcfs`` and ``-rr`` are MuxServe's
scheduling ablation (its placement, FCFS or round-robin instead of ADBS).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.errors import UnknownNameError

__all__ = ["MULTI_STACKS", "MultiStack", "get_multi_stack"]


@dataclass(frozen=True, slots=True)
class MultiStack:
    """One multi-LLM system's choices (registry names)."""

    name: str
    description: str
    placement: str
    scheduler: str
    layout: str
    replacement: bool = False


MULTI_STACKS: dict[str, MultiStack] = {
    s.name: s
    for s in (
        MultiStack(
            "vllm",
            "vLLM: GPUs split among services by rate, FCFS",
            "dedicated",
            "fcfs",
            "partitioned",
        ),
        MultiStack(
            "alpaserve",
            "AlpaServe: MuxServe's placement, temporal FCFS, unified KV cache",
            "muxserve",
            "fcfs",
            "merged",
        ),
        MultiStack(
            "muxserve",
            "MuxServe: enumeration greedy placement, ADBS, head-wise KV blocks",
            "muxserve",
            "adbs",
            "headwise",
        ),
        MultiStack(
            "seallm",
            "SeaLLM: search placement, DB scheduling, merged KV, adaptive replacement",
            "seallm",
            "db",
            "merged",
            True,
        ),
        MultiStack("seallm-fcfs", "SeaLLM-F: SeaLLM with FCFS", "seallm", "fcfs", "merged", True),
        MultiStack(
            "seallm-mlfq", "SeaLLM-M: SeaLLM with skip-join MLFQ", "seallm", "mlfq", "merged", True
        ),
        MultiStack(
            "seallm-noplace",
            "SeaLLM-P: no placement algorithm (dedicated GPUs), DB scheduling",
            "dedicated",
            "db",
            "merged",
        ),
        MultiStack(
            "seallm-norepl",
            "SeaLLM-A: placement found once, no adaptive replacement",
            "seallm",
            "db",
            "merged",
        ),
        MultiStack(
            "muxserve-fcfs", "MuxServe's placement with FCFS", "muxserve", "fcfs", "headwise"
        ),
        MultiStack(
            "muxserve-rr", "MuxServe's placement with round-robin", "muxserve", "rr", "headwise"
        ),
    )
}


def get_multi_stack(name: str) -> MultiStack:
    """The multi-LLM stack called ``name``; a clear error suggesting close names."""
    try:
        return MULTI_STACKS[name]
    except KeyError:
        raise UnknownNameError("multi-LLM stack", name, MULTI_STACKS) from None
