"""Per-model indexes of instances, so dispatch costs grow with work, not with the cluster.

The dispatch policies (:mod:`fleetserve.policy.dispatch`) pick among a model's
instances by their available KV blocks: Best-Fit the least that is enough,
Worst-Fit the most, round-robin the next in activation order that has room,
least-loaded the least loaded that has room. A scan reads every instance per
arrival. A :class:`ModelIndex` answers the same questions with the same
answers (same instance, same ties) reading only a few.

Bounds instead of values. An instance's ``available_blocks`` is an "as of
now" view: while it decodes a macro-step segment its blocks grow with
virtual time, with no event. So an index cannot hold the value itself. It
holds, per instance, the bounds :meth:`TrackedView.avail_bounds` gave when the
instance last reported a change::

    lo <= available_blocks(t) <= hi     for every t until the next change report,
    and available_blocks(t) never increases in that time

(``hi`` is the value at the report, ``lo`` the value at the end of the segment
in flight; an instance that does not decode has ``lo == hi``). A query reads
the exact value of an instance only when its bounds cannot decide, and then
lowers its known upper bound ``cur`` to that value ("tightening", valid
because the value never increases until the next report and the clock never
goes back), so the next queries skip it without reading it. Worst-Fit, which
walks the entries by upper bound, also refiles the entry under it.

Instances report changes by writing themselves into a log (a dict by id) the
index drains before each query (:meth:`ModelIndex.refresh`), so an instance
that changed many times between two queries costs one update.

Structures (each built on first use, so a run pays only for the policy it uses):

- ``by_hi``: entries sorted by ``(hi, pos)`` in blocks, each block knowing the
  least ``lo`` of its entries. Best-Fit walks upward from ``hi >= need`` and
  skips every block whose least ``lo`` exceeds the best value found (none of
  its entries can be smaller); Worst-Fit walks downward and stops below the
  best value found.
- ``by_pos``: entries in activation order (the ``instances_of`` order), blocks
  knowing their greatest ``hi``: round-robin skips blocks where nothing can fit.
- ``by_load``: entries sorted by ``(running + waiting, id)``, blocks knowing
  their greatest ``hi``: least-loaded takes the first that fits.

Blocks hold at most ``2 * BLOCK`` entries, so an update costs a bisection and a
short list insert, and a query visits ``O(n / BLOCK)`` block summaries plus the
entries it cannot rule out: those whose bounds straddle the request's need and
those that could beat the best found. That is not a worst-case bound, but it
is exact, and in practice a few dozen entries out of thousands.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetserve.cluster.state import TrackedView

BLOCK = 32
"""Half the largest block of a sorted structure."""


class Entry:
    """What an index knows of one instance (see the module docstring)."""

    __slots__ = ("cur", "hi", "id", "lo", "load", "pos", "view")

    def __init__(self, view: TrackedView, pos: int) -> None:
        self.view = view
        self.id = view.id
        self.pos = pos  # activation order among the model's instances
        self.lo, self.hi = view.avail_bounds()
        self.cur = self.hi  # the least upper bound known: lo <= available <= cur <= hi
        self.load = view.num_running + view.num_waiting

    def __repr__(self) -> str:
        return (
            f"Entry(id={self.id}, pos={self.pos}, lo={self.lo}, cur={self.cur}, "
            f"hi={self.hi}, load={self.load})"
        )


class _Blocks:
    """Entries sorted by key, in consecutive blocks of at most ``2 * BLOCK``,
    with one aggregate per block (None: to recompute)."""

    __slots__ = ("agg", "ents", "keys", "last")

    def __init__(self, items: Iterable[tuple[Any, Entry]] = ()) -> None:
        self.keys: list[list[Any]] = []
        self.ents: list[list[Entry]] = []
        self.last: list[Any] = []  # last key of each block
        self.agg: list[int | None] = []
        pairs = sorted(items, key=lambda p: p[0])
        for lo in range(0, len(pairs), BLOCK):
            chunk = pairs[lo : lo + BLOCK]
            self.keys.append([k for k, _ in chunk])
            self.ents.append([e for _, e in chunk])
            self.last.append(chunk[-1][0])
            self.agg.append(None)

    # Aggregate of one entry and of a block; subclasses choose.
    def _of(self, e: Entry) -> int:
        raise NotImplementedError

    def _fold(self, a: int, v: int) -> int:
        raise NotImplementedError

    def _compute(self, es: list[Entry]) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        return sum(len(k) for k in self.keys)

    def aggregate(self, b: int) -> int:
        """The aggregate of block ``b``."""
        a = self.agg[b]
        if a is None:
            a = self.agg[b] = self._compute(self.ents[b])
        return a

    def _block(self, key: Any) -> int:
        b = bisect_left(self.last, key)
        return b if b < len(self.last) else len(self.last) - 1

    def insert(self, key: Any, e: Entry) -> None:
        """Add ``e`` under ``key`` (keys are unique)."""
        if not self.keys:
            self.keys.append([key])
            self.ents.append([e])
            self.last.append(key)
            self.agg.append(self._of(e))
            return
        b = self._block(key)
        ks = self.keys[b]
        i = bisect_left(ks, key)
        ks.insert(i, key)
        self.ents[b].insert(i, e)
        if i == len(ks) - 1:
            self.last[b] = key
        a = self.agg[b]
        if a is not None:
            self.agg[b] = self._fold(a, self._of(e))
        if len(ks) > 2 * BLOCK:
            h = len(ks) // 2
            es = self.ents[b]
            self.keys[b : b + 1] = [ks[:h], ks[h:]]
            self.ents[b : b + 1] = [es[:h], es[h:]]
            self.last[b : b + 1] = [ks[h - 1], ks[-1]]
            self.agg[b : b + 1] = [None, None]

    def remove(self, key: Any, e: Entry) -> None:
        """Remove ``e``, filed under ``key`` with its current fields."""
        b = self._block(key)
        ks = self.keys[b]
        i = bisect_left(ks, key)
        if i == len(ks) or ks[i] != key:
            raise KeyError(key)
        del ks[i]
        del self.ents[b][i]
        if not ks:
            del self.keys[b], self.ents[b], self.last[b], self.agg[b]
            return
        self.last[b] = ks[-1]
        if self.agg[b] == self._of(e):
            self.agg[b] = None
        if len(ks) < BLOCK // 2 and len(self.keys) > 1:  # merge with a neighbour
            c = b if b + 1 < len(self.keys) else b - 1
            self.keys[c : c + 2] = [self.keys[c] + self.keys[c + 1]]
            self.ents[c : c + 2] = [self.ents[c] + self.ents[c + 1]]
            self.last[c : c + 2] = [self.last[c + 1]]
            self.agg[c : c + 2] = [None]
            if len(self.keys[c]) > 2 * BLOCK:  # split again, evenly
                ks, es = self.keys[c], self.ents[c]
                h = len(ks) // 2
                self.keys[c : c + 1] = [ks[:h], ks[h:]]
                self.ents[c : c + 1] = [es[:h], es[h:]]
                self.last[c : c + 1] = [ks[h - 1], ks[-1]]
                self.agg[c : c + 1] = [None, None]

    def changed(self, key: Any, old: int, new: int) -> None:
        """The aggregated field of the entry filed under ``key`` went from ``old`` to ``new``."""
        b = self._block(key)
        a = self.agg[b]
        if a is None:
            return
        f = self._fold(a, new)
        if f != a:
            self.agg[b] = f
        elif old == a and new != old:
            self.agg[b] = None

    def check(self, key_of: Any) -> None:
        """Raise AssertionError unless sorted, keyed as ``key_of`` says, aggregates right."""
        flat = [k for ks in self.keys for k in ks]
        assert flat == sorted(flat) and len(set(map(repr, flat))) == len(flat)
        for b, (ks, es) in enumerate(zip(self.keys, self.ents, strict=True)):
            assert ks and len(ks) == len(es) <= 2 * BLOCK and self.last[b] == ks[-1]
            assert ks == [key_of(e) for e in es]
            a = self.agg[b]
            assert a is None or a == self._compute(es), (b, a)


class _MinLo(_Blocks):
    __slots__ = ()

    def _of(self, e: Entry) -> int:
        return e.lo

    def _fold(self, a: int, v: int) -> int:
        return v if v < a else a

    def _compute(self, es: list[Entry]) -> int:
        return min(e.lo for e in es)


class _MaxHi(_Blocks):
    __slots__ = ()

    def _of(self, e: Entry) -> int:
        return e.hi

    def _fold(self, a: int, v: int) -> int:
        return v if v > a else a

    def _compute(self, es: list[Entry]) -> int:
        return max(e.hi for e in es)


def _hi_key(e: Entry) -> tuple[int, int]:
    return (e.hi, e.pos)


def _load_key(e: Entry) -> tuple[int, int]:
    return (e.load, e.id)


def _pos_key(e: Entry) -> int:
    return e.pos


class ModelIndex:
    """The indexes of one model's instances (see the module docstring).

    Args:
        views: the model's instances, in activation order.
    """

    __slots__ = ("block_size", "by_hi", "by_load", "by_pos", "entries", "next_pos", "uniform")

    def __init__(self, views: Iterable[TrackedView]) -> None:
        self.entries: dict[int, Entry] = {}
        self.block_size = 0  # tokens per block of its instances (all alike: ``uniform``)
        self.uniform = True
        self.by_hi: _MinLo | None = None
        self.by_pos: _MaxHi | None = None
        self.by_load: _MaxHi | None = None
        self.next_pos = 0
        for v in views:
            self.add(v)

    def __len__(self) -> int:
        return len(self.entries)

    # ------------------------------------------------------------ updates
    def add(self, view: TrackedView) -> None:
        """Index a newly active instance (it comes last in activation order)."""
        e = Entry(view, self.next_pos)
        self.next_pos += 1
        if not self.entries:
            self.block_size = view.block_size
        elif view.block_size != self.block_size:
            self.uniform = False
        self.entries[e.id] = e
        if self.by_hi is not None:
            self.by_hi.insert(_hi_key(e), e)
        if self.by_pos is not None:
            self.by_pos.insert(e.pos, e)
        if self.by_load is not None:
            self.by_load.insert(_load_key(e), e)

    def remove(self, instance_id: int) -> None:
        """Forget a released instance."""
        e = self.entries.pop(instance_id)
        if self.by_hi is not None:
            self.by_hi.remove(_hi_key(e), e)
        if self.by_pos is not None:
            self.by_pos.remove(e.pos, e)
        if self.by_load is not None:
            self.by_load.remove(_load_key(e), e)

    def refresh(self, view: TrackedView) -> None:
        """Re-read an instance that reported a change."""
        e = self.entries[view.id]
        lo, hi = view.avail_bounds()
        self._move(e, lo, hi, view.num_running + view.num_waiting)

    def _move(self, e: Entry, lo: int, hi: int, load: int) -> None:
        e.cur = hi
        if lo == e.lo and hi == e.hi and load == e.load:
            return
        by_hi, by_load = self.by_hi, self.by_load
        if by_hi is not None:
            by_hi.remove((e.hi, e.pos), e)
        if by_load is not None:
            by_load.remove((e.load, e.id), e)
        old_hi = e.hi
        e.lo, e.hi, e.load = lo, hi, load
        if by_hi is not None:
            by_hi.insert((hi, e.pos), e)
        if by_load is not None:
            by_load.insert((load, e.id), e)
        if self.by_pos is not None and hi != old_hi:
            self.by_pos.changed(e.pos, old_hi, hi)

    def _tighten(self, seen: list[tuple[Entry, int]], refile: bool = False) -> None:
        """Lower the upper bound of entries whose exact value a query read: the
        ``cur`` field only (cheap; the filters read it), or with ``refile`` also
        ``hi``, which moves the entry in the structures (Worst-Fit walks by it)."""
        for e, a in seen:
            if a < e.cur:
                e.cur = a
            if refile and a < e.hi:
                self._move(e, e.lo, a, e.load)

    # ---------------------------------------------------------- structures
    def _hi(self) -> _MinLo:
        s = self.by_hi
        if s is None:
            s = self.by_hi = _MinLo((_hi_key(e), e) for e in self.entries.values())
        return s

    def _pos(self) -> _MaxHi:
        s = self.by_pos
        if s is None:
            s = self.by_pos = _MaxHi((e.pos, e) for e in self.entries.values())
        return s

    def _load(self) -> _MaxHi:
        s = self.by_load
        if s is None:
            s = self.by_load = _MaxHi((_load_key(e), e) for e in self.entries.values())
        return s

    # ------------------------------------------------------------- queries
    def best_fit(self, need: int) -> TrackedView | None:
        """The instance with the least available blocks ``>= need``; ties: the
        earliest activated. None when none has ``need``."""
        s = self._hi()
        keys, ents = s.keys, s.ents
        nb = len(keys)
        b = bisect_left(s.last, (need, -1))
        if b == nb:
            return None
        i = bisect_left(keys[b], (need, -1))
        best: Entry | None = None
        best_a = best_pos = 0
        seen: list[tuple[Entry, int]] = []
        while b < nb:
            if best is None or s.aggregate(b) <= best_a:
                es = ents[b]
                for j in range(i, len(es)):
                    e = es[j]
                    cur = e.cur
                    if cur < need:
                        continue
                    lo = e.lo
                    if best is not None and lo > best_a:
                        continue
                    if lo == cur:
                        a = lo
                    else:
                        a = e.view.available_blocks
                        seen.append((e, a))
                    if a >= need and (
                        best is None or a < best_a or (a == best_a and e.pos < best_pos)
                    ):
                        best, best_a, best_pos = e, a, e.pos
            b += 1
            i = 0
        self._tighten(seen)
        return None if best is None else best.view

    def most_available(self) -> TrackedView | None:
        """The instance with the most available blocks; ties: the earliest activated."""
        s = self._hi()
        keys, ents = s.keys, s.ents
        best: Entry | None = None
        best_a = best_pos = 0
        seen: list[tuple[Entry, int]] = []
        for b in range(len(keys) - 1, -1, -1):
            if best is not None and keys[b][-1][0] < best_a:
                break
            es = ents[b]
            done = False
            for j in range(len(es) - 1, -1, -1):
                e = es[j]
                if best is not None:
                    if e.hi < best_a:
                        done = True
                        break
                    if e.cur < best_a:
                        continue
                cur = e.cur
                if e.lo == cur:
                    a = cur
                else:
                    a = e.view.available_blocks
                    seen.append((e, a))
                if best is None or a > best_a or (a == best_a and e.pos < best_pos):
                    best, best_a, best_pos = e, a, e.pos
            if done:
                break
        self._tighten(seen, refile=True)
        return None if best is None else best.view

    def nth(self, rank: int) -> TrackedView:
        """The instance at ``rank`` in activation order (``instances_of(model)[rank]``)."""
        ents = self._pos().ents
        b = 0
        while rank >= len(ents[b]):
            rank -= len(ents[b])
            b += 1
        return ents[b][rank].view

    def first_fit(self, need: int, start: int) -> tuple[TrackedView, int] | None:
        """Round-robin: the first instance at or after rank ``start`` in activation
        order, cyclically, with ``need`` available blocks, and its rank; None if none."""
        s = self._pos()
        ents = s.ents
        b, r = 0, start
        while r >= len(ents[b]):
            r -= len(ents[b])
            b += 1
        seen: list[tuple[Entry, int]] = []
        got = self._first(s, need, b, r, len(ents), start, seen)
        if got is None and start:
            got = self._first(s, need, 0, 0, b + 1, 0, seen, stop=(b, r))
        self._tighten(seen)
        return None if got is None else (got[0].view, got[1])

    def least_loaded(self, need: int) -> TrackedView | None:
        """Fewest running + waiting among instances with ``need`` available
        blocks; ties: lowest id. None if none has room."""
        s = self._load()
        seen: list[tuple[Entry, int]] = []
        got = self._first(s, need, 0, 0, len(s.ents), 0, seen)
        self._tighten(seen)
        return None if got is None else got[0].view

    def least_loaded_any(self) -> TrackedView | None:
        """Fewest running + waiting (ties: lowest id), room or not."""
        s = self._load()
        return s.ents[0][0].view if s.ents else None

    @staticmethod
    def _first(
        s: _MaxHi,
        need: int,
        b: int,
        i: int,
        b_end: int,
        rank: int,
        seen: list[tuple[Entry, int]],
        stop: tuple[int, int] | None = None,
    ) -> tuple[Entry, int] | None:
        """The first entry from position ``(b, i)`` (whose rank is ``rank``) up
        to block ``b_end`` (excluded) or position ``stop`` (excluded) with
        ``need`` available blocks, and its rank."""
        ents = s.ents
        while b < b_end:
            es = ents[b]
            n = len(es) if stop is None or b != stop[0] else stop[1]
            if s.aggregate(b) >= need:
                for j in range(i, n):
                    e = es[j]
                    if e.cur < need:
                        continue
                    if e.lo < need:
                        a = e.view.available_blocks
                        seen.append((e, a))
                        if a < need:
                            continue
                    return e, rank + j - i
            rank += len(es) - i
            b += 1
            i = 0
        return None

    # ----------------------------------------------------------- integrity
    def check(self) -> None:
        """Raise AssertionError if an entry's bounds do not hold now, or a
        structure is out of order or out of date (call after a refresh)."""
        order = sorted(self.entries.values(), key=lambda e: e.pos)
        for e in order:
            a = e.view.available_blocks
            assert e.lo <= a <= e.cur <= e.hi, (e, a)
            assert e.load == e.view.num_running + e.view.num_waiting, e
        for s, key_of in (
            (self.by_hi, _hi_key),
            (self.by_pos, _pos_key),
            (self.by_load, _load_key),
        ):
            if s is not None:
                s.check(key_of)
                assert sorted(e.id for es in s.ents for e in es) == sorted(self.entries)
