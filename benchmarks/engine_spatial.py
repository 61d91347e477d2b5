"""Spatial sharing inside one engine: ADBS's jobs at once on their thread shares,
against the same jobs one after another on all threads (issue 24).

One engine hosts two models (``small-llama`` and ``tiny-llama-b`` by default)
under MuxServe's ADBS scheduler, with ``--threads`` intra-op threads. The same
offline load (requests of both models added at once: prompts and outputs
uniform in the given ranges, random byte tokens, greedy, ``ignore_eos``) runs
with ``spatial_shares`` on and off, alternating, ``--rounds`` times each, in
one process. Reported: wall time, generated tokens per second, the share of
jobs that ran at once, and whether every request's tokens are identical
between the two modes. Ratios are taken within each round (the two runs of a
round are back to back, so a slow spell of this shared machine that hits both
cancels out).

Run: ``.venv/bin/python benchmarks/engine_spatial.py`` (``--help``); writes
``results/bench/engine_spatial.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fleetserve.policy.sharing import BATCHING, ServiceStats
from fleetserve.runtime.engine.engine import Engine
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.engine.weights import load_weight_source

ROOT = Path(__file__).resolve().parents[1]
OUT_JSON = ROOT / "results" / "bench" / "engine_spatial.json"


def _range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition("-")
    return int(lo), int(hi or lo)


def _stats(models: list[str]) -> dict[str, ServiceStats]:
    out = {}
    for m in models:
        spec = load_weight_source(m).cfg.spec
        out[m] = ServiceStats(
            rate=1.0,
            exec_mean_s=0.5,
            exec_std_s=0.1,
            kv_bytes_per_token=spec.kv_bytes_per_token,
            prefill_s_per_token=1e-4,
        )
    return out


def run_once(args: argparse.Namespace, spatial: bool, work: list[Any]) -> dict[str, Any]:
    eng = Engine(
        args.models,
        args.arena_mib << 20,
        batching=BATCHING.get("adbs")(),
        services=_stats(args.models),
        spatial_shares=spatial,
    )
    t0 = time.perf_counter()
    rids = [
        eng.add_request(m, ids, SamplingParams(max_tokens=n, ignore_eos=True)) for m, ids, n in work
    ]
    while eng.has_work():
        eng.step()
    wall = time.perf_counter() - t0
    outs = [eng.pop_finished(r).output_ids for r in rids]
    tokens = sum(len(o) for o in outs)
    jobs = eng.group_jobs_alone + eng.group_jobs_at_once
    return {
        "wall_s": wall,
        "tok_s": tokens / wall,
        "jobs": jobs,
        "at_once": eng.group_jobs_at_once / jobs if jobs else 0.0,
        "outputs": outs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs=2, default=["small-llama", "tiny-llama-b"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16, help="per model")
    ap.add_argument("--prompt-range", type=_range, default=(32, 256))
    ap.add_argument("--output-range", type=_range, default=(32, 64))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arena-mib", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT_JSON)
    args = ap.parse_args()
    if args.threads < 2:
        print("error: --threads must be at least 2 (one share each)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    work = []
    for k in range(args.requests * 2):
        m = args.models[k % 2]
        ids = [rng.randrange(3, 250) for _ in range(rng.randint(*args.prompt_range))]
        work.append((m, ids, rng.randint(*args.output_range)))
    run_once(args, True, work[:4])  # warm-up: kernels, thread pools
    rounds = []
    for r in range(args.rounds):
        pair = {}
        for spatial in (True, False) if r % 2 == 0 else (False, True):
            pair["at_once" if spatial else "one_by_one"] = run_once(args, spatial, work)
        a, b = pair["at_once"], pair["one_by_one"]
        rounds.append(
            {
                "at_once_tok_s": a["tok_s"],
                "one_by_one_tok_s": b["tok_s"],
                "ratio": a["tok_s"] / b["tok_s"],
                "jobs_at_once_share": a["at_once"],
                "identical": a["outputs"] == b["outputs"],
            }
        )
        print(
            f"round {r + 1}: at once {a['tok_s']:.0f} tok/s ({a['at_once']:.0%} of "
            f"{a['jobs']} jobs at once), one by one {b['tok_s']:.0f} tok/s: "
            f"{a['tok_s'] / b['tok_s']:.2f}x, outputs identical: {a['outputs'] == b['outputs']}"
        )
    ratios = [x["ratio"] for x in rounds]
    summary = {
        "models": args.models,
        "threads": args.threads,
        "requests_per_model": args.requests,
        "prompt_range": args.prompt_range,
        "output_range": args.output_range,
        "median_ratio": statistics.median(ratios),
        "rounds": rounds,
        "identical": all(x["identical"] for x in rounds),
        "machine": platform.processor() or platform.machine(),
    }
    print(
        f"median ratio, at once / one by one: {summary['median_ratio']:.2f}x "
        f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}); "
        f"outputs identical in every round: {summary['identical']}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
