"""The Numba kernel of :mod:`~fleetserve.runtime.engine.paged_cpu` (imported
only when that kernel is used: Numba is the ``runtime`` extra).

``decode_serial`` is cached on disk; ``decode_parallel`` (the ``prange`` over
the jobs run in parallel) is compiled in each process that runs with more than
one thread and not cached, so that the two builds of one Python function never
share a cache entry.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["decode_parallel", "decode_serial"]


def _prefetch_typer(typingctx, arr, page, row, col):  # type: ignore[no-untyped-def]
    """Hint the CPU to fetch the cache line of ``arr[page, row, col]`` (a 3-D
    C array) into every cache level: LLVM's ``llvm.prefetch`` (a read, high
    locality). Nothing is loaded into a register and nothing can fault."""
    sig = types.void(arr, page, row, col)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        idx = [
            context.cast(builder, v, t, types.intp)
            for v, t in zip(args[1:], signature.args[1:], strict=True)
        ]
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, idx, wraparound=False)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


# ``_prefetch(arr, page, row, col)`` in compiled code (Numba drops ``typingctx``)
_prefetch: Any = intrinsic(_prefetch_typer)


# floats per 64-byte cache line: one prefetch per line of a row
_LINE = 16

# exp in the softmax, written so LLVM vectorises it: Numba's np.exp is a call
# to the C library's expf per element (no SVML in llvmlite's wheels); the
# kernel ran 1.08x faster without those calls (benchmarks/paged_kernel.py).
# exp(x) = 2^n * e^r with n the integer nearest x*log2(e) and r = x - n*ln2
# (ln2 split in a high part exact in float32 and a low part, so r keeps its
# bits: Cody and Waite); |r| <= ln2/2, and e^r is its Taylor series to degree
# 7 (truncation error (ln2/2)^8/8! < 6e-9 relative); 2^n is built from its
# exponent bits. Measured against float64 exp on [-87, 0]: 3.0e-7 relative at
# most (2.5 float32 ulp), 1.2e-7 on average. Scores are shifted by their
# maximum, so x <= 0; x is clamped at -87, where e^x is already below
# float32's normal range (such weights are 0 to float32 anyway).
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # 15 significant bits: n * _LN2_HI is exact for |n| < 512
_LN2_LO = np.float32(math.log(2.0) - 0.693145751953125)
_EXP_MIN = np.float32(-87.0)
_EXP_TAYLOR = np.array([1.0 / math.factorial(k) for k in range(8)], dtype=np.float32)


def _job_py(
    q: np.ndarray,  # [n, nkv, g, d] float32
    kv: np.ndarray,  # [pages, page_elems // d, d] float32, C-contiguous: the arena
    tab: np.ndarray,  # [n, ntb, nkv] int64 page of each token-block and KV head
    ctx: np.ndarray,  # [n] int64 tokens each request attends to (new one included)
    out: np.ndarray,  # [n, nkv, g, d] float32
    bs: int,
    scale: float,
    job: int,
) -> None:
    """Job ``job``: request ``job // nkv``, KV head ``job % nkv``."""
    # Indexes are whole rows of ``kv`` (page, row, e) with ``e`` the inner loop:
    # an index computed as ``row * d + e`` would need a negative-index check
    # in the inner loop, which keeps LLVM from vectorising it (measured 3x).
    # Loops run over whole blocks, so no token needs a division for its page.
    # Pages lie anywhere in the arena, so the hardware prefetcher, which
    # follows a stream within a 4 KiB page, misses at every block: each pass
    # prefetches the next block's rows while it computes on this one (1.3x on
    # 64 decodes whose KV is not in cache; two or four blocks ahead did no
    # better, docs/engine-speed.md).
    nkv, g, d = q.shape[1], q.shape[2], q.shape[3]
    b = job // nkv
    h = job - b * nkv
    length = ctx[b]
    scale32 = np.float32(scale)
    nblk = (length + bs - 1) // bs
    s = np.empty((g, length), dtype=np.float32)
    acc = np.zeros((g, d), dtype=np.float32)
    # scores: every query head of this KV head against each key row once
    for blk in range(nblk):
        page = tab[b, blk, h]
        t0 = blk * bs
        nxt = tab[b, blk + 1, h] if blk + 1 < nblk else page
        for r in range(min(bs, length - t0)):  # key rows first in a page
            for e in range(0, d, _LINE):  # the next block's key rows (see above)
                _prefetch(kv, nxt, r, e)
            for j in range(g):
                dot = np.float32(0.0)
                for e in range(d):
                    dot += q[b, h, j, e] * kv[page, r, e]
                s[j, t0 + r] = dot * scale32
    # softmax per query head, in place; exp as 2^n * e^r (see _EXP_TAYLOR)
    two_n = np.empty(length, dtype=np.int32)
    two_n_f = two_n.view(np.float32)
    for j in range(g):
        m = s[j, 0]
        for t in range(1, length):
            if s[j, t] > m:
                m = s[j, t]
        for t in range(length):
            x = max(s[j, t] - m, _EXP_MIN)
            n = np.floor(x * _LOG2E + np.float32(0.5))
            r = (x - n * _LN2_HI) - n * _LN2_LO
            p = _EXP_TAYLOR[7]
            for c in range(6, -1, -1):
                p = p * r + _EXP_TAYLOR[c]
            s[j, t] = p
            two_n[t] = (np.int32(n) + np.int32(127)) << np.int32(23)  # bits of 2^n
        tot = np.float32(0.0)
        for t in range(length):
            x = s[j, t] * two_n_f[t]
            s[j, t] = x
            tot += x
        inv = np.float32(1.0) / tot
        for t in range(length):
            s[j, t] *= inv
    # weighted sum of the value rows, which follow the block's key rows
    for blk in range(nblk):
        page = tab[b, blk, h]
        t0 = blk * bs
        nxt = tab[b, blk + 1, h] if blk + 1 < nblk else page
        for r in range(min(bs, length - t0)):
            for e in range(0, d, _LINE):  # the next block's value rows
                _prefetch(kv, nxt, bs + r, e)
            for j in range(g):
                p = s[j, t0 + r]
                for e in range(d):
                    acc[j, e] += p * kv[page, bs + r, e]
    for j in range(g):
        for e in range(d):
            out[b, h, j, e] = acc[j, e]


def _decode(
    q: np.ndarray,
    kv: np.ndarray,
    tab: np.ndarray,
    ctx: np.ndarray,
    out: np.ndarray,
    bs: int,
    scale: float,
    parts: int,
) -> None:
    """Every (request, KV head) job, dealt round-robin into ``parts`` parts that
    run in parallel (``prange``) in the parallel build. The engine passes its
    decodes sorted by context length, so round-robin parts get equal work
    where contiguous ones would give one thread every long context."""
    jobs = q.shape[0] * q.shape[1]
    for part in prange(parts):
        for job in range(part, jobs, parts):
            _job(q, kv, tab, ctx, out, bs, scale, job)


_job = njit(fastmath=True, nogil=True, cache=True, boundscheck=False)(_job_py)
decode_serial = njit(fastmath=True, nogil=True, cache=True, boundscheck=False)(_decode)
decode_parallel = njit(fastmath=True, nogil=True, parallel=True, boundscheck=False)(_decode)
