"""Unified KV-cache layouts of a multi-LLM sharing group (simulator accounting).

A *sharing group* hosts several LLM services on one set of GPUs. Their KV caches
share one pool of ``capacity_bytes`` (the group's whole KV memory, all
tensor-parallel GPUs together). This module keeps the books of that pool for
three layouts -- counts and ids of blocks, never tensors -- behind one ABC,
:class:`KVLayout`, with vLLM-style check/commit pairs (``can_grow``/``grow``).

Every layout stores a request's KV in *token-blocks* of ``block_size`` tokens.
A token-block of service ``m`` holds ``tb_m = block_size * kv_bytes_per_token_m``
bytes of KV (``kv_bytes_per_token = kv_layers * 2 * kv_heads * head_dim *
dtype_bytes``; ``kv_layers`` is ``num_layers`` except for vision models, whose
cross-attention layers keep no per-token KV). A request of ``t`` tokens holds
``ceil(t / block_size)`` token-blocks.

Layouts
-------
``headwise`` (MuxServe)
    The pool is cut into *units* of one KV head of one layer for one token-block:
    ``unit_bytes = 2 * block_size * max_m(head_dim_m * dtype_bytes_m)``. A
    token-block of ``m`` takes ``kv_layers_m * num_kv_heads_m`` units (1,024 for
    llama-2-7b) and as many block-table entries. Units are interchangeable, so
    the layout counts them instead of naming them; every model can use every
    free unit (nothing is stranded). A model with a smaller head_dim wastes
    the padding of each unit.

``merged`` (SeaLLM section 4.4)
    A physical block is sized for the largest token-block of the group,
    ``P = max_m tb_m``. A physical block belongs to one model at a time, which
    packs ``k_m = P // tb_m`` of its logical token-blocks into it; a logical
    block is addressed by (physical id, second index)::

        physical block p: P bytes (llama-2-13b token-block = 13,107,200 B)
        +--------------+--------------+--------------+--------------+-------+
        | slot 0       | slot 1       | slot 2       | slot 3       | slack |
        | req 7, blk 0 | req 9, blk 2 |   (free)     | req 7, blk 1 |       |
        +--------------+--------------+--------------+--------------+-------+
        |<-- tb_m --->|  qwen-2.5-14b: tb_m = 3,145,728 B, k_m = 4;  P - k_m*tb_m
                                                                  = 524,288 B
        block table of req 7: [(p, 0), (p, 3)]   <- (physical id, second index)
        byte offset of (p, j) in the pool: p * P + j * tb_m

    Slots of one physical block may hold blocks of different requests of the
    owning model. A new logical block takes a free slot of one of the model's
    partly used physical blocks (the oldest such block: insertion order), else
    a fresh physical block from the pool; a physical block whose slots are all
    free goes back to the pool at once. One block-table entry per token-block
    (plus its second index).

``partitioned`` (static baseline)
    Each model owns a fixed byte share of the pool and cuts it into vLLM blocks
    of its own token-block size; it can never use another partition's free
    memory. Default shares are proportional to each service's KV bytes per
    token, which gives every service the same token capacity. One block-table
    entry per token-block.

Accounting
----------
``capacity = used + free + unusable`` in every layout:

* ``used_bytes``: physical memory assigned to requests (merged: whole physical
  blocks owned by a model, their free slots and slack included).
* ``free_bytes``: memory held by no request and no model (head-wise: free units;
  merged: free physical blocks; partitioned: the free blocks of all partitions,
  each usable only by its own model).
* ``unusable_bytes``: capacity no block can ever use: the remainder of the
  pool (or of each partition) after cutting whole blocks, and for partitioned
  the part of the pool left out by shares summing to less than 1.
* ``valid_bytes``: bytes holding KV of tokens, ``sum tokens * kv_bytes_per_token``.

Fragmentation (:class:`LayoutStats`):

* ``internal_frag = (used - valid) / used`` (0 when nothing is used): partial
  last token-blocks, head_dim padding of head-wise units, merged-block slack
  ``P - k_m * tb_m`` and free slots of partly used merged blocks.
* ``stranded_bytes = reclaimable - min_m free_bytes_for(m)``: the free memory
  that the worst-placed model cannot use now. ``reclaimable`` is every byte
  that could take a new token-block of *some* model: ``free_bytes`` plus, for
  merged, the free slots of partly used physical blocks (those are counted in
  ``used_bytes``). Head-wise strands nothing; partitioned strands the other
  partitions' free blocks; merged strands other models' free slots.

Every grow and free is O(1) plus O(new or freed token-blocks); no call scans
the pool. ``check_integrity`` is the slow, exhaustive check for tests.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter
from types import MappingProxyType
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from fleetserve.errors import ConfigError, FleetserveError, UnknownNameError
from fleetserve.spec.types import ModelSpec

logger = logging.getLogger(__name__)

__all__ = [
    "LAYOUTS",
    "HeadwiseLayout",
    "KVLayout",
    "LayoutStats",
    "MergedLayout",
    "PartitionedLayout",
    "PoolFull",
    "make_layout",
]

_SHARE_TOLERANCE = 1e-9


class PoolFull(FleetserveError):
    """A grow does not fit in the memory the layout gives the request's model."""


