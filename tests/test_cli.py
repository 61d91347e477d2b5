"""End-to-end tests of the ``fleetserve`` command line, run in-process.

Every bad input must give exit status 2 and exactly ONE line on stderr that
names the file / line / field at fault, and never a traceback. Good input must
write a complete ``summary.json`` (the DESIGN.md contract).

Runs are kept tiny (a few-row trace, a 30-60 s synthetic workload,
``--max-requests``) so the whole file stays well under a minute.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from png_util import skip_run_rendering

from fleetserve.cli.main import main

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"
AZURE_CONV = DATA_DIR / "azure_llm_2023_conv.csv"
AZURE_CONV_ROWS = 19_366
needs_azure_trace = pytest.mark.skipif(
    not AZURE_CONV.is_file(), reason=f"real Azure conv trace not present at {AZURE_CONV}"
)

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"

# 1 + 20 rows, ~0.7 s apart, modest lengths: a few seconds of simulated time.
TINY_ROWS = 20
TINY_AZURE = HEADER + "".join(
    f"2023-11-16 18:15:{10 + i * 0.7:010.7f},{200 + 37 * i},{20 + 11 * (i % 7)}\n"
    for i in range(TINY_ROWS)
)


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _plain_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """No colour codes and a wide console, so assertions see plain text."""
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(autouse=True)
def _no_run_rendering(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run folder's plots are built but not rendered: nothing here looks
    at the PNGs (test_metrics checks what ``write_run`` renders), and rendering
    them was half of this file's time."""
    skip_run_rendering(monkeypatch)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """Run ``fleetserve argv...`` in-process; return (exit code, stdout, stderr)."""
    capsys.readouterr()  # drop anything printed before
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, out: str, err: str, *needles: str) -> str:
    """Exit 2, one ``error: ...`` line on stderr containing every needle, no traceback."""
    assert "Traceback" not in out + err, out + err
    assert rc == 2, f"exit code {rc}; stderr: {err!r}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {err!r}"
    line = lines[0]
    assert line.startswith("error:"), line
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    return line


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def tiny_trace(tmp_path: Path) -> Path:
    return write(tmp_path / "azure_tiny.csv", TINY_AZURE)


def load_summary(out: Path) -> dict[str, Any]:
    path = out / "summary.json"
    assert path.is_file(), f"no summary.json in {out}"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def assert_no_results(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), f"results written to {out}"


STAT_KEYS = ("mean", "p50", "p90", "p99")


def assert_summary_complete(s: dict[str, Any]) -> None:
    """Every field DESIGN.md promises in summary.json, with sane values."""
    req = s["requests"]
    for k in ("total", "finished", "rejected", "unfinished"):
        assert isinstance(req[k], int) and req[k] >= 0, (k, req[k])
    assert req["finished"] + req["rejected"] + req["unfinished"] == req["total"]
    assert req["total"] > 0

    for metric in ("ttft", "tpot", "e2e"):
        stats = s["latency_s"][metric]
        for k in STAT_KEYS:
            assert k in stats, f"latency_s.{metric}.{k} missing"
            v = stats[k]
            assert v is None or (isinstance(v, int | float) and v >= 0), (metric, k, v)
    assert "normalized_latency" in s
    slo = s["slo_attainment"]
    assert isinstance(slo, dict) and slo, "slo_attainment must map SLO scales to shares"
    for share in slo.values():
        assert share is None or 0.0 <= share <= 1.0
    for k in ("throughput_rps", "throughput_tokens_s"):
        assert isinstance(s[k], int | float) and s[k] >= 0, (k, s[k])

    gpus = s["gpus"]
    for k in ("peak", "mean", "gpu_hours", "lower_bound"):
        assert k in gpus, f"gpus.{k} missing"
    assert gpus["peak"] >= 1
    assert 0 <= gpus["mean"] <= gpus["peak"]
    assert gpus["gpu_hours"] >= 0

    assert "mean" in s["kv_utilization"]
    util = s["kv_utilization"]["mean"]
    assert util is None or 0.0 <= util <= 1.0

    mig = s["migrations"]
    for k in ("count", "per_s", "bytes", "by_mode"):
        assert k in mig, f"migrations.{k} missing"
    assert isinstance(mig["by_mode"], dict)

    assert s["sim"]["wall_s"] >= 0
    assert s["sim"]["events"] > 0

    cfg = s["config"]
    for k in ("model", "seed", "workload", "cluster", "engine", "policy"):
        assert k in cfg, f"config.{k} missing"


