"""A worker: one (emulated) GPU's engine, driven by the controller.

:class:`WorkerCore` is the plain-Python part (testable without Ray): it owns
an :class:`~fleetserve.runtime.engine.engine.Engine` whose arena — layer
weights plus KV cache — is the GPU's memory budget, runs engine steps, and
reports what happened (tokens, finishes): at the end of each step over the
controller's report channel (:mod:`.channel`), else when the controller
polls.
:class:`Worker` is the Ray actor around it: an asyncio actor that runs
every engine call, steps included, one at a time on one dedicated thread, so
its event loop answers Ray calls while a step runs.

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
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from fleetserve.errors import ConfigError
from fleetserve.policy.batching import engine_batching
from fleetserve.policy.sharing import ServiceStats
from fleetserve.runtime.buddy import (
    GroupRunner,
    RemoteFn,
    StageResult,
    StageRole,
    StageWork,
    free_stage_keys,
    join_chunks,
    stage_export,
    stage_export_layers,
    stage_forward,
    stage_import,
    stage_remote_attention,
    stage_write,
)
from fleetserve.runtime.channel import ReportSink
from fleetserve.runtime.engine.engine import Engine, EngineRequest, Forward
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

T = TypeVar("T")

# how often a worker released with requests still on it looks whether they left,
# and after how long it logs that they did not
SLEEP_RETRY_S = 0.05
SLEEP_WARN_S = 60.0

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
    services: tuple[tuple[str, ServiceStats], ...] = ()  # what a group scheduler reads
    chunked_prefill: bool = False  # engine.chunked_prefill
    spatial_shares: bool = False  # serve.spatial_shares
    cuda_graphs: bool = True  # serve.cuda_graphs
    prefix_caching: bool = False  # engine.prefix_caching
    watermark: float = 0.0  # engine.watermark
    asleep: bool = False  # start without weights or arena (an elastic pool's inactive GPU)
    block_size: int = 16
    step_log: bool = False  # report every local engine step (Report.steps_done)
    cpus: tuple[int, ...] | None = None  # the engine thread's cores (serve.pin_cores)


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
    decoding: bool


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
    layers_held: dict[str, tuple[int, ...]] = field(default_factory=dict)
    num_layers: dict[str, int] = field(default_factory=dict)
    layer_bytes: dict[str, int] = field(default_factory=dict)
    group: int | None = None  # the buddy group it is a stage of (KunServe)
    stage: int | None = None
    group_steps: int = 0
    group_broken: str | None = None  # why the group it leads stopped stepping
    asleep: bool = False  # holds no weights and no arena (an inactive GPU)
    prefix_tokens: tuple[int, int] = (0, 0)  # prompt tokens admitted, of which cache hits
    preemptions: int = 0  # requests its engine preempted, cumulative
    kun_flips: int = 0  # live-exchange victims its groups flipped, cumulative
    group_jobs: tuple[int, int] = (0, 0)  # group jobs run alone, at once (spatial), cumulative
    prefill: tuple[int, float] = (0, 0.0)  # prompt tokens computed, seconds of those steps
    watermark_blocks: int = 0  # KV pages admission keeps free (engine.watermark)


@dataclass(frozen=True, slots=True)
class LiveStage:
    """One copy stage of a live KV migration, from the source (see
    :meth:`WorkerCore.live_stage`).

    ``chunk``: the KV of the token-blocks that filled up since the last stage
    (None: at most ``final_blocks`` are left, or none filled; time for the
    stop-and-copy). ``state``: the request (without callbacks) on the first
    stage, for the destination's pre-commit. ``preemptions``: the request's
    count; a change between stages means its KV was recomputed and the copy
    is void."""

    chunk: KVChunk | None
    full_blocks: int
    preemptions: int
    state: RequestState | None = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One local engine step (``WorkerSpec.step_log``): when it started (Unix
    seconds), how long ``Engine.step`` took, and each model's forward in it."""

    start_s: float
    duration_s: float
    forwards: tuple[Forward, ...]
    more: bool = False  # work was left for a next step (its start - this end: a hand-off)


@dataclass(slots=True)
class Report:
    """What a poll returns: tokens and finishes since the last poll, and a snapshot.

    ``tokens`` maps a request id to ``(index, token_id, text_piece)`` tuples;
    ``finished`` maps it to its finish reason (``stop``, ``length``,
    ``abort``, ``capacity``).

    The ``t_*`` fields are the worker's stamps of the serving path's hops
    (``time.monotonic``; :mod:`fleetserve.runtime.hops`): ``t_steps`` the
    start and end of each local engine step in this report, ``t_tokens``
    per request ``(index, step in t_steps, when the engine emitted it)`` of
    each token a local step made, ``t_admit`` per new request when the actor
    got its submit and when the engine had it, ``t_sent`` when the poll
    handed the report back (or the engine thread wrote it to the
    :mod:`~fleetserve.runtime.channel`).

    ``seq`` and ``seq_end``: the report holds the worker's reports number
    ``seq`` to ``seq_end - 1`` (every report that leaves a worker has the
    next number; merged ones, a range): the controller applies them in that
    order whichever way they came (Ray poll or report channel).
    """

    worker_id: int
    tokens: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)
    snap: WorkerSnap | None = None
    step_s: float = 0.0
    steps: int = 0
    steps_done: list[StepRecord] = field(default_factory=list)
    t_steps: list[tuple[float, float]] = field(default_factory=list)
    t_tokens: dict[int, list[tuple[int, int, float]]] = field(default_factory=dict)
    t_admit: dict[int, tuple[float, float]] = field(default_factory=dict)
    t_sent: float = 0.0
    seq: int = 0
    seq_end: int = 0


