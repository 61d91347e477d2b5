"""Tests of ``fleetserve bench-serve`` against a fake OpenAI-compatible server.

The fake server (FastAPI + uvicorn in a background thread, on a free localhost
port) streams ``max_tokens`` one-character chunks: the first after
``BASE_S + PER_PROMPT_S * prompt_tokens``, the next ones ``PER_TOKEN_S`` apart, so
a request alone takes ``BASE_S + PER_PROMPT_S * p + PER_TOKEN_S * (o - 1)``. Some
``max_tokens`` values are special, which makes its answers deterministic whatever
the order requests arrive in: 7 -> 429 with ``Retry-After``, 11 -> 503, 9 -> a
stream that stalls (for ``--timeout``). With ``state.api_key`` set it answers 401
to any other key.

Timing assertions are loose (the machine may have 2 slow, busy cores): they check
the measurement is of the right size, not its precision.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from rich.console import Console  # noqa: E402

from fleetserve.cli.bench import add_bench_serve_parser  # noqa: E402
from fleetserve.errors import ConfigError, FleetserveError, InputError  # noqa: E402
from fleetserve.runtime.bench_serve import (  # noqa: E402
    BenchConfig,
    ProbePoint,
    fit_ideal,
    load_bench_workload,
    run_bench,
)

BASE_S = 0.03
PER_PROMPT_S = 0.0002
PER_TOKEN_S = 0.01
MODELS = ("fake-a", "fake-b")
REJECT_429 = 7
REJECT_503 = 11
STALL = 9


# --------------------------------------------------------------------------- fake server


@dataclass
class FakeState:
    """What the fake server does; tests change it between runs."""

    api_key: str | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "fake", "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def make_app(state: FakeState) -> Any:
    app = fastapi.FastAPI()

    def authorized(request: fastapi.Request) -> bool:
        if state.api_key is None:
            return True
        return request.headers.get("authorization") == f"Bearer {state.api_key}"

    @app.get("/v1/models")
    async def models(request: fastapi.Request) -> Any:
        if not authorized(request):
            return _error(401, "invalid API key")
        return {"object": "list", "data": [{"id": m, "object": "model"} for m in MODELS]}

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request) -> Any:
        if not authorized(request):
            return _error(401, "invalid API key")
        body = await request.json()
        state.bodies.append(body)
        n_out = int(body["max_tokens"])
        if body["model"] not in MODELS:
            return _error(404, f"model {body['model']} not found")
        if n_out == REJECT_429:
            return _error(429, "queue full", {"Retry-After": "1"})
        if n_out == REJECT_503:
            return _error(503, "draining")
        n_prompt = len(body["prompt"])

        async def stream() -> Any:
            state.in_flight += 1
            state.peak = max(state.peak, state.in_flight)
            try:
                await asyncio.sleep(BASE_S + PER_PROMPT_S * n_prompt)
                for i in range(n_out):
                    if i:
                        await asyncio.sleep(3.0 if n_out == STALL else PER_TOKEN_S)
                    last = i == n_out - 1
                    chunk = {
                        "id": "cmpl-fake",
                        "object": "text_completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {"index": 0, "text": "x", "finish_reason": "length" if last else None}
                        ],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
                usage = {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n_out,
                    "total_tokens": n_prompt + n_out,
                }
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@dataclass
class FakeServer:
    url: str
    state: FakeState


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(state), log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    try:
        yield FakeServer(f"http://127.0.0.1:{port}", state)
    finally:
        srv.should_exit = True
        thread.join(timeout=5)
        sock.close()


@pytest.fixture
def fake(server: FakeServer) -> FakeServer:
    """The module's server with a fresh state for each test."""
    server.state.api_key = None
    server.state.bodies.clear()
    server.state.peak = 0
    return server


# --------------------------------------------------------------------------- helpers


