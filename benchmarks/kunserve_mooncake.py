"""Issue 22's KunServe acceptance on a long-prompt trace, measured.

``fleetserve simulate`` of the Mooncake conversation trace (12,031 requests,
12k-token prompts on average) with Qwen-2.5-14B on 8 A800-80GB, stack
``kunserve`` against stack ``vllm``, runs interleaved (``--repeat`` rounds).
It checks what the issue asks, from each run's ``summary.json``:

* KunServe's P99 TTFT and its throughput (requests/s and output tokens/s)
  are never worse than vLLM's (the simulations are deterministic: every
  round gives the same figures, and the check says so);
* its simulation (the event loop's wall time, ``sim.wall_s``) costs at most
  ``--max-ratio`` (3) x vLLM's. Timings on a shared machine are noisy: the
  ratio is taken per round (the two runs of a round are back to back) and the
  median over the rounds is judged; every round is printed. Five rounds by
  default (three until session 32: single rounds on this 2-core machine
  spread over 2.1-3.8x around a median near 2.9x, so a 3-round median was
  decided by the noise about as often as by the code).

Exit status 1 when a check fails. Usage::

    .venv/bin/python benchmarks/kunserve_mooncake.py [--repeat 5] [--trace PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("FLEETSERVE_DATA_DIR", ROOT.parent / "shared" / "data"))


def run(stack: str, trace: Path, out: Path) -> dict[str, float]:
    cmd = [
        str(ROOT / ".venv" / "bin" / "fleetserve"),
        "simulate",
        "--stack",
        stack,
        "--trace",
        str(trace),
        "--format",
        "mooncake",
        "--model",
        "qwen-2.5-14b",
        "--gpu",
        "a800-80gb",
        "--gpus",
        "8",
        "--out",
        str(out),
        "--no-progress",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = json.loads((out / "summary.json").read_text())
    return {
        "p99_ttft_s": s["latency_s"]["ttft"]["p99"],
        "req_s": s["throughput_rps"],
        "tok_s": s["throughput_tokens_s"],
        "sim_wall_s": s["sim"]["wall_s"],
        "events": s["sim"]["events"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--trace", type=Path, default=DATA / "mooncake_conversation_trace.jsonl")
    ap.add_argument("--max-ratio", type=float, default=3.0)
    args = ap.parse_args()
    if not args.trace.is_file():
        print(f"error: trace not found: {args.trace}", file=sys.stderr)
        return 2
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            got = {s: run(s, args.trace, Path(tmp) / f"{s}-{i}") for s in ("vllm", "kunserve")}
            rounds.append(got)
            v, k = got["vllm"], got["kunserve"]
            print(
                f"round {i + 1}: simulation vllm {v['sim_wall_s']:.2f} s ({v['events']:,.0f} "
                f"events), kunserve {k['sim_wall_s']:.2f} s ({k['events']:,.0f} events): "
                f"{k['sim_wall_s'] / v['sim_wall_s']:.2f}x"
            )
    v, k = rounds[0]["vllm"], rounds[0]["kunserve"]
    same = all(
        r[s][m] == rounds[0][s][m] for r in rounds for s in r for m in ("p99_ttft_s", "tok_s")
    )
    print(f"figures identical in every round: {same}")
    print("| metric | vllm | kunserve | kunserve / vllm |")
    print("|---|---|---|---|")
    for m, label in (("p99_ttft_s", "P99 TTFT (s)"), ("req_s", "req/s"), ("tok_s", "output tok/s")):
        print(f"| {label} | {v[m]:,.2f} | {k[m]:,.2f} | {k[m] / v[m]:.3f} |")
    ratio = statistics.median(r["kunserve"]["sim_wall_s"] / r["vllm"]["sim_wall_s"] for r in rounds)
    print(f"| simulation wall (median ratio of {len(rounds)} rounds) | | | {ratio:.2f} |")
    ok = (
        same
        and k["p99_ttft_s"] <= v["p99_ttft_s"]
        and k["req_s"] >= v["req_s"]
        and k["tok_s"] >= v["tok_s"]
        and ratio <= args.max_ratio
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
