"""``fleetserve plan``: search logic, bounds, checks, determinism, replay."""

from __future__ import annotations

import csv
import json
import math
import random
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.cli.main import main
from fleetserve.errors import ConfigError, FleetserveError, InputError
from fleetserve.experiments.plan.bounds import nearest_rank
from fleetserve.experiments.plan.evaluate import EvalTask, evaluate, judge
from fleetserve.experiments.plan.report import write_plan
from fleetserve.experiments.plan.run import run_plan
from fleetserve.experiments.plan.search import (
    Combo,
    Point,
    brute_force_search,
    drive,
    point_key,
    stack_search,
)
from fleetserve.experiments.plan.spec import load_plan
from fleetserve.experiments.plan.traffic import build_traffic
from fleetserve.metrics.records import RequestRecord

# ----------------------------------------------------------------------------- search logic


def _run_sync(gen: Any, feasible: Any) -> Any:
    try:
        p = next(gen)
        while True:
            p = gen.send(feasible(p))
    except StopIteration as stop:
        return stop.value


@st.composite
def _stack(draw: Any) -> tuple[list[Combo], dict[tuple[str, int], int]]:
    """Combos with monotone feasibility thresholds and lower bounds at or below them."""
    n = draw(st.integers(1, 5))
    max_gpus = draw(st.integers(1, 24))
    combos, thresholds = [], {}
    for i in range(n):
        gpu = f"g{i}"
        price = draw(st.sampled_from([0.5, 1.0, 1.3, 2.0, 3.0]))
        step = draw(st.sampled_from([1, 1, 2, 4]))
        thr = draw(st.integers(1, 30))  # > max_gpus: never feasible
        lb = draw(st.integers(1, thr))
        combos.append(Combo("s", gpu, 1, price, lb, max_gpus, order=i, step=step))
        thresholds[(gpu, 1)] = thr
    return combos, thresholds


@settings(max_examples=300, deadline=None)
@given(_stack())
def test_pruned_bisection_finds_what_brute_force_finds(
    case: tuple[list[Combo], dict[tuple[str, int], int]],
) -> None:
    combos, thr = case

    def feasible(p: Point) -> bool:
        return p.n_gpus >= thr[(p.gpu, p.tp)]

    fast = _run_sync(stack_search(combos), feasible)
    slow = _run_sync(brute_force_search(combos), feasible)
    assert (fast.best is None) == (slow.best is None)
    if slow.best is not None:
        assert point_key(fast.best) == point_key(slow.best)
    # never simulated below a lower bound, nor above max_gpus
    for p, _ok in fast.evaluated:
        c = next(c for c in combos if c.gpu == p.gpu)
        assert c.lower_bound <= p.n_gpus <= c.max_gpus and p.n_gpus % c.step == 0
    assert len(fast.evaluated) <= len(slow.evaluated)


def test_pruning_skips_a_combo_whose_bound_costs_more() -> None:
    cheap = Combo("s", "a", 1, 1.0, 2, 10, order=0)
    dear = Combo("s", "b", 1, 5.0, 1, 10, order=1)  # 5 $/h at its bound > 2 $/h
    res = _run_sync(stack_search([cheap, dear]), lambda p: p.n_gpus >= 2)
    assert res.best == cheap.point(2)
    assert [c for c, _ in res.pruned] == [dear]
    assert all(p.gpu == "a" for p, _ in res.evaluated)


def test_drive_is_deterministic_under_any_completion_order() -> None:
    combos = {
        name: [Combo(name, f"g{i}", 1, 1.0 + i, 1 + i, 16, order=i) for i in range(3)]
        for name in ("x", "y", "z")
    }
    thr = {"x": 5, "y": 9, "z": 3}

    def feasible(p: Point) -> bool:
        return p.n_gpus >= thr[p.stack] + (p.gpu == "g0")

    def sync(p: Point) -> Future[bool]:
        f: Future[bool] = Future()
        f.set_result(feasible(p))
        return f

    base = drive({n: stack_search(c) for n, c in combos.items()}, sync, bool)
    rng = random.Random(0)
    with ThreadPoolExecutor(4) as ex:

        def jittered(p: Point) -> bool:
            time.sleep(rng.random() * 0.002)
            return feasible(p)

        other = drive(
            {n: stack_search(c) for n, c in combos.items()},
            lambda p: ex.submit(jittered, p),
            bool,
        )
    for n in combos:
        a, b = base.results[n], other.results[n]
        assert a is not None and b is not None
        assert a.best == b.best and a.evaluated == b.evaluated


