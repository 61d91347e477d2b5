"""A worker: one (emulated) GPU's engine, driven by the controller.

:class:`WorkerCore` is the plain-Python part (testable without Ray): it owns
an :class:`~fleetserve.runtime.engine.engine.Engine` whose arena — layer
weights plus KV cache — is the GPU's memory budget, runs engine steps, and
buffers what happened (tokens, finishes) until the controller polls.
:class:`Worker` is the Ray actor around it: an asyncio actor whose step loop
runs between method calls, so every engine mutation happens on one thread.

The worker makes no decision of its own. Where a request runs, when it moves
and where to is decided by the controller's policies; whom to admit and whom
to preempt inside one engine by the batching policy the engine calls.

Events carry each token's *index* (the request's generated count after it),
so the controller can drop a token it already has — after a migration the
source's last poll and the exported state may both contain it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from fleetserve.errors import ConfigError
from fleetserve.policy.base import BATCHING
from fleetserve.runtime.engine.engine import Engine, EngineRequest
from fleetserve.runtime.engine.kvpool import PoolFull
from fleetserve.runtime.engine.migration import (
    ImportHandle,
    KVChunk,
    RequestState,
    snapshot_detok,
)
from fleetserve.runtime.engine.sampling import SamplingParams, request_generator
from fleetserve.runtime.engine.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to build one worker (plain data: it crosses to the Ray actor).

    ``models`` are what the engine loads (built-in names or checkpoint
    folders); ``served`` the same models by the names clients use (a
    checkpoint's config name), in the same order.
    """

    worker_id: int
    models: tuple[str, ...]
    served: tuple[str, ...]
    arena_bytes: int
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1
    max_running: int = 64
    max_batch_tokens: int = 4096
    batching: str = "fcfs"
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class SeqSnap:
    """A request as last reported by its worker (a ``SeqView``)."""

    id: int
    model: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    generated: int
    kv_tokens: int
    demand_tokens: int
    migrating: bool
    running: bool


@dataclass(frozen=True, slots=True)
class WorkerSnap:
    """A worker's state at the end of its last step (what the controller observes)."""

    worker_id: int
    models: tuple[str, ...]
    block_size: int
    total_blocks: int
    used_blocks: int
    free_blocks: int
    pages_per_block: dict[str, int]
    num_running: int
    num_waiting: int
    decode_steps: int
    arena_bytes: int
    page_bytes: int
    weight_bytes: int
    kv_bytes_used: int
    seqs: tuple[SeqSnap, ...]
    time_s: float


@dataclass(slots=True)
class Report:
    """What a poll returns: tokens and finishes since the last poll, and a snapshot.

    ``tokens`` maps a request id to ``(index, token_id, text_piece)`` tuples;
    ``finished`` maps it to its finish reason (``stop``, ``length``,
    ``abort``, ``capacity``).
    """

    worker_id: int
    tokens: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)
    snap: WorkerSnap | None = None
    step_s: float = 0.0
    steps: int = 0


