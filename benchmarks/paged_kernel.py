"""The paged CPU decode-attention kernel alone (``runtime/engine/_paged_kernel``).

One call of the serial kernel on a decode batch shaped like small-llama's
(``--requests`` requests, 4 KV heads of 3 query heads each, head width 64,
16-token pages), contexts uniform in ``--ctx``. Pages are placed in the arena
in a random order, as the engine's allocator leaves them after some churn.
Two arenas:

* ``cache``: every job reads its pages from a small pool (0.5 MB), so the KV
  stays in cache: what the kernel's arithmetic costs;
* ``dram``: each (request, KV head) has its own pages, ~44 MB at the default
  sizes, more than this machine's L3: what a real decode step sees.

Reported per KV row (one key and one value row of one head: 512 bytes):
nanoseconds and the KV bandwidth achieved, medians of ``--repeats`` timings
of ``--calls`` calls each. The kernel's history (vectorised exp, software
prefetch) is in docs/engine-speed.md.

Run: ``.venv/bin/python benchmarks/paged_kernel.py``; writes
``results/bench/paged_kernel.json`` as well.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _arena(
    rng: np.random.Generator, ctx: np.ndarray, nkv: int, bs: int, d: int, pool: int | None
) -> tuple[np.ndarray, np.ndarray]:
    nb = (ctx + bs - 1) // bs
    need = int(nb.sum()) * nkv
    pages = need if pool is None else pool
    kv = rng.standard_normal((pages, 2 * bs, d), dtype=np.float32)
    # without a pool every block has its own page, in a random place
    order = rng.permutation(pages) if pool is None else rng.integers(0, pages, need)
    tab = np.zeros((len(ctx), int(nb.max()), nkv), np.int64)
    k = 0
    for b in range(len(ctx)):
        for blk in range(int(nb[b])):
            for h in range(nkv):
                tab[b, blk, h] = order[k]
                k += 1
    return kv, tab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--ctx", default="40,600", help="context range in tokens, lo,hi")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench/paged_kernel.json")
    args = ap.parse_args()
    from fleetserve.runtime.engine._paged_kernel import decode_serial

    nkv, g, d, bs = 4, 3, 64, 16
    lo, hi = (int(x) for x in args.ctx.split(","))
    rng = np.random.default_rng(args.seed)
    ctx = np.sort(rng.integers(lo, hi + 1, args.requests)).astype(np.int64)
    q = rng.standard_normal((args.requests, nkv, g, d), dtype=np.float32)
    rows = int(ctx.sum()) * nkv
    out: dict[str, dict[str, float]] = {}
    for name, pool in (("cache", 64), ("dram", None)):
        kv, tab = _arena(rng, ctx, nkv, bs, d, pool)
        o = np.empty_like(q)
        decode_serial(q, kv, tab, ctx, o, bs, d**-0.5, 1)  # compile or load
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for _ in range(args.calls):
                decode_serial(q, kv, tab, ctx, o, bs, d**-0.5, 1)
            times.append((time.perf_counter() - t) / args.calls)
        dt = float(np.median(times))
        out[name] = {
            "arena_mb": kv.nbytes / 1e6,
            "ms_per_call": dt * 1e3,
            "ns_per_row": dt / rows * 1e9,
            "kv_gb_s": rows * 2 * d * 4 / dt / 1e9,
        }
        r = out[name]
        print(
            f"{name:5s} arena {r['arena_mb']:5.1f} MB: {r['ms_per_call']:.2f} ms/call, "
            f"{r['ns_per_row']:.1f} ns per KV row, {r['kv_gb_s']:.2f} GB/s"
        )
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"requests": args.requests, "ctx": [lo, hi], **out}, indent=1))


if __name__ == "__main__":
    main()
