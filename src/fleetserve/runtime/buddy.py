r"""KunServe buddy groups across worker actors: the mechanism, no decisions.

When the controller applies a :class:`~fleetserve.policy.actions.DropLayers`
(decided by :class:`~fleetserve.policy.kunserve.KunServePolicy`), the
member workers of the new group become the stages of one pipeline of the
model. Member ``i`` keeps the layers ``keep[i]`` (the ranges tile
``[0, L)``: one complete copy of the parameters in the group) and frees the
weight pages of the others, which join its KV pool. Stage 0 (the *leader*,
:class:`GroupRunner`) owns the group's requests — tokens, sampler state,
text, stop rules — and drives every step::

    leader (stage 0)                       stage 1                 stage k-1
    embed ─► run_layers(keep[0]) ─h─►  run_layers(keep[1]) ─h─► ... ─h─┐
       ▲        KV of keep[0]              KV of keep[1]                │
       └──── head, sample, stream the tokens ◄─────────────────────────┘

``h`` (packed hidden states, ``[new tokens, hidden]``) is a real tensor that
crosses between the actors as the argument and result of
:meth:`~fleetserve.runtime.worker.Worker.stage_forward` (Ray's object store);
the KV cache of a stage's layers never leaves it. Every member keeps the
embeddings, final norm and LM head (KunServe drops only layer parameters),
so the leader runs the head on the last stage's output.

A group request's block table on each stage is keyed by the controller's
request id (unique in the cluster; a member's engine holds no request of the
group's model while it is a stage, so the key is free).

**KV exchange at a merge** (§4.2), ``kunserve.exchange``:

* ``blocking``: the controller pauses the sources' requests
  (:meth:`~fleetserve.runtime.worker.WorkerCore.evacuate`); a request keeps
  the KV of its own worker's range in place (its table drops the other
  layers' pages) and the KV of every other range is copied to the stage that
  keeps it (:func:`stage_import`) before the group runs. A request whose KV
  does not fit on some stage is recomputed instead (its KV is freed, it
  prefills again in the group) — the choice a careful implementer makes when
  the paper's exchange cannot place a request: nothing is lost, only
  recomputed.
* ``live`` (the ``kunserve`` stack's default): nothing is copied at the
  merge. A running request (a *victim*) keeps its whole table, every layer,
  on its origin stage, and runs in micro-batches of its own: the other
  stages compute its layers but send q/k/v of each one to the origin, which
  writes the new k/v into the victim's pages and returns the attention
  (*remote attention*, :func:`stage_remote_attention`; the origin's pages
  for the step are grown first by a ``grow_only`` work). Meanwhile the
  leader copies each victim's KV of the other stages' layers to them
  (:meth:`GroupRunner._exchange`, at most ``max_copies`` at once, beside the
  steps); at the next step boundary after its copy it copies the tokens
  added since, drops those layers from the origin's table and *flips* the
  victim: from then on it runs as any request of the group. A copy or flip
  that lacks pages waits for a later boundary (the victim stays remote).

**Batching in a group** (the paper leaves the pipelined engine's scheduler
to vLLM): every running request decodes in every step; waiting ones are
admitted first-come first-served while the step stays within
``max_running`` / ``max_batch_tokens`` and every stage has the pages for
them (the leader tracks each stage's free pages and each request's
token-blocks there exactly). When a stage lacks pages for the running
requests' next tokens the newest running request is preempted by recompute,
as the engine's FCFS policy does. A stage still answers "no room" when its
pages went elsewhere since its last report (a layer restore): the leader
then corrects its count and plans again; that micro-batch does not advance
in that step.

**Overlapped stages.** A step's batch goes in micro-batches, one per stage
(fewer for a small batch; :meth:`GroupRunner.split`), all in flight at once:
while stage 1 runs the first, the leader runs stage 0 of the second, and so
on, as vLLM's virtual engines keep one micro-batch per pipeline stage. The
simulator's pipeline cost (:mod:`fleetserve.costmodel.pipeline`) models the
same round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fleetserve.runtime.engine.engine import Batch, Engine
from fleetserve.runtime.engine.migration import (
    KVChunk,
    RequestState,
    gather_pages,
    restore_detok,
    scatter_pages,
    snapshot_detok,
)
from fleetserve.runtime.engine.pipeline import PipelineRequest
from fleetserve.runtime.engine.sampling import (
    SamplingParams,
    append_token,
    request_generator,
    sample_token,
)
from fleetserve.runtime.engine.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "GroupRunner",
    "StageResult",
    "StageRole",
    "StageWork",
    "free_stage_keys",
    "join_chunks",
    "stage_export",
    "stage_forward",
    "stage_import",
]


@dataclass(frozen=True, slots=True)
class StageRole:
    """A worker's place in a buddy group.

    Attributes:
        group: the group's id (the controller's executor key).
        model: the model the group serves.
        index: this worker's stage (0: the leader).
        stages: ``(worker id, (first layer, end layer))`` per stage, in order.
    """

    group: int
    model: str
    index: int
    stages: tuple[tuple[int, tuple[int, int]], ...]

    @property
    def keep(self) -> range:
        a, b = self.stages[self.index][1]
        return range(a, b)


@dataclass(frozen=True, slots=True)
class StageWork:
    """One step's work for one stage: the batch and its input.

    ``h`` is the previous stage's output (None on stage 0, which embeds
    ``ids``). ``free`` lists request keys whose tables this stage frees
    first (finished or preempted requests). ``remote_owner``: the KV of this
    stage's layers of these requests is still on that stage (a live
    exchange's victims): their attention runs there, and no table is opened
    here. ``grow_only``: only grow the tables of ``keys`` here to
    ``starts + lens`` tokens (the victims' whole tables on their origin,
    before a step's remote attention writes into them).
    """

    model: str
    keys: tuple[int, ...]
    starts: tuple[int, ...]
    lens: tuple[int, ...]
    h: torch.Tensor | None = None
    ids: tuple[int, ...] = ()
    free: tuple[int, ...] = ()
    remote_owner: int | None = None
    grow_only: bool = False


@dataclass(frozen=True, slots=True)
class StageResult:
    """A stage's answer: its output (None when it lacked pages) and its free pages."""

    ok: bool
    h: torch.Tensor | None
    free_pages: int


def free_stage_keys(engine: Engine, keys: Iterable[int], held: set[int]) -> int:
    """Free the tables of ``keys`` this stage holds; returns pages freed."""
    n = 0
    for k in keys:
        if k in held:
            held.discard(k)
            if engine.pool.has(k):
                n += engine.pool.free(k)
    return n


@torch.inference_mode()
def stage_forward(
    engine: Engine,
    role: StageRole,
    work: StageWork,
    held: set[int],
    remote: RemoteFn | None = None,
    copies: set[int] | None = None,
) -> StageResult:
    """Run this stage's layers on ``work`` (see the module docstring).

    Frees ``work.free`` first; then grows every request's table to cover its
    new tokens — all or nothing: when the pages are short nothing grows and
    the result is ``ok=False`` — and runs the layers of :attr:`StageRole.keep`.
    ``held`` is the set of keys with a table here (kept up to date). With
    ``work.remote_owner`` set (another stage) the layers' attention runs
    there through ``remote`` and nothing grows here. ``copies``: keys whose
    table here is a live exchange's copy not flipped yet; one that runs here
    as any request (it was preempted or its group dissolved since, and is
    recomputed) gets a fresh table instead.
    """
    pool = engine.pool
    free_stage_keys(engine, work.free, held)
    if copies:
        copies.difference_update(work.free)
    ends = [s + n for s, n in zip(work.starts, work.lens, strict=True)]
    if work.grow_only:
        return StageResult(stage_grow(engine, work.keys, ends), None, pool.num_free)
    owner = work.remote_owner
    away = owner is not None and owner != role.index  # the KV of these layers is on ``owner``
    if away and remote is None:
        raise ValueError(f"stage {role.index}: remote attention on stage {owner}, no way there")
    if not away:
        layers = tuple(role.keep)
        need = 0
        for k, end in zip(work.keys, ends, strict=True):
            if copies and k in copies:  # a stale copy: the request is recomputed here
                copies.discard(k)
                if pool.has(k):
                    pool.free(k)
            if not pool.has(k):
                pool.open(k, work.model, layers)
                held.add(k)
            need += pool.pages_to_grow(k, end)
        if need > pool.num_free:
            return StageResult(False, None, pool.num_free)
        for k, end in zip(work.keys, ends, strict=True):
            pool.grow(k, end)
    if not work.keys:  # a round that only frees
        return StageResult(True, None, pool.num_free)
    batch = Batch.build(
        work.model, list(work.keys), list(work.starts), list(work.lens), engine.device
    )
    h = engine.embed(work.model, list(work.ids)) if work.h is None else work.h.to(engine.device)
    fns = None
    if away:
        assert owner is not None and remote is not None
        head = replace(work, h=None, ids=(), free=())  # what the owner needs of the work
        fns = {li: _remote_layer(remote, owner, head, li) for li in role.keep}
    h = engine.run_layers(batch, h, role.keep, remote=fns)
    return StageResult(True, h, pool.num_free)


def _remote_layer(
    remote: RemoteFn, owner: int, head: StageWork, layer: int
) -> Callable[[Batch, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def fn(batch: Batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return remote(owner, head, layer, q, k, v).to(q.device)

    return fn


def stage_grow(engine: Engine, keys: Iterable[int], ends: Iterable[int]) -> bool:
    """Grow the tables of ``keys`` here to ``ends`` tokens, all or nothing."""
    pool = engine.pool
    pairs = list(zip(keys, ends, strict=True))
    if sum(pool.pages_to_grow(k, e) for k, e in pairs) > pool.num_free:
        return False
    for k, e in pairs:
        pool.grow(k, e)
    return True


@torch.inference_mode()
def stage_remote_attention(
    engine: Engine, work: StageWork, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """On a victim's origin stage: the attention of ``layer`` for the
    requests of ``work`` over the KV their tables hold here (grown beforehand
    by a ``grow_only`` work: this touches their pages only, so it may run
    beside the stage's own work on other requests)."""
    batch = Batch.build(
        work.model, list(work.keys), list(work.starts), list(work.lens), engine.device
    )
    return engine.remote_attention(batch, layer, q, k, v)


def stage_import(
    engine: Engine, role: StageRole, key: int, n_tokens: int, chunk: KVChunk, held: set[int]
) -> int | None:
    """Take the KV of this stage's layers of request ``key`` (a merge's exchange).

    Opens the request's table for :attr:`StageRole.keep`, grows it to
    ``n_tokens`` tokens and writes ``chunk`` (its layers must be exactly the
    kept ones). Returns the table's token-blocks, or None when the pages are
    short (nothing changed).
    """
    pool = engine.pool
    layers = tuple(role.keep)
    if chunk.layers != layers:
        raise ValueError(
            f"stage {role.index} keeps layers {list(layers)}; the chunk of request {key} "
            f"holds {list(chunk.layers)}"
        )
    if pool.has(key):
        raise ValueError(f"request {key} already has a table on this stage")
    pool.open(key, role.model, layers)
    if pool.pages_to_grow(key, n_tokens) > pool.num_free:
        pool.free(key)
        return None
    pool.grow(key, n_tokens)
    held.add(key)
    if chunk.n_tb:
        table = pool.table(key)[chunk.first_tb : chunk.first_tb + chunk.n_tb]
        pages = table[:, torch.tensor(layers, dtype=torch.int64)].numpy().astype(np.int64)
        scatter_pages(pool, role.model, pages, chunk.data)
    return pool.token_blocks(key)


def stage_export(engine: Engine, model: str, key: int, n_tokens: int) -> KVChunk:
    """A copy of the KV of request ``key``'s first ``n_tokens`` tokens in
    this stage's table (the layers it keeps): a live restore gathers a
    request's stages on one member."""
    pool = engine.pool
    layers = pool.layers(key)
    bs = pool.block_size
    n_tb = -(-n_tokens // bs)
    if n_tb > pool.token_blocks(key):
        raise ValueError(f"request {key}: {n_tokens} tokens, its table holds fewer here")
    table = pool.table(key).numpy()[:n_tb][:, list(layers)]
    data = gather_pages(pool, model, table)
    return KVChunk(model, tuple(layers), 0, n_tokens, bs, engine.dtype, data)


def stage_export_layers(
    engine: Engine, model: str, key: int, layers: tuple[int, ...], first_tb: int, n_tokens: int
) -> KVChunk:
    """A copy of the KV of ``layers`` of request ``key`` here, from token-block
    ``first_tb`` up to ``n_tokens`` tokens: a live exchange's copy of a
    victim's KV for another stage (``first_tb`` 0), and its catch-up at the
    flip (the tokens added since, from the block the copy ended in)."""
    pool = engine.pool
    bs = pool.block_size
    n_tb = -(-n_tokens // bs)
    if n_tb > pool.token_blocks(key) or not set(layers) <= set(pool.layers(key)):
        raise ValueError(f"request {key}: its table here lacks tokens or layers to export")
    table = pool.table(key).numpy()[first_tb:n_tb][:, list(layers)]
    data = gather_pages(pool, model, table)
    return KVChunk(model, tuple(layers), first_tb, n_tokens - first_tb * bs, bs, engine.dtype, data)


def stage_write(engine: Engine, key: int, n_tokens: int, chunk: KVChunk) -> int | None:
    """Grow request ``key``'s table here to ``n_tokens`` tokens and write
    ``chunk`` into it (a live exchange's catch-up); its token-blocks, or None
    when the pages are short (nothing changed)."""
    pool = engine.pool
    if not pool.has(key) or not set(chunk.layers) <= set(pool.layers(key)):
        raise ValueError(f"request {key}: no table here for layers {list(chunk.layers)}")
    if pool.pages_to_grow(key, n_tokens) > pool.num_free:
        return None
    pool.grow(key, n_tokens)
    if chunk.n_tb:
        table = pool.table(key)[chunk.first_tb : chunk.first_tb + chunk.n_tb]
        idx = torch.tensor(chunk.layers, dtype=torch.int64)
        pages = table[:, idx].numpy().astype(np.int64)
        scatter_pages(pool, chunk.model, pages, chunk.data)
    return pool.token_blocks(key)


def join_chunks(chunks: Iterable[KVChunk]) -> KVChunk:
    """One chunk of every layer from the chunks of a request's stages (the
    same tokens, disjoint layer ranges)."""
    parts = sorted(chunks, key=lambda c: c.layers[0])
    if not parts:
        raise ValueError("no chunks to join")
    first = parts[0]
    for c in parts[1:]:
        if (c.model, c.first_tb, c.n_tokens, c.n_tb) != (
            first.model,
            first.first_tb,
            first.n_tokens,
            first.n_tb,
        ):
            raise ValueError("the stages' chunks do not cover the same tokens")
    layers = tuple(li for c in parts for li in c.layers)
    if len(set(layers)) != len(layers):
        raise ValueError(f"the stages' chunks overlap: layers {list(layers)}")
    data = torch.cat([c.data for c in parts], dim=1)
    return KVChunk(
        first.model, layers, first.first_tb, first.n_tokens, first.block_size, first.dtype, data
    )


RemoteFn = Callable[[int, StageWork, int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(owner stage, work, layer, q, k, v)`` -> the attention of ``layer`` for
``work``'s requests, computed on the owner stage (:func:`stage_remote_attention`
there; ``work`` without its hidden states)."""

Emit = Callable[[int, int, int, str], None]  # (request id, index, token, text piece)
Ask = Callable[..., Awaitable[Any]]
"""``ask(j, method, *args)``: a stage's worker method (stage 0: the leader's own)."""
Finish = Callable[[int, str], None]  # (request id, reason)
StageCall = Callable[[int, StageWork], Awaitable[StageResult]]


class _NoRoom(Exception):
    """A stage lacked the pages for a victim's copy."""


@dataclass(slots=True)
class _Meta:
    arrival_s: float
    blocks: list[int] = field(default_factory=list)  # token-blocks of its table per stage
    layers: list[int] = field(default_factory=list)  # layers its table holds per stage
    origin: int | None = None  # a live exchange's victim: the stage holding all its KV


class GroupRunner:
    """The leader's side of a buddy group: its requests and its steps.

    Args:
        engine: the leader's engine (stage 0's layers, the embeddings and head).
        role: the leader's :class:`StageRole` (``index`` 0).
        max_running: at most this many requests in a step.
        max_batch_tokens: at most this many new tokens in a step (a longer
            prompt still runs, alone).
        stage_free: each stage's free pages now.
        stage_total: each stage's KV pages when empty (a request needing
            more on some stage can never run: it ends with ``capacity``).
        held: the keys with a table on this engine (shared with the worker).
        emit: called for each token a request streams.
        finish: called once when a request ends.
        local: runs stage 0's work (default: here, in the caller's thread);
            a worker runs it on its engine thread, off its event loop, so
            that the loop serves the remote attention stages ask of it.
        remote: the way to another stage's remote attention (a live
            exchange's victims, :meth:`adopt` with ``origin``).
    """

    def __init__(
        self,
        engine: Engine,
        role: StageRole,
        *,
        max_running: int,
        max_batch_tokens: int,
        stage_free: list[int],
        stage_total: list[int],
        held: set[int],
        emit: Emit,
        finish: Finish,
        local: Callable[[StageWork], Awaitable[StageResult]] | None = None,
        remote: RemoteFn | None = None,
    ) -> None:
        if role.index != 0:
            raise ValueError("the group runner lives on stage 0")
        self.engine = engine
        self.role = role
        self.model = role.model
        self.cfg = engine.models[role.model].cfg
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.block_size = engine.pool.block_size
        self.kv_heads = engine.pool.pages_per_token_block(role.model, 1)
        self.stage_layers = [b - a for _, (a, b) in role.stages]
        self.stage_free = list(stage_free)
        self.stage_total = list(stage_total)
        self.credit = [0] * len(role.stages)  # pages freed since each stage's last report
        self.held = held
        self.requests: dict[int, PipelineRequest] = {}
        self.meta: dict[int, _Meta] = {}
        self.live: list[PipelineRequest] = []  # arrival order
        self.pending_free: list[int] = []
        self.broken: str | None = None
        self.steps = 0
        self._emit = emit
        self._finish_cb = finish
        self._local = local
        self.remote = remote
        # live exchange (KunServe §4.2): a victim's KV of the other stages'
        # layers is copied while it decodes (ask_bg), then caught up and
        # flipped at a step boundary (ask_now); see :meth:`_exchange`
        self.ask_bg: Ask | None = None
        self.ask_now: Ask | None = None
        self.max_copies = 2  # victims whose copy is in flight at once
        self._copies: dict[int, asyncio.Task[None]] = {}
        self._copied: dict[int, tuple[int, dict[int, int]]] = {}  # rid -> (tokens, blocks)
        self.flips = 0  # victims whose KV finished crossing
        self.closed = False  # its requests were taken (drop_all, handover): copies stop

    # ------------------------------------------------------------ requests
    def add(
        self, rid: int, prompt_ids: list[int], params: SamplingParams, arrival_s: float
    ) -> None:
        """A new request (it prefills in a coming step)."""
        tok = self.engine.tokenizer(self.model)
        req = PipelineRequest(
            id=rid,
            key=rid,
            tokens=list(prompt_ids),
            prompt_len=len(prompt_ids),
            params=params,
            generator=request_generator(params, rid),
            detok=IncrementalDetokenizer(tok),
        )
        self._insert(req, self._fresh_meta(arrival_s))

    def _fresh_meta(self, arrival_s: float) -> _Meta:
        k = len(self.role.stages)
        return _Meta(arrival_s, [0] * k, list(self.stage_layers))

    def adopt(
        self,
        state: RequestState,
        n_cached: int,
        blocks: list[int],
        origin: int | None = None,
    ) -> None:
        """A request that ran elsewhere continues here (a merge moved it).

        ``n_cached`` tokens of it are in the stages' tables (0: it is
        recomputed), whose token-blocks per stage are ``blocks``. With
        ``origin`` (a live exchange) its table on that stage holds every
        layer's KV and it has none elsewhere: the other stages' layers run
        their attention there (:class:`StageWork` ``remote_owner``).
        """
        if origin is not None and n_cached == 0:
            origin = None  # nothing cached: it prefills here like any request
        gen = torch.Generator(device="cpu")
        gen.set_state(state.generator_state)
        req = PipelineRequest(
            id=state.id,
            key=state.id,
            tokens=list(state.tokens),
            prompt_len=state.prompt_len,
            params=state.params,
            generator=gen,
            detok=restore_detok(self.engine.tokenizer(self.model), state.detok),
            n_cached=n_cached,
            text=state.text,
            held=state.held,
        )
        meta = self._fresh_meta(state.arrival_s)
        meta.blocks = list(blocks)
        if origin is not None:
            n = sum(self.stage_layers)
            meta.layers = [n if j == origin else 0 for j in range(len(self.stage_layers))]
            meta.origin = origin
        self._insert(req, meta)

    def _insert(self, req: PipelineRequest, meta: _Meta) -> None:
        if req.id in self.requests:
            raise ValueError(f"request {req.id} is already in group {self.role.group}")
        self.requests[req.id] = req
        self.meta[req.id] = meta
        self.live.append(req)
        self.live.sort(key=lambda r: self.meta[r.id].arrival_s)

    def abort(self, rid: int) -> bool:
        """End ``rid`` now (its pages are freed in the next step); False if unknown."""
        req = self.requests.get(rid)
        if req is None:
            return False
        self._end(req, "abort", notify=False)
        return True

    def has_work(self) -> bool:
        return self.broken is None and bool(self.live or self.pending_free)

    def drop_all(self) -> list[RequestState]:
        """Forget every request (the group is dissolved or merged); returns
        each one's state to recompute elsewhere (``n_cached`` 0)."""
        return self._take(keep_kv=False)

    def handover(self) -> list[RequestState]:
        """Forget every request at a step boundary, for a live restore:
        each one's state with ``n_cached`` as the stages' tables hold it
        (0: it waits to be prefilled). The tables stay on the stages until
        freed (:func:`stage_export` reads them first)."""
        return self._take(keep_kv=True)

    def _take(self, *, keep_kv: bool) -> list[RequestState]:
        # copies in flight stop touching the stages (their tables go with the
        # group's: the members free every group table when they leave it);
        # this may run on the engine thread, so the cancel goes through the loop
        self.closed = True
        for task in self._copies.values():
            task.get_loop().call_soon_threadsafe(task.cancel)
        self._copies.clear()
        self._copied.clear()
        out = [
            RequestState(
                id=r.id,
                model=self.model,
                tokens=tuple(r.tokens),
                prompt_len=r.prompt_len,
                params=r.params,
                generator_state=r.generator.get_state(),
                n_cached=r.n_cached if keep_kv else 0,
                text=r.text,
                held=r.held,
                detok=snapshot_detok(r.detok),
                arrival_s=self.meta[r.id].arrival_s,
            )
            for r in self.live
        ]
        self.requests.clear()
        self.meta.clear()
        self.live.clear()
        self.pending_free.clear()
        return out

    # ---------------------------------------------------------------- step
    def _need(self, req: PipelineRequest, tokens: int) -> list[int]:
        """Pages each stage must add for ``req``'s table to hold ``tokens`` tokens."""
        tb = -(-tokens // self.block_size)
        m = self.meta[req.id]
        return [max(0, tb - b) * n * self.kv_heads for b, n in zip(m.blocks, m.layers, strict=True)]

    def _pages(self, req: PipelineRequest) -> list[int]:
        """Pages ``req``'s tables hold on each stage."""
        m = self.meta[req.id]
        return [b * n * self.kv_heads for b, n in zip(m.blocks, m.layers, strict=True)]

    def _release(self, req: PipelineRequest) -> list[int]:
        """Give ``req``'s pages back (they are freed on every stage by the next
        step's free list); returns them per stage."""
        pages = self._pages(req)
        for j, n in enumerate(pages):
            self.credit[j] += n
        m = self.meta[req.id]
        m.blocks = [0] * len(self.stage_layers)
        m.layers = list(self.stage_layers)  # recomputed, it runs as any request
        m.origin = None
        self.pending_free.append(req.key)
        return pages

    def plan(self) -> list[PipelineRequest]:
        """This step's batch: every running request (preempting the newest by
        recompute while a stage lacks pages for them), then waiting ones FCFS
        while they fit. A waiting head that cannot fit even in empty stages
        ends with reason ``capacity``."""
        free = [f + c for f, c in zip(self.stage_free, self.credit, strict=True)]
        running = [r for r in self.live if r.n_cached > 0]
        preempted: set[int] = set()

        def total(reqs: list[PipelineRequest]) -> list[int]:
            out = [0] * len(free)
            for r in reqs:
                for j, x in enumerate(self._need(r, len(r.tokens))):
                    out[j] += x
            return out

        while running and any(n > f for n, f in zip(total(running), free, strict=True)):
            victim = running.pop()
            got = self._release(victim)
            victim.n_cached = 0
            preempted.add(victim.id)
            free = [f + g for f, g in zip(free, got, strict=True)]
        free = [f - n for f, n in zip(free, total(running), strict=True)]
        batch = list(running)
        tokens = len(running)
        for r in list(self.live):
            if r.n_cached > 0 or r.id in preempted:
                continue
            if len(batch) >= self.max_running:
                break
            n = len(r.tokens)
            if batch and tokens + n > self.max_batch_tokens:
                break
            need = self._need(r, n)
            if any(x > t for x, t in zip(need, self.stage_total, strict=True)):
                self._end(r, "capacity", notify=True)
                continue
            if any(x > f for x, f in zip(need, free, strict=True)):
                break  # first come, first served: no overtaking
            batch.append(r)
            tokens += n
            free = [f - x for f, x in zip(free, need, strict=True)]
        return batch

    def split(self, batch: list[PipelineRequest]) -> list[list[PipelineRequest]]:
        """The step's micro-batches: as many as the group has stages (fewer
        for a small batch), contiguous in batch order, of about equal new
        tokens (a part starts where the running total passes the next
        ``i / k`` of the step's tokens). As vLLM's virtual engines keep one
        micro-batch per stage in flight, each stage works on one while the
        others are on the next stages (the simulator's
        :mod:`~fleetserve.costmodel.pipeline` round)."""
        k = min(len(self.role.stages), len(batch))
        if k <= 1:
            return [batch]
        sizes = [len(r.tokens) - r.n_cached for r in batch]
        total = sum(sizes)
        parts: list[list[PipelineRequest]] = [[]]
        acc = 0
        for i, (r, n) in enumerate(zip(batch, sizes, strict=True)):
            # a new part once this one holds its share, or when each part
            # still to come needs one of the requests left (never an empty one)
            left = len(batch) - i
            share = acc >= total * len(parts) / k
            if parts[-1] and len(parts) < k and (share or left == k - len(parts)):
                parts.append([])
            parts[-1].append(r)
            acc += n
        return parts

    async def step(self, call: StageCall) -> None:
        """One pipelined iteration (``call(j, work)`` runs stage ``j >= 1``):
        the batch of :meth:`plan` in the micro-batches of :meth:`split`, all
        in flight at once (each one's stage 0 runs here, then it awaits the
        next stages while the next micro-batch's stage 0 runs). Pages freed
        since the last step go with the first micro-batch, which reaches
        every stage first.

        Raises what ``call`` raises (a dead stage): the group is then
        :attr:`broken` and steps no more.
        """
        if self.broken is not None:
            return
        if self._copied or any(m.origin is not None for m in self.meta.values()):
            await self._exchange()
        batch = self.plan()
        if not batch and not self.pending_free:
            return
        free = tuple(self.pending_free)
        # a live exchange's victims go in parts of their own, one per origin:
        # their layers' attention then has one owner on every stage
        normal: list[PipelineRequest] = []
        victims: dict[int, list[PipelineRequest]] = {}
        for r in batch:
            o = self.meta[r.id].origin
            if o is None:
                normal.append(r)
            else:
                victims.setdefault(o, []).append(r)
        parts = (self.split(normal) if normal else []) + [victims[o] for o in sorted(victims)]
        if not parts:
            parts = [[]]
        done = await asyncio.gather(
            *(self._run_part(p, free if i == 0 else (), call) for i, p in enumerate(parts)),
            return_exceptions=True,
        )
        for d in done:
            if isinstance(d, BaseException):
                raise d
        if done[0]:  # every stage freed the list (else it goes again next step)
            self.pending_free = [k for k in self.pending_free if k not in set(free)]
        self.steps += 1

    async def _run_part(
        self, part: list[PipelineRequest], free: tuple[int, ...], call: StageCall
    ) -> bool:
        """One micro-batch through every stage, then its tokens; False when
        a stage lacked pages (the part's requests advance next step)."""
        keys = tuple(r.key for r in part)
        starts = tuple(r.n_cached for r in part)
        lens = tuple(len(r.tokens) - r.n_cached for r in part)
        ids = tuple(t for r in part for t in r.tokens[r.n_cached :])
        origin = self.meta[part[0].id].origin if part else None
        if origin is not None:  # the victims' tables on their origin hold the new tokens first
            grow = StageWork(self.model, keys, starts, lens, grow_only=True)
            res = await self._stage(origin, grow, call)
            self.stage_free[origin] = res.free_pages
            self.credit[origin] = 0
            if not res.ok:
                return False
        h: torch.Tensor | None = None
        for j in range(len(self.role.stages)):
            owner = origin if origin is not None and origin != j else None
            work = StageWork(
                self.model, keys, starts, lens, h, ids if j == 0 else (), free, remote_owner=owner
            )
            res = await self._stage(j, work, call)
            self.stage_free[j] = res.free_pages
            self.credit[j] = 0
            if not res.ok:
                return False  # the count is corrected; the part goes again next step
            self._grown(part, j)
            h = res.h
        if not part:
            return True
        assert h is not None
        with torch.inference_mode():
            hb = Batch.build(self.model, list(keys), list(starts), list(lens), self.engine.device)
            logits = self.engine.head(hb, h)
        eos = self.cfg.eos_token_ids
        for i, req in enumerate(part):
            if req.id not in self.requests:
                continue  # aborted while the stages ran
            tok = sample_token(logits[i], req.params, req.generator, req.tokens, req.generated, eos)
            req.n_cached = len(req.tokens)
            piece, reason = append_token(req, tok, eos)
            self._emit(req.id, req.generated, tok, piece)
            if reason is not None:
                self._end(req, reason, notify=True)
        return True

    # ------------------------------------------------------- live exchange
    async def _exchange(self) -> None:
        """At a step boundary: flip the victims whose copy is done, then start
        copies for others (KunServe §4.2's live exchange; see the module
        docstring). A copy runs beside the steps; the flip copies the tokens
        added since (from the block the copy ended in) to each stage, drops
        those layers from the victim's table on its origin, and from then on
        the victim runs as any request of the group (local attention on every
        stage). A flip that lacks pages on a stage waits for a later boundary;
        meanwhile the victim keeps its remote attention."""
        if self.ask_now is None or self.ask_bg is None:
            return  # no way to move KV: victims stay remote until they finish
        bs = self.block_size
        for rid, (n0, blocks) in list(self._copied.items()):
            req, m = self.requests.get(rid), self.meta.get(rid)
            if req is None or m is None or m.origin is None:
                del self._copied[rid]  # it ended or was preempted: its tables went with it
                continue
            o, n, tb0 = m.origin, req.n_cached, n0 // bs
            done = True
            for j in blocks:
                a, b = self.role.stages[j][1]
                chunk = await self.ask_now(
                    o, "stage_export_layers", req.key, tuple(range(a, b)), tb0, n
                )
                got = await self.ask_now(j, "stage_write", req.key, n, chunk)
                if got is None:
                    done = False
                    break
                m.blocks[j] = got
            if not done:
                continue
            gone = tuple(li for j in blocks for li in range(*self.role.stages[j][1]))
            self.credit[o] += await self.ask_now(o, "stage_drop_layers", req.key, gone)
            m.layers[o] = self.stage_layers[o]
            m.origin = None
            del self._copied[rid]
            self.flips += 1
        for rid, task in list(self._copies.items()):
            if task.done():
                del self._copies[rid]
        for req in self.live:
            if len(self._copies) >= self.max_copies:
                break
            m = self.meta[req.id]
            if m.origin is not None and req.id not in self._copies and req.id not in self._copied:
                self._copies[req.id] = asyncio.get_running_loop().create_task(self._copy(req, m))

    async def _copy(self, req: PipelineRequest, m: _Meta) -> None:
        """Copy victim ``req``'s KV of every other stage's layers from its
        origin to that stage (its first ``n_cached`` tokens, while it decodes)."""
        assert self.ask_bg is not None and m.origin is not None
        o, n0, key = m.origin, req.n_cached, req.key
        blocks: dict[int, int] = {}
        try:
            for j, (_w, (a, b)) in enumerate(self.role.stages):
                if j == o:
                    continue
                chunk = await self.ask_bg(o, "stage_export_layers", key, tuple(range(a, b)), 0, n0)
                if self.closed:
                    return
                got = await self.ask_bg(j, "stage_import", key, n0, chunk, True)
                if self.closed:
                    return
                if got is None:  # no room there now: undo, try again at a later boundary
                    raise _NoRoom
                blocks[j] = got
        except asyncio.CancelledError:
            return
        except Exception as e:  # a copy that fails leaves the victim remote
            if self.closed:
                return
            if not isinstance(e, _NoRoom):  # e.g. a member left for a new merge meanwhile
                logger.info(
                    "group %d: copy of request %d stopped (it stays remote): %s",
                    self.role.group,
                    key,
                    e,
                )
            for j in blocks:  # frees only a table that is still this copy's
                await self.ask_bg(j, "stage_free_copy", key)
            return
        if self.closed:
            return
        if self.meta.get(req.id) is not m or m.origin != o:  # ended or preempted meanwhile
            for j in blocks:
                await self.ask_bg(j, "stage_free_copy", key)
            return
        for j, got in blocks.items():  # counted from now on: the planner keeps room to catch up
            m.layers[j] = self.stage_layers[j]
            m.blocks[j] = got
        self._copied[req.id] = (n0, blocks)

    async def _stage(self, j: int, work: StageWork, call: StageCall) -> StageResult:
        """Stage ``j``'s answer to ``work`` (stage 0: this engine)."""
        if j == 0:
            if self._local is not None:
                return await self._local(work)
            return stage_forward(self.engine, self.role, work, self.held, self.remote)
        try:
            return await call(j, work)
        except Exception as e:
            self.broken = f"stage {j} (worker {self.role.stages[j][0]}) failed: {e}"
            raise

    def _grown(self, batch: list[PipelineRequest], j: int) -> None:
        bs = self.block_size
        for r in batch:
            m = self.meta[r.id]
            # a victim's table away from its origin (a copy) grows at its flip only
            if m.layers[j] and (m.origin is None or m.origin == j):
                m.blocks[j] = max(m.blocks[j], -(-len(r.tokens) // bs))

    def _end(self, req: PipelineRequest, reason: str, *, notify: bool) -> None:
        req.finish_reason = reason
        self._release(req)
        self.requests.pop(req.id, None)
        self.meta.pop(req.id, None)
        if req in self.live:
            self.live.remove(req)
        if notify:
            self._finish_cb(req.id, reason)
