"""The serving-path overhead model of the fidelity simulation and ``fleetserve fidelity``'s
wiring (no server: the measurement is made up; the server lifecycle runs a stand-in)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from png_util import skip_rendering
from test_cli import assert_one_line_error, run_cli
from test_fidelity_sim import A, _config, _profile, config_from_dict

from fleetserve.cli.fidelity import ServerProcess, merge_profiles
from fleetserve.config import SimConfig
from fleetserve.errors import ConfigError, FleetserveError
from fleetserve.experiments.fidelity import (
    emulated_sim_config,
    fit_overhead,
    placed_simulator,
    simulate_emulated,
)
from fleetserve.experiments.fidelity_overhead import (
    RuntimeOverhead,
    Timeline,
    deliver,
    with_iteration_overhead,
)
from fleetserve.metrics.probes import ProbeRequest
from fleetserve.spec import get_model
from fleetserve.workload.request import Request


@pytest.fixture(autouse=True)
def _no_rendering(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated runs' plots are built but not rendered: nothing here looks
    at them (test_fidelity_sim renders those of the same kind of run), and
    rendering them was about half of this file's time."""
    skip_rendering(monkeypatch)


# ------------------------------------------------------------------------ parameters


def test_overhead_parameters() -> None:
    assert RuntimeOverhead().off
    assert not RuntimeOverhead(delivery_iters=1).off
    ov = RuntimeOverhead(0.01, 0.001, 2.5)
    assert RuntimeOverhead.from_dict(ov.to_dict()) == ov
    with pytest.raises(ConfigError, match="request_s must be a number >= 0"):
        RuntimeOverhead(request_s=-1.0)
    with pytest.raises(ConfigError, match="delivery_iters"):
        RuntimeOverhead(delivery_iters=math.nan)
    with pytest.raises(ConfigError, match="unknown RuntimeOverhead key"):
        RuntimeOverhead.from_dict({"lag": 1})


def test_deliver_counts_iterations_and_stops_at_idle() -> None:
    tl = Timeline([1.0, 2.0, 4.0, 5.0, 9.0], [True, True, True, False, False])
    assert deliver(tl, 1.0, 0) == 1.0
    assert deliver(tl, 1.0, 1) == 2.0
    assert deliver(tl, 1.0, 1.5) == 3.0  # halfway into the iteration 2.0 -> 4.0
    assert deliver(tl, 1.0, 2) == 4.0
    assert deliver(tl, 1.0, 10) == 5.0  # the instance goes idle after 5.0
    assert deliver(tl, 5.0, 3) == 5.0  # produced as it went idle: at once
    assert deliver(tl, 9.0, 2) == 9.0
    assert deliver(tl, 3.0, 2) == 3.0  # not an iteration end: unchanged


# ------------------------------------------------------------------------ simulation


def _one_request_config(tmp_path: Path, prompt: int = 40, output: int = 12) -> SimConfig:
    trace = tmp_path / "one.jsonl"
    rec = {"arrival_s": 0.5, "prompt_tokens": prompt, "output_tokens": output}
    trace.write_text(json.dumps(rec) + "\n")
    return config_from_dict(
        {
            "model": A,
            "workload": {"trace": str(trace), "format": "jsonl"},
            "serve": {"workers": 1, "gpu_memory_mb": 48, "max_running": 16},
        }
    )


def _latencies(summary: dict) -> tuple[float, float]:
    lat = summary["latency_s"]
    return lat["ttft"]["mean"], lat["tpot"]["mean"]