# --------------------------------------------------------------------------- bad traces

BAD_TRACES = {
    # name: (content, line, column)
    "missing_column": (
        "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n",
        1,
        "GeneratedTokens",
    ),
    "nonnumeric": (
        HEADER + "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,abc,109\n",
        3,
        "ContextTokens",
    ),
    "negative": (
        HEADER
        + "2023-11-16 18:15:46.6805900,374,44\n"
        + "2023-11-16 18:15:50.9951690,396,109\n"
        + "2023-11-16 18:15:51.1000000,396,-5\n",
        4,
        "GeneratedTokens",
    ),
    "fractional": (
        HEADER + "2023-11-16 18:15:46.6805900,374,12.5\n",
        2,
        "GeneratedTokens",
    ),
    "unsorted": (
        HEADER
        + "2023-11-16 18:15:46.0000000,374,44\n"
        + "2023-11-16 18:15:48.0000000,396,109\n"
        + "2023-11-16 18:15:47.0000000,100,10\n",
        4,
        "TIMESTAMP",
    ),
    "bad_timestamp": (
        HEADER + "2023-11-16 18:15:46.6805900,374,44\n16/11/2023 18:15:50,396,109\n",
        3,
        "TIMESTAMP",
    ),
    "empty": ("", None, None),
    "header_only": (HEADER, None, None),
}