def write_trace(path: Path, rows: list[tuple[float, int, int]], model: str | None = None) -> Path:
    """A native JSONL trace of ``(arrival_s, prompt_tokens, output_tokens)`` rows."""
    lines = []
    for t, p, o in rows:
        row: dict[str, Any] = {"arrival_s": t, "prompt_tokens": p, "output_tokens": o}
        if model is not None:
            row["model"] = model
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """``fleetserve bench-serve argv...`` as ``fleetserve``'s ``main()`` runs a command:
    a :class:`FleetserveError` becomes one ``error:`` line on stderr and status 2."""
    parser = argparse.ArgumentParser(prog="fleetserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_serve_parser(sub)
    args = parser.parse_args(["bench-serve", *(str(a) for a in argv)])
    console = Console(width=200, no_color=True)
    err = Console(stderr=True, width=200, no_color=True)
    capsys.readouterr()
    try:
        rc = int(args.func(args, console))
    except FleetserveError as e:
        err.print(f"error: {e}", highlight=False, soft_wrap=True, markup=False)
        rc = 2
    out, errs = capsys.readouterr()
    return rc, out, errs


def one_line_error(rc: int, err: str, *needles: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# Trace: 12 requests 0.1 s apart (0.05 s after --rate-scale 2); two are 429, one 503.
ROWS = [(0.1 * i, 20 + 5 * i, (5, 6, 8, REJECT_429, 10, 12, REJECT_503)[i % 7]) for i in range(12)]
QUICK_PROBE = ("--probe-prompts", "8,64", "--probe-outputs", "2,10", "--probe-repeats", "1")


# --------------------------------------------------------------------------- pure parts


def test_fit_ideal_recovers_a_linear_model_and_stays_non_negative() -> None:
    pts = [ProbePoint(p, o, 0.05 + 0.001 * p + 0.02 * o, None) for p in (16, 128) for o in (8, 32)]
    fit = fit_ideal(pts)
    assert fit.a_s == pytest.approx(0.05, abs=1e-9)
    assert fit.b_s_per_prompt_token == pytest.approx(0.001, abs=1e-12)
    assert fit.c_s_per_output_token == pytest.approx(0.02, abs=1e-12)
    assert fit.rms_residual_s < 1e-9
    # Unconstrained least squares would give a negative intercept here.
    neg = [ProbePoint(p, o, -0.05 + 0.01 * o, None) for p in (16, 128) for o in (8, 32)]
    fit = fit_ideal(neg)
    assert min(fit.a_s, fit.b_s_per_prompt_token, fit.c_s_per_output_token) >= 0
    assert fit.a_s == 0.0


def test_workload_transforms_and_caps(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [(float(i), 100 + i, 50) for i in range(10)])
    cfg = BenchConfig(
        url="http://127.0.0.1:1/v1/",
        trace=str(trace),
        max_requests=4,
        rate_scale=2.0,
        max_prompt_tokens=102,
        max_output_tokens=40,
    )
    assert cfg.url == "http://127.0.0.1:1"
    wl = load_bench_workload(cfg)
    assert [r.arrival_s for r in wl.requests] == [0.0, 0.5, 1.0, 1.5]
    assert [r.prompt_tokens for r in wl.requests] == [100, 101, 102, 102]
    assert {r.output_tokens for r in wl.requests} == {40}
    assert wl.capped == 4 and all(r.length_capped for r in wl.requests)
    window = load_bench_workload(BenchConfig(url=cfg.url, trace=str(trace), start_s=2, end_s=5))
    assert [r.arrival_s for r in window.requests] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"rate_scale": 0.0}, "--rate-scale"),
        ({"token_range": (5, 2)}, "--token-range"),
        ({"max_prompt_tokens": 0}, "--max-prompt-tokens"),
        ({"url": "localhost:8000"}, "--url"),
        ({"models": ("a",), "model_weights": (1.0, 2.0)}, "--model-weights"),
        ({"ideal": "fit"}, "--ideal"),
    ],
)
def test_bad_settings_are_config_errors(kwargs: dict[str, Any], needle: str) -> None:
    base: dict[str, Any] = {"url": "http://127.0.0.1:1", "trace": "x.jsonl"}
    with pytest.raises(ConfigError, match=needle):
        BenchConfig(**{**base, **kwargs})


# --------------------------------------------------------------------------- against the fake