def test_drive_simulates_a_point_once_and_honours_the_deadline() -> None:
    c = Combo("s", "g", 1, 1.0, 1, 8)
    calls: list[Point] = []

    def submit(p: Point) -> Future[bool]:
        calls.append(p)
        f: Future[bool] = Future()
        f.set_result(p.n_gpus >= 3)
        return f

    # two searches asking for the same points: simulated once
    out = drive({"a": stack_search([c]), "b": stack_search([c])}, submit, bool)
    assert len(calls) == len(set(calls))
    assert out.results["a"].best == out.results["b"].best == c.point(3)  # type: ignore[union-attr]
    # a deadline already past: nothing starts, the search is reported as cut
    cut = drive({"a": stack_search([c])}, submit, bool, deadline=0.0, clock=lambda: 1.0)
    assert cut.results["a"] is None and cut.cut == ["a"]


# ----------------------------------------------------------------------------- judging


def _rec(i: int, model: str, ttft: float | None, status: str = "finished") -> RequestRecord:
    r = RequestRecord(id=i, model=model, arrival_s=0.0, prompt_tokens=10, output_tokens=4)
    r.status = status  # type: ignore[assignment]
    if status == "finished":
        assert ttft is not None
        r.first_token_s = ttft
        r.finish_s = ttft + 0.3
        r.generated = 4
        r.ideal_s = 0.1
    return r