@pytest.mark.parametrize("case", sorted(BAD_TRACES))
def test_simulate_bad_trace_names_file_line_column(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, line, column = BAD_TRACES[case]
    trace = write(tmp_path / f"azure_{case}.csv", content)
    out = tmp_path / "out"
    rc, o, e = run_cli(
        capsys, "simulate", "--trace", trace, "--format", "azure", "--out", out, "--no-progress"
    )
    needles = [trace.name]
    if line is not None:
        needles.append(f"{trace.name}:{line}")
    if column is not None:
        needles.append(f"'{column}'")
    assert_one_line_error(rc, o, e, *needles)
    assert_no_results(out)


def test_simulate_empty_trace_with_format_detection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write(tmp_path / "empty.csv", "")
    out = tmp_path / "out"
    rc, o, e = run_cli(capsys, "simulate", "--trace", trace, "--out", out, "--no-progress")
    line = assert_one_line_error(rc, o, e, trace.name)
    assert "empty" in line
    assert_no_results(out)


def test_simulate_missing_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc, o, e = run_cli(
        capsys,
        "simulate",
        "--trace",
        tmp_path / "nope.csv",
        "--format",
        "azure",
        "--out",
        out,
        "--no-progress",
    )
    line = assert_one_line_error(rc, o, e, "nope.csv")
    assert "not found" in line
    assert_no_results(out)


def test_trace_inspect_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    content, line, column = BAD_TRACES["negative"]
    trace = write(tmp_path / "neg.csv", content)
    rc, o, e = run_cli(capsys, "trace", "inspect", trace, "--format", "azure")
    assert_one_line_error(rc, o, e, f"neg.csv:{line}", f"'{column}'")


def test_bad_trace_in_a_real_process_prints_one_line(tmp_path: Path) -> None:
    """The same contract holds outside pytest's capture (logging, rich console)."""
    content, line, column = BAD_TRACES["nonnumeric"]
    trace = write(tmp_path / "nonnum.csv", content)
    proc = subprocess.run(
        [sys.executable, "-m", "fleetserve.cli.main", "simulate", "--trace", str(trace),
         "--format", "azure", "--out", str(tmp_path / "out"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "NO_COLOR": "1", "COLUMNS": "200"},
    )  # fmt: skip
    assert_one_line_error(
        proc.returncode, proc.stdout, proc.stderr, f"nonnum.csv:{line}", f"'{column}'"
    )


# --------------------------------------------------------------------------- unknown names

SMALL_SYNTH = ("--set", "workload.synthetic_duration_s=10")


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (("--model", "llama-2-7"), ("'llama-2-7'", "Did you mean 'llama-2-7b'")),
        (("--gpu", "a100-40"), ("'a100-40'", "Did you mean 'a100-40gb'")),
        (("--stack", "no-such-stack"), ("stack", "'no-such-stack'", "bf")),
        (("--dispatch", "no-such-policy"), ("dispatch", "'no-such-policy'", "best_fit")),
        (("--stack", "bf", "--migration", "teleport"), ("migration", "'teleport'")),
    ],
    ids=["model", "gpu", "stack", "dispatch", "migration"],
)
def test_unknown_names(
    flags: tuple[str, ...],
    needles: tuple[str, ...],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    rc, o, e = run_cli(capsys, "simulate", *flags, *SMALL_SYNTH, "--out", out, "--no-progress")
    assert_one_line_error(rc, o, e, *needles)
    assert_no_results(out)


def test_unknown_trace_format(
    tiny_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    rc, o, e = run_cli(
        capsys, "simulate", "--trace", tiny_trace, "--format", "azur", "--out", out, "--no-progress"
    )
    assert_one_line_error(rc, o, e, "'azur'", "Did you mean 'azure'")
    assert_no_results(out)


def test_model_that_does_not_fit_fails_before_running(
    tiny_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    rc, o, e = run_cli(
        capsys,
        "simulate",
        "--trace",
        tiny_trace,
        "--format",
        "azure",
        "--model",
        "llama-2-70b",
        "--gpu",
        "a100-40gb",
        "--gpus",
        "1",
        "--out",
        out,
        "--no-progress",
    )
    line = assert_one_line_error(rc, o, e, "llama-2-70b", "a100-40gb")
    assert re.search(r"does not fit|cannot fit|doesn't fit|needs .*GB", line), line
    assert_no_results(out)
    assert "finished" not in o  # no summary table: nothing ran


# --------------------------------------------------------------------------- bad configs


def test_config_unknown_key_names_dotted_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write(tmp_path / "bad_key.yaml", "model: llama-2-7b\ncluster: {gpuz: 3}\n")
    out = tmp_path / "out"
    rc, o, e = run_cli(capsys, "simulate", cfg, "--out", out, "--no-progress")
    line = assert_one_line_error(rc, o, e, "bad_key.yaml", "cluster.gpuz")
    assert "gpus" in line  # lists the keys that are allowed
    assert_no_results(out)


def test_config_wrong_type_names_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path / "bad_type.yaml", "seed: abc\n")
    out = tmp_path / "out"
    rc, o, e = run_cli(capsys, "simulate", cfg, "--out", out, "--no-progress")
    assert_one_line_error(rc, o, e, "bad_type.yaml", "'seed'", "abc")
    assert_no_results(out)


def test_config_invalid_yaml_names_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path / "broken.yaml", "seed: 1\ncluster: {gpu: [\n")
    rc, o, e = run_cli(capsys, "simulate", cfg, "--out", tmp_path / "out", "--no-progress")
    assert_one_line_error(rc, o, e, "broken.yaml:", "YAML")


def test_config_file_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, o, e = run_cli(
        capsys, "simulate", tmp_path / "nope.yaml", "--out", tmp_path / "out", "--no-progress"
    )
    assert_one_line_error(rc, o, e, "nope.yaml", "not found")


def test_set_without_equals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc, o, e = run_cli(capsys, "simulate", "--set", "seed", "--out", out, "--no-progress")
    assert_one_line_error(rc, o, e, "--set", "key=value", "'seed'")
    assert_no_results(out)


def test_set_wrong_type_names_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc, o, e = run_cli(
        capsys, "simulate", "--set", "cluster.gpus=abc", "--out", out, "--no-progress"
    )
    assert_one_line_error(rc, o, e, "cluster.gpus", "abc")


# --------------------------------------------------------------------------- good runs


def test_simulate_elastic_bf_writes_complete_summary(
    tiny_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    # With the progress bar (the default) to exercise that path too.
    rc, o, e = run_cli(
        capsys,
        "simulate",
        "--trace",
        tiny_trace,
        "--format",
        "azure",
        "--elastic",
        "--stack",
        "bf",
        "--out",
        out,
    )
    assert rc == 0, e
    assert "Traceback" not in o + e
    s = load_summary(out)
    assert_summary_complete(s)
    assert s["requests"]["total"] == TINY_ROWS
    assert s["config"]["policy"]["stack"] == "bf"
    assert s["config"]["cluster"]["elastic"] is True
    assert s["config"]["workload"]["format"] == "azure"


def test_simulate_same_seed_is_deterministic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(out: Path, seed: int) -> dict[str, Any]:
        rc, _, e = run_cli(
            capsys,
            "simulate",
            "--set",
            "workload.synthetic_duration_s=60",
            "--elastic",
            "--stack",
            "bf",
            "--seed",
            str(seed),
            "--out",
            out,
            "--no-progress",
        )
        assert rc == 0, e
        s = load_summary(out)
        del s["sim"]["wall_s"]
        return s

    first = run(tmp_path / "a", 7)
    second = run(tmp_path / "b", 7)
    assert first == second
    other = run(tmp_path / "c", 8)
    assert other != first  # the seed is actually used


def test_simulate_builtin_synthetic_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    rc, o, e = run_cli(
        capsys,
        "simulate",
        "--set",
        "workload.synthetic_duration_s=30",
        "--out",
        out,
        "--no-progress",
    )
    assert rc == 0, e
    assert "synthetic" in o  # the note says where the requests came from
    s = load_summary(out)
    assert_summary_complete(s)
    assert s["config"]["workload"]["trace"] is None
    assert s["config"]["workload"]["synthetic_duration_s"] == 30


def test_simulate_fixed_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc, _, e = run_cli(
        capsys,
        "simulate",
        "--set",
        "workload.synthetic_duration_s=30",
        "--gpus",
        "4",
        "--out",
        out,
        "--no-progress",
    )
    assert rc == 0, e
    s = load_summary(out)
    assert_summary_complete(s)
    assert s["config"]["cluster"]["elastic"] is False
    assert s["config"]["cluster"]["gpus"] == 4
    assert s["gpus"]["peak"] == 4


def test_simulate_from_yaml_config_with_relative_trace(
    tiny_trace: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A config's relative trace path is resolved against the config's folder."""
    cfg = write(
        tmp_path / "conf" / "run.yaml",
        "model: llama-2-7b\n"
        "workload: {trace: ../azure_tiny.csv, format: azure}\n"
        "cluster: {gpu: a100-40gb, elastic: true}\n"
        "policy: {stack: bf}\n",
    )
    other = tmp_path / "elsewhere"  # the working directory is neither folder
    other.mkdir()
    monkeypatch.chdir(other)
    out = tmp_path / "out"
    rc, _, e = run_cli(capsys, "simulate", cfg, "--out", out, "--no-progress")
    assert rc == 0, e
    s = load_summary(out)
    assert s["requests"]["total"] == TINY_ROWS
    assert s["config"]["policy"]["stack"] == "bf"


def test_compare_writes_comparison_and_one_folder_per_stack(
    tiny_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    rc, _, e = run_cli(
        capsys,
        "compare",
        "--trace",
        tiny_trace,
        "--format",
        "azure",
        "--stacks",
        "bf,wf",
        "--out",
        out,
        "--no-progress",
    )
    assert rc == 0, e
    md = out / "comparison.md"
    assert md.is_file()
    text = md.read_text()
    totals = set()
    for stack in ("bf", "wf"):
        assert stack in text
        s = load_summary(out / stack)
        assert_summary_complete(s)
        assert s["config"]["policy"]["stack"] == stack
        totals.add(s["requests"]["total"])
    assert totals == {TINY_ROWS}  # the same workload for every stack


def test_compare_unknown_stack_fails_before_running(
    tiny_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    rc, o, e = run_cli(
        capsys,
        "compare",
        "--trace",
        tiny_trace,
        "--format",
        "azure",
        "--stacks",
        "bf,no-such-stack",
        "--out",
        out,
        "--no-progress",
    )
    assert_one_line_error(rc, o, e, "'no-such-stack'")
    assert_no_results(out)


def test_summary_config_can_be_rerun(
    tiny_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "first"
    rc, _, e = run_cli(
        capsys, "simulate", "--trace", tiny_trace, "--format", "azure", "--stack", "bf",
        "--seed", "3", "--out", out, "--no-progress",
    )  # fmt: skip
    assert rc == 0, e
    first = load_summary(out)
    cfg = write(tmp_path / "again.yaml", yaml.safe_dump(first["config"]))
    rc, _, e = run_cli(capsys, "simulate", cfg, "--out", tmp_path / "again", "--no-progress")
    assert rc == 0, e
    again = load_summary(tmp_path / "again")
    for s in (first, again):
        del s["sim"]["wall_s"]
    assert again == first


# --------------------------------------------------------------------------- trace inspect


def test_trace_inspect_fixture(tiny_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, o, e = run_cli(capsys, "trace", "inspect", tiny_trace)
    assert rc == 0, e
    assert "azure" in o  # the detected format
    assert re.search(rf"requests\W+{TINY_ROWS}\b", o), o
    assert "rate" in o


@needs_azure_trace
def test_trace_inspect_real_azure_trace(capsys: pytest.CaptureFixture[str]) -> None:
    rc, o, e = run_cli(capsys, "trace", "inspect", AZURE_CONV, "--format", "azure")
    assert rc == 0, e
    assert re.search(rf"requests\W+{AZURE_CONV_ROWS:,}\b", o), o
    assert "rate" in o


@needs_azure_trace
def test_acceptance_command_on_real_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's acceptance command, trimmed to 500 requests for speed."""
    out = tmp_path / "acc"
    rc, o, e = run_cli(
        capsys,
        "simulate",
        "--trace",
        AZURE_CONV,
        "--format",
        "azure",
        "--model",
        "llama-2-13b",
        "--gpu",
        "a100-40gb",
        "--elastic",
        "--stack",
        "bf",
        "--length-scale",
        "10",
        "--max-requests",
        "500",
        "--out",
        out,
        "--no-progress",
    )
    assert rc == 0, e
    assert "Traceback" not in o + e
    s = load_summary(out)
    assert_summary_complete(s)
    assert s["requests"]["total"] == 500
    assert s["config"]["model"] == "llama-2-13b"
    assert s["config"]["workload"]["length_scale"] == 10
    notes = " ".join(s.get("notes", []))
    assert "capped" in notes, s.get("notes")
    assert "capped" in o  # and the user is told on the console


FIXTURES = Path(__file__).parent / "fixtures" / "workload"


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("azure_ok.csv", ()),
        ("burstgpt_ok.csv", ()),
        # Mooncake's 7k-token prompts need a long-context model (LLaMA-2's
        # 4,096-token window would reject them)
        ("mooncake_ok.jsonl", ("--model", "llama-3.1-8b")),
        ("native_ok.jsonl", ()),
        ("lengths_ok.csv", ("--rate", "2")),
    ],
)
def test_simulate_mell_any_format_elastic(
    name: str, extra: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--stack mell`` on every trace format: a complete summary with
    migrations split by mode (count and bytes) and the adaptive mechanism."""
    out = tmp_path / "out"
    rc, _, e = run_cli(
        capsys,
        "simulate",
        "--trace",
        FIXTURES / name,
        *extra,
        "--elastic",
        "--stack",
        "mell",
        "--out",
        out,
        "--no-progress",
    )
    assert rc == 0, e
    s = load_summary(out)
    assert_summary_complete(s)
    assert s["requests"]["finished"] == s["requests"]["total"]
    assert s["config"]["policy"]["stack"] == "mell"
    assert s["config"]["migration"]["mechanism"] == "adaptive"
    for mode in ("kv", "token"):
        assert set(s["migrations"]["by_mode"][mode]) == {"count", "bytes"}


def test_simulate_mell_fixed_pool_is_a_one_line_error(
    tiny_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    rc, o, e = run_cli(
        capsys, "simulate", "--trace", tiny_trace, "--gpus", "2", "--stack", "mell", "--out", out
    )
    assert_one_line_error(rc, o, e, "elastic")
    assert_no_results(out)


def test_a_missing_extra_is_one_clear_line() -> None:
    from fleetserve.errors import FleetserveError, require_modules

    require_modules("serve", "runtime", "json")  # present: no error
    msg = r"serve needs no_such_mod_x, .* pip install 'fleetserve\[runtime\]'"
    with pytest.raises(FleetserveError, match=msg):
        require_modules("serve", "runtime", "json", "no_such_mod_x")
