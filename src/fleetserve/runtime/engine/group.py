"""The engine as a sharing group: what a group scheduler reads and admits through.

An :class:`~fleetserve.runtime.engine.engine.Engine` given a catalog group
scheduler (:data:`fleetserve.policy.sharing.BATCHING`: FCFS, RR, MLFQ, DB,
ADBS) runs each step as the simulator's sharing group
(:class:`fleetserve.sim.group.SharingGroup`) runs a scheduling point: it asks
the scheduler for jobs (:meth:`~fleetserve.policy.sharing.GroupScheduler.schedule`),
runs each one (a prefill of the requests the scheduler admitted, or one
decode iteration of one model's running requests), and reports each job's
measured duration (:meth:`~fleetserve.policy.sharing.GroupScheduler.on_job_end`).
This module holds the two views the scheduler reads; the engine holds the
loop (``Engine._group_step``). None of it decides anything: whom to serve,
whom to admit and whom to preempt are the scheduler's.

Where the engine differs from the simulated group, by construction:

* **A scheduling point's jobs all end before the next point.** A temporal
  scheduler names one job a point, which runs on all of the engine's threads.
  A spatial scheduler (ADBS) names a prefill of one service and decode steps
  of the others; the engine runs them at once, each in its own thread with
  its share of the engine's intra-op threads (``Engine(spatial_shares=...)``:
  the CPU's cores stand for the GPU's compute units), or one after another
  when the shares do not give every job a thread. Either way the view
  reports no job in flight and the whole compute share free: the next point
  comes when the last job has ended, where the simulated group asks again as
  each job ends.
* **Time is measured.** ``now`` is the engine's clock (``time.monotonic``
  unless a test passes another) and a job's duration is the wall time of
  its forward and sampling, so MLFQ's quanta and DB's budgets count real
  seconds. The services' statistics (L̂_s, σ_s, seconds per prompt token)
  are inputs: the runtime passes those its placement computed (the
  simulator's, on the worker's emulated GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fleetserve.policy.sharing import GroupScheduler, GroupSeq

if TYPE_CHECKING:
    from fleetserve.runtime.engine.engine import Engine, EngineRequest

__all__ = ["JobBudget", "StateView"]

_RUNNING = "running"


class StateView:
    """The engine between jobs, as a :class:`~fleetserve.policy.sharing.GroupState`.

    Per-model queues are built once per scheduling point (requests admitted
    through :class:`JobBudget` stay in ``waiting`` until their job starts,
    as in the simulated group); ``kv_used`` reads the pool live.
    """

    __slots__ = ("_e", "_ready", "_waiting", "models")

    def __init__(self, engine: Engine) -> None:
        self._e = engine
        self.models: tuple[str, ...] = tuple(engine.models)
        self._waiting: dict[str, list[EngineRequest]] = {m: [] for m in self.models}
        self._ready: dict[str, list[EngineRequest]] = {m: [] for m in self.models}
        for r in engine.waiting:
            self._waiting[r.model].append(r)
        for r in engine.running:
            if r.status == _RUNNING:
                self._ready[r.model].append(r)
        for r in engine.prefilling:  # chunked prefill: a partly prefilled prompt is ready
            if r.status == _RUNNING:
                self._ready[r.model].append(r)

    @property
    def free_share(self) -> float:
        return 1.0

    @property
    def jobs_in_flight(self) -> int:
        return 0

    def waiting(self, model: str) -> Sequence[GroupSeq]:
        return self._waiting.get(model, [])

    def ready(self, model: str) -> Sequence[GroupSeq]:
        return self._ready.get(model, [])

    def running_of(self, model: str) -> list[EngineRequest]:
        """The model's running requests now (preemptible, live)."""
        return [r for r in self._e.running if r.model == model and r.status == _RUNNING]

    def busy(self, model: str, phase: str) -> bool:
        return False

    def kv_used(self, model: str) -> int:
        return self._e.kv_bytes(model)

    def prefill_in_flight(self) -> bool:
        return False


class JobBudget:
    """Admission into one prefill job (a :class:`~fleetserve.policy.sharing.GroupBudget`):
    one model per job, the engine's batch limits (``max_running`` requests,
    ``max_batch_tokens`` tokens; a lone prompt may exceed the token limit, as
    in the simulated group), free pages for the prompt plus its next token,
    and the model's KV quota (:meth:`~fleetserve.policy.sharing.GroupScheduler.kv_allows`).
    ``take`` allocates the request's KV at once."""

    __slots__ = ("_e", "_reserved", "_sched", "model", "seqs_left", "taken", "tokens_left")

    def __init__(self, engine: Engine, scheduler: GroupScheduler) -> None:
        self._e = engine
        self._sched = scheduler
        self.model: str | None = None
        self.seqs_left = engine.max_running - len(engine.running) - len(engine.prefilling)
        self.tokens_left = engine.max_batch_tokens
        self.taken: dict[int, EngineRequest] = {}
        self._reserved = 0  # chunked prefill: pages the model's decodes take first

    def _first(self, model: str) -> tuple[int, int]:
        """``(tokens_left, reserved pages)`` of a job of ``model`` before its
        first prompt: with chunked prefill, its mixed step's decodes and
        partly prefilled prompts come first (their tokens, and the decodes'
        pages: a step that admits never preempts)."""
        e = self._e
        if not e.chunked_prefill:
            return e.max_batch_tokens, 0
        run = [r for r in e.running if r.model == model and r.status == _RUNNING]
        part = [r for r in e.prefilling if r.model == model]
        tokens = e.max_batch_tokens - len(run) - sum(len(r.tokens) - r.n_cached for r in part)
        return tokens, sum(e.pool.pages_to_grow(r.id, r.n_cached + 1) for r in run)

    def fits(self, seq: GroupSeq) -> bool:
        """Whether ``seq`` may join the job. The job's model is fixed by the
        first prompt *taken*: a scheduler may try several models' queues in
        one call (round-robin), and a model whose head does not fit must not
        close the job to the next one's."""
        e = self._e
        req = e.requests.get(seq.id)
        if req is None or req.status != "waiting" or req.id in self.taken:
            return False
        if self.model is None:
            tokens_left, reserved = self._first(req.model)
        elif req.model != self.model:
            return False  # one service per job
        else:
            tokens_left, reserved = self.tokens_left, self._reserved
        n = len(req.tokens)
        if self.seqs_left <= 0:
            return False
        if e.chunked_prefill:  # a prompt needs one token of the budget to start
            if tokens_left <= 0:
                return False
        elif self.taken and n > tokens_left:
            return False
        pages = e.prompt_pages(req.id)
        room = e.pool.num_available - reserved - e.watermark_pages()
        return pages <= room and e._kv_allows(self._sched, req, pages)

    def take(self, seq: GroupSeq) -> None:
        e = self._e
        req = e.requests[seq.id]
        if self.model is None:
            self.model = req.model
            self.tokens_left, self._reserved = self._first(req.model)
        e.alloc_prompt(req)
        self.taken[req.id] = req
        self.seqs_left -= 1
        self.tokens_left -= len(req.tokens) - req.n_cached
