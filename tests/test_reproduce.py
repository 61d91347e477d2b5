"""``fleetserve reproduce mell``: the grid runs, its report, and bad input.

The runs use small generated traces (``$FLEETSERVE_DATA`` points at them) and
the hidden ``--scale`` knob (arrival windows x0.02 = 72 s), so the whole
file takes a few seconds. Stacks ``llumnix`` and ``mell`` are exercised
through the report only (hand-made summaries), so these tests do not depend
on those policies.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from png_util import skip_rendering, skip_run_rendering

from fleetserve.cli.main import main
from fleetserve.experiments.mell import (
    HARDWARE,
    STACKS,
    WORKLOADS,
    Mode,
    grid_specs,
    run_config,
    run_dir,
    select_stacks,
)
from fleetserve.experiments.mell_figures import batching, claims, collect, savings
from fleetserve.experiments.mell_report import write_report
from fleetserve.experiments.runner import RunSpec, execute_run, run_grid
from fleetserve.workload.data import DATA_ENV

SCALE = "0.02"
FIGURES = (
    "fig11_gpus.png",
    "fig12_migrations.png",
    "fig13_batching.png",
    "fig14_kv_util.png",
    "fig15_gpus_over_time.png",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- fixtures


def make_data(folder: Path) -> Path:
    """Small stand-ins for the shared ShareGPT lengths and Azure conv traces."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    with (folder / "sharegpt_8k_lengths.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["num_prefill_tokens", "num_decode_tokens", "num_total_tokens", "pd_ratio"])
        for _ in range(200):
            p, d = int(rng.integers(30, 300)), int(rng.integers(10, 120))
            w.writerow([p, d, p + d, p / d])
    with (folder / "azure_llm_2023_conv.csv").open("w", newline="") as fh:
        fh.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for i in range(150):
            sec = 10 + i * 0.5
            stamp = f"2023-11-16 18:{int(sec // 60):02d}:{sec % 60:010.7f}"
            fh.write(f"{stamp},{int(rng.integers(50, 400))},{int(rng.integers(10, 100))}\n")
    return folder


