"""A third-party load generator (NVIDIA AIPerf) against ``fleetserve serve``, end to end.

``make bench-client`` installs the pinned ``aiperf`` into its own environment
(``.venv-bench/``, no torch) and runs this script with the project's Python:

1. ``fleetserve tokenizer MODEL --out OUT/tokenizer`` writes the Hugging Face
   tokenizer folder of the config's first model (aiperf counts prompt tokens
   with it when it builds its synthetic prompts).
2. ``fleetserve serve CONFIG --port <free> --api-key <random>`` starts in the
   background (its own process group), its output in ``OUT/server.log``; the
   script waits until ``GET /v1/models`` with the key answers 200 (and checks
   that the same request without the key gets 401), or stops with the log's
   tail after ``--ready-timeout`` seconds.
3. ``aiperf profile`` sweeps ``--rates`` (Poisson arrivals, ``--duration``
   seconds each, after a short warm-up) over ``/v1/completions`` with streaming,
   ``--prompt-tokens`` synthetic prompt tokens and exactly ``--output-tokens``
   output tokens (``ignore_eos``), round-robin over every served model, sending
   the API key. Token counts are the server's ``usage`` (the tiny models emit
   random bytes, often not valid UTF-8, so the streamed text does not
   re-tokenize to the generated ids). Its reports land in ``OUT/aiperf/``
   (one ``rate_R/`` folder per rate with ``profile_export_aiperf.json``/``.csv``
   and per-request ``profile_export.jsonl``, plus ``sweep_aggregate/``).
4. The server gets SIGTERM and ``--stop-timeout`` seconds to exit, then its
   process group is killed; always, also when a step fails.
5. ``OUT/summary.md``: one row per rate from aiperf's JSON (requests ok and
   failed, request rate, output tokens/s, mean/P99 TTFT, ITL and latency).

Exit status 1 when the server does not come up, aiperf fails, a rate has no
report, or any request failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, key: str | None, timeout: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no server log)"
    return "\n".join(text[-lines:])


def wait_ready(
    proc: subprocess.Popen[bytes], base: str, key: str, timeout: float, log: Path
) -> list[str]:
    """Served model ids once ``GET /v1/models`` answers 200; SystemExit otherwise."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        if proc.poll() is not None:
            raise SystemExit(
                f"the server exited with status {proc.returncode} before it was ready; "
                f"last lines of {log}:\n{log_tail(log)}"
            )
        try:
            status, body = http_get(base + "/v1/models", key, timeout=2.0)
            if status == 200:
                return [m["id"] for m in json.loads(body)["data"]]
            last = f"HTTP {status}: {body[:200]!r}"
        except (OSError, ValueError, KeyError) as e:
            last = repr(e)
        if time.monotonic() > deadline:
            raise SystemExit(
                f"GET {base}/v1/models did not answer 200 within {timeout:g} s "
                f"(last: {last}); last lines of {log}:\n{log_tail(log)}"
            )
        time.sleep(1.0)


def stop_server(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """SIGTERM, wait, then SIGKILL the server's process group; how it ended."""
    if proc.poll() is not None:
        how = f"had already exited with status {proc.returncode}"
    else:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=timeout)
            how = f"exited with status {rc} {time.monotonic() - t0:.1f} s after SIGTERM"
        except subprocess.TimeoutExpired:
            how = f"did not exit within {timeout:g} s of SIGTERM: killed"
            proc.kill()
            proc.wait()
    # Whatever the server started in its own process group (Ray's helpers) and left behind.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        how += "; leftover processes in its group killed"
    except ProcessLookupError:
        pass
    return how


def first_model(config: Path) -> str:
    models = (yaml.safe_load(config.read_text()) or {}).get("serve", {}).get("models") or []
    if not models:
        raise SystemExit(f"{config}: serve.models is empty")
    return str(models[0])


def client_version(client: Path) -> str:
    r = subprocess.run([str(client), "--version"], capture_output=True, text=True, check=False)
    lines = (r.stdout + r.stderr).strip().splitlines()
    return lines[-1].strip() if lines else "?"


def run_client(cmd: list[str], log: Path) -> int:
    """Run aiperf, its output both on the console and in ``log``."""
    env = dict(os.environ, NO_COLOR="1")
    # aiperf 0.13 loads a tokenizer *folder* only when the Hub is online: with
    # HF_HUB_OFFLINE it looks the path up in the Hub cache and fails. A local path
    # never touches the network, so the variables are dropped, not set.
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(var, None)
    with (
        log.open("w") as f,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
        ) as p,
    ):
        assert p.stdout is not None
        for line in p.stdout:
            sys.stdout.write(line)
            f.write(line)
        return p.wait()


