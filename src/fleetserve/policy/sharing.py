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

import math
from abc import abstractmethod
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from fleetserve.errors import ConfigError
from fleetserve.policy.base import Policy
from fleetserve.policy.db_theory import db_priority
from fleetserve.policy.registry import Registry

__all__ = [
    "DECODE",
    "GROUP_BATCHING",
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
]

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True)
class Job:
    """One iteration of one service: ``phase`` of requests ``seqs`` on ``share``
    of the group's compute units."""

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

    def stable_iterations(
        self,
        state: GroupState,
        model: str,
        batch: Sequence[GroupSeq],
        ends: Sequence[float],
        now: float,
    ) -> int:
        """How many of the decode iterations ``batch`` would run back to back
        (ending at ``ends``) this scheduler provably keeps choosing, given no
        arrival and no finish meanwhile (the group cuts the segment short on
        an arrival). Lets the simulator advance them as one job.

        Default: all of them when nothing is queued and no other service has
        running requests (then this batch is the only possible job), else 1.
        """
        if any(state.waiting(m) for m in state.models):
            return 1
        if any(state.ready(m) for m in state.models if m != model):
            return 1
        return len(ends)

    def on_arrival(self, seq: GroupSeq, now: float) -> None:
        """A request joined the group's queue."""

    def on_job_end(self, job: Job, seqs: Sequence[GroupSeq], duration_s: float, now: float) -> None:
        """A job ended after ``duration_s``; ``seqs`` are its requests still live."""

    def on_finish(self, seq: GroupSeq) -> None:
        """A request finished or left the group."""


GROUP_BATCHING: Registry[GroupScheduler] = Registry("batching")


def _admit(waiting: Sequence[GroupSeq], budget: GroupBudget) -> list[GroupSeq]:
    """vLLM admission: in queue order while the head fits (no skipping)."""
    out: list[GroupSeq] = []
    for s in waiting:
        if not budget.fits(s):
            break
        budget.take(s)
        out.append(s)
    return out


def _job(model: str, phase: str, seqs: Sequence[GroupSeq], share: float = 1.0) -> Job:
    return Job(model, phase, tuple(s.id for s in seqs), share)


@GROUP_BATCHING.register("fcfs")
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

    def schedule(self, state: GroupState, budget: GroupBudget, now: float) -> list[Job]:
        heads = [(q[0].arrival_s, q[0].id, m) for m in state.models if (q := state.waiting(m))]
        if heads:
            _, _, m = min(heads)
            got = _admit(state.waiting(m), budget)
            if got:
                return [_job(m, PREFILL, got)]
        oldest = [(min(s.arrival_s for s in r), m) for m in state.models if (r := state.ready(m))]
        if oldest:
            _, m = min(oldest)
            return [_job(m, DECODE, state.ready(m))]
        return []


@GROUP_BATCHING.register("rr")
class RoundRobin(GroupScheduler):
    """Round-robin over the group's services, one iteration each in turn.

    Each turn goes to the next service (after the last one served) with work;
    it runs a prefill of its queue if the head prompt fits, else a decode step
    of its running requests.
    """

    def __init__(self) -> None:
        super().__init__()
        self._last = -1

    def schedule(self, state: GroupState, budget: GroupBudget, now: float) -> list[Job]:
        models = list(state.models)
        n = len(models)
        for k in range(1, n + 1):
            i = (self._last + k) % n
            m = models[i]
            got = _admit(state.waiting(m), budget) if state.waiting(m) else []
            if got:
                self._last = i
                return [_job(m, PREFILL, got)]
            ready = state.ready(m)
            if ready:
                self._last = i
                return [_job(m, DECODE, ready)]
        return []


@GROUP_BATCHING.register("mlfq")
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
        got = _admit(order, budget)
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


