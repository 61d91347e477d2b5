"""Decode attention that reads the paged KV arena in place, on the CPU.

The engine's ``gather`` path copies every page of every decoding request into
a padded tensor, then runs dense attention on the copy: each KV byte is read
twice and written once, and padding inside a bucket adds up to 2x more
(docs/engine-speed.md measured it at ~19% of the engine's time). This kernel
reads the head-wise pages where they lie (the layout of
:mod:`~fleetserve.runtime.engine.kvpool`), once, as vLLM's CPU paged-attention
kernel does.

It is compiled with Numba (LLVM, ``fastmath``) when first used; compiled code
is cached beside this file (or in Numba's user cache), so later processes load
it in well under a second. One job is one (request, KV head): the query heads
that share the KV head are scored against its keys together, so each key and
value row is read once for all of them.

Numerics: scores, the softmax and the weighted sum are float32, as in the
gather path, but summed in another order (``fastmath`` lets LLVM reassociate
the dot products into SIMD lanes). Outputs differ from the gather path by
float rounding (~1e-7 relative); the engine's greedy-equality tests against
HF transformers hold on both paths.

Threads: with one torch thread the serial kernel runs, releasing the GIL
(``nogil``), so engines on other Python threads keep running. With more torch
threads, the jobs are split across a Numba parallel loop on a thread-safe
threading layer (OpenMP or TBB); where neither is installed the serial kernel
is used. The choice is made once per process (:func:`threads_note`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["available", "decode_attention", "fits", "threads_note", "warm_up"]

log = logging.getLogger(__name__)
_PROBE = threading.Lock()
_PARALLEL_OK: bool | None = None
_NOTE = ""


def available() -> bool:
    """Numba is installed (the ``engine`` extra), so the kernel can be built."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel(parallel: bool) -> Callable[..., None]:
    """The compiled kernel (Numba compiles, or loads from its cache, on the
    first call)."""
    from fleetserve.runtime.engine import _paged_kernel as pk

    return pk.decode_parallel if parallel else pk.decode_serial


def _parallel_ok() -> bool:
    """Whether a thread-safe Numba threading layer loads here (OpenMP or TBB).

    Numba's fallback ``workqueue`` layer aborts the process when two threads
    enter a parallel region at once, and engines may run on several threads
    (the KunServe pipeline's micro-batches), so it is never used."""
    global _PARALLEL_OK, _NOTE
    if _PARALLEL_OK is not None:  # decided: no lock on the engine's hot path
        return _PARALLEL_OK
    with _PROBE:
        if _PARALLEL_OK is not None:
            return _PARALLEL_OK
        import numba

        numba.config.THREADING_LAYER = "threadsafe"  # type: ignore[attr-defined]
        try:
            _tiny(_kernel(True))
            _NOTE = f"numba parallel, {numba.threading_layer()} layer"
            _PARALLEL_OK = True
        except ValueError as e:  # Numba's "No threading layer could be loaded"
            _NOTE = f"numba serial: no thread-safe threading layer ({e})"
            log.warning("paged decode attention runs on one thread: %s", _NOTE)
            _PARALLEL_OK = False
    return _PARALLEL_OK


def _run(
    kern: Callable[..., None],
    q: torch.Tensor,
    arena: torch.Tensor,
    tab: torch.Tensor,
    ctx: Any,
    bs: int,
    parts: int = 1,
) -> torch.Tensor:
    d = q.shape[-1]
    out = torch.empty_like(q)
    c = np.asarray(ctx, dtype=np.int64)
    kv = arena.view(arena.shape[0], -1, d).numpy()  # rows of d: see _paged_kernel
    kern(q.numpy(), kv, tab.numpy(), c, out.numpy(), bs, 1.0 / math.sqrt(d), parts)
    return out


def fits(page_elems: int, head_dim: int) -> bool:
    """Whether the kernel can read a model of ``head_dim`` from pages of
    ``page_elems`` (it indexes the arena as rows of ``head_dim``)."""
    return page_elems % head_dim == 0


def threads_note() -> str:
    """How the kernel runs with more than one torch thread (for logs)."""
    _parallel_ok()
    return _NOTE


def _tiny(kern: Callable[..., None]) -> None:
    """One call on a one-token context: compiles ``kern`` for the engine's types."""
    tab = torch.zeros(1, 1, 1, dtype=torch.int64)
    _run(kern, torch.zeros(1, 1, 1, 1), torch.zeros(1, 2), tab, [1], 1)


def warm_up() -> None:
    """Compile (or load from the cache) the kernel this process will use."""
    _tiny(_kernel(torch.get_num_threads() > 1 and _parallel_ok()))


def decode_attention(
    q: torch.Tensor,
    arena: torch.Tensor,
    tab: torch.Tensor,
    ctx: Any,
    block_size: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Attention of one new query token per request over its paged KV.

    Args:
        q: [n, num_heads, d] float32 on the CPU; query heads
            ``[k*g, (k+1)*g)`` share KV head ``k`` (grouped-query attention).
        arena: the pool's arena [pages, page_elems] (C-contiguous float32);
            a page holds ``block_size`` key rows of ``d`` then as many value
            rows; ``page_elems`` must be a multiple of ``d`` (:func:`fits`).
        tab: [n, >= ceil(max ctx / block_size), num_kv_heads] int64 pages.
        ctx: [n] tokens each request attends to, the new one included (its K/V
            must already be in the pages).
        block_size: tokens per page.
        num_kv_heads: KV heads.

    Returns:
        [n, num_heads, d].
    """
    n, nh, d = q.shape
    g = nh // num_kv_heads
    threads = torch.get_num_threads()
    parallel = threads > 1 and _parallel_ok()
    qg = q.reshape(n, num_kv_heads, g, d).contiguous()
    parts = threads if parallel else 1
    out = _run(_kernel(parallel), qg, arena, tab.contiguous(), ctx, block_size, parts)
    return out.view(n, nh, d)
