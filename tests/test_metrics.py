"""Tests of fleetserve.metrics: summary numbers by hand, files, plots, properties."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.metrics import (
    DEFAULT_SLO_SCALES,
    GpuInterval,
    MetricsInvariantError,
    MigrationRecord,
    RequestRecord,
    RunResult,
    TimeSeries,
    comparison_markdown,
    comparison_rows,
    comparison_table,
    read_summary,
    render_report,
    summarize,
    write_comparison,
    write_run,
)
from fleetserve.metrics.plots import _downsample, plot_timeseries
from fleetserve.metrics.summary import gpu_step, large_request_counts

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rec(
    id: int,
    model: str,
    arrival: float,
    status: str,
    *,
    first: float | None = None,
    finish: float | None = None,
    generated: int = 0,
    output: int = 0,
    ideal: float = 0.0,
    reason: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        id=id,
        model=model,
        arrival_s=arrival,
        prompt_tokens=10,
        output_tokens=output,
        status=status,  # type: ignore[arg-type]
        reason=reason,
        first_token_s=first,
        finish_s=finish,
        generated=generated,
        ideal_s=ideal,
    )


def make_result(kv_bytes_per_gpu: int | None = 100, sim: bool = True) -> RunResult:
    """A run with known numbers (expected values worked out in the tests below)."""
    records = [
        # finished: ttft 1, tpot 0.5, e2e 3, norm 3
        _rec(0, "a", 0.0, "finished", first=1.0, finish=3.0, generated=5, output=5, ideal=1.0),
        # finished: ttft 0.5, tpot 0.75, e2e 2, norm 1
        _rec(1, "a", 2.0, "finished", first=2.5, finish=4.0, generated=3, output=3, ideal=2.0),
        # finished: ttft 2, tpot None (1 token), e2e 2, norm 4
        _rec(2, "b", 4.0, "finished", first=6.0, finish=6.0, generated=1, output=1, ideal=0.5),
        # finished: ttft 0.5, tpot 0.95, e2e 10, norm 10
        _rec(3, "b", 5.0, "finished", first=5.5, finish=15.0, generated=11, output=11, ideal=1.0),
        _rec(4, "a", 6.0, "rejected", reason="too_long", output=7, ideal=1.0),
        _rec(5, "b", 7.0, "rejected", reason="too_long", output=7, ideal=1.0),
        _rec(6, "a", 8.0, "rejected", output=7, ideal=1.0),
        # unfinished: has a first token but is not counted in latencies
        _rec(7, "b", 9.0, "unfinished", first=10.0, generated=3, output=9, ideal=1.0),
    ]
    ts = TimeSeries(interval_s=5.0)
    for t, used, cap, demand, gpus in (
        (0.0, 0, 0, 0, 0),
        (5.0, 50, 100, 150, 3),
        (10.0, 50, 200, 250, 3),
        (15.0, 100, 200, 401, 2),
        (20.0, 100, 100, 100, 1),
    ):
        ts.append(t, gpus, used, cap, demand, queued=1, running=2)
    intervals = [
        GpuInterval(0, 0.0, 20.0),
        GpuInterval(1, 2.0, 10.0),
        GpuInterval(2, 5.0, 12.0),
        GpuInterval(3, 10.0, 16.0),  # starts when gpu 1 stops: no overlap
        GpuInterval(4, 16.0, 16.0),  # zero length: ignored
    ]
    migrations = [
        MigrationRecord(3.0, 0, 0, 1, "kv", 1000),
        MigrationRecord(8.0, 3, 1, 2, "token", 0),
        MigrationRecord(9.0, 3, 2, 1, "kv", 500),
    ]
    return RunResult(
        records=records,
        timeseries=ts,
        gpu_intervals=intervals,
        migrations=migrations,
        end_s=20.0,
        kv_bytes_per_gpu=kv_bytes_per_gpu,
        config={"stack": "bf", "model": "llama-2-7b", "seed": 1},
        sim_wall_s=1.5 if sim else None,
        sim_events=1234 if sim else None,
        notes=["lengths capped at 4096"],
    )


def empty_result() -> RunResult:
    return RunResult(
        records=[],
        timeseries=TimeSeries(interval_s=1.0),
        gpu_intervals=[],
        migrations=[],
        end_s=0.0,
        kv_bytes_per_gpu=None,
        config={},
    )


# --------------------------------------------------------------------------- summary


def test_summary_requests() -> None:
    result = make_result()
    result.records[0].preemptions = 2  # a finished request recomputed twice
    result.records[7].preemptions = 1  # and an unfinished one once
    s = summarize(result)
    assert s["requests"] == {
        "total": 8,
        "finished": 4,
        "rejected": 3,
        "unfinished": 1,
        "rejected_reasons": {"too_long": 2, "unspecified": 1},
        "preemptions": 3,
        "preempted": 2,
    }


def test_summary_latency_percentiles() -> None:
    lat = summarize(make_result())["latency_s"]
    # ttft over finished: [1, 0.5, 2, 0.5] -> sorted [0.5, 0.5, 1, 2]
    assert lat["ttft"] == pytest.approx({"mean": 1.0, "p50": 0.75, "p90": 1.7, "p99": 1.97})
    # tpot: [0.5, 0.75, 0.95] (request 2 produced a single token)
    assert lat["tpot"] == pytest.approx({"mean": 2.2 / 3, "p50": 0.75, "p90": 0.91, "p99": 0.946})
    # e2e: [3, 2, 2, 10] -> sorted [2, 2, 3, 10]; linear interpolation
    assert lat["e2e"] == pytest.approx({"mean": 4.25, "p50": 2.5, "p90": 7.9, "p99": 9.79})
    for kind in ("ttft", "tpot", "e2e"):
        vals = {"ttft": [1, 0.5, 2, 0.5], "tpot": [0.5, 0.75, 0.95], "e2e": [3, 2, 2, 10]}[kind]
        assert lat[kind]["p99"] == pytest.approx(float(np.percentile(vals, 99)))


def test_summary_normalized_and_slo() -> None:
    s = summarize(make_result())
    assert s["normalized_latency"] == pytest.approx((3 + 1 + 4 + 10) / 4)
    # ratios of finished requests: 3, 1, 4, 10; 8 requests in all (misses included)
    assert s["slo_attainment"] == pytest.approx(
        {"1.5": 1 / 8, "2": 1 / 8, "3": 2 / 8, "5": 3 / 8, "10": 4 / 8, "20": 0.5, "50": 0.5}
    )
    assert set(s["slo_attainment"]) == {f"{k:g}" for k in DEFAULT_SLO_SCALES}
    s2 = summarize(make_result(), slo_scales=(1, 4))
    assert s2["slo_attainment"] == pytest.approx({"1": 1 / 8, "4": 3 / 8})


def test_summary_throughput() -> None:
    s = summarize(make_result())
    # span: first arrival 0 to end 20; 4 finished, 5 + 3 + 1 + 11 output tokens
    assert s["throughput_rps"] == pytest.approx(0.2)
    assert s["throughput_tokens_s"] == pytest.approx(1.0)


def test_summary_gpus() -> None:
    s = summarize(make_result())
    g = s["gpus"]
    assert g["peak"] == 3
    assert isinstance(g["peak"], int)
    # 20 + 8 + 7 + 6 GPU-seconds over a 20 s span
    assert g["mean"] == pytest.approx(41 / 20)
    assert g["gpu_hours"] == pytest.approx(41 / 3600)
    # demand / 100 bytes per GPU: ceil of 0, 1.5, 2.5, 4.01, 1 -> max 5
    assert g["lower_bound"] == 5
    assert g["lower_bound_kv"] == 5
    assert g["lower_bound_large"] is None  # no instance capacity: not the single-model world
    assert summarize(make_result(kv_bytes_per_gpu=None))["gpus"]["lower_bound"] is None


def test_large_requests_bound_the_gpus_at_each_sample() -> None:
    """Prompts of 10 tokens on instances of 19 tokens (2 GPUs each): every
    request is large. In flight at t = 0, 5, 10, 15, 20 (rejected ones left
    out; request 7 never finishes): 1, 2, 2, 1, 1 -> x 2 GPUs. The combined
    bound takes the larger of the two at each sample: KV 0, 2, 3, 5, 1."""
    res = make_result()
    res.instance_kv_tokens = 19
    res.config["cluster"] = {"tp": 2}
    assert large_request_counts(res.records, res.timeseries.t, 19) == [1, 2, 2, 1, 1]
    g = summarize(res)["gpus"]
    assert g["lower_bound_large"] == 4
    assert g["lower_bound_kv"] == 5
    assert g["lower_bound"] == 5  # max over samples of (2, 4, 4, 5, 2)
    res.instance_kv_tokens = 20  # a prompt of exactly half is not large
    assert large_request_counts(res.records, res.timeseries.t, 20) == [0] * 5
    assert summarize(res)["gpus"]["lower_bound_large"] == 0


@settings(max_examples=100, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(
            st.floats(0, 50),
            st.one_of(st.none(), st.floats(0, 50)),
            st.integers(1, 100),
            st.sampled_from(["finished", "rejected", "unfinished"]),
        ),
        max_size=30,
    ),
    times=st.lists(st.floats(0, 60), min_size=1, max_size=10),
    cap=st.integers(1, 150),
)
def test_large_request_counts_match_a_scan(
    reqs: list[tuple[float, float | None, int, str]], times: list[float], cap: int
) -> None:
    records = []
    for i, (arrival, dur, prompt, status) in enumerate(reqs):
        finish = None if dur is None or status != "finished" else arrival + dur
        rec = _rec(i, "a", arrival, status, finish=finish)
        rec.prompt_tokens = prompt
        records.append(rec)
    got = large_request_counts(records, sorted(times), cap)
    want = [
        sum(
            1
            for r in records
            if r.status != "rejected"
            and r.prompt_tokens * 2 > cap
            and r.arrival_s <= t
            and (r.finish_s is None or r.finish_s > t)
        )
        for t in sorted(times)
    ]
    assert got == want


def test_gpu_peak_ties_and_mean_over_span() -> None:
    ivs = [GpuInterval(0, 0.0, 5.0), GpuInterval(1, 5.0, 10.0), GpuInterval(2, 5.0, 10.0)]
    times, counts = gpu_step(ivs)
    assert times == [0.0, 5.0, 10.0]
    assert counts == [1, 2, 0]
    res = make_result()
    res.gpu_intervals = ivs
    g = summarize(res)["gpus"]
    assert g["peak"] == 2
    # 15 GPU-seconds in [0, 20]
    assert g["mean"] == pytest.approx(0.75)
    assert g["gpu_hours"] == pytest.approx(15 / 3600)


def test_summary_kv_utilization_excludes_zero_capacity() -> None:
    s = summarize(make_result())
    # samples: (0/0 excluded), 0.5, 0.25, 0.5, 1.0
    assert s["kv_utilization"]["mean"] == pytest.approx(2.25 / 4)


def test_summary_migrations() -> None:
    m = summarize(make_result())["migrations"]
    assert m == {
        "count": 3,
        "per_s": pytest.approx(3 / 20),
        "bytes": 1500,
        "by_mode": {"kv": {"count": 2, "bytes": 1500}, "token": {"count": 1, "bytes": 0}},
    }


def test_summary_sim_config_notes() -> None:
    s = summarize(make_result())
    assert s["sim"] == {"wall_s": 1.5, "events": 1234}
    assert s["config"] == {"stack": "bf", "model": "llama-2-7b", "seed": 1}
    assert s["notes"] == ["lengths capped at 4096"]
    assert "sim" not in summarize(make_result(sim=False))


def test_summary_services() -> None:
    sv = summarize(make_result())["services"]
    assert list(sv) == ["a", "b"]
    a, b = sv["a"], sv["b"]
    assert a["requests"] == {"total": 4, "finished": 2, "rejected": 2, "unfinished": 0}
    assert b["requests"] == {"total": 4, "finished": 2, "rejected": 1, "unfinished": 1}
    assert a["latency_s"]["e2e"] == pytest.approx({"mean": 2.5, "p99": 2.99})
    assert b["latency_s"]["e2e"] == pytest.approx({"mean": 6.0, "p99": 9.92})
    assert a["normalized_latency"] == pytest.approx(2.0)
    assert b["normalized_latency"] == pytest.approx(7.0)
    assert a["slo_attainment"]["1.5"] == pytest.approx(0.25)
    assert a["slo_attainment"]["3"] == pytest.approx(0.5)
    assert b["slo_attainment"]["5"] == pytest.approx(0.25)
    assert b["slo_attainment"]["10"] == pytest.approx(0.5)


def test_summary_schema_keys() -> None:
    s = summarize(make_result())
    for key in (
        "requests",
        "latency_s",
        "normalized_latency",
        "slo_attainment",
        "throughput_rps",
        "throughput_tokens_s",
        "gpus",
        "kv_utilization",
        "migrations",
        "sim",
        "config",
        "notes",
        "services",
    ):
        assert key in s
    for kind in ("ttft", "tpot", "e2e"):
        assert set(s["latency_s"][kind]) == {"mean", "p50", "p90", "p99"}
    assert {"peak", "mean", "gpu_hours"} <= set(s["gpus"])
    assert set(s["migrations"]) == {"count", "per_s", "bytes", "by_mode"}


def test_bad_status_raises() -> None:
    res = make_result()
    res.records[2].status = "done"  # type: ignore[assignment]
    with pytest.raises(MetricsInvariantError, match="request 2"):
        summarize(res)


def test_finished_without_finish_time_raises() -> None:
    res = make_result()
    res.records[0].finish_s = None
    with pytest.raises(MetricsInvariantError, match="finish_s"):
        summarize(res)


def test_ragged_timeseries_raises() -> None:
    res = make_result()
    res.timeseries.queued.pop()
    with pytest.raises(MetricsInvariantError, match="queued"):
        summarize(res)


def test_all_rejected_is_strict_json() -> None:
    res = make_result()
    for r in res.records:
        r.status = "rejected"
        r.reason = "no_gpu"
        r.first_token_s = r.finish_s = None
    res.timeseries = TimeSeries(interval_s=1.0)
    res.gpu_intervals = []
    s = summarize(res)
    text = json.dumps(s, allow_nan=False)
    assert "NaN" not in text
    for kind in ("ttft", "tpot", "e2e"):
        assert s["latency_s"][kind] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert s["normalized_latency"] is None
    assert all(v == 0.0 for v in s["slo_attainment"].values())
    assert s["kv_utilization"]["mean"] is None
    assert s["gpus"] == {
        "peak": 0,
        "mean": 0.0,
        "gpu_hours": 0.0,
        "lower_bound": None,
        "lower_bound_kv": None,
        "lower_bound_large": None,
    }
    assert s["requests"]["rejected_reasons"] == {"no_gpu": 8}
    assert s["throughput_rps"] == 0.0


def test_empty_run_is_strict_json() -> None:
    s = summarize(empty_result())
    json.dumps(s, allow_nan=False)
    assert s["requests"]["total"] == 0
    assert s["throughput_rps"] is None
    assert s["gpus"]["mean"] is None
    assert s["migrations"]["per_s"] is None
    assert all(v is None for v in s["slo_attainment"].values())
    assert s["services"] == {}


record_strategy = st.builds(
    lambda status, arrival, lat, first_frac, gen, ideal: _rec(
        0,
        "m",
        arrival,
        status,
        first=arrival + lat * first_frac if status != "rejected" else None,
        finish=arrival + lat if status == "finished" else None,
        generated=gen,
        output=gen,
        ideal=ideal,
    ),
    st.sampled_from(["finished", "rejected", "unfinished"]),
    st.floats(0, 1000, allow_nan=False),
    st.floats(0, 100, allow_nan=False),
    st.floats(0, 1, allow_nan=False),
    st.integers(0, 50),
    st.floats(0, 10, allow_nan=False),
)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(record_strategy, max_size=40),
    st.lists(st.floats(0.1, 100, allow_nan=False), min_size=1, max_size=8),
)
def test_property_counts_and_slo_monotone(
    records: list[RequestRecord], scales: list[float]
) -> None:
    for i, r in enumerate(records):
        r.id = i
    end = max((r.finish_s or r.arrival_s for r in records), default=0.0) + 1.0
    res = RunResult(records, TimeSeries(1.0), [], [], end, None, {})
    s = summarize(res, slo_scales=scales)
    req = s["requests"]
    assert req["finished"] + req["rejected"] + req["unfinished"] == req["total"] == len(records)
    json.dumps(s, allow_nan=False)
    shares = [v for _, v in sorted(s["slo_attainment"].items(), key=lambda kv: float(kv[0]))]
    if records:
        assert all(0.0 <= v <= 1.0 for v in shares)
        assert all(a <= b for a, b in itertools.pairwise(shares))
        assert shares[-1] <= req["finished"] / req["total"]
    else:
        assert all(v is None for v in shares)


# --------------------------------------------------------------------------- files


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000
    assert data.startswith(PNG_MAGIC)


def test_write_run_creates_every_file(tmp_path: Path) -> None:
    res = make_result()
    s = summarize(res)
    out = tmp_path / "run" / "bf"
    files = write_run(out, res, s)
    names = {p.name for p in files}
    assert names == {
        "summary.json",
        "requests.csv",
        "timeseries.csv",
        "migrations.csv",
        "timeseries.png",
        "latency_cdf.png",
        "report.md",
    }
    for p in files:
        assert p.exists() and p.stat().st_size > 0
        if p.suffix == ".png":
            _assert_png(p)
    text = (out / "summary.json").read_text()
    assert text == json.dumps(s, indent=2, sort_keys=True) + "\n"
    assert read_summary(out) == json.loads(text)
    assert read_summary(out / "summary.json")["requests"]["total"] == 8

    with (out / "requests.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 8
    assert {"id", "model", "status", "reason", "ttft_s", "tpot_s", "e2e_s", "normalized"} <= set(
        rows[0]
    )
    assert float(rows[3]["e2e_s"]) == pytest.approx(10.0)
    assert float(rows[3]["normalized"]) == pytest.approx(10.0)
    assert rows[4]["e2e_s"] == "" and rows[4]["reason"] == "too_long"
    with (out / "timeseries.csv").open() as fh:
        ts_rows = list(csv.DictReader(fh))
    assert len(ts_rows) == 5 and ts_rows[0]["kv_utilization"] == ""
    with (out / "migrations.csv").open() as fh:
        m_rows = list(csv.DictReader(fh))
    assert [r["mode"] for r in m_rows] == ["kv", "token", "kv"]

    report = (out / "report.md").read_text()
    assert "too_long" in report
    assert "lengths capped at 4096" in report
    assert "timeseries.png" in report and "latency_cdf.png" in report


def test_write_run_all_rejected(tmp_path: Path) -> None:
    res = empty_result()
    res.records = [_rec(0, "m", 0.0, "rejected", reason="too_long")]
    res.end_s = 1.0
    files = write_run(tmp_path, res, summarize(res))
    for p in files:
        if p.suffix == ".png":
            _assert_png(p)


def test_write_comparison(tmp_path: Path) -> None:
    r1, r2 = make_result(), make_result(kv_bytes_per_gpu=None, sim=False)
    r2.gpu_intervals = [GpuInterval(0, 0.0, 20.0)]
    named = {"bf": (summarize(r1), r1), "wf": (summarize(r2), r2)}
    files = write_comparison(tmp_path / "cmp", named)
    assert {p.name for p in files} == {
        "comparison.md",
        "comparison.csv",
        "comparison.json",
        "compare_timeseries.png",
        "compare_latency.png",
        "compare_bars.png",
    }
    for p in files:
        assert p.exists() and p.stat().st_size > 0
        if p.suffix == ".png":
            _assert_png(p)
    data = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert data["stacks"] == ["bf", "wf"]
    assert [r["gpus_peak"] for r in data["rows"]] == [3, 1]
    with (tmp_path / "cmp" / "comparison.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["stack"] for r in rows] == ["bf", "wf"]
    assert rows[1]["sim_wall_s"] == ""


def test_comparison_rows_and_tables() -> None:
    s = summarize(make_result())
    rows = comparison_rows({"bf": s})
    (row,) = rows
    assert row["stack"] == "bf"
    assert row["gpus_peak"] == 3
    assert row["gpus_lower_bound"] == 5
    assert row["finished"] == 4 and row["rejected"] == 3 and row["unfinished"] == 1
    assert row["ttft_p50_s"] == pytest.approx(0.75)
    assert row["e2e_p99_s"] == pytest.approx(9.79)
    assert row["slo_scale"] == 5.0 and row["slo_attainment"] == pytest.approx(3 / 8)
    assert row["kv_util_mean"] == pytest.approx(0.5625)
    assert row["migrations"] == 3 and row["sim_wall_s"] == 1.5
    md = comparison_markdown(rows)
    assert md.startswith("| stack |") and "| bf |" in md and "37.5%" in md
    table = comparison_table(rows, "bf vs nothing")
    assert table.row_count == 1 and table.title == "bf vs nothing"
    # a scale set without 5: the middle one is used
    rows2 = comparison_rows({"x": summarize(make_result(), slo_scales=(1, 2, 4))})
    assert rows2[0]["slo_scale"] == 2.0


def test_render_report_minimal() -> None:
    text = render_report(summarize(empty_result()), [])
    assert text.startswith("# fleetserve run report")
    assert "n/a" in text


def test_plot_downsample_and_speed(tmp_path: Path) -> None:
    t = np.arange(100_000, dtype=float)
    y = np.zeros_like(t)
    y[54_321] = 7.0
    tt, yy = _downsample(t, y, how="max")
    assert len(tt) <= 2000 and yy.max() == 7.0
    tt, yy = _downsample(t, y)
    assert len(tt) <= 2000 and tt[-1] == t[-1]

    res = make_result()
    ts = TimeSeries(interval_s=0.1)
    for i in range(50_000):
        ts.append(i * 0.1, 2, i % 100, 100, 50, i % 7, 3)
    res.timeseries = ts
    res.gpu_intervals = [GpuInterval(i, i * 0.1, i * 0.1 + 5.0) for i in range(20_000)]
    res.end_s = 5000.0
    path = plot_timeseries(res, tmp_path / "long.png")
    _assert_png(path)