class WorkerCore:
    """One GPU's engine and its event buffer (see the module docstring)."""

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
        if spec.device == "cpu":
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self.engine = Engine(
            list(spec.models),
            spec.arena_bytes,
            block_size=spec.block_size,
            device=spec.device,
            dtype=DTYPES[spec.dtype],
            batching=BATCHING.get(spec.batching)(),
            max_running=spec.max_running,
            max_batch_tokens=spec.max_batch_tokens,
            engine_id=spec.worker_id,
        )
        self._report = Report(spec.worker_id)
        self._imports: dict[int, ImportHandle] = {}
        self._handle_ids = itertools.count(1)

    # ----------------------------------------------------------- callbacks
    def _on_token(self, req: EngineRequest, tok: int, piece: str) -> None:
        self._report.tokens.setdefault(req.id, []).append((req.generated, tok, piece))

    def _on_finish(self, req: EngineRequest) -> None:
        self._report.finished[req.id] = req.finish_reason or "stop"

    # ------------------------------------------------------------ requests
    def submit(
        self,
        rid: int,
        model: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_s: float = 0.0,
    ) -> None:
        """Queue a new request under the controller's id ``rid``."""
        self.engine.add_request(
            model,
            prompt_ids,
            params,
            request_id=rid,
            arrival_s=arrival_s,
            on_token=self._on_token,
            on_finish=self._on_finish,
        )

    def resume(
        self,
        rid: int,
        model: str,
        prompt_ids: list[int],
        output_ids: list[int],
        text: str,
        params: SamplingParams,
        arrival_s: float = 0.0,
    ) -> None:
        """Continue a request from the controller's record (its worker failed).

        The request re-prefills prompt + the tokens already streamed and
        generates the rest. Its text continues from ``text`` (what the client
        has); text the failed worker held back for a possible stop string is
        recomputed from the tokens. A sampled request's generator restarts,
        seeded by its seed (or id) plus the tokens already generated: the
        failed worker's generator state is lost with it, so the continuation
        is a valid sample but not the one that worker would have drawn;
        greedy requests continue exactly.
        """
        tok = self.engine.tokenizer(model)
        detok = IncrementalDetokenizer(tok)
        full = "".join(detok.push(t) for t in output_ids)
        held = full[len(text) :] if full.startswith(text) else ""
        seed = params.seed if params.seed is not None else rid
        gen = request_generator(SamplingParams(seed=seed + len(output_ids)), rid)
        state = RequestState(
            id=rid,
            model=model,
            tokens=(*prompt_ids, *output_ids),
            prompt_len=len(prompt_ids),
            params=params,
            generator_state=gen.get_state(),
            n_cached=0,
            text=text,
            held=held,
            detok=snapshot_detok(detok),
            arrival_s=arrival_s,
            on_token=self._on_token,
            on_finish=self._on_finish,
        )
        self.engine.import_tokens(state, request_id=rid)

    def abort(self, rid: int) -> bool:
        """Finish ``rid`` now and free its KV; False when it is not here."""
        req = self.engine.requests.get(rid)
        if req is None:
            return False
        self.engine.abort(rid)
        if rid in self.engine.requests:
            self.engine.pop_finished(rid)
        return True

    # ----------------------------------------------------------- migration
    def export(self, rid: int, with_kv: bool) -> tuple[RequestState, KVChunk | None] | None:
        """Pause ``rid`` and return its state (and KV); None if it is not live here.

        A running request is paused (it keeps its KV until :meth:`release` or
        :meth:`unpause`); a waiting one is only snapshotted — it has no KV, so
        the move is a token migration whatever was asked.
        """
        req = self.engine.requests.get(rid)
        if req is None or req.status == "finished":
            return None
        if req.status == "running":
            self.engine.pause(rid)
        state = self.engine.export_state(rid)
        state = _without_callbacks(state)
        chunk = None
        if with_kv and state.n_cached > 0 and self.engine.pool.has(rid):
            chunk = self.engine.export_kv(rid, copy=True)
        return state, chunk

    def release(self, rid: int) -> None:
        """The request continues elsewhere: free its KV here, send no finish."""
        if rid in self.engine.requests:
            self.engine.release_migrated(rid)
            self.engine.requests.pop(rid, None)
        self._report.tokens.pop(rid, None)

    def unpause(self, rid: int) -> None:
        """The move failed: the paused request runs here again."""
        req = self.engine.requests.get(rid)
        if req is not None and req.status == "paused":
            self.engine.resume(rid)

    def import_request(self, state: RequestState, chunk: KVChunk | None) -> bool:
        """Continue a migrated request here: with its KV (live KV transfer) or,
        without a chunk, by re-prefilling its tokens. False when the KV does not fit."""
        st = _with_callbacks(state, self)
        if chunk is None or state.n_cached < 1:
            self.engine.import_tokens(_as_waiting(st), request_id=state.id)
            return True
        try:
            handle = self.engine.begin_import(state.model, state.n_cached, chunk.layers)
        except PoolFull:
            return False
        try:
            self.engine.write_import(handle, chunk)
            self.engine.commit_import(handle, st, request_id=state.id)
        except BaseException:
            if handle.is_open:
                self.engine.abort_import(handle)
            raise
        return True

    # ---------------------------------------------------------------- step
    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        t0 = time.perf_counter()
        out = self.engine.step()
        self._report.step_s += time.perf_counter() - t0
        self._report.steps += 1
        for rid in out.finished:
            req = self.engine.requests.get(rid)
            if req is not None and req.status == "finished":
                self.engine.pop_finished(rid)

    def has_events(self) -> bool:
        r = self._report
        return bool(r.tokens or r.finished)

    def take_report(self) -> Report:
        """Events since the last call, with a fresh snapshot."""
        rep = self._report
        self._report = Report(self.spec.worker_id)
        rep.snap = self.snapshot()
        return rep

    def snapshot(self) -> WorkerSnap:
        e = self.engine
        pool = e.pool
        seqs = []
        for r in [*e.running, *e.waiting, *(x for x in e.requests.values() if x.migrating)]:
            seqs.append(
                SeqSnap(
                    id=r.id,
                    model=r.model,
                    arrival_s=r.arrival_s,
                    prompt_tokens=r.prompt_tokens,
                    output_tokens=r.output_tokens,
                    generated=r.generated,
                    kv_tokens=r.kv_tokens,
                    demand_tokens=r.demand_tokens,
                    migrating=r.migrating,
                    running=r.status == "running",
                )
            )
        weight_pages = pool.weight_pages()
        return WorkerSnap(
            worker_id=self.spec.worker_id,
            models=tuple(e.models),
            block_size=pool.block_size,
            total_blocks=pool.num_pages - weight_pages,
            used_blocks=pool.kv_pages,
            free_blocks=pool.num_free,
            pages_per_block={m: pool.pages_per_token_block(m) for m in e.models},
            num_running=len(e.running),
            num_waiting=len(e.waiting),
            decode_steps=e.steps,
            arena_bytes=pool.num_pages * pool.page_bytes,
            page_bytes=pool.page_bytes,
            weight_bytes=weight_pages * pool.page_bytes,
            kv_bytes_used=pool.kv_pages * pool.page_bytes,
            seqs=tuple(seqs),
            time_s=time.time(),
        )

    def check_integrity(self) -> None:
        self.engine.check_integrity()


