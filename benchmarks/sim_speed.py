"""Simulator speed: the full Azure conv trace, LLaMA-2-7B, elastic A100-40GB pool, stack bf
(its instances are one-model sharing groups, since session 29).

Target: >= 25,000 simulated requests per wall-second on the 2-core development
machine (issue 21: the "One system" refactor must keep the speed measured
before it, ~28,000; issue 2 asked for 6,000), without coarsening: the simulator's macro-steps give
exactly the results of an iteration-by-iteration run (tests/test_sim.py checks
it bit for bit). This benchmark also times the iteration-by-iteration mode on
the same trace for reference, the trace loader, and the cost model's decode
call, and writes everything to results/bench/sim_speed.json.

Cluster size (issue 21 item 8): the cost of an event must grow with the work,
not with the number of GPUs. Two more points run the same trace with Mell's
x10 conversation lengths (capped to fit an instance), time-compressed so the
elastic pool peaks near 225 GPUs (rate x1.6) and near 1,300 GPUs (rate x9):
the same requests and about the same events and per-instance load, six times
the instances. Target: the large point costs at most 2x the small one per event.

Run: ``make bench`` (or ``.venv/bin/python benchmarks/sim_speed.py``).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from fleetserve.config import config_from_dict
from fleetserve.costmodel import CostModel
from fleetserve.metrics import summarize
from fleetserve.sim.build import build_workload
from fleetserve.sim.simulator import Simulator
from fleetserve.spec import get_gpu, get_model
from fleetserve.workload import default_workload, load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "azure_llm_2023_conv.csv"
TARGET_RPS = 25000.0
SCALE_POINTS = (("225 GPUs", 1.6), ("1,300 GPUs", 9.0))
"""Rate scales of the cluster-size points (peaks of 227 and 1,317 GPUs on the shared trace)."""
MAX_SCALE_RATIO = 2.0


def best_of(n: int, fn):  # type: ignore[no-untyped-def]
    best, out = float("inf"), None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> int:
    if TRACE.exists():
        load_s, loaded = best_of(3, lambda: load_trace(TRACE, "azure", model="llama-2-7b"))
        reqs = list(loaded.requests)
        source = str(TRACE)
    else:
        print(f"note: {TRACE} not found; using the built-in synthetic workload (1 hour)")
        load_s = float("nan")
        reqs = default_workload(np.random.default_rng(0), 3600.0, model="llama-2-7b")
        source = "synthetic"
    base = {"model": "llama-2-7b", "cluster": {"gpu": "a100-40gb", "elastic": True}}
    cfg = config_from_dict({**base, "policy": {"stack": "bf"}})
    sim_s, res = best_of(3, lambda: Simulator(cfg, reqs).run())
    summary = summarize(res)
    ref_cfg = config_from_dict({**base, "policy": {"stack": "bf"}, "macro_steps": False})
    ref_s, ref = best_of(1, lambda: Simulator(ref_cfg, reqs).run())
    same = [(r.finish_s, r.first_token_s, r.instance) for r in res.records] == [
        (r.finish_s, r.first_token_s, r.instance) for r in ref.records
    ]
    cost = CostModel().bind(get_model("llama-2-7b"), get_gpu("a100-40gb"))
    x1, xk = np.array([1234.0]), np.arange(1000, dtype=np.float64) * 13 + 100
    n = 20000
    d1, _ = best_of(3, lambda: [cost.decode_time(8, x1) for _ in range(n)])
    dk, _ = best_of(3, lambda: [cost.decode_time(8, xk) for _ in range(n)])
    scale = [scale_point(label, rate) for label, rate in SCALE_POINTS]
    ratio = scale[1]["us_per_event"] / scale[0]["us_per_event"]

    rps = len(reqs) / sim_s
    out = {
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or "?"},
        "workload": {"source": source, "requests": len(reqs)},
        "trace_load_s": load_s,
        "sim": {
            "wall_s": sim_s,
            "events": res.sim_events,
            "requests_per_s": rps,
            "events_per_s": (res.sim_events or 0) / sim_s,
            "gpus_peak": summary["gpus"]["peak"],
            "finished": summary["requests"]["finished"],
        },
        "iteration_by_iteration": {
            "wall_s": ref_s,
            "events": ref.sim_events,
            "requests_per_s": len(reqs) / ref_s,
            "identical_results": same,
        },
        "decode_time_us": {"len1": d1 / n * 1e6, "len1000": dk / n * 1e6},
        "target_requests_per_s": TARGET_RPS,
        "meets_target": rps >= TARGET_RPS,
        "cluster_size": {
            "points": scale,
            "us_per_event_ratio": ratio,
            "max_ratio": MAX_SCALE_RATIO,
            "meets_target": ratio <= MAX_SCALE_RATIO,
        },
    }
    dest = ROOT / "results" / "bench"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "sim_speed.json").write_text(json.dumps(out, indent=2))
    print(f"workload          {source}: {len(reqs):,} requests")
    print(f"trace load        {load_s:.3f} s")
    print(
        f"simulate (bf)     {sim_s:.3f} s  {rps:,.0f} requests/s  "
        f"{out['sim']['events_per_s']:,.0f} events/s  ({res.sim_events:,} events, "
        f"peak {summary['gpus']['peak']} GPUs)"
    )
    print(
        f"iteration by iteration  {ref_s:.3f} s  {len(reqs) / ref_s:,.0f} requests/s  "
        f"({ref.sim_events:,} events)  identical results: {same}"
    )
    print(f"decode_time       {d1 / n * 1e6:.2f} µs (1 ctx)  {dk / n * 1e6:.2f} µs (1,000 ctx)")
    verdict = "meets" if rps >= TARGET_RPS else "MISSES"
    print(f"target >= {TARGET_RPS:,.0f} requests/s: {verdict}")
    for p in scale:
        print(
            f"{p['label']:<11} (x10 lengths, rate x{p['rate_scale']:g})  {p['wall_s']:.3f} s  "
            f"{p['events']:,} events  {p['us_per_event']:.1f} µs/event  "
            f"(peak {p['gpus_peak']} GPUs)"
        )
    verdict = "meets" if ratio <= MAX_SCALE_RATIO else "MISSES"
    print(
        f"µs/event at {scale[1]['label']} / at {scale[0]['label']}: {ratio:.2f}x "
        f"(target <= {MAX_SCALE_RATIO:g}x): {verdict}"
    )
    print(f"written to {dest / 'sim_speed.json'}")
    return 0 if rps >= TARGET_RPS and same and ratio <= MAX_SCALE_RATIO else 1


def scale_point(label: str, rate_scale: float) -> dict[str, object]:
    """The benchmark trace with Mell's x10 lengths at ``rate_scale`` on the elastic
    pool, stack bf: wall time (best of 2), events, µs per event, peak GPUs."""
    cfg = config_from_dict(
        {
            "model": "llama-2-7b",
            "cluster": {"gpu": "a100-40gb", "elastic": True},
            "policy": {"stack": "bf"},
            # x10 lengths stand for a long-context model (as in Mell's setting):
            # serve a window no capped request exceeds (each is capped to one
            # instance's KV, ~50k tokens here), or most would be rejected as too long
            "engine": {"max_model_len": 131072},
            "workload": {
                "trace": str(TRACE),
                "format": "azure",
                "if_missing": "synthetic",
                "synthetic_duration_s": 3600.0,
                "length_scale": 10.0,
                "cap_lengths": True,
                "rate_scale": rate_scale,
            },
        }
    )
    reqs = build_workload(cfg).requests
    wall, res = best_of(2, lambda: Simulator(cfg, reqs).run())
    events = res.sim_events or 0
    return {
        "label": label,
        "rate_scale": rate_scale,
        "requests": len(reqs),
        "wall_s": wall,
        "events": events,
        "us_per_event": wall / max(events, 1) * 1e6,
        "gpus_peak": summarize(res)["gpus"]["peak"],
    }


if __name__ == "__main__":
    sys.exit(main())