def avg(d: dict[str, Any], key: str, stat: str = "avg") -> float:
    v = d.get(key)
    if isinstance(v, dict) and v.get(stat) is not None:
        return float(v[stat])
    return float("nan")


def profiling_rate(d: dict[str, Any]) -> float:
    for ph in d.get("input_config", {}).get("phases", []):
        if ph.get("kind") == "profiling" and ph.get("rate") is not None:
            return float(ph["rate"])
    return float("nan")


def read_reports(folder: Path) -> list[dict[str, Any]]:
    rows = []
    for f in sorted(folder.glob("*/profile_export_aiperf.json")):
        d = json.loads(f.read_text())
        errors = avg(d, "error_request_count")
        ok = avg(d, "request_count")
        rows.append(
            {
                "report": str(f.relative_to(folder.parent)),
                "rate": profiling_rate(d),
                "ok": 0 if ok != ok else int(ok),
                "failed": 0 if errors != errors else int(errors),
                "errors": d.get("error_summary") or [],
                "cancelled": bool(d.get("was_cancelled")),
                "duration_s": avg(d, "benchmark_duration"),
                "req_s": avg(d, "request_throughput"),
                "out_tok_s": avg(d, "output_token_throughput"),
                "osl": avg(d, "output_sequence_length"),
                "isl": avg(d, "input_sequence_length"),
                "ttft": avg(d, "time_to_first_token"),
                "ttft_p99": avg(d, "time_to_first_token", "p99"),
                "itl": avg(d, "inter_token_latency"),
                "itl_p99": avg(d, "inter_token_latency", "p99"),
                "lat": avg(d, "request_latency"),
                "lat_p99": avg(d, "request_latency", "p99"),
            }
        )
    rows.sort(key=lambda r: r["rate"])
    return rows


