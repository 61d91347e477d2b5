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

Three mechanisms are registered in :data:`MECHANISM`: ``kv`` and ``token``
start every move at once in that mode; ``adaptive`` (:class:`AdaptiveHybrid`,
Mell §V) packs all pending moves into the two modes within the epoch's
communication boundary per link port (:class:`LinkPort`,
:func:`link_charges`) and computation boundary per destination instance.

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


# --------------------------------------------------------------------- adaptive

LINK_KINDS: tuple[str, ...] = ("intra", "inter")
"""Link kinds: a GPU's intra-node port (NVLink/PCIe) and its network port."""


@dataclass(frozen=True, slots=True, order=True)
class LinkPort:
    """One direction of one GPU's link: a communication resource of the epoch.

    Every GPU has four ports: ``out``/``in`` of its intra-node link and of its
    network link. Each port has its own budget per epoch (``intra_node_bytes``
    or ``inter_node_bytes``), so the ports model full-duplex links where a GPU
    can send and receive at full rate at once, and concurrent transfers from
    (or to) one GPU share its port. Mell §V's example — GPU 1 and GPU 2 both
    migrating to GPU 4 through the inter-machine switch — contends on GPU 4's
    ``in``/``inter`` port.
    """

    gpu: int
    direction: str  # "out" or "in"
    kind: str  # "intra" or "inter"


