"""SeaLLM's adaptive replacement on live workers (``runtime/replace.py``):
the worker matching, the interval's measurement and adaptation, and a switch
that loads and unloads models on serving workers while their requests move
on, every output the engine's own. The controller and its workers run in
one event loop (``LocalHandle``), as in ``tests/test_runtime_kun.py``."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from local_handle import LocalHandle

from fleetserve.cli.serve import serve_config_dict
from fleetserve.config import config_from_dict
from fleetserve.policy.catalog import get_stack
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.policy.sharing import ServiceStats
from fleetserve.runtime import cluster
from fleetserve.runtime.controller import Controller
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.plan import SharingPlacement
from fleetserve.runtime.replace import Replacer, match_workers
from fleetserve.runtime.worker import Worker, WorkerSpec
from fleetserve.spec import get_gpu

pytest.importorskip("ray")

A, B = "tiny-llama-a", "tiny-llama-b"
MB = 2**20


# --------------------------------------------------------------- matching
def test_matching_keeps_identical_sets_and_then_the_largest_overlap() -> None:
    a, b, ab = frozenset({A}), frozenset({B}), frozenset({A, B})
    assert match_workers([a, b], [b, a]) == [a, b]  # nothing moves
    assert match_workers([a, b], [ab, b]) == [ab, b]  # worker 0 gains B
    assert match_workers([a, b], [ab]) == [ab, frozenset()]
    with pytest.raises(ValueError, match="3 GPUs; 2 workers"):
        match_workers([a, b], [a, b, ab])


@settings(max_examples=80, deadline=None)
@given(
    cur=st.lists(st.frozensets(st.sampled_from("abcd"), max_size=3), min_size=1, max_size=6),
    data=st.data(),
)
def test_matching_gives_every_slot_one_worker(cur: list[frozenset[str]], data: Any) -> None:
    slots = data.draw(
        st.lists(st.frozensets(st.sampled_from("abcd"), min_size=1, max_size=3), max_size=len(cur))
    )
    got = match_workers(cur, slots)
    assert len(got) == len(cur)
    assert sorted(map(sorted, (g for g in got if g))) == sorted(map(sorted, slots))
    for w, s in enumerate(cur):  # a worker whose set is a slot keeps it, if that slot is free
        if s in slots and slots.count(s) >= sum(1 for c in cur if c == s):
            assert got[w] == s


# ---------------------------------------------------------------- harness
def _stats() -> dict[str, ServiceStats]:
    return {
        m: ServiceStats(
            rate=1.0,
            exec_mean_s=0.05,
            exec_std_s=0.01,
            kv_bytes_per_token=4096,
            prefill_s_per_token=1e-4,
        )
        for m in (A, B)
    }


class FakePlanner:
    """Plans what the test says; ideal time 0.1 s per request."""

    def __init__(self, plans: list[tuple[tuple[tuple[str, ...], ...], float]]) -> None:
        self.plans = list(plans)
        self.windows: list[int] = []

    def place(self, window: Any, window_s: float) -> tuple[PlacementPlan, float, Any]:
        self.windows.append(len(window))
        workers, est = self.plans.pop(0)
        groups = tuple(GroupPlacement((g,), 1, tuple(s)) for g, s in enumerate(workers) if s)
        return PlacementPlan(groups, len(workers)), est, _stats()

    def ideal_s(self, model: str, prompt_tokens: int, output_tokens: int) -> float:
        return 0.1


async def _start(
    hosted: list[tuple[str, ...]], planner: FakePlanner, interval_s: float = 600.0
) -> tuple[Controller, list[LocalHandle], Replacer]:
    data = {
        "serve": {"workers": len(hosted), "gpu_memory_mb": 72, "models": [A, B]},
        "policy": {"stack": "seallm"},
        "multi": {"replacement_interval_s": interval_s, "min_interval_s": 1.0},
    }
    cfg = config_from_dict(serve_config_dict(data))
    served = cluster.served_models(cfg)
    stats = _stats()
    specs = [
        WorkerSpec(
            wid,
            models,
            models,
            72 * MB,
            batching="db",
            services=tuple((m, stats[m]) for m in models),
        )
        for wid, models in enumerate(hosted)
    ]
    handles = [LocalHandle(Worker(s)) for s in specs]
    snaps = {s.worker_id: await h.worker.start() for s, h in zip(specs, handles, strict=True)}
    ctl = Controller(
        cluster.runtime_policy_config(cfg),
        {s.worker_id: (s, h) for s, h in zip(specs, handles, strict=True)},
        snaps,
        {i.name: i for i in served.values()},
    )
    placement = SharingPlacement(
        get_stack("seallm"),
        PlacementPlan((), len(hosted)),
        {},
        get_gpu("a100-40gb"),
        0.9,
        tuple(hosted),
        stats,
        cfg,
    )
    ctl.replacer = Replacer(ctl, placement, planner, {A: A, B: B})
    await ctl.start()
    return ctl, handles, ctl.replacer


def _prompts(n: int) -> list[list[int]]:
    return [[(5 * i + 3 * j) % 250 + 4 for j in range(20 + 7 * (i % 4))] for i in range(n)]


@functools.cache
def _reference(model: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    from fleetserve.runtime.engine.engine import Engine

    eng = Engine([model], 64 * MB)
    rid = eng.add_request(model, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True))
    while eng.has_work():
        eng.step()
    return tuple(eng.requests[rid].output_ids)


async def _collect(t: Any) -> list[int]:
    toks: list[int] = []
    while True:
        ev = await t.events.get()
        if ev[0] == "token":
            toks.append(ev[2])
        elif ev[0] == "done":
            return toks
        else:
            raise AssertionError(f"request {t.id} failed: {ev}")


# ------------------------------------------------------------------ switch
def test_a_switch_loads_and_unloads_models_while_requests_run_on() -> None:
    """Worker 0 serves A, worker 1 serves B; the new plan puts A and B on
    worker 0 and A on worker 1: B is loaded on worker 0, B's requests on
    worker 1 move there (token migration), B is unloaded from worker 1 and A
    loaded there. Every request, moved or not, ends with the engine's own
    tokens, each once; new requests of both models are served after."""
    n = 150  # long enough to be running when the switch comes
    work = [(A if i % 2 else B, p) for i, p in enumerate(_prompts(8))]

    async def main() -> None:
        ctl, handles, rep = await _start([(A,), (B,)], FakePlanner([]))
        try:
            ts = [ctl.submit(m, p, SamplingParams(max_tokens=n, ignore_eos=True)) for m, p in work]
            tasks = [asyncio.ensure_future(_collect(t)) for t in ts]
            await asyncio.sleep(0.05)  # they run
            await rep.switch({0: (A, B), 1: (A,)})
            assert set(ctl.workers[0].instances) == {A, B}
            assert set(ctl.workers[1].instances) == {A}
            assert set(handles[1].worker.core.engine.models) == {A}
            assert set(handles[0].worker.core.engine.models) == {A, B}
            assert ctl.workers[1].spec.served == (A,)  # a restart loads the new set
            outs = await asyncio.gather(*tasks)
            for (m, p), got in zip(work, outs, strict=True):
                assert tuple(got) == _reference(m, tuple(p), n)
            # B's requests, still running at the switch, moved once each; A's stayed
            assert [t.migrations for t in ts] == [1 if m == B else 0 for m, _p in work]
            loads = ctl.metrics.model_loads._sum.get()
            assert loads > 0
            # served after the switch, by the new hosts
            short = SamplingParams(max_tokens=8, ignore_eos=True)
            more = [ctl.submit(m, p, short) for m, p in work]
            for (m, p), got in zip(work, await asyncio.gather(*map(_collect, more)), strict=True):
                assert tuple(got) == _reference(m, tuple(p), 8)
            b_hosts = {ctl.inst_of[t.instance][0] for t in more if t.model == B and t.instance}
            assert b_hosts == {0}
            for h in handles:
                await h.worker.check_integrity()
        finally:
            await ctl.stop()

    asyncio.run(main())


def test_an_interval_measures_adapts_searches_and_switches() -> None:
    """At an interval's end the replacer measures M_real (the requests whose
    deadline fell in it), adapts the interval with Equation 8 against the
    plan's estimate, searches on the interval's requests and switches when
    the plan moves a model."""
    planner = FakePlanner([(((A, B), (B,)), 0.8)])

    async def main() -> None:
        ctl, _handles, rep = await _start([(A,), (B,)], planner, interval_s=2.0)
        try:
            ts = [
                ctl.submit(m, p, SamplingParams(max_tokens=4, ignore_eos=True))
                for m, p in [(A, _prompts(1)[0]), (B, _prompts(2)[1])]
            ]
            await asyncio.gather(*map(_collect, ts))
            now = ctl.now()
            rep.next_at = now  # the interval ends now
            rep.tick(now)
            await asyncio.sleep(0)
            for _ in range(200):
                if rep.switching is not None and rep.switching.done():
                    break
                await asyncio.sleep(0.05)
            ev = rep.log[-1]
            assert ev["history_requests"] == 2 and planner.windows == [2]
            # both met their deadline (0.5 s after arrival, if they finished by then)
            assert ev["m_real"] in (None, 0.0, 0.5, 1.0)
            m_real, m_est = ev["m_real"], 0.9
            if m_real is not None:
                gap = abs(m_real - m_est) / m_est
                want = 2.0 * (0.9 if gap > 0.1 else 1.1)
                assert ev["next_interval_s"] == pytest.approx(max(1.0, want))
            assert ev["models_moved"] == 1 and rep.switches == 1
            assert set(ctl.workers[0].instances) == {A, B}
            assert rep.m_est == 0.8
            info = ctl.cluster_json()["replacement"]
            assert info["switches"] == 1 and info["events"]
        finally:
            await ctl.stop()

    asyncio.run(main())