@pytest.fixture(autouse=True)
def _plain_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def smoke(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One bf,wf run of the grid with two worker processes and the progress display."""
    out = tmp_path_factory.mktemp("smoke") / "mell"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DATA_ENV, str(data_dir))
        mp.setenv("NO_COLOR", "1")
        mp.setenv("COLUMNS", "200")
        argv = ["reproduce", "mell", "--stacks", "bf,wf", "--scale", SCALE, "--jobs", "2"]
        rc = main([*argv, "--out", str(out)])
    assert rc == 0
    return out


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, out: str, err: str, *needles: str) -> str:
    assert "Traceback" not in out + err, out + err
    assert rc == 2, f"exit code {rc}; stderr: {err!r}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {err!r}"
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


# --------------------------------------------------------------------------- the smoke run


def test_smoke_run_writes_every_output(smoke: Path) -> None:
    out = smoke
    for name in ("table.md", "results.csv", "results.json", *FIGURES):
        assert (out / name).is_file(), name
    for name in FIGURES:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    for hw in HARDWARE:
        for wl in WORKLOADS:
            for st in select_stacks(["bf", "wf"]):
                d = run_dir(out, hw, wl, st)
                for f in ("summary.json", "timeseries.csv", "requests.csv", "report.md"):
                    assert (d / f).is_file(), d / f
            for st in select_stacks(["llumnix", "mell", "mell-nobatch"]):
                assert not run_dir(out, hw, wl, st).exists()


def test_results_json_matches_the_runs(smoke: Path) -> None:
    out = smoke
    res = load(out / "results.json")
    assert res["experiment"] == "mell"
    assert res["mode"]["window_s"] == pytest.approx(3600 * float(SCALE))
    assert res["notes"] == []
    runs = {(r["hardware"], r["workload"], r["stack"]): r for r in res["runs"]}
    assert len(runs) == len(HARDWARE) * len(WORKLOADS) * 2
    for (hw, wl, st), r in runs.items():
        s = load(out / "runs" / hw / wl / st / "summary.json")
        assert r["gpus_peak"] == s["gpus"]["peak"]
        assert r["gpus_lower_bound"] == s["gpus"]["lower_bound"]
        assert r["peak_over_lower_bound"] == pytest.approx(
            s["gpus"]["peak"] / s["gpus"]["lower_bound"]
        )
        assert r["migrations"] == s["migrations"]["count"] == 0  # bf and wf never migrate
        assert r["kv_utilization"] == pytest.approx(s["kv_utilization"]["mean"])
        assert r["requests"] == s["requests"]["total"] > 0
        assert s["config"]["cluster"]["elastic"] is True
        assert s["config"]["workload"]["length_scale"] == 10
        assert s["config"]["workload"]["cap_lengths"] is True
    # Every stack of a workload replays the same requests.
    for hw in HARDWARE:
        for wl in WORKLOADS:
            assert (
                runs[(hw.name, wl.name, "bf")]["requests"]
                == runs[(hw.name, wl.name, "wf")]["requests"]
            )
    # Mell was not run: no savings, no batching figures, every claim n/a.
    assert all(s["saving_pct"] is None for s in res["savings"])
    assert all(b["reduction_pct"] is None for b in res["batching"])
    assert {c["reproduces"] for c in res["claims"]} == {"n/a"}

    with (out / "results.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(runs)
    for row in rows:
        assert (
            int(row["gpus_peak"])
            == runs[(row["hardware"], row["workload"], row["stack"])]["gpus_peak"]
        )


def test_table_shows_the_figures_and_dashes_for_missing_stacks(smoke: Path) -> None:
    out = smoke
    table = (out / "table.md").read_text()
    res = load(out / "results.json")
    runs = {(r["hardware"], r["workload"], r["stack"]): r for r in res["runs"]}
    for hw in HARDWARE:
        assert f"## {hw.label}" in table
        section = table.split(f"## {hw.label}")[1].split("### Mell's GPU saving")[0]
        for wl in WORKLOADS:
            line = next(ln for ln in section.splitlines() if ln.startswith(f"| {wl.label} |"))
            cells = [c.strip() for c in line.strip("|").split("|")]
            bf, wf = runs[(hw.name, wl.name, "bf")], runs[(hw.name, wl.name, "wf")]
            assert cells[1].startswith(f"{bf['gpus_peak']} (")
            assert cells[2].startswith(f"{wf['gpus_peak']} (")
            assert cells[3:6] == ["—", "—", "—"]  # llumnix, mell, mell-nobatch
    for heading in ("Fig. 11", "Fig. 12", "Fig. 13", "Fig. 14"):
        assert heading in table
    assert "## What the paper reports vs what we measured" in table
    for f in FIGURES:
        assert f"({f})" in table


def test_a_run_is_deterministic_in_process(
    smoke: Path, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run repeated in this process equals the one made in a worker process."""
    skip_run_rendering(monkeypatch)  # the same run's plots: the smoke run rendered them
    specs = grid_specs(tmp_path, select_stacks(["wf"]), Mode(scale=float(SCALE)), data_dir)
    spec = next(s for s in specs if s.key.endswith("/poisson-1.1/wf"))
    outcome = execute_run(spec)
    a = load(smoke / spec.out_dir.relative_to(tmp_path) / "summary.json")
    b = load(outcome.out_dir / "summary.json")
    for k in ("requests", "gpus", "kv_utilization", "latency_s", "migrations", "config"):
        assert a[k] == b[k], k


def test_a_failing_run_does_not_stop_the_grid(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_run_rendering(monkeypatch)  # the good run's plots: nothing here looks at them
    specs = grid_specs(tmp_path, select_stacks(["bf"]), Mode(scale=0.005), data_dir)
    good = next(s for s in specs if s.key.endswith("/poisson-0.5/bf"))
    bad = RunSpec("bad/run", tmp_path / "bad", {**good.config, "nosuch": 1})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "summary.json").write_text("{}")  # stale: must not survive
    got_bad, got_good = run_grid([bad, good], jobs=1)
    assert got_good.error is None and (good.out_dir / "summary.json").is_file()
    assert got_bad.error is not None and "nosuch" in got_bad.error
    assert (tmp_path / "bad" / "error.txt").is_file()
    assert not (tmp_path / "bad" / "summary.json").exists()


def test_report_only_rebuilds_from_the_runs_on_disk(
    smoke: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "copy"
    shutil.copytree(smoke / "runs", out / "runs")
    # The runs were made at scale 0.02 (full): for a --quick report they do not count.
    rows, notes = collect(out, Mode(quick=True, scale=float(SCALE)))
    assert rows == {}
    assert len(notes) == len(HARDWARE) * len(WORKLOADS) * 2
    assert "made with other settings" in notes[0]
    # One run removed: the report still renders, with a dash in its place.
    hw, wl = HARDWARE[0], WORKLOADS[0]
    shutil.rmtree(out / "runs" / hw.name / wl.name / "wf")
    rc, _, e = run_cli(capsys, "reproduce", "mell", "--report-only", "--scale", SCALE, "--out", out)
    assert rc == 0, e
    assert len(load(out / "results.json")["runs"]) == len(HARDWARE) * len(WORKLOADS) * 2 - 1
    section = (out / "table.md").read_text().split(f"## {hw.label}")[1]
    line = next(ln for ln in section.splitlines() if ln.startswith(f"| {wl.label} |"))
    assert [c.strip() for c in line.strip("|").split("|")][2] == "—"


# --------------------------------------------------------------------------- report logic


def _fake_runs(out: Path, mode: Mode, data: Path) -> None:
    """Summaries for all five stacks: Mell 20% below bf, 10% below LB, batching -25%."""
    peaks = {"bf": 100, "wf": 100, "llumnix": 90, "mell": 80, "mell-nobatch": 82}
    migs = {"bf": 0, "wf": 0, "llumnix": 400, "mell": 150, "mell-nobatch": 200}
    util = {"bf": 0.7, "wf": 0.75, "llumnix": 0.8, "mell": 0.9, "mell-nobatch": 0.89}
    for hw in HARDWARE:
        for i, wl in enumerate(WORKLOADS):
            for st in STACKS:
                cfg = run_config(hw, wl, st, mode, data)
                cfg["policy"] = {"stack": st.stack}
                peak = peaks[st.label] + (i * 10 if st.label != "mell" else i * 5)
                s = {
                    "requests": {"total": 10, "finished": 10, "rejected": 0, "unfinished": 0},
                    "gpus": {"peak": peak, "mean": peak / 2, "lower_bound": 70},
                    "migrations": {"count": migs[st.label], "per_s": migs[st.label] / 1000},
                    "kv_utilization": {"mean": util[st.label]},
                    "config": cfg,
                    "notes": [],
                }
                d = run_dir(out, hw, wl, st)
                d.mkdir(parents=True)
                (d / "summary.json").write_text(json.dumps(s))
                (d / "timeseries.csv").write_text("t,active_gpus\n0,1\n10,3\n20,0\n")


def test_claims_are_computed_from_the_runs(tmp_path: Path) -> None:
    mode = Mode(scale=0.5)
    _fake_runs(tmp_path, mode, tmp_path / "data")
    rows, notes = collect(tmp_path, mode)
    assert notes == [] and len(rows) == len(HARDWARE) * len(WORKLOADS) * len(STACKS)
    saved = savings(rows)
    vs_bf = [s["saving_pct"] for s in saved if s["baseline"] == "bf"]
    assert vs_bf[0] == pytest.approx(20.0)  # 80 vs 100
    batched = batching(rows)
    assert [b["reduction_pct"] for b in batched] == [pytest.approx(25.0)] * len(batched)
    verdicts = {c["claim"]: c["reproduces"] for c in claims(rows, saved, batched)}
    assert set(verdicts.values()) == {"yes"}, verdicts

    files, report = write_report(tmp_path, mode, wall_s=None, jobs=1)
    assert {p.name for p in files} >= {"table.md", "results.csv", "results.json", *FIGURES}
    table = (tmp_path / "table.md").read_text()
    assert "+20.0%" in table and "25.0%" in table
    mell_rows = [r for r in report["runs"] if r["stack"] == "mell"]
    assert all(r["batching_reduction_pct"] == pytest.approx(25.0) for r in mell_rows)


def test_claims_are_na_or_no_when_the_data_says_so(tmp_path: Path) -> None:
    mode = Mode(scale=0.5)
    _fake_runs(tmp_path, mode, tmp_path / "data")
    rows, _ = collect(tmp_path, mode)
    # Mell worse than every baseline, LB missing.
    for key, r in rows.items():
        if key[2] == "mell":
            r["gpus_peak"] = 1000
    rows = {k: v for k, v in rows.items() if k[2] != "llumnix"}
    saved = savings(rows)
    got = {c["claim"]: c["reproduces"] for c in claims(rows, saved, batching(rows))}
    assert got["Mell needs fewer GPUs than BF and WF"] == "no"
    assert got["Mell needs fewer GPUs than LB (Llumnix)"] == "n/a"
    assert got["Mell migrates less often than LB"] == "n/a"


def test_specs_share_arrivals_across_stacks_and_put_heavy_runs_first(tmp_path: Path) -> None:
    specs = grid_specs(tmp_path, select_stacks(None), Mode(), tmp_path)
    assert len(specs) == len(HARDWARE) * len(WORKLOADS) * len(STACKS)
    by_key = {s.key: s for s in specs}
    a = by_key["llama-2-13b_a100-40gb/poisson-1.1/bf"].config
    b = by_key["llama-2-13b_a100-40gb/poisson-1.1/mell-nobatch"].config
    assert a["workload"] == b["workload"] and a["seed"] == b["seed"]
    assert b["mell"] == {"batching": False} and b["policy"] == {"stack": "mell"}
    assert (
        by_key["llama-2-13b_a100-40gb/azure-conv/mell"].weight
        > by_key["llama-2-13b_a100-40gb/poisson-0.5/bf"].weight
    )


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--stacks", "bf,nosuch"], ["unknown stack 'nosuch'", "mell-nobatch"]),
        (["--stacks", "bf,bf"], ["twice"]),
        (["--stacks", ","], ["at least one"]),
        (["--jobs", "0"], ["--jobs"]),
        (["--scale", "0"], ["--scale"]),
    ],
)
def test_bad_arguments_are_one_line_errors(
    argv: list[str],
    needles: list[str],
    data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DATA_ENV, str(data_dir))
    out = tmp_path / "out"
    rc, o, e = run_cli(capsys, "reproduce", "mell", *argv, "--out", out)
    assert_one_line_error(rc, o, e, *needles)
    assert not out.exists()