class WorkerCore:
    """One GPU's engine and its event buffer (see the module docstring)."""

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
        if spec.device == "cpu":
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self._woken_s: float | None = None  # a wake by new work, not yet reported
        self._prefill = (0, 0.0)  # prompt tokens computed, seconds of the steps doing it
        self.engine = Engine(
            list(spec.models),
            spec.arena_bytes,
            block_size=spec.block_size,
            device=spec.device,
            dtype=DTYPES[spec.dtype],
            batching=engine_batching(spec.batching, len(spec.models)),
            services=dict(spec.services),
            max_running=spec.max_running,
            max_batch_tokens=spec.max_batch_tokens,
            chunked_prefill=spec.chunked_prefill,
            prefix_caching=spec.prefix_caching,
            watermark=spec.watermark,
            engine_id=spec.worker_id,
            spatial_shares=spec.spatial_shares,
            decode_graphs="auto" if spec.cuda_graphs else "off",
        )
        if spec.asleep:
            self.engine.sleep()
        self._report = Report(spec.worker_id)
        self._imports: dict[int, ImportHandle] = {}
        self._handle_ids = itertools.count(1)
        self.role: StageRole | None = None  # a stage of a KunServe buddy group
        self.group: GroupRunner | None = None  # ... and its leader
        self.stage_keys: set[int] = set()  # group requests with a table here
        self.remote: RemoteFn | None = None  # the way to the other stages' remote attention
        self.kun_flips = 0  # flips of the groups it led before the current one
        self.copy_keys: set[int] = set()  # tables here that are live-exchange copies not flipped
        self._stepping = False  # a local engine step runs (its tokens get hop stamps)
        # events sealed at a step's end, with a snapshot, for the poll to take
        # without the engine (see seal); the lock guards only this hand-over
        self._sealed: Report | None = None
        self._sealed_lock = threading.Lock()
        self._seq = 0  # the next report's number (Report.seq)
        self.sink: ReportSink | None = None  # the report channel (engine thread only)

    # ----------------------------------------------------------- callbacks
    def _on_token(self, req: EngineRequest, tok: int, piece: str) -> None:
        rep = self._report
        rep.tokens.setdefault(req.id, []).append((req.generated, tok, piece))
        if self._stepping:
            mark = (req.generated, len(rep.t_steps), time.monotonic())
            rep.t_tokens.setdefault(req.id, []).append(mark)

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
        received: float | None = None,
    ) -> None:
        """Queue a new request under the controller's id ``rid`` (in the
        buddy group this worker leads, if it leads one for ``model``).
        ``received``: when the actor got the call (``time.monotonic``; a hop
        stamp)."""
        self._awake()
        if self.group is not None and model == self.group.model:
            self.group.add(rid, prompt_ids, params, arrival_s)
        else:
            self.engine.add_request(
                model,
                prompt_ids,
                params,
                request_id=rid,
                arrival_s=arrival_s,
                on_token=self._on_token,
                on_finish=self._on_finish,
            )
        now = time.monotonic()
        self._report.t_admit[rid] = (received if received is not None else now, now)

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
        self._awake()
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
        if self.group is not None and model == self.group.model:
            self.group.adopt(state, 0, [0] * len(self.group.role.stages))
            return
        self.engine.import_tokens(state, request_id=rid)

    def abort(self, rid: int) -> bool:
        """Finish ``rid`` now and free its KV; False when it is not here."""
        if self.group is not None and self.group.abort(rid):
            return True
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
        self._drop_tokens(rid)

    def _drop_tokens(self, rid: int) -> None:
        """Forget the tokens of ``rid`` not yet polled (sealed ones too)."""
        self._report.tokens.pop(rid, None)
        with self._sealed_lock:
            if self._sealed is not None:
                self._sealed.tokens.pop(rid, None)

    def unpause(self, rid: int) -> None:
        """The move failed: the paused request runs here again."""
        req = self.engine.requests.get(rid)
        if req is not None and req.status == "paused":
            self.engine.resume(rid)

    def import_request(self, state: RequestState, chunk: KVChunk | None) -> bool:
        """Continue a migrated request here: with its KV (live KV transfer) or,
        without a chunk, by re-prefilling its tokens. False when the KV does not fit."""
        self._awake()
        st = _with_callbacks(state, self)
        if self.group is not None and state.model == self.group.model:
            self.group.adopt(_as_waiting(state), 0, [0] * len(self.group.role.stages))
            return True
        if chunk is None or state.n_cached < 1:
            self.engine.import_tokens(_as_waiting(st), request_id=state.id)
            return True
        return self._import_kv(st, chunk)

    def _import_kv(self, st: RequestState, chunk: KVChunk) -> bool:
        """Run ``st`` here on the KV of ``chunk`` (all of its cached tokens);
        False when the pages are not free (nothing is reserved then)."""
        try:
            handle = self.engine.begin_import(st.model, st.n_cached, chunk.layers)
        except PoolFull:
            return False
        try:
            self.engine.write_import(handle, chunk)
            self.engine.commit_import(handle, st, request_id=st.id)
        except BaseException:
            if handle.is_open:
                self.engine.abort_import(handle)
            raise
        return True

    # -------------------------------------------------- live KV migration
    # The controller drives Llumnix's staged protocol between two workers
    # (engine.migration.migrate_live is the same protocol between two engines
    # of one process): copy stages while the request decodes on the source,
    # the destination pre-commits it paused and grows its pages as it grows;
    # then a stop-and-copy of the tail. Both sides hold the KV until the end.

    def live_stage(self, rid: int, first_tb: int, final_blocks: int) -> LiveStage | None:
        """The next copy stage of ``rid`` from token-block ``first_tb`` on (the
        request keeps running); None when it is not running here (finished,
        preempted or queued: the move is off)."""
        e = self.engine
        req = e.requests.get(rid)
        if req is None or req.status != "running" or not e.pool.has(rid):
            return None
        bs = e.pool.block_size
        full = req.n_cached // bs
        left = -(-req.n_cached // bs) - first_tb
        if left <= final_blocks or full <= first_tb:
            return LiveStage(None, first_tb, req.preemptions)
        chunk = e.export_kv(rid, first_tb, full - first_tb, copy=True)
        state = _without_callbacks(e.export_state(rid)) if first_tb == 0 else None
        return LiveStage(chunk, full, req.preemptions, state)

    def live_receive(self, rid: int, chunk: KVChunk, state: RequestState | None) -> bool:
        """Take a copy stage of incoming ``rid``: the first (``state`` given)
        reserves the pages and pre-commits the request here, paused; later
        ones grow its pages and write them. False when the pages are not free:
        nothing of the import is left here."""
        self._awake()
        e = self.engine
        if state is not None:
            try:
                handle = e.begin_import(state.model, chunk.end_token, chunk.layers)
            except PoolFull:
                return False
            try:
                e.write_import(handle, chunk)
                pre = e.precommit_import(handle, _with_callbacks(state, self))
            except BaseException:
                if handle.is_open:
                    e.abort_import(handle)
                raise
            if pre != rid:  # the id is taken here (never expected): refuse
                e.abort_paused(pre)
                return False
            return True
        try:
            e.grow_paused(rid, chunk.end_token)
        except PoolFull:
            e.abort_paused(rid)
            return False
        e.write_paused(rid, chunk)
        return True

    def live_final(self, rid: int, first_tb: int) -> tuple[RequestState, KVChunk] | None:
        """The stop: pause ``rid`` and return its state and the KV from
        token-block ``first_tb`` to its end (the partial last block too);
        None when it is not running here. It keeps its KV until
        :meth:`release` (moved) or :meth:`unpause` (the move failed)."""
        e = self.engine
        req = e.requests.get(rid)
        if req is None or req.status != "running" or not e.pool.has(rid):
            return None
        e.pause(rid)
        state = _without_callbacks(e.export_state(rid))
        return state, e.export_kv(rid, first_tb, copy=True)

    def live_finish(self, rid: int, state: RequestState, chunk: KVChunk) -> bool:
        """Write the tail into pre-committed ``rid``, bring it to ``state`` and
        run it here; False when the tail's pages are not free (nothing of the
        import is left here)."""
        e = self.engine
        try:
            e.grow_paused(rid, state.n_cached)
        except PoolFull:
            e.abort_paused(rid)
            return False
        try:
            e.write_paused(rid, chunk)
            e.finish_import(rid, state)
        except BaseException:
            req = e.requests.get(rid)
            if req is not None and req.status == "paused":
                e.abort_paused(rid)
            raise
        return True

    def live_abort(self, rid: int) -> bool:
        """Undo the pre-commit of incoming ``rid`` (the move is off); False
        when nothing of it is here."""
        req = self.engine.requests.get(rid)
        if req is None or req.status != "paused":
            return False
        self.engine.abort_paused(rid)
        return True

    # ------------------------------------------------- KunServe buddy groups
    def evacuate(
        self, model: str, role: StageRole, live: bool = False
    ) -> list[tuple[RequestState, dict[int, KVChunk], int]]:
        """Hand this worker's requests of ``model`` to the buddy group it joins
        as ``role`` (the first half of a merge; see :mod:`.buddy`).

        Each request comes back as ``(state, chunks, blocks)``:

        * ``live`` (a live exchange): a running request keeps its whole table
          here, every layer's KV (``blocks`` token-blocks), and no chunk is
          copied: the other stages run its attention here
          (:func:`.buddy.stage_remote_attention`);

        * a running request of the engine keeps the KV of ``role.keep`` here
          (its table now holds those layers only, ``blocks`` token-blocks) and
          ``chunks[j]`` is a copy of the KV of stage ``j``'s layers, for every
          other stage; the engine forgets the request;
        * a waiting one has no KV (``n_cached`` 0, no chunks, 0 blocks);
        * when this worker was a stage of another group (groups merge), that
          group's tables here are freed and, on its leader, its requests come
          back with ``n_cached`` 0 (they are recomputed in the new group).
        """
        out: list[tuple[RequestState, dict[int, KVChunk], int]] = []
        e = self.engine
        if self.role is not None:  # an older group merges into the new one
            if self.group is not None:
                out.extend((st, {}, 0) for st in self.group.drop_all())
                self.kun_flips += self.group.flips
                self.group = None
            free_stage_keys(e, list(self.stage_keys), self.stage_keys)
            self.copy_keys.clear()
            self.role = None
        keep = set(role.keep)
        for req in [r for r in [*e.running, *e.waiting] if r.model == model]:
            state = _without_callbacks(e.export_state(req.id))
            rid = req.id
            if live and req.status == "running" and req.n_cached > 0 and e.pool.has(rid):
                e.running.remove(req)
                del e.requests[rid]
                self.stage_keys.add(rid)
                out.append((state, {}, e.pool.token_blocks(rid)))
            elif req.status == "running" and req.n_cached > 0 and e.pool.has(rid):
                chunks = {
                    j: e.export_kv(rid, layers=list(range(a, b)), copy=True)
                    for j, (_w, (a, b)) in enumerate(role.stages)
                    if j != role.index
                }
                e.pool.drop_layers(rid, tuple(li for li in e.pool.layers(rid) if li not in keep))
                e.running.remove(req)
                del e.requests[rid]
                self.stage_keys.add(rid)
                out.append((state, chunks, e.pool.token_blocks(rid)))
            else:
                e.release_migrated(rid)
                del e.requests[rid]
                out.append((_as_waiting(state), {}, 0))
            self._drop_tokens(rid)
        return out

    def become_stage(self, role: StageRole) -> int:
        """Drop the layers of ``role.model`` outside ``role.keep``; returns the
        number of layers dropped (their pages join the KV pool at once)."""
        e = self.engine
        keep = set(role.keep)
        gone = [li for li in e.held_layers(role.model) if li not in keep]
        for li in gone:
            e.drop_layer(role.model, li)
        self.role = role
        return len(gone)

    def lead(self, role: StageRole, stage_free: list[int], stage_total: list[int]) -> None:
        """Run the group (this worker is its stage 0): see :class:`.buddy.GroupRunner`."""
        if role.index != 0 or self.role != role:
            raise ValueError("lead() is for the group's stage 0, after become_stage()")
        self.group = GroupRunner(
            self.engine,
            role,
            max_running=self.spec.max_running,
            max_batch_tokens=self.spec.max_batch_tokens,
            stage_free=stage_free,
            stage_total=stage_total,
            held=self.stage_keys,
            emit=self._emit_group,
            finish=self._finish_group,
        )

    def adopt(self, items: list[tuple[RequestState, int, list[int], int | None]]) -> None:
        """The leader takes the merged requests: ``(state, n_cached, blocks per
        stage, origin)`` (origin: the stage holding all its KV, a live
        exchange's victim; None otherwise)."""
        if self.group is None:
            raise ValueError(f"worker {self.spec.worker_id} leads no group")
        for state, n_cached, blocks, origin in items:
            self.group.adopt(state, n_cached, blocks, origin)

    def stage_pages(self) -> tuple[int, int]:
        """``(free pages, KV pages when empty)`` of this stage."""
        pool = self.engine.pool
        return pool.num_free, pool.num_pages - pool.weight_pages()

    def stage_forward(self, work: StageWork) -> StageResult:
        if self.role is None:
            raise ValueError(f"worker {self.spec.worker_id} is no stage of a group")
        return stage_forward(
            self.engine, self.role, work, self.stage_keys, self.remote, self.copy_keys
        )

    def stage_remote_attention(
        self, work: StageWork, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The attention of ``layer`` for victims whose KV is here (a live
        exchange); see :func:`.buddy.stage_remote_attention`."""
        if not self.stage_keys.issuperset(work.keys):
            raise ValueError(f"worker {self.spec.worker_id}: remote attention for keys not here")
        return stage_remote_attention(self.engine, work, layer, q, k, v)

    def stage_import(
        self, key: int, n_tokens: int, chunk: KVChunk, copy: bool = False
    ) -> int | None:
        """``copy``: a live exchange's copy (see :attr:`copy_keys`)."""
        if self.role is None:
            raise ValueError(f"worker {self.spec.worker_id} is no stage of a group")
        got = stage_import(self.engine, self.role, key, n_tokens, chunk, self.stage_keys)
        if copy and got is not None:
            self.copy_keys.add(key)
        return got

    def stage_free(self, keys: list[int]) -> int:
        self.copy_keys.difference_update(keys)
        return free_stage_keys(self.engine, keys, self.stage_keys)

    def stage_free_copy(self, key: int) -> int:
        """Free ``key``'s table if it is still a live exchange's copy (not a
        table the request has run with since); pages freed."""
        if key not in self.copy_keys:
            return 0
        self.copy_keys.discard(key)
        return free_stage_keys(self.engine, [key], self.stage_keys)

    # live exchange (buddy.GroupRunner._exchange): a victim's KV crosses while it decodes
    def stage_export_layers(
        self, key: int, layers: tuple[int, ...], first_tb: int, n_tokens: int
    ) -> KVChunk:
        if self.role is None or key not in self.stage_keys:
            raise ValueError(f"worker {self.spec.worker_id}: request {key} has no table here")
        return stage_export_layers(self.engine, self.role.model, key, layers, first_tb, n_tokens)

    def stage_write(self, key: int, n_tokens: int, chunk: KVChunk) -> int | None:
        if key not in self.stage_keys:
            raise ValueError(f"worker {self.spec.worker_id}: request {key} has no table here")
        got = stage_write(self.engine, key, n_tokens, chunk)
        if got is not None:
            self.copy_keys.discard(key)  # flipped: the request's own table from now on
        return got

    def stage_drop_layers(self, key: int, layers: tuple[int, ...]) -> int:
        """Free ``key``'s pages of ``layers`` here (their KV crossed); pages freed."""
        if key not in self.stage_keys:
            return 0
        return self.engine.pool.drop_layers(key, layers)

    def restore_layers(self, model: str) -> tuple[int, int]:
        """Reload dropped layers of ``model`` from the host copy (the weight
        source) while the pool has room; returns ``(restored now, still missing)``."""
        e = self.engine
        n = e.models[model].cfg.spec.num_layers
        missing = [li for li in range(n) if li not in e.models[model].layers]
        done = 0
        for li in missing:
            if not e.can_restore_layer(model):
                break
            e.restore_layer(model, li)
            done += 1
        return done, len(missing) - done

    def leave_group(self) -> list[RequestState]:
        """Stop being a stage: free the group's tables here; on the leader,
        return its requests' states (``n_cached`` 0) and stop running it."""
        out: list[RequestState] = []
        if self.group is not None:
            out = self.group.drop_all()
            self.kun_flips += self.group.flips
            self.group = None
        free_stage_keys(self.engine, list(self.stage_keys), self.stage_keys)
        self.copy_keys.clear()
        self.role = None
        return out

    # re-placement (runtime.replace: SeaLLM's adaptive replacement)
    def load_model(self, source: str, services: tuple[tuple[str, ServiceStats], ...]) -> float:
        """Host one more model (``source``: built-in name or checkpoint folder);
        the seconds its weights took to load, or -1 when they do not fit the
        arena now (nothing changed)."""
        try:
            return self.engine.load_model(source, dict(services))
        except PoolFull:
            return -1.0

    def unload_model(self, name: str, services: tuple[tuple[str, ServiceStats], ...]) -> int:
        """Stop hosting ``name``; bytes freed, or -1 while requests of it are
        still here (nothing changed: call again once they have left)."""
        if any(r.model == name for r in self.engine.requests.values()):
            return -1
        return self.engine.unload_model(name, dict(services))

    # live restore (kun_control.KunRuntime: a restored group's requests move
    # to its members, each gathered from the stages on one of them)
    def group_handover(self) -> list[RequestState]:
        """The leader stops running its group and hands its requests over
        (:meth:`.buddy.GroupRunner.handover`); the stage tables stay."""
        if self.group is None:
            return []
        out = self.group.handover()
        self.kun_flips += self.group.flips
        self.group = None
        return out

    def stage_export(self, key: int, n_tokens: int) -> KVChunk | None:
        """A copy of ``key``'s KV here (None: it has no table here, as a live
        exchange's victim away from its origin)."""
        if self.role is None:
            raise ValueError(f"worker {self.spec.worker_id} is no stage of a group")
        if key not in self.stage_keys:
            return None
        return stage_export(self.engine, self.role.model, key, n_tokens)

    def restore_import(self, state: RequestState, chunks: list[KVChunk]) -> bool:
        """Continue ``state`` here with its KV joined from every stage's chunk
        (this stage's own table is freed first: its pages make room). False
        when the pages are short: it is queued here to be recomputed instead
        (same tokens, sampler state kept)."""
        self._awake()
        free_stage_keys(self.engine, [state.id], self.stage_keys)
        self.copy_keys.discard(state.id)
        st = _with_callbacks(state, self)
        if self._import_kv(st, join_chunks(chunks)):
            return True
        self.engine.import_tokens(_as_waiting(st), request_id=state.id)
        return False

    def group_idle(self) -> bool:
        return self.group is None or not self.group.requests

    def _emit_group(self, rid: int, idx: int, tok: int, piece: str) -> None:
        self._report.tokens.setdefault(rid, []).append((idx, tok, piece))

    def _finish_group(self, rid: int, reason: str) -> None:
        self._report.finished[rid] = reason

    # ---------------------------------------------------------------- step
    def has_work(self) -> bool:
        return self.engine.has_work()

    def group_has_work(self) -> bool:
        return self.group is not None and self.group.has_work()

    def step(self) -> None:
        t0 = time.perf_counter()
        m0 = time.monotonic()
        self._stepping = True
        try:
            out = self.engine.step()
        finally:
            self._stepping = False
        dt = time.perf_counter() - t0
        self._report.t_steps.append((m0, time.monotonic()))
        self._report.step_s += dt
        self._report.steps += 1
        computed = sum(n for f in out.forwards for n, _cached in f.chunks)
        if computed:  # the re-prefill rate Mell's adaptive mechanism budgets with
            self._prefill = (self._prefill[0] + computed, self._prefill[1] + dt)
        if self.spec.step_log and out.forwards:
            self._report.steps_done.append(
                StepRecord(time.time() - dt, dt, tuple(out.forwards), self.engine.has_work())
            )
        for rid in out.finished:
            req = self.engine.requests.get(rid)
            if req is not None and req.status == "finished":
                self.engine.pop_finished(rid)

    def run_steps(self, more: Callable[[], bool], sealed: Callable[[], None]) -> None:
        """Engine steps back to back while there is local work and ``more()``
        says go on (nobody waits for the engine); after each, the step's
        events are sealed (:meth:`seal`), and ``sealed()`` is called when
        they wait for the poll. One step at least."""
        while True:
            self.step()
            if self.seal():
                sealed()
            if not more() or not self.engine.has_work():
                return

    def seal(self) -> bool:
        """Send the events buffered so far, with a snapshot taken now: over the
        report channel when the worker has one (:meth:`set_sink`), else to
        where :meth:`take_sealed` finds them for the poll (merged after any not
        yet taken). True when they wait for the poll. Call with the engine
        (the engine thread)."""
        r = self._report
        if not (r.tokens or r.finished):
            return False
        self._report = Report(self.spec.worker_id)
        r.snap = self.snapshot()
        self._number(r)
        if self.sink is not None:
            r.t_sent = time.monotonic()
            try:
                self.sink.send(r)
                return False
            except OSError as e:  # the controller stopped reading: the poll takes over
                logger.warning("worker %d: report channel broken: %s", self.spec.worker_id, e)
                self.sink.close()
                self.sink = None
        with self._sealed_lock:
            self._sealed = r if self._sealed is None else _merge(self._sealed, r)
        return True

    def set_sink(self, sink: ReportSink | None) -> None:
        """Send step reports over ``sink`` from now on (None: through the poll)."""
        if self.sink is not None:
            self.sink.close()
        self.sink = sink

    def _number(self, r: Report) -> None:
        r.seq = self._seq
        self._seq += 1
        r.seq_end = self._seq

    def take_sealed(self) -> Report | None:
        """The sealed events (:meth:`seal`), or None; needs no engine: safe on
        the actor's loop while a step runs."""
        with self._sealed_lock:
            rep, self._sealed = self._sealed, None
        return rep

    def has_events(self) -> bool:
        r = self._report
        return self._sealed is not None or bool(r.tokens or r.finished)

    def take_report(self) -> Report:
        """Events since the last call (sealed ones first), with a fresh snapshot."""
        rep = self._report
        self._report = Report(self.spec.worker_id)
        self._number(rep)
        old = self.take_sealed()
        if old is not None:
            rep = _merge(old, rep)
        rep.snap = self.snapshot()
        return rep

    def snapshot(self) -> WorkerSnap:
        e = self.engine
        pool = e.pool
        seqs = []
        live = [*e.running, *e.prefilling, *e.waiting]
        for r in [*live, *(x for x in e.requests.values() if x.migrating)]:
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
                    decoding=r.decoding,
                )
            )
        if self.group is not None:
            g = self.group
            for gr in g.live:
                seqs.append(
                    SeqSnap(
                        id=gr.id,
                        model=g.model,
                        arrival_s=g.meta[gr.id].arrival_s,
                        prompt_tokens=gr.prompt_len,
                        output_tokens=gr.params.max_tokens,
                        generated=gr.generated,
                        kv_tokens=gr.n_cached,
                        demand_tokens=len(gr.tokens),
                        migrating=False,
                        running=gr.n_cached > 0,
                        decoding=0 < gr.n_cached >= len(gr.tokens) - 1,
                    )
                )
        held_pages = pool.weight_pages()
        # asleep: the KV capacity it will have awake (its weights in the arena)
        weight_pages = held_pages + e.asleep_weight_pages()
        # KV in use: requests' own pages (a pass over the page table: once) and
        # the cached blocks requests reference (prefix caching; the others
        # count as free, as the engine admits)
        kv_pages = pool.kv_pages + pool.cached_pages - pool.evictable_pages
        return WorkerSnap(
            worker_id=self.spec.worker_id,
            models=tuple(e.models),
            block_size=pool.block_size,
            total_blocks=pool.num_pages - weight_pages,
            used_blocks=kv_pages,
            free_blocks=pool.num_available - (weight_pages - held_pages),
            watermark_blocks=int(e.watermark * (pool.num_pages - weight_pages)),
            pages_per_block={m: pool.pages_per_token_block(m) for m in e.models},
            num_running=len(e.running) + len(e.prefilling),
            num_waiting=len(e.waiting),
            decode_steps=e.steps,
            arena_bytes=pool.num_pages * pool.page_bytes,
            page_bytes=pool.page_bytes,
            weight_bytes=held_pages * pool.page_bytes,
            kv_bytes_used=kv_pages * pool.page_bytes,
            seqs=tuple(seqs),
            time_s=time.time(),
            layers_held={m: tuple(e.held_layers(m)) for m in e.models},
            num_layers={m: e.models[m].cfg.spec.num_layers for m in e.models},
            layer_bytes={m: e.layer_bytes(m) for m in e.models},
            group=self.role.group if self.role is not None else None,
            stage=self.role.index if self.role is not None else None,
            group_steps=self.group.steps if self.group is not None else 0,
            group_broken=self.group.broken if self.group is not None else None,
            asleep=e.asleep,
            prefix_tokens=(e.prefix_queries, e.prefix_hits),
            preemptions=e.preemptions,
            kun_flips=self.kun_flips + (self.group.flips if self.group is not None else 0),
            group_jobs=(e.group_jobs_alone, e.group_jobs_at_once),
            prefill=self._prefill,
        )

    # --------------------------------------------------------------- sleep
    def activate(self) -> float:
        """Wake the engine (load the arena and weights); the seconds it took.
        When new work woke it first (the calls came reordered), that wake's
        seconds: each activation is reported once; 0 when it was awake."""
        if self._woken_s is not None:
            took, self._woken_s = self._woken_s, None
            if not self.engine.asleep:
                return took
        return self.engine.wake()

    def _awake(self) -> None:
        """Wake an asleep engine that gets work before its activation call
        (the controller activates first; this only covers a reordered call)."""
        if self.engine.asleep:
            took = self._woken_s = self.engine.wake()
            logger.info("worker %d: woken by new work (%.3f s)", self.spec.worker_id, took)

    def deactivate(self) -> bool:
        """Put an idle engine to sleep (no weights, no arena); False when it
        has requests (it stays awake)."""
        if self.engine.requests or self.engine.has_work():
            return False
        self.engine.sleep()
        return True

    def check_integrity(self) -> None:
        self.engine.check_integrity()


