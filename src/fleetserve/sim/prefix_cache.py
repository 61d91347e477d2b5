"""Automatic prefix caching of one simulated instance (vLLM's semantics).

A request whose prompt carries prefix-block ids
(:attr:`~fleetserve.workload.request.Request.prefix_blocks`, Mooncake's
``hash_ids``: block ``i`` names the prompt's first ``(i + 1) * H`` tokens) can
share the KV of its leading blocks with other requests of the same model on
the same instance:

* **publish**: the KV blocks a prefill computed for the prompt's *full* prefix
  blocks become cache entries, keyed by the block's id (a partial last block
  is never cached: its id says nothing about the tokens it lacks);
* **hit**: a new (re)prefill looks its leading blocks up, in order, and stops
  at the first miss; the hits are not recomputed and their KV is shared
  (counted once, reference-counted). At least one prompt token is always
  computed (the logits of the last one are needed), so a hit covering the
  whole prompt drops its last block;
* **evict**: an entry no running request references stays cached and counts
  as *free* memory; when the instance needs the memory, the least recently
  released entries go first (entries released together go tail first, as
  vLLM frees a request's blocks in reverse).

Trace blocks onto KV blocks. A trace block holds ``H`` tokens (512), a KV block
``bs`` (16). The entry of trace block ``i`` owns the KV blocks whose *last*
token lies in it — they are fully determined by the tokens up to the end of
block ``i`` — i.e. KV blocks ``j`` with ``floor(i H / bs) <= j < floor((i + 1) H
/ bs)``::

    H = 40, bs = 16:   trace blocks |    h0 (0-39)    |    h1 (40-79)    | h2 ..
                       KV blocks    | k0  | k1  | k2 ....| k3  | k4  | ...
                       entry h0 = k0, k1 (k2 ends in h1); entry h1 = k2, k3, k4

so ``k`` leading hits hold ``floor(k H / bs)`` KV blocks, ``floor(k H / bs) *
bs`` tokens (``k H`` exactly when ``bs`` divides ``H``, as 16 divides 512).
Entries are whole trace blocks: one is hit, published or evicted as a unit.

Memory. The instance's ``used`` counts a request's *private* blocks
(``blocks_for(kv) - seq.shared``) plus every entry some request references,
once; evictable entries are not in ``used``. :meth:`PrefixCache.fit` evicts
until ``used + evictable <= total`` again; the instance calls it wherever
``used`` grows (admission, a reservation, the growth of a finished decode
segment) before anything is looked up, so each eviction happens, in LRU order,
before the next lookup could see the difference: the same entries go as when
evicting at the very iteration that needed the block (macro-steps stay exact).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetserve.sim.seq import Seq

Key = tuple[int, int, int]
"""``(trace block tokens, block index, block id)`` of an entry."""


class Entry:
    """The cached KV blocks of one full trace block."""

    __slots__ = ("blocks", "key", "refs")

    def __init__(self, key: Key, blocks: int) -> None:
        self.key = key
        self.blocks = blocks  # KV blocks it owns (see the module docstring)
        self.refs = 0  # requests referencing it


class PrefixStats:
    """Counters of every prefix cache of one run (shared by its instances).

    Attributes:
        recompute_hit_tokens: tokens found cached by re-prefills (after a
            preemption or a token migration); first prefills are counted on
            the request records (``cached_tokens``).
        published_blocks: KV blocks that became cache entries.
        evicted_blocks: KV blocks of entries evicted.
    """

    __slots__ = ("evicted_blocks", "published_blocks", "recompute_hit_tokens")

    def __init__(self) -> None:
        self.recompute_hit_tokens = 0
        self.published_blocks = 0
        self.evicted_blocks = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name (for ``summary.json``)."""
        return {
            "recompute_hit_tokens": self.recompute_hit_tokens,
            "published_blocks": self.published_blocks,
            "evicted_blocks": self.evicted_blocks,
        }


