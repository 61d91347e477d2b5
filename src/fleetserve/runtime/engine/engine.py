"""The engine: several models, one arena, continuous batching.

An :class:`Engine` hosts one or more models (all or a range of their layers)
and one :class:`~.kvpool.KVPool` arena that holds their layer weights and the
KV cache of every request. ``step()`` is one iteration:

1. every running request needs room for its next token; while the pool
   cannot give it, the batching policy names a victim, which is preempted by
   recompute (its KV freed, it re-enters the waiting queue at the head);
2. if nothing was preempted, the batching policy admits waiting requests
   (queue order) through an admission budget (free pages, batch limits);
3. per model, one forward over its prefills and decodes (linear layers on the
   packed tokens, attention on a padded batch gathered from the paged KV);
4. each request samples its next token with its own generator (after its
   logits processing: ``logit_bias``, ``min_tokens``, ``repetition_penalty``),
   streams it, and stops on EOS, a stop token id, a stop string or
   ``max_tokens`` (:func:`~.sampling.append_token`).

Layer ranges and remote attention (KunServe): :meth:`Engine.run_layers` runs
layers ``[a, b)`` of a batch whose hidden states come from elsewhere; the KV
of a layer may live on another engine, whose :meth:`Engine.remote_attention`
computes that layer's attention from the q/k/v sent to it. Dropping a layer
(:meth:`Engine.drop_layer`) frees its weight pages for KV at once; restoring
takes them back.

The engine makes no policy decision of its own: whom to admit and whom to
preempt come from the ``batching`` policy (``fleetserve.policy``).

Given a catalog *group scheduler* instead (``batching`` a
:class:`~fleetserve.policy.sharing.GroupScheduler`: FCFS, RR, MLFQ, DB or
ADBS, as a sharing group of several models runs it), a step is one
scheduling point of that scheduler: it names jobs (a prefill of one model's
admitted requests, or a decode iteration of one model's running ones), the
engine runs each and reports its measured duration
(:mod:`~fleetserve.runtime.engine.group`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fleetserve.errors import ConfigError, FleetserveError
from fleetserve.policy.base import AdmissionBudget, BatchingPolicy
from fleetserve.policy.batching import instance_batching
from fleetserve.policy.sharing import DECODE, PREFILL, GroupScheduler, Job, ServiceStats
from fleetserve.runtime.engine import paged_cpu
from fleetserve.runtime.engine.config import EngineModelConfig
from fleetserve.runtime.engine.decode_graphs import DecodeGraphs, gather_decode, gather_kv
from fleetserve.runtime.engine.group import JobBudget, StateView
from fleetserve.runtime.engine.kvpool import KVPool, PoolFull
from fleetserve.runtime.engine.migration import (
    ImportHandle,
    KVChunk,
    RequestState,
    gather_pages,
    restore_detok,
    scatter_pages,
    snapshot_detok,
)
from fleetserve.runtime.engine.model import (
    LayerWeights,
    Rotary,
    attention_padded,
    fuse_views,
    layer_numel,
    layer_views,
    linear,
    mlp_residual,
    out_residual,
    pack_views,
    qkv,
    rms_norm,
    sdpa,
)
from fleetserve.runtime.engine.paged_flex import FlexStep, PagedFlex, flex_supported
from fleetserve.runtime.engine.sampling import (
    SamplingParams,
    StopMatcher,
    append_token,
    needs_logits_processing,
    request_generator,
    sample_one,
    sample_token,
)
from fleetserve.runtime.engine.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from fleetserve.runtime.engine.weights import WeightSource, layer_tensors, load_weight_source

logger = logging.getLogger(__name__)

__all__ = ["AttnGroup", "Batch", "Engine", "EngineRequest", "StepOutput"]

TokenCallback = Callable[["EngineRequest", int, str], None]
FinishCallback = Callable[["EngineRequest"], None]
RemoteAttention = Callable[["Batch", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

WAITING, RUNNING, PAUSED, FINISHED = "waiting", "running", "paused", "finished"


@dataclass(eq=False)
class EngineRequest:
    """One request on this engine (the engine's ``SeqView``).

    ``tokens`` is prompt + generated; the KV cache holds ``n_cached`` of them
    (a running request's last sampled token is not cached until the next step).
    """

    id: int
    model: str
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator
    detok: IncrementalDetokenizer
    arrival_s: float = 0.0
    n_cached: int = 0
    status: str = WAITING
    finish_reason: str | None = None
    text: str = ""
    preemptions: int = 0
    on_token: TokenCallback | None = None
    on_finish: FinishCallback | None = None
    held: str = ""  # text held back while it may be the start of a stop string
    # the stop strings' automata, rebuilt from ``held`` when that is set elsewhere
    stop_matcher: StopMatcher | None = field(default=None, repr=False)
    # chain hashes of its full token-blocks so far (prefix caching)
    block_hashes: list[int] = field(default_factory=list, repr=False)

    # --- SeqView --------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        return self.prompt_len

    @property
    def output_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def kv_tokens(self) -> int:
        return self.n_cached

    @property
    def demand_tokens(self) -> int:
        return max(self.n_cached, len(self.tokens))

    @property
    def migrating(self) -> bool:
        return self.status == PAUSED

    @property
    def decoding(self) -> bool:
        # past its (re)prefill: every token but the newest is cached
        return self.status == RUNNING and 0 < self.n_cached >= len(self.tokens) - 1

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass(frozen=True, slots=True)
class AttnGroup:
    """Requests of a batch whose attention is one padded call over their paged KV.

    Member j is request ``idx[j]`` of the batch; packed row ``rows[i]`` is
    member ``g_b[i]``'s query slot ``g_t[i]``; ``mask`` [G, 1, q_len, ctx] is
    True where a query may attend.
    """

    idx: torch.Tensor  # [G]
    rows: torch.Tensor  # [Ng]
    g_b: torch.Tensor  # [Ng]
    g_t: torch.Tensor  # [Ng]
    mask: torch.Tensor  # [G, 1, q_len, ctx] bool

    @staticmethod
    def build(
        members: Sequence[int],
        st: torch.Tensor,
        ln: torch.Tensor,
        first: torch.Tensor,
        device: Any,
    ) -> AttnGroup:
        ci = torch.tensor(members, dtype=torch.int64)
        cst, cln = st[ci], ln[ci]
        g_b = torch.repeat_interleave(torch.arange(ci.numel()), cln)
        g_t = torch.arange(int(cln.sum())) - (torch.cumsum(cln, 0) - cln)[g_b]
        q = torch.arange(int(cln.max()))[None, :, None]
        k = torch.arange(int((cst + cln).max()))[None, None, :]
        ok = (k <= cst[:, None, None] + q) & (q < cln[:, None, None])
        ok[:, :, 0] = True  # padded query rows attend to one key (discarded)
        return AttnGroup(
            ci.to(device),
            (first[ci][g_b] + g_t).to(device),
            g_b.to(device),
            g_t.to(device),
            ok[:, None].to(device),
        )


ATTENTION_MODES = ("auto", "paged", "gather", "flex")
DECODE_GRAPH_MODES = ("auto", "capture", "static", "off")
_GROUP_MIN = 8  # a decode bucket takes this many requests before it may close


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch of requests of one model, for the layer loop.

    ``starts[b]`` tokens of request b are cached already; ``lens[b]`` new ones
    are in this batch, packed in order (token i of the packed hidden states is
    request ``b_idx[i]``'s token at position ``pos[i]``)::

        packed rows:  [r0 t0, r0 t1, r0 t2 | r1 t0 | r2 t0, r2 t1]
        b_idx:        [  0,     0,     0,     1,      2,     2  ]
        t_idx:        [  0,     1,     2,     0,      0,     1  ]
        pos:          [ s0,   s0+1,  s0+2,   s1,     s2,   s2+1 ]

    Attention (:meth:`Engine._attend`) runs per request for ``fresh`` ones
    (nothing cached: whole prompts, by packed rows ``[lo, hi)``; causal
    attention on their own k/v, no gather, no padding) and per
    :class:`AttnGroup` for the others: decodes bucketed by context length (a
    bucket closes when the next context is under half its longest and it has
    ``_GROUP_MIN`` members, so padding stays under 2x without many small
    calls), each continuation (cached context and several new tokens) alone.
    """

    model: str
    rids: tuple[int, ...]
    starts: torch.Tensor  # [B] int64, CPU
    lens: torch.Tensor  # [B] int64, CPU
    b_idx: torch.Tensor  # [N]
    t_idx: torch.Tensor  # [N]
    pos: torch.Tensor  # [N]
    last: torch.Tensor  # [B] packed row of each request's last new token
    max_len: int
    max_ctx: int
    fresh: tuple[tuple[int, int], ...]
    groups: tuple[AttnGroup, ...]
    # decodes (one new token after a cached context), for the paged kernel:
    # their batch indexes (CPU), packed rows, and context lengths (CPU)
    dec: torch.Tensor
    dec_rows: torch.Tensor
    dec_ctx: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.rids)

    @staticmethod
    def build(
        model: str, rids: Sequence[int], starts: Sequence[int], lens: Sequence[int], device: Any
    ) -> Batch:
        st = torch.tensor(starts, dtype=torch.int64)
        ln = torch.tensor(lens, dtype=torch.int64)
        b_idx = torch.repeat_interleave(torch.arange(len(rids)), ln)
        first = torch.cumsum(ln, 0) - ln
        t_idx = torch.arange(int(ln.sum())) - first[b_idx]
        pos = st[b_idx] + t_idx
        sl, nl, fl = st.tolist(), ln.tolist(), first.tolist()
        fresh = tuple((f, f + n) for s, n, f in zip(sl, nl, fl, strict=True) if s == 0)
        members: list[list[int]] = [[i] for i in range(len(sl)) if sl[i] > 0 and nl[i] > 1]
        decodes = sorted(
            ((s + 1, i) for i, s in enumerate(sl) if s > 0 and nl[i] == 1), reverse=True
        )
        buckets: list[list[int]] = []
        top = 0
        for ctx, i in decodes:
            if buckets and (2 * ctx > top or len(buckets[-1]) < _GROUP_MIN):
                buckets[-1].append(i)
            else:
                buckets.append([i])
                top = ctx
        members += buckets
        dec = torch.tensor([i for _, i in decodes], dtype=torch.int64)
        return Batch(
            model,
            tuple(rids),
            st,
            ln,
            b_idx.to(device),
            t_idx.to(device),
            pos.to(device),
            (first + ln - 1).to(device),
            int(ln.max()),
            int((st + ln).max()),
            fresh,
            tuple(AttnGroup.build(m, st, ln, first, device) for m in members),
            dec,
            first[dec].to(device),
            st[dec] + 1,
        )


@dataclass(frozen=True, slots=True)
class Forward:
    """The work of one model's forward in a step, as the cost model sees an
    iteration: ``chunks`` are ``(new_tokens, tokens_already_cached)`` of each
    prompt (or recomputed prefix) in it; ``decode_batch`` requests decode one
    token each, reading ``decode_ctx`` KV tokens in total (the new ones
    included)."""

    model: str
    chunks: tuple[tuple[int, int], ...]
    decode_batch: int
    decode_ctx: int


@dataclass(slots=True)
class StepOutput:
    """What one ``step()`` did."""

    prefilled: list[int] = field(default_factory=list)
    decoded: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    tokens: dict[int, int] = field(default_factory=dict)
    forwards: list[Forward] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        return not (self.prefilled or self.decoded or self.preempted)


@dataclass(slots=True)
class _Model:
    cfg: EngineModelConfig
    source: WeightSource
    tokenizer: Tokenizer
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    rotary: Rotary
    layers: dict[int, LayerWeights]


class _View:
    """The engine as the batching policy sees it (an ``InstanceView``)."""

    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.id = engine.engine_id
        self.model = "+".join(engine.models)
        self.gpus = (engine.engine_id,)
        self.tp = 1
        self.block_size = engine.pool.block_size
        self.decode_steps = engine.steps

    @property
    def total_blocks(self) -> int:
        return self.e.pool.num_pages - self.e.pool.weight_pages()

    @property
    def used_blocks(self) -> int:
        return self.e.pool.kv_pages

    @property
    def free_blocks(self) -> int:
        return self.e.pool.num_available

    reserved_blocks = 0

    @property
    def available_blocks(self) -> int:
        return self.e.pool.num_available - self.e.watermark_pages()

    @property
    def num_running(self) -> int:
        return len(self.e.running) + len(self.e.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.e.waiting)

    @property
    def idle(self) -> bool:
        return not self.e.has_work()

    def seqs(self) -> list[Any]:
        return [*self.e.running, *self.e.prefilling, *self.e.waiting]


class _Budget(AdmissionBudget):
    """Free pages, batch size and batch tokens left for this step's prefills.
    With chunked prefill a prompt needs one token of the budget to start (its
    pages in full), as the simulated instance admits."""

    def __init__(self, engine: Engine, running: int, tokens: int) -> None:
        self.e = engine
        self.pages = engine.pool.num_available - engine.watermark_pages()
        self.seqs = engine.max_running - running
        self.tokens = tokens
        self.chunked = engine.chunked_prefill

    def fits(self, seq: Any) -> bool:
        n = len(self.e.requests[seq.id].tokens)
        room = self.tokens > 0 if self.chunked else n <= self.tokens
        return self.seqs >= 1 and room and self.e.prompt_pages(seq.id) <= self.pages

    def take(self, seq: Any) -> None:
        self.seqs -= 1
        self.tokens -= len(self.e.requests[seq.id].tokens)
        self.pages -= self.e.prompt_pages(seq.id)


class Engine:
    """A PyTorch LLaMA-family engine with a unified paged KV arena.

    Args:
        models: built-in names, checkpoint folders, weight sources, or
            ``(source, layers)`` pairs to hold only ``layers`` of a model.
        arena_bytes: the arena: layer weights plus KV. Allocated once.
        block_size: tokens per KV block.
        device: ``cpu`` or ``cuda`` (``cuda:N``).
        dtype: weights and KV element type.
        batching: the batching policy (default vLLM FCFS: each step admits
            in queue order and runs every hosted model's prefills and decodes),
            or a catalog group scheduler (each step runs the jobs it names,
            one after another; see the module docstring).
        services: the hosted models' statistics a group scheduler reads
            (required by those that read them: MLFQ, DB, ADBS).
        clock: the group scheduler's clock (seconds; default ``time.monotonic``).
        max_running: most requests in one batch.
        max_batch_tokens: most tokens (prefill + decode) in one step.
        prefix_caching: keep the KV of full token-blocks after their requests
            end, keyed by a chain hash of the model and the tokens up to each
            block's end, and start a request whose prompt begins with cached
            blocks from them (vLLM's automatic prefix caching; the blocks are
            shared, counted by reference, evicted least recently used when
            pages are needed; :mod:`~fleetserve.runtime.engine.kvpool`). Not
            with ``attention="flex"``.
        chunked_prefill: split prompts into chunks that fill each step's
            token budget beside the running requests' decodes (Sarathi-Serve,
            vLLM's option; the simulated instance's ``chunked_prefill``):
            while a prompt is being prefilled every step is mixed, partly
            prefilled prompts first, then newly admitted ones; a prompt's
            pages are taken in full when it is admitted, and a prompt may be
            longer than ``max_batch_tokens``. With a group scheduler (FCFS
            or RR only), a job of a model with a prompt to start or continue
            is such a mixed step of that model, as in the simulated group.
        watermark: vLLM's admission watermark (``engine.watermark``): a
            prompt is admitted only if ``watermark`` of the arena's KV pages
            stay free after it (0: none, the engine's default; ``serve``
            passes the config's, 1% by default, as the simulator keeps).
        engine_id: this engine's id in views and logs.
        attention: how requests with cached context attend:

            - ``paged``: decodes through a CPU kernel that reads the pages in
              place (:mod:`~fleetserve.runtime.engine.paged_cpu`; float32 on
              the CPU, Numba installed); continuations of several new tokens
              as with ``gather``, and so are the decodes of a model whose head
              width does not divide the arena's page (:func:`paged_cpu.fits`).
            - ``gather``: copy their pages into a padded tensor, then dense
              attention.
            - ``flex``: FlexAttention reading the pages in place
              (:mod:`~fleetserve.runtime.engine.paged_flex`; compiled on CUDA,
              dense and slow on a CPU). Measured on an H100 (docs/gpu.md), the
              compiled kernel over 16-token head-wise pages is slower than the
              gather.
            - ``auto`` (default): ``paged`` where it can run, else ``gather``.
        spatial_shares: a spatial group scheduler's jobs (ADBS: a prefill of
            one model beside decodes of others, each on a ``share`` of the
            compute units) run at once, each in its own thread with
            ``floor(share * threads)`` intra-op threads (at least one) of the
            engine thread's ``torch.get_num_threads()``; when those do not
            add up (one thread, three jobs on two threads) or off (the
            default: on a 2-core CPU it measured faster, docs/runtime-parity.md),
            one after another on all threads. CPU only, not with
            ``attention="flex"``.
        decode_graphs: how a step in which every request of a model decodes
            one token runs (:mod:`~fleetserve.runtime.engine.decode_graphs`):

            - ``capture``: as a replay of a CUDA graph captured per batch and
              context bucket (CUDA, ``gather`` attention);
            - ``static``: the same padded static step run eagerly, on any
              device (what a replay computes; for checks);
            - ``off``: the eager step (:meth:`_attend`'s buckets);
            - ``auto`` (default): ``capture`` on CUDA with ``gather``
              attention, else ``off``.
    """

    def __init__(
        self,
        models: Sequence[str | WeightSource | tuple[str | WeightSource, Iterable[int]]],
        arena_bytes: int,
        *,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batching: BatchingPolicy | GroupScheduler | None = None,
        services: Mapping[str, ServiceStats] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_running: int = 256,
        max_batch_tokens: int = 8192,
        chunked_prefill: bool = False,
        prefix_caching: bool = False,
        watermark: float = 0.0,
        engine_id: int = 0,
        attention: str = "auto",
        spatial_shares: bool = False,
        decode_graphs: str = "auto",
    ) -> None:
        if not models:
            raise ConfigError("an engine needs at least one model")
        if attention not in ATTENTION_MODES:
            raise ConfigError(
                f"attention {attention!r}: expected one of {', '.join(ATTENTION_MODES)}"
            )
        if decode_graphs not in DECODE_GRAPH_MODES:
            raise ConfigError(
                f"decode_graphs {decode_graphs!r}: expected one of {', '.join(DECODE_GRAPH_MODES)}"
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but torch sees no CUDA device")
        self.dtype = dtype
        self.engine_id = engine_id
        self.group: GroupScheduler | None = None
        if isinstance(batching, GroupScheduler):
            self.group = batching
            self.batching: BatchingPolicy = instance_batching("fcfs")  # unused in group mode
        else:
            self.batching = batching if batching is not None else instance_batching("fcfs")
        self.clock = clock
        self._known: set[int] = set()  # requests the group scheduler was told of
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        g = self.group
        if chunked_prefill and g is not None and (g.spatial or not g.one_model):
            raise ConfigError(
                f"chunked_prefill with group scheduler {type(g).__name__}: it runs whole "
                "prefill jobs (chunked prefill is for FCFS and RR, as in the simulated group)"
            )
        self.chunked_prefill = chunked_prefill
        if not 0 <= watermark < 1:
            raise ConfigError(f"watermark must be in [0, 1), got {watermark}")
        self.watermark = watermark
        if attention in ("auto", "paged"):
            why = self._paged_unsupported(dtype)
            if attention == "paged" and why:
                raise ConfigError(f"attention 'paged' cannot run: {why}")
            attention = "gather" if why else "paged"
            if attention == "paged":
                paged_cpu.warm_up()
        if prefix_caching and attention == "flex":
            raise ConfigError("prefix caching cannot run with attention 'flex' (one owner a page)")
        self.prefix_caching = prefix_caching
        self.spatial_shares = spatial_shares and self.device.type == "cpu" and attention != "flex"
        self._job_pool: ThreadPoolExecutor | None = None  # threads of jobs run at once
        self.group_jobs_alone = 0  # group jobs run one after another, cumulative
        self.group_jobs_at_once = 0  # group jobs run beside others on their shares
        self.prefix_queries = 0  # prompt tokens admitted (prefix caching)
        self.preemptions = 0  # requests preempted (recomputed later), cumulative
        self.prefix_hits = 0  # of which were read from cached blocks
        srcs: list[tuple[WeightSource, list[int] | None]] = []
        for m in models:
            if isinstance(m, tuple):
                given, held = m
                srcs.append((self._source(given), sorted(set(held))))
            else:
                srcs.append((self._source(m), None))
        hd = max(s.cfg.spec.head_dim for s, _ in srcs)
        self.pool = KVPool(arena_bytes, block_size, hd, dtype, self.device)
        self.attention = attention
        self._graphs = self._decode_graphs(decode_graphs)
        self._flex: PagedFlex | None = None
        self._flex_models: set[str] = set()
        self._flex_step: tuple[Batch, FlexStep] | None = None
        self.models: dict[str, _Model] = {}
        for src, lay in srcs:
            self._load(src, lay)
        self.requests: dict[int, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        # admitted, KV allocated in full, prompt partly prefilled (chunked prefill)
        self.prefilling: list[EngineRequest] = []
        self.steps = 0
        self._ids = itertools.count()
        self._asleep: dict[str, list[int]] | None = None  # layers to load on wake
        if self.group is not None:
            self._setup_group(self.group, services or {})

    # ------------------------------------------------------------- models
    def _paged_unsupported(self, dtype: torch.dtype) -> str:
        """Why the ``paged`` CPU kernel cannot run here ("" when it can)."""
        if self.device.type != "cpu":
            return f"it is a CPU kernel (device {self.device})"
        if dtype != torch.float32:
            return f"it reads float32 pages (dtype {dtype})"
        if not paged_cpu.available():
            return "numba is not installed (pip install 'fleetserve[engine]')"
        return ""

    def _decode_graphs(self, mode: str) -> DecodeGraphs | None:
        cuda = self.device.type == "cuda"
        if mode == "auto":
            mode = "capture" if cuda and self.attention == "gather" else "off"
        if mode == "off":
            return None
        if mode == "capture" and not cuda:
            raise ConfigError(f"decode_graphs 'capture' needs a CUDA device, not {self.device}")
        if self.attention == "flex":
            raise ConfigError(f"decode_graphs {mode!r} runs the gather path, not attention 'flex'")
        return DecodeGraphs(self.device, capture=mode == "capture")

    def _weights_moved(self) -> None:
        """Weights or the arena changed place: captured decode steps are stale."""
        if self._graphs is not None:
            self._graphs.clear()

    def _choose_attention(self, name: str, head_dim: int) -> None:
        if self.attention != "flex":
            return
        pool = self.pool
        why = flex_supported(pool.page_elems, pool.block_size, head_dim, self.device)
        if why:
            raise ConfigError(f"model {name!r}: attention 'flex' cannot run: {why}")
        if self._flex is None:
            self._flex = PagedFlex(pool.arena, pool.block_size, compiled=self.device.type == "cuda")
        self._flex_models.add(name)

    @staticmethod
    def _source(s: str | WeightSource) -> WeightSource:
        return load_weight_source(s) if isinstance(s, str) else s

    def _load(self, src: WeightSource, layers: list[int] | None) -> None:
        cfg = src.cfg
        name = cfg.name
        if name in self.models:
            raise ConfigError(f"model {name!r} is loaded twice in one engine")
        n = cfg.spec.num_layers
        held = list(range(n)) if layers is None else layers
        if held and (held[0] < 0 or held[-1] >= n):
            raise ConfigError(f"model {name!r}: layers {held} outside [0, {n})")
        self.pool.add_model(name, n, cfg.spec.num_kv_heads, cfg.spec.head_dim)
        self._choose_attention(name, cfg.spec.head_dim)
        dev, dt = self.device, self.dtype
        m = _Model(
            cfg=cfg,
            source=src,
            tokenizer=load_tokenizer(getattr(src, "folder", None), cfg),
            embed=src.tensor("embed").to(dev, dt),
            norm=src.tensor("norm").to(dev, dt),
            lm_head=src.tensor("lm_head").to(dev, dt),
            rotary=Rotary(cfg, dev),
            layers={},
        )
        self.models[name] = m
        need = len(held) * self.pool.region_pages(layer_numel(cfg))
        if need > self.pool.num_free:
            have = self.pool.num_free * self.pool.page_bytes
            raise ConfigError(
                f"model {name!r}: its {len(held)} layers need {need * self.pool.page_bytes:,} "
                f"bytes of the arena, {have:,} are left (arena_bytes too small)"
            )
        for li in held:
            self.restore_layer(name, li)

    def layer_bytes(self, model: str) -> int:
        """Arena bytes one layer of ``model`` occupies (whole pages)."""
        numel = layer_numel(self.models[model].cfg)
        return self.pool.region_pages(numel) * self.pool.page_bytes

    def held_layers(self, model: str) -> list[int]:
        return sorted(self.models[model].layers)

    def drop_layer(self, model: str, layer: int) -> int:
        """Drop a layer's weights; its pages join the KV pool. Returns bytes freed."""
        m = self.models[model]
        if layer not in m.layers:
            raise ValueError(f"model {model!r}: layer {layer} is not held")
        del m.layers[layer]
        self._weights_moved()
        return self.pool.free_weights(f"{model}/{layer}") * self.pool.page_bytes

    def can_restore_layer(self, model: str) -> bool:
        return self.pool.can_alloc_weights(layer_numel(self.models[model].cfg))

    def restore_layer(self, model: str, layer: int, tensors: LayerWeights | None = None) -> None:
        """Take a layer's pages back from the pool and load its weights.

        ``tensors`` come from a peer (network) or default to the weight source
        (host copy / checkpoint). Raises PoolFull when the pool lacks the pages.
        """
        m = self.models[model]
        if layer in m.layers:
            raise ValueError(f"model {model!r}: layer {layer} is already held")
        flat = self.pool.alloc_weights(f"{model}/{layer}", layer_numel(m.cfg))
        views = layer_views(m.cfg, flat)
        src = tensors if tensors is not None else layer_tensors(m.source, layer)
        for k, v in views.items():
            v.copy_(src[k])
        fuse_views(views)  # qkv and gate_up: views of the same pages
        pack_views(views)  # CPU float32: oneDNN-packed copies for the GEMMs
        m.layers[layer] = views
        self._weights_moved()

    # ------------------------------------------------- re-placement (SeaLLM)
    def load_model(
        self,
        model: str | WeightSource,
        services: Mapping[str, ServiceStats] | None = None,
    ) -> float:
        """Host one more model from now on (a re-placement): register its KV
        layout and load its weights into the arena; returns the seconds it
        took. A group scheduler is set up again over the hosted models with
        ``services``' statistics.

        Raises:
            PoolFull: its weights do not fit the arena now (nothing changed).
            ConfigError: asleep, already hosted, or a one-model batching
                policy (its engine hosts one model).
        """
        if self.asleep:
            raise ConfigError(f"engine {self.engine_id} is asleep; wake it before loading")
        if self.group is None and self.models:
            raise ConfigError(
                f"engine {self.engine_id} runs one-model batching; it cannot host a second model"
            )
        src = self._source(model)
        name = src.cfg.name
        if name in self.models:
            raise ConfigError(f"model {name!r} is loaded twice in one engine")
        need = src.cfg.spec.num_layers * self.pool.region_pages(layer_numel(src.cfg))
        if need > self.pool.num_available:
            raise PoolFull(f"model {name!r}: {need} weight pages, {self.pool.num_available} free")
        t0 = time.perf_counter()
        try:
            self._load(src, None)
        except (PoolFull, ConfigError) as e:  # no window after all: undo what was loaded
            m = self.models.pop(name, None)
            if m is not None:
                for li in sorted(m.layers):
                    self.pool.free_weights(f"{name}/{li}")
            self._flex_models.discard(name)
            raise PoolFull(f"model {name!r}: {e}") from None
        if self.group is not None:
            self._setup_group(self.group, services or {})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def unload_model(self, name: str, services: Mapping[str, ServiceStats] | None = None) -> int:
        """Stop hosting ``name`` (a re-placement): its weights' pages join the
        KV pool; returns the bytes freed. It must hold no request here (move
        them first). Its cached prefix blocks are given back; its KV layout
        stays registered (a later :meth:`load_model` reuses it).

        Raises:
            ConfigError: not hosted. ValueError: it still has requests here.
        """
        m = self._model(name)
        if any(r.model == name for r in self.requests.values()):
            raise ValueError(f"engine {self.engine_id}: model {name!r} still has requests here")
        freed = sum(self.drop_layer(name, li) for li in self.held_layers(name))
        for t in (m.embed, m.norm, m.lm_head):
            freed += t.numel() * t.element_size()
        del self.models[name]
        self._weights_moved()
        self._flex_models.discard(name)
        self.pool.forget_cached(name)
        if self.group is not None:
            self._setup_group(self.group, services or {})
        return freed

    # -------------------------------------------------------------- sleep
    @property
    def asleep(self) -> bool:
        """Whether the engine holds no weights and no arena (:meth:`sleep`)."""
        return self._asleep is not None

    def sleep(self) -> int:
        """Give back every weight and the arena, as an inactive GPU of an
        elastic pool holds none; returns the bytes released. Only an engine
        with no request may sleep. The models' host copies (their weight
        sources) and tokenizers stay; :meth:`wake` loads the weights again.
        """
        if self.asleep:
            return 0
        if self.requests or self.has_work():
            raise ValueError(f"engine {self.engine_id} has requests; only an idle engine sleeps")
        if self._flex is not None:
            raise ConfigError("attention 'flex' keeps the arena compiled in; it cannot sleep")
        pool = self.pool
        held = {name: self.held_layers(name) for name in self.models}
        freed = pool.num_pages * pool.page_bytes  # the arena, weights and KV
        for name, layers in held.items():
            m = self.models[name]
            for li in layers:
                self.drop_layer(name, li)
            for t in (m.embed, m.norm, m.lm_head):
                freed += t.numel() * t.element_size()
            empty = torch.empty(0, dtype=self.dtype, device=self.device)
            m.embed = m.norm = m.lm_head = empty
        pool.release_arena()
        self._weights_moved()
        self._asleep = held
        return freed

    def asleep_weight_pages(self) -> int:
        """Arena pages the weights :meth:`wake` loads take (0 when awake): an
        asleep engine's KV capacity is what it will have awake."""
        if self._asleep is None:
            return 0
        pool = self.pool
        return sum(
            len(layers) * pool.region_pages(layer_numel(self.models[m].cfg))
            for m, layers in self._asleep.items()
        )

    def wake(self) -> float:
        """Allocate the arena and load the weights :meth:`sleep` gave back (from
        the host copies); returns the seconds it took (an activation's cost)."""
        held = self._asleep
        if held is None:
            return 0.0
        t0 = time.perf_counter()
        self.pool.acquire_arena()
        self._weights_moved()
        dev, dt = self.device, self.dtype
        for name, layers in held.items():
            m = self.models[name]
            m.embed = m.source.tensor("embed").to(dev, dt)
            m.norm = m.source.tensor("norm").to(dev, dt)
            m.lm_head = m.source.tensor("lm_head").to(dev, dt)
            for li in layers:
                self.restore_layer(name, li)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._asleep = None
        return time.perf_counter() - t0

    # ----------------------------------------------------------- requests
    def tokenizer(self, model: str) -> Tokenizer:
        return self._model(model).tokenizer

    def _model(self, model: str) -> _Model:
        m = self.models.get(model)
        if m is None:
            raise ConfigError(f"unknown model {model!r}; this engine hosts {sorted(self.models)}")
        return m

    def add_request(
        self,
        model: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: int | None = None,
        arrival_s: float = 0.0,
        on_token: TokenCallback | None = None,
        on_finish: FinishCallback | None = None,
    ) -> int:
        """Queue a request; returns its id. Tokens stream through ``on_token``."""
        m = self._model(model)
        if self.asleep:
            raise ConfigError(f"engine {self.engine_id} is asleep (inactive); wake it first")
        p = params if params is not None else SamplingParams()
        ids = m.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ConfigError("empty prompt")
        vocab = m.cfg.spec.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        p.check_vocab(vocab)
        limit = m.cfg.spec.max_context
        if len(ids) + p.max_tokens > limit:
            raise ConfigError(
                f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds the "
                f"context window of {model} ({limit})"
            )
        if len(ids) > self.max_batch_tokens and not self.chunked_prefill:
            raise ConfigError(
                f"prompt ({len(ids)} tokens) is longer than the engine's max_batch_tokens "
                f"({self.max_batch_tokens})"
            )
        need = self.pool.pages_per_token_block(model) * -(-(len(ids) + 1) // self.pool.block_size)
        kv_pages = self.pool.num_pages - self.pool.weight_pages() - self.watermark_pages()
        if need > kv_pages:
            kept = " (less the admission watermark)" if self.watermark else ""
            raise ConfigError(
                f"prompt ({len(ids)} tokens) needs {need} KV pages; the arena has {kv_pages} "
                f"for KV{kept} (raise arena_bytes)"
            )
        rid = next(self._ids) if request_id is None else request_id
        # an automatic id must not name a block table opened outside the queue
        # (a pipeline stage, remote KV); an explicit one may (imported KV)
        while request_id is None and (rid in self.requests or self.pool.has(rid)):
            rid = next(self._ids)
        if rid in self.requests:
            raise ValueError(f"request id {rid} is in use")
        gen = request_generator(p, rid)
        req = EngineRequest(
            id=rid,
            model=model,
            tokens=ids,
            prompt_len=len(ids),
            params=p,
            generator=gen,
            detok=IncrementalDetokenizer(m.tokenizer),
            arrival_s=arrival_s,
            on_token=on_token,
            on_finish=on_finish,
        )
        self.requests[rid] = req
        self.waiting.append(req)
        if self.group is not None:
            self._known.add(rid)
            self.group.on_arrival(req, self.clock())
        return rid

    def abort(self, rid: int) -> None:
        """Finish ``rid`` now (reason ``abort``), freeing its KV at once."""
        req = self.requests.get(rid)
        if req is None or req.status == FINISHED:
            return
        self._finish(req, "abort")

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def pop_finished(self, rid: int) -> EngineRequest:
        """Forget a finished request (the caller has read its output)."""
        req = self.requests[rid]
        if req.status != FINISHED:
            raise ValueError(f"request {rid} is {req.status}")
        return self.requests.pop(rid)

    def generate(
        self, model: str, prompts: Sequence[str | Sequence[int]], params: SamplingParams
    ) -> list[list[int]]:
        """Run ``prompts`` to completion; returns each one's generated token ids."""
        rids = [self.add_request(model, p, params) for p in prompts]
        while any(self.requests[r].status != FINISHED for r in rids):
            self.step()
        return [self.pop_finished(r).output_ids for r in rids]

    # ---------------------------------------------------------------- step
    def step(self) -> StepOutput:
        """One iteration (see the module docstring)."""
        out = StepOutput()
        self.steps += 1
        if self.group is not None:
            return self._group_step(out)
        view = _View(self)
        pool = self.pool
        # 1. room for every running request's next token, preempting if needed
        self.running = [r for r in self.running if r.status == RUNNING]
        while self.running:
            need = sum(pool.pages_to_grow(r.id, r.n_cached + 1) for r in self.running)
            if need <= pool.num_available:
                break
            victim = self.batching.victim(view, list(self.running))
            self._preempt(self.requests[victim.id])
            out.preempted.append(victim.id)
        for r in self.running:
            pool.grow(r.id, r.n_cached + 1)
        decodes = list(self.running)
        # 2. prompt chunks of partly prefilled requests (chunked prefill), then
        # admission (only when nothing was preempted this step)
        left = self.max_batch_tokens - len(decodes)
        chunks: dict[int, int] = {}  # request id -> tokens of its prompt this step
        prefills: list[EngineRequest] = []
        for r in self.prefilling:
            if left <= 0:
                break
            chunks[r.id] = n = min(len(r.tokens) - r.n_cached, left)
            prefills.append(r)
            left -= n
        if not out.preempted and self.waiting:
            n_run = len(self.running) + len(self.prefilling)
            budget = _Budget(self, n_run, left)
            chosen = self.batching.admit(view, list(self.waiting), budget)
            for seq in chosen:
                req = self.requests[seq.id]
                self.alloc_prompt(req)
                req.status = RUNNING
                self.waiting.remove(req)
                if self.chunked_prefill:
                    self.prefilling.append(req)
                    chunks[req.id] = n = min(len(req.tokens) - req.n_cached, left)
                    left -= n
                else:
                    self.running.append(req)
                prefills.append(req)
        if not decodes and not prefills:
            self._fail_unfittable(out)
            return out
        # 3. one forward per model
        pre = set(prefills)  # EngineRequest hashes by identity (eq=False)
        by_model: dict[str, list[EngineRequest]] = {}
        for r in [*prefills, *decodes]:
            by_model.setdefault(r.model, []).append(r)
        for model, reqs in by_model.items():
            n_pre = sum(1 for r in reqs if r in pre)  # prefills come first in reqs
            self._run_forward(model, reqs, n_pre, out, chunks)
        out.prefilled = [r.id for r in prefills]
        out.decoded = [r.id for r in decodes]
        if self.prefilling:  # prompts prefilled in full this step now decode
            done = [r for r in self.prefilling if r.n_cached == len(r.tokens) - 1]
            self.prefilling = [r for r in self.prefilling if r.n_cached != len(r.tokens) - 1]
            self.running += [r for r in done if r.status == RUNNING]
        self.running = [r for r in self.running if r.status == RUNNING]
        return out

    def _run_forward(
        self,
        model: str,
        reqs: list[EngineRequest],
        n_pre: int,
        out: StepOutput,
        chunks: Mapping[int, int] | None = None,
    ) -> None:
        """One forward of ``model`` over ``reqs`` (its first ``n_pre`` prefills,
        the rest decodes; their pages already hold the new tokens), then each
        request samples, streams and checks its stop conditions. A request in
        ``chunks`` runs that many of its uncached tokens; one that leaves some
        uncached only caches them (a prompt chunk: nothing is sampled)."""
        starts, lens, ids = self._forward_inputs(model, reqs, n_pre, out, chunks)
        logits = self.forward(model, [r.id for r in reqs], starts, lens, ids)
        self._take_logits(model, reqs, n_pre, starts, lens, logits, out)

    def _forward_inputs(
        self,
        model: str,
        reqs: list[EngineRequest],
        n_pre: int,
        out: StepOutput,
        chunks: Mapping[int, int] | None = None,
    ) -> tuple[list[int], list[int], list[int]]:
        """``(starts, lens, token ids)`` of a forward of ``reqs`` (see
        :meth:`_run_forward`), recorded in ``out.forwards``."""
        starts = [r.n_cached for r in reqs]
        lens = [len(r.tokens) - r.n_cached for r in reqs]
        if chunks:
            lens = [chunks.get(r.id, n) for r, n in zip(reqs, lens, strict=True)]
        ids = [t for r, n in zip(reqs, lens, strict=True) for t in r.tokens[r.n_cached :][:n]]
        out.forwards.append(
            Forward(
                model,
                tuple(zip(lens[:n_pre], starts[:n_pre], strict=True)),
                len(reqs) - n_pre,
                sum(starts[n_pre:]) + len(reqs) - n_pre,
            )
        )
        return starts, lens, ids

    def _take_logits(
        self,
        model: str,
        reqs: list[EngineRequest],
        n_pre: int,
        starts: list[int],
        lens: list[int],
        logits: torch.Tensor,
        out: StepOutput,
    ) -> None:
        """After a forward (:meth:`_run_forward`): each request samples,
        streams and checks its stop conditions, or caches its prompt chunk."""
        eos = self.models[model].cfg.eos_token_ids
        # requests whose logits are processed (logit_bias, min_tokens,
        # repetition_penalty) sample from their processed row
        raw = [not needs_logits_processing(r.params, r.generated) for r in reqs]
        # the other greedy ones: one argmax and one device->host copy for the batch
        greedy = (
            logits.argmax(-1).tolist()
            if any(ok and r.params.temperature == 0 for ok, r in zip(raw, reqs, strict=True))
            else []
        )
        for i, r in enumerate(reqs):
            if starts[i] + lens[i] < len(r.tokens):  # a prompt chunk
                r.n_cached += lens[i]
                continue
            p = r.params
            if not raw[i]:
                tok = sample_token(logits[i], p, r.generator, r.tokens, r.generated, eos)
            elif p.temperature == 0:
                tok = greedy[i]
            else:
                tok = sample_one(logits[i], p, r.generator)
            r.n_cached = len(r.tokens)
            if i < n_pre and self.prefix_caching:
                self._publish(r)
            out.tokens[r.id] = tok
            self._append(r, tok)
            if r.status == FINISHED:
                out.finished.append(r.id)

    # ------------------------------------------------------ prefix caching
    def _hashes(self, req: EngineRequest, n_blocks: int) -> list[int]:
        """Chain hashes of the first ``n_blocks`` full token-blocks of ``req``:
        block i's hash covers every token up to its end (the pool keys it with
        the model). BLAKE2b, 128 bits: a prompt crafted to collide with
        another request's cached prefix (and read its KV) is out of reach,
        which Python's ``hash`` would not guarantee."""
        hs = req.block_hashes
        bs = self.pool.block_size
        prev = hs[-1].to_bytes(16, "little") if hs else b""
        for i in range(len(hs), n_blocks):
            block = np.asarray(req.tokens[i * bs : (i + 1) * bs], dtype=np.int64).tobytes()
            prev = hashlib.blake2b(prev + block, digest_size=16).digest()
            hs.append(int.from_bytes(prev, "little"))
        return hs[:n_blocks]

    def _hits(self, req: EngineRequest) -> list[tuple[str, int]]:
        """The cached blocks ``req``'s tokens start with, leaving at least one
        token to compute (its logits give the next token)."""
        if not self.prefix_caching:
            return []
        full = (len(req.tokens) - 1) // self.pool.block_size
        return self.pool.match(req.model, self._hashes(req, full)) if full else []

    def prompt_pages(self, rid: int) -> int:
        """Pages an admission budget counts for ``rid``: its prompt plus the
        next token, in full. With prefix caching it takes at most that many of
        the available pages (its cached blocks are not allocated again, and
        attaching an evictable one takes at most its pages back), even when an
        allocation before it evicts blocks it would have hit; counting the
        hits as savings could over-commit then."""
        req = self.requests[rid]
        pool = self.pool
        if pool.has(rid):
            return pool.pages_to_grow(rid, len(req.tokens) + 1)
        per = pool.pages_per_token_block(req.model)
        return -(-(len(req.tokens) + 1) // pool.block_size) * per

    def watermark_pages(self) -> int:
        """KV pages admission keeps free (``watermark`` of the arena's KV
        pages now: the arena less the weights it holds)."""
        if not self.watermark:
            return 0
        return int(self.watermark * (self.pool.num_pages - self.pool.weight_pages()))

    def alloc_prompt(self, req: EngineRequest) -> None:
        """KV for an admitted request's prompt: its cached blocks (prefix
        caching), then pages for the rest."""
        pool = self.pool
        if not pool.has(req.id):
            pool.open(req.id, req.model)
            hits = self._hits(req)
            if hits:
                pool.attach(req.id, hits)
                req.n_cached = len(hits) * pool.block_size
            if self.prefix_caching:
                self.prefix_queries += len(req.tokens)
                self.prefix_hits += req.n_cached
        pool.grow(req.id, len(req.tokens))

    def _publish(self, req: EngineRequest) -> None:
        """Publish the full token-blocks ``req`` has cached (after a prefill)."""
        full = req.n_cached // self.pool.block_size
        done = self.pool.cached_prefix(req.id)
        if full > done:
            self.pool.publish(req.id, self._hashes(req, full)[done:])

    # --------------------------------------------------------- group mode
    def _setup_group(self, sched: GroupScheduler, services: Mapping[str, ServiceStats]) -> None:
        """Give a group scheduler its services and the arena's KV capacity."""
        hosted = list(self.models)
        missing = [m for m in hosted if m not in services]
        if missing and not sched.one_model:
            raise ConfigError(
                f"batching {type(sched).__name__} reads each service's statistics; none "
                f"given for {', '.join(missing)}"
            )
        kv_bytes = self.pool.bytes_of(self.pool.num_pages - self.pool.weight_pages())
        sched.setup({m: services[m] for m in hosted if m in services}, kv_bytes)

    def kv_bytes(self, model: str) -> int:
        """KV bytes the requests of ``model`` hold now."""
        return self.kv_use(model)[0]

    def kv_use(self, model: str, but: int | None = None) -> tuple[int, int]:
        """KV bytes the requests of ``model`` hold now, and how many of them
        hold any (request ``but`` left out of the count)."""
        pool = self.pool
        pages = holders = 0
        for r in self.requests.values():
            if r.model == model and r.status != FINISHED and pool.has(r.id):
                pages += pool.pages_of(r.id)
                holders += r.id != but
        return pool.bytes_of(pages), holders

    def _kv_allows(self, sched: GroupScheduler, req: EngineRequest, pages: int) -> bool:
        """Whether ``req`` may take ``pages`` more KV pages under its model's
        quota (:meth:`~fleetserve.policy.sharing.GroupScheduler.kv_allows`)."""
        # no new page takes nothing: past its quota, a model holds KV only in
        # one request (kv_allows), so the answer is yes; skip the pass over requests
        if not pages or math.isinf(sched.kv_limit(req.model)):
            return True
        used, others = self.kv_use(req.model, but=req.id)
        return sched.kv_allows(req.model, used, self.pool.bytes_of(pages), others)

    def _arrivals(self) -> None:
        """Tell the group scheduler of queued requests it has not seen (new,
        imported, resumed), at the engine's clock."""
        sched = self.group
        if sched is None:
            return
        now: float | None = None
        for r in [*self.waiting, *self.running]:
            if r.id not in self._known:
                now = self.clock() if now is None else now
                self._known.add(r.id)
                sched.on_arrival(r, now)

    def _forget(self, req: EngineRequest) -> None:
        """The request left this engine (finished, aborted or moved away)."""
        if self.group is not None and req.id in self._known:
            self._known.discard(req.id)
            self.group.on_finish(req)

    def _group_step(self, out: StepOutput) -> StepOutput:
        """One scheduling point of the group scheduler (module docstring)."""
        sched = self.group
        assert sched is not None
        self.running = [r for r in self.running if r.status == RUNNING]
        self._arrivals()
        state = StateView(self)
        budget = JobBudget(self, sched)
        jobs = sched.schedule(state, budget, self.clock())
        taken = budget.taken
        for job in jobs:
            if job.phase not in (PREFILL, DECODE):
                raise ValueError(f"job of unknown phase {job.phase!r}")
        threads = self._job_threads(jobs) if sched.spatial else None
        if threads is None:
            prefills, decodes = self._jobs_one_by_one(jobs, taken, state, out)
        else:
            prefills, decodes = self._jobs_at_once(jobs, threads, taken, state, out)
        if taken:  # admitted through the budget but in no job: a scheduler defect
            raise RuntimeError(f"engine {self.engine_id}: {sorted(taken)} admitted, not run")
        self.running = [r for r in self.running if r.status == RUNNING]
        out.prefilled = [r.id for r in prefills]
        out.decoded = [r.id for r in decodes]
        if not jobs:
            self._fail_unfittable(out)
        return out

    def _jobs_one_by_one(
        self, jobs: list[Job], taken: dict[int, EngineRequest], state: StateView, out: StepOutput
    ) -> tuple[list[EngineRequest], list[EngineRequest]]:
        """Run ``jobs`` in order, each on all threads; the requests prefilled
        and decoded."""
        sched = self.group
        assert sched is not None
        prefills: list[EngineRequest] = []
        decodes: list[EngineRequest] = []
        for job in jobs:
            chunks: dict[int, int] | None = None
            if self.chunked_prefill and (
                job.phase == PREFILL or any(r.model == job.model for r in self.prefilling)
            ):
                pre, dec, chunks = self._mixed_job(job, taken, state, out)
                prefills += pre
                decodes += dec
                reqs, n_pre = pre + dec, len(pre)
            elif job.phase == PREFILL:
                reqs = self._start_prefill(job, taken)
                prefills += reqs
                n_pre = len(reqs)
            else:
                reqs = self._grow_decode(job, state, out)
                decodes += reqs
                n_pre = 0
            if not reqs:
                continue
            t0 = self.clock()
            self._run_forward(job.model, reqs, n_pre, out, chunks)
            if chunks:  # prompts whose last chunk ran now decode
                done = [r for r in self.prefilling if r.n_cached == len(r.tokens) - 1]
                self.prefilling = [r for r in self.prefilling if r not in done]
                self.running += [r for r in done if r.status == RUNNING]
            t1 = self.clock()
            self.group_jobs_alone += 1
            sched.on_job_end(job, [r for r in reqs if r.status == RUNNING], t1 - t0, t1)
        return prefills, decodes

    def _job_threads(self, jobs: list[Job]) -> list[int] | None:
        """Intra-op threads of each job run at once on its share, or None
        when they run one after another (see ``spatial_shares``)."""
        if not self.spatial_shares or len(jobs) < 2:
            return None
        total = torch.get_num_threads()
        threads = [max(1, int(job.share * total + 1e-9)) for job in jobs]
        return threads if sum(threads) <= total else None

    def _jobs_at_once(
        self,
        jobs: list[Job],
        threads: list[int],
        taken: dict[int, EngineRequest],
        state: StateView,
        out: StepOutput,
    ) -> tuple[list[EngineRequest], list[EngineRequest]]:
        """Run ``jobs`` at once, job ``i`` in a thread of its own with
        ``threads[i]`` intra-op threads; the requests prefilled and decoded.

        Every job's requests are set up first: the decode jobs grow (and
        preempt the scheduler's victims among their model's running
        requests), then the prefill jobs' requests join the batch, so that no
        victim is a request another job is about to run (as in the simulated
        group, where a request in a job in flight is no victim). The forwards
        run at once: they read the models' weights, and write the new
        tokens' KV into pages each request holds alone. Sampling, streaming
        and finishing follow in the main thread, job by job in the order the
        jobs ended, and each job's end is reported with its own measured
        duration. The next scheduling point comes when the last job has
        ended (the simulated group asks again as each one ends)."""
        sched = self.group
        assert sched is not None
        reqs_of: list[list[EngineRequest]] = [[] for _ in jobs]
        for i, job in enumerate(jobs):
            if job.phase == DECODE:
                reqs_of[i] = self._grow_decode(job, state, out)
        for i, job in enumerate(jobs):
            if job.phase == PREFILL:
                reqs_of[i] = self._start_prefill(job, taken)
        runs = []
        for job, reqs, n in zip(jobs, reqs_of, threads, strict=True):
            if reqs:
                n_pre = len(reqs) if job.phase == PREFILL else 0
                runs.append(
                    (job, reqs, n_pre, n, self._forward_inputs(job.model, reqs, n_pre, out))
                )
        if self._job_pool is None:
            self._job_pool = ThreadPoolExecutor(
                max_workers=max(2, torch.get_num_threads()),
                thread_name_prefix=f"engine{self.engine_id}-job",
            )
        futures = [
            self._job_pool.submit(self._timed_forward, n, job.model, reqs, *inputs)
            for job, reqs, _, n, inputs in runs
        ]
        wait(futures)  # every forward is over before anything else moves
        results = [f.result() for f in futures]
        order = sorted(range(len(runs)), key=lambda k: (results[k][2], k))
        for k in order:
            job, reqs, n_pre, _, (starts, lens, _ids) = runs[k]
            logits, t0, t1 = results[k]
            self._take_logits(job.model, reqs, n_pre, starts, lens, logits, out)
            self.group_jobs_at_once += 1
            sched.on_job_end(job, [r for r in reqs if r.status == RUNNING], t1 - t0, t1)
        prefills = [
            r for job, reqs in zip(jobs, reqs_of, strict=True) if job.phase == PREFILL for r in reqs
        ]
        decodes = [
            r for job, reqs in zip(jobs, reqs_of, strict=True) if job.phase == DECODE for r in reqs
        ]
        return prefills, decodes

    def _timed_forward(
        self,
        n_threads: int,
        model: str,
        reqs: list[EngineRequest],
        starts: list[int],
        lens: list[int],
        ids: list[int],
    ) -> tuple[torch.Tensor, float, float]:
        """In a job's thread: its forward on ``n_threads`` intra-op threads
        (the setting is the calling thread's own, as is the paged kernel's
        split, which reads it); ``(logits, start, end)``."""
        if torch.get_num_threads() != n_threads:  # a pool thread keeps its setting
            torch.set_num_threads(n_threads)
        t0 = self.clock()
        logits = self.forward(model, [r.id for r in reqs], starts, lens, ids)
        return logits, t0, self.clock()

    def _start_prefill(self, job: Job, taken: dict[int, EngineRequest]) -> list[EngineRequest]:
        """The requests of a prefill job, taken through the budget (KV allocated),
        from the waiting queue into the running batch."""
        reqs = []
        for rid in job.seqs:
            req = taken.pop(rid, None)
            if req is None or req.model != job.model:
                raise RuntimeError(f"engine {self.engine_id}: prefill of {rid} not admitted")
            req.status = RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            reqs.append(req)
        return reqs

    def _mixed_job(
        self, job: Job, taken: dict[int, EngineRequest], state: StateView, out: StepOutput
    ) -> tuple[list[EngineRequest], list[EngineRequest], dict[int, int]]:
        """Chunked prefill under a group scheduler: the job's model runs one
        mixed step, as the simulated group's (``sim/group.py``): every running
        request of the model decodes (the scheduler's victims preempted while
        that does not fit), then its partly prefilled prompts' next chunks,
        then the prompts the job admitted, within ``max_batch_tokens``.
        Returns the prompts chunked, the decodes, and each prompt's chunk."""
        m = job.model
        admitted = self._start_prefill(job, taken) if job.phase == PREFILL else []
        for r in admitted:  # _start_prefill put them in the batch: they prefill first
            self.running.remove(r)
        run = tuple(r.id for r in self.running if r.model == m and r.status == RUNNING)
        decodes = self._grow_decode(Job(m, DECODE, run), state, out) if run else []
        left = self.max_batch_tokens - len(decodes)
        chunks: dict[int, int] = {}
        pre: list[EngineRequest] = []
        for r in [*(x for x in self.prefilling if x.model == m), *admitted]:
            if left <= 0:
                break
            chunks[r.id] = n = min(len(r.tokens) - r.n_cached, left)
            pre.append(r)
            left -= n
        if any(r not in pre for r in admitted):
            raise RuntimeError(f"engine {self.engine_id}: a prompt admitted past the budget")
        self.prefilling += admitted
        return pre, decodes, chunks

    def _grow_decode(self, job: Job, state: StateView, out: StepOutput) -> list[EngineRequest]:
        """Room for the next token of each request of a decode job, preempting
        the scheduler's victims of the job's model while it does not fit (free
        pages, the model's KV quota); the requests left in the job."""
        sched = self.group
        assert sched is not None
        pool = self.pool
        reqs = [self.requests[rid] for rid in job.seqs]
        for r in reqs:
            if r.model != job.model or r.status != RUNNING:
                raise RuntimeError(f"engine {self.engine_id}: decode of {r.id} ({r.status})")
        i = 0
        while i < len(reqs):
            r = reqs[i]
            need = pool.pages_to_grow(r.id, r.n_cached + 1)
            if need <= pool.num_available and self._kv_allows(sched, r, need):
                pool.grow(r.id, r.n_cached + 1)
                i += 1
                continue
            cands = state.running_of(job.model)
            victim = self.requests[sched.victim(state, job.model, cands).id]
            if victim not in cands:
                raise RuntimeError(f"engine {self.engine_id}: victim {victim.id} not running")
            self._preempt(victim)
            out.preempted.append(victim.id)
            if victim in reqs:
                k = reqs.index(victim)
                reqs.pop(k)
                if k < i:
                    i -= 1
        return reqs

    def _fail_unfittable(self, out: StepOutput) -> None:
        """Finish (reason ``capacity``) a head-of-queue request that cannot fit
        even in an otherwise empty arena: its KV outgrew what the arena has for
        KV, so waiting would never end (vLLM aborts such a sequence too)."""
        pool = self.pool
        if (
            self.running
            or self.prefilling
            or not self.waiting
            or pool.kv_pages
            or pool.usage()["reserved"]
        ):
            return
        head = self.waiting[0]
        need = pool.pages_per_token_block(head.model) * -(
            -(len(head.tokens) + 1) // pool.block_size
        )
        if need > pool.num_available - self.watermark_pages():
            logger.warning(
                "engine %d: request %d needs %d KV pages, only %d exist: finished (capacity)",
                self.engine_id,
                head.id,
                need,
                pool.num_available,
            )
            self._finish(head, "capacity")
            out.finished.append(head.id)

    def _preempt(self, req: EngineRequest) -> None:
        self.pool.free(req.id)
        req.n_cached = 0
        req.status = WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        logger.debug("engine %d: preempted request %d", self.engine_id, req.id)

    def _append(self, req: EngineRequest, tok: int) -> None:
        """Record a sampled token; stream it; check the stop conditions
        (:func:`~.sampling.append_token`, the rules pipeline groups share)."""
        piece, reason = append_token(req, tok, self.models[req.model].cfg.eos_token_ids)
        if req.on_token is not None:
            req.on_token(req, tok, piece)
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: EngineRequest, reason: str) -> None:
        req.finish_reason = reason
        if self.pool.has(req.id):
            self.pool.free(req.id)
        if req.status == WAITING and req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        req.status = FINISHED
        self._forget(req)
        if req.on_finish is not None:
            req.on_finish(req)

    # ------------------------------------------------------------- forward
    def forward(
        self,
        model: str,
        rids: Sequence[int],
        starts: Sequence[int],
        lens: Sequence[int],
        token_ids: Sequence[int],
    ) -> torch.Tensor:
        """Embed, run every layer (local KV), head: logits [B, V] of each
        request's last new token. Tables must already hold the tokens.

        A step in which every request decodes one token runs as a captured
        decode step when the engine has them (``decode_graphs``)."""
        m = self.models[model]
        n_layers = m.cfg.spec.num_layers
        if (
            self._graphs is not None
            and len(m.layers) == n_layers
            and all(n == 1 for n in lens)
            and all(s > 0 for s in starts)
        ):
            self._check_tables(rids, range(n_layers))
            kv = self.pool.kv(model)
            tables = [self.pool.table(r) for r in rids]
            return self._graphs.run(model, m, kv, tables, starts, token_ids)
        batch = Batch.build(model, rids, starts, lens, self.device)
        h = self.embed(model, token_ids)
        h = self.run_layers(batch, h, range(self.models[model].cfg.spec.num_layers))
        return self.head(batch, h)

    @torch.inference_mode()
    def embed(self, model: str, token_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return F.embedding(ids, self.models[model].embed)

    @torch.inference_mode()
    def head(self, batch: Batch, h: torch.Tensor) -> torch.Tensor:
        m = self.models[batch.model]
        x = rms_norm(h[batch.last], m.norm, m.cfg.rms_norm_eps)
        return linear(x, m.lm_head)

    @torch.inference_mode()
    def run_layers(
        self,
        batch: Batch,
        h: torch.Tensor,
        layers: range,
        remote: Mapping[int, RemoteAttention] | None = None,
    ) -> torch.Tensor:
        """Run layers ``layers`` of ``batch.model`` on packed hidden states ``h``.

        The weights of every layer in ``layers`` must be held here. A layer's
        attention runs here when the requests' KV of that layer is here (their
        tables must cover ``starts + lens`` tokens), or through ``remote[l]``
        (another engine's :meth:`remote_attention`) when it is not.
        """
        m = self.models[batch.model]
        cfg = m.cfg
        missing = [li for li in layers if li not in m.layers]
        if missing:  # before anything runs: no KV written for the layers before it
            raise FleetserveError(
                f"engine {self.engine_id}: layer {missing[0]} of {cfg.name} not held "
                f"(holds {sorted(m.layers)})"
            )
        local = [li for li in layers if li not in (remote or {})]
        tables = self._tables(batch, local) if local else None
        cos, sin = m.rotary.cos_sin(batch.pos, h.dtype)
        for li in layers:
            w = m.layers[li]
            q, k, v = qkv(cfg, w, h, cos, sin)
            fn = remote.get(li) if remote else None
            if fn is not None:
                a = fn(batch, q, k, v)
            else:
                assert tables is not None
                a = self._attend(batch, tables, li, q, k, v)
            h = out_residual(w, a, h)
            h = mlp_residual(cfg, w, h)
        return h

    @torch.inference_mode()
    def remote_attention(
        self, batch: Batch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Attention of ``layer`` for ``batch``, whose KV of that layer lives here:
        stores the new k/v in this engine's pages and returns [N, heads*d]."""
        dev = self.device
        return self._attend(
            batch, self._tables(batch, (layer,)), layer, q.to(dev), k.to(dev), v.to(dev)
        )

    def _check_tables(self, rids: Iterable[int], layers: Iterable[int]) -> None:
        """Every request must have a table here holding ``layers``: a missing
        layer would read as page 0 and write its K/V over another's pages."""
        pool = self.pool
        need = set(layers)
        for r in rids:
            if not pool.has(r):
                raise FleetserveError(f"engine {self.engine_id}: request {r} has no KV here")
            lack = need.difference(pool.layers(r))
            if lack:
                raise FleetserveError(
                    f"engine {self.engine_id}: the KV table of request {r} lacks layers "
                    f"{sorted(lack)} (it holds {list(pool.layers(r))})"
                )

    def _tables(self, batch: Batch, layers: Iterable[int]) -> torch.Tensor:
        """Padded block tables [B, max_tb, num_layers, kv_heads] (-1 -> page 0)
        of the batch's requests (:meth:`_check_tables`)."""
        self._check_tables(batch.rids, layers)
        pool = self.pool
        max_tb = -(-batch.max_ctx // pool.block_size)
        tabs = [pool.table(r) for r in batch.rids]
        out = torch.full((len(tabs), max_tb, *tabs[0].shape[1:]), -1, dtype=torch.int64)
        for i, t in enumerate(tabs):
            n = min(t.shape[0], max_tb)
            out[i, :n] = t[:n]
        if self._flex is not None and batch.model in self._flex_models and batch.groups:
            self._flex.mark(out, out.shape[2])
        return out.clamp_(min=0).to(self.device)

    def _flex_inputs(self, batch: Batch) -> FlexStep:
        """The batch's FlexAttention inputs, built once for all its layers."""
        assert self._flex is not None
        if self._flex_step is None or self._flex_step[0] is not batch:
            st, ln = batch.starts.tolist(), batch.lens.tolist()
            first = (torch.cumsum(batch.lens, 0) - batch.lens).tolist()
            members = [i for i, s in enumerate(st) if s > 0]
            spec = self.models[batch.model].cfg.spec
            fs = self._flex.step(members, st, ln, first, spec.num_kv_heads, spec.num_layers)
            self._flex_step = (batch, fs)
        return self._flex_step[1]

    def _attend(
        self,
        batch: Batch,
        tables: torch.Tensor,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.models[batch.model].cfg
        s = cfg.spec
        bs = self.pool.block_size
        kv = self.pool.kv(batch.model)
        tab = tables[:, :, layer]  # [B, max_tb, nkv]
        # write the new tokens' K/V into their pages
        page = tab[batch.b_idx, batch.pos // bs]  # [N, nkv]
        off = (batch.pos % bs)[:, None]
        kv[page, 0, off] = k
        kv[page, 1, off] = v
        nh, nkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        out = q.new_empty(q.shape[0], nh * d)
        # whole prompts: causal attention on their own k/v (no gather, no padding)
        for lo, hi in batch.fresh:
            a = sdpa(
                q[lo:hi].transpose(0, 1)[None],
                k[lo:hi].transpose(0, 1)[None],
                v[lo:hi].transpose(0, 1)[None],
                is_causal=True,
            )
            out[lo:hi] = a[0].transpose(0, 1).reshape(hi - lo, nh * d)
        if self._flex is not None and batch.model in self._flex_models and batch.groups:
            fs = self._flex_inputs(batch)
            out[fs.rows] = self._flex.attend(fs, tab, layer, q, nh, nkv, d)
            return out
        paged = self.attention == "paged" and paged_cpu.fits(self.pool.page_elems, d)
        if paged and batch.dec.numel():
            # decodes: one kernel call reading the pages in place
            rows = batch.dec_rows
            a = paged_cpu.decode_attention(
                q[rows], self.pool.arena, tab[batch.dec], batch.dec_ctx, bs, nkv
            )
            out[rows] = a.view(-1, nh * d)
        # the rest, group by group: padded attention over K/V gathered from the
        # pages, keys and values each in one index_select (rows: request, head, block)
        for g in batch.groups:
            n, q_len, ctx = g.mask.shape[0], g.mask.shape[2], g.mask.shape[3]
            if paged and q_len == 1:
                continue  # done above
            ntb = -(-ctx // bs)
            if q_len == 1:  # decodes
                valid = g.mask.view(n, ctx)
                out[g.rows] = gather_decode(q[g.rows], kv, tab[g.idx, :ntb], valid, nh, nkv, d)
                continue
            keys, vals = gather_kv(kv, tab[g.idx, :ntb], ctx)
            qp = q.new_zeros(n, q_len, nh, d)
            qp[g.g_b, g.g_t] = q[g.rows]
            a = attention_padded(qp.transpose(1, 2), keys, vals, g.mask)
            out[g.rows] = a.transpose(1, 2)[g.g_b, g.g_t].reshape(-1, nh * d)
        return out

    # ---------------------------------------------------------- migration
    # KV export/import with reservations, request state, pause/resume and token
    # migration; the drivers (blocking, live multi-stage, tokens) are in
    # :mod:`.migration`.
    def export_kv(
        self,
        rid: int,
        first_tb: int = 0,
        n_tb: int | None = None,
        layers: Sequence[int] | None = None,
        *,
        copy: bool = True,
    ) -> KVChunk:
        """A copy of the KV of token-blocks ``[first_tb, first_tb + n_tb)`` of ``rid``.

        With ``copy=False`` the chunk is a *view* of the arena when the pages
        are one consecutive run in table order (the pool hands out the lowest
        free pages first, so a request's pages mostly are); the importer's
        scatter is then the only copy. The view is valid until the request's
        pages change: consume it before the source steps again (the migration
        drivers write it at once). Otherwise it is a copy as usual.

        Args:
            rid: a request holding KV here (running or paused).
            first_tb: the first token-block.
            n_tb: how many token-blocks; default: up to the last one holding
                cached tokens (the last may be partial).
            layers: which layers (held by the request); default: all it holds.

        Returns:
            A :class:`~.migration.KVChunk`, gathered in one index operation.
        """
        req = self.requests.get(rid)
        if req is None or not self.pool.has(rid):
            raise ValueError(f"engine {self.engine_id}: request {rid} holds no KV here")
        bs = self.pool.block_size
        held = self.pool.layers(rid)
        lay = held if layers is None else tuple(sorted(set(layers)))
        if not set(lay) <= set(held):
            raise ValueError(f"request {rid}: layers {sorted(set(lay) - set(held))} not held")
        have = min(-(-req.n_cached // bs), self.pool.token_blocks(rid))
        n = have - first_tb if n_tb is None else n_tb
        if first_tb < 0 or n < 0 or first_tb + n > have:
            raise ValueError(
                f"request {rid}: token-blocks [{first_tb}, {first_tb + n}) outside [0, {have})"
            )
        table = self.pool.table(rid).numpy()[first_tb : first_tb + n]
        if lay != tuple(range(table.shape[1])):
            table = table[:, list(lay)]
        flat = table.reshape(-1)
        if not copy and flat.size and int(flat[-1]) - int(flat[0]) == flat.size - 1:
            if bool((np.diff(flat) == 1).all()):  # one run: a view, no copy
                kv = self.pool.kv(req.model)
                p0 = int(flat[0])
                data = kv[p0 : p0 + flat.size].view(*table.shape, *kv.shape[1:])
            else:
                data = gather_pages(self.pool, req.model, table)
        else:
            data = gather_pages(self.pool, req.model, table)
        covered = min(max(req.n_cached - first_tb * bs, 0), n * bs)
        return KVChunk(req.model, lay, first_tb, covered, bs, self.dtype, data)

    def _import_pages(self, model: str, n_tokens: int, layers: tuple[int, ...]) -> int:
        ntb = -(-n_tokens // self.pool.block_size)
        return ntb * self.pool.pages_per_token_block(model, len(layers))

    def _import_layers(self, model: str, layers: Sequence[int] | None) -> tuple[int, ...]:
        n = self._model(model).cfg.spec.num_layers
        lay = tuple(range(n)) if layers is None else tuple(sorted(set(layers)))
        if not lay or lay[0] < 0 or lay[-1] >= n:
            raise ValueError(f"model {model!r}: layers {list(lay)} outside [0, {n})")
        return lay

    def can_import(self, model: str, n_tokens: int, layers: Sequence[int] | None = None) -> bool:
        """Whether :meth:`begin_import` of ``n_tokens`` tokens would succeed now."""
        lay = self._import_layers(model, layers)
        return self.pool.can_reserve(self._import_pages(model, n_tokens, lay))

    def begin_import(
        self, model: str, n_tokens: int, layers: Sequence[int] | None = None
    ) -> ImportHandle:
        """Reserve the pages for ``n_tokens`` tokens of an incoming request's KV.

        Args:
            model: the request's model (hosted here).
            n_tokens: tokens to reserve for (grow later with :meth:`grow_import`).
            layers: the layers coming in; default: all of the model's.

        Raises:
            PoolFull: the pages are not free (nothing is reserved).
        """
        lay = self._import_layers(model, layers)
        if n_tokens < 0:
            raise ValueError("n_tokens must be >= 0")
        res = self.pool.reserve(self._import_pages(model, n_tokens, lay))
        return ImportHandle(model, lay, n_tokens, res, self.pool)

    def _check_handle(self, handle: ImportHandle) -> None:
        if handle.pool is not self.pool:
            raise ValueError(f"import handle does not belong to engine {self.engine_id}")
        if not handle.is_open:
            raise ValueError(f"import is {handle.state}")

    def grow_import(self, handle: ImportHandle, n_tokens: int) -> None:
        """Reserve more pages so the import can hold ``n_tokens`` tokens.

        Raises:
            PoolFull: the extra pages are not free (the reservation is unchanged).
        """
        self._check_handle(handle)
        extra = self._import_pages(handle.model, n_tokens, handle.layers) - len(
            handle.reservation.pages
        )
        if extra > 0:
            self.pool.reserve(extra, handle.reservation)
        handle.n_tokens = max(handle.n_tokens, n_tokens)

    def write_import(self, handle: ImportHandle, chunk: KVChunk) -> None:
        """Copy ``chunk`` into the reserved pages (one scatter); may be called per stage."""
        self._check_handle(handle)
        if chunk.model != handle.model or chunk.layers != handle.layers:
            raise ValueError(
                f"chunk of {chunk.model} layers {list(chunk.layers)} does not match the "
                f"import of {handle.model} layers {list(handle.layers)}"
            )
        bs = self.pool.block_size
        if chunk.block_size != bs or chunk.dtype != self.dtype:
            raise ValueError(
                f"chunk has block_size {chunk.block_size} / {chunk.dtype}; this engine "
                f"uses {bs} / {self.dtype}"
            )
        end_tb = chunk.first_tb + chunk.n_tb
        if chunk.end_token > handle.n_tokens:
            raise ValueError(
                f"chunk reaches token {chunk.end_token}; {handle.n_tokens} reserved "
                "(call grow_import first)"
            )
        if chunk.n_tb == 0:
            return
        per_tb = self.pool.pages_per_token_block(handle.model, len(handle.layers))
        pages = handle.pages()[chunk.first_tb * per_tb : end_tb * per_tb]
        shape = (chunk.n_tb, len(handle.layers), -1)
        scatter_pages(self.pool, handle.model, pages.reshape(shape), chunk.data)
        if len(handle.filled) < end_tb:
            handle.filled.extend([0] * (end_tb - len(handle.filled)))
        for tb in range(chunk.first_tb, end_tb):
            handle.filled[tb] = min(bs, max(0, chunk.end_token - tb * bs))

    def abort_import(self, handle: ImportHandle) -> None:
        """Give the reserved pages back; nothing of the import remains."""
        self._check_handle(handle)
        self.pool.release(handle.reservation)
        handle.state = "aborted"

    def _new_rid(self, preferred: int | None) -> int:
        free = preferred is not None and preferred >= 0 and preferred not in self.requests
        if free and preferred is not None and not self.pool.has(preferred):
            return preferred
        rid = next(self._ids)
        while rid in self.requests or self.pool.has(rid):
            rid = next(self._ids)
        return rid

    def _restore_request(self, state: RequestState, rid: int, status: str) -> EngineRequest:
        m = self._model(state.model)
        spec = m.cfg.spec
        if not state.tokens or not 0 < state.prompt_len <= len(state.tokens):
            raise ValueError(f"request state {state.id}: bad tokens / prompt_len")
        if min(state.tokens) < 0 or max(state.tokens) >= spec.vocab_size:
            raise ValueError(f"request state {state.id}: token ids outside [0, {spec.vocab_size})")
        if state.prompt_len + state.params.max_tokens > spec.max_context:
            raise ValueError(
                f"request state {state.id}: exceeds the context window of {state.model}"
            )
        gen = torch.Generator(device="cpu")
        gen.set_state(state.generator_state.clone())
        return EngineRequest(
            id=rid,
            model=state.model,
            tokens=list(state.tokens),
            prompt_len=state.prompt_len,
            params=state.params,
            generator=gen,
            detok=restore_detok(m.tokenizer, state.detok),
            arrival_s=state.arrival_s,
            status=status,
            text=state.text,
            preemptions=state.preemptions,
            on_token=state.on_token,
            on_finish=state.on_finish,
            held=state.held,
        )

    def precommit_import(self, handle: ImportHandle, state: RequestState) -> int:
        """Set the incoming request up here, PAUSED, while the source still runs.

        Llumnix's destination prepares the request during the copy stages, so
        that the stop-and-copy only moves the tail. The reservation becomes the
        request's block table at once (``handle.n_tokens`` tokens of pages);
        ``state`` may lag behind the source (it is a snapshot from before the
        source's last steps): :meth:`finish_import` applies the final state.
        Further pages come from :meth:`grow_paused`, data from
        :meth:`write_paused`; :meth:`abort_paused` undoes it all.

        Returns:
            The request's id on this engine.
        """
        self._check_handle(handle)
        if state.model != handle.model:
            raise ValueError(f"state of {state.model} committed to an import of {handle.model}")
        rid = self._new_rid(state.id)
        self._adopt_import(handle, state, rid, PAUSED, handle.n_tokens)
        return rid

    def _adopt_import(
        self, handle: ImportHandle, state: RequestState, rid: int, status: str, n_tokens: int
    ) -> EngineRequest:
        """Restore ``state`` as request ``rid`` here on the import's pages
        (``n_tokens`` of them become its table) and register it."""
        req = self._restore_request(state, rid, status)
        req.n_cached = state.n_cached
        self.pool.adopt(
            handle.reservation, rid, state.model, handle.layers, n_tokens, pages=handle.pages()
        )
        handle.state = "committed"
        self.requests[rid] = req
        return req

    def _paused(self, rid: int) -> EngineRequest:
        req = self.requests.get(rid)
        if req is None or req.status != PAUSED:
            raise ValueError(f"engine {self.engine_id}: request {rid} is not paused here")
        return req

    def grow_paused(self, rid: int, n_tokens: int) -> None:
        """More pages for a pre-committed request (check/commit; PoolFull, unchanged)."""
        self._paused(rid)
        self.pool.grow(rid, n_tokens)

    def write_paused(self, rid: int, chunk: KVChunk) -> None:
        """Copy ``chunk`` into a paused request's own pages (one scatter)."""
        req = self._paused(rid)
        layers = self.pool.layers(rid)
        if chunk.model != req.model or chunk.layers != layers:
            raise ValueError(f"chunk of {chunk.model} {list(chunk.layers)} does not match {rid}")
        end_tb = chunk.first_tb + chunk.n_tb
        if end_tb > self.pool.token_blocks(rid):
            raise ValueError(f"chunk reaches token-block {end_tb}; request {rid} has fewer")
        table = self.pool.table(rid).numpy()[chunk.first_tb : end_tb]
        if len(layers) != table.shape[1]:
            table = table[:, list(layers)]
        scatter_pages(self.pool, req.model, table, chunk.data)

    def finish_import(self, rid: int, state: RequestState) -> None:
        """Bring a pre-committed request to ``state`` (the source's, paused) and run it.

        Only what changed since the pre-commit is applied: the new tokens
        (validated), the sampler's generator state, the streamed text and the
        detokenizer. The request's pages must cover ``state.n_cached`` tokens.
        """
        req = self._paused(rid)
        old = len(req.tokens)
        if (
            state.model != req.model
            or state.prompt_len != req.prompt_len
            or len(state.tokens) < old
        ):
            raise ValueError(f"request {rid}: final state does not continue the pre-committed one")
        if state.n_cached != len(state.tokens) - 1:
            raise ValueError(f"request state {state.id}: not a paused running request")
        if self.pool.capacity_tokens(rid) < state.n_cached:
            raise ValueError(f"request {rid}: pages cover fewer than {state.n_cached} tokens")
        new = state.tokens[old:]
        vocab = self.models[req.model].cfg.spec.vocab_size
        if new and (min(new) < 0 or max(new) >= vocab):
            raise ValueError(f"request state {state.id}: token ids outside [0, {vocab})")
        req.tokens.extend(new)
        req.generator.set_state(state.generator_state)
        req.text, req.held = state.text, state.held
        req.detok = restore_detok(self.models[req.model].tokenizer, state.detok)
        req.n_cached = state.n_cached
        req.preemptions = state.preemptions
        req.status = RUNNING
        self.running.append(req)

    def abort_paused(self, rid: int) -> None:
        """Undo a pre-commit: free the request's pages and forget it."""
        req = self._paused(rid)
        self.pool.free(rid)
        del self.requests[rid]
        self._forget(req)

    def commit_import(
        self, handle: ImportHandle, state: RequestState, *, request_id: int | None = None
    ) -> int:
        """Adopt the imported KV as request ``state``, running here from where it was.

        The request's KV must cover its ``state.n_cached`` tokens (all written).
        It becomes RUNNING here with the same tokens, parameters, generator
        state, streamed text and callbacks; its next token comes from this
        engine's next ``step()``.

        Args:
            handle: an open import of ``state.model``.
            state: the request (from the source's :meth:`export_state` after
                its last step, e.g. while paused).
            request_id: the id here; default: the source's id when free here.

        Returns:
            The request's id on this engine.
        """
        self._check_handle(handle)
        if state.model != handle.model:
            raise ValueError(f"state of {state.model} committed to an import of {handle.model}")
        if state.n_cached < 1 or state.n_cached != len(state.tokens) - 1:
            raise ValueError(
                f"request state {state.id}: n_cached {state.n_cached} with {len(state.tokens)} "
                "tokens is not a running request's (use import_tokens)"
            )
        if handle.written_tokens() < state.n_cached:
            raise ValueError(
                f"import holds the KV of {handle.written_tokens()} tokens, the request "
                f"has {state.n_cached} cached"
            )
        rid = self._new_rid(state.id if request_id is None else request_id)
        if request_id is not None and rid != request_id:
            raise ValueError(f"request id {request_id} is in use")
        self.running.append(self._adopt_import(handle, state, rid, RUNNING, state.n_cached))
        return rid

    def export_state(self, rid: int) -> RequestState:
        """Everything about ``rid`` but its KV (a snapshot; the request is unchanged)."""
        req = self.requests.get(rid)
        if req is None:
            raise KeyError(f"engine {self.engine_id}: no request {rid}")
        if req.status == FINISHED:
            raise ValueError(f"request {rid} is finished")
        return RequestState(
            id=req.id,
            model=req.model,
            tokens=tuple(req.tokens),
            prompt_len=req.prompt_len,
            params=req.params,
            generator_state=req.generator.get_state(),
            n_cached=req.n_cached,
            text=req.text,
            held=req.held,
            detok=snapshot_detok(req.detok),
            arrival_s=req.arrival_s,
            preemptions=req.preemptions,
            on_token=req.on_token,
            on_finish=req.on_finish,
        )

    def pause(self, rid: int) -> None:
        """Take a running request out of the batches; it keeps its KV (status PAUSED).

        A paused request is neither scheduled nor preempted by :meth:`step`.
        """
        req = self.requests.get(rid)
        if req is None or req.status != RUNNING:
            status = "unknown" if req is None else req.status
            raise ValueError(f"request {rid} is {status}; only a running request can pause")
        if req in self.prefilling:
            raise ValueError(f"request {rid} is still prefilling its prompt; it cannot pause")
        req.status = PAUSED
        self.running.remove(req)

    def resume(self, rid: int) -> None:
        """Put a paused request back into the batches."""
        req = self.requests.get(rid)
        if req is None or req.status != PAUSED:
            status = "unknown" if req is None else req.status
            raise ValueError(f"request {rid} is {status}; only a paused request can resume")
        req.status = RUNNING
        self.running.append(req)

    def release_migrated(self, rid: int) -> None:
        """End ``rid`` here after it moved to another engine: its KV is freed,
        ``finish_reason`` is ``migrated``, and ``on_finish`` is not called (the
        request goes on elsewhere)."""
        req = self.requests.get(rid)
        if req is None or req.status == FINISHED:
            raise ValueError(f"request {rid} is not live on engine {self.engine_id}")
        if self.pool.has(rid):
            self.pool.free(rid)
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        req.status = FINISHED
        req.finish_reason = "migrated"
        self._forget(req)

    def import_tokens(self, state: RequestState, *, request_id: int | None = None) -> int:
        """Token migration: queue ``state`` here to be re-prefilled from its token ids.

        It enters the waiting queue (at the tail) with prompt + generated
        tokens and no KV; the step that admits it recomputes the KV and samples
        its next token, continuing from the state's generator, text and
        callbacks.

        Returns:
            The request's id on this engine.
        """
        rid = self._new_rid(state.id if request_id is None else request_id)
        if request_id is not None and rid != request_id:
            raise ValueError(f"request id {request_id} is in use")
        req = self._restore_request(state, rid, WAITING)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    # --------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """The pool's invariants plus: every live request's table covers its
        cached tokens, finished requests hold no pages, each request is in
        exactly one of waiting / running / finished."""
        self.pool.check_integrity()
        seen: set[int] = set()
        for r in self.waiting:
            assert r.status == WAITING and r.id not in seen, f"request {r.id}: waiting twice"
            seen.add(r.id)
        for r in self.running:
            assert r.status == RUNNING and r.id not in seen, f"request {r.id}: running twice"
            seen.add(r.id)
            assert self.pool.capacity_tokens(r.id) >= r.n_cached, f"request {r.id}: KV lost"
        for r in self.prefilling:
            assert r.status == RUNNING and r.id not in seen, f"request {r.id}: prefilling twice"
            seen.add(r.id)
            assert r.n_cached < len(r.tokens) - 1 or r.n_cached == 0, f"request {r.id}: prefilled"
            assert self.pool.capacity_tokens(r.id) >= len(r.tokens), f"request {r.id}: KV short"
        for r in self.requests.values():
            if r.status == FINISHED:
                assert not self.pool.has(r.id), f"request {r.id}: finished but holds pages"
            elif r.status in (WAITING, RUNNING):
                assert r.id in seen, f"request {r.id}: {r.status} but in no queue"