def test_overhead_off_is_the_engine_only_simulation(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    prof = _profile(tmp_path)
    plain = simulate_emulated(cfg, prof, tmp_path / "a")
    off = simulate_emulated(cfg, prof, tmp_path / "b", overhead=RuntimeOverhead())
    for s in (plain, off):
        s.pop("sim")
        s["fidelity"].pop("overhead", None)
    assert off == plain
    a = (tmp_path / "a" / "requests.csv").read_text()
    assert (tmp_path / "b" / "requests.csv").read_text() == a


def test_overhead_adds_what_it_says(tmp_path: Path) -> None:
    cfg = _one_request_config(tmp_path)
    prof = _profile(tmp_path)
    ttft0, tpot0 = _latencies(simulate_emulated(cfg, prof, tmp_path / "0"))
    # a fixed latency per request: TTFT grows by it, TPOT does not change
    s = simulate_emulated(cfg, prof, tmp_path / "r", overhead=RuntimeOverhead(request_s=0.02))
    ttft, tpot = _latencies(s)
    assert ttft == pytest.approx(ttft0 + 0.02, abs=1e-12)
    assert tpot == pytest.approx(tpot0, abs=1e-12)
    assert s["fidelity"]["overhead"]["request_s"] == 0.02
    # per iteration: one more on the first token (its prefill), one more per decode step
    s = simulate_emulated(cfg, prof, tmp_path / "i", overhead=RuntimeOverhead(iteration_s=0.003))
    ttft, tpot = _latencies(s)
    assert ttft == pytest.approx(ttft0 + 0.003, abs=1e-12)
    assert tpot == pytest.approx(tpot0 + 0.003, abs=1e-12)


def test_delivery_lag_counts_the_instances_iterations(tmp_path: Path) -> None:
    cfg = _one_request_config(tmp_path, output=12)
    prof = _profile(tmp_path)
    base = simulate_emulated(cfg, prof, tmp_path / "0")
    lagged = simulate_emulated(
        cfg, prof, tmp_path / "l", overhead=RuntimeOverhead(delivery_iters=3)
    )
    em = emulated_sim_config(cfg, prof)
    timelines: dict[int, Timeline] = {}
    reqs = [Request(0, A, 0.5, 40, 12)]
    config = replace(em.config, macro_steps=False)
    placed_simulator(config, reqs, placement=em.placement, timelines=timelines, cost=em.cost).run()
    (tl,) = timelines.values()
    assert len(tl.ends) == 12 and tl.busy_after == [True] * 11 + [False]
    # the first token waits for the next 3 iterations; the last one comes as the
    # instance goes idle, so it is not delayed
    waits = tl.ends[3] - tl.ends[0]
    ttft0, tpot0 = _latencies(base)
    ttft, tpot = _latencies(lagged)
    assert ttft == pytest.approx(ttft0 + waits, rel=1e-9)
    assert tpot == pytest.approx(tpot0 - waits / 11, rel=1e-9)


def test_timelines_need_single_iterations(tmp_path: Path) -> None:
    em = emulated_sim_config(_config(tmp_path), _profile(tmp_path))
    with pytest.raises(ValueError, match="macro_steps"):
        placed_simulator(em.config, [], placement=em.placement, timelines={})


def test_iteration_overhead_needs_a_calibration(tmp_path: Path) -> None:
    em = emulated_sim_config(_config(tmp_path), None)
    assert with_iteration_overhead(em.cost, 0.01) is em.cost
    cal = emulated_sim_config(_config(tmp_path), _profile(tmp_path)).cost
    more = with_iteration_overhead(cal, 0.01)
    assert cal.calibration is not None and more.calibration is not None
    for k, p in cal.calibration.entries.items():
        assert more.calibration.entries[k].overhead_s == pytest.approx(p.overhead_s + 0.01)


# ------------------------------------------------------------------------------ fit


def _synthetic_probes(cfg: SimConfig, prof: Path, truth: RuntimeOverhead) -> list[ProbeRequest]:
    """Probes 'measured' on a server that is the simulation plus ``truth``."""
    groups = [[(16, 8)], [(64, 32)], [(128, 8)], [(64, 32)] * 4, [(64, 32)] * 8]
    reqs, meta = [], []
    for g, members in enumerate(groups):
        for p, o in members:
            reqs.append(Request(len(reqs), A, 100.0 * g, p, o))
            meta.append(g)
    em = emulated_sim_config(cfg, prof)
    from fleetserve.experiments.fidelity import _run_emulated

    recs = _run_emulated(em, reqs, truth).records
    out = []
    for rec, g in zip(recs, meta, strict=True):
        assert rec.first_token_s is not None and rec.finish_s is not None
        n = rec.output_tokens
        out.append(
            ProbeRequest(
                g,
                A,
                0.0,
                rec.prompt_tokens,
                n,
                rec.first_token_s - rec.arrival_s,
                (rec.finish_s - rec.first_token_s) / (n - 1),
            )
        )
    return out


def test_fit_recovers_a_known_overhead(tmp_path: Path) -> None:
    cfg = replace(_config(tmp_path), serve=replace(_config(tmp_path).serve, workers=1))
    prof = _profile(tmp_path)
    truth = RuntimeOverhead(request_s=0.015, iteration_s=0.0012, delivery_iters=4.0)
    fit = fit_overhead(cfg, prof, _synthetic_probes(cfg, prof, truth))
    assert fit.overhead.iteration_s == pytest.approx(truth.iteration_s, abs=1e-9)
    assert fit.overhead.delivery_iters == truth.delivery_iters
    assert fit.overhead.request_s == pytest.approx(truth.request_s, abs=1e-9)
    assert fit.ttft_mean_abs_pct < 1e-6 and fit.tpot_mean_abs_pct < 1e-6
    assert fit.engine_only_ttft_mean_abs_pct > 10
    assert fit.to_dict()["overhead"]["delivery_iters"] == 4.0


def test_fit_with_a_measured_iteration_cost_fits_the_request_latency_alone(
    tmp_path: Path,
) -> None:
    cfg = replace(_config(tmp_path), serve=replace(_config(tmp_path).serve, workers=1))
    prof = _profile(tmp_path)
    truth = RuntimeOverhead(request_s=0.011, iteration_s=0.0014, delivery_iters=0.0)
    probes = _synthetic_probes(cfg, prof, truth)
    fit = fit_overhead(cfg, prof, probes, iteration_grid=(0.0014,), lag_grid=(0.0,))
    assert fit.overhead.request_s == pytest.approx(0.011, abs=1e-9)
    assert (fit.overhead.iteration_s, fit.overhead.delivery_iters) == (0.0014, 0.0)
    assert fit.ttft_mean_abs_pct < 1e-6 and fit.engine_only_ttft_mean_abs_pct > 5
    # a wrong fixed iteration cost is kept as given, and it shows in the error
    off = fit_overhead(cfg, prof, probes, iteration_grid=(0.004,), lag_grid=(0.0,))
    assert off.overhead.iteration_s == 0.004 and off.tpot_mean_abs_pct > 5


def test_fit_needs_usable_probes(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    with pytest.raises(FleetserveError, match="no usable overhead probes"):
        fit_overhead(cfg, _profile(tmp_path), [ProbeRequest(0, A, 0.0, 8, 4, math.nan, None)])
    with pytest.raises(FleetserveError, match="does not serve"):
        fit_overhead(cfg, _profile(tmp_path), [ProbeRequest(0, "tiny-llama-b", 0, 8, 4, 0.1, None)])


# ------------------------------------------------------------------------------ CLI


def _serve_yaml(tmp_path: Path, **extra: object) -> Path:
    trace = tmp_path / "t.jsonl"
    if not trace.exists():
        _config(tmp_path)  # writes t.jsonl
    lines = [
        "serve: {workers: 1, gpu_memory_mb: 48, max_running: 16, models: [tiny-llama-a]}",
        f"workload: {{trace: {trace}, format: jsonl}}",
        *(f"{k}: {v}" for k, v in extra.items()),
    ]
    path = tmp_path / "fid.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _measured_run(tmp_path: Path, truth: RuntimeOverhead) -> tuple[Path, SimConfig, Path, Path]:
    """A fidelity directory whose "measurement" is the simulation plus ``truth``,
    and probes of that same server: (config file, config, profile, directory)."""
    cfg_path = _serve_yaml(tmp_path)
    cfg = _config(tmp_path)
    cfg = replace(cfg, serve=replace(cfg.serve, workers=1))
    prof = _profile(tmp_path)
    out = tmp_path / "fid"
    simulate_emulated(cfg, prof, out / "measured", overhead=truth)
    probes = _synthetic_probes(cfg, prof, truth)
    (out / "overhead_probe.json").write_text(json.dumps({"probes": [p.to_dict() for p in probes]}))
    return cfg_path, cfg, prof, out


def test_cli_analyze_only_writes_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the "measurement": the simulation plus a known overhead, and probes of the same server
    cfg_path, _, prof, out = _measured_run(
        tmp_path, RuntimeOverhead(request_s=0.01, iteration_s=0.0006, delivery_iters=2.0)
    )
    rc, stdout, err = run_cli(
        capsys, "fidelity", cfg_path, "--out", out, "--profile", prof, "--analyze-only"
    )
    assert rc == 0, err
    assert "4 of 4 target metrics within 15%" in stdout
    report = json.loads((out / "fidelity.json").read_text())
    assert report["target_within"] == 4
    assert report["overhead"]["overhead"]["delivery_iters"] == 2.0
    for row in report["rows"]:
        if row["target"]:
            assert abs(row["rel_error_pct"]) < 1e-6
    md = (out / "fidelity.md").read_text()
    assert "Engine only" in md and "serving-path overhead" in md
    assert (out / "simulated" / "summary.json").is_file()
    assert (out / "simulated-engine-only" / "summary.json").is_file()


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    rc, o, e = run_cli(capsys, "fidelity", tmp_path / "nope.yaml", "--out", out)
    assert_one_line_error(rc, o, e, "nope.yaml", "config file not found")
    bad = _serve_yaml(tmp_path, serve_extra="1")
    rc, o, e = run_cli(capsys, "fidelity", bad, "--out", out)
    assert_one_line_error(rc, o, e, "serve_extra")
    cuda = tmp_path / "cuda.yaml"
    cuda.write_text("serve: {workers: 1, device: cuda}\n")
    rc, o, e = run_cli(capsys, "fidelity", cuda, "--out", out)
    assert_one_line_error(rc, o, e, "serve.device")
    ok = _serve_yaml(tmp_path)
    rc, o, e = run_cli(capsys, "fidelity", ok, "--out", out, "--profile", tmp_path / "p.csv")
    assert_one_line_error(rc, o, e, "p.csv", "profile not found")
    rc, o, e = run_cli(capsys, "fidelity", ok, "--out", out, "--rate-scale", "0")
    assert_one_line_error(rc, o, e, "--rate-scale must be positive")
    rc, o, e = run_cli(capsys, "fidelity", ok, "--out", out, "--trace", tmp_path / "x.csv")
    assert_one_line_error(rc, o, e, "x.csv", "trace not found")


# -------------------------------------------------------------------- server process

_FAKE_SERVER = """
import http.server, signal, sys
# a shell's background job inherits SIGINT ignored; a real server handles it
signal.signal(signal.SIGINT, signal.default_int_handler)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_process_waits_for_health_and_always_stops(tmp_path: Path) -> None:
    srv = ServerProcess("unused.yaml", [], tmp_path / "server.log", startup_timeout_s=20)
    srv.cmd = [sys.executable, "-c", _FAKE_SERVER, str(srv.port)]
    with srv:
        assert srv.proc is not None and srv.proc.poll() is None
    assert srv.proc.poll() is not None  # stopped on leaving
    srv.stop()  # idempotent


def test_server_process_reports_an_early_exit(tmp_path: Path) -> None:
    srv = ServerProcess("unused.yaml", [], tmp_path / "server.log", startup_timeout_s=20)
    srv.cmd = [sys.executable, "-c", "print('boom: bad config'); raise SystemExit(3)"]
    with pytest.raises(FleetserveError, match=r"exited with status 3.*boom: bad config"), srv:
        pass


def test_profiles_before_and_after_merge_into_one_calibration_input(tmp_path: Path) -> None:
    from fleetserve.costmodel import load_profile

    head = "model,gpu,tp,phase,batch_size,tokens,context_tokens,time_s\n"
    a = tmp_path / "before.csv"
    b = tmp_path / "after.csv"
    a.write_text(head + "tiny-llama-a,cpu,1,decode,1,1,64,0.002\n")
    b.write_text(head + "tiny-llama-a,cpu,1,decode,1,1,64,0.003\n")
    rows = load_profile(merge_profiles([a, b], tmp_path / "profile.csv"))
    assert [r.time_s for r in rows] == [0.002, 0.003]  # both measurements, in order


def test_cli_calibrates_in_situ_from_the_probes_step_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg_path, cfg, prof, out = _measured_run(
        tmp_path, RuntimeOverhead(request_s=0.01, iteration_s=0.0006, delivery_iters=2.0)
    )
    em = emulated_sim_config(cfg, prof)
    bound = em.cost.bind(get_model(A), em.gpu)
    steps = []
    for i in range(30):  # probe steps 1.3x slower than the profile; replay steps 5x
        for t, k in ((10.0 + i, 1.3), (1000.0 + i, 5.0)):
            fw = {"model": A, "chunks": [], "decode_batch": 1, "decode_ctx": 50}
            dur = k * bound.decode_time_scalar(1, 50.0)
            steps.append({"worker": 0, "start_s": t, "duration_s": dur, "forwards": [fw]})
    (out / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (out / "replay_span.json").write_text(json.dumps({"start_s": 500.0, "end_s": 2000.0}))
    args = ["fidelity", cfg_path, "--out", out, "--profile", prof, "--analyze-only"]
    rc, _, err = run_cli(capsys, *args)
    assert rc == 0, err
    report = json.loads((out / "fidelity.json").read_text())
    assert report["handoff"] is None  # no 'more' in these lines: the three-way fit
    f = report["in_situ"]["factors"][A]
    assert f["decode"] == pytest.approx(1.3) and f["decode_steps"] == 30
    assert f["prefill"] == 1.0 and f["prefill_steps"] == 0  # too few: unchanged
    assert report["in_situ"]["profile"] == str(out / "profile-in-situ.csv")
    # the replay's steps, against the rescaled calibration: 5 / 1.3
    assert report["engine_steps"]["replay"]["all"]["ratio"] == pytest.approx(5 / 1.3, rel=0.03)
    md = (out / "fidelity.md").read_text()
    assert "decode x1.30 (30 steps)" in md and "Engine steps during the replay" in md
    rc, _, err = run_cli(capsys, *args, "--standalone-profile")
    assert rc == 0, err
    report = json.loads((out / "fidelity.json").read_text())
    assert report["in_situ"] is None
    assert report["engine_steps"]["replay"]["all"]["ratio"] == pytest.approx(5.0, rel=0.01)


def test_calibration_load_is_the_requests_after_the_replayed_ones(tmp_path: Path) -> None:
    from fleetserve.cli.fidelity import Replay, bench_config, calibration_replay
    from fleetserve.runtime.bench_serve import load_bench_workload

    trace = tmp_path / "cal.jsonl"  # _config writes t.jsonl
    arrivals = [0.0, 1.0, 2.0, 3.0, 3.0, 4.0, 5.5, 6.0, 7.0, 8.0]  # a tie at 3.0
    trace.write_text(
        "".join(
            json.dumps({"arrival_s": a, "prompt_tokens": 10 + i, "output_tokens": 4}) + "\n"
            for i, a in enumerate(arrivals)
        )
    )

    cfg = _config(tmp_path)

    def prompts(r: Replay) -> list[int]:  # what bench-serve replays of r
        bench = bench_config(cfg, "http://x", r, [A])
        return [q.prompt_tokens for q in load_bench_workload(bench).requests]

    base = Replay(str(trace), "jsonl", 1.0, None, 2, 0.5, 1.0, None, None)
    cal = calibration_replay(base, 2)
    assert prompts(base) == [11, 12]
    assert cal is not None and cal.start_s == 3.0 and prompts(cal) == [13, 14]
    assert (cal.rate_scale, cal.max_requests, cal.end_s) == (0.5, 2, None)
    # a request tied with the last replayed one is in neither (a window cannot split a tie)
    tie = replace(base, max_requests=3)  # 11, 12, 13; 14 arrives with 13 at 3.0
    cal = calibration_replay(tie, 2)
    assert prompts(tie) == [11, 12, 13]
    assert cal is not None and cal.start_s == 4.0 and prompts(cal) == [15, 16]
    assert calibration_replay(base, 0) is None
    assert calibration_replay(replace(base, max_requests=9), 5) is None  # nothing after it


def test_cli_measures_the_iteration_cost_from_the_step_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg_path, cfg, prof, out = _measured_run(
        tmp_path, RuntimeOverhead(request_s=0.01, iteration_s=0.0015, delivery_iters=0.0)
    )
    em = emulated_sim_config(cfg, prof)
    dur = em.cost.bind(get_model(A), em.gpu).decode_time_scalar(1, 50.0)
    fw = {"model": A, "chunks": [], "decode_batch": 1, "decode_ctx": 50}
    steps, t = [], 10.0
    for i in range(40):  # steps at the profile's speed, 1.5 ms apart while work is left
        steps.append(
            {"worker": 0, "start_s": t, "duration_s": dur, "more": i % 10 != 9, "forwards": [fw]}
        )
        t += dur + (0.0015 if i % 10 != 9 else 3.0)
    (out / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (out / "replay_span.json").write_text(json.dumps({"start_s": 500.0, "end_s": 600.0}))
    rc, stdout, err = run_cli(
        capsys, "fidelity", cfg_path, "--out", out, "--profile", prof, "--analyze-only"
    )
    assert rc == 0, err
    report = json.loads((out / "fidelity.json").read_text())
    assert report["handoff"]["gaps"] == 36
    assert report["handoff"]["seconds"] == pytest.approx(0.0015, abs=1e-6)
    o = report["overhead"]["overhead"]
    assert o["iteration_s"] == report["handoff"]["seconds"] and o["delivery_iters"] == 0.0
    assert o["request_s"] == pytest.approx(0.01, abs=2e-4)
    assert "4 of 4 target metrics within 15%" in stdout
    assert "per engine iteration measured" in (out / "fidelity.md").read_text()
