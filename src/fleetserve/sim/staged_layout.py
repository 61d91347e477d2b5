"""A count-only KV layout over pipeline stages (the KunServe world's memory).

KunServe serves one model on ``N`` instances (each ``tp`` GPUs). Under a burst
it merges replicas into pipelines whose members keep only their stage's
layers, and the dropped weights join the KV pool. Its memory is therefore
per *instance*, in **token-layers** (the KV of one token in one layer,
``kvpl`` bytes)::

    capacity_tl(m) = (cap_b(m) - weights(m)) // kvpl
    weights(m)     = non-layer weights + layers held x layer bytes (+ a reload in flight)
    used_tl(m)     = layers_m x T + corr(m)

Two objects keep these books:

* :class:`StageMemory` -- every instance's bytes, weights, held layer range,
  and the two corrections below. It is the deployment's, and outlives the
  executors (an instance moves from a replica into a pipeline and back).
* :class:`StagedLayout` -- one executor's KV layout over its members in stage
  order (a replica is the one-stage case). It is a :class:`~fleetserve.sim.
  kvlayout.KVLayout` with one service and one-token blocks, counts only: its
  requests' KV (``T`` tokens) is a bound batch (:meth:`KVLayout.bulk_change`)
  plus blocks held by no running request (:meth:`KVLayout.hold`: prefills,
  stalled or incoming requests, the decode iteration in flight). New KV is
  checked against the room; KV that is already resident and only changes
  hands (a request moved from another executor, a prefill joining the
  batch) is counted without a check (``check=False``), since the
  corrections say where it is. A token
  costs member ``m`` its ``layers_m`` token-layers: a settled request's KV is
  spread over the stages in proportion to their layers.

Corrections (``StageMemory.corr``, ``pend_in``). A piece of a request's KV
that is not where the proportional rule puts it: after a merge, a victim's KV
for layers now owned by another stage is still on its old instance until the
piece is copied (``+layers x tokens`` on the source, ``-`` on the
destination, until the destination reserves it when the copy starts);
``pend_in`` is the room a destination has committed to pieces not yet
reserved, so admissions cannot take it.

The room an executor has for new tokens is::

    room = min_m (capacity_tl(m) - corr(m) - pend_in(m)) // layers_m  -  T

(``(A - n T) // n = A // n - T`` for integers), cached per
:attr:`StageMemory.version`, which every change of weights or corrections
bumps. Nothing is over-committed: every growth is checked against it
(:class:`~fleetserve.sim.kvlayout.PoolFull` otherwise), and
:meth:`StagedLayout.check_integrity` checks ``used_tl(m) <= capacity_tl(m)``
for every member.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from fleetserve.errors import ConfigError
from fleetserve.sim.kvlayout import KVLayout, _require
from fleetserve.spec.types import ModelSpec

__all__ = ["StageMemory", "StagedLayout"]


class StageMemory:
    """The memory books of a KunServe deployment's instances.

    Args:
        instances: instances in the deployment (active or not).
        cap_bytes: memory of one instance for weights and KV (all its GPUs).
        spec: the model served (every instance holds all of its layers at
            the start).

    Attributes:
        cap_b, weights, held, reloading, corr, pend_in: per instance (see
            the module docstring); read them, change them through the methods.
        version: bumped by every change of ``weights``, ``corr`` or ``pend_in``.
    """

    def __init__(self, instances: int, cap_bytes: int, spec: ModelSpec) -> None:
        self.L = spec.num_layers
        self.kvpl = spec.kv_bytes_per_token_per_layer
        self.layer_b = spec.weight_bytes_per_layer
        self.full_w = spec.weight_bytes
        self.base_w = spec.weight_bytes - self.L * self.layer_b
        self.cap_b = [cap_bytes] * instances
        self.weights = [spec.weight_bytes] * instances
        self.held: list[tuple[int, int]] = [(0, self.L)] * instances
        self.reloading = [0] * instances  # bytes of a reload in flight
        self.corr = [0] * instances
        self.pend_in = [0] * instances  # token-layers committed to pieces not reserved yet
        self.version = 0

    def cap_tl(self, m: int) -> int:
        """KV capacity of instance ``m`` in token-layers."""
        return (self.cap_b[m] - self.weights[m]) // self.kvpl

    def keep_layers(self, m: int, lo: int, hi: int) -> int:
        """Instance ``m`` keeps layers ``[lo, hi)`` only (they must be held)
        and drops the rest: the bytes freed (0 when it keeps everything it holds).

        Raises:
            RuntimeError: ``m`` does not hold ``[lo, hi)``.
        """
        old = self.held[m]
        if not old[0] <= lo < hi <= old[1]:
            raise RuntimeError(f"instance {m} holds {old}, cannot serve stage {(lo, hi)}")
        dropped = ((old[1] - old[0]) - (hi - lo)) * self.layer_b
        if dropped > 0:
            self.weights[m] -= dropped
            self.version += 1
            self.held[m] = (lo, hi)
        return max(0, dropped)

    def reload_start(self, m: int, nbytes: int) -> None:
        """A reload of ``nbytes`` of dropped weights onto ``m`` starts (the
        bytes are taken from its KV pool now)."""
        self.weights[m] += nbytes
        self.reloading[m] += nbytes
        self.version += 1

    def reload_done(self, m: int, nbytes: int) -> None:
        """The reload of ``nbytes`` onto ``m`` is in: it holds every layer."""
        self.reloading[m] -= nbytes
        self.held[m] = (0, self.L)

    def correct(self, m: int, token_layers: int) -> None:
        """Instance ``m`` holds ``token_layers`` more (negative: fewer) than the
        proportional rule says (a KV piece away from its stage)."""
        self.corr[m] += token_layers
        self.version += 1

    def commit_in(self, m: int, token_layers: int) -> None:
        """``token_layers`` more (negative: fewer) of ``m``'s room are
        committed to pieces not reserved yet."""
        self.pend_in[m] += token_layers
        self.version += 1

    def check_instance(self, m: int, used_tl: int) -> None:
        """Instance ``m``'s books, with ``used_tl`` token-layers in use."""
        lo, hi = self.held[m]
        _require(
            self.weights[m] == self.base_w + (hi - lo) * self.layer_b + self.reloading[m],
            f"instance {m}: weights {self.weights[m]} do not match layers {(lo, hi)}",
        )
        _require(self.pend_in[m] >= 0, f"instance {m}: negative committed room")
        _require(
            self.weights[m] + used_tl * self.kvpl <= self.cap_b[m],
            f"instance {m} over-committed: weights {self.weights[m]} + KV "
            f"{used_tl * self.kvpl} > {self.cap_b[m]}",
        )


