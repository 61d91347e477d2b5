"""Request migrations between instances, as the simulator carries them out.

A migration policy plans moves (:class:`~fleetserve.policy.actions.Migrate`);
each request has a FIFO of planned moves. Once per epoch the simulator hands
the head move of every request that can move now to the migration
*mechanism* (:mod:`fleetserve.policy.mechanism`), which returns the moves to
start with their mode. This module executes them on the simulator's
:class:`~fleetserve.sim.group_instance.GroupInstance` objects.

KV transfer of a running request (Llumnix's live migration)::

    src  ─ decode ─ decode ─ decode ─ decode ─┤detach        (blocks held)  ├free
    link     [stage 1: KV so far][stage 2: new KV]  [final copy: the rest]
    dst   (reserve) ··········· (reserve more) ···· (reserve rest) ├attach ─ decode ─
                                                  ◄──── stall ─────►

* Stage ``k`` copies the KV of the decode iterations the source completed
  since the previous stage, while the request keeps decoding there. Before
  it starts, the destination reserves the blocks that KV will occupy; a
  reservation may only take blocks that are free as of now, beyond the
  growth of the iteration in flight and the admission watermark
  (:meth:`GroupInstance.can_reserve`), and it truncates the destination's decode
  segment so the next boundary re-plans with less memory. No room: abort —
  unless no KV was sent yet and ``migration.wait_for_room_s`` is above 0: the
  move then *waits* (the request decodes on at its source) and is retried at
  each of the destination's iteration boundaries (after its finished requests
  left, before it admits new ones) and at each epoch, until the first stage
  fits or the wait has lasted ``wait_for_room_s`` (then it aborts as before,
  and the migration policy is told). A move planned into a GPU whose own
  requests are still on their way out thus starts when they have left, not
  at the next epoch.
* Once at most ``final_blocks`` blocks of KV are left to send (or
  ``max_stages`` stages ran), *stop and copy*: the destination reserves the
  rest (what the request will hold after the source's iteration in flight),
  the source's segment is truncated at that iteration, and at its end the
  request leaves the batch (its blocks stay allocated, ``mig_out``). The rest
  is copied; then the source frees the blocks and the request joins the
  destination's running batch at its next iteration boundary (at once if
  the destination is idle). Memory is held on both ends until the copy is
  done. The **stall** is detach → attach: the time the request does not
  decode because of the move.
* The request finishing on the source before it is detached, or being
  preempted there, aborts the move; so does a destination without room for
  a stage. An abort frees the destination's reservation; the request stays
  where it is. Instances touched by a migration are never ``idle``, so they
  cannot be released while it is in flight.

Token transfer of a running request: at the source's next iteration boundary
the request leaves the batch and frees its KV (as a preemption does; it keeps
its generated tokens), its token ids travel (``4 * tokens`` bytes), and it
joins the *head* of the destination's waiting queue, which re-prefills
prompt + generated tokens in an ordinary prefill iteration (the destination's
compute is charged there). Stall: detach → its next token (the end of that
prefill), so it includes queueing and the re-prefill at the destination.

A waiting request (queued, or preempted: no KV) moves the same way without a
detach: out of the source's queue, ``4 * tokens`` bytes, into the
destination's queue — at the head if it had generated tokens (preempted or
migrated before), else at the tail. It was not decoding, so no stall.
Its move is recorded as ``token`` whatever mode was asked (it has no KV).

Modelling choices:

* Link: intra-node (``gpu.intra_node_bw``) if the first GPUs of both
  instances are on one node (``g // gpus_per_node``; a tensor-parallel group
  never spans nodes), else the network link (``gpu.network_bw``). KV of a
  ``tp``-way instance is sharded: each of the ``tp`` GPU pairs sends its
  ``1/tp`` share in parallel, so a copy takes ``latency + bytes / tp /
  bandwidth`` (:meth:`InstanceCost.kv_transfer_time`); records count all
  bytes. Token ids are sent once: ``latency + 4 * tokens / bandwidth``.
* Link contention (``migration.link_contention``, on by default): each GPU
  has four link ports (:class:`~fleetserve.policy.mechanism.LinkPort`: out
  and in, of its intra-node and of its network link; full duplex). A
  transfer occupies the ports of every GPU pair its shards cross
  (:func:`~fleetserve.policy.mechanism.shard_ports`, the pairing the
  adaptive mechanism's budgets use; token ids
  cross the first pair only) from its start to its end, and a port carries
  one transfer at a time, in the order transfers start: a transfer begins
  when all its ports are free, so two moves out of one GPU take twice as long
  in all as one. This is first-come-first-served rather than fair sharing:
  the last of ``k`` equal concurrent transfers ends at the same time under
  both, the first ones earlier here. Modelling choices where the papers are
  silent: a queued transfer's HBM load
  (``copy_contention``) counts from the moment it is queued, and an aborted
  move keeps the port time its transfer in flight had taken. Before session
  22, concurrent transfers each got the whole link (``link_contention:
  false``); the adaptive mechanism budgets link use per epoch either way.
* Bytes are counted per token (``kv_bytes(tokens)``), not per whole block;
  "blocks left" is ``ceil(unsent tokens / block_size)``.
* A request "lives" on its source until it is attached to (or queued at) the
  destination; a token move in flight is "in transit"; a KV move after the
  detach is "detached" from its source. ``record.instance`` changes when the
  move completes, and each completed move appends a
  :class:`~fleetserve.metrics.records.MigrationRecord` (time of completion,
  all bytes sent). Aborted moves are counted (``aborted_migrations``), not
  recorded.
* Prefix caching (``engine.prefix_caching``): a request detached for its
  final copy keeps its source's cache references until the copy is done (the
  copy reads those blocks; ``held`` counts its private blocks only); the
  destination receives all its KV as private blocks (not cache entries) — a
  request re-prefilled there (token move, later preemption) looks the cache up
  again.
* A move whose destination was released before it started is dropped and
  counted as aborted; a move of a request already on its destination is
  dropped silently; moves of finished requests are forgotten.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from fleetserve.cluster.state import blocks_for
from fleetserve.costmodel.transfer import Link, intra_node_link, network_link, transfer_time
from fleetserve.metrics.records import MigrationRecord
from fleetserve.policy.mechanism import (
    MODES,
    LinkPort,
    MechanismContext,
    MigrationMechanism,
    PendingMove,
    shard_ports,
)
from fleetserve.sim.events import ITER_END, TRANSFER, Event
from fleetserve.sim.group_instance import IDLE, GroupInstance
from fleetserve.sim.seq import PREFILLING, Seq

if TYPE_CHECKING:
    from fleetserve.config import MigrationConfig
    from fleetserve.spec.types import GpuSpec

logger = logging.getLogger(__name__)

TOKEN_ID_BYTES = 4
"""Bytes of one token id on the wire (int32)."""

# Task phases.
STAGE = "stage"  # kv: a live copy stage in flight, the request decodes on the source
DETACHING = "detaching"  # leaves the source's batch at its next iteration boundary
FINAL_COPY = "final_copy"  # kv: detached, the rest of its KV in flight
ATTACHING = "attaching"  # kv: copied, joins the destination at its next boundary
TRANSIT = "transit"  # token ids in flight
WAITING = "waiting"  # kv: no room for its first stage yet, retried (wait_for_room_s)
DONE = "done"
ABORTED = "aborted"


class MigrationTask:
    """One move in flight.

    Attributes:
        seq: the request.
        src, dst: the instances.
        mode: ``kv`` or ``token``.
        link: the link it uses.
        phase: see the phase constants.
        sent: KV tokens copied so far (kv).
        reserved: blocks reserved on ``dst`` (kv).
        held: blocks the source still holds after the detach (kv, final copy;
            its private blocks, without the cache entries it references).
        final_kv: KV tokens the request will hold when detached (kv).
        bytes: bytes sent so far, all stages.
        stages: live copy stages started (kv).
        t_detach: when it left the source's batch (None: not yet, or waiting move).
        head: a token move joins the head of the destination's queue.
        src_ref, dst_ref: whether it still counts in ``mig_refs`` of the ends.
    """

    __slots__ = (
        "bytes",
        "dst",
        "dst_ref",
        "final_kv",
        "head",
        "held",
        "link",
        "load",
        "mode",
        "phase",
        "reserved",
        "sent",
        "seq",
        "src",
        "src_ref",
        "stages",
        "t_detach",
        "wait_since",
    )

    def __init__(
        self, seq: Seq, src: GroupInstance, dst: GroupInstance, mode: str, link: Link
    ) -> None:
        self.seq = seq
        self.src = src
        self.dst = dst
        self.mode = mode
        self.link = link
        self.phase = STAGE
        self.sent = 0
        self.reserved = 0
        self.held = 0
        self.final_kv = 0
        self.bytes = 0
        self.stages = 0
        self.t_detach: float | None = None
        self.load = 0.0  # HBM fraction of its copy in flight on each end (0: none)
        self.head = False
        self.src_ref = False
        self.dst_ref = False
        self.wait_since: float | None = None  # WAITING: when its first refusal was


class Migrations:
    """Pending and in-flight moves of one simulation.

    The simulator calls :meth:`plan_move` for each ``Migrate`` action,
    :meth:`start_pending` once per epoch, :meth:`on_event` for this module's
    events, :meth:`at_boundary` between an instance's ``complete`` and
    ``schedule`` when ``mig_refs`` is set, and :meth:`after_schedule` when the
    instance preempted a migrating request. Each returns the events it causes;
    instances whose memory or queue changed while they were not at a boundary
    are appended to :attr:`touched`, for the simulator to re-schedule when
    they sit idle (and consult the memory policy when they became idle).

    Args:
        cfg: the migration section of the config.
        gpu: the GPU type (links).
        gpus_per_node: GPUs per node.
        mechanism: chooses the mode of pending moves and which start.
        block_size: tokens per KV block.
    """

    def __init__(
        self,
        cfg: MigrationConfig,
        gpu: GpuSpec,
        gpus_per_node: int,
        mechanism: MigrationMechanism,
        block_size: int,
    ) -> None:
        self.cfg = cfg
        self.mechanism = mechanism
        self.gpus_per_node = gpus_per_node
        self.block_size = block_size
        self.intra = intra_node_link(gpu)
        self.inter = network_link(gpu)
        self.hbm_bw = gpu.hbm_bw
        self.pending: dict[int, deque[tuple[GroupInstance, str | None]]] = {}
        self._out: dict[int, list[MigrationTask]] = {}  # by source instance id
        self._in: dict[int, list[MigrationTask]] = {}  # by destination instance id
        self.transit: dict[int, MigrationTask] = {}  # token moves in flight, by request id
        self.records: list[MigrationRecord] = []
        self.aborted = 0
        self.abort_reasons: dict[str, int] = {}  # aborts by reason (ids as N)
        self.touched: list[GroupInstance] = []
        # Told the request id of every aborted or dropped move (the simulator
        # passes MigrationPolicy.on_move_aborted).
        self.on_abort: Callable[[int], None] = _ignore
        self._port_free: dict[LinkPort, float] = {}  # when each busy port is free again

    # ------------------------------------------------------------- planning
    def plan_move(self, seq: Seq, dst: GroupInstance, mode: str | None) -> None:
        """Append a move of ``seq`` to ``dst`` to its FIFO of pending moves."""
        self.pending.setdefault(seq.id, deque()).append((dst, mode))

    def link(self, src: GroupInstance, dst: GroupInstance) -> Link:
        """The link a move from ``src`` to ``dst`` uses."""
        gpn = self.gpus_per_node
        return self.intra if src.gpus[0] // gpn == dst.gpus[0] // gpn else self.inter

    def start_pending(
        self,
        seqs: Sequence[Seq | None],
        alive: dict[int, GroupInstance],
        ctx: MechanismContext,
        now: float,
    ) -> list[Event]:
        """Offer every startable head move to the mechanism; start what it returns.

        A head move is startable when its request is on an instance, not
        (re)prefilling and not migrating. Moves to released instances are
        dropped (counted as aborted), moves to where the request already is
        are dropped, and finished requests' moves are forgotten.
        """
        offered: list[PendingMove] = []
        by_move: dict[int, tuple[Seq, GroupInstance]] = {}
        for rid in list(self.pending):
            fifo = self.pending[rid]
            seq = seqs[rid]
            assert seq is not None
            while fifo:
                dst, _mode = fifo[0]
                if seq.record.status != "unfinished":
                    fifo.clear()
                elif alive.get(dst.id) is not dst:
                    fifo.popleft()
                    self._count_abort(seq, f"destination {dst.id} was released")
                elif seq.inst is dst and seq.mig is None:
                    fifo.popleft()
                else:
                    break
            if not fifo:
                del self.pending[rid]
                continue
            src = seq.inst
            if src is None or seq.mig is not None or seq.state == PREFILLING:
                continue
            dst, mode = fifo[0]
            kv_bytes = src.cost.kv_bytes(seq.kv_tokens) if seq.bound else 0
            tokens = seq.prompt_tokens + seq.generated
            move = PendingMove(seq.id, src.id, dst.id, src.gpus, dst.gpus, kv_bytes, tokens, mode)
            offered.append(move)
            by_move[id(move)] = (seq, dst)
        if not offered:
            return []
        events: list[Event] = []
        for move, mode in self.mechanism.assign(offered, ctx):
            got = by_move.pop(id(move), None)
            if got is None:
                raise RuntimeError(f"mechanism returned a move it was not offered: {move}")
            if mode not in MODES or (move.mode is not None and mode != move.mode):
                raise RuntimeError(f"mechanism gave mode {mode!r} to {move}")
            seq, dst = got
            self.pending[seq.id].popleft()
            if not self.pending[seq.id]:
                del self.pending[seq.id]
            self._start(seq, dst, mode, now, events)
        return events

    # ------------------------------------------------------------- starting
    def _start(self, seq: Seq, dst: GroupInstance, mode: str, now: float, ev: list[Event]) -> None:
        src = seq.inst
        assert src is not None
        task = MigrationTask(seq, src, dst, mode, self.link(src, dst))
        seq.mig = task
        self._ref(task, dst=True)
        if not seq.bound:  # waiting: no KV; token ids only
            task.mode = "token"
            task.head = seq.gen_saved > 0
            _iter_end(src, src.remove_waiting(seq, now), ev)
            self.touched.append(src)
            self._send_tokens(task, now, ev)
            return
        self._ref(task, src=True)
        if mode == "token":
            task.phase = DETACHING
            _iter_end(src, src.truncate(now), ev)
        else:
            self._next_stage(task, now, ev)

    def _next_stage(self, t: MigrationTask, now: float, ev: list[Event]) -> None:
        """Start another live stage, or the stop-and-copy."""
        done = t.seq.base + t.src.decode_steps  # KV of the decode iterations completed
        left = blocks_for(done - t.sent, self.block_size)
        if left <= self.cfg.final_blocks or t.stages >= self.cfg.max_stages:
            self._stop_and_copy(t, now, ev)
            return
        if not self._reserve(t, done, now, ev):
            return
        tokens = done - t.sent
        cost = t.src.cost
        t.bytes += cost.kv_bytes(tokens)
        t.sent = done
        t.stages += 1
        t.phase = STAGE
        self._copy_start(t, now, ev)
        end = self._occupy(t, cost.kv_transfer_time(tokens, t.link), now, shards=True)
        ev.append((end, TRANSFER, (t, STAGE)))

    def _stop_and_copy(self, t: MigrationTask, now: float, ev: list[Event]) -> None:
        kv = t.seq.kv_tokens  # what it holds once the iteration in flight ends
        if not self._reserve(t, kv, now, ev):
            return
        t.final_kv = kv
        t.phase = DETACHING
        _iter_end(t.src, t.src.truncate(now), ev)

    def _reserve(self, t: MigrationTask, tokens: int, now: float, ev: list[Event]) -> bool:
        """Reserve room for ``tokens`` KV tokens on the destination; abort if none."""
        need = blocks_for(tokens, self.block_size) - t.reserved
        if need <= 0:
            return True
        if not t.dst.can_reserve(need):
            wait = self.cfg.wait_for_room_s
            if t.sent == 0 and wait > 0 and (t.wait_since is None or now - t.wait_since < wait):
                if t.wait_since is None:
                    t.wait_since = now
                t.phase = WAITING
                return False
            when = "before any KV was sent" if t.sent == 0 else "after KV was sent"
            self._abort(t, f"destination {t.dst.id} has no room for {need} blocks, {when}", now, ev)
            return False
        _iter_end(t.dst, t.dst.reserve(need, now), ev)
        t.reserved += need
        return True

    def _send_tokens(self, t: MigrationTask, now: float, ev: list[Event]) -> None:
        seq = t.seq
        seq.inst = None
        nbytes = TOKEN_ID_BYTES * seq.prefill_tokens
        t.bytes = nbytes
        t.phase = TRANSIT
        self.transit[seq.id] = t
        end = self._occupy(t, transfer_time(nbytes, t.link), now, shards=False)
        ev.append((end, TRANSFER, (t, TRANSIT)))

    # --------------------------------------------------------------- events
    def on_event(self, payload: tuple[MigrationTask, str], now: float) -> list[Event]:
        """A transfer of a task ended (ignored if the task moved on or aborted)."""
        t, phase = payload
        if t.phase != phase:
            return []
        ev: list[Event] = []
        self._copy_end(t, now, ev)
        if phase == STAGE:
            self._next_stage(t, now, ev)
        elif phase == FINAL_COPY:
            src, dst = t.src, t.dst
            _iter_end(src, src.release_held(t.held, now, t.seq), ev)
            t.held = 0
            self._unref(t, src=True)
            self.touched.append(src)
            if dst.phase == IDLE:  # attach at once; the simulator starts an iteration
                self._attach(t, now)
                self.touched.append(dst)
            else:
                t.phase = ATTACHING
                _iter_end(dst, dst.truncate(now), ev)
        else:  # TRANSIT
            del self.transit[t.seq.id]
            _iter_end(t.dst, t.dst.enqueue(t.seq, now, head=t.head), ev)
            self._complete(t, now)
        return ev

    def at_boundary(self, inst: GroupInstance, now: float) -> list[Event]:
        """``inst`` completed an iteration and has not planned the next one:
        abort moves of requests that just finished there, detach requests
        leaving it, attach requests arriving."""
        ev: list[Event] = []
        for t in list(self._out.get(inst.id, ())):
            if t.phase in (STAGE, DETACHING, WAITING) and t.seq.record.status == "finished":
                self._abort(t, "the request finished on the source", now, ev)
            elif t.phase == DETACHING:
                self._detach(t, now, ev)
        for t in list(self._in.get(inst.id, ())):
            if t.phase == ATTACHING:
                self._attach(t, now)
            elif t.phase == WAITING:
                self._retry(t, now, ev)
        return ev

    def retry_waiting(self, now: float) -> list[Event]:
        """Each epoch: every waiting move starts if its destination has room
        now, or aborts once it has waited ``wait_for_room_s``."""
        ev: list[Event] = []
        for tasks in list(self._in.values()):
            for t in list(tasks):
                if t.phase == WAITING:
                    self._retry(t, now, ev)
        return ev

    def _retry(self, t: MigrationTask, now: float, ev: list[Event]) -> None:
        """Try a waiting move's first stage again (:meth:`_next_stage`)."""
        seq = t.seq
        if seq.record.status == "finished":
            self._abort(t, "the request finished on the source", now, ev)
            return
        t.phase = STAGE
        self._next_stage(t, now, ev)

    def after_schedule(self, inst: GroupInstance, now: float) -> list[Event]:
        """``inst`` preempted requests that were migrating out: abort their moves."""
        ev: list[Event] = []
        pre = list(inst.preempted_migrating)
        inst.preempted_migrating.clear()  # (a group instance shares its group's list)
        for seq in pre:
            t = seq.mig
            if t is not None and t.src is inst:
                self._abort(t, "the request was preempted on the source", now, ev)
        return ev

    def _detach(self, t: MigrationTask, now: float, ev: list[Event]) -> None:
        seq, src = t.seq, t.src
        t.t_detach = now
        if t.mode == "token":
            src.detach(seq, keep_blocks=False)
            self._unref(t, src=True)
            seq.stall_from = now
            t.head = True
            self._send_tokens(t, now, ev)
            return
        kv = src.detach(seq, keep_blocks=True)
        assert kv == t.final_kv, (kv, t.final_kv)
        t.held = blocks_for(kv, self.block_size) - seq.shared  # its private blocks
        tokens = kv - t.sent
        cost = src.cost
        t.bytes += cost.kv_bytes(tokens)
        t.sent = kv
        t.phase = FINAL_COPY
        self._copy_start(t, now, ev)
        end = self._occupy(t, cost.kv_transfer_time(tokens, t.link), now, shards=True)
        ev.append((end, TRANSFER, (t, FINAL_COPY)))

    def _attach(self, t: MigrationTask, now: float) -> None:
        t.dst.attach(t.seq, t.seq.kv_saved, t.reserved)
        t.reserved = 0
        assert t.t_detach is not None
        t.seq.record.migration_stall_s += now - t.t_detach
        self._complete(t, now)

    # ------------------------------------------------------------ endings
    def _complete(self, t: MigrationTask, now: float) -> None:
        seq = t.seq
        rec = seq.record
        rec.migrations += 1
        rec.instance = t.dst.id
        self.records.append(
            MigrationRecord(now, seq.id, t.src.id, t.dst.id, t.mode, t.bytes, t.stages)
        )
        seq.mig = None
        t.phase = DONE
        self._unref(t, dst=True)

    def _ports(self, t: MigrationTask, shards: bool) -> list[LinkPort]:
        """The link ports a transfer of ``t`` crosses: each GPU pair of its
        shards (``shards``: KV, paired by ``shard_ports``), or the
        first pair only (token ids); a pair within one GPU crosses none."""
        src, dst = (t.src.gpus, t.dst.gpus) if shards else (t.src.gpus[:1], t.dst.gpus[:1])
        return [p for pair in shard_ports(src, dst, self.gpus_per_node) for p in pair]

    def _occupy(self, t: MigrationTask, seconds: float, now: float, *, shards: bool) -> float:
        """When a transfer of ``seconds`` on its own, started now, ends: after
        every port it crosses is free (``link_contention``), each port then
        busy until that end."""
        if not self.cfg.link_contention:
            return now + seconds
        ports = self._ports(t, shards)
        start = max([now] + [self._port_free.get(p, now) for p in ports])
        end = start + seconds
        for p in ports:
            self._port_free[p] = end
        return end

    def _copy_start(self, t: MigrationTask, now: float, ev: list[Event]) -> None:
        """A KV copy of ``t`` starts: both ends' HBM serves it beside their
        iterations (each GPU of the pair streams at the link's rate)."""
        if not self.cfg.copy_contention:
            return
        t.load = t.link.bandwidth_Bps / self.hbm_bw
        for inst in (t.src, t.dst):
            _iter_end(inst, inst.add_copy_load(t.load, now), ev)

    def _copy_end(self, t: MigrationTask, now: float, ev: list[Event]) -> None:
        """``t``'s copy in flight ended (or its move aborted): release its load."""
        if t.load:
            for inst in (t.src, t.dst):
                _iter_end(inst, inst.add_copy_load(-t.load, now), ev)
            t.load = 0.0

    def _abort(self, t: MigrationTask, reason: str, now: float, ev: list[Event]) -> None:
        self._copy_end(t, now, ev)
        if t.reserved:
            _iter_end(t.dst, t.dst.unreserve(t.reserved, now), ev)
            t.reserved = 0
        self._unref(t, src=t.src_ref, dst=True)
        self.touched.append(t.dst)
        t.seq.mig = None
        t.phase = ABORTED
        self._count_abort(t.seq, reason)

    def _count_abort(self, seq: Seq, reason: str) -> None:
        seq.record.aborted_migrations += 1
        self.aborted += 1
        key = re.sub(r"\d+", "N", reason)
        self.abort_reasons[key] = self.abort_reasons.get(key, 0) + 1
        logger.debug("migration of request %d aborted: %s", seq.id, reason)
        self.on_abort(seq.id)

    def _ref(self, t: MigrationTask, *, src: bool = False, dst: bool = False) -> None:
        if src:
            t.src_ref = True
            t.src.mig_refs += 1
            self._out.setdefault(t.src.id, []).append(t)
        if dst:
            t.dst_ref = True
            t.dst.mig_refs += 1
            self._in.setdefault(t.dst.id, []).append(t)

    def _unref(self, t: MigrationTask, *, src: bool = False, dst: bool = False) -> None:
        if src and t.src_ref:
            t.src_ref = False
            t.src.mig_refs -= 1
            _remove(self._out, t.src.id, t)
        if dst and t.dst_ref:
            t.dst_ref = False
            t.dst.mig_refs -= 1
            _remove(self._in, t.dst.id, t)

    # ------------------------------------------------------------ integrity
    def places(self) -> Iterator[tuple[int, str]]:
        """``(request id, place)`` of requests that are on no instance's lists:
        detached from their source (KV final copy) or in transit (token ids)."""
        for tasks in self._in.values():
            for t in tasks:
                if t.phase in (FINAL_COPY, ATTACHING):
                    yield t.seq.id, f"detached from {t.src.id}"
        for rid in self.transit:
            yield rid, "in transit"

    def check_integrity(self, instances: dict[int, GroupInstance]) -> None:
        """Migration memory and references of every instance match the tasks."""
        for iid, inst in instances.items():
            out = self._out.get(iid, [])
            into = self._in.get(iid, [])
            assert inst.mig_refs == len(out) + len(into), (iid, inst.mig_refs)
            assert inst.mig_in == sum(t.reserved for t in into), (iid, inst.mig_in)
            assert inst.mig_out == sum(t.held for t in out), (iid, inst.mig_out)
            load = sum(t.load for t in out) + sum(t.load for t in into)
            assert abs(inst.copy_load - load) < 1e-9, (iid, inst.copy_load, load)
            for t in out:
                assert t.src is inst and t.seq.mig is t
                if t.phase in (STAGE, DETACHING, WAITING):
                    assert t.seq.bound and t.seq.inst is inst
                if t.phase == WAITING:
                    assert t.sent == 0 and t.reserved == 0 and t.wait_since is not None
            for t in into:
                assert t.dst is inst and t.seq.mig is t
                assert t.reserved <= blocks_for(max(t.sent, t.final_kv), self.block_size)
        for iid in (*self._out, *self._in):
            assert iid in instances, f"a migration touches released instance {iid}"


def _ignore(request_id: int) -> None:
    pass


def _iter_end(inst: GroupInstance, end: float | None, ev: list[Event]) -> None:
    if end is not None:
        ev.append((end, ITER_END, (inst, inst.version)))


def _remove(d: dict[int, list[MigrationTask]], key: int, t: MigrationTask) -> None:
    lst = d[key]
    lst.remove(t)
    if not lst:
        del d[key]
