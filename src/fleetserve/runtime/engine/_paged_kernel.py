"""The Numba kernel of :mod:`~fleetserve.runtime.engine.paged_cpu` (imported
only when that kernel is used: Numba is the ``runtime`` extra).

``decode_serial`` is cached on disk; ``decode_parallel`` (the ``prange`` over
the jobs run in parallel) is compiled in each process that runs with more than
one thread and not cached, so that the two builds of one Python function never
share a cache entry.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["decode_parallel", "decode_serial"]


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
    nkv, g, d = q.shape[1], q.shape[2], q.shape[3]
    b = job // nkv
    h = job - b * nkv
    length = ctx[b]
    nblk = (length + bs - 1) // bs
    s = np.empty((g, length), dtype=np.float32)
    acc = np.zeros((g, d), dtype=np.float32)
    # scores: every query head of this KV head against each key row once
    for blk in range(nblk):
        page = tab[b, blk, h]
        t0 = blk * bs
        for r in range(min(bs, length - t0)):  # key rows first in a page
            for j in range(g):
                dot = np.float32(0.0)
                for e in range(d):
                    dot += q[b, h, j, e] * kv[page, r, e]
                s[j, t0 + r] = dot * scale
    # softmax per query head, in place
    for j in range(g):
        m = s[j, 0]
        for t in range(1, length):
            if s[j, t] > m:
                m = s[j, t]
        tot = np.float32(0.0)
        for t in range(length):
            x = np.exp(s[j, t] - m)
            s[j, t] = x
            tot += x
        inv = np.float32(1.0) / tot
        for t in range(length):
            s[j, t] *= inv
    # weighted sum of the value rows, which follow the block's key rows
    for blk in range(nblk):
        page = tab[b, blk, h]
        t0 = blk * bs
        for r in range(min(bs, length - t0)):
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
