"""``fleetserve reproduce seallm|muxserve``: grids, reports, claims and bad input.

Real runs use a small generated ShareGPT file (``$FLEETSERVE_DATA`` points at
it) and the hidden ``--scale`` knob (run lengths x0.1: 12 s runs after a 6 s
history), with cheap stacks; the report and the claims are also checked on
hand-made rows and run folders, so nothing here depends on how well a policy
does.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from png_util import skip_run_rendering
from test_cli import assert_one_line_error, run_cli

from fleetserve.cli.main import main
from fleetserve.config import config_from_dict
from fleetserve.errors import FleetserveError, UnknownNameError
from fleetserve.experiments import EXPERIMENTS, check_experiment
from fleetserve.experiments.multi_llm import (
    MUXSERVE,
    SEALLM,
    SLO_SCALES,
    Mode,
    grid_specs,
    run_config,
    run_dir,
    select_stacks,
)
from fleetserve.experiments.multi_llm_report import (
    aggregated_throughput,
    collect,
    muxserve_claims,
    seallm_claims,
    verdict,
    write_report,
)
from fleetserve.experiments.runner import RunSpec
from fleetserve.workload.data import DATA_ENV

SCALE = "0.1"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = {
    "seallm": (
        "fig6_latency_slo.png",
        "fig8_ablation.png",
        "fig7_ttft_tpot.png",
        "fig10_slo_scale.png",
    ),
    "muxserve": ("fig5_throughput_slo.png", "fig9_scheduling.png", "slo_scale.png"),
}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def _plain_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small stand-in for the shared ShareGPT lengths file."""
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(3)
    with (folder / "sharegpt_8k_lengths.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["num_prefill_tokens", "num_decode_tokens", "num_total_tokens", "pd_ratio"])
        for _ in range(200):
            p, d = int(rng.integers(20, 200)), int(rng.integers(5, 60))
            w.writerow([p, d, p + d, p / d])
    return folder


@pytest.fixture(scope="module")
def seallm_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny real ``reproduce seallm --quick`` with two cheap stacks, in process.
    Each run folder's plots are built but not rendered (nothing here looks at
    them); the report's figures are rendered."""
    out = tmp_path_factory.mktemp("seallm") / "out"
    with pytest.MonkeyPatch.context() as mp:
        skip_run_rendering(mp)
        mp.setenv(DATA_ENV, str(data_dir))
        mp.setenv("NO_COLOR", "1")
        mp.setenv("COLUMNS", "200")
        argv = ["reproduce", "seallm", "--quick", "--scale", SCALE, "--jobs", "1"]
        argv += ["--stacks", "vllm,seallm-noplace", "--no-progress", "--out", str(out)]
        rc = main(argv)
    assert rc == 0
    return out, "quick"


# --------------------------------------------------------------------------- the grid


@pytest.mark.parametrize("exp", [SEALLM, MUXSERVE], ids=lambda e: e.name)
@pytest.mark.parametrize("quick", [False, True])
def test_grid_has_one_valid_config_per_point_and_stack(
    exp: Any, quick: bool, tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DATA_ENV, str(data_dir))
    mode = Mode(quick=quick)
    stacks = select_stacks(exp, None, mode)
    specs = grid_specs(tmp_path, exp, stacks, mode)
    points = mode.points(exp)
    assert len(specs) == len(points) * len(stacks)
    assert [s.key for s in specs] == [
        f"{exp.axis}-{v:g}/{st.label}" for v in points for st in stacks
    ]
    seeds: dict[float, set[int]] = {}
    for spec in specs:
        cfg = config_from_dict(spec.config)
        assert cfg.is_multi and cfg.multi.generator == exp.generator
        assert cfg.multi.processes == 1
        assert cfg.cluster.gpus == exp.gpus and cfg.cluster.gpu == exp.gpu
        assert tuple(cfg.slo_scales) == SLO_SCALES
        assert cfg.multi.duration_s == mode.sizes(exp).duration_s
        v = float(spec.key.split("/")[0].split("-", 1)[1])
        assert cfg.multi.alpha == v if exp.axis == "alpha" else cfg.multi.rate == v
        assert spec.out_dir == run_dir(tmp_path, exp, v, spec.key.split("/")[1])
        seeds.setdefault(v, set()).add(cfg.seed)
    # every run has the same seed: common random numbers across stacks and points
    assert set().union(*seeds.values()) == {0}


