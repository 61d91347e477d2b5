"""Mell's elastic pool in the multi-LLM world: an idle sharing group releases
its GPUs after its keep-alive and reloads its weights when a request needs it
(composed stacks seallm-mell, muxserve-mell)."""

from __future__ import annotations

import itertools

import pytest

from fleetserve.errors import ConfigError
from fleetserve.metrics.records import RunResult
from fleetserve.metrics.summary import summarize
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.sim.multi import MultiConfig, MultiSimulator
from fleetserve.spec import get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

SERVICES = {
    "a": Service("a", get_model("llama-2-7b"), 1.0, 300, 50),
    "b": Service("b", get_model("llama-2-13b"), 1.0, 300, 50),
}
PLAN = PlacementPlan((GroupPlacement((0,), 1, ("a",)), GroupPlacement((1,), 1, ("b",))), 2)


def _reqs() -> list[Request]:
    """a busy in the first 10 s; b only at 40-45 s."""
    out = [(0.5 * i, "a", 200, 30) for i in range(20)]
    out += [(40.0 + 0.5 * i, "b", 200, 30) for i in range(10)]
    out.sort()
    return [Request(i, m, t, p, o) for i, (t, m, p, o) in enumerate(out)]


def _run(memory: str, keepalive_s: float = 5.0) -> RunResult:
    cfg = MultiConfig(
        gpu="a100-80gb",
        n_gpus=2,
        scheduler="fcfs",
        layout="merged",
        memory=memory,
        keepalive_s=keepalive_s,
        check_integrity=True,
    )
    return MultiSimulator(cfg, SERVICES, PLAN, _reqs()).run()


def test_idle_groups_sleep_wake_on_demand_and_pay_their_reload() -> None:
    rs, re_ = _run("static"), _run("elastic")
    assert all(r.status == "finished" for r in re_.records)
    info = re_.extra["elastic"]
    # b sleeps at 5 s (idle from the start), wakes at 40 s; a sleeps after its work
    assert info["wakes"] == 1 and info["sleeps"] >= 2
    s_static, s_elastic = summarize(rs), summarize(re_)
    assert s_elastic["gpus"]["gpu_hours"] < 0.6 * s_static["gpus"]["gpu_hours"]
    # b's first request waits for b's weights: 13B over PCIe, over a second
    first_b = next(r for r in re_.records if r.model == "b")
    same_b = next(r for r in rs.records if r.model == "b")
    assert first_b.first_token_s is not None and same_b.first_token_s is not None
    ttft_e = first_b.first_token_s - first_b.arrival_s
    ttft_s = same_b.first_token_s - same_b.arrival_s
    assert ttft_e > ttft_s + 1.0
    # a's requests ran before anything slept: identical to static
    for x, y in zip(rs.records, re_.records, strict=True):
        if x.model == "a":
            assert (x.first_token_s, x.finish_s) == (y.first_token_s, y.finish_s)
    # per-GPU active intervals never overlap and stay within the run
    by_gpu: dict[int, list[tuple[float, float]]] = {}
    for iv in re_.gpu_intervals:
        assert 0.0 <= iv.start_s <= iv.end_s <= re_.end_s
        by_gpu.setdefault(iv.gpu, []).append((iv.start_s, iv.end_s))
    for spans in by_gpu.values():
        spans.sort()
        assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))


def test_a_keepalive_longer_than_the_run_is_the_static_pool() -> None:
    static, never = _run("static"), _run("elastic", keepalive_s=1e6)
    a, b = summarize(static), summarize(never)
    for key in ("requests", "latency_s", "gpus"):
        assert a[key] == b[key]
    assert never.extra["elastic"]["wakes"] == 0


def test_bad_memory_settings_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="memory"):
        MultiConfig(memory="planned")
    with pytest.raises(ConfigError, match="keepalive"):
        MultiConfig(keepalive_s=-1.0)
