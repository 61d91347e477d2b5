"""Attention over the arena's head-wise pages with FlexAttention: no gather.

The default decode path (:meth:`Engine._attend <fleetserve.runtime.engine.engine.Engine._attend>`)
gathers every request's KV pages into a padded tensor with ``index_select``
and then runs a dense attention: on a GPU that copy costs as much memory
traffic as the attention itself. Here the attention reads the pages where
they lie, with PyTorch's FlexAttention (``torch.nn.attention.flex_attention``)
and a block-sparse mask built from the block tables.

**The arena as one key sequence.** A page holds ``block_size`` keys, then
``block_size`` values, of one (request, layer, KV head), ``head_dim`` wide.
When the model's ``head_dim`` is the arena's widest (always, with one model),
the arena is one ``[num_pages * 2 * block_size, head_dim]`` matrix ``A`` and::

    K = A[: -block_size]     V = A[block_size :]        (views, no copy)

so KV block ``2p`` (blocks of ``block_size`` rows) of ``K`` is page ``p``'s keys
and the same block of ``V`` its values. Every (request, KV head) pair is a
FlexAttention batch entry whose ``g = heads / kv_heads`` query heads share one
key head (GQA); ``K`` and ``V`` have batch 1 and broadcast.

**The block mask** lists, for batch entry (request, KV head), the blocks
``2 * table[tb, layer, head]`` of its token blocks in order: the kernel reads
those pages and no others. FlexAttention defines the result by the mask
function alone (the block list is only what the kernel may skip), so the mask
function is exact on its own: key row ``kv`` of page ``pg = kv // (2*bs)`` at
offset ``o = kv % (2*bs)`` is visible to query row ``i`` of entry ``b`` iff

* ``o < bs`` (a key row, not a value row),
* ``page_seq[pg]`` is entry ``b``'s (request, layer, KV head) id, and
* ``page_tb[pg] * bs + o <= qpos[b, i]`` (causal, by absolute position).

``page_seq``/``page_tb`` are per-page maps over the whole arena, written for
the pages of the batch before its layers run (:meth:`PagedFlex.mark`) and
cleared afterwards, so pages of other requests never match.

**Compiled or not.** On CUDA the call is ``torch.compile``-d: it lowers to one
fused Triton kernel (FlashDecoding for short queries) that visits only the
listed blocks. Without compilation (the CPU, where the gather path is the
default and faster) FlexAttention evaluates the mask over the whole arena:
exact but dense, which the tests use on small arenas to check the layout. The
eager path also wants the block list as wide as the key sequence, so it is
padded there; the compiled kernel takes the compact one.

**Measured on an H100** (torch 2.11, ``benchmarks/flex_probe.py``, bf16,
Llama-2-7B heads, one decode step): the compiled kernel over 16-token pages
moved 235 GB/s where the gather path moved 885 GB/s (64 requests of 2,048
tokens), and building the block mask costs ~130 us per layer on the host, so
the engine keeps ``gather`` as its default. ``full_blocks`` (pages below every
query skip the mask) made the kernel ~1.5x faster there but gave wrong greedy
tokens at batch 1 on CUDA (exact in eager mode): it is off by default until
that is understood (docs/gpu.md).

Where the arena cannot be seen as one matrix (a model narrower than another
in the same engine) or the kernel's shape limits are not met, the engine
keeps the gather path (:func:`flex_supported`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FlexStep", "PagedFlex", "flex_supported"]

_Q_BLOCK = 128  # FlexAttention's query block: one block for decodes and short continuations


def flex_supported(page_elems: int, block_size: int, head_dim: int, device: torch.device) -> str:
    """Why FlexAttention cannot run for this model in this arena ('' when it can)."""
    if page_elems != 2 * block_size * head_dim:
        return f"head_dim {head_dim} is narrower than the arena's pages"
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - torch too old
        return "this torch has no FlexAttention"
    if device.type == "cuda":
        if block_size % 16:
            return f"block_size {block_size} is not a multiple of 16 (the kernel's key tile)"
        if head_dim not in (16, 32, 64, 128, 256):
            return f"head_dim {head_dim} is not a power of two in [16, 256]"
    return ""


@dataclass(frozen=True, slots=True)
class FlexStep:
    """What one batch's FlexAttention calls share across its layers.

    Entry ``e = j * kv_heads + h`` is member ``j`` (batch request ``mem[j]``)
    and KV head ``h``; its queries are the member's new tokens, padded to
    ``q_len`` (padded rows repeat the last position and are discarded).
    """

    mem: torch.Tensor  # [m] batch indices of the members (device)
    rows: torch.Tensor  # [Nm] packed rows of the members' tokens
    g_b: torch.Tensor  # [Nm] member of each row
    g_t: torch.Tensor  # [Nm] query slot of each row
    qpos: torch.Tensor  # [m*kv_heads, q_len] absolute position of each query
    kv_blocks: torch.Tensor  # [m*kv_heads, 1, n_qb] int32 partial token blocks of each entry
    full_blocks: torch.Tensor  # [m*kv_heads, 1, n_qb] int32 token blocks below every query
    part_at: torch.Tensor  # [m*kv_heads, width] index of the k-th partial block in the table
    seq_base: torch.Tensor  # [m*kv_heads] int32 page id of the entry at layer 0
    q_len: int
    width: int  # token blocks of the longest member


class PagedFlex:
    """FlexAttention over one engine's arena (see the module docstring)."""

    def __init__(
        self, arena: torch.Tensor, block_size: int, *, compiled: bool, full_blocks: bool = False
    ) -> None:
        self.arena = arena
        self.bs = block_size
        self.num_pages = arena.shape[0]
        dev = arena.device
        self.page_seq = torch.full((self.num_pages,), -1, dtype=torch.int32, device=dev)
        self.page_tb = torch.zeros(self.num_pages, dtype=torch.int32, device=dev)
        self._marked: torch.Tensor | None = None
        self.compiled = compiled
        self.full_blocks = full_blocks
        self._expand_kv = False  # probe only (benchmarks/flex_probe.py): K/V batch by stride 0
        from torch.nn.attention.flex_attention import flex_attention

        self._fn: Any = (
            torch.compile(flex_attention, fullgraph=True) if compiled else flex_attention
        )

    # ------------------------------------------------------------ page maps
    def mark(self, tables: torch.Tensor, num_layers: int) -> None:
        """Write the page maps for a batch's padded tables ``[B, T, L, H]`` (CPU,
        ``-1`` where there is no page); clears the previous batch's pages."""
        self.clear()
        b, tb, lay, h = (tables >= 0).nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        dev = self.arena.device
        pages = tables[b, tb, lay, h].to(dev, non_blocking=True)
        heads = tables.shape[3]
        ids = ((b * num_layers + lay) * heads + h).to(torch.int32)
        self.page_seq[pages] = ids.to(dev, non_blocking=True)
        self.page_tb[pages] = tb.to(torch.int32).to(dev, non_blocking=True)
        self._marked = pages

    def clear(self) -> None:
        if self._marked is not None:
            self.page_seq[self._marked] = -1
            self._marked = None

    # ------------------------------------------------------------- the step
    def step(
        self,
        members: list[int],
        starts: list[int],
        lens: list[int],
        firsts: list[int],
        kv_heads: int,
        num_layers: int,
    ) -> FlexStep:
        """The per-batch inputs for members (batch indices) with cached context."""
        dev = self.arena.device
        bs = self.bs
        m = len(members)
        q_len = max(lens[i] for i in members)
        mem = torch.tensor(members, dtype=torch.int64)
        ln = torch.tensor([lens[i] for i in members], dtype=torch.int64)
        st = torch.tensor([starts[i] for i in members], dtype=torch.int64)
        fi = torch.tensor([firsts[i] for i in members], dtype=torch.int64)
        g_b = torch.repeat_interleave(torch.arange(m), ln)
        g_t = torch.arange(int(ln.sum())) - (torch.cumsum(ln, 0) - ln)[g_b]
        slot = torch.arange(q_len)[None, :]
        qpos = st[:, None] + torch.minimum(slot, ln[:, None] - 1)  # [m, q_len]
        ntb = -(-(st + ln) // bs)
        # token blocks every query of the member sees whole (none: every block partial)
        full = (st + 1) // bs if self.full_blocks else torch.zeros_like(st)
        n_qb = -(-q_len // _Q_BLOCK)
        ent = torch.arange(kv_heads)
        seq_base = (mem[:, None] * num_layers * kv_heads + ent[None, :]).reshape(-1)
        width = int(ntb.max())

        def per_entry(x: torch.Tensor) -> torch.Tensor:
            out = x.repeat_interleave(kv_heads).to(torch.int32)[:, None, None]
            return out.expand(-1, 1, n_qb).contiguous().to(dev)

        part_at = (full.repeat_interleave(kv_heads)[:, None] + torch.arange(width)).clamp(
            max=width - 1
        )
        return FlexStep(
            mem=mem.to(dev),
            rows=(fi[g_b] + g_t).to(dev),
            g_b=g_b.to(dev),
            g_t=g_t.to(dev),
            qpos=qpos.repeat_interleave(kv_heads, 0).to(dev),
            kv_blocks=per_entry(ntb - full),
            full_blocks=per_entry(full),
            part_at=part_at.to(dev),
            seq_base=seq_base.to(torch.int32).to(dev),
            q_len=q_len,
            width=width,
        )

    def block_mask(self, fs: FlexStep, tab: torch.Tensor, layer: int, head_dim: int) -> Any:
        """The layer's block mask: each entry's pages in token order, as partial
        blocks (the mask function evaluated); with ``full_blocks``, those below
        every query as full blocks (no mask evaluated) and the rest partial."""
        from torch.nn.attention.flex_attention import BlockMask

        bs, hk = self.bs, tab.shape[2]
        e, w = fs.seq_base.numel(), fs.width
        n_qb = fs.kv_blocks.shape[2]
        s_len = self.num_pages * 2 * bs - bs
        idx = (tab[fs.mem, :w].permute(0, 2, 1).reshape(e, w) * 2).to(torch.int32)
        part = idx.gather(1, fs.part_at)
        if not self.compiled:  # eager: the lists as wide as the key sequence
            pad = s_len // bs - w
            idx = torch.nn.functional.pad(idx, (0, pad))
            part = torch.nn.functional.pad(part, (0, pad))
        width = idx.shape[1]
        seq_id = fs.seq_base + layer * hk
        page_seq, page_tb, qpos = self.page_seq, self.page_tb, fs.qpos

        def visible(b: Any, h: Any, qi: Any, kv: Any) -> Any:
            pg = kv // (2 * bs)
            off = kv % (2 * bs)
            return (
                (off < bs) & (page_seq[pg] == seq_id[b]) & (page_tb[pg] * bs + off <= qpos[b, qi])
            )

        return BlockMask.from_kv_blocks(
            fs.kv_blocks,
            part[:, None, None].expand(e, 1, n_qb, width),
            fs.full_blocks,
            idx[:, None, None].expand(e, 1, n_qb, width),
            BLOCK_SIZE=(_Q_BLOCK, bs),
            mask_mod=visible,
            seq_lengths=(fs.q_len, s_len),
            compute_q_blocks=False,
        )

    def run(
        self, fs: FlexStep, mask: Any, q: torch.Tensor, heads: int, kv_heads: int, head_dim: int
    ) -> torch.Tensor:
        """The attention kernel of the members' rows under ``mask``: [Nm, heads*head_dim]."""
        bs, d, hk = self.bs, head_dim, kv_heads
        g = heads // hk
        m, q_len = fs.mem.numel(), fs.q_len
        e = m * hk
        a2 = self.arena.view(-1, d)  # [num_pages * 2 * bs, d]
        keys, vals = a2[:-bs][None, None], a2[bs:][None, None]
        if q_len == 1:
            qp = q[fs.rows].reshape(m, hk, g, 1, d).reshape(e, g, 1, d)
        else:
            pad = q.new_zeros(m, q_len, heads, d)
            pad[fs.g_b, fs.g_t] = q[fs.rows].view(-1, heads, d)
            qp = pad.view(m, q_len, hk, g, d).permute(0, 2, 3, 1, 4).reshape(e, g, q_len, d)
        if self._expand_kv:
            keys, vals = keys.expand(e, -1, -1, -1), vals.expand(e, -1, -1, -1)
        opts = {"BLOCK_N": min(bs, 128)} if self.compiled else None
        o = self._fn(qp, keys, vals, block_mask=mask, enable_gqa=True, kernel_options=opts)
        o = o.view(m, hk, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(m, q_len, heads * d)
        return o[fs.g_b, fs.g_t]

    def attend(
        self,
        fs: FlexStep,
        tab: torch.Tensor,
        layer: int,
        q: torch.Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
    ) -> torch.Tensor:
        """Attention of the members' rows for ``layer``: [Nm, heads*head_dim].

        ``tab`` is the layer's clamped device tables [B, T, kv_heads]; the new
        tokens' K/V must already be in their pages.
        """
        mask = self.block_mask(fs, tab, layer, head_dim)
        return self.run(fs, mask, q, heads, kv_heads, head_dim)