def link_charges(move: PendingMove, gpus_per_node: int) -> dict[LinkPort, int]:
    """Bytes a KV transfer of ``move`` puts on each link port.

    A tensor-parallel instance holds a ``1/tp`` shard of every KV block on each
    of its GPUs, and the shards travel in parallel, GPU to GPU::

        src_gpus = (s0, s1)   ──shard 0──►  dst_gpus = (d0, d1)
                              ──shard 1──►
        shard k: s[k % len(src)] → d[k % len(dst)],  k < n = max(len(src), len(dst))
        bytes per shard = ceil(kv_bytes / n)

    Shard ``k`` charges its bytes to the ``out`` port of its source GPU and the
    ``in`` port of its destination GPU, of kind ``intra`` when both GPUs are on
    the same node (node = gpu // gpus_per_node) and ``inter`` otherwise. A
    shard whose two GPUs are the same GPU (two instances sharing it) is a local
    copy and charges nothing. With equal group sizes (same model, same tp) the
    pairing is one-to-one; unequal sizes are paired round-robin as drawn.

    Returns:
        bytes by port (empty for a zero-byte move or a purely local copy).
    """
    out: dict[LinkPort, int] = {}
    if move.kv_bytes <= 0 or not move.src_gpus or not move.dst_gpus:
        return out
    shard = -(-move.kv_bytes // max(len(move.src_gpus), len(move.dst_gpus)))
    for pair in shard_ports(move.src_gpus, move.dst_gpus, gpus_per_node):
        for port in pair:
            out[port] = out.get(port, 0) + shard
    return out


def shard_ports(
    src_gpus: Sequence[int], dst_gpus: Sequence[int], gpus_per_node: int
) -> list[tuple[LinkPort, LinkPort]]:
    """The (``out``, ``in``) ports each shard of a transfer from ``src_gpus``
    to ``dst_gpus`` crosses, paired as :func:`link_charges` describes (shard
    ``k``: ``src[k % len(src)]`` to ``dst[k % len(dst)]``); a shard within one
    GPU crosses none."""
    if not src_gpus or not dst_gpus:
        return []
    out: list[tuple[LinkPort, LinkPort]] = []
    for k in range(max(len(src_gpus), len(dst_gpus))):
        s, d = src_gpus[k % len(src_gpus)], dst_gpus[k % len(dst_gpus)]
        if s != d:
            kind = "intra" if s // gpus_per_node == d // gpus_per_node else "inter"
            out.append((LinkPort(s, "out", kind), LinkPort(d, "in", kind)))
    return out


class _Ledger:
    """Budget use of one epoch: bytes per link port, re-prefill tokens per instance."""

    def __init__(self, ctx: MechanismContext) -> None:
        self.ctx = ctx
        self.link_used: dict[LinkPort, int] = {}
        self.compute_used: dict[int, int] = {}

    def link_budget(self, port: LinkPort) -> int:
        return self.ctx.intra_node_bytes if port.kind == "intra" else self.ctx.inter_node_bytes

    def compute_budget(self, inst: int) -> int:
        return self.ctx.compute_tokens.get(inst, self.ctx.default_compute_tokens)

    # KV bin ------------------------------------------------------------------
    def kv_fits(self, charges: Mapping[LinkPort, int]) -> bool:
        return all(self.link_used.get(p, 0) + b <= self.link_budget(p) for p, b in charges.items())

    def kv_oversize(self, charges: Mapping[LinkPort, int]) -> bool:
        """Larger than a fresh epoch's budget on some port: can never fit normally."""
        return any(b > self.link_budget(p) for p, b in charges.items())

    def kv_untouched(self, charges: Mapping[LinkPort, int]) -> bool:
        return all(self.link_used.get(p, 0) == 0 for p in charges)

    def take_kv(self, charges: Mapping[LinkPort, int], alone: bool) -> None:
        for p, b in charges.items():
            used = self.link_used.get(p, 0) + b
            # A lone oversize move fills its ports: nothing else joins it this epoch.
            self.link_used[p] = max(used, self.link_budget(p) + 1) if alone else used

    # token bin ---------------------------------------------------------------
    def token_fits(self, dst: int, tokens: int) -> bool:
        return self.compute_used.get(dst, 0) + tokens <= self.compute_budget(dst)

    def token_oversize(self, dst: int, tokens: int) -> bool:
        return tokens > self.compute_budget(dst)

    def token_untouched(self, dst: int) -> bool:
        return self.compute_used.get(dst, 0) == 0

    def take_token(self, dst: int, tokens: int, alone: bool) -> None:
        used = self.compute_used.get(dst, 0) + tokens
        self.compute_used[dst] = max(used, self.compute_budget(dst) + 1) if alone else used


@MECHANISM.register("adaptive")
class AdaptiveHybrid(MigrationMechanism):
    """Mell's adaptive request migration (§V): a global two-bin packing per epoch.

    What the paper says:

    * *Boundary profiling* — every link has a *communication boundary* (the
      data it may carry for migrations within the epoch, so that the memory a
      migrating request pins is freed soon) and every instance a *computation
      boundary* (the re-prefill tokens it may take without disturbing its
      batch). Here both come from :class:`MechanismContext`.
    * *Hybrid migration* — the moves are split into KV transfers (Llumnix) and
      token transfers re-prefilled at the destination (ServerlessLLM), "a
      two-bin-packing problem that can be solved using a greedy algorithm
      (e.g., first-fit or best-fit)".
    * *Global consensus* — sources share links and destinations, so the
      division considers *all* moves of the system at once.

    What this implementation chooses where the paper is silent:

    * **First-fit decreasing.** Moves are visited by KV bytes, largest first
      (ties: request id, then the order given); each goes to the first bin it
      fits: KV when every link port it uses (:func:`link_charges`) still has
      room for its bytes, else token when its destination's computation
      boundary still has room for its ``tokens``, else it waits for a later
      epoch (not returned). A move with a fixed ``mode`` is only tried in that
      bin. Big moves first leaves the small ones to fill the gaps.
    * **Link model.** Per GPU, per direction, per kind (intra-node link or
      network link) — see :class:`LinkPort` and :func:`link_charges`: a
      tensor-parallel move sends its ``1/tp`` shards in parallel, each shard
      charging its source GPU's outgoing and its destination GPU's incoming
      port. Token transfers send only token ids (4 bytes a token) and are not
      charged on links; KV transfers cost no destination compute.
    * **Zero-byte moves** (``kv_bytes == 0``: a waiting request with no KV
      yet) cost nothing in either bin: nothing is copied and the request
      prefills at the destination as it would have at the source. Unfixed,
      they are returned as ``token`` moves; fixed ``kv`` ones as ``kv``.
    * **Lone oversize.** A move larger than a *fresh* epoch's budget in every
      bin it may use could never fit and would starve. It is started alone
      instead: in KV when none of its ports has carried anything yet this
      epoch, else in token when its destination has taken no re-prefill yet;
      its resources are then full for the rest of the epoch. This is the only
      way a resource's use exceeds its budget, and it is then used by that
      one move only. Since bigger moves are visited first, among oversize
      moves competing for the same ports the biggest goes first and the
      others follow in later epochs.
    * **Order of one request's moves.** A request may have several pending
      moves (planned in order); a move waits while an earlier one of the same
      request (in the order given) has not been started.

    The moves to start are returned in the order given (so one request's
    moves stay in sequence). The result is deterministic: it depends only on
    the moves, their order, and the context.
    """

    def assign(
        self, moves: Sequence[PendingMove], ctx: MechanismContext
    ) -> list[tuple[PendingMove, str]]:
        ledger = _Ledger(ctx)
        order = sorted(
            range(len(moves)), key=lambda i: (-moves[i].kv_bytes, moves[i].request_id, i)
        )
        # Index (in the given order) of each request's moves, to keep them in sequence.
        per_request: dict[int, list[int]] = {}
        for i, m in enumerate(moves):
            per_request.setdefault(m.request_id, []).append(i)
        started: set[int] = set()
        chosen: dict[int, str] = {}
        for i in order:
            m = moves[i]
            if m.mode is not None and m.mode not in MODES:
                raise ValueError(f"move of request {m.request_id}: unknown mode {m.mode!r}")
            earlier = per_request[m.request_id]
            if any(j < i and j not in started for j in earlier):
                continue
            mode = self._place(m, ctx, ledger)
            if mode is not None:
                started.add(i)
                chosen[i] = mode
        return [(m, chosen[i]) for i, m in enumerate(moves) if i in chosen]

    @staticmethod
    def _place(m: PendingMove, ctx: MechanismContext, ledger: _Ledger) -> str | None:
        """The bin ``m`` goes to (charging it), or None when it waits."""
        if m.kv_bytes <= 0:
            return m.mode or "token"
        allow_kv = m.mode in (None, "kv")
        allow_token = m.mode in (None, "token")
        charges = link_charges(m, ctx.gpus_per_node) if allow_kv else {}
        if allow_kv and ledger.kv_fits(charges):
            ledger.take_kv(charges, alone=False)
            return "kv"
        if allow_token and ledger.token_fits(m.dst, m.tokens):
            ledger.take_token(m.dst, m.tokens, alone=False)
            return "token"
        # Lone oversize: only for a move no fresh budget of its bins could hold.
        if allow_kv and not ledger.kv_oversize(charges):
            return None
        if allow_token and not ledger.token_oversize(m.dst, m.tokens):
            return None
        if allow_kv and ledger.kv_untouched(charges):
            ledger.take_kv(charges, alone=True)
            return "kv"
        if allow_token and ledger.token_untouched(m.dst):
            ledger.take_token(m.dst, m.tokens, alone=True)
            return "token"
        return None
