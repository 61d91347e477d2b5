"""Migration mechanisms: *how* a planned move is carried out, and when.

A migration policy (Llumnix, Mell) decides *which* request goes *where*
(:class:`~fleetserve.policy.actions.Migrate`). Once per epoch the backend
hands every move that has not started yet to the mechanism, as
:class:`PendingMove` records, and the mechanism returns the moves to start
now with their mode:

* ``kv`` — the request's KV cache is copied to the destination (Llumnix's
  live migration: in stages while the request keeps decoding, then a short
  stop-and-copy); costs link bandwidth and destination memory during the copy.
* ``token`` — only token ids are sent and the destination re-prefills them
  (ServerlessLLM); costs destination compute, stalls the request.

Moves left out of the answer wait for the next epoch. The backend carries the
moves out (see ``fleetserve.sim.migration``); this module is pure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fleetserve.policy.registry import Registry

MODES: tuple[str, ...] = ("kv", "token")


@dataclass(frozen=True, slots=True)
class PendingMove:
    """A planned move that has not started.

    Attributes:
        request_id: the request.
        src, dst: instance ids.
        src_gpus, dst_gpus: GPUs of the two instances (node = gpu // gpus_per_node).
        kv_bytes: bytes of the request's KV cache now (0 while it waits).
        tokens: tokens a destination re-prefill would process (prompt + generated).
        mode: fixed by the policy (``"kv"`` or ``"token"``), or None to let
            the mechanism choose.
    """

    request_id: int
    src: int
    dst: int
    src_gpus: tuple[int, ...]
    dst_gpus: tuple[int, ...]
    kv_bytes: int
    tokens: int
    mode: str | None = None


@dataclass(frozen=True, slots=True)
class MechanismContext:
    """The boundaries of one epoch, from the backend's link and cost models.

    Attributes:
        gpus_per_node: GPUs per node (to tell intra-node from inter-node moves).
        intra_node_bytes: communication boundary of one intra-node link per
            epoch, in bytes (Mell §V: what the link may carry for migrations
            within the epoch).
        inter_node_bytes: the same for a GPU's network link.
        compute_tokens: computation boundary of each destination instance
            per epoch: re-prefill tokens it may take (by instance id). An
            instance missing here gets ``default_compute_tokens``.
        default_compute_tokens: boundary of instances not in ``compute_tokens``.
    """

    gpus_per_node: int
    intra_node_bytes: int
    inter_node_bytes: int
    compute_tokens: Mapping[int, int] = field(default_factory=dict)
    default_compute_tokens: int = 0


class MigrationMechanism(ABC):
    """Chooses the mode of pending moves and which start this epoch."""

    @abstractmethod
    def assign(
        self, moves: Sequence[PendingMove], ctx: MechanismContext
    ) -> list[tuple[PendingMove, str]]:
        """The moves to start now, each with its mode (``"kv"`` or ``"token"``).

        Moves not returned wait for the next epoch. A move whose ``mode`` is
        set must be returned with that mode (or postponed).
        """


MECHANISM: Registry[MigrationMechanism] = Registry("migration mechanism")


@MECHANISM.register("kv")
class KvTransfer(MigrationMechanism):
    """Every move at once as a live KV transfer (Llumnix), unless fixed otherwise."""

    def assign(
        self, moves: Sequence[PendingMove], ctx: MechanismContext
    ) -> list[tuple[PendingMove, str]]:
        return [(m, m.mode or "kv") for m in moves]


@MECHANISM.register("token")
class TokenTransfer(MigrationMechanism):
    """Every move at once as token ids re-prefilled at the destination, unless fixed."""

    def assign(
        self, moves: Sequence[PendingMove], ctx: MechanismContext
    ) -> list[tuple[PendingMove, str]]:
        return [(m, m.mode or "token") for m in moves]