def test_unknown_experiment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, o, e = run_cli(capsys, "reproduce", "mel", "--out", tmp_path / "x")
    assert_one_line_error(rc, o, e, "unknown experiment 'mel'", "mell")


def test_missing_data_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "nowhere"))
    out = tmp_path / "out"
    rc, o, e = run_cli(capsys, "reproduce", "mell", "--stacks", "bf", "--out", out)
    assert_one_line_error(rc, o, e, "shared trace data not found", DATA_ENV)
    assert not out.exists()


def test_report_only_needs_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, o, e = run_cli(capsys, "reproduce", "mell", "--report-only", "--out", tmp_path)
    assert_one_line_error(rc, o, e, "no runs/")


def test_set_overrides_every_run_and_is_recorded(
    data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``reproduce --set``: every run's config carries the override (e.g. Mell's
    testbed links), OUT/overrides.txt records it; a key no run reads is refused
    before anything runs."""
    monkeypatch.setenv(DATA_ENV, str(data_dir))
    # The figures are built but not rendered: the smoke run renders the same ones
    # for the same stack (bf) and checks the report's; here only the configs
    # matter, and rendering was most of this test's time.
    skip_rendering(monkeypatch)
    out = tmp_path / "out"
    link = "cluster.intra_node_bw=32000000000"
    rc, _, e = run_cli(
        capsys, "reproduce", "mell", "--stacks", "bf", "--scale", SCALE, "--jobs", "1",
        "--no-progress", "--set", link, "--out", out,
    )  # fmt: skip
    assert rc == 0, e
    assert (out / "overrides.txt").read_text() == link + "\n"
    summaries = list(out.glob("runs/**/summary.json"))
    assert summaries
    for path in summaries:
        assert json.loads(path.read_text())["config"]["cluster"]["intra_node_bw"] == 32e9
    rc, o, e = run_cli(
        capsys, "reproduce", "mell", "--stacks", "bf", "--scale", SCALE, "--set",
        "cluster.nosuch=1", "--out", tmp_path / "bad",
    )  # fmt: skip
    assert_one_line_error(rc, o, e, "--set on run", "nosuch")
    assert not (tmp_path / "bad" / "overrides.txt").exists()  # refused before anything
