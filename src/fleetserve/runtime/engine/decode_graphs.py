"""Decode steps as CUDA graphs: one replay instead of hundreds of kernel launches.

A step in which every request of one model decodes one token (each has a
cached context and one new token) is the step a serving engine runs most. On a
GPU a small model's step is bound by the host: the engine launches a few
hundred small kernels, builds index tensors and copies block tables for each.
This module runs such a step as a replay of a captured CUDA graph (vLLM does
the same for its decode batches).

**Static shapes.** A graph replays fixed shapes and addresses, so a step is
padded to a bucket: the batch to the next power of two of requests, the block
tables to the next power of two of token-blocks. The inputs are copied into
the bucket's static buffers (token ids, positions, context lengths, block
tables; the tables of all a model's buckets are views of one buffer) before
the replay; the logits come out of a static buffer. One graph
is captured per (model, batch bucket, table bucket) the first time it is
needed, at most ``max_graphs`` per engine (least recently used ones are
dropped), all drawing their activations from one memory pool.

**Padding rows** copy the batch's first request (token, position, table,
context), and write its key and value (``k[src]``, ``src`` mapping every
padding row to row 0) to the same slot: a duplicate index in the write with
bit-identical values, so the page holds what the eager step writes. Their
logits are dropped.

**What the graph computes** is the eager gather path of
:meth:`Engine._attend <fleetserve.runtime.engine.engine.Engine._attend>` for
decodes (:func:`gather_decode`, one function for both), over the whole padded
table with the context as a key mask: the same keys, values and scores, the
masked ones exactly zero after the softmax.

**Invalidation.** A graph holds the addresses of the model's weights and the
arena. The engine drops every graph when a layer is dropped or restored, a
model is loaded or unloaded, or it sleeps or wakes (:meth:`DecodeGraphs.clear`).

``capture=False`` runs the same static, padded step eagerly, on any device:
what a replay computes, checkable on a CPU (the engine's
``decode_graphs="static"``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fleetserve.runtime.engine.model import mlp_residual, out_residual, qkv, rms_norm

__all__ = ["DecodeGraphs", "gather_decode", "gather_kv", "pow2_at_least"]

logger = logging.getLogger(__name__)
_MAX_FAILURES = 3  # capture tries of one bucket before its steps stay eager


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def gather_kv(kv: torch.Tensor, tab: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values [n, nkv, ctx, d] of the pages ``tab`` [n, ntb, nkv]
    names (``kv``: a model's page view [pages, 2, block, d]), each gathered in
    one ``index_select`` (rows: request, head, block)."""
    n, ntb, nkv = tab.shape
    bs, d = kv.shape[2], kv.shape[3]
    flat = tab.transpose(1, 2).reshape(-1)
    shape = (n, nkv, ntb * bs, d)
    keys = kv[:, 0].index_select(0, flat).view(shape)[:, :, :ctx]
    vals = kv[:, 1].index_select(0, flat).view(shape)[:, :, :ctx]
    return keys, vals


