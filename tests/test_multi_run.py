"""Multi-LLM stacks end to end: config sections, placement on a history, the
run, replacement re-searching on the last interval, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleetserve.cli.main import main
from fleetserve.config import config_from_dict
from fleetserve.errors import ConfigError, FleetserveError
from fleetserve.policy.catalog import MULTI, stack_for, stacks_in
from fleetserve.sim.build import build_workload
from fleetserve.sim.multi import ReplacementConfig
from fleetserve.sim.multi_run import MultiRunSettings, run_multi_stack, services_from_window
from fleetserve.spec import get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service


def _requests(seconds: float, seed: int, names: list[str], rate: float) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    t = rng.exponential(1 / rate)
    while t < seconds:
        out.append((t, names[int(rng.integers(len(names)))], int(rng.integers(32, 1500))))
        t += rng.exponential(1 / rate)
    return [
        Request(i, m, a, p, int(rng.integers(1, 300))) for i, (a, m, p) in enumerate(sorted(out))
    ]


SERVICES = {
    "a": Service("a", get_model("llama-2-7b"), 2.0, 700, 150),
    "b": Service("b", get_model("llama-2-13b"), 2.0, 700, 150),
    "c": Service("c", get_model("opt-6.7b"), 2.0, 700, 150),
}


@pytest.mark.parametrize("stack", sorted(stacks_in(MULTI)))
def test_every_stack_places_runs_and_ends_every_request_once(stack: str) -> None:
    names = sorted(SERVICES)
    history = _requests(15.0, 1, names, 3.0)
    run = _requests(30.0, 2, names, 3.0)
    settings = MultiRunSettings(
        gpu="a100-80gb",
        n_gpus=4,
        replacement=ReplacementConfig(initial_interval_s=10.0, min_interval_s=5.0),
        processes=1,
        check_integrity=True,
    )
    res = run_multi_stack(stack, SERVICES, history, run, settings)
    assert all(r.status == "finished" for r in res.records)
    assert res.extra["stack"]["name"] == stack
    searches = res.extra["placement_search_s"]
    if stack_for(stack, MULTI).replacement:
        rep = res.extra["replacement"]
        assert rep["replacements"] >= 2  # at 10 s, then adapted (>= 5 s), before 30 s
        assert len(searches) == 1 + sum(1 for e in rep["events"] if e["history_requests"])
    else:
        assert "replacement" not in res.extra and len(searches) == 1


def test_the_configs_family_overrides_reach_the_run() -> None:
    """``policy.batching`` and ``policy.placement`` override a multi-LLM stack's
    group scheduler and placement (they were read by no one before session 25:
    an unknown name passed, a known one was ignored), checked against their
    registries with suggestions."""
    from fleetserve.errors import UnknownNameError
    from fleetserve.policy.catalog import with_family_overrides
    from fleetserve.sim.group import SharingGroup
    from fleetserve.sim.multi_build import multi_preflight, multi_settings

    mux = stack_for("muxserve", MULTI)
    assert with_family_overrides(mux) is mux
    got = with_family_overrides(mux, batching="fcfs", placement="dedicated")
    assert (got.batching, got.placement, got.layout) == ("fcfs", "dedicated", mux.layout)
    with pytest.raises(UnknownNameError, match="fcfs"):
        with_family_overrides(mux, batching="fcsf")
    with pytest.raises(UnknownNameError, match="dedicated"):
        with_family_overrides(mux, placement="dedicate")
    data: dict[str, Any] = {
        "services": [{"name": "a", "model": "llama-2-7b"}],
        "cluster": {"gpus": 2, "elastic": False},
        "policy": {"stack": "muxserve", "batching": "fcfs", "placement": "dedicated"},
    }
    cfg = config_from_dict(data)
    settings = multi_settings(cfg)
    assert (settings.batching, settings.placement) == ("fcfs", "dedicated")
    with pytest.raises(UnknownNameError, match="placement"):
        multi_preflight(
            config_from_dict({**data, "policy": {"stack": "muxserve", "placement": "x"}})
        )
    names = sorted(SERVICES)
    seen: set[str] = set()
    orig = SharingGroup.__init__

    def spy(self: SharingGroup, *a: Any, **k: Any) -> None:
        orig(self, *a, **k)
        seen.add(type(self.scheduler).__name__)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SharingGroup, "__init__", spy)
        res = run_multi_stack(
            "muxserve",
            SERVICES,
            _requests(10.0, 1, names, 3.0),
            _requests(10.0, 2, names, 3.0),
            MultiRunSettings(gpu="a100-80gb", n_gpus=4, batching="fcfs", placement="dedicated"),
        )
    assert res.extra["stack"]["scheduler"] == "fcfs"
    assert res.extra["stack"]["placement"] == "dedicated"
    assert seen == {"GroupFcfs"}


def test_services_from_window_measures_rates_and_keeps_idle_services_placeable() -> None:
    win = [Request(0, "a", 1.0, 100, 10), Request(1, "a", 2.0, 300, 30)]
    out = services_from_window(SERVICES, win, 10.0)
    assert out["a"].rate == pytest.approx(0.2)
    assert out["a"].mean_prompt == pytest.approx(200) and out["a"].mean_output == pytest.approx(20)
    assert out["b"].rate == pytest.approx(0.05)  # half a request per window
    assert out["b"].mean_prompt == SERVICES["b"].mean_prompt


def _cfg(tmp_path: Path, extra: str = "") -> Path:
    trace = tmp_path / "t.jsonl"
    rng = np.random.default_rng(0)
    t = 0.0
    with trace.open("w") as f:
        for _ in range(300):
            t += float(rng.exponential(0.25))
            row = {"arrival_s": t, "prompt_tokens": 200, "output_tokens": 50}
            f.write(json.dumps(row) + "\n")
    p = tmp_path / "cfg.yaml"
    p.write_text(
        "services:\n"
        "  - {name: chat, model: llama-2-7b}\n"
        "  - {name: code, model: opt-6.7b}\n"
        f"workload: {{trace: {trace}, format: jsonl}}\n"
        "cluster: {gpu: a100-80gb, gpus: 2}\n"
        "multi: {history_s: 20, replacement_interval_s: 15, processes: 1}\n" + extra
    )
    return p


def test_compare_runs_multi_llm_stacks_from_a_services_config(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    out = tmp_path / "out"
    rc = main(["compare", str(cfg), "--stacks", "vllm,seallm", "--out", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads((out / "seallm" / "summary.json").read_text())
    assert set(s["services"]) == {"chat", "code"}
    assert s["stack"]["scheduler"] == "db" and s["replacement"]["replacements"] >= 1
    assert s["workload"]["requests"] == s["requests"]["total"]
    v = json.loads((out / "vllm" / "summary.json").read_text())
    groups = v["config"]["placement"]["groups"]
    assert sorted(g["services"][0] for g in groups) == ["chat", "code"]


def test_history_and_run_are_split_at_history_s(tmp_path: Path) -> None:
    from fleetserve.config import load_config

    cfg = config_from_dict(load_config(_cfg(tmp_path)))
    wl = build_workload(cfg)
    assert wl.history and wl.services is not None
    assert max(r.arrival_s for r in wl.history) < 20.0
    assert wl.requests[0].arrival_s >= 0.0 and [r.id for r in wl.requests] == list(
        range(len(wl.requests))
    )
    assert len(wl.history) + len(wl.requests) == 300
    rate = sum(s.rate for s in wl.services.values())
    assert rate == pytest.approx(len(wl.history) / 20.0)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"services": [{"name": "a", "model": "llama-2-7b"}]}, "cluster.gpus"),
        (
            {
                "services": [
                    {"name": "a", "model": "llama-2-7b"},
                    {"name": "a", "model": "opt-6.7b"},
                ],
                "cluster": {"gpus": 2},
            },
            "duplicate",
        ),
        (
            {
                "services": [{"name": "a", "model": "llama-2-7b"}],
                "multi": {"generator": "seallm"},
                "cluster": {"gpus": 2},
            },
            "leave out",
        ),
        ({"multi": {"generator": "alpaca"}, "cluster": {"gpus": 2}}, "multi.generator"),
        ({"multi": {"rate": -1}}, "multi.rate"),
    ],
)
def test_bad_multi_configs_are_clear_errors(data: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_dict(data)


def test_unknown_multi_stack_and_unknown_service_names_are_clear(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    out = tmp_path / "o"
    assert main(["simulate", str(cfg), "--stack", "sealm", "--out", str(out)]) != 0
    bad = _cfg(tmp_path, "")
    text = bad.read_text().replace("format: jsonl}", "format: jsonl, models: [chat, nope]}")
    bad.write_text(text)
    from fleetserve.config import load_config

    with pytest.raises(FleetserveError, match="nope"):
        build_workload(config_from_dict(load_config(bad)))


@pytest.mark.parametrize("stack", ["vllm", "muxserve", "seallm"])
@pytest.mark.parametrize("sizes", [(1,), (2,), (2, 4)])
def test_tp_sizes_bound_every_placement(stack: str, sizes: tuple[int, ...]) -> None:
    """``multi.tp_sizes``: every group of every placement has an allowed size, and a
    dedicated service takes the smallest allowed one it fits on."""
    from fleetserve.policy.catalog import stack_for as _stack
    from fleetserve.sim.multi_run import place_for_stack

    names = sorted(SERVICES)
    history = _requests(15.0, 1, names, 3.0)
    settings = MultiRunSettings(gpu="a100-80gb", n_gpus=8, processes=1, tp_sizes=sizes)
    plan, _ = place_for_stack(_stack(stack, MULTI), SERVICES, history, settings)
    assert plan.groups and all(g.tp in sizes for g in plan.groups)
    if stack == "vllm":
        assert {g.tp for g in plan.groups} == {min(sizes)}


def test_tp_sizes_that_fit_no_service_are_a_clear_error() -> None:
    from fleetserve.policy.group_placement import dedicated_place
    from fleetserve.spec import get_gpu

    big = [Service("x", get_model("llama-3.1-70b"), 1.0, 500, 100)]
    with pytest.raises(ConfigError, match="no allowed tensor-parallel size"):
        dedicated_place(big, 8, get_gpu("a100-80gb"), 0.9, (1,))
    with pytest.raises(ConfigError, match="powers of two"):
        config_from_dict({"multi": {"tp_sizes": [3]}})


def test_keep_models_replays_a_trace_with_its_services(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"arrival_s": i * 0.5, "prompt_tokens": 100, "output_tokens": 10, "model": "ab"[i % 2]}
        for i in range(80)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    base: dict[str, Any] = {
        "cluster": {"gpu": "a100-80gb", "gpus": 2, "elastic": False},
        "services": [{"name": "a", "model": "llama-2-7b"}, {"name": "b", "model": "opt-6.7b"}],
        "workload": {"trace": str(trace), "format": "jsonl", "keep_models": True},
        "multi": {"history_s": 10},
    }
    wl = build_workload(config_from_dict(base))
    assert [r.model for r in wl.requests[:4]] == ["a", "b", "a", "b"]
    bad = {**base, "services": [{"name": "a", "model": "llama-2-7b"}]}
    with pytest.raises(ConfigError, match="not services"):
        build_workload(config_from_dict(bad))
    with pytest.raises(ConfigError, match=r"leave out workload\.models"):
        config_from_dict({**base, "workload": {**base["workload"], "models": ["a"]}})