def test_quick_is_smaller_and_seeded_like_full() -> None:
    for exp in (SEALLM, MUXSERVE):
        full, quick = Mode(seed=5), Mode(quick=True, seed=5)
        assert set(quick.points(exp)) <= set(full.points(exp))
        assert quick.sizes(exp).duration_s < full.sizes(exp).duration_s
        st = exp.stacks[0]
        for v in quick.points(exp):
            assert (
                run_config(exp, v, st, quick)["seed"] == 5 == run_config(exp, v, st, full)["seed"]
            )


def test_scale_shrinks_every_length_and_keeps_the_interval_valid() -> None:
    mode = Mode(quick=True, scale=0.05)
    cfg = config_from_dict(run_config(SEALLM, 1.0, SEALLM.stacks[3], mode))
    assert cfg.multi.duration_s == pytest.approx(6.0)
    assert cfg.multi.history_s == pytest.approx(3.0)
    assert cfg.multi.min_interval_s <= cfg.multi.replacement_interval_s
    assert mode.name == "quick x0.05"


def test_seallm_history_predicts_the_run_and_the_hot_service_changes_once() -> None:
    """The hot service of the history stays hot into the run, and changes once after it
    (issue 22: a history that predicts the run); MuxServe's generator has no rotation."""
    for mode in (Mode(), Mode(quick=True), Mode(quick=True, scale=0.05)):
        sizes = mode.sizes(SEALLM)
        cfg = config_from_dict(run_config(SEALLM, 1.0, SEALLM.stacks[3], mode))
        assert cfg.multi.rotate_s == pytest.approx(sizes.rotate_s)
        rotate, history, end = cfg.multi.rotate_s, cfg.multi.history_s, cfg.multi.duration_s
        assert history < rotate < history + end <= 2 * rotate  # one change, inside the run
    assert "rotate_s" not in run_config(MUXSERVE, 0.7, MUXSERVE.stacks[0], Mode())["multi"]


def test_stack_selection() -> None:
    mode = Mode()
    assert [s.label for s in select_stacks(MUXSERVE, ["muxserve", "vllm"], mode)] == [
        "vllm",
        "muxserve",
    ]  # display order
    with pytest.raises(UnknownNameError, match="nosuch"):
        select_stacks(SEALLM, ["nosuch"], mode)
    with pytest.raises(FleetserveError, match="twice"):
        select_stacks(SEALLM, ["vllm", "vllm"], mode)
    with pytest.raises(FleetserveError, match="at least one"):
        select_stacks(SEALLM, [], mode)


def test_check_experiment_knows_the_multi_llm_experiments() -> None:
    for name in ("mell", "seallm", "muxserve"):
        assert check_experiment(name) == name and name in EXPERIMENTS
    with pytest.raises(UnknownNameError) as e:
        check_experiment("seallmm")
    assert "seallm" in str(e.value)


# --------------------------------------------------------------------------- claims


def test_verdict() -> None:
    assert verdict([]) == "n/a"
    assert verdict([True, True]) == "yes"
    assert verdict([True, False]) == "partly"
    assert verdict([False, False]) == "no"


def _row(v: float, stack: str, **fields: float) -> dict[str, Any]:
    base: dict[str, Any] = {
        "value": v,
        "stack": stack,
        "requests": 10,
        "rejected": 0,
        "unfinished": 0,
        "normalized_latency": 2.0,
        "e2e_p99_s": 10.0,
        "slo_attainment": 0.9,
        "ttft_mean_s": 1.0,
        "tpot_mean_s": 0.05,
        "agg_throughput_rps": 10.0,
        "search_max_s": None,
    }
    base.update(fields)
    base["slo"] = {s: base["slo_attainment"] for s in SLO_SCALES}
    return base


def _by(claimed: list[dict[str, str]], needle: str) -> str:
    return next(c["reproduces"] for c in claimed if needle in c["claim"])


