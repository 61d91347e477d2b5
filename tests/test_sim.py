"""Simulator: exactness of macro-steps, determinism, invariants, pools, policies."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.cluster.state import ClusterState
from fleetserve.config import config_from_dict
from fleetserve.costmodel import CostModel
from fleetserve.errors import ConfigError, UnknownNameError
from fleetserve.metrics import summarize
from fleetserve.metrics.records import RunResult
from fleetserve.policy import DISPATCH, ActivateGpu, Dispatch, Reject
from fleetserve.sim.simulator import Simulator
from fleetserve.spec import get_gpu, get_model
from fleetserve.workload.request import Request

MODEL = "llama-2-7b"
# mem_util 0.33 leaves llama-2-7b ~0.7 GB of KV on an A100-40GB: ~80 blocks, so
# small workloads exercise preemption and activation.
SMALL = {"cluster": {"mem_util": 0.33}}


def cfg(**over: Any) -> Any:
    data: dict[str, Any] = {"model": MODEL}
    for k, v in over.items():
        if isinstance(v, dict):
            data.setdefault(k, {}).update(v)
        else:
            data[k] = v
    return config_from_dict(data)


def workload(n: int, rate: float, seed: int, pmax: int = 3000, omax: int = 600) -> list[Request]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    p = rng.integers(1, pmax, n)
    o = rng.integers(1, omax, n)
    return [Request(i, MODEL, float(t[i]), int(p[i]), int(o[i])) for i in range(n)]


def outcome(res: RunResult) -> list[tuple[Any, ...]]:
    return [
        (r.status, r.reason, r.first_token_s, r.finish_s, r.generated, r.preemptions, r.instance)
        for r in res.records
    ]


def run(c: Any, reqs: list[Request]) -> RunResult:
    return Simulator(c, reqs).run()


# --------------------------------------------------------------------- exactness


@pytest.mark.parametrize("stack", ["bf", "wf", "vllm", "ll"])
def test_macro_steps_equal_iteration_by_iteration(stack: str) -> None:
    """Advancing fixed decode batches with numpy gives exactly the results (bit for
    bit: times, tokens, preemptions, placement, time series) of running one
    iteration per event."""
    reqs = workload(400, 6.0, seed=1, pmax=1500, omax=400)
    fast = run(cfg(policy={"stack": stack}, **SMALL), reqs)
    slow = run(cfg(policy={"stack": stack}, macro_steps=False, **SMALL), reqs)
    assert outcome(fast) == outcome(slow)
    assert fast.timeseries == slow.timeseries
    assert fast.gpu_intervals == slow.gpu_intervals
    assert sum(r.preemptions for r in fast.records) > 0  # the case is not trivial
    assert fast.sim_events is not None and slow.sim_events is not None
    assert fast.sim_events < slow.sim_events


def test_macro_steps_equal_on_fixed_pool_with_queueing() -> None:
    reqs = workload(300, 20.0, seed=2, pmax=1200, omax=300)
    c = {"cluster": {"elastic": False, "gpus": 2, "mem_util": 0.33}}
    fast = run(cfg(**c), reqs)
    slow = run(cfg(macro_steps=False, **c), reqs)
    assert outcome(fast) == outcome(slow)
    assert fast.timeseries == slow.timeseries


def test_single_request_takes_its_ideal_time() -> None:
    """Alone on an idle instance, a request's TTFT is one prefill and its e2e is
    the cost model's closed-form execution time."""
    req = Request(0, MODEL, 0.0, 777, 123)
    res = run(cfg(), [req])
    rec = res.records[0]
    cost = CostModel().bind(get_model(MODEL), get_gpu("a100-40gb"))
    assert rec.first_token_s == pytest.approx(cost.prefill_time([777]), rel=1e-12)
    assert rec.finish_s == pytest.approx(rec.ideal_s, rel=1e-9)
    assert rec.generated == 123 and rec.status == "finished"
    assert summarize(res)["normalized_latency"] == pytest.approx(1.0, rel=1e-9)


# ------------------------------------------------------------------ determinism


def _strip_wall(s: dict[str, Any]) -> dict[str, Any]:
    s = dict(s)
    s["sim"] = {k: v for k, v in s["sim"].items() if k != "wall_s"}
    return s


def test_same_seed_same_summary_and_no_interference() -> None:
    reqs = workload(300, 8.0, seed=3)
    a = Simulator(cfg(policy={"stack": "vllm"}, **SMALL), reqs)
    b = Simulator(cfg(policy={"stack": "bf"}, **SMALL), reqs)
    ra, rb = a.run(), b.run()  # two simulations alive in one process
    ra2 = run(cfg(policy={"stack": "vllm"}, **SMALL), reqs)
    rb2 = run(cfg(policy={"stack": "bf"}, **SMALL), reqs)
    assert _strip_wall(summarize(ra)) == _strip_wall(summarize(ra2))
    assert _strip_wall(summarize(rb)) == _strip_wall(summarize(rb2))
    assert outcome(ra) != outcome(rb)


# ------------------------------------------------------------------- invariants

