"""Would a C decode-attention kernel close the gap to vLLM? (issue 25, session 31)

The engine's paged decode kernel is Numba (``runtime/engine/_paged_kernel``).
This probe writes the same two-pass algorithm in C (scores, softmax with the
same polynomial exp, weighted sum of the value rows; the next block's rows
prefetched), specialised at compile time for small-llama's shape (3 query
heads per KV head, head width 64) with a generic fallback, compiles it with
the system's C compiler (``cc -O3 -march=native -ffast-math``, about 0.3 s)
into a temporary folder, and times both kernels on the arenas of
``benchmarks/paged_kernel.py`` (pages in a random order; ``cache``: the KV in
cache, what the arithmetic costs; ``dram``: a real step's KV, larger than the
L3), interleaved. It checks the two kernels agree (relative difference of the
outputs) and prints nanoseconds per KV row for each.

It is a measurement, not part of the engine: no C is compiled at run time.
docs/engine-speed.md ("Session 31") has the figures and what they mean.

Run: ``.venv/bin/python benchmarks/paged_kernel_c.py [--bs 16]`` (needs ``cc``).
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_kernel import _arena

C_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float exp_neg(float x) {  /* as _paged_kernel: 2^n e^r, Cody-Waite, Taylor 7 */
    const float LOG2E = 1.4426950408889634f, LN2_HI = 0.693145751953125f;
    const float LN2_LO = (float)(0.6931471805599453 - 0.693145751953125);
    if (x < -87.0f) x = -87.0f;
    float n = floorf(x * LOG2E + 0.5f);
    float r = (x - n * LN2_HI) - n * LN2_LO;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f; p = p * r + 1.0f / 120.0f; p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f; p = p * r + 0.5f; p = p * r + 1.0f; p = p * r + 1.0f;
    union { int32_t i; float f; } u; u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

#define JOB_BODY                                                                       \
    int64_t b = jb / nkv, h = jb - b * nkv;                                            \
    int64_t len = ctx[b], nblk = (len + bs - 1) / bs, pe = 2 * bs * d;                 \
    const float *qj = q + (b * nkv + h) * g * d;                                       \
    const int64_t *t = tab + b * ntb * nkv + h;                                        \
    for (int64_t blk = 0; blk < nblk; blk++) {                                         \
        const float *page = kv + t[blk * nkv] * pe;                                    \
        const float *nxt = kv + t[(blk + 1 < nblk ? blk + 1 : blk) * nkv] * pe;        \
        int64_t t0 = blk * bs, rows = len - t0 < bs ? len - t0 : bs;                   \
        for (int64_t r = 0; r < rows; r++) {                                           \
            for (int64_t e = 0; e < d; e += 16) __builtin_prefetch(nxt + r * d + e, 0, 3); \
            const float *kr = page + r * d;                                            \
            for (int64_t j = 0; j < g; j++) {                                          \
                float dot = 0.0f;                                                      \
                for (int64_t e = 0; e < d; e++) dot += qj[j * d + e] * kr[e];          \
                s[j * len + t0 + r] = dot * scale;                                     \
            }                                                                          \
        }                                                                              \
    }                                                                                  \
    for (int64_t j = 0; j < g; j++) {                                                  \
        float *sj = s + j * len, m = sj[0], tot = 0.0f;                                \
        for (int64_t i = 1; i < len; i++) m = sj[i] > m ? sj[i] : m;                   \
        for (int64_t i = 0; i < len; i++) { float x = exp_neg(sj[i] - m); sj[i] = x; tot += x; } \
        float inv = 1.0f / tot;                                                        \
        for (int64_t i = 0; i < len; i++) sj[i] *= inv;                                \
    }                                                                                  \
    float acc[16 * 256];                                                               \
    memset(acc, 0, sizeof(float) * g * d);                                             \
    for (int64_t blk = 0; blk < nblk; blk++) {                                         \
        const float *page = kv + t[blk * nkv] * pe + bs * d;                           \
        const float *nxt = kv + t[(blk + 1 < nblk ? blk + 1 : blk) * nkv] * pe + bs * d; \
        int64_t t0 = blk * bs, rows = len - t0 < bs ? len - t0 : bs;                   \
        for (int64_t r = 0; r < rows; r++) {                                           \
            for (int64_t e = 0; e < d; e += 16) __builtin_prefetch(nxt + r * d + e, 0, 3); \
            const float *vr = page + r * d;                                            \
            for (int64_t j = 0; j < g; j++) {                                          \
                float p = s[j * len + t0 + r];                                         \
                for (int64_t e = 0; e < d; e++) acc[j * d + e] += p * vr[e];           \
            }                                                                          \
        }                                                                              \
    }                                                                                  \
    memcpy(out + (b * nkv + h) * g * d, acc, sizeof(float) * g * d);

#define ARGS const float *restrict q, const float *restrict kv, const int64_t *restrict tab, \
    const int64_t *restrict ctx, float *restrict out, int64_t nkv, int64_t ntb, int64_t bs, \
    float scale, int64_t jb, float *restrict s

static void job_any(ARGS, int64_t g, int64_t d) { JOB_BODY }
static void job_3_64(ARGS) { const int64_t g = 3, d = 64; JOB_BODY }

void decode(const float *q, const float *kv, const int64_t *tab, const int64_t *ctx, float *out,
            int64_t n, int64_t nkv, int64_t g, int64_t ntb, int64_t bs, int64_t d, float scale,
            float *scratch) {
    for (int64_t jb = 0; jb < n * nkv; jb++) {
        if (g == 3 && d == 64) job_3_64(q, kv, tab, ctx, out, nkv, ntb, bs, scale, jb, scratch);
        else job_any(q, kv, tab, ctx, out, nkv, ntb, bs, scale, jb, scratch, g, d);
    }
}
"""


