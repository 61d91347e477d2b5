"""The controller: the same policies as the simulator, applied to live workers.

Every request passes through here. On arrival the ``dispatch`` policy picks
an instance from a :class:`~fleetserve.cluster.state.ClusterState` built from
the workers' latest snapshots (:mod:`.views`); every ``migration.epoch_s`` the
``migration`` policy (Llumnix, Mell) plans moves and the configured migration
*mechanism* (``kv``, ``token``, Mell's ``adaptive``) decides how each one
travels; ``placement`` decides which models the workers host at start;
per-worker batching is the engine's ``batching`` policy. The controller only
applies the returned actions: it makes no placement, dispatch or migration
decision of its own.

Each worker is long-polled by its own task (:meth:`Controller._poll_loop`):
tokens stream from the poll results into each request's event queue, which
the HTTP handler reads. The controller keeps, per request, the prompt and
every token it has passed on — the record fault tolerance resumes from: when
a worker dies, each of its requests is dispatched again (same policy) and
re-prefills prompt + the tokens already streamed, so a streaming client sees
every token exactly once.

A migration is stop-and-copy through the Ray object store: the source pauses
the request and exports its state and KV (one chunk of all its layers); the
destination reserves pages and imports it, or refuses when full (the request
then continues on the source). A token migration sends no KV: the
destination re-prefills.

With a KunServe stack (``policy.stack: kunserve``) the ``memory`` decisions
— dropping replicated layers into pipelined buddy groups and restoring them
— come from :class:`~fleetserve.policy.kunserve.KunServePolicy` every
``kunserve.monitor_interval_s``, applied by
:class:`~fleetserve.runtime.kun_control.KunRuntime`; dispatch and batching
are then the ``vllm`` stack's (``policy.dispatch`` may override), and the
policies see one instance per executor (a replica, or a group).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from fleetserve.cluster.state import ClusterState
from fleetserve.config import SimConfig
from fleetserve.errors import FleetserveError
from fleetserve.policy.actions import (
    ActivateGpu,
    Defer,
    Dispatch,
    Migrate,
    Reject,
    ReleaseGpu,
)
from fleetserve.policy.base import DISPATCH, MEMORY, MIGRATION
from fleetserve.policy.catalog import resolve_policies
from fleetserve.policy.mechanism import MECHANISM, MechanismContext, PendingMove
from fleetserve.runtime.channel import ReportServer
from fleetserve.runtime.engine.migration import RequestState
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.hops import HopRecorder, TokenStamps, token_stamps
from fleetserve.runtime.kun_control import KunRuntime, kun_settings
from fleetserve.runtime.metrics import RuntimeMetrics
from fleetserve.runtime.plan import runtime_policy_names
from fleetserve.runtime.views import LiveInstance, Pending
from fleetserve.runtime.worker import Report, WorkerSnap, WorkerSpec

if TYPE_CHECKING:
    from fleetserve.runtime.replace import Replacer
from fleetserve.workload.request import Request

logger = logging.getLogger(__name__)

# The migration mechanism's per-epoch budgets (Mell §V) come from what the
# runtime measures: the KV bytes per second its migrations moved between
# workers (export, Ray object store, import) and each destination worker's
# prompt tokens per second. These two are the starting values, used until a
# first measurement exists: on this project's 2-core CPU machine a KV chunk of
# a few MB moves at 0.5-2 GB/s, and tiny models prefill several thousand
# tokens/s on one core.
OBJECT_STORE_BW = 1e9
REPREFILL_TOKENS_S = 5000.0


DRAIN_WINDOW_S = 30.0
"""How far back the drain rate behind ``Retry-After`` looks."""


def retry_after_s(queue: int, done_times: deque[float], now: float, oldest_wait_s: float) -> int:
    """``Retry-After`` seconds for a request refused because ``queue``
    requests wait for their first token: the time the measured drain rate
    (requests that left the system — finished, aborted or failed — in the last
    :data:`DRAIN_WINDOW_S`, or since the start when sooner) needs to serve the
    queue and this request. With nothing finished in the window, the time the
    oldest waiting request has waited so far (a lower bound of what it takes).
    Clamped to 1..600. Forgets finish times older than the window.
    """
    forget_before(done_times, now - DRAIN_WINDOW_S)
    span = min(DRAIN_WINDOW_S, now)
    wait = (queue + 1) * span / len(done_times) if done_times and span > 0 else oldest_wait_s
    return int(min(600, max(1, math.ceil(wait))))


def forget_before(times: deque[float], t: float) -> None:
    """Drop the times (ascending) earlier than ``t``."""
    while times and times[0] < t:
        times.popleft()


def worker_error(e: BaseException, what: str) -> tuple[int, str]:
    """The status and client-safe message of a worker-side exception.

    One of fleetserve's own errors (a request the engine refuses, e.g. a
    ConfigError) is the client's fault: 400 with its first line. Anything
    else is logged here in full under an id and the client gets a 500 naming
    only that id: no traceback, path, PID or address ever leaves the server.
    """
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, FleetserveError):
        return 400, _one_line(cause)
    err_id = uuid.uuid4().hex[:12]
    logger.error("%s: internal error %s: %s", what, err_id, e)
    return 500, f"internal error while running the request (logged as {err_id})"


def _one_line(e: BaseException, limit: int = 300) -> str:
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ServeError(FleetserveError):
    """An error with its HTTP status and OpenAI error type (the server renders it).

    Attributes:
        status: HTTP status code.
        type: OpenAI error ``type`` (``invalid_request_error``, ...).
        code: OpenAI error ``code`` or None.
        param: the request field at fault, or None.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}


@dataclass(slots=True)
class ModelInfo:
    """What the server needs to know of a served model."""

    name: str
    max_context: int
    vocab_size: int
    tokenizer: Any


@dataclass(eq=False)
class Tracked:
    """One request at the controller (its record and its event queue).

    ``events`` carries ``("token", text_piece, token_id, stamps)``, then one
    ``("done", finish_reason)`` or ``("error", status, message)``; ``stamps``
    is the token's :class:`~fleetserve.runtime.hops.TokenStamps` when its hops
    are measured (the first token; every token with ``serve.hop_trace``), else
    None. The ``t_*`` and ``last_*`` fields are hop stamps (``time.monotonic``).
    """

    id: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    events: asyncio.Queue[tuple[Any, ...]]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    instance: int | None = None
    deferred: bool = False
    moving: str | None = None  # None, "export", "stages" (live copy) or "import"
    move_dst: int | None = None  # the worker it is being imported on
    early_end: str | None = None  # its finish reported by move_dst before the move ended
    done: bool = False
    finish_reason: str | None = None
    t_first: float | None = None
    t_done: float | None = None
    resumes: int = 0
    migrations: int = 0
    t_http: float | None = None  # the HTTP handler got the request
    t_sent: float | None = None  # the controller sent it to a worker
    t_admit: tuple[float, float] | None = None  # the worker actor got it, its engine had it
    last_step_end: float | None = None  # the step of the last measured token ended
    last_written: float | None = None  # the last measured token was written

    @property
    def remaining(self) -> int:
        return max(1, self.params.max_tokens - len(self.output_ids))


