"""One preallocated arena per engine: head-wise KV blocks and layer weights.

The arena is a single tensor allocated once (``capacity_bytes``, rounded down
to whole pages) and never grown. It is cut into equal **pages**; a page is one
MuxServe *head-wise block*: ``block_size`` tokens of one KV head of one layer,
keys and values::

    arena [num_pages, page_elems]           page_elems = 2 * block_size * head_dim_max
    page p, model m (head_dim d <= head_dim_max):
        kv(m)[p] = arena[p, : 2*block_size*d].view(2, block_size, d)
                          ^ 0 = keys, 1 = values; row t = token (tb * block_size + t)

so models with different layer counts, KV-head counts and head widths share
the pool (a token-block of model m costs ``layers_held * num_kv_heads``
pages). A request's **block table** is ``[token_blocks, num_layers, kv_heads]``
page ids (``-1`` for layers this engine does not hold for it)::

    table[tb, l, h] = page holding tokens [tb*bs, (tb+1)*bs) of layer l, KV head h

A model layer's **weights** can also live in the arena, in a contiguous run of
pages (placed from the top of the arena down; KV pages are handed out lowest
first, so the two grow towards each other). Dropping the layer frees its pages
for KV at once; restoring it needs a contiguous run again — if free pages
suffice but no run is free, the KV pages in the cheapest window are moved
elsewhere (data copied, tables rewritten) first.

Every page is in exactly one state: free, KV of one request, weights of one
region, reserved (an import in progress), or a cached prefix block's.

**Prefix caching** (vLLM's automatic prefix caching): a full token-block of a
request's KV may be *published* under a key (the engine's chain hash of the
model and every token up to the block's end); its pages then belong to the
cache, shared by every request whose table starts with the same keys
(:meth:`KVPool.attach`). A cached block counts its references; one that no
request references stays cached, evictable, and is given back least recently
used first when pages are needed (``num_available`` counts it). A table's
cached blocks are always a prefix of it, and are never written (a request
writes only at positions past its cached tokens). Mutations come as check/commit
pairs (``can_grow``/``grow``, ``can_reserve``/``reserve``); a commit that
would not fit raises :class:`PoolFull` and changes nothing.
:meth:`KVPool.check_integrity` verifies the whole state.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fleetserve.errors import FleetserveError

__all__ = ["KVPool", "PoolFull", "Reservation"]

FREE = -1
WEIGHT = -2
RESERVED = -3
CACHED = -4

CacheKey = tuple[str, int]  # (model, chain hash of the tokens up to the block's end)


class PoolFull(FleetserveError):
    """A commit asked for more pages than are free (call the check first)."""


@dataclass(frozen=True, slots=True)
class _ModelLayout:
    num_layers: int
    kv_heads: int
    head_dim: int


@dataclass(slots=True)
class Reservation:
    """Pages set aside (e.g. for an incoming KV import) but not yet owned."""

    id: int
    pages: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Table:
    model: str
    layers: tuple[int, ...]
    pages: torch.Tensor  # [cap_tb, num_layers, kv_heads] int64, -1 = none
    ntb: int = 0
    cached: list[CacheKey] = field(default_factory=list)  # its first token-blocks' keys


@dataclass(slots=True)
class _Cached:
    """A published token-block: its pages (all layers and heads) and references."""

    pages: torch.Tensor  # [num_layers, kv_heads] int64
    refs: int = 0


class KVPool:
    """The engine's arena: paged head-wise KV blocks and weight regions.

    Args:
        capacity_bytes: arena size; rounded down to whole pages.
        block_size: tokens per block.
        head_dim_max: the widest head of any model the pool will host.
        dtype: element type of KV and weights.
        device: where the arena lives.
    """

    def __init__(
        self,
        capacity_bytes: int,
        block_size: int,
        head_dim_max: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size < 1 or head_dim_max < 1:
            raise ValueError("block_size and head_dim_max must be >= 1")
        self.block_size = block_size
        self.head_dim_max = head_dim_max
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_elems = 2 * block_size * head_dim_max
        self.page_bytes = self.page_elems * torch.empty((), dtype=dtype).element_size()
        self.num_pages = int(capacity_bytes // self.page_bytes)
        if self.num_pages < 1:
            raise ValueError(
                f"arena of {capacity_bytes} bytes holds no page of {self.page_bytes} bytes"
            )
        self.arena = torch.zeros(self.num_pages, self.page_elems, dtype=dtype, device=self.device)
        self.owner = np.full(self.num_pages, FREE, dtype=np.int64)
        self._heap: list[int] = list(range(self.num_pages))
        self.num_free = self.num_pages
        self._models: dict[str, _ModelLayout] = {}
        self._tables: dict[int, _Table] = {}
        self._regions: dict[str, tuple[int, int]] = {}  # key -> (first page, pages)
        self._reservations: dict[int, Reservation] = {}
        self._res_ids = itertools.count()
        self._cache: dict[CacheKey, _Cached] = {}
        self._evictable: OrderedDict[CacheKey, _Cached] = OrderedDict()  # refs 0, LRU first
        self.evictable_pages = 0
        self.cached_pages = 0  # pages of every cached block
        self._kv = 0  # pages requests own (kv_pages, kept without a scan)
        self.evictions = 0  # cached blocks given back

    # ----------------------------------------------------------------- models
    def add_model(self, name: str, num_layers: int, kv_heads: int, head_dim: int) -> None:
        """Declare a model whose KV will live in the pool."""
        if head_dim > self.head_dim_max:
            raise ValueError(
                f"model {name!r}: head_dim {head_dim} > the pool's head_dim_max {self.head_dim_max}"
            )
        self._models[name] = _ModelLayout(num_layers, kv_heads, head_dim)

    def kv(self, model: str) -> torch.Tensor:
        """The arena as model ``model`` sees it: [num_pages, 2, block_size, head_dim]."""
        d = self._models[model].head_dim
        return self.arena[:, : 2 * self.block_size * d].view(self.num_pages, 2, self.block_size, d)

    def pages_per_token_block(self, model: str, n_layers: int | None = None) -> int:
        lay = self._models[model]
        return (lay.num_layers if n_layers is None else n_layers) * lay.kv_heads

    # --------------------------------------------------------------- requests
    def open(self, rid: int, model: str, layers: range | tuple[int, ...] | None = None) -> None:
        """Start an empty block table for request ``rid`` (no pages yet)."""
        if rid in self._tables:
            raise ValueError(f"request {rid} already has a block table")
        if rid < 0:
            raise ValueError("request ids must be >= 0")
        lay = self._models[model]
        held = tuple(range(lay.num_layers)) if layers is None else tuple(sorted(set(layers)))
        if not held or held[0] < 0 or held[-1] >= lay.num_layers:
            raise ValueError(f"request {rid}: layers {held} outside [0, {lay.num_layers})")
        self._tables[rid] = _Table(model, held, _new_table(4, lay.num_layers, lay.kv_heads))

    def has(self, rid: int) -> bool:
        return rid in self._tables

    def layers(self, rid: int) -> tuple[int, ...]:
        return self._tables[rid].layers

    def token_blocks(self, rid: int) -> int:
        return self._tables[rid].ntb

    def capacity_tokens(self, rid: int) -> int:
        """Tokens the request's table can hold now."""
        return self._tables[rid].ntb * self.block_size

    def table(self, rid: int) -> torch.Tensor:
        """The request's block table [token_blocks, num_layers, kv_heads] (a view)."""
        t = self._tables[rid]
        return t.pages[: t.ntb]

    def pages_of(self, rid: int) -> int:
        """KV pages the table of ``rid`` holds."""
        t = self._tables[rid]
        return t.ntb * len(t.layers) * self._models[t.model].kv_heads

    def pages_to_grow(self, rid: int, n_tokens: int) -> int:
        """Pages needed for the table to hold ``n_tokens`` tokens."""
        t = self._tables[rid]
        need = -(-n_tokens // self.block_size) - t.ntb
        return max(0, need) * len(t.layers) * self._models[t.model].kv_heads

    def can_grow(self, rid: int, n_tokens: int) -> bool:
        return self.pages_to_grow(rid, n_tokens) <= self.num_available

    @property
    def num_available(self) -> int:
        """Pages an allocation may take: free ones and evictable cached blocks'."""
        return self.num_free + self.evictable_pages

    def grow(self, rid: int, n_tokens: int) -> None:
        """Extend the table to hold ``n_tokens`` tokens (raises PoolFull, unchanged)."""
        t = self._tables[rid]
        n = self.pages_to_grow(rid, n_tokens)
        if n == 0:
            return
        if n > self.num_available:
            raise PoolFull(f"request {rid}: needs {n} pages, {self.num_available} available")
        self._evict(n)
        new_tb = -(-n_tokens // self.block_size)
        self._ensure_cap(t, new_tb)
        pages = self._take(n, rid)
        lay = self._models[t.model]
        block = torch.tensor(pages, dtype=torch.int64).view(
            new_tb - t.ntb, len(t.layers), lay.kv_heads
        )
        idx = torch.tensor(t.layers, dtype=torch.int64)
        t.pages[t.ntb : new_tb, idx] = block
        t.ntb = new_tb

    def free(self, rid: int) -> int:
        """Return every page of ``rid`` to the pool (its cached blocks lose a
        reference); returns the number of its own pages freed."""
        t = self._tables.pop(rid)
        k = len(t.cached)
        used = t.pages[k : t.ntb]
        pages = used[used >= 0].tolist()
        self._give(pages)
        for key in t.cached:
            self._unref(key)
        return len(pages)

    def drop_layers(self, rid: int, layers: tuple[int, ...] | range) -> int:
        """Free the pages of ``layers`` of ``rid`` (e.g. their KV moved to a peer)."""
        t = self._tables[rid]
        gone = sorted(set(layers) & set(t.layers))
        if not gone:
            return 0
        if len(gone) == len(t.layers):
            raise ValueError(f"request {rid}: cannot drop all its layers (free it instead)")
        if t.cached:
            raise ValueError(f"request {rid}: its prefix-cached blocks are shared; cannot drop")
        idx = torch.tensor(gone, dtype=torch.int64)
        sel = t.pages[: t.ntb, idx]
        pages = sel[sel >= 0].tolist()
        t.pages[:, idx] = -1
        t.layers = tuple(x for x in t.layers if x not in set(gone))
        self._give(pages)
        return len(pages)

    def truncate(self, rid: int, n_tokens: int) -> int:
        """Free whole token-blocks beyond ``n_tokens`` tokens; returns pages freed."""
        t = self._tables[rid]
        keep = -(-n_tokens // self.block_size)
        if keep >= t.ntb:
            return 0
        for key in t.cached[keep:]:
            self._unref(key)
        own = max(keep, len(t.cached))
        del t.cached[keep:]
        sel = t.pages[own : t.ntb]
        pages = sel[sel >= 0].tolist()
        t.pages[keep : t.ntb] = -1
        t.ntb = keep
        self._give(pages)
        return len(pages)

    # ---------------------------------------------------------- prefix cache
    def match(self, model: str, hashes: list[int]) -> list[CacheKey]:
        """The keys of the longest prefix of ``hashes`` cached for ``model``."""
        out = []
        for h in hashes:
            if (model, h) not in self._cache:
                break
            out.append((model, h))
        return out

    def attach(self, rid: int, keys: list[CacheKey]) -> None:
        """Start the (empty) table of ``rid`` with the cached blocks ``keys``."""
        t = self._tables[rid]
        if t.ntb or t.cached:
            raise ValueError(f"request {rid}: cached blocks attach to an empty table only")
        lay = self._models[t.model]
        if len(t.layers) != lay.num_layers:
            raise ValueError(f"request {rid}: a partial-layer table cannot share cached blocks")
        self._ensure_cap(t, len(keys))
        for tb, key in enumerate(keys):
            b = self._cache[key]
            if b.refs == 0:
                del self._evictable[key]
                self.evictable_pages -= int(b.pages.numel())
            b.refs += 1
            t.pages[tb] = b.pages
        t.cached = list(keys)
        t.ntb = len(keys)

    def publish(self, rid: int, hashes: list[int]) -> int:
        """Publish the full token-blocks of ``rid`` after its cached ones, keyed
        ``hashes[i]`` for token-block ``len(cached) + i``: they become cached
        blocks this request references. Stops at a key already cached (that
        block stays the request's own). Returns the blocks published."""
        t = self._tables[rid]
        lay = self._models[t.model]
        if len(t.layers) != lay.num_layers:
            return 0
        n = 0
        for h in hashes:
            tb = len(t.cached)
            key = (t.model, h)
            if tb >= t.ntb or key in self._cache:
                break
            pages = t.pages[tb].clone()
            self.owner[pages.view(-1).numpy()] = CACHED
            self._kv -= int(pages.numel())
            self._cache[key] = _Cached(pages, 1)
            self.cached_pages += int(pages.numel())
            t.cached.append(key)
            n += 1
        return n

    def _unref(self, key: CacheKey) -> None:
        b = self._cache[key]
        b.refs -= 1
        if b.refs == 0:
            self._evictable[key] = b
            self.evictable_pages += int(b.pages.numel())

    def _evict(self, n: int) -> None:
        """Give back least recently used evictable blocks until ``n`` pages are free."""
        while self.num_free < n and self._evictable:
            key, b = self._evictable.popitem(last=False)
            del self._cache[key]
            pages = b.pages.view(-1).tolist()
            self.evictable_pages -= len(pages)
            self.cached_pages -= len(pages)
            self.evictions += 1
            self._give(pages)

    def forget_cached(self, model: str) -> int:
        """Give back every cached block of ``model`` (it is no longer hosted;
        none may be referenced); returns the blocks given back."""
        keys = [k for k in self._cache if k[0] == model]
        for key in keys:
            b = self._cache[key]
            if b.refs:
                raise ValueError(f"cached block of {model!r} still referenced by a request")
            del self._evictable[key]
            del self._cache[key]
            pages = b.pages.view(-1).tolist()
            self.evictable_pages -= len(pages)
            self.cached_pages -= len(pages)
            self._give(pages)
        return len(keys)

    @property
    def cached_blocks(self) -> int:
        return len(self._cache)

    def cached_prefix(self, rid: int) -> int:
        """How many of ``rid``'s first token-blocks are cached blocks."""
        return len(self._tables[rid].cached)

    # ----------------------------------------------------------- reservations
    def can_reserve(self, n_pages: int) -> bool:
        return n_pages <= self.num_available

    def reserve(self, n_pages: int, res: Reservation | None = None) -> Reservation:
        """Set ``n_pages`` pages aside (a new reservation, or more for ``res``)."""
        if n_pages > self.num_available:
            raise PoolFull(f"reservation needs {n_pages} pages, {self.num_available} available")
        self._evict(n_pages)
        if res is None:
            res = Reservation(next(self._res_ids))
            self._reservations[res.id] = res
        elif self._reservations.get(res.id) is not res:
            raise ValueError(f"reservation {res.id} is not open")
        res.pages.extend(self._take(n_pages, RESERVED))
        return res

    def release(self, res: Reservation) -> None:
        """Abort: the reserved pages go back to free."""
        if self._reservations.pop(res.id, None) is None:
            raise ValueError(f"reservation {res.id} is not open")
        self._give(res.pages)
        res.pages = []

    def adopt(
        self,
        res: Reservation,
        rid: int,
        model: str,
        layers: tuple[int, ...] | range,
        n_tokens: int,
        pages: np.ndarray[Any, np.dtype[np.int64]] | None = None,
    ) -> None:
        """Commit a reservation as the block table of a new request ``rid``.

        ``pages``, when given, is ``res.pages`` already as an int64 array (the
        caller's cache; saves the conversion in a migration's stop-and-copy).

        The first ``token_blocks * len(layers) * kv_heads`` reserved pages, in
        table order (token-block, layer, head), become the table; any surplus
        returns to free. Data written into them while reserved is kept.
        """
        if self._reservations.get(res.id) is not res:
            raise ValueError(f"reservation {res.id} is not open")
        self.open(rid, model, layers)
        t = self._tables[rid]
        ntb = -(-n_tokens // self.block_size)
        need = ntb * len(t.layers) * self._models[model].kv_heads
        if need > len(res.pages):
            del self._tables[rid]
            raise PoolFull(f"request {rid}: needs {need} pages, {len(res.pages)} reserved")
        del self._reservations[res.id]
        if pages is None or len(pages) != len(res.pages):
            pages = np.asarray(res.pages, dtype=np.int64)
        else:
            pages = pages.copy()  # the table must not share the caller's array
        used, spare = pages[:need], res.pages[need:]
        res.pages = []
        block = torch.from_numpy(used).view(ntb, len(t.layers), -1)
        if len(t.layers) == self._models[model].num_layers and ntb:
            t.pages = block  # the table is the reserved pages, in order (no copy)
        else:
            self._ensure_cap(t, ntb)
            t.pages[:ntb, torch.tensor(t.layers, dtype=torch.int64)] = block
        t.ntb = ntb
        self.owner[used] = rid
        self._kv += len(used)
        self._give(spare)

    # ---------------------------------------------------------------- weights
    def region_pages(self, numel: int) -> int:
        return -(-numel // self.page_elems)

    def can_alloc_weights(self, numel: int) -> bool:
        return self.region_pages(numel) <= self.num_available

    def alloc_weights(self, key: str, numel: int) -> torch.Tensor:
        """A contiguous flat view of ``numel`` elements for weights ``key``.

        Takes the highest free run of pages that fits; if there is none but
        enough pages are free, the KV pages of the window with the fewest of
        them (and no weights or reservations) are moved elsewhere first.
        """
        if key in self._regions:
            raise ValueError(f"weights {key!r} already allocated")
        n = self.region_pages(numel)
        if n > self.num_available:
            raise PoolFull(f"weights {key!r}: need {n} pages, {self.num_available} available")
        self._evict(self.num_pages)  # cached blocks do not move: give back the unused ones
        start = self._find_window(n)
        self._claim(start, n)
        self._regions[key] = (start, n)
        return self.arena[start : start + n].view(-1)[:numel]

    def free_weights(self, key: str) -> int:
        """Drop weights ``key``: its pages become free for KV at once."""
        start, n = self._regions.pop(key)
        self._give(list(range(start, start + n)))
        return n

    def weight_pages(self) -> int:
        return sum(n for _, n in self._regions.values())

    def _find_window(self, n: int) -> int:
        """Start of the best window of ``n`` pages: free, else fewest KV pages."""
        blocked = (self.owner == WEIGHT) | (self.owner == RESERVED) | (self.owner == CACHED)
        kv = self.owner >= 0
        # windows containing no weight/reserved page, cost = KV pages inside
        b = np.concatenate(([0], np.cumsum(blocked)))
        k = np.concatenate(([0], np.cumsum(kv)))
        starts = np.arange(self.num_pages - n + 1)
        ok = (b[starts + n] - b[starts]) == 0
        if not ok.any():
            raise PoolFull(f"no window of {n} pages without weights or reservations")
        cost = np.where(ok, k[starts + n] - k[starts], np.iinfo(np.int64).max)
        best = cost.min()
        return int(starts[cost == best].max())  # highest such window

    def _claim(self, start: int, n: int) -> None:
        """Mark [start, start + n) as weights, moving its KV pages elsewhere.

        The window's free pages are claimed first (so they cannot be chosen as
        destinations); each KV page inside is then copied to a free page
        outside and its table entry rewritten. ``num_free`` drops by ``n``.
        Enough free pages exist outside: ``num_free >= n`` was checked.
        """
        window = self.owner[start : start + n]
        kv_inside = (np.flatnonzero(window >= 0) + start).tolist()
        window[window == FREE] = WEIGHT  # stale heap entries are skipped by _take
        self.num_free -= n - len(kv_inside)
        dest = self._take(len(kv_inside), RESERVED)
        for src, dst in zip(kv_inside, dest, strict=True):
            rid = int(self.owner[src])
            self.arena[dst] = self.arena[src]
            t = self._tables[rid]
            t.pages[t.pages == src] = dst
            self.owner[dst] = rid  # a request's page moved: the count does not change
            self.owner[src] = WEIGHT

    # ---------------------------------------------------------------- helpers
    def _take(self, n: int, owner: int) -> list[int]:
        """The ``n`` lowest free pages, now owned by ``owner`` (``n <= num_free``).

        Small takes pop the min-heap (stale entries, pages no longer free, are
        skipped). A large take (``n`` at least 1/256 of the arena, e.g. an
        import's reservation) scans ``owner`` once with NumPy instead: the
        same pages, without a heap pop per page; the heap keeps their entries,
        which go stale and are skipped or dropped at the next rebuild.
        """
        own = self.owner
        if owner >= 0:
            self._kv += n
        if n * 256 >= self.num_pages:
            got = np.flatnonzero(own == FREE)[:n]
            own[got] = owner
            self.num_free -= n
            return got.tolist()
        out: list[int] = []
        heap = self._heap
        while len(out) < n:
            p = heapq.heappop(heap)
            if own[p] == FREE:
                own[p] = owner
                out.append(p)
        self.num_free -= n
        return out

    def _give(self, pages: list[int]) -> None:
        if not pages:
            return
        self._kv -= int((self.owner[pages] >= 0).sum())
        self.owner[pages] = FREE
        for p in pages:
            heapq.heappush(self._heap, p)
        self.num_free += len(pages)
        if len(self._heap) > 4 * self.num_pages:  # rebuild: drop stale entries
            self._heap = np.flatnonzero(self.owner == FREE).tolist()
            heapq.heapify(self._heap)

    @staticmethod
    def _ensure_cap(t: _Table, ntb: int) -> None:
        cap = t.pages.shape[0]
        if ntb <= cap:
            return
        new = max(ntb, 2 * cap)
        grown = _new_table(new, *t.pages.shape[1:])
        grown[:cap] = t.pages
        t.pages = grown

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Verify every page is in exactly one state and every table is consistent.

        Raises:
            AssertionError: with what is wrong.
        """
        own = self.owner
        seen = np.zeros(self.num_pages, dtype=bool)
        refs: dict[CacheKey, int] = dict.fromkeys(self._cache, 0)
        for rid, t in self._tables.items():
            lay = self._models[t.model]
            used = t.pages[: t.ntb]
            if t.ntb:
                held = used[:, list(t.layers)]
                assert bool((held >= 0).all()), f"request {rid}: hole in its held layers"
                others = [x for x in range(lay.num_layers) if x not in set(t.layers)]
                if others:
                    assert bool((used[:, others] == -1).all()), f"request {rid}: stray pages"
            assert bool((t.pages[t.ntb :] == -1).all()), f"request {rid}: pages past its end"
            assert len(t.cached) <= t.ntb, f"request {rid}: more cached blocks than blocks"
            for tb, key in enumerate(t.cached):
                assert key in self._cache and key[0] == t.model, f"request {rid}: stale {key}"
                assert bool((used[tb] == self._cache[key].pages).all()), f"request {rid}: {key}"
                refs[key] += 1
            used = used[len(t.cached) :]
            pages = used[used >= 0].numpy()
            assert not seen[pages].any(), f"request {rid}: page shared with another owner"
            assert len(np.unique(pages)) == len(pages), f"request {rid}: page listed twice"
            seen[pages] = True
            assert bool((own[pages] == rid).all()), f"request {rid}: owner array disagrees"
        for ck, b in self._cache.items():
            assert b.refs == refs[ck], f"cached block {ck}: {b.refs} references, {refs[ck]}"
            assert (b.refs == 0) == (ck in self._evictable), f"cached block {ck}: eviction list"
            pages = b.pages.view(-1).numpy()
            assert not seen[pages].any(), f"cached block {ck}: page shared"
            seen[pages] = True
            assert bool((own[pages] == CACHED).all()), f"cached block {ck}: owner"
        assert len(self._evictable) == sum(1 for b in self._cache.values() if b.refs == 0)
        assert self.evictable_pages == sum(int(b.pages.numel()) for b in self._evictable.values())
        assert self.cached_pages == sum(int(b.pages.numel()) for b in self._cache.values())
        for res in self._reservations.values():
            assert not seen[res.pages].any(), f"reservation {res.id}: page shared"
            seen[res.pages] = True
            assert bool((own[res.pages] == RESERVED).all()), f"reservation {res.id}: owner"
        for wkey, (s, n) in self._regions.items():
            assert not seen[s : s + n].any(), f"weights {wkey}: page shared"
            seen[s : s + n] = True
            assert bool((own[s : s + n] == WEIGHT).all()), f"weights {wkey}: owner"
        assert self._kv == int((own >= 0).sum()), f"kv_pages {self._kv} != owned pages"
        free = own == FREE
        assert not (seen & free).any(), "a used page is marked free"
        assert bool((seen | free).all()), "a page is neither free nor owned"
        assert int(free.sum()) == self.num_free, (
            f"num_free {self.num_free} != {int(free.sum())} free pages"
        )
        in_heap = set(self._heap)
        assert all(p in in_heap for p in np.flatnonzero(free).tolist()), "free page not in heap"

    # ------------------------------------------------------------------ sleep
    @property
    def released(self) -> bool:
        """Whether the arena's memory is given back (:meth:`release_arena`)."""
        return self.arena.numel() == 0

    def release_arena(self) -> None:
        """Give the arena's memory back (an inactive GPU holds none). Only an
        empty pool may: no KV, no weights, no reservation."""
        self._evict(self.num_pages)
        if self._tables or self._regions or self._reservations or self._cache:
            raise ValueError("only an empty pool can release its arena")
        self.arena = torch.empty(0, self.page_elems, dtype=self.dtype, device=self.device)

    def acquire_arena(self) -> None:
        """Allocate the arena again after :meth:`release_arena` (zeroed, all pages free)."""
        if not self.released:
            raise ValueError("the arena is allocated")
        self.arena = torch.zeros(
            self.num_pages, self.page_elems, dtype=self.dtype, device=self.device
        )

    # ------------------------------------------------------------------ stats
    @property
    def kv_pages(self) -> int:
        """Pages requests own (a counter; :meth:`check_integrity` checks it)."""
        return self._kv

    def usage(self) -> dict[str, int]:
        """Pages by state (for metrics and tests)."""
        return {
            "pages": self.num_pages,
            "free": self.num_free,
            "kv": self.kv_pages,
            "weights": self.weight_pages(),
            "reserved": sum(len(r.pages) for r in self._reservations.values()),
        }

    def bytes_of(self, pages: int) -> int:
        return pages * self.page_bytes

    @staticmethod
    def pages_for(numel: int, page_elems: int) -> int:
        return math.ceil(numel / page_elems)


def _new_table(*shape: int) -> torch.Tensor:
    """A block table of ``shape`` filled with -1: always a normal tensor,
    also when opened inside inference mode (a buddy stage's forward), since
    the pool rewrites table entries in place outside it (moving KV pages out
    of a window that weights reclaim)."""
    with torch.inference_mode(False):
        return torch.full(shape, -1, dtype=torch.int64)