@GROUP_BATCHING.register("db")
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

    def setup(self, services: Mapping[str, ServiceStats], kv_capacity_bytes: int) -> None:
        super().setup(services, kv_capacity_bytes)
        self._limit = {m: self.starvation_scale * st.exec_mean_s for m, st in services.items()}
        self._prio: dict[int, float] = {}  # O_r, kept up to date (budgets change at job ends)

    def on_arrival(self, seq: GroupSeq, now: float) -> None:
        st = self.services[seq.model]
        q = st.exec_mean_s + st.exec_std_s
        self._budget[seq.id] = q
        self._renewals[seq.id] = 0
        self._served[seq.id] = now
        self._prio[seq.id] = db_priority(q, st.exec_mean_s)

    def priority(self, seq: GroupSeq) -> float:
        """``O_r`` of ``seq`` now (smaller is served first)."""
        st = self.services[seq.model]
        return db_priority(self._budget.get(seq.id, st.exec_mean_s + st.exec_std_s), st.exec_mean_s)

    def _key(self, s: GroupSeq) -> tuple[float, float, int]:
        p = self._prio.get(s.id)
        return (self.priority(s) if p is None else p, s.arrival_s, s.id)

    def schedule(self, state: GroupState, budget: GroupBudget, now: float) -> list[Job]:
        # one pass: the highest priority (smallest O_r) and the most starved
        # request (idle past its service's threshold the longest)
        prio, served = self._prio, self._served
        best: tuple[tuple[float, float, int], str, str] | None = None
        worst: tuple[float, str, str] | None = None
        for m in state.models:
            limit = self._limit[m]
            for phase, seqs in ((PREFILL, state.waiting(m)), (DECODE, state.ready(m))):
                for s in seqs:
                    sid = s.id
                    p = prio.get(sid)
                    k = (self.priority(s) if p is None else p, s.arrival_s, sid)
                    if best is None or k < best[0]:
                        best = (k, m, phase)
                    over = now - served.get(sid, s.arrival_s) - limit
                    if over > 0 and (worst is None or over > worst[0]):
                        worst = (over, m, phase)
        if best is None:
            return []
        m, phase = (worst[1], worst[2]) if worst is not None else (best[1], best[2])
        if phase == PREFILL:
            got = _admit(sorted(state.waiting(m), key=self._key), budget)
            if got:
                return [_job(m, PREFILL, got)]
            # no memory for the best prompt: run the best decodable batch meanwhile
            cands = [(self._key(s), mm) for mm in state.models for s in state.ready(mm)]
            if not cands:
                return []
            _, m = min(cands)
        return [_job(m, DECODE, sorted(state.ready(m), key=self._key))]

    def on_job_end(self, job: Job, seqs: Sequence[GroupSeq], duration_s: float, now: float) -> None:
        for s in seqs:
            st = self.services[s.model]
            left = self._budget.get(s.id, 0.0) - duration_s
            if left <= 0.0:  # used up: a doubled budget (Algorithm 2, UpdateBudget)
                k = self._renewals.get(s.id, 0) + 1
                self._renewals[s.id] = k
                left = (2**k) * (st.exec_mean_s + st.exec_std_s)
            self._budget[s.id] = left
            self._served[s.id] = now
            self._prio[s.id] = db_priority(left, st.exec_mean_s)

    def victim(self, state: GroupState, model: str, running: Sequence[GroupSeq]) -> GroupSeq:
        return max(running, key=self._key)

    def stable_iterations(
        self,
        state: GroupState,
        model: str,
        batch: Sequence[GroupSeq],
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
        inside = {s.id for s in batch}
        best = min(
            (
                self._key(s)
                for m in state.models
                for q in (state.waiting(m), state.ready(m))
                for s in q
            ),
            default=None,
        )
        if best is None or best[2] not in inside:
            return 1
        cum = [t - now for t in ends]
        k = n
        for s in batch:  # (1): budget used up at the end of iteration j
            left = self._budget.get(s.id)
            if left is None:
                return 1
            j = bisect_left(cum, left)
            k = min(k, j + 1)
        t_starve = math.inf  # (2): earliest time a request outside the batch starves
        for m in state.models:
            limit = self._limit[m]
            for seqs in (state.waiting(m), state.ready(m)):
                for s in seqs:
                    if s.id not in inside:
                        t_starve = min(t_starve, self._served.get(s.id, s.arrival_s) + limit)
        if t_starve < math.inf:
            # iteration j (0-based) starts at ``now`` (j = 0) or ends[j - 1];
            # the decision before an iteration starting past t_starve may differ
            starts = [now, *ends[:-1]]
            j = bisect_right(starts, t_starve)
            k = min(k, max(1, j))
        return max(1, min(k, n))

    def on_finish(self, seq: GroupSeq) -> None:
        self._budget.pop(seq.id, None)
        self._renewals.pop(seq.id, None)
        self._served.pop(seq.id, None)
        self._prio.pop(seq.id, None)


@GROUP_BATCHING.register("adbs")
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
    """

    spatial = True

    def __init__(
        self,
        prefill_share: float = 0.6,
        period_s: float = 5.0,
        low_use: float = 0.9,
        floor: float = 0.25,
    ) -> None:
        super().__init__()
        if not 0 < prefill_share <= 1 or period_s <= 0 or not 0 < low_use <= 1:
            raise ConfigError("adbs: prefill_share and low_use in (0, 1], period_s > 0")
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
                        got = _admit(state.waiting(m), budget)
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
        for i, m in enumerate(order):
            share = free / (len(order) - i)
            if share <= 1e-9:
                break
            jobs.append(_job(m, DECODE, state.ready(m), share))
            free -= share
            self._rr_decode = models.index(m)
        return jobs
