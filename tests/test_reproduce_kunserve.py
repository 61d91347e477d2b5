"""``fleetserve reproduce kunserve``: the grid, the KV provisioning, the claims, the CLI.

The smoke run is a real ``--quick`` run shrunk by the hidden ``--scale`` knob
(9 s of arrivals, a 1 s burst) in this process; the per-run PNGs every result
directory gets (timeseries, latency CDF) are stubbed there, since drawing ~60 of
them would take most of the test time (the experiment's own figures are drawn).
The claims are checked on hand-made rows, so nothing here depends on how well a
policy does. Tests that simulate need the shared Azure conversation trace.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_cli import assert_one_line_error, run_cli

from fleetserve.cli.main import main
from fleetserve.config import config_from_dict
from fleetserve.errors import FleetserveError, UnknownNameError
from fleetserve.experiments import EXPERIMENTS, check_experiment
from fleetserve.experiments import kunserve as ks
from fleetserve.experiments import kunserve_report as kr
from fleetserve.experiments.kunserve import (
    KV_FACTOR,
    NETWORKS,
    PROFILES,
    STACKS,
    Mode,
    Run,
    grid_runs,
    grid_specs,
    measure_provision,
    provision,
    provision_from_samples,
    run_config,
    select_stacks,
    time_average,
)
from fleetserve.experiments.kunserve_report import (
    NA,
    NO,
    PARTLY,
    YES,
    claims,
    combine,
    level,
    share,
    slo_violations,
)
from fleetserve.policy.catalog import KUNSERVE, world_of
from fleetserve.spec import get_model

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
AZURE_CONV = SHARED / "azure_llm_2023_conv.csv"
needs_azure = pytest.mark.skipif(
    not AZURE_CONV.is_file(),
    reason=f"shared trace {AZURE_CONV} not present (see shared/data/README.md)",
)

SCALE = "0.05"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = (
    "fig10_end_to_end.png",
    "fig11_timeline.png",
    "fig14_exchange.png",
    "fig15_16_ablations.png",
)


@pytest.fixture(autouse=True)
def _plain_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")


def _stub_run_plots(mp: pytest.MonkeyPatch) -> None:
    """Per-run PNGs as empty files (the run folders are otherwise complete)."""
    import fleetserve.metrics.io as mio

    def stub(_data: Any, path: Any, *args: Any, **kwargs: Any) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
        return p

    mp.setattr(mio, "plot_timeseries", stub)
    mp.setattr(mio, "plot_latency_cdf", stub)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A tiny real ``reproduce kunserve --quick`` with every stack, in process."""
    if not AZURE_CONV.is_file():
        pytest.skip(f"shared trace {AZURE_CONV} not present (see shared/data/README.md)")
    out = tmp_path_factory.mktemp("kunserve") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NO_COLOR", "1")
        mp.setenv("COLUMNS", "200")
        _stub_run_plots(mp)
        argv = ["reproduce", "kunserve", "--quick", "--scale", SCALE, "--jobs", "1"]
        rc = main([*argv, "--no-progress", "--out", str(out)])
    return out, rc


# --------------------------------------------------------------------------- the grid


def test_kunserve_is_a_registered_experiment() -> None:
    assert check_experiment("kunserve") == "kunserve" and "kunserve" in EXPERIMENTS


@pytest.mark.parametrize("quick", [False, True])
def test_grid_has_one_valid_config_per_run(quick: bool, tmp_path: Path) -> None:
    mode = Mode(quick=quick, seed=3)
    kv = {p.name: ks.Provision(p.name, p.base_rate, 1.0, 2.0, 1000 + i, {}, 0.0)
          for i, p in enumerate(PROFILES)}  # fmt: skip
    specs = grid_specs(tmp_path, mode, STACKS, kv)
    runs = grid_runs(mode)
    assert [s.key for s in specs] == [r.key for r in runs]
    assert len({s.key for s in specs}) == len(specs)
    assert len({s.out_dir for s in specs}) == len(specs)
    n_main = len(PROFILES) * len(mode.mults) * 6 + len(mode.mults) * 3
    n_net = (len(NETWORKS) - 1) * 2
    assert len(specs) == n_main + 6 + n_net + 2 * len(PROFILES)
    for run, spec in zip(runs, specs, strict=True):
        cfg = config_from_dict(spec.config)
        kc = cfg.kunserve
        assert world_of(cfg) == KUNSERVE and kc.generator == "bursty"
        assert cfg.seed == 3 and cfg.cluster.gpus == 8 and cfg.cluster.tp == 1
        assert cfg.model == "qwen-2.5-14b" and cfg.cluster.gpu == "a800-80gb"
        assert kc.kv_tokens == kv[run.profile].kv_tokens
        assert kc.gpus_per_node == 1 and kc.network_gbps == run.network_gbps
        assert kc.duration_s == mode.sizes().duration_s
        assert kc.burst_factor == (1.0 if run.kind == "ref" else 14.0)
        assert kc.arrival == ("gamma" if run.kind == "gamma" else "azure-burst")
        assert kc.static_stages == (2 if run.stack == "pipeline" else None)
        assert kc.rate == pytest.approx(ks.PROFILE_BY_NAME[run.profile].base_rate * run.mult)
    # ablations and the exchange sweep are BurstGPT only; gamma and the sweep at x1.5
    assert {r.profile for r in runs if r.stack.startswith("kunserve-")} == {"burstgpt"}
    assert {r.mult for r in runs if r.kind in ("gamma", "net")} == {1.5}
    assert {r.network_gbps for r in runs if r.kind == "net"} == {25.0, 50.0, 100.0}


