"""Where a CUDA decode step's time goes: the torch profiler's top kernels for the
engine's eager decode steps (fp32 and bf16), and plain GEMMs of the model's
shapes in each dtype. For a lent GPU (docs/gpu.md); prints tables only.

Run: ``PYTHONPATH=src python3 benchmarks/cuda_step_profile.py [--model M]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fleetserve.runtime.engine.engine import Engine
from fleetserve.runtime.engine.sampling import SamplingParams


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def gemm_us(dev: str, m: int, k: int, n: int, dt: torch.dtype, reps: int = 200) -> float:
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt)
    for _ in range(10):
        torch.nn.functional.linear(x, w)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(x, w)
    sync(dev)
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llama-b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--graphs", default="off", help="the engine's decode_graphs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (engine_decode's 1)")
    ap.add_argument("--prompt-max", type=int, default=512, help="prompts of 16..N tokens")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu for a dry run")
    args = ap.parse_args(argv)
    dev = args.device
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    lens = [rng.randint(16, max(16, args.prompt_max)) for _ in range(args.batch)]
    if dev == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    for dt in (torch.float32, torch.bfloat16):
        eng = Engine([args.model], 512 << 20, device=dev, dtype=dt, decode_graphs=args.graphs)
        spec = eng.models[args.model].cfg.spec
        h, i = spec.hidden_size, spec.intermediate_size
        qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        print(f"\n== {args.model} {dt}, batch {args.batch}, decode_graphs {args.graphs}")
        for m in (1, args.batch, 512):
            shapes = [(h, qkv), (h, h), (h, 2 * i), (i, h)]
            us = [gemm_us(dev, m, k, n, dt) for k, n in shapes]
            print(
                f"GEMM rows {m}: "
                + ", ".join(f"{k}x{n} {u:.1f} us" for (k, n), u in zip(shapes, us, strict=True))
            )
        p = SamplingParams(max_tokens=60, ignore_eos=True)
        for j in range(args.batch):
            eng.add_request(args.model, [1 + (j * 7 + t) % 250 for t in range(lens[j])], p)
        for _ in range(8):
            eng.step()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(10):
            eng.step()
        sync(dev)
        print(f"10 decode steps: {(time.perf_counter() - t0) * 1e3:.1f} ms wall")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                eng.step()
            sync(dev)
        key = "cuda_time_total" if dev == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
