"""KunServe's parameter-centric drop policy: buddy groups, drop trigger, re-balance.

KunServe (paper 004) answers memory throttling by dropping model *parameters*
instead of KV cache. Instances are replicas of one model (each holds all ``L``
layers). Under throttling they merge into **buddy groups** (§4.1): a group of
``k`` instances runs as a ``k``-stage pipeline, each member keeps one
contiguous range of layers and drops the rest, so the group holds exactly one
complete copy of every layer and frees ``(k - 1) * P`` bytes, ``P`` being the
bytes of one replica's layer parameters. This module is the pure decision code:

* :func:`split_layers`, :class:`BuddyPlan`, :func:`freed_bytes`: the plan and
  which layers each member keeps.
* :func:`throughput_greedy` (Algorithm 1, the paper's choice) and
  :func:`memory_greedy` (the alternative it rejects), dispatched by
  :func:`plan_drop`; :func:`check_one_copy` and :func:`layers_held` check the
  invariant.
* :class:`DemandMonitor` (§4.3 "Online monitor and drop trigger") and
  :func:`should_restore` (when to undo a drop).
* :func:`max_batch` and :func:`rebalance` (§4.3 "Online dispatcher").
* :class:`KunServePolicy`: the decisions a backend asks for once per monitor
  interval — sample the monitor, flag executors, size the requirement,
  plan the buddy groups (:class:`~fleetserve.policy.actions.DropLayers`),
  fall back to a spare instance
  (:class:`~fleetserve.policy.actions.ActivateSpare`), time the restores
  (:class:`~fleetserve.policy.actions.Restore`) — over executors the backend
  shows through :class:`KunExecutorView`.

No torch, no clocks (callers pass ``now``), no global state.

Choices the paper leaves open, made here:

* **Freed memory counts whole layers only.** ``freed = Σ (|g| - 1) * P``
  exactly as in the paper's constraint (a); embeddings and the LM head are
  part of ``P`` for this accounting (the caller decides what ``P`` holds).
  Every merge of two groups frees exactly one more ``P`` whatever their sizes,
  so the freed bytes depend only on how many groups there are.
* **Stage order** within a group is ascending instance id; stage ``i`` keeps
  the ``i``-th range of :func:`split_layers`, whose earlier stages take the
  extra layer when ``L`` is not a multiple of ``k``. Groups in a plan are
  listed by their smallest id.
* **Re-planning.** Both strategies start from a given configuration, not only
  from singletons: the paper's Algorithm 1 starts from singletons, and passing
  the current groups lets a second throttle merge further without undoing the
  first drop (a group is never split; splitting is a restore, which is the
  caller's decision). ``required_bytes`` is then the *total* extra memory the
  whole configuration must provide, counting what the given groups already
  free: to ask for ``Δ`` more on top of the current drop, pass
  ``freed_bytes(current, P) + Δ``.
* **Tie-breaking** is by smallest instance id, so plans are deterministic.
* **Group size cap.** A group cannot have more stages than the model has
  layers. The strategies take an optional keyword ``max_group_size``
  (callers pass ``L``, or a lower pipeline-depth limit); a merge that would
  exceed it is not made and the plan may end unmet. The paper then scales out
  a new instance (§4.1, §4.3); that is the caller's fallback.
* **Bytes are integers.** Byte arguments must be integers >= 0 (round a
  fractional requirement up with :func:`math.ceil`); instance ids are any
  distinct integers. A bad argument raises
  :class:`~fleetserve.errors.ConfigError` with a one-line message.
"""

from __future__ import annotations

import heapq
import math
import operator
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from fleetserve.cluster.state import InstanceView
from fleetserve.errors import ConfigError
from fleetserve.policy.actions import ActivateSpare, DropLayers, KunAction, Restore

__all__ = [
    "DEFAULT_RESTORE_THRESHOLD",
    "STRATEGIES",
    "BuddyPlan",
    "DemandMonitor",
    "ExecutorLoad",
    "ExecutorSnapshot",
    "KunAction",
    "KunExecutorView",
    "KunServePolicy",
    "check_one_copy",
    "freed_bytes",
    "layers_held",
    "max_batch",
    "memory_greedy",
    "plan_drop",
    "rebalance",
    "should_restore",
    "singletons",
    "split_layers",
    "throughput_greedy",
]

THROUGHPUT_GREEDY = "throughput-greedy"
MEMORY_GREEDY = "memory-greedy"
#: Names :func:`plan_drop` accepts, mapped to the plan's ``strategy``.
STRATEGIES: dict[str, str] = {
    "throughput": THROUGHPUT_GREEDY,
    THROUGHPUT_GREEDY: THROUGHPUT_GREEDY,
    "memory": MEMORY_GREEDY,
    MEMORY_GREEDY: MEMORY_GREEDY,
}
#: The restore threshold callers use (see :func:`should_restore`).
DEFAULT_RESTORE_THRESHOLD = 0.5

Groups = tuple[tuple[int, ...], ...]


# ---------------------------------------------------------------- validation


def _as_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an ``int`` >= ``minimum`` (numpy integers accepted, bools and floats not)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    number = operator.index(value)
    if number < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {number}")
    return int(number)


def _as_bytes(name: str, value: object) -> int:
    """A byte count: an integer >= 0."""
    if isinstance(value, float):
        raise ConfigError(
            f"{name} must be an integer number of bytes (round up with math.ceil), got {value!r}"
        )
    return _as_int(name, value, 0)


def _as_real(name: str, value: object, minimum: float | None = 0.0) -> float:
    """A finite real number, optionally >= ``minimum``."""
    if (  # the monitor's hot path
        type(value) is float and math.isfinite(value) and (minimum is None or value >= minimum)
    ):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{name} must be finite, got {number}")
    if minimum is not None and number < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {number}")
    return number


def _normalize_groups(groups: Sequence[Sequence[int]], *, allow_empty: bool = False) -> Groups:
    """Groups as sorted tuples of ids, listed by smallest id; rejects empty and duplicate ids."""
    if isinstance(groups, (str, bytes)):
        raise ConfigError(f"groups must be a sequence of sequences of instance ids, got {groups!r}")
    out: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for index, group in enumerate(groups):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
            raise ConfigError(f"group {index} must be a sequence of instance ids, got {group!r}")
        members: list[int] = []
        for raw in group:
            iid = _as_int("instance id", raw, -(2**63))
            if iid in seen:
                raise ConfigError(f"instance id {iid} appears more than once in the groups")
            seen.add(iid)
            members.append(iid)
        if not members:
            raise ConfigError(f"group {index} is empty; a buddy group needs at least one instance")
        out.append(tuple(sorted(members)))
    if not out and not allow_empty:
        raise ConfigError("no groups given; pass at least one instance, e.g. singletons(ids)")
    out.sort(key=lambda g: g[0])
    return tuple(out)


def _as_cap(max_group_size: int | None, start: Groups) -> int | None:
    """Validate ``max_group_size`` against the starting groups."""
    if max_group_size is None:
        return None
    cap = _as_int("max_group_size", max_group_size, 1)
    biggest = max(len(g) for g in start)
    if biggest > cap:
        raise ConfigError(
            f"max_group_size {cap} is smaller than an existing group of {biggest} instances"
        )
    return cap


