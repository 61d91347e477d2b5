"""``fleetserve reproduce fleet``: the grid, the report read back from the runs, bad input.

Real runs use a small generated Azure trace (``$FLEETSERVE_DATA`` points at it) and the
hidden ``--scale`` knob (x0.1 of the quick lengths: 30 s workloads after a 6 s history)
with cheap stacks; the findings are also checked on hand-made rows, so nothing here
depends on how well a policy does.
"""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from png_util import skip_run_rendering
from test_cli import assert_one_line_error, run_cli
from test_fleet_trace import write_azure

from fleetserve.cli.main import main
from fleetserve.config import config_from_dict, load_config
from fleetserve.errors import FleetserveError, UnknownNameError
from fleetserve.experiments import EXPERIMENTS, check_experiment
from fleetserve.experiments import fleet_report as fr
from fleetserve.experiments.fleet import (
    AZURE_CONV,
    BURSTY,
    FLEET_STACK,
    SCENARIOS,
    STACKS_BASE,
    TRACE,
    Mode,
    catalog_has_fleet,
    composed_of,
    default_stacks,
    grid_specs,
    plan,
    run_config,
    select_stacks,
    stack_spec,
    workload_config,
)
from fleetserve.experiments.fleet_report import METRICS, compare, findings
from fleetserve.policy import catalog
from fleetserve.workload.data import DATA_ENV