def test_replay_counts_latencies_and_result_files(
    fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", ROWS)
    out = tmp_path / "out"
    rc, stdout, err = run_cli(
        capsys,
        *("--url", fake.url, "--trace", trace, "--rate-scale", "2", "--out", out),
        *QUICK_PROBE,
        "--no-progress",
    )
    assert rc == 0, err
    s = json.loads((out / "summary.json").read_text())
    req = s["requests"]
    assert req["total"] == 12
    assert req["finished"] + req["rejected"] + req["unfinished"] == req["total"]
    assert req["rejected"] == 3 and req["unfinished"] == 0
    assert req["rejected_reasons"] == {"HTTP 429: queue full": 2, "HTTP 503: draining": 1}
    assert s["bench"]["http_status"] == {"200": 9, "429": 2, "503": 1}

    # Open loop at 20 req/s with ~0.1 s requests: several in flight at once.
    assert s["bench"]["concurrency_peak"] >= 2
    assert s["bench"]["scales"]["rate_scale"] == 2.0
    assert s["bench"]["trace_span_s"] == pytest.approx(0.55)

    lat = s["latency_s"]
    # TTFT: BASE_S + PER_PROMPT_S * (20..75) = 0.034..0.045 s plus client/server overhead.
    assert 0.8 * BASE_S <= lat["ttft"]["p50"] <= BASE_S + 0.25
    assert 0.5 * PER_TOKEN_S <= lat["tpot"]["p50"] <= 4 * PER_TOKEN_S
    assert lat["e2e"]["p50"] > lat["ttft"]["p50"]
    assert s["throughput_rps"] > 0 and s["throughput_tokens_s"] > 0

    # The probe fit describes the fake server: c ~ PER_TOKEN_S per output token.
    fit = s["bench"]["ideal_model"]["fake-a"]
    assert len(fit["points"]) == 4
    assert 0.5 * PER_TOKEN_S <= fit["c_s_per_output_token"] <= 3 * PER_TOKEN_S
    assert 0.0 <= fit["a_s"] <= BASE_S + 0.1
    assert s["normalized_latency"] is not None and s["normalized_latency"] > 0.3
    slo = s["slo_attainment"]
    assert all(0.0 <= v <= 9 / 12 for v in slo.values())
    assert slo["50"] == pytest.approx(9 / 12)  # all finished, at light load, within 50x

    # Fields a client cannot know are None, not invented.
    assert s["gpus"] == {"peak": None, "mean": None, "gpu_hours": None, "lower_bound": None}
    assert s["kv_utilization"]["mean"] is None
    assert s["migrations"]["count"] is None
    assert s["config"]["backend"] == "bench-serve"

    # Requests as sent: token-id prompts in range, max_tokens from the trace.
    replayed = [b for b in fake.state.bodies if b["max_tokens"] in {r[2] for r in ROWS}]
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 for b in replayed)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    assert all(b["stream_options"] == opts for b in replayed)
    assert all(0 <= t <= 255 for b in replayed for t in b["prompt"])
    assert {b["model"] for b in fake.state.bodies} == {"fake-a"}  # the server's first model

    csv_lines = (out / "requests.csv").read_text().splitlines()
    assert len(csv_lines) == 13
    assert (out / "latency_cdf.png").stat().st_size > 0
    assert "bench-serve" in (out / "report.md").read_text()
    assert "9 finished" in stdout and "3 rejected" in stdout


def test_timeout_is_unfinished_and_limit_caps_concurrency(fake: FakeServer, tmp_path: Path) -> None:
    rows = [(0.0, 10, 3), (0.0, 10, STALL), (0.0, 10, 4), (0.01, 10, 3)]
    trace = write_trace(tmp_path / "t.jsonl", rows, model="fake-b")
    cfg = BenchConfig(
        url=fake.url,
        trace=str(trace),
        ideal="none",
        timeout_s=0.6,
        concurrency_limit=1,
        max_requests=3,
    )
    bench = run_bench(cfg)
    s = bench.summary
    assert s["requests"]["total"] == 3
    assert (s["requests"]["finished"], s["requests"]["unfinished"]) == (2, 1)
    assert s["bench"]["unfinished_reasons"] == {"timeout after 0.6 s": 1}
    stalled = next(r for r in bench.result.records if r.status == "unfinished")
    assert stalled.reason == "timeout after 0.6 s"
    assert stalled.generated == 1 and stalled.first_token_s is not None  # one chunk, then stall
    assert s["bench"]["concurrency_peak"] == 1
    assert s["bench"]["send_lag_s"]["max"] >= 0.5  # the 3rd waited for the stalled one
    # The trace's model name is kept when the server serves it.
    assert {b["model"] for b in fake.state.bodies} == {"fake-b"}
    # --ideal none: nothing to normalize by, reported as not measured.
    assert s["normalized_latency"] is None
    assert all(v is None for v in s["slo_attainment"].values())
    assert s["bench"]["ideal_model"] is None
    assert any("--ideal none" in n for n in s["notes"])


def test_model_flag_with_weights(fake: FakeServer, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [(0.005 * i, 8, 2) for i in range(20)])
    cfg = BenchConfig(
        url=fake.url,
        trace=str(trace),
        ideal="none",
        models=("fake-a", "fake-b"),
        model_weights=(1.0, 0.0),
    )
    s = run_bench(cfg).summary
    assert s["requests"]["finished"] == 20
    assert s["bench"]["models"] == {"fake-a": 20}
    bad = BenchConfig(url=fake.url, trace=str(trace), ideal="none", models=("nope",))
    with pytest.raises(FleetserveError, match="does not serve model"):
        run_bench(bad)