class PrefixCache:
    """Prefix cache entries of one instance (one model), with LRU eviction.

    Args:
        block_size: tokens per KV block of the instance.
        stats: the run's counters.
    """

    __slots__ = ("bs", "entries", "evictable", "lru", "stats")

    def __init__(self, block_size: int, stats: PrefixStats) -> None:
        self.bs = block_size
        self.stats = stats
        self.entries: dict[Key, Entry] = {}
        self.lru: OrderedDict[Key, Entry] = OrderedDict()  # refs == 0, oldest first
        self.evictable = 0  # KV blocks of the entries in ``lru``

    def lookup(self, seq: Seq, tokens: int) -> tuple[list[Entry], int]:
        """The leading cached blocks of ``seq``'s prompt for a (re)prefill of
        ``tokens`` tokens (prompt + generated).

        Returns:
            The entries hit (a chain from block 0) and the tokens they hold,
            less than ``tokens``.
        """
        ids = seq.hashes
        if ids is None:
            return [], 0
        size = seq.hash_tokens
        full = min(len(ids), seq.prompt_tokens // size)
        get = self.entries.get
        hits: list[Entry] = []
        for i in range(full):
            e = get((size, i, ids[i]))
            if e is None:
                break
            hits.append(e)
        bs = self.bs
        k = len(hits)
        while k and (k * size) // bs * bs >= tokens:  # compute one token at least
            k -= 1
        if k < len(hits):
            del hits[k:]
        return hits, (k * size) // bs * bs

    def acquire(self, hits: Iterable[Entry]) -> int:
        """Reference ``hits`` for a request.

        Returns:
            KV blocks taken back from the evictable entries (they join ``used``).
        """
        revived = 0
        lru = self.lru
        for e in hits:
            if not e.refs:
                del lru[e.key]
                revived += e.blocks
            e.refs += 1
        self.evictable -= revived
        return revived

    def release(self, refs: list[Entry]) -> int:
        """Drop a request's references (its last blocks first).

        Returns:
            KV blocks of the entries nobody references any more (they leave
            ``used`` and become evictable).
        """
        freed = 0
        lru = self.lru
        for e in reversed(refs):
            e.refs -= 1
            if not e.refs:
                lru[e.key] = e
                freed += e.blocks
        self.evictable += freed
        return freed

    def publish(self, seq: Seq, computed: int) -> None:
        """Make the full prompt blocks of ``seq`` whose KV its prefill has
        computed (its first ``computed`` tokens) cache entries it references.

        A block already cached (another request computed it too) stays the
        request's private copy.
        """
        ids = seq.hashes
        refs = seq.refs
        if ids is None or refs is None:
            return
        size = seq.hash_tokens
        bs = self.bs
        full = min(len(ids), seq.prompt_tokens // size)
        i = seq.pub
        entries = self.entries
        while i < full:
            end = ((i + 1) * size) // bs  # KV blocks up to the end of block i
            if end * bs > computed:
                break
            key = (size, i, ids[i])
            if key not in entries:
                e = Entry(key, end - (i * size) // bs)
                e.refs = 1
                entries[key] = e
                refs.append(e)
                seq.shared += e.blocks
                self.stats.published_blocks += e.blocks
            i += 1
        seq.pub = i

    def fit(self, free: int) -> None:
        """Evict least recently released entries until at most ``free`` KV
        blocks are evictable (``free = total - used``, minus growth already
        planned)."""
        if self.evictable <= free:
            return
        lru = self.lru
        entries = self.entries
        evicted = 0
        while self.evictable > free:
            key, e = lru.popitem(last=False)
            del entries[key]
            self.evictable -= e.blocks
            evicted += e.blocks
        self.stats.evicted_blocks += evicted

    def check(self, holders: Iterable[Seq], free: int) -> int:
        """Check the references of ``holders`` (every request that may hold
        any) against the entries; raise AssertionError on any inconsistency.

        Returns:
            KV blocks of the referenced entries (part of the instance's ``used``).
        """
        count: dict[Key, int] = {}
        for s in holders:
            refs = s.refs
            if refs is None:
                assert s.shared == 0, s.id
                continue
            assert len({e.key for e in refs}) == len(refs), s.id
            assert s.shared == sum(e.blocks for e in refs), (s.id, s.shared)
            for e in refs:
                assert self.entries.get(e.key) is e, ("evicted entry referenced", s.id, e.key)
                count[e.key] = count.get(e.key, 0) + 1
        referenced = 0
        for key, e in self.entries.items():
            assert e.key == key and e.blocks > 0
            assert e.refs == count.get(key, 0), (key, e.refs, count.get(key, 0))
            assert (e.refs == 0) == (key in self.lru), ("free and referenced", key)
            if e.refs:
                referenced += e.blocks
        assert all(self.entries.get(k) is e for k, e in self.lru.items())
        assert self.evictable == sum(e.blocks for e in self.lru.values())
        assert 0 <= self.evictable <= free, (self.evictable, free)
        return referenced