def test_seallm_claims_follow_the_numbers() -> None:
    points = (1.0, 2.0)
    good = {}
    for v in points:
        good[(v, "seallm")] = _row(
            v,
            "seallm",
            normalized_latency=1.0,
            e2e_p99_s=5.0,
            slo_attainment=0.95,
            ttft_mean_s=0.5,
            tpot_mean_s=0.01,
            search_max_s=2.0,
        )
        good[(v, "vllm")] = _row(v, "vllm")
        good[(v, "alpaserve")] = _row(v, "alpaserve", tpot_mean_s=0.2)
        good[(v, "muxserve")] = _row(v, "muxserve", ttft_mean_s=3.0)
        good[(v, "seallm-fcfs")] = _row(v, "seallm-fcfs", normalized_latency=1.5)
    claimed = seallm_claims(SEALLM, good, points)
    for needle in (
        "lowest normalized latency",
        "lowest P99",
        "highest SLO attainment at 5",
        "lowest mean TTFT",
        "stays < 3",
        "TPOT is below",
        "MuxServe's mean TTFT is the worst",
        "every SLO scale",
        "SeaLLM-F",
        "under a minute",
    ):
        assert _by(claimed, needle) == "yes", needle
    assert _by(claimed, "SeaLLM-M") == "n/a"  # not run
    assert _by(claimed, "no 2-services cap") == "n/a"  # the variant: not run

    bad = dict(good)
    bad[(1.0, "seallm")] = _row(
        1.0, "seallm", normalized_latency=5.0, e2e_p99_s=50.0, slo_attainment=0.5, search_max_s=90.0
    )
    bad[(2.0, "seallm")] = bad[(1.0, "seallm")] | {"value": 2.0}
    for v in points:
        bad[(v, "muxserve")] = _row(v, "muxserve", ttft_mean_s=0.1)
    claimed = seallm_claims(SEALLM, bad, points)
    assert _by(claimed, "lowest normalized latency") == "no"
    assert _by(claimed, "highest SLO attainment at 5") == "no"
    assert _by(claimed, "stays < 3") == "no"
    assert _by(claimed, "MuxServe's mean TTFT is the worst") == "no"
    assert _by(claimed, "SeaLLM-F") == "no"  # the ablation is better than SeaLLM here
    assert _by(claimed, "under a minute") == "no"


def test_an_ablation_equal_to_seallm_is_not_worse() -> None:
    rows = {
        (1.0, "seallm"): _row(1.0, "seallm", normalized_latency=1.0),
        (1.0, "seallm-norepl"): _row(1.0, "seallm-norepl", normalized_latency=1.001),
    }
    assert _by(seallm_claims(SEALLM, rows, (1.0,)), "SeaLLM-A") == "no"


def test_muxserve_claims_follow_the_numbers() -> None:
    points = (0.7, 1.3, 2.1)
    rows = {}
    for i, v in enumerate(points):
        rows[(v, "vllm")] = _row(v, "vllm", agg_throughput_rps=10.0, slo_attainment=0.8)
        rows[(v, "alpaserve")] = _row(v, "alpaserve", agg_throughput_rps=9.0, slo_attainment=0.7)
        rows[(v, "muxserve")] = _row(v, "muxserve", agg_throughput_rps=11.0 + i, slo_attainment=0.9)
        rows[(v, "muxserve-rr")] = _row(v, "muxserve-rr", agg_throughput_rps=9.5)
        rows[(v, "muxserve-fcfs")] = _row(v, "muxserve-fcfs", agg_throughput_rps=9.2)
    claimed = muxserve_claims(MUXSERVE, rows, points)
    assert all(c["reproduces"] == "yes" for c in claimed), claimed

    # the gain shrinks with alpha; FCFS beats round-robin at one alpha
    for i, v in enumerate(points):
        rows[(v, "muxserve")] = _row(v, "muxserve", agg_throughput_rps=13.0 - i, slo_attainment=0.9)
    rows[(2.1, "muxserve-fcfs")] = _row(2.1, "muxserve-fcfs", agg_throughput_rps=9.9)
    claimed = muxserve_claims(MUXSERVE, rows, points)
    assert _by(claimed, "over spatial partitioning (vLLM) grows") == "no"
    assert _by(claimed, "over temporal (AlpaServe) grows") == "no"
    assert _by(claimed, "highest aggregated throughput") == "yes"
    assert _by(claimed, "round-robin has higher throughput than FCFS") == "partly"