def test_quick_is_smaller_than_full() -> None:
    full, quick = Mode(), Mode(quick=True)
    assert set(quick.mults) <= set(full.mults) and full.focus in quick.mults
    assert quick.sizes().duration_s < full.sizes().duration_s
    assert len(grid_runs(quick)) < len(grid_runs(full))
    scaled = Mode(quick=True, scale=0.1).sizes()
    assert scaled.duration_s == pytest.approx(quick.sizes().duration_s * 0.1)
    assert scaled.burst_start_s == pytest.approx(quick.sizes().burst_start_s * 0.1)


def test_stack_selection() -> None:
    assert [s.label for s in select_stacks(None)] == [s.label for s in STACKS]
    assert [s.label for s in select_stacks(["kunserve", "wf"])] == ["wf", "kunserve"]
    with pytest.raises(UnknownNameError, match="kunserv"):
        select_stacks(["kunserv"])
    with pytest.raises(FleetserveError, match="twice"):
        select_stacks(["wf", "wf"])
    with pytest.raises(FleetserveError, match="at least one"):
        select_stacks([])
    runs = grid_runs(Mode(quick=True), select_stacks(["kunserve"]))
    # the SLO reference (wf, no burst) always runs; the pipeline reference only with it
    assert {r.stack for r in runs} == {"kunserve", "wf"}
    assert {r.kind for r in runs if r.stack == "wf"} == {"ref"}
    assert {r.kind for r in runs} == {"main", "gamma", "net", "ref"}


def test_cli_rejects_unknown_stack_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, out, err = run_cli(
        capsys, "reproduce", "kunserve", "--quick", "--stacks", "wf,kunserv", "--out", tmp_path
    )
    assert_one_line_error(rc, out, err, "kunserv")
    assert not (tmp_path / "provision.json").exists()  # nothing ran


def test_report_only_needs_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = run_cli(
        capsys, "reproduce", "kunserve", "--report-only", "--out", tmp_path / "none"
    )
    assert_one_line_error(rc, out, err, "runs/")


# --------------------------------------------------------------------------- provisioning


def test_time_average_is_time_weighted() -> None:
    # 0 for 1 s, then 10 for 3 s (samples at 0, 1, 2, 4; trapezoids between them)
    assert time_average([0, 1, 2, 4], [0, 0, 10, 10], 4) == pytest.approx((5 + 20) / 4)
    # samples after the window are cut; the last value is held to its end
    assert time_average([0, 2, 5], [4, 4, 100], 3) == pytest.approx(4.0)
    assert time_average([], [], 3) == 0.0
    assert time_average([1.0], [7.0], 3) == pytest.approx(7.0)


def test_provision_arithmetic() -> None:
    per_token = get_model("qwen-2.5-14b").kv_bytes_per_token
    tokens = [0, 8000, 8000, 0]
    avg, peak, kv = provision_from_samples([0, 1, 3, 4], [t * per_token for t in tokens], 4)
    assert avg == pytest.approx((4000 + 16000 + 4000) / 4)
    assert peak == pytest.approx(8000)
    assert kv == round(KV_FACTOR * avg / 8)
    d = ks.derived_numbers(kv)
    assert d["kv_gb_per_gpu"] == pytest.approx(kv * per_token / 1e9)
    assert d["param_to_kv"] == pytest.approx(d["param_gb_per_gpu"] / d["kv_gb_per_gpu"])
    # the paper's setup: all of an A800's HBM at 0.9 for KV, parameters ~0.6x the KV region
    assert 0.5 < d["full_hbm_param_to_kv"] < 0.7