def _merge(a: Report, b: Report) -> Report:
    """``a`` with the events of ``b`` (which came after) added; ``b``'s snapshot."""
    off = len(a.t_steps)
    for rid, toks in b.tokens.items():
        a.tokens.setdefault(rid, []).extend(toks)
    for rid, marks in b.t_tokens.items():
        a.t_tokens.setdefault(rid, []).extend((i, s + off, t) for i, s, t in marks)
    a.finished.update(b.finished)
    a.t_steps.extend(b.t_steps)
    a.t_admit.update(b.t_admit)
    a.step_s += b.step_s
    a.steps += b.steps
    a.steps_done.extend(b.steps_done)
    a.snap = b.snap
    a.seq_end = b.seq_end
    return a


def _without_callbacks(s: RequestState) -> RequestState:
    return replace(s, on_token=None, on_finish=None)


def _with_callbacks(s: RequestState, core: WorkerCore) -> RequestState:
    return replace(s, on_token=core._on_token, on_finish=core._on_finish)


def _as_waiting(s: RequestState) -> RequestState:
    return replace(s, n_cached=0)


class Worker:
    """The Ray actor around :class:`WorkerCore` (created with ``ray.remote``).

    An asyncio actor whose engine work runs on one dedicated thread. Every
    call that touches the core (engine steps, submits, polls' reports,
    migrations, buddy-group stages) goes through :meth:`_call`: an
    ``asyncio.Lock`` (FIFO) plus a single-thread executor, so the engine is
    only ever touched by one call at a time, in arrival order. The event
    loop stays free while a step runs (the forward releases the GIL in its
    kernels), so Ray delivers calls during the step: a submit is queued for
    the lock at once and enters the very next step. A buddy group's leader
    runs its group step on the loop (it awaits its stages' actors) holding
    the same lock.

    :meth:`_run` is a task that steps the engine while it has work and
    sleeps on an event otherwise. Its steps run back to back on the engine
    thread (:meth:`WorkerCore.run_steps`, one executor call) until a call
    queues for the lock: no trip through the loop between two steps. At the
    end of each step the engine thread seals the step's tokens with a
    snapshot (:meth:`WorkerCore.seal`) and, once :meth:`connect` gave it the
    controller's report channel (:mod:`.channel`), writes them there itself:
    no Ray call per step. Without a channel (a worker on another node) it
    wakes the poll instead. :meth:`poll` long-polls: it returns as soon as
    there are events — sealed ones without waiting for the engine, so a step
    in progress delays nothing already made — or after ``timeout_s`` with
    just a snapshot.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.core = WorkerCore(spec)
        self._wake = asyncio.Event()
        self._events = asyncio.Event()
        self._lock = asyncio.Lock()
        self._thread = ThreadPoolExecutor(
            1,
            thread_name_prefix=f"worker{spec.worker_id}-engine",
            initializer=_engine_thread_init,
            initargs=(spec,),
        )
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._queued = 0  # calls waiting for the engine (a run of steps yields to them)
        self._stages: list[Any] = []  # a group leader's stage actors (index 0: unused)
        self._remote_thread = ThreadPoolExecutor(
            1,
            thread_name_prefix=f"worker{spec.worker_id}-remote",
            initializer=_engine_thread_init,
            initargs=(spec,),
        )
        self._activations = 0  # activate calls received (a pending sleep yields to a new one)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine thread, after every call queued before it."""
        self._queued += 1
        try:
            await self._lock.acquire()
        finally:
            self._queued -= 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        finally:
            self._lock.release()

    def _more_steps(self) -> bool:
        """A run of steps goes on (read on the engine thread between steps)."""
        return not self._queued and not self._stopped

    async def start(self) -> WorkerSnap:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return await self._call(self.core.snapshot)

    async def _run(self) -> None:
        core = self.core
        loop = asyncio.get_running_loop()

        def sealed() -> None:  # on the engine thread: wake a waiting poll
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(self._events.set)

        try:
            while not self._stopped:
                # read on the loop while the engine thread may be busy: a stale
                # answer only costs one more turn (a submit sets _wake after
                # its call has run)
                local, grouped = core.has_work(), core.group_has_work()
                if not local and not grouped:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                try:
                    if local:  # steps back to back until a call waits (one with a group)
                        more = self._more_steps if not grouped else _once
                        await self._call(core.run_steps, more, sealed)
                    if grouped:
                        async with self._lock:
                            await self._group_step()
                except Exception:  # an engine bug must not hang the controller's polls
                    logger.exception("worker %d: step failed", core.spec.worker_id)
                    raise
                if core.has_events():
                    self._events.set()
                # one turn of the loop: a poll woken just now queues for the lock
                # ahead of the next step (calls that came during the step already are)
                await asyncio.sleep(0)
        finally:
            if core.sink is not None:
                core.sink.close()
            self._thread.shutdown(wait=False)

    async def _group_step(self) -> None:
        g = self.core.group
        if g is None:  # handed over (a live restore) since the loop looked
            return
        t0 = time.perf_counter()
        try:
            await g.step(self._call_stage)
        except Exception as e:  # a stage died: the controller dissolves the group
            g.broken = g.broken or f"{type(e).__name__}: {e}"
            logger.warning(
                "worker %d: group %d broken: %s", self.core.spec.worker_id, g.role.group, e
            )
            self._events.set()
        rep = self.core._report
        rep.step_s += time.perf_counter() - t0
        rep.steps += 1

    async def _call_stage(self, j: int, work: StageWork) -> StageResult:
        return await self._stages[j].stage_forward.remote(work)

    def _kick(self) -> None:
        self._wake.set()
        self._events.set()

    async def submit(
        self, rid: int, model: str, prompt_ids: list[int], params: SamplingParams, arrival_s: float
    ) -> None:
        got = time.monotonic()
        await self._call(self.core.submit, rid, model, prompt_ids, params, arrival_s, got)
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
        await self._call(
            self.core.resume, rid, model, prompt_ids, output_ids, text, params, arrival_s
        )
        self._wake.set()

    async def abort(self, rid: int) -> bool:
        ok = await self._call(self.core.abort, rid)
        self._kick()
        return ok

    async def export(self, rid: int, with_kv: bool) -> tuple[RequestState, KVChunk | None] | None:
        return await self._call(self.core.export, rid, with_kv)

    async def release(self, rid: int) -> None:
        await self._call(self.core.release, rid)
        self._kick()

    async def unpause(self, rid: int) -> None:
        await self._call(self.core.unpause, rid)
        self._wake.set()

    async def import_request(self, state: RequestState, chunk: KVChunk | None) -> bool:
        ok = await self._call(self.core.import_request, state, chunk)
        self._wake.set()
        return ok

    # live KV migration (see WorkerCore)
    async def live_stage(self, rid: int, first_tb: int, final_blocks: int) -> LiveStage | None:
        return await self._call(self.core.live_stage, rid, first_tb, final_blocks)

    async def live_receive(self, rid: int, chunk: KVChunk, state: RequestState | None) -> bool:
        return await self._call(self.core.live_receive, rid, chunk, state)

    async def live_final(self, rid: int, first_tb: int) -> tuple[RequestState, KVChunk] | None:
        return await self._call(self.core.live_final, rid, first_tb)

    async def live_finish(self, rid: int, state: RequestState, chunk: KVChunk) -> bool:
        ok = await self._call(self.core.live_finish, rid, state, chunk)
        self._wake.set()
        return ok

    async def live_abort(self, rid: int) -> bool:
        ok = await self._call(self.core.live_abort, rid)
        self._kick()
        return ok

    # KunServe buddy groups (see WorkerCore and .buddy)
    async def evacuate(
        self, model: str, role: StageRole, live: bool = False
    ) -> list[tuple[RequestState, dict[int, KVChunk], int]]:
        return await self._call(self.core.evacuate, model, role, live)

    async def become_stage(self, role: StageRole) -> int:
        return await self._call(self.core.become_stage, role)

    async def lead(
        self, role: StageRole, stages: list[Any], stage_free: list[int], stage_total: list[int]
    ) -> None:
        await self._call(self.core.lead, role, stage_free, stage_total)
        self._stages = list(stages)
        g = self.core.group
        assert g is not None
        loop = asyncio.get_running_loop()
        # stage 0 on the engine thread (the group step holds the lock): the loop
        # stays free to serve the remote attention the other stages ask of it
        g._local = lambda work: loop.run_in_executor(self._thread, self.core.stage_forward, work)
        g.remote = self.core.remote

        async def ask_now(j: int, name: str, *args: Any) -> Any:  # inside a step (lock held)
            if j == 0:
                return await loop.run_in_executor(self._thread, getattr(self.core, name), *args)
            return await getattr(self._stages[j], name).remote(*args)

        async def ask_bg(j: int, name: str, *args: Any) -> Any:  # beside the steps
            if j == 0:
                return await self._call(getattr(self.core, name), *args)
            return await getattr(self._stages[j], name).remote(*args)

        g.ask_now, g.ask_bg = ask_now, ask_bg

    async def set_peers(self, handles: list[Any]) -> None:
        """The group's stage actors, in stage order: a live exchange's victims
        reach their origin's KV through them (remote attention)."""
        loop = asyncio.get_running_loop()
        peers = list(handles)

        async def ask(owner: int, *args: Any) -> torch.Tensor:
            return await peers[owner].stage_remote_attention.remote(*args)

        def remote(owner: int, *args: Any) -> torch.Tensor:
            # on the engine thread: wait for the owner's answer (its loop runs the call)
            return asyncio.run_coroutine_threadsafe(ask(owner, *args), loop).result()

        self.core.remote = remote
        if self.core.group is not None:
            self.core.group.remote = remote

    async def stage_remote_attention(
        self, work: StageWork, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # not behind the engine lock: the stage waiting for this answer may be
        # the one holding it (two stages asking each other would wait for ever)
        return await asyncio.get_running_loop().run_in_executor(
            self._remote_thread, self.core.stage_remote_attention, work, layer, q, k, v
        )

    async def adopt(self, items: list[tuple[RequestState, int, list[int], int | None]]) -> None:
        await self._call(self.core.adopt, items)
        self._wake.set()

    async def stage_pages(self) -> tuple[int, int]:
        return await self._call(self.core.stage_pages)

    async def stage_forward(self, work: StageWork) -> StageResult:
        return await self._call(self.core.stage_forward, work)

    async def stage_import(
        self, key: int, n_tokens: int, chunk: KVChunk, copy: bool = False
    ) -> int | None:
        return await self._call(self.core.stage_import, key, n_tokens, chunk, copy)

    async def stage_free_copy(self, key: int) -> int:
        return await self._call(self.core.stage_free_copy, key)

    async def stage_free(self, keys: list[int]) -> int:
        return await self._call(self.core.stage_free, keys)

    async def stage_export_layers(
        self, key: int, layers: tuple[int, ...], first_tb: int, n_tokens: int
    ) -> KVChunk:
        return await self._call(self.core.stage_export_layers, key, layers, first_tb, n_tokens)

    async def stage_write(self, key: int, n_tokens: int, chunk: KVChunk) -> int | None:
        return await self._call(self.core.stage_write, key, n_tokens, chunk)

    async def stage_drop_layers(self, key: int, layers: tuple[int, ...]) -> int:
        return await self._call(self.core.stage_drop_layers, key, layers)

    async def restore_layers(self, model: str) -> tuple[int, int]:
        return await self._call(self.core.restore_layers, model)

    async def leave_group(self) -> list[RequestState]:
        out = await self._call(self.core.leave_group)
        self._stages = []
        self._kick()
        return out

    async def load_model(
        self, source: str, services: tuple[tuple[str, ServiceStats], ...]
    ) -> float:
        return await self._call(self.core.load_model, source, services)

    async def unload_model(self, name: str, services: tuple[tuple[str, ServiceStats], ...]) -> int:
        return await self._call(self.core.unload_model, name, services)

    async def group_handover(self) -> list[RequestState]:
        out = await self._call(self.core.group_handover)
        self._stages = []
        return out

    async def stage_export(self, key: int, n_tokens: int) -> KVChunk | None:
        return await self._call(self.core.stage_export, key, n_tokens)

    async def restore_import(self, state: RequestState, chunks: list[KVChunk]) -> bool:
        ok = await self._call(self.core.restore_import, state, chunks)
        self._wake.set()
        return ok

    async def group_idle(self) -> bool:
        return await self._call(self.core.group_idle)

    async def poll(self, timeout_s: float) -> Report:
        if not self.core.has_events():
            self._events.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._events.wait()
        self._events.clear()
        # what steps sealed needs no engine: no wait for a step in progress
        rep = self.core.take_sealed()
        if rep is None:  # events of calls or group steps, or none: from the engine
            rep = await self._call(self.core.take_report)
        rep.t_sent = time.monotonic()
        return rep

    async def connect(self, path: str, token: bytes) -> bool:
        """Send step reports over the controller's report channel at ``path``
        (:mod:`.channel`); False when it cannot be reached (another node):
        the poll carries them."""
        try:
            sink = ReportSink(path, token)
        except OSError:
            return False
        await self._call(self.core.set_sink, sink)
        return True

    async def snapshot(self) -> WorkerSnap:
        return await self._call(self.core.snapshot)

    async def activate(self) -> float:
        """Load the weights and arena of an asleep engine; the seconds it took."""
        self._activations += 1
        return await self._call(self.core.activate)

    async def deactivate(self) -> bool:
        """Give the engine's weights and arena back; True once it sleeps.

        The controller releases a worker when its view shows no request there,
        but that view is as old as the worker's last report and calls cross on
        the way: a request can still be on the engine when the release arrives
        (seen in CI: one paused for a move, until the move's release). Such a
        worker sleeps as soon as its last request left, looked at every
        ``SLEEP_RETRY_S``; an activation received meanwhile wins (False: it
        stays awake, and active). Before, the release was refused for good and
        the worker kept its weights while inactive."""
        gen = self._activations
        warn_at: float | None = time.monotonic() + SLEEP_WARN_S
        while True:
            if await self._call(self.core.deactivate):
                return True
            if self._stopped or self._activations != gen:
                return False
            if warn_at is not None and time.monotonic() >= warn_at:  # a request that never leaves
                warn_at = None
                held = await self._call(lambda: sorted(self.core.engine.requests))
                logger.warning(
                    "worker %d: released %.0f s ago but requests %s are still here",
                    self.core.spec.worker_id,
                    SLEEP_WARN_S,
                    held,
                )
            await asyncio.sleep(SLEEP_RETRY_S)

    async def check_integrity(self) -> None:
        await self._call(self.core.check_integrity)

    async def stop(self) -> None:
        self._stopped = True
        self._wake.set()


def _once() -> bool:
    return False


def _engine_thread_init(spec: WorkerSpec) -> None:
    """The engine thread's torch settings (intra-op threads are per thread
    under some OpenMP runtimes) and cores (``spec.cpus``: the thread pins
    itself; intra-op threads it starts inherit the set)."""
    if spec.cpus:
        try:
            os.sched_setaffinity(0, spec.cpus)  # Linux: 0 is the calling thread
        except (AttributeError, OSError) as e:  # no such cores on this node, not Linux
            logger.warning("worker %d: cannot pin to cores %s: %s", spec.worker_id, spec.cpus, e)
    if spec.device == "cpu":
        torch.set_num_threads(spec.threads)