def test_lost_requests_count_as_infinite_latency(tmp_path: Path) -> None:
    assert nearest_rank([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert nearest_rank([1.0] * 99 + [math.inf], 0.99) == 1.0
    assert nearest_rank([1.0] * 98 + [math.inf] * 2, 0.99) == math.inf
    spec, _ = load_plan(_tiny(tmp_path))
    recs = [_rec(i, "a", 0.5) for i in range(98)] + [
        _rec(98, "a", None, "rejected"),
        _rec(99, "a", None, "unfinished"),
    ]
    res = judge(spec, recs)["a"]
    assert res.lost == 2 and res.ttft_p99_s == math.inf and not res.meets


# ----------------------------------------------------------------------------- real plans


def _tiny(tmp_path: Path, edit: Callable[[Any], object] | None = None, **extra: Any) -> Path:
    """Two small services, one GPU type, two stacks, a few GPUs at most; ``extra``
    replaces top-level keys, then ``edit`` may change the plan dict in place."""
    plan: dict[str, Any] = {
        "duration_s": 60,
        "history_s": 20,
        "seed": 0,
        "services": [
            {
                "name": "a",
                "model": "llama-3.1-8b",
                "traffic": {"rate": 3.0, "prompt_tokens": 400, "output_tokens": 40},
                "slo": {"ttft_p99_s": 0.5, "tpot_p99_s": 0.05},
            },
            {
                "name": "b",
                "model": "qwen-2.5-14b",
                "traffic": {"curve": [[0, 1.0], [80, 3.0]], "lengths": "azure-conv"},
                "slo": {"e2e_p99_s": 30.0},
            },
        ],
        "gpus": [{"name": "a100-80gb"}, {"name": "l4-24gb", "price_per_hour": 0.4}],
        "search": {
            "stacks": ["vllm", "muxserve"],
            "tp": [1, 2],
            "max_gpus": 4,
            "jobs": 1,
            "robustness_seeds": [1],
            "headroom_steps": 2,
        },
    }
    plan.update(extra)
    if edit is not None:
        edit(plan)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("plan")
    spec, base = load_plan(_tiny(d))
    fast = run_plan(spec, base)
    brute = run_plan(replace(spec, search=replace(spec.search, brute_force=True)), base)
    again = run_plan(spec, base)
    out = d / "out"
    write_plan(fast, out)
    return {"spec": spec, "base": base, "fast": fast, "brute": brute, "again": again, "out": out}


def test_bisection_and_brute_force_agree_on_a_small_plan(tiny_runs: dict[str, Any]) -> None:
    fast, brute = tiny_runs["fast"], tiny_runs["brute"]
    assert fast.chosen is not None
    assert brute.chosen == fast.chosen
    for name in ("vllm", "muxserve"):
        assert fast.searches[name].best == brute.searches[name].best
    assert len(fast.outcomes) < len(brute.outcomes)


def test_the_same_plan_gives_the_same_answer(tiny_runs: dict[str, Any]) -> None:
    a, b = tiny_runs["fast"], tiny_runs["again"]
    assert a.chosen == b.chosen and a.headroom == b.headroom
    assert {p: o.services for p, o in a.outcomes.items()} == {
        p: o.services for p, o in b.outcomes.items()
    }


def test_two_processes_give_the_answer_of_one(tiny_runs: dict[str, Any]) -> None:
    spec, base, one = tiny_runs["spec"], tiny_runs["base"], tiny_runs["fast"]
    two = run_plan(replace(spec, search=replace(spec.search, jobs=2)), base)
    assert two.chosen == one.chosen and two.headroom == one.headroom
    assert {p: o.services for p, o in two.outcomes.items()} == {
        p: o.services for p, o in one.outcomes.items()
    }


def test_nothing_below_a_lower_bound_is_feasible(tiny_runs: dict[str, Any]) -> None:
    spec, base, res = tiny_runs["spec"], tiny_runs["base"], tiny_runs["fast"]
    for combos in res.combos.values():
        for c in combos:
            lo, _ = c.units
            if lo > 1:
                o = evaluate(EvalTask(spec, base, c.point(lo - 1), spec.seed))
                assert not o.meets


def test_outputs_and_replay(tiny_runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    out: Path = tiny_runs["out"]
    doc = json.loads((out / "plan.json").read_text())
    for f in ("report.md", "frontier.png", "chosen.yaml", "traffic.jsonl"):
        assert (out / f).stat().st_size > 0
    ch = doc["chosen"]
    assert ch["meets_slos"] and ch["cost_per_hour"] == pytest.approx(ch["gpus"] * 1.30)
    assert set(ch["services"]["a"]["margins"]) == {"ttft_p99_s", "tpot_p99_s"}
    assert all(m >= 1 for s in ch["services"].values() for m in s["margins"].values())
    assert doc["frontier"][0]["cost_per_hour"] == ch["cost_per_hour"]
    assert set(doc["per_stack"]) == {"vllm", "muxserve"}
    # the replay command reproduces the chosen point's figures exactly
    monkeypatch.chdir(out)
    assert main(["simulate", "chosen.yaml", "--out", "replay", "--no-progress"]) == 0
    with (out / "replay" / "requests.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    for svc in ("a", "b"):
        ttft = [
            float(r["first_token_s"]) - float(r["arrival_s"]) if r["first_token_s"] else math.inf
            for r in rows
            if r["model"] == svc
        ]
        assert nearest_rank(ttft, 0.99) == ch["services"][svc]["ttft_p99_s"]


def test_one_service_plans_compare_the_one_model_stacks_and_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one service, Mell, Llumnix and KunServe join (their own simulators);
    whichever stack is chosen, its replay reproduces the plan's figures."""

    def one_service(plan: dict[str, Any]) -> None:
        plan["services"] = plan["services"][:1]
        plan["services"][0]["traffic"]["rate"] = 6.0
        plan["search"]["stacks"] = ["vllm", "llumnix", "mell", "kunserve"]
        plan["gpus"] = [{"name": "a100-80gb"}]

    path = _tiny(tmp_path, one_service)
    spec, base = load_plan(path)
    res = run_plan(spec, base)
    assert set(res.searches) == {"vllm", "llumnix", "mell", "kunserve"}
    for name in ("llumnix", "mell", "kunserve"):
        search = res.searches[name]
        assert search is not None and search.evaluated
        assert all(o.error is None for p, o in res.outcomes.items() if p.stack == name)
    out = tmp_path / "out"
    write_plan(res, out)
    doc = json.loads((out / "plan.json").read_text())
    for name in ("llumnix", "mell", "kunserve"):  # replay each stack's cheapest point
        best = res.searches[name].best  # type: ignore[union-attr]
        if best is None:
            continue
        res.chosen = best
        write_plan(res, out)
        monkeypatch.chdir(out)
        assert main(["simulate", "chosen.yaml", "--out", f"replay-{name}", "--no-progress"]) == 0
        with (out / f"replay-{name}" / "requests.csv").open() as fh:
            ttft = [
                float(r["first_token_s"]) - float(r["arrival_s"])
                if r["first_token_s"]
                else math.inf
                for r in csv.DictReader(fh)
            ]
        assert nearest_rank(ttft, 0.99) == res.outcomes[best].services["a"].ttft_p99_s
    assert doc["per_stack"]["vllm"]["status"] == "feasible"


def test_several_services_refuse_one_model_stacks(tmp_path: Path) -> None:
    path = _tiny(tmp_path, search={"stacks": ["vllm", "mell"]})
    with pytest.raises(ConfigError, match="serves one model"):
        load_plan(path)


def test_cli_plan_runs_and_reports(tmp_path: Path) -> None:
    plan = _tiny(tmp_path)
    args = ["plan", str(plan), "--out", str(tmp_path / "o"), "--no-progress"]
    code = main([*args, "--set", "search.stacks=[vllm]"])
    assert code == 0
    doc = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert doc["chosen"]["stack"] == "vllm"


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"surprise": 1}, "unknown key"),
        ({"services": []}, "at least one service"),
        ({"gpus": [{"name": "a100-40gb"}]}, "no default price"),
        ({"search": {"stacks": ["mell"]}}, "stack"),
        ({"search": {"tp": [3]}}, "powers of two"),
    ],
)
def test_bad_plans_get_one_line_errors(tmp_path: Path, change: dict[str, Any], match: str) -> None:
    path = _tiny(tmp_path, **change)
    with pytest.raises(FleetserveError, match=match):
        spec, base = load_plan(path)
        run_plan(spec, base)


