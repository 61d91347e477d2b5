"""Chunked prefill in a sharing group (``engine.chunked_prefill`` in the
multi-LLM world): several services, FCFS or RR, memory tight or not. Every
request ends finished, the integrity checks hold after every event, each
mixed iteration stays within ``max_batched_tokens``, and a prompt's chunks
add up to exactly its (re)prefill."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.config import config_from_dict
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.sim.group import SharingGroup
from fleetserve.sim.multi import MultiConfig, MultiSimulator
from fleetserve.sim.multi_build import multi_settings
from fleetserve.spec import get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

MODELS = ("llama-2-7b", "llama-2-13b", "llama-3.1-8b")


def _run(seed: int, scheduler: str, tokens: int, mem_util: float, chunked: bool) -> Any:
    svc = {m: Service(m, get_model(m), 2.0, 400, 150) for m in MODELS}
    rng = np.random.default_rng(seed)
    rows = sorted((float(t), m) for m in MODELS for t in np.cumsum(rng.exponential(0.25, size=25)))
    reqs = [
        Request(i, m, t, int(rng.integers(1, 3000)), int(rng.integers(1, 200)))
        for i, (t, m) in enumerate(rows)
    ]
    plan = PlacementPlan((GroupPlacement((0, 1), 2, MODELS),), 2)
    cfg = MultiConfig(
        gpu="a100-80gb",
        n_gpus=2,
        scheduler=scheduler,
        layout="headwise",
        mem_util=mem_util,
        max_batched_tokens=tokens,
        chunked_prefill=chunked,
        check_integrity=True,
    )
    return MultiSimulator(cfg, svc, plan, reqs).run()


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    scheduler=st.sampled_from(["fcfs", "rr"]),
    tokens=st.sampled_from([256, 1024, 4096]),
    mem_util=st.sampled_from([0.36, 0.9]),
)
def test_chunked_groups_serve_everything_within_the_token_budget(
    seed: int, scheduler: str, tokens: int, mem_util: float
) -> None:
    seen: list[tuple[int, int]] = []  # (tokens in the iteration, budget)
    done: dict[int, int] = {}  # request -> prompt tokens chunked since its last (re)start
    orig = SharingGroup._start_mixed

    def spy(self: SharingGroup, job: Any, now: float) -> Any:
        got = orig(self, job, now)
        if got is not None and got[1] in self._chunks:
            chunks = self._chunks[got[1]]
            decodes = len(self.jobs[got[1]][1]) - len(chunks)
            seen.append((decodes + sum(n for _, n in chunks), self.max_batched_tokens))
            for s, n in chunks:
                done[s.id] = n if s.prefilled == 0 else done.get(s.id, 0) + n
                assert done[s.id] <= s.prompt_tokens + s.gen_saved
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SharingGroup, "_start_mixed", spy)
        res = _run(seed, scheduler, tokens, mem_util, True)
    assert all(r.status == "finished" for r in res.records)
    assert seen and all(n <= budget for n, budget in seen)
    assert any(n > 1 for n, _ in seen)


def test_chunking_changes_when_first_tokens_come() -> None:
    """The same load with and without chunked prefill: both finish everything,
    and the first tokens differ (prompts are split across iterations)."""
    a = _run(3, "fcfs", 512, 0.9, True)
    b = _run(3, "fcfs", 512, 0.9, False)
    assert all(r.status == "finished" for r in (*a.records, *b.records))
    assert [r.first_token_s for r in a.records] != [r.first_token_s for r in b.records]


def test_the_config_key_reaches_the_groups() -> None:
    """``engine.chunked_prefill`` in a multi-LLM config reaches the groups;
    with MLFQ it is refused with the reason."""
    data: dict[str, Any] = {
        "services": [{"name": "a", "model": MODELS[0]}],
        "cluster": {"gpus": 2, "elastic": False},
        "policy": {"stack": "seallm", "batching": "fcfs"},
        "engine": {"chunked_prefill": True},
    }
    cfg = config_from_dict(data)
    assert multi_settings(cfg).chunked_prefill
    with pytest.raises(Exception, match="chunked"):
        MultiConfig(scheduler="mlfq", chunked_prefill=True)