def test_wrong_api_key_is_a_clear_error(
    fake: FakeServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake.state.api_key = "secret"
    monkeypatch.setenv("FLEETSERVE_API_KEY", "secret")
    trace = write_trace(tmp_path / "t.jsonl", [(0.0, 8, 2)])
    out = tmp_path / "out"
    args = ("--url", fake.url, "--trace", trace, "--out", out, "--no-progress", *QUICK_PROBE)
    rc, _, err = run_cli(capsys, *args, "--api-key", "wrong")
    one_line_error(rc, err, "401", "--api-key")
    assert not out.exists()
    rc, _, err = run_cli(capsys, *args)  # the key from $FLEETSERVE_API_KEY
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["config"]["api_key"] == "<redacted>"


def test_unreachable_url_and_bad_trace_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    trace = write_trace(tmp_path / "t.jsonl", [(0.0, 8, 2)])
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "--url", url, "--trace", trace, "--out", out, "--no-progress")
    one_line_error(rc, err, "cannot reach", url)
    assert not out.exists()

    missing = tmp_path / "missing.jsonl"
    rc, _, err = run_cli(capsys, "--url", url, "--trace", missing, "--out", out)
    one_line_error(rc, err, str(missing), "not found")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": "many", "output_tokens": 2}\n')
    with pytest.raises(InputError, match="prompt_tokens"):
        load_bench_workload(BenchConfig(url=url, trace=str(bad)))
    rc, _, err = run_cli(capsys, "--url", url, "--trace", trace, "--out", out, "--seed", "-1")
    one_line_error(rc, err, "--seed")
    rc, _, err = run_cli(
        capsys, "--url", url, "--trace", trace, "--out", out, "--token-range", "0-255"
    )
    one_line_error(rc, err, "--token-range", "LOW..HIGH")


def _bench_serve_registered() -> bool:
    from fleetserve.cli.main import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return "bench-serve" in action.choices
    return False


@pytest.mark.skipif(
    not _bench_serve_registered(), reason="bench-serve not yet added to cli.main.build_parser()"
)
def test_fleetserve_main_runs_bench_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fleetserve.cli.main import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trace = write_trace(tmp_path / "t.jsonl", [(0.0, 8, 2)])
    url = f"http://127.0.0.1:{port}"
    rc = main(["bench-serve", "--url", url, "--trace", str(trace), "--out", str(tmp_path / "o")])
    one_line_error(rc, capsys.readouterr().err, "cannot reach", url)


# --------------------------------------------------------------------------- token timing


def _sse_outcome(chunks: list[dict[str, Any]], pause_s: float = 0.02) -> Any:
    """``stream_completion`` against a stream of ``chunks`` sent ``pause_s`` apart."""
    import httpx

    from fleetserve.runtime.bench_serve import stream_completion

    async def body() -> Any:
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n".encode()
            await asyncio.sleep(pause_s)
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    async def go() -> Any:
        async with httpx.AsyncClient(
            base_url="http://fake", transport=httpx.MockTransport(handler)
        ) as client:
            out, _ = await stream_completion(client, {"model": "m"}, 10)
            return out

    return asyncio.run(go())


def _tok(text: str, n: int | None, finish: str | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if n is not None:
        c["usage"] = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}
    return c


def test_per_token_usage_times_tokens_whose_text_is_held_back() -> None:
    # vLLM's continuous_usage_stats: token 1 is half a UTF-8 character (no text yet)
    out = _sse_outcome([_tok("", 1), _tok("é", 2), _tok("a", 3), _tok("", 3, "length")])
    assert out.status == "finished" and out.generated == 3 and out.finish_reason == "length"
    assert len(out.gaps) == 2 and all(g >= 0.01 for g in out.gaps)
    # the first token arrived with the first (empty) chunk, a pause before the text
    assert out.last_token - out.first_token == pytest.approx(sum(out.gaps))
    assert sum(out.gaps) >= 0.03


def test_tokens_sharing_a_chunk_count_each() -> None:
    out = _sse_outcome([_tok("ab", 2), _tok("cde", 5, "length")])
    assert out.generated == 5
    assert len(out.gaps) == 4 and out.gaps[0] == 0.0 and out.gaps[2:] == [0.0, 0.0]
    assert out.gaps[1] >= 0.01


def test_without_per_chunk_usage_text_chunks_are_tokens() -> None:
    usage_only = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
    out = _sse_outcome([_tok("", None), _tok("x", None), _tok("y", None, "length"), usage_only])
    assert out.generated == 3  # the final usage has the last word
    assert len(out.gaps) == 1  # two text chunks: the empty one is not a token
