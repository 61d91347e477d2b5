"""Request migration between engines: KV chunks, request state, and drivers.

Three ways to move a running request from engine ``src`` to engine ``dst``
(the :class:`~fleetserve.runtime.engine.engine.Engine` primitives are
``export_kv`` / ``begin_import`` / ``write_import`` / ``grow_import`` /
``commit_import`` / ``abort_import``, ``export_state``, ``pause`` / ``resume``,
``release_migrated`` and ``import_tokens``):

* :func:`migrate_blocking` — reserve the pages on ``dst``, pause, copy all of
  the KV, commit on ``dst``, release on ``src``. The request stalls for the
  whole copy (the reservation comes before the pause: nothing runs on the
  source in between, so the request's size cannot change).
* :func:`migrate_live` — Llumnix-style multi-stage copy::

      stage 1   copy every full token-block; pre-commit on dst: the request
                is set up there, PAUSED, on the reserved pages, from a state
                that will lag               (request keeps decoding on src)
      stage k   copy the blocks that filled up since  (request keeps decoding on src)
      final     grow the tail's pages; pause; copy the rest, incl. the partial
                last block; apply the final state on dst (new tokens, generator,
                text) and run it there (the stall ends); release on src

  The pre-commit (``precommit_import`` / ``grow_paused`` / ``write_paused`` /
  ``finish_import`` / ``abort_paused``) keeps building the request and its
  block table out of the stall, as Llumnix's destination prepares during the
  copy stages: the stop-and-copy only moves the tail and a state delta. The
  tail's copy is planned before the pause too (:func:`plan_page_copy`: page
  ids and arena views on both sides, once the tail's pages are reserved), so
  the stall is the state export, the copies themselves and the hand-over.

  The destination reserves its pages before the first copy and grows the
  reservation as the request grows, so both engines hold the KV until the
  commit. If ``dst`` runs out of pages, or the request finishes (or is
  preempted) on ``src`` meanwhile, the import is aborted and the request stays
  where it is.
* :func:`migrate_tokens` — no KV moves: ``dst`` re-prefills the token ids
  (prompt + generated) and continues.

In every mode the request continues on ``dst`` exactly where it stopped on
``src``: tokens, sampling parameters, the sampler's generator state, streamed
text (incremental detokenizer, text held back for a stop string) and its
callbacks travel in a :class:`RequestState`. A KV migration copies the cache
bit for bit, so a migrated request yields exactly the tokens it would have
produced unmigrated.

Copies go through one gather (export) and one scatter (import) with an index
array of page ids, no Python loop over pages: on the CPU through NumPy fancy
indexing on an integer view of the arena (single threaded, 60-75 % of the
fastest memcpy in ``benchmarks/engine_migration.py``; torch's multi-threaded
index kernels collapse when the cores are shared), elsewhere through
``torch.index_select`` / ``index_copy_``.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fleetserve.runtime.engine.kvpool import KVPool, PoolFull, Reservation
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.engine.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from fleetserve.runtime.engine.engine import Engine, EngineRequest

__all__ = [
    "DetokState",
    "ImportHandle",
    "KVChunk",
    "MigrationStats",
    "PageCopy",
    "RequestState",
    "copy_pages",
    "gather_pages",
    "migrate_blocking",
    "migrate_live",
    "migrate_tokens",
    "plan_page_copy",
    "restore_detok",
    "scatter_pages",
    "snapshot_detok",
]

_RUNNING, _PAUSED, _FINISHED = "running", "paused", "finished"  # EngineRequest.status


# ------------------------------------------------------------------ data types
@dataclass(frozen=True, slots=True, eq=False)
class KVChunk:
    """The KV of some token-blocks of one request, for some layers.

    ``data[i, j, h]`` holds keys (``[..., 0, :, :]``) and values
    (``[..., 1, :, :]``) of tokens ``[(first_tb + i) * block_size, ... + block_size)``
    of layer ``layers[j]``, KV head ``h``. Only the first ``n_tokens`` tokens
    from ``start_token`` are valid (the last block may be partial).

    Attributes:
        model: the model's name.
        layers: the layers in ``data``'s second axis.
        first_tb: the first token-block.
        n_tokens: valid tokens covered, from ``first_tb * block_size``.
        block_size: tokens per block.
        dtype: element type of ``data``.
        data: ``[n_tb, len(layers), kv_heads, 2, block_size, head_dim]`` (a copy).
    """

    model: str
    layers: tuple[int, ...]
    first_tb: int
    n_tokens: int
    block_size: int
    dtype: torch.dtype
    data: torch.Tensor

    @property
    def n_tb(self) -> int:
        """Token-blocks in the chunk."""
        return int(self.data.shape[0])

    @property
    def start_token(self) -> int:
        return self.first_tb * self.block_size

    @property
    def end_token(self) -> int:
        """One past the last valid token."""
        return self.start_token + self.n_tokens

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(frozen=True, slots=True)
class DetokState:
    """An :class:`~.tokenizer.IncrementalDetokenizer`'s position (see its fields)."""

    ids: tuple[int, ...]
    prefix: int
    read: int
    text: tuple[str, ...]