@dataclass(frozen=True, slots=True)
class LayoutStats:
    """Snapshot of a layout's accounting.

    Attributes:
        layout: layout name (``headwise``, ``merged``, ``partitioned``).
        capacity_bytes: the pool's bytes.
        used_bytes: physical bytes assigned to requests (see module docstring).
        valid_bytes: bytes holding KV of tokens.
        free_bytes: bytes held by no request and no model.
        unusable_bytes: bytes no block can ever use.
        requests: requests held.
        table_entries: block-table entries of all requests.
        internal_frag: fraction of ``used_bytes`` not holding valid KV.
        stranded_bytes: free memory the worst-placed model cannot use.
    """

    layout: str
    capacity_bytes: int
    used_bytes: int
    valid_bytes: int
    free_bytes: int
    unusable_bytes: int
    requests: int
    table_entries: int
    internal_frag: float
    stranded_bytes: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class KVLayout(ABC):
    """One sharing group's KV pool under one layout.

    Args:
        capacity_bytes: the group's KV memory in bytes (all TP GPUs together).
        models: service name -> model shape. Two services may share a spec.
        block_size: tokens per token-block.

    Raises:
        ConfigError: non-positive capacity or block size, no models, a value
            that is not a ModelSpec, or a pool that cannot hold one token-block
            of some model.
    """

    name: ClassVar[str]
    _tracks_alloc: ClassVar[bool] = True
    """Whether :meth:`_alloc` and :meth:`_release` change anything (a
    partition's blocks are interchangeable: its count is the state, so the
    calls are skipped where only the state matters)."""
    counts_only: ClassVar[bool] = True
    """Whether the layout keeps counts only (partitioned, head-wise), so a
    service's bound batch can be one set of totals (:meth:`bind`); the merged
    layout names every slot."""
    capacity_changes: ClassVar[bool] = False
    """Whether :meth:`max_tokens` may change while the layout is in use (the
    staged layout's, as its members drop or reload layers); its holder then
    refreshes what it derives from it."""

    def __init__(
        self, capacity_bytes: int, models: Mapping[str, ModelSpec], block_size: int = 16
    ) -> None:
        if not _is_int(capacity_bytes) or capacity_bytes <= 0:
            raise ConfigError(
                f"{self.name} KV layout: capacity_bytes must be a positive integer, "
                f"got {capacity_bytes!r}"
            )
        if not _is_int(block_size) or block_size < 1:
            raise ConfigError(
                f"{self.name} KV layout: block_size must be an integer >= 1, got {block_size!r}"
            )
        if not isinstance(models, Mapping) or not models:
            raise ConfigError(f"{self.name} KV layout: a sharing group needs at least one model")
        for svc, spec in models.items():
            if not isinstance(svc, str) or not svc:
                raise ConfigError(
                    f"{self.name} KV layout: service names must be non-empty strings, got {svc!r}"
                )
            if not isinstance(spec, ModelSpec):
                raise ConfigError(
                    f"{self.name} KV layout: service {svc!r} must map to a ModelSpec, "
                    f"got {type(spec).__name__}"
                )
        self._capacity = capacity_bytes
        self._block_size = block_size
        self._models: dict[str, ModelSpec] = dict(models)
        self._kvb: dict[str, int] = {m: s.kv_bytes_per_token for m, s in self._models.items()}
        self._tb: dict[str, int] = {m: block_size * b for m, b in self._kvb.items()}
        # per request
        self._rmodel: dict[int, str] = {}
        self._rtokens: dict[int, int] = {}
        self._rblocks: dict[int, int] = {}
        # per model
        self._mtokens: dict[str, int] = dict.fromkeys(self._models, 0)
        self._mblocks: dict[str, int] = dict.fromkeys(self._models, 0)
        self._mreqs: dict[str, int] = dict.fromkeys(self._models, 0)  # requests held
        # per model, a bound batch's totals (:meth:`bind`): requests, tokens, blocks
        self._bulk: dict[str, list[int]] = {m: [0, 0, 0] for m in self._models}
        # per model, token-blocks held by no request (:meth:`hold`)
        self._held: dict[str, int] = dict.fromkeys(self._models, 0)

    # --- construction helpers -------------------------------------------------
    def _validate_fit(self) -> None:
        """Raise ConfigError when some model cannot get even one token-block."""
        for m in self._models:
            if self.max_tokens(m) < self._block_size:
                raise ConfigError(
                    f"{self.name} KV layout: {self._capacity} bytes of KV memory cannot hold "
                    f"one {self._block_size}-token block of service {m!r} "
                    f"({self._models[m].name}, {self.bytes_per_token_block(m)} bytes per block"
                    f"{self._fit_detail(m)})"
                )

    def _fit_detail(self, model: str) -> str:
        return ""

    def _check_model(self, model: str) -> None:
        if model not in self._models:
            raise KeyError(
                f"unknown service {model!r} in this sharing group; "
                f"known: {', '.join(sorted(self._models))}"
            )

    def _check_grow_args(self, rid: int, model: str, tokens: int) -> None:
        # fast path (every decode step of the simulator comes here): a plain
        # int, a known service, the request's own or a new one
        if type(tokens) is int and tokens >= 0 and model in self._models:
            owner = self._rmodel.get(rid)
            if owner is None or owner == model:
                return
        self._check_model(model)
        if not _is_int(tokens) or tokens < 0:
            raise ValueError(f"tokens must be an integer >= 0, got {tokens!r}")
        owner = self._rmodel.get(rid)
        if owner is not None and owner != model:
            raise ValueError(f"request {rid} belongs to service {owner!r}, not {model!r}")

    # --- read-only facts ------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """The pool's bytes."""
        return self._capacity

    @property
    def block_size(self) -> int:
        """Tokens per token-block."""
        return self._block_size

    @property
    def models(self) -> Mapping[str, ModelSpec]:
        """Service name -> model shape (read-only view)."""
        return MappingProxyType(self._models)

    @property
    def num_requests(self) -> int:
        """Requests held."""
        return len(self._rmodel)

    def holders(self, model: str) -> int:
        """Requests of ``model`` held."""
        return self._mreqs[model]

    # --- check/commit ---------------------------------------------------------
    def can_grow(self, rid: int, model: str, tokens: int) -> bool:
        """Whether request ``rid`` (new or held) can hold ``tokens`` tokens in total.

        Args:
            rid: request id.
            model: the request's service (fixed at its first grow).
            tokens: total tokens the request would hold.

        Returns:
            True when :meth:`grow` with the same arguments would succeed.

        Raises:
            KeyError: unknown service.
            ValueError: negative tokens, or ``model`` differs from the request's.
        """
        self._check_grow_args(rid, model, tokens)
        add = -(-tokens // self._block_size) - self._rblocks.get(rid, 0)
        return add <= 0 or self._fits(model, add)

    def grow_bytes(self, rid: int, model: str, tokens: int) -> int:
        """Bytes :meth:`grow` with the same arguments would newly assign to
        ``model`` (``used_bytes(model)`` grows by exactly this much; 0 when no
        new token-block is needed). Quotas (MuxServe's ADBS) check it first."""
        self._check_grow_args(rid, model, tokens)
        add = -(-tokens // self._block_size) - self._rblocks.get(rid, 0)
        return self._add_bytes(model, add) if add > 0 else 0

    def grow(self, rid: int, model: str, tokens: int) -> None:
        """Make request ``rid`` hold ``tokens`` tokens in total (commit).

        A new ``rid`` is registered under ``model`` (also with 0 tokens).
        Growing to no more tokens than held is a no-op.

        Args:
            rid: request id.
            model: the request's service (fixed at its first grow).
            tokens: total tokens the request holds after the call.

        Raises:
            PoolFull: the new token-blocks do not fit; nothing changed.
            KeyError: unknown service.
            ValueError: negative tokens, or ``model`` differs from the request's.
        """
        self._check_grow_args(rid, model, tokens)
        held = self._rtokens.get(rid)
        if held is not None and tokens <= held:
            return
        blocks = self._rblocks.get(rid, 0)
        add = -(-tokens // self._block_size) - blocks
        if add > 0:
            if not self._fits(model, add):
                raise PoolFull(
                    f"{self.name} KV layout: request {rid} of service {model!r} needs "
                    f"{add} more token-block(s) for {tokens} tokens; "
                    f"{self.free_bytes_for(model)} bytes free for {model!r}"
                )
            if self._tracks_alloc:
                self._alloc(rid, model, add)
            self._rblocks[rid] = blocks + add
            self._mblocks[model] += add
        if held is None:
            self._rmodel[rid] = model
            self._rblocks.setdefault(rid, 0)
            self._mreqs[model] += 1
            held = 0
        self._rtokens[rid] = tokens
        self._mtokens[model] += tokens - held

    def free(self, rid: int) -> int:
        """Release everything request ``rid`` holds.

        Args:
            rid: request id.

        Returns:
            Bytes by which ``used_bytes()`` dropped (merged: only physical blocks
            that became entirely free count; slots freed inside a block still
            used by other requests do not).

        Raises:
            KeyError: ``rid`` is not held.
        """
        model = self._rmodel.pop(rid, None)
        if model is None:
            raise KeyError(f"request {rid} holds no KV in this {self.name} layout")
        tokens = self._rtokens.pop(rid)
        blocks = self._rblocks.pop(rid)
        self._mreqs[model] -= 1
        self._mtokens[model] -= tokens
        self._mblocks[model] -= blocks
        return self._release(rid, model, blocks)

    def shrink(self, rid: int, tokens: int) -> int:
        """Make request ``rid`` hold only ``tokens`` tokens: whole token-blocks
        past them go back (the simulator allocates a few decode steps ahead and
        gives back what an interrupted segment did not use).

        Returns:
            Bytes by which ``used_bytes()`` dropped.

        Raises:
            KeyError: ``rid`` is not held.
            ValueError: negative ``tokens``.
        """
        model = self._rmodel[rid]
        if tokens < 0:
            raise ValueError(f"request {rid}: tokens must be >= 0, got {tokens}")
        held = self._rtokens[rid]
        if tokens >= held:
            return 0
        self._rtokens[rid] = tokens
        self._mtokens[model] -= held - tokens
        keep = _ceil_div(tokens, self._block_size)
        drop = self._rblocks[rid] - keep
        if drop <= 0:
            return 0
        self._rblocks[rid] = keep
        self._mblocks[model] -= drop
        return self._release(rid, model, drop)

    def grow_needs(self, model: str, rids: Sequence[int], tokens: npt.NDArray[np.int64]) -> int:
        """Token-blocks of ``model`` that growing each held request ``rids[i]``
        (of ``model``) to ``tokens[i]`` tokens would add, all together."""
        held = np.fromiter((self._rblocks[r] for r in rids), np.int64, len(rids))
        add = -(-tokens // self._block_size) - held
        return int(add[add > 0].sum())

    def can_add_blocks(self, model: str, add: int) -> bool:
        """Whether ``add`` more token-blocks of ``model`` fit now, in any number
        of grows (a layout's fit is additive in one model's token-blocks: the
        grows one after another fit exactly when their sum does)."""
        self._check_model(model)
        return add <= 0 or self._fits(model, add)

    def grow_all(self, model: str, rids: Sequence[int], tokens: Sequence[int]) -> None:
        """:meth:`grow` each held request ``rids[i]`` of ``model`` to
        ``tokens[i]`` tokens, as one commit: :class:`PoolFull` (nothing
        changed) when their new token-blocks do not fit together."""
        bs = self._block_size
        adds = []
        total = 0
        for rid, t in zip(rids, tokens, strict=True):
            if self._rmodel.get(rid) != model or type(t) is not int:
                self._check_grow_args(rid, model, t)
                if rid not in self._rmodel:
                    raise KeyError(f"request {rid} holds no KV in this {self.name} layout")
            a = -(-t // bs) - self._rblocks[rid]
            adds.append(a)
            if a > 0:
                total += a
        if total and not self._fits(model, total):
            raise PoolFull(
                f"{self.name} KV layout: {len(adds)} requests of service {model!r} need "
                f"{total} more token-block(s); {self.free_bytes_for(model)} bytes free"
            )
        rtok, rblk = self._rtokens, self._rblocks
        grown = 0
        for rid, t, a in zip(rids, tokens, adds, strict=True):
            if a > 0:
                if self._tracks_alloc:
                    self._alloc(rid, model, a)
                rblk[rid] += a
            held = rtok[rid]
            if t > held:
                rtok[rid] = t
                grown += t - held
        self._mblocks[model] += total
        self._mtokens[model] += grown

    # --- bound batches (count-only layouts) ------------------------------------
    def bind(self, rid: int) -> None:
        """Request ``rid``'s KV joins its service's *bound batch*: from now on
        the layout keeps only the batch's totals (requests, tokens,
        token-blocks), and the batch's holder reports their changes
        (:meth:`bulk_change`). A sharing group does this for the running
        requests of a service whose decodes all step together
        (:class:`~fleetserve.sim.batch.BoundBatch`): a decode iteration then
        changes three counts, not one entry per request. Count-only layouts
        only (:attr:`counts_only`).

        Raises:
            KeyError: ``rid`` is not held.
            NotImplementedError: the merged layout, which names every slot.
        """
        if not self.counts_only:
            raise NotImplementedError(f"the {self.name} layout names every slot: no bound batch")
        model = self._rmodel.pop(rid, None)
        if model is None:
            raise KeyError(f"request {rid} holds no KV in this {self.name} layout")
        b = self._bulk[model]
        b[0] += 1
        b[1] += self._rtokens.pop(rid)
        b[2] += self._rblocks.pop(rid)

    def bulk_change(
        self, model: str, requests: int, tokens: int, blocks: int, *, check: bool = True
    ) -> None:
        """``model``'s bound batch changes by ``requests`` requests, ``tokens``
        tokens and ``blocks`` token-blocks (each signed: a decode segment
        grows it, a request that finishes or is preempted leaves it with its
        tokens and blocks, an interrupted segment gives back what it did not
        use). ``check=False``: KV that is already resident joins (a request
        moved in whose blocks were just freed or held here; in a staged
        layout, KV whose place the corrections track), not checked against
        the free blocks.

        Raises:
            PoolFull: the new token-blocks do not fit (with ``check``); nothing changed.
            ValueError: the batch would hold a negative count.
        """
        b = self._bulk.get(model)
        if b is None:
            self._check_model(model)  # raises, with the known services
            return
        n, t, k = b[0] + requests, b[1] + tokens, b[2] + blocks
        if n < 0 or t < 0 or k < 0:
            raise ValueError(
                f"{self.name} KV layout: the bound batch of {model!r} ({b[0]} requests, "
                f"{b[1]} tokens, {b[2]} token-blocks) cannot change by "
                f"({requests}, {tokens}, {blocks})"
            )
        if blocks > 0:
            if check and not self._fits(model, blocks):
                raise PoolFull(
                    f"{self.name} KV layout: the bound batch of {model!r} needs {blocks} more "
                    f"token-block(s); {self.free_bytes_for(model)} bytes free"
                )
            if self._tracks_alloc:
                self._alloc(-1, model, blocks)
        elif blocks < 0 and self._tracks_alloc:
            self._release(-1, model, -blocks)
        b[0], b[1], b[2] = n, t, k
        self._mreqs[model] += requests
        self._mtokens[model] += tokens
        self._mblocks[model] += blocks

    def bulk(self, model: str) -> tuple[int, int, int]:
        """``model``'s bound batch: (requests, tokens, token-blocks)."""
        n, t, b = self._bulk[model]
        return n, t, b

    # --- blocks held by no request (count-only layouts) -----------------------
    def hold(self, model: str, blocks: int, *, check: bool = True) -> None:
        """Take ``blocks`` token-blocks of ``model`` that no request holds: a
        KV migration's reservation for a request being copied in, or the
        blocks of a request that left while a copy still reads them. They
        count as used (and as ``model``'s) until :meth:`unhold`. Count-only
        layouts only (:attr:`counts_only`). ``check=False``: the blocks are
        already resident (as :meth:`bulk_change`'s).

        Raises:
            PoolFull: they do not fit (with ``check``); nothing changed.
            ValueError: ``blocks`` is negative.
            NotImplementedError: the merged layout, which names every slot.
        """
        if not self.counts_only:
            raise NotImplementedError(f"the {self.name} layout names every slot: no held blocks")
        self._check_model(model)
        if blocks < 0:
            raise ValueError(f"{self.name} KV layout: cannot hold {blocks} token-blocks")
        if blocks and check and not self._fits(model, blocks):
            raise PoolFull(
                f"{self.name} KV layout: {model!r} cannot hold {blocks} more token-block(s); "
                f"{self.free_bytes_for(model)} bytes free"
            )
        if self._tracks_alloc:
            self._alloc(-1, model, blocks)
        self._held[model] += blocks
        self._mblocks[model] += blocks

    def unhold(self, model: str, blocks: int) -> None:
        """Give back ``blocks`` of the token-blocks :meth:`hold` took for ``model``.

        Raises:
            ValueError: ``blocks`` is negative or more than are held.
        """
        self._check_model(model)
        if not 0 <= blocks <= self._held[model]:
            raise ValueError(
                f"{self.name} KV layout: cannot give back {blocks} of the "
                f"{self._held[model]} token-blocks held for {model!r}"
            )
        self._held[model] -= blocks
        self._mblocks[model] -= blocks
        self._release(-1, model, blocks)

    def held(self, model: str) -> int:
        """Token-blocks of ``model`` held by no request (:meth:`hold`)."""
        self._check_model(model)
        return self._held[model]

    def free_token_blocks(self, model: str) -> int:
        """The most token-blocks of ``model`` that fit now (a count-only
        layout's fit is linear in them)."""
        if not self.counts_only:
            raise NotImplementedError(f"the {self.name} layout has no linear fit")
        if model not in self._bulk:
            self._check_model(model)  # raises, with the known services
        return self._free_token_blocks(model)

    def _free_token_blocks(self, model: str) -> int:
        raise NotImplementedError

    # --- per request ----------------------------------------------------------
    def holds(self, rid: int) -> bool:
        """Whether request ``rid`` is registered (it may hold 0 tokens)."""
        return rid in self._rmodel

    def tokens_of(self, rid: int) -> int:
        """Tokens request ``rid`` holds. Raises KeyError when not held."""
        return self._rtokens[rid]

    def model_of(self, rid: int) -> str:
        """Service of request ``rid``. Raises KeyError when not held."""
        return self._rmodel[rid]

    def table_entries(self, rid: int) -> int:
        """Block-table entries request ``rid`` uses now. Raises KeyError when not held."""
        model = self._rmodel[rid]
        return self._rblocks[rid] * self._entries_per_block(model)

    def table_entries_total(self) -> int:
        """Block-table entries of all requests."""
        return sum(b * self._entries_per_block(m) for m, b in self._mblocks.items())

    # --- per model ------------------------------------------------------------
    def token_blocks(self, model: str) -> int:
        """Logical token-blocks held by ``model``'s requests."""
        self._check_model(model)
        return self._mblocks[model]

    def valid_bytes(self, model: str | None = None) -> int:
        """Bytes holding KV of tokens (tokens x kv_bytes_per_token), of one model or all."""
        if model is None:
            return sum(t * self._kvb[m] for m, t in self._mtokens.items())
        self._check_model(model)
        return self._mtokens[model] * self._kvb[model]

    def stats(self) -> LayoutStats:
        """Snapshot of the accounting; see the module docstring for definitions."""
        used = self.used_bytes()
        valid = self.valid_bytes()
        frag = (used - valid) / used if used else 0.0
        worst = min(self.free_bytes_for(m) for m in self._models)
        return LayoutStats(
            layout=self.name,
            capacity_bytes=self._capacity,
            used_bytes=used,
            valid_bytes=valid,
            free_bytes=self.free_bytes(),
            unusable_bytes=self.unusable_bytes(),
            requests=len(self._rmodel) + sum(b[0] for b in self._bulk.values()),
            table_entries=self.table_entries_total(),
            internal_frag=frag,
            stranded_bytes=self._reclaimable_bytes() - worst,
        )

    def stats_as_of(
        self, tokens: Mapping[int, int], bulk: Mapping[str, tuple[int, int]] | None = None
    ) -> LayoutStats:
        """:meth:`stats` as if each held request ``rid`` of ``tokens`` held
        only ``tokens[rid]`` tokens (no more than it holds), and each bound
        batch of ``bulk`` held ``(tokens, blocks)`` fewer, changing nothing:
        a sample as of an earlier point of a decode segment whose KV was
        allocated ahead (:meth:`~fleetserve.sim.group.SharingGroup.layout_stats`).

        Here the requests are shrunk, the stats read, and the requests grown
        back. That restores the state exactly because these layouts keep counts
        only (partitioned, head-wise). The merged layout, whose slots have an
        order, computes it without shrinking."""
        back = [(rid, self._rtokens[rid]) for rid in tokens]
        for rid, t in tokens.items():
            self.shrink(rid, t)
        for m, (t, b) in (bulk or {}).items():
            self.bulk_change(m, 0, -t, -b)
        st = self.stats()
        for m, (t, b) in (bulk or {}).items():
            self.bulk_change(m, 0, t, b)
        for rid, t in back:
            self.grow(rid, self._rmodel[rid], t)
        return st

    def check_integrity(self) -> None:
        """Check every accounting invariant (slow: for tests and idle loops).

        Raises:
            AssertionError: the books are inconsistent.
        """
        _require(
            self._rmodel.keys() == self._rtokens.keys() == self._rblocks.keys(),
            "per-request maps disagree on the requests held",
        )
        tokens: Counter[str] = Counter()
        blocks: Counter[str] = Counter()
        for rid, m in self._rmodel.items():
            _require(m in self._models, f"request {rid}: unknown service {m!r}")
            t, b = self._rtokens[rid], self._rblocks[rid]
            _require(
                b == _ceil_div(t, self._block_size),
                f"request {rid}: {b} token-blocks for {t} tokens",
            )
            tokens[m] += t
            blocks[m] += b
        held = Counter(self._rmodel.values())
        for m, (n, t, b) in self._bulk.items():  # a bound batch: n requests' totals
            _require(n >= 0 and t >= 0 and b >= 0, f"service {m!r}: negative bound batch")
            _require(
                _ceil_div(t, self._block_size)
                <= b
                <= (t + n * (self._block_size - 1)) // self._block_size,
                f"service {m!r}: {b} token-blocks for a bound batch of {n} requests, {t} tokens",
            )
            _require(self.counts_only or n == 0, f"{self.name} layout holds a bound batch")
            tokens[m] += t
            blocks[m] += b
            held[m] += n
        for m, b in self._held.items():  # blocks of no request (a copy in flight)
            _require(b >= 0 and (self.counts_only or b == 0), f"service {m!r}: held blocks {b}")
            blocks[m] += b
        for m in self._models:
            _require(tokens[m] == self._mtokens[m], f"service {m!r}: token sum mismatch")
            _require(blocks[m] == self._mblocks[m], f"service {m!r}: token-block sum mismatch")
        _require(all(held[m] == self._mreqs[m] for m in self._models), "request count mismatch")
        used, free, unusable = self.used_bytes(), self.free_bytes(), self.unusable_bytes()
        _require(0 <= used <= self._capacity, f"used {used} outside [0, {self._capacity}]")
        _require(free >= 0 and unusable >= 0, "negative free or unusable bytes")
        _require(
            used + free + unusable == self._capacity,
            f"used {used} + free {free} + unusable {unusable} != capacity {self._capacity}",
        )
        _require(
            sum(self.used_bytes(m) for m in self._models) == used, "per-service used sum mismatch"
        )
        for m in self._models:
            _require(
                self.valid_bytes(m) <= self.used_bytes(m), f"service {m!r}: valid > used bytes"
            )
            _require(
                0 <= self.free_bytes_for(m) <= self._reclaimable_bytes(),
                f"service {m!r}: free_bytes_for outside [0, reclaimable]",
            )
        self._check_layout()

    # --- layout-specific ------------------------------------------------------
    @abstractmethod
    def units_needed(self, model: str, tokens: int) -> int:
        """Physical units (layout-specific) a lone request of ``tokens`` needs from an empty pool.

        Head-wise: units; merged: physical blocks; partitioned: blocks of the
        model's own partition.
        """

    @abstractmethod
    def max_tokens(self, model: str) -> int:
        """Most tokens one request of ``model`` could hold in an empty pool (memory bound only)."""

    @abstractmethod
    def bytes_per_token_block(self, model: str) -> int:
        """Physical bytes one token-block of ``model`` occupies in this layout.

        Head-wise: its units including head_dim padding; merged: one slot
        (``tb_m``, excluding merged-block slack); partitioned: ``tb_m``.
        """

    @abstractmethod
    def used_bytes(self, model: str | None = None) -> int:
        """Physical bytes assigned to ``model``'s requests (all models when None)."""

    @abstractmethod
    def free_bytes(self) -> int:
        """Bytes held by no request and no model."""

    @abstractmethod
    def free_bytes_for(self, model: str) -> int:
        """Bytes ``model`` could fill with new token-blocks now."""

    @abstractmethod
    def unusable_bytes(self) -> int:
        """Capacity no block can ever use (remainders of cutting into blocks)."""

    def _reclaimable_bytes(self) -> int:
        """Bytes that could take a new token-block of some model."""
        return self.free_bytes()

    @abstractmethod
    def _entries_per_block(self, model: str) -> int: ...

    @abstractmethod
    def _fits(self, model: str, add: int) -> bool:
        """Whether ``add`` more token-blocks of ``model`` fit now."""

    @abstractmethod
    def _alloc(self, rid: int, model: str, add: int) -> None:
        """Take ``add`` token-blocks for ``rid`` (already checked by ``_fits``)."""

    @abstractmethod
    def _add_bytes(self, model: str, add: int) -> int:
        """Bytes ``add`` more token-blocks of ``model`` would add to its use."""

    @abstractmethod
    def _release(self, rid: int, model: str, blocks: int) -> int:
        """Give back the last ``blocks`` token-blocks of ``rid`` (all of them
        from :meth:`free`); return the drop in used bytes."""

    @abstractmethod
    def _check_layout(self) -> None: ...


class HeadwiseLayout(KVLayout):
    """MuxServe head-wise blocks: units of one KV head x one layer x one token-block.

    ``unit_bytes = 2 * block_size * max(head_dim * dtype_bytes)`` over the
    group's models; a token-block of ``m`` takes ``kv_layers * num_kv_heads``
    units and as many block-table entries. Free units serve any model.
    """

    name: ClassVar[str] = "headwise"

    def __init__(
        self, capacity_bytes: int, models: Mapping[str, ModelSpec], block_size: int = 16
    ) -> None:
        super().__init__(capacity_bytes, models, block_size)
        widest = max(s.head_dim * s.dtype_bytes for s in self._models.values())
        self._unit_bytes = 2 * block_size * widest
        self._num_units = capacity_bytes // self._unit_bytes
        self._upt = {m: s.kv_layers * s.num_kv_heads for m, s in self._models.items()}
        self._used_units = 0
        self._validate_fit()

    @property
    def unit_bytes(self) -> int:
        """Bytes of one unit (one KV head of one layer for one token-block)."""
        return self._unit_bytes

    @property
    def num_units(self) -> int:
        """Units in the pool."""
        return self._num_units

    @property
    def used_units(self) -> int:
        """Units assigned to requests."""
        return self._used_units

    def units_per_token_block(self, model: str) -> int:
        """Units (and block-table entries) one token-block of ``model`` takes."""
        self._check_model(model)
        return self._upt[model]

    def units_needed(self, model: str, tokens: int) -> int:
        """Units a lone request of ``tokens`` tokens needs."""
        self._check_model(model)
        return _ceil_div(tokens, self._block_size) * self._upt[model]

    def max_tokens(self, model: str) -> int:
        """Tokens one request could hold if it had every unit."""
        self._check_model(model)
        return self._num_units // self._upt[model] * self._block_size

    def bytes_per_token_block(self, model: str) -> int:
        """Units of a token-block times unit bytes (head_dim padding included)."""
        self._check_model(model)
        return self._upt[model] * self._unit_bytes

    def used_bytes(self, model: str | None = None) -> int:
        """Bytes of the units held by ``model``'s requests (all when None)."""
        if model is None:
            return self._used_units * self._unit_bytes
        self._check_model(model)
        return self._mblocks[model] * self._upt[model] * self._unit_bytes

    def free_bytes(self) -> int:
        """Bytes of free units."""
        return (self._num_units - self._used_units) * self._unit_bytes

    def free_bytes_for(self, model: str) -> int:
        """Bytes of free units: every model can use every free unit."""
        self._check_model(model)
        return self.free_bytes()

    def unusable_bytes(self) -> int:
        """Remainder of the pool after cutting whole units."""
        return self._capacity - self._num_units * self._unit_bytes

    def _fit_detail(self, model: str) -> str:
        return f" = {self._upt[model]} units of {self._unit_bytes} bytes"

    def _entries_per_block(self, model: str) -> int:
        return self._upt[model]

    def _fits(self, model: str, add: int) -> bool:
        return add * self._upt[model] <= self._num_units - self._used_units

    def _free_token_blocks(self, model: str) -> int:
        return (self._num_units - self._used_units) // self._upt[model]

    def _alloc(self, rid: int, model: str, add: int) -> None:
        self._used_units += add * self._upt[model]

    def _add_bytes(self, model: str, add: int) -> int:
        return add * self._upt[model] * self._unit_bytes

    def _release(self, rid: int, model: str, blocks: int) -> int:
        units = blocks * self._upt[model]
        self._used_units -= units
        return units * self._unit_bytes

    def _check_layout(self) -> None:
        expect = sum(b * self._upt[m] for m, b in self._mblocks.items())
        _require(self._used_units == expect, f"used units {self._used_units} != {expect}")
        _require(0 <= self._used_units <= self._num_units, "used units outside [0, num_units]")


class MergedLayout(KVLayout):
    """SeaLLM merged blocks: physical blocks sized for the largest token-block.

    Physical block size ``P = max_m tb_m``; model ``m`` packs ``k_m = P // tb_m``
    logical token-blocks into each physical block it owns; a logical block is
    addressed by ``(physical id, second index)`` (see the module docstring).
    """

    name: ClassVar[str] = "merged"
    counts_only: ClassVar[bool] = False

    def __init__(
        self, capacity_bytes: int, models: Mapping[str, ModelSpec], block_size: int = 16
    ) -> None:
        super().__init__(capacity_bytes, models, block_size)
        self._pbytes = max(self._tb.values())
        self._num_phys = capacity_bytes // self._pbytes
        self._k = {m: self._pbytes // tb for m, tb in self._tb.items()}
        self._recycled: list[int] = []  # returned physical ids (stack)
        self._next_fresh = 0  # ids >= this were never handed out
        self._owner: dict[int, str] = {}
        # owned pid -> its free second indices; only blocks of models with
        # k_m > 1 (a block of k_m = 1 is full from its first use on)
        self._slot_free: dict[int, list[int]] = {}
        # per model: owned pids with a free slot, oldest first (dict as ordered set)
        self._partial: dict[str, dict[int, None]] = {m: {} for m in self._models}
        self._free_slots: dict[str, int] = dict.fromkeys(self._models, 0)
        self._owned: dict[str, int] = dict.fromkeys(self._models, 0)
        self._table: dict[int, list[tuple[int, int]]] = {}
        self._validate_fit()

    @property
    def physical_block_bytes(self) -> int:
        """``P``: bytes of one physical block (the largest token-block)."""
        return self._pbytes

    @property
    def num_physical_blocks(self) -> int:
        """Physical blocks in the pool."""
        return self._num_phys

    def free_physical_blocks(self) -> int:
        """Physical blocks owned by no model."""
        return len(self._recycled) + self._num_phys - self._next_fresh

    def slots_per_block(self, model: str) -> int:
        """``k_m``: logical token-blocks of ``model`` per physical block."""
        self._check_model(model)
        return self._k[model]

    def slack_bytes(self, model: str) -> int:
        """``P - k_m * tb_m``: bytes of a physical block ``model`` can never use."""
        self._check_model(model)
        return self._pbytes - self._k[model] * self._tb[model]

    def physical_blocks(self, model: str) -> int:
        """Physical blocks ``model`` owns."""
        self._check_model(model)
        return self._owned[model]

    def free_slots(self, model: str) -> int:
        """Free slots in ``model``'s partly used physical blocks."""
        self._check_model(model)
        return self._free_slots[model]

    def slots_of(self, rid: int) -> tuple[tuple[int, int], ...]:
        """Block table of ``rid``: ``(physical id, second index)`` per token-block, in order.

        Raises:
            KeyError: ``rid`` is not held.
        """
        if rid not in self._rmodel:
            raise KeyError(f"request {rid} holds no KV in this merged layout")
        return tuple(self._table.get(rid, ()))

    def units_needed(self, model: str, tokens: int) -> int:
        """Physical blocks a lone request of ``tokens`` tokens needs."""
        self._check_model(model)
        return _ceil_div(_ceil_div(tokens, self._block_size), self._k[model])

    def max_tokens(self, model: str) -> int:
        """Tokens one request could hold if it had every physical block."""
        self._check_model(model)
        return self._num_phys * self._k[model] * self._block_size

    def bytes_per_token_block(self, model: str) -> int:
        """Bytes of one slot, ``tb_m`` (merged-block slack not included)."""
        self._check_model(model)
        return self._tb[model]

    def used_bytes(self, model: str | None = None) -> int:
        """Bytes of the physical blocks owned by ``model`` (all when None), free slots included."""
        if model is None:
            return (self._num_phys - self.free_physical_blocks()) * self._pbytes
        self._check_model(model)
        return self._owned[model] * self._pbytes

    def free_bytes(self) -> int:
        """Bytes of the physical blocks owned by no model."""
        return self.free_physical_blocks() * self._pbytes

    def free_bytes_for(self, model: str) -> int:
        """Free physical blocks plus the free slots of ``model``'s own blocks."""
        self._check_model(model)
        return self.free_bytes() + self._free_slots[model] * self._tb[model]

    def unusable_bytes(self) -> int:
        """Remainder of the pool after cutting whole physical blocks."""
        return self._capacity - self._num_phys * self._pbytes

    def _reclaimable_bytes(self) -> int:
        return self.free_bytes() + sum(n * self._tb[m] for m, n in self._free_slots.items())

    def stats(self) -> LayoutStats:
        """As :meth:`KVLayout.stats` (the same integers), computed in one pass
        (the simulator samples every group every second)."""
        free = (len(self._recycled) + self._num_phys - self._next_fresh) * self._pbytes
        used = self._num_phys * self._pbytes - free
        valid = sum(t * self._kvb[m] for m, t in self._mtokens.items())
        slots = [n * self._tb[m] for m, n in self._free_slots.items()]
        return LayoutStats(
            layout=self.name,
            capacity_bytes=self._capacity,
            used_bytes=used,
            valid_bytes=valid,
            free_bytes=free,
            unusable_bytes=self._capacity - self._num_phys * self._pbytes,
            requests=len(self._rmodel),
            table_entries=sum(self._mblocks.values()),
            internal_frag=(used - valid) / used if used else 0.0,
            # reclaimable (free + every model's free slots) - the least free_bytes_for
            stranded_bytes=(free + sum(slots)) - (free + min(slots)),
        )

    def stats_as_of(
        self, tokens: Mapping[int, int], bulk: Mapping[str, tuple[int, int]] | None = None
    ) -> LayoutStats:
        """:meth:`KVLayout.stats_as_of` without shrinking (a shrink and a grow
        back could land in other slots: a grow takes the oldest partly used
        block first): the slots each request would give back are its table's
        tail, and a physical block returns to the pool when they are all its
        used slots."""
        if bulk:
            raise NotImplementedError("the merged layout holds no bound batch")
        st = self.stats()
        bs = self._block_size
        rel: Counter[int] = Counter()  # slots given back, per physical block
        valid = entries = 0
        for rid, t in tokens.items():
            m = self._rmodel[rid]
            held = self._rtokens[rid]
            if t >= held:
                continue
            valid += (held - t) * self._kvb[m]
            drop = self._rblocks[rid] - _ceil_div(t, bs)
            if drop > 0:
                entries += drop
                rel.update(pid for pid, _ in self._table[rid][-drop:])
        back: Counter[str] = Counter()  # whole blocks returned, per model
        slots = dict(self._free_slots)
        for pid, n in rel.items():
            m = self._owner[pid]
            k = self._k[m]
            slots[m] += n
            if len(self._slot_free.get(pid, ())) + n == k:
                back[m] += 1
                slots[m] -= k
        freed = sum(back.values()) * self._pbytes
        used = st.used_bytes - freed
        valid_b = st.valid_bytes - valid
        per = [n * self._tb[m] for m, n in slots.items()]
        return dataclasses.replace(
            st,
            used_bytes=used,
            valid_bytes=valid_b,
            free_bytes=st.free_bytes + freed,
            table_entries=st.table_entries - entries,
            internal_frag=(used - valid_b) / used if used else 0.0,
            stranded_bytes=sum(per) - min(per),
        )

    def _fit_detail(self, model: str) -> str:
        return f"; physical blocks are {self._pbytes} bytes"

    def _entries_per_block(self, model: str) -> int:
        return 1

    def _fits(self, model: str, add: int) -> bool:
        return add <= self._free_slots[model] + self.free_physical_blocks() * self._k[model]

    def _add_bytes(self, model: str, add: int) -> int:
        # new physical blocks only: free slots of the model's partly used blocks
        # are already counted in its use
        new_blocks = _ceil_div(max(0, add - self._free_slots[model]), self._k[model])
        return new_blocks * self._pbytes

    def _alloc(self, rid: int, model: str, add: int) -> None:
        table = self._table.get(rid)
        if table is None:
            table = self._table[rid] = []
        k = self._k[model]
        slot_free = self._slot_free
        owner = self._owner
        if k == 1:
            # one slot per physical block: every new token-block takes a whole
            # block (recycled ones first, last returned first), which is full
            # at once, so the model never has a partly used block
            recycled = self._recycled
            n = min(add, len(recycled))
            pids: list[int] = []
            if n:
                pids = recycled[-n:]
                pids.reverse()
                del recycled[-n:]
            if add > n:
                fresh = self._next_fresh
                pids.extend(range(fresh, fresh + add - n))
                self._next_fresh = fresh + add - n
            owner.update(dict.fromkeys(pids, model))
            table.extend(zip(pids, repeat(0)))
            self._owned[model] += add
            return
        partial = self._partial[model]
        left = add
        while left:
            if partial:
                pid = next(iter(partial))  # the oldest partly used block
                free = slot_free[pid]
            else:
                if self._recycled:
                    pid = self._recycled.pop()
                else:
                    pid = self._next_fresh
                    self._next_fresh += 1
                owner[pid] = model
                free = slot_free[pid] = list(range(k - 1, -1, -1))
                self._owned[model] += 1
                self._free_slots[model] += k
                partial[pid] = None
            # its free slots, last first (as popping them one by one does)
            take = min(left, len(free))
            table.extend([(pid, free.pop()) for _ in range(take)])
            left -= take
            if not free:
                del partial[pid]
        self._free_slots[model] -= add

    def _release(self, rid: int, model: str, blocks: int) -> int:
        table = self._table.get(rid, [])
        cut = len(table) - blocks
        tail = table[cut:]
        del table[cut:]
        if not table:
            self._table.pop(rid, None)
        k = self._k[model]
        slot_free = self._slot_free
        owner = self._owner
        if k == 1:  # every slot is a whole block: each goes back to the pool
            pids = list(map(itemgetter(0), tail))
            deque(map(owner.__delitem__, pids), maxlen=0)
            self._recycled.extend(pids)
            self._owned[model] -= len(tail)
            return len(tail) * self._pbytes
        partial = self._partial[model]
        returned = 0
        for pid, slot in tail:
            free = slot_free[pid]
            free.append(slot)
            n = len(free)
            if n == k:
                del slot_free[pid]
                del owner[pid]
                partial.pop(pid, None)
                self._recycled.append(pid)
                returned += 1
            elif n == 1:
                partial[pid] = None
        self._owned[model] -= returned
        self._free_slots[model] += len(tail) - returned * k
        return returned * self._pbytes

    def _check_layout(self) -> None:
        recycled = set(self._recycled)
        _require(len(recycled) == len(self._recycled), "a physical block is recycled twice")
        _require(not recycled & self._owner.keys(), "a physical block is both free and owned")
        _require(
            all(0 <= p < self._next_fresh for p in (*recycled, *self._owner)),
            "a physical id outside the handed-out range",
        )
        _require(0 <= self._next_fresh <= self._num_phys, "next fresh id outside the pool")
        _require(
            len(recycled) + len(self._owner) == self._next_fresh,
            "a handed-out physical block is neither free nor owned",
        )
        _require(
            self._slot_free.keys() == {p for p, m in self._owner.items() if self._k[m] > 1},
            "owner and slot maps disagree",
        )
        _require(Counter(self._owner.values()) == +Counter(self._owned), "owned-count mismatch")
        used: dict[int, set[int]] = {p: set() for p in self._owner}
        _require(self._table.keys() <= self._rmodel.keys(), "block table of an unknown request")
        for rid, m in self._rmodel.items():
            table = self._table.get(rid, [])
            _require(len(table) == self._rblocks[rid], f"request {rid}: table length mismatch")
            for pid, slot in table:
                _require(self._owner.get(pid) == m, f"request {rid}: block {pid} not owned by {m}")
                _require(0 <= slot < self._k[m], f"request {rid}: second index {slot} out of range")
                _require(slot not in used[pid], f"slot ({pid}, {slot}) used twice")
                used[pid].add(slot)
        free_slots: Counter[str] = Counter()
        for pid, m in self._owner.items():
            free = self._slot_free.get(pid, [])
            k = self._k[m]
            _require(len(set(free)) == len(free), f"block {pid}: duplicate free slot")
            _require(
                used[pid] | set(free) == set(range(k)) and not used[pid] & set(free),
                f"block {pid}: used and free slots do not partition [0, {k})",
            )
            _require(len(free) < k, f"block {pid}: all slots free but not returned to the pool")
            _require((pid in self._partial[m]) == bool(free), f"block {pid}: partial-set mismatch")
            free_slots[m] += len(free)
        for m in self._models:
            _require(self._partial[m].keys() <= self._owner.keys(), f"{m}: partial block not owned")
            _require(free_slots[m] == self._free_slots[m], f"{m}: free-slot count mismatch")


class PartitionedLayout(KVLayout):
    """Static per-model partitions with vLLM blocks of each model's own size.

    Args:
        capacity_bytes: the group's KV memory in bytes.
        models: service name -> model shape.
        block_size: tokens per token-block.
        shares: service -> fraction of ``capacity_bytes`` (each > 0, sum <= 1,
            every service named). Default: proportional to each service's KV
            bytes per token, i.e. equal token capacity for every service.

    Raises:
        ConfigError: as :class:`KVLayout`, or bad shares.
    """

    name: ClassVar[str] = "partitioned"
    _tracks_alloc: ClassVar[bool] = False

    def __init__(
        self,
        capacity_bytes: int,
        models: Mapping[str, ModelSpec],
        block_size: int = 16,
        shares: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(capacity_bytes, models, block_size)
        if shares is None:
            total = sum(self._kvb.values())
            self._shares = {m: b / total for m, b in self._kvb.items()}
            self._part_bytes = {m: capacity_bytes * b // total for m, b in self._kvb.items()}
        else:
            self._shares = self._validate_shares(shares)
            self._part_bytes = {m: int(capacity_bytes * s) for m, s in self._shares.items()}
            excess = sum(self._part_bytes.values()) - capacity_bytes
            if excess > 0:  # float rounding of shares summing to 1
                big = max(self._part_bytes, key=lambda m: self._part_bytes[m])
                self._part_bytes[big] -= excess
        self._part_blocks = {m: self._part_bytes[m] // self._tb[m] for m in self._models}
        self._validate_fit()

    def _validate_shares(self, shares: Mapping[str, float]) -> dict[str, float]:
        if not isinstance(shares, Mapping):
            raise ConfigError("partitioned KV layout: shares must map service name -> fraction")
        unknown = sorted(str(k) for k in shares if k not in self._models)
        if unknown:
            raise ConfigError(
                f"partitioned KV layout: shares name unknown service(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(self._models))}"
            )
        missing = sorted(m for m in self._models if m not in shares)
        if missing:
            raise ConfigError(f"partitioned KV layout: shares miss service(s) {', '.join(missing)}")
        out: dict[str, float] = {}
        for m in self._models:
            s = shares[m]
            if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s):
                raise ConfigError(f"partitioned KV layout: share of {m!r} must be a number")
            if not 0 < s <= 1:
                raise ConfigError(
                    f"partitioned KV layout: share of {m!r} must be in (0, 1], got {s}"
                )
            out[m] = float(s)
        total = math.fsum(out.values())
        if total > 1 + _SHARE_TOLERANCE:
            raise ConfigError(f"partitioned KV layout: shares sum to {total:.6g}, must be <= 1")
        return out

    @property
    def shares(self) -> Mapping[str, float]:
        """Service -> fraction of the pool (read-only view)."""
        return MappingProxyType(self._shares)

    def partition_bytes(self, model: str) -> int:
        """Bytes of ``model``'s partition."""
        self._check_model(model)
        return self._part_bytes[model]

    def partition_blocks(self, model: str) -> int:
        """Whole token-blocks in ``model``'s partition."""
        self._check_model(model)
        return self._part_blocks[model]

    def units_needed(self, model: str, tokens: int) -> int:
        """Blocks (of ``model``'s own size) a lone request of ``tokens`` tokens needs."""
        self._check_model(model)
        return _ceil_div(tokens, self._block_size)

    def max_tokens(self, model: str) -> int:
        """Tokens one request could hold if it had its whole partition."""
        self._check_model(model)
        return self._part_blocks[model] * self._block_size

    def bytes_per_token_block(self, model: str) -> int:
        """``tb_m``: the model's own token-block bytes."""
        self._check_model(model)
        return self._tb[model]

    def used_bytes(self, model: str | None = None) -> int:
        """Bytes of the blocks held by ``model``'s requests (all when None)."""
        if model is None:
            return sum(b * self._tb[m] for m, b in self._mblocks.items())
        self._check_model(model)
        return self._mblocks[model] * self._tb[model]

    def free_bytes(self) -> int:
        """Free blocks of all partitions (each usable by its own model only)."""
        return sum((self._part_blocks[m] - b) * self._tb[m] for m, b in self._mblocks.items())

    def free_bytes_for(self, model: str) -> int:
        """Free blocks of ``model``'s partition."""
        self._check_model(model)
        return (self._part_blocks[model] - self._mblocks[model]) * self._tb[model]

    def unusable_bytes(self) -> int:
        """Partition remainders and the part of the pool no share covers."""
        return self._capacity - sum(self._part_blocks[m] * self._tb[m] for m in self._models)

    def _fit_detail(self, model: str) -> str:
        return f"; its partition is {self._part_bytes[model]} bytes"

    def _entries_per_block(self, model: str) -> int:
        return 1

    def _fits(self, model: str, add: int) -> bool:
        return self._mblocks[model] + add <= self._part_blocks[model]

    def _free_token_blocks(self, model: str) -> int:
        return self._part_blocks[model] - self._mblocks[model]

    def free_token_blocks(self, model: str) -> int:
        # the base's, in one call (a one-model group asks at every job)
        part = self._part_blocks.get(model)
        if part is None:
            self._check_model(model)  # raises, with the known services
        return part - self._mblocks[model]  # type: ignore[operator]

    def _alloc(self, rid: int, model: str, add: int) -> None:
        return None  # blocks of a partition are interchangeable: the count is the state

    def _add_bytes(self, model: str, add: int) -> int:
        return add * self._tb[model]

    def _release(self, rid: int, model: str, blocks: int) -> int:
        return blocks * self._tb[model]

    def _check_layout(self) -> None:
        _require(sum(self._part_bytes.values()) <= self._capacity, "partitions exceed the capacity")
        for m, b in self._mblocks.items():
            _require(0 <= b <= self._part_blocks[m], f"{m}: blocks outside its partition")
            _require(
                self._part_blocks[m] * self._tb[m] <= self._part_bytes[m],
                f"{m}: partition blocks exceed partition bytes",
            )


LAYOUTS: dict[str, type[KVLayout]] = {
    HeadwiseLayout.name: HeadwiseLayout,
    MergedLayout.name: MergedLayout,
    PartitionedLayout.name: PartitionedLayout,
}


def make_layout(
    name: str,
    capacity_bytes: int,
    models: Mapping[str, ModelSpec],
    block_size: int = 16,
    shares: Mapping[str, float] | None = None,
) -> KVLayout:
    """Build a layout by name.

    Args:
        name: ``headwise``, ``merged`` or ``partitioned`` (case-insensitive).
        capacity_bytes: the group's KV memory in bytes.
        models: service name -> model shape.
        block_size: tokens per token-block.
        shares: partition fractions; only for ``partitioned``.

    Raises:
        UnknownNameError: unknown layout name.
        ConfigError: ``shares`` given to a shared layout, or as the constructors.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in LAYOUTS:
        raise UnknownNameError("KV layout", str(name), LAYOUTS)
    if key == PartitionedLayout.name:
        return PartitionedLayout(capacity_bytes, models, block_size, shares)
    if shares is not None:
        raise ConfigError(f"KV layout {key!r}: shares apply only to the partitioned layout")
    return LAYOUTS[key](capacity_bytes, models, block_size)
