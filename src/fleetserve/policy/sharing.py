"""Per-group batch schedulers for multi-LLM sharing groups (the ``batching`` family).

A sharing group hosts several services on one GPU group. At every scheduling
point (a job ended, a request arrived) the group asks its scheduler which
*jobs* to start: a job is one iteration of one service in one phase (a prefill
of some waiting requests, or one decode step of some running ones) on a
``share`` of the group's compute units. The group then runs them (see
:mod:`fleetserve.sim.group`): it allocates KV, times the job with the cost
model and calls back :meth:`GroupScheduler.on_job_end`.

Two kinds of compute sharing::

    temporal (FCFS, RR, MLFQ, DB)     spatial-temporal (ADBS)
    one job at a time, share 1.0      prefill of one service at a time, decode
                                      jobs of the others at once, each on a
    |A prefill|B dec|A dec|B dec|     share of the compute units
                                      |A prefill (0.6) ||B dec|B dec|B dec|
                                      |C dec (0.4)     ||C dec     |C dec|

Schedulers are pure: they read a :class:`GroupState` (the group implements
it) and return :class:`Job` records; clocks and randomness are passed in.
Memory is the group's: a scheduler admits prompts through a
:class:`GroupBudget` (``fits`` / ``take``) and
names victims when a decode step does not fit; ADBS also limits each
service's KV bytes through :meth:`GroupScheduler.kv_limit`.
"""

from __future__ import annotations

import heapq
import math
from abc import abstractmethod
from bisect import bisect_left, bisect_right
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from operator import attrgetter, is_
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar, cast

from fleetserve.errors import ConfigError
from fleetserve.policy.base import Policy
from fleetserve.policy.db_theory import db_priority
from fleetserve.policy.registry import Registry

__all__ = [
    "BATCHING",
    "DECODE",
    "PREFILL",
    "Adbs",
    "DoublingBudget",
    "GroupBudget",
    "GroupFcfs",
    "GroupScheduler",
    "GroupSeq",
    "GroupState",
    "Job",
    "RoundRobin",
    "ServiceStats",
    "SkipJoinMlfq",
    "admit_in_order",
]

PREFILL, DECODE = "prefill", "decode"
_S = TypeVar("_S")


class _Budget(Protocol):
    """A check/commit pair over requests (:class:`GroupBudget`, or a one-model
    instance's :class:`~fleetserve.policy.base.AdmissionBudget`)."""

    def fits(self, seq: Any, /) -> bool: ...
    def take(self, seq: Any, /) -> None: ...


_ID = attrgetter("id")
_DbKey = tuple[float, float, int]  # DB's order: (O_r, arrival, id)
_ARR = attrgetter("arrival_s")


def _same(a: Sequence[object], b: Sequence[object]) -> bool:
    """The same objects in the same order (identity, not equality)."""
    return len(a) == len(b) and all(map(is_, a, b))


class Job(NamedTuple):
    """One iteration of one service: ``phase`` of requests ``seqs`` on ``share``
    of the group's compute units. Immutable; a named tuple (made for every
    job a simulated group runs: cheaper to make than a frozen dataclass)."""

    model: str
    phase: str
    seqs: tuple[int, ...]
    share: float = 1.0


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """What a scheduler knows about a service before any request runs.

    Attributes:
        rate: mean request rate (req/s) the placement planned for.
        exec_mean_s: L̂_s, mean execution time of its requests alone on an
            idle group (profiled: the cost model over the trace's lengths).
        exec_std_s: σ_s, their standard deviation.
        kv_bytes_per_token: KV bytes one token of the model holds.
        prefill_s_per_token: prefill seconds per prompt token (MLFQ's
            skip-join estimate of a request's first iteration).
    """

    rate: float
    exec_mean_s: float
    exec_std_s: float
    kv_bytes_per_token: int
    prefill_s_per_token: float = 0.0