def snapshot_detok(detok: IncrementalDetokenizer) -> DetokState:
    """The state of ``detok`` (its window of ids and the text returned so far)."""
    return DetokState(tuple(detok._ids), detok._prefix, detok._read, tuple(detok._text))


def restore_detok(tokenizer: Tokenizer, state: DetokState) -> IncrementalDetokenizer:
    """A detokenizer for ``tokenizer`` that continues exactly from ``state``."""
    d = IncrementalDetokenizer(tokenizer)
    d._ids = list(state.ids)
    d._prefix = state.prefix
    d._read = state.read
    d._text = list(state.text)
    return d


@dataclass(frozen=True, slots=True, eq=False)
class RequestState:
    """Everything about a request but its KV: enough to continue it elsewhere.

    Attributes:
        id: the request's id on the engine it was exported from.
        model: the model's name.
        tokens: prompt + generated token ids.
        prompt_len: how many of ``tokens`` are the prompt.
        params: sampling parameters.
        generator_state: the sampler generator's state (``torch.Generator.get_state``).
        n_cached: tokens in the KV cache on the source (``len(tokens) - 1``
            for a running or paused request, 0 for a waiting one).
        text: text streamed so far.
        held: text held back because it may start a stop string (the stop
            matcher's state is rebuilt from it alone: ``StopMatcher(stop, held)``).
        detok: the incremental detokenizer's state.
        arrival_s: the request's arrival time.
        preemptions: times it was preempted so far.
        on_token: the token callback (in-process migration only).
        on_finish: the finish callback (in-process migration only).
    """

    id: int
    model: str
    tokens: tuple[int, ...]
    prompt_len: int
    params: SamplingParams
    generator_state: torch.Tensor
    n_cached: int
    text: str
    held: str
    detok: DetokState
    arrival_s: float = 0.0
    preemptions: int = 0
    on_token: Callable[..., None] | None = None
    on_finish: Callable[..., None] | None = None

    @property
    def output_ids(self) -> list[int]:
        return list(self.tokens[self.prompt_len :])

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(slots=True, eq=False)
class ImportHandle:
    """An import in progress on one engine: pages reserved for a request's KV.

    The reserved pages, in order, are the future block table
    ``[token_blocks, len(layers), kv_heads]`` (see ``KVPool.adopt``).

    Attributes:
        model: the model whose KV comes in.
        layers: the layers that come in.
        n_tokens: tokens the reservation can hold now.
        reservation: the pool's reservation.
        pool: the pool it was made in (a handle only works on its engine).
        filled: valid tokens written so far, per token-block.
        state: ``open``, ``committed`` or ``aborted``.
    """

    model: str
    layers: tuple[int, ...]
    n_tokens: int
    reservation: Reservation
    pool: KVPool = field(repr=False)
    filled: list[int] = field(default_factory=list)
    state: str = "open"
    _pages: np.ndarray[Any, np.dtype[np.int64]] | None = field(default=None, repr=False)

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    def pages(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The reserved page ids as an array (cached until the reservation grows)."""
        have = self.reservation.pages
        if self._pages is None:
            self._pages = np.asarray(have, dtype=np.int64)
        elif len(self._pages) != len(have):  # grown: convert only the new pages
            new = np.asarray(have[len(self._pages) :], dtype=np.int64)
            self._pages = np.concatenate((self._pages, new))
        return self._pages

    def written_tokens(self) -> int:
        """Tokens from 0 whose KV has been written (a contiguous prefix)."""
        n = 0
        for tb, f in enumerate(self.filled):
            n = tb * self.pool.block_size + f
            if f < self.pool.block_size:
                break
        return n


@dataclass(frozen=True, slots=True)
class MigrationStats:
    """What one migration did.

    Attributes:
        mode: ``blocking``, ``live`` or ``tokens``.
        rid: the request's id on the source.
        new_rid: its id on the destination (None when aborted).
        n_tokens: the request's cached tokens at the stop (KV modes; at the
            abort when aborted), or its token ids (``tokens``).
        stages: KV copy rounds, the final stop-and-copy included (0 for tokens).
        bytes: bytes moved (KV, or token ids as int64 for ``tokens``).
        stall_bytes: bytes copied while the request was paused.
        stall_s: wall time the request could not decode: from its pause on the
            source to its commit on the destination (the source's release comes
            after). For ``tokens`` only the hand-over: the destination's
            re-prefill happens in its next step and is not included.
        total_s: wall time of the whole migration.
        aborted: the request stayed on the source.
        reason: why it was aborted ('' otherwise).
    """

    mode: str
    rid: int
    new_rid: int | None
    n_tokens: int
    stages: int = 0
    bytes: int = 0
    stall_bytes: int = 0
    stall_s: float = 0.0
    total_s: float = 0.0
    aborted: bool = False
    reason: str = ""


# ------------------------------------------------------------ page copy paths
_INT_VIEW: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}


def _np_view(t: torch.Tensor) -> np.ndarray[Any, Any] | None:
    """A NumPy view sharing ``t``'s memory (CPU only; any element type)."""
    if t.device.type != "cpu" or t.requires_grad:
        return None
    iv = _INT_VIEW.get(t.element_size())
    if iv is None:
        return None
    return t.view(iv).numpy()