# ---------------------------------------------------------------- plans


def split_layers(num_layers: int, k: int) -> list[tuple[int, int]]:
    """Split layers ``0..num_layers`` into ``k`` contiguous pipeline stages.

    Returns ``k`` half-open ranges ``[lo, hi)`` in stage order that cover
    ``0..num_layers`` exactly once. Their sizes differ by at most one; the
    earlier stages get the extra layers (e.g. 10 layers in 3 stages: 4, 3, 3).

    Raises:
        ConfigError: ``num_layers < 1`` or ``k`` not in ``1..num_layers``
            (every stage must keep at least one layer).
    """
    layers = _as_int("num_layers", num_layers, 1)
    stages = _as_int("k (pipeline stages)", k, 1)
    if stages > layers:
        raise ConfigError(f"cannot split {layers} layers into {stages} stages: k must be <= layers")
    base, extra = divmod(layers, stages)
    ranges: list[tuple[int, int]] = []
    lo = 0
    for stage in range(stages):
        hi = lo + base + (1 if stage < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def stages_within(
    held: Mapping[int, tuple[int, int]], num_layers: int
) -> list[tuple[int, tuple[int, int]]] | None:
    """Stage order and layer ranges for a group whose members already hold ``held``.

    Merging groups that already dropped layers (a second throttle, Algorithm 1
    merging two pairs) must not make a member load layers back: each member
    keeps a non-empty contiguous sub-range of what it holds, and the ranges
    tile ``0..num_layers``. Among such tilings this picks the most even one
    (smallest largest stage — the slowest stage paces a pipeline — then the
    smallest sum of squared stage sizes), by dynamic programming over (stage,
    first layer). Members holding a strict sub-range go in the order of their
    range; each member holding every layer is inserted where the tiling is
    most even (the latest such position, so singletons keep id order). When
    every member holds every layer this is :func:`split_layers`. Two pairs
    ``{a1: 0-24, a2: 24-48}`` and ``{b1: 0-24, b2: 24-48}`` give ``a1 0-12,
    b1 12-24, a2 24-36, b2 36-48``.

    Returns:
        ``[(member, (lo, hi)), ...]`` in stage order, or None when the
        holdings admit no tiling (the caller skips that merge).
    """
    layers = _as_int("num_layers", num_layers, 1)
    if not held:
        raise ConfigError("stages_within needs at least one member")
    if len(held) > layers:
        return None
    full = sorted(m for m, (lo, hi) in held.items() if lo <= 0 and hi >= layers)
    if len(full) == len(held):
        return list(zip(full, split_layers(layers, len(full)), strict=True))
    order = sorted((m for m in held if m not in full), key=lambda m: (held[m][0], held[m][1], m))

    def tile(seq: list[int]) -> tuple[tuple[int, int], list[int]] | None:
        k = len(seq)
        # best[i][c]: (cost, next cut) tiling [c, layers) with seq[i:], cost = (max, sumsq)
        best: list[dict[int, tuple[tuple[int, int], int]]] = [{} for _ in range(k + 1)]
        best[k][layers] = ((0, 0), layers)
        for i in range(k - 1, -1, -1):
            lo, hi = held[seq[i]]
            for c in range(lo, min(hi, layers)):
                choice: tuple[tuple[int, int], int] | None = None
                for e in range(c + 1, min(hi, layers) + 1):
                    nxt = best[i + 1].get(e)
                    if nxt is None or (i + 1 < k and e < held[seq[i + 1]][0]):
                        continue
                    size = e - c
                    cost = (max(size, nxt[0][0]), size * size + nxt[0][1])
                    if choice is None or cost < choice[0]:
                        choice = (cost, e)
                if choice is not None:
                    best[i][c] = choice
        first = best[0].get(0)
        if first is None:
            return None
        cuts = [0]
        for i in range(k):
            cuts.append(best[i][cuts[-1]][1])
        return first[0], cuts

    for m in full:
        pick: tuple[tuple[int, int], list[int]] | None = None
        for pos in range(len(order) + 1):
            cand = [*order[:pos], m, *order[pos:]]
            got = tile(cand)
            if got is not None and (pick is None or got[0] <= pick[0]):
                pick = (got[0], cand)
        if pick is None:
            return None
        order = pick[1]
    got = tile(order)
    if got is None:
        return None
    cuts = got[1]
    return [(m, (cuts[i], cuts[i + 1])) for i, m in enumerate(order)]


def singletons(instance_ids: Sequence[int]) -> Groups:
    """The undropped configuration: every instance its own buddy group."""
    return _normalize_groups([[iid] for iid in instance_ids])


def freed_bytes(groups: Sequence[Sequence[int]], param_bytes: int) -> int:
    """Bytes a configuration frees: ``Σ (len(g) - 1) * param_bytes`` (paper §4.1, constraint a)."""
    normalized = _normalize_groups(groups, allow_empty=True)
    p = _as_bytes("param_bytes", param_bytes)
    return sum(len(g) - 1 for g in normalized) * p


@dataclass(frozen=True, slots=True)
class BuddyPlan:
    """A buddy-group configuration and how much memory it frees.

    Attributes:
        groups: the groups; each lists its instance ids in stage order
            (ascending id), and they are disjoint. The strategies list groups
            by their smallest id.
        freed_bytes: bytes the configuration frees, ``Σ (|g| - 1) * P``.
        required_bytes: the extra bytes the plan was asked to provide.
        met: ``freed_bytes >= required_bytes``. An unmet plan is the best the
            strategy could do; the caller scales out for the rest (§4.1).
        strategy: ``"throughput-greedy"`` or ``"memory-greedy"`` (free text
            for hand-made plans).
    """

    groups: Groups
    freed_bytes: int
    required_bytes: int
    met: bool
    strategy: str

    def __post_init__(self) -> None:
        coerced = tuple(tuple(g) for g in self.groups)
        object.__setattr__(self, "groups", coerced)
        _normalize_groups(coerced)  # non-empty, no empty group, no duplicate id
        for group in coerced:
            if list(group) != sorted(group):
                raise ConfigError(f"group {group} is not in stage order (ascending instance ids)")
        freed = _as_bytes("freed_bytes", self.freed_bytes)
        required = _as_bytes("required_bytes", self.required_bytes)
        if bool(self.met) != (freed >= required):
            raise ConfigError(
                f"met={self.met} contradicts freed_bytes={freed} and required_bytes={required}"
            )

    @property
    def sizes(self) -> tuple[int, ...]:
        """Group sizes (pipeline depths), in the order of :attr:`groups`."""
        return tuple(len(g) for g in self.groups)

    @property
    def max_size(self) -> int:
        """The deepest pipeline of the plan."""
        return max(self.sizes)

    @property
    def instances(self) -> tuple[int, ...]:
        """Every instance id of the plan, ascending."""
        return tuple(sorted(iid for g in self.groups for iid in g))

    def group_of(self, iid: int) -> tuple[int, ...]:
        """The group holding instance ``iid``.

        Raises:
            ConfigError: ``iid`` is in no group of the plan.
        """
        for group in self.groups:
            if iid in group:
                return group
        raise ConfigError(f"instance {iid} is in no group of this plan")

    def assignment(self, num_layers: int) -> dict[int, tuple[int, int]]:
        """Instance id -> the half-open layer range ``[lo, hi)`` it keeps.

        Each group's ranges come from :func:`split_layers` in stage order, so a
        singleton keeps every layer. Raises :class:`ConfigError` when a group
        has more members than ``num_layers``.
        """
        held: dict[int, tuple[int, int]] = {}
        for group in self.groups:
            for iid, layer_range in zip(group, split_layers(num_layers, len(group)), strict=True):
                held[iid] = layer_range
        return held

    def merges_from(self, previous_groups: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The groups of this plan that are not groups of ``previous_groups``.

        These are the groups whose members must drop (and exchange KV cache);
        groups present in both configurations (same member set) keep running
        as they are. Listed in the order of :attr:`groups`.
        """
        before = {frozenset(g) for g in _normalize_groups(previous_groups, allow_empty=True)}
        return [g for g in self.groups if frozenset(g) not in before]


def _make_plan(members: list[list[int]], p: int, required: int, strategy: str) -> BuddyPlan:
    groups = tuple(sorted((tuple(sorted(m)) for m in members), key=lambda g: g[0]))
    freed = sum(len(g) - 1 for g in groups) * p
    return BuddyPlan(groups, freed, required, freed >= required, strategy)


def throughput_greedy(
    groups: Sequence[Sequence[int]],
    param_bytes: int,
    required_bytes: int,
    *,
    max_group_size: int | None = None,
) -> BuddyPlan:
    """Algorithm 1 (KunServe's choice): merge the smallest groups until enough is freed.

    Starting from ``groups`` (singletons for a fresh drop; the current groups
    to merge further on a second throttle, never splitting one), a heap pops
    the two smallest groups (ties: the group whose smallest id is lowest),
    merges them and pushes the result, while more than one group remains and
    the freed bytes are below ``required_bytes``. Each merge frees exactly one
    more ``param_bytes``, so the plan makes the fewest merges that meet the
    requirement, and keeping groups small keeps pipelines shallow (from
    singletons the sizes stay within a factor of two of each other).
    ``O(N log N)`` for ``N`` instances.

    Args:
        groups: the starting configuration (disjoint, non-empty groups of ids).
        param_bytes: ``P``, the bytes of one replica's layer parameters.
        required_bytes: ``R``, the total extra bytes the configuration must
            free (counting what ``groups`` already free).
        max_group_size: optional cap on group size (pass the layer count);
            when the two smallest groups cannot merge under it, no pair can,
            and the plan stops unmet.

    Returns:
        The plan, ``strategy="throughput-greedy"``; ``met`` is False when even
        one group (or the cap) cannot free ``R``.
    """
    start = _normalize_groups(groups)
    p = _as_bytes("param_bytes", param_bytes)
    required = _as_bytes("required_bytes", required_bytes)
    cap = _as_cap(max_group_size, start)
    heap: list[tuple[int, int, list[int]]] = [(len(g), g[0], list(g)) for g in start]
    heapq.heapify(heap)
    freed = sum(len(g) - 1 for g in start) * p
    while len(heap) > 1 and freed < required:
        first = heapq.heappop(heap)
        second = heapq.heappop(heap)
        if cap is not None and first[0] + second[0] > cap:
            heapq.heappush(heap, first)
            heapq.heappush(heap, second)
            break
        merged = first[2] + second[2]
        heapq.heappush(heap, (len(merged), min(first[1], second[1]), merged))
        freed += p
    return _make_plan([entry[2] for entry in heap], p, required, THROUGHPUT_GREEDY)


def memory_greedy(
    groups: Sequence[Sequence[int]],
    param_bytes: int,
    required_bytes: int,
    kv_region_bytes: int,
    *,
    max_group_size: int | None = None,
) -> BuddyPlan:
    """The paper's memory-greedy alternative: grow big groups for more droppable memory.

    The paper: "prioritizes the configuration with more droppable parameter
    memory ... group as many instances as possible ... terminate when the
    additional memory exceeds the original KVCache region". Implemented as:
    ``target = max(required_bytes, kv_region_bytes)``; while more than one
    group remains and the freed bytes are below ``target``, merge the
    smallest group (ties: lowest smallest id) into the largest other group
    (ties: lowest smallest id), so one group grows into a deep pipeline.
    "Exceeds" is read as ``freed >= target``. ``O(N log N)`` comparisons.

    Args:
        groups: the starting configuration, as for :func:`throughput_greedy`.
        param_bytes: ``P``.
        required_bytes: ``R``, total extra bytes needed (``met`` still means
            ``freed >= R``).
        kv_region_bytes: the original KV-cache region, in the same scope as
            ``R`` (cluster-wide: the sum over the planned instances of the KV
            region each had before any drop). Stopping there means the KV
            capacity at most doubles, since doubling it does not double
            throughput.
        max_group_size: optional cap; the smallest group then merges into the
            largest group it fits in, and the plan stops when it fits in none
            (then no pair fits).

    Returns:
        The plan, ``strategy="memory-greedy"``.
    """
    start = _normalize_groups(groups)
    p = _as_bytes("param_bytes", param_bytes)
    required = _as_bytes("required_bytes", required_bytes)
    kv_region = _as_bytes("kv_region_bytes", kv_region_bytes)
    cap = _as_cap(max_group_size, start)
    target = max(required, kv_region)
    total = sum(len(g) for g in start)
    limit_cap = total if cap is None else cap
    # Groups keyed by their smallest id; ``order`` sorted by (size, smallest id).
    members: dict[int, list[int]] = {g[0]: list(g) for g in start}
    order: list[tuple[int, int]] = sorted((len(g), g[0]) for g in start)
    freed = sum(len(g) - 1 for g in start) * p
    while len(order) > 1 and freed < target:
        small_size, small_id = order[0]
        room = limit_cap - small_size
        # Candidates: the other groups of size <= room; take the largest, lowest id.
        hi = bisect_right(order, room, key=lambda entry: entry[0])
        if hi <= 1:
            break
        big_size = order[hi - 1][0]
        lo = bisect_left(order, big_size, lo=1, hi=hi, key=lambda entry: entry[0])
        _, big_id = order.pop(lo)
        order.pop(0)
        merged = members.pop(big_id)
        merged.extend(members.pop(small_id))  # in place: the big group grows, O(N) in all
        new_id = min(big_id, small_id)
        members[new_id] = merged
        insort(order, (len(merged), new_id))
        freed += p
    return _make_plan(list(members.values()), p, required, MEMORY_GREEDY)


def plan_drop(
    strategy: str,
    groups: Sequence[Sequence[int]],
    param_bytes: int,
    required_bytes: int,
    kv_region_bytes: int,
    *,
    max_group_size: int | None = None,
) -> BuddyPlan:
    """Plan a drop with the named strategy.

    ``strategy`` is ``"throughput"`` (or ``"throughput-greedy"``, the paper's
    choice) or ``"memory"`` (or ``"memory-greedy"``); ``kv_region_bytes`` is
    used by the memory-greedy strategy only.

    Raises:
        ConfigError: an unknown strategy or a bad argument.
    """
    name = STRATEGIES.get(strategy.strip().lower()) if isinstance(strategy, str) else None
    if name is None:
        raise ConfigError(
            f"unknown KunServe drop strategy {strategy!r}; expected 'throughput' or 'memory'"
        )
    if name == THROUGHPUT_GREEDY:
        _as_bytes("kv_region_bytes", kv_region_bytes)
        return throughput_greedy(groups, param_bytes, required_bytes, max_group_size=max_group_size)
    return memory_greedy(
        groups, param_bytes, required_bytes, kv_region_bytes, max_group_size=max_group_size
    )


def check_one_copy(plan: BuddyPlan, num_layers: int) -> None:
    """Assert the one-copy invariant of a plan.

    Every instance is in exactly one group, and within each group the members'
    layer ranges (:meth:`BuddyPlan.assignment`) are non-empty and cover every
    layer ``0..num_layers`` exactly once.

    Raises:
        AssertionError: the invariant does not hold (raised explicitly, so it
            also works under ``python -O``).
        ConfigError: ``num_layers < 1``.
    """
    layers = _as_int("num_layers", num_layers, 1)
    owner: dict[int, int] = {}
    for index, group in enumerate(plan.groups):
        if not group:
            raise AssertionError(f"group {index} is empty")
        for iid in group:
            if iid in owner:
                raise AssertionError(f"instance {iid} is in groups {owner[iid]} and {index}")
            owner[iid] = index
        if len(group) > layers:
            raise AssertionError(
                f"group {group} has {len(group)} stages but the model has {layers} layers"
            )
    held = plan.assignment(layers)
    for group in plan.groups:
        count = np.zeros(layers, dtype=np.int64)
        for iid in group:
            lo, hi = held[iid]
            if not 0 <= lo < hi <= layers:
                raise AssertionError(f"instance {iid} holds bad layer range [{lo}, {hi})")
            count[lo:hi] += 1
        if not np.all(count == 1):
            missing = np.flatnonzero(count == 0).tolist()
            doubled = np.flatnonzero(count > 1).tolist()
            raise AssertionError(
                f"group {group} does not hold one copy: missing {missing}, repeated {doubled}"
            )


def layers_held(plan: BuddyPlan, num_layers: int) -> dict[int, int]:
    """Instance id -> how many of the ``num_layers`` layers it keeps under ``plan``."""
    return {iid: hi - lo for iid, (lo, hi) in plan.assignment(num_layers).items()}


# ---------------------------------------------------------------- monitor


class DemandMonitor:
    """The §4.3 drop trigger: extrapolate KV demand and capacity one horizon ahead.

    Per executor key, :meth:`observe` records ``(now, demand, capacity)``
    samples. *Demand* is the KV bytes the executor's running requests hold
    plus the KV bytes its head-of-line queued requests need, as Llumnix counts
    head-of-line queued requests; the caller computes it (how many queued
    requests count as head-of-line is its choice). *Capacity* is the HBM
    available to the KV cache, which grows when parameters are dropped.

    The paper uses "the increase rate of KVCache requirements and the change
    rate of available HBM" and triggers when usage "is about to exceed the
    available HBM in one second". Choices made here:

    * Rates are least-squares slopes over the samples of the last
      ``window_s`` seconds (a sample at exactly ``now - window_s`` is kept),
      but at least the two latest samples are always kept, so a slow sampler
      still has a rate. With fewer than two samples, or all at one time,
      rates are 0.
    * "Current" values are the latest sample; predictions are
      ``current + rate * horizon``, not clamped at 0.
    * Throttled means current demand > current capacity *or* predicted
      demand > predicted capacity (strict: demand equal to capacity fits).
    * Times per key must not decrease; an unknown key raises ConfigError.

    Args:
        window_s: sliding-window length, seconds (> 0). Default 1.0.
        horizon_s: default look-ahead of :meth:`predict`, :meth:`throttled`
            and :meth:`required_bytes`, seconds (>= 0). Default 1.0 (the paper's
            "one second").
    """

    def __init__(self, window_s: float = 1.0, horizon_s: float = 1.0) -> None:
        self.window_s = _as_real("window_s", window_s)
        if self.window_s <= 0:
            raise ConfigError(f"window_s must be > 0, got {self.window_s}")
        self.horizon_s = _as_real("horizon_s", horizon_s)
        # per key: the samples' times, demands and capacities, oldest first
        self._samples: dict[int, tuple[deque[float], deque[float], deque[float]]] = {}
        self._rates: dict[int, tuple[float, float]] = {}  # since the latest sample

    def observe(self, key: int, now: float, demand_bytes: float, capacity_bytes: float) -> None:
        """Record one sample of executor ``key`` and evict samples older than the window."""
        t = _as_real("now", now, None)
        demand = _as_real("demand_bytes", demand_bytes)
        capacity = _as_real("capacity_bytes", capacity_bytes)
        self._record(key, t, demand, capacity)

    def _record(self, key: int, t: float, demand: float, capacity: float) -> None:
        """:meth:`observe` of values already checked (finite, >= 0)."""
        got = self._samples.get(key)
        if got is None:
            got = self._samples[key] = (deque(), deque(), deque())
        times, demands, caps = got
        if times and t < times[-1]:
            raise ConfigError(
                f"executor {key}: sample time {t} is before the previous one {times[-1]}"
            )
        times.append(t)
        demands.append(demand)
        caps.append(capacity)
        self._rates.pop(key, None)
        oldest = t - self.window_s
        while len(times) > 2 and times[0] < oldest:
            times.popleft()
            demands.popleft()
            caps.popleft()

    def samples(self, key: int) -> tuple[tuple[float, float, float], ...]:
        """The ``(time, demand, capacity)`` samples of ``key`` in the window, oldest first."""
        return tuple(zip(*self._get(key), strict=True))

    def rates(self, key: int) -> tuple[float, float]:
        """Least-squares slopes ``(demand rate, capacity rate)``, bytes per second."""
        got = self._rates.get(key)
        if got is None:
            times, demands, caps = self._get(key)
            # _slope's arithmetic, the time deviations shared by both rates
            n = len(times)
            got = (0.0, 0.0)
            if n >= 2:
                t_mean = sum(times) / n
                dts = [t - t_mean for t in times]
                den = sum([d * d for d in dts])
                if den > 0.0:
                    d_mean = sum(demands) / n
                    rate = sum([d * (v - d_mean) for d, v in zip(dts, demands, strict=True)])
                    cap_rate = 0.0  # capacity moves only on drops and restores
                    if caps.count(caps[0]) != n:
                        c_mean = sum(caps) / n
                        cap_rate = sum([d * (v - c_mean) for d, v in zip(dts, caps, strict=True)])
                    got = rate / den, cap_rate / den
            self._rates[key] = got
        return got

    def predict(self, key: int, horizon_s: float | None = None) -> tuple[float, float]:
        """``(demand, capacity)`` extrapolated ``horizon_s`` seconds past the latest sample."""
        horizon = self._horizon(horizon_s)
        demand, capacity = self._latest(key)
        demand_rate, capacity_rate = self.rates(key)
        return demand + demand_rate * horizon, capacity + capacity_rate * horizon

    def throttled(self, key: int, horizon_s: float | None = None) -> bool:
        """Whether ``key`` is, or within ``horizon_s`` will be, short of KV memory."""
        demand, capacity = self._latest(key)
        if demand > capacity:
            return True
        horizon = self._horizon(horizon_s)
        demand_rate, capacity_rate = self.rates(key)
        return demand + demand_rate * horizon > capacity + capacity_rate * horizon

    def required_bytes(self, key: int, horizon_s: float | None = None) -> float:
        """Extra bytes ``key`` needs: the larger of the predicted and current shortfall, >= 0."""
        demand, capacity = self._latest(key)
        future_demand, future_capacity = self.predict(key, horizon_s)
        return max(0.0, future_demand - future_capacity, demand - capacity)

    def observe_each(
        self, key: int, times: Sequence[float], demand_bytes: float, capacity_bytes: float
    ) -> None:
        """:meth:`observe` of one ``(demand, capacity)`` at each of ``times``
        (increasing). Only the samples the window keeps are recorded: the
        others would be evicted by the last one (the two latest are kept in
        any case), so the samples are those of one :meth:`observe` per time."""
        demand = _as_real("demand_bytes", demand_bytes)
        capacity = _as_real("capacity_bytes", capacity_bytes)
        if len(times) > 2:
            first = bisect_left(times, times[-1] - self.window_s)
            times = times[min(first, len(times) - 2) :]
        for t in times:
            self._record(key, _as_real("now", t, None), demand, capacity)

    def forget(self, key: int) -> None:
        """Drop every sample of ``key`` (an unknown key is a no-op)."""
        self._samples.pop(key, None)
        self._rates.pop(key, None)

    def _get(self, key: int) -> tuple[deque[float], deque[float], deque[float]]:
        samples = self._samples.get(key)
        if not samples or not samples[0]:
            raise ConfigError(f"executor {key} has no samples; call observe() first")
        return samples

    def _latest(self, key: int) -> tuple[float, float]:
        """The latest sample's ``(demand, capacity)``."""
        _, demands, caps = self._get(key)
        return demands[-1], caps[-1]

    def _horizon(self, horizon_s: float | None) -> float:
        return self.horizon_s if horizon_s is None else _as_real("horizon_s", horizon_s)


def should_restore(
    demand_bytes: float,
    restored_capacity_bytes: float,
    threshold: float = DEFAULT_RESTORE_THRESHOLD,
) -> bool:
    """Whether a drop can be undone: ``demand <= threshold * restored capacity``.

    The paper restores "when the memory demand decreases" without a rule; this
    is a hysteresis rule. ``restored_capacity_bytes`` is the KV capacity the
    executor(s) would have with their parameters restored (smaller than the
    current one); a threshold below 1 (callers use 0.5) leaves headroom, so a
    restore is not immediately followed by another drop.

    Raises:
        ConfigError: negative bytes or ``threshold`` outside ``(0, 1]``.
    """
    demand = _as_real("demand_bytes", demand_bytes)
    capacity = _as_real("restored_capacity_bytes", restored_capacity_bytes)
    fraction = _as_real("threshold", threshold)
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"threshold must be in (0, 1], got {fraction}")
    return _low(demand, capacity, fraction)


def _low(demand: float, capacity: float, fraction: float) -> bool:
    """:func:`should_restore`'s rule on checked values."""
    return demand <= fraction * capacity


# ---------------------------------------------------------------- dispatcher


def max_batch(decode_time: Callable[[int], float], limit: int, slowdown: float = 2.0) -> int:
    """The §4.3 per-instance maximum batch, from a cost model's decode time.

    The paper profiles the limit offline so that a dropped instance does not
    queue behind a batch its compute cannot serve, without a rule. Here it is
    the largest ``b`` in ``1..limit`` whose decode step time
    ``decode_time(b) <= slowdown * decode_time(1)``. ``decode_time`` is
    assumed non-decreasing in the batch size (true of the cost models), which
    makes the feasible sizes a prefix, found by binary search with
    ``O(log limit)`` calls. Batch size 1 always qualifies.

    Raises:
        ConfigError: ``limit < 1``, ``slowdown < 1`` or a negative or
            non-finite ``decode_time(1)``.
    """
    top = _as_int("limit", limit, 1)
    factor = _as_real("slowdown", slowdown)
    if factor < 1.0:
        raise ConfigError(f"slowdown must be >= 1, got {factor}")
    base = decode_time(1)
    if not math.isfinite(base) or base < 0:
        raise ConfigError(f"decode_time(1) must be finite and >= 0, got {base}")
    budget = factor * base
    lo, hi = 1, top  # decode_time(lo) <= budget; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_time(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class ExecutorLoad:
    """One executor's load as the dispatcher sees it after a drop.

    Attributes:
        key: executor key (an instance, or a buddy group's entry instance).
        running: requests in its running batch (never moved).
        waiting: queued request ids, in queue order (head first).
        max_batch: its maximum batch (:func:`max_batch`), >= 1.
        free_tokens: KV tokens it can give to requests moved to it: its free
            KV tokens after its own queue is provided for (the caller
            computes it).
        waiting_tokens: KV tokens each waiting request needs, same order.
    """

    key: int
    running: int
    waiting: tuple[int, ...]
    max_batch: int
    free_tokens: int
    waiting_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "waiting", tuple(self.waiting))
        object.__setattr__(self, "waiting_tokens", tuple(self.waiting_tokens))
        where = f"executor {self.key}"
        _as_int(f"{where}: running", self.running, 0)
        _as_int(f"{where}: max_batch", self.max_batch, 1)
        _as_int(f"{where}: free_tokens", self.free_tokens, 0)
        if len(self.waiting) != len(self.waiting_tokens):
            raise ConfigError(
                f"{where}: {len(self.waiting)} waiting requests but "
                f"{len(self.waiting_tokens)} waiting_tokens"
            )
        if len(set(self.waiting)) != len(self.waiting):
            raise ConfigError(f"{where}: a request id appears twice in its queue")
        for tokens in self.waiting_tokens:
            _as_int(f"{where}: waiting_tokens", tokens, 0)

    @property
    def slots(self) -> int:
        """Queued requests its batch can still take: ``max(0, max_batch - running)``."""
        return max(0, self.max_batch - self.running)


def rebalance_may_move(counts: Iterable[tuple[int, int, int]]) -> bool:
    """Whether :func:`rebalance` could move anything, from each executor's
    ``(running, waiting, max_batch)`` counts alone: only if some executor is
    overflowed (more waiting than its slots) and another is spare (``running
    + waiting < max_batch``). A backend checks this before building the full
    :class:`ExecutorLoad` records (every queued request's tokens): under a
    long burst every queue overflows and none is spare, so nothing would move.
    """
    overflow = spare = False
    for running, waiting, batch in counts:
        slots = max(0, batch - running)
        if waiting > slots:
            overflow = True
        elif running + waiting < batch:
            spare = True
        if overflow and spare:
            return True
    return False


def rebalance(loads: Sequence[ExecutorLoad]) -> list[tuple[int, int, int]]:
    """The §4.3 dispatcher re-balance after a drop: move overflowed requests to spare executors.

    * **Overflow** of an executor: its waiting requests beyond the
      ``max_batch - running`` slots its batch has left, taken from the *tail*
      of its queue (the head keeps its place). Running requests are never
      moved (their KV cache stays; victims are served by KV exchange).
    * **Spare** executors: ``running + len(waiting) < max_batch``, with
      ``max_batch - running - len(waiting)`` free slots and ``free_tokens``.
    * Overflowed requests are placed in the order they appear (``loads``
      order, then queue order; the records carry no arrival times). Each
      goes to the spare executor with the most slots left whose tokens left
      (``free_tokens`` minus the tokens already moved there) cover its
      ``waiting_tokens``; ties go to the lowest key. A request that fits
      nowhere stays where it is (the caller may scale out).

    No executor is both overflowed and spare, so nothing moves to its own
    executor, and no target goes over its slots or tokens. ``O(M * S)`` for
    ``M`` overflowed requests and ``S`` spare executors.

    Returns:
        ``(request_id, from_key, to_key)`` per move, in placement order.

    Raises:
        ConfigError: duplicate executor keys or a request id in two queues.
    """
    keys: set[int] = set()
    requests: set[int] = set()
    overflow: list[tuple[int, int, int]] = []  # (request id, from key, tokens)
    spare: dict[int, list[int]] = {}  # key -> [slots left, tokens left]
    for load in loads:
        if load.key in keys:
            raise ConfigError(f"executor key {load.key} appears twice in the loads")
        keys.add(load.key)
        for rid in load.waiting:
            if rid in requests:
                raise ConfigError(f"request {rid} is queued on more than one executor")
            requests.add(rid)
        slots = load.slots
        if len(load.waiting) > slots:
            tail = zip(load.waiting[slots:], load.waiting_tokens[slots:], strict=True)
            overflow.extend((rid, load.key, tokens) for rid, tokens in tail)
        elif load.running + len(load.waiting) < load.max_batch:
            spare[load.key] = [slots - len(load.waiting), load.free_tokens]
    moves: list[tuple[int, int, int]] = []
    for rid, source, tokens in overflow:
        best: int | None = None
        best_slots = 0
        for key, (slots_left, tokens_left) in spare.items():
            if slots_left <= 0 or tokens_left < tokens:
                continue
            if best is None or slots_left > best_slots or (slots_left == best_slots and key < best):
                best, best_slots = key, slots_left
        if best is None:
            continue
        spare[best][0] -= 1
        spare[best][1] -= tokens
        moves.append((rid, source, best))
    return moves


# ---------------------------------------------------------------- policy object


class KunExecutorView(Protocol):
    """One executor — a replica or a buddy group — as :class:`KunServePolicy` reads it.

    A backend implements this read-only view over what it owns (the
    simulator's executors; the runtime's worker reports), as
    :class:`~fleetserve.cluster.state.InstanceView` does for the other
    policies. The view answers "as of now"; the policy keeps nothing of it
    but the monitor samples and restore timers, keyed by :attr:`key`.

    KV amounts are in *tokens of all layers* (one token's K and V in every
    layer, ``kv_bytes_per_token`` bytes); a token of a pipelined group counts
    once, however its layers are spread over the stages::

        members       (a, b)            stage order
        held_layers   ((0, 24), (24, 48))
        replica_kv_bytes  (Ka, Kb)      each member's KV region as a replica
    """

    @property
    def key(self) -> int:
        """Executor id; never reused for another executor."""
        ...

    @property
    def members(self) -> tuple[int, ...]:
        """Instance ids in stage order (one id: a replica)."""
        ...

    @property
    def held_layers(self) -> tuple[tuple[int, int], ...]:
        """The half-open layer range each member holds now, in :attr:`members` order."""
        ...

    @property
    def replica_kv_bytes(self) -> tuple[int, ...]:
        """KV bytes each member has as a full replica (before any drop), same order."""
        ...

    @property
    def kv_used_tokens(self) -> int:
        """KV tokens its requests hold (running, prefilling, stalled, reserved)."""
        ...

    @property
    def kv_head_tokens(self) -> int:
        """KV tokens the head-of-line queued request needs (0: empty queue)."""
        ...

    @property
    def kv_queued_tokens(self) -> int:
        """KV tokens every queued request needs together."""
        ...

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens it holds when full, with the layers its members hold now."""
        ...

    @property
    def accepting(self) -> bool:
        """Whether the dispatcher still sends it requests (False while restoring)."""
        ...

    @property
    def stable(self) -> bool:
        """No merge, restore, KV transfer, swap or migration in progress: it may
        be merged into a buddy group or restored."""
        ...


@dataclass(frozen=True, slots=True)
class ExecutorSnapshot:
    """A plain :class:`KunExecutorView` (tests; backends that copy their state)."""

    key: int
    members: tuple[int, ...]
    held_layers: tuple[tuple[int, int], ...]
    replica_kv_bytes: tuple[int, ...]
    kv_used_tokens: int
    kv_head_tokens: int
    kv_queued_tokens: int
    kv_capacity_tokens: int
    accepting: bool = True
    stable: bool = True

    def __post_init__(self) -> None:
        for name in ("members", "held_layers", "replica_kv_bytes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "held_layers", tuple(tuple(r) for r in self.held_layers))
        if not self.members:
            raise ConfigError(f"executor {self.key} has no members")
        if not len(self.members) == len(self.held_layers) == len(self.replica_kv_bytes):
            raise ConfigError(
                f"executor {self.key}: {len(self.members)} members but "
                f"{len(self.held_layers)} held_layers and "
                f"{len(self.replica_kv_bytes)} replica_kv_bytes"
            )


class KunServePolicy:
    """KunServe's memory decisions: when and how to drop parameters, when to restore.

    The pure decision core behind the simulator (:mod:`fleetserve.sim.kun`)
    and the runtime's controller. It owns the §4.3 demand monitor (one
    :class:`DemandMonitor` over every executor) and the restore timers; the
    backend owns the mechanism (memory accounting, KV exchange, weight
    transfers, timing) and applies the returned actions. No clock, no
    torch, no randomness: ``now`` is passed in and ties are broken by
    instance id, so a run is deterministic whatever the seed.

    A backend, once per monitor interval:

    1. :meth:`observe` every executor (and each new one once its requests
       are placed on it — a sample of an empty executor would look like
       sudden growth to the next one);
    2. :meth:`plan` (or :meth:`plan_drops`, apply, then
       :meth:`decide_restore` per executor: the simulator applies a merge at
       once when its executors are idle, and the restore rule then sees the
       new group), and apply the actions in order;
    3. :meth:`forget` an executor when it is retired (merged, split).

    **Drop** (§4.3 "Online monitor and drop trigger", §4.1 Algorithm 1). An
    accepting executor is *flagged* when the monitor predicts its demand
    (KV in use + the head-of-line request, Llumnix's count) exceeds its
    capacity within ``horizon_s``. The memory requirement ``R`` is, summed
    over the flagged executors, the larger of the predicted shortfall and
    the shortfall of serving its whole queue now (a burst queues far more
    than one horizon of growth). The planner (``strategy``: throughput- or
    memory-greedy) merges the current groups, never splitting one, until
    the parameters freed cover ``R`` on top of what the current groups
    already free; the memory-greedy variant's KV region is the replicas'
    KV regions summed over every executor. Each new group becomes a
    :class:`~fleetserve.policy.actions.DropLayers` whose stages keep
    sub-ranges of what the members hold (:func:`stages_within`), so no
    member reloads a layer to merge; a group whose executors are not
    :attr:`~KunExecutorView.stable` (a merge, restore or KV transfer under
    way) or whose holdings admit no tiling is left for a later call. When
    the plan cannot meet ``R`` (too few groups, or ``num_layers`` stages
    already) an :class:`~fleetserve.policy.actions.ActivateSpare` comes
    first: §4.1 "we will scale a new instance for fallback".

    **Restore** (§4.2 "Live KVCache restore": the paper restores "when the
    memory demand decreases" without a rule). A stable group is *low* when
    its demand (KV in use + its whole queue) is at most
    ``restore_threshold`` of the KV capacity its members would have as
    replicas (:func:`should_restore`) and the monitor does not predict a
    throttle. It is restored once it has been low for ``restore_min_s``
    without a break (hysteresis: right after a drop the demand may still be
    low, and a dip inside a burst should not undo it). The timer restarts
    whenever the group is not low; while it is not stable (exchanging KV)
    the timer is left as it is.

    Args:
        model: the model's name (carried in the actions).
        num_layers: ``L``, layers of the model (every layer holds KV).
        param_bytes: ``P``, the droppable parameter bytes of one replica.
        kv_bytes_per_token: KV bytes of one token in every layer.
        strategy: ``"throughput"`` (Algorithm 1) or ``"memory"``.
        horizon_s: the trigger's look-ahead (the paper: one second).
        window_s: the monitor's sliding window.
        restore_threshold: see :func:`should_restore`, in ``(0, 1]``.
        restore_min_s: how long a group stays low before it is restored.
        restore_from: where dropped layers are reloaded from, ``"host"``
            or ``"peer"`` (carried in :class:`~fleetserve.policy.actions.Restore`).
    """

    def __init__(
        self,
        *,
        model: str,
        num_layers: int,
        param_bytes: int,
        kv_bytes_per_token: int,
        strategy: str = "throughput",
        horizon_s: float = 1.0,
        window_s: float = 1.0,
        restore_threshold: float = DEFAULT_RESTORE_THRESHOLD,
        restore_min_s: float = 20.0,
        restore_from: str = "host",
    ) -> None:
        self.model = model
        self.num_layers = _as_int("num_layers", num_layers, 1)
        self.param_bytes = _as_bytes("param_bytes", param_bytes)
        self.kv_bytes_per_token = _as_int("kv_bytes_per_token", kv_bytes_per_token, 1)
        if not isinstance(strategy, str) or strategy.strip().lower() not in STRATEGIES:
            raise ConfigError(
                f"unknown KunServe drop strategy {strategy!r}; expected 'throughput' or 'memory'"
            )
        self.strategy = strategy
        self.horizon_s = _as_real("horizon_s", horizon_s)
        self.restore_threshold = _as_real("restore_threshold", restore_threshold)
        if not 0.0 < self.restore_threshold <= 1.0:
            raise ConfigError(f"restore_threshold must be in (0, 1], got {self.restore_threshold}")
        self.restore_min_s = _as_real("restore_min_s", restore_min_s)
        if restore_from not in ("host", "peer"):
            raise ConfigError(f"restore_from must be 'host' or 'peer', got {restore_from!r}")
        self.restore_from = restore_from
        self.monitor = DemandMonitor(window_s=window_s, horizon_s=self.horizon_s)
        self._low_since: dict[int, float] = {}
        self._last_samples: list[tuple[int, float, float]] = []  # the latest observe's
        # per executor: its replica KV bytes (the view's tuple) and the tokens
        # they hold, kept while the view hands back the same tuple
        self._restored: dict[int, tuple[tuple[int, ...], int]] = {}

    # ------------------------------------------------------------ samples
    def observe(self, now: float, executors: Iterable[KunExecutorView]) -> None:
        """One monitor sample of each executor: demand = KV in use + the
        head-of-line request, capacity = its KV capacity, in bytes."""
        kvb = self.kv_bytes_per_token
        t = _as_real("now", now, None)
        record = self.monitor._record  # token counts are ints >= 0: nothing to check
        last = self._last_samples = []
        for e in executors:
            key = e.key
            demand = float((e.kv_used_tokens + e.kv_head_tokens) * kvb)
            capacity = float(e.kv_capacity_tokens * kvb)
            record(key, t, demand, capacity)
            last.append((key, demand, capacity))

    def observe_again(self, times: Sequence[float]) -> None:
        """The latest :meth:`observe`'s samples again at each of ``times``
        (increasing, after it): the monitor's ticks while its executors do
        not change (between two events)."""
        each = self.monitor.observe_each
        for key, demand, capacity in self._last_samples:
            each(key, times, demand, capacity)

    def quiet(self, executors: Iterable[KunExecutorView], *, spare: bool) -> bool:
        """Whether :meth:`plan_drops` (with ``spare``) and :meth:`decide_restore`
        return nothing and change nothing, now and at every later time while
        these executors stay as they are (the monitor's samples may come and
        go): no spare to start and fewer than two executors (nothing to
        merge), and each executor a replica, not stable, or a stable group
        with demand above the restore threshold (a rule of the executors'
        counts alone) and no restore timer running (else
        :meth:`decide_restore` clears it)."""
        views = list(executors)
        if spare or len(views) >= 2:
            return False
        return not any(
            len(e.members) > 1 and (e.key in self._low_since or self._low(e)) and e.stable
            for e in views
        )

    def _low(self, e: KunExecutorView) -> bool:
        """Whether ``e``'s demand is within the restore threshold of its
        capacity with its parameters restored (:func:`should_restore`)."""
        kvb = self.kv_bytes_per_token
        demand = e.kv_used_tokens + e.kv_queued_tokens
        rkb = e.replica_kv_bytes
        got = self._restored.get(e.key)
        if got is None or got[0] is not rkb:  # (a tuple is immutable: same one, same sum)
            got = self._restored[e.key] = (rkb, sum(b // kvb for b in rkb))
        # token counts are ints >= 0, the threshold checked at construction
        return _low(float(demand), float(got[1]), self.restore_threshold)

    def forget(self, key: int) -> None:
        """Executor ``key`` is gone: drop its samples and restore timer."""
        self.monitor.forget(key)
        self._low_since.pop(key, None)
        self._restored.pop(key, None)

    def low_since(self, key: int) -> float | None:
        """Since when group ``key`` has been low (None: it is not, or never checked)."""
        return self._low_since.get(key)

    # -------------------------------------------------------------- plans
    def plan(
        self,
        now: float,
        executors: Iterable[KunExecutorView],
        rng: np.random.Generator | None = None,
    ) -> list[KunAction]:
        """Drop and restore decisions on one view of the executors.

        :meth:`plan_drops`, then :meth:`decide_restore` for every executor
        that no returned :class:`~fleetserve.policy.actions.DropLayers`
        merges (an executor is never both dropped and restored in one call).
        ``rng`` is accepted for the policy interface; no decision is random.
        """
        del rng  # deterministic: ties are broken by instance id
        views = list(executors)
        actions: list[KunAction] = list(self.plan_drops(now, views))
        merging = {k for a in actions if isinstance(a, DropLayers) for k in a.sources}
        for e in views:
            if e.key in merging:
                continue
            restore = self.decide_restore(now, e)
            if restore is not None:
                actions.append(restore)
        return actions

    def plan_drops(
        self, now: float, executors: Iterable[KunExecutorView], *, spare: bool = True
    ) -> list[DropLayers | ActivateSpare]:
        """The drop decision (see the class docstring): an
        :class:`~fleetserve.policy.actions.ActivateSpare` first when the plan
        falls short, then one :class:`~fleetserve.policy.actions.DropLayers`
        per new buddy group, in the plan's group order. Empty when no
        accepting executor is flagged.

        ``spare=False`` tells the policy no spare instance could be started;
        with fewer than two executors nothing can then be merged or started,
        and the answer is empty without judging the throttling (what it would
        return otherwise is at most an ``ActivateSpare`` that cannot be served).

        Every executor must have been observed (``now`` is that of the
        latest samples; the monitor's samples carry their own times).

        Raises:
            ConfigError: an executor without samples.
        """
        views = list(executors)
        if not spare and len(views) < 2:
            return []
        mon, horizon, kvb = self.monitor, self.horizon_s, self.kv_bytes_per_token
        flagged = [e for e in views if e.accepting and mon.throttled(e.key)]  # its horizon is ours
        if not flagged:
            return []
        need = 0.0
        for e in flagged:
            queued = (e.kv_used_tokens + e.kv_queued_tokens - e.kv_capacity_tokens) * kvb
            need += max(mon.required_bytes(e.key, horizon), float(queued))
        groups = [e.members for e in views]
        current = freed_bytes(groups, self.param_bytes)
        kv_region = sum(b for e in views for b in e.replica_kv_bytes)
        plan = plan_drop(
            self.strategy,
            groups,
            self.param_bytes,
            int(current + need),
            int(kv_region),
            max_group_size=self.num_layers,
        )
        actions: list[DropLayers | ActivateSpare] = []
        if not plan.met:
            actions.append(ActivateSpare(self.model, plan.required_bytes - plan.freed_bytes))
        owner = {m: e for e in views for m in e.members}
        held = {m: r for e in views for m, r in zip(e.members, e.held_layers, strict=True)}
        for group in plan.merges_from(groups):
            sources: list[KunExecutorView] = []
            for m in group:
                e = owner[m]
                if all(s.key != e.key for s in sources):
                    sources.append(e)
            if not all(e.stable for e in sources):
                continue
            stages = stages_within({m: held[m] for m in group}, self.num_layers)
            if stages is None:
                continue
            actions.append(
                DropLayers(
                    model=self.model,
                    num_layers=self.num_layers,
                    sources=tuple(e.key for e in sources),
                    members=tuple(m for m, _ in stages),
                    keep=tuple(r for _, r in stages),
                    drop=tuple(_outside(held[m], r) for m, r in stages),
                )
            )
        return actions

    def decide_restore(self, now: float, executor: KunExecutorView) -> Restore | None:
        """The restore rule for one executor (see the class docstring).

        Replicas and executors that are not stable return None and leave
        the timer as it is; otherwise the timer starts (or restarts) and a
        :class:`~fleetserve.policy.actions.Restore` comes once the group has
        been low for ``restore_min_s``.
        """
        e = executor
        if len(e.members) == 1 or not e.stable:
            return None
        if not self._low(e) or self.monitor.throttled(e.key):
            self._low_since.pop(e.key, None)
            return None
        since = self._low_since.setdefault(e.key, now)
        if now - since < self.restore_min_s:
            return None
        del self._low_since[e.key]
        return Restore(
            executor=e.key,
            model=self.model,
            members=e.members,
            reload=tuple(_complement(r, self.num_layers) for r in e.held_layers),
            source=self.restore_from,
        )


def _outside(held: tuple[int, int], keep: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """The parts of ``held`` outside ``keep`` (``keep`` lies within ``held``)."""
    parts = []
    if held[0] < keep[0]:
        parts.append((held[0], keep[0]))
    if keep[1] < held[1]:
        parts.append((keep[1], held[1]))
    return tuple(parts)


def _complement(held: tuple[int, int], num_layers: int) -> tuple[tuple[int, int], ...]:
    """The layers of ``0..num_layers`` outside ``held``."""
    return _outside((0, num_layers), held)


class DispatchTarget(InstanceView, Protocol):
    """An executor as KunServe's dispatcher filters it: an instance view plus
    its pipeline degree, whether it accepts new requests, and its batch cap."""

    @property
    def k(self) -> int: ...

    accepting: bool
    max_batch: int


_T = TypeVar("_T", bound=DispatchTarget)


def dispatch_candidates(
    executors: Sequence[_T], prompt_blocks: int, *, batch_capped: bool
) -> list[_T]:
    """The executors a new request may go to; the stack's dispatch policy
    then picks among them (Worst-Fit, Llumnix's, in the paper's systems).

    KunServe §4.3: the global dispatcher load-balances among *accepting*
    executors (all of them when none accepts). Full replicas with room for the
    prompt come first: pipelined buddy groups are for what replicas cannot
    hold, and KunServe reverts to replicas as soon as queuing is relieved (a
    group that drew every request for its larger memory would never drain and
    restore). While buddy groups exist (``batch_capped``), executors below
    their maximum batch come first (the dispatcher's maximum batch limit).
    The paper gives the filters, not their order; this order (accepting,
    then replicas, then the batch cap) is the implementer's choice.

    Args:
        executors: every executor, in a fixed order (ties keep it).
        prompt_blocks: the prompt's KV blocks.
        batch_capped: buddy groups exist under KunServe's pressure policy.
    """
    cands = [e for e in executors if e.accepting] or list(executors)
    replicas = [e for e in cands if e.k == 1 and e.available_blocks >= prompt_blocks]
    if replicas and len(replicas) < len(cands):
        cands = replicas
    if batch_capped:
        cands = [e for e in cands if e.num_running + e.num_waiting < e.max_batch] or cands
    return cands
