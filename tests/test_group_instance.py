"""The single-model world's instances are one-model sharing groups
(sim/group_instance.py; issue 21 item 2, session 29). They replaced the
single-model ``Instance`` class, whose records, time series, GPU intervals,
migrations and (under FCFS) events they reproduced on every draw of these
tests and on every fingerprinted run (benchmarks/fingerprints/session29.json.gz)
before it went.

What is checked now without that reference: a run advanced by macro-steps
(decode segments as one job) is the iteration-by-iteration run, record for
record, sample for sample, move for move, for every single-model stack
(Llumnix's and Mell's moves included), elastic or fixed, FCFS or RR, chunked
prefill or not, under memory pressure (preemptions, activations), with the
integrity checks after every event; MLFQ and DB on one GPU give the
multi-LLM world's records; and what explicit counts do not model is refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fleetserve.config import config_from_dict
from fleetserve.errors import ConfigError
from fleetserve.metrics.records import RunResult
from fleetserve.sim.simulator import Simulator
from fleetserve.workload.request import Request

MODEL = "llama-2-7b"
_TS = ("t", "active_gpus", "kv_used_bytes", "kv_capacity_bytes", "kv_demand_bytes")
_TS += ("queued", "running")


def _load(seed: int, n: int, rate: float) -> list[Request]:
    rng = np.random.default_rng(seed)
    ts = np.cumsum(rng.exponential(1 / rate, size=n))
    return [
        Request(i, MODEL, float(t), int(rng.integers(1, 2000)), int(rng.integers(1, 500)))
        for i, t in enumerate(ts)
    ]


def _run(cfg: dict[str, Any], reqs: list[Request], macro: bool) -> RunResult:
    return Simulator(config_from_dict({**cfg, "macro_steps": macro}), reqs).run()


def _same(cfg: dict[str, Any], reqs: list[Request]) -> RunResult:
    """The run with macro-steps equals the run iteration by iteration."""
    a, b = _run(cfg, reqs, True), _run(cfg, reqs, False)

    def key(r: Any) -> tuple[Any, ...]:
        return (r.id, r.status, r.reason, r.instance, r.first_token_s, r.finish_s)

    def more(r: Any) -> tuple[Any, ...]:
        return (r.generated, r.preemptions, r.migrations, r.migration_stall_s, r.aborted_migrations)

    assert [key(r) + more(r) for r in a.records] == [key(r) + more(r) for r in b.records]
    for f in _TS:
        assert getattr(a.timeseries, f) == getattr(b.timeseries, f), f
    assert a.gpu_intervals == b.gpu_intervals
    assert a.migrations == b.migrations
    assert a.end_s == b.end_s
    assert (a.sim_events or 0) <= (b.sim_events or 0)
    return a


def _cfg(stack: str, cluster: dict[str, Any], **engine: Any) -> dict[str, Any]:
    batching = engine.pop("batching", "fcfs")
    migration = engine.pop("migration", {})
    return {
        "model": MODEL,
        "cluster": {"gpu": "a100-80gb", **cluster},
        "policy": {"stack": stack, "batching": batching},
        "engine": engine,
        "migration": migration,
        "check_integrity": True,
    }


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    stack=st.sampled_from(["vllm", "bf", "wf", "ll"]),
    elastic=st.booleans(),
    mem_util=st.sampled_from([0.19, 0.25, 0.9]),
    rate=st.sampled_from([5.0, 20.0]),
    batching=st.sampled_from(["fcfs", "rr"]),
    chunked=st.booleans(),
    watermark=st.sampled_from([0.0, 0.01]),
)
@example(
    seed=1,
    stack="vllm",
    elastic=True,
    mem_util=0.19,
    rate=20.0,
    batching="fcfs",
    chunked=False,
    watermark=0.01,
)
def test_macro_steps_give_the_iteration_by_iteration_run(
    seed: int,
    stack: str,
    elastic: bool,
    mem_util: float,
    rate: float,
    batching: str,
    chunked: bool,
    watermark: float,
) -> None:
    cluster: dict[str, Any] = {"elastic": elastic, "mem_util": mem_util}
    if elastic:
        cluster |= {"max_gpus": 8, "activation_s": 2.0}
    else:
        cluster["gpus"] = 3
    cfg = _cfg(
        stack,
        cluster,
        batching=batching,
        chunked_prefill=chunked,
        max_batched_tokens=2048,
        watermark=watermark,
    )
    _same(cfg, _load(seed, 250, rate))


def test_the_usage_totals_of_many_instances_equal_a_scan() -> None:
    """20 instances: the time series come from the kept totals (sim/usage.py),
    with the groups' macro jobs' blocks held ahead subtracted per grid time.
    300 requests (88 running at the peak, 41 preemptions): the run iteration
    by iteration with integrity checks costs ~0.7 ms per event at 20 instances."""
    cfg = _cfg("wf", {"elastic": False, "gpus": 20, "mem_util": 0.19})
    res = _same(cfg, _load(3, 300, 60.0))
    assert max(res.timeseries.running) > 20
    assert sum(r.preemptions for r in res.records) > 0


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    stack=st.sampled_from(["llumnix", "mell"]),
    mechanism=st.sampled_from([None, "kv", "token", "adaptive"]),
    mem_util=st.sampled_from([0.25, 0.9]),
    rate=st.sampled_from([10.0, 30.0]),
    batching=st.sampled_from(["fcfs", "rr"]),
    chunked=st.booleans(),
    copy_contention=st.booleans(),
)
@example(
    seed=0,
    stack="mell",
    mechanism=None,
    mem_util=0.25,
    rate=20.0,
    batching="fcfs",
    chunked=False,
    copy_contention=True,
)
def test_moves_run_as_iteration_by_iteration(
    seed: int,
    stack: str,
    mechanism: str | None,
    mem_util: float,
    rate: float,
    batching: str,
    chunked: bool,
    copy_contention: bool,
) -> None:
    """Llumnix's and Mell's moves (live KV copies in stages, token re-prefills,
    the adaptive choice) run through the group's own actions (reserve,
    detach, attach, held blocks, copies beside iterations): macro-steps give
    the iteration-by-iteration records, migrations and time series. The
    example is the run that found a token move's stall unrecorded (against
    the instance, before it went)."""
    cluster = {"elastic": True, "mem_util": mem_util, "max_gpus": 40, "activation_s": 2.0}
    mig: dict[str, Any] = {"copy_contention": copy_contention}
    if mechanism is not None:
        mig["mechanism"] = mechanism
    cfg = _cfg(stack, cluster, batching=batching, chunked_prefill=chunked, migration=mig)
    res = _same(cfg, _load(seed, 300, rate))
    if stack == "mell":  # Mell moves requests on this load (llumnix, on some draws)
        assert res.migrations


@pytest.mark.parametrize(
    ("stack", "engine", "why"),
    [
        ("vllm", {"prefix_caching": True, "batching": "db"}, "engine.prefix_caching"),
        ("llumnix", {"batching": "mlfq"}, "migration policy 'llumnix'"),
    ],
)
def test_what_explicit_counts_do_not_model_is_refused(
    stack: str, engine: dict[str, Any], why: str
) -> None:
    """MLFQ and DB keep each request's counts (no bound batch): no moves, no
    shared cache blocks, with the reason."""
    cfg = config_from_dict(_cfg(stack, {"elastic": True, "max_gpus": 4}, **engine))
    with pytest.raises(ConfigError, match=why):
        Simulator(cfg, _load(0, 5, 1.0))


def _multi_one_group(reqs: list[Request], sched: str, mem_util: float) -> list[Any]:
    from fleetserve.policy.groups import GroupPlacement, PlacementPlan
    from fleetserve.sim.multi import MultiConfig, MultiSimulator
    from fleetserve.spec import get_model
    from fleetserve.workload.service import Service

    span = reqs[-1].arrival_s - reqs[0].arrival_s
    svc = Service(
        MODEL,
        get_model(MODEL),
        len(reqs) / span,
        sum(r.prompt_tokens for r in reqs) / len(reqs),
        sum(r.output_tokens for r in reqs) / len(reqs),
    )
    plan = PlacementPlan((GroupPlacement((0,), 1, (MODEL,)),), 1)
    cfg = MultiConfig(
        gpu="a100-80gb",
        n_gpus=1,
        scheduler=sched,
        layout="partitioned",
        mem_util=mem_util,
        watermark=0.01,
        check_integrity=True,
    )
    return list(MultiSimulator(cfg, {MODEL: svc}, plan, reqs).run().records)


@pytest.mark.parametrize("sched", ["mlfq", "db"])
@pytest.mark.parametrize("mem_util", [0.25, 0.9])
def test_mlfq_and_db_run_in_the_single_model_world_as_a_one_model_group(
    sched: str, mem_util: float
) -> None:
    """A batching policy without a one-model case (FastServe's MLFQ, SeaLLM's
    DB) runs in the single-model world on one-model groups, with statistics
    profiled from the workload as the multi-LLM world profiles them: one model
    on one GPU gives the multi-LLM world's records."""
    reqs = _load(4, 200, 8.0)
    cfg = _cfg("vllm", {"elastic": False, "gpus": 1, "mem_util": mem_util}, batching=sched)
    one = Simulator(config_from_dict(cfg), reqs).run()
    multi = _multi_one_group(reqs, sched, mem_util)

    def key(r: Any) -> tuple[Any, ...]:
        return (r.id, r.status, r.first_token_s, r.finish_s, r.generated, r.preemptions)

    assert [key(r) for r in one.records] == [key(r) for r in multi]
    assert all(r.status == "finished" for r in one.records)
    assert any("one-model sharing groups" in n for n in one.notes)


