"""Every stack of the catalog, in every world it runs in, on arbitrary small
workloads: the simulator's integrity checks run after every event (memory
never over-committed, every request in exactly one place), and every request
ends in exactly one terminal state with nothing lost (issue 21 acceptance).

Composed stacks join this test when the catalog has them.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.config import config_from_dict
from fleetserve.metrics.records import RunResult
from fleetserve.metrics.summary import summarize
from fleetserve.policy.catalog import KUNSERVE, MULTI, SINGLE, stacks_in
from fleetserve.policy.sharing import BATCHING
from fleetserve.sim.kun import KunSimulator
from fleetserve.sim.multi import ReplacementConfig
from fleetserve.sim.multi_run import MultiRunSettings, run_multi_stack
from fleetserve.sim.simulator import Simulator
from fleetserve.spec import get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

MODEL = "llama-2-7b"
SERVICES = {
    "a": Service("a", get_model("llama-2-7b"), 2.0, 300, 80),
    "b": Service("b", get_model("opt-6.7b"), 2.0, 300, 80),
}

streams = st.lists(
    st.tuples(
        st.floats(0.0, 1.0, allow_nan=False),  # inter-arrival gap
        st.integers(1, 1200),  # prompt
        st.integers(1, 200),  # output
        st.booleans(),  # which service (multi-LLM world)
    ),
    min_size=1,
    max_size=25,
)


def _requests(items: list[tuple[float, int, int, bool]], names: tuple[str, str]) -> list[Request]:
    t, out = 0.0, []
    for i, (gap, p, o, second) in enumerate(items):
        t += gap
        out.append(Request(i, names[1] if second else names[0], t, p, o))
    return out


def _ends_once(res: RunResult, n: int) -> None:
    s = summarize(res)["requests"]
    assert s["finished"] + s["rejected"] + s["unfinished"] == s["total"] == n
    assert s["unfinished"] == 0
    for r in res.records:
        assert r.status in ("finished", "rejected")
        assert (r.status == "finished") == (r.finish_s is not None)
        if r.status == "finished":
            assert r.generated == r.output_tokens
        else:
            assert r.reason


CASES = [(SINGLE, n) for n in sorted(stacks_in(SINGLE))]
CASES += [(MULTI, n) for n in sorted(stacks_in(MULTI))]
CASES += [(KUNSERVE, n) for n in sorted(stacks_in(KUNSERVE))]


def _single(stack: str, reqs: list[Request], small: bool, **engine: Any) -> RunResult:
    """The single-model world, integrity checks after every event."""
    cluster: dict[str, Any] = {"gpu": "a100-40gb", "mem_util": 0.33 if small else 0.9}
    if stack in ("mell", "llumnix") or not small:
        cluster["elastic"] = True
    else:
        cluster.update(elastic=False, gpus=2)
    data: dict[str, Any] = {
        "model": MODEL,
        "cluster": cluster,
        "policy": {"stack": stack},
        "check_integrity": True,
    }
    if engine:
        data["engine"] = engine
    return Simulator(config_from_dict(data), reqs).run()


def _multi(stack: str, reqs: list[Request], small: bool, **settings_: Any) -> RunResult:
    """The multi-LLM world, integrity checks after every event."""
    run = MultiRunSettings(
        gpu="a100-80gb",
        n_gpus=2 if small else 4,
        replacement=ReplacementConfig(initial_interval_s=4.0, min_interval_s=2.0),
        keepalive_s=0.5,  # elastic stacks: groups sleep and wake within the run
        processes=1,
        check_integrity=True,
        **settings_,
    )
    return run_multi_stack(stack, SERVICES, reqs, reqs, run)


@pytest.mark.parametrize(("world", "stack"), CASES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=streams, small=st.booleans())
def test_every_stack_keeps_its_invariants_after_every_event(
    world: str, stack: str, items: list[tuple[float, int, int, bool]], small: bool
) -> None:
    if world == SINGLE:
        reqs = _requests(items, (MODEL, MODEL))
        res = _single(stack, reqs, small)
    elif world == MULTI:
        reqs = _requests(items, ("a", "b"))
        res = _multi(stack, reqs, small)
    else:
        reqs = _requests(items, (MODEL, MODEL))
        res = KunSimulator(
            reqs,
            model=MODEL,
            gpu="a800-80gb",
            instances=2,
            settings=stacks_in(KUNSERVE)[stack].burst,
            stack=stack,
            kv_tokens=3000 if small else 12000,
            network_gbps=200,
            gpus_per_node=1,
            check_integrity=True,
        ).run()
    _ends_once(res, len(reqs))


_GROUPED = [n for n, st_ in sorted(stacks_in(SINGLE).items()) if st_.migration == "none"]


@pytest.mark.parametrize(("stack", "batching"), [(n, b) for n in _GROUPED for b in ("mlfq", "db")])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=streams, small=st.booleans())
def test_single_model_stacks_with_every_batching_keep_their_invariants(
    stack: str, batching: str, items: list[tuple[float, int, int, bool]], small: bool
) -> None:
    """The single-model world's stacks without migration with MLFQ and DB
    (their requests keep explicit counts), and with the stack's own batching
    (FCFS: bound batches)."""
    reqs = _requests(items, (MODEL, MODEL))
    cluster: dict[str, Any] = {"gpu": "a100-40gb", "mem_util": 0.33 if small else 0.9}
    cluster |= {"elastic": False, "gpus": 2} if small else {"elastic": True}
    data = {
        "model": MODEL,
        "cluster": cluster,
        "policy": {"stack": stack, "batching": batching},
        "check_integrity": True,
    }
    _ends_once(Simulator(config_from_dict(data), reqs).run(), len(reqs))
    data["policy"] = {"stack": stack}
    _ends_once(Simulator(config_from_dict(data), reqs).run(), len(reqs))


def _chunked_cases() -> list[tuple[str, str]]:
    """Stacks that run chunked prefill: every single-model stack; the
    multi-LLM stacks whose group scheduler has a one-model case (FCFS, RR)
    and no KunServe drop (session 25)."""
    out = [(SINGLE, n) for n in sorted(stacks_in(SINGLE))]
    for n, s in sorted(stacks_in(MULTI).items()):
        if BATCHING.get(s.batching).one_model and s.pressure != "kunserve":
            out.append((MULTI, n))
    return out


@pytest.mark.parametrize(("world", "stack"), _chunked_cases())
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=streams, small=st.booleans(), budget=st.sampled_from([64, 512]))
def test_every_stack_with_chunked_prefill_keeps_its_invariants(
    world: str, stack: str, items: list[tuple[float, int, int, bool]], small: bool, budget: int
) -> None:
    if world == SINGLE:
        reqs = _requests(items, (MODEL, MODEL))
        res = _single(stack, reqs, small, chunked_prefill=True, max_batched_tokens=budget)
    else:
        reqs = _requests(items, ("a", "b"))
        res = _multi(
            stack,
            reqs,
            small,
            mem_util=0.5 if small else 0.9,
            chunked_prefill=True,
            max_batched_tokens=budget,
        )
    _ends_once(res, len(reqs))
