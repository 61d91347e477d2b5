"""Multi-model sharing placements (SeaLLM, MuxServe) and Mell's elastic pool at runtime.

The runtime's worker plan for a multi-LLM stack is the stack's own group
placement on the same inputs as the simulator's (services measured on the
workload's history, each worker the emulated GPU of its arena, one GPU per
node); a worker then hosts several models in one engine, and completions of
both models are the engine's greedy texts. Mell's dispatch and epoch plans
activate idle workers under load and release them once empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_util import metric_value, reference_text, running_server

from fleetserve.cli.serve import load_serve_config, serve_config_dict
from fleetserve.config import SimConfig, config_from_dict
from fleetserve.costmodel import CostModel
from fleetserve.errors import ConfigError, UnknownNameError
from fleetserve.policy.catalog import get_stack, resolve_policies
from fleetserve.policy.groups import PlacementPlan
from fleetserve.policy.muxserve_placement import muxserve_place
from fleetserve.policy.seallm_placement import seallm_place
from fleetserve.runtime.plan import (
    plan_workers,
    runtime_gaps,
    runtime_policy_config,
    runtime_policy_names,
    sharing_placement,
)
from fleetserve.sim.evaluate import PlanEvaluator
from fleetserve.sim.multi import MultiConfig
from fleetserve.sim.multi_build import build_multi, history_placement
from fleetserve.spec import emulated_gpu_name, get_gpu

A, B = "tiny-llama-a", "tiny-llama-b"
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _cfg(stack: str, workers: int, mb: float = 64, **extra: Any) -> SimConfig:
    data: dict[str, Any] = {
        "serve": {"workers": workers, "gpu_memory_mb": mb, "models": [A, B]},
        "policy": {"stack": stack},
        "workload": {"synthetic_duration_s": 20.0, "length_scale": 0.1},
        "multi": {"history_s": 20.0},
    }
    for k, v in extra.items():
        if isinstance(v, dict):
            data.setdefault(k, {}).update(v)
        else:
            data[k] = v
    return config_from_dict(serve_config_dict(data))


def _policy_plan(cfg: SimConfig, placement: str) -> PlacementPlan:
    """The placement policy called directly, on the simulator's inputs for the
    same cluster: services of the ``services:`` config the simulator would
    run, on ``workers`` emulated GPUs of the arena (one per node, mem_util 1)."""
    sv = cfg.serve
    sim_cfg = replace(
        cfg,
        services=None,
        cluster=replace(
            cfg.cluster, gpu=emulated_gpu_name(sv.gpu_memory_mb), gpus=sv.workers, mem_util=1.0
        ),
    )
    d = sim_cfg.to_dict()
    d["services"] = [{"name": m, "model": m} for m in sv.models or ()]
    inp = build_multi(config_from_dict(d), require_run=False)
    gpu = replace(get_gpu(emulated_gpu_name(sv.gpu_memory_mb)), gpus_per_node=1)
    svcs = list(inp.services.values())
    if placement == "muxserve":
        return muxserve_place(svcs, sv.workers, gpu, CostModel(), 1.0)
    assert placement == "seallm"
    mc = MultiConfig(
        gpu=gpu.name,
        n_gpus=sv.workers,
        scheduler="db",
        layout="merged",
        mem_util=1.0,
        max_num_seqs=sv.max_running,
        max_batched_tokens=sv.max_batch_tokens,
    )
    ev = PlanEvaluator(mc, inp.services, inp.history, slo_scale=cfg.multi.slo_scale)
    plan, _cands = seallm_place(svcs, sv.workers, gpu, ev, mem_util=1.0)
    return plan


def _workers_of(plan: PlacementPlan) -> list[tuple[str, ...]]:
    slots = {gpu: g.services for g in plan.groups for gpu in g.gpus}
    return [tuple(slots[i]) for i in sorted(slots)]


# ------------------------------------------------------------------ plan_workers


@pytest.mark.parametrize(("stack", "workers"), [("muxserve", 1), ("muxserve", 3)])
def test_muxserve_plan_is_the_policys(stack: str, workers: int) -> None:
    cfg = _cfg(stack, workers)
    want = _policy_plan(cfg, "muxserve")
    got = sharing_placement(cfg, [A, B], placer=history_placement)
    assert got.plan == want
    assert plan_workers(cfg, [A, B], placer=history_placement) == _workers_of(want)
    if workers == 1:  # one GPU: MuxServe must co-locate both models in one unit
        assert plan_workers(cfg, [A, B], placer=history_placement) == [want.groups[0].services]
        assert set(want.groups[0].services) == {A, B}
    else:  # the demand is met by a unit per model: the third GPU starts no worker
        assert sorted(plan_workers(cfg, [A, B], placer=history_placement)) == [(A,), (B,)]


def test_link_overrides_are_refused_by_the_runtime() -> None:
    """The runtime moves data through its real links: a simulated link override
    is an error that names it, never silently ignored."""
    cfg = _cfg("muxserve", 1, cluster={"intra_node_bw": 32e9})
    with pytest.raises(ConfigError, match="intra_node_bw"):
        plan_workers(cfg, [A, B], placer=history_placement)


def test_seallm_plan_is_the_policys_and_shares_gpus() -> None:
    cfg = _cfg("seallm", 2)
    want = _policy_plan(cfg, "seallm")
    got = sharing_placement(cfg, [A, B], placer=history_placement)
    assert got.plan == want
    assert got.estimate is not None
    workers = plan_workers(cfg, [A, B], placer=history_placement)
    assert workers == _workers_of(want)
    assert any(len(w) > 1 for w in workers)  # multi-model workers
    assert {m for w in workers for m in w} == {A, B}


def test_rates_follow_the_workload_weights() -> None:
    cfg = _cfg("muxserve", 1, workload={"models": [A, B], "model_weights": [3.0, 1.0]})
    got = sharing_placement(cfg, [A, B], placer=history_placement)
    assert got.services[A].rate > 2 * got.services[B].rate
    assert got.plan == _policy_plan(cfg, "muxserve")


def test_controller_families_for_a_multi_llm_stack() -> None:
    cfg = _cfg("muxserve", 2, policy={"dispatch": "round_robin"})
    names = runtime_policy_names(cfg)
    assert names["stack"] == "muxserve" and names["placement"] == "muxserve"
    assert names["dispatch"] == "round_robin"  # an override is kept
    assert names["migration"] == "none" and names["memory"] == "static"
    # what the controller itself resolves
    assert resolve_policies(runtime_policy_config(cfg))["dispatch"] == "round_robin"
    over = _cfg("muxserve", 2, policy={"batching": "fcfs", "placement": "dedicated"})
    got = runtime_policy_names(over)  # the overrides reach the runtime as the simulator
    assert (got["batching"], got["placement"]) == ("fcfs", "dedicated")
    plain = _cfg("llumnix", 2)
    assert runtime_policy_config(plain) is plain
    assert plan_workers(plain, [A, B]) == [(A,), (B,)]  # single-model stacks unchanged


def test_sharing_config_errors() -> None:
    with pytest.raises(ConfigError, match="fixed pool"):
        plan_workers(_cfg("seallm", 2, cluster={"elastic": True}), [A, B], placer=history_placement)
    with pytest.raises(ConfigError, match="served models"):
        plan_workers(
            _cfg("seallm", 2, services=[{"name": A, "model": A}]), [A, B], placer=history_placement
        )
    with pytest.raises(ConfigError, match="serves"):
        bad = [{"name": A, "model": B}, {"name": B, "model": B}]
        plan_workers(_cfg("seallm", 2, services=bad), [A, B], placer=history_placement)
    with pytest.raises(UnknownNameError):
        plan_workers(
            _cfg("llumnix", 2, services=[{"name": A, "model": A}]), [A], placer=history_placement
        )
    # the tiny models' KV does not fit next to their weights in 40 MiB
    with pytest.raises(ConfigError):
        plan_workers(_cfg("seallm", 2, mb=40), [A, B], placer=history_placement)
    # the sharing placement is the simulator's: the caller injects it
    with pytest.raises(ConfigError, match="placer="):
        plan_workers(_cfg("seallm", 2), [A, B])
    # a tensor-parallel degree the runtime does not run is an error, never ignored
    with pytest.raises(ConfigError, match=r"cluster\.tp is 2"):
        plan_workers(_cfg("vllm", 2, cluster={"tp": 2}), [A, B])


def test_example_configs_plan() -> None:
    sharing = load_serve_config(str(CONFIGS / "serve-sharing.yaml"), [])
    workers = plan_workers(sharing, list(sharing.serve.models or ()), placer=history_placement)
    assert len(workers) == 2 and all(set(w) == {A, B} for w in workers)
    mell = load_serve_config(str(CONFIGS / "serve-mell.yaml"), [])
    assert mell.cluster.elastic and resolve_policies(mell)["dispatch"] == "mell"
    assert plan_workers(mell, [A]) == [(A,)] * 3


def test_a_sharing_worker_runs_the_stacks_group_scheduler_with_the_placers_stats() -> None:
    """Each worker of a sharing stack gets the stack's scheduler and the
    statistics the placer computed for its services (the simulator's
    ``service_stats`` over the history); its engine then runs job by job. A
    scheduler that reads statistics where none are computed is refused."""
    from fleetserve.policy.sharing import DoublingBudget
    from fleetserve.runtime import cluster
    from fleetserve.runtime.worker import WorkerCore

    cfg = _cfg("seallm", 1)
    specs = cluster.worker_specs(cfg, cluster.served_models(cfg), placer=history_placement)
    (spec,) = specs
    assert spec.batching == "db" and set(spec.served) == {A, B}
    stats = dict(spec.services)
    assert set(stats) == {A, B}
    assert all(st.exec_mean_s > 0 and st.rate > 0 for st in stats.values())
    eng = WorkerCore(spec).engine
    assert isinstance(eng.group, DoublingBudget)
    assert eng.group.services == stats
    one = config_from_dict(
        serve_config_dict(
            {
                "serve": {"workers": 1, "gpu_memory_mb": 48, "models": [A]},
                "policy": {"stack": "wf", "batching": "db"},
            }
        )
    )
    with pytest.raises(ConfigError, match="statistics"):
        cluster.worker_specs(one, cluster.served_models(one))
    # a group scheduler prefills whole prompts: chunked prefill is refused,
    # not ignored (the simulated group refuses it too)
    chunked = _cfg("seallm", 1, engine={"chunked_prefill": True})
    with pytest.raises(ConfigError, match="chunked_prefill"):
        cluster.worker_specs(chunked, cluster.served_models(chunked), placer=history_placement)


def test_serve_engines_read_the_simulators_engine_keys() -> None:
    """``engine.chunked_prefill`` and ``engine.prefix_caching`` reach every
    worker's engine (one key for both clocks); the snapshot reports the
    prefix cache's counters; KunServe refuses prefix caching; an elastic
    pool's workers start asleep."""
    from fleetserve.runtime import cluster
    from fleetserve.runtime.engine.sampling import SamplingParams
    from fleetserve.runtime.worker import WorkerCore

    def one(**extra: Any) -> SimConfig:
        data: dict[str, Any] = {"serve": {"workers": 1, "gpu_memory_mb": 48, "models": [A]}}
        data.update(extra)
        return config_from_dict(serve_config_dict(data))

    cfg = one(engine={"chunked_prefill": True, "prefix_caching": True, "watermark": 0.05})
    (spec,) = cluster.worker_specs(cfg, cluster.served_models(cfg))
    assert spec.chunked_prefill and spec.prefix_caching and not spec.asleep
    assert spec.watermark == 0.05  # engine.watermark too (session 25; it was ignored)
    core = WorkerCore(spec)
    assert core.engine.chunked_prefill and core.engine.prefix_caching
    assert core.engine.watermark == 0.05 and core.engine.watermark_pages() > 0
    text = "shared words " * 8
    for i, p in enumerate([text + "one", text + "two"]):
        ids = core.engine.tokenizer(A).encode(p)
        core.submit(i, A, ids, SamplingParams(max_tokens=2, ignore_eos=True))
        while core.has_work():
            core.step()
    snap = core.snapshot()
    prompt, hit = snap.prefix_tokens
    assert prompt > 0 and hit >= 16 * (len(text) // 16 - 1)
    # the controller's view leaves the watermark out of the available blocks
    from fleetserve.runtime.views import LiveInstance

    assert snap.watermark_blocks == core.engine.watermark_pages() > 0
    view = LiveInstance(0, 0, A, snap)
    per = snap.pages_per_block[A]
    assert view.available_blocks == view.free_blocks - view.reserved_blocks - (
        snap.watermark_blocks // per
    )
    with pytest.raises(ConfigError, match="prefix_caching"):
        k = one(policy={"stack": "kunserve"}, engine={"prefix_caching": True})
        cluster.worker_specs(k, cluster.served_models(k))
    el = one(cluster={"elastic": True})
    (spec,) = cluster.worker_specs(el, cluster.served_models(el))
    core = WorkerCore(spec)
    assert spec.asleep and core.snapshot().asleep and core.snapshot().weight_bytes == 0
    assert core.activate() > 0 and not core.snapshot().asleep and core.activate() == 0.0
    assert core.deactivate() and core.snapshot().asleep


def test_a_released_worker_sleeps_once_its_last_request_left(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A release can reach a worker before the call that takes its last
    request away (a move's release of the source, an abort): the worker
    sleeps as soon as that request left, and an activation that comes
    meanwhile wins (it stays awake). Found in CI: Mell released a worker
    while a request paused for a move was still on it, and it kept its
    weights. A release that waits too long logs the requests that stay."""
    from fleetserve.runtime import cluster
    from fleetserve.runtime import worker as worker_mod
    from fleetserve.runtime.engine.sampling import SamplingParams
    from fleetserve.runtime.worker import SLEEP_RETRY_S, Worker

    # a release still waiting after SLEEP_WARN_S says which requests stay
    monkeypatch.setattr(worker_mod, "SLEEP_WARN_S", 1.5 * SLEEP_RETRY_S)
    data: dict[str, Any] = {"serve": {"workers": 1, "gpu_memory_mb": 48, "models": [A]}}
    cfg = config_from_dict(serve_config_dict(data))
    (spec,) = cluster.worker_specs(cfg, cluster.served_models(cfg))
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def scenario() -> tuple[bool, bool, bool, bool]:
        w = Worker(spec)  # the actor's class, driven without Ray (no step loop)
        try:
            ids = w.core.engine.tokenizer(A).encode("a request still here")
            await w.submit(1, A, ids, params, 0.0)
            pending = asyncio.ensure_future(w.deactivate())
            await asyncio.sleep(3 * SLEEP_RETRY_S)
            waited = not pending.done() and not w.core.engine.asleep
            await w.abort(1)  # the request leaves: the worker sleeps
            slept = await asyncio.wait_for(pending, 10) and w.core.engine.asleep
            await w.activate()
            await w.submit(2, A, ids, params, 0.0)
            pending = asyncio.ensure_future(w.deactivate())
            await asyncio.sleep(3 * SLEEP_RETRY_S)
            await w.activate()  # activated again before the request left
            kept = not await asyncio.wait_for(pending, 10)
            return waited, slept, kept, not w.core.engine.asleep
        finally:
            await w.stop()
            w._thread.shutdown(wait=True)

    assert asyncio.run(scenario()) == (True, True, True, True)
    warned = [r.getMessage() for r in caplog.records if "still here" in r.getMessage()]
    assert warned and "[1]" in warned[0]


# ------------------------------------------------------------------ end to end


def _sampler(fn: Callable[[], Any], out: list[Any], stop: threading.Event) -> threading.Thread:
    """Call ``fn`` every 10 ms until ``stop`` (reads controller state from
    another thread: a dict changing size mid-read is simply retried)."""

    def run() -> None:
        while not stop.is_set():
            with contextlib.suppress(RuntimeError):
                out.append(fn())
            time.sleep(0.01)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def _complete(url: str, model: str, prompt: str, n: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body | {"ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.slow
def test_multi_model_workers_serve_both_models_exactly() -> None:
    data = {
        "serve": {"workers": 2, "gpu_memory_mb": 64, "models": [A, B]},
        "policy": {"stack": "seallm"},
        "workload": {"synthetic_duration_s": 20.0, "length_scale": 0.1},
        # SeaLLM re-places every interval (1 s here, the bound's least)
        "multi": {"history_s": 20.0, "replacement_interval_s": 1.0, "min_interval_s": 1.0},
    }
    jobs = [(A, "Sharing one GPU", 24), (B, "Two models, one arena", 24)] * 2
    with running_server(data) as srv:
        ctl = srv.controller
        info = httpx.get(srv.url + "/v1/cluster").json()
        assert info["policies"]["stack"] == "seallm"
        assert info["policies"]["placement"] == "seallm"
        assert info["policies"]["batching"] == "db"  # SeaLLM's scheduler, in each engine
        assert all(set(w["models"]) == {A, B} for w in info["workers"])
        seen: list[set[tuple[int, str]]] = []
        stop = threading.Event()
        th = _sampler(
            lambda: {
                (ctl.inst_of[t.instance][0], t.model)
                for t in list(ctl.requests.values())
                if t.instance is not None
            },
            seen,
            stop,
        )
        with ThreadPoolExecutor(len(jobs)) as ex:
            outs = list(ex.map(lambda j: _complete(srv.url, *j), jobs))
        stop.set()
        th.join()
        for (model, prompt, n), out in zip(jobs, outs, strict=True):
            assert out["model"] == model
            assert out["usage"]["completion_tokens"] == n
            assert out["choices"][0]["text"] == reference_text(model, prompt, n)
        ran = set().union(*seen)
        # some worker ran requests of both models
        assert any((w, A) in ran and (w, B) in ran for w in ctl.workers)
        metrics = httpx.get(srv.url + "/metrics").text
        for m in (A, B):
            done = metric_value(metrics, "fleetserve_requests_total", model=m, outcome="finished")
            assert done == 2
        # an interval ended with requests in it: measured, searched (kept or switched)
        deadline = time.monotonic() + 30
        searched = 0.0
        while searched < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            metrics = httpx.get(srv.url + "/metrics").text
            searched = sum(
                metric_value(metrics, "fleetserve_replacements_total", outcome=o)
                for o in ("unchanged", "switched")
            )
        assert searched >= 1
        rep = httpx.get(srv.url + "/v1/cluster").json()["replacement"]
        assert any(e["history_requests"] for e in rep["events"])


@pytest.mark.slow
def test_mell_activates_workers_under_load_and_releases_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = {
        "serve": {"workers": 3, "gpu_memory_mb": 16, "models": [A], "max_running": 16},
        "cluster": {"elastic": True},
        "policy": {"stack": "mell"},
        "migration": {"epoch_s": 0.2},
    }
    # four prompts of ~400 tokens (25 blocks each): more KV than one worker's ~78 blocks
    prompts = [f"{i}: " + "the elastic pool grows and shrinks. " * 11 for i in range(4)]
    n = 32
    with running_server(data) as srv:
        ctl = srv.controller
        info = httpx.get(srv.url + "/v1/cluster").json()
        assert info["elastic"] and info["policies"]["dispatch"] == "mell"
        assert all(w["active"] == [] for w in info["workers"])  # nothing active at start
        # an inactive worker holds no weights and no arena
        assert all(w["asleep"] and w["memory"]["weight_bytes"] == 0 for w in info["workers"])
        active: list[int] = []
        stop = threading.Event()
        th = _sampler(lambda: len(ctl.active), active, stop)
        with ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(lambda p: _complete(srv.url, A, p, n), prompts))
        for p, out in zip(prompts, outs, strict=True):
            assert out["choices"][0]["text"] == reference_text(A, p, n)
        assert max(active) >= 2  # Mell activated more than one worker
        # once every request departed, Mell's epochs release the empty workers
        deadline = time.monotonic() + 10
        while ctl.active and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        th.join()
        assert not ctl.active
        info = httpx.get(srv.url + "/v1/cluster").json()
        assert all(w["active"] == [] for w in info["workers"])
        assert info["requests_in_flight"] == 0
        # each activation loaded its worker's weights (timed); each release gave them back
        text = httpx.get(srv.url + "/metrics").text
        woke = metric_value(text, "fleetserve_worker_activation_seconds_count")
        assert woke >= 2
        assert metric_value(text, "fleetserve_worker_activation_seconds_sum") > 0
        deadline = time.monotonic() + 10
        while metric_value(text, "fleetserve_worker_sleeps_total") < woke:
            assert time.monotonic() < deadline, "released workers kept their weights"
            time.sleep(0.05)
            text = httpx.get(srv.url + "/metrics").text


@pytest.mark.slow
def test_a_worker_runs_adbs_jobs_at_once_on_their_shares_exactly() -> None:
    """MuxServe's spatial sharing at runtime: one worker hosts both models with
    two threads, and ADBS's prefill and decode jobs of one scheduling point run
    at once, one thread each (``fleetserve_group_jobs_total{mode="at_once"}``);
    every output equals the reference engine's."""
    data = {
        "serve": {
            "workers": 1,
            "gpu_memory_mb": 64,
            "models": [A, B],
            "threads_per_worker": 2,
            "spatial_shares": True,
        },
        "policy": {"stack": "muxserve"},
        "workload": {"synthetic_duration_s": 20.0, "length_scale": 0.1},
    }
    jobs = [(A, "Spatial shares", 20), (B, "of one worker's threads", 20)] * 3
    with running_server(data) as srv:
        info = httpx.get(srv.url + "/v1/cluster").json()
        assert info["policies"]["batching"] == "adbs"
        assert all(set(w["models"]) == {A, B} for w in info["workers"])
        with ThreadPoolExecutor(len(jobs)) as ex:
            outs = list(ex.map(lambda j: _complete(srv.url, *j), jobs))
        for (model, prompt, n), out in zip(jobs, outs, strict=True):
            assert out["choices"][0]["text"] == reference_text(model, prompt, n)
        deadline = time.monotonic() + 10
        at_once = 0.0
        while at_once < 1 and time.monotonic() < deadline:  # the last report may lag
            metrics = httpx.get(srv.url + "/metrics").text
            at_once = metric_value(metrics, "fleetserve_group_jobs_total", mode="at_once")
            time.sleep(0.1)
        assert at_once >= 1
        assert metric_value(metrics, "fleetserve_group_jobs_total", mode="alone") >= 1


def test_what_the_runtime_does_not_run_of_a_stack_is_said() -> None:
    """The runtime runs a multi-LLM stack's group scheduler one job at a
    time: each part it does not run is listed (and logged when served), none
    silently."""
    assert runtime_gaps(get_stack("alpaserve")) == []
    assert runtime_gaps(get_stack("seallm")) == []  # re-placement runs (runtime.replace)
    gaps = runtime_gaps(get_stack("fleet"))
    assert len(gaps) == 3
    for words in ("elastic", "'adaptive'", "'kunserve'"):
        assert any(words in g for g in gaps), words
    assert any("spatial sharing ('adbs')" in g for g in runtime_gaps(get_stack("muxserve")))
    on = runtime_gaps(get_stack("muxserve"), threads=2, spatial_shares=True)
    assert on == []  # jobs at once on their shares
    off = runtime_gaps(get_stack("muxserve"), threads=2)
    assert len(off) == 1 and "serve.spatial_shares is off" in off[0]


def test_the_runtime_replanner_is_the_simulators_search_on_a_window() -> None:
    """What the runtime asks at a re-placement: the simulator's SeaLLM search
    on the requests of the last interval (their rates and lengths), on the
    running workers, with its estimate and the statistics the schedulers
    read; and each request's ideal time (the base of its SLO)."""
    from fleetserve.sim.multi_build import RuntimeReplanner
    from fleetserve.workload.request import Request

    cfg = _cfg("seallm", 2)
    sp = sharing_placement(cfg, [A, B], placer=history_placement)
    rp = RuntimeReplanner(sp.stack, sp.config, sp.gpu, sp.services, 2)
    window = [Request(i, B if i % 4 else A, 0.5 * i, 40 + i, 10) for i in range(40)]
    plan, est, stats = rp.place(window, 20.0)
    assert plan.n_gpus == 2 and est is not None and 0.0 <= est <= 1.0
    assert {s for g in plan.groups for s in g.services} == {A, B}
    assert set(stats) == {A, B}
    assert stats[B].rate == pytest.approx(30 / 20.0)  # measured on the window
    assert rp.ideal_s(A, 100, 20) > rp.ideal_s(A, 100, 5) > 0