@needs_azure
def test_probe_measures_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mode = Mode(quick=True, scale=0.05)
    prof = PROFILES[0]
    p = measure_provision(prof, mode)
    assert p.avg_tokens > 0 and p.peak_tokens >= p.avg_tokens
    assert p.kv_tokens == round(KV_FACTOR * p.avg_tokens / 8)
    assert p.probe_wall_s < 2.0
    cfg = config_from_dict(p.probe)
    assert cfg.policy.stack == "wf" and cfg.kunserve.kv_tokens is None
    assert cfg.kunserve.rate == prof.base_rate and cfg.kunserve.burst_factor == 14.0

    calls: list[str] = []

    def fake(profile: ks.Profile, mode: Mode, out: Path | None = None) -> ks.Provision:
        calls.append(profile.name)
        return ks.Provision(
            profile.name, profile.base_rate, 100.0, 200.0, 42, ks.probe_config(profile, mode), 0.1
        )

    monkeypatch.setattr(ks, "measure_provision", fake)
    got = provision(tmp_path, mode)
    assert sorted(calls) == sorted(q.name for q in PROFILES)
    assert {k: v.kv_tokens for k, v in got.items()} == {q.name: 42 for q in PROFILES}
    data = json.loads((tmp_path / "provision.json").read_text())
    assert len(data["probes"]) == len(PROFILES) and data["kv_factor"] == KV_FACTOR
    calls.clear()
    assert provision(tmp_path, mode) == got and calls == []  # cached
    assert provision(tmp_path, Mode(quick=True, scale=0.05, seed=1), probe=False) == {}
    provision(tmp_path, Mode(quick=True, scale=0.05, seed=1))  # another seed: probed, added
    assert len(json.loads((tmp_path / "provision.json").read_text())["probes"]) == 2 * len(PROFILES)


# --------------------------------------------------------------------------- SLOs and claims


def test_slo_violations_counts_unfinished_and_either_slo() -> None:
    reqs = [
        ("finished", 0.0, 0.1, 0.01),  # fine
        ("finished", 0.0, 0.9, 0.01),  # TTFT over
        ("finished", 0.0, 0.1, 0.20),  # TBT over
        ("finished", 0.0, 0.1, None),  # one output token: no TBT
        ("unfinished", 0.0, None, None),
    ]
    both, ttft, tbt = slo_violations(reqs, 0.5, 0.1) or (0, 0, 0)
    assert both == pytest.approx(3 / 5)
    assert ttft == pytest.approx(2 / 5) and tbt == pytest.approx(2 / 5)
    assert slo_violations([], 1.0, 1.0) is None


def test_level_combine_share() -> None:
    assert level(None, 2.0) is None
    assert level(3.0, 2.0) == YES and level(1.5, 2.0) == PARTLY and level(1.0, 2.0) == NO
    assert level(0.2, 0.5, direction=0.0) == PARTLY and level(-0.1, 0.5, direction=0.0) == NO
    assert combine([YES, YES, None]) == YES and combine([NO, NO]) == NO
    assert combine([YES, NO]) == PARTLY and combine([PARTLY]) == PARTLY and combine([]) == NA
    assert share([True, True]) == YES and share([True, False]) == PARTLY
    assert share([False]) == NO and share([]) == NA


def _rows(mode: Mode, good: bool) -> dict[Run, dict[str, Any]]:
    """Synthetic rows for every run: KunServe as the paper has it (``good``) or worse
    than every baseline."""
    rows: dict[Run, dict[str, Any]] = {}
    runs = [*ks.probe_runs(), *grid_runs(mode)]
    for r in runs:
        kun = r.stack.startswith("kunserve")
        ttft = 1.0 if kun else (30.0 if good else 0.5)
        tbt = 0.020
        if r.stack == "kunserve":
            tbt = 0.022 if good else 0.080
        if r.stack == "kunserve-norestore":
            ttft = 40.0 if good else 1.0
        if r.stack == "kunserve-memgreedy":
            ttft = 1.3 if good else 0.9
        if r.kind == "ref":
            ttft, tbt = 0.1, (0.036 if good and r.stack == "pipeline" else 0.020)
        victims = 100
        mean_decode = 0.1 if r.stack == "kunserve" else 1.0
        if not good:
            mean_decode = 2.0 if r.stack == "kunserve" else 1.0
        rows[r] = {
            "ttft_p50_s": ttft / 2,
            "ttft_p99_s": ttft,
            "tbt_p50_s": tbt,
            "tbt_p99_s": 2 * tbt,
            "slo_violation": (0.0 if good else 0.6) if r.stack == "kunserve" else 0.4,
            "victims": victims,
            "victim_mean_decode_s": mean_decode,
        }
    return rows