class GroupSeq(Protocol):
    """A request as a scheduler sees it (no output length: that is unknown)."""

    @property
    def id(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def arrival_s(self) -> float: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def generated(self) -> int: ...


class GroupState(Protocol):
    """A sharing group between iterations, as schedulers read it."""

    @property
    def models(self) -> Sequence[str]: ...
    @property
    def free_share(self) -> float:
        """Compute share not held by jobs in flight (1.0 when idle)."""
        ...

    @property
    def jobs_in_flight(self) -> int: ...
    def waiting(self, model: str) -> Sequence[GroupSeq]:
        """Requests without KV, in queue order (preempted ones at the head)."""
        ...

    def ready(self, model: str) -> Sequence[GroupSeq]:
        """Running requests (KV held) not in a job now, in admission order."""
        ...

    def busy(self, model: str, phase: str) -> bool:
        """Whether a job of ``model`` in ``phase`` is in flight."""
        ...

    def kv_used(self, model: str) -> int:
        """KV bytes the model's requests hold now."""
        ...

    def prefill_in_flight(self) -> bool: ...


class GroupBudget(Protocol):
    """The group's check/commit pair for admitting prompts to one prefill job
    (memory of the layout and the service's ``kv_limit``, batch room, token
    budget). ``take`` allocates the prompt's KV."""

    def fits(self, seq: GroupSeq) -> bool: ...
    def take(self, seq: GroupSeq) -> None: ...


class GroupScheduler(Policy):
    """Decides the jobs of one sharing group (see the module docstring).

    Attributes:
        spatial: True for spatial-temporal sharing (jobs run at once on
            shares); False: the group asks only when no job is in flight and
            every job gets the whole group.
    """

    spatial: ClassVar[bool] = False
    one_model: ClassVar[bool] = False
    """Whether a one-model instance (the single-model and KunServe worlds, the
    runtime's engine) can run it: its one-model case needs no per-service
    statistics, admits the queue in order while prompts fit (vLLM admission,
    :func:`admit_in_order`) and otherwise runs a decode step; its victim is
    :meth:`victim`. ``tests/test_batching_one_model.py`` checks that
    :meth:`schedule` agrees."""
    macro_step_safe: ClassVar[bool] = False
    """On a one-model instance: decisions depend only on queue order and free
    memory, so a fixed decode batch may advance several iterations at once."""
    decodes_past_queue: ClassVar[bool] = False
    """A queued prompt does not end a decode segment (:meth:`stable_iterations`).
    True for a scheduler that decodes only when the head of the queue it tried
    did not fit (FCFS, RR). Within a segment nothing arrives, nothing finishes
    and no request is preempted (the group allocates the segment's KV first),
    so the queues and the batch stay the same while the free KV only shrinks:
    that head fits at no boundary of the segment, and every step-by-step
    choice is the same decode. The single-model instance steps its decode
    segments past a queue the same way."""

    def setup(self, services: Mapping[str, ServiceStats], kv_capacity_bytes: int) -> None:
        """Called once per group before anything runs (services it hosts)."""
        self.services = dict(services)

    @abstractmethod
    def schedule(self, state: GroupState, budget: GroupBudget, now: float) -> list[Job]:
        """Jobs to start now (possibly none). A prefill job's requests must have
        been taken through ``budget`` (which allocates their KV)."""

    def victim(self, state: GroupState, model: str, running: Sequence[GroupSeq]) -> GroupSeq:
        """The running request of ``model`` to preempt (recompute) when a decode
        step does not fit: by default the one that arrived last (vLLM)."""
        return max(running, key=lambda s: (s.arrival_s, s.id))

    def kv_limit(self, model: str) -> float:
        """Most KV bytes ``model`` may hold (quota); unlimited by default."""
        return math.inf

    def kv_allows(self, model: str, used: float, extra: float, others: int) -> bool:
        """Whether a request of ``model`` may take ``extra`` more KV bytes while
        its service holds ``used`` bytes, ``others`` of its other requests
        holding KV (the rule every group enforces its quota with).

        Within the quota (:meth:`kv_limit`), always. Beyond it, only a request
        that is its service's only holder of KV (our choice; MuxServe is
        silent): quotas move only from services without queued requests
        (:meth:`Adbs.adapt`), so without it a request longer than its
        service's quota would wait for ever once every service has one
        queued, with memory free (the engine's tests found that deadlock on
        small arenas). One such request per service may exceed the quota by
        at most its own size.
        """
        return used + extra <= self.kv_limit(model) or others == 0

    def stable_iterations(
        self,
        state: GroupState,
        model: str,
        batch: Collection[GroupSeq],
        ends: Sequence[float],
        now: float,
    ) -> int:
        """How many of the decode iterations ``batch`` would run back to back
        (ending at ``ends``) this scheduler provably keeps choosing, given no
        arrival and no finish meanwhile (the group cuts the segment short on
        an arrival). Lets the simulator advance them as one job.

        Default: all of them when no other service has running requests and
        nothing is queued (or :attr:`decodes_past_queue`), else 1: then this
        batch is the only possible job.
        """
        models = state.models
        if not self.decodes_past_queue and any(state.waiting(m) for m in models):
            return 1
        if len(models) > 1 and any(state.ready(m) for m in models if m != model):
            return 1
        return len(ends)

    @property
    def keeps_lone_batch(self) -> bool:
        """Whether, on a group hosting one service, :meth:`stable_iterations`
        keeps every iteration it is offered (the default rule with
        :attr:`decodes_past_queue`: FCFS, RR), so a one-model group may skip
        the call per segment."""
        cls = type(self)
        return self.decodes_past_queue and cls.stable_iterations is GroupScheduler.stable_iterations

    @property
    def observes_jobs(self) -> bool:
        """Whether :meth:`on_job_end` or :meth:`on_job_ends` does anything
        (FCFS and RR keep no per-job state: a group may skip both calls)."""
        cls = type(self)
        return (
            cls.on_job_end is not GroupScheduler.on_job_end
            or cls.on_job_ends is not GroupScheduler.on_job_ends
        )

    def on_arrival(self, seq: GroupSeq, now: float) -> None:
        """A request joined the group's queue."""

    def on_job_end(self, job: Job, seqs: Sequence[GroupSeq], duration_s: float, now: float) -> None:
        """A job ended after ``duration_s``; ``seqs`` are its requests still live."""

    def on_job_ends(
        self, job: Job, seqs: Sequence[GroupSeq], ends: Sequence[float], start: float
    ) -> None:
        """Iterations of ``job`` ended one after another at ``ends`` (the first
        began at ``start``), all with the same requests ``seqs`` and no other
        event in between (a macro job's iterations but its last). Equals
        ``on_job_end(job, seqs, t - prev, t)`` for each end ``t`` in order (the
        default); a scheduler may apply them at once."""
        if type(self).on_job_end is GroupScheduler.on_job_end:
            return  # each would be a no-op (FCFS, RR): a macro job's ends cost nothing
        prev = start
        for t in ends:
            self.on_job_end(job, seqs, t - prev, t)
            prev = t

    def on_finish(self, seq: GroupSeq) -> None:
        """A request finished or left the group."""


BATCHING: Registry[GroupScheduler] = Registry("batching")
"""The batching policies of every world (one registry: FCFS, RR, MLFQ, DB, ADBS)."""


def admit_in_order(waiting: Iterable[_S], budget: _Budget) -> list[_S]:
    """vLLM admission: in queue order while the head fits (no skipping). The
    one admission rule of every batching policy (each passes its own order)
    and of every world (a one-model instance's budget works the same way)."""
    out: list[_S] = []
    for s in waiting:
        if not budget.fits(s):
            break
        budget.take(s)
        out.append(s)
    return out


_ID = attrgetter("id")


def _job(model: str, phase: str, seqs: Sequence[GroupSeq], share: float = 1.0) -> Job:
    return Job(model, phase, tuple(map(_ID, seqs)), share)


@BATCHING.register("fcfs")
class GroupFcfs(GroupScheduler):
    """First-come-first-served across the group's services (vLLM; AlpaServe's
    temporal sharing).

    The next iteration serves the service of the earliest-arrived waiting
    request if its head-of-queue prompt fits (a prefill of that service's
    queue in order, as vLLM admits), else a decode step of the service whose
    running requests include the earliest arrival. With one service this is
    vLLM: prefill first while prompts fit, else decode. Across services it
    keeps FCFS's head-of-line blocking, which SeaLLM's Fig. 2 illustrates.
    """

    one_model = True
    macro_step_safe = True
    decodes_past_queue = True

    def schedule(self, state: GroupState, budget: GroupBudget, now: float) -> list[Job]:
        heads = [(q[0].arrival_s, q[0].id, m) for m in state.models if (q := state.waiting(m))]
        if heads:
            _, _, m = min(heads)
            got = admit_in_order(state.waiting(m), budget)
            if got:
                return [_job(m, PREFILL, got)]
        ready = [(m, r) for m in state.models if (r := state.ready(m))]
        if not ready:
            return []
        if len(ready) == 1:  # one service has running requests: its decode
            m, r = ready[0]
        else:  # the service whose running requests include the earliest arrival
            _, _, m, r = min(
                (min(s.arrival_s for s in r), i, m, r) for i, (m, r) in enumerate(ready)
            )
        return [_job(m, DECODE, r)]


@BATCHING.register("rr")
class RoundRobin(GroupScheduler):
    """Round-robin over the group's services, one iteration each in turn.

    Each turn goes to the next service (after the last one served) with work;
    it runs a prefill of its queue if the head prompt fits, else a decode step
    of its running requests.
    """

    one_model = True
    decodes_past_queue = True

    def __init__(self) -> None:
        super().__init__()
        self._last = -1

    def schedule(self, state: GroupState, budget: GroupBudget, now: float) -> list[Job]:
        models = list(state.models)
        n = len(models)
        for k in range(1, n + 1):
            i = (self._last + k) % n
            m = models[i]
            got = admit_in_order(state.waiting(m), budget) if state.waiting(m) else []
            if got:
                self._last = i
                return [_job(m, PREFILL, got)]
            ready = state.ready(m)
            if ready:
                self._last = i
                return [_job(m, DECODE, ready)]
        return []


@BATCHING.register("mlfq")
class SkipJoinMlfq(GroupScheduler):
    """FastServe's skip-join multi-level feedback queue, per group.

    Level ``k`` has quantum ``q0 * 2**k``. An arriving request skips to the
    highest level whose quantum covers its first iteration (its prefill,
    estimated from the service's profiled seconds per prompt token); each
    iteration a request takes part in counts against its quantum, and a
    request that used it up drops one level. The next iteration serves the
    highest-priority request (lowest level, then earliest arrival) and
    batches the same service and phase in priority order; other services'
    requests wait. A request not served for ``starve_s`` seconds is promoted
    to level 0 (FastServe's starvation guard). Victims are the lowest priority.

    Args:
        q0_s: quantum of level 0 (default 0.05 s, about one large iteration).
        levels: number of levels.
        starve_s: promotion threshold.
    """

    def __init__(self, q0_s: float = 0.05, levels: int = 8, starve_s: float = 10.0) -> None:
        super().__init__()
        if q0_s <= 0 or levels < 1 or starve_s <= 0:
            raise ConfigError("mlfq: q0_s, levels and starve_s must be positive")
        self.q0 = q0_s
        self.levels = levels
        self.starve_s = starve_s
        self._level: dict[int, int] = {}
        self._used: dict[int, float] = {}
        self._last: dict[int, float] = {}

    def on_arrival(self, seq: GroupSeq, now: float) -> None:
        st = self.services[seq.model]
        first = st.prefill_s_per_token * seq.prompt_tokens
        k = 0
        while k < self.levels - 1 and self.q0 * 2**k < first:
            k += 1
        self._level[seq.id] = k
        self._used[seq.id] = 0.0
        self._last[seq.id] = now

    def _key(self, s: GroupSeq, now: float) -> tuple[int, float, int]:
        lvl = self._level.get(s.id, 0)
        if now - self._last.get(s.id, now) > self.starve_s:
            lvl = 0
        return (lvl, s.arrival_s, s.id)

    def schedule(self, state: GroupState, budget: GroupBudget, now: float) -> list[Job]:
        best: tuple[tuple[int, float, int], str, str] | None = None
        for m in state.models:
            for phase, seqs in ((PREFILL, state.waiting(m)), (DECODE, state.ready(m))):
                for s in seqs:
                    k = self._key(s, now)
                    if best is None or k < best[0]:
                        best = (k, m, phase)
        if best is None:
            return []
        _, m, phase = best
        if phase == DECODE:
            return [_job(m, DECODE, state.ready(m))]
        order = sorted(state.waiting(m), key=lambda s: self._key(s, now))
        got = admit_in_order(order, budget)
        if got:
            return [_job(m, PREFILL, got)]
        # the top prompt does not fit: serve the best running requests instead
        decodable = [(self._key(s, now), mm) for mm in state.models for s in state.ready(mm)]
        if decodable:
            _, mm = min(decodable)
            return [_job(mm, DECODE, state.ready(mm))]
        return []

    def on_job_end(self, job: Job, seqs: Sequence[GroupSeq], duration_s: float, now: float) -> None:
        for s in seqs:
            used = self._used.get(s.id, 0.0) + duration_s
            lvl = self._level.get(s.id, 0)
            if used >= self.q0 * 2**lvl and lvl < self.levels - 1:
                self._level[s.id] = lvl + 1
                used = 0.0
            self._used[s.id] = used
            self._last[s.id] = now

    def victim(self, state: GroupState, model: str, running: Sequence[GroupSeq]) -> GroupSeq:
        return max(running, key=lambda s: self._key(s, math.inf))

    def on_finish(self, seq: GroupSeq) -> None:
        self._level.pop(seq.id, None)
        self._used.pop(seq.id, None)
        self._last.pop(seq.id, None)


class _Run:
    """Job ends DB has not applied yet: ``durations`` of consecutive jobs of
    the same requests ``seqs``, the last one ending at ``now``."""

    __slots__ = ("durations", "now", "seqs")

    def __init__(self, seqs: tuple[GroupSeq, ...], durations: list[float], now: float) -> None:
        self.seqs = seqs
        self.durations = durations
        self.now = now


def _same_run(snap: tuple[GroupSeq, ...], seqs: Sequence[GroupSeq]) -> bool:
    """``seqs`` holds the objects of ``snap`` in order (identity; this runs
    once per decode iteration, hence the short cases spelled out)."""
    n = len(snap)
    if len(seqs) != n:
        return False
    if n == 1:
        return seqs[0] is snap[0]
    if n == 2:
        return seqs[0] is snap[0] and seqs[1] is snap[1]
    return n == 0 or all(map(is_, seqs, snap))


class _Scan:
    """Every non-empty queue of a group as DB scans it, flattened: queue
    ``j`` (``labels[j]``: service and phase) holds positions
    ``[ends[j - 1], ends[j])`` of ``seqs``, ``ids``, ``ps`` (their ``O_r``) and
    ``served`` (last served; arrival when never). Per queue it keeps the
    smallest ``O_r`` and the earliest last-served time (computed when first
    asked for, kept up to date by :meth:`update`).

    Ties: every minimum is the *first* position holding it, which is what a
    request-by-request scan with strict comparisons keeps.
    """

    __slots__ = (
        "_best",
        "_first",
        "_minp",
        "_pos",
        "decode",
        "ends",
        "ids",
        "labels",
        "ps",
        "seqs",
        "served",
    )

    def __init__(
        self,
        labels: list[tuple[str, str]],
        seqs: list[GroupSeq],
        ids: list[int],
        ps: list[float],
        served: list[float],
        ends: list[int],
    ) -> None:
        self.labels = labels
        self.seqs = seqs
        self.ids = ids
        self.ps = ps
        self.served = served
        self.ends = ends
        self.decode = [j for j, (_, phase) in enumerate(labels) if phase == DECODE]
        self._best: int | None = None
        self._minp: list[float] | None = None
        self._first: list[float] | None = None
        self._pos: dict[int, int] | None = None

    def span(self, j: int) -> tuple[int, int]:
        """Positions ``[lo, hi)`` of queue ``j``."""
        return (self.ends[j - 1] if j else 0), self.ends[j]

    def queue_of(self, i: int) -> int:
        """The queue holding position ``i``."""
        return bisect_right(self.ends, i)

    def positions(self) -> dict[int, int] | None:
        """Position of each id (None: some id is queued twice)."""
        if self._pos is None:
            self._pos = dict(zip(self.ids, range(len(self.ids)), strict=True))
        return self._pos if len(self._pos) == len(self.ids) else None

    def update(self, changed: Mapping[int, tuple[float, float]]) -> None:
        """New ``(O_r, last served)`` of some positions."""
        queues = set()
        for i, (p, t) in changed.items():
            self.ps[i] = p
            self.served[i] = t
            queues.add(self.queue_of(i))
        self._best = None
        for j in queues:
            lo, hi = self.span(j)
            if self._minp is not None:
                self._minp[j] = min(self.ps[lo:hi])
            if self._first is not None:
                self._first[j] = min(self.served[lo:hi])

    def _per_queue(self, values: list[float]) -> list[float]:
        out = []
        lo = 0
        for hi in self.ends:
            out.append(min(values[lo:hi]))
            lo = hi
        return out

    def min_p(self) -> list[float]:
        """Each queue's smallest ``O_r``."""
        if self._minp is None:
            self._minp = self._per_queue(self.ps)
        return self._minp

    def first_served(self) -> list[float]:
        """Each queue's earliest last-served time."""
        if self._first is None:
            self._first = self._per_queue(self.served)
        return self._first

    def best_of(self, queues: Sequence[int]) -> int | None:
        """Position of the smallest key ``(O_r, arrival, id)`` in ``queues``
        (None: no queue)."""
        minp = self.min_p()
        if not queues:
            return None
        p = min([minp[j] for j in queues])
        holding = [j for j in queues if minp[j] == p]
        if len(holding) == 1:  # the usual case: one request has the smallest O_r
            lo, hi = self.span(holding[0])
            part = self.ps[lo:hi]
            if part.count(p) == 1:
                return lo + part.index(p)
        return min(t for j in holding for t in self.keyed(*self.span(j)) if t[0] == p)[3]

    def best(self) -> int:
        """Position of the smallest key overall."""
        if self._best is None:
            i = self.best_of(range(len(self.ends)))
            assert i is not None  # a scan has a queue
            self._best = i
        return self._best

    def keyed(self, lo: int, hi: int) -> list[tuple[float, float, int, int]]:
        """Positions ``[lo, hi)`` as ``(O_r, arrival, id, position)``, in order."""
        return list(
            zip(
                self.ps[lo:hi],
                map(_ARR, self.seqs[lo:hi]),
                self.ids[lo:hi],
                range(lo, hi),
                strict=True,
            )
        )


@BATCHING.register("db")
class DoublingBudget(GroupScheduler):
    """SeaLLM's doubling-budget (DB) scheduler (§4.2, Algorithm 2).

    Every request starts with a budget ``Q = L̂_s + σ_s`` of execution time
    (service ``s``'s profiled mean and standard deviation). Its priority is
    ``O_r = Q_r · L̂_s`` (:func:`~fleetserve.policy.db_theory.db_priority`;
    smaller runs first), where ``Q_r`` is the budget left: every iteration the
    request takes part in costs it that iteration's time. A request that uses
    up its budget gets a doubled one, ``2^k (L̂_s + σ_s)`` after the k-th
    renewal (Algorithm 2's UpdateBudget). Before every iteration the
    scheduler takes the highest-priority request, or a *starved* one first:
    a service whose oldest request has not been served for
    ``starvation_scale · L̂_s`` seconds (SeaLLM sets "a starvation threshold
    for each service" without a value; we scale it with L̂_s, default 5,
    SeaLLM's SLO scale). The batch has that request's phase and service only:
    its service's waiting (prefill) or running (decode) requests in priority
    order, as far as memory and the batch limit allow (Algorithm 2, lines
    17-20). The victim of a memory shortage is the lowest-priority request.

    Speed (SeaLLM's placement search simulates thousands of groups with it):
    job ends are recorded and applied in order just before anything reads
    the budgets (a macro job's iterations then cost one tight pass per
    request); the scan of every queue before each iteration runs as C-level
    ``map``/``min`` over all queues at once, and when the group's queues hold
    the same requests as at the last scan, only the requests whose state
    changed since are looked up again. All of it computes exactly what the
    plain request-by-request loops compute (see :meth:`_settle`,
    :meth:`_scan` and :meth:`schedule`).

    Args:
        starvation_scale: starvation threshold in units of L̂_s.
    """

    def __init__(self, starvation_scale: float = 5.0) -> None:
        super().__init__()
        if starvation_scale <= 0:
            raise ConfigError("db: starvation_scale must be positive")
        self.starvation_scale = starvation_scale
        self._budget: dict[int, float] = {}
        self._renewals: dict[int, int] = {}
        self._served: dict[int, float] = {}  # last time served (arrival at first)
        self._prio: dict[int, float] = {}  # O_r, kept up to date (budgets change at job ends)
        self._pending: list[_Run] = []  # job ends not applied yet, in order
        self._last: _Scan | None = None  # the last scan of the queues
        self._dirty: set[int] = set()  # requests whose state changed since

    def setup(self, services: Mapping[str, ServiceStats], kv_capacity_bytes: int) -> None:
        super().setup(services, kv_capacity_bytes)
        self._limit = {m: self.starvation_scale * st.exec_mean_s for m, st in services.items()}
        self._min_limit = min(self._limit.values(), default=math.inf)
        # per service: L̂_s and the first budget L̂_s + σ_s (the same floats as from the stats)
        self._mean = {m: st.exec_mean_s for m, st in services.items()}
        self._q0 = {m: st.exec_mean_s + st.exec_std_s for m, st in services.items()}
        self._last = None

    def on_arrival(self, seq: GroupSeq, now: float) -> None:
        self._settle()
        st = self.services[seq.model]
        q = st.exec_mean_s + st.exec_std_s
        self._budget[seq.id] = q
        self._renewals[seq.id] = 0
        self._served[seq.id] = now
        self._prio[seq.id] = db_priority(q, st.exec_mean_s)
        self._dirty.add(seq.id)

    def priority(self, seq: GroupSeq) -> float:
        """``O_r`` of ``seq`` now (smaller is served first)."""
        self._settle()
        st = self.services[seq.model]
        return db_priority(self._budget.get(seq.id, st.exec_mean_s + st.exec_std_s), st.exec_mean_s)

    def _key(self, s: GroupSeq) -> _DbKey:
        p = self._prio.get(s.id)
        return (self.priority(s) if p is None else p, s.arrival_s, s.id)

    # ------------------------------------------------------------ job ends
    def on_job_end(self, job: Job, seqs: Sequence[GroupSeq], duration_s: float, now: float) -> None:
        # recorded (as _record does, inlined: called once per iteration);
        # _settle applies it before anything reads the budgets
        pend = self._pending
        if pend:
            run = pend[-1]
            if _same_run(run.seqs, seqs):
                run.durations.append(duration_s)
                run.now = now
                return
        pend.append(_Run(tuple(seqs), [duration_s], now))

    def on_job_ends(
        self, job: Job, seqs: Sequence[GroupSeq], ends: Sequence[float], start: float
    ) -> None:
        if not ends:
            return
        prev = float(start)
        durations = []
        for end in ends:
            t = float(end)
            durations.append(t - prev)
            prev = t
        self._record(seqs, durations, prev)

    def _record(self, seqs: Sequence[GroupSeq], durations: Sequence[float], now: float) -> None:
        pend = self._pending
        if pend and _same_run(pend[-1].seqs, seqs):  # one more iteration of the last run
            run = pend[-1]
            run.durations.extend(durations)
            run.now = now
        else:
            pend.append(_Run(tuple(seqs), list(durations), now))

    def _settle(self) -> None:
        """Apply the recorded job ends in order. A run of ends of the same
        requests (a macro job's iterations) is applied request by request:
        the same subtractions in the same order, so the same floats, as
        applying them job by job (requests are independent)."""
        pend = self._pending
        if not pend:
            return
        self._pending = []
        for run in pend:
            seqs, durations = run.seqs, run.durations
            if len(durations) == 1 or len(set(map(_ID, seqs))) == len(seqs):
                self._apply(seqs, durations, run.now)
            else:  # a request twice in one job: job by job, exactly as they came
                for d in durations:
                    self._apply(seqs, (d,), run.now)

    def _apply(self, seqs: Sequence[GroupSeq], durations: Sequence[float], now: float) -> None:
        """``seqs`` took part in iterations of ``durations`` (in order), the
        last ending at ``now``."""
        budget, renewals = self._budget, self._renewals
        for s in seqs:
            sid, m = s.id, s.model
            q0 = self._q0[m]
            left = budget.get(sid, 0.0)
            for d in durations:
                left = left - d
                if left <= 0.0:  # used up: a doubled budget (Algorithm 2, UpdateBudget)
                    k = renewals.get(sid, 0) + 1
                    renewals[sid] = k
                    left = (2**k) * q0
            budget[sid] = left
            self._served[sid] = now
            self._prio[sid] = db_priority(left, self._mean[m])
            self._dirty.add(sid)

    def on_finish(self, seq: GroupSeq) -> None:
        self._settle()
        self._budget.pop(seq.id, None)
        self._renewals.pop(seq.id, None)
        self._served.pop(seq.id, None)
        self._prio.pop(seq.id, None)
        self._dirty.add(seq.id)

    # ----------------------------------------------------------------- scan
    def _scan(self, state: GroupState) -> _Scan | None:
        """Every non-empty queue (services in order, waiting before ready),
        flattened, with each request's ``O_r`` and last-served time (see
        :class:`_Scan`); None when all are empty.

        When the queues hold the same requests in the same places as at the
        last scan (the group asks :meth:`stable_iterations` right after
        :meth:`schedule`, and a decode step changes no queue), that scan is
        brought up to date instead: only the requests whose state changed
        since are looked up again."""
        self._settle()
        queues: list[Sequence[GroupSeq]] = []
        labels: list[tuple[str, str]] = []
        for m in state.models:
            w = state.waiting(m)
            if w:
                queues.append(w)
                labels.append((m, PREFILL))
            r = state.ready(m)
            if r:
                queues.append(r)
                labels.append((m, DECODE))
        if not queues:
            return None
        seqs = list(chain.from_iterable(queues))
        ends = list(accumulate(map(len, queues)))
        last, dirty = self._last, self._dirty
        if (
            last is not None
            and last.ends == ends
            and last.labels == labels
            and _same(last.seqs, seqs)
            and (not dirty or self._refresh(last))
        ):
            dirty.clear()
            return last
        dirty.clear()
        ids = list(map(_ID, seqs))
        try:
            ps = list(map(self._prio.__getitem__, ids))
        except KeyError:  # a request DB was not told about: its default priority
            ps = [self._key(x)[0] for x in seqs]
        try:
            served = list(map(self._served.__getitem__, ids))
        except KeyError:
            got = self._served
            served = [got.get(x.id, x.arrival_s) for x in seqs]
        self._last = sc = _Scan(labels, seqs, ids, ps, served, ends)
        return sc

    def _refresh(self, sc: _Scan) -> bool:
        """Look the requests of ``self._dirty`` up again in ``sc`` (the same
        queues); False (``sc`` unusable: scan afresh) when one of them has no
        state any more or some request is queued twice."""
        pos = sc.positions()
        if pos is None:
            return False
        prio, served = self._prio, self._served
        changed: dict[int, tuple[float, float]] = {}
        for rid in self._dirty:
            i = pos.get(rid)
            if i is None:
                continue  # not queued
            p = prio.get(rid)
            t = served.get(rid)
            if p is None or t is None:
                return False
            changed[i] = (p, t)
        if changed:
            sc.update(changed)
        return True

    def _first(self, sc: _Scan, j: int) -> Iterator[GroupSeq]:
        """Queue ``j`` in key order (``sorted(queue, key=self._key)``), one at a
        time: its best first, the rest sorted only if admission asks for more."""
        i = sc.best_of((j,))
        assert i is not None
        yield sc.seqs[i]
        rest = [t for t in sc.keyed(*sc.span(j)) if t[3] != i]
        heapq.heapify(rest)
        while rest:
            yield sc.seqs[heapq.heappop(rest)[3]]

    def schedule(self, state: GroupState, budget: GroupBudget, now: float) -> list[Job]:
        sc = self._scan(state)
        if sc is None:
            return []
        # the highest priority (smallest key) ...
        j = sc.queue_of(sc.best())
        # ... unless some request is starved (idle past its service's
        # threshold): the most starved one's queue. Per queue that is at its
        # earliest last-served time (``now - t - limit`` is monotone in ``t``,
        # IEEE rounding included); the first queue with the overall maximum
        # wins, as a strict ``>`` scan keeps. No queue has ``over > 0`` when
        # even the earliest time against the smallest limit has not (monotone)
        if now - min(sc.served) - self._min_limit > 0:
            limit = self._limit
            overs = [
                now - t - limit[m] for t, (m, _) in zip(sc.first_served(), sc.labels, strict=True)
            ]
            worst = max(overs)
            if worst > 0:
                j = overs.index(worst)
        m, phase = sc.labels[j]
        if phase == PREFILL:
            got = admit_in_order(self._first(sc, j), budget)
            if got:
                return [_job(m, PREFILL, got)]
            # no memory for the best prompt: run the best decodable batch
            # meanwhile (nothing was admitted: the scan still holds)
            i = sc.best_of(sc.decode)
            if i is None:
                return []
            j = sc.queue_of(i)
            m = sc.labels[j][0]
        order = sorted(sc.keyed(*sc.span(j)))
        return [_job(m, DECODE, [sc.seqs[t[3]] for t in order])]

    def victim(self, state: GroupState, model: str, running: Sequence[GroupSeq]) -> GroupSeq:
        self._settle()
        return max(running, key=self._key)

    def stable_iterations(
        self,
        state: GroupState,
        model: str,
        batch: Collection[GroupSeq],
        ends: Sequence[float],
        now: float,
    ) -> int:
        """DB keeps choosing a decode batch that holds the best request while
        (1) no request of the batch uses up its budget (its priority only
        drops until then, so it stays ahead of every request outside, whose
        priority is fixed), and (2) no request outside the batch reaches its
        starvation threshold. The iteration in which a budget runs out is the
        last one kept. A batch picked for starvation or as a fallback is
        stepped one iteration at a time."""
        n = len(ends)
        if n <= 1:
            return n
        # the batch must hold the best request now (not a starved or fallback pick)
        sc = self._scan(state)
        if sc is None:
            return 1
        inside = set(map(_ID, batch))
        if sc.ids[sc.best()] not in inside:
            return 1
        # (1): a budget ``left`` runs out at the end of iteration
        # bisect_left([t - now for t in ends], left), monotone in ``left``:
        # the smallest decides (bisect with a key probes the same values)
        lefts = list(map(self._budget.get, inside))
        if None in lefts:
            return 1
        left = min(cast(list[float], lefts))
        k = min(n, bisect_left(ends, left, key=lambda t: t - now) + 1)
        # (2): earliest time a request outside the batch starves (``t + limit``
        # is monotone in ``t``: per queue, its earliest last-served time)
        t_starve = math.inf
        first = sc.first_served()
        for j, (m, _) in enumerate(sc.labels):
            lo, hi = sc.span(j)
            ids = sc.ids[lo:hi]
            if inside.isdisjoint(ids):
                t = first[j]
            else:
                rest = [t for x, t in zip(ids, sc.served[lo:hi], strict=True) if x not in inside]
                if not rest:
                    continue
                t = min(rest)
            t_starve = min(t_starve, t + self._limit[m])
        if t_starve < math.inf:
            # iteration j (0-based) starts at ``now`` (j = 0) or ends[j - 1];
            # the decision before an iteration starting past t_starve may
            # differ. The starts ``[now, *ends[:-1]]`` ascend: the count of
            # those <= t_starve
            j = 0 if t_starve < now else 1 + bisect_right(ends, t_starve, 0, n - 1)
            k = min(k, max(1, j))
        return max(1, min(k, n))


@BATCHING.register("adbs")
class Adbs(GroupScheduler):
    """MuxServe's adaptive batch scheduling (Algorithm 3), spatial-temporal.

    * Prefill first: when no prefill job is in flight, the next service in
      round-robin order with a waiting prompt that fits its token-block quota
      starts a prefill job on ``prefill_share`` of the compute units (all
      free units when no decode work is left). If that share is not free yet
      (decode jobs hold it), the scheduler waits for it: no new decode job
      starts meanwhile (Algorithm 3's ``prefill_waiting``).
    * Decode fills the rest: services with running requests and no decode
      job in flight, in round-robin order, each start a decode step on an
      equal part of the free units, while memory and quotas allow.
    * Token-block quotas: each service may hold at most ``quota[m]`` KV bytes
      (``kv_limit``; the group enforces it, preempting within the service).
      They start proportional to ``rate × KV bytes per token`` (MuxServe: rate
      × blocks per token) over the group's KV capacity, and every
      ``period_s`` seconds services whose use is under ``low_use`` (90%) of
      their quota and who have no queued request give half of the unused
      part to the others (at or above ``low_use``, or with queued requests),
      split in proportion to their initial weights. A quota never drops below
      its service's use nor below ``floor`` (25%) of its initial value (so a
      service idle for a while can still admit its next request), and the
      quotas always sum to the capacity. MuxServe gives no numbers for the
      period or the amounts moved: these are our choices.

    Args:
        prefill_share: compute fraction of a prefill job (MuxServe gives a
            prefill most of the SMs; 0.6 by default).
        period_s: quota adaptation period.
        low_use: use/quota threshold below which a service donates.
        floor: a quota's least share of its initial value.
        min_share: least compute fraction a job starts on (our choice;
            MuxServe sizes MPS partitions in coarse steps). Decode jobs get
            equal parts of the free units, but no more jobs start than
            ``min_share`` parts fit; the others wait for a job to end.
    """

    spatial = True

    def __init__(
        self,
        prefill_share: float = 0.6,
        period_s: float = 5.0,
        low_use: float = 0.9,
        floor: float = 0.25,
        min_share: float = 0.1,
    ) -> None:
        super().__init__()
        if not 0 < prefill_share <= 1 or period_s <= 0 or not 0 < low_use <= 1:
            raise ConfigError("adbs: prefill_share and low_use in (0, 1], period_s > 0")
        if not 0 < min_share <= min(prefill_share, 1.0):
            raise ConfigError("adbs: min_share must be in (0, prefill_share]")
        self.min_share = min_share
        if not 0 <= floor <= 1:
            raise ConfigError("adbs: floor must be in [0, 1]")
        self.prefill_share = prefill_share
        self.period_s = period_s
        self.low_use = low_use
        self.floor = floor
        self._rr_prefill = -1
        self._rr_decode = -1
        self.quota: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._next_adapt = period_s

    def setup(self, services: Mapping[str, ServiceStats], kv_capacity_bytes: int) -> None:
        super().setup(services, kv_capacity_bytes)
        w = {m: max(st.rate, 1e-9) * st.kv_bytes_per_token for m, st in services.items()}
        total = sum(w.values())
        self._weight = {m: x / total for m, x in w.items()}
        self.quota = {m: kv_capacity_bytes * x for m, x in self._weight.items()}
        self._quota0 = dict(self.quota)
        self.capacity = float(kv_capacity_bytes)

    def kv_limit(self, model: str) -> float:
        return self.quota.get(model, math.inf)

    def adapt(self, state: GroupState) -> None:
        """Move quota from services under ``low_use`` to saturated ones."""
        use = {m: float(state.kv_used(m)) for m in state.models}
        donors = [
            m
            for m in state.models
            if use[m] < self.low_use * self.quota[m] and not state.waiting(m)
        ]
        takers = [m for m in state.models if m not in donors]
        if not donors or not takers:
            return
        pool = 0.0
        for m in donors:
            keep = max(use[m], self.floor * self._quota0[m])
            give = max(0.0, (self.quota[m] - keep) / 2)
            self.quota[m] -= give
            pool += give
        if pool <= 0.0:
            return
        wsum = sum(self._weight[m] for m in takers)
        for m in takers:
            self.quota[m] += pool * self._weight[m] / wsum
        # keep the sum exact despite rounding
        drift = self.capacity - sum(self.quota.values())
        self.quota[takers[0]] += drift

    def schedule(self, state: GroupState, budget: GroupBudget, now: float) -> list[Job]:
        if now >= self._next_adapt:
            self.adapt(state)
            while self._next_adapt <= now:
                self._next_adapt += self.period_s
        models = list(state.models)
        n = len(models)
        jobs: list[Job] = []
        free = state.free_share
        decode_work = [m for m in models if state.ready(m) and not state.busy(m, DECODE)]
        prefill_waiting = False
        if not state.prefill_in_flight():
            cands = [models[(self._rr_prefill + k) % n] for k in range(1, n + 1)]
            cands = [m for m in cands if state.waiting(m)]
            if cands:
                busy_decode = state.jobs_in_flight > 0 or bool(decode_work)
                need = self.prefill_share if busy_decode else 1.0
                prefill_waiting = True
                if free + 1e-12 >= need:
                    for m in cands:
                        got = admit_in_order(state.waiting(m), budget)
                        if got:
                            self._rr_prefill = models.index(m)
                            share = min(need, free) if busy_decode else free
                            jobs.append(_job(m, PREFILL, got, share))
                            free -= share
                            prefill_waiting = False
                            break
                    else:  # nothing fits its memory/quota: do not hold decodes back
                        prefill_waiting = False
        if prefill_waiting or free <= 1e-9:
            return jobs
        order = [models[(self._rr_decode + k) % n] for k in range(1, n + 1)]
        order = [m for m in order if m in decode_work]
        # never start a job on a sliver of the compute units (its compute
        # term would stretch without bound): at most as many decode jobs as
        # ``min_share`` parts fit in what is free; the rest wait for a job to end
        k = min(len(order), int(free / self.min_share + 1e-9))
        for m in order[:k]:
            share = free / k
            jobs.append(_job(m, DECODE, state.ready(m), share))
            self._rr_decode = models.index(m)
        return jobs
