"""Mell's online KV-cache scheduling (§VI-C, Fig. 10, Algorithm 1; analysis §VII).

The packer is the pure algorithm: GPUs are bins of KV capacity ``C`` (an
integer, here KV blocks), requests are items whose size ``S_i`` grows. It
keeps the allocation near-optimal with three operations and reports the
moves (migrations) each one causes; the policy adapter
(:mod:`fleetserve.policy.mell.scheduler`) turns them into actions.

Classes of a request of size ``s`` (integer arithmetic, so no rounding)::

    L  (C/2, C]    M  (C/3, C/2]    S  (C/4, C/3]    T  (C/8, C/4]    X  (0, C/8]

``X`` ("tiny") requests are grouped into *multi-items* of size (C/8, C/4]
that act as T-items: on each GPU the tiny requests, in arrival order, are
cut greedily into groups whose size first exceeds C/8 (so a group is at most
C/4); the remainder (at most C/8) is the GPU's one open group. Groups are
formed when T-content is moved or counted, which costs no migration since
all members sit on one GPU. A *T-unit* is a T-request or such a group; a
move of a T-unit counts as **one item move** (the unit of Theorem 3) and as
one request move per member (reported separately).

A GPU's category is its largest class (L, M, S, T; tiny counts as T).
"Most recently activated" is the highest activation number (bin id) among
live GPUs of that category.

Operations (Fig. 10), with the details the figure leaves open:

* ``allocate(i)``
  - T/X: the L-GPU with room and the highest priority (or an M-GPU under
    3C/4 whose T-content stays within C/4, property 5); else the most
    recently activated T-GPU if it has room; else a new GPU.
  - S/M: the L-GPU without S/M with ``S_L + S_i <= C`` (the figure writes
    ``<``; constraint (2) allows equality) and the highest priority, then
    its T-units are departed and re-allocated; else the most recently
    activated S-GPU (for S; it holds at most 3) or M-GPU (for M; at most 2)
    if it has room; else a new GPU.
  - L: a new GPU; then an S/M-request that fits moves in from an S/M-GPU
    (*pull*, below); the GPU it left is refilled with a request of the same
    class from the most recently activated GPU of that class.
* ``depart(i)`` on GPU j
  - j is the most recently activated GPU overall: just remove i (the repair
    pass still applies, e.g. an M left behind by a departed L goes to an
    L-GPU it fits, property 4).
  - T/X: refill j with T-units from the most recently activated T-GPU while
    j is under 3C/4 and a unit fits (the figure's "move a T-request ... to
    fit in j").
  - S/M from an S- or M-GPU: a request of the same class moves in from the
    most recently activated GPU of that class; T-units in j are re-allocated.
  - S/M from an L-GPU: pull an S/M-request as in ``allocate`` of an L.
  - L: every other request in j is re-allocated.
* ``update(i)`` (size change)
  - X -> T: stays (it leaves its multi-item).
  - to S or M from X/T/S, to L from X/T/S, and M -> L on an L-GPU: "depart
    i and re-allocate i" -- i leaves j and is allocated as its new class
    first; the refills Depart would do on j are left to the repair pass,
    which does the same (j is touched) but sees where i went (i may land on
    j again, and no T-unit is pulled into j for i's sake).
  - M -> L on an M-GPU: if j overflows, depart and re-allocate all other
    requests in j.
  - growth within a class that overflows j: of the L-request (the figure's
    L -> L) -- re-allocate all other requests in j; of any other request
    (any GPU) -- re-allocate T-units, largest first, then the smaller S/M
    requests, until j fits (the fewest moves; re-allocating an L-GPU's S/M
    for a T-unit's growth would cost a pull and its refills for nothing).
  - (not in Mell's model, for robustness) a shrink to a lower class departs
    and re-allocates i; an S/M shrinking within its class on an S/M-GPU
    moves to an L-GPU it now fits (property 4).

*Pull* (an L-GPU without S/M takes one): among the S/M-requests on S/M-GPUs
that fit, those on the most recently activated S- or M-GPU come first, then
the highest GPU-to-GPU priority (Fig. 10: "the highest priority for GPU
j"). The most recent GPU of a category is exempt, so taking from it needs
no refill: one migration instead of a chain of refills.

After every operation a *repair* pass restores the properties of Theorem 1
on the GPUs the operation touched and on the GPU that was the most recent
of each category before (what the figure does case by case, made uniform
so growth and category changes are covered). A GPU changed again after its
repair (a later repair pulled from it) is repaired again. Two phases:

1. S/M/L structure (properties 1, 2, 4), GPUs that just became S/M-GPUs
   first (their S/M go to L-GPUs they fit, as ``allocate`` would place
   them, before another GPU refills from them), then by category, L first:
   an S-GPU with fewer than three S (M-GPU with fewer than two M) pulls from
   the most recently activated S-GPU (M-GPU); an L-GPU without S/M pulls
   one; an M-GPU keeps one T-unit of T-content (at most C/4).
2. T-content (properties 3 and 5): a T-GPU under 3C/4 pulls T-units from
   the most recently activated T-GPU, or, if it just became a T-GPU and
   either an L/M-GPU that is not the most recent of its category is under
   3C/4 or it holds at most two units, is dissolved: its units move to
   L-GPUs with room, M-GPUs under 3C/4, the most recent T-GPU or another
   T-GPU with room -- all of them or none (a partial dissolve would be
   paid again by the refill); L-GPUs and M-GPUs with two M under 3C/4 pull
   T-units while T-GPUs exist, including GPUs the operation did not touch
   (when it created the first T-GPU, property 5 covers every L/M-GPU). The
   most recent M-GPU with one M pulls none (it is exempt, and one M plus
   C/4 of T-content cannot reach 3C/4 anyway).

T-units displaced in phase 1 or by the operation itself (the "depart and
re-allocate" of T-units when an S/M joins a GPU) are *lifted* -- taken off
their GPU into the operation's buffer -- and re-allocated between the two
phases, largest first. Just before, GPUs that became T-GPUs under 3C/4 are
dissolved if they can be (as in phase 2; first, so that the landing units
do not take the room their units need). The units land first on a T-GPU
under 3C/4 that phase 2 refills anyway (not the most recent one, and not
one that can still be dissolved), else as ``allocate`` places a
T-unit, except that before a new GPU is opened for it any T-GPU with room
takes it (the fullest that fits; it only gets fuller, and a new T-GPU
would be dissolved into such GPUs by phase 2 at the cost of another move).
So a T-unit moves at most once for them, never onto a GPU that an
S/M then evicts it from again (this is Mell's operation batching, §VI-C,
within one operation: the buffered moves are executed once, where they end
up; a unit that lands back on its own GPU does not move).

Theorem 3 bounds an operation by ten migrations; its proof counts Fig. 10's
moves only, not the repairs. Here ``item_moves`` counts every T-unit and
S/M/L move the operation makes, repairs included; the choices above keep
it at most ten on every random stream tried (about 31,000 streams, 16
million operations, capacities 64 to 780: at most nine; the tests check
ten), but that bound is measured, not proven for this implementation.

**Exceptions.** The properties are checked on every GPU except the most
recently activated GPU of each category: at most **4** GPUs (the constant
of Theorem 1 here). :meth:`MellPacker.violations` lists the rest.

GPU priority for new requests: ``w_free * free/C + w_requests / (1 + n)``
(more free memory, fewer requests: higher). GPU-to-GPU priority adds
``w_distance`` when both GPUs are on the same node.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

X, T, S, M, L = 0, 1, 2, 3, 4
CLASS_NAMES = ("X", "T", "S", "M", "L")
EMPTY = -1
CATEGORY_NAMES = {EMPTY: "empty", T: "T", S: "S", M: "M", L: "L"}

__all__ = [
    "CLASS_NAMES",
    "EMPTY",
    "Bin",
    "L",
    "M",
    "MellPacker",
    "Move",
    "OpResult",
    "S",
    "T",
    "X",
    "size_class",
]


def size_class(s: int, cap: int) -> int:
    """Class of a request of size ``s`` on GPUs of capacity ``cap``."""
    if 2 * s > cap:
        return L
    if 3 * s > cap:
        return M
    if 4 * s > cap:
        return S
    if 8 * s > cap:
        return T
    return X


@dataclass(frozen=True, slots=True)
class Move:
    """Request ``rid`` goes from bin ``src`` (None: a new placement) to ``dst``."""

    rid: int
    src: int | None
    dst: int


@dataclass(slots=True)
class OpResult:
    """What one operation did.

    Attributes:
        moves: request moves in order (a placement of a new request has
            ``src`` None and is not a migration).
        item_moves: migrations counted as Theorem 3 counts them (a
            multi-item moves as one).
    """

    moves: list[Move]
    item_moves: int

    @property
    def migrations(self) -> int:
        """Request migrations (every member of a moved multi-item counts)."""
        return sum(1 for m in self.moves if m.src is not None)


class Bin:
    """One GPU's KV capacity and the requests allocated to it."""

    __slots__ = ("by", "cat", "id", "node", "used")

    def __init__(self, bid: int, node: int | None) -> None:
        self.id = bid
        self.node = node
        self.by: list[dict[int, None]] = [{}, {}, {}, {}, {}]  # rids by class
        self.used = 0
        self.cat = EMPTY

    @property
    def n(self) -> int:
        """Requests on this GPU."""
        by = self.by
        return len(by[0]) + len(by[1]) + len(by[2]) + len(by[3]) + len(by[4])

    def category(self) -> int:
        by = self.by
        for c in (L, M, S, T):
            if by[c]:
                return c
        return T if by[X] else EMPTY

    def __repr__(self) -> str:
        parts = [f"{CLASS_NAMES[c]}{list(self.by[c])}" for c in (L, M, S, T, X) if self.by[c]]
        return f"Bin({self.id}, {CATEGORY_NAMES[self.cat]}, used={self.used}, {' '.join(parts)})"