@dataclass(slots=True)
class _Worker:
    spec: WorkerSpec
    handle: Any
    snap: WorkerSnap
    alive: bool = True
    instances: dict[str, int] = field(default_factory=dict)  # model -> instance id
    pending: dict[int, Pending] = field(default_factory=dict)
    gen: int = 0  # the actor's generation (a restart makes the next)
    next_seq: int = 0  # the number of the next report to apply (Report.seq)
    held: dict[int, tuple[Report, float]] = field(default_factory=dict)  # came early
    prefix_seen: tuple[int, int] = (0, 0)  # its engine's prefix-cache counters, counted
    preempt_seen: int = 0  # its engine's preemptions, counted
    group_jobs_seen: tuple[int, int] = (0, 0)  # its engine's group jobs (alone, at once), counted
    flips_seen: int = 0  # live-exchange flips of the groups it led, counted


class Controller:
    """Runs the policies on live workers (see the module docstring).

    Args:
        config: the resolved config (``policy``, ``migration``, ``serve``).
        workers: per worker id, its spec and Ray actor handle (started).
        snaps: each worker's first snapshot.
        models: the served models.
    """

    def __init__(
        self,
        config: SimConfig,
        workers: dict[int, tuple[WorkerSpec, Any]],
        snaps: dict[int, WorkerSnap],
        models: dict[str, ModelInfo],
    ) -> None:
        self.cfg = config
        self.serve = config.serve
        self.models = models
        self.metrics = RuntimeMetrics()
        self.hops = HopRecorder(self.metrics, config.serve.hop_trace, config.serve.hop_log)
        self.rng = np.random.default_rng(config.seed)
        self.t0 = time.monotonic()
        kun = kun_settings(config)
        # KunServe: the vllm stack's dispatch and batching (runtime.plan)
        names = self.policy_names = (
            resolve_policies(config) if kun is None else runtime_policy_names(config)
        )
        self.dispatcher = DISPATCH.get(names["dispatch"]).from_config(config)
        self.migration = MIGRATION.get(names["migration"]).from_config(config)
        self.memory = MEMORY.get(names["memory"]).from_config(config)
        self.mechanism = MECHANISM.get(names["mechanism"])()
        self.migration.attach(self.dispatcher)
        self.elastic = config.cluster.elastic
        self.workers: dict[int, _Worker] = {}
        self.inst_of: dict[int, tuple[int, str]] = {}  # instance id -> (worker, model)
        self.active: set[int] = set()
        ids = itertools.count()
        for wid, (spec, handle) in sorted(workers.items()):
            w = _Worker(spec, handle, snaps[wid])
            for m in spec.served:
                iid = next(ids)
                w.instances[m] = iid
                self.inst_of[iid] = (wid, m)
                if not self.elastic:
                    self.active.add(iid)
            self.workers[wid] = w
        self._next_iid = len(self.inst_of)
        self.replacer: Replacer | None = None  # SeaLLM's re-placement (runtime.replace)
        self.requests: dict[int, Tracked] = {}
        self._ids = itertools.count()
        self._moves: list[tuple[int, int, str | None]] = []  # (rid, dst iid, mode) pending
        self._tasks: list[asyncio.Task[Any]] = []
        self._move_tasks: set[asyncio.Task[Any]] = set()
        self._refs: dict[int, int] = {}
        self._stopping = False
        self._done_times: deque[float] = deque()  # when requests left the system (Retry-After)
        self.respawn: Callable[[WorkerSpec], Awaitable[tuple[Any, WorkerSnap]]] | None = None
        self.channel: ReportServer | None = None  # workers' step reports (runtime.channel)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.migration_log: list[dict[str, Any]] = []
        self._moved = (0, 0.0)  # KV bytes migrations moved, seconds of those transfers
        for w in self.workers.values():
            self._update_worker_gauges(w)
        self.metrics.workers_alive.set(len(self.workers))
        self.kun = KunRuntime(self, kun) if kun is not None else None
        self._step_log: IO[str] | None = None
        if self.serve.step_log is not None:
            try:
                self._step_log = open(self.serve.step_log, "a", encoding="utf-8")  # noqa: SIM115
            except OSError as e:
                msg = f"serve.step_log: cannot write {e.filename}: {e.strerror}"
                raise FleetserveError(msg) from None

    # --------------------------------------------------------------- clock
    def now(self) -> float:
        """Seconds since the controller started (the policies' ``now``)."""
        return time.monotonic() - self.t0

    # ----------------------------------------------------------- lifecycle
    async def start(self) -> None:
        loop = self.loop = asyncio.get_running_loop()
        channel = ReportServer(self._channel_report)
        try:
            await channel.start()
            self.channel = channel
        except OSError as e:  # no Unix sockets here: reports come with the polls
            logger.warning("no report channel (%s): workers report through Ray polls", e)
            await channel.stop()
        for wid in self.workers:
            self._tasks.append(loop.create_task(self._poll_loop(wid)))
        self._tasks.append(loop.create_task(self._tick_loop()))

    async def stop(self) -> None:
        self._stopping = True
        for t in [*self._tasks, *self._move_tasks]:
            t.cancel()
        for t in [*self._tasks, *self._move_tasks]:
            with contextlib.suppress(BaseException):
                await t
        for req in list(self.requests.values()):
            if not req.done:
                self._fail(req, 503, "the server is shutting down")
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None
        self.hops.close()
        if self.channel is not None:
            await self.channel.stop()

    # --------------------------------------------------------------- state
    def state(self) -> ClusterState:
        """The ``ClusterState`` the policies observe now."""
        st = ClusterState(
            gpus_limit=len(self.workers),
            elastic=self.elastic,
            pool_fixed=True,
            model_tp=dict.fromkeys(self.models, 1),
            gpus_per_node=len(self.workers) or 1,
            block_size=self.cfg.cluster.block_size,
        )
        if self.kun is not None:
            for e, view in self.kun.views():
                if e.accepting:
                    st.add(view)  # type: ignore[arg-type]
            for m in self.models:
                st.request_blocks[m] = max(
                    (e.view.total_blocks for e in self.kun.execs.values() if e.view is not None),
                    default=0,
                )
            return st
        moving = frozenset(t.id for t in self.requests.values() if t.moving)
        for iid in sorted(self.active):
            wid, model = self.inst_of[iid]
            w = self.workers[wid]
            if not w.alive:
                continue
            view = LiveInstance(
                iid,
                wid,
                model,
                w.snap,
                [p for p in w.pending.values() if p.model == model],
                moving,
            )
            st.add(view)  # type: ignore[arg-type]  # seqs() lists SeqView-shaped objects
        for m in self.models:
            caps = [v.total_blocks for v in st.instances_of(m)]
            if not caps:
                caps = [
                    LiveInstance(iid, wid, m, self.workers[wid].snap).total_blocks
                    for iid, (wid, mm) in self.inst_of.items()
                    if mm == m and self.workers[wid].alive
                ]
            st.request_blocks[m] = max(caps, default=0)
        return st

    def queue_length(self) -> int:
        """Admitted requests still waiting for their first token."""
        return sum(1 for t in self.requests.values() if not t.done and t.t_first is None)

    def models_ready(self) -> dict[str, bool]:
        """Per served model: whether a live worker hosts it (readiness)."""
        return {
            m: any(self.workers[self.inst_of[i][0]].alive for i in self._instances_of(m))
            for m in self.models
        }

    def end_in_flight(self, message: str) -> int:
        """End every unfinished request with a 503 ``message`` (a drain's
        deadline); their workers abort them. Returns how many."""
        n = 0
        for t in list(self.requests.values()):
            if not t.done:
                if t.instance is not None:
                    w = self.workers[self.inst_of[t.instance][0]]
                    if w.alive:
                        self._spawn(self._call_quietly(w.handle.abort.remote(t.id)))
                self._fail(t, 503, message)
                n += 1
        return n

    # ------------------------------------------------------------- arrival
    def model_info(self, model: str) -> ModelInfo:
        """The served model ``model``; a 404 :class:`ServeError` naming the served ones."""
        info = self.models.get(model)
        if info is None:
            raise ServeError(
                404,
                f"The model `{model}` does not exist. Served models: {', '.join(self.models)}",
                code="model_not_found",
                param="model",
            )
        return info

    def submit(
        self,
        model: str,
        prompt_ids: list[int],
        params: SamplingParams,
        received: float | None = None,
    ) -> Tracked:
        """Admit a request and dispatch it (raises :class:`ServeError`).
        ``received``: when the HTTP handler got it (``time.monotonic``; a hop stamp)."""
        info = self.model_info(model)
        if not prompt_ids:
            raise ServeError(400, "the prompt is empty", param="prompt")
        if len(prompt_ids) + params.max_tokens > info.max_context:
            raise ServeError(
                400,
                f"This model's maximum context length is {info.max_context} tokens. However, "
                f"you requested {len(prompt_ids) + params.max_tokens} tokens "
                f"({len(prompt_ids)} in the prompt, {params.max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.",
                code="context_length_exceeded",
                param="prompt",
            )
        if any(not 0 <= t < info.vocab_size for t in prompt_ids):
            raise ServeError(
                400, f"prompt token ids must be in [0, {info.vocab_size})", param="prompt"
            )
        if not any(self.workers[self.inst_of[i][0]].alive for i in self._instances_of(model)):
            self.metrics.requests.labels(model, "rejected").inc()
            raise ServeError(
                503, f"no live worker serves {model}", type="service_unavailable", code="no_worker"
            )
        if self.queue_length() >= self.serve.max_queue:
            self.metrics.requests.labels(model, "rejected").inc()
            raise ServeError(
                429,
                f"the server is overloaded: {self.serve.max_queue} requests are already waiting "
                "for their first token; retry later",
                type="rate_limit_error",
                code="overloaded",
                headers={"Retry-After": str(self._retry_after())},
            )
        rid = next(self._ids)
        t = Tracked(rid, model, list(prompt_ids), params, self.now(), asyncio.Queue())
        t.t_http = received
        self.requests[rid] = t
        self.metrics.prompt_tokens.labels(model).inc(len(prompt_ids))
        if self.replacer is not None:
            self.replacer.on_request(t)
        self._dispatch(t)
        self._update_queue_gauges()
        return t

    def _instances_of(self, model: str) -> list[int]:
        return [i for i, (_w, m) in self.inst_of.items() if m == model]

    def add_instance(self, wid: int, model: str) -> int:
        """A model a worker has just loaded (a re-placement) serves from now on."""
        iid = self._next_iid
        self._next_iid += 1
        self.inst_of[iid] = (wid, model)
        self.workers[wid].instances[model] = iid
        if not self.elastic:
            self.active.add(iid)
        return iid

    def remove_instance(self, iid: int) -> None:
        """A model a worker has unloaded serves no more there (its id stays
        known: requests that ran on it still name it)."""
        wid, model = self.inst_of[iid]
        self.workers[wid].instances.pop(model, None)
        self.active.discard(iid)
        self.migration.on_release(iid, self.now())

    def load_of(self, iid: int) -> int:
        """Requests on instance ``iid`` now (sent, running or queued there)."""
        return sum(1 for t in self.requests.values() if not t.done and t.instance == iid)

    def _retry_after(self) -> int:
        """Seconds a client should wait (:func:`retry_after_s` over the requests
        that left in the last :data:`DRAIN_WINDOW_S`)."""
        now = self.now()
        waiting = [t.arrival for t in self.requests.values() if not t.done and t.t_first is None]
        oldest = now - min(waiting) if waiting else 0.0
        return retry_after_s(self.queue_length(), self._done_times, now, oldest)

    def _request_of(self, t: Tracked) -> Request:
        return Request(
            id=t.id,
            model=t.model,
            arrival_s=max(0.0, t.arrival),
            prompt_tokens=len(t.prompt_ids) + len(t.output_ids),
            output_tokens=t.remaining,
        )

    def _dispatch(self, t: Tracked) -> None:
        st = self.state()
        if self.kun is not None and not st.instances_of(t.model):
            t.deferred = True  # every executor is merging or restoring: the next tick retries
            return
        if self.replacer is not None and not st.instances_of(t.model):
            t.deferred = True  # a re-placement moves the model: its next load dispatches it
            return
        action = self.dispatcher.dispatch(st, self._request_of(t), self.now(), self.rng)
        self._apply_dispatch(t, action)

    def _apply_dispatch(self, t: Tracked, action: Any) -> None:
        if isinstance(action, Dispatch):
            self._send(t, action.instance_id)
        elif isinstance(action, Reject):
            self._fail(t, 503, f"rejected by the dispatch policy: {action.reason}")
        elif isinstance(action, Defer):
            t.deferred = True
        elif isinstance(action, ActivateGpu):
            iid = self._activate(action.model)
            if iid is None:
                self._fail(t, 503, f"no idle worker left to activate for {action.model}")
            else:
                if action.ref is not None:
                    self._refs[action.ref] = iid
                    self.migration.bind(action.ref, iid)
                self._send(t, iid)
        else:
            raise RuntimeError(f"unexpected dispatch action {action!r}")

    def _activate(self, model: str) -> int | None:
        for iid, (wid, m) in sorted(self.inst_of.items()):
            if m == model and iid not in self.active and self.workers[wid].alive:
                self.active.add(iid)
                if self.elastic:  # an inactive worker holds no weights: load them
                    self._spawn(self._wake(wid))
                return iid
        return None

    async def _wake(self, wid: int) -> None:
        """Load an activated worker's weights and arena (timed by the worker;
        the request sent right after it queues behind the call there)."""
        w = self.workers[wid]
        try:
            took = float(await w.handle.activate.remote())
        except Exception as e:
            if not self._is_actor_death(e):
                logger.warning("worker %d: activation failed: %s", wid, e)
            return
        if took > 0:
            self.metrics.activations.observe(took)
            logger.info("worker %d activated: weights and arena loaded in %.3f s", wid, took)

    def _send(self, t: Tracked, iid: int) -> None:
        wid, model = self.inst_of[iid]
        w = self.workers[wid]
        if not w.alive:
            self._fail(t, 503, f"worker {wid} is down")
            return
        t.instance = iid
        t.deferred = False
        w.pending[t.id] = Pending(
            t.id, model, t.arrival, len(t.prompt_ids), t.params.max_tokens, len(t.output_ids)
        )
        t.t_sent = time.monotonic()
        if t.output_ids:
            ref = w.handle.resume.remote(
                t.id, model, t.prompt_ids, t.output_ids, t.text, t.params, t.arrival
            )
        else:
            ref = w.handle.submit.remote(t.id, model, t.prompt_ids, t.params, t.arrival)
        self._watch(ref, wid, t)

    def _watch(self, ref: Any, wid: int, t: Tracked) -> None:
        """Surface a failed submit (the worker refused the request) to its client."""

        async def check() -> None:
            try:
                await ref
            except Exception as e:
                if self._is_actor_death(e):
                    return  # the poll loop handles the dead worker
                self.workers[wid].pending.pop(t.id, None)
                self._fail(t, *worker_error(e, f"worker {wid} refused request {t.id}"))

        self._spawn(check())

    # -------------------------------------------------------------- cancel
    def abort(self, rid: int) -> None:
        """The client went away: free the request's KV now."""
        t = self.requests.get(rid)
        if t is None or t.done:
            return
        t.done = True
        t.finish_reason = "abort"
        t.t_done = self.now()
        self.metrics.requests.labels(t.model, "aborted").inc()
        t.events.put_nowait(("error", 503, "the request was aborted"))
        if t.instance is not None:
            wid, _m = self.inst_of[t.instance]
            w = self.workers[wid]
            w.pending.pop(rid, None)
            if w.alive:
                self._spawn(self._call_quietly(w.handle.abort.remote(rid)))
        self._finished(t)

    async def _call_quietly(self, ref: Any) -> None:
        """Await a fire-and-forget worker call (abort, release): a dead worker
        is the poll loop's business; any other failure is logged, not raised."""
        try:
            await ref
        except Exception as e:
            if not self._is_actor_death(e):
                logger.warning("a worker call failed: %s", e)

    # ------------------------------------------------------------ polling
    async def _poll_loop(self, wid: int) -> None:
        w = self.workers[wid]
        if self.channel is not None and self.channel.path is not None:
            token = self.channel.token(wid, w.gen)
            with contextlib.suppress(Exception):  # a dead worker: the poll below says so
                await w.handle.connect.remote(self.channel.path, token)
        while not self._stopping and w.alive:
            try:
                rep: Report = await w.handle.poll.remote(0.25)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._stopping:
                    return
                logger.warning("worker %d is dead: %s", wid, type(e).__name__)
                self._on_worker_dead(wid)
                return
            self._receive(w, rep, time.monotonic())

    def _channel_report(self, wid: int, gen: int, rep: Report, received: float) -> None:
        """A report read from the report channel (``runtime.channel``)."""
        w = self.workers.get(wid)
        if w is not None and w.alive and w.gen == gen and not self._stopping:
            self._receive(w, rep, received)

    MAX_HELD_REPORTS = 256

    def _receive(self, w: _Worker, rep: Report, received: float) -> None:
        """Apply ``w``'s reports in their order (``Report.seq``): one that came
        before an earlier one (by the other way) waits for it."""
        if rep.seq_end <= w.next_seq:
            return  # already applied (cannot happen; defensive)
        if rep.seq > w.next_seq:
            w.held[rep.seq] = (rep, received)
            if len(w.held) <= self.MAX_HELD_REPORTS:
                return
            # never expected: a report went missing; go on without it
            logger.error(
                "worker %d: report %d never came; going on from %d",
                w.spec.worker_id,
                w.next_seq,
                min(w.held),
            )
            w.next_seq = min(w.held)
            rep, received = w.held.pop(w.next_seq)
        w.next_seq = rep.seq_end
        self._apply_report(w, rep, received)
        while w.next_seq in w.held:
            nxt, got = w.held.pop(w.next_seq)
            w.next_seq = nxt.seq_end
            self._apply_report(w, nxt, got)

    def _apply_report(self, w: _Worker, rep: Report, received: float | None = None) -> None:
        """Apply a poll's report; ``received``: when it came (a hop stamp)."""
        now = self.now()
        got = received if received is not None else time.monotonic()
        for rid, admit in rep.t_admit.items():
            t = self.requests.get(rid)
            if t is not None and t.t_admit is None:
                t.t_admit = admit
        if self._step_log is not None and rep.steps_done:
            self._write_steps(w.spec.worker_id, rep)
        if rep.snap is not None:
            w.snap = rep.snap
            seen = {s.id for s in rep.snap.seqs}
            for rid in list(w.pending):
                if rid in seen or rid in rep.finished or rid in rep.tokens:
                    del w.pending[rid]
            self._update_worker_gauges(w)
        wid = w.spec.worker_id
        for rid, toks in rep.tokens.items():
            t = self.requests.get(rid)
            if t is None or t.done or not (self._runs_on(t, wid) or self._imports_on(t, wid)):
                continue
            for idx, tok, piece in toks:
                first = t.t_first is None
                stamps = None
                if self.hops.wanted(first):
                    stamps = token_stamps(rep, rid, idx, first, got)
                self._token(t, idx, tok, piece, now, stamps)
        for rid, reason in rep.finished.items():
            t = self.requests.get(rid)
            if t is None or t.done or reason in ("migrated", "abort"):
                continue
            if self._runs_on(t, wid):
                self._end(t, reason, now)
            elif self._imports_on(t, wid):
                t.early_end = reason  # once the move has ended (_move)
        self._update_queue_gauges()

    def _runs_on(self, t: Tracked, wid: int) -> bool:
        return t.instance is not None and self.inst_of[t.instance][0] == wid

    def _imports_on(self, t: Tracked, wid: int) -> bool:
        """``t`` is being imported on worker ``wid``: its first steps there can
        report (by the report channel) before the import call has answered."""
        return t.moving == "import" and t.move_dst == wid

    def _end(self, t: Tracked, reason: str, now: float) -> None:
        """The worker running ``t`` finished it (``reason``)."""
        if reason == "capacity":
            self._fail(t, 503, "the request's KV cache outgrew the worker's memory")
        else:
            self._finish(t, reason, now)

    def _write_steps(self, wid: int, rep: Report) -> None:
        """Append the report's engine steps to ``serve.step_log`` (one JSON line each)."""
        assert self._step_log is not None
        lines = [
            json.dumps(
                {
                    "worker": wid,
                    "start_s": round(st.start_s, 6),
                    "duration_s": round(st.duration_s, 7),
                    "more": st.more,
                    "forwards": [
                        {
                            "model": f.model,
                            "chunks": [list(c) for c in f.chunks],
                            "decode_batch": f.decode_batch,
                            "decode_ctx": f.decode_ctx,
                        }
                        for f in st.forwards
                    ],
                }
            )
            for st in rep.steps_done
        ]
        self._step_log.write("\n".join(lines) + "\n")
        self._step_log.flush()

    def _token(
        self,
        t: Tracked,
        idx: int,
        tok: int,
        piece: str,
        now: float,
        stamps: TokenStamps | None = None,
    ) -> None:
        have = len(t.output_ids)
        if idx <= have:
            return  # already passed on (a migration's state and a poll both had it)
        if idx > have + 1:
            logger.warning("request %d: token %d arrived after %d; gap", t.id, idx, have)
        t.output_ids.append(tok)
        t.text += piece
        if t.t_first is None:
            t.t_first = now
        t.events.put_nowait(("token", piece, tok, stamps))
        self.metrics.tokens.labels(t.model).inc()

    def _finish(self, t: Tracked, reason: str, now: float) -> None:
        t.done = True
        t.finish_reason = reason
        t.t_done = now
        m = self.metrics
        m.requests.labels(t.model, "finished").inc()
        if t.t_first is not None:
            m.ttft.labels(t.model).observe(t.t_first - t.arrival)
            if len(t.output_ids) > 1:
                m.tpot.labels(t.model).observe((now - t.t_first) / (len(t.output_ids) - 1))
        m.e2e.labels(t.model).observe(now - t.arrival)
        t.events.put_nowait(("done", reason))
        self._finished(t)

    def _fail(self, t: Tracked, status: int, message: str) -> None:
        if t.done:
            return
        t.done = True
        t.finish_reason = "error"
        t.t_done = self.now()
        self.metrics.requests.labels(
            t.model, "rejected" if status in (429, 503) else "failed"
        ).inc()
        t.events.put_nowait(("error", status, message))
        self._finished(t)

    def _finished(self, t: Tracked) -> None:
        now = self.now()
        self._done_times.append(now)
        forget_before(self._done_times, now - DRAIN_WINDOW_S)  # bounded on a long-lived server
        if t.instance is not None:
            self.migration.on_finish(t.id, t.instance, now)
            wid, _m = self.inst_of[t.instance]
            self.workers[wid].pending.pop(t.id, None)
        self._update_queue_gauges()

    def forget(self, rid: int) -> None:
        """The HTTP handler has read the request's last event."""
        t = self.requests.get(rid)
        if t is not None and t.done:
            del self.requests[rid]

    # ----------------------------------------------------------- failures
    @staticmethod
    def _is_actor_death(e: BaseException) -> bool:
        import ray.exceptions

        return isinstance(e, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError)

    def _on_worker_dead(self, wid: int) -> None:
        w = self.workers[wid]
        if not w.alive:
            return
        w.alive = False
        w.pending.clear()
        self.metrics.worker_failures.inc()
        self.metrics.workers_alive.set(sum(x.alive for x in self.workers.values()))
        for iid in w.instances.values():
            self.active.discard(iid)
            self.migration.on_release(iid, self.now())
        if self.serve.restart_workers and self.respawn is not None and not self._stopping:
            self._spawn(self._restart(wid))
        if self.kun is not None and self.kun.on_worker_dead(wid):
            return  # a buddy group's member: its recovery resumes the group's requests
        for t in list(self.requests.values()):
            if t.done or t.instance is None or self.inst_of[t.instance][0] != wid:
                continue
            if t.moving in ("import", "stages"):
                continue  # the move holds its state and resumes it (_move, _move_live)
            self._resume(t)

    RESTART_ATTEMPTS = 5
    RESTART_BACKOFF_S = 1.0

    async def _restart(self, wid: int) -> None:
        """Respawn dead worker ``wid``: a new actor with the same spec (its
        engine loads the weights again); its instances serve again once it has
        started. Tries :attr:`RESTART_ATTEMPTS` times with doubling backoff."""
        import ray

        w = self.workers[wid]
        assert self.respawn is not None
        if ray.is_initialized():  # (never start Ray here: tests drive in-process workers)
            with contextlib.suppress(Exception):
                ray.kill(w.handle)  # a hung actor must not linger beside its successor
        delay = self.RESTART_BACKOFF_S
        for attempt in range(1, self.RESTART_ATTEMPTS + 1):
            try:
                handle, snap = await self.respawn(w.spec)
                break
            except Exception as e:
                logger.warning("worker %d: restart %d failed: %s", wid, attempt, _one_line(e))
                self.metrics.worker_restarts.labels("failed").inc()
                await asyncio.sleep(delay)
                delay *= 2
        else:
            logger.error("worker %d: not restarted after %d tries", wid, self.RESTART_ATTEMPTS)
            return
        if self._stopping:
            if ray.is_initialized():
                with contextlib.suppress(Exception):
                    ray.kill(handle)
            return
        w.handle, w.snap, w.alive = handle, snap, True
        w.gen += 1
        w.next_seq = 0
        w.held.clear()
        self.metrics.worker_restarts.labels("done").inc()
        self.metrics.workers_alive.set(sum(x.alive for x in self.workers.values()))
        self._update_worker_gauges(w)
        for iid in w.instances.values():
            if not self.elastic:
                self.active.add(iid)
        if self.kun is not None:
            self.kun.on_worker_back(wid)
        logger.warning("worker %d restarted", wid)
        assert self.loop is not None
        self._tasks.append(self.loop.create_task(self._poll_loop(wid)))
        self._redispatch_deferred()

    def _resume(self, t: Tracked) -> None:
        """Dispatch ``t`` again from the controller's record (re-prefill)."""
        t.instance = None
        t.moving = None
        t.resumes += 1
        self.metrics.resumed.inc()
        if t.remaining <= 0 or len(t.output_ids) >= t.params.max_tokens:
            self._finish(t, "length", self.now())
            return
        self._dispatch(t)

    # -------------------------------------------------------------- ticks
    async def _tick_loop(self) -> None:
        interval = self.migration.interval_s
        next_epoch = interval if interval is not None else math.inf
        next_kun = self.kun.interval_s if self.kun is not None else math.inf
        while not self._stopping:
            await asyncio.sleep(self.serve.tick_s)
            now = self.now()
            if self.kun is not None and now >= next_kun:
                try:
                    self.kun.tick(now)
                    self._redispatch_deferred()
                except Exception:
                    logger.exception("KunServe tick failed")
                next_kun = now + self.kun.interval_s
            if self.replacer is not None:
                try:
                    self.replacer.tick(now)
                except Exception:
                    logger.exception("SeaLLM re-placement failed")
            if now >= next_epoch:
                try:
                    self._epoch(now)
                except Exception:
                    logger.exception("migration epoch failed")
                assert interval is not None
                next_epoch = now + interval
            self._release_idle(now)

    def _redispatch_deferred(self) -> None:
        """Dispatch again the requests that found no accepting executor."""
        for t in list(self.requests.values()):
            if t.deferred and not t.done and t.instance is None:
                self._dispatch(t)

    def _release_idle(self, now: float) -> None:
        if not self.elastic:
            return
        st = self.state()
        for iid in list(self.active):
            v = st.instances.get(iid)
            if v is not None and v.idle:
                for act in self.memory.on_idle(st, v, now):
                    self._release(act)

    def _release(self, act: ReleaseGpu) -> None:
        iid = self._refs.get(act.instance_id, act.instance_id)
        if iid in self.active:
            self.active.discard(iid)
            self.migration.on_release(iid, self.now())
            w = self.workers[self.inst_of[iid][0]]
            if self.elastic and w.alive:  # give its weights and arena back
                self._spawn(self._sleep(w))

    async def _sleep(self, w: Any) -> None:
        try:
            if await w.handle.deactivate.remote():
                self.metrics.sleeps.inc()
        except Exception as e:
            if not self._is_actor_death(e):
                logger.warning("a worker call failed: %s", e)

    def _epoch(self, now: float) -> None:
        st = self.state()
        self._refs = {}
        for action in self.migration.plan(st, now, self.rng):
            if isinstance(action, ActivateGpu):
                iid = self._activate(action.model)
                if iid is None:
                    logger.warning("plan activates %s but no idle worker is left", action.model)
                    continue
                if action.ref is not None:
                    self._refs[action.ref] = iid
                    self.migration.bind(action.ref, iid)
                if action.request_id is not None:
                    t = self.requests.get(action.request_id)
                    if t is not None and not t.done:
                        self._send(t, iid)
            elif isinstance(action, Dispatch):
                t = self.requests.get(action.request_id)
                if t is not None and not t.done:
                    self._send(t, self._refs.get(action.instance_id, action.instance_id))
            elif isinstance(action, Reject):
                t = self.requests.get(action.request_id)
                if t is not None:
                    self._fail(t, 503, action.reason)
            elif isinstance(action, Migrate):
                self._moves.append(
                    (action.request_id, self._refs.get(action.dst, action.dst), action.mode)
                )
            elif isinstance(action, ReleaseGpu):
                self._release(action)
            else:
                raise RuntimeError(f"unexpected action in a migration plan: {action!r}")
        self._start_moves()

    def _start_moves(self) -> None:
        """Hand the pending moves to the mechanism; start the ones it picks."""
        if not self._moves:
            return
        st = self.state()
        cands: list[PendingMove] = []
        keep: list[tuple[int, int, str | None]] = []
        for rid, dst, mode in self._moves:
            t = self.requests.get(rid)
            if t is None or t.done or t.moving or t.instance is None or t.instance == dst:
                self.migration.on_move_aborted(rid)
                continue
            if dst not in st.instances:
                self.migration.on_move_aborted(rid)
                continue
            src_w = self.inst_of[t.instance][0]
            snap = self.workers[src_w].snap
            kv_tokens = next((s.kv_tokens for s in snap.seqs if s.id == rid), 0)
            ppb = snap.pages_per_block.get(t.model, 1)
            kv_bytes = -(-kv_tokens // snap.block_size) * ppb * snap.page_bytes
            cands.append(
                PendingMove(
                    rid,
                    t.instance,
                    dst,
                    (src_w,),
                    (self.inst_of[dst][0],),
                    kv_bytes,
                    len(t.prompt_ids) + len(t.output_ids),
                    mode,
                )
            )
            keep.append((rid, dst, mode))
        chosen = self.mechanism.assign(cands, self.mechanism_context()) if cands else []
        started = {m.request_id for m, _mode in chosen}
        self._moves = [x for x in keep if x[0] not in started]
        for move, how in chosen:
            t = self.requests[move.request_id]
            t.moving = "export"
            go = self._move_live if how == "kv" else self._move
            task = self._spawn(go(t, move.src, move.dst, how))
            self._move_tasks.add(task)
            task.add_done_callback(self._move_tasks.discard)

    def transfer_bw(self) -> tuple[float, bool]:
        """KV bytes per second migrations moved between workers (export,
        object store, import: the whole of each transfer's calls), and
        whether it is measured (else :data:`OBJECT_STORE_BW`)."""
        nbytes, secs = self._moved
        if nbytes <= 0 or secs <= 0:
            return OBJECT_STORE_BW, False
        return nbytes / secs, True

    def mechanism_context(self) -> MechanismContext:
        """Mell §V's boundaries for this epoch: the links may carry
        ``link_share x epoch_s`` of the measured transfer bandwidth; each
        instance may re-prefill ``compute_share x epoch_s`` of its worker's
        measured prompt tokens per second (the steps that prefilled, mixed
        ones included). Before a first measurement: the module's constants."""
        mc = self.cfg.migration
        link = int(mc.link_share * mc.epoch_s * self.transfer_bw()[0])
        compute: dict[int, int] = {}
        for iid, (wid, _m) in self.inst_of.items():
            tokens, secs = self.workers[wid].snap.prefill
            if tokens > 0 and secs > 0:
                compute[iid] = int(mc.compute_share * mc.epoch_s * tokens / secs)
        return MechanismContext(
            gpus_per_node=len(self.workers) or 1,
            intra_node_bytes=link,
            inter_node_bytes=link,
            compute_tokens=compute,
            default_compute_tokens=int(mc.compute_share * mc.epoch_s * REPREFILL_TOKENS_S),
        )

    def _moved_add(self, nbytes: int, secs: float) -> None:
        self._moved = (self._moved[0] + nbytes, self._moved[1] + secs)

    async def _move_live(self, t: Tracked, src_iid: int, dst_iid: int, mode: str) -> None:
        """Llumnix's live KV migration of ``t`` between two workers.

        Copy stages while the request decodes on the source (each sends the
        token-blocks filled since the last; the destination pre-commits the
        request paused on the first and grows its pages after), at most
        ``migration.max_stages`` of them, until at most
        ``migration.final_blocks`` blocks are left; then the stop-and-copy:
        the source pauses the request and sends its state and the tail, the
        destination writes it and runs the request. Both workers hold the KV
        until then. The move is off, and the request goes on where it was,
        when the destination runs out of pages, or the request finishes, is
        preempted or is cancelled on the source meanwhile.
        """
        src = self.workers[self.inst_of[src_iid][0]]
        dst = self.workers[self.inst_of[dst_iid][0]]
        mc = self.cfg.migration
        t0 = time.perf_counter()
        t.moving = "stages"  # a worker's death now is this move's to handle
        copied = stages = moved = 0
        pre = False  # the destination holds a pre-commit
        preempted: int | None = None
        reason = ""
        try:
            while stages < mc.max_stages:
                ts = time.perf_counter()
                st = await src.handle.live_stage.remote(t.id, copied, mc.final_blocks)
                if st is None or t.done:
                    reason = "it left the source"
                    break
                if preempted is None:
                    preempted = st.preemptions
                if st.preemptions != preempted:
                    reason = "preempted on the source"
                    break
                if st.chunk is None:
                    break
                ok = await dst.handle.live_receive.remote(t.id, st.chunk, None if pre else st.state)
                self._moved_add(st.chunk.nbytes, time.perf_counter() - ts)
                if not ok:
                    pre = False  # the destination cleaned up
                    reason = "the destination is full"
                    break
                pre = True
                copied = st.full_blocks
                moved += st.chunk.nbytes
                stages += 1
                self.metrics.migration_stages.inc()
            if reason or t.done:
                await self._live_off(t, dst, pre, reason or "cancelled", stop=False)
                return
            ts = time.perf_counter()
            fin = await src.handle.live_final.remote(t.id, copied)
        except Exception as e:  # the source or destination died, or a call failed
            await self._live_off(t, dst, pre, _one_line(e), stop=True, error=e)
            return
        if fin is None or t.done:
            if fin is not None:  # cancelled while the stop was on its way
                await self._call_quietly(src.handle.abort.remote(t.id))
            await self._live_off(t, dst, pre, "it left the source", stop=False)
            return
        state, tail = fin
        if preempted is not None and state.preemptions != preempted:
            await self._live_off(t, dst, pre, "preempted on the source", stop=True)
            return
        t.moving = "import"
        t.move_dst = dst.spec.worker_id
        self._catch_up(t, state)
        ok = False
        try:
            if pre:
                ok = bool(await dst.handle.live_finish.remote(t.id, state, tail))
            else:  # no stage ran (a short request): a blocking copy of it all
                ok = bool(await dst.handle.import_request.remote(state, tail))
            ok = ok and dst.alive
        except Exception as e:
            logger.warning(
                "request %d: import on worker %d failed: %s", t.id, dst.spec.worker_id, e
            )
        stall = time.perf_counter() - ts
        self._moved_add(tail.nbytes, stall)
        if ok:
            self.metrics.migration_stall.observe(stall)
        await self._move_end(t, src, dst, src_iid, dst_iid, "kv", ok, moved + tail.nbytes, t0)

    async def _live_off(
        self,
        t: Tracked,
        dst: Any,
        pre: bool,
        reason: str,
        *,
        stop: bool,
        error: BaseException | None = None,
    ) -> None:
        """A live move is off before its stop-and-copy ended: undo the
        destination's pre-commit; the request goes on at its source
        (``stop``: it was paused there: run it again), or, when the source
        died, from the controller's record."""
        src = self.workers[self.inst_of[t.instance][0]] if t.instance is not None else None
        if pre and dst.alive:
            await self._call_quietly(dst.handle.live_abort.remote(t.id))
        t.moving = t.move_dst = None
        self.migration.on_move_aborted(t.id)
        self.metrics.migrations.labels("kv", "aborted").inc()
        if error is not None and not self._is_actor_death(error):
            logger.warning("request %d: live migration failed: %s", t.id, reason)
        else:
            logger.debug("request %d: live migration off: %s", t.id, reason)
        if t.done:
            return
        if src is not None and src.alive:
            if stop:
                await self._call_quietly(src.handle.unpause.remote(t.id))
            return
        self._resume(t)  # its worker died during the stages

    async def _move(self, t: Tracked, src_iid: int, dst_iid: int, mode: str) -> None:
        src = self.workers[self.inst_of[src_iid][0]]
        dst = self.workers[self.inst_of[dst_iid][0]]
        t0 = time.perf_counter()
        try:
            got = await src.handle.export.remote(t.id, mode == "kv")
        except Exception as e:
            t.moving = None
            if not self._is_actor_death(e):
                logger.warning("request %d: export failed: %s", t.id, e)
            self.migration.on_move_aborted(t.id)
            self.metrics.migrations.labels(mode, "aborted").inc()
            return
        if got is None or t.done:
            t.moving = None
            self.migration.on_move_aborted(t.id)
            self.metrics.migrations.labels(mode, "aborted").inc()
            if got is not None and t.done:
                await self._call_quietly(src.handle.abort.remote(t.id))
            return
        state, chunk = got
        t.moving = "import"
        t.move_dst = dst.spec.worker_id
        self._catch_up(t, state)
        ok = False
        try:
            ok = bool(await dst.handle.import_request.remote(state, chunk)) and dst.alive
        except Exception as e:
            logger.warning(
                "request %d: import on worker %d failed: %s", t.id, dst.spec.worker_id, e
            )
        if chunk is not None:
            nbytes = chunk.nbytes
            self._moved_add(nbytes, time.perf_counter() - t0)
        else:
            nbytes = 8 * len(state.tokens)
        how = "kv" if chunk is not None else "token"
        await self._move_end(t, src, dst, src_iid, dst_iid, how, ok, nbytes, t0, mode)

    async def _move_end(
        self,
        t: Tracked,
        src: Any,
        dst: Any,
        src_iid: int,
        dst_iid: int,
        how: str,
        ok: bool,
        nbytes: int,
        t0: float,
        asked: str | None = None,
    ) -> None:
        """The end of a move whose request was stopped at the source and sent
        (``how``: ``kv`` or ``token``; ``asked``: the mode planned, when it
        differs): on success ``t`` runs on the destination and the source
        lets it go; else it runs at the source again (or is resumed)."""
        t.moving = t.move_dst = None
        early, t.early_end = t.early_end, None
        if ok:
            # the source lets go before this coroutine awaits anything: once
            # nothing moves, the controller may release the source, and that
            # release must reach its worker after this call (Ray keeps order)
            let_go = src.handle.release.remote(t.id) if src.alive else None
            if t.done:  # the client left while it moved
                await self._call_quietly(dst.handle.abort.remote(t.id))
            t.instance = dst_iid
            dst.pending[t.id] = Pending(
                t.id, t.model, t.arrival, len(t.prompt_ids), t.params.max_tokens, len(t.output_ids)
            )
            t.migrations += 1
            self.metrics.migrations.labels(how, "done").inc()
            self.metrics.migration_bytes.inc(nbytes if how == "kv" else 0)
            self.migration_log.append(
                {
                    "request": t.id,
                    "src": src_iid,
                    "dst": dst_iid,
                    "mode": how,
                    "bytes": nbytes,
                    "seconds": time.perf_counter() - t0,
                    "t": self.now(),
                }
            )
            if early is not None and not t.done:  # it finished on dst before the answer
                self._end(t, early, self.now())
            if let_go is not None:
                await self._call_quietly(let_go)
            return
        self.migration.on_move_aborted(t.id)
        self.metrics.migrations.labels(asked or how, "aborted").inc()
        if src.alive and not t.done:
            try:
                await src.handle.unpause.remote(t.id)
                return
            except Exception as e:
                if not self._is_actor_death(e):
                    raise
        if not t.done:
            self._resume(t)

    # ------------------------------------------------------------ helpers
    def _catch_up(self, t: Tracked, state: RequestState) -> None:
        """Pass on the tokens an exported ``state`` has that ``t`` has not
        (the source made them after its last poll)."""
        for i, tok in enumerate(state.output_ids[len(t.output_ids) :], len(t.output_ids) + 1):
            piece = state.text[len(t.text) :] if i == len(state.output_ids) else ""
            self._token(t, i, tok, piece, self.now())

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda x: self._tasks.remove(x) if x in self._tasks else None)
        return task

    def _update_worker_gauges(self, w: _Worker) -> None:
        s = w.snap
        k = str(s.worker_id)
        m = self.metrics
        m.kv_util.labels(k).set(s.used_blocks / s.total_blocks if s.total_blocks else 0.0)
        if s.prefix_tokens != w.prefix_seen:  # cumulative in the engine; a new actor restarts
            old = w.prefix_seen if s.prefix_tokens[0] >= w.prefix_seen[0] else (0, 0)
            m.prefix_tokens.labels("prompt").inc(s.prefix_tokens[0] - old[0])
            m.prefix_tokens.labels("hit").inc(max(0, s.prefix_tokens[1] - old[1]))
            w.prefix_seen = s.prefix_tokens
        if s.preemptions != w.preempt_seen:  # cumulative too
            old_p = w.preempt_seen if s.preemptions >= w.preempt_seen else 0
            m.preemptions.inc(s.preemptions - old_p)
            w.preempt_seen = s.preemptions
        if s.kun_flips != w.flips_seen:  # cumulative too
            old_f = w.flips_seen if s.kun_flips >= w.flips_seen else 0
            m.kun_flips.inc(s.kun_flips - old_f)
            w.flips_seen = s.kun_flips
        if s.group_jobs != w.group_jobs_seen:  # cumulative too
            old_j = w.group_jobs_seen if s.group_jobs[0] >= w.group_jobs_seen[0] else (0, 0)
            m.group_jobs.labels("alone").inc(max(0, s.group_jobs[0] - old_j[0]))
            m.group_jobs.labels("at_once").inc(max(0, s.group_jobs[1] - old_j[1]))
            w.group_jobs_seen = s.group_jobs
        m.kv_bytes.labels(k).set(s.kv_bytes_used)
        m.arena_bytes.labels(k).set(s.arena_bytes)
        m.weight_bytes.labels(k).set(s.weight_bytes)
        m.worker_running.labels(k).set(s.num_running)
        m.worker_waiting.labels(k).set(s.num_waiting)

    def _update_queue_gauges(self) -> None:
        self.metrics.queue.set(self.queue_length())
        self.metrics.in_flight.set(sum(1 for t in self.requests.values() if not t.done))

    # ------------------------------------------------------------- report
    def cluster_json(self) -> dict[str, Any]:
        """Placement and memory state (``GET /v1/cluster``)."""
        workers = []
        for wid, w in sorted(self.workers.items()):
            s = w.snap
            workers.append(
                {
                    "worker": wid,
                    "alive": w.alive,
                    "models": list(s.models),
                    "instances": {m: i for m, i in w.instances.items()},
                    "active": [m for m, i in w.instances.items() if i in self.active],
                    "asleep": s.asleep,
                    "memory": {
                        "budget_bytes": s.arena_bytes,
                        "weight_bytes": s.weight_bytes,
                        "kv_bytes_used": s.kv_bytes_used,
                        "kv_pages_total": s.total_blocks,
                        "kv_pages_used": s.used_blocks,
                        "kv_pages_free": s.free_blocks,
                        "within_budget": s.weight_bytes + s.kv_bytes_used <= s.arena_bytes,
                    },
                    "running": s.num_running,
                    "waiting": s.num_waiting + len(w.pending),
                    "decode_steps": s.decode_steps,
                }
            )
        return {
            "policies": dict(self.policy_names),
            "elastic": self.elastic,
            "queue_length": self.queue_length(),
            "max_queue": self.serve.max_queue,
            "requests_in_flight": sum(1 for t in self.requests.values() if not t.done),
            "workers": workers,
            "migrations": self.migration_log[-50:],
            **({"kunserve": self.kun.cluster_json()} if self.kun is not None else {}),
            **({"replacement": self.replacer.cluster_json()} if self.replacer else {}),
        }