def test_aggregated_throughput_sums_services_over_their_own_span(tmp_path: Path) -> None:
    path = tmp_path / "requests.csv"
    rows = [
        # service a keeps up within the 10 s window: 4 requests / 10 s
        *[("a", "finished", 1.0 + i, 5) for i in range(4)],
        # service b falls behind: 2 requests finished by 40 s, one never
        ("b", "finished", 20.0, 10),
        ("b", "finished", 40.0, 10),
        ("b", "unfinished", "", 0),
    ]
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "model", "status", "finish_s", "generated"])
        for i, (m, st, fin, gen) in enumerate(rows):
            w.writerow([i, m, st, fin, gen])
    rps, tok = aggregated_throughput(path, 10.0)  # type: ignore[misc]
    assert rps == pytest.approx(4 / 10 + 2 / 40)
    assert tok == pytest.approx(20 / 10 + 20 / 40)
    assert aggregated_throughput(tmp_path / "missing.csv", 10.0) is None


# --------------------------------------------------------------------------- report


def _fake_run(out: Path, exp: Any, mode: Mode, v: float, stack: str, nl: float) -> None:
    """A hand-made run folder: ``summary.json`` with the grid's config + ``requests.csv``."""
    st = next(s for s in exp.stacks if s.label == stack)
    d = run_dir(out, exp, v, st)
    d.mkdir(parents=True)
    cfg = run_config(exp, v, st, mode)
    summary = {
        "requests": {"total": 3, "finished": 3, "rejected": 0, "unfinished": 0},
        "latency_s": {k: {"mean": nl, "p99": 3 * nl} for k in ("ttft", "tpot", "e2e")},
        "normalized_latency": nl,
        "slo_attainment": {f"{s:g}": min(1.0, s / 10) for s in SLO_SCALES},
        "throughput_rps": 1.0,
        "throughput_tokens_s": 10.0,
        "placement_search_s": [0.5],
        "replacement": {"replacements": 1, "switches": 1} if stack.startswith("seallm") else None,
        "sim": {"wall_s": 0.1},
        "config": {"run": cfg},
    }
    (d / "summary.json").write_text(json.dumps(summary))
    with (d / "requests.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "model", "status", "finish_s", "generated"])
        w.writerow([0, "s0", "finished", 1.0, 4])


@pytest.mark.parametrize("exp", [SEALLM, MUXSERVE], ids=lambda e: e.name)
def test_report_from_hand_made_runs(exp: Any, tmp_path: Path) -> None:
    mode = Mode(quick=True)
    points = mode.points(exp)
    for i, st in enumerate(exp.stacks[:2]):
        _fake_run(tmp_path, exp, mode, points[0], st.label, 1.0 + i)
    files, report = write_report(tmp_path, exp, mode, wall_s=None, jobs=1)
    names = {p.name for p in files}
    assert {"table.md", "results.csv", "results.json", *FIGURES[exp.name]} <= names
    for f in FIGURES[exp.name]:
        assert (tmp_path / f).read_bytes()[:8] == PNG_MAGIC
    assert len(report["runs"]) == 2
    assert json.loads((tmp_path / "results.json").read_text())["claims"] == report["claims"]
    assert report["table"]["rows"] and all(
        len(r) == len(report["table"]["columns"]) for r in report["table"]["rows"]
    )
    with (tmp_path / "results.csv").open() as fh:
        got = list(csv.DictReader(fh))
    assert [r["stack"] for r in got] == [s.label for s in exp.stacks[:2]]
    md = (tmp_path / "table.md").read_text()
    assert "What the paper reports vs what we measured" in md
    assert "—" in md  # points and stacks not run


def test_runs_from_another_mode_are_left_out_with_a_note(tmp_path: Path) -> None:
    quick = Mode(quick=True)
    v = quick.points(MUXSERVE)[0]
    _fake_run(tmp_path, MUXSERVE, quick, v, "vllm", 1.0)
    rows, notes = collect(tmp_path, MUXSERVE, Mode())
    assert not rows and any("other settings" in n for n in notes)
    rows, notes = collect(tmp_path, MUXSERVE, quick)
    assert list(rows) == [(v, "vllm")] and not notes


# --------------------------------------------------------------------------- real runs


def test_tiny_seallm_run_writes_every_output(seallm_run: tuple[Path, str]) -> None:
    out, _ = seallm_run
    for name in ("table.md", "results.csv", "results.json", *FIGURES["seallm"]):
        assert (out / name).is_file(), name
    report = json.loads((out / "results.json").read_text())
    assert report["experiment"] == "seallm" and report["mode"]["name"] == "quick x0.1"
    assert {(r["point"], r["stack"]) for r in report["runs"]} == {
        (f"rate-{v:g}", s) for v in SEALLM.quick_points for s in ("vllm", "seallm-noplace")
    }
    assert all(r["requests"] > 0 and r["normalized_latency"] for r in report["runs"])
    assert any(c["reproduces"] == "n/a" for c in report["claims"])  # SeaLLM itself not run


def test_report_only_rerenders_and_prints_the_tables(
    seallm_run: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = seallm_run
    (out / "table.md").unlink()
    rc, o, e = run_cli(
        capsys, "reproduce", "seallm", "--quick", "--scale", SCALE, "--report-only", "--out", out
    )
    assert rc == 0, e
    assert (out / "table.md").is_file()
    assert "seallm-noplace" in o and "What the paper reports vs what we measured" in o


def test_tiny_muxserve_run(
    data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DATA_ENV, str(data_dir))
    skip_run_rendering(monkeypatch)  # nothing here looks at each run's plots
    rc, o, e = run_cli(
        capsys,
        "reproduce",
        "muxserve",
        "--quick",
        "--scale",
        "0.05",
        "--jobs",
        "1",
        "--stacks",
        "vllm",
        "--no-progress",
        "--out",
        tmp_path,
    )
    assert rc == 0, e
    report = json.loads((tmp_path / "results.json").read_text())
    assert len(report["runs"]) == len(MUXSERVE.quick_points)
    assert all(r["agg_throughput_rps"] > 0 for r in report["runs"])
    assert "agg. req/s" in o


def test_a_failed_run_gives_exit_code_1(
    data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fleetserve.experiments.multi_llm as ml

    monkeypatch.setenv(DATA_ENV, str(data_dir))
    real = ml.plan

    def broken(*args: Any, **kwargs: Any) -> Any:
        exp, specs = real(*args, **kwargs)
        bad = RunSpec(specs[0].key, specs[0].out_dir, {**specs[0].config, "nosuch": 1})
        return exp, [bad]

    monkeypatch.setattr(ml, "plan", broken)
    rc, _o, e = run_cli(
        capsys,
        "reproduce",
        "seallm",
        "--quick",
        "--scale",
        SCALE,
        "--jobs",
        "1",
        "--stacks",
        "vllm",
        "--no-progress",
        "--out",
        tmp_path,
    )
    assert rc == 1
    assert "failed" in e and "nosuch" in e
    assert (tmp_path / "table.md").is_file()  # the report is still written


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["seallm", "--stacks", "vllm,nosuch"], ["nosuch", "seallm-norepl"]),
        (["muxserve", "--stacks", "vllm,vllm"], ["twice"]),
        (["seallm", "--stacks", ","], ["at least one"]),
        (["muxserve", "--jobs", "0"], ["--jobs"]),
        (["seallm", "--scale", "0"], ["--scale"]),
        (["seallmm"], ["unknown experiment 'seallmm'", "seallm"]),
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
    rc, o, e = run_cli(capsys, "reproduce", *argv, "--out", out)
    assert_one_line_error(rc, o, e, *needles)
    assert not out.exists()


def test_missing_data_and_missing_runs_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "nowhere"))
    rc, o, e = run_cli(capsys, "reproduce", "muxserve", "--out", tmp_path / "out")
    assert_one_line_error(rc, o, e, "shared trace data not found", DATA_ENV)
    rc, o, e = run_cli(capsys, "reproduce", "seallm", "--report-only", "--out", tmp_path)
    assert_one_line_error(rc, o, e, "no runs/")