# NumPy views of each pool's KV: no per-call conversion. Keyed by the arena's
# address as well: an engine that sleeps gives its arena back and gets a new one
# when it wakes, and a view of the old one would read and write memory the
# engine no longer uses.
_NP_KV: weakref.WeakKeyDictionary[KVPool, tuple[int, dict[str, np.ndarray[Any, Any] | None]]] = (
    weakref.WeakKeyDictionary()
)


def _pool_np(pool: KVPool, model: str) -> np.ndarray[Any, Any] | None:
    ptr = pool.arena.data_ptr()
    got = _NP_KV.get(pool)
    if got is None or got[0] != ptr:
        got = _NP_KV[pool] = (ptr, {})
    per = got[1]
    if model not in per:
        per[model] = _np_view(pool.kv(model))
    return per[model]


def gather_pages(pool: KVPool, model: str, pages: np.ndarray[Any, Any]) -> torch.Tensor:
    """``pool.kv(model)[pages]`` as a new tensor, in one gather.

    On the CPU a NumPy fancy index on an integer view of the arena (a
    row-by-row memcpy, single threaded); elsewhere ``torch.index_select``.

    Args:
        pool: the arena.
        model: whose view of the pages (its head_dim).
        pages: page ids (int64) of any shape ``S``.

    Returns:
        ``[*S, 2, block_size, head_dim]`` on the pool's device.
    """
    arr = _pool_np(pool, model)
    kv = pool.kv(model) if arr is None else None
    if arr is not None:
        return torch.from_numpy(arr[pages]).view(pool.dtype)
    assert kv is not None
    idx = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64)).to(kv.device)
    rows = kv.view(kv.shape[0], -1)
    return torch.index_select(rows, 0, idx.reshape(-1)).view(*idx.shape, *kv.shape[1:])


def scatter_pages(
    pool: KVPool, model: str, pages: np.ndarray[Any, Any], data: torch.Tensor
) -> None:
    """``pool.kv(model)[pages] = data`` in one scatter (``data``: ``[*S, 2, bs, d]``)."""
    arr = _pool_np(pool, model)
    data = data.to(device=pool.device, dtype=pool.dtype)
    src = _np_view(data.contiguous()) if arr is not None else None
    if arr is not None and src is not None:
        arr[pages] = src
        return
    kv = pool.kv(model)
    idx = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64)).to(kv.device)
    kv.view(kv.shape[0], -1).index_copy_(0, idx.reshape(-1), data.reshape(idx.numel(), -1))


