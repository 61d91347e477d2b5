"""Building blocks of the KunServe simulator (:mod:`fleetserve.sim.kun`).

What a stack does under memory pressure, and the KunServe knobs, are its
:class:`~fleetserve.policy.pressure.KunSettings` (the stack's ``burst`` in
:data:`~fleetserve.policy.catalog.STACKS`).

* :class:`KSeq`: one request's state.
* :class:`Channel`: one link direction of one instance (its network NIC or its
  PCIe link to host memory) carrying transfers one at a time, FIFO, at a rate
  that live KV exchange may lower while activations use the link.
* :class:`Piece`: part of a request's KV cache that must cross from one
  instance to another (KunServe's KV exchange and live restore).

Memory is accounted in *token-layers* (one token's K and V of one layer,
``kv_bytes_per_token_per_layer`` bytes): KunServe's fine-grained allocator
hands out memory at layer granularity, so parameters freed by dropping layers
join the KV pool exactly, without block rounding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetserve.costmodel.transfer import Link

if TYPE_CHECKING:
    from fleetserve.metrics.records import RequestRecord
    from fleetserve.sim.kun import Executor
    from fleetserve.workload.request import Request


class KSeq:
    """A request's state in the KunServe simulator (implements ``SeqView``).

    While running on an executor its KV holds ``base + executor.steps``
    tokens (all running requests grow by one token per decode iteration);
    otherwise ``tokens`` holds the count (0 while waiting without KV).

    ``state``: ``waiting`` (queued, no KV), ``prefill`` (admitted, its
    (re)prefill in flight), ``running``, ``stalled`` (holds KV on an executor
    but does not decode: a blocking-exchange victim, or a swap-out in flight),
    ``transit`` (its KV is on the way to an executor: swap-in, the last copy
    of a migration), ``host`` (swapped out), ``done``.
    """

    __slots__ = (
        "base",
        "exe",
        "finish_step",
        "gen",
        "id",
        "last_tok_s",
        "max_gap_s",
        "mig",
        "n_gaps",
        "pieces",
        "prompt",
        "record",
        "req",
        "state",
        "sum_gap_s",
        "tokens",
        "track_kind",
        "tracked_since",
    )

    def __init__(self, req: Request, record: RequestRecord) -> None:
        self.id = req.id
        self.req = req
        self.record = record
        self.prompt = req.prompt_tokens
        self.exe: Executor | None = None
        self.state = "new"
        self.base = 0
        self.finish_step = 0
        self.gen = 0  # generated tokens while not running
        self.tokens = 0  # KV tokens held while not running
        self.pieces: list[Piece] = []  # KV pieces still to cross (exchange / restore)
        self.mig: Any = None  # a Llumnix migration in flight
        self.last_tok_s = 0.0
        self.max_gap_s = 0.0
        self.sum_gap_s = 0.0
        self.n_gaps = 0
        self.tracked_since: float | None = None  # victim: when its exchange began
        self.track_kind = ""  # "exchange" or "restore"

    # --- SeqView ----------------------------------------------------------
    @property
    def model(self) -> str:
        return self.req.model

    @property
    def arrival_s(self) -> float:
        return self.req.arrival_s

    @property
    def prompt_tokens(self) -> int:
        return self.prompt

    @property
    def output_tokens(self) -> int:
        return self.req.output_tokens

    @property
    def kv_tokens(self) -> int:
        """KV tokens held now."""
        if self.state == "running":
            exe = self.exe
            assert exe is not None
            return self.base + exe.steps
        return self.tokens

    @property
    def generated(self) -> int:
        """Output tokens generated so far."""
        if self.state == "running":
            return self.kv_tokens - self.prompt + 1
        return self.gen

    @property
    def demand_tokens(self) -> int:
        return max(self.kv_tokens, self.prompt + self.generated)

    @property
    def migrating(self) -> bool:
        return self.mig is not None

    def need_tokens(self) -> int:
        """KV tokens a (re)prefill of it allocates."""
        return self.prompt + self.gen


@dataclass(slots=True, eq=False)
class Piece:
    """``layers`` layers of request ``seq``'s first ``tokens`` KV tokens, to
    move from instance ``src`` to instance ``dst``. Until it has arrived the
    request's attention for those layers runs on ``src`` (live) or the request
    stalls (blocking)."""

    seq: KSeq
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


class WaitQueue(deque["KSeq"]):
    """An executor's queue, and the KV tokens its requests need together
    (:attr:`tokens`, what every monitor interval reads), kept as requests
    come and go instead of summed again each time. A queued request's need
    (``prompt + generated``) does not change while it waits; the simulator's
    integrity check compares the total with the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0

    def append(self, s: KSeq) -> None:
        super().append(s)
        self.tokens += s.need_tokens()

    def appendleft(self, s: KSeq) -> None:
        super().appendleft(s)
        self.tokens += s.need_tokens()

    def extend(self, items: Iterable[KSeq]) -> None:
        for s in items:
            self.append(s)

    def extendleft(self, items: Iterable[KSeq]) -> None:
        for s in items:
            self.appendleft(s)

    def pop(self, i: int = -1, /) -> KSeq:
        if i != -1:
            raise TypeError("WaitQueue: pop takes the last request only")
        s = super().pop()
        self.tokens -= s.need_tokens()
        return s

    def popleft(self) -> KSeq:
        s = super().popleft()
        self.tokens -= s.need_tokens()
        return s

    def remove(self, s: KSeq) -> None:
        super().remove(s)
        self.tokens -= s.need_tokens()

    def clear(self) -> None:
        super().clear()
        self.tokens = 0

    def __delitem__(self, i: object) -> None:
        raise TypeError("WaitQueue: remove requests with popleft, pop or remove")

    def __setitem__(self, i: object, s: object) -> None:
        raise TypeError("WaitQueue: requests are not replaced in place")

    def insert(self, i: int, s: KSeq) -> None:
        raise TypeError("WaitQueue: requests join at either end")