def summary_md(rows: list[dict[str, Any]], meta: dict[str, str]) -> str:
    out = ["# Third-party client against fleetserve serve", ""]
    out += [f"- **{k}**: {v}" for k, v in meta.items()]
    out += [
        "",
        "| target req/s | ok | failed | req/s | output tok/s | in/out tok | "
        "TTFT mean ms | TTFT P99 ms | ITL mean ms | ITL P99 ms | latency P99 s |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['rate']:g} | {r['ok']} | {r['failed']} | {r['req_s']:.2f} | "
            f"{r['out_tok_s']:.1f} | {r['isl']:.0f}/{r['osl']:.0f} | {r['ttft']:.0f} | "
            f"{r['ttft_p99']:.0f} | {r['itl']:.1f} | {r['itl_p99']:.1f} | "
            f"{r['lat_p99'] / 1000:.2f} |"
        )
    errs = [(r["rate"], e) for r in rows for e in r["errors"]]
    if errs:
        out += ["", "Errors reported by the client:", ""]
        out += [f"- rate {rate:g}: {json.dumps(e)}" for rate, e in errs]
    out += [
        "",
        "ok/failed: aiperf's `request_count`/`error_request_count`; req/s and output tok/s "
        "over the rate's profiling window; in/out tok: mean prompt and output tokens as the "
        "server's `usage` reports them (the prompt counts BOS); ITL: inter-token latency "
        "(TPOT) per request, after the first token. Per-request records: "
        "`aiperf/rate_*/profile_export.jsonl`.",
        "",
    ]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/serve-tiny.yaml")
    p.add_argument("--out", default="results/bench-client")
    p.add_argument("--client", default=".venv-bench/bin/aiperf", help="the aiperf executable")
    p.add_argument("--rates", default="2,8,16", help="request rates to sweep (req/s)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per rate")
    p.add_argument("--grace", type=float, default=30.0, help="seconds to drain after each rate")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--stop-timeout", type=float, default=30.0)
    args = p.parse_args()

    config = Path(args.config)
    out = Path(args.out).resolve()
    client = Path(args.client)
    if not client.exists():
        print(f"{client} not found: run `make bench-client`", file=sys.stderr)
        return 1
    fleetserve = Path(sys.executable).with_name("fleetserve")
    # a fresh report each run: aiperf's folders, the tokenizer, the old summary
    for stale in ("aiperf", "tokenizer", "summary.md", "server.log", "aiperf.log"):
        path = out / stale
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    out.mkdir(parents=True, exist_ok=True)

    model = first_model(config)
    tok_dir = out / "tokenizer"
    subprocess.run(
        [str(fleetserve), "tokenizer", model, "--out", str(tok_dir)],
        check=True,
        stdout=subprocess.DEVNULL,
    )

    port = free_port()
    # hex: a urlsafe token may start with '-', which a command line reads as an option
    key = secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    server_log = out / "server.log"
    env = dict(os.environ)
    env.pop("FLEETSERVE_API_KEY", None)
    cmd = [
        str(fleetserve),
        "serve",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        key,
    ]
    t_start = time.monotonic()
    with server_log.open("wb") as logf:
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    stopped = "not stopped"
    rc = 1
    try:
        models = wait_ready(proc, base, key, args.ready_timeout, server_log)
        ready_s = time.monotonic() - t_start
        noauth, _ = http_get(base + "/v1/models", None)
        print(f"server ready in {ready_s:.1f} s at {base}, models {models}; no key -> {noauth}")
        if noauth != 401:
            print(f"GET /v1/models without the API key answered {noauth}, not 401", file=sys.stderr)
        aiperf_dir = out / "aiperf"
        client_cmd = [
            str(client),
            "profile",
            "--model",
            ",".join(models),
            "--url",
            base,
            "--endpoint-type",
            "completions",
            "--streaming",
            "--api-key",
            key,
            "--tokenizer",
            str(tok_dir),
            "--prompt-input-tokens-mean",
            str(args.prompt_tokens),
            "--prompt-input-tokens-stddev",
            "0",
            "--prompt-output-tokens-mean",
            str(args.output_tokens),
            "--prompt-output-tokens-stddev",
            "0",
            "--extra-inputs",
            "ignore_eos:true",
            "--use-server-token-count",
            "--request-rate",
            args.rates,
            "--benchmark-duration",
            f"{args.duration:g}",
            "--benchmark-grace-period",
            f"{args.grace:g}",
            # a single warm-up rate: a list in --request-rate alone would also sweep the warm-up
            "--warmup-request-count",
            str(args.warmup_requests),
            "--warmup-request-rate",
            "2",
            "--random-seed",
            str(args.seed),
            "--ui-type",
            "none",
            # one load worker and one record processor: on a small machine the client
            # shares the CPU with the server, and every extra process adds jitter
            "--workers-max",
            "1",
            "--record-processors",
            "1",
            "--no-gpu-telemetry",
            "--no-server-metrics",
            "--output-artifact-dir",
            str(aiperf_dir),
        ]
        t_client = time.monotonic()
        client_rc = run_client(client_cmd, out / "aiperf.log")
        client_s = time.monotonic() - t_client
        alive = proc.poll() is None
        stopped = stop_server(proc, args.stop_timeout)

        rows = read_reports(aiperf_dir)
        rates = [float(r) for r in args.rates.split(",")]
        meta = {
            "client": f"aiperf {client_version(client)} (`aiperf profile`, its own venv)",
            "server": f"`fleetserve serve {config} --api-key ...`: {', '.join(models)}",
            "load": (
                f"/v1/completions, streaming, {args.prompt_tokens} prompt tokens, "
                f"{args.output_tokens} output tokens (ignore_eos), Poisson arrivals at "
                f"{args.rates} req/s, {args.duration:g} s each after {args.warmup_requests} "
                "warm-up requests, models round-robin"
            ),
            "run": (
                f"{dt.datetime.now().isoformat(timespec='seconds')}; server ready in "
                f"{ready_s:.1f} s; client {client_s:.0f} s (exit {client_rc}); server "
                f"{'alive' if alive else 'DEAD'} after the run, {stopped}"
            ),
            "auth": f"GET /v1/models without the key -> {noauth}",
        }
        (out / "summary.md").write_text(summary_md(rows, meta))
        print()
        print((out / "summary.md").read_text())

        problems = []
        if client_rc != 0:
            problems.append(f"aiperf exited with status {client_rc}")
        missing = [r for r in rates if r not in {row["rate"] for row in rows}]
        if missing:
            problems.append(f"no aiperf report for rate(s) {missing}")
        problems += [
            f"rate {r['rate']:g}: {r['failed']} failed requests" for r in rows if r["failed"]
        ]
        problems += [f"rate {r['rate']:g}: no successful request" for r in rows if not r["ok"]]
        if not alive:
            problems.append("the server died during the run")
        if noauth != 401:
            problems.append(f"the server answered {noauth} without the API key")
        for msg in problems:
            print(f"FAIL: {msg}", file=sys.stderr)
        rc = 1 if problems else 0
    finally:
        if proc.poll() is None or stopped == "not stopped":
            stopped = stop_server(proc, args.stop_timeout)
        print(f"server {stopped}; log: {server_log}")
    print(f"report: {out / 'summary.md'}, aiperf's own files: {out / 'aiperf'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
