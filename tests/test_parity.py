"""The parity report (``fleetserve parity``): the /metrics delta, the mechanism
rows against a simulated summary, the simulator's side in each world, the
command's errors, and one end-to-end run against a real server (slow)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from png_util import skip_run_rendering
from serve_util import metric_value
from test_cli import assert_one_line_error, run_cli

from fleetserve.cli.serve import load_serve_config
from fleetserve.experiments.fidelity import fidelity_table
from fleetserve.experiments.parity import (
    MetricsSnapshot,
    activation_mean,
    footnoted,
    mechanism_rows,
    metrics_delta,
    parity_markdown,
    parse_metrics,
    summary_rows,
    with_measured_activation,
)
from fleetserve.experiments.parity_sim import (
    ParityContext,
    parity_context,
    parity_world,
    simulate_runtime,
)
from fleetserve.runtime.metrics import RuntimeMetrics
from fleetserve.workload.request import Request

A, B = "tiny-llama-a", "tiny-llama-b"
SINGLE = ParityContext("single", elastic=False, prefix_caching=False, replacement=False)


@pytest.fixture(autouse=True)
def _no_run_rendering(monkeypatch: pytest.MonkeyPatch) -> None:
    skip_run_rendering(monkeypatch)


def _page(m: RuntimeMetrics) -> MetricsSnapshot:
    return parse_metrics(m.render().decode())


def _delta() -> MetricsSnapshot:
    """A made-up replay on the runtime's own metrics: counters touched before
    the replay (they must not count) and during it."""
    m = RuntimeMetrics()
    m.migrations.labels("kv", "done").inc(2)  # before the replay
    m.requests.labels(A, "finished").inc(4)
    before = _page(m)
    m.requests.labels(A, "finished").inc(5)
    m.requests.labels(B, "finished").inc(2)
    m.requests.labels(A, "rejected").inc(1)
    m.migrations.labels("kv", "done").inc(3)
    m.migrations.labels("token", "done").inc(1)
    m.migrations.labels("kv", "aborted").inc(2)
    m.migrations.labels("token", "aborted").inc(1)
    m.migration_bytes.inc(4096)
    m.preemptions.inc(7)
    m.activations.observe(0.2)
    m.activations.observe(0.4)
    m.sleeps.inc(1)
    m.kun_actions.labels("DropLayers").inc(2)
    m.drops.inc(6)
    m.kun_exchanged.labels("kv").inc(4)
    m.kun_exchanged.labels("recomputed").inc(1)
    m.kun_exchanged.labels("remote").inc(2)  # a live exchange's victims count too
    return metrics_delta(before, _page(m))


def _sim(**extra: Any) -> dict[str, Any]:
    """A made-up simulated summary."""
    return {
        "requests": {"finished": 7, "preemptions": 3},
        "migrations": {
            "by_mode": {"kv": {"count": 4, "bytes": 8192}, "token": {"count": 0, "bytes": 0}}
        },
        "mechanisms": {
            "activations": 3,
            "releases": 2,
            "migration_stages": 9,
            "migration_stall_s": 0.2,
            "migrations_aborted": 1,
        },
        "config": {"cluster": {"activation_s": 0.3}},
        **extra,
    }


# ------------------------------------------------------------------------- metrics


def test_the_delta_counts_only_the_replay() -> None:
    d = _delta()
    assert d.value("fleetserve_requests_total", outcome="finished") == 7  # both models
    assert d.value("fleetserve_requests_total", model=A) == 6
    assert d.value("fleetserve_migrations_total", mode="kv", outcome="done") == 3
    assert d.value("fleetserve_migrations_total", outcome="aborted") == 3
    assert d.value("fleetserve_migration_bytes_total") == 4096
    assert d.value("fleetserve_preemptions_total") == 7
    assert d.value("fleetserve_worker_activation_seconds_count") == 2
    assert activation_mean(d) == (pytest.approx(0.3), 2)
    # declared but never incremented: a measured 0; not exported at all: None
    assert d.value("fleetserve_layer_restores_total") == 0
    assert d.value("fleetserve_kun_actions_total", action="Restore") == 0
    assert d.value("fleetserve_no_such_metric_total") is None
    assert not any(name.endswith("_created") for name, _ in d.samples)


def test_a_page_that_is_not_prometheus_is_a_clear_error() -> None:
    from fleetserve.errors import InputError

    with pytest.raises(InputError, match="not a Prometheus metrics page"):
        parse_metrics("fleetserve_x_total{mode=kv} not-a-number\n")


def test_activation_mean_needs_an_activation() -> None:
    assert activation_mean(_page(RuntimeMetrics())) is None


# ---------------------------------------------------------------------- mechanisms


def _by_key(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in rows}


def test_rows_of_a_fixed_single_model_pool() -> None:
    rows = _by_key(mechanism_rows(_delta(), _sim(), SINGLE))
    r = rows["migrations_kv"]
    assert (r["runtime"], r["simulated"]) == (3, 4)
    assert (rows["migrations_token"]["runtime"], rows["migrations_token"]["simulated"]) == (1, 0)
    assert (rows["migrations_aborted"]["runtime"], rows["migrations_aborted"]["simulated"]) == (
        3,
        1,
    )
    assert (rows["migration_bytes"]["runtime"], rows["migration_bytes"]["simulated"]) == (
        4096,
        8192,
    )
    assert rows["migration_stages"]["simulated"] == 9
    assert rows["migration_stages"]["runtime"] == 0  # declared, never incremented: measured
    # a server without the metric (an older one): no value, and why
    d = _delta()
    older = MetricsSnapshot(d.families - {"fleetserve_migration_stages"}, d.samples)
    r = _by_key(mechanism_rows(older, _sim(), SINGLE))["migration_stages"]
    assert r["runtime"] is None and "does not export" in r["runtime_note"]
    # the runtime timed no live migration: no mean, said why; the simulator: 0.2 s / 4
    stall = rows["migration_stall_mean"]
    assert stall["runtime"] is None and stall["runtime_note"]
    assert stall["simulated"] == pytest.approx(0.05)
    assert (rows["preemptions"]["runtime"], rows["preemptions"]["simulated"]) == (7, 3)
    assert (rows["requests_finished"]["runtime"], rows["requests_finished"]["simulated"]) == (7, 7)
    # mechanisms neither side has here: None on both sides, with the reason
    for key in ("activations", "releases", "kun_merges", "layers_dropped", "prefix_hit_tokens"):
        assert rows[key]["runtime"] is None and rows[key]["simulated"] is None, key
        assert rows[key]["runtime_note"] and rows[key]["sim_note"], key
    assert rows["resumed"]["runtime"] == 0 and rows["resumed"]["simulated"] is None
    # every value None has its reason, and only those
    for r in rows.values():
        assert (r["runtime"] is None) == (r["runtime_note"] is not None), r
        assert (r["simulated"] is None) == (r["sim_note"] is not None), r


def test_rows_of_an_elastic_pool() -> None:
    ctx = replace(SINGLE, elastic=True)
    rows = _by_key(mechanism_rows(_delta(), _sim(), ctx))
    assert (rows["activations"]["runtime"], rows["activations"]["simulated"]) == (2, 3)
    assert rows["activation_mean"]["runtime"] == pytest.approx(0.3)
    assert rows["activation_mean"]["simulated"] == 0.3  # the simulation's input
    assert (rows["releases"]["runtime"], rows["releases"]["simulated"]) == (1, 2)


def test_rows_of_kunserve() -> None:
    ctx = replace(SINGLE, world="kunserve")
    sim = _sim(
        memory={"drops": 3, "restores": 1}, kunserve={"victims": {"count": 5, "restore_moves": 0}}
    )
    rows = _by_key(mechanism_rows(_delta(), sim, ctx))
    assert (rows["kun_merges"]["runtime"], rows["kun_merges"]["simulated"]) == (2, 3)
    assert (rows["kun_restores"]["runtime"], rows["kun_restores"]["simulated"]) == (0, 1)
    assert rows["layers_dropped"]["runtime"] == 6
    assert (
        rows["layers_dropped"]["simulated"] is None
        and "not layers" in (rows["layers_dropped"]["sim_note"])
    )
    assert (rows["kv_exchanged"]["runtime"], rows["kv_exchanged"]["simulated"]) == (6, 5)


def test_rows_of_a_sharing_stack_with_replacement() -> None:
    ctx = replace(SINGLE, world="sharing", replacement=True)
    m = RuntimeMetrics()
    before = _page(m)
    m.replacements.labels("unchanged").inc(3)
    m.replacements.labels("switched").inc(1)
    d = metrics_delta(before, _page(m))
    sim = _sim(replacement={"replacements": 5, "switches": 2})
    rows = _by_key(mechanism_rows(d, sim, ctx))
    assert (rows["replacement_searches"]["runtime"], rows["replacement_searches"]["simulated"]) == (
        4,
        5,
    )
    assert (rows["replacements"]["runtime"], rows["replacements"]["simulated"]) == (1, 2)
    assert rows["migration_stall_mean"]["simulated"] is None  # not recorded in that world
    # a stack without re-placement: neither side has it
    rows = _by_key(mechanism_rows(d, sim, replace(ctx, replacement=False)))
    assert rows["replacements"]["runtime"] is None and rows["replacements"]["simulated"] is None


def test_the_simulators_stall_mixes_token_moves() -> None:
    sim = _sim()
    sim["migrations"]["by_mode"]["token"]["count"] = 1
    r = _by_key(mechanism_rows(_delta(), sim, SINGLE))["migration_stall_mean"]
    assert r["simulated"] is None and "token" in r["sim_note"]


def test_prefix_caching_rows() -> None:
    m = RuntimeMetrics()
    before = _page(m)
    m.prefix_tokens.labels("prompt").inc(100)
    m.prefix_tokens.labels("hit").inc(32)
    d = metrics_delta(before, _page(m))
    rows = _by_key(mechanism_rows(d, _sim(), replace(SINGLE, prefix_caching=True)))
    assert rows["prefix_prompt_tokens"]["runtime"] == 100
    assert rows["prefix_hit_tokens"]["runtime"] == 32
    assert rows["prefix_hit_tokens"]["simulated"] is None
    assert "block ids" in rows["prefix_hit_tokens"]["sim_note"]


def test_tables_mark_each_reason_once() -> None:
    rows = mechanism_rows(_delta(), _sim(), SINGLE)
    body, notes = footnoted(rows)
    assert len(notes) == len(set(notes))
    cells = {row[0]: row[1:] for row in body}
    assert cells["migrations, KV transfer (done)"] == ["3", "4"]
    kun = notes.index("not a KunServe stack: no buddy groups on either side") + 1
    assert cells["KunServe: layers dropped"] == [f"— [{kun}]", f"— [{kun}]"]
    latency = fidelity_table(
        {"latency_s": {"ttft": {"mean": 0.2}}, "requests": {"finished": 7}},
        {"latency_s": {"ttft": {"mean": 0.1}}, "requests": {"finished": 7}},
        counts=True,
    )
    by = {r["metric"]: r for r in latency}
    assert by["TTFT mean"]["rel_error_pct"] == pytest.approx(100.0)
    assert by["requests finished"]["simulated"] == by["requests finished"]["measured"] == 7
    stack = {
        "stack": "llumnix",
        "world": "single",
        "about": ["x"],
        "rows": rows,
        "latency": latency,
    }
    md = parity_markdown(stack, "## Latency\n\nbody")
    assert "## Stack `llumnix` (single world)" in md and "### Latency" in md
    assert f"[{kun}] not a KunServe stack" in md
    header, sbody = summary_rows([stack])
    cells = dict(zip(header, sbody[0], strict=True))
    assert cells["KV migrations"] == "3 / 4"
    assert cells["activations"] == "— / —"
    assert cells["TTFT mean (s)"] == "0.1 / 0.2"


# -------------------------------------------------------------- the simulated side


def _serve_yaml(tmp_path: Path, body: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def _requests(models: list[str], n: int = 24) -> list[Request]:
    return [
        Request(
            id=i,
            model=models[i % len(models)],
            arrival_s=0.05 * i,
            prompt_tokens=40 + 7 * i,
            output_tokens=10 + i % 9,
        )
        for i in range(n)
    ]


def test_activation_s_is_the_runtimes_mean_for_an_elastic_pool(tmp_path: Path) -> None:
    elastic = load_serve_config(
        str(
            _serve_yaml(
                tmp_path, "serve: {workers: 2, gpu_memory_mb: 48}\ncluster: {elastic: true}\n"
            )
        ),
        [],
    )
    got, info = with_measured_activation(elastic, _delta())
    assert got.cluster.activation_s == pytest.approx(0.3)
    assert info["activations"] == 2 and "runtime" in info["source"]
    same, info = with_measured_activation(elastic, _page(RuntimeMetrics()))
    assert same is elastic and info["activations"] == 0
    fixed = load_serve_config(str(_serve_yaml(tmp_path, "serve: {workers: 2}\n", "f.yaml")), [])
    same, info = with_measured_activation(fixed, _delta())
    assert same is fixed and info["source"] == "fixed pool"


def test_kunserve_is_simulated_on_the_engines_capacity(tmp_path: Path) -> None:
    cfg = load_serve_config(
        str(
            _serve_yaml(
                tmp_path,
                "serve: {workers: 2, gpu_memory_mb: 16, models: [tiny-llama-a]}\n"
                "policy: {stack: kunserve}\n",
            )
        ),
        [],
    )
    assert parity_world(cfg) == "kunserve" and parity_context(cfg).world == "kunserve"
    reqs = _requests([A])
    s = simulate_runtime(cfg, None, tmp_path / "kun", reqs)
    assert s["parity_world"] == "kunserve"
    assert s["requests"]["finished"] == len(reqs)
    assert set(s["mechanisms"]) >= {"activations", "releases", "migration_stages"}
    assert s["mechanisms"]["activations"] == 0  # no spare instance, as the runtime
    assert "drops" in s["memory"] and "victims" in s["kunserve"]
    assert any("1248 KV tokens each" in n for n in s["notes"])  # the engine's capacity
    assert json.loads((tmp_path / "kun" / "summary.json").read_text())["mechanisms"]


def test_a_sharing_stack_is_simulated_on_the_runtimes_placement(tmp_path: Path) -> None:
    cfg = load_serve_config("configs/serve-sharing.yaml", ["policy.stack=muxserve"])
    assert parity_world(cfg) == "sharing"
    reqs = _requests([A, B])
    s = simulate_runtime(cfg, None, tmp_path / "mux", reqs)
    assert s["requests"]["finished"] == len(reqs)
    assert any("the runtime's placement (muxserve)" in n for n in s["notes"])
    assert s["stack"]["name"] == "muxserve"
    assert s["placement_search_s"] == []  # the runtime's plan, not searched again


# ------------------------------------------------------------------------------ CLI


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    rc, o, e = run_cli(capsys, "parity", tmp_path / "nope.yaml", "--out", out)
    assert_one_line_error(rc, o, e, "nope.yaml", "config file not found")
    plain = _serve_yaml(tmp_path, "model: llama-2-7b\n", "plain.yaml")
    rc, o, e = run_cli(capsys, "parity", plain, "--out", out)
    assert_one_line_error(rc, o, e, "plain.yaml", "no serve: section")
    ok = _serve_yaml(
        tmp_path, "serve: {workers: 2, gpu_memory_mb: 48, models: [tiny-llama-a, tiny-llama-b]}\n"
    )
    rc, o, e = run_cli(capsys, "parity", ok, "--out", out, "--stacks", "vllm,nosuch")
    assert_one_line_error(rc, o, e, "stack 'nosuch'", "unknown stack")
    rc, o, e = run_cli(capsys, "parity", ok, "--out", out, "--stacks", "kunserve")
    assert_one_line_error(rc, o, e, "stack 'kunserve'", "one replicated model")
    rc, o, e = run_cli(capsys, "parity", ok, "--out", out, "--stacks", "vllm,vllm")
    assert_one_line_error(rc, o, e, "twice")
    rc, o, e = run_cli(capsys, "parity", ok, "--out", out, "--profile", tmp_path / "p.csv")
    assert_one_line_error(rc, o, e, "p.csv", "profile not found")
    rc, o, e = run_cli(capsys, "parity", ok, "--out", out, "--trace", tmp_path / "x.csv")
    assert_one_line_error(rc, o, e, "x.csv", "trace not found")
    rc, o, e = run_cli(capsys, "parity", ok, "--out", out, "--analyze-only")
    assert_one_line_error(rc, o, e, "no such result directory")
    assert not out.exists()  # nothing ran


# ------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_parity_end_to_end_on_an_elastic_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real server (Mell on two sleeping 48 MiB workers) replays 6 requests;
    the report has both sides, and the simulation waited the runtime's mean
    activation time."""
    n = 6
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"arrival_s": 0.3 * i, "prompt_tokens": 20 + 10 * i, "output_tokens": 8 + i})
            + "\n"
            for i in range(n)
        )
    )
    cfg = _serve_yaml(
        tmp_path,
        "serve: {workers: 2, gpu_memory_mb: 48, max_running: 16, models: [tiny-llama-a]}\n"
        "cluster: {elastic: true}\npolicy: {stack: mell}\nmigration: {epoch_s: 0.25}\n"
        f"workload: {{trace: {trace}, format: jsonl}}\n",
    )
    out = tmp_path / "par"
    rc, stdout, err = run_cli(capsys, "parity", cfg, "--out", out)
    assert rc == 0, err
    report = json.loads((out / "parity.json").read_text())
    (st,) = report["stacks"]
    assert (st["stack"], st["world"], st["simulation_error"]) == ("mell", "single", None)
    rows = {r["key"]: r for r in st["rows"]}
    assert rows["requests_finished"]["runtime"] == n
    assert rows["requests_finished"]["simulated"] == n
    lat = {r["metric"]: r for r in st["latency"]}
    assert lat["requests finished"]["measured"] == lat["requests finished"]["simulated"] == n
    # the runtime's activations, read here from the two scrapes with the tests' own parser
    d = out / "mell"
    before, after = (d / "metrics-before.prom").read_text(), (d / "metrics-after.prom").read_text()
    name = "fleetserve_worker_activation_seconds"
    count = metric_value(after, name + "_count") - metric_value(before, name + "_count")
    total = metric_value(after, name + "_sum") - metric_value(before, name + "_sum")
    assert count >= 1  # the first request wakes a sleeping worker
    assert rows["activations"]["runtime"] == count
    assert rows["activations"]["simulated"] >= 1
    assert st["activation"]["activation_s"] == pytest.approx(total / count)
    sim = json.loads((d / "simulated" / "summary.json").read_text())
    assert sim["config"]["cluster"]["activation_s"] == pytest.approx(total / count)
    for key in ("kun_merges", "replacements", "prefix_hit_tokens"):
        assert rows[key]["runtime"] is None and rows[key]["simulated"] is None
    md = (out / "parity.md").read_text()
    assert "## Stack `mell` (single world)" in md and "uncalibrated emulated GPU" in md
    assert "Parity over stacks" in stdout
    # the report again from the measurements: the same counts on both sides
    rc, _, err = run_cli(capsys, "parity", cfg, "--out", out, "--analyze-only")
    assert rc == 0, err
    again = json.loads((out / "parity.json").read_text())
    assert again["stacks"][0]["rows"] == st["rows"]
    assert again["command"] == report["command"] and again["analyzed"] is not None