@pytest.mark.parametrize("quick", [False, True])
def test_claims_reproduce_on_paper_like_rows(quick: bool) -> None:
    mode = Mode(quick=quick)
    got = claims(_rows(mode, good=True), mode)
    assert len(got) == 10
    assert [c["reproduces"] for c in got] == [YES] * 10, [
        (c["claim"], c["measured"]) for c in got if c["reproduces"] != YES
    ]


@pytest.mark.parametrize("quick", [False, True])
def test_claims_fail_on_contrary_rows(quick: bool) -> None:
    mode = Mode(quick=quick)
    got = claims(_rows(mode, good=False), mode)
    assert [c["reproduces"] for c in got] == [NO] * 10, [
        (c["claim"], c["measured"]) for c in got if c["reproduces"] != NO
    ]


def test_claims_without_runs_are_na() -> None:
    assert {c["reproduces"] for c in claims({}, Mode())} == {NA}


# --------------------------------------------------------------------------- smoke run


def test_smoke_quick_run_writes_report(smoke: tuple[Path, int]) -> None:
    out, rc = smoke
    assert rc == 0
    for name in ("table.md", "results.csv", "results.json", "provision.json"):
        assert (out / name).is_file(), name
    for name in FIGURES:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    report = json.loads((out / "results.json").read_text())
    mode = Mode(quick=True, scale=float(SCALE))
    assert report["mode"]["name"] == mode.name
    assert len(report["runs"]) == len(grid_runs(mode)) + len(PROFILES)  # + the probes
    assert not report["notes"], report["notes"]
    assert {c["reproduces"] for c in report["claims"]} <= {YES, PARTLY, NO, NA}
    assert set(report["provisioning"]) == {p.name for p in PROFILES}
    assert set(report["slo"]) == {p.name for p in PROFILES}
    assert all(r["slo_violation"] is not None for r in report["runs"])
    table = (out / "table.md").read_text()
    assert "What the paper reports vs what we measured" in table
    for name in FIGURES:
        assert f"({name})" in table
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 1 + len(report["runs"])
    # every run is a normal result folder whose config is the planned one
    for r in grid_runs(mode)[:3]:
        s = json.loads((r.out_dir(out) / "summary.json").read_text())
        kv = report["provisioning"][r.profile]["kv_tokens"]
        assert s["config"]["kunserve"] == {
            **s["config"]["kunserve"],
            **run_config(r, mode, kv)["kunserve"],
        }


def test_report_only_rebuilds_without_probing(
    smoke: tuple[Path, int], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, rc = smoke
    assert rc == 0

    def no_probe(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("--report-only must not probe")

    # The quick report's figures are the smoke run's: it drew them from the same
    # runs (the rows are equal, checked below) and they are checked there; drawing
    # them again here and in the restore at the end was most of this test's time.
    drawn = {name: (out / name).read_bytes() for name in FIGURES}

    def figures_of_the_smoke_run(fig_out: Path, _rows: Any, _mode: Any) -> list[Path]:
        for name, png in drawn.items():
            (fig_out / name).write_bytes(png)
        return [fig_out / name for name in FIGURES]

    monkeypatch.setattr(ks, "measure_provision", no_probe)
    before = json.loads((out / "results.json").read_text())
    (out / "table.md").unlink()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kr, "write_figures", figures_of_the_smoke_run)
        rc2, stdout, err = run_cli(
            capsys, "reproduce", "kunserve", "--quick", "--scale", SCALE, "--report-only",
            "--out", out,
        )  # fmt: skip
    assert rc2 == 0, err
    assert (out / "table.md").is_file()
    after = json.loads((out / "results.json").read_text())
    assert after["runs"] == before["runs"] and after["claims"] == before["claims"]
    assert "What the paper reports" in stdout
    # a full-mode report of quick runs leaves every run out, with notes, and does not probe
    rc3, _, err3 = run_cli(
        capsys, "reproduce", "kunserve", "--scale", SCALE, "--report-only", "--out", out
    )
    assert rc3 == 0, err3
    full = json.loads((out / "results.json").read_text())
    assert full["runs"] == [] and full["notes"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kr, "write_figures", figures_of_the_smoke_run)
        run_cli(
            capsys, "reproduce", "kunserve", "--quick", "--scale", SCALE, "--report-only",
            "--out", out,
        )  # fmt: skip