def test_traffic_must_be_one_kind(tmp_path: Path) -> None:
    path = _tiny(tmp_path, lambda p: p["services"][0]["traffic"].update(curve=[[0, 1]]))
    with pytest.raises(ConfigError, match="exactly one of rate, curve or trace"):
        load_plan(path)


def test_slo_below_idle_latency_fails_before_any_simulation(tmp_path: Path) -> None:
    path = _tiny(tmp_path, lambda p: p["services"][0]["slo"].update(ttft_p99_s=0.001))
    spec, base = load_plan(path)
    seen: list[str] = []

    class L:
        def phase(self, name: str) -> None:
            seen.append(name)

        def evaluated(self, *a: object) -> None:
            seen.append("sim")

    with pytest.raises(ConfigError, match="below the idle P99 TTFT"):
        run_plan(spec, base, listener=L())
    assert seen == []


def test_model_that_fits_no_gpu_is_refused(tmp_path: Path) -> None:
    path = _tiny(
        tmp_path,
        lambda p: p["services"][1].update(model="llama-3.1-70b"),
        gpus=[{"name": "rtx4090-24gb"}],
    )
    spec, base = load_plan(path)
    with pytest.raises(ConfigError, match="fits no candidate GPU"):
        run_plan(spec, base)


def test_a_gpu_the_model_does_not_fit_is_skipped_not_fatal(tmp_path: Path) -> None:
    """At mem_util 0.5 the 90B model fits no node of RTX 4090s but fits A100-80GBs:
    the plan places it on the A100s and lists the RTX 4090 as unusable."""

    def big(plan: dict[str, Any]) -> None:
        plan["services"] = plan["services"][:1]
        plan["services"][0]["model"] = "llama-3.2-90b"
        plan["services"][0]["slo"] = {"e2e_p99_s": 60.0}
        plan["gpus"] = [{"name": "rtx4090-24gb"}, {"name": "a100-80gb"}]
        plan["search"].update(stacks=["vllm"], tp=[1, 2, 4, 8], max_gpus=8)

    spec, base = load_plan(_tiny(tmp_path, big, mem_util=0.5))
    res = run_plan(spec, base)
    assert res.chosen is not None and res.chosen.gpu == "a100-80gb"
    assert ("vllm", "rtx4090-24gb", "a service fits no allowed TP degree") in res.unplaceable


def test_input_errors_name_the_service(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["services"][1]["traffic"]["curve"] = [[0, 1], [0, 2]]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"services\[1\]: traffic\.curve"):
        load_plan(path)
    data["services"][1]["traffic"]["curve"] = [[0, 1], [80, 3]]
    data["services"][1]["model"] = "llama-9b"
    path.write_text(yaml.safe_dump(data))
    spec, base = load_plan(path)
    with pytest.raises(ConfigError, match="service 'b': unknown model 'llama-9b'"):
        run_plan(spec, base)
    data["services"][1]["model"] = "qwen-2.5-14b"
    data["services"][1]["traffic"] = {"rate": 0.001, "prompt_tokens": 10, "output_tokens": 5}
    path.write_text(yaml.safe_dump(data))
    spec, base = load_plan(path)
    with pytest.raises(ConfigError, match="service 'b' has no request in the simulated"):
        run_plan(spec, base)


def test_missing_trace_names_the_file(tmp_path: Path) -> None:
    trace = {"trace": "nope.csv", "format": "azure"}
    path = _tiny(tmp_path, lambda p: p["services"][0].update(traffic=trace))
    spec, base = load_plan(path)
    with pytest.raises(InputError, match=r"nope\.csv"):
        build_traffic(spec, base, seed=0)


def test_cli_bad_plan_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _tiny(tmp_path, gpus=[{"name": "a100-40gb"}])
    assert main(["plan", str(path), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no default price" in err and "Traceback" not in err
