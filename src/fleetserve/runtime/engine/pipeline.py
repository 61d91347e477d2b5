"""Layer ranges across engines: pipelined execution and remote attention (KunServe).

A :class:`PipelineGroup` runs one model split across several engines. Stage
``i`` is an :class:`~.engine.Engine` holding (at least) the weights of the
layers ``range_i``; the ranges are contiguous and cover ``[0, L)`` exactly::

    L = 6, stages = [(E0, range(0, 1)), (E1, range(1, 4)), (E2, range(4, 6))]

    layer      0 | 1   2   3 | 4   5
    stage      0 |     1     |   2
               ^ r0.start == 0       r_i.start == r_{i-1}.stop       r_last.stop == L ^
               every range non-empty, step 1

One step of the group, for the batch of its live requests (packed tokens as in
:class:`~.engine.Batch`)::

    token ids ─► E0.embed ─► E0.run_layers(r0) ─h─► E1.run_layers(r1) ─h─► ... ─► E_last.head
                              KV of r0 in E0        KV of r1 in E1              logits [B, V]
                                                                                     │
                              each request samples its next token  ◄──────────────────┘

What crosses between engines: only the packed hidden states ``h`` ``[N, H]``
(``N`` new tokens of the step), moved with ``.to(next_engine.device)``. Each
stage keeps the KV cache of its own layers in its own arena: a request has one
block table per engine, holding ``len(range_i) * kv_heads`` pages per token
block, opened, grown and freed through that engine's pool.

**Remote attention.** A :class:`RemoteKV` names an engine (the *owner*) that
keeps the KV of some layers; the engine holding their weights computes
everything else of those layers and sends q/k/v to the owner::

    engine A (weights of layer l)                   owner B (KV of layer l)
    h ─► RMSNorm, q/k/v projections, RoPE
         q [N, nh, d], k, v [N, nkv, d]  ──────────►  write k, v into B's pages,
                                                      attend over the cached context
         h += o_proj(a); h += mlp(h)     ◄──────────  a [N, nh * d]

so the per-layer traffic is ``N * (nh + 2 * nkv) * d`` elements out and
``N * nh * d`` back; the KV cache itself never moves. In a group, the local
engine's table holds the stage's other layers and the owner's table holds the
remote ones, for example ``A: range(0, 4)`` with ``RemoteKV(B, model, [1, 3])``::

    layer          0   1   2   3
    weights        A   A   A   A
    KV (table)     A   B   A   B        A: pool.open(rid, model, (0, 2))
                                        B: pool.open(rid, model, (1, 3))

Request ids: a request of the group has one id, ``key``, on every engine it
uses (chosen free in each: neither an engine request nor a block table there),
and at most one block table per engine, covering every layer whose KV that
engine keeps for the group (its stages' local layers plus the remote layers it
owns). The engines' own queues and ``step()`` are not involved.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from fleetserve.errors import ConfigError
from fleetserve.runtime.engine.engine import Batch, Engine, RemoteAttention
from fleetserve.runtime.engine.kvpool import PoolFull
from fleetserve.runtime.engine.sampling import (
    SamplingParams,
    StopMatcher,
    append_token,
    request_generator,
    sample_token,
)
from fleetserve.runtime.engine.tokenizer import IncrementalDetokenizer

__all__ = ["PipelineGroup", "PipelineRequest", "RemoteKV", "append_token", "check_stage_ranges"]

_KEY_BASE = 1 << 40
"""Block-table ids of groups start here, far from the ids engines hand out (0, 1, ...)."""

_keys: Iterator[int] = itertools.count(_KEY_BASE)


def _free_key(engines: Iterable[Engine]) -> int:
    """An id that names no request and no block table on any of ``engines``."""
    engs = list(engines)
    while True:
        key = next(_keys)
        if all(key not in e.requests and not e.pool.has(key) for e in engs):
            return key


def _unique(engines: Iterable[Engine]) -> list[Engine]:
    out: list[Engine] = []
    for e in engines:
        if all(e is not o for o in out):
            out.append(e)
    return out


def check_stage_ranges(ranges: Sequence[range], num_layers: int) -> None:
    """Check that ``ranges`` are contiguous, in order, and cover ``[0, num_layers)``.

    Raises:
        ConfigError: naming the first range that breaks the rule.
    """
    shown = ", ".join(f"[{r.start}, {r.stop})" for r in ranges)
    where = f"stage ranges {shown} of a {num_layers}-layer model"
    if not ranges:
        raise ConfigError(f"{where}: a pipeline needs at least one stage")
    expect = 0
    for i, r in enumerate(ranges):
        if r.step != 1 or len(r) == 0:
            raise ConfigError(f"{where}: stage {i} must be a non-empty range with step 1")
        if r.start != expect:
            raise ConfigError(
                f"{where}: stage {i} starts at layer {r.start}, expected {expect} "
                "(ranges must be contiguous, in order, from layer 0)"
            )
        expect = r.stop
    if expect != num_layers:
        raise ConfigError(f"{where}: the last stage ends at {expect}, expected {num_layers}")


class RemoteKV:
    """The KV cache of ``layers`` of ``model`` kept on another engine, ``owner``.

    :meth:`functions` gives the ``remote={layer: fn}`` mapping of
    :meth:`Engine.run_layers`: ``fn(batch, q, k, v)`` sends q/k/v to the owner,
    which stores k/v in its pages and returns the attention output (moved back
    to q's device). The owner must host the model (its weights of these layers
    are not needed: ``Engine([(source, [])], ...)`` holds KV only).

    The owner needs a block table, under the same request id as in the
    caller's batch, holding (at least) these layers. :meth:`open`,
    :meth:`grow` and :meth:`free` manage one for standalone use; a
    :class:`PipelineGroup` manages the tables itself.

    Args:
        owner: the engine keeping the KV.
        model: the model's name (hosted by the owner).
        layers: the layers whose KV the owner keeps.

    Raises:
        ConfigError: the owner does not host the model, or a layer is out of range.
    """

    def __init__(self, owner: Engine, model: str, layers: Iterable[int]) -> None:
        if model not in owner.models:
            raise ConfigError(
                f"remote KV: engine {owner.engine_id} does not host {model!r} "
                f"(it hosts {sorted(owner.models)})"
            )
        n = owner.models[model].cfg.spec.num_layers
        held = tuple(sorted(set(layers)))
        if not held or held[0] < 0 or held[-1] >= n:
            raise ConfigError(
                f"remote KV of {model!r} on engine {owner.engine_id}: layers {list(held)} "
                f"must be a non-empty subset of [0, {n})"
            )
        self.owner = owner
        self.model = model
        self.layers = held
        self._device = torch.empty(0, device=owner.device).device  # "cuda" -> "cuda:0"
        self._cache: tuple[Batch, Batch] | None = None

    def __repr__(self) -> str:
        owner = self.owner.engine_id
        return f"RemoteKV(engine {owner}, {self.model!r}, layers={list(self.layers)})"

    # --------------------------------------------------------- block tables
    def open(self, rid: int) -> None:
        """Open the owner's block table of request ``rid`` for these layers (no pages yet)."""
        self.owner.pool.open(rid, self.model, self.layers)

    def pages_to_grow(self, rid: int, n_tokens: int) -> int:
        return self.owner.pool.pages_to_grow(rid, n_tokens)

    def grow(self, rid: int, n_tokens: int) -> None:
        """Let the owner's table of ``rid`` hold ``n_tokens`` tokens (PoolFull, unchanged)."""
        self.owner.pool.grow(rid, n_tokens)

    def free(self, rid: int) -> int:
        """Free the owner's pages of ``rid``; returns the number of pages freed."""
        return self.owner.pool.free(rid)

    # ------------------------------------------------------------ attention
    def functions(self) -> dict[int, RemoteAttention]:
        """The ``remote`` mapping for :meth:`Engine.run_layers`: one function per layer."""
        return {li: partial(self.attention, li) for li in self.layers}

    def attention(
        self, layer: int, batch: Batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Attention of ``layer`` computed by the owner; the result on ``q``'s device.

        Raises:
            ConfigError: ``layer`` is not one of this object's layers.
        """
        if layer not in self.layers:
            raise ConfigError(
                f"{self!r}: asked for the attention of layer {layer}, whose KV is not kept there"
            )
        a = self.owner.remote_attention(self._owner_batch(batch), layer, q, k, v)
        return a.to(q.device)

    def _owner_batch(self, batch: Batch) -> Batch:
        """``batch`` with its index tensors on the owner's device (cached per batch)."""
        dev = self._device
        if batch.pos.device == dev:
            return batch
        if self._cache is None or self._cache[0] is not batch:
            moved = Batch.build(
                batch.model, batch.rids, batch.starts.tolist(), batch.lens.tolist(), dev
            )
            self._cache = (batch, moved)
        return self._cache[1]


@dataclass(eq=False)
class PipelineRequest:
    """One request of a :class:`PipelineGroup`.

    ``tokens`` is prompt + generated; the KV of every engine holds ``n_cached``
    of them. ``key`` is its block-table id on every engine it uses.
    """

    id: int
    key: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator
    detok: IncrementalDetokenizer
    n_cached: int = 0
    text: str = ""
    held: str = ""  # text held back: it may begin a stop string
    finish_reason: str | None = None
    engines: list[Engine] = field(default_factory=list)  # those holding a table of it
    # the stop strings' automata, rebuilt from ``held`` when that is set elsewhere
    stop_matcher: StopMatcher | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class PipelineGroup:
    """One model split across engines by layer ranges, with optional remote KV.

    Requests run greedily or with sampling (``sample_token``: the request's
    logits processing, then one generator per request seeded with
    ``params.seed``, else the request's id, as the engine does; ids count
    from 0, so a fresh group and a fresh engine given the same prompts in
    the same order sample alike); tokens are appended by the engine's rules
    (:func:`~.sampling.append_token`). Batching is kept simple: every
    live request is in every step (new ones prefill, the others decode), and
    finished ones leave at once, their pages freed on every engine. There is
    no preemption: when an engine lacks the pages for a step, :meth:`step`
    raises :class:`~.kvpool.PoolFull` naming it and changes nothing.

    Args:
        stages: ``(engine, layers)`` per stage; ``layers`` ranges contiguous
            and covering ``[0, L)`` (see the module docstring). Each engine
            must hold the weights of its range.
        model: the model's name (hosted by every engine).
        remote: remote KV holders; their layers' attention is computed by
            their owner instead of the stage engine (layers disjoint).

    Raises:
        ConfigError: bad ranges, an engine that does not host the model (or
            hosts another config under that name) or lacks a layer of its
            range, overlapping remote layers.
    """

    def __init__(
        self,
        stages: Sequence[tuple[Engine, range]],
        model: str,
        *,
        remote: Sequence[RemoteKV] = (),
    ) -> None:
        if not stages:
            raise ConfigError(f"pipeline of {model!r}: at least one stage is needed")
        first = stages[0][0]
        if model not in first.models:
            raise ConfigError(
                f"pipeline: engine {first.engine_id} of stage 0 does not host {model!r} "
                f"(it hosts {sorted(first.models)})"
            )
        cfg = first.models[model].cfg
        n = cfg.spec.num_layers
        check_stage_ranges([r for _, r in stages], n)
        owners = [(f"stage {i}", e) for i, (e, _) in enumerate(stages)]
        owners += [(f"remote KV {rk!r}", rk.owner) for rk in remote]
        for what, e in owners:
            m = e.models.get(model)
            if m is None:
                raise ConfigError(
                    f"pipeline of {model!r}: engine {e.engine_id} ({what}) does not host it"
                )
            if m.cfg != cfg:
                raise ConfigError(
                    f"pipeline of {model!r}: engine {e.engine_id} ({what}) hosts a different "
                    "config under that name"
                )
        for i, (e, r) in enumerate(stages):
            missing = sorted(set(r) - set(e.held_layers(model)))
            if missing:
                raise ConfigError(
                    f"pipeline of {model!r}: stage {i} (engine {e.engine_id}) runs layers "
                    f"[{r.start}, {r.stop}) but does not hold the weights of {missing}"
                )
        remote_of: dict[int, RemoteKV] = {}
        for rk in remote:
            if rk.model != model:
                raise ConfigError(f"pipeline of {model!r}: {rk!r} is for another model")
            for li in rk.layers:
                if li in remote_of:
                    raise ConfigError(
                        f"pipeline of {model!r}: the KV of layer {li} is given to two remote "
                        f"holders ({remote_of[li]!r} and {rk!r})"
                    )
                remote_of[li] = rk
        self.model = model
        self.cfg = cfg
        self.stages: list[tuple[Engine, range]] = [(e, r) for e, r in stages]
        self.remote: list[RemoteKV] = list(remote)
        # per stage: the remote mapping for its layers
        self._remote_fns: list[dict[int, RemoteAttention]] = []
        for _, r in self.stages:
            fns: dict[int, RemoteAttention] = {}
            for rk in self.remote:
                fns.update({li: f for li, f in rk.functions().items() if li in r})
            self._remote_fns.append(fns)
        # per engine: the layers whose KV it keeps for the group (one table per request)
        kv: list[tuple[Engine, set[int]]] = []

        def layers_of(e: Engine) -> set[int]:
            for o, s in kv:
                if o is e:
                    return s
            s = set()
            kv.append((e, s))
            return s

        for e, r in self.stages:
            layers_of(e).update(li for li in r if li not in remote_of)
        for rk in self.remote:
            layers_of(rk.owner).update(rk.layers)
        self._kv_layers: list[tuple[Engine, tuple[int, ...]]] = [
            (e, tuple(sorted(s))) for e, s in kv if s
        ]
        self._engines = _unique([*(e for e, _ in self.stages), *(rk.owner for rk in remote)])
        self.requests: dict[int, PipelineRequest] = {}
        self._live: list[PipelineRequest] = []
        self._ids = itertools.count()

    # ------------------------------------------------------------- queries
    @property
    def num_layers(self) -> int:
        return self.cfg.spec.num_layers

    def stage_of(self, layer: int) -> int:
        """The stage running ``layer``."""
        for i, (_, r) in enumerate(self.stages):
            if layer in r:
                return i
        raise ValueError(f"layer {layer} outside [0, {self.num_layers})")

    def kv_layers(self) -> list[tuple[Engine, tuple[int, ...]]]:
        """Each engine keeping KV for the group, with the layers its tables hold."""
        return list(self._kv_layers)

    def has_work(self) -> bool:
        return bool(self._live)

    # ------------------------------------------------------------ requests
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        """Add a request (it prefills in the next step); returns its id.

        Opens its (empty) block table on every engine keeping KV for the group.
        """
        p = params if params is not None else SamplingParams()
        tok = self.stages[0][0].tokenizer(self.model)
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ConfigError("empty prompt")
        s = self.cfg.spec
        if any(not 0 <= t < s.vocab_size for t in ids):
            raise ConfigError(f"prompt token ids must be in [0, {s.vocab_size})")
        p.check_vocab(s.vocab_size)
        if len(ids) + p.max_tokens > s.max_context:
            raise ConfigError(
                f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds the "
                f"context window of {self.model} ({s.max_context})"
            )
        rid = next(self._ids)
        while rid in self.requests:
            rid = next(self._ids)
        gen = request_generator(p, rid)
        key = _free_key(self._engines)
        req = PipelineRequest(
            id=rid,
            key=key,
            tokens=ids,
            prompt_len=len(ids),
            params=p,
            generator=gen,
            detok=IncrementalDetokenizer(tok),
        )
        for e, layers in self._kv_layers:
            e.pool.open(key, self.model, layers)
            req.engines.append(e)
        self.requests[rid] = req
        self._live.append(req)
        return rid

    def abort(self, rid: int) -> None:
        """Finish ``rid`` now (reason ``abort``), freeing its pages on every engine."""
        req = self.requests.get(rid)
        if req is not None and not req.finished:
            self._finish(req, "abort")

    def pop_finished(self, rid: int) -> PipelineRequest:
        """Forget a finished request."""
        req = self.requests[rid]
        if not req.finished:
            raise ValueError(f"request {rid} is still running")
        return self.requests.pop(rid)

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams
    ) -> list[list[int]]:
        """Run ``prompts`` together to completion; returns each one's generated ids."""
        rids = [self.add_request(p, params) for p in prompts]
        try:
            while any(not self.requests[r].finished for r in rids):
                self.step()
        except BaseException:
            for r in rids:
                self.abort(r)
            raise
        return [self.pop_finished(r).output_ids for r in rids]

    # ---------------------------------------------------------------- step
    def step(self) -> dict[int, int]:
        """One forward of every live request through all stages; returns ``{rid: token}``.

        Raises:
            PoolFull: an engine lacks the pages for this step's tokens (nothing
                changed; abort requests or give that engine more room).
        """
        reqs = [r for r in self._live if r.n_cached == 0] + [
            r for r in self._live if r.n_cached > 0
        ]
        if not reqs:
            return {}
        # 1. room for every new token on every engine: check all, then commit
        for e, _ in self._kv_layers:
            need = sum(e.pool.pages_to_grow(r.key, len(r.tokens)) for r in reqs)
            if need > e.pool.num_free:
                raise PoolFull(
                    f"pipeline of {self.model!r}: engine {e.engine_id} needs {need} KV pages "
                    f"for this step ({len(reqs)} requests), {e.pool.num_free} free"
                )
        for e, _ in self._kv_layers:
            for r in reqs:
                e.pool.grow(r.key, len(r.tokens))
        # 2. embed on stage 0, the layer ranges in order, the head on the last stage
        keys = [r.key for r in reqs]
        starts = [r.n_cached for r in reqs]
        lens = [len(r.tokens) - r.n_cached for r in reqs]
        ids = [t for r in reqs for t in r.tokens[r.n_cached :]]
        batches: dict[torch.device, Batch] = {}

        def batch_on(dev: torch.device) -> Batch:
            b = batches.get(dev)
            if b is None:
                b = batches[dev] = Batch.build(self.model, keys, starts, lens, dev)
            return b

        h = self.stages[0][0].embed(self.model, ids)
        for (e, layers), fns in zip(self.stages, self._remote_fns, strict=True):
            h = e.run_layers(batch_on(e.device), h.to(e.device), layers, remote=fns)
        last = self.stages[-1][0]
        logits = last.head(batch_on(last.device), h)
        # 3. sample, stop, free the finished
        out: dict[int, int] = {}
        eos = self.cfg.eos_token_ids
        for i, req in enumerate(reqs):
            tok = sample_token(logits[i], req.params, req.generator, req.tokens, req.generated, eos)
            req.n_cached = len(req.tokens)
            out[req.id] = tok
            self._append(req, tok)
        self._live = [r for r in reqs if not r.finished]
        return out

    def _append(self, req: PipelineRequest, tok: int) -> None:
        """Record a sampled token; finish on EOS, a stop string or ``max_tokens``."""
        _piece, reason = append_token(req, tok, self.cfg.eos_token_ids)
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: PipelineRequest, reason: str) -> None:
        req.finish_reason = reason
        for e in req.engines:
            if e.pool.has(req.key):
                e.pool.free(req.key)
        req.engines = []
        if req in self._live:
            self._live.remove(req)
