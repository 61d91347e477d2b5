"""Multi-LLM sharing groups: schedulers (FCFS, RR, MLFQ, DB, ADBS), the group
simulator and its invariants (every request ends exactly once, memory and
quotas never over-committed, every layout returns all blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from fleetserve.policy.groups import GroupPlacement, PlacementPlan, Service
from fleetserve.policy.sharing import (
    DECODE,
    GROUP_BATCHING,
    PREFILL,
    Adbs,
    DoublingBudget,
    ServiceStats,
    SkipJoinMlfq,
)
from fleetserve.sim.multi import MultiConfig, MultiSimulator
from fleetserve.spec import get_model
from fleetserve.workload.request import Request

SCHEDULERS = ["fcfs", "rr", "mlfq", "db", "adbs"]
LAYOUTS = ["headwise", "merged", "partitioned"]


def services(*pairs: tuple[str, str, float]) -> dict[str, Service]:
    return {n: Service(n, get_model(m), rate, 256, 128) for n, m, rate in pairs}


def workload(
    rates: dict[str, float], seconds: float, seed: int, lens: dict[str, tuple[int, int]]
) -> list[Request]:
    rng = np.random.default_rng(seed)
    out: list[tuple[float, str, int, int]] = []
    for name, rate in rates.items():
        t = 0.0
        while True:
            t += rng.exponential(1 / rate)
            if t >= seconds:
                break
            p, o = lens[name]
            out.append((t, name, int(rng.integers(p // 2, p + 1)), int(rng.integers(1, o + 1))))
    out.sort()
    return [Request(i, m, a, p, o) for i, (a, m, p, o) in enumerate(out)]


def one_group(names: list[str], gpus: int = 1, tp: int = 1) -> PlacementPlan:
    return PlacementPlan((GroupPlacement(tuple(range(gpus)), tp, tuple(names)),), gpus)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sched", SCHEDULERS)
def test_every_request_ends_once_and_memory_is_never_overcommitted(sched: str, layout: str) -> None:
    svc = services(("a", "llama-2-7b", 4.0), ("b", "llama-2-13b", 1.0))
    reqs = workload({"a": 4.0, "b": 1.0}, 20.0, 1, {"a": (512, 256), "b": (1024, 64)})
    cfg = MultiConfig(
        gpu="a100-80gb",
        n_gpus=1,
        scheduler=sched,
        layout=layout,
        check_integrity=True,
        max_num_seqs=32,
    )
    sim = MultiSimulator(cfg, svc, one_group(["a", "b"]), reqs)
    res = sim.run()
    assert all(r.status == "finished" for r in res.records)
    assert all(r.generated == r.output_tokens for r in res.records)
    for g in sim.groups:  # every layout gives all memory back
        assert g.layout.used_bytes() == 0
        assert g.idle
        g.layout.check_integrity()
    for r in res.records:
        assert r.first_token_s is not None and r.finish_s is not None
        assert r.arrival_s <= r.first_token_s <= r.finish_s


def test_memory_pressure_preempts_and_still_finishes_everything() -> None:
    svc = services(("a", "llama-2-13b", 20.0), ("b", "llama-2-13b", 20.0))
    reqs = workload({"a": 20.0, "b": 20.0}, 4.0, 2, {"a": (2048, 512), "b": (2048, 512)})
    for sched in SCHEDULERS:
        cfg = MultiConfig(n_gpus=1, scheduler=sched, check_integrity=True, mem_util=0.8)
        sim = MultiSimulator(cfg, svc, one_group(["a", "b"]), reqs)
        res = sim.run()
        assert all(r.status == "finished" for r in res.records), sched
        assert sum(g.preemptions for g in sim.groups) > 0, sched


def test_adbs_runs_prefill_and_decodes_of_other_services_at_once() -> None:
    svc = services(("a", "llama-2-7b", 5.0), ("b", "llama-2-7b", 5.0))
    reqs = workload({"a": 5.0, "b": 5.0}, 10.0, 3, {"a": (512, 128), "b": (512, 128)})
    sim = MultiSimulator(
        MultiConfig(n_gpus=1, scheduler="adbs", check_integrity=True),
        svc,
        one_group(["a", "b"]),
        reqs,
    )
    seen = []
    g0 = None

    orig = sim._on_job_end

    def spy(g, token, now):  # type: ignore[no-untyped-def]
        nonlocal g0
        g0 = g
        seen.append({(j.model, j.phase) for j, _, _, _ in g.jobs.values()})
        orig(g, token, now)

    sim._on_job_end = spy  # type: ignore[method-assign]
    sim.run()
    assert any(len(s) >= 2 for s in seen)  # spatial: jobs overlap
    assert any(("a", PREFILL) in s and ("b", DECODE) in s for s in seen) or any(
        ("b", PREFILL) in s and ("a", DECODE) in s for s in seen
    )


def test_adbs_quotas_are_never_exceeded_and_adapt_to_use() -> None:
    # a is popular and fills its quota, b is rare: b's unused quota moves to a
    svc = services(("a", "llama-2-7b", 20.0), ("b", "llama-2-7b", 0.2))
    reqs = workload({"a": 20.0, "b": 0.2}, 30.0, 4, {"a": (2048, 512), "b": (64, 16)})
    sim = MultiSimulator(  # check_integrity checks used <= quota after every event
        MultiConfig(n_gpus=1, scheduler="adbs", check_integrity=True, mem_util=0.45),
        svc,
        one_group(["a", "b"]),
        reqs,
    )
    sched = sim.groups[0].scheduler
    assert isinstance(sched, Adbs)
    q0 = dict(sched.quota)
    history: list[dict[str, float]] = []
    adapt = sched.adapt

    def record(state):  # type: ignore[no-untyped-def]
        adapt(state)
        history.append(dict(sched.quota))
        for m in ("a", "b"):  # never below use, never below the floor
            assert sched.quota[m] >= state.kv_used(m)
            assert sched.quota[m] >= sched.floor * q0[m] - 1e-6

    sched.adapt = record  # type: ignore[method-assign]
    res = sim.run()
    assert all(r.status == "finished" for r in res.records)
    assert len(history) >= 5
    assert max(h["a"] for h in history) > q0["a"]  # a got b's unused quota
    assert min(h["b"] for h in history) < q0["b"]
    for h in history:
        assert sum(h.values()) == pytest.approx(sum(q0.values()))


def test_db_serves_the_short_service_first_and_doubles_budgets() -> None:
    stats = {
        "short": ServiceStats(1.0, 1.0, 0.0, 1),
        "long": ServiceStats(1.0, 10.0, 0.0, 1),
    }
    db = DoublingBudget()
    db.setup(stats, 1 << 30)

    class S:
        def __init__(self, i: int, model: str, t: float) -> None:
            self.id, self.model, self.arrival_s = i, model, t
            self.prompt_tokens, self.generated = 10, 0

    long_, short = S(0, "long", 0.0), S(1, "short", 1.0)
    db.on_arrival(long_, 0.0)
    db.on_arrival(short, 1.0)
    assert db.priority(short) == 1.0 * 1.0 and db.priority(long_) == 10.0 * 10.0
    assert db.priority(short) < db.priority(long_)  # the later, shorter one goes first
    # running 1.5 s uses up short's budget of 1.0: doubled to 2 * (1 + 0)
    db.on_job_end(None, [short], 1.5, 2.5)  # type: ignore[arg-type]
    assert db.priority(short) == 2.0 * 1.0


def test_mlfq_skip_joins_long_prompts_lower_and_demotes_after_quantum() -> None:
    stats = {"m": ServiceStats(1.0, 1.0, 0.0, 1, prefill_s_per_token=1e-3)}
    q = SkipJoinMlfq(q0_s=0.05)
    q.setup(stats, 1 << 30)

    class S:
        def __init__(self, i: int, p: int) -> None:
            self.id, self.model, self.arrival_s, self.prompt_tokens, self.generated = (
                i,
                "m",
                0.0,
                p,
                0,
            )

    short, long_ = S(0, 10), S(1, 1000)  # prefill 0.01 s vs 1 s
    q.on_arrival(short, 0.0)
    q.on_arrival(long_, 0.0)
    assert q._level[0] == 0 and q._level[1] == 5  # 0.05 * 2**5 = 1.6 >= 1.0
    q.on_job_end(None, [short], 0.06, 0.1)  # type: ignore[arg-type]
    assert q._level[0] == 1


def test_fcfs_with_one_service_serves_in_arrival_order() -> None:
    svc = services(("a", "llama-2-7b", 2.0))
    reqs = [Request(i, "a", 0.01 * i, 128, 16) for i in range(20)]
    res = MultiSimulator(
        MultiConfig(n_gpus=1, scheduler="fcfs", check_integrity=True), svc, one_group(["a"]), reqs
    ).run()
    firsts = [r.first_token_s for r in res.records]
    assert firsts == sorted(firsts)  # type: ignore[type-var]


def test_replicas_split_a_service_and_unknown_names_are_clear_errors() -> None:
    svc = services(("a", "llama-2-7b", 8.0))
    plan = PlacementPlan((GroupPlacement((0, 1), 1, ("a",)),), 2)
    reqs = workload({"a": 8.0}, 5.0, 5, {"a": (256, 64)})
    sim = MultiSimulator(MultiConfig(n_gpus=2, check_integrity=True), svc, plan, reqs)
    res = sim.run()
    assert len(sim.groups) == 2
    used = {r.instance for r in res.records}
    assert used == {0, 1}
    with pytest.raises(Exception, match="batching policy"):
        MultiSimulator(MultiConfig(n_gpus=2, scheduler="nope"), svc, plan, reqs)
    assert set(SCHEDULERS) <= set(GROUP_BATCHING.names())


def test_weights_that_leave_no_kv_room_are_a_config_error() -> None:
    svc = services(("a", "llama-2-70b", 1.0), ("b", "llama-2-13b", 1.0))
    with pytest.raises(Exception, match="leave no KV memory"):
        MultiSimulator(MultiConfig(n_gpus=2), svc, one_group(["a", "b"], gpus=2, tp=2), [])


@pytest.mark.parametrize("heavy", [False, True])
@pytest.mark.parametrize("sched", ["fcfs", "rr", "mlfq", "db"])
def test_macro_steps_give_the_same_results_as_step_by_step(sched: str, heavy: bool) -> None:
    """A lone decode batch advanced many iterations at once (truncated by
    arrivals) gives the records of an iteration-by-iteration run."""
    if heavy:  # three services, queues, DB budgets running out and starvation
        svc = services(("a", "llama-2-7b", 3), ("b", "llama-2-13b", 1), ("c", "opt-6.7b", 1))
        rates = {"a": 3.0, "b": 1.0, "c": 1.0}
        lens = {"a": (1024, 400), "b": (2048, 300), "c": (256, 600)}
        reqs = workload(rates, 20.0, 9, lens)
    else:
        svc = services(("a", "llama-2-7b", 1.5), ("b", "llama-2-13b", 0.5))
        reqs = workload({"a": 1.5, "b": 0.5}, 30.0, 7, {"a": (512, 400), "b": (256, 300)})
    runs = []
    for macro in (False, True):
        cfg = MultiConfig(
            n_gpus=1, scheduler=sched, macro_steps=macro, check_integrity=True, mem_util=0.75
        )
        sim = MultiSimulator(cfg, svc, one_group(sorted(svc)), reqs)
        res = sim.run()
        runs.append((res, sim.n_events))
    (slow, n_slow), (fast, n_fast) = runs
    assert n_fast <= n_slow
    for a, b in zip(slow.records, fast.records, strict=True):
        assert (a.status, a.generated, a.preemptions) == (b.status, b.generated, b.preemptions)
        assert a.first_token_s == pytest.approx(b.first_token_s, rel=1e-12, abs=1e-12)
        assert a.finish_s == pytest.approx(b.finish_s, rel=1e-12, abs=1e-12)


def test_macro_steps_skip_most_iterations_of_a_lone_batch() -> None:
    svc = services(("a", "llama-2-7b", 0.5))
    reqs = workload({"a": 0.5}, 30.0, 8, {"a": (256, 500)})
    n = []
    for macro in (False, True):
        sim = MultiSimulator(MultiConfig(n_gpus=1, macro_steps=macro), svc, one_group(["a"]), reqs)
        sim.run()
        n.append(sim.n_events)
    assert n[1] < n[0] / 5