def copy_pages(
    src_pool: KVPool,
    dst_pool: KVPool,
    model: str,
    src_pages: np.ndarray[Any, Any],
    dst_pages: np.ndarray[Any, Any],
) -> int:
    """Copy pages straight from one arena into another (export and import fused).

    Within one process (or between GPUs of one node) a migration needs no
    intermediate chunk: page ``src_pages[i]`` goes to ``dst_pages[i]``. Runs
    where both page ids are consecutive are copied as slices, one memcpy per
    run (a request's pages are mostly consecutive: the pool hands out the
    lowest free pages first); if they are fragmented (more than one run per 8
    pages) one fancy-indexed gather/scatter is used instead.

    Returns:
        Bytes copied.
    """
    return plan_page_copy(src_pool, dst_pool, model, src_pages, dst_pages).run()


@dataclass(slots=True, eq=False)
class PageCopy:
    """A planned page copy between two arenas (see :func:`plan_page_copy`).

    ``runs`` are (source view, destination view) pairs of consecutive pages;
    when the pages are too fragmented for runs, ``gather`` holds the page ids
    for one gather/scatter instead. The views stay valid while the pages keep
    their owners (the arena never moves).
    """

    dst_pool: KVPool
    model: str
    nbytes: int
    runs: list[tuple[torch.Tensor, torch.Tensor]]
    gather: tuple[KVPool, np.ndarray[Any, Any], np.ndarray[Any, Any]] | None = None

    def run(self) -> int:
        """Copy now; returns the bytes copied."""
        if self.gather is not None:
            src_pool, s, d = self.gather
            scatter_pages(self.dst_pool, self.model, d, gather_pages(src_pool, self.model, s))
        for a, b in self.runs:
            b.copy_(a)
        return self.nbytes