def test_mlfq_and_db_run_on_an_elastic_pool_and_adbs_is_refused() -> None:
    cfg = _cfg("bf", {"elastic": True, "max_gpus": 6, "mem_util": 0.25}, batching="db")
    res = Simulator(config_from_dict(cfg), _load(5, 300, 25.0)).run()
    assert max(res.timeseries.active_gpus) > 1
    assert all(r.status in ("finished", "rejected") for r in res.records)
    with pytest.raises(ConfigError, match=r"at once \(spatial sharing"):
        cfg = _cfg("vllm", {"elastic": False, "gpus": 1}, batching="adbs")
        Simulator(config_from_dict(cfg), _load(0, 5, 1.0))
    with pytest.raises(ConfigError, match=r"engine\.chunked_prefill"):
        cfg = _cfg("vllm", {"elastic": False, "gpus": 1}, batching="mlfq", chunked_prefill=True)
        Simulator(config_from_dict(cfg), _load(0, 5, 1.0))


@pytest.mark.parametrize("stack", ["vllm", "llumnix"])
@pytest.mark.parametrize("chunked", [False, True])
def test_an_iteration_observer_sees_every_iteration_and_changes_nothing(
    stack: str, chunked: bool
) -> None:
    """``on_iteration_end`` (the fidelity experiments' timelines, macro steps
    off) is called at each iteration end of each instance, in time order,
    busy or idle after it (idle at its last: the run drained), and the run
    is the one without an observer."""
    cfg = _cfg(stack, {"elastic": False, "gpus": 3, "mem_util": 0.25}, chunked_prefill=chunked)
    cfg["macro_steps"] = False
    reqs = _load(3, 200, 20.0)
    log: list[tuple[int, float, bool]] = []
    seen = Simulator(
        config_from_dict(cfg),
        reqs,
        on_iteration_end=lambda inst, now: log.append((inst.id, now, inst.phase != 0)),
    ).run()
    plain = Simulator(config_from_dict(cfg), reqs).run()
    assert [(r.first_token_s, r.finish_s) for r in seen.records] == [
        (r.first_token_s, r.finish_s) for r in plain.records
    ]
    longest = max(r.output_tokens for r in reqs)
    assert len(log) >= longest and len(log) > len(reqs)
    by_inst: dict[int, list[tuple[float, bool]]] = {}
    for iid, now, busy in log:
        by_inst.setdefault(iid, []).append((now, busy))
    for ends in by_inst.values():
        times = [t for t, _ in ends]
        assert times == sorted(times) and len(set(times)) == len(times)
        assert ends[-1][1] is False
