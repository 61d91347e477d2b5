"""``make bench-client``'s harness (benchmarks/bench_client.py) end to end,
with a stand-in for AIPerf so ``make test`` needs no 1.2 GB client venv: the
harness writes the tokenizer, starts ``fleetserve serve`` with an API key,
runs the client, writes ``summary.md`` from the client's JSON and stops the
server with SIGTERM. The stand-in sends real requests with the key and the
tokenizer folder the harness gave it, and writes AIPerf's report fields.
The real client runs in ``make bench-client``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

STUB = r"""
import sys
if sys.argv[1] == "--version":  # before the imports: they take seconds
    print("stub 0"); sys.exit(0)
import json, time
from pathlib import Path
import httpx
from transformers import AutoTokenizer
a = sys.argv[2:]
opt = {a[i]: a[i + 1] for i in range(len(a) - 1) if a[i].startswith("--")}
tok = AutoTokenizer.from_pretrained(opt["--tokenizer"])
prompt = tok.decode(list(b"hello world " * 10))
models = opt["--model"].split(",")
hdr = {"Authorization": "Bearer " + opt["--api-key"]}
for rate in opt["--request-rate"].split(","):
    ok = 0
    t = []
    for i in range(3):
        t0 = time.monotonic()
        body = {"model": models[i % len(models)], "prompt": prompt, "max_tokens": 4,
                "ignore_eos": True}
        r = httpx.post(opt["--url"] + "/v1/completions", headers=hdr, timeout=60, json=body)
        ok += r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        t.append(1000 * (time.monotonic() - t0))
    stat = {"avg": sum(t) / 3, "p99": max(t)}
    rep = {"request_count": {"avg": ok}, "error_request_count": {"avg": 3 - ok},
           "input_config": {"phases": [{"kind": "profiling", "rate": float(rate)}]},
           "request_throughput": {"avg": 1.0}, "output_token_throughput": {"avg": 4.0},
           "output_sequence_length": {"avg": 4}, "input_sequence_length": {"avg": 121},
           "time_to_first_token": stat, "inter_token_latency": stat, "request_latency": stat}
    d = Path(opt["--output-artifact-dir"]) / f"rate_{rate}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "profile_export_aiperf.json").write_text(json.dumps(rep))
"""


def test_bench_client_harness_runs_a_client_against_a_real_server(tmp_path: Path) -> None:
    stub = tmp_path / "aiperf"
    stub.write_text(f"#!{sys.executable}\n{STUB}")
    stub.chmod(0o755)
    # the shipped config with two workers (one per model) instead of four: the
    # harness is under test, and the two workers fewer start seconds sooner
    config = yaml.safe_load((ROOT / "configs/serve-tiny.yaml").read_text())
    config["serve"]["workers"] = 2
    (tmp_path / "serve-tiny.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "report"
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_client.py"), "--client", str(stub)]
    cmd += ["--out", str(out), "--rates", "1,2", "--config", str(tmp_path / "serve-tiny.yaml")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = (out / "summary.md").read_text()
    assert "| 1 | 3 | 0 |" in summary and "| 2 | 3 | 0 |" in summary, summary
    assert "without the key -> 401" in summary
    assert "exited with status 0" in summary, summary  # the server drained on SIGTERM
    assert (out / "tokenizer" / "tokenizer.json").is_file()
