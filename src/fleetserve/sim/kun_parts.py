"""Building blocks of the KunServe simulator (:mod:`fleetserve.sim.kun`).

* :class:`KunSettings` / :data:`KUN_STACKS`: what a stack does under memory
  pressure, and the KunServe knobs (exchange mode, live restore, strategy,
  trigger horizon, ...); :meth:`KunSettings.policy` builds the pure
  :class:`~fleetserve.policy.kunserve.KunServePolicy` that makes KunServe's
  drop/restore decisions from them.
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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fleetserve.costmodel.transfer import Link
from fleetserve.errors import ConfigError, UnknownNameError
from fleetserve.policy.kunserve import KunServePolicy

if TYPE_CHECKING:
    from fleetserve.metrics.records import RequestRecord
    from fleetserve.sim.kun import Executor
    from fleetserve.spec import ModelSpec
    from fleetserve.workload.request import Request

PRESSURES = ("queue", "kv-drop", "kv-swap", "llumnix", "kunserve")


@dataclass(frozen=True, slots=True)
class KunSettings:
    """How a replicated deployment reacts to memory throttling.

    Attributes:
        pressure: ``queue`` (vLLM: new requests wait until memory frees),
            ``kv-drop`` (drop running requests' KV, newest first, to admit the
            head of the queue; they are recomputed later), ``kv-swap`` (swap
            running requests' KV to host memory one at a time over PCIe, as
            vLLM's default swap space does), ``llumnix`` (live KV migration
            from loaded to spare instances) or ``kunserve`` (drop replicated
            layers into buddy groups).
        static_stages: group size formed at start and never changed (the
            static pipeline baseline, ``Llumnix (pipeline)``); 1 = replicas.
        exchange: ``live`` (victims keep decoding with remote attention while
            their KV crosses) or ``blocking`` (they stall until it has).
        live_restore: move pipelined requests back to full instances with
            live KV migration when parameters are restored; without it a
            restored group keeps pipelining until its requests finish.
        strategy: buddy-group planner, ``throughput`` (Algorithm 1) or ``memory``.
        horizon_s: the trigger's look-ahead (the paper: one second).
        window_s: samples the monitor fits the growth rates to.
        monitor_interval_s: how often the monitor samples and decides.
        restore_threshold: restore a group when its KV demand is at most this
            share of the KV capacity its members have as full replicas.
        restore_min_s: a group restores once its demand has stayed below the
            threshold this long (hysteresis: a drop answers a predicted
            shortage, so the demand right after it may still be low, and a
            dip in a burst should not undo it).
        restore_from: ``host`` (PCIe from the host copy) or ``peer`` (network).
        max_batch_slowdown: the dispatcher's maximum batch per instance is the
            largest batch whose decode iteration is at most this many times
            the batch-1 iteration (from the cost model).
        swap_max_out: ``kv-swap``: requests an instance may have swapped out
            at once (vLLM swaps "a small number of requests, default 1").
    """

    pressure: str = "queue"
    static_stages: int = 1
    exchange: str = "live"
    live_restore: bool = True
    strategy: str = "throughput"
    horizon_s: float = 1.0
    window_s: float = 1.0
    monitor_interval_s: float = 0.1
    restore_threshold: float = 0.5
    restore_min_s: float = 20.0
    restore_from: str = "host"
    max_batch_slowdown: float = 2.0
    swap_max_out: int = 1

    def __post_init__(self) -> None:
        if self.pressure not in PRESSURES:
            raise ConfigError(
                f"kunserve.pressure must be one of {PRESSURES}, got {self.pressure!r}"
            )
        if self.exchange not in ("live", "blocking"):
            raise ConfigError(f"kunserve.exchange must be live or blocking, got {self.exchange!r}")
        if self.strategy not in ("throughput", "memory"):
            raise ConfigError(
                f"kunserve.strategy must be throughput or memory, got {self.strategy!r}"
            )
        if self.restore_from not in ("host", "peer"):
            raise ConfigError(
                f"kunserve.restore_from must be host or peer, got {self.restore_from!r}"
            )
        if isinstance(self.static_stages, bool) or self.static_stages < 1:
            raise ConfigError(f"kunserve.static_stages must be >= 1, got {self.static_stages!r}")
        for name in ("horizon_s", "window_s", "monitor_interval_s", "max_batch_slowdown"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and v > 0):
                raise ConfigError(f"kunserve.{name} must be a number > 0, got {v!r}")
        if isinstance(self.swap_max_out, bool) or self.swap_max_out < 1:
            raise ConfigError(f"kunserve.swap_max_out must be >= 1, got {self.swap_max_out!r}")
        if self.max_batch_slowdown < 1:
            raise ConfigError("kunserve.max_batch_slowdown must be >= 1")
        if not 0 < self.restore_threshold <= 1:
            raise ConfigError(
                f"kunserve.restore_threshold must be in (0, 1], got {self.restore_threshold!r}"
            )
        v = self.restore_min_s
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise ConfigError(f"kunserve.restore_min_s must be a number >= 0, got {v!r}")

    def with_overrides(self, **kw: Any) -> KunSettings:
        """A copy with some fields replaced (validated)."""
        return replace(self, **kw)

    def policy(self, model: ModelSpec) -> KunServePolicy:
        """KunServe's decision policy for replicas of ``model`` under these settings.

        The policy's knobs are ``strategy``, ``horizon_s``, ``window_s``,
        ``restore_threshold``, ``restore_min_s`` and ``restore_from``; the rest
        (exchange mode, live restore, batch limits, the baselines' pressure)
        is mechanism the simulator applies. ``P`` is every layer's weights
        (the non-layer weights are never dropped).
        """
        return self.policy_for(
            model.name,
            model.num_layers,
            model.num_layers * model.weight_bytes_per_layer,
            model.kv_bytes_per_token,
        )

    def policy_for(
        self, model: str, num_layers: int, param_bytes: int, kv_bytes_per_token: int
    ) -> KunServePolicy:
        """:meth:`policy` for a model given by its sizes (the runtime's engines
        measure theirs: layers rounded to arena pages)."""
        return KunServePolicy(
            model=model,
            num_layers=num_layers,
            param_bytes=param_bytes,
            kv_bytes_per_token=kv_bytes_per_token,
            strategy=self.strategy,
            horizon_s=self.horizon_s,
            window_s=self.window_s,
            restore_threshold=self.restore_threshold,
            restore_min_s=self.restore_min_s,
            restore_from=self.restore_from,
        )


@dataclass(frozen=True, slots=True)
class KunStack:
    """A named memory-pressure system of the KunServe comparison."""

    name: str
    description: str
    settings: KunSettings


KUN_STACKS: dict[str, KunStack] = {
    s.name: s
    for s in (
        KunStack(
            "vllm",
            "replicas; new requests queue until memory frees (Llumnix (replication))",
            KunSettings(pressure="queue"),
        ),
        KunStack(
            "kv-drop",
            "replicas; drop running requests' KV (newest first) to admit queued ones, recompute",
            KunSettings(pressure="kv-drop"),
        ),
        KunStack(
            "kv-swap",
            "replicas; swap running requests' KV to host one at a time over PCIe (vLLM swap)",
            KunSettings(pressure="kv-swap"),
        ),
        KunStack(
            "llumnix",
            "replicas; live KV migration from loaded to spare instances (Llumnix (w/ migration))",
            KunSettings(pressure="llumnix"),
        ),
        KunStack(
            "pipeline",
            "static pipeline groups from the start (Llumnix (pipeline)); stages: static_stages",
            KunSettings(pressure="queue", static_stages=2),
        ),
        KunStack(
            "kunserve",
            "KunServe: drop replicated layers into buddy groups, live KV exchange, live restore",
            KunSettings(pressure="kunserve"),
        ),
        KunStack(
            "kunserve-blocking",
            "KunServe with blocking KV exchange (ablation)",
            KunSettings(pressure="kunserve", exchange="blocking"),
        ),
        KunStack(
            "kunserve-norestore",
            "KunServe without live restore (ablation)",
            KunSettings(pressure="kunserve", live_restore=False),
        ),
        KunStack(
            "kunserve-memgreedy",
            "KunServe with the memory-greedy planner (ablation)",
            KunSettings(pressure="kunserve", strategy="memory"),
        ),
    )
}


KUN_ONLY_STACKS: frozenset[str] = frozenset(n for n in KUN_STACKS if n not in ("vllm", "llumnix"))
"""Stacks only the KunServe simulator has (``vllm`` and ``llumnix`` also name
stacks of the main simulator; they mean the KunServe baselines when
``kunserve.generator`` is set)."""


def get_kun_stack(name: str) -> KunStack:
    """The KunServe-comparison stack called ``name`` (clear error with suggestions)."""
    try:
        return KUN_STACKS[name]
    except KeyError:
        raise UnknownNameError("kunserve stack", name, KUN_STACKS) from None


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
        "dropped",
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
        self.dropped = False  # its KV was dropped once (kv-drop)
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