def _without_callbacks(s: RequestState) -> RequestState:
    return replace(s, on_token=None, on_finish=None)


def _with_callbacks(s: RequestState, core: WorkerCore) -> RequestState:
    return replace(s, on_token=core._on_token, on_finish=core._on_finish)


def _as_waiting(s: RequestState) -> RequestState:
    return replace(s, n_cached=0)


class Worker:
    """The Ray actor around :class:`WorkerCore` (created with ``ray.remote``).

    An asyncio actor: :meth:`run` is a task that steps the engine while it has
    work and sleeps on an event otherwise; other calls run between steps, so
    nothing touches the engine concurrently. :meth:`poll` long-polls: it
    returns as soon as there are events, or after ``timeout_s`` with just a
    snapshot.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.core = WorkerCore(spec)
        self._wake = asyncio.Event()
        self._events = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    async def start(self) -> WorkerSnap:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self.core.snapshot()

    async def _run(self) -> None:
        while not self._stopped:
            if not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                self.core.step()
            except Exception:  # an engine bug must not hang the controller's polls
                logger.exception("worker %d: step failed", self.core.spec.worker_id)
                raise
            if self.core.has_events():
                self._events.set()
            await asyncio.sleep(0)

    def _kick(self) -> None:
        self._wake.set()
        self._events.set()

    async def submit(
        self, rid: int, model: str, prompt_ids: list[int], params: SamplingParams, arrival_s: float
    ) -> None:
        self.core.submit(rid, model, prompt_ids, params, arrival_s)
        self._wake.set()

    async def resume(
        self,
        rid: int,
        model: str,
        prompt_ids: list[int],
        output_ids: list[int],
        text: str,
        params: SamplingParams,
        arrival_s: float,
    ) -> None:
        self.core.resume(rid, model, prompt_ids, output_ids, text, params, arrival_s)
        self._wake.set()

    async def abort(self, rid: int) -> bool:
        ok = self.core.abort(rid)
        self._kick()
        return ok

    async def export(self, rid: int, with_kv: bool) -> tuple[RequestState, KVChunk | None] | None:
        return self.core.export(rid, with_kv)

    async def release(self, rid: int) -> None:
        self.core.release(rid)
        self._kick()

    async def unpause(self, rid: int) -> None:
        self.core.unpause(rid)
        self._wake.set()

    async def import_request(self, state: RequestState, chunk: KVChunk | None) -> bool:
        ok = self.core.import_request(state, chunk)
        self._wake.set()
        return ok

    async def poll(self, timeout_s: float) -> Report:
        if not self.core.has_events():
            self._events.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._events.wait(), timeout_s)
        self._events.clear()
        return self.core.take_report()

    async def snapshot(self) -> WorkerSnap:
        return self.core.snapshot()

    async def check_integrity(self) -> None:
        self.core.check_integrity()

    async def stop(self) -> None:
        self._stopped = True
        self._wake.set()