def plan_page_copy(
    src_pool: KVPool,
    dst_pool: KVPool,
    model: str,
    src_pages: np.ndarray[Any, Any],
    dst_pages: np.ndarray[Any, Any],
) -> PageCopy:
    """Plan :func:`copy_pages` ahead: find the runs and make their views now,
    so that running the copy later is only the copies (a live migration plans
    its stop-and-copy before it pauses the request)."""
    s = np.ascontiguousarray(src_pages, dtype=np.int64).reshape(-1)
    d = np.ascontiguousarray(dst_pages, dtype=np.int64).reshape(-1)
    if s.shape != d.shape:
        raise ValueError(f"{s.size} source pages vs {d.size} destination pages")
    if s.size == 0:
        return PageCopy(dst_pool, model, 0, [])
    src_kv, dst_kv = src_pool.kv(model), dst_pool.kv(model)
    nbytes = int(s.size * src_kv[0].numel() * src_kv.element_size())
    cut = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    if len(cut) + 1 > max(1, s.size // 8):  # fragmented: one gather + one scatter
        return PageCopy(dst_pool, model, nbytes, [], (src_pool, s, d))
    starts = np.concatenate(([0], cut)).tolist()
    ends = np.concatenate((cut, [s.size])).tolist()
    sl, dl = s.tolist(), d.tolist()
    runs = [  # copy_ also copies across devices
        (src_kv[sl[a] : sl[a] + (b - a)], dst_kv[dl[a] : dl[a] + (b - a)])
        for a, b in zip(starts, ends, strict=True)
    ]
    return PageCopy(dst_pool, model, nbytes, runs)


# -------------------------------------------------------------------- drivers
def _check_pair(src: Engine, dst: Engine, rid: int) -> EngineRequest:
    if src is dst:
        raise ValueError("source and destination are the same engine")
    req = src.requests.get(rid)
    if req is None:
        raise KeyError(f"engine {src.engine_id}: no request {rid}")
    if req.model not in dst.models:
        raise ValueError(
            f"engine {dst.engine_id} does not host model {req.model!r} (request {rid})"
        )
    return req


def _check_kv_pair(src: Engine, dst: Engine, rid: int) -> EngineRequest:
    req = _check_pair(src, dst, rid)
    if req.status != _RUNNING:
        raise ValueError(
            f"request {rid} is {req.status}; a KV migration needs a running request "
            "(use migrate_tokens for a waiting one)"
        )
    if src.pool.block_size != dst.pool.block_size:
        raise ValueError(
            f"block sizes differ ({src.pool.block_size} vs {dst.pool.block_size}); "
            "use migrate_tokens"
        )
    if src.dtype != dst.dtype:
        raise ValueError(f"KV dtypes differ ({src.dtype} vs {dst.dtype}); use migrate_tokens")
    return req


def migrate_blocking(src: Engine, dst: Engine, rid: int) -> MigrationStats:
    """Stop-and-copy: pause ``rid`` on ``src``, copy all its KV, continue it on ``dst``.

    Args:
        src: the engine running the request.
        dst: the engine to continue it (hosts the same model).
        rid: the request's id on ``src``; it must be running.

    Returns:
        The stats; ``aborted`` (request resumed on ``src``) when ``dst`` has
        no room for its KV.
    """
    t0 = time.perf_counter()
    req = _check_kv_pair(src, dst, rid)
    layers = src.pool.layers(rid)
    if not dst.can_import(req.model, req.n_cached, layers):
        t1 = time.perf_counter()
        return MigrationStats(
            "blocking",
            rid,
            None,
            req.n_cached,
            total_s=t1 - t0,
            aborted=True,
            reason="destination full",
        )
    # the destination reserves before the stop (nothing runs on the source in
    # between, so the request's size cannot change)
    handle = dst.begin_import(req.model, req.n_cached, layers)
    src.pause(rid)
    t_pause = time.perf_counter()
    try:
        state = src.export_state(rid)
        chunk = src.export_kv(rid, layers=layers, copy=False)
        dst.write_import(handle, chunk)
        new = dst.commit_import(handle, state)
        t_commit = time.perf_counter()
    except BaseException:
        if handle.is_open:
            dst.abort_import(handle)
        if src.requests[rid].status == _PAUSED:
            src.resume(rid)
        raise
    src.release_migrated(rid)
    n = chunk.nbytes
    stall = t_commit - t_pause
    return MigrationStats(
        "blocking",
        rid,
        new,
        state.n_cached,
        stages=1,
        bytes=n,
        stall_bytes=n,
        stall_s=stall,
        total_s=time.perf_counter() - t0,
    )


def migrate_live(
    src: Engine,
    dst: Engine,
    rid: int,
    *,
    run_source_step: Callable[[], object] | None = None,
    max_stages: int = 8,
    tail_blocks: int = 1,
) -> MigrationStats:
    """Multi-stage live migration (Llumnix): copy while the request decodes.

    Stage 1 copies every full token-block; then ``run_source_step()`` lets the
    source generate (by default one ``src.step()``) and the next stage copies
    the blocks that filled up meanwhile. When at most ``tail_blocks`` blocks
    are left uncopied (the partial last block counts), or after
    ``max_stages`` copy stages, the final stop-and-copy pauses the request,
    copies the rest, commits it on ``dst`` and releases it on ``src``.

    Args:
        src: the engine running the request.
        dst: the engine to continue it.
        rid: the request's id on ``src``; it must be running.
        run_source_step: lets the source make progress between stages.
        max_stages: most copy stages before the final stop-and-copy.
        tail_blocks: stop-and-copy once this few blocks are left.

    Returns:
        The stats. ``aborted`` (import released, request left running on
        ``src``) when ``dst`` cannot reserve the pages, or the request
        finishes or is preempted on ``src`` during the stages.
    """
    if max_stages < 0 or tail_blocks < 0:
        raise ValueError("max_stages and tail_blocks must be >= 0")
    t0 = time.perf_counter()
    req = _check_kv_pair(src, dst, rid)
    step = run_source_step if run_source_step is not None else src.step
    bs = src.pool.block_size
    layers = src.pool.layers(rid)
    preemptions = req.preemptions
    moved = 0
    stages = 0

    pre: int | None = None  # the request's id on dst once pre-committed

    def aborted(reason: str, handle: ImportHandle | None) -> MigrationStats:
        if pre is not None:
            dst.abort_paused(pre)
        elif handle is not None and handle.is_open:
            dst.abort_import(handle)
        t = time.perf_counter() - t0
        return MigrationStats(
            "live",
            rid,
            None,
            req.n_cached,
            stages=stages,
            bytes=moved,
            total_s=t,
            aborted=True,
            reason=reason,
        )

    if not dst.can_import(req.model, req.n_cached, layers):
        return aborted("destination full", None)
    handle = dst.begin_import(req.model, req.n_cached, layers)
    copied = 0  # full token-blocks copied so far
    try:
        while stages < max_stages:
            n_full = req.n_cached // bs
            left = math.ceil(req.n_cached / bs) - copied
            if left <= tail_blocks or n_full == copied:
                break
            try:
                if pre is None:
                    dst.grow_import(handle, n_full * bs)
                else:
                    dst.grow_paused(pre, n_full * bs)
            except PoolFull:
                return aborted("destination full", handle)
            chunk = src.export_kv(rid, copied, n_full - copied, layers, copy=False)
            if pre is None:
                dst.write_import(handle, chunk)
                # set the request up on dst now, while the source decodes on
                # (its state lags; the final stage applies the difference)
                pre = dst.precommit_import(handle, src.export_state(rid))
            else:
                dst.write_paused(pre, chunk)
            moved += chunk.nbytes
            copied = n_full
            stages += 1
            step()
            cur = src.requests.get(rid)
            if cur is not req or req.status == _FINISHED:
                return aborted("finished on the source", handle)
            if req.preemptions != preemptions or req.status != _RUNNING:
                return aborted(f"{req.status} on the source", handle)
        # final stop-and-copy; the pages for the tail are reserved first
        try:
            if pre is None:
                dst.grow_import(handle, req.n_cached)
            else:
                dst.grow_paused(pre, req.n_cached)
        except PoolFull:
            return aborted("destination full", handle)
        if pre is None:  # no stage ran (a short request): as a blocking copy
            src.pause(rid)
            t_pause = time.perf_counter()
            state = src.export_state(rid)
            chunk = src.export_kv(rid, copied, layers=layers, copy=False)
            dst.write_import(handle, chunk)
            new = dst.commit_import(handle, state)
            stall_bytes = chunk.nbytes
        else:
            # plan the tail's copy (page ids and arena views on both sides)
            # before the stop: nothing runs on the source in between
            n_tb = -(-req.n_cached // bs)
            tail = _plan_tail(src, dst, rid, pre, copied, n_tb)
            src.pause(rid)
            t_pause = time.perf_counter()
            state = src.export_state(rid)
            if -(-state.n_cached // bs) != n_tb:
                raise RuntimeError(f"request {rid} grew between the plan and the pause")
            stall_bytes = tail.run()
            dst.finish_import(pre, state)
            new = pre
        t_commit = time.perf_counter()
    except BaseException:
        if pre is not None and dst.requests.get(pre) is not None:
            if dst.requests[pre].status == _PAUSED:
                dst.abort_paused(pre)
        elif handle.is_open:
            dst.abort_import(handle)
        cur = src.requests.get(rid)
        if cur is req and req.status == _PAUSED:
            src.resume(rid)
        raise
    src.release_migrated(rid)
    moved += stall_bytes
    stall = t_commit - t_pause
    total = time.perf_counter() - t0
    return MigrationStats(
        "live",
        rid,
        new,
        state.n_cached,
        stages=stages + 1,
        bytes=moved,
        stall_bytes=stall_bytes,
        stall_s=stall,
        total_s=total,
    )


def _plan_tail(
    src: Engine, dst: Engine, rid: int, pre: int, first_tb: int, end_tb: int
) -> PageCopy:
    """The copy of token-blocks ``[first_tb, end_tb)`` of ``rid`` on ``src``
    into the same blocks of the pre-committed ``pre`` on ``dst``.

    Both tables list the same held layers (``-1`` marks a layer not held), so
    their valid entries in table order pair up page for page.
    """
    s_tab = src.pool.table(rid).numpy()[first_tb:end_tb]
    d_tab = dst.pool.table(pre).numpy()[first_tb:end_tb]
    s, d = s_tab[s_tab >= 0], d_tab[d_tab >= 0]
    if s.shape != d.shape:
        raise RuntimeError(
            f"request {pre} on engine {dst.engine_id}: {d.size} tail pages for {s.size}"
        )
    return plan_page_copy(src.pool, dst.pool, src.requests[rid].model, s, d)


def migrate_tokens(src: Engine, dst: Engine, rid: int) -> MigrationStats:
    """Token migration: ``dst`` re-prefills the request's token ids and continues.

    Works for a waiting, running or paused request; nothing of its KV moves
    (``dst`` recomputes it in its next step).

    Returns:
        The stats (``bytes``: the token ids as int64).
    """
    t0 = time.perf_counter()
    _check_pair(src, dst, rid)
    state = src.export_state(rid)
    new = dst.import_tokens(state)
    src.release_migrated(rid)
    t1 = time.perf_counter()
    nbytes = 8 * len(state.tokens)
    return MigrationStats(
        "tokens",
        rid,
        new,
        len(state.tokens),
        bytes=nbytes,
        stall_s=t1 - t0,
        total_s=t1 - t0,
    )
