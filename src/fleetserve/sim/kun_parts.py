"""Building blocks of the KunServe simulator (:mod:`fleetserve.sim.kun`).

What a stack does under memory pressure, and the KunServe knobs, are its
:class:`~fleetserve.policy.pressure.KunSettings` (the stack's ``burst`` in
:data:`~fleetserve.policy.catalog.STACKS`).

* :class:`Channel`: one link direction of one instance (its network NIC or its
  PCIe link to host memory) carrying transfers one at a time, FIFO, at a rate
  that live KV exchange may lower while activations use the link.
* :class:`Piece`: part of a request's KV cache that must cross from one
  instance to another (KunServe's KV exchange and live restore).
* :func:`remote_attention_s` and :func:`activation_gap_share`: what a live
  exchange costs a decode round and leaves its copies, in the KunServe world
  and in the multi-LLM world's drops (:mod:`fleetserve.sim.multi_burst`).

Memory is accounted in *token-layers* (one token's K and V of one layer,
``kv_bytes_per_token_per_layer`` bytes): KunServe's fine-grained allocator
hands out memory at layer granularity, so parameters freed by dropping layers
join the KV pool exactly, without block rounding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleetserve.costmodel.transfer import Link, transfer_time

if TYPE_CHECKING:
    from fleetserve.sim.seq import Seq
    from fleetserve.spec.types import ModelSpec


def remote_attention_s(spec: ModelSpec, victims: int, layers: int, link: Link) -> float:
    """One decode round's remote attention from one source instance: for each
    of ``layers`` layers whose KV is still there, the queries and new K/V of
    its ``victims`` go out over ``link`` and the attention outputs come back
    (sequential across layers, on the round's critical path)."""
    q_b = spec.num_heads * spec.head_dim * spec.dtype_bytes
    kv_b = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes
    return layers * (
        transfer_time(victims * (q_b + kv_b), link) + transfer_time(victims * q_b, link)
    )


def activation_gap_share(round_s: float, hop_s: float, extra_s: float) -> float:
    """The share of a link a live KV copy gets during a decode round of
    ``round_s`` seconds: what the activation transfers (``hop_s``) and the
    remote attention (``extra_s``) leave, at least 5%."""
    return 1.0 - min(0.95, (hop_s + extra_s) / round_s)


@dataclass(slots=True, eq=False)
class Piece:
    """``layers`` layers of request ``seq``'s first ``tokens`` KV tokens, to
    move from instance ``src`` to instance ``dst``. Until it has arrived the
    request's attention for those layers runs on ``src`` (live) or the request
    stalls (blocking)."""

    seq: Seq
    src: int
    dst: int
    layers: int
    tokens: int
    live: bool
    started: bool = False
    cancelled: bool = False
    transfer: Transfer | None = None

    @property
    def token_layers(self) -> int:
        return self.layers * self.tokens


@dataclass(slots=True, eq=False)
class Transfer:
    """One transfer on a :class:`Channel`.

    ``ready()`` may hold it at the head of the queue (e.g. until the
    destination has room); ``on_start``/``on_done`` apply its effects.
    ``live`` transfers yield the link to activations (see :meth:`Channel.set_share`).
    """

    kind: str
    nbytes: float
    on_done: Callable[[float], None]
    ready: Callable[[], bool] = field(default=lambda: True)
    on_start: Callable[[float], None] = field(default=lambda now: None)
    live: bool = False
    cancelled: bool = False


class Channel:
    """One direction of one instance's link: FIFO transfers, one at a time.

    The transfer in flight moves at ``bandwidth x share``; ``share`` < 1 while
    a live exchange yields the link to activations. Changing the share
    re-times the transfer in flight (``version`` invalidates its old end event).
    """

    __slots__ = ("cur", "link", "name", "queue", "rate", "remaining", "share", "t_last", "version")

    def __init__(self, name: str, link: Link) -> None:
        self.name = name
        self.link = link
        self.queue: deque[Transfer] = deque()
        self.cur: Transfer | None = None
        self.remaining = 0.0  # bytes (latency folded in as bytes at the start)
        self.rate = link.bandwidth_Bps
        self.share = 1.0
        self.t_last = 0.0
        self.version = 0

    @property
    def busy(self) -> bool:
        return self.cur is not None or bool(self.queue)

    def _rate_for(self, tr: Transfer) -> float:
        return self.link.bandwidth_Bps * (self.share if tr.live else 1.0)

    def try_start(self, now: float) -> float | None:
        """Start the head transfer if the channel is free and it is ready; its end time."""
        while self.queue and self.queue[0].cancelled:
            self.queue.popleft()
        if self.cur is not None or not self.queue:
            return None
        tr = self.queue[0]
        if not tr.ready():
            return None
        self.queue.popleft()
        tr.on_start(now)
        self.cur = tr
        self.remaining = tr.nbytes + self.link.latency_s * self.link.bandwidth_Bps
        self.rate = self._rate_for(tr)
        self.t_last = now
        self.version += 1
        return now + self.remaining / self.rate

    def set_share(self, share: float, now: float) -> float | None:
        """Change the live share; the new end time of a live transfer in flight, if any."""
        share = min(1.0, max(share, 0.05))
        if share == self.share:
            return None
        self.share = share
        tr = self.cur
        if tr is None or not tr.live:
            return None
        self.remaining = max(0.0, self.remaining - (now - self.t_last) * self.rate)
        self.t_last = now
        self.rate = self._rate_for(tr)
        self.version += 1
        return now + self.remaining / self.rate

    def finish(self) -> Transfer:
        """The transfer in flight has ended; return it and free the channel."""
        tr = self.cur
        assert tr is not None
        self.cur = None
        self.remaining = 0.0
        self.version += 1
        return tr