def gather_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    tab: torch.Tensor,
    valid: torch.Tensor,
    nh: int,
    nkv: int,
    d: int,
) -> torch.Tensor:
    """Attention of one new token per request over its paged KV, by gathering.

    Args:
        q: [n, nh, d] queries (any layout ``view`` accepts).
        kv: a model's page view [pages, 2, block, d] of the arena.
        tab: [n, ntb, nkv] page ids of each request's token-blocks (padding
            entries may name any page: ``valid`` masks them).
        valid: [n, ctx] True for the keys a query may attend (ctx <= ntb*block).

    The keys and values are gathered (:func:`gather_kv`), then a plain
    matmul-softmax-matmul with the query heads of one KV head side by side
    (measured ~30% faster than CPU SDPA for one query). Returns [n, nh*d].
    """
    n, ctx = tab.shape[0], valid.shape[-1]
    keys, vals = gather_kv(kv, tab, ctx)
    qg = q.reshape(n, nkv, nh // nkv, d)
    sc = torch.matmul(qg, keys.transpose(-1, -2)).mul_(d**-0.5)
    sc.masked_fill_(~valid.view(n, 1, 1, ctx), float("-inf"))
    a = torch.matmul(torch.softmax(sc, dim=-1), vals)
    return a.reshape(n, nh * d)


@dataclass(slots=True)
class _Graph:
    """One bucket's static buffers, its graph (``None`` when run eagerly) and
    its output."""

    ids: torch.Tensor  # [B] int64
    pos: torch.Tensor  # [B] int64: the new token's position (context - 1)
    tab: torch.Tensor  # [B, T, L, nkv] int64 page ids (a view of the model's table buffer)
    src: torch.Tensor  # [B] int64: the row whose K/V each row writes
    graph: Any = None
    logits: torch.Tensor | None = None
    failures: int = 0  # captures that failed (the step then ran eagerly)


def decode_step(m: Any, kv: torch.Tensor, g: _Graph) -> torch.Tensor:
    """One decode step of model ``m`` (the engine's per-model record: cfg,
    embed, layers, norm, lm_head, rotary) on ``g``'s static buffers, writing
    the new tokens' K/V into ``kv``; logits [B, V]."""
    cfg = m.cfg
    s = cfg.spec
    nh, nkv, d = s.num_heads, s.num_kv_heads, s.head_dim
    bs = kv.shape[2]
    n, ntb = g.tab.shape[0], g.tab.shape[1]
    h = F.embedding(g.ids, m.embed)
    cos, sin = m.rotary.cos_sin(g.pos, h.dtype)
    rows = torch.arange(n, device=h.device)
    blk = g.pos // bs
    off = (g.pos % bs)[:, None]
    valid = torch.arange(ntb * bs, device=h.device)[None, :] <= g.pos[:, None]
    for li in range(s.num_layers):
        w = m.layers[li]
        q, k, v = qkv(cfg, w, h, cos, sin)
        tab = g.tab[:, :, li]  # [B, T, nkv]
        page = tab[rows, blk]  # [B, nkv]
        kv[page, 0, off] = k[g.src]
        kv[page, 1, off] = v[g.src]
        a = gather_decode(q, kv, tab, valid, nh, nkv, d)
        h = out_residual(w, a, h)
        h = mlp_residual(cfg, w, h)
    return F.linear(rms_norm(h, m.norm, cfg.rms_norm_eps), m.lm_head)


class DecodeGraphs:
    """An engine's captured decode steps (see the module docstring).

    Args:
        device: the engine's device.
        capture: capture CUDA graphs (a CUDA device); ``False`` runs the
            static padded step eagerly.
        max_graphs: graphs kept at once; the least recently used goes first.
    """

    def __init__(self, device: torch.device, *, capture: bool, max_graphs: int = 48) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.device = device
        self.capture = capture
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple[str, int, int], _Graph] = OrderedDict()
        self._tables: dict[str, torch.Tensor] = {}  # per model: every bucket's tables
        self._pool: Any = None
        self.captured = 0  # graphs captured, cumulative
        self.replays = 0  # steps run as a replay, cumulative
        self.eager_steps = 0  # static steps run eagerly (no graph), cumulative
        self.failed = 0  # captures that failed, cumulative

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Forget every graph (weights or the arena moved), and the table buffers."""
        self._graphs.clear()
        self._tables.clear()

    @torch.inference_mode()
    def run(
        self,
        name: str,
        m: Any,
        kv: torch.Tensor,
        tables: Sequence[torch.Tensor],
        starts: Sequence[int],
        token_ids: Sequence[int],
    ) -> torch.Tensor:
        """Decode one token for each request of model ``name``: ``tables[i]``
        is request i's block table [token_blocks, L, nkv] (``-1`` = none)
        holding at least ``starts[i] + 1`` tokens, ``starts[i]`` its cached
        tokens, ``token_ids[i]`` its new token. Returns logits [n, V]."""
        n = len(starts)
        if n == 0 or len(tables) != n or len(token_ids) != n:
            raise ValueError(
                f"a decode step needs one table, start and token per request "
                f"(got {len(tables)}, {n}, {len(token_ids)})"
            )
        bs = kv.shape[2]
        ntb = -(-(max(starts) + 1) // bs)
        b_pad, t_pad = pow2_at_least(n), pow2_at_least(ntb)
        L, nkv = tables[0].shape[1], tables[0].shape[2]
        tab = torch.zeros((b_pad, t_pad, L, nkv), dtype=torch.int64)
        for i, t in enumerate(tables):
            k = min(t.shape[0], t_pad)
            tab[i, :k] = t[:k]
        tab.clamp_(min=0)
        tab[n:] = tab[0]
        pad = b_pad - n
        pos = torch.tensor([*starts, *[starts[0]] * pad], dtype=torch.int64)
        ids = torch.tensor([*token_ids, *[token_ids[0]] * pad], dtype=torch.int64)
        src = torch.tensor([*range(n), *[0] * pad], dtype=torch.int64)
        g = self._buffers(name, b_pad, t_pad, L, nkv)
        g.ids.copy_(ids, non_blocking=True)
        g.pos.copy_(pos, non_blocking=True)
        g.tab.copy_(tab, non_blocking=True)
        g.src.copy_(src, non_blocking=True)
        if self.capture and g.graph is None and g.failures < _MAX_FAILURES:
            self._try_capture(g, lambda: decode_step(m, kv, g))
        if g.graph is None:
            self.eager_steps += 1
            out = decode_step(m, kv, g)
        else:
            self.replays += 1
            g.graph.replay()
            assert g.logits is not None
            out = g.logits
        # a copy: graphs share one memory pool, the next replay reuses the buffer
        return out[:n].clone()

    def _buffers(self, name: str, b: int, t: int, layers: int, nkv: int) -> _Graph:
        key = (name, b, t)
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            return g
        dev = self.device
        g = _Graph(
            ids=torch.zeros(b, dtype=torch.int64, device=dev),
            pos=torch.zeros(b, dtype=torch.int64, device=dev),
            tab=self._table_view(name, b, t, layers, nkv),
            src=torch.zeros(b, dtype=torch.int64, device=dev),
        )
        self._graphs[key] = g
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return g

    def _table_view(self, name: str, b: int, t: int, layers: int, nkv: int) -> torch.Tensor:
        """Bucket ``(b, t)``'s block tables [b, t, layers, nkv]: a view of one
        buffer per model, shared by all its buckets (a replay reads only its
        own bucket's view, filled just before it). One buffer per bucket
        would hold up to ``max_graphs`` tables of a whole batch, each as
        large as the largest: 0.5 GB for Llama-2-7B's 256 requests of 4,096
        tokens. The buffer grows to the next power of two of elements when a
        larger bucket comes; the model's graphs read the old one, so they go
        (and are captured again as they are needed)."""
        need = b * t * layers * nkv
        flat = self._tables.get(name)
        if flat is None or flat.numel() < need:
            flat = torch.zeros(pow2_at_least(need), dtype=torch.int64, device=self.device)
            self._tables[name] = flat
            for key in [k for k in self._graphs if k[0] == name]:
                del self._graphs[key]
        return flat[:need].view(b, t, layers, nkv)

    def _try_capture(self, g: _Graph, fn: Callable[[], torch.Tensor]) -> None:
        """Capture ``g``; when the capture fails (another thread's work on the
        legacy stream can invalidate it), log it and leave the bucket without
        a graph: its steps run eagerly, and it is tried again at most
        ``_MAX_FAILURES`` times in all."""
        try:
            self._capture(g, fn)
        except RuntimeError as e:
            g.failures += 1
            self.failed += 1
            g.graph = g.logits = None
            logger.warning(
                "decode step capture failed (%d of %d tries), running it eagerly: %s",
                g.failures,
                _MAX_FAILURES,
                e,
            )

    def _capture(self, g: _Graph, fn: Callable[[], torch.Tensor]) -> None:
        """Warm up on a side stream (cuBLAS handles, the allocator), then capture.

        The buffers already hold this step's inputs, so the warm-up runs write
        exactly the K/V the step writes (the replay writes them again, the
        same values to the same slots): no live page gets anything else."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        # A pool lives while a graph captured into it does: once the last one
        # is gone (LRU, a larger table buffer, clear), capturing into its handle
        # again trips an internal assert of the caching allocator (measured on
        # an H100, torch 2.11: every capture after the first buffer growth
        # failed), so a fresh pool is taken then.
        if self._pool is None or not any(o.graph is not None for o in self._graphs.values()):
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another engine thread (remote attention) may use the GPU meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            g.logits = fn()
        g.graph = graph
        self.captured += 1