class _SortedPairs:
    """A sorted list of ``(key, id)`` pairs (bisect on a plain list)."""

    __slots__ = ("a",)

    def __init__(self) -> None:
        self.a: list[tuple[int, int]] = []

    def add(self, key: int, ident: int) -> None:
        bisect.insort(self.a, (key, ident))

    def remove(self, key: int, ident: int) -> None:
        a = self.a
        i = bisect.bisect_left(a, (key, ident))
        if i == len(a) or a[i] != (key, ident):
            raise KeyError((key, ident))
        del a[i]

    def upto(self, key: int) -> int:
        """Number of entries with key <= ``key``."""
        return bisect.bisect_right(self.a, (key, 1 << 62))

    def __len__(self) -> int:
        return len(self.a)


class MellPacker:
    """Mell's allocation of growing requests to GPUs of KV capacity ``capacity``.

    Args:
        capacity: ``C``, KV capacity of one GPU (any integer unit, e.g. blocks).
        w_requests, w_free, w_distance: priority weights (see module docstring).

    Every public operation returns an :class:`OpResult`. Sizes must satisfy
    ``1 <= size <= capacity`` (Mell's model assumes ``S_i <= C``).
    """

    def __init__(
        self,
        capacity: int,
        *,
        w_requests: float = 1.0,
        w_free: float = 1.0,
        w_distance: float = 1.0,
    ) -> None:
        if capacity < 8:
            raise ValueError(f"capacity must be at least 8 units, got {capacity}")
        self.C = capacity
        self.w_requests = w_requests
        self.w_free = w_free
        self.w_distance = w_distance
        self.bins: dict[int, Bin] = {}
        self.where: dict[int, Bin] = {}
        self.size: dict[int, int] = {}
        self.cls: dict[int, int] = {}
        self._next_bin = 0
        self._cats: list[list[int]] = [[] for _ in range(5)]  # sorted bin ids by category
        self._lfree = _SortedPairs()  # (free, bin) of L-GPUs
        self._tfree = _SortedPairs()  # (free, bin) of T-GPUs
        self._lbyn: dict[int, _SortedPairs] = {}  # n -> (free, bin) of L-GPUs with n requests
        self._lns: list[int] = []  # the n of _lbyn, sorted
        self._lnkey: dict[int, int] = {}  # L-GPU -> its n in _lbyn
        self._lopen = _SortedPairs()  # (L size, bin) of L-GPUs without S/M
        self._smpool = _SortedPairs()  # (size, rid) of S/M requests on S/M-GPUs
        self._keys: dict[int, tuple[int | None, int | None]] = {}  # bin -> (lfree, lopen) keys
        self._inpool: dict[int, int] = {}  # rid -> its key in _smpool
        self._moves: list[Move] = []
        self._items = 0
        self._touched: dict[int, None] = {}
        self._air: list[tuple[tuple[int, ...], Bin]] = []  # lifted T-units, their source
        self._done: set[int] = set()  # bins repaired (and unchanged since) in this op
        self._repairing = -1  # the bin being repaired now
        self._became: dict[int, None] = {}  # bins whose category changed in this op
        self._refill_next: dict[int, None] = {}  # new T-GPUs that could not be dissolved
        self._was_latest: list[int] = [-1] * 5  # the latest GPU per category when the op began
        self._order: list[int] = []  # max-heap (negated) of live bin ids
        self._mlow: dict[int, None] = {}  # M-GPUs under 3C/4
        self.new_bins: list[int] = []  # bins opened since the caller last cleared it

    # ------------------------------------------------------------- queries
    def latest(self, cat: int) -> Bin | None:
        """The most recently activated live GPU of category ``cat``."""
        ids = self._cats[cat]
        return self.bins[ids[-1]] if ids else None

    def second_latest(self, cat: int) -> Bin | None:
        """The GPU of category ``cat`` activated just before the latest one."""
        ids = self._cats[cat]
        return self.bins[ids[-2]] if len(ids) > 1 else None

    def latest_overall(self) -> Bin | None:
        """The most recently activated live GPU."""
        h = self._order
        while h and -h[0] not in self.bins:
            heapq.heappop(h)
        return self.bins[-h[0]] if h else None

    def prio(self, b: Bin) -> float:
        """Priority of GPU ``b`` for a new request."""
        return self.w_free * (self.C - b.used) / self.C + self.w_requests / (1 + b.n)

    def prio_to(self, b: Bin, target: Bin) -> float:
        """Priority of GPU ``b`` for GPU ``target`` (workload and distance)."""
        same = b.node is not None and b.node == target.node
        return self.prio(b) + (self.w_distance if same else 0.0)

    def t_units(self, b: Bin) -> list[tuple[int, ...]]:
        """The T-units of ``b``: its T-requests, then its tiny requests cut into
        multi-items (greedy, in arrival order; the last one may be open)."""
        units: list[tuple[int, ...]] = [(r,) for r in b.by[T]]
        group: list[int] = []
        acc = 0
        size = self.size
        cap = self.C
        for r in b.by[X]:
            group.append(r)
            acc += size[r]
            if 8 * acc > cap:
                units.append(tuple(group))
                group, acc = [], 0
        if group:
            units.append(tuple(group))
        return units

    def t_content(self, b: Bin) -> int:
        """Total size of ``b``'s T- and tiny requests."""
        size = self.size
        return sum(size[r] for r in b.by[T]) + sum(size[r] for r in b.by[X])

    # ---------------------------------------------------------- operations
    def allocate(self, rid: int, size: int) -> OpResult:
        """Allocate a new request (``J.Allocate(i)``)."""
        if rid in self.where:
            raise ValueError(f"request {rid} is already allocated")
        self._check_size(rid, size)
        self._begin()
        self.size[rid] = size
        self.cls[rid] = size_class(size, self.C)
        self._allocate((rid,), None)
        return self._end()

    def depart(self, rid: int) -> OpResult:
        """Remove a completed request (``J.Depart(i)``)."""
        self._begin()
        self._depart(rid)
        del self.size[rid]
        del self.cls[rid]
        return self._end()

    def update(self, rid: int, size: int) -> OpResult:
        """Apply request ``rid``'s new size (``J.Update(i)``)."""
        self._check_size(rid, size)
        self._begin()
        self._update(rid, size)
        return self._end()

    def set_size(self, rid: int, size: int) -> None:
        """Record a size change without running an operation (batched epochs
        apply all sizes first, then run the operations they cause)."""
        self._check_size(rid, size)
        b = self.where[rid]
        self._unindex(b)
        self._set_size(rid, b, size)
        self._index(b)

    def needs_update(self, rid: int, size: int) -> bool:
        """Whether resizing ``rid`` to ``size`` changes its class or overflows
        its GPU, so that ``update`` must run; otherwise ``set_size`` suffices."""
        b = self.where[rid]
        grown = b.used - self.size[rid] + size
        return size_class(size, self.C) != self.cls[rid] or grown > self.C

    # -------------------------------------------------------- op framework
    def _check_size(self, rid: int, size: int) -> None:
        if not 1 <= size <= self.C:
            raise ValueError(f"request {rid}: size {size} outside [1, C={self.C}]")

    def _begin(self) -> None:
        self._moves = []
        self._items = 0
        self._touched = {}
        self._done = set()
        self._became = {}
        self._refill_next = {}
        self._was_latest = [ids[-1] if ids else -1 for ids in self._cats]

    def _end(self) -> OpResult:
        self._repair_touched()
        assert not self._air
        for bid in self._touched:
            b = self.bins.get(bid)
            if b is not None and b.cat == EMPTY:
                self._drop_bin(bid)
        return OpResult(self._moves, self._items)

    def _touch(self, b: Bin) -> None:
        self._touched[b.id] = None
        if b.id != self._repairing:
            self._done.discard(b.id)  # changed after its repair: repair it again

    # ---------------------------------------------------------- primitives
    def _new_bin(self) -> Bin:
        b = Bin(self._next_bin, None)
        self._next_bin += 1
        self.bins[b.id] = b
        heapq.heappush(self._order, -b.id)
        self._touch(b)
        self._keys[b.id] = (None, None)
        self.new_bins.append(b.id)
        return b

    def _drop_bin(self, bid: int) -> None:
        b = self.bins.pop(bid)
        assert b.cat == EMPTY and b.used == 0
        del self._keys[bid]

    def _unindex(self, b: Bin) -> None:
        kf, ko = self._keys[b.id]
        if kf is not None:
            if b.cat == L:
                self._lfree.remove(kf, b.id)
                n = self._lnkey.pop(b.id)
                byn = self._lbyn[n]
                byn.remove(kf, b.id)
                if not byn:
                    del self._lbyn[n]
                    del self._lns[bisect.bisect_left(self._lns, n)]
            else:
                self._tfree.remove(kf, b.id)
        if ko is not None:
            self._lopen.remove(ko, b.id)
        self._keys[b.id] = (None, None)
        self._mlow.pop(b.id, None)
        inpool = self._inpool
        for c in (S, M):
            for r in b.by[c]:
                k = inpool.pop(r, None)
                if k is not None:
                    self._smpool.remove(k, r)

    def _index(self, b: Bin) -> None:
        cat = b.category()
        if cat != b.cat:
            if b.cat != EMPTY:
                ids = self._cats[b.cat]
                del ids[bisect.bisect_left(ids, b.id)]
            b.cat = cat
            if cat != EMPTY:
                bisect.insort(self._cats[cat], b.id)
            if cat != EMPTY:
                self._became[b.id] = None
        kf = ko = None
        if cat == L:
            kf = self.C - b.used
            self._lfree.add(kf, b.id)
            n = b.n
            byn = self._lbyn.get(n)
            if byn is None:
                byn = self._lbyn[n] = _SortedPairs()
                bisect.insort(self._lns, n)
            byn.add(kf, b.id)
            self._lnkey[b.id] = n
            if not b.by[S] and not b.by[M]:
                (lr,) = b.by[L]
                ko = self.size[lr]
                self._lopen.add(ko, b.id)
        elif cat == T:
            kf = self.C - b.used
            self._tfree.add(kf, b.id)
        elif cat in (S, M):
            size = self.size
            for c in (S, M):
                for r in b.by[c]:
                    self._inpool[r] = size[r]
                    self._smpool.add(size[r], r)
            if cat == M and 4 * b.used < 3 * self.C:
                self._mlow[b.id] = None
        self._keys[b.id] = (kf, ko)

    def _set_size(self, rid: int, b: Bin, size: int) -> None:
        """Change a request's size inside an unindexed bin (keeps its class slot)."""
        b.used += size - self.size[rid]
        self.size[rid] = size

    def _put(self, unit: tuple[int, ...], b: Bin, src: Bin | None) -> None:
        """Place ``unit`` on ``b``; record the moves if it came from ``src``."""
        self._unindex(b)
        for r in unit:
            c = self.cls[r]
            b.by[c][r] = None
            b.used += self.size[r]
            self.where[r] = b
            if src is None or src is not b:
                self._moves.append(Move(r, None if src is None else src.id, b.id))
        if src is not None and src is not b:
            self._items += 1
        self._index(b)
        self._touch(b)

    def _take(self, unit: tuple[int, ...]) -> Bin:
        """Remove ``unit`` (all on one bin) from its bin; returns the bin."""
        b = self.where[unit[0]]
        self._unindex(b)
        for r in unit:
            assert self.where[r] is b
            del b.by[self.cls[r]][r]
            b.used -= self.size[r]
            del self.where[r]
        self._index(b)
        self._touch(b)
        return b

    def _unit_size(self, unit: tuple[int, ...]) -> int:
        size = self.size
        return sum(size[r] for r in unit)

    def _lift(self, unit: tuple[int, ...]) -> None:
        """Take a T-unit off its GPU to be re-allocated by :meth:`_land` (the
        operation's buffer: it moves once, wherever it lands)."""
        self._air.append((unit, self._take(unit)))

    def _land(self) -> None:
        """Re-allocate the lifted T-units, largest first. A T-GPU that is
        under 3C/4 and no longer the most recent one (property 3 has it
        refilled from the most recent T-GPU next) takes them first; the rest
        are allocated as new T-units are."""
        while self._air:
            air = sorted(self._air, key=lambda a: (-self._unit_size(a[0]), a[0]))
            self._air = []
            needy = self._needy_t()
            for unit, src in air:
                us = self._unit_size(unit)
                dst = next((b for b in needy if self._wants_t(b, us)), None)
                if dst is not None:
                    self._put(unit, dst, src)
                else:
                    self._allocate(unit, src, spill=True)

    def _dissolve_new_t(self) -> None:
        """Before the lifted T-units land: GPUs that just became T-GPUs (not
        the most recent one) under 3C/4 are dissolved if they can be, before
        the landing units take the room their units need; the others are
        refilled in phase 2 and so take landing units first."""
        lt = self.latest(T)
        cap = self.C
        for bid in list(self._touched):
            b = self.bins.get(bid)
            if b is None or b.cat != T or b is lt or bid not in self._became:
                continue
            if 4 * b.used < 3 * cap and not self._dissolve_t(b):
                self._refill_next[bid] = None

    def _needy_t(self) -> list[Bin]:
        """T-GPUs touched by this operation or just past their exemption that
        are under 3C/4 and will be refilled rather than dissolved (new T-GPUs
        only once :meth:`_dissolve_new_t` failed to dissolve them)."""
        lt = self.latest(T)
        if lt is None:
            return []
        cap = self.C
        cands = [self.bins[b] for b in self._touched if b in self.bins]
        sl = self.second_latest(T)
        if sl is not None:
            cands.append(sl)
        out: list[Bin] = []
        for b in cands:
            needy = b.cat == T and b is not lt
            needy = needy and (b.id not in self._became or b.id in self._refill_next)
            if needy and 4 * b.used < 3 * cap and b not in out:
                out.append(b)
        return out

    def _wants_t(self, b: Bin, us: int) -> bool:
        """``b`` (a needy T-GPU) is still under 3C/4 and has room for ``us``."""
        return 4 * b.used < 3 * self.C and b.used + us <= self.C

    def _move_unit(self, unit: tuple[int, ...], dst: Bin) -> None:
        src = self._take(unit)
        self._put(unit, dst, src)

    # ------------------------------------------------------------ allocate
    def _allocate(self, unit: tuple[int, ...], src: Bin | None, spill: bool = False) -> Bin:
        """Allocate ``unit`` (one request, or a multi-item of tiny ones) that
        is on no bin now; ``src`` is where it was (for move records; ``spill``
        see :meth:`_choose_t`)."""
        c = self.cls[unit[0]] if len(unit) == 1 else T
        s = self._unit_size(unit)
        if c <= T:
            dst = self._choose_t(s, spill=spill)
            self._put(unit, dst, src)
            if dst.cat == M and 4 * self.t_content(dst) > self.C:
                for own in self.t_units(dst):  # the M-GPU's older T-content makes way
                    if unit[0] not in own:
                        self._take(own)
                        self._put(own, self._choose_t(self._unit_size(own), avoid=dst), dst)
        elif c == L:
            dst = self._new_bin()
            self._put(unit, dst, src)
            self._pull_sm(dst)
        else:
            lbin = self._choose_l_for_sm(s)
            if lbin is not None:
                dst = lbin
                self._put(unit, dst, src)
                self._reallocate_t(dst)
            else:
                lt = self.latest(c)
                cap = 3 if c == S else 2
                if (
                    lt is not None
                    and len(lt.by[c]) < cap
                    and lt.used - self.t_content(lt) + s <= self.C
                ):
                    dst = lt  # T-units that no longer fit are re-allocated
                else:
                    dst = self._new_bin()
                self._put(unit, dst, src)
                self._reallocate_t_overflow(dst)
        return dst

    def _choose_t(self, s: int, avoid: Bin | None = None, spill: bool = False) -> Bin:
        """Where a T-unit of size ``s`` is allocated (see the module docstring;
        ``spill``: a re-allocated unit tries every T-GPU with room, the fullest
        first, before a new GPU)."""
        best: Bin | None = None
        best_key = (0.0, 0, 0)
        wf, wr, cap = self.w_free, self.w_requests, self.C
        a = self._lfree.a
        if a and a[-1][0] >= s:
            # the L-GPU of highest priority with room: per request count n,
            # the one with the most free memory (ties: the higher id)
            top = wf * a[-1][0] / cap
            prune = wf >= 0 and wr >= 0
            avoid_id = -1 if avoid is None else avoid.id
            for n in self._lns:
                if prune and best is not None and top + wr / (1 + n) < best_key[0]:
                    break  # priorities only fall with n
                pa = self._lbyn[n].a
                i = len(pa) - 1
                if pa[i][1] == avoid_id:
                    i -= 1
                if i < 0 or pa[i][0] < s:
                    continue
                free, bid = pa[i]
                key = (wf * free / cap + wr / (1 + n), free, bid)
                if best is None or key > best_key:
                    best, best_key = self.bins[bid], key
        best_p = best_key[0]
        for bid in self._mlow:  # property 5: M-GPUs under 3C/4 take T-content up to C/4
            b = self.bins[bid]
            if (
                b is not avoid
                and b.used + s <= cap
                and 4 * (self.t_content(b) + s) <= cap
                and (best is None or self.prio(b) > best_p)
            ):
                best, best_p = b, self.prio(b)
        if best is not None:
            return best
        lt = self.latest(T)
        if lt is not None and lt is not avoid and lt.used + s <= self.C:
            return lt
        if spill:
            ta = self._tfree.a
            for i in range(bisect.bisect_left(ta, (s, -1)), len(ta)):
                b = self.bins[ta[i][1]]
                if b is not avoid:
                    return b
        for bid in self._mlow:  # an M-GPU whose smaller T-content can make way
            b = self.bins[bid]
            tc = self.t_content(b)
            if b is not avoid and tc < s and 4 * s <= cap and b.used - tc + s <= cap:
                return b
        return self._new_bin()

    def _choose_l_for_sm(self, s: int) -> Bin | None:
        best: Bin | None = None
        best_p = 0.0
        a = self._lopen.a
        wf, wr, cap = self.w_free, self.w_requests, self.C
        for i in range(self._lopen.upto(cap - s)):
            lsize, bid = a[i]
            if best is not None and wf * (cap - lsize) / cap + wr / 2 <= best_p:
                break  # larger L requests leave less room: no better one follows
            b = self.bins[bid]
            p = self.prio(b)
            if best is None or p > best_p:
                best, best_p = b, p
        return best

    def _reallocate_t(self, b: Bin) -> None:
        """Depart and re-allocate every T-unit on ``b`` (Fig. 10, Allocate S/M)."""
        for unit in self.t_units(b):
            self._lift(unit)

    def _pull_sm(self, j: Bin) -> None:
        """Move into L-GPU ``j`` an S/M-request that fits: from the most recent
        S- or M-GPU if one of theirs fits, else from the S/M-GPU with the
        highest priority for ``j`` (the smallest fitting request of it);
        refill the GPU it left."""
        if j.cat != L or j.by[S] or j.by[M]:
            return
        (lr,) = j.by[L]
        room = self.C - self.size[lr]
        best: Bin | None = None
        best_key = (0.0, 0, 0)
        size = self.size
        # the most recent S/M-GPU first: it needs no refill (it is exempt)
        for src in (self.latest(S), self.latest(M)):
            if src is None:
                continue
            p = self.prio_to(src, j)
            for c in (S, M):
                for r in src.by[c]:
                    key = (p, -size[r], -r)  # ties: the smallest, as in the pool
                    if size[r] <= room and (best is None or key > best_key):
                        best, best_key = src, key
        if best is None:
            a = self._smpool.a
            cache: dict[int, float] = {}
            for i in range(self._smpool.upto(room)):
                r = a[i][1]
                src = self.where[r]
                q = cache.get(src.id)
                if q is None:
                    q = cache[src.id] = self.prio_to(src, j)
                if best is None or q > best_key[0]:
                    best, best_key = src, (q, -size[r], -r)
        if best is None:
            return
        best_r = -best_key[2]
        c = self.cls[best_r]
        self._move_unit((best_r,), j)
        self._reallocate_t_overflow(j)
        self._refill_class(best, c)

    def _reallocate_t_overflow(self, j: Bin) -> None:
        """Re-allocate T-units of ``j``, largest first, until it fits."""
        if j.used <= self.C:
            return
        units = sorted(self.t_units(j), key=lambda u: (-self._unit_size(u), u))
        for unit in units:
            if j.used <= self.C:
                break
            self._lift(unit)

    def _refill_class(self, j: Bin, c: int) -> None:
        """``j`` lost a class-``c`` (S or M) request: take one of that class from
        the most recently activated GPU of that category, if it fits."""
        if j.cat == EMPTY or j.id not in self.bins:
            return
        lt = self.latest(c)
        if lt is None or lt is j or (j.cat != c and j.cat != L):
            return
        if j.cat == c and len(j.by[c]) >= (3 if c == S else 2):
            return
        room = self.C - j.used + self.t_content(j)  # T-units make way if needed
        cand = [r for r in lt.by[c] if self.size[r] <= room]
        if not cand:
            return
        r = max(cand, key=lambda x: (self.size[x], -x))
        self._move_unit((r,), j)
        self._reallocate_t_overflow(j)

    # -------------------------------------------------------------- depart
    def _depart(self, rid: int) -> Bin:
        """Remove ``rid`` with Fig. 10's Depart repairs; returns its old bin."""
        j = self.where[rid]
        c = self.cls[rid]
        cat_before = j.cat
        is_latest = self.latest_overall() is j
        self._take((rid,))
        if j.cat == EMPTY or is_latest:
            return j
        if c <= T:
            self._refill_t(j)
        elif c in (S, M):
            if cat_before in (S, M):
                self._refill_class(j, c)
                if cat_before == M:
                    self._reallocate_t(j)
            elif cat_before == L:
                self._pull_sm(j)
        else:  # the L-request left: re-allocate everything else on j
            for cc in (M, S):
                for r in list(j.by[cc]):
                    self._take((r,))
                    self._allocate((r,), j)
            for unit in self.t_units(j):
                self._lift(unit)
        return j

    def _refill_t(self, j: Bin) -> None:
        """Pull T-units from the most recently activated T-GPU into ``j`` while
        ``j`` is under 3C/4 and one fits."""
        if j.cat == M:
            self._refill_t_one(j)
            return
        cap = self.C
        while 4 * j.used < 3 * cap:
            lt = self.latest(T)
            if lt is None or lt is j:
                return
            fitting = self._pullable(lt, cap - j.used)
            if not fitting:
                return
            unit = max(fitting, key=lambda u: (self._unit_size(u), [-r for r in u]))
            self._move_unit(unit, j)

    # -------------------------------------------------------------- update
    def _update(self, rid: int, size: int) -> None:
        j = self.where[rid]
        old = self.cls[rid]
        new = size_class(size, self.C)
        shrank = size < self.size[rid]
        self._unindex(j)
        self._set_size(rid, j, size)
        self._index(j)
        self._touch(j)
        if new == old:
            if shrank and new in (S, M) and j.cat in (S, M):
                # (not in Mell's model) it may fit an L-GPU now: property 4
                dst = self._choose_l_for_sm(size)
                if dst is not None:
                    self._move_unit((rid,), dst)
                    self._reallocate_t_overflow(dst)
            self._resolve_overflow(j, rid)
            return
        if new == T and old == X:
            self._reclass(rid, j, new)
            self._resolve_overflow(j, rid)
            return
        if new in (S, M) or (new == L and old < M):
            # "Depart i and re-allocate i": i leaves j and is allocated as its
            # new class; j's Depart refills are left to the repair pass, which
            # then sees where i went (i may even land on j again).
            self._take((rid,))
            self.cls[rid] = new
            self._allocate((rid,), j)
            return
        if new == L and old == M:
            if j.cat == L and self._other_l(j, rid):
                self._take((rid,))  # as above
                self.cls[rid] = new
                self._allocate((rid,), j)
                return
            self._reclass(rid, j, new)
            if j.used > self.C:
                self._reallocate_others(j, rid)
            return
        # A class that shrank (sizes never shrink in Mell's model, but be safe).
        self._depart(rid)
        self.cls[rid] = new
        self._allocate((rid,), j)

    def _other_l(self, j: Bin, rid: int) -> bool:
        return any(r != rid for r in j.by[L])

    def _reclass(self, rid: int, j: Bin, new: int) -> None:
        self._unindex(j)
        del j.by[self.cls[rid]][rid]
        self.cls[rid] = new
        j.by[new][rid] = None
        self._index(j)
        self._touch(j)

    def _reallocate_others(self, j: Bin, keep: int) -> None:
        for cc in (L, M, S):
            for r in list(j.by[cc]):
                if r != keep:
                    self._take((r,))
                    self._allocate((r,), j)
        for unit in self.t_units(j):
            self._lift(unit)

    def _resolve_overflow(self, j: Bin, grown: int) -> None:
        """Growth within a class overflowed ``j``: L-GPU — re-allocate all the
        others (Fig. 10, L -> L); other GPUs — T-units largest first, then the
        smaller S/M requests, until ``j`` fits."""
        if j.used <= self.C:
            return
        if j.cat == L and grown in j.by[L]:
            self._reallocate_others(j, grown)
            return
        self._reallocate_t_overflow(j)
        for cc in (S, M):
            for r in sorted(j.by[cc], key=lambda x: (self.size[x], x)):
                if j.used <= self.C:
                    return
                self._take((r,))
                self._allocate((r,), j)

    # -------------------------------------------------------------- repair
    def _repair_touched(self) -> None:
        """Restore Theorem 1's properties on the GPUs this operation touched,
        and on the GPU that was the most recent of each category before (it
        lost its exemption if a newer GPU joined the category).

        Two phases. First the S/M/L structure (properties 1, 2 and 4: S/M
        refills, L-GPUs pulling an S/M); T-units these moves displace are
        lifted, not re-allocated yet. Then the lifted T-units land and the
        T-content is repaired (property 1's C/4, 3 and 5). T-moves never
        change the S/M/L structure, so the second phase cannot undo the
        first, and no T-unit is placed on a GPU that an S/M move then
        evicts it from again."""
        became = self._became
        self._repair_phase(
            (L, M, S),
            False,
            # GPUs that just became S/M-GPUs first (their S/M may belong on
            # an L-GPU, property 4, before another GPU refills from them);
            # then larger categories first: an L-GPU pulling an S/M may need
            # no T-units
            lambda x: (not (x.id in became and x.cat in (S, M)), -x.cat, x.id),
            self._repair_sm,
        )
        self._dissolve_new_t()
        self._land()
        self._repair_phase((L, M, T), True, lambda x: (-x.cat, x.id), self._repair_t)
        self._land()

    def _repair_phase(
        self,
        cats: tuple[int, ...],
        p5: bool,
        key: Callable[[Bin], tuple[Any, ...]],
        repair: Callable[[Bin], None],
    ) -> None:
        """Run ``repair`` on every touched GPU, and on the second most recent
        GPU of each of ``cats`` and the one that was the most recent when the
        operation began (both may have lost their exemption), until none
        changed since its repair (with ``p5``: then on the L/M-GPUs property
        5 has pull T-units)."""
        done: set[int] = set()
        self._done = done
        for _ in range(16):  # a pull can touch one more GPU; chains are short
            pending = [b for b in self._touched if b not in done and b in self.bins]
            for c in cats:
                sl = self.second_latest(c)
                if sl is not None and sl.id not in done:
                    pending.append(sl.id)
                # the latest before the operation, if two newer ones joined
                was = self._was_latest[c]
                if was not in done and was in self.bins and self.bins[was].cat == c:
                    pending.append(was)
            if not pending and p5:
                pending = self._p5_pending()
            if not pending:
                return
            bins = [self.bins[b] for b in set(pending) if b in self.bins]
            for b in sorted(bins, key=key):
                done.add(b.id)
                if b.cat != EMPTY:
                    self._repairing = b.id
                    repair(b)
                    self._repairing = -1

    def _p5_pending(self) -> list[int]:
        """L/M-GPUs (not the most recent of their category) under 3C/4 while a
        T-GPU exists: property 5 has them pull T-units. Untouched GPUs can be
        among them when this operation created the first T-GPU."""
        if self.latest(T) is None:
            return []
        cap = self.C
        out: list[int] = []
        lt_l, lt_m = self.latest(L), self.latest(M)
        a = self._lfree.a
        for i in range(len(a) - 1, -1, -1):
            free, bid = a[i]
            if 4 * free <= cap:
                break
            if lt_l is None or bid != lt_l.id:
                out.append(bid)
        out.extend(b for b in self._mlow if lt_m is None or b != lt_m.id)
        return [b for b in out if b not in self._done]

    def _repair_sm(self, b: Bin) -> None:
        """Properties 1 (two M, T-content <= C/4), 2 and 4 on ``b``."""
        cat = b.cat
        if cat in (S, M) and b.id in self._became and self._sm_to_l(b):
            return
        if cat == S:
            while len(b.by[S]) < 3:
                n0 = len(b.by[S])
                self._refill_class(b, S)
                if len(b.by[S]) == n0:
                    break
        elif cat == M:
            while len(b.by[M]) < 2:
                n0 = len(b.by[M])
                self._refill_class(b, M)
                if len(b.by[M]) == n0:
                    break
            if 4 * self.t_content(b) > self.C:
                # keep the largest T-unit, re-allocate the rest (property 1)
                units = sorted(self.t_units(b), key=lambda u: (-self._unit_size(u), u))
                for unit in units[1:]:
                    self._lift(unit)
        elif cat == L and not b.by[S] and not b.by[M]:
            self._pull_sm(b)

    def _repair_t(self, b: Bin) -> None:
        """Properties 3 and 5 on ``b`` (T-moves only)."""
        cat = b.cat
        if cat == T:
            if b.id not in self._became or not self._dissolve_t(b):
                self._refill_t(b)
        elif cat == M:
            # the most recent M-GPU with one M is exempt, and one M plus C/4 of
            # T-content cannot reach 3C/4: pulling T-units would be wasted
            useful = len(b.by[M]) == 2 or self.latest(M) is not b
            if useful and self.latest(T) is not None and 4 * b.used < 3 * self.C:
                self._refill_t_one(b)
        elif cat == L and self.latest(T) is not None:
            self._refill_t(b)

    def _dissolve_t(self, b: Bin) -> bool:
        """``b`` just became a T-GPU. If an L/M-GPU other than the most recent
        of its category is under 3C/4 (property 5 forbids T-GPUs then), or
        ``b`` is under 3C/4 with at most two T-units (cheaper to move out than
        to fill up), its T-units move to L-GPUs with room, M-GPUs under 3C/4,
        the most recent T-GPU, or another T-GPU with room (the fullest that
        fits: it only gets fuller) -- all of them or none (a partial move would
        leave ``b`` to be refilled, paying twice). True if ``b`` emptied
        (False: it stays and is refilled instead)."""
        cap = self.C
        units = sorted(self.t_units(b), key=lambda u: (-self._unit_size(u), u))
        a = self._lfree.a
        lt_l, lt_m = self.latest(L), self.latest(M)
        low = any(lt_m is None or bid != lt_m.id for bid in self._mlow) or any(
            4 * a[i][0] > cap and self.bins[a[i][1]] is not lt_l
            for i in range(len(a) - 1, max(len(a) - 3, 0) - 1, -1)
        )
        if not low and (4 * b.used >= 3 * cap or len(units) > 2):
            return False
        lt = self.latest(T)
        extra: dict[int, int] = {}  # planned additions per destination
        plan: list[tuple[tuple[int, ...], Bin]] = []
        for unit in units:
            us = self._unit_size(unit)
            dst: Bin | None = None
            for i in range(len(a) - 1, -1, -1):
                free, bid = a[i]
                if free < us:
                    break
                if free - extra.get(bid, 0) >= us:
                    dst = self.bins[bid]
                    break
            if dst is None:
                for bid in self._mlow:
                    m = self.bins[bid]
                    e = extra.get(bid, 0) + us
                    if m.used + e <= cap and 4 * (self.t_content(m) + e) <= cap:
                        dst = m
                        break
            if (
                dst is None
                and lt is not None
                and lt is not b
                and lt.used + extra.get(lt.id, 0) + us <= cap
            ):
                dst = lt
            if dst is None:
                # another T-GPU with room: it only gets fuller (best fit)
                ta = self._tfree.a
                for i in range(bisect.bisect_left(ta, (us, -1)), len(ta)):
                    free, bid = ta[i]
                    if bid != b.id and free - extra.get(bid, 0) >= us:
                        dst = self.bins[bid]
                        break
            if dst is None:
                return False
            extra[dst.id] = extra.get(dst.id, 0) + us
            plan.append((unit, dst))
        for unit, dst in plan:
            self._move_unit(unit, dst)
        return b.cat == EMPTY

    def _pullable(self, src: Bin, room: int) -> list[tuple[int, ...]]:
        """T-units of ``src`` of size at most ``room``; if none, one group of
        its tiny requests (largest first) that fits ``room``."""
        units = [u for u in self.t_units(src) if self._unit_size(u) <= room]
        if units:
            return units
        group: list[int] = []
        acc = 0
        for r in sorted(src.by[X], key=lambda x: (-self.size[x], x)):
            if acc + self.size[r] <= room:
                group.append(r)
                acc += self.size[r]
        return [tuple(group)] if group else []

    def _sm_to_l(self, b: Bin) -> bool:
        """A GPU just became an S/M-GPU (its larger request left): its S/M
        requests go to L-GPUs that fit them, as ``allocate`` would place them
        (property 4). True if ``b`` emptied."""
        for c in (M, S):
            for r in sorted(b.by[c], key=lambda x: (-self.size[x], x)):
                dst = self._choose_l_for_sm(self.size[r])
                if dst is not None:
                    self._move_unit((r,), dst)
                    self._reallocate_t_overflow(dst)
        if b.cat == T:
            self._became[b.id] = None
        return b.cat == EMPTY

    def _refill_t_one(self, j: Bin) -> None:
        """An M-GPU under 3C/4 takes T-units while its T-content stays within
        one T-unit's size, C/4 (Theorem 1, property 1)."""
        cap = self.C
        swapped = False
        for _ in range(4):
            if 4 * j.used >= 3 * cap:
                return
            lt = self.latest(T)
            if lt is None or lt is j:
                return
            room = min(cap - j.used, cap // 4 - self.t_content(j))
            fitting = self._pullable(lt, room) if room > 0 else []
            tc = self.t_content(j)
            if not fitting and tc and not swapped:
                # its small T-content blocks a unit that would fit: swap once
                big = [
                    u
                    for u in self._pullable(lt, min(cap - j.used + tc, cap // 4))
                    if self._unit_size(u) > tc and lt.used - self._unit_size(u) + tc <= cap
                ]
                if big:
                    # exchange: the unit comes in, j's smaller T-content goes to lt
                    unit = max(big, key=lambda u: (self._unit_size(u), [-r for r in u]))
                    own = tuple(r for u in self.t_units(j) for r in u)
                    self._move_unit(unit, j)
                    self._move_unit(own, lt)
                    swapped = True
                    continue
            if not fitting:
                return
            unit = max(fitting, key=lambda u: (self._unit_size(u), [-r for r in u]))
            self._move_unit(unit, j)

    # ---------------------------------------------------------- properties
    def violations(self) -> list[str]:
        """Theorem 1's properties that do not hold, on GPUs other than the
        most recently activated one of each category (the exceptions), plus
        any bin over capacity (constraint (2), no exceptions)."""
        out: list[str] = []
        cap = self.C
        exempt = {b.id for c in (L, M, S, T) if (b := self.latest(c)) is not None}
        lowest_lm_fill = 1.0
        t_exists = False
        for b in self.bins.values():
            if b.used > cap:
                out.append(f"bin {b.id} over capacity: {b.used} > {cap}")
            if b.cat == T:
                t_exists = True
            if b.id in exempt:
                continue
            if b.cat in (L, M):
                lowest_lm_fill = min(lowest_lm_fill, b.used / cap)
            if b.cat == M:
                if len(b.by[M]) != 2 or b.by[S] or 4 * self.t_content(b) > cap:
                    out.append(f"P1: M-GPU {b!r} needs two M-requests and T-content <= C/4")
            elif b.cat == S:
                if len(b.by[S]) != 3:
                    out.append(f"P2: S-GPU {b!r} needs three S-requests")
            elif b.cat == T:
                if 4 * b.used < 3 * cap:
                    out.append(f"P3: T-GPU {b!r} under 75%")
            elif b.cat == L and not b.by[S] and not b.by[M]:
                (lr,) = b.by[L]
                room = cap - self.size[lr]
                if self._smpool.upto(room) > 0:
                    out.append(f"P4: L-GPU {b!r} has no S/M but one fits")
        if t_exists:
            for b in self.bins.values():
                if b.id not in exempt and b.cat in (L, M) and 4 * b.used < 3 * cap:
                    out.append(f"P5: T-GPUs exist but L/M-GPU {b!r} is under 75%")
        return out

    def check(self) -> None:
        """Internal consistency of the indexes (tests)."""
        for rid, b in self.where.items():
            assert rid in b.by[self.cls[rid]], rid
        for b in self.bins.values():
            assert b.used == sum(self.size[r] for d in b.by for r in d), b
            assert b.cat == b.category(), b
            assert b.cat != EMPTY, b
            for c in range(5):
                for r in b.by[c]:
                    assert self.cls[r] == c, (r, c)
                    assert self.where[r] is b
        assert len(self._smpool) == len(self._inpool)
        assert len(self._lfree) == len(self._cats[L])
        assert sum(len(sp) for sp in self._lbyn.values()) == len(self._lfree)
        assert self._lns == sorted(self._lbyn) and all(self._lbyn.values())
        for bid, n in self._lnkey.items():
            assert self.bins[bid].n == n, (bid, n)
        assert len(self._tfree) == len(self._cats[T])
        assert not self._air