class StagedLayout(KVLayout):
    """One executor's KV layout over its members' memory (module docstring).

    Args:
        memory: the deployment's books.
        layers: member instance -> layers its stage holds, in stage order.
        service: the service's name.
        spec: its model.
    """

    name: ClassVar[str] = "staged"
    _tracks_alloc: ClassVar[bool] = False
    capacity_changes: ClassVar[bool] = True

    def __init__(
        self, memory: StageMemory, layers: Mapping[int, int], service: str, spec: ModelSpec
    ) -> None:
        if not layers or any(n < 1 for n in layers.values()):
            raise ConfigError(f"staged KV layout: every stage needs a layer, got {dict(layers)}")
        self.memory = memory
        self.layers = dict(layers)
        self.service = service
        super().__init__(max(1, self._capacity_now()), {service: spec}, block_size=1)
        self._mem_v = -1  # memory version of the two floors below
        self._room0 = 0
        self._cap0 = 0

    def _capacity_now(self) -> int:
        mem = self.memory
        return sum(mem.cap_b[m] - mem.weights[m] for m in self.layers)

    def _floors(self) -> None:
        """Bring ``_room0`` (room before this layout's own tokens) and
        ``_cap0`` (tokens when full) up to the memory's version."""
        mem = self.memory
        cap_b, weights, corr, pend, kvpl = mem.cap_b, mem.weights, mem.corr, mem.pend_in, mem.kvpl
        room = cap = None
        for m, n in self.layers.items():
            c = (cap_b[m] - weights[m]) // kvpl
            r = (c - corr[m] - pend[m]) // n
            c //= n
            room = r if room is None or r < room else room
            cap = c if cap is None or c < cap else cap
        assert room is not None and cap is not None
        self._room0, self._cap0 = room, cap
        self._mem_v = mem.version

    # --- the executor's counts ----------------------------------------------
    def tokens(self) -> int:
        """KV tokens this executor's requests hold (``T``)."""
        return self._mblocks[self.service]

    def room_tokens(self) -> int:
        """KV tokens every stage can still take (negative when a correction
        or a reload took more than was free)."""
        if self._mem_v != self.memory.version:
            self._floors()
        return self._room0 - self._mblocks[self.service]

    def capacity_tokens(self) -> int:
        """KV tokens the executor holds when full (all settled)."""
        if self._mem_v != self.memory.version:
            self._floors()
        return self._cap0

    def used_tl(self, m: int) -> int:
        """Token-layers member ``m`` holds."""
        return self.layers[m] * self._mblocks[self.service] + self.memory.corr[m]

    # --- KVLayout -------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """The members' memory less their weights (it changes with drops and reloads)."""
        return self._capacity_now()

    def units_needed(self, model: str, tokens: int) -> int:
        return tokens

    def max_tokens(self, model: str) -> int:
        return self.capacity_tokens()

    def bytes_per_token_block(self, model: str) -> int:
        return self._kvb[model]

    def used_bytes(self, model: str | None = None) -> int:
        return sum(self.used_tl(m) for m in self.layers) * self.memory.kvpl

    def free_bytes(self) -> int:
        mem = self.memory
        return sum(mem.cap_tl(m) - self.used_tl(m) for m in self.layers) * mem.kvpl

    def free_bytes_for(self, model: str) -> int:
        return max(0, self.room_tokens()) * self._kvb[model]

    def unusable_bytes(self) -> int:
        mem = self.memory
        return sum((mem.cap_b[m] - mem.weights[m]) % mem.kvpl for m in self.layers)

    def _entries_per_block(self, model: str) -> int:
        return 1

    def _fits(self, model: str, add: int) -> bool:
        return add <= self.room_tokens()

    def _free_token_blocks(self, model: str) -> int:
        return max(0, self.room_tokens())

    def _alloc(self, rid: int, model: str, add: int) -> None:
        return None

    def _add_bytes(self, model: str, add: int) -> int:
        return add * self._kvb[model]

    def _release(self, rid: int, model: str, blocks: int) -> int:
        return blocks * self._kvb[model]

    def _check_layout(self) -> None:
        for m in self.layers:
            self.memory.check_instance(m, self.used_tl(m))

    def check_integrity(self) -> None:
        """The counts (bound batch, held blocks, registered requests) add up,
        and no member is over-committed. The pool-wide byte identities of
        :meth:`KVLayout.check_integrity` are not asked: a member may hold
        pieces of another executor's requests, or lack pieces of its own,
        so its bytes are not its requests' tokens."""
        svc = self.service
        n, t, b = self._bulk[svc]
        _require(n >= 0 and t >= 0 and b == t, f"staged layout: bound batch {(n, t, b)}")
        held = self._held[svc]
        _require(held >= 0, f"staged layout: {held} tokens held")
        rt = sum(self._rtokens.values())
        _require(self._mtokens[svc] == t + rt, "staged layout: token sum mismatch")
        _require(self._mblocks[svc] == b + held + rt, "staged layout: token-block sum mismatch")
        _require(self._mreqs[svc] == n + len(self._rmodel), "staged layout: request count mismatch")
        self._check_layout()