request_lists = st.lists(
    st.tuples(
        st.floats(0.0, 2.0, allow_nan=False),  # inter-arrival gap
        st.integers(1, 1400),  # prompt
        st.integers(1, 400),  # output
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=request_lists,
    stack=st.sampled_from(["bf", "wf", "vllm", "ll"]),
    fixed=st.booleans(),
    max_seqs=st.sampled_from([2, 256]),
)
def test_invariants_hold_after_every_event(
    items: list[tuple[float, int, int]], stack: str, fixed: bool, max_seqs: int
) -> None:
    """On arbitrary streams: block accounting consistent and memory never
    over-committed after every event (check_integrity), every request ends in
    exactly one terminal state, nothing lost."""
    t = 0.0
    reqs = []
    for i, (gap, p, o) in enumerate(items):
        t += gap
        reqs.append(Request(i, MODEL, t, p, o))
    cluster: dict[str, Any] = {"mem_util": 0.33}
    if fixed:
        cluster.update(elastic=False, gpus=2)
    c = cfg(
        policy={"stack": stack},
        cluster=cluster,
        engine={"max_num_seqs": max_seqs},
        check_integrity=True,
    )
    res = run(c, reqs)
    s = summarize(res)["requests"]
    assert s["finished"] + s["rejected"] + s["unfinished"] == s["total"] == len(reqs)
    assert s["unfinished"] == 0
    for r in res.records:
        assert (r.status == "finished") == (r.finish_s is not None)
        if r.status == "finished":
            assert r.generated == r.output_tokens
            assert r.first_token_s is not None and r.arrival_s <= r.first_token_s <= r.finish_s
        else:
            assert r.reason


def test_request_larger_than_an_instance_is_rejected_with_reason() -> None:
    big = Request(0, MODEL, 0.0, 1000, 2000)  # within the context; one instance holds ~1.3k
    ok = Request(1, MODEL, 0.5, 100, 10)
    res = run(cfg(**SMALL), [big, ok])
    assert res.records[0].status == "rejected"
    assert "KV tokens" in (res.records[0].reason or "")
    assert res.records[1].status == "finished"


def test_max_time_leaves_requests_unfinished() -> None:
    reqs = workload(100, 10.0, seed=4)
    res = run(cfg(max_time_s=3.0), reqs)
    s = summarize(res)["requests"]
    assert s["unfinished"] > 0
    assert s["finished"] + s["rejected"] + s["unfinished"] == s["total"]
    assert res.end_s == pytest.approx(3.0)


# ------------------------------------------------------------------------ pools


def test_elastic_pool_activates_and_releases() -> None:
    reqs = workload(200, 5.0, seed=5, pmax=1000, omax=300)
    res = run(cfg(policy={"stack": "bf"}, **SMALL), reqs)
    s = summarize(res)
    assert s["gpus"]["peak"] >= 2
    released = [iv for iv in res.gpu_intervals if iv.end_s < res.end_s]
    assert released, "idle GPUs must be released"
    assert s["gpus"]["peak"] >= s["gpus"]["lower_bound"] >= 1


@pytest.mark.parametrize("stack", ["bf", "mell"])
def test_an_activated_gpu_serves_after_its_activation_time(stack: str) -> None:
    """``cluster.activation_s``: an instance the elastic pool activates during
    the run starts its first iteration that long after (its requests wait;
    invariants checked after every event); 0 is the run without it."""
    reqs = workload(120, 4.0, seed=5, pmax=1000, omax=200)
    base = cfg(policy={"stack": stack}, **SMALL, check_integrity=True)
    plain = run(base, reqs)
    same = run(cfg(policy={"stack": stack}, cluster={"mem_util": 0.33, "activation_s": 0.0}), reqs)
    assert outcome(same) == outcome(plain)
    slow = run(
        cfg(
            policy={"stack": stack},
            cluster={"mem_util": 0.33, "activation_s": 7.5},
            check_integrity=True,
        ),
        reqs,
    )
    assert [r.status for r in slow.records] == [r.status for r in plain.records]
    assert "unfinished" not in {r.status for r in slow.records}
    first = min(slow.records, key=lambda r: r.arrival_s)
    assert first.first_token_s >= first.arrival_s + 7.5  # the pool starts empty
    waits = [r.first_token_s - r.arrival_s for r in slow.records]
    base_waits = [r.first_token_s - r.arrival_s for r in plain.records]
    assert sum(waits) > sum(base_waits)
    with pytest.raises(ConfigError, match="activation_s"):
        cfg(cluster={"activation_s": -1.0})


def test_fixed_pool_keeps_all_gpus() -> None:
    reqs = workload(100, 5.0, seed=6)
    res = run(cfg(cluster={"elastic": False, "gpus": 3}), reqs)
    assert len(res.gpu_intervals) == 3
    assert all(iv.start_s == 0.0 and iv.end_s == res.end_s for iv in res.gpu_intervals)
    assert {r.instance for r in res.records} == {0, 1, 2}  # round-robin spreads


def test_model_that_does_not_fit_fails_before_running() -> None:
    with pytest.raises(ConfigError, match="llama-2-70b"):
        Simulator(
            cfg(model="llama-2-70b", cluster={"elastic": False, "gpus": 1}),
            [Request(0, "llama-2-70b", 0.0, 10, 10)],
        )


def test_unknown_stack_suggests() -> None:
    with pytest.raises(UnknownNameError, match="'bf'"):
        Simulator(cfg(policy={"stack": "bff"}), [Request(0, MODEL, 0.0, 10, 10)])


# --------------------------------------------------------------------- dispatch


@dataclasses.dataclass
class FakeInst:
    id: int
    available_blocks: int
    num_running: int = 0
    num_waiting: int = 0
    model: str = MODEL
    gpus: tuple[int, ...] = (0,)
    tp: int = 1
    block_size: int = 16
    total_blocks: int = 1000
    used_blocks: int = 0
    free_blocks: int = 0
    reserved_blocks: int = 0


def state_of(*insts: FakeInst, elastic: bool = True, limit: int = 100) -> ClusterState:
    st_ = ClusterState(gpus_limit=limit, elastic=elastic, model_tp={MODEL: 1})
    for i in insts:
        st_.add(i)  # type: ignore[arg-type]
    return st_


def dispatch(name: str, state: ClusterState, prompt: int) -> Any:
    pol = DISPATCH.get(name)()
    return pol.dispatch(state, Request(7, MODEL, 0.0, prompt, 10), 0.0, np.random.default_rng(0))


def test_best_fit_picks_least_sufficient() -> None:
    s = state_of(FakeInst(0, 100), FakeInst(1, 20), FakeInst(2, 5), FakeInst(3, 50))
    assert dispatch("best_fit", s, prompt=16 * 10) == Dispatch(7, 1)  # needs 10 blocks


def test_worst_fit_picks_most_available() -> None:
    s = state_of(FakeInst(0, 100), FakeInst(1, 20), FakeInst(2, 500))
    assert dispatch("worst_fit", s, prompt=16) == Dispatch(7, 2)


@pytest.mark.parametrize("name", ["best_fit", "worst_fit", "round_robin", "least_loaded"])
def test_nothing_fits_activates_or_queues_or_rejects(name: str) -> None:
    s = state_of(FakeInst(0, 3), FakeInst(1, 4))
    assert dispatch(name, s, prompt=16 * 10) == ActivateGpu(MODEL, 1, 7)
    full = state_of(FakeInst(0, 3), FakeInst(1, 4), elastic=False, limit=2)
    act = dispatch(name, full, prompt=16 * 10)
    assert isinstance(act, Dispatch) and act.instance_id in (0, 1)
    empty = state_of(elastic=False, limit=0)
    assert isinstance(dispatch(name, empty, prompt=16), Reject)


def test_round_robin_cycles() -> None:
    s = state_of(FakeInst(0, 100), FakeInst(1, 100), FakeInst(2, 100))
    pol = DISPATCH.get("round_robin")()
    rng = np.random.default_rng(0)
    got = [
        pol.dispatch(s, Request(i, MODEL, 0.0, 16, 1), 0.0, rng).instance_id  # type: ignore[union-attr]
        for i in range(6)
    ]
    assert got == [0, 1, 2, 0, 1, 2]


def test_least_loaded_picks_fewest_requests() -> None:
    s = state_of(FakeInst(0, 100, 3, 1), FakeInst(1, 100, 1, 0), FakeInst(2, 100, 2, 0))
    assert dispatch("least_loaded", s, prompt=16) == Dispatch(7, 1)


# -------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("stack", ["bf", "vllm"])
def test_chunked_prefill_exact_and_consistent(stack: str) -> None:
    """Mixed iterations keep every invariant, and macro-stepping the decode-only
    stretches between them still equals an iteration-by-iteration run."""
    reqs = workload(300, 8.0, seed=7, pmax=1200, omax=300)
    over: dict[str, Any] = {
        "policy": {"stack": stack},
        "engine": {"chunked_prefill": True, "max_batched_tokens": 512},
        **SMALL,
    }
    fast = run(cfg(check_integrity=True, **over), reqs)
    slow = run(cfg(macro_steps=False, **over), reqs)
    assert outcome(fast) == outcome(slow)
    assert all(r.status in ("finished", "rejected") for r in fast.records)
    assert sum(r.status == "finished" for r in fast.records) > 250
    unchunked = run(cfg(policy={"stack": stack}, **SMALL), reqs)
    assert outcome(fast) != outcome(unchunked)


def test_chunked_prefill_splits_a_long_prompt() -> None:
    """A 2,000-token prompt with a 512-token budget takes four mixed iterations, so
    its TTFT is the sum of four chunk times (longer than one whole prefill)."""
    res = run(
        cfg(engine={"chunked_prefill": True, "max_batched_tokens": 512}),
        [Request(0, MODEL, 0.0, 2000, 5)],
    )
    cost = CostModel().bind(get_model(MODEL), get_gpu("a100-40gb"))
    expect = 0.0
    done = 0
    for n in (512, 512, 512, 464):
        expect += cost.mixed_time([(n, done)], 0, 0)
        done += n
    assert res.records[0].first_token_s == pytest.approx(expect, rel=1e-12)
    assert res.records[0].status == "finished"