REPO = Path(__file__).resolve().parents[1]
SCALE = "0.1"
TINY_STACKS = ("vllm", "vllm-elastic", "muxserve", "muxserve-mell")
FIGURES = ("fleet_cost_latency.png", "fleet_active_gpus.png", "fleet_slo.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _plain_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small stand-in for the shared Azure conversation trace (300 requests in 60 s)."""
    folder = tmp_path_factory.mktemp("data")
    write_azure(folder / AZURE_CONV, n=300, span_s=60.0)
    return folder


@pytest.fixture(scope="module")
def tiny_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny real ``reproduce fleet --quick`` of both scenarios, in process.
    Each run folder's plots are built but not rendered (nothing here looks at
    them; rendering them was half of the run's time); the report's are rendered."""
    out = tmp_path_factory.mktemp("fleet") / "out"
    with pytest.MonkeyPatch.context() as mp:
        skip_run_rendering(mp)
        mp.setenv(DATA_ENV, str(data_dir))
        mp.setenv("NO_COLOR", "1")
        mp.setenv("COLUMNS", "200")
        argv = ["reproduce", "fleet", "--quick", "--scale", SCALE, "--jobs", "1"]
        argv += ["--stacks", ",".join(TINY_STACKS), "--no-progress", "--out", str(out)]
        assert main(argv) == 0
    return out


# --------------------------------------------------------------------------- the grid


def test_fleet_is_an_experiment() -> None:
    assert check_experiment("fleet") == "fleet" and "fleet" in EXPERIMENTS


def test_default_stacks_are_data_with_the_composed_ones_last() -> None:
    labels = [s.label for s in STACKS_BASE]
    assert labels == ["vllm", "vllm-elastic", "seallm", "muxserve", "seallm-mell", "muxserve-mell"]
    by = {s.label: s for s in STACKS_BASE}
    assert by["vllm-elastic"].stack == "vllm"
    assert by["vllm-elastic"].overrides == {"policy": {"memory": "elastic"}}
    assert by["seallm-mell"].composes == ("seallm", "vllm-elastic")
    assert by["muxserve-mell"].composes == ("muxserve", "vllm-elastic")
    for st in STACKS_BASE:
        assert st.stack in catalog.STACKS
        if st.composed:  # what the catalog's families say it combines
            assert st.composes == composed_of(catalog.STACKS[st.stack])


@pytest.mark.parametrize("quick", [False, True])
def test_grid_has_one_valid_config_per_scenario_and_stack(quick: bool, tmp_path: Path) -> None:
    mode = Mode(quick=quick)
    stacks = select_stacks(None)
    specs = grid_specs(tmp_path, stacks, mode)
    assert [s.key for s in specs] == [f"{sc.name}/{st.label}" for sc in SCENARIOS for st in stacks]
    for spec in specs:
        cfg = config_from_dict(spec.config)
        assert cfg.is_multi and cfg.cluster.gpus == 16 and cfg.multi.processes == 1
        assert spec.out_dir == tmp_path / "runs" / spec.key
    el = config_from_dict(run_config(BURSTY, stack_spec("vllm-elastic"), mode))
    assert el.policy.stack == "vllm" and el.policy.memory == "elastic"
    q, f = Mode(quick=True).sizes(), Mode().sizes()
    assert q.duration_s < f.duration_s and q.end_s < f.end_s


@pytest.mark.parametrize(
    ("scenario", "path"), [(BURSTY, "configs/fleet.yaml"), (TRACE, "configs/fleet-trace.yaml")]
)
def test_full_mode_runs_the_config_files_workloads(scenario: Any, path: str) -> None:
    """The full mode's workload is the config file's (so the docs' commands agree)."""
    assert scenario.config_file == path
    src = REPO / path
    want = config_from_dict(load_config(src), str(src))
    got = config_from_dict(workload_config(scenario, Mode()))
    wf, gf = want.fleet, got.fleet
    if scenario is TRACE:
        assert Path(str(gf.trace)).name == Path(str(wf.trace)).name == AZURE_CONV
        gf = replace(gf, trace=wf.trace)
    assert gf == wf
    assert got.cluster == want.cluster and got.seed == want.seed
    assert got.multi.history_s == want.multi.history_s
    assert got.multi.keepalive_s == want.multi.keepalive_s


def test_stack_selection_and_unknown_names() -> None:
    assert [s.label for s in select_stacks(["muxserve", "vllm"])] == ["muxserve", "vllm"]
    assert stack_spec("alpaserve").stack == "alpaserve"  # any multi-LLM catalog stack
    with pytest.raises(UnknownNameError, match="fleet stack 'nope'"):
        select_stacks(["vllm", "nope"])
    with pytest.raises(UnknownNameError):
        stack_spec("mell")  # a single-model stack
    with pytest.raises(FleetserveError, match="twice"):
        select_stacks(["vllm", "vllm"])
    with pytest.raises(FleetserveError, match="at least one"):
        select_stacks([])


def test_a_catalog_fleet_stack_joins_the_default_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """The composed ``fleet`` stack is picked up from the catalog by name (stand-in here)."""
    if not catalog_has_fleet():
        with pytest.raises(UnknownNameError, match="no 'fleet' stack yet"):
            stack_spec(FLEET_STACK)
        # as the catalog will have it: seallm-mell plus KunServe's drop/restore
        stand_in = replace(catalog.STACKS["seallm-mell"], name=FLEET_STACK, description="x")
        monkeypatch.setitem(catalog.STACKS, FLEET_STACK, stand_in)
    labels = [s.label for s in default_stacks()]
    assert labels[-1] == FLEET_STACK and labels[:-1] == [s.label for s in STACKS_BASE]
    entry = stack_spec(FLEET_STACK)
    assert entry.stack == FLEET_STACK and entry.composed
    assert entry.composes == composed_of(catalog.STACKS[FLEET_STACK])
    assert entry.what == catalog.STACKS[FLEET_STACK].description
    if catalog.STACKS[FLEET_STACK].placement == "seallm":
        assert entry.composes == ("seallm-mell", "seallm", "vllm-elastic")


def test_the_catalogs_fleet_stack_runs_on_both_scenarios(tmp_path: Path) -> None:
    """Once another change adds ``fleet`` to the catalog, it must run on both workloads."""
    if not catalog_has_fleet():
        pytest.skip("the stack catalog has no 'fleet' stack yet")
    specs, notes = plan(tmp_path, Mode(quick=True), [FLEET_STACK])
    assert [s.key for s in specs] == [f"{sc.name}/{FLEET_STACK}" for sc in SCENARIOS]
    assert not notes


# --------------------------------------------------------------------------- findings


def _row(**kw: Any) -> dict[str, Any]:
    base = {
        "gpu_hours": 1.0,
        "gpus_peak": 16.0,
        "gpus_mean": 16.0,
        "ttft_p99_s": 1.0,
        "tpot_p99_s": 0.05,
        "slo_attainment": 1.0,
        "wakes": None,
        "sleeps": None,
        "groups": 4,
        "replacements": None,
        "migrations": 0,
        "rejected": 0,
        "unfinished": 0,
    }
    return base | kw


def test_compare_uses_the_tolerances() -> None:
    by = {m.field: m for m in METRICS}
    assert compare(by["gpu_hours"], 0.9, 1.0)[0] == "win"
    assert compare(by["gpu_hours"], 1.01, 1.0)[0] == "tie"
    assert compare(by["ttft_p99_s"], 2.0, 1.0) == ("loss", "+100%")
    assert compare(by["slo_attainment"], 0.99, 1.0)[0] == "loss"
    assert compare(by["slo_attainment"], 0.997, 1.0)[0] == "tie"
    assert compare(by["gpus_peak"], 12, 16) == ("win", "-4")


def test_findings_follow_the_numbers_and_explain_losses() -> None:
    stacks = [stack_spec(s) for s in ("vllm", "vllm-elastic", "muxserve", "muxserve-mell")]
    rows = {
        ("bursty", "vllm"): _row(stack="vllm"),
        ("bursty", "vllm-elastic"): _row(
            stack="vllm-elastic", gpu_hours=0.7, gpus_mean=11.0, sleeps=30, wakes=20
        ),
        ("bursty", "muxserve"): _row(stack="muxserve", ttft_p99_s=3.0),
        ("bursty", "muxserve-mell"): _row(
            stack="muxserve-mell", gpu_hours=0.9, gpus_mean=14.0, ttft_p99_s=3.3, sleeps=4, wakes=5
        ),
    }
    got = {(f["baseline"], f["field"]): f for f in findings(rows, stacks)}
    assert {f[0] for f in got} == {"vllm", "muxserve", "vllm-elastic"}  # only the composed row
    assert got[("vllm", "gpu_hours")]["verdict"] == "win"
    assert got[("vllm-elastic", "gpu_hours")]["verdict"] == "loss"
    assert any("group release" in e for e in got[("vllm-elastic", "gpu_hours")]["evidence"])
    ttft = got[("vllm", "ttft_p99_s")]
    assert ttft["verdict"] == "loss" and ttft["value"] == 3.3 and ttft["baseline_value"] == 1.0
    assert any("`muxserve` alone loses too (3 s)" in e for e in ttft["evidence"])
    assert any("5 group wake" in e for e in ttft["evidence"])
    assert got[("muxserve", "ttft_p99_s")]["verdict"] == "loss"  # +10%
    assert got[("vllm", "slo_attainment")]["verdict"] == "tie"
    assert got[("vllm", "slo_attainment")]["evidence"] == []


def test_findings_name_kunserve_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    if not catalog_has_fleet():
        stand_in = replace(catalog.STACKS["seallm-mell"], name=FLEET_STACK, description="x")
        monkeypatch.setitem(catalog.STACKS, FLEET_STACK, stand_in)
    stacks = [stack_spec(s) for s in ("vllm", "seallm-mell", FLEET_STACK)]
    rows = {
        ("trace", "vllm"): _row(stack="vllm"),
        ("trace", "seallm-mell"): _row(stack="seallm-mell", sleeps=3, wakes=0),
        ("trace", FLEET_STACK): _row(stack=FLEET_STACK, sleeps=3, wakes=0, drops=2, ttft_p99_s=1.5),
        ("bursty", "vllm"): _row(stack="vllm"),
        ("bursty", "seallm-mell"): _row(stack="seallm-mell", sleeps=3, wakes=0),
        ("bursty", FLEET_STACK): _row(stack=FLEET_STACK, sleeps=3, wakes=0, drops=0),
    }
    got = {(f["scenario"], f["baseline"], f["field"]): f for f in findings(rows, stacks)}
    loss = got[("trace", "seallm-mell", "ttft_p99_s")]
    assert loss["verdict"] == "loss"
    assert any("2 KunServe parameter drop" in e for e in loss["evidence"])
    tie = got[("bursty", "seallm-mell", "ttft_p99_s")]
    assert tie["verdict"] == "tie" and any("never acted" in e for e in tie["evidence"])


# --------------------------------------------------------------------------- a real tiny run


def _summary(out: Path, scenario: str, stack: str) -> dict[str, Any]:
    path = out / "runs" / scenario / stack / "summary.json"
    return dict(json.loads(path.read_text()))


def test_tiny_run_writes_every_output(tiny_run: Path) -> None:
    for name in ("report.md", "report.json", "results.csv"):
        assert (tiny_run / name).is_file(), name
    for name in FIGURES:
        assert (tiny_run / name).read_bytes()[:8] == PNG_MAGIC, name
    report = json.loads((tiny_run / "report.json").read_text())
    keys = [(r["scenario"], r["stack"]) for r in report["runs"]]
    assert keys == [(sc.name, s) for sc in SCENARIOS for s in TINY_STACKS]
    assert [row[:2] for row in report["table"]["rows"]] == [list(k) for k in keys]
    with (tiny_run / "results.csv").open(newline="") as fh:
        assert len(list(csv.DictReader(fh))) == len(keys)
    md = (tiny_run / "report.md").read_text()
    for sc in SCENARIOS:
        assert f"## `{sc.name}`" in md
    assert "## Where the composition wins and where it does not" in md
    assert report["findings"] and {f["stack"] for f in report["findings"]} == {"muxserve-mell"}


def test_report_values_are_the_runs_summaries(tiny_run: Path) -> None:
    report = json.loads((tiny_run / "report.json").read_text())
    for r in report["runs"]:
        s = _summary(tiny_run, r["scenario"], r["stack"])
        assert r["gpu_hours"] == s["gpus"]["gpu_hours"]
        assert r["gpus_peak"] == s["gpus"]["peak"]
        assert r["gpus_mean"] == s["gpus"]["mean"]
        assert r["ttft_p99_s"] == s["latency_s"]["ttft"]["p99"]
        assert r["tpot_p99_s"] == s["latency_s"]["tpot"]["p99"]
        assert r["slo_attainment"] == s["slo_attainment"]["5"]
        assert r["requests"] == s["requests"]["total"]
        base = _summary(tiny_run, r["scenario"], "vllm")
        assert r["gpu_hours_vs_vllm"] == pytest.approx(
            s["gpus"]["gpu_hours"] / base["gpus"]["gpu_hours"]
        )
        run_cfg = s["config"]["run"]
        assert run_cfg["policy"]["stack"] == (
            "vllm" if r["stack"] == "vllm-elastic" else r["stack"]
        )
        if r["stack"] == "vllm-elastic":
            assert run_cfg["policy"]["memory"] == "elastic"
    # every stack of a scenario replayed the same requests
    for sc in SCENARIOS:
        totals = {_summary(tiny_run, sc.name, s)["requests"]["total"] for s in TINY_STACKS}
        assert len(totals) == 1


def test_report_only_rerenders_the_same_tables(
    tiny_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DATA_ENV, raising=False)  # the trace's folder need not be found again
    # The quick report's figures are the tiny run's: it drew them from the same
    # runs (the rows are equal, checked below) and they are checked there; drawing
    # them again here and in the restore at the end was most of this test's time.
    drawn = {name: (tiny_run / name).read_bytes() for name in FIGURES}

    def figures_of_the_tiny_run(fig_out: Path, _rows: Any, _stacks: Any) -> list[Path]:
        for name, png in drawn.items():
            (fig_out / name).write_bytes(png)
        return [fig_out / name for name in FIGURES]

    before = json.loads((tiny_run / "report.json").read_text())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fr, "write_figures", figures_of_the_tiny_run)
        rc, out, err = run_cli(
            capsys, "reproduce", "fleet", "--quick", "--scale", SCALE, "--report-only",
            "--out", tiny_run,
        )  # fmt: skip
    assert rc == 0, err
    after = json.loads((tiny_run / "report.json").read_text())
    assert after["runs"] == before["runs"] and after["findings"] == before["findings"]
    assert "muxserve-mell" in out and "report.md" in out
    # reporting the full mode from quick runs leaves every run out, with a note each
    rc, out, err = run_cli(capsys, "reproduce", "fleet", "--report-only", "--out", tiny_run)
    assert rc == 0, err
    full = json.loads((tiny_run / "report.json").read_text())
    assert full["runs"] == [] and len(full["notes"]) == len(before["runs"])
    assert all("other settings" in n for n in full["notes"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fr, "write_figures", figures_of_the_tiny_run)
        run_cli(
            capsys, "reproduce", "fleet", "--quick", "--scale", SCALE, "--report-only",
            "--out", tiny_run,
        )  # fmt: skip


def test_bad_input_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data_dir: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv(DATA_ENV, str(data_dir))
    out = tmp_path / "out"
    rc, o, e = run_cli(capsys, "reproduce", "fleet", "--stacks", "vllm,nope", "--out", out)
    assert_one_line_error(rc, o, e, "fleet stack 'nope'")
    rc, o, e = run_cli(capsys, "reproduce", "fleet", "--stacks", "vllm,vllm", "--out", out)
    assert_one_line_error(rc, o, e, "twice")
    rc, o, e = run_cli(capsys, "reproduce", "fleet", "--report-only", "--out", out)
    assert_one_line_error(rc, o, e, "no runs/ folder")
    assert not (out / "runs").exists()