def build(folder: Path) -> ctypes.CDLL:
    """Compile :data:`C_SOURCE` into ``folder`` and load it."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("paged_kernel_c.py needs a C compiler (cc) on PATH")
    src, lib = folder / "paged.c", folder / "paged.so"
    src.write_text(C_SOURCE)
    flags = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-shared"]
    subprocess.run([cc, *flags, "-o", str(lib), str(src)], check=True)
    dll = ctypes.CDLL(str(lib))
    p, i = ctypes.c_void_p, ctypes.c_int64
    dll.decode.argtypes = [p, p, p, p, p, i, i, i, i, i, i, ctypes.c_float, p]
    dll.decode.restype = None
    return dll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--ctx", default="40,600", help="context range in tokens, lo,hi")
    ap.add_argument("--bs", type=int, default=16, help="tokens per page")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from fleetserve.runtime.engine._paged_kernel import decode_serial

    nkv, g, d, bs = 4, 3, 64, args.bs
    lo, hi = (int(x) for x in args.ctx.split(","))
    rng = np.random.default_rng(args.seed)
    ctx = np.sort(rng.integers(lo, hi + 1, args.requests)).astype(np.int64)
    q = rng.standard_normal((args.requests, nkv, g, d), dtype=np.float32)
    rows = int(ctx.sum()) * nkv
    scale = d**-0.5
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(Path(tmp))
        scratch = np.empty(g * int(ctx.max()), np.float32)
        for name, pool in (("cache", 64), ("dram", None)):
            kv, tab = _arena(rng, ctx, nkv, bs, d, pool)
            o_nb, o_c = np.empty_like(q), np.empty_like(q)
            calls = {
                "numba": partial(decode_serial, q, kv, tab, ctx, o_nb, bs, scale, 1),
                "c": partial(
                    dll.decode,
                    *(a.ctypes.data for a in (q, kv, tab, ctx, o_c)),
                    args.requests, nkv, g, tab.shape[1], bs, d, scale, scratch.ctypes.data,
                ),
            }  # fmt: skip
            for fn in calls.values():
                fn()
            diff = float(np.abs(o_nb - o_c).max() / np.abs(o_nb).max())
            times: dict[str, list[float]] = {k: [] for k in calls}
            for _ in range(args.repeats):  # interleaved
                for key, fn in calls.items():
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    times[key].append((time.perf_counter() - t) / args.calls / rows * 1e9)
            med = {k: float(np.median(v)) for k, v in times.items()}
            print(
                f"{name:5s} arena {kv.nbytes / 1e6:5.1f} MB, {bs}-token pages: Numba "
                f"{med['numba']:.1f} ns per KV row, C {med['c']:.1f} "
                f"({med['numba'] / med['c']:.2f}x); outputs differ by {diff:.1e} (relative)"
            )


if __name__ == "__main__":
    main()
